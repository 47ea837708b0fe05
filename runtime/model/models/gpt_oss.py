"""GPT-OSS (openai/gpt-oss-20b): what differs from the common MoE transformer.

- attention: biases on q/k/v/o; one learned sink logit per head joins every softmax; a sliding
  window on the layers `layer_types` marks "sliding_attention" (alternating, the first sliding);
- RoPE: YaRN on the two halves (its config says `truncate: false`);
- router: linear with bias; top-k on the logits, then softmax over those k;
- experts: biases and a clamped SwiGLU: gate ≤ limit, −limit ≤ up ≤ limit,
  out = (up + 1) · gate · σ(α · gate), α 1.702, limit 7 (`swiglu_alpha`, `swiglu_limit`);
- on disk experts are always fused, gate/up interleaved on the last axis and input-major:
  gate_up [E, H, 2I], down [E, I, H], with biases — or MXFP4 `*_blocks` / `*_scales` (hub files);
- GGUF (`gpt-oss`): experts split into gate/up/down `*_exps` with `.bias`; the FFN norm is named
  `post_attention_norm`; llama.cpp fixes α and the limit, and alternates the window.
"""

from __future__ import annotations

from ..config import ConfigReader, ModelConfig, common_gguf_fields, common_hf_fields

NAME = "gpt_oss"
HF_MODEL_TYPES = ("gpt_oss",)
GGUF_ARCHES = ("gpt-oss",)
HF_EXPERTS = "interleaved"
_X = "model.layers.{L}.mlp.experts."
HF_NAMES: dict[str, tuple[str, ...]] = {
    "router": ("model.layers.{L}.mlp.router.weight",),
    "router_bias": ("model.layers.{L}.mlp.router.bias",),
    "sinks": ("model.layers.{L}.self_attn.sinks",),
    "experts.gate_up_bias": (_X + "gate_up_proj_bias",),
    "experts.down_bias": (_X + "down_proj_bias",),
    "experts.gate_up_blocks": (_X + "gate_up_proj_blocks",),
    "experts.gate_up_scales": (_X + "gate_up_proj_scales",),
    "experts.down_blocks": (_X + "down_proj_blocks",),
    "experts.down_scales": (_X + "down_proj_scales",),
}
GGUF_NAMES: dict[str, tuple[str, ...]] = {
    "ffn_norm": ("blk.{L}.post_attention_norm.weight",),
    "sinks": ("blk.{L}.attn_sinks.weight",),
}
SWIGLU = (1.702, 7.0)  # llama.cpp's fixed (alpha, limit)


def _alternating(n: int) -> tuple[bool, ...]:
    return tuple(i % 2 == 0 for i in range(n))


SHARED = dict(router="topk_softmax", norm_topk_prob=True, attention_sinks=True, router_bias=True, expert_bias=True,
              expert_act="swiglu_clamped")


def config_from_hf(cfg: ConfigReader) -> ModelConfig:
    fields = common_hf_fields(cfg)
    n = fields["num_layers"]
    types = cfg.data.get("layer_types")
    sliding = tuple(t == "sliding_attention" for t in types) if types else _alternating(n)
    return ModelConfig(
        arch=NAME,
        **fields,
        **SHARED,
        attention_out_bias=fields["attention_bias"],  # one switch for q/k/v/o in GPT-OSS
        expert_intermediate_size=cfg.get("intermediate_size"),
        sliding_window=cfg.get("sliding_window", default=None),
        sliding_layers=sliding,
        swiglu_alpha=cfg.get("swiglu_alpha", default=SWIGLU[0], kind=float),
        swiglu_limit=cfg.get("swiglu_limit", default=SWIGLU[1], kind=float),
    )


def config_from_gguf(meta: ConfigReader, arch: str) -> ModelConfig:
    a = arch
    fields = common_gguf_fields(meta, a)
    if fields.get("rope_type") == "yarn":
        fields["rope_truncate"] = False  # GPT-OSS's YaRN leaves the correction range untruncated
    fields["attention_bias"] = True  # llama.cpp's gpt-oss always carries q/k/v/o biases
    n = fields["num_layers"]
    pattern = meta.data.get(f"{a}.attention.sliding_window_pattern")
    sliding = tuple(bool(v) for v in pattern) if isinstance(pattern, list) else _alternating(n)
    return ModelConfig(
        arch=NAME,
        **fields,
        **SHARED,
        attention_out_bias=True,
        expert_intermediate_size=meta.get(f"{a}.expert_feed_forward_length"),
        sliding_window=meta.get(f"{a}.attention.sliding_window", default=None),
        sliding_layers=sliding,
        swiglu_alpha=SWIGLU[0],
        swiglu_limit=SWIGLU[1],
    )
