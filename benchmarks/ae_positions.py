"""What each draft position adds to verification: AE's ΔC_ver by position, from drafts forced to the cap.

    python benchmarks/ae_positions.py --out docs/results/acceptance/positions-25.json \
        -- --model WIDENED -b 0.25 -w humaneval --n-prompts 3 --profile P.json --no-live-costs

Runs `s2moe bench --methods s2moe --utility-threshold 0` (every draft reaches the cap, so every
position is priced) with AE's pricing logged: per draft token its acceptance probability p_j, the
prefix P_j, ΔC_ver(j|S) under the prices in use, and per draft the count verification kept. Prints
the mean ΔC_ver and P_j by position. This tested the hypothesis behind `--ae-lookahead`: that the
first draft token carries most of a batch's new experts (docs/performance.md, "AE's lookahead").
The figures are AE's prices, not times, so they repeat on a busy machine with fixed constants.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record_drafts(bench_args: list[str]) -> list[dict]:
    """Run the bench in this process with AE's pricing wrapped; one dict per draft."""
    from s2moe.runtime.cli import app
    from s2moe.runtime.decoding import speculative as sp

    drafts: list[dict] = []
    chain, p_accept, price, learn = (sp.SpeculativeDecoder._draft_chain, sp.SpeculativeDecoder._p_accept,
                                     sp.marginal_verification_cost, sp.SpeculativeDecoder._learn_acceptance)

    def logged_chain(self, *args, **kwargs):
        drafts.append({"p": [], "delta": [], "miss_price": self.costs.t_exp_miss})
        return chain(self, *args, **kwargs)

    def logged_p(self, q):
        drafts[-1]["p"].append(p := p_accept(self, q))
        return p

    def logged_price(new, state, costs):
        drafts[-1]["delta"].append(d := price(new, state, costs))
        return d

    def logged_learn(self, d, accepted):
        drafts[-1]["kept"] = accepted
        return learn(self, d, accepted)

    sp.SpeculativeDecoder._draft_chain, sp.SpeculativeDecoder._p_accept = logged_chain, logged_p
    sp.marginal_verification_cost, sp.SpeculativeDecoder._learn_acceptance = logged_price, logged_learn
    try:
        app(["bench", "--methods", "s2moe", "--utility-threshold", "0", *bench_args], standalone_mode=False)
    finally:
        sp.SpeculativeDecoder._draft_chain, sp.SpeculativeDecoder._p_accept = chain, p_accept
        sp.marginal_verification_cost, sp.SpeculativeDecoder._learn_acceptance = price, learn
    return [d for d in drafts if "kept" in d and d["delta"]]


def by_position(drafts: list[dict], key: str, cap: int) -> list[float]:
    rows = np.full((len(drafts), cap), np.nan)
    for i, d in enumerate(drafts):
        values = np.cumprod(d["p"]) if key == "P" else np.asarray(d[key]) * 1e3
        rows[i, :len(values[:cap])] = values[:cap]
    return [round(float(v), 3) for v in np.nanmean(rows, axis=0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the drafts and the means here (JSON)")
    ap.add_argument("--cap", type=int, default=8, help="positions reported (the draft cap)")
    ap.add_argument("bench", nargs="*", help="`s2moe bench` flags (after --)")
    args = ap.parse_args()
    drafts = record_drafts(args.bench)
    if not drafts:
        sys.exit("no draft was verified: check the bench flags")
    summary = {"drafts": len(drafts), "delta_ms_by_position": by_position(drafts, "delta", args.cap),
               "P_by_position": by_position(drafts, "P", args.cap),
               "kept_mean": round(float(np.mean([d["kept"] for d in drafts])), 3)}
    print(json.dumps(summary))
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({**summary, "bench_flags": args.bench, "raw": drafts}, f)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
