"""Qwen3-MoE (Qwen/Qwen3-30B-A3B): what differs from the common MoE transformer.

- q/k RMSNorm **per head** ([head_dim]) after the head split;
- router: softmax over all experts, top-k, renormalised when `norm_topk_prob`;
- `mlp_only_layers` / `decoder_sparse_step` can make some layers dense SwiGLU MLPs
  (`intermediate_size` is the dense width, `moe_intermediate_size` the expert width).
"""

from __future__ import annotations

from ..config import ConfigReader, ModelConfig, common_gguf_fields, common_hf_fields

NAME = "qwen3_moe"
HF_MODEL_TYPES = ("qwen3_moe",)
GGUF_ARCHES = ("qwen3moe",)
HF_NAMES: dict[str, tuple[str, ...]] = {}
GGUF_NAMES: dict[str, tuple[str, ...]] = {}


def _moe_layers(cfg: ConfigReader, num_layers: int) -> tuple[bool, ...]:
    step = cfg.get("decoder_sparse_step", default=1)
    dense = set(cfg.data.get("mlp_only_layers") or [])
    return tuple(i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers))


def config_from_hf(cfg: ConfigReader) -> ModelConfig:
    fields = common_hf_fields(cfg)
    if cfg.data.get("use_sliding_window"):
        fields["sliding_window"] = cfg.get("sliding_window", default=None)
    return ModelConfig(
        arch=NAME,
        **fields,
        expert_intermediate_size=cfg.get("moe_intermediate_size"),
        dense_intermediate_size=cfg.get("intermediate_size", default=None),
        moe_layers=_moe_layers(cfg, fields["num_layers"]),
        router="softmax_topk",
        norm_topk_prob=bool(cfg.data.get("norm_topk_prob", True)),
        qk_norm="per_head",
    )


def config_from_gguf(meta: ConfigReader, arch: str) -> ModelConfig:
    return ModelConfig(
        arch=NAME,
        **common_gguf_fields(meta, arch),
        expert_intermediate_size=meta.get(f"{arch}.expert_feed_forward_length"),
        dense_intermediate_size=meta.get(f"{arch}.feed_forward_length", default=None),
        router="softmax_topk",
        # llama.cpp always renormalises for qwen3moe unless the file says otherwise.
        norm_topk_prob=bool(meta.data.get(f"{arch}.expert_weights_norm", True)),
        qk_norm="per_head",
    )
