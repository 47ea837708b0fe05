"""How many experts a draft should read ahead, at equal process memory.

    python benchmarks/prefetch_slots.py --model WIDENED [--slots 0,4,8,16] [--budgets 0.25,0.1]
                                        [--workloads humaneval,gsm8k,mt-bench] [--reps 3] [--n-prompts 3]

Under a share budget every method runs in the same memory (offload/memory.py): the prefetch slots
a drafting run reads into come out of its expert cache, and AR, which reads nothing ahead, caches
them. So more slots hide more of verification's reads behind the draft, and leave fewer experts
resident. Each repetition runs, per budget and workload, AR and then S²-MoE at every slot count,
the order of the slot counts rotated between repetitions; a speedup is taken against the AR run
just before it. Writes the raw records to docs/results/prefetch-slots.json/.csv and prints a
markdown table (medians over repetitions, then each repetition's ratio).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the widened model (tools/widen_model.py)")
    ap.add_argument("--slots", default="0,4,8,16", help="prefetch slot counts for S²-MoE (8 = 2 × top-k, the default)")
    ap.add_argument("--budgets", default="0.25,0.1")
    ap.add_argument("--workloads", default="humaneval,gsm8k,mt-bench")
    ap.add_argument("--method", default="s2moe")
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--emulate-bandwidth", type=float, default=None, help="emulated slow tier, MB/s")
    ap.add_argument("--emulate-latency", type=float, default=0.0, help="emulated request latency, µs")
    ap.add_argument("--out", default="docs/results/prefetch-slots")
    args = ap.parse_args()

    from s2moe.runtime.bench import run_bench
    from s2moe.runtime.cli.spec_options import make_settings
    from s2moe.runtime.decoding.estimate import estimate_costs
    from s2moe.runtime.decoding.sampling import SamplingParams
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    loaded = load_model(args.model)
    tok = load_tokenizer(loaded)
    base = make_settings(loaded.config, None, None, None, None, "paper", None)  # the gating its recorded runs used
    slots = [int(s) for s in args.slots.split(",")]
    engine_kw = ({"emulate_bandwidth": args.emulate_bandwidth, "emulate_latency": args.emulate_latency}
                 if args.emulate_bandwidth else {})
    records: list[Record] = []
    for rep in range(args.reps):
        order = slots[rep % len(slots):] + slots[:rep % len(slots)]  # rotate: no count always runs first
        for budget in args.budgets.split(","):
            for workload in args.workloads.split(","):
                print(f"repetition {rep + 1} · budget {budget} · {workload} · slots {order}", file=sys.stderr)
                bench = lambda method, settings: run_bench(  # noqa: E731
                    loaded, tok, workload, [method], budget, args.n_prompts, args.max_tokens, settings, None,
                    SamplingParams(), estimate=estimate_costs, live=True, engine_kw=engine_kw)[0]
                ar = bench("ar", base)
                ar.params.update(repetition=rep + 1, prefetch_slots=0)
                records.append(ar)
                for n in order:
                    r = bench(args.method, dataclasses.replace(base, prefetch_slots=n))
                    r.params.update(repetition=rep + 1, prefetch_slots=n)
                    r.extra["speedup_vs_ar"] = r.extra["decode_tokens_per_s_aggregate"] / \
                        ar.extra["decode_tokens_per_s_aggregate"]
                    records.append(r)
    write_outputs(records, machine_info(), args.out, "prefetch slots at equal memory")
    summary(records)


def summary(records) -> None:
    med = statistics.median
    groups: dict = {}
    for r in records:
        groups.setdefault((r.params["budget"], r.params["workload"], r.name, r.params["prefetch_slots"]), []).append(r)
    print("| budget | tier | workload | method | slots | tok/s | speedup vs AR (per repetition) | MB fetched/token | "
          "fetch on the critical path (ms/token) | acceptance length |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (budget, workload, name, n), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3])):
        x = [r.extra for r in rs]
        ups = [e["speedup_vs_ar"] for e in x if e.get("speedup_vs_ar") is not None and name != "ar"]
        up = f"**{med(ups):.2f}×** ({', '.join(f'{u:.2f}' for u in ups)})" if ups else "-"
        tier = rs[0].params.get("emulation") or "disk"
        print(f"| {budget} | {tier} | {workload} | {name} | {n} | {med(e['decode_tokens_per_s_aggregate'] for e in x):.1f} | "
              f"{up} | {med(e['bytes_fetched_per_token'] for e in x) / 1e6:.1f} | "
              f"{med(e['ms_per_token']['fetch_critical'] for e in x):.1f} | "
              f"{med(e['acceptance_length'] for e in x):.2f} |")


if __name__ == "__main__":
    main()
