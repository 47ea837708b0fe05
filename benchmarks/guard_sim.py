"""Backs docs/performance/s2moe-ae.md, "A probe judged on what AE expected, not on what one iteration
kept" (and tests/test_rate_guard.py, which drives its guards here): the rate guard on a simulated clock.

The rate guard on a simulated clock: how much slower a guarded run is than the better of its two
ways of stepping, where speculation's speed against AR's is known (runtime/decoding/rate_guard.py).

    python benchmarks/guard_sim.py [--seeds 300] [--tokens 378] [--out docs/results/guard-expected/sim]

Each speculative iteration drafts ``--drafted`` tokens and keeps each in turn with probability
``--keep``, so it emits 1 to drafted + 1 tokens; it takes the same time (± 20 %) whatever it keeps,
set so that speculation costs RATIO × AR's time per token on average. An AR step takes AR's time
± 10 %. The guard is told either the tokens each iteration kept ("realized", as before f9670eb) or
AE's expectation of them, exact or off by a factor ("expected ×0.87": AE expects 13 % too few).
No machine time is measured: the table is the same on any machine for the same seeds.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe.runtime.decoding.rate_guard import RateGuard  # noqa: E402
from benchmarks.common import Record, machine_info, write_outputs  # noqa: E402

RATIOS = (0.75, 0.87, 1.0, 1.15, 1.4)
TELLS = (("realized", None), ("expected", 1.0), ("expected x0.87", 0.87), ("expected x1.15", 1.15))


def run(seed: int, ratio: float, bias: float | None, tokens: int = 378, keep: float = 0.72, drafted: int = 5,
        ar_ms: float = 1.5, guard: RateGuard | None = None) -> tuple[float, int]:
    """(the run's time over the better way's, AR steps taken); ``bias`` None: the guard is told the
    tokens kept, else AE's expectation × ``bias``. tests/test_rate_guard.py drives its guards here."""
    rng, guard = random.Random(seed), guard or RateGuard()
    mean = sum(keep ** i for i in range(drafted + 1))  # tokens an iteration emits on average
    spent = 0.0
    emitted = ar_steps = 0
    while emitted < tokens:
        if guard.speculate():
            kept = 1
            while kept <= drafted and rng.random() < keep:
                kept += 1
            seconds = ratio * ar_ms * mean * rng.uniform(0.8, 1.2) / 1e3
            guard.observe(True, kept, seconds, None if bias is None else mean * bias)
        else:
            kept, seconds = 1, ar_ms * rng.uniform(0.9, 1.1) / 1e3
            guard.observe(False, 1, seconds)
            ar_steps += 1
        spent, emitted = spent + seconds, emitted + kept
    return spent / (min(ratio, 1.0) * ar_ms * emitted / 1e3), ar_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=378)
    ap.add_argument("--keep", type=float, default=0.72)
    ap.add_argument("--drafted", type=int, default=5)
    ap.add_argument("--out", default="docs/results/guard-expected/sim")
    args = ap.parse_args()
    records = []
    print("| speculation / AR | " + " | ".join(name for name, _ in TELLS) + " |")
    print("|---" * (len(TELLS) + 1) + "|")
    for ratio in RATIOS:
        cells = []
        for name, bias in TELLS:
            runs = [run(s, ratio, bias, args.tokens, args.keep, args.drafted) for s in range(args.seeds)]
            slow = sorted(r[0] for r in runs)
            held = sorted(r[1] for r in runs)
            records.append(Record("guard-sim", f"{name} at {ratio}", "time over the better way", slow,
                                  {"ratio": ratio, "told": name, "seeds": args.seeds, "tokens": args.tokens,
                                   "keep": args.keep, "drafted": args.drafted},
                                  extra={"ar_steps": held}))
            p90 = lambda xs: xs[int(0.9 * (len(xs) - 1))]  # noqa: E731
            cells.append(f"{statistics.median(slow):.3f} / {statistics.mean(slow):.3f} / {p90(slow):.3f} "
                         f"(AR {statistics.median(held):.0f}, {p90(held)})")
        print(f"| {ratio} | " + " | ".join(cells) + " |")
    print("(median / mean / p90 of the time over the better way; AR steps median, p90)")
    write_outputs(records, machine_info(), args.out, "the rate guard on a simulated clock")


if __name__ == "__main__":
    main()
