"""Backs docs/performance/sampling.md, "Standard vs coupled sampling": what a reproducible seed costs
in acceptance.

What the coupled sampler costs in acceptance: standard vs coupled sampled speculation on the same
prompts, seeds and draft lengths (embedded default model, or --model).

    python benchmarks/samplers.py [--model DIR] [--n-prompts 8] [--max-tokens 48] [--cap 4]
                                  [--temperatures 0.7,1.0] [--seeds 2]

Method ca (a fixed-length draft, no AE, no gating) so the draft lengths do not follow timings: every
number here is a count, the same on any machine for one commit. Per (temperature, sampler): drafted
and accepted tokens, the acceptance rate and the acceptance length (tokens per verification). At
the first draft position of every standard verification it also records the two acceptance
probabilities that position offers, from its own p and q: Σ min(p, q) (standard) and the Gumbel
coupling rate Σ_i 1 / Σ_j max(p_j/p_i, q_j/q_i) (coupled), so the gap is measured on identical
laws, not only on two different sample paths. Writes docs/results/samplers.json/.csv (records
with machine and commit) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (Record, machine_info, prompts_of, resident_model, unused_costs,  # noqa: E402
                               write_outputs)


def gumbel_rate(p: np.ndarray, q: np.ndarray) -> float:
    """P(argmax(log p + g) = argmax(log q + g)) for Gumbel noise g."""
    both = np.nonzero((p > 0) & (q > 0))[0]
    return float(sum(1.0 / np.maximum(p / p[i], q / q[i]).sum() for i in both))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", default="gsm8k")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cap", type=int, default=4, help="draft length")
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    ap.add_argument("--out", default="docs/results/samplers")
    args = ap.parse_args()

    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.sampling import SamplingParams, probabilities
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder

    path, engine, tok = resident_model(args.model)
    prompts = prompts_of(tok, [args.workload], args.n_prompts)
    costs = unused_costs()
    records: list[Record] = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for sampler in ("standard", "coupled"):
            drafted = accepted = verifications = 0
            rates: list[float] = []
            offered: dict[str, list[float]] = {"standard": [], "coupled": []}
            for i, ids in enumerate(prompts):
                for seed in range(args.seeds):
                    params = SamplingParams(temperature=temperature, seed=1000 * i + seed, sampler=sampler)
                    dec = SpeculativeDecoder(engine.model, get_method("ca", reuse_gating=False),
                                             SpecSettings(draft_cap=args.cap), costs, params)
                    if sampler == "standard":
                        accept = dec._accept_chain

                        def spy(logits, d, *rest, _accept=accept, _params=params):
                            if d.tokens:
                                p, q = probabilities(logits[0], _params), d.dists[0]
                                offered["standard"].append(float(np.minimum(p, q).sum()))
                                offered["coupled"].append(gumbel_rate(p, q))
                            return _accept(logits, d, *rest)

                        dec._accept_chain = spy
                    dec.generate(ids, args.max_tokens)
                    m = dec.metrics
                    drafted, accepted, verifications = drafted + m.drafted, accepted + m.accepted, verifications + m.verifications
                    if m.drafted:
                        rates.append(m.accepted / m.drafted)
            extra = {"drafted": drafted, "accepted": accepted, "verifications": verifications,
                     "acceptance_rate": accepted / max(drafted, 1),
                     "acceptance_length": (accepted + verifications) / max(verifications, 1)}
            if offered["standard"]:
                extra.update(first_position_standard=statistics.mean(offered["standard"]),
                             first_position_coupled=statistics.mean(offered["coupled"]),
                             first_positions=len(offered["standard"]))
            records.append(Record("samplers", f"{sampler} T{temperature}", "acceptance rate per run", rates,
                                  params={"model": os.path.basename(path.rstrip("/")), "workload": args.workload,
                                          "n_prompts": len(prompts), "seeds": args.seeds, "draft_cap": args.cap,
                                          "max_tokens": args.max_tokens, "temperature": temperature,
                                          "sampler": sampler},
                                  extra=extra))
            print(f"T {temperature} {sampler}: {extra}", file=sys.stderr)
    engine.close()
    write_outputs(records, machine_info(), args.out, "standard vs coupled sampling")
    print("| T | sampler | drafted | acceptance rate | acceptance length | first position: Σ min(p,q) | "
          "first position: Gumbel rate |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        e = r.extra
        first = (f"{e['first_position_standard']:.3f} | {e['first_position_coupled']:.3f}"
                 if "first_position_standard" in e else "- | -")
        print(f"| {r.params['temperature']} | {r.params['sampler']} | {e['drafted']} | {e['acceptance_rate']:.3f} | "
              f"{e['acceptance_length']:.2f} | {first} |")


if __name__ == "__main__":
    main()
