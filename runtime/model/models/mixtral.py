"""Mixtral (mistralai/Mixtral-8x7B): what differs from the common MoE transformer.

- no q/k norms;
- router: top-k on the logits, then softmax over those k (equal to softmax → top-k → renormalise);
- original checkpoints name the MoE block `block_sparse_moe` with experts `w1` (gate), `w3` (up),
  `w2` (down); transformers 5's fused layout uses `mlp.gate` / `mlp.experts` like the others;
- GGUF stores it as architecture `llama` with `expert_count` set, and llama.cpp's converter permutes
  the q/k rows for its interleaved RoPE (undone by the GGUF loader).
"""

from __future__ import annotations

from ..config import ConfigReader, ModelConfig, common_gguf_fields, common_hf_fields

NAME = "mixtral"
HF_MODEL_TYPES = ("mixtral",)
GGUF_ARCHES = ("llama",)
HF_NAMES: dict[str, tuple[str, ...]] = {
    "router": ("model.layers.{L}.block_sparse_moe.gate.weight", "model.layers.{L}.mlp.gate.weight"),
    "expert.gate": ("model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",),
    "expert.up": ("model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",),
    "expert.down": ("model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight",),
}
GGUF_NAMES: dict[str, tuple[str, ...]] = {}
# llama.cpp writes q/k of arch "llama" permuted for interleaved (GPT-J style) RoPE.
GGUF_QK_PERMUTED = True


def config_from_hf(cfg: ConfigReader) -> ModelConfig:
    fields = common_hf_fields(cfg)
    fields["sliding_window"] = cfg.get("sliding_window", default=None)
    return ModelConfig(
        arch=NAME,
        **fields,
        expert_intermediate_size=cfg.get("intermediate_size"),
        router="topk_softmax",
        norm_topk_prob=True,
        qk_norm="none",
    )


def config_from_gguf(meta: ConfigReader, arch: str) -> ModelConfig:
    return ModelConfig(
        arch=NAME,
        **common_gguf_fields(meta, arch),
        expert_intermediate_size=meta.get(f"{arch}.expert_feed_forward_length", f"{arch}.feed_forward_length"),
        router="topk_softmax",
        norm_topk_prob=True,
        qk_norm="none",
    )
