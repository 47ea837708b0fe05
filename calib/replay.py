"""Timing verification passes on a shared machine: capture them, then replay them in rounds.

A verification pass of the default model lasts 2–30 ms, and this class of machine (a shared VM)
changes speed by up to 70 % in bursts of a few hundred milliseconds; the bursts show in CPU time
too, so they are not steal that a clock could subtract (docs/performance.md). One wall time per
pass is then mostly the burst it fell into. So a pass is first *captured* (its tokens, positions,
routing policy, the KV prefix it attends to and the non-pinned experts resident before it) and
later *replayed* R times in rounds. Each round restores every pass's cache state and KV prefix
outside the timer and runs all passes in a shuffled order, so the repetitions of one pass are
seconds apart. The estimate is the fastest repetition, timeit's rule: slower repetitions measure
interference, not the pass. The replacement policy's state is restored too (under a budget, a
fetch in one layer can evict what a later layer of the same pass needs). A replay must miss and
hit exactly the experts the original did; one that does not is a bug and raises.
"""

from __future__ import annotations

import copy
import gc
import random
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from s2moe.runtime.kernels.stored import StoredMatrix
from s2moe.runtime.offload.experts import ExpertWeights
from s2moe.runtime.model.kv_cache import KVCache
from s2moe.runtime.model.forward import MoEModel

Key = tuple[int, int]
DEFAULT_ROUNDS = 9
# Replays reuse the resident experts' decoded weights instead of reading them again for every
# restore; beyond this many bytes of references they are read from the store instead.
POOL_LIMIT_BYTES = 1 << 30


@dataclass
class CapturedPass:
    model: MoEModel  # replays run on it, from its expert cache
    tokens: list[int]
    start: int  # the pass writes KV slots [start, start + len(tokens)) and attends to [0, start)
    kv: KVCache  # holds the committed prefix [0, start); never written by replays
    resident: frozenset  # non-pinned experts resident before the pass
    n_missing: int
    n_resident: int  # cache hits (pinned experts included)
    forward_kwargs: dict = field(default_factory=dict)  # policy, positions, tree_mask, logits
    single_seconds: float | None = None  # the original pass's own wall time (decode passes only)
    policy_state: object = None  # the replacement policy before the pass: its evictions decide misses too
    times: list[float] = field(default_factory=list)  # replay times in round order (CUDA events on a device)
    unbudgeted: bool = False  # replayed with the cache's budget lifted (the speed probe's compute pass)

    @property
    def seconds(self) -> float:
        return min(self.times)

    def sample(self) -> dict:
        """One row of the profile's samples file and the cost model's input."""
        row = {"n_tokens": len(self.tokens), "n_missing": self.n_missing, "n_resident": self.n_resident,
               "seconds": self.seconds, "repeats": [round(t, 7) for t in self.times]}
        if self.single_seconds is not None:
            row["single_seconds"] = self.single_seconds
        return row


class WeightPool:
    """Decoded weights of experts some captured pass had resident (shared, bounded), each a copy in
    the pool's own memory (`detached`).

    Why copies: a host expert is a view of the store's read buffer, and that buffer goes back to the
    store's `BufferPool` only when the last view dies. Kept here, thousands of them stayed checked
    out, the store's pool sat past its limit, and every read of every replay mapped a fresh buffer
    and faulted its pages in, which a run (whose pool holds only what its cache holds) never does:
    validate's replays made 11,760 fresh maps to 126 reuses and ran 1.18x (default model, 25 %)
    to 1.78x (widened model) the fit, whose passes had mostly borrowed another store's buffers
    (docs/performance/calibration.md, "The term: replays that read into fresh buffers")."""

    def __init__(self, limit_bytes: int = POOL_LIMIT_BYTES):
        self.weights: dict[Key, ExpertWeights] = {}
        self.limit = limit_bytes
        self.nbytes = 0

    def offer(self, key: Key, w: ExpertWeights) -> None:
        if key not in self.weights and self.nbytes + w.nbytes <= self.limit:
            self.weights[key] = detached(w)
            self.nbytes += w.nbytes


def _own(part):
    if isinstance(part, StoredMatrix):
        return StoredMatrix.checked_before(part.data.copy(), part.dtype, part.shape)
    return part.copy() if isinstance(part, np.ndarray) else part


def detached(w: ExpertWeights) -> ExpertWeights:
    """``w`` with its host parts copied into memory of their own (no read buffer stays checked
    out); device parts (CuPy arrays, no read buffers) as they are. The kernels' cached view goes:
    it points at the old parts, and is rebuilt on first use, outside the fastest replay. Page-locked
    parts (the host tier's staging copies, not read buffers) stay as they are: a copy would not be
    page-locked."""
    if w.pinned:
        return w
    parts = {name: _own(getattr(w, name)) for name in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")}
    return replace(w, **parts, kernel_args=None)


@contextmanager
def capture_passes(model: MoEModel, phase: str, pool: WeightPool) -> Iterator[list[CapturedPass]]:
    """Record every forward pass the model runs while its cache is in ``phase`` (e.g. "verify"
    during real S²-MoE decoding). The decoding itself is unchanged."""
    cache = model.experts
    original = model.forward
    captured: list[CapturedPass] = []

    def forward(tokens, kv, start=None, **kwargs):
        if cache.phase != phase:
            return original(tokens, kv, start=start, **kwargs)
        start = kv.filled if start is None else start
        if cache.prefetching:  # routing may lean on reads in flight, which a replay cannot restore
            raise RuntimeError(f"capture_passes: {cache.prefetching} prefetches in flight at a {phase} pass; "
                               "capture with the cache's prefetch_slots = 0")
        resident = frozenset(k for k in cache.held if k not in cache.pinned)
        policy_state = copy.deepcopy(cache.policy) if cache.capacity is not None else None
        for key in resident:
            pool.offer(key, cache.held[key])
        stats = cache.stats[phase]
        misses, hits = stats.misses, stats.hits
        with model.backend.timed() as took:
            out = original(tokens, kv, start=start, **kwargs)
        p = CapturedPass(model, [int(t) for t in tokens], start, kv, resident, stats.misses - misses, stats.hits - hits,
                         dict(kwargs), took[0], policy_state=policy_state)
        captured.append(p)
        return out

    model.forward = forward  # an instance attribute shadows the method for this model only
    try:
        yield captured
    finally:
        del model.forward


@contextmanager
def budget_lifted(cache, lifted: bool = True):
    """The cache with no budget inside the block (when ``lifted``); the caller empties it of what
    the budget cannot hold before the block ends."""
    saved = cache.capacity
    if lifted:
        cache.capacity = None
    try:
        yield cache
    finally:
        cache.capacity = saved


def restore(cache, p: CapturedPass, pool: WeightPool) -> None:
    """The cache as it was before ``p``: pinned experts plus ``p.resident``, nothing read if pooled."""
    cache.clear()
    unpooled: dict[int, list[int]] = {}
    for key in sorted(p.resident):
        w = pool.weights.get(key)
        if w is None:
            unpooled.setdefault(key[0], []).append(key[1])
        else:
            cache.hold(key, w)
    with cache.in_phase("replay-setup"):
        for layer, experts in unpooled.items():
            cache.get(layer, experts)
    if p.policy_state is not None:  # a fetch in layer 0 may evict what layer 2 needs: same counts, same victims
        cache.policy = copy.deepcopy(p.policy_state)


def replay(passes: list[CapturedPass], pool: WeightPool, rounds: int = DEFAULT_ROUNDS,
           tick: Callable[[], None] = lambda: None, seed: int = 0,
           groups: list[list[CapturedPass]] = ()) -> list[CapturedPass]:
    """Time every pass ``rounds`` times, rounds interleaved; fills ``p.times``. One tick per replay.

    ``groups``: more passes timed in the same rounds, each group in a block of its own, shuffled
    within (a round runs ``passes``, then each group). Passes of another model or cache (profile's
    controlled passes) go there: timed in the same rounds, a drift of the machine's speed biases no
    group, and in blocks, one model's passes do not run between the other's, whose weights they
    would push out of the CPU's caches (mixed in, the decode passes ran 3-7 % slower in two runs, a
    cost no run pays: docs/performance/calibration.md)."""
    blocks = [list(g) for g in (passes, *groups) if g]
    if not blocks:
        return passes
    everything = [p for block in blocks for p in block]
    capacity = max(p.start + len(p.tokens) for p in everything)
    scratches: dict = {}  # replays write here, never into a captured KV; one per cache type
    rng = random.Random(seed)
    for _ in range(rounds):
        order = []
        for block in blocks:
            shuffled = list(block)
            rng.shuffle(shuffled)
            order += shuffled
        for p in order:
            cache = p.model.experts
            with budget_lifted(cache, p.unbudgeted):
                restore(cache, p, pool)
                kind = p.kv.cache_type
                if kind not in scratches:
                    scratches[kind] = KVCache.for_config(p.model.config, capacity, p.model.backend.xp, kind)
                scratch = scratches[kind]
                scratch.copy_prefix(p.kv, p.start)
                stats = cache.stats["replay"]
                misses, hits = stats.misses, stats.hits
                with cache.in_phase("replay"):
                    gc.disable()  # a collection inside a 3 ms pass is a 10 % error
                    try:
                        with p.model.backend.timed() as took:
                            p.model.forward(p.tokens, scratch, start=p.start, **p.forward_kwargs)
                        p.times.append(took[0])
                    finally:
                        gc.enable()
                if p.unbudgeted:
                    cache.clear()  # back within the budget before it returns
            if (stats.misses - misses, stats.hits - hits) != (p.n_missing, p.n_resident):
                raise RuntimeError(f"replay of a {len(p.tokens)}-token pass missed/hit {stats.misses - misses}/"
                                   f"{stats.hits - hits} experts, the original {p.n_missing}/{p.n_resident}")
            tick()
    for cache in {id(p.model.experts): p.model.experts for p in everything}.values():
        cache.clear()
    return passes


def single_shot_samples(passes: list[CapturedPass]) -> list[dict]:
    """The original wall times, for reporting next to the replay estimate."""
    return [{"n_tokens": len(p.tokens), "n_missing": p.n_missing, "n_resident": p.n_resident,
             "seconds": p.single_seconds} for p in passes if p.single_seconds is not None]


def spread(passes: list[CapturedPass]) -> dict:
    """How much repetitions of one pass differ: the machine's noise, and the best fit it allows.

    ``noise_ceiling_r2``: the R² a perfect cost model would score against these estimates. Each
    pass's replays are split into two halves (odd and even rounds); the fastest of each half are two
    independent estimates of the same pass, so half the variance of their difference is the noise
    variance of one estimate, and 1 − noise variance / variance of the passes' times is the ceiling.
    Half-size estimates are noisier than the fastest of all rounds, so the ceiling is conservative.
    ``noise_mape_floor_percent``: the same noise as a mean absolute percentage (a perfect model's MAPE)."""
    cv = [float(np.std(p.times) / np.mean(p.times)) for p in passes if len(p.times) > 1]
    out = {"rounds": len(passes[0].times) if passes else 0,
           "repeat_cv_median": round(float(np.median(cv)), 4) if cv else None,
           "noise_ceiling_r2": None, "noise_mape_floor_percent": None}
    halves = [(min(p.times[0::2]), min(p.times[1::2]), min(p.times)) for p in passes if len(p.times) >= 2]
    if len(halves) >= 3:
        a, b, y = (np.array(v) for v in zip(*halves))
        noise_var = float(np.var(a - b)) / 2.0
        total_var = float(np.var(y))
        if total_var > 0:
            out["noise_ceiling_r2"] = round(max(0.0, 1.0 - noise_var / total_var), 4)
        # |e| of a normal error is sqrt(2/π)·σ on average
        out["noise_mape_floor_percent"] = round(float(np.mean(np.sqrt(2 / np.pi) * np.sqrt(noise_var) / y)) * 100, 3)
    return out
