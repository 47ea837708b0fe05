"""A stand-in for `MoEModel` whose next-token distributions are known functions of the context.

`SpeculativeDecoder` drives it exactly as it drives the real model (forward passes into a real
`KVCache`, draft policy vs target policy, rollback, commit, tree masks), but the stub's logits are
log-probabilities read from two small tables, so the law of the generated tokens can be computed
exactly and compared with what the decoder produces.

The stub keeps the *token id* of every cache slot in the KV cache's key array: the context a pass
sees is whatever the decoder left in the cache, so a rollback or commit mistake shows up as a
wrong distribution, just as it would with real attention.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from s2moe.runtime.model.kv_cache import KVCache
from s2moe.runtime.model.routing import TARGET, LayerRouting, RoutingRecord


class StubModel:
    """``target(ctx)`` and ``draft(ctx)`` map a context (tuple of token ids) to a probability vector
    over the vocabulary. A pass whose policy sets a top-k override is the draft's."""

    def __init__(self, target, draft, vocab: int, experts_of=None):
        """``experts_of(token)``: the two experts (of 4) a token routes to; given, every pass
        records one MoE layer whose router logits pick exactly those (AE's ΔC_ver reads them)."""
        self.target_dist, self.draft_dist = target, draft
        self.experts_of = experts_of
        self.config = SimpleNamespace(top_k=2, num_experts=4, vocab_size=vocab, num_layers=1)
        self.experts = None  # no expert cache: nothing resident, no phases
        self.passes = {"draft": 0, "target": 0}
        self._logs: dict[tuple, np.ndarray] = {}

    def _log_dist(self, is_draft: bool, ctx: tuple) -> np.ndarray:
        key = (is_draft, ctx)
        row = self._logs.get(key)
        if row is None:
            with np.errstate(divide="ignore"):
                row = self._logs[key] = np.log(np.asarray((self.draft_dist if is_draft else self.target_dist)(ctx),
                                                          np.float64))
        return row

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(1, 1, 1, capacity)

    def forward(self, tokens, kv: KVCache, start=None, policy=TARGET, logits="all", record=True, positions=None,
                tree_mask=None, head=None):
        """``head``: a draft head (model/draft_head.py): the logits of its tokens, −inf elsewhere."""
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        T = len(tokens)
        start = kv.filled if start is None else start
        kv.begin_write(start, T)
        ids = np.asarray(tokens, np.float32).reshape(1, T, 1)
        kv.write(0, start, ids, ids)
        is_draft = policy.top_k is not None or bool(policy.layer_top_k)
        self.passes["draft" if is_draft else "target"] += 1
        prefix = tuple(int(t) for t in kv.keys[0][0, :start, 0])
        rows = []
        for i in range(T):
            if tree_mask is None:
                ctx = prefix + tuple(tokens[:i + 1])
            else:
                ctx = prefix + tuple(tokens[j] for j in range(T) if tree_mask[i, j])
            rows.append(self._log_dist(is_draft, ctx))
        out = np.stack(rows[-1:] if logits == "last" else rows)
        out = out if head is None else head.expand(out[:, head.ids])
        return out, (self._record(tokens) if record else None)

    def _record(self, tokens) -> RoutingRecord:
        rec = RoutingRecord()
        if self.experts_of is not None:
            chosen = np.array([sorted(self.experts_of(t)) for t in tokens], dtype=np.int64)
            router = np.zeros((len(tokens), self.config.num_experts), np.float32)
            np.put_along_axis(router, chosen, 1.0, axis=-1)
            rec.layers[0] = LayerRouting(router, chosen, np.full(chosen.shape, 0.5, np.float32))
        return rec


# A small vocabulary (0, 1, 2; token 3 = START appears only in the prompt) and two Markov-style
# tables keyed by (last token, context length mod 2): the target p and the draft q differ by a total
# variation of 0.3–0.4 in every context, each has a zero the other fills (p(1 | 1, even) = 0 while
# q gives it 0.3; q(1 | 2, even) = 0, so that token is reachable only through the residual), and the
# parity makes a pass that sees the wrong number of context tokens draw from the wrong row.
START, VOCAB = 3, 4
TARGET_TABLE = {(0, 0): (.5, .3, .2), (0, 1): (.2, .5, .3), (1, 0): (.6, 0., .4), (1, 1): (.1, .3, .6),
                (2, 0): (.3, .3, .4), (2, 1): (0., .7, .3)}
DRAFT_TABLE = {(0, 0): (.2, .3, .5), (0, 1): (.5, .2, .3), (1, 0): (.3, .3, .4), (1, 1): (.4, .4, .2),
               (2, 0): (.7, 0., .3), (2, 1): (.3, .5, .2)}


def table_target(ctx: tuple) -> np.ndarray:
    if ctx[-1] == START:  # the first generated token is fixed: it is sampled by the prefill, not drafted
        return np.array([1., 0., 0., 0.])
    return np.array([*TARGET_TABLE[ctx[-1], len(ctx) % 2], 0.])


def table_draft(ctx: tuple) -> np.ndarray:
    if ctx[-1] == START:
        return np.array([1 / 3, 1 / 3, 1 / 3, 0.])
    return np.array([*DRAFT_TABLE[ctx[-1], len(ctx) % 2], 0.])


def exact_law(target, prompt: tuple, n: int) -> dict[tuple, float]:
    """Probability of every length-``n`` continuation of ``prompt`` under ``target`` (zeros left out)."""
    law = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, p in law.items():
            dist = np.asarray(target(tuple(prompt) + seq), np.float64)
            for t in np.nonzero(dist)[0]:
                nxt[seq + (int(t),)] = p * dist[t]
        law = nxt
    return law

