"""AE's decisions under fixed cost constants, seen through bytes fetched per generated token.

    python benchmarks/ae_sweep.py --model WIDENED --misses 2,4.5,10.7,16 [--t-ar 197 --c-draft 8.5]
                                  [--out docs/results/acceptance/price-sweep] [-- extra s2moe bench flags]

With the constants fixed (`--no-live-costs`), what AE drafts depends on the constants and the
prompts only, not on timings, so acceptance length and bytes per token repeat exactly from run to
run (checked: two runs of each of two prices gave identical figures) even on a busy machine. Under
an emulated 200 MB/s + 300 µs tier, where a step's time is its bytes over the link, bytes per token
is the speed AE's choices buy, without the machine's noise. Each price is a copy of the widened
model's 10 % profile (`docs/results/profiles/cpu-widened-0.1.json`) with T_AR, C_draft and the
miss cost replaced and nothing pinned; `s2moe bench --methods ar,s2moe`, HumanEval, 3 prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the widened model (tools/widen_model.py)")
    ap.add_argument("--misses", default="2,4.5,10.7,16,25", help="miss costs to try, ms")
    ap.add_argument("--t-ar", type=float, default=197.0, help="ms (what live costs measured on this tier)")
    ap.add_argument("--c-draft", type=float, default=8.5, help="ms")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "acceptance", "price-sweep"))
    ap.add_argument("extra", nargs="*", help="further `s2moe bench` flags (after --)")
    args = ap.parse_args()
    base = json.load(open(os.path.join(ROOT, "docs", "results", "profiles", "cpu-widened-0.1.json")))
    os.makedirs(args.out, exist_ok=True)
    print("| miss (ms) | method | acceptance length | MB per token | AE predicted / observed acceptance |")
    print("|---|---|---|---|---|")
    for miss in (float(m) for m in args.misses.split(",")):
        prof = json.loads(json.dumps(base))
        prof["cost_model"].update(t_ar_ms=args.t_ar, c_draft_ms=args.c_draft, t_exp_miss_ms=miss, t_exp_hit_ms=0.0)
        prof["hot_experts"].update(gpu_experts=[], strategy="lfu")
        tag = "-".join([f"{args.t_ar:g}", f"{args.c_draft:g}", f"{miss:g}"] + [e.strip("-") for e in args.extra])
        prof_path, res = os.path.join(args.out, f"profile-{tag}.json"), os.path.join(args.out, f"res-{tag}.json")
        with open(prof_path, "w") as f:
            json.dump(prof, f)
        cmd = [sys.executable, "-m", "s2moe.runtime.cli", "bench", "--model", args.model, "-w", "humaneval",
               "--n-prompts", "3", "-b", "0.1", "--methods", "ar,s2moe", "--profile", prof_path, "--no-live-costs",
               "--emulate-bandwidth", "200", "--emulate-latency", "300", "--json", res, *args.extra]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr[-2000:])
        for rec in json.load(open(res))["records"]:
            ae = rec.get("ae_acceptance") or {}
            print(f"| {miss:g} | {rec['method']} | {rec['acceptance_length']:.2f} | "
                  f"{rec['bytes_fetched_per_token'] / 1e6:.2f} | {ae.get('predicted', '-')} / {ae.get('observed', '-')} |",
                  flush=True)


if __name__ == "__main__":
    main()
