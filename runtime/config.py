"""`ModelConfig`: the one description of a MoE transformer that the forward pass reads.

Architecture files (`runtime/models/*.py`) build it from a Hugging Face `config.json` or from GGUF
metadata; everything downstream (loader checks, forward pass, byte accounting) reads only this.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .errors import ModelFormatError

ROUTERS = ("softmax_topk", "topk_softmax")
QK_NORMS = ("none", "full", "per_head")


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
        if problems:
            raise ModelFormatError("invalid model config: " + "; ".join(problems))

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, moe in enumerate(self.moe_layers) if moe]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def rope_theta_from_hf(cfg: ConfigReader, default: float = 10000.0) -> float:
    """transformers 5 writes `rope_parameters.rope_theta`; hub files have `rope_theta`."""
    params = cfg.data.get("rope_parameters") or cfg.data.get("rope_scaling") or {}
    if isinstance(params, Mapping):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in (None, "default"):
            raise ModelFormatError(
                f"{cfg.source}: rope type {kind!r} is not supported yet (only the default RoPE)"
            )
        if params.get("rope_theta") is not None:
            return float(params["rope_theta"])
    return cfg.get("rope_theta", default=default, kind=float)


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
        num_experts=cfg.get("num_experts", "num_local_experts"),
        top_k=cfg.get("num_experts_per_tok"),
        rms_norm_eps=cfg.get("rms_norm_eps", default=1e-5, kind=float),
        rope_theta=rope_theta_from_hf(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", default=4096),
        tie_word_embeddings=bool(cfg.data.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.data.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id", default=None),
        eos_token_ids=token_ids(cfg.data.get("eos_token_id")),
    )


def _from_f32(value: float) -> float:
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
        rms_norm_eps=_from_f32(meta.get(f"{a}.attention.layer_norm_rms_epsilon", default=1e-5, kind=float)),
        rope_theta=_from_f32(meta.get(f"{a}.rope.freq_base", default=10000.0, kind=float)),
        max_position_embeddings=meta.get(f"{a}.context_length", default=4096),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", default=None),
        eos_token_ids=token_ids(meta.data.get("tokenizer.ggml.eos_token_id")),
    )
