"""Self-speculative decoding: expert-sparse self-draft, context alignment, adaptive expansion,
reuse-aware gating; and the baselines that share this loop (see `methods.py`).

One iteration, with P committed KV positions and a pending token ``root`` (emitted, not in KV):
  1. draft from ``root`` with the draft top-k, one token at a time (KV written past P);
  2. admit draft token i while its rule allows (AE: U_i = p_i·T_AR / (ΔC_ver(i|S) + C_draft) ≥ θ, or,
     with a lookahead, the prefix whose summed gain p_i·T_AR − θ·(ΔC_ver + C_draft) is largest);
  3. roll the shared KV back to P, verify [root, d_1..d_n] in one target pass (RG bias if on);
  4. accept (greedy match, coupled match, or speculative sampling), commit the target-computed KV of
     root and the accepted drafts, emit the accepted drafts and the target's next token (the new root).
Greedy and coupled sampling (`sampling.py`) accept a draft token iff it is the target's own pick at its
position, so their text is AR's; standard sampling accepts with min(1, p/q).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from .cost_model import CostConstants, UtilityRule, expected_tokens, marginal_verification_cost
from .live_costs import LiveCosts
from .prefetch_trial import trial_for
from .rate_guard import RateGuard
from ..engine import phase_of
from .generate import GenerationResult
from .gating import ReuseGating
from ..model.kv_cache import KVCache
from .methods import MethodSpec, SpecSettings
from ..model.forward import MoEModel
from ..model.routing import TARGET, RoutingPolicy, RoutingRecord, softmax, top_k_indices
from .acceptance import AcceptanceModel
from .sampling import SamplingParams, draws_for, probabilities, sample
from .metrics import SpecMetrics

Key = tuple[int, int]


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    token_probs: list[float] = field(default_factory=list)  # q(d_i) of each draft token
    p_accept: list[float] = field(default_factory=list)  # AE's P(d_i accepted | d_<i accepted) when drafted
    # the law d_i has *given that it was admitted* (standard sampling only): q(·) under a fixed-length
    # rule and AE (which stops after a token rather than dropping it), q restricted to {q ≥ θ} under
    # the confidence rule; None where verification needs no law (greedy, coupled, a forced tree branch)
    dists: list[np.ndarray | None] = field(default_factory=list)

    def truncate(self, n: int) -> None:
        for seq in (self.tokens, self.token_probs, self.p_accept, self.dists):
            del seq[n:]


@dataclass
class SpecResult(GenerationResult):
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    def stats(self) -> dict:
        return {**super().stats(), **self.metrics.to_dict(len(self.tokens))}


class SpeculativeDecoder:
    def __init__(self, model: MoEModel, method: MethodSpec, settings: SpecSettings, costs: CostConstants,
                 params: SamplingParams = SamplingParams(), live: bool = False, residency=None):
        """``live``: AE's constants follow the passes this decoder makes (LiveCosts), starting
        from ``costs``; otherwise ``costs`` stay fixed. ``residency``: the expert cache whose
        residency the draft and gating see, if not the model's own (`predict` draws chains with
        another device's simulated cache; such a decoder only drafts, it does not generate)."""
        c = model.config
        self.model, self.method, self.costs, self.params = model, method, costs, params
        self.live = LiveCosts(costs) if live else None
        # speculation only while it is measured faster than AR steps (follows the clock: live runs only)
        self.guard = RateGuard() if live and settings.rate_guard and method.admit == "utility" else None
        self.settings = settings.validate(c.top_k, c.num_experts)
        self.top_k = c.top_k
        self.cache = model.experts if residency is None else residency
        self.trial = trial_for(model, method, settings, live)  # prefetch where measured to pay, or None
        resident = getattr(self.cache, "resident_mask", None) if settings.draft_resident else None
        self.draft_policy = RoutingPolicy(top_k=settings.draft_topk, layer_top_k=dict(settings.layer_draft_topk),
                                          allowed=(lambda L: resident(L, c.num_experts)) if resident else None,
                                          fallback=settings.draft_fallback)
        # FR-Spec: a draft head over the most frequent tokens (None: the full head, or AR, which drafts
        # nothing and whose memory plan has no room for one)
        self.draft_head = (model.draft_head(settings.draft_vocab, settings.token_ranks)
                           if settings.draft_vocab and method.admit != "none" else None)
        self.metrics = SpecMetrics()
        self._cascade_k: int | None = None
        # AE's acceptance probabilities: learned from this decoder's verifications (kept across
        # prompts, as live costs are), or the draft's confidence as the paper has it
        self.acceptance = AcceptanceModel() if method.admit == "utility" else None
        self._learned = settings.acceptance == "learned"
        self._greedy_pick = getattr(getattr(model, "ops", None), "greedy_pick", None)

    # -- helpers --------------------------------------------------------------------------------
    def _state(self, key: Key) -> str:
        """Where verification will find an expert: "held", "in_flight" (prefetched, perhaps not
        landed yet: priced at what verification has been waiting for such reads) or "missing"."""
        contains = getattr(self.cache, "contains", None)
        if contains and contains(*key):
            return "held"
        in_flight = getattr(self.cache, "in_flight", None)
        return "in_flight" if in_flight and in_flight(key) else "missing"

    def _available(self, layer: int):
        mask = getattr(self.cache, "available_mask", None)
        return mask(layer, self.model.config.num_experts) if mask else None

    def _prefetch(self, keys: set[Key]) -> None:
        prefetch = getattr(self.cache, "prefetch", None)
        if prefetch and self.settings.prefetch:
            if self.trial is not None and not self.trial.now:  # the trial's way this iteration
                self.cache.hold_back(keys)
            else:
                prefetch(sorted(keys))

    def _logit_rows(self, record: RoutingRecord, t: int):
        """Token t's router logits of every layer, [layers, E] float64, and the same rows sorted
        high to low: both predictions of a draft pass (prefetch, AE) start from them."""
        layers = list(record.layers)
        if not layers:  # (a stub model without MoE layers)
            return layers, None, None
        rows = np.stack([record.layers[L].logits[t] for L in layers]).astype(np.float64)  # [layers, E]
        return layers, rows, -np.sort(-rows, axis=1)

    def _predicted_experts(self, record: RoutingRecord, t: int, batch: set[Key] | None = None,
                           rows=None) -> set[Key]:
        """Experts token t would use in verification: the target top-k of its draft-time logits.
        With reuse-aware gating and the batch's experts so far (``batch``), the top-k of the logits
        as gating will bias them: the batch's experts (and, for the "resident" variant, what the
        fast tier holds or is reading and its E* would take) raised by the token's own top-1 −
        (k+1)-th gap, so AE prices what verification will really load. Every layer at once: this
        runs once or twice per draft pass, sharing ``rows`` (`_logit_rows`) when given."""
        layers, rows, ordered = rows if rows is not None else self._logit_rows(record, t)
        if not layers:
            return set()
        if batch is not None and self.method.reuse_gating and self.settings.rg_strength > 0:
            favoured = self._batch_mask(layers, batch, rows.shape)
            if self.settings.rg_variant == "resident":
                favoured |= self._tier_in_preferred_set(layers, rows, ordered)
            gap = ordered[:, 0] - ordered[:, min(self.top_k, rows.shape[1] - 1)]
            rows = rows + self.settings.rg_strength * gap[:, None] * favoured
        return {(L, e) for L, top in zip(layers, top_k_indices(rows, self.top_k).tolist()) for e in top}

    def predictions(self, record: RoutingRecord, batch: set[Key] | None,
                    t: int = 0) -> tuple[set[Key], set[Key] | None]:
        """A draft pass's two predictions for its token t: `_predicted_experts` without and, if
        ``batch`` is given, with the batch (what it prefetches, what AE prices). One C call where
        the kernels have it (`CpuOps.ae_predict`: about 40 NumPy calls a pass otherwise), else the
        NumPy path, sharing one sort."""
        fast = getattr(getattr(self.model, "ops", None), "ae_predict", None)
        layers = list(record.layers)
        if fast and layers and isinstance(record.layers[layers[0]].logits, np.ndarray):
            # row t of each layer's logits (the C call reads a buffer's first E values; None: rows it cannot read)
            rows = [record.layers[L].logits[t] if t else record.layers[L].logits for L in layers]
            s, E = self.settings, rows[0].shape[-1]
            gate = batch is not None and self.method.reuse_gating and s.rg_strength > 0
            avail, size = None, 0
            if gate and s.rg_variant == "resident" and s.rg_residency > 0:
                avail = self._available_rows(layers, E)
                size = min(max(s.reuse_cap_for(self.top_k), self.top_k), E)
            got = fast(rows, layers, self.top_k, batch if gate else None, s.rg_strength, avail, s.rg_residency,
                       size) if 0 < self.top_k <= E else None
            if got is not None:
                plain, gated = got
                return plain, (gated if gate else None if batch is None else set(plain))
        shared = self._logit_rows(record, t)
        return (self._predicted_experts(record, t, rows=shared),
                None if batch is None else self._predicted_experts(record, t, batch, shared))

    @staticmethod
    def _batch_mask(layers: list[int], batch: set[Key], shape) -> np.ndarray:
        """[layers, E] bool: the batch's experts, a row per entry of ``layers`` (other layers' left out)."""
        index = {L: i for i, L in enumerate(layers)}
        favoured = np.zeros(shape, dtype=bool)
        for L, e in batch:
            if L in index:
                favoured[index[L], e] = True
        return favoured

    def _available_rows(self, layers: list[int], num_experts: int):
        """[layers, E] bool: resident or being read, per layer; None without a budget."""
        masks = getattr(self.cache, "available_masks", None)
        if masks is not None:
            return masks(layers, num_experts)
        rows = [self._available(L) for L in layers]  # a provider with the one-layer query only
        return None if rows[0] is None else np.stack(rows)

    def _tier_in_preferred_set(self, layers: list[int], logits: np.ndarray, ordered: np.ndarray | None = None):
        """[layers, E] bool: the available experts (resident or being read) that the "resident"
        variant's E* takes for this token, per layer: its logits scaled to [0, 1], plus ρ where
        available, top max(cap, k), as `ReuseGating` ranks a batch's importance (`preferred_set`,
        row by row). A small ρ adds only the available experts the token already ranks high;
        ρ ≥ 1 adds every one (up to the cap). ``ordered``: the rows sorted high to low, if known."""
        if self.settings.rg_residency <= 0:  # ρ = 0: the paper's E*, AE's paper rule
            return False
        avail = self._available_rows(layers, logits.shape[1])
        if avail is None:  # no budget: nothing to favour
            return False
        if ordered is None:
            low, high = logits.min(1, keepdims=True), logits.max(1, keepdims=True)
        else:  # the same values, from the sort already made
            low, high = ordered[:, -1:], ordered[:, :1]
        spread = high - low
        g = (logits - low) / np.where(spread > 0, spread, 1.0) + self.settings.rg_residency * avail
        size = min(max(self.settings.reuse_cap_for(self.top_k), self.top_k), logits.shape[1])
        star = np.zeros(logits.shape, dtype=bool)
        star[np.arange(len(layers))[:, None], top_k_indices(g, size)] = True
        return avail & star

    def pick(self, logits: np.ndarray, draws, position: int) -> tuple[int, float, np.ndarray | None]:
        """Draft token at ``position`` from draft logits: (token, its probability, the law standard
        verification needs, else None)."""
        if self.params.greedy:  # softmax's value at the argmax is 1 / Σ exp(x − max)
            fast = self._greedy_pick(logits) if self._greedy_pick else None  # one C call (CPU kernels): to 1e-6
            if fast is not None:
                return fast[0], fast[1], None
            # NumPy: softmax's bits, a pass less (the reference the kernel is held to)
            z = logits.astype(np.float64)
            z -= z.max()
            return int(np.argmax(logits)), float(1.0 / np.exp(z, out=z).sum()), None
        q = probabilities(logits, self.params)
        token = draws.token(q, position)
        return token, float(q[token]), None if draws.coupled else q

    def _runner_up(self, logits: np.ndarray, draws, position: int) -> int | None:
        """A tree's second first token: the draft's second choice (of the noisy scores when coupled,
        so it differs from the first branch's token); None when truncation leaves only one."""
        if self.params.greedy:
            second = int(top_k_indices(logits[None, :], 2)[0, 1])
            return second if np.isfinite(logits[second]) else None  # (a draft head of one token)
        scores = draws.scores(probabilities(logits, self.params), position)
        second = int(top_k_indices(scores[None, :], 2)[0, 1])
        return second if scores[second] > 0 else None

    def _p_accept(self, q: float) -> float:
        """AE's p_i for a token drafted at confidence q: learned, never below q (the paper's rule),
        so a model that learned "rarely kept" still drafts what the paper would and keeps learning."""
        if self.acceptance is None or not self._learned:
            return q
        return max(self.acceptance.p(q), q)

    def _learn_acceptance(self, d: Draft, accepted: int) -> None:
        """Each verified token of a branch (those up to its first rejection) teaches AE's
        acceptance model; the metrics keep what AE predicted for them against what happened."""
        if self.acceptance is None:
            return
        for i in range(min(accepted + 1, len(d.tokens))):
            kept = i < accepted
            self.acceptance.observe(d.token_probs[i], kept)
            self.metrics.record_acceptance(d.p_accept[i], kept)

    def _draft_length(self) -> int:
        m, s = self.method, self.settings
        if m.admit == "utility" and s.backoff and self._skip > 0:
            self._skip -= 1
            self.metrics.backoff_steps += 1
            return 0
        if self.guard is not None and not self.guard.speculate():
            self.metrics.guard_steps += 1
            return 0
        if m.admit == "cascade":
            return self._cascade_k if self._cascade_k is not None else s.draft_cap
        return m.fixed_length or s.draft_cap

    # -- drafting -------------------------------------------------------------------------------
    def _draft_root(self, feed: list[int], kv: KVCache) -> tuple[np.ndarray, set[Key]]:
        """Run the draft over ``feed`` (tokens not yet in its KV; the last is the root).
        Returns the draft logits after the root and the root's predicted experts (S's start)."""
        logits, rec = self.model.forward(feed, kv, policy=self.draft_policy, logits="last", head=self.draft_head)
        self.metrics.draft_passes += 1
        predicted = self.predictions(rec, None, len(feed) - 1)[0]
        self._prefetch(predicted)
        return logits[-1], predicted

    def _draft_chain(self, kv: KVCache, draws, base: int, length: int, logits: np.ndarray, selected: set[Key],
                     first: int | None = None) -> Draft:
        """Draft up to ``length`` tokens after the root, admitting each by the method's rule; the
        first would be the generated text's token number ``base``."""
        m, s = self.method, self.settings
        d = Draft()
        selected = set(selected)
        rule = UtilityRule(self.costs, s.utility_threshold, s.ae_lookahead, length)  # AE's gain and its peak
        droppable = self.params.greedy or draws.coupled  # dropping drafted tokens leaves the text exact
        while len(d.tokens) < length:
            if first is not None and not d.tokens:  # a tree branch's forced first token
                token, dist = first, None
                prob = float(softmax(logits.astype(np.float64))[token])
            else:
                token, prob, dist = self.pick(logits, draws, base + len(d.tokens))
            if m.admit == "confidence" and prob < s.confidence_threshold:
                break
            if dist is not None and m.admit == "confidence":
                # the rule drops tokens by their own probability, so an admitted token was in effect
                # drawn from q restricted to {q ≥ θ}; verifying it against plain q would bias the output
                dist = np.where(dist >= s.confidence_threshold, dist, 0.0)
                dist = dist / dist.sum()
            # AE. Greedy, coupled: tokens past the best prefix are dropped. Standard: U_j depends on the
            # token's experts, so dropping it would leave the admitted tokens with an unknown law;
            # instead every drafted token is verified and only the decision to draft the next one
            # looks at the gain: a stopping time of the drafted tokens, so speculative sampling stays exact.
            last = False
            p_acc = self._p_accept(prob)
            ceiling = rule.ceiling(p_acc)
            if m.admit == "utility" and ceiling < 0:  # even with ΔC_ver = 0 this token cannot pay
                if droppable:
                    break  # skip its draft pass
                last = True
            # AE needs token i's experts before admitting it; other rules only need the next logits
            need_next = (m.admit == "utility" and not last) or (len(d.tokens) + 1 < length and not last)
            if need_next:
                next_logits, rec = self.model.forward([token], kv, policy=self.draft_policy, logits="last",
                                                      head=self.draft_head)
                self.metrics.draft_passes += 1
                plain, gated = self.predictions(rec, selected if m.admit == "utility" and not last else None)
                self._prefetch(plain)  # verification will need these: read them now
            if m.admit == "utility" and not last:  # ΔC_ver(i|S): what token i adds beyond S under the gating
                new = gated - selected
                last = rule.add(len(d.tokens) + 1, p_acc, ceiling, marginal_verification_cost(new, self._state, self.costs))
                selected |= new
            d.tokens.append(token)
            d.token_probs.append(prob)
            d.p_accept.append(p_acc)
            d.dists.append(dist)
            if last:
                break
            if need_next:
                logits = next_logits[-1]
        if m.admit == "utility" and droppable:
            d.truncate(rule.best_n)
        return d

    # -- verification ---------------------------------------------------------------------------
    def verify_policy(self, confidences: list[float]) -> RoutingPolicy:
        """Verification's routing for a batch with these draft confidences (root: 1.0): the
        target's, or reuse-aware gating's when the method gates (trace.py asks for it too)."""
        if not self.method.reuse_gating:
            return TARGET
        s = self.settings
        rg = ReuseGating(self.top_k, s.reuse_cap_for(self.top_k), s.rg_variant, s.rg_strength,
                         np.asarray(confidences), s.rg_residency, self._available,
                         getattr(getattr(self.model, "ops", None), "reuse_bias", None))
        return RoutingPolicy(selection_bias=rg.bias)

    def _accept_chain(self, logits: np.ndarray, d: Draft, draws, base: int, offset: int = 0) -> tuple[int, int]:
        """(accepted count, next token) for a chain whose i-th token sits at batch row offset+i+1
        and is the text's token number base+i; its parent row is 0 (the root) for i = 0, else offset+i."""
        rows = [0] + [offset + i + 1 for i in range(len(d.tokens))]
        for i, token in enumerate(d.tokens):
            parent = logits[rows[i]]
            if self.params.greedy or draws.coupled:  # accepted iff it is the target's own pick here
                pick = sample(parent, self.params, draws, base + i)
                if pick != token:
                    return i, pick
                continue
            p = probabilities(parent, self.params)
            q = d.dists[i]
            if q is None:  # a forced tree branch has no law, and standard sampling drafts no trees
                raise RuntimeError("sampled verification of a draft token whose law is unknown")
            if draws.uniform() < min(1.0, p[token] / q[token]):
                continue
            residual = np.maximum(p - q, 0.0)  # resample from the part of p that q under-covers
            total = residual.sum()
            return i, draws.token(residual / total if total > 0 else p, base + i)
        return len(d.tokens), sample(logits[rows[-1]], self.params, draws, base + len(d.tokens))

    def _verify(self, root: int, P: int, branches: list[Draft], kv: KVCache, draws, at: int) -> tuple[list[int], int]:
        """One target pass over [root, branch tokens…]; commits the accepted path's KV. ``at``: the
        text's token number of the first draft token."""
        tokens, positions, confidences = [root], [P], [1.0]
        mask_rows = []
        for d in branches:
            base = len(tokens)
            for i, t in enumerate(d.tokens):
                tokens.append(t)
                positions.append(P + 1 + i)
                confidences.append(d.token_probs[i])
                mask_rows.append((base + i, [0] + list(range(base, base + i + 1))))
        tree = None
        if len(branches) > 1:
            tree = np.zeros((len(tokens), len(tokens)), dtype=bool)
            tree[0, 0] = True
            for row, visible in mask_rows:
                tree[row, visible] = True
        policy = self.verify_policy(confidences)
        stats = getattr(self.cache, "stats", None)
        v = stats["verify"] if stats is not None else None
        before = (v.misses, v.hits) if v is not None else None
        ahead = getattr(self.cache, "prefetch_stats", None)
        ahead_before = (ahead.used, ahead.waited_seconds) if ahead is not None else None
        tv = time.perf_counter()
        with phase_of(self.model, "verify"):
            logits, rec = self.model.forward(tokens, kv, start=P, policy=policy,
                                             positions=positions if tree is not None else None, tree_mask=tree)
        took = time.perf_counter() - tv
        settle = getattr(self.cache, "settle_prefetches", None)
        if settle:  # waits for wrong guesses still being read: verification's time, not its passes'
            with phase_of(self.model, "verify"):
                settle()
        self.metrics.verify_seconds += time.perf_counter() - tv
        if before is not None:
            missing, resident = v.misses - before[0], v.hits - before[1]
            # experts a prefetch was reading count as misses in the cache's stats
            used, pre_wait = ((ahead.used - ahead_before[0], ahead.waited_seconds - ahead_before[1])
                              if ahead_before is not None else (0, 0.0))
            # as a profile's passes (prefetch off) would see it: prefetched experts as resident,
            # their wait left out, so `profile --update` keeps a miss meaning a cold read
            self.metrics.verify_samples.append((len(tokens), missing - used, resident + used, took - pre_wait))
            if self.live:
                self.live.observe_verify(len(tokens), missing, resident, took)
                self.live.observe_prefetch_wait(used, pre_wait)  # nothing to learn where none was used
                self.costs = self.live.current()
        best, offset = None, 0
        for b, d in enumerate(branches):
            a, nxt = self._accept_chain(logits, d, draws, at, offset)
            self._learn_acceptance(d, a)
            if best is None or a > best[0]:
                best = (a, nxt, b, offset)
            offset += len(d.tokens)
        a, nxt, b, offset = best
        slots = [P] + [P + 1 + offset + i for i in range(a)]
        kv.keep(slots, P)  # the accepted path's target-computed KV, moved into place
        kv.commit(P + 1 + a)
        self.metrics.record_verification(rec, len(tokens), [0] + [1 + offset + i for i in range(a)],
                                         sum(len(d.tokens) for d in branches), a, self.top_k)
        self._last_branch = b
        return branches[b].tokens[:a], nxt

    # -- cascade (arXiv 2506.20675): test each K briefly, then use the best for a while -----------
    def _cascade_options(self) -> list[int]:
        cap = self.settings.draft_cap
        return sorted({0, 1, max(cap // 2, 1), cap})

    def _cascade_observe(self, k: int, produced: int, seconds: float) -> None:
        if self.method.admit != "cascade":
            return
        st = self.__dict__.setdefault("_cascade", {"phase": "test", "i": 0, "obs": {}, "left": 0})
        if st["phase"] == "test":
            st["obs"].setdefault(k, []).append((produced, seconds))
            options = self._cascade_options()
            st["i"] += 1
            per = self.settings.cascade_test_iters
            if st["i"] >= per * len(options):
                goodput = {o: sum(p for p, _ in v) / max(sum(t for _, t in v), 1e-9) for o, v in st["obs"].items()}
                self._cascade_k = max(goodput, key=goodput.get)
                st.update(phase="set", left=self.settings.cascade_set_iters, obs={}, i=0)
                self.metrics.cascade_choices.append(self._cascade_k)
            else:
                self._cascade_k = options[st["i"] // per]
        else:
            st["left"] -= 1
            if st["left"] <= 0:
                st["phase"] = "test"
                self._cascade_k = self._cascade_options()[0]

    # -- the loop -------------------------------------------------------------------------------
    def generate(self, prompt: Iterable[int], max_tokens: int, stop_ids: Iterable[int] = (),
                 on_token: Callable[[int], None] | None = None) -> SpecResult:
        m, s = self.method, self.settings
        prompt = [int(t) for t in prompt]
        stop = set(stop_ids)
        draws = draws_for(self.params)
        width = m.tree_width if self.params.greedy or draws.coupled else 1  # standard sampling needs one law per token
        longest = max(s.draft_cap, m.fixed_length or 0)
        capacity = len(prompt) + max_tokens + width * longest + 2
        kv = self.model.new_cache(capacity)
        draft_kv = kv if m.share_kv else self.model.new_cache(capacity)
        self.metrics = SpecMetrics()
        self.__dict__.pop("_cascade", None)
        self._cascade_k = self._cascade_options()[0] if m.admit == "cascade" else None
        self._skip, self._wait = 0, 1
        out: list[int] = []

        def emit(tokens: list[int]) -> bool:
            for t in tokens:
                out.append(t)
                if on_token:
                    on_token(t)
                if t in stop or len(out) >= max_tokens:
                    return True
            return False

        settle = getattr(self.cache, "settle_prefetches", None)
        if settle:  # guesses a failed earlier call left in flight would shrink this prefill's reads
            settle()
        t0 = time.perf_counter()
        with phase_of(self.model, "prefill"):
            logits, _ = self.model.forward(prompt, kv, logits="last", record=False)
        kv.commit(len(prompt))
        if not m.share_kv:  # the draft keeps its own approximate KV, from its own prefill
            with phase_of(self.model, "prefill"):
                self.model.forward(prompt, draft_kv, policy=self.draft_policy, logits="last", record=False,
                                   head=self.draft_head)
            draft_kv.commit(len(prompt))
        prefill = time.perf_counter() - t0  # both prefills when the draft has its own KV
        t1 = time.perf_counter()
        done = emit([sample(logits[-1], self.params, draws, 0)])
        while not done:
            draws.forget_before(len(out))
            root, P = out[-1], kv.length
            length = self._draft_length()
            started = time.perf_counter()
            if m.admit == "none" or length == 0:
                stats = getattr(self.cache, "stats", None)
                before = (stats["ar"].misses, stats["ar"].hits) if stats is not None else None
                with phase_of(self.model, "ar"):
                    logits, _ = self.model.forward([root], kv, logits="last", record=False)
                took = time.perf_counter() - started
                if before is not None:
                    self.metrics.ar_samples.append((1, stats["ar"].misses - before[0], stats["ar"].hits - before[1], took))
                if self.live:
                    self.live.observe_ar(took)
                    self.costs = self.live.current()
                kv.commit(P + 1)
                self.metrics.ar_steps += 1
                done = emit([sample(logits[-1], self.params, draws, len(out))])
                self._cascade_observe(length, 1, time.perf_counter() - started)
                if self.guard is not None:
                    self.guard.observe(False, 1, time.perf_counter() - started)
                continue
            history = prompt + out
            feed = history[draft_kv.filled:] if not m.share_kv else [root]
            if self.trial is not None:
                self.trial.prefetch_now()
            td, passes = time.perf_counter(), self.metrics.draft_passes
            with phase_of(self.model, "draft"):
                root_logits, root_experts = self._draft_root(feed, draft_kv)
                branches = [self._draft_chain(draft_kv, draws, len(out), length, root_logits, root_experts)]
                runner_up = self._runner_up(root_logits, draws, len(out)) if width > 1 and branches[0].tokens else None
                if runner_up is not None:
                    draft_kv.rollback(P + 1)
                    branches.append(self._draft_chain(draft_kv, draws, len(out), length, root_logits, root_experts,
                                                      first=runner_up))
            drafted_for = time.perf_counter() - td
            self.metrics.draft_seconds += drafted_for
            if self.metrics.draft_passes > passes:
                self.metrics.draft_samples.append((self.metrics.draft_passes - passes, drafted_for))
            if self.live:
                self.live.observe_draft(drafted_for, self.metrics.draft_passes - passes)
            branches = [b for b in branches if b.tokens] or branches[:1]
            if m.admit == "utility":  # back off after a draft that admitted nothing (see SpecSettings)
                self._skip, self._wait = (self._wait, min(2 * self._wait, 16)) if not branches[0].tokens else (0, 1)
            if m.share_kv:
                kv.rollback(P)  # context alignment: draft KV never reaches the committed cache
            if not branches[0].tokens:  # nothing admitted: the verification is a plain AR step
                self.metrics.empty_drafts += 1
            accepted, nxt = self._verify(root, P, branches, kv, draws, len(out))
            if not m.share_kv:
                # the draft cache is valid up to the accepted tokens only if it holds the accepted
                # branch (the last one drafted); otherwise keep the root and catch up next time
                valid = P + 1 + len(accepted) if self._last_branch == len(branches) - 1 else P + 1
                draft_kv.rollback(min(draft_kv.filled, valid))
                draft_kv.commit(draft_kv.filled)
            done = emit(accepted + [nxt])
            self._cascade_observe(length, len(accepted) + 1, time.perf_counter() - started)
            took, expected = time.perf_counter() - started, expected_tokens(branches[0].p_accept)
            if self.guard is not None:
                self.guard.observe(True, len(accepted) + 1, took, expected)
            if self.trial is not None:  # each way of prefetching judged on seconds per expected token
                self.trial.observe(took, expected)
        decode = time.perf_counter() - t1
        if self.draft_head is not None:  # which emitted tokens the draft head could have proposed
            self.metrics.draft_vocab = self.draft_head.size
            self.metrics.vocab_tokens += len(out)
            self.metrics.vocab_covered += int(np.isin(out, self.draft_head.ids).sum())
        self.draws = draws  # kept for inspection (tests check the noise it holds stays bounded)
        # tokens accepted past max_tokens were committed but never emitted: drop their KV too
        kv.rollback(min(kv.length, len(prompt) + len(out) - 1))
        self.kv = kv  # kept for inspection (tests compare it with a fresh prefill)
        reason = "eos" if out and out[-1] in stop else "max_tokens"
        return SpecResult(prompt, out, prefill, decode, reason, metrics=self.metrics)
