"""A machine-speed probe: one fixed reference pass that `profile` and `validate` both time.

Validate's passes are predicted by constants `profile` measured earlier. When they come out slower,
either the machine got slower in between (drift) or the cost model misses a cost real passes pay
(model error). One ratio cannot tell them apart; a second can. Both commands build the same pass
(fixed token ids after a fixed context, three in four of the experts it needs resident, on the run's own
engine, cache and budget) and replay copies of it in the same interleaved rounds as their own
passes, so it is measured as they are. Its time in validate over its time in profile is how much
the machine moved. A bias is called drift only where the probe moved by as much
(docs/performance/calibration.md, "Drift or model error: the speed probe").
"""

from __future__ import annotations

import copy

import numpy as np

from s2moe.runtime.model.routing import TARGET

from .replay import CapturedPass, WeightPool, restore

CONTEXT = 24  # tokens before the pass (their KV is attended to, as a verification's prefix is)
TOKENS = 4  # the pass's batch: a typical verification
COPIES = 8  # copies replayed among the other passes: the probe's time is the median of their fastest
MIN_DRIFT = 0.05  # the probe must move by more than this (and more than 3 standard errors) to be drift


def probe_ids(vocab_size: int) -> list[int]:
    """The same token ids for every model of a vocabulary: the context, then the pass."""
    return [(97 * i + 13) % vocab_size for i in range(CONTEXT + TOKENS)]


def reference_passes(model, pool: WeightPool, copies: int = COPIES) -> list[CapturedPass]:
    """``copies`` captures of the reference pass on ``model`` (its cache's budget, pinned experts
    and store), three in four of the non-pinned experts it needs resident, so it computes and reads."""
    cache = model.experts
    ids = probe_ids(model.config.vocab_size)
    ctx, batch = ids[:CONTEXT], ids[CONTEXT:]
    kv = model.new_cache(len(ids))
    with cache.in_phase("probe-setup"):
        model.forward(ctx, kv, logits="last", record=False)
        kv.commit(len(ctx))
        cache.clear()
        _, rec = model.forward(batch, kv, start=len(ctx), logits="last")
        needed = sorted(k for k in rec.unique_experts() if k not in cache.pinned)
        wanted = [k for i, k in enumerate(needed) if i % 4]  # one in four left to read, as decoding's passes miss
        cache.clear()
        by_layer: dict[int, list[int]] = {}
        for L, e in wanted:
            by_layer.setdefault(L, []).append(e)
        for L, experts in sorted(by_layer.items()):
            cache.get(L, experts)
    resident = frozenset(k for k in cache.held if k not in cache.pinned)  # what the budget kept
    for key in resident:
        pool.offer(key, cache.held[key])
    policy_state = _policy_state(cache)
    kwargs = {"logits": "all", "record": False, "policy": TARGET}
    first = CapturedPass(model, batch, len(ctx), kv, resident, 0, 0, kwargs, policy_state=policy_state)
    restore(cache, first, pool)  # the counts a replay must reproduce: one untimed run from the state
    stats = cache.stats["probe-setup"]
    misses, hits = stats.misses, stats.hits
    scratch = model.new_cache(len(ids))
    scratch.copy_prefix(kv, len(ctx))
    with cache.in_phase("probe-setup"):
        model.forward(batch, scratch, start=len(ctx), **kwargs)
    n_missing, n_resident = stats.misses - misses, stats.hits - hits
    cache.clear()
    return [CapturedPass(model, batch, len(ctx), kv, resident, n_missing, n_resident, kwargs,
                         policy_state=copy.deepcopy(policy_state)) for _ in range(copies)]


def _policy_state(cache):
    return copy.deepcopy(cache.policy) if cache.capacity is not None else None


def summarize(passes: list[CapturedPass]) -> dict | None:
    """The probe's time (median over copies of each copy's fastest replay) and its relative
    standard error (from the copies' spread); None without replays."""
    best = np.array([p.seconds for p in passes if p.times])
    if not best.size:
        return None
    median = float(np.median(best))
    # the median's standard error from a robust spread (1.4826 · MAD estimates σ)
    sigma = 1.4826 * float(np.median(np.abs(best - median)))
    se = 1.2533 * sigma / np.sqrt(best.size) / median
    return {"ms": round(median * 1e3, 5), "se_percent": round(se * 100, 3), "copies": int(best.size),
            "n_missing": passes[0].n_missing, "n_resident": passes[0].n_resident, "tokens": TOKENS}


def compare(at_profile: dict | None, now: dict | None, fit_ratio: float) -> dict:
    """The probe's ratio (now / at profile), whether it saw drift, and what the bias is called.

    ``fit_ratio``: validate's median measured / predicted. ``drift``: the probe moved by more than
    its noise (3 standard errors) and ``MIN_DRIFT``. ``verdict``: "agrees" where the fit is off by
    no more than that threshold; otherwise "drift" where the probe's ratio explains the fit's to
    within it, else "model error"; "unknown" without a probe."""
    if not at_profile or not now:
        return {"ratio": None, "drift": None, "verdict": "unknown", "fit_ratio": round(fit_ratio, 4),
                "profile_ms": (at_profile or {}).get("ms"), "validate_ms": (now or {}).get("ms")}
    ratio = now["ms"] / at_profile["ms"]
    noise = float(np.hypot(at_profile["se_percent"], now["se_percent"])) / 100
    threshold = max(MIN_DRIFT, 3 * noise)
    def beyond(r: float) -> bool:
        return abs(np.log(r)) > np.log1p(threshold)

    drift = beyond(ratio)
    unexplained = fit_ratio / ratio
    verdict = "agrees" if not beyond(fit_ratio) else ("model error" if beyond(unexplained) else "drift")
    return {"ratio": round(ratio, 4), "drift": bool(drift), "threshold_percent": round(threshold * 100, 2),
            "verdict": verdict, "fit_ratio": round(fit_ratio, 4), "unexplained_ratio": round(unexplained, 4),
            "profile_ms": at_profile["ms"], "validate_ms": now["ms"]}
