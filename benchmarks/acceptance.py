"""Is the draft's confidence an acceptance probability? The calibration table behind AE's learned p_i.

    python benchmarks/acceptance.py [--model DIR] [--n-prompts 4] [--max-tokens 64] [--cap 8]
                                    [--temperatures 0,1.0]

Method ca (a fixed-length draft, no AE, no gating) on HumanEval, GSM8K and MT-Bench prompts, so
what is drafted never follows timings: every number is a count, the same on any machine for one
commit. Each verified draft token (those up to its chain's first rejection) is a pair (q = the
draft's probability of the token, kept or not); per confidence bin: how many, their mean q and the
share kept. A calibrated draft has share kept ≈ mean q, which is what the paper's AE assumes.
Writes docs/results/acceptance-calibration.json/.csv and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.counting import prompts_of, resident_model, unused_costs  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

BINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
WORKLOADS = ("humaneval", "gsm8k", "mt-bench")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF folder (default: the embedded model)")
    ap.add_argument("--n-prompts", type=int, default=4, help="per workload")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cap", type=int, default=8, help="draft length")
    ap.add_argument("--temperatures", default="0,1.0", help="0 = greedy; > 0: standard sampling, seed 0")
    ap.add_argument("--out", default="docs/results/acceptance-calibration")
    args = ap.parse_args()

    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.sampling import SamplingParams
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder

    path, engine, tok = resident_model(args.model)
    prompts = prompts_of(tok, WORKLOADS, args.n_prompts, tail=512)
    costs = unused_costs()
    records: list[Record] = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        pairs: list[tuple[float, bool]] = []
        for i, ids in enumerate(prompts):
            params = SamplingParams(temperature=temperature, seed=i if temperature > 0 else None,
                                    sampler="standard")
            dec = SpeculativeDecoder(engine.model, get_method("ca", reuse_gating=False),
                                     SpecSettings(draft_cap=args.cap), costs, params)
            accept = dec._accept_chain

            def spy(logits, d, *rest, _accept=accept):
                n, nxt = _accept(logits, d, *rest)
                pairs.extend((q, k < n) for k, q in enumerate(d.token_probs[: n + 1]))
                return n, nxt

            dec._accept_chain = spy
            dec.generate(ids, args.max_tokens)
        q = np.array([p for p, _ in pairs])
        kept = np.array([k for _, k in pairs], dtype=float)
        rows = []
        for lo, hi in zip(BINS, BINS[1:]):
            m = (q >= lo) & ((q < hi) if hi < 1.0 else (q <= hi))
            if m.any():
                rows.append({"q": [lo, hi], "tokens": int(m.sum()), "mean_q": round(float(q[m].mean()), 4),
                             "kept": round(float(kept[m].mean()), 4)})
        records.append(Record("acceptance", f"T{temperature:g}", "kept (per verified draft token)", kept.tolist(),
                              params={"model": os.path.basename(path.rstrip("/")), "workloads": list(WORKLOADS),
                                      "n_prompts": len(prompts), "draft_cap": args.cap, "max_tokens": args.max_tokens,
                                      "temperature": temperature},
                              extra={"bins": rows, "tokens": len(pairs), "mean_q": round(float(q.mean()), 4),
                                     "kept": round(float(kept.mean()), 4)}))
    engine.close()
    write_outputs(records, machine_info(), args.out, "draft confidence vs acceptance")
    print("| T | q bin | tokens | mean q | share kept |")
    print("|---|---|---|---|---|")
    for r in records:
        for row in r.extra["bins"]:
            print(f"| {r.params['temperature']:g} | {row['q'][0]:.2f}–{row['q'][1]:.2f} | {row['tokens']} | "
                  f"{row['mean_q']:.3f} | {row['kept']:.3f} |")
        print(f"| {r.params['temperature']:g} | all | {r.extra['tokens']} | {r.extra['mean_q']:.3f} | "
              f"{r.extra['kept']:.3f} |")


if __name__ == "__main__":
    main()
