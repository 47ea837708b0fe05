"""`ModelConfig`: the one description of a MoE transformer that the forward pass reads.

Architecture files (`runtime/model/models/*.py`) build it from a Hugging Face `config.json` or from GGUF
metadata; everything downstream (loader checks, forward pass, byte accounting) reads only this.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from ..errors import ModelFormatError, UnsupportedModelError

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_topk")
QK_NORMS = ("none", "full", "per_head")
ATTENTIONS = ("gqa", "mla")
ROPE_TYPES = ("default", "yarn")
EXPERT_ACTS = ("swiglu", "swiglu_clamped")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    router: str = "softmax_topk"  # softmax over all experts then top-k, or top-k logits then softmax
    norm_topk_prob: bool = False
    qk_norm: str = "none"
    clip_qkv: float | None = None
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    dense_intermediate_size: int | None = None
    # True where the layer's FFN is a MoE block; False marks a dense SwiGLU MLP.
    moe_layers: tuple[bool, ...] = field(default=())
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # ---- Added with DeepSeek-V2 / GPT-OSS. to_dict() leaves these out while they hold their defaults,
    # so the fingerprints of older families' models (and the profiles calibrated for them) do not move.
    attention: str = "gqa"  # "gqa": per-head q/k/v; "mla": DeepSeek's multi-head latent attention
    q_lora_rank: int | None = None  # MLA: q through a low-rank bottleneck (q_a → RMSNorm → q_b)
    kv_lora_rank: int | None = None  # MLA: width of the cached latent c_kv
    qk_rope_head_dim: int | None = None  # MLA: the RoPE part of each q/k head (head_dim = nope + rope)
    v_head_dim: int | None = None  # MLA: value width per head (differs from the q/k width)
    attention_out_bias: bool = False
    attention_sinks: bool = False  # GPT-OSS: one learned logit per head joins every softmax
    sliding_layers: tuple[bool, ...] = ()  # layers that use `sliding_window`; () = every layer
    rope_interleave: bool = False  # rotate adjacent pairs (DeepSeek), not the two halves
    rope_type: str = "default"
    rope_factor: float = 1.0  # YaRN fields follow transformers' `_compute_yarn_parameters`
    rope_original_max_position: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    shared_expert_intermediate_size: int | None = None  # always-resident shared experts (dense)
    routed_scaling_factor: float = 1.0
    expert_groups: int | None = None  # group-limited routing: choose among the best groups only
    expert_groups_used: int | None = None
    router_bias: bool = False  # GPT-OSS: the router is a linear layer with bias
    router_score_bias: bool = False  # DeepSeek-V3: e_score_correction_bias, for selection only
    expert_bias: bool = False
    expert_act: str = "swiglu"  # or "swiglu_clamped" (GPT-OSS)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (True,) * self.num_layers)
        problems = []
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "num_experts", "top_k", "expert_intermediate_size"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive (got {getattr(self, name)})")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.top_k > self.num_experts:
            problems.append(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.router not in ROUTERS:
            problems.append(f"router {self.router!r} not in {ROUTERS}")
        if self.qk_norm not in QK_NORMS:
            problems.append(f"qk_norm {self.qk_norm!r} not in {QK_NORMS}")
        if len(self.moe_layers) != self.num_layers:
            problems.append(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if not all(self.moe_layers) and not self.dense_intermediate_size:
            problems.append("dense layers need dense_intermediate_size")
        problems += self._check_extensions()
        if problems:
            raise ModelFormatError("invalid model config: " + "; ".join(problems))

    def _check_extensions(self) -> list[str]:
        problems = []
        for name, allowed in (("attention", ATTENTIONS), ("rope_type", ROPE_TYPES), ("expert_act", EXPERT_ACTS)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} {getattr(self, name)!r} not in {allowed}")
        if self.attention == "mla":
            if not (self.kv_lora_rank and self.qk_rope_head_dim and self.v_head_dim):
                problems.append("MLA needs kv_lora_rank, qk_rope_head_dim and v_head_dim")
            elif not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
                problems.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and at most "
                                f"head_dim {self.head_dim}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            problems.append(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.expert_groups:
            if self.num_experts % self.expert_groups:
                problems.append(f"num_experts {self.num_experts} does not split into {self.expert_groups} groups")
            if not 0 < (self.expert_groups_used or 0) <= self.expert_groups:
                problems.append(f"expert_groups_used {self.expert_groups_used} not in 1..{self.expert_groups}")
        return problems

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, moe in enumerate(self.moe_layers) if moe]

    @property
    def rope_dim(self) -> int:
        """Width that RoPE rotates: the whole head, or MLA's decoupled RoPE part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def attn_scale(self) -> float:
        """Softmax scale: 1/sqrt(q/k head width), times DeepSeek's YaRN mscale² (`yarn_apply_mscale`)."""
        scale = self.head_dim ** -0.5
        if self.rope_type != "default" and self.rope_mscale_all_dim:
            m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(cached heads, key width, value width) per position and layer. MLA caches one latent
        c_kv (the "key") and the shared RoPE key k_pe (the "value"); every head's keys and values
        are re-derived from them."""
        if self.attention == "mla":
            return 1, self.kv_lora_rank, self.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def kv_floats_per_position(self) -> int:
        heads, kd, vd = self.kv_shape
        return self.num_layers * heads * (kd + vd)

    def window_of(self, layer: int) -> int | None:
        if not self.sliding_window or (self.sliding_layers and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        later = [f for f in fields(self)][[f.name for f in fields(self)].index("attention"):]
        for f in later:  # see the comment above `attention`
            if out[f.name] == f.default:
                del out[f.name]
        return out


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class ConfigReader:
    """Typed access to a config mapping, with errors that name the file and the field."""

    def __init__(self, data: Mapping[str, Any], source: str):
        self.data = data
        self.source = source

    def get(self, *names: str, default: Any = ..., kind: type = int) -> Any:
        """First present key among ``names`` (spellings differ across versions), converted to ``kind``."""
        for name in names:
            value = self.data.get(name)
            if value is not None:
                try:
                    return kind(value)
                except (TypeError, ValueError):
                    raise ModelFormatError(
                        f"{self.source}: field '{name}' should be {kind.__name__}, got {value!r}"
                    ) from None
        if default is ...:
            raise ModelFormatError(f"{self.source}: missing field '{names[0]}'")
        return default


def rope_from_hf(cfg: ConfigReader, default_theta: float = 10000.0) -> dict[str, Any]:
    """RoPE fields: transformers 5 writes `rope_parameters`; hub files have `rope_theta`/`rope_scaling`."""
    params = cfg.data.get("rope_parameters") or cfg.data.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        params = {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ModelFormatError(f"{cfg.source}: rope type {kind!r} is not supported yet (only default RoPE and YaRN)")
    theta = params.get("rope_theta")
    out: dict[str, Any] = {"rope_theta": float(theta) if theta is not None else
                           cfg.get("rope_theta", default=default_theta, kind=float)}
    if kind == "yarn":
        p = ConfigReader(params, f"{cfg.source} (rope parameters)")
        max_pos = cfg.get("max_position_embeddings", default=4096)
        orig = p.get("original_max_position_embeddings", default=None) or cfg.get(
            "original_max_position_embeddings", default=max_pos)
        truncate = params.get("truncate")
        out.update(
            rope_type="yarn",
            # a missing factor means the context extension ratio (DeepSeek-V3's convention)
            rope_factor=p.get("factor", default=None, kind=float) or max_pos / orig,
            rope_original_max_position=orig,
            rope_beta_fast=p.get("beta_fast", default=None, kind=float) or 32.0,
            rope_beta_slow=p.get("beta_slow", default=None, kind=float) or 1.0,
            rope_truncate=True if truncate is None else bool(truncate),
            rope_attention_factor=p.get("attention_factor", default=None, kind=float),
            rope_mscale=p.get("mscale", default=None, kind=float),
            rope_mscale_all_dim=p.get("mscale_all_dim", default=None, kind=float),
        )
    return out


def rope_from_gguf(meta: ConfigReader, arch: str) -> dict[str, Any]:
    """llama.cpp's `rope.scaling.*` keys (YaRN only; beta defaults as in llama.cpp and transformers)."""
    a = arch
    kind = meta.get(f"{a}.rope.scaling.type", default="none", kind=str)
    if kind in ("none", "default"):
        return {}
    if kind != "yarn":
        raise UnsupportedModelError(f"{meta.source}: rope scaling {kind!r} is not supported yet (only YaRN)")
    out: dict[str, Any] = dict(
        rope_type="yarn",
        rope_factor=from_f32(meta.get(f"{a}.rope.scaling.factor", kind=float)),
        rope_original_max_position=meta.get(f"{a}.rope.scaling.original_context_length"),
    )
    for key, name in (("yarn_beta_fast", "rope_beta_fast"), ("yarn_beta_slow", "rope_beta_slow"),
                      ("attn_factor", "rope_attention_factor")):
        value = meta.get(f"{a}.rope.scaling.{key}", default=None, kind=float)
        if value is not None:
            out[name] = from_f32(value)
    return out


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def common_hf_fields(cfg: ConfigReader) -> dict[str, Any]:
    """Fields spelled the same way across the Llama-derived MoE configs."""
    hidden = cfg.get("hidden_size")
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim", default=None) or hidden // heads
    return dict(
        vocab_size=cfg.get("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.get("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", default=heads),
        head_dim=head_dim,
        num_experts=cfg.get("num_experts", "num_local_experts", "n_routed_experts"),
        top_k=cfg.get("num_experts_per_tok", "experts_per_token"),  # the latter: GPT-OSS hub files
        rms_norm_eps=cfg.get("rms_norm_eps", default=1e-5, kind=float),
        **rope_from_hf(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", default=4096),
        tie_word_embeddings=bool(cfg.data.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.data.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id", default=None),
        eos_token_ids=token_ids(cfg.data.get("eos_token_id")),
    )


def from_f32(value: float) -> float:
    """GGUF stores float32: 1e-5 comes back as 9.99999975e-06; take its shortest float32 spelling."""
    import numpy as np

    return float(str(np.float32(value)))


def common_gguf_fields(meta: ConfigReader, arch: str) -> dict[str, Any]:
    """GGUF keys are `<arch>.<field>`; shared by every llama.cpp MoE architecture."""
    a = arch
    hidden = meta.get(f"{a}.embedding_length")
    heads = meta.get(f"{a}.attention.head_count")
    return dict(
        vocab_size=meta.get(f"{a}.vocab_size", default=None),
        hidden_size=hidden,
        num_layers=meta.get(f"{a}.block_count"),
        num_heads=heads,
        num_kv_heads=meta.get(f"{a}.attention.head_count_kv", default=heads),
        head_dim=meta.get(f"{a}.attention.key_length", default=None) or hidden // heads,
        num_experts=meta.get(f"{a}.expert_count"),
        top_k=meta.get(f"{a}.expert_used_count"),
        rms_norm_eps=from_f32(meta.get(f"{a}.attention.layer_norm_rms_epsilon", default=1e-5, kind=float)),
        rope_theta=from_f32(meta.get(f"{a}.rope.freq_base", default=10000.0, kind=float)),
        **rope_from_gguf(meta, a),
        max_position_embeddings=meta.get(f"{a}.context_length", default=4096),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", default=None),
        eos_token_ids=token_ids(meta.data.get("tokenizer.ggml.eos_token_id")),
    )
