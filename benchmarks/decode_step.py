"""What the CPU decode step's pieces cost on the embedded default model, old way against new, taking
turns in one process (this machine drifts by tens of percent within seconds).

    python benchmarks/decode_step.py [--reps 7] [--out docs/results/kernels-decode/step]

Pairs (A = the path before e37f636 / 195bb83, B = now; both still in the code):
- attention core at one token over 64, 191 and 512 cached slots: the portable loop (scalar exp,
  a call per slot) against the SIMD head kernel (`_cpu.use_simd`);
- a layer's attention block at 191 slots: seven steps from Python against one C call
  (`CpuOps.attention_blocks`);
- routing one token: NumPy (`ReferenceOps.route`) against the C router;
- a whole AR decode pass at 128-420 slots: the step-by-step attention and NumPy routing against the
  block and the C router (the SIMD attention and the tails stay on: their switch is the matrix
  kernels' too).
The experts' 8-wide tails have no switch; `docs/results/kernels-decode/run-*.json` time them with
the rest, by revision. Results: a markdown table on stdout, JSON/CSV under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402


def per_call(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="docs/results/kernels-decode/step")
    args = ap.parse_args()

    from s2moe import _cpu
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.kernels import cpu
    from s2moe.runtime.kernels.reference import ReferenceOps
    from s2moe.runtime.model.forward import MoEModel
    from s2moe.runtime.model.loader import load_model

    loaded = load_model(str(DEFAULT_MODEL))
    model = MoEModel(loaded, ops=cpu.CpuOps())
    c, W, ops = loaded.config, model.W, model.ops
    rng = np.random.default_rng(0)
    nh, nkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    cases = {}

    def attend_case(S):
        K = rng.standard_normal((nkv, 2048, D)).astype(np.float32)
        V = rng.standard_normal((nkv, 2048, D)).astype(np.float32)
        q = rng.standard_normal((1, nh * D)).astype(np.float32)
        k = rng.standard_normal((1, nkv * D)).astype(np.float32)
        cos, sin = np.ones((1, D // 2), np.float32), np.zeros((1, D // 2), np.float32)
        mask, out = np.ones((1, S), bool), np.empty((1, nh * D), np.float32)
        call = lambda: _cpu.attend(q, k, k, K, V, cos, sin, mask, None, out, nh, nkv, D, S - 1, 0.18, True, False)  # noqa: E731

        def side(simd):
            def run():
                _cpu.use_simd(simd)
                try:
                    return per_call(call, 2000)
                finally:
                    _cpu.use_simd(True)
            return run
        return side(False), side(True)

    for S in (64, 191, 512):
        cases[f"attention core, 1 token, {S} slots"] = attend_case(S)

    kv = model.new_cache(600)
    model.forward(np.arange(10, 201), kv, logits="last", record=False)
    kv.commit(191)
    start, h = 191, rng.standard_normal((1, c.hidden_size)).astype(np.float32)
    cs = model._rope(np.arange(start, start + 1))
    mask = model._visibility(start, 1, np.arange(start, start + 1), None, None)
    kv.begin_write(start, 1)
    norm = W["layers.0.attn_norm"]
    steps = lambda: h + model._attention(0, ops.rms_norm(h, norm, c.rms_norm_eps), start, kv, *cs, mask)  # noqa: E731
    block = lambda: ops.gqa_block(c, W, 0, h, norm, start, kv, cs, mask)  # noqa: E731
    cases["attention block, 1 token, 191 slots"] = (lambda: per_call(steps, 2000), lambda: per_call(block, 2000))

    logits = rng.standard_normal((1, c.num_experts)).astype(np.float32)
    ref = ReferenceOps()
    route = lambda o: lambda: per_call(lambda: o.route(logits, c.top_k, c.router, c.norm_topk_prob), 5000)  # noqa: E731
    cases["routing, 1 token"] = (route(ref), route(ops))

    for L in c.moe_layer_ids:  # every expert resident: the pass, not the reads
        model.experts.get(L, list(range(c.num_experts)))

    def decode(old):
        def run():
            saved = cpu.CpuOps.attention_blocks, cpu.CpuOps.route
            if old:
                cpu.CpuOps.attention_blocks, cpu.CpuOps.route = False, ReferenceOps.route
            try:
                cache = model.new_cache(600)
                model.forward(np.arange(10, 138), cache, logits="last", record=False)
                cache.commit(128)
                t0 = time.perf_counter()
                for i in range(292):
                    model.forward([5 + i % 50], cache, logits="last", record=False)
                    cache.commit(cache.filled)
                return (time.perf_counter() - t0) / 292
            finally:
                cpu.CpuOps.attention_blocks, cpu.CpuOps.route = saved
        return run
    cases["AR decode pass, 128-420 slots (block and C router off / on)"] = (decode(True), decode(False))

    records, rows = [], []
    for name, (old, new) in cases.items():
        a, b = [], []
        for rep in range(args.reps):  # A then B, then B then A: drift falls on both
            for side in ((old, a), (new, b)) if rep % 2 == 0 else ((new, b), (old, a)):
                side[1].append(side[0]() * 1e6)
        ratio = [x / y for x, y in zip(a, b)]
        for label, samples in (("before", a), ("after", b)):
            records.append(Record("decode-step", f"{name} {label}", "us", samples, params={"case": name, "side": label},
                                  extra={"before_over_after": ratio} if label == "after" else {}))
        rows.append((name, statistics.median(a), statistics.median(b), statistics.median(ratio), min(ratio), max(ratio)))
        print(rows[-1], file=sys.stderr, flush=True)
    write_outputs(records, machine_info(), args.out, "CPU decode step: old paths against new")
    print("| piece | before | after | before / after, median (range) |")
    print("|---|---|---|---|")
    for name, a, b, r, lo, hi in rows:
        print(f"| {name} | {a:.1f} µs | {b:.1f} µs | **{r:.2f}×** ({lo:.2f}–{hi:.2f}) |")


if __name__ == "__main__":
    main()
