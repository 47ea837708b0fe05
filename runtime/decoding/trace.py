"""Routing traces (`s2moe run|bench --trace FILE`): what each pass of a run asked of the expert
cache, so that `s2moe-calib predict` can replay it through another device's cost model and budget.

One record per method: its generated tokens, its measured decode seconds here, and its passes in
order, each ``[phase, n_tokens, keys]`` with ``phase`` one of prefill / ar / draft / verify and
``keys`` the distinct experts the pass requested, in request order, as ``layer * E + expert``.

Version 2 adds what lets `predict` re-make AE's decisions with another device's costs (the passes
above hold this device's decisions: on a fast disk mostly AR steps, where a slow tier drafts far
more). Each run keeps its ``prompts`` and ``texts`` (per prompt, the token ids given and
generated), its ``settings`` (`SpecSettings.trace_dict`) and, for a greedy AE method, ``drafts``:
per prompt, per text position j, the draft chain a draft from the text's token j would make, up to
the draft cap, ``[root_keys, [[token, q, plain, gated], ...], rows, kept]``: ``q`` the draft's
confidence; ``plain`` the experts the target would route that token to as predicted at draft time
(what the draft prefetches), ``gated`` the same under reuse-aware gating with the chain so far
(what AE prices); ``rows`` the experts each row of one verification of the whole chain used (root
first); ``kept``, how many draft tokens that verification accepted (greedy: the target's pick,
under gating where the method gates, equals the draft token). The tables hold this device's
residency; with the prompts and settings `predict` can draw them again with another's
(`DraftWalk`). Written as JSON (temp file + rename, the umask's mode).
"""

from __future__ import annotations

import json

import numpy as np

from .. import jsonfile
from ..errors import UsageError

VERSION = 2
READABLE = (1, 2)


class TraceRecorder:
    def __init__(self, loaded, budget: str | None, emulation: str | None = None):
        from ..profile import model_fingerprint

        c = loaded.config
        self.data = {"s2moe_trace": VERSION, "model": {"path": loaded.path, "fingerprint": model_fingerprint(loaded),
                                                       "experts_per_layer": c.num_experts, "top_k": c.top_k},
                     "recorded": {"budget": budget or "1.0", "emulation": emulation}, "runs": []}
        self._cache = None

    def start(self, cache) -> None:
        """Record the passes ``cache`` serves from now on."""
        cache.trace = []
        self._cache = cache

    def stop(self, method: str, tokens: int, decode_seconds: float, texts: list[list[int]] = (),
             settings: dict | None = None, prompts: list[list[int]] = ()) -> None:
        cache, self._cache = self._cache, None
        E = self.data["model"]["experts_per_layer"]
        passes = [[phase, n, [L * E + e for L, e in keys]] for phase, n, keys in cache.trace]
        cache.trace = None
        self.data["runs"].append({"method": method, "tokens": int(tokens), "decode_seconds": float(decode_seconds),
                                  "passes": passes, "texts": [[int(t) for t in x] for x in texts],
                                  **({"prompts": [[int(t) for t in x] for x in prompts]} if prompts else {}),
                                  **({"settings": settings} if settings else {})})

    def record_drafts(self, decoder, prompts: list[list[int]], texts: list[list[int]]) -> None:
        """The last run's draft table (see the module's docstring), from ``decoder`` (greedy) along
        ``texts``, AR's text for each prompt. Untimed: it runs after the run it belongs to."""
        self.data["runs"][-1]["drafts"] = [draft_table(decoder, p, t) for p, t in zip(prompts, texts)]

    def write(self, path: str) -> None:
        from ..outputs import write_atomic

        write_atomic(path, json.dumps(self.data, separators=(",", ":")) + "\n")


def draft_table(decoder, prompt: list[int], text: list[int]) -> list:
    """Per position j < len(text) − 1: `DraftWalk.row` (the module's docstring says what a row holds)."""
    walk = DraftWalk(decoder, prompt, text)
    return [walk[j] for j in range(len(text) - 1)]


class DraftWalk:
    """AR's text of one prompt, walked position by position: ``walk[j]``, with the committed context
    ``prompt + text[:j]`` (the target's KV, shared as context alignment shares it), is the draft
    chain from ``text[j]``, ``draft_cap`` tokens long, as the decoder drafts it, and one verification
    of the whole chain under the method's routing (reuse-aware gating included): each row's experts,
    and how many draft tokens it accepts. Each position then commits ``text[j]`` by a target pass,
    as an AR step would; so j only goes forward.

    The draft and the gating see the residency of ``decoder.cache``: the run's own cache when a
    trace is recorded, the other device's simulated cache when `predict` draws the chains again."""

    def __init__(self, decoder, prompt: list[int], text: list[int]):
        from ..engine import phase_of

        self.decoder, self.text, self.model = decoder, text, decoder.model
        self.kv = self.model.new_cache(len(prompt) + len(text) + decoder.settings.draft_cap + 2)
        with phase_of(self.model, "prefill"):
            self.model.forward(prompt, self.kv, logits="last", record=False)
        self.kv.commit(len(prompt))
        self.at = 0  # text positions committed

    def __len__(self) -> int:
        return max(len(self.text) - 1, 0)

    def __getitem__(self, j: int) -> list:
        from ..engine import phase_of
        from .sampling import draws_for

        if not self.at <= j < len(self):
            raise IndexError(f"draft walk at {self.at}: position {j} is behind it or past the text")
        d, model, kv = self.decoder, self.model, self.kv
        while self.at < j:
            self._commit()
        cap, E = d.settings.draft_cap, model.config.num_experts
        keys = lambda pairs: sorted(L * E + e for L, e in pairs)  # noqa: E731
        draft = {"policy": d.draft_policy, "logits": "last", "head": d.draft_head}
        gate = d.method.admit == "utility"
        draws, root, P = draws_for(d.params), self.text[j], kv.length
        chain = []
        with phase_of(model, "draft"):
            logits, rec = model.forward([root], kv, **draft)
            root_keys = d.predictions(rec, None)[0]
            selected = set(root_keys)
            for i in range(cap):
                token, q, _ = d.pick(logits[-1], draws, j + 1 + i)
                logits, rec = model.forward([token], kv, **draft)
                plain, gated = d.predictions(rec, selected if gate else None)
                gated = plain if gated is None else gated
                selected |= gated  # what AE's ΔC_ver sees when it drafts this far
                chain.append([int(token), round(float(q), 6), keys(plain), keys(gated)])
        kv.rollback(P)
        batch = [root] + [t for t, _, _, _ in chain]
        with phase_of(model, "verify"):
            policy = d.verify_policy([1.0] + [q for _, q, _, _ in chain])
            out, rec = model.forward(batch, kv, start=P, policy=policy)
        picks = [int(i) for i in np.argmax(np.asarray(out), axis=-1)]  # greedy: the target's pick after each row
        kept = next((i for i in range(cap) if picks[i] != chain[i][0]), cap)
        verified = [keys({(L, int(e)) for L, r in rec.layers.items() for e in r.experts[t] if e >= 0})
                    for t in range(len(batch))]
        kv.rollback(P)
        self._commit()
        return [keys(root_keys), chain, verified, kept]

    def _commit(self) -> None:
        from ..engine import phase_of

        P = self.kv.length
        with phase_of(self.model, "ar"):
            self.model.forward([self.text[self.at]], self.kv, logits="last", record=False)
        self.kv.commit(P + 1)
        self.at += 1


def load_trace(path: str) -> dict:
    """A trace file, checked enough that a replay cannot fail half-way."""
    try:
        with open(path, encoding="utf-8") as f:
            data = jsonfile.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such trace; record one with s2moe bench --trace {path}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not a trace (not JSON: {exc}); record one with s2moe bench --trace") from None
    if not isinstance(data, dict) or data.get("s2moe_trace") not in READABLE:
        raise UsageError(f"{path}: not an s2moe trace of version {VERSION}; record it again with s2moe bench --trace")
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs:
        raise UsageError(f"{path}: runs: no recorded runs")
    E = data.get("model", {}).get("experts_per_layer")
    if not isinstance(E, int) or E <= 0:
        raise UsageError(f"{path}: model.experts_per_layer must be a positive integer")
    for i, run in enumerate(runs):
        where = f"{path}: runs[{i}]"
        if not isinstance(run, dict) or not isinstance(run.get("method"), str):
            raise UsageError(f"{where}.method: missing")
        if not isinstance(run.get("tokens"), int) or run["tokens"] < 1:
            raise UsageError(f"{where}.tokens: must be a positive integer")
        for j, p in enumerate(run.get("passes") or []):
            if not (isinstance(p, list) and len(p) == 3 and p[0] in ("prefill", "ar", "draft", "verify", "estimate")
                    and isinstance(p[1], int) and isinstance(p[2], list)
                    and all(isinstance(k, int) and k >= 0 for k in p[2])):
                raise UsageError(f"{where}.passes[{j}]: expected [phase, n_tokens, [expert keys]]")
        drafts, texts = run.get("drafts"), run.get("texts")
        if drafts is not None and not (isinstance(drafts, list) and isinstance(texts, list)
                                       and len(drafts) == len(texts)
                                       and all(isinstance(d, list) and len(d) == max(len(t) - 1, 0)
                                               and all(isinstance(e, list) and len(e) == 4 for e in d)
                                               for d, t in zip(drafts, texts))):
            raise UsageError(f"{where}.drafts: expected one draft chain per text position of each prompt; "
                             "record the trace again with s2moe bench --trace")
    return data
