"""Load a MoE checkpoint: dense weights into memory, experts as byte ranges (`ExpertRefs`).

Accepts a Hugging Face folder (config.json + *.safetensors, per-expert or fused 3-D experts, GPT-OSS's
interleaved and MXFP4 experts) or a single GGUF file (merged `*_exps` or split `ffn_*.NNN` experts).
Every tensor is checked against the shape the config implies before anything is computed, so a bad
file fails with one line naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .config import ConfigReader, ModelConfig
from .. import jsonfile
from ..errors import ModelFormatError, UnsupportedModelError
from . import dense as D
from .formats.tensors import TensorRef
from .models import BY_GGUF_ARCH, BY_HF_TYPE, names_for

PROJECTIONS = ("gate", "up", "down")
BIASES = ("gate_bias", "up_bias", "down_bias")


@dataclass(frozen=True)
class ExpertRefs:
    """Where one (layer, expert)'s weights live on disk: named byte ranges (roles) and the layout
    that `offload.experts.assemble` turns them into resident weights with."""

    layer: int
    expert: int
    parts: tuple[tuple[str, TensorRef], ...]
    layout: str = "split"

    @classmethod
    def split(cls, layer: int, expert: int, gate: TensorRef, up: TensorRef, down: TensorRef,
              biases: tuple[TensorRef, ...] = ()) -> "ExpertRefs":
        return cls(layer, expert, tuple(zip(PROJECTIONS + BIASES, (gate, up, down) + tuple(biases))))

    @property
    def refs(self) -> tuple[TensorRef, ...]:
        return tuple(ref for _, ref in self.parts)

    @property
    def gate(self) -> TensorRef:
        """The part holding the gate weights (alone or with up): what reports name and time."""
        return self.parts[0][1]

    @property
    def storage_type(self) -> str:
        return "MXFP4" if any(role.endswith("_blocks") for role, _ in self.parts) else self.gate.dtype

    @property
    def stored_bytes(self) -> int:
        return sum(r.nbytes for r in self.refs)

    def resident_bytes_for(self, direct: bool) -> int:
        """Memory one resident copy holds: the read buffers of parts kept stored (page-rounded
        under O_DIRECT) plus the arrays converted parts become (see offload/experts.py)."""
        from ..offload.experts import converted_bytes, kept_stored
        from ..offload.reader import coalesce, span_cost

        roles = [role for role, _ in self.parts]
        kept = sum(span_cost(span.offset, span.nbytes, direct) for span, members in coalesce(self.refs)
                   if any(kept_stored(self.layout, roles[i], ref) for i, ref in members))
        return kept + sum(converted_bytes(self.layout, role, ref) for role, ref in self.parts)

    @property
    def resident_bytes(self) -> int:
        """Memory one resident copy holds when read with O_DIRECT (the most it can hold)."""
        return self.resident_bytes_for(True)


@dataclass
class LoadedModel:
    config: ModelConfig
    dense_specs: dict[str, D.DenseSpec]  # "embed", "norm", "lm_head", "layers.{L}.{name}"
    experts: dict[tuple[int, int], ExpertRefs]
    path: str
    format: str  # "safetensors" | "gguf"
    expert_layout: str  # "per-expert" | "fused" | "merged" | "split"
    tokenizer_path: str | None = None
    gguf: object | None = field(default=None, repr=False)
    # the model's own sampling defaults (temperature / top_k / top_p) where it asks to sample:
    # generation_config.json with do_sample, or a GGUF's general.sampling.* keys
    generation_defaults: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict, repr=False)  # filled by load_dense()
    # set once a draft head has stored ``dense["lm_head"]``'s rows in rank order (MoEModel.draft_head),
    # for every model that computes with these objects
    head_order: object | None = field(default=None, repr=False)  # a draft_head.HeadOrder

    def without_kernel(self) -> dict[str, tuple[int, int, int]]:
        """Block types whose weights have no kernel here (decoded to float32 at load): type →
        (tensors, stored bytes, bytes as float32). Empty for every type llama.cpp's common mixes use."""
        from ..kernels.stored import kernel_type

        out: dict[str, list] = {}
        refs = [r for s in self.dense_specs.values() for r in s.refs] + [r for e in self.experts.values() for r in e.refs]
        for r in {(r.path, r.offset, r.nbytes): r for r in refs}.values():  # (one slice per expert of a merged tensor)
            if r.dtype in ("F32", "U8") or len(r.shape) < 2 or kernel_type(r.dtype, r.shape[-1]):
                continue
            n = out.setdefault(r.dtype, [set(), 0, 0])
            n[0].add((r.path, r.name.split("[")[0]))  # (an expert of a merged tensor: "name[e]")
            n[1] += r.nbytes
            n[2] += 4 * r.n_elements
        return {k: (len(v[0]), v[1], v[2]) for k, v in out.items()}

    def load_dense(self, direct: bool = True) -> dict:
        """Read the dense part (once): O_DIRECT or buffered + dropped pages, stored encodings kept."""
        if not self.dense and self.dense_specs:
            from ..offload.reader import FileReader

            reader = FileReader(direct)
            try:
                self.dense = D.load(self.dense_specs, reader)
            finally:
                reader.close()
        return self.dense

    @property
    def dense_bytes(self) -> int:
        """Memory the dense part holds once loaded (planned from the specs: nothing is read)."""
        return D.resident_bytes(self.dense_specs)

    @property
    def dense_stored_bytes(self) -> int:
        return sum(r.nbytes for s in {id(s): s for s in self.dense_specs.values()}.values() for r in s.refs)

    @property
    def expert_stored_bytes(self) -> int:
        return sum(e.stored_bytes for e in self.experts.values())

    @property
    def expert_resident_bytes(self) -> int:
        return sum(e.resident_bytes for e in self.experts.values())

    def layer(self, i: int, name: str):
        return self.load_dense().get(f"layers.{i}.{name}")


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


def load_model(path: str, dense: bool = True) -> LoadedModel:
    """Index a checkpoint; with ``dense`` also read its dense part (the engine plans its memory
    first, so it passes False and loads after the budget check)."""
    loaded = _open_model(path)
    if dense:
        loaded.load_dense()
    return loaded


def _open_model(path: str) -> LoadedModel:
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
            raw = jsonfile.load(f)
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
    dense = _dense_specs(config, res)
    experts, layout = _expert_refs(config, res, "hf", getattr(arch, "HF_EXPERTS", "split"))
    tok = os.path.join(folder, "tokenizer.json")
    return LoadedModel(config, dense, experts, folder, "safetensors", layout, tok if os.path.exists(tok) else None,
                       generation_defaults=_generation_config(folder))


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
    repeat = _repeated_kv_heads(index.metadata, config, path)
    if repeat > 1:  # our export repeated each KV head for llama.cpp: read back the original heads
        config = ModelConfig(**{**config.to_dict(), "num_kv_heads": config.num_heads // repeat})
    dense = _dense_specs(config, res, tied_if_missing=True, qk_permuted=getattr(arch, "GGUF_QK_PERMUTED", False),
                         kv_repeat=repeat)
    experts, layout = _expert_refs(config, res, "gguf")
    return LoadedModel(config, dense, experts, path, "gguf", layout, None, gguf=index,
                       generation_defaults=_gguf_sampling(index.metadata))


def _layer_shapes(c: ModelConfig, L: int) -> dict[str, tuple[int, ...]]:
    """Canonical name → shape of every dense tensor of layer ``L`` the config implies."""
    H, D, nh = c.hidden_size, c.head_dim, c.num_heads
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (H,), "ffn_norm": (H,)}
    if c.attention == "mla":
        r, dr, dv = c.kv_lora_rank, c.qk_rope_head_dim, c.v_head_dim
        if c.q_lora_rank:
            shapes.update(q_a=(c.q_lora_rank, H), q_a_norm=(c.q_lora_rank,), q_b=(nh * D, c.q_lora_rank))
        else:
            shapes["q"] = (nh * D, H)
        shapes.update(kv_a=(r + dr, H), kv_a_norm=(r,), kv_b=(nh * (D - dr + dv), r), o=(H, nh * dv))
        if c.attention_bias:  # DeepSeek: on the down-projections and the output, not on q_b / kv_b
            shapes.update(kv_a_bias=(r + dr,), o_bias=(H,))
            if c.q_lora_rank:
                shapes["q_a_bias"] = (c.q_lora_rank,)
    else:
        q_out, kv_out = nh * D, c.num_kv_heads * D
        shapes.update(q=(q_out, H), k=(kv_out, H), v=(kv_out, H), o=(H, q_out))
        norm_width = {"full": (q_out, kv_out), "per_head": (D, D)}.get(c.qk_norm)
        if norm_width:
            shapes["q_norm"], shapes["k_norm"] = (norm_width[0],), (norm_width[1],)
        if c.attention_bias:
            shapes.update(q_bias=(q_out,), k_bias=(kv_out,), v_bias=(kv_out,))
        if c.attention_out_bias:
            shapes["o_bias"] = (H,)
        if c.attention_sinks:
            shapes["sinks"] = (nh,)
    if c.moe_layers[L]:
        shapes["router"] = (c.num_experts, H)
        if c.router_bias:
            shapes["router_bias"] = (c.num_experts,)
        if c.router_score_bias:
            shapes["router_score_bias"] = (c.num_experts,)
        S = c.shared_expert_intermediate_size
        if S:  # shared experts are dense: resident with the attention weights, never in the cache
            shapes.update(shared_gate=(S, H), shared_up=(S, H), shared_down=(H, S))
    else:
        I = c.dense_intermediate_size
        shapes.update(mlp_gate=(I, H), mlp_up=(I, H), mlp_down=(H, I))
    return shapes


def _generation_config(folder: str) -> dict:
    """Sampling defaults from generation_config.json, only when it asks to sample (do_sample);
    a missing or unreadable file means none."""
    try:
        with open(os.path.join(folder, "generation_config.json")) as f:
            gen = jsonfile.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(gen, dict) or not gen.get("do_sample"):
        return {}
    return {k: gen[k] for k in ("temperature", "top_k", "top_p") if gen.get(k) is not None}


def _gguf_sampling(meta: dict) -> dict:
    """llama.cpp's general.sampling.* keys, read back at their float32-shortest value."""
    from .config import from_f32

    keys = (("temperature", "temp"), ("top_k", "top_k"), ("top_p", "top_p"))
    return {k: from_f32(meta[f"general.sampling.{g}"]) for k, g in keys if f"general.sampling.{g}" in meta}


def _repeated_kv_heads(meta: dict, config: ModelConfig, path: str) -> int:
    """The factor by which `s2moe convert` repeated KV heads for llama.cpp (1: not repeated)."""
    original = meta.get("s2moe.repeated_kv_heads_from")
    if original is None:
        return 1
    if not isinstance(original, int) or original <= 0 or config.num_heads % original:
        raise ModelFormatError(f"{path}: s2moe.repeated_kv_heads_from {original!r} does not divide "
                               f"{config.num_heads} heads")
    return config.num_heads // original


def _dense_specs(config: ModelConfig, res: _Resolver, tied_if_missing: bool = False,
                 qk_permuted: bool = False, kv_repeat: int = 1) -> dict[str, D.DenseSpec]:
    """Every dense tensor's spec (refs, shape checked against the config; nothing read yet).
    ``kv_repeat``: the file holds each KV head that many times (k, v, k_norm and their biases)."""
    c = config
    H, V = c.hidden_size, c.vocab_size
    repeated = ("k", "v", "k_norm", "k_bias", "v_bias") if kv_repeat > 1 else ()

    def spec(name: str, ref: TensorRef) -> D.DenseSpec:
        canon = name.rsplit(".", 1)[-1]
        if canon in repeated:
            return D.DenseSpec(name, (ref,), "unrepeat", kv_repeat,
                               shape=(ref.shape[0] // kv_repeat, *ref.shape[1:]), head_dim=c.head_dim)
        heads = {"q": c.num_heads, "k": c.num_kv_heads}.get(canon, 0) if qk_permuted else 0
        kind = "unpermute" if heads else ("stored" if canon in D.STORED else "float")
        return D.DenseSpec(name, (ref,), kind, heads)

    specs = {"embed": spec("embed", res.need("embed", (V, H))), "norm": spec("norm", res.need("norm", (H,)))}
    # Tied models omit the head: HF says so in the config, GGUF simply leaves out `output.weight`.
    if c.tie_word_embeddings or (tied_if_missing and res.find("lm_head") is None):
        specs["lm_head"] = specs["embed"]
    else:
        specs["lm_head"] = spec("lm_head", res.need("lm_head", (V, H)))
    for L in range(c.num_layers):
        for name, shape in _layer_shapes(c, L).items():
            key = f"layers.{L}.{name}"
            if name == "kv_b" and res.find("kv_b", L=L) is None and res.find("k_b", L=L) is not None:
                specs[key] = _kv_b_from_split(c, res, L, key)
                continue
            if name in repeated:  # the file's width: every KV head kv_repeat times
                shape = (shape[0] * kv_repeat, *shape[1:])
            specs[key] = spec(key, res.need(name, shape, L=L))
    return specs


def _kv_b_from_split(c: ModelConfig, res: _Resolver, L: int, key: str) -> D.DenseSpec:
    """Newer llama.cpp GGUFs may carry MLA's kv_b only as attn_k_b [heads, r, nope] (transposed)
    and attn_v_b [heads, dv, r]; kv_b [heads · (nope + dv), r] is rebuilt from both."""
    nh, r, dv = c.num_heads, c.kv_lora_rank, c.v_head_dim
    dn = c.head_dim - c.qk_rope_head_dim
    refs = (res.need("k_b", (nh, r, dn), L=L), res.need("v_b", (nh, dv, r), L=L))
    return D.DenseSpec(key, refs, "kv_b", shape=(nh * (dn + dv), r))


def _expert_refs(config: ModelConfig, res: _Resolver, fmt: str, hf_layout: str = "split") -> tuple[dict, str]:
    c = config
    E, I, H = c.num_experts, c.expert_intermediate_size, c.hidden_size
    experts: dict[tuple[int, int], ExpertRefs] = {}
    layouts = set()

    def merged_biases(L: int) -> list[TensorRef]:
        if not c.expert_bias:
            return []
        shapes = {"experts.gate_bias": (E, I), "experts.up_bias": (E, I), "experts.down_bias": (E, H)}
        return [res.need(name, shape, L=L) for name, shape in shapes.items()]

    for L in c.moe_layer_ids:
        if hf_layout == "interleaved":  # GPT-OSS: always fused, gate/up interleaved, MXFP4 or plain
            bias = [res.need("experts.gate_up_bias", (E, 2 * I), L=L), res.need("experts.down_bias", (E, H), L=L)]
            if res.find("experts.gate_up_blocks", L=L) is not None:
                if H % 32 or I % 32:
                    raise ModelFormatError(f"{res.source}: MXFP4 experts need hidden and expert widths divisible by 32")
                parts = {"gate_up_blocks": (E, 2 * I, H // 32, 16), "gate_up_scales": (E, 2 * I, H // 32),
                         "down_blocks": (E, H, I // 32, 16), "down_scales": (E, H, I // 32)}
                layout = "interleaved_mxfp4"
            else:
                parts = {"gate_up": (E, H, 2 * I), "down": (E, I, H)}
                layout = "interleaved"
            refs = {role: res.need("experts." + role, shape, L=L) for role, shape in parts.items()}
            refs.update(gate_up_bias=bias[0], down_bias=bias[1])
            for e in range(E):
                experts[L, e] = ExpertRefs(L, e, tuple((role, ref.slice_leading(e)) for role, ref in refs.items()),
                                           layout)
            layouts.add(layout.replace("_", "-"))
            continue
        if fmt == "hf" and all(res.find(n, L=L) for n in ("experts.gate_up", "experts.down")):
            # HF fused: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]
            gate_up = res.check(res.find("experts.gate_up", L=L), (E, 2 * I, H))
            down = res.check(res.find("experts.down", L=L), (E, H, I))
            for e in range(E):
                gu = gate_up.slice_leading(e)
                experts[L, e] = ExpertRefs.split(L, e, gu.split_rows(2, 0), gu.split_rows(2, 1), down.slice_leading(e))
            layouts.add("fused")
            continue
        merged = [res.find(f"experts.{p}", L=L) for p in PROJECTIONS]
        if fmt == "gguf" and all(merged):  # GGUF merged: gate/up [E, I, H], down [E, H, I]
            gate, up = res.check(merged[0], (E, I, H)), res.check(merged[1], (E, I, H))
            down = res.check(merged[2], (E, H, I))
            biases = merged_biases(L)
            for e in range(E):
                experts[L, e] = ExpertRefs.split(L, e, gate.slice_leading(e), up.slice_leading(e),
                                                 down.slice_leading(e), tuple(b.slice_leading(e) for b in biases))
            layouts.add("merged")
            continue
        for e in range(E):
            biases = ()
            if c.expert_bias:
                biases = tuple(res.need(f"expert.{name}", shape, L=L, E=e) for name, shape in
                               (("gate_bias", (I,)), ("up_bias", (I,)), ("down_bias", (H,))))
            experts[L, e] = ExpertRefs.split(
                L, e,
                res.need("expert.gate", (I, H), L=L, E=e),
                res.need("expert.up", (I, H), L=L, E=e),
                res.need("expert.down", (H, I), L=L, E=e),
                biases,
            )
        layouts.add("split" if fmt == "gguf" else "per-expert")
    return experts, "+".join(sorted(layouts)) or "none"
