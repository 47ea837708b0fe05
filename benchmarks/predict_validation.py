"""Backs docs/performance/calibration.md, "AE's decisions re-made for the other device" and "At
OLMoE-1B-7B's size" (`docs/results/predict-default/`, `docs/results/predict-olmoe-widened/`): is
`s2moe-calib predict` right?

Is `s2moe-calib predict` right? Predict a device from a trace recorded here, then run that device.

    python benchmarks/predict_validation.py [--model /path/to/widened] [--out docs/results/predict]
    python benchmarks/predict_validation.py --render docs/results/predict   # the table only

Steps (each a CLI call, so this is what a user would run; nothing else may run on the machine):
1. `s2moe bench --trace` at real-disk speed, AR and S²-MoE, at each budget;
2. `s2moe-calib profile` under the emulated tier (``--emulate-bandwidth/--emulate-latency``);
3. `s2moe-calib predict` from each trace with that profile, at each budget: AE's decisions re-made
   with the profile's costs (the default), and the passes priced as recorded (`--as-recorded`);
   also from a trace recorded with every expert resident (a workstation's), at each budget;
4. `s2moe bench` under the emulated tier with that profile, for real (and S²-MoE without prefetch,
   which tells the prefetch model's share of the error).
The table compares predicted and measured decode tokens/s (aggregate: tokens / decode seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def call(args: list[str], log: str) -> None:
    with open(log, "w") as f:
        r = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"{' '.join(args[:3])} … failed ({r.returncode}); see {log}")


def run(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    o = lambda name: os.path.join(a.out, name)  # noqa: E731
    model = ["--model", a.model] if a.model else []  # none: the embedded default model
    bench = ["s2moe", "bench", *model, "--workload", a.workload, "--n-prompts", str(a.n_prompts),
             "--max-tokens", str(a.max_tokens)]
    emulate = ["--emulate-bandwidth", str(a.bandwidth), "--emulate-latency", str(a.latency)]
    for b in a.budgets:
        call(bench + ["--methods", "ar,s2moe", "--budget", b, "--trace", o(f"trace-{b}.json"),
                      "--json", o(f"real-{b}.json")], o(f"real-{b}.log"))
    call(["s2moe-calib", "profile", "--device", "cpu", *model, "--budget", a.budgets[0], *emulate,
          "--samples", "80", "--rounds", "5", "--n-prompts", str(a.profile_prompts), "--out", o("emu-profile.json"),
          *(["--draft-topk", str(a.draft_topk)] if a.draft_topk else [])],
         o("profile.log"))
    def predict(trace: str, b: str, prefix: str = "") -> None:  # re-made, and priced as recorded
        for name, extra in ((f"{prefix}predict-{b}.json", []), (f"{prefix}recorded-{b}.json", ["--as-recorded"])):
            with open(o(name), "w") as f:
                subprocess.run(["s2moe-calib", "predict", "--trace", o(trace), "--profile", o("emu-profile.json"),
                                "--budget", b, "--json", *extra], stdout=f, check=True)

    for b in a.budgets:
        predict(f"trace-{b}.json", b)
        call(bench + ["--methods", "ar,s2moe", "--budget", b, "--profile", o("emu-profile.json"), *emulate,
                      "--json", o(f"emu-{b}.json")], o(f"emu-{b}.log"))
    # a trace with every expert resident (a workstation's), predicted at each budget: here the
    # recorded decisions are furthest from the capped device's, so re-making them matters most
    call(bench + ["--methods", "ar,s2moe", "--trace", o("trace-full.json"), "--json", o("real-full.json")], o("real-full.log"))
    for b in a.budgets:
        predict("trace-full.json", b, "full-")
    b = a.budgets[0]
    call(bench + ["--methods", "s2moe", "--budget", b, "--profile", o("emu-profile.json"), *emulate, "--no-prefetch",
                  "--json", o(f"emu-noprefetch-{b}.json")], o(f"emu-noprefetch-{b}.log"))


def render(folder: str) -> None:
    def load(name):
        path = os.path.join(folder, name)
        return json.load(open(path)) if os.path.exists(path) else None

    def rows(b: str, prefix: str, label: str) -> None:
        """One row a method: the re-made prediction and the one priced as recorded, against the
        emulated run; the acceptance lengths where the trace's run is at the same budget."""
        pred, recorded = load(f"{prefix}predict-{b}.json"), load(f"{prefix}recorded-{b}.json")
        if pred is None:
            return
        recorded = {m["method"]: m for m in recorded["methods"]} if recorded else {}
        emu = {r["name"]: r for r in load(f"emu-{b}.json")["records"]}
        real = {r["name"]: r for r in load(f"real-{b}.json")["records"]} if not prefix else None
        agg = {k: r["extra"]["decode_tokens_per_s_aggregate"] for k, r in emu.items()}
        for p in pred["methods"]:
            name, got = p["method"], agg[p["method"]]
            r = recorded.get(name)
            as_recorded = f"{(r['predicted_tokens_per_s'] / got - 1) * 100:+.1f} %" if r else "-"
            acc = (f"{real[name]['extra']['acceptance_length']:.2f} → {emu[name]['extra']['acceptance_length']:.2f}"
                   if real else "–")
            print(f"| {label} | {name} | {p['predicted_tokens_per_s']:.2f} | {got:.2f} | "
                  f"{(p['predicted_tokens_per_s'] / got - 1) * 100:+.1f} % | {as_recorded} | "
                  f"{p['predicted_speedup_vs_ar']:.2f}× | {got / agg['ar']:.2f}× | {acc} |")

    print("| budget | method | predicted tok/s | measured tok/s | error | as recorded: error | predicted speedup |"
          " measured speedup | acceptance length (trace → emulated run) |")
    print("|---|---|---|---|---|---|---|---|---|")
    budgets = sorted({f.split("-", 1)[1].removesuffix(".json") for f in os.listdir(folder) if f.startswith("predict-")},
                     key=float, reverse=True)
    for b in budgets:
        rows(b, "", b)
    for b in budgets:  # (a trace with every expert resident)
        rows(b, "full-", f"{b}, from the full-budget trace")
    for f in sorted(os.listdir(folder)):
        if f.startswith("emu-noprefetch-") and f.endswith(".json"):
            r = {x["name"]: x for x in load(f)["records"]}["s2moe"]
            print(f"\nS²-MoE without prefetch at {r['params']['budget']}: "
                  f"{r['extra']['decode_tokens_per_s_aggregate']:.2f} tok/s measured")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the traced model (default: the embedded one; tools/widen_model.py makes "
                    "the real-size one)")
    ap.add_argument("--budgets", default="0.25,0.1")
    ap.add_argument("--draft-topk", type=int, default=None,
                    help="the profile's draft k, instead of measuring every k (saves most of a real-size profile)")
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--profile-prompts", type=int, default=16, help="prompts the profile decodes (its --n-prompts)")
    ap.add_argument("--bandwidth", type=float, default=200.0, help="emulated MB/s")
    ap.add_argument("--latency", type=float, default=300.0, help="emulated µs")
    ap.add_argument("--out", default="docs/results/predict")
    ap.add_argument("--render", metavar="FOLDER", help="only print the comparison of a finished run")
    a = ap.parse_args()
    if a.render:
        return render(a.render)
    a.budgets = a.budgets.split(",")
    run(a)
    render(a.out)


if __name__ == "__main__":
    main()
