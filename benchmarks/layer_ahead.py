"""What-if: prefetch a layer's experts from the layer before it. An instrument, not a feature.

    python benchmarks/layer_ahead.py [--model DIR] [--n-prompts 4] [--tokens 32]

An AR step under a budget waits on the reads of the experts it misses (on the embedded model at
25 %, about half of a token's time). Those reads could start a layer early if the next layer's
experts were known: apply layer L+d's router to layer L's MoE input, rescaled from L's norm weights
to L+d's (the residual stream before L+d's norm is approximated by the one before L's). This
counts, for greedy AR decoding with every expert resident (only routing matters here), the share
of layer L+d's chosen experts that this guess names, for d = 1 and 2. For comparison: the share
the previous token's choice at the same layer names (what a cache of recent experts already
holds). Softmax routers (top-k of the logits). One sample per prompt. Writes
docs/results/layer-ahead.json/.csv.

With ``--prefetch BUDGET`` it instead times AR under that budget with the guess acted on: before
each layer's experts, the next layer's guessed experts that are absent start reading as prefetches
(into the cache, as a draft's do; settled after each pass), the top 1, 2 or 4 guesses against none,
taking turns (`--reps`), 64 tokens per prompt. The tokens must equal plain AR's (checked). Writes
``--out``-prefetch.json/.csv.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.counting import prompts_of  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

WORKLOADS = ("humaneval", "gsm8k", "mt-bench")


class Guesser:
    """Layer L+d's router on layer L's MoE input, rescaled from L's norm weights to L+d's (zero
    where L's weight is zero: the widened model's padding). Scales are made once per layer pair."""

    def __init__(self, model):
        c, W = model.config, model.W
        norms = [np.asarray(W[f"layers.{L}.ffn_norm"], np.float32) for L in range(c.num_layers)]
        self.routers = [np.asarray(W[f"layers.{L}.router"], np.float32) for L in range(c.num_layers)]
        self.scales = {(L, d): np.divide(norms[L + d], norms[L], out=np.zeros_like(norms[L]), where=norms[L] != 0)
                       for L in range(c.num_layers) for d in (1, 2) if L + d < c.num_layers}

    def guess(self, L: int, d: int, x: np.ndarray, n: int) -> list[int]:
        """The ``n`` experts of layer L+d the guess ranks first, from one token's input ``x`` [H]."""
        logits = x * self.scales[(L, d)] @ self.routers[L + d].T
        return np.argsort(-logits, kind="stable")[:n].tolist()


def shares(model, ids: list[int], tokens: int) -> dict[str, float]:
    """Over ``tokens`` greedy steps after ``ids``: the share of each guess's hits in the experts chosen."""
    c = model.config
    inputs: dict[int, np.ndarray] = {}
    real = model._moe

    def moe(L, x, policy, rec, norm=None):  # note each layer's MoE input
        inputs[L] = np.array(x, dtype=np.float32)
        return real(L, x, policy, rec, norm)

    model._moe = moe
    try:
        guesser = Guesser(model)
        kv = model.new_cache(len(ids) + tokens + 1)
        logits, _ = model.forward(ids, kv, logits="last")
        kv.commit(kv.filled)
        token, previous = int(logits[-1].argmax()), None
        hits = {"layer ahead, d=1": [0, 0], "layer ahead, d=2": [0, 0], "previous token, same layer": [0, 0]}
        for _ in range(tokens):
            logits, rec = model.forward([token], kv, logits="last")
            kv.commit(kv.filled)
            chosen = {L: set(rec.layers[L].experts[0].tolist()) for L in rec.layers}
            for L in chosen:
                for d in (1, 2):
                    if L + d in chosen:
                        named = set(guesser.guess(L, d, inputs[L][0], c.top_k))
                        h = hits[f"layer ahead, d={d}"]
                        h[0] += len(named & chosen[L + d])
                        h[1] += len(chosen[L + d])
                if previous is not None:
                    h = hits["previous token, same layer"]
                    h[0] += len(previous[L] & chosen[L])
                    h[1] += len(chosen[L])
            previous, token = chosen, int(logits[-1].argmax())
    finally:
        model._moe = real
    return {k: h[0] / h[1] for k, h in hits.items() if h[1]}


def guessing(engine, guesses: int) -> None:
    """Make ``engine``'s AR passes prefetch the next layer's ``guesses`` top guessed experts."""
    model, cache, c = engine.model, engine.model.experts, engine.model.config
    guesser = Guesser(model)
    real_moe, real_forward = model._moe, model.forward

    def moe(L, x, policy, rec, norm=None):
        if x.shape[0] == 1 and cache.phase == "ar" and L + 1 < c.num_layers:
            top = guesser.guess(L, 1, x[0], guesses)
            cache.prefetch([(L + 1, e) for e in top if (L + 1, e) not in cache.held])
        return real_moe(L, x, policy, rec, norm)

    def forward(*a, **k):
        try:
            return real_forward(*a, **k)
        finally:
            if cache.phase == "ar":
                cache.settle_prefetches()  # what the pass did not use: kept in its room, or dropped

    model._moe, model.forward = moe, forward


def time_prefetch(loaded, tok, budget: str, n_prompts: int, reps: int) -> list:
    from s2moe.runtime.decoding.cost_model import CostConstants
    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder
    from s2moe.runtime.engine import build_engine

    c = loaded.config
    prompts = prompts_of(tok, ["humaneval"], n_prompts, tail=512)
    sides = {}
    for guesses in (0, 1, 2, c.top_k):
        engine = build_engine(loaded.path, budget, 700, loaded=loaded, prefetch_slots=2 * c.top_k if guesses else None)
        if guesses:
            guessing(engine, guesses)
        decoder = SpeculativeDecoder(engine.model, get_method("ar"), SpecSettings(),
                                     CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=1e-3, t_exp_hit=1e-4))
        decoder.generate(prompts[0][:16], 4)  # warm-up, untimed
        sides[guesses] = (engine, decoder, [])
    texts: dict = {}
    for rep in range(reps):
        for guesses in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
            engine, decoder, samples = sides[guesses]
            tokens, seconds = 0, 0.0
            for i, ids in enumerate(prompts):
                result = decoder.generate(ids, 64)
                tokens, seconds = tokens + len(result.tokens) - 1, seconds + result.decode_seconds
                texts.setdefault(guesses, {})[i] = result.tokens
            samples.append(tokens / seconds)
    records = []
    for guesses, (engine, _, samples) in sides.items():
        if texts[guesses] != texts[0]:
            raise SystemExit(f"error: AR with {guesses} guesses a layer ahead changed the tokens")
        report = engine.cache.report()["prefetch"]
        records.append(Record("layer-ahead-prefetch", f"{guesses} guesses a layer ahead" if guesses else "plain AR",
                              "tok/s", samples,
                              params={"budget": budget, "n_prompts": len(prompts), "max_tokens": 64, "guesses": guesses},
                              extra={"ratio_to_plain": [s / p for s, p in zip(samples, sides[0][2])],
                                     "prefetch": {k: report[k] for k in ("issued", "used", "wasted", "kept")}}))
        engine.close()
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default="docs/results/layer-ahead")
    ap.add_argument("--prefetch", metavar="BUDGET", help="time AR under this budget with the guess acted on")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    loaded = load_model(args.model or str(DEFAULT_MODEL))
    tok = load_tokenizer(loaded)
    if args.prefetch:
        records = time_prefetch(loaded, tok, args.prefetch, args.n_prompts, args.reps)
        write_outputs(records, machine_info(), args.out + "-prefetch", "AR prefetching its guesses a layer ahead")
        for r in records:
            print(r.name, f"{r.median:.1f} tok/s", "ratio", [f"{x:.2f}" for x in r.extra["ratio_to_plain"]], r.extra["prefetch"])
        return
    records = []
    model = build_engine(loaded.path, None, 1024, loaded=loaded).model
    for workload in WORKLOADS:
        per: dict[str, list[float]] = {}
        for ids in prompts_of(tok, [workload], args.n_prompts, tail=200):
            for name, share in shares(model, ids, args.tokens).items():
                per.setdefault(name, []).append(share)
        records += [Record("layer-ahead", f"{workload}: {name}", "share of chosen experts named", samples,
                           params={"workload": workload, "model": os.path.basename(loaded.path.rstrip("/")),
                                   "tokens": args.tokens, "top_k": loaded.config.top_k})
                    for name, samples in per.items()]
    write_outputs(records, machine_info(), args.out, "layer-ahead expert guesses (what-if)")


if __name__ == "__main__":
    main()
