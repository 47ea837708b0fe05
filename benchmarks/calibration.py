"""Backs docs/performance/calibration.md, "Three in a row" (`docs/results/calibration-probe/`) and the
profiles under `docs/results/profiles/`: profile then validate, as a user runs them.

Calibration figures for docs/performance/calibration.md: profile + validate the default model on this
machine at several budgets, and check that an emulated slow tier is recovered.

    python benchmarks/calibration.py [--budgets 1.0,0.25,0.1] [--out docs/results/calibration.json]
    python benchmarks/calibration.py --model DIR --name widened --no-emulated \
        --out docs/results/calibration-widened.json      # a model of your own (tools/widen_model.py)
    python benchmarks/calibration.py --budgets 0.25,0.1 --repeat 3 --no-emulated   # profile then
        validate, three times in a row per budget, as a user would run them (default flags)

Runs the real CLIs (`s2moe-calib profile`, `s2moe-calib validate --json`) so the figures are what a
user gets. Profiles go to docs/results/profiles/ (``--profiles``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import write_json  # noqa: E402


def calib(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "s2moe.calib", *args], capture_output=True, text=True, cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="1.0,0.25,0.1")
    ap.add_argument("--samples", default="150")
    ap.add_argument("--n-prompts", default="16")
    ap.add_argument("--out", default="docs/results/calibration.json")
    ap.add_argument("--model", default=None, help="model folder or file (default: the embedded model)")
    ap.add_argument("--name", default="default", help="profiles are written as cpu-NAME-BUDGET.json")
    ap.add_argument("--rounds", default=None, help="interleaved replays per timed pass (default: the CLI's)")
    ap.add_argument("--no-emulated", action="store_true", help="skip the emulated-tier check")
    ap.add_argument("--repeat", type=int, default=1, help="profile + validate this many times in a row per budget")
    ap.add_argument("--profiles", default="docs/results/profiles", help="where the profiles are written")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    rounds = ["--rounds", args.rounds] if args.rounds else []
    folder = os.path.join(ROOT, args.profiles)
    os.makedirs(folder, exist_ok=True)
    rows = []
    for budget, run in [(b, i) for b in args.budgets.split(",") for i in range(args.repeat)]:
        path = os.path.join(folder, f"cpu-{args.name}-{budget}.json")
        r = calib("profile", "--device", "cpu", *model, *rounds, "--budget", budget, "--samples", args.samples,
                  "--out", path)
        if r.returncode:
            sys.exit(f"profile at budget {budget} failed:\n{r.stderr}")
        prof = json.load(open(path))
        v = calib("validate", "--profile", path, *rounds, "--n-prompts", args.n_prompts, "--json")
        result = json.loads(v.stdout) if v.stdout.strip() else {"error": v.stderr}
        rows.append({"budget": budget, "run": run + 1, "validate": result, "fit_in_sample": prof["cost_model"]["fit"],
                     "t_ar_ms": prof["cost_model"]["t_ar_ms"], "c_draft_ms": prof["cost_model"]["c_draft_ms"],
                     "t_exp_miss_ms": prof["cost_model"]["t_exp_miss_ms"],
                     "t_exp_hit_ms": prof["cost_model"]["t_exp_hit_ms"],
                     "bandwidth_mb_s": prof["offload"]["bandwidth_mb_s"], "latency_us": prof["offload"]["latency_us"],
                     "residency": prof["hot_experts"]["strategy"],
                     "heldout_hit_rates": prof["hot_experts"]["heldout_hit_rates"]})
        print(json.dumps(rows[-1]), file=sys.stderr)
    table(rows, args.name)
    if args.no_emulated:
        _write(args, rows, None)
        return
    # emulated slow tier: known bandwidth and latency, serial fetches so T_exp = latency + bytes / BW
    emu = os.path.join(folder, f"cpu-{args.name}-emulated.json")
    r = calib("profile", "--device", "cpu", *model, *rounds, "--budget", "0.25", "--samples", args.samples, "--fetch-threads", "1",
              "--emulate-bandwidth", "400", "--emulate-latency", "300", "--out", emu)
    if r.returncode:
        sys.exit(f"emulated profile failed:\n{r.stderr}")
    prof = json.load(open(emu))
    stored = prof["model"]["expert_bytes_stored"]
    expected_ms = 0.3 + stored / 400e6 * 1e3
    fetch_ms = prof["cost_model"]["t_exp_miss_ms"] - prof["cost_model"]["t_exp_hit_ms"]
    emulated = {"set": {"bandwidth_mb_s": 400, "latency_us": 300},
                "recovered": {"bandwidth_mb_s": prof["offload"]["bandwidth_mb_s"],
                              "latency_us": prof["offload"]["latency_us"]},
                "t_exp_fetch_ms": fetch_ms, "latency_plus_bytes_over_bw_ms": expected_ms,
                "t_exp_relative_error": fetch_ms / expected_ms - 1, "fit_in_sample": prof["cost_model"]["fit"]}
    # held-out validation where fetch time is deterministic: what the model does without the VM's noise
    v = calib("validate", "--profile", emu, *rounds, "--n-prompts", args.n_prompts, "--json")
    emulated["validate"] = json.loads(v.stdout) if v.stdout.strip() else {"error": v.stderr}
    print(json.dumps(emulated), file=sys.stderr)
    _write(args, rows, emulated)


def table(rows: list, name: str) -> None:
    """Each profile + validate as a user sees it: the raw figures, the noise, the speed probe."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"profile then validate · {name}")
    for col in ("budget", "run", "R²", "MAPE %", "median resid. %", "noise ceiling", "probe ×", "fit ×", "verdict"):
        t.add_column(col, justify="right")
    for row in rows:
        v = row["validate"]
        if "error" in v:
            t.add_row(row["budget"], str(row["run"]), "error", "", "", "", "", "", v["error"][:60])
            continue
        probe = v.get("probe") or {}
        t.add_row(row["budget"], str(row["run"]), f"{v['r2']:.3f}", f"{v['mape_percent']:.1f}",
                  f"{v['residual_percent_p50']:+.1f}", str(v["timing"]["noise_ceiling_r2"]),
                  str(probe.get("ratio")), str(v.get("fit_ratio")),
                  ("pass" if v["passed"] else "fail") + f" ({probe.get('verdict')})")
    Console(stderr=True).print(t)


def _write(args, rows: list, emulated: dict | None) -> None:
    write_json(os.path.join(ROOT, args.out), {"model": args.model or "embedded default", "budgets": rows,
                                              "emulated": emulated})


if __name__ == "__main__":
    main()
