"""A machine-speed probe: two fixed reference passes that `profile` and `validate` both time.

Validate's passes are predicted by constants `profile` measured earlier. When they come out slower,
either the machine got slower in between (drift) or the cost model misses a cost real passes pay
(model error). One ratio cannot tell them apart; the probe's can. Both commands build the same two
passes on the run's own engine, cache and store (fixed token ids after a fixed context): one with
every expert it needs resident, the budget lifted for it ("compute"), one with none ("reads"). Copies of each are replayed
in the same interleaved rounds as the commands' own passes, so they are measured as those are.

Compute and the slow tier drift apart (a busy neighbour slows the one, a busy disk the other: a
single mixed probe moved 17 % while 10 %-budget passes moved 8 %), so each validate pass expects
the drift of its own mix: the compute probe's ratio moved toward the reads probe's by the share of
its predicted time that is misses. A bias is called drift only where that expectation moved the
same way by at least half as much and explains it to within the threshold
(docs/performance/calibration.md, "Drift or model error: the speed probe").
"""

from __future__ import annotations

import copy

import numpy as np

from s2moe.runtime.decoding.cost_model import FEATURES, VerificationCostModel
from s2moe.runtime.model.routing import TARGET

from .replay import CapturedPass, WeightPool, budget_lifted, restore

CONTEXT = 24  # tokens before the pass (their KV is attended to, as a verification's prefix is)
TOKENS = 4  # the pass's batch: a typical verification
COPIES = 6  # copies of each probe pass replayed among the other passes
KINDS = ("compute", "reads")
MIN_DRIFT = 0.05  # a move smaller than this (or than 3 standard errors) is not drift


def probe_ids(vocab_size: int) -> list[int]:
    """The same token ids for every model of a vocabulary: the context, then the pass."""
    return [(97 * i + 13) % vocab_size for i in range(CONTEXT + TOKENS)]


def reference_passes(model, pool: WeightPool, copies: int = COPIES) -> dict[str, list[CapturedPass]]:
    """``copies`` captures of each probe pass on ``model`` (its cache, pinned experts and store):
    "compute" with every expert it needs resident (its replays lift the budget), "reads" with none
    but the pinned ones."""
    cache = model.experts
    ids = probe_ids(model.config.vocab_size)
    ctx, batch = ids[:CONTEXT], ids[CONTEXT:]
    kv = model.new_cache(len(ids))
    # a policy with no history: which of the pass's experts a budget keeps, and which it evicts
    # while the pass reads, must not follow what the command decoded before (profile and validate
    # decode different halves of the workload)
    saved, cache.policy = cache.policy, type(cache.policy)()
    try:
        return _reference_passes(model, pool, copies, ctx, batch, kv)
    finally:
        cache.policy = saved


def _reference_passes(model, pool, copies, ctx, batch, kv) -> dict[str, list[CapturedPass]]:
    cache = model.experts
    with cache.in_phase("probe-setup"):
        model.forward(ctx, kv, logits="last", record=False)
        kv.commit(len(ctx))
        cache.clear()
        _, rec = model.forward(batch, kv, start=len(ctx), logits="last")
        needed = sorted(k for k in rec.unique_experts() if k not in cache.pinned)
    out = {}
    # compute: every expert resident, the budget lifted for the pass (a small budget cannot hold a
    # whole pass's experts: at 10 % its "resident" pass read all 35); reads: none resident
    for kind, wanted in (("compute", needed), ("reads", [])):
        with budget_lifted(cache, kind == "compute"):
            cache.clear()
            with cache.in_phase("probe-setup"):
                by_layer: dict[int, list[int]] = {}
                for L, e in wanted:
                    by_layer.setdefault(L, []).append(e)
                for L, experts in sorted(by_layer.items()):
                    cache.get(L, experts)
            out[kind] = _captured(model, batch, ctx, kv, pool, copies, unbudgeted=kind == "compute")
            cache.clear()
    return out


def _captured(model, batch, ctx, kv, pool: WeightPool, copies: int, unbudgeted: bool) -> list[CapturedPass]:
    """Copies of the pass from the cache's present state, with the miss and hit counts a replay
    must reproduce (from one untimed run)."""
    cache = model.experts
    resident = frozenset(k for k in cache.held if k not in cache.pinned)  # what the budget kept
    for key in resident:
        pool.offer(key, cache.held[key])
    policy_state = copy.deepcopy(cache.policy) if cache.capacity is not None else None
    kwargs = {"logits": "all", "record": False, "policy": TARGET}
    restore(cache, CapturedPass(model, batch, len(ctx), kv, resident, 0, 0, kwargs, policy_state=policy_state), pool)
    stats = cache.stats["probe-setup"]
    misses, hits = stats.misses, stats.hits
    scratch = model.new_cache(len(ctx) + len(batch))
    scratch.copy_prefix(kv, len(ctx))
    with cache.in_phase("probe-setup"):
        model.forward(batch, scratch, start=len(ctx), **kwargs)
    counts = stats.misses - misses, stats.hits - hits
    return [CapturedPass(model, batch, len(ctx), kv, resident, *counts, kwargs,
                         policy_state=copy.deepcopy(policy_state), unbudgeted=unbudgeted) for _ in range(copies)]


def every_pass(probes: dict[str, list[CapturedPass]]) -> list[CapturedPass]:
    return [p for kind in KINDS for p in probes.get(kind, [])]


def summarize(probes: dict[str, list[CapturedPass]]) -> dict | None:
    """Per probe pass: its time (median over copies of each copy's fastest replay), relative
    standard error (from the copies' spread) and counts; None without replays."""
    out = {}
    for kind in KINDS:
        best = np.array([p.seconds for p in probes.get(kind, []) if p.times])
        if not best.size:
            return None
        median = float(np.median(best))
        sigma = 1.4826 * float(np.median(np.abs(best - median)))  # a robust σ (MAD)
        se = 1.2533 * sigma / np.sqrt(best.size) / median  # the median's standard error
        first = probes[kind][0]
        out[kind] = {"ms": round(median * 1e3, 5), "se_percent": round(se * 100, 3), "copies": int(best.size),
                     "n_tokens": len(first.tokens), "n_missing": first.n_missing, "n_resident": first.n_resident}
    return out


def _miss_share(costs, rows: list[dict]) -> np.ndarray:
    """The share of each pass's predicted time that is its misses."""
    X = np.array([[r[f] for f in FEATURES] for r in rows], dtype=np.float64)
    predicted = VerificationCostModel.from_constants(costs).predict(X)
    return costs.t_exp_miss * X[:, FEATURES.index("n_missing")] / np.maximum(predicted, 1e-12)


def expected_ratios(at_profile: dict, now: dict, costs, samples: list[dict]) -> tuple[dict, np.ndarray]:
    """Each probe's ratio (now / at profile), and per sample the drift its mix of compute and
    misses expects: the compute ratio moved toward the reads ratio by its miss share, placed
    between the two probes' own shares."""
    ratio = {kind: now[kind]["ms"] / at_profile[kind]["ms"] for kind in KINDS}
    share = dict(zip(KINDS, _miss_share(costs, [at_profile[kind] for kind in KINDS])))
    s = _miss_share(costs, samples)
    span = share["reads"] - share["compute"]
    t = np.clip((s - share["compute"]) / span, 0.0, 1.0) if span > 1e-9 else np.zeros_like(s)
    return ratio, ratio["compute"] + t * (ratio["reads"] - ratio["compute"])


def compare(at_profile: dict | None, now: dict | None, fit_ratio: float, costs=None,
            samples: list[dict] = ()) -> dict:
    """What the probe says of validate's bias. ``fit_ratio``: the median measured / predicted.

    The threshold: ``MIN_DRIFT``, or 3 standard errors of the probes where that is more.
    ``ratio``: the drift the passes expect (median over them, `expected_ratios`); ``scale``: per
    pass. ``verdict``: "agrees" where the fit is off by no more than ``MIN_DRIFT``; otherwise
    "drift" where the expected drift moved the same way by at least half as much and explains
    the fit's ratio to within the threshold, else "model error"; "unknown" without a probe on both
    sides. ``drift``: a probe moved beyond the threshold, or the drift explains the bias (then
    validate also scores the model scaled by ``scale``)."""
    if not at_profile or not now or set(at_profile) != set(now):
        return {"ratio": None, "drift": None, "verdict": "unknown", "fit_ratio": round(fit_ratio, 4),
                "at_profile": at_profile, "now": now}
    ratios, scale = expected_ratios(at_profile, now, costs, list(samples))
    ratio = float(np.median(scale))
    noise = max(float(np.hypot(at_profile[k]["se_percent"], now[k]["se_percent"])) for k in KINDS) / 100
    threshold = max(MIN_DRIFT, 3 * noise)
    tol = np.log1p(threshold)
    bias, move = np.log(fit_ratio), np.log(ratio)
    explains = abs(bias - move) <= tol and move * bias > 0 and abs(move) >= abs(bias) / 2
    verdict = "agrees" if abs(bias) <= np.log1p(MIN_DRIFT) else ("drift" if explains else "model error")
    moved = any(abs(np.log(r)) > tol for r in ratios.values())
    return {"ratio": round(ratio, 4), "compute_ratio": round(ratios["compute"], 4),
            "reads_ratio": round(ratios["reads"], 4), "drift": bool(moved or verdict == "drift"),
            "threshold_percent": round(threshold * 100, 2), "verdict": verdict, "fit_ratio": round(fit_ratio, 4),
            "unexplained_ratio": round(fit_ratio / ratio, 4), "at_profile": at_profile, "now": now,
            "scale": scale}
