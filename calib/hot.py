"""Hot experts: which experts to pin for a budget, and whether pinning beats a dynamic cache.

Counts come from routing on a profiling split; the resident set is filled by frequency per byte.
On a held-out split we compare three strategies by hit rate: a static set filling the whole
expert budget, a dynamic cache (LRU / decayed LFU) with nothing pinned, and a hybrid (half pinned,
half dynamic). A static list can lose to a cache that follows the text; we say which wins.
"""

from __future__ import annotations

from collections import Counter

from s2moe.runtime.offload.cache import ExpertCache

Trace = list[list[tuple[int, list[int]]]]  # per token: [(layer, experts)]


def activation_counts(trace: Trace) -> Counter:
    counts: Counter = Counter()
    for token in trace:
        for L, experts in token:
            counts.update((L, e) for e in experts)
    return counts


def choose_hot(counts: Counter, sizes: dict, capacity: int, candidates=None) -> list[tuple[int, int]]:
    """Greedy by activations per byte until the capacity is full."""
    keys = candidates if candidates is not None else list(sizes)
    ranked = sorted(keys, key=lambda k: (-counts.get(k, 0) / sizes[k], k))
    chosen, used = [], 0
    for key in ranked:
        if counts.get(key, 0) == 0:
            break
        if used + sizes[key] <= capacity:
            chosen.append(key)
            used += sizes[key]
    return chosen


def coverage(trace: Trace, hot: set) -> float:
    total = hit = 0
    for token in trace:
        for L, experts in token:
            total += len(experts)
            hit += sum((L, e) in hot for e in experts)
    return hit / total if total else 0.0


class _Sized:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


class _SizesOnly:
    """A stand-in store for simulation: the cache needs only each expert's size."""

    def __init__(self, sizes: dict):
        self.sizes = sizes

    def read_many(self, layer: int, experts: list[int]) -> list[_Sized]:
        return [_Sized(self.sizes[layer, e]) for e in experts]

    def stored_bytes(self, layer: int, expert: int) -> int:
        return 0


def simulate_hit_rate(trace: Trace, sizes: dict, capacity: int, policy: str, pinned=()) -> float:
    """Hit rate of the runtime's own expert cache (policy, admission, protection) on a trace,
    without reading anything: the cache runs over a store stand-in that only knows sizes."""
    cache = ExpertCache(_SizesOnly(sizes), capacity, policy, list(pinned), sizes.__getitem__)
    with cache.in_phase("simulate"):
        for token in trace:
            for L, experts in token:
                cache.get(L, experts)
    s = cache.stats["simulate"]
    return s.hits / (s.hits + s.misses) if s.hits + s.misses else 0.0


def plan_residency(profile_trace: Trace, heldout_trace: Trace, sizes: dict, capacity: int) -> dict:
    counts = activation_counts(profile_trace)
    static = choose_hot(counts, sizes, capacity)
    hybrid = choose_hot(counts, sizes, capacity // 2)
    rates = {
        "static": coverage(heldout_trace, set(static)),
        "lru": simulate_hit_rate(heldout_trace, sizes, capacity, "lru"),
        "lfu": simulate_hit_rate(heldout_trace, sizes, capacity, "lfu"),
        "hybrid_lfu": simulate_hit_rate(heldout_trace, sizes, capacity, "lfu", hybrid),
    }
    winner = max(rates, key=rates.get)
    pinned = {"static": static, "hybrid_lfu": hybrid}.get(winner, [])
    return {
        "gpu_experts": [list(k) for k in sorted(pinned)],
        "strategy": winner,
        "heldout_hit_rates": {k: round(v, 4) for k, v in rates.items()},
        "static_coverage_heldout": round(rates["static"], 4),
        "activations_profiled": sum(counts.values()),
        "top25_share_per_layer": _top_share(counts),
    }


def _top_share(counts: Counter) -> dict:
    by_layer: dict[int, list[int]] = {}
    for (L, _), n in counts.items():
        by_layer.setdefault(L, []).append(n)
    out = {}
    for L, values in sorted(by_layer.items()):
        values.sort(reverse=True)
        k = max(1, len(values) // 4)
        out[str(L)] = round(sum(values[:k]) / max(sum(values), 1), 4)
    return out
