"""AR tok/s under settings of the kernels' thread pool, taking turns in one process (this machine
drifts by tens of percent): how long a worker spins for the next job before sleeping
(`_cpu.pool_spin_us`) and the work below which a job runs on the caller (`_cpu.pool_min_work`).

    python benchmarks/pool_settings.py [--model DIR] [--budget 0.25|full] [--tokens 64] [--reps 6] \
        [--settings 50:512,5000:64]

A setting is SPIN_US:MIN_WORK_K. Each repetition runs `generate_ar` on a 60-token random prompt
once per setting, in alternating order, the expert cache cleared before each run under a budget.
Prints tok/s per repetition and each setting's ratio to the first, per repetition. Results:
docs/results/native-io/pool-threshold.txt (threshold alone, 2a8976f) and pool-spin.txt (41812a1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe import _cpu  # noqa: E402
from s2moe.runtime.cli.common import DEFAULT_MODEL  # noqa: E402
from s2moe.runtime.decoding.generate import generate_ar  # noqa: E402
from s2moe.runtime.engine import build_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--budget", default="0.25", help="a share of the experts, or 'full'")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--settings", default="50:512,5000:64", help="SPIN_US:MIN_WORK_K, comma-separated")
    a = ap.parse_args()
    settings = [tuple(int(v) for v in item.split(":")) for item in a.settings.split(",")]
    full = a.budget == "full"
    engine = build_engine(a.model, budget=None if full else a.budget)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 6000, 60)]
    generate_ar(engine.model, prompt, 8)  # warm-up
    rates: dict[tuple, list[float]] = {v: [] for v in settings}
    default = (_cpu.pool_spin_us(), _cpu.pool_min_work())
    try:
        for rep in range(a.reps):
            for spin, work in settings if rep % 2 == 0 else settings[::-1]:
                _cpu.pool_spin_us(spin)
                _cpu.pool_min_work(work * 1024)
                if not full:
                    engine.cache.clear()
                result = generate_ar(engine.model, prompt, a.tokens)
                rates[(spin, work)].append(a.tokens / result.decode_seconds)
    finally:
        _cpu.pool_spin_us(default[0])
        _cpu.pool_min_work(default[1])
    first = rates[settings[0]]
    for spin, work in settings:
        r = rates[(spin, work)]
        ratios = [x / y for x, y in zip(r, first)]
        print(f"spin {spin} us, min work {work}K: median {statistics.median(r):.1f} tok/s;",
              f"to the first, per rep {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")

if __name__ == "__main__":
    main()
