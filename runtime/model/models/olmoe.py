"""OLMoE (allenai/OLMoE-1B-7B): what differs from the common MoE transformer.

- q/k RMSNorm over the **full** projection width (heads × head_dim), before the head split;
- optional `clip_qkv` clamp after those norms;
- router: softmax over all experts, top-k, not renormalised (`norm_topk_prob: false`).
"""

from __future__ import annotations

from ..config import ConfigReader, ModelConfig, common_gguf_fields, common_hf_fields

NAME = "olmoe"
HF_MODEL_TYPES = ("olmoe",)
GGUF_ARCHES = ("olmoe",)
HF_NAMES: dict[str, tuple[str, ...]] = {}
GGUF_NAMES: dict[str, tuple[str, ...]] = {}


def config_from_hf(cfg: ConfigReader) -> ModelConfig:
    return ModelConfig(
        arch=NAME,
        **common_hf_fields(cfg),
        expert_intermediate_size=cfg.get("intermediate_size"),
        router="softmax_topk",
        norm_topk_prob=bool(cfg.data.get("norm_topk_prob", False)),
        qk_norm="full",
        clip_qkv=cfg.get("clip_qkv", default=None, kind=float),
    )


def config_from_gguf(meta: ConfigReader, arch: str) -> ModelConfig:
    fields = common_gguf_fields(meta, arch)
    return ModelConfig(
        arch=NAME,
        **fields,
        # llama.cpp's olmoe: feed_forward_length is the expert width.
        expert_intermediate_size=meta.get(f"{arch}.expert_feed_forward_length", f"{arch}.feed_forward_length"),
        router="softmax_topk",
        norm_topk_prob=bool(meta.data.get(f"{arch}.expert_weights_norm", False)),
        qk_norm="full",
        clip_qkv=meta.get(f"{arch}.attention.clamp_kqv", default=None, kind=float),
    )
