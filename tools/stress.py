"""The suite under load: the full test suite N times in a row beside CPU burners, on a clean copy.

Issue 13's check of the timing-sensitive tests: the whole suite must pass run after run with two
CPU-bound processes beside it. The copy is one commit (``git archive``, as tools/mutate.py makes
it, plus the built extension), so edits made while it runs do not leak into it. Each run appends a
line to ``LOGDIR/summary.jsonl`` (run, exit code, seconds, pytest's last line, commit, start) and
keeps its log; the loop stops at the first failure or when a run would start after ``--deadline``.

    python tools/stress.py --commit HEAD --runs 20 --logdir /tmp/stress
    python tools/stress.py --commit 90061a7 --runs 8 --deadline 14:57 --logdir /tmp/stress

Nothing here times anything: do not run benchmarks while it runs (the machine is the load).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mutate  # noqa: E402  (its make_copy: a clean tree of one commit, importable as s2moe)


def deadline_epoch(text: str | None) -> float:
    """HH:MM today (local time), or no deadline."""
    if not text:
        return float("inf")
    hh, mm = (int(x) for x in text.split(":"))
    now = time.localtime()
    return time.mktime((now.tm_year, now.tm_mon, now.tm_mday, hh, mm, 0, 0, 0, -1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--burners", type=int, default=2, help="CPU-bound processes beside the suite")
    ap.add_argument("--deadline", help="HH:MM: start no run after this")
    ap.add_argument("--logdir", required=True)
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", args.commit], cwd=mutate.ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    copy = os.path.join(args.logdir, "copy")
    if not os.path.exists(copy):
        os.makedirs(copy)
        mutate.make_copy(commit, copy)  # with the extension built here (not in git)
    env = {**os.environ, "PYTHONPATH": copy}
    env.pop("S2MOE_DEBUG", None)
    summary = os.path.join(args.logdir, "summary.jsonl")
    stop_after = deadline_epoch(args.deadline)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    failed = False
    try:
        for i in range(1, args.runs + 1):
            if time.time() > stop_after:
                print(f"deadline reached before run {i}")
                break
            t0 = time.time()
            log = os.path.join(args.logdir, f"run{i:02d}.log")
            with open(log, "w") as f:
                rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                                    cwd=copy, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
            lines = open(log).read().strip().splitlines()
            rec = {"run": i, "rc": rc, "seconds": round(time.time() - t0, 1), "tail": lines[-1] if lines else "",
                   "commit": commit, "start": time.strftime("%H:%M:%S", time.gmtime(t0)), "burners": args.burners}
            with open(summary, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(rec, flush=True)
            if rc != 0:
                failed = True
                break
    finally:
        for b in burners:
            b.kill()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
