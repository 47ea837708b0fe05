"""Architecture registry and tensor-name tables.

Each architecture file states only what differs (config parsing, router kind, q/k norm, name
overrides, expert layout); the transformer loop itself lives once in `runtime/model/forward.py`, the two
attention kinds (GQA, MLA) in `runtime/model/attention.py`.
"""

from __future__ import annotations

from types import ModuleType

from . import deepseek_v2, gpt_oss, mixtral, olmoe, qwen3_moe

ARCHITECTURES: tuple[ModuleType, ...] = (olmoe, qwen3_moe, mixtral, deepseek_v2, gpt_oss)
BY_HF_TYPE = {t: m for m in ARCHITECTURES for t in m.HF_MODEL_TYPES}
BY_GGUF_ARCH = {t: m for m in ARCHITECTURES for t in m.GGUF_ARCHES}

# Canonical name → candidate templates ({L} layer, {E} expert). First match wins.
HF_NAMES: dict[str, tuple[str, ...]] = {
    "embed": ("model.embed_tokens.weight",),
    "norm": ("model.norm.weight",),
    "lm_head": ("lm_head.weight",),
    "attn_norm": ("model.layers.{L}.input_layernorm.weight",),
    "q": ("model.layers.{L}.self_attn.q_proj.weight",),
    "k": ("model.layers.{L}.self_attn.k_proj.weight",),
    "v": ("model.layers.{L}.self_attn.v_proj.weight",),
    "o": ("model.layers.{L}.self_attn.o_proj.weight",),
    "q_bias": ("model.layers.{L}.self_attn.q_proj.bias",),
    "k_bias": ("model.layers.{L}.self_attn.k_proj.bias",),
    "v_bias": ("model.layers.{L}.self_attn.v_proj.bias",),
    "o_bias": ("model.layers.{L}.self_attn.o_proj.bias",),
    "q_norm": ("model.layers.{L}.self_attn.q_norm.weight",),
    "k_norm": ("model.layers.{L}.self_attn.k_norm.weight",),
    "ffn_norm": ("model.layers.{L}.post_attention_layernorm.weight",),
    "router": ("model.layers.{L}.mlp.gate.weight",),
    "mlp_gate": ("model.layers.{L}.mlp.gate_proj.weight",),
    "mlp_up": ("model.layers.{L}.mlp.up_proj.weight",),
    "mlp_down": ("model.layers.{L}.mlp.down_proj.weight",),
    # Per-expert layout (what save_pretrained writes by default, and hub checkpoints).
    "expert.gate": ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight",),
    "expert.up": ("model.layers.{L}.mlp.experts.{E}.up_proj.weight",),
    "expert.down": ("model.layers.{L}.mlp.experts.{E}.down_proj.weight",),
    # Fused layout (save_original_format=False): gate_up [E, 2I, H] gate rows first, down [E, H, I].
    "experts.gate_up": ("model.layers.{L}.mlp.experts.gate_up_proj",),
    "experts.down": ("model.layers.{L}.mlp.experts.down_proj",),
}

GGUF_NAMES: dict[str, tuple[str, ...]] = {
    "embed": ("token_embd.weight",),
    "norm": ("output_norm.weight",),
    "lm_head": ("output.weight",),
    "attn_norm": ("blk.{L}.attn_norm.weight",),
    "q": ("blk.{L}.attn_q.weight",),
    "k": ("blk.{L}.attn_k.weight",),
    "v": ("blk.{L}.attn_v.weight",),
    "o": ("blk.{L}.attn_output.weight",),
    "q_bias": ("blk.{L}.attn_q.bias",),
    "k_bias": ("blk.{L}.attn_k.bias",),
    "v_bias": ("blk.{L}.attn_v.bias",),
    "o_bias": ("blk.{L}.attn_output.bias",),
    "q_norm": ("blk.{L}.attn_q_norm.weight",),
    "k_norm": ("blk.{L}.attn_k_norm.weight",),
    "ffn_norm": ("blk.{L}.ffn_norm.weight",),
    "router": ("blk.{L}.ffn_gate_inp.weight",),
    "router_bias": ("blk.{L}.ffn_gate_inp.bias",),
    "mlp_gate": ("blk.{L}.ffn_gate.weight",),
    "mlp_up": ("blk.{L}.ffn_up.weight",),
    "mlp_down": ("blk.{L}.ffn_down.weight",),
    # Split layout of the published S²-MoE fork: one tensor per (layer, expert, projection).
    "expert.gate": ("blk.{L}.ffn_gate.{E:03d}.weight",),
    "expert.up": ("blk.{L}.ffn_up.{E:03d}.weight",),
    "expert.down": ("blk.{L}.ffn_down.{E:03d}.weight",),
    "expert.gate_bias": ("blk.{L}.ffn_gate.{E:03d}.bias",),
    "expert.up_bias": ("blk.{L}.ffn_up.{E:03d}.bias",),
    "expert.down_bias": ("blk.{L}.ffn_down.{E:03d}.bias",),
    # Merged layout (llama.cpp default): numpy shape [E, I, H] (ne [H, I, E]); biases [E, I] / [E, H].
    "experts.gate": ("blk.{L}.ffn_gate_exps.weight",),
    "experts.up": ("blk.{L}.ffn_up_exps.weight",),
    "experts.down": ("blk.{L}.ffn_down_exps.weight",),
    "experts.gate_bias": ("blk.{L}.ffn_gate_exps.bias",),
    "experts.up_bias": ("blk.{L}.ffn_up_exps.bias",),
    "experts.down_bias": ("blk.{L}.ffn_down_exps.bias",),
}


def names_for(arch: ModuleType, fmt: str) -> dict[str, tuple[str, ...]]:
    """The architecture's own spellings first, then the common ones as fallback."""
    base = HF_NAMES if fmt == "hf" else GGUF_NAMES
    own = arch.HF_NAMES if fmt == "hf" else arch.GGUF_NAMES
    return {key: own.get(key, ()) + base.get(key, ()) for key in {**base, **own}}
