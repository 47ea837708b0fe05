"""Power of tests/test_sampled_speculation.py against broken samplers (the numbers in its docstring).

For each fixed-length case of that test, the exact law of the tokens it compares is computed by
enumeration for the correct speculative sampler and for each mutant:
  always      accept every draft token
  resample_p  on rejection, resample from p instead of max(p − q, 0)
  q_over_p    accept with min(1, q/p) instead of min(1, p/q)
  bonus_q     draw the bonus token (all drafts accepted) from the draft instead of the target
Then, with the test's pooling (cells with expected count < 5 merged) and false-alarm level α, the
power of Pearson's chi-square is the noncentral chi-square tail with λ = n · Σ (p₁ − p₀)² / p₀.

Usage: python tools/spec_power.py [--n N ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from scipy import stats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from stub_model import START, exact_law, table_draft, table_target  # noqa: E402
from test_sampled_speculation import ALPHA, CASES, truncated  # noqa: E402

from s2moe.runtime.decoding.sampling import SamplingParams  # noqa: E402

MUTANTS = ("always", "resample_p", "q_over_p", "bonus_q")


def chain_law(p_of, q_of, ctx: tuple, need: int, L: int, variant: str) -> dict[tuple, float]:
    """Law of the next ``need`` emitted tokens when every iteration drafts exactly L tokens."""
    if need <= 0:
        return {(): 1.0}
    out: dict[tuple, float] = {}

    def emit(seq, pr, new_ctx):
        if len(seq) >= need:
            out[seq[:need]] = out.get(seq[:need], 0.0) + pr
            return
        for rest, pp in chain_law(p_of, q_of, new_ctx, need - len(seq), L, variant).items():
            out[seq + rest] = out.get(seq + rest, 0.0) + pr * pp

    def step(c, i, pr, acc):
        p = p_of(c)
        if i == L:  # bonus token
            b = q_of(c) if variant == "bonus_q" else p
            for t in np.nonzero(b)[0]:
                emit(acc + (int(t),), pr * b[t], c + (int(t),))
            return
        q = q_of(c)
        for d in np.nonzero(q)[0]:
            d = int(d)
            if variant == "always":
                a = 1.0
            elif variant == "q_over_p":
                a = min(1.0, q[d] / p[d]) if p[d] > 0 else 1.0
            else:
                a = min(1.0, p[d] / q[d])
            if a > 0:
                step(c + (d,), i + 1, pr * q[d] * a, acc + (d,))
            if a < 1:
                r = p.copy() if variant == "resample_p" else np.maximum(p - q, 0.0)
                r = r / r.sum() if r.sum() > 0 else p
                for t in np.nonzero(r)[0]:
                    emit(acc + (int(t),), pr * q[d] * (1 - a) * r[t], c + (int(t),))

    step(ctx, 0, 1.0, ())
    return out


def power(null: dict, alt: dict, n: int, alpha: float) -> tuple[float, float, int, float]:
    """(power, w², df, mass the alternative puts on outcomes the target cannot produce)."""
    big = sorted(k for k, p in null.items() if p * n >= 5)
    small = [k for k in null if k not in big]
    impossible = sum(v for k, v in alt.items() if k not in null)
    p0 = np.array([null[k] for k in big] + ([sum(null[k] for k in small)] if small else []))
    p1 = np.array([alt.get(k, 0.0) for k in big] + ([sum(alt.get(k, 0.0) for k in small)] if small else []))
    w2 = float(((p1 - p0) ** 2 / p0).sum())
    df = len(p0) - 1
    chi = float(stats.ncx2.sf(stats.chi2.ppf(1 - alpha, df), df, n * w2))
    # the test also fails as soon as one impossible outcome is observed
    return 1 - (1 - chi) * (1 - impossible) ** n, w2, df, impossible


def generic_power(null: dict, n: int, alpha: float, tv: float) -> tuple[float, int]:
    """Power against any law whose pooled cells differ from the target's by TV ≥ ``tv``:
    Cauchy–Schwarz gives Σ(p₁−p₀)²/p₀ ≥ (Σ|p₁−p₀|)² = 4·TV²."""
    big = sum(1 for p in null.values() if p * n >= 5)
    df = big - (0 if big < len(null) else 1)
    return float(stats.ncx2.sf(stats.chi2.ppf(1 - alpha, df), df, n * 4 * tv ** 2)), df


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="*", help="sample counts to evaluate (default: each case's)")
    args = ap.parse_args()
    print(f"alpha = {ALPHA:g}")
    for name, (method, cap, temperature, top_k, n_tokens, n_case, *_rest) in CASES.items():
        params = SamplingParams(temperature=temperature, top_k=top_k)
        p_of, q_of = truncated(table_target, params), truncated(table_draft, params)
        null = exact_law(p_of, (START,), n_tokens)
        for n in args.n or [n_case]:
            g15, df = generic_power(null, n, ALPHA, 0.15)
            g20, _ = generic_power(null, n, ALPHA, 0.20)
            print(f"{name}: {len(null)} outcomes, n {n}, df {df}: power vs any pooled TV ≥ 0.15 {g15:.4f}, "
                  f"≥ 0.20 {g20:.4f}")
        if method != "ca":
            continue
        # the first token is the prefill's sample (fixed by the tables); the chain starts after it
        first = {k[1:]: v for k, v in null.items()}
        correct = chain_law(p_of, q_of, (START, 0), n_tokens - 1, cap, "correct")
        gap = max(abs(first.get(k, 0) - correct.get(k, 0)) for k in set(first) | set(correct))
        print(f"  the correct sampler's exact law equals the target law (max gap {gap:.1e})")
        for variant in MUTANTS:
            alt = {(0,) + k: v for k, v in chain_law(p_of, q_of, (START, 0), n_tokens - 1, cap, variant).items()}
            tv = 0.5 * sum(abs(null.get(k, 0) - alt.get(k, 0)) for k in set(null) | set(alt))
            for n in args.n or [n_case]:
                pw, w2, df, imp = power(null, alt, n, ALPHA)
                print(f"  {variant:10s} TV {tv:.3f}  n {n:5d}  w² {w2:.4f}  df {df:3d}  impossible mass {imp:.3f}  "
                      f"power {pw:.6f}")


if __name__ == "__main__":
    main()
