"""DeepSeek-V2 / V3 (deepseek-ai/DeepSeek-V2-Lite, DeepSeek-V3): what differs from the common MoE transformer.

- multi-head latent attention (`runtime/model/attention.py`): q directly or through a LoRA bottleneck
  (q_a → RMSNorm → q_b); keys/values from a compressed latent (kv_a → RMSNorm, then kv_b) plus one
  RoPE key shared by all heads; the KV cache holds just the latent and that RoPE key;
- RoPE only on the last `qk_rope_head_dim` dims of each q/k head, on adjacent pairs (V2 always,
  V3 when `rope_interleave`); YaRN also scales the softmax by mscale(factor, mscale_all_dim)²;
- the first `first_k_dense_replace` layers are dense SwiGLU MLPs (`intermediate_size`); MoE layers
  add shared experts (width moe_intermediate_size · n_shared_experts) that every token uses;
- V2 router: softmax, top-k greedy or group-limited (`topk_method`; groups ranked by their best
  expert), weights × routed_scaling_factor and never renormalised (transformers 5.24 ignores
  `norm_topk_prob` for V2);
- V3 router: sigmoid; e_score_correction_bias added for the choice only; groups ranked by the sum of
  their best two; renormalised when `norm_topk_prob`, then × routed_scaling_factor;
- GGUF: llama.cpp's arch `deepseek2` for both (sigmoid gating marks V3); RoPE pairs adjacent.
"""

from __future__ import annotations

from ..config import ConfigReader, ModelConfig, from_f32, common_gguf_fields, common_hf_fields
from ...errors import UnsupportedModelError

NAME = "deepseek_v2"
HF_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
GGUF_ARCHES = ("deepseek2",)
_A = "model.layers.{L}.self_attn."
HF_NAMES: dict[str, tuple[str, ...]] = {
    "q_a": (_A + "q_a_proj.weight",), "q_a_bias": (_A + "q_a_proj.bias",), "q_a_norm": (_A + "q_a_layernorm.weight",),
    "q_b": (_A + "q_b_proj.weight",), "kv_a": (_A + "kv_a_proj_with_mqa.weight",),
    "kv_a_bias": (_A + "kv_a_proj_with_mqa.bias",), "kv_a_norm": (_A + "kv_a_layernorm.weight",),
    "kv_b": (_A + "kv_b_proj.weight",),
    "shared_gate": ("model.layers.{L}.mlp.shared_experts.gate_proj.weight",),
    "shared_up": ("model.layers.{L}.mlp.shared_experts.up_proj.weight",),
    "shared_down": ("model.layers.{L}.mlp.shared_experts.down_proj.weight",),
    "router_score_bias": ("model.layers.{L}.mlp.gate.e_score_correction_bias",),
}
GGUF_NAMES: dict[str, tuple[str, ...]] = {
    "q_a": ("blk.{L}.attn_q_a.weight",), "q_a_bias": ("blk.{L}.attn_q_a.bias",),
    "q_a_norm": ("blk.{L}.attn_q_a_norm.weight",), "q_b": ("blk.{L}.attn_q_b.weight",),
    "kv_a": ("blk.{L}.attn_kv_a_mqa.weight",), "kv_a_bias": ("blk.{L}.attn_kv_a_mqa.bias",),
    "kv_a_norm": ("blk.{L}.attn_kv_a_norm.weight",), "kv_b": ("blk.{L}.attn_kv_b.weight",),
    "k_b": ("blk.{L}.attn_k_b.weight",), "v_b": ("blk.{L}.attn_v_b.weight",),
    "shared_gate": ("blk.{L}.ffn_gate_shexp.weight",), "shared_up": ("blk.{L}.ffn_up_shexp.weight",),
    "shared_down": ("blk.{L}.ffn_down_shexp.weight",), "router_score_bias": ("blk.{L}.exp_probs_b.bias",),
}
GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def config_from_hf(cfg: ConfigReader) -> ModelConfig:
    v3 = cfg.data.get("model_type") == "deepseek_v3"
    fields = common_hf_fields(cfg)
    nope, rope = cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim")
    # head_dim is the q/k width (the config's own `head_dim` is the RoPE width); every head has its
    # own keys and values, re-derived from one cached latent, so "kv heads" = heads
    fields.update(head_dim=nope + rope, num_kv_heads=fields["num_heads"])
    method = cfg.data.get("topk_method", "greedy") if not v3 else "noaux_tc"
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise UnsupportedModelError(f"{cfg.source}: topk_method {method!r} is not supported "
                                    "(greedy, group_limited_greedy)")
    groups = (cfg.get("n_group", default=1), cfg.get("topk_group", default=1)) if method != "greedy" else (None, None)
    shared = cfg.get("n_shared_experts", default=0)
    dense = cfg.get("first_k_dense_replace", default=0)
    return ModelConfig(
        arch="deepseek_v3" if v3 else NAME,
        **fields,
        expert_intermediate_size=cfg.get("moe_intermediate_size"),
        dense_intermediate_size=cfg.get("intermediate_size", default=None),
        moe_layers=tuple(i >= dense for i in range(fields["num_layers"])),
        router="sigmoid_topk" if v3 else "softmax_topk",
        norm_topk_prob=bool(cfg.data.get("norm_topk_prob", True)) if v3 else False,
        attention="mla",
        q_lora_rank=cfg.get("q_lora_rank", default=None) or None,
        kv_lora_rank=cfg.get("kv_lora_rank"),
        qk_rope_head_dim=rope,
        v_head_dim=cfg.get("v_head_dim"),
        rope_interleave=bool(cfg.data.get("rope_interleave", True)) if v3 else True,
        shared_expert_intermediate_size=cfg.get("moe_intermediate_size") * shared if shared else None,
        routed_scaling_factor=cfg.get("routed_scaling_factor", default=1.0, kind=float),
        expert_groups=groups[0],
        expert_groups_used=groups[1],
        router_score_bias=v3,
    )


def config_from_gguf(meta: ConfigReader, arch: str) -> ModelConfig:
    a = arch
    fields = common_gguf_fields(meta, a)
    rope = meta.get(f"{a}.rope.dimension_count")
    # newer llama.cpp: key/value_length describe its absorbed cache; the *_mla keys the heads
    head_dim = meta.get(f"{a}.attention.key_length_mla", f"{a}.attention.key_length")
    fields.update(head_dim=head_dim, num_kv_heads=fields["num_heads"])
    log_mul = meta.get(f"{a}.rope.scaling.yarn_log_multiplier", default=None, kind=float)
    if fields.get("rope_type") == "yarn" and log_mul:
        # llama.cpp stores 0.1 · mscale_all_dim (float32) and assumes mscale = mscale_all_dim
        mscale = float(f"{log_mul / 0.1:.6g}")
        fields.update(rope_mscale=mscale, rope_mscale_all_dim=mscale)
    v3 = meta.get(f"{a}.expert_gating_func", default=1) == GATING_SIGMOID
    groups, used = meta.get(f"{a}.expert_group_count", default=0), meta.get(f"{a}.expert_group_used_count", default=0)
    shared = meta.get(f"{a}.expert_shared_count", default=0)
    expert_width = meta.get(f"{a}.expert_feed_forward_length")
    dense = meta.get(f"{a}.leading_dense_block_count", default=0)
    return ModelConfig(
        arch="deepseek_v3" if v3 else NAME,
        **fields,
        expert_intermediate_size=expert_width,
        dense_intermediate_size=meta.get(f"{a}.feed_forward_length", default=None),
        moe_layers=tuple(i >= dense for i in range(fields["num_layers"])),
        router="sigmoid_topk" if v3 else "softmax_topk",
        norm_topk_prob=bool(meta.data.get(f"{a}.expert_weights_norm", False)) if v3 else False,
        attention="mla",
        q_lora_rank=meta.get(f"{a}.attention.q_lora_rank", default=None) or None,
        kv_lora_rank=meta.get(f"{a}.attention.kv_lora_rank"),
        qk_rope_head_dim=rope,
        v_head_dim=meta.get(f"{a}.attention.value_length_mla", f"{a}.attention.value_length"),
        rope_interleave=True,
        shared_expert_intermediate_size=expert_width * shared if shared else None,
        routed_scaling_factor=from_f32(meta.get(f"{a}.expert_weights_scale", default=1.0, kind=float)),
        expert_groups=groups or None,
        expert_groups_used=used or None,
        router_score_bias=v3,
    )
