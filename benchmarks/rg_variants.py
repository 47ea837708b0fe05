"""Reuse-aware gating variants under a budget: what each does to the bytes a generated token reads
and to the tokens a verification keeps, on the same prompts.

    python benchmarks/rg_variants.py --model WIDENED --budgets 0.25,0.1 \
        --workloads humaneval,gsm8k,mt-bench --n-prompts 16 \
        --variants "paper,resident=0.25,resident=0.5" --out docs/results/rg-variants/widened

Each variant is `s2moe` with that gating. AE's constants come from a profile and stay fixed
(``--profile-pattern``, default the widened model's LFU profiles in docs/results/residency/), so
what is drafted depends only on the model, the cache and the gating: the counts below are the same
on any machine. Greedy, 64 tokens, EOS ignored, one engine per (budget, variant) with its cache
warm across the prompts, as `s2moe bench` runs them.

Records: acceptance length (tokens per verification), MB read per generated token (all decode
reads, prefetches included) and the verification misses per token as ``samples``: one per workload,
in the order given; ``extra.prefetch`` holds the prefetch counters per workload, with verification's
misses split by why no prefetch served them. Decode tok/s is kept as ``extra`` for orientation only; it is timed on a shared
machine, not alternated, and `benchmarks/speculative.py` is the measure of speed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

PROFILES = "docs/results/residency/profiles/cpu-widened-{budget}-nohot.json"


def variant_settings(spec: str) -> dict:
    """"paper", "code" or "resident=RHO" → SpecSettings fields."""
    name, _, rho = spec.partition("=")
    return {"rg_variant": name, **({"rg_residency": float(rho)} if rho else {})}


def run(model: str, budget: str, variant: str, costs, prompts: dict[str, list[list[int]]], loaded) -> dict:
    from s2moe.runtime.bench import phase_bytes as decode_reads  # decode's reads: not load, estimate, prefill
    from s2moe.runtime.bench import prefetch_counts
    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder
    from s2moe.runtime.engine import build_engine

    spec, settings = get_method("s2moe"), SpecSettings(**variant_settings(variant))
    engine = build_engine(model, budget, 1024, loaded=loaded, prefetch_slots=settings.slots_for(spec))
    decoder = SpeculativeDecoder(engine.model, spec, settings, costs)
    first = next(iter(prompts.values()))[0]
    decoder.generate(first[:16], 4)  # warm-up, as bench does
    out = {}
    for workload, ids in prompts.items():
        start = engine.cache.report()
        before, misses0 = decode_reads(start), engine.cache.stats["verify"].misses
        tokens = verifications = 0
        seconds = 0.0
        for p in ids:
            r = decoder.generate(p, 64)
            tokens += len(r.tokens) - 1
            seconds += r.decode_seconds
            verifications += r.metrics.verifications + r.metrics.ar_steps
        out[workload] = {"acceptance_length": tokens / max(verifications, 1),
                         "mb_per_token": (decode_reads(engine.cache.report()) - before) / max(tokens, 1) / 1e6,
                         "verify_misses_per_token": (engine.cache.stats["verify"].misses - misses0) / max(tokens, 1),
                         "tok_s": tokens / seconds if seconds else 0.0,
                         "prefetch": prefetch_counts(start, engine.cache.report())}
    engine.close()
    return out


def main() -> None:
    from s2moe.runtime.bench import resolve_workload
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer
    from s2moe.runtime.profile import load_profile
    from s2moe.runtime.prompts import load_workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/work/models/widened", help="tools/widen_model.py output (hidden 1024)")
    ap.add_argument("--budgets", default="0.25,0.1")
    ap.add_argument("--workloads", default="humaneval,gsm8k,mt-bench")
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--variants", default="paper,resident=0.25,resident=0.5")
    ap.add_argument("--profile-pattern", default=PROFILES, help="a profile per budget ({budget} is replaced)")
    ap.add_argument("--ae-whole-tier", action="store_true",
                    help="ablation: AE's prediction favours every expert the tier holds or is reading, as before "
                         "05a7162, instead of those the variant's E* takes")
    ap.add_argument("--out", default="docs/results/rg-variants/widened")
    args = ap.parse_args()
    if args.ae_whole_tier:
        from s2moe.runtime.decoding.speculative import SpeculativeDecoder

        def whole_tier(self, layer, logits):
            avail = self._available(layer)
            return False if avail is None else avail

        SpeculativeDecoder._tier_in_preferred_set = whole_tier
    loaded = load_model(args.model)
    tok = load_tokenizer(loaded)
    workloads = args.workloads.split(",")
    prompts = {w: [tok.encode(p).ids[-512:] for p in load_workload(resolve_workload(w))[:args.n_prompts]]
               for w in workloads}
    records = []
    for budget in args.budgets.split(","):
        costs = load_profile(args.profile_pattern.format(budget=budget)).costs
        for variant in args.variants.split(","):
            got = run(args.model, budget, variant, costs, prompts, loaded)
            params = {"model": os.path.basename(args.model.rstrip("/")), "budget": budget, "variant": variant,
                      "workloads": workloads, "n_prompts": args.n_prompts, "max_tokens": 64,
                      "costs": "fixed, " + args.profile_pattern.format(budget=budget),
                      "ae_prediction": "whole tier" if args.ae_whole_tier else "E*"}
            for measure, unit in (("acceptance_length", "tokens per verification"), ("mb_per_token", "MB per token"),
                                  ("verify_misses_per_token", "verification misses per token")):
                records.append(Record("rg-variants", f"{budget} {variant} {measure}", unit,
                                      [round(got[w][measure], 4) for w in workloads], params=params,
                                      extra={"tok_s_untimed_order": [round(got[w]["tok_s"], 2) for w in workloads],
                                             "prefetch": [got[w]["prefetch"] for w in workloads]}))
            print(f"| {budget} | {variant} | " + " | ".join(
                f"{got[w]['acceptance_length']:.2f} / {got[w]['mb_per_token']:.2f}" for w in workloads) + " |", flush=True)
    write_outputs(records, machine_info(), args.out, "reuse-aware gating variants under a budget")


if __name__ == "__main__":
    main()
