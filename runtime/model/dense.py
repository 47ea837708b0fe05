"""The dense part of a model (embeddings, attention, norms, routers, shared experts, head): what
each tensor becomes in memory, what that costs, and loading it.

Planning and loading are separate steps: the specs say, before a byte is read, what every dense
tensor will cost (`resident_bytes`), so a budget is checked before loading (offload/memory.py).
Matrices the model multiplies with (`STORED`) stay in their stored encoding as `StoredMatrix`;
the rest (norms, biases, routers, sinks, MLA's kv_b) is small and kept as float32, and counted.
Reads go through `FileReader`: O_DIRECT, or buffered with the pages dropped, never a mapping of
the file, so a model larger than memory loads in the memory its dense part needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.stored import StoredMatrix, kernel_type
from .formats.tensors import TensorRef, decode_array

# Matrices the forward pass multiplies with: kept stored. (The router stays float32: its logits
# choose the experts, and keeping them on one exact path keeps routing identical across kernels.)
STORED = frozenset({"q", "k", "v", "o", "q_a", "q_b", "kv_a", "shared_gate", "shared_up", "shared_down",
                    "mlp_gate", "mlp_up", "mlp_down", "embed", "lm_head"})
# Float32 matrices multiplied as x @ W.T by BLAS: kept input-major (Fortran order, same values), so
# W.T is C-contiguous and OpenBLAS's small-M kernels run 2–5× faster (docs/performance.md).
INPUT_MAJOR = frozenset({"router"})


@dataclass(frozen=True, eq=False)
class DenseSpec:
    """How one dense tensor is built. ``kind``: "stored", "float", "unpermute" (llama.cpp's q/k row
    order undone; ``heads`` given), "unrepeat" (KV heads our export repeated ``heads`` times for
    llama.cpp: the first copy of each kept) or "kv_b" (MLA's kv_b rebuilt from attn_k_b + attn_v_b)."""

    name: str  # canonical key: "embed", "layers.3.q", …
    refs: tuple[TensorRef, ...]
    kind: str = "float"
    heads: int = 0
    shape: tuple[int, ...] = ()  # the built tensor's shape (kv_b's differs from its parts')
    head_dim: int = 0  # "unrepeat": rows per head

    @property
    def keeps_stored(self) -> bool:
        ref = self.refs[0]
        return self.kind in ("stored", "unpermute", "unrepeat") and len(ref.shape) == 2 \
            and kernel_type(ref.dtype, ref.shape[1])

    def resident_bytes(self, direct: bool = True) -> int:
        from ..offload.reader import span_cost

        ref = self.refs[0]
        if self.keeps_stored:  # the read buffer is kept (a row selection makes an exact copy)
            if self.kind == "stored":
                return span_cost(ref.offset, ref.nbytes, direct)
            return ref.nbytes // (self.heads if self.kind == "unrepeat" else 1)
        return 4 * int(np.prod(self.shape or ref.shape, dtype=np.int64))


def unrepeat_rows(rows: int, repeat: int, head_dim: int) -> np.ndarray:
    """Rows of the first copy of each repeated KV head ([heads · D] → [kv_heads · D])."""
    return np.arange(rows).reshape(-1, repeat, head_dim)[:, 0].reshape(-1)


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (interleaved RoPE → rotate-half)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def build(spec: DenseSpec, read) -> StoredMatrix | np.ndarray:
    """The tensor in memory; ``read(ref)`` returns its raw bytes (uint8, owning its buffer)."""
    raws = [read(ref) for ref in spec.refs]
    ref = spec.refs[0]
    where = f"{ref.path}: tensor {ref.name}"
    if spec.kind == "kv_b":
        (k_ref, v_ref), (k_raw, v_raw) = spec.refs, raws
        k_b = decode_array(k_ref.dtype, k_ref.shape, k_raw, where)  # [nh, r, dn]
        v_b = decode_array(v_ref.dtype, v_ref.shape, v_raw, where)  # [nh, dv, r]
        r = k_b.shape[1]
        return np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, r))
    order = None
    if spec.kind == "unpermute":
        order = unpermute_rows(ref.shape[0], spec.heads)
    elif spec.kind == "unrepeat":  # rows per head: the kept shape's first axis over the KV heads
        order = unrepeat_rows(ref.shape[0], spec.heads, spec.head_dim)
    if spec.keeps_stored:
        w = StoredMatrix(raws[0], ref.dtype, tuple(ref.shape))
        return w if order is None else w.rows(order)
    w = decode_array(ref.dtype, ref.shape, raws[0], where)
    if order is not None:
        w = w[order]
    if spec.kind in ("stored", "unpermute") or (spec.kind == "unrepeat" and w.ndim == 2):  # no kernel: F32
        return StoredMatrix.from_float(w)
    w = np.ascontiguousarray(w, dtype=np.float32)
    return np.asfortranarray(w) if spec.name.rsplit(".", 1)[-1] in INPUT_MAJOR else w


def resident_bytes(specs: dict[str, DenseSpec], direct: bool = True) -> int:
    """Bytes the dense part holds once loaded (a tied head is the embedding: counted once)."""
    unique = {id(s): s for s in specs.values()}
    return sum(s.resident_bytes(direct) for s in unique.values())


def largest(specs: dict[str, DenseSpec]) -> int:
    """The most bytes one tensor's load holds at once beyond what it keeps (a row permutation or a
    decode holds the read buffer and the result together): workspace while loading."""
    return max((s.refs[0].nbytes for s in specs.values()), default=0)


def load(specs: dict[str, DenseSpec], reader) -> dict[str, StoredMatrix | np.ndarray]:
    """Read and build every tensor; a tied head shares the embedding's object. A layer's q, k and
    v projections of one type are joined into one matrix, ``layers.L.qkv`` (one kernel call per
    layer instead of three); the three names stay as views of its rows."""
    built: dict[int, object] = {}
    out = {}
    for name, spec in specs.items():
        if id(spec) not in built:
            built[id(spec)] = build(spec, lambda ref: reader.read(ref.path, ref.offset, ref.nbytes,
                                                                  f"tensor {ref.name}"))
        out[name] = built[id(spec)]
        if name.endswith(".v"):
            _join_qkv(out, name[:-1])
    return out


def _join_qkv(out: dict, prefix: str) -> None:
    parts = [out.get(prefix + n) for n in ("q", "k", "v")]
    if not all(isinstance(m, StoredMatrix) for m in parts) or len({(m.dtype, m.shape[1]) for m in parts}) > 1:
        return
    joined = np.empty(sum(m.nbytes for m in parts), dtype=np.uint8)  # the three buffers are freed after
    at = 0
    for name, m in zip("qkv", parts):
        joined[at:at + m.nbytes] = m.data
        out[prefix + name] = StoredMatrix(joined[at:at + m.nbytes], m.dtype, m.shape)
        at += m.nbytes
    out[prefix + "qkv"] = StoredMatrix(joined, parts[0].dtype, (sum(m.shape[0] for m in parts), parts[0].shape[1]))
    biases = [out.get(prefix + n + "_bias") for n in ("q", "k", "v")]
    if all(b is not None for b in biases):
        out[prefix + "qkv_bias"] = np.concatenate(biases)
