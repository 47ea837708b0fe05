"""A preallocated KV cache with a committed length and O(1), exact rollback.

Two integers describe it: ``length`` (committed: target-computed, accepted positions) and
``filled`` (positions holding valid data, committed or not). Draft passes write past ``length``;
``rollback(length)`` drops them by moving ``filled`` back, without touching memory. A pass may only
start at or before ``filled`` (no gaps), so keys a query attends to are always valid.

Keys and values may differ in width: multi-head latent attention (DeepSeek) caches one "head"
whose key is the compressed latent c_kv and whose value is the shared RoPE key k_pe
(`ModelConfig.kv_shape`), from which every head's keys and values are re-derived.

Cache types (``--cache-type``), as llama.cpp's ``--cache-type-k/v``: ``f32``; ``f16`` (the
default of runs, half the bytes); ``q8_0`` (llama.cpp's block of 32: an f16 scale and 32 int8
values, 34 bytes, ~0.27 of f32). Positions are rounded once, when written; every later pass reads
the same rounded values, so greedy speculation still equals AR. ``keys``/``values`` hold the
stored form ([heads, positions, width] for f32/f16, [heads, positions, 34 bytes per block] for
q8_0); `view` returns float32.
"""

from __future__ import annotations

import numpy as np

from ..errors import KVCacheError, UsageError

CACHE_TYPES = ("f32", "f16", "q8_0")
Q8_BLOCK, Q8_BYTES = 32, 34  # values per block; bytes per block (f16 scale + 32 int8)


def row_bytes(cache_type: str, width: int) -> int:
    """Bytes one head's key (or value) of ``width`` values takes at one position."""
    if cache_type == "f32":
        return 4 * width
    if cache_type == "f16":
        return 2 * width
    if cache_type == "q8_0":
        return width // Q8_BLOCK * Q8_BYTES
    raise UsageError(f"--cache-type {cache_type!r}: choose from {', '.join(CACHE_TYPES)}")


def check_cache_type(cache_type: str, config) -> str:
    """``cache_type`` if this model's cached widths can hold it; else a one-line error."""
    heads, kd, vd = config.kv_shape
    row_bytes(cache_type, kd)  # names the choices for an unknown type
    if cache_type == "q8_0" and (kd % Q8_BLOCK or vd % Q8_BLOCK):
        raise UsageError(f"--cache-type q8_0 needs cached widths that are multiples of {Q8_BLOCK} (this model's "
                         f"keys are {kd} and values {vd} wide); use --cache-type f16")
    return cache_type


def resolve_cache_type(cache_type: str | None, config) -> str:
    """``--cache-type`` as a run uses it (auto: f16, on the host and on a device, whose attention
    kernels read it), checked against the model's widths."""
    chosen = "f16" if cache_type in (None, "auto") else cache_type
    return check_cache_type(chosen, config)


def kv_bytes_per_position(config, cache_type: str = "f32") -> int:
    """What one position costs across all layers: the memory plan's KV term per position."""
    heads, kd, vd = config.kv_shape
    return config.num_layers * heads * (row_bytes(cache_type, kd) + row_bytes(cache_type, vd))


def _round_away(xp, a):
    """roundf: halves away from zero (ggml's reference quantiser, and `gguf.quants`)."""
    return xp.sign(a) * xp.floor(xp.abs(a) + xp.float32(0.5))


def q8_0_encode(x, xp=np):
    """float32 [..., width] → uint8 [..., width/32 · 34]: ggml's block_q8_0, bit for bit
    (d = amax/127 in float32, q = roundf(x/d) through 1/d, d stored as f16)."""
    x = xp.asarray(x, dtype=xp.float32)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // Q8_BLOCK, Q8_BLOCK))
    d = xp.abs(blocks).max(axis=-1, keepdims=True) / xp.float32(127)
    inv = xp.where(d == 0, xp.float32(0), xp.float32(1) / xp.where(d == 0, xp.float32(1), d))
    q = _round_away(xp, blocks * inv).astype(xp.int8)
    out = xp.empty(blocks.shape[:-1] + (Q8_BYTES,), xp.uint8)
    out[..., :2] = d.astype(xp.float16).view(xp.uint8)
    out[..., 2:] = q.view(xp.uint8)
    return out.reshape(x.shape[:-1] + (-1,))


def q8_0_decode(raw, xp=np):
    """uint8 [..., blocks · 34] → float32 [..., blocks · 32]."""
    blocks = raw.reshape(raw.shape[:-1] + (raw.shape[-1] // Q8_BYTES, Q8_BYTES))
    d = xp.ascontiguousarray(blocks[..., :2]).view(xp.float16).astype(xp.float32)
    q = xp.ascontiguousarray(blocks[..., 2:]).view(xp.int8).astype(xp.float32)
    return (d * q).reshape(raw.shape[:-1] + (-1,))


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, cache_type: str = "f32",
                 value_dim: int | None = None, xp=np):
        if capacity <= 0:
            raise KVCacheError(f"KV cache capacity must be positive (got {capacity})")
        self.capacity = capacity
        self.cache_type = cache_type
        self.xp = xp
        value_dim = head_dim if value_dim is None else value_dim
        self.key_dim, self.value_dim = head_dim, value_dim
        if cache_type == "q8_0" and (head_dim % Q8_BLOCK or value_dim % Q8_BLOCK):
            raise KVCacheError(f"a q8_0 KV cache needs widths that are multiples of {Q8_BLOCK} "
                               f"(got {head_dim} and {value_dim})")
        kd, vd = head_dim, value_dim
        if cache_type == "q8_0":  # a row of blocks: bytes
            kd, vd = row_bytes("q8_0", kd), row_bytes("q8_0", vd)
        if cache_type not in CACHE_TYPES:
            row_bytes(cache_type, 0)  # raises, naming the types
        dtype = {"f32": np.float32, "f16": np.float16, "q8_0": np.uint8}[cache_type]
        # [kv_heads, positions, width] per layer: one head's keys are contiguous for attention.
        self.keys = [xp.zeros((num_kv_heads, capacity, kd), dtype) for _ in range(num_layers)]
        self.values = [xp.zeros((num_kv_heads, capacity, vd), dtype) for _ in range(num_layers)]
        self.length = 0
        self.filled = 0

    @classmethod
    def for_config(cls, config, capacity: int, xp=np, cache_type: str = "f32") -> "KVCache":
        heads, key_dim, value_dim = config.kv_shape
        return cls(config.num_layers, heads, key_dim, capacity, cache_type=cache_type, value_dim=value_dim, xp=xp)

    def encode(self, x):
        """float32 rows → the stored form (rounded as every pass will read them)."""
        if self.cache_type == "f32":
            return x
        if self.cache_type == "f16":
            return x.astype(self.xp.float16)
        return q8_0_encode(x, self.xp)

    def decode(self, raw):
        """The stored form → float32."""
        if self.cache_type == "f32":
            return raw
        if self.cache_type == "f16":
            return raw.astype(self.xp.float32)
        return q8_0_decode(raw, self.xp)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def begin_write(self, start: int, count: int) -> None:
        """Called by the forward pass before writing positions [start, start + count)."""
        if not 0 <= start <= self.filled:
            raise KVCacheError(f"KV write at position {start} leaves a gap (valid positions end at {self.filled})")
        if start + count > self.capacity:
            raise KVCacheError(
                f"KV cache full: positions up to {start + count} requested, capacity {self.capacity}; "
                "lower --max-tokens or the prompt length"
            )
        # Anything after this pass is stale once we overwrite from `start`.
        self.filled = start + count
        self.length = min(self.length, start)

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v: [kv_heads, count, key / value width]."""
        end = start + k.shape[1]
        self.keys[layer][:, start:end] = self.encode(k)
        self.values[layer][:, start:end] = self.encode(v)

    def view(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 keys and values of positions [0, end) (a view for f32, decoded otherwise)."""
        return self.decode(self.keys[layer][:, :end]), self.decode(self.values[layer][:, :end])

    def copy_prefix(self, other: "KVCache", n: int) -> None:
        """Hold ``other``'s positions [0, n), committed (calibration replays a pass from its context)."""
        if not 0 <= n <= min(other.filled, self.capacity):
            raise KVCacheError(f"cannot copy {n} positions: source holds {other.filled}, capacity {self.capacity}")
        self._same_type(other)
        for dst, src in zip(self.keys + self.values, other.keys + other.values):
            dst[:, :n] = src[:, :n]
        self.filled = self.length = n

    def commit(self, upto: int) -> None:
        """Mark positions [0, upto) as committed (they must have been written)."""
        if not self.length <= upto <= self.filled:
            raise KVCacheError(f"cannot commit to {upto}: committed {self.length}, valid up to {self.filled}")
        self.length = upto

    def rollback(self, to: int) -> int:
        """Drop every position >= ``to`` (committed or draft). O(1). Returns how many were dropped."""
        if not 0 <= to <= self.filled:
            raise KVCacheError(f"cannot roll back to {to}: valid positions are 0..{self.filled}")
        dropped = self.filled - to
        self.filled = to
        self.length = min(self.length, to)
        return dropped

    def trim(self, n: int) -> int:
        """Remove the last ``n`` valid positions (mlx-lm's spelling); returns ``n`` or raises."""
        if not 0 <= n <= self.filled:
            raise KVCacheError(f"cannot trim {n} positions from a cache holding {self.filled}")
        return self.rollback(self.filled - n)

    def keep(self, slots, at: int) -> None:
        """Move the KV of ``slots`` (an accepted tree branch) to positions [at, at + len(slots)).

        Slots only move backwards (a branch's slots lie at or after its positions), and the moved
        range becomes the valid end of the cache.
        """
        slots = list(slots)
        if any(s < at + i for i, s in enumerate(slots)) or (slots and max(slots) >= self.filled):
            raise KVCacheError(f"cannot move slots {slots} to {at}: slots must lie in [{at}, {self.filled})")
        if slots != list(range(at, at + len(slots))):
            for arrays in (self.keys, self.values):
                for a in arrays:
                    a[:, at:at + len(slots)] = a[:, slots]  # fancy indexing copies first: overlap-safe
        self.rollback(at + len(slots))

    def discard_uncommitted(self) -> int:
        return self.rollback(self.length)

    def copy_prefix_from(self, other: "KVCache", upto: int) -> None:
        """Copy committed positions [0, upto) from another cache (a draft's private cache syncs this way)."""
        self._same_type(other)
        for dst, src in zip(self.keys + self.values, other.keys + other.values):
            dst[:, :upto] = src[:, :upto]
        self.filled = self.length = upto

    def _same_type(self, other: "KVCache") -> None:
        if other.cache_type != self.cache_type:
            raise KVCacheError(f"cannot copy a {other.cache_type} KV cache into a {self.cache_type} one")
