"""Backs docs/performance/s2moe-targets.md, "Speedup against the targets with residency-aware gating"
(and docs/performance/s2moe-real-size.md, "S²-MoE against AR, real disk"): S²-MoE against AR and the
baselines, per budget and workload.

S²-MoE vs AR and the baselines (embedded default model, or --model): `s2moe bench` at several budgets
over HumanEval, GSM8K and MT-Bench prompts, in one process per configuration.

    python benchmarks/speculative.py [--n-prompts 8] [--max-tokens 64] [--budgets 1.0,0.25,0.1] [--reps 3]
                                     [--emulate-bandwidth MB/s --emulate-latency µs]

Each repetition runs every budget × workload × method once, AR first in each (budget, workload), so
a method's speedup is taken against the AR run just before it; the table gives the median over
repetitions of those ratios (this machine drifts by tens of percent between minutes).

Writes raw records (per-prompt samples, machine, commit) to docs/results/speculative*.json/.csv
and prints markdown rows for the performance notes. Fetches come from the model file with O_DIRECT;
with --emulate-* every fetch also waits on an emulated link, and every row says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Record, machine_info, write_outputs  # noqa: E402

WORKLOADS = ("humaneval", "gsm8k", "mt-bench")
METHODS = "ar,es,confidence,cascade,ca,ca+ae,s2moe"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="1.0,0.25,0.1")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--profile", default=None, help="cost constants from this profile instead of start-up estimates")
    ap.add_argument("--hot-experts", default=None, help='pin these experts in every run, JSON {"gpu_experts": '
                    '[[layer, expert], ...]}; a list that fills the budget leaves no cache across steps, '
                    "as in the published code")
    ap.add_argument("--emulate-bandwidth", type=float, default=None)
    ap.add_argument("--emulate-latency", type=float, default=0.0)
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded model); "
                    "tools/widen_model.py makes the cost-realistic one")
    ap.add_argument("--no-live-costs", action="store_true", help="keep the start-up (or profile) constants fixed")
    ap.add_argument("--rg-variant", default=None, help="reuse-aware gating variant: resident (default), paper or code")
    ap.add_argument("--rg-residency", type=float, default=None, help="the resident variant's bonus ρ (default 0.25)")
    ap.add_argument("--rg-strength", type=float, default=None, help="gating's bias, in multiples of a token's gap (default 1)")
    ap.add_argument("--no-rate-guard", action="store_true", help="AE speculates even where it is measured slower than AR")
    ap.add_argument("--draft-topk", default=None, help="draft experts per token, K or K,LAYER:K,... (default: the "
                    "profile's, else k/2)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of the whole sweep")
    ap.add_argument("--out", default="docs/results/speculative")
    args = ap.parse_args()

    from s2moe.runtime.bench import run_bench
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.cli.spec_options import make_settings
    from s2moe.runtime.decoding.estimate import estimate_costs
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.profile import load_profile
    from s2moe.runtime.decoding.sampling import SamplingParams
    from s2moe.runtime.model.tokenizer import load_tokenizer

    engine_kw = ({"emulate_bandwidth": args.emulate_bandwidth, "emulate_latency": args.emulate_latency}
                 if args.emulate_bandwidth else {})
    loaded = load_model(args.model or str(DEFAULT_MODEL))
    tok = load_tokenizer(loaded)
    prof = load_profile(args.profile) if args.profile else None
    from s2moe.runtime.decoding.methods import SpecSettings

    settings = make_settings(loaded.config, args.draft_topk, None, None, None, args.rg_variant or SpecSettings.rg_variant, prof,
                             rg_residency=SpecSettings.rg_residency if args.rg_residency is None else args.rg_residency,
                             rg_strength=SpecSettings.rg_strength if args.rg_strength is None else args.rg_strength,
                             rate_guard=not args.no_rate_guard)
    methods = args.methods.split(",")
    records: list[Record] = []
    for rep in range(args.reps):
        for budget in args.budgets.split(","):
            for workload in args.workloads.split(","):
                print(f"repetition {rep + 1} · budget {budget} · {workload}", file=sys.stderr)
                rs = run_bench(loaded, tok, workload, methods, budget, args.n_prompts, args.max_tokens, settings,
                               prof.costs if prof else None, SamplingParams(), estimate=estimate_costs,
                               engine_kw=engine_kw, live=not args.no_live_costs, hot=args.hot_experts)
                for r in rs:
                    r.params["repetition"] = rep + 1
                    r.params["hot_experts"] = args.hot_experts
                records += rs
    write_outputs(records, machine_info(), args.out, "speculative decoding")
    print_summary(records)


def print_summary(records) -> None:
    """Markdown: per (budget, workload, method) medians over repetitions, the per-repetition
    speedups, and where a generated token's time goes (ms, medians)."""
    med = statistics.median
    groups: dict = {}
    for r in records:
        groups.setdefault((r.params["budget"], r.params["workload"], r.name), []).append(r)
    print("| budget | workload | method | tok/s | speedup vs AR (per repetition) | acceptance length | "
          "tokens per verification | AR steps | reuse ratio | KiB fetched/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (budget, workload, name), rs in groups.items():
        x = [r.extra for r in rs]
        reuse = [e["reuse_ratio"] for e in x if e["reuse_ratio"] is not None]
        ups = [e["speedup_vs_ar"] for e in x if e["speedup_vs_ar"] is not None]  # none without an AR run
        speedup = f"**{med(ups):.2f}×** ({', '.join(f'{u:.2f}' for u in ups)})" if ups else "-"
        # acceptance length counts AR steps (the rate guard's, back-off) as one token each
        per_verify = [e["tokens_per_verification"] for e in x if e.get("tokens_per_verification") is not None]
        ar_steps = [e["steps"]["ar_steps"] for e in x if "steps" in e]
        print(f"| {budget} | {workload} | {name} | {med(e['decode_tokens_per_s_aggregate'] for e in x):.1f} | "
              f"{speedup} | "
              f"{med(e['acceptance_length'] for e in x):.2f} | {f'{med(per_verify):.2f}' if per_verify else '-'} | "
              f"{f'{med(ar_steps):.0f}' if ar_steps else '-'} | {f'{med(reuse):.3f}' if reuse else '-'} | "
              f"{med(e['bytes_fetched_per_token'] for e in x) / 1024:.0f} |")
    parts = ("draft_compute", "verify_compute", "other_compute", "fetch_critical", "fetch_hidden", "total")
    print("\n| budget | workload | method | " + " | ".join(parts) + " |")
    print("|---|---|---|" + "---|" * len(parts))
    for (budget, workload, name), rs in groups.items():
        print(f"| {budget} | {workload} | {name} | " +
              " | ".join(f"{med(r.extra['ms_per_token'][k] for r in rs):.1f}" for k in parts) + " |")


if __name__ == "__main__":
    main()
