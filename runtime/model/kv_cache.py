"""A preallocated KV cache with a committed length and O(1), exact rollback.

Two integers describe it: ``length`` (committed: target-computed, accepted positions) and
``filled`` (positions holding valid data, committed or not). Draft passes write past ``length``;
``rollback(length)`` drops them by moving ``filled`` back, without touching memory. A pass may only
start at or before ``filled`` (no gaps), so keys a query attends to are always valid.

Keys and values may differ in width: multi-head latent attention (DeepSeek) caches one "head"
whose key is the compressed latent c_kv and whose value is the shared RoPE key k_pe
(`ModelConfig.kv_shape`), from which every head's keys and values are re-derived.
"""

from __future__ import annotations

import numpy as np

from ..errors import KVCacheError


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype=np.float32,
                 value_dim: int | None = None, xp=np):
        if capacity <= 0:
            raise KVCacheError(f"KV cache capacity must be positive (got {capacity})")
        self.capacity = capacity
        value_dim = head_dim if value_dim is None else value_dim
        # [kv_heads, positions, head_dim] per layer: one head's keys are contiguous for attention.
        self.keys = [xp.zeros((num_kv_heads, capacity, head_dim), dtype) for _ in range(num_layers)]
        self.values = [xp.zeros((num_kv_heads, capacity, value_dim), dtype) for _ in range(num_layers)]
        self.length = 0
        self.filled = 0

    @classmethod
    def for_config(cls, config, capacity: int, xp=np) -> "KVCache":
        heads, key_dim, value_dim = config.kv_shape
        return cls(config.num_layers, heads, key_dim, capacity, value_dim=value_dim, xp=xp)

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
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v

    def view(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def copy_prefix(self, other: "KVCache", n: int) -> None:
        """Hold ``other``'s positions [0, n), committed (calibration replays a pass from its context)."""
        if not 0 <= n <= min(other.filled, self.capacity):
            raise KVCacheError(f"cannot copy {n} positions: source holds {other.filled}, capacity {self.capacity}")
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
        for dst, src in zip(self.keys + self.values, other.keys + other.values):
            dst[:, :upto] = src[:, :upto]
        self.filled = self.length = upto
