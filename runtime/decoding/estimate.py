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
    # T_AR is what an AR step of this run costs: a new token at a new position, finding the experts
    # the cache holds after the steps before it and reading the rest. Timing one token again after a
    # warm pass made its experts resident priced a step at a hit on every expert: 0.6 ms against
    # 2.8-3.1 ms that the run then measured at a 25 % budget (embedded model), so AE admitted nothing
    # early and the rate guard saw speculation lose. So: prefill, one untimed step (code and buffers
    # warm), then ``reps`` steps on the context's next tokens, each committed.
    reps = max(1, reps)
    seq = list(prompt[-16:]) or [0]
    while len(seq) < reps + 2:
        seq = seq + seq
    head, steps = seq[:-(reps + 1)], seq[-(reps + 1):]
    kv = model.new_cache(len(seq) + 2)
    with phase_of(model, "estimate"):
        model.forward(head, kv, logits="last", record=False)
        kv.commit(kv.filled)
        samples = []
        for token in steps:
            t0 = time.perf_counter()
            model.forward([token], kv, logits="last", record=False)
            samples.append(time.perf_counter() - t0)
            kv.commit(kv.filled)
        t_ar = statistics.median(samples[1:])
        P = kv.length
        token = steps[-1]

        def step(policy=None, head=None):
            kv.rollback(P - 1)
            model.forward([token], kv, policy=policy or RoutingPolicy(), logits="last", record=False, head=head)

        # the draft reads only resident experts, so a warm repeat is what its passes cost
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
