"""Quick start-up estimate of the cost constants, for runs without a calibrated profile.

A handful of timed passes on the actual prompt (not a calibration: `s2moe-calib profile` measures
these properly across cache states and writes them to a profile). Callers must say it happened.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from .cost_model import CostConstants
from ..engine import phase_of
from ..model.forward import MoEModel
from ..model.routing import RoutingPolicy


def _median_time(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def estimate_costs(model: MoEModel, prompt: list[int], draft_policy: RoutingPolicy, reps: int = 3,
                   draft_head=None) -> CostConstants:
    """``draft_head``: the draft's head over a token subset (FR-Spec), timed as the draft runs it."""
    c = model.config
    ctx = prompt[-16:] or [0]
    kv = model.new_cache(len(ctx) + 2)
    with phase_of(model, "estimate"):
        model.forward(ctx[:-1] or ctx, kv, logits="last", record=False)
        kv.commit(kv.filled)
        P = kv.length
        token = ctx[-1]

        def step(policy=None, head=None):
            kv.rollback(P)
            model.forward([token], kv, policy=policy or RoutingPolicy(), logits="last", record=False, head=head)

        step()  # warm: the experts this token needs become resident (as far as the budget allows)
        t_ar = _median_time(step, reps)
        c_draft = _median_time(lambda: step(draft_policy, draft_head), reps)
        # one resident expert's compute for one token
        L = c.moe_layer_ids[0]
        w = model.experts.get(L, [0])[0]
        arrays = model.backend
        x = arrays.to_device(np.random.default_rng(0).standard_normal((1, c.hidden_size)).astype(np.float32))
        arrays.wait(w)

        def one_expert():
            model.ops.expert(x, w, model.act)
            arrays.synchronize()  # device work is asynchronous: time its completion

        t_hit = _median_time(one_expert, 20)
        # a miss adds a read of the stored bytes through the slow tier
        store = getattr(model.experts, "store", None)
        t_read = 0.0
        if store is not None:
            experts = list(range(min(4, c.num_experts)))
            t_read = _median_time(lambda: store.read_many(L, experts), 2) / len(experts)
    return CostConstants(t_ar=t_ar, c_draft=c_draft, t_exp_miss=t_hit + t_read, t_exp_hit=t_hit, source="estimated")
