"""Measurement stages of `s2moe-calib profile`, each built on the runtime's own code paths.

- `offload_bandwidth`: raw requests through the expert store (O_DIRECT, emulation as configured)
  at several sizes around the expert size, fitted as latency = a + bytes / BW.
- `controlled_passes`: verification passes over workload text with a controlled number of distinct
  experts missing from / resident in the cache, captured for `replay` to time; the cost model is
  fitted on these and on captured passes of real decoding.
- `decode_step_times`: AR decode steps at the budget (T_AR) and draft steps (C_draft).
- `routing_traces`: per-token expert choices on workload text, for the hot-expert stage.
"""

from __future__ import annotations

import os
import random
import statistics
from typing import Callable

import numpy as np

from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.model.kv_cache import KVCache
from s2moe.runtime.model.forward import MoEModel
from s2moe.runtime.decoding.gating import ReuseGating
from s2moe.runtime.model.routing import TARGET, RoutingPolicy

from .replay import CapturedPass, WeightPool

Tick = Callable[[], None]


LINE_R2 = 0.8  # below this the read times are noise around a flat line, not latency + bytes / BW


def _noop() -> None:
    pass


def offload_bandwidth(store, loaded, reps: int = 6, tick: Tick = _noop, seed: int = 0) -> dict:
    """Time raw reads at request sizes around the expert size; fit latency = a + bytes / BW."""
    expert = next(iter(loaded.experts.values()))
    path = expert.gate.path
    size = os.path.getsize(path)
    base = max(expert.stored_bytes, 64 << 10)
    sizes = sorted({max(4096, int(base * f) // 4096 * 4096) for f in (0.25, 0.5, 1, 2, 4)})
    sizes = [s for s in sizes if s < size // 2] or [4096]
    rng = random.Random(seed)
    samples = []
    for _ in range(reps):
        for nbytes in sizes:
            # random aligned offsets: repeated offsets would time the host cache, not the storage
            offset = rng.randrange(0, max(size - nbytes, 1)) // 4096 * 4096
            samples.append((nbytes, store.timed_read(path, offset, nbytes)))
            tick()
    # a host-cache miss below the virtual disk or a scheduler hiccup is one slow outlier
    return {**fit_latency_bandwidth(samples, sizes), "request_sizes": sizes, "samples": samples}


def fit_latency_bandwidth(samples: list[tuple[int, float]], sizes: list[int]) -> dict:
    """latency = a + bytes / BW over the per-size medians (one slow outlier must not tilt the line).

    The line is kept when it is one: three sizes or more, a rising slope and R² ≥ ``LINE_R2`` (real
    disks fit at 0.989–0.9998 here). Otherwise the times do not grow with the size (requests this
    small are all latency, or a busy machine's noise swamps the transfer) and the line cannot split
    the two: BW is bounded from below by the largest request, all of its time charged to the
    transfer, the latency is what the smallest takes beyond its transfer at that BW,
    ``bandwidth_is_bound`` says so and ``fit_r2`` is None (the rejected line's R² means nothing)."""
    x = np.array(sizes, dtype=np.float64)
    y = np.array([np.median([t for n, t in samples if n == size]) for size in sizes])
    if len(x) >= 3:
        slope, intercept = np.polyfit(x, y, 1)
        total = ((y - y.mean()) ** 2).sum()
        r2 = 1 - ((y - (slope * x + intercept)) ** 2).sum() / total if total > 1e-12 * (y ** 2).sum() else 0.0
        if slope > 0 and r2 >= LINE_R2:
            return {"bandwidth_mb_s": float(1 / slope / 1e6), "latency_us": float(max(intercept, 0.0) * 1e6),
                    "fit_r2": float(r2), "bandwidth_is_bound": False}
    bandwidth = x[-1] / max(y[-1], 1e-9)  # bytes/s
    return {"bandwidth_mb_s": float(bandwidth / 1e6), "latency_us": float(max(y[0] - x[0] / bandwidth, 0.0) * 1e6),
            "fit_r2": None, "bandwidth_is_bound": True}


def refit_if_old(link: dict) -> dict:
    """A link probe resumed from a samples file written before bounds were flagged: refit its
    samples, so a slope that never rose becomes a flagged bound there too."""
    if "bandwidth_is_bound" not in link:
        link.update(fit_latency_bandwidth(link["samples"], link["request_sizes"]))
    return link


def host_to_device(backend, expert_bytes: int, reps: int = 10, tick: Tick = _noop) -> dict:
    """Pinned host → device copies on the backend's copy path at sizes around the expert size,
    timed with CUDA events; fitted as latency = a + bytes / BW."""
    sizes = sorted({max(4096, int(expert_bytes * f) // 4096 * 4096) for f in (0.25, 0.5, 1, 2, 4)})
    buffers = {n: backend.pin(np.ones(n // 4, dtype=np.float32)) for n in sizes}
    buffers = {n: (src, backend.xp.empty(src.shape, src.dtype)) for n, src in buffers.items()}
    samples = []
    for _ in range(reps):
        for nbytes in sizes:
            src, dst = buffers[nbytes]
            with backend.timed() as took:
                dst.set(src)
            samples.append((nbytes, took[0]))
            tick()
    return {**fit_latency_bandwidth(samples, sizes), "request_sizes": sizes, "samples": samples}


def _contexts(token_lists: list[list[int]], context: int, batch: int) -> list[tuple[list[int], list[int]]]:
    """(context tokens, following tokens) windows cut from the workload's token streams."""
    out = []
    for ids in token_lists:
        for start in range(0, max(len(ids) - context - batch, 0) + 1, context + batch):
            ctx, nxt = ids[start:start + context], ids[start + context:start + context + batch]
            if len(ctx) == context and len(nxt) == batch:
                out.append((ctx, nxt))
    return out


def controlled_passes(model: MoEModel, token_lists: list[list[int]], max_batch: int, n_samples: int,
                      pool: WeightPool, tick: Tick = _noop, seed: int = 0, context: int = 24,
                      reuse_cap: int | None = None) -> list[CapturedPass]:
    """Target passes of 1..max_batch tokens with a chosen share of their experts resident, captured
    for `replay.replay` to time (no budget: the cache holds whatever a state needs).

    For each sample one untimed pass finds the distinct experts N the batch needs; the pass is
    captured with a random subset R of N resident, so its replays fetch N \\ R and hit R.
    With ``reuse_cap`` the passes route as S²-MoE verification does (reuse-aware gating, random
    draft confidences), so they carry the gating's own cost like the passes they model.
    """
    cache = model.experts
    rng = np.random.default_rng(seed)
    windows = _contexts(token_lists, context, max_batch)
    if not windows:
        raise ValueError("workload too short for verification samples")
    fractions = (0.0, 0.25, 0.5, 0.75, 1.0)
    prefilled: dict[int, KVCache] = {}  # one KV per window: replays copy its context prefix
    passes = []
    with cache.in_phase("calibrate"):
        for i in range(n_samples):
            w = i % len(windows)
            ctx, nxt = windows[w]
            if w not in prefilled:
                kv = prefilled[w] = model.new_cache(context + max_batch)
                model.forward(ctx, kv, logits="last", record=False)
                kv.commit(len(ctx))
            batch = nxt[: int(rng.integers(1, max_batch + 1))]
            policy = TARGET
            if reuse_cap:
                confidences = np.concatenate([[1.0], rng.uniform(0.2, 1.0, len(batch) - 1)])
                policy = RoutingPolicy(selection_bias=ReuseGating(model.config.top_k, reuse_cap,
                                                                  confidences=confidences).bias)
            _, rec = model.forward(batch, prefilled[w], start=len(ctx), logits="last", policy=policy)
            needed = sorted(rec.unique_experts())
            frac = fractions[i % len(fractions)]
            keep = [needed[j] for j in rng.permutation(len(needed))[: int(round(frac * len(needed)))]]
            for key in keep:
                pool.offer(key, cache.held[key])
            passes.append(CapturedPass(model, list(batch), len(ctx), prefilled[w], frozenset(keep),
                                       len(needed) - len(keep), len(keep),
                                       {"logits": "all", "record": False, "policy": policy}))
            tick()
    cache.clear()
    return passes


def decode_step_times(model: MoEModel, prompts: list[list[int]], tokens: int, policy: RoutingPolicy,
                      tick: Tick = _noop, head=None) -> list[float]:
    """Per-step wall times of AR decoding (with the target, or the draft's policy and lm head for C_draft)."""
    steps: list[float] = []
    for ids in prompts:
        res = generate_ar(model, ids, tokens, policy=policy, head=head)
        steps.extend(res.step_seconds[1:])  # the first step still carries prompt-side misses
        tick()
    return steps


def routing_traces(model: MoEModel, token_lists: list[list[int]], tick: Tick = _noop) -> list[list[tuple[int, list[int]]]]:
    """Per token: [(layer, experts)] chosen by the target on workload text (teacher-forced)."""
    traces = []
    for ids in token_lists:
        kv = model.new_cache(len(ids))
        _, rec = model.forward(ids, kv)
        for t in range(len(ids)):
            traces.append([(L, [int(e) for e in r.experts[t]]) for L, r in sorted(rec.layers.items())])
        tick()
    return traces


def summarize(samples: list[float]) -> dict:
    arr = np.array(samples)
    return {"median": float(np.median(arr)), "p90": float(np.percentile(arr, 90)), "n": len(samples),
            "mean": float(statistics.fmean(samples))}
