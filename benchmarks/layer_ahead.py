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


def shares(model, ids: list[int], tokens: int) -> dict[str, float]:
    """Over ``tokens`` greedy steps after ``ids``: the share of each guess's hits in the experts chosen."""
    c, W = model.config, model.W
    inputs: dict[int, np.ndarray] = {}
    real = model._moe

    def moe(L, x, policy, rec, norm=None):  # note each layer's MoE input
        inputs[L] = np.array(x, dtype=np.float32)
        return real(L, x, policy, rec, norm)

    model._moe = moe
    try:
        norms = [np.asarray(W[f"layers.{L}.ffn_norm"], np.float32) for L in range(c.num_layers)]
        routers = [np.asarray(W[f"layers.{L}.router"], np.float32) for L in range(c.num_layers)]
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
                        scale = np.divide(norms[L + d], norms[L], out=np.zeros_like(norms[L]), where=norms[L] != 0)
                        guess = inputs[L][0] * scale @ routers[L + d].T
                        named = set(np.argsort(-guess, kind="stable")[:c.top_k].tolist())
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default="docs/results/layer-ahead")
    args = ap.parse_args()

    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    loaded = load_model(args.model or str(DEFAULT_MODEL))
    model = build_engine(loaded.path, None, 1024, loaded=loaded).model
    tok = load_tokenizer(loaded)
    records = []
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
