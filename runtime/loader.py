"""Load a MoE checkpoint: dense weights into memory, experts as byte ranges (`ExpertRefs`).

Accepts a Hugging Face folder (config.json + *.safetensors, per-expert or fused 3-D experts) or a
single GGUF file (merged `*_exps` or split `ffn_*.NNN` experts). Every tensor is checked against the
shape the config implies before anything is computed, so a bad file fails with one line naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import numpy as np

from .config import ConfigReader, ModelConfig
from .errors import ModelFormatError, UnsupportedModelError
from .formats import tensors as T
from .formats.tensors import TensorRef
from .models import BY_GGUF_ARCH, BY_HF_TYPE, names_for

PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertRefs:
    """Where one (layer, expert)'s three projections live on disk."""

    layer: int
    expert: int
    gate: TensorRef  # [I, H]
    up: TensorRef  # [I, H]
    down: TensorRef  # [H, I]

    @property
    def refs(self) -> tuple[TensorRef, TensorRef, TensorRef]:
        return (self.gate, self.up, self.down)

    @property
    def stored_bytes(self) -> int:
        return sum(r.nbytes for r in self.refs)

    @property
    def resident_bytes(self) -> int:
        """Bytes once dequantised to the float32 compute format."""
        return sum(r.n_elements for r in self.refs) * 4


@dataclass
class LoadedModel:
    config: ModelConfig
    dense: dict[str, np.ndarray]  # "embed", "norm", "lm_head", "layers.{L}.{name}"
    experts: dict[tuple[int, int], ExpertRefs]
    path: str
    format: str  # "safetensors" | "gguf"
    expert_layout: str  # "per-expert" | "fused" | "merged" | "split"
    tokenizer_path: str | None = None
    gguf: object | None = field(default=None, repr=False)

    @property
    def dense_bytes(self) -> int:
        return sum(a.nbytes for a in self.dense.values())

    @property
    def expert_stored_bytes(self) -> int:
        return sum(e.stored_bytes for e in self.experts.values())

    @property
    def expert_resident_bytes(self) -> int:
        return sum(e.resident_bytes for e in self.experts.values())

    def layer(self, i: int, name: str) -> np.ndarray | None:
        return self.dense.get(f"layers.{i}.{name}")


class _Resolver:
    """Finds tensors by canonical name and checks their shapes."""

    def __init__(self, refs: dict[str, TensorRef], names: dict[str, tuple[str, ...]], source: str):
        self.refs, self.names, self.source = refs, names, source

    def find(self, canon: str, **where) -> TensorRef | None:
        for template in self.names.get(canon, ()):
            ref = self.refs.get(template.format(**where))
            if ref is not None:
                return ref
        return None

    def need(self, canon: str, shape: tuple[int, ...], **where) -> TensorRef:
        ref = self.find(canon, **where)
        if ref is None:
            wanted = self.names[canon][0].format(**where)
            raise ModelFormatError(f"{self.source}: missing tensor {wanted}")
        return self.check(ref, shape)

    def check(self, ref: TensorRef, shape: tuple[int, ...]) -> TensorRef:
        if tuple(ref.shape) != tuple(shape):
            raise ModelFormatError(
                f"{ref.path}: tensor {ref.name} has shape {list(ref.shape)}, the config implies {list(shape)}"
            )
        return ref


def load_model(path: str) -> LoadedModel:
    if not os.path.exists(path):
        raise ModelFormatError(f"{path}: no such file or folder; pass --model with a Hugging Face folder or a .gguf file")
    if os.path.isdir(path):
        return _load_hf(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(path)
    raise ModelFormatError(f"{path}: not a model (expected a Hugging Face folder with config.json, or a .gguf file)")


def _load_hf(folder: str) -> LoadedModel:
    from .formats.safetensors_index import index_folder

    cfg_path = os.path.join(folder, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ModelFormatError(f"{folder}: no config.json; is this a Hugging Face model folder?") from None
    except (ValueError, UnicodeDecodeError):
        raise ModelFormatError(f"{cfg_path}: not valid JSON") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{cfg_path}: expected a JSON object")
    model_type = raw.get("model_type")
    arch = BY_HF_TYPE.get(model_type)
    if arch is None:
        known = ", ".join(sorted(BY_HF_TYPE))
        raise UnsupportedModelError(f"{cfg_path}: model_type {model_type!r} is not supported (supported: {known})")
    config = arch.config_from_hf(ConfigReader(raw, cfg_path))
    refs = index_folder(folder)
    res = _Resolver(refs, names_for(arch, "hf"), folder)
    dense = _load_dense(config, res, T.load)
    experts, layout = _expert_refs(config, res, fused=("experts.gate_up", "experts.down"))
    tok = os.path.join(folder, "tokenizer.json")
    return LoadedModel(config, dense, experts, folder, "safetensors", layout, tok if os.path.exists(tok) else None)


def _load_gguf(path: str) -> LoadedModel:
    from .formats.gguf_index import GGUFIndex

    index = GGUFIndex(path)
    arch_name = index.architecture
    arch = BY_GGUF_ARCH.get(arch_name)
    if arch is None:
        known = ", ".join(sorted(BY_GGUF_ARCH))
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch_name!r} is not supported (supported: {known})")
    meta = ConfigReader(index.metadata, path)
    if meta.get(f"{arch_name}.expert_count", default=0) <= 0:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch_name!r} without experts is not a MoE model")
    config = arch.config_from_gguf(meta, arch_name)
    if config.vocab_size is None:
        tokens = index.array("tokenizer.ggml.tokens")
        emb = index.tensors.get("token_embd.weight")
        vocab = len(tokens) if tokens else (emb.shape[0] if emb else None)
        if not vocab:
            raise ModelFormatError(f"{path}: cannot tell the vocabulary size (no vocab_size, tokens or token_embd)")
        config = ModelConfig(**{**config.to_dict(), "vocab_size": vocab})
    res = _Resolver(index.tensors, names_for(arch, "gguf"), path)
    load = T.load
    if getattr(arch, "GGUF_QK_PERMUTED", False):
        load = _unpermuting_loader(config)
    dense = _load_dense(config, res, load, tied_if_missing=True)
    experts, layout = _expert_refs(config, res, fused=("experts.gate", "experts.up", "experts.down"))
    return LoadedModel(config, dense, experts, path, "gguf", layout, None, gguf=index)


def _unpermuting_loader(config: ModelConfig) -> Callable[[TensorRef], np.ndarray]:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE) so HF's rotate-half RoPE applies."""

    def load(ref: TensorRef) -> np.ndarray:
        w = T.load(ref)
        kind = ref.name.split(".")[-2] if ref.name.endswith(".weight") else ""
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(kind)
        if heads is None:
            return w
        rows, cols = w.shape
        return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)

    return load


def _load_dense(
    config: ModelConfig, res: _Resolver, load: Callable[[TensorRef], np.ndarray], tied_if_missing: bool = False
) -> dict[str, np.ndarray]:
    c = config
    H, D, V = c.hidden_size, c.head_dim, c.vocab_size
    q_out, kv_out = c.num_heads * D, c.num_kv_heads * D
    dense = {"embed": load(res.need("embed", (V, H))), "norm": load(res.need("norm", (H,)))}
    # Tied models omit the head: HF says so in the config, GGUF simply leaves out `output.weight`.
    if c.tie_word_embeddings or (tied_if_missing and res.find("lm_head") is None):
        dense["lm_head"] = dense["embed"]
    else:
        dense["lm_head"] = load(res.need("lm_head", (V, H)))
    norm_width = {"full": (q_out, kv_out), "per_head": (D, D)}.get(c.qk_norm)
    for L in range(c.num_layers):
        shapes = {
            "attn_norm": (H,), "ffn_norm": (H,),
            "q": (q_out, H), "k": (kv_out, H), "v": (kv_out, H), "o": (H, q_out),
        }
        if norm_width:
            shapes["q_norm"], shapes["k_norm"] = (norm_width[0],), (norm_width[1],)
        if c.moe_layers[L]:
            shapes["router"] = (c.num_experts, H)
        else:
            I = c.dense_intermediate_size
            shapes.update(mlp_gate=(I, H), mlp_up=(I, H), mlp_down=(H, I))
        for name, shape in shapes.items():
            dense[f"layers.{L}.{name}"] = load(res.need(name, shape, L=L))
        if c.attention_bias:
            for name, width in (("q_bias", q_out), ("k_bias", kv_out), ("v_bias", kv_out)):
                dense[f"layers.{L}.{name}"] = load(res.need(name, (width,), L=L))
    return dense


def _expert_refs(config: ModelConfig, res: _Resolver, fused: tuple[str, ...]) -> tuple[dict, str]:
    c = config
    E, I, H = c.num_experts, c.expert_intermediate_size, c.hidden_size
    experts: dict[tuple[int, int], ExpertRefs] = {}
    layouts = set()
    for L in c.moe_layer_ids:
        merged = [res.find(name, L=L) for name in fused]
        if all(merged):
            if len(fused) == 2:  # HF fused: gate_up [E, 2I, H], down [E, H, I]
                gate_up = res.check(merged[0], (E, 2 * I, H))
                down = res.check(merged[1], (E, H, I))
                for e in range(E):
                    gu = gate_up.slice_leading(e)
                    experts[L, e] = ExpertRefs(L, e, gu.split_rows(2, 0), gu.split_rows(2, 1), down.slice_leading(e))
                layouts.add("fused")
            else:  # GGUF merged: gate/up [E, I, H], down [E, H, I]
                gate, up = res.check(merged[0], (E, I, H)), res.check(merged[1], (E, I, H))
                down = res.check(merged[2], (E, H, I))
                for e in range(E):
                    experts[L, e] = ExpertRefs(L, e, gate.slice_leading(e), up.slice_leading(e), down.slice_leading(e))
                layouts.add("merged")
            continue
        for e in range(E):
            experts[L, e] = ExpertRefs(
                L, e,
                res.need("expert.gate", (I, H), L=L, E=e),
                res.need("expert.up", (I, H), L=L, E=e),
                res.need("expert.down", (H, I), L=L, E=e),
            )
        layouts.add("split" if len(fused) == 3 else "per-expert")
    return experts, "+".join(sorted(layouts)) or "none"
