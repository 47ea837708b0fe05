"""How many experts the draft takes, chosen by measurement (`s2moe-calib profile` without
--draft-topk; `benchmarks/draft_topk.py`, at commit 807e4cc, printed the same figures).

One more draft expert costs what it adds to a draft pass and gains the draft tokens it makes the
target keep. Both depend on the device and the model: on the embedded model (168 KiB experts) three
draft experts ran 1.42x AR on HumanEval against 1.19x with two, on the widened copy (3 MiB experts)
two were best (docs/performance/s2moe-draft.md, "How many experts the draft takes").

The target decodes the prompts greedily at the budget, so its cache evolves as AR's does. Before
each target step every candidate k drafts a greedy chain of ``cap`` tokens from the same root on
the same shared KV (context alignment), experts restricted to the resident ones as runs draft, in a
rotating order, and the chain is rolled back: every k meets the same conditions, step by step,
which a drifting machine needs. Per k: ``kept``, how many chain tokens match the target's
continuation before the first miss (what greedy verification keeps), and the draft passes' seconds.
The model: a chain of g ≤ cap tokens yields 1 + E[min(kept, g)] tokens for g · C_draft + T_AR (a
verification costing about one AR step). It leaves out AE's choices and verification's extra
experts: it ranks k, it does not predict a speedup.

Tokens kept vary a lot from step to step: over 144 steps of the default prompts the means of k = 1..4
came out 2.83, 2.79, 2.62, 2.94, where 768 steps of HumanEval, GSM8K and MT-Bench gave 3.64, 4.62,
4.92, 5.26. So a k replaces the paper's k/2 only when its modeled speed beats k/2's by more than
two standard errors of the paired difference over prompts (each prompt a block), as `hot.py`
pins experts.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np


def candidates(top_k: int, default: int) -> list[int]:
    """The draft k worth measuring: 1 up to twice the paper's default (at least two past it)."""
    return list(range(1, min(top_k, max(2 * default, default + 2)) + 1))


def matched(chain: list[int], truth: list[int]) -> int:
    """How many of ``chain`` equal ``truth`` before the first difference."""
    n = 0
    for a, b in zip(chain, truth):
        if a != b:
            break
        n += 1
    return n


def _per_step(kept: list[int], g: int, c_draft: float, t_ar: float) -> list[float]:
    """Each step's modeled tokens per T_AR with chains of g (g = 0: AR, 1 token per T_AR)."""
    scale = t_ar / (g * c_draft + t_ar)
    return [(1.0 + min(m, g)) * scale for m in kept]


def modeled(kept: list[int], c_draft: float, t_ar: float, cap: int) -> tuple[int, float]:
    """(best chain length, tokens per T_AR) for the matched lengths ``kept`` and these costs;
    chain length 0 is AR (1 token per T_AR)."""
    best = (0, 1.0)
    for g in range(1, cap + 1):
        rate = statistics.mean(_per_step(kept, g, c_draft, t_ar)) if kept else t_ar / (g * c_draft + t_ar)
        if rate > best[1]:
            best = (g, rate)
    return best


def measure(model, prompts: list[list[int]], tokens: int, ks: list[int], cap: int, policy_for: Callable,
            tick: Callable[[], None] = lambda: None) -> dict:
    """Drafts of every k beside a greedy target decode; returns {"t_ar": [s], "c_draft": {k: [s]},
    "kept": {k: [int]}} (``kept`` only for steps with ``cap`` target tokens after them)."""
    from s2moe.runtime.engine import phase_of

    chains: dict[int, list[list[int]]] = {k: [] for k in ks}
    truth: list[list[int]] = []
    c_draft: dict[int, list[float]] = {k: [] for k in ks}
    t_ar: list[float] = []
    policies = {k: policy_for(k) for k in ks}
    step = 0
    block: list[int] = []  # per step: its prompt
    for b, ids in enumerate(prompts):
        if len(ids) < 2:  # a root and something before it
            continue
        kv = model.new_cache(len(ids) + tokens + cap + 2)
        model.forward(ids[:-1], kv, logits="last")
        kv.commit(len(ids) - 1)
        root, emitted, first = ids[-1], [], len(truth)
        for _ in range(tokens):
            at = kv.filled
            with phase_of(model, "draft"):
                for k in ks[step % len(ks):] + ks[:step % len(ks)]:
                    chain, x = [], root
                    for _ in range(cap):
                        t0 = time.perf_counter()
                        out, _ = model.forward([x], kv, policy=policies[k], logits="last")
                        c_draft[k].append(time.perf_counter() - t0)
                        x = int(np.argmax(out[-1]))
                        chain.append(x)
                    chains[k].append(chain)
                    kv.rollback(at)
            t0 = time.perf_counter()
            out, _ = model.forward([root], kv, logits="last")
            t_ar.append(time.perf_counter() - t0)
            kv.commit(at + 1)
            root = int(np.argmax(out[-1]))
            emitted.append(root)
            truth.append([])
            block.append(b)
            step += 1
        for j in range(len(emitted)):  # a step's truth: what the target emitted from it on
            truth[first + j] = emitted[j:]
        tick()
    counted = [i for i, tr in enumerate(truth) if len(tr) >= cap]
    kept = {k: [matched(chains[k][i], truth[i]) for i in counted] for k in ks}
    first_ok = {k: sum(ch[0] == tr[0] for ch, tr in zip(chains[k], truth) if tr) / max(1, len(truth)) for k in ks}
    return {"t_ar": t_ar, "c_draft": c_draft, "kept": kept, "first_token_agreement": first_ok,
            "blocks": [block[i] for i in counted]}


def margin(a: list[float], b: list[float], blocks: list[int]) -> tuple[float, float]:
    """(mean of a − b, its standard error over blocks: the paired differences' block means)."""
    by: dict[int, list[float]] = {}
    for x, y, blk in zip(a, b, blocks):
        by.setdefault(blk, []).append(x - y)
    means = [statistics.mean(v) for v in by.values()]
    if len(means) < 2:
        return statistics.mean(means) if means else 0.0, float("inf")
    return statistics.mean(means), statistics.stdev(means) / len(means) ** 0.5


def choose(measured: dict, cap: int, default: int) -> tuple[int, dict]:
    """(the draft k to use, a record of every candidate's figures). ``default`` (the paper's k/2)
    stays unless a candidate models faster by more than 2 standard errors of the paired difference;
    among those that do, the fastest (a tie: fewer experts)."""
    t_ar = statistics.median(measured["t_ar"])
    blocks = measured["blocks"]
    table, steps = {}, {}
    for k in sorted(measured["c_draft"]):
        cd = statistics.median(measured["c_draft"][k])
        kept = measured["kept"][k]
        g, rate = modeled(kept, cd, t_ar, cap)
        steps[k] = _per_step(kept, g, cd, t_ar)
        table[k] = {"c_draft_ms": round(cd * 1e3, 4), "mean_kept": round(statistics.mean(kept), 3) if kept else 0.0,
                    "first_token_agreement": round(measured["first_token_agreement"][k], 4),
                    "best_chain": g, "modeled_tokens_per_t_ar": round(rate, 4)}
    base = default if default in table else min(table)
    for k in table:
        if k != base:
            mean, se = margin(steps[k], steps[base], blocks)
            table[k]["over_default"] = {"mean": round(mean, 4), "standard_error": round(se, 4)}
    winners = [k for k in table if k != base and table[k]["over_default"]["mean"] > 2 * table[k]["over_default"]["standard_error"]]
    best = max(sorted(winners), key=lambda k: (table[k]["modeled_tokens_per_t_ar"], -k)) if winners else base
    return best, {"chosen": best, "default": base, "rule": "the default unless another k models faster by > 2 SE",
                  "t_ar_ms": round(t_ar * 1e3, 4), "cap": cap, "steps": len(measured["t_ar"]),
                  "candidates": {str(k): v for k, v in table.items()}}
