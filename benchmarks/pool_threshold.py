"""AR tok/s at three settings of the kernels' pool threshold (`_cpu.pool_min_work`: below it a job
runs on the calling thread), taking turns in one process (this machine drifts by tens of percent).

    python benchmarks/pool_threshold.py [--model DIR] [--budget 0.25|full] [--tokens 64] [--reps 6]

Each repetition runs `generate_ar` on a 60-token random prompt once per setting, in alternating
order, the expert cache cleared before each run under a budget. Prints tok/s per repetition and the
ratio of each setting to 512K (the default) per repetition. Results of 2a8976f:
docs/results/native-io/pool-threshold.txt.
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

SETTINGS = [96 * 1024, 256 * 1024, 512 * 1024]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--budget", default="0.25", help="a share of the experts, or 'full'")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args()
    full = a.budget == "full"
    engine = build_engine(a.model, budget=None if full else a.budget)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 6000, 60)]
    generate_ar(engine.model, prompt, 8)  # warm-up
    rates: dict[int, list[float]] = {v: [] for v in SETTINGS}
    default = _cpu.pool_min_work()
    try:
        for rep in range(a.reps):
            for v in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:
                _cpu.pool_min_work(v)
                if not full:
                    engine.cache.clear()
                result = generate_ar(engine.model, prompt, a.tokens)
                rates[v].append(a.tokens / result.decode_seconds)
    finally:
        _cpu.pool_min_work(default)
    for v in SETTINGS:
        print(f"{v // 1024} K", [round(x, 1) for x in rates[v]], f"median {statistics.median(rates[v]):.1f}")
    for v in SETTINGS[:-1]:
        print(f"{v // 1024}K / 512K per rep", [round(x / y, 3) for x, y in zip(rates[v], rates[SETTINGS[-1]])])


if __name__ == "__main__":
    main()
