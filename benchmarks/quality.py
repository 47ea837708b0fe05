"""Backs docs/performance/s2moe-gating.md, "Residency-aware gating by default" (and "The price of a
stronger bias"; docs/performance/s2moe-real-size.md, "A stronger bias"): reuse-aware gating's PPL
ratio and top-1 agreement against the unmodified target, with bootstrap intervals.

What reuse-aware gating costs in quality: the paper's Table 2 measures for every non-lossless
setting, against the unmodified target, on held-out text.

    python benchmarks/quality.py [--model DIR] [--budget 0.25] [--windows 12] [--batch 5]

Held-out text: the default model's held-out split (stdlib files it never saw, tools/corpus.py).
Each window is decoded with perfect drafts (teacher forcing): after a 32-token prefill, batches of
``--batch`` tokens are verified twice from the same committed KV, once by the unmodified target and
once with the gating variant (draft confidences from a draft pass over the same tokens, as in a
run; the fast tier at ``--budget``, as in a run, so the "resident" variant sees real residency).
Per position: KL(p_target ‖ p_gated), RMS of p_target − p_gated over the vocabulary, whether the
top-1 tokens agree, and the log-likelihood of the true next token under each (PPL ratio =
exp(mean NLL gated − mean NLL target)). Only the target's KV is committed.

Variants marked λ×s gate with s times the paper's bias (`--rg-strength s`): the price of reading less.

Intervals (95 %) come from resampling whole windows. Every variant after ``paper`` is also paired
with it, window by window: the quotient of the two PPL ratios and the difference of the top-1
agreements, with their intervals (``vs_paper``), which says whether a variant costs more than the
paper's gating does.

Results: a table on stderr, JSON/CSV at --out (e.g. docs/results/quality-budgets/, gating-strength/quality-b5.*).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from benchmarks.common import Record, machine_info, write_outputs  # noqa: E402

VARIANTS = [("paper", {}), ("code", {}), ("resident ρ=0.25", {"residency": 0.25}),
            ("resident ρ=0.5", {"residency": 0.5}), ("resident ρ=1", {"residency": 1.0}),
            ("resident ρ=2", {"residency": 2.0}), ("resident ρ=1 λ×1.1", {"residency": 1.0, "strength": 1.1}),
            ("resident ρ=1 λ×1.25", {"residency": 1.0, "strength": 1.25}),
            ("resident ρ=1 λ×1.5", {"residency": 1.0, "strength": 1.5}), ("resident ρ=1 λ×2", {"residency": 1.0, "strength": 2.0}),
            ("resident ρ=0.25 λ×1.25", {"residency": 0.25, "strength": 1.25}),
            ("resident ρ=0.25 λ×2", {"residency": 0.25, "strength": 2.0})]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def measure(model_dir: str, budget: str, variant: str, options: dict, windows: list[np.ndarray], batch: int,
            draft_topk: int) -> dict:
    from s2moe.runtime.decoding.gating import ReuseGating
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.routing import TARGET, RoutingPolicy

    engine = build_engine(model_dir, budget, 512)
    model, cache = engine.model, engine.cache
    c = model.config
    draft = RoutingPolicy(top_k=draft_topk)
    kl, rms, agree, nll_t, nll_g = [], [], [], [], []
    per_window = []  # (Σ NLL gated − target, positions, top-1 agreements): windows are the independent units
    for ids in windows:
        mark = (len(nll_t), len(agree))
        kv = model.new_cache(len(ids) + batch + 1)
        model.forward(ids[:32], kv, logits="last", record=False)
        kv.commit(32)
        for i in range(32, len(ids) - batch, batch):
            toks = ids[i:i + batch]
            P = kv.length
            # draft confidences of each batch token (what a run's gating weighs tokens by)
            d_logits, _ = model.forward(toks, kv, start=P, policy=draft, record=False)
            q = np.exp(log_softmax(d_logits))
            conf = np.concatenate([[1.0], [q[j - 1, toks[j]] for j in range(1, len(toks))]])
            kv.rollback(P)
            avail = (lambda L: cache.available_mask(L, c.num_experts)) if variant.startswith("resident") else None
            rg = ReuseGating(c.top_k, 2 * c.top_k, variant.split()[0], options.get("strength", 1.0), conf,
                             options.get("residency", 0.5), avail)
            g_logits, _ = model.forward(toks, kv, start=P, policy=RoutingPolicy(selection_bias=rg.bias), record=False)
            kv.rollback(P)
            t_logits, _ = model.forward(toks, kv, start=P, policy=TARGET, record=False)
            kv.commit(P + len(toks))  # only the unmodified target's KV goes on
            lt, lg = log_softmax(t_logits), log_softmax(g_logits)
            pt, pg = np.exp(lt), np.exp(lg)
            kl.extend((pt * (lt - lg)).sum(-1))
            rms.extend(np.sqrt(((pt - pg) ** 2).mean(-1)))
            agree.extend(pt.argmax(-1) == pg.argmax(-1))
            nxt = ids[i + 1:i + 1 + len(toks)]
            rows = np.arange(len(nxt))
            nll_t.extend(-lt[rows, nxt])
            nll_g.extend(-lg[rows, nxt])
        n0, a0 = mark
        per_window.append((float(np.sum(nll_g[n0:]) - np.sum(nll_t[n0:])), len(nll_t) - n0, int(np.sum(agree[a0:]))))
    engine.close()
    lo, hi = bootstrap(per_window)
    return {"mean_kl": float(np.mean(kl)), "rms_dp": float(np.mean(rms)), "top1_agreement": float(np.mean(agree)),
            "ppl_ratio": float(math.exp(np.mean(nll_g) - np.mean(nll_t))), "positions": len(kl),
            "ppl_target": float(math.exp(np.mean(nll_t))), "ppl_ratio_ci95": [lo[0], hi[0]],
            "top1_agreement_ci95": [lo[1], hi[1]], "per_window": per_window}


def _resampled(x: np.ndarray, y: np.ndarray, seed: int, draws: int = 2000):
    """Rows (Σ NLL gated − target, positions, top-1 agreements) per window: the PPL-ratio quotient
    and the top-1 difference of x over y in each of ``draws`` resamples of whole windows, taken
    together (positions within a window share their context, so they are not independent)."""
    pick = np.random.default_rng(seed).integers(0, len(x), (draws, len(x)))
    n = x[pick, 1].sum(1)
    return np.exp((x[pick, 0] - y[pick, 0]).sum(1) / n), (x[pick, 2] - y[pick, 2]).sum(1) / n


def _ci95(v: np.ndarray) -> list[float]:
    return [float(np.quantile(v, 0.025)), float(np.quantile(v, 0.975))]


def paired(a: list, b: list, seed: int = 1) -> dict:
    """Variant a against variant b on the same windows: the quotient of their PPL ratios and the
    difference of their top-1 agreements, with 95 % intervals from resampling windows together."""
    x, y = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    quotient, top1 = _resampled(x, y, seed)
    return {"ppl_ratio_quotient": float(math.exp((x[:, 0] - y[:, 0]).sum() / x[:, 1].sum())),
            "ppl_ratio_quotient_ci95": _ci95(quotient),
            "top1_difference": float((x[:, 2] - y[:, 2]).sum() / x[:, 1].sum()), "top1_difference_ci95": _ci95(top1)}


def bootstrap(per_window: list[tuple[float, int, int]], seed: int = 0):
    """95 % intervals of the PPL ratio and top-1 agreement: ((ppl low, top-1 low), (ppl high, top-1 high))."""
    d = np.array(per_window, dtype=np.float64)
    (p_lo, p_hi), (t_lo, t_hi) = map(_ci95, _resampled(d, np.zeros_like(d), seed))
    return (p_lo, t_lo), (p_hi, t_hi)


def main() -> None:
    from s2moe.runtime.cli.common import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--batch", type=int, default=5, help="verification batch (root + drafts)")
    ap.add_argument("--draft-topk", type=int, default=2)
    ap.add_argument("--variants", default=",".join(name for name, _ in VARIANTS),
                    help="comma-separated names from: " + ", ".join(name for name, _ in VARIANTS))
    ap.add_argument("--out", default="docs/results/quality")
    args = ap.parse_args()
    chosen = sorted((v.strip() for v in args.variants.split(",")), key=lambda v: v != "paper")  # paper first: the pair
    unknown = [v for v in chosen if v not in dict(VARIANTS)]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}")

    from evaluate_model import stream
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    loaded = load_model(args.model, dense=False)
    tok = load_tokenizer(loaded)
    eos = loaded.config.eos_token_ids[0] if loaded.config.eos_token_ids else 0
    heldout = stream(tok, "heldout", eos)
    starts = np.linspace(0, len(heldout) - args.window - 2, args.windows).astype(int)
    windows = [heldout[s:s + args.window + 1].astype(np.int64) for s in starts]
    records, measured = [], {}
    for name, options in [(v, dict(VARIANTS)[v]) for v in chosen]:
        q = measure(args.model, args.budget, name, options, windows, args.batch, args.draft_topk)
        measured[name] = q
        if name != "paper" and "paper" in measured:  # paired with the paper's variant, window by window
            q["vs_paper"] = paired(q["per_window"], measured["paper"]["per_window"])
        print(f"{name}: { {k: v for k, v in q.items() if k != 'per_window'} }", file=sys.stderr)
        records.append(Record("quality", name, "ppl_ratio", [q["ppl_ratio"]],
                              params={"model": os.path.basename(args.model.rstrip("/")), "budget": args.budget,
                                      "draft_topk": args.draft_topk,
                                      "batch": args.batch, "windows": args.windows, "window": args.window},
                              extra=q))
    write_outputs(records, machine_info(), args.out, "reuse-aware gating vs the unmodified target (held-out text)")


if __name__ == "__main__":
    main()
