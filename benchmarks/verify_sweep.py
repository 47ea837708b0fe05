"""Verification-pass latency against batch size (1..9 tokens), this tree vs a baseline commit.

    python benchmarks/verify_sweep.py [--baseline 77de70d] [--reps 7] [--out docs/results/verify-sweep]

The embedded default model, every expert resident, a 64-token context. The baseline runs from a
temporary `git worktree`; the two trees alternate repetition by repetition in one run, so their
ratio is not skewed by the machine's drift. One repetition of one batch size is the fastest of 20
passes (timeit's rule); the record keeps every repetition. Results: a table on stderr, JSON/CSV
under docs/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

# Run inside each tree: prints {batch: seconds} for one repetition.
CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from runtime.loader import load_model
from runtime.model import MoEModel
loaded = load_model(sys.argv[2])
model = MoEModel(loaded)
rng = np.random.default_rng(0)
kv = model.new_cache(128)
model.forward(rng.integers(0, 6000, 64).tolist(), kv, logits="last", record=False)
kv.commit(64)
out = {}
for n in range(1, 10):
    tokens = rng.integers(0, 6000, n).tolist()
    model.forward(tokens, kv, start=64)  # warm-up
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        model.forward(tokens, kv, start=64)
        best = min(best, time.perf_counter() - t0)
    out[n] = best
print(json.dumps(out))
"""


def run_child(tree: str, model: str) -> dict[int, float]:
    # the trees are imported as plain folders (runtime/ …), not as the installed package
    r = subprocess.run([sys.executable, "-c", CHILD, tree, model], capture_output=True, text=True, cwd=tree)
    if r.returncode:
        sys.exit(f"benchmark child in {tree} failed:\n{r.stderr}")
    return {int(k): v for k, v in json.loads(r.stdout).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="77de70d")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="docs/results/verify-sweep")
    args = ap.parse_args()
    model = os.path.join(ROOT, "runtime", "assets", "default-moe")
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "baseline")
        subprocess.run(["git", "worktree", "add", "--detach", base, args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            samples: dict[str, list[dict[int, float]]] = {"baseline": [], "this": []}
            for _ in range(args.reps):
                samples["baseline"].append(run_child(base, model))
                samples["this"].append(run_child(ROOT, model))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base], cwd=ROOT, capture_output=True)
    records = [Record("verify_sweep", f"{tree} · {n} tokens", "ms", [r[n] * 1e3 for r in reps],
                      params={"tree": tree, "baseline": args.baseline, "batch": n})
               for tree, reps in samples.items() for n in range(1, 10)]
    write_outputs(records, machine_info(), os.path.join(ROOT, args.out), "verification pass latency vs batch size")
    print(f"{'batch':>5} {'baseline ms':>12} {'this ms':>8} {'speedup':>8}", file=sys.stderr)
    for n in range(1, 10):
        b = np.median([r[n] for r in samples["baseline"]]) * 1e3
        t = np.median([r[n] for r in samples["this"]]) * 1e3
        print(f"{n:>5} {b:>12.2f} {t:>8.2f} {b / t:>7.2f}x", file=sys.stderr)


if __name__ == "__main__":
    main()
