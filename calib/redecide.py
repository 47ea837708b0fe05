"""`predict` for an AE method: replay the routing, re-make the decisions with the target's costs.

A trace's passes hold the decisions AE made with this device's costs. On a fast disk an expert
miss is cheap next to an AR step, so AE drafts little and the rate guard holds speculation off;
under a slow tier AE drafts far more. Priced as recorded, the default model's S²-MoE run came out
24 % slow against a run under a 200 MB/s tier. So for an AE method whose trace carries draft tables
(`runtime/decoding/trace.py`, version 2) the run is simulated again, iteration by iteration:

- the draft length: the back-off after empty drafts and the rate guard (fed the simulated seconds);
- AE over the draft chain at that position (`UtilityRule`, the decoder's own arithmetic),
  its p_i from an acceptance model learned from the simulated verifications, ΔC_ver from the
  simulated cache's residency and the target profile's constants;
- acceptance: what the verification of the whole chain kept (greedy, gating included),
  up to the admitted length; the walk then goes on along AR's text (gating may change the text);
- verification's experts: the verification of the whole chain at that position, its
  first rows (reuse-aware gating included, with the batch the whole chain made);
- prefetch: every expert a draft pass predicts is read while the draft runs; verification waits
  for what the tier could not read in the draft's time (reads serial at the fitted miss cost, the
  ones verification uses first; the prefetch slots' limit is not modelled).

Prices as `predict.replay`: a verification t_base + t_token·n + t_exp_miss·misses + t_exp_hit·hits,
an AR step that price scaled to the profile's T_AR (`ar_step_scale`), a draft pass C_draft.

The chains: the trace's tables hold the drafts and gating's choices made with this device's cache
residency. The draft uses resident experts only, so a device that holds other experts drafts other
tokens. Where the trace kept its prompts and settings, `redraw` draws every chain again on the
model, here, with the simulated cache's residency at that moment (`DraftWalk`): the time of a run
of the model, for drafts as that device would make them. What stays as recorded: the text (AR's,
which gating may change), and the prefetches in flight, which gating counts as available on the
device but the replay does not.
"""

from __future__ import annotations

from s2moe.runtime.decoding.acceptance import AcceptanceModel
from s2moe.runtime.decoding.cost_model import CostConstants, UtilityRule, expected_tokens
from s2moe.runtime.decoding.rate_guard import RateGuard
from s2moe.runtime.errors import UsageError


def serve(cache, phase: str, n_tokens: int, pairs: list[tuple[int, int]]) -> tuple[int, int]:
    """One pass's experts through ``cache``, layer by layer in request order: (hits, misses).
    An expert asked twice is one request (a cache that read it twice would count its bytes twice)."""
    pairs = list(dict.fromkeys(pairs))
    with cache.in_phase(phase):
        s = cache.stats[phase]
        before = (s.hits, s.misses)
        cache.begin_pass(n_tokens)
        for layer in dict.fromkeys(L for L, _ in pairs):
            for _ in cache.stream(layer, [e for L, e in pairs if L == layer]):
                pass
        cache.end_pass()
        return s.hits - before[0], s.misses - before[1]


def price(costs: CostConstants, n_tokens: int, h: float, m: float) -> float:
    """The fitted cost of a pass of ``n_tokens`` that hits ``h`` resident experts and misses ``m``."""
    return costs.t_base + costs.t_token * n_tokens + costs.t_exp_miss * m + costs.t_exp_hit * h


def ar_step_scale(ar_run: dict | None, E: int, cache, costs: CostConstants) -> float:
    """T_AR over the fitted price of the AR run's mean step, replayed on ``cache`` (the profile's own
    budget): the factor that prices an AR step.

    The cost model is fitted on verification passes of 2+ tokens. A one-token decode step also pays
    what the fit never sees (sampling, the step's interpreter, the one-token pass's own form): on
    OLMoE-1B-7B's shape the fit priced it 144 ms where the profile measured T_AR 195 ms. Scaled so,
    an AR step costs T_AR at the misses T_AR was measured with, and more or less as its own misses
    differ; a profile without T_AR (or a trace without an AR run) keeps the fitted price."""
    if ar_run is None or not costs.t_ar:
        return 1.0
    h = m = n = 0
    for phase, n_tokens, keys in ar_run["passes"]:
        hh, mm = serve(cache, phase, n_tokens, [(k // E, k % E) for k in keys])
        if phase == "ar":
            h, m, n = h + hh, m + mm, n + 1
    fitted = price(costs, 1, h / n, m / n) if n else 0.0
    return costs.t_ar / fitted if fitted > 0 else 1.0


def per_prompt(passes: list) -> list[tuple[list[int], list[list[int]]]]:
    """An AR run's passes split by prompt: (its prefill chunks' keys, each AR step's keys in order).
    A long prompt is prefilled in chunks: consecutive prefill passes are one prompt's."""
    out, last = [], None
    for phase, _, keys in passes:
        if phase == "prefill":
            if last == "prefill":  # (each chunk a pass: the cache sees them as the run did)
                out[-1][0].append(keys)
            else:
                out.append(([keys], []))
        elif phase == "ar" and out:
            out[-1][1].append(keys)
        last = phase
    return out


def redrawable(ar_run: dict | None, run: dict) -> bool:
    """Whether ``run``'s chains can be drawn again here: the trace kept the prompts and the settings
    its drafts were drawn with (traces from before that cannot)."""
    return (ar_run is not None and bool(ar_run.get("prompts")) and len(ar_run["prompts"]) == len(ar_run.get("texts") or ())
            and "draw" in (run.get("settings") or {}))


def redraw(ar_run: dict, run: dict, cache, engine):
    """Per prompt, a `DraftWalk` along AR's text on ``engine``'s model, whose draft and gating see
    ``cache``'s residency (the other device's, as the replay fills it): the chains that device
    would draft. The trace's own tables were drawn with this device's residency, and resident-only
    drafts are only as good as what is resident: on the widened OLMoE-1B-7B at 25 % they kept 4.34
    tokens a verification where a run under a slower tier, with the profile's hot list pinned,
    kept 2.74 (docs/performance/calibration.md)."""
    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.sampling import SamplingParams
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder
    from s2moe.runtime.decoding.trace import DraftWalk

    c = engine.model.config
    settings = SpecSettings.from_trace(run["settings"]).validate(c.top_k, c.num_experts)
    decoder = SpeculativeDecoder(engine.model, get_method(run["method"]), settings, None, SamplingParams(),
                                 residency=cache)
    return (DraftWalk(decoder, p, t) for p, t in zip(ar_run["prompts"], ar_run["texts"]))


def ar_steers(prompts: list, texts: list, tables: int) -> bool:
    """AR's recorded run can steer a replay: one AR step per text token past the first, in every
    prompt, and a draft table per prompt."""
    return len(prompts) == len(texts) == tables and all(len(k) == len(t) - 1 for (_, k), t in zip(prompts, texts))


def simulate(ar_run: dict, run: dict, E: int, cache, costs: CostConstants, ar_scale: float = 1.0,
             drafts=None) -> dict:
    """``run`` (an AE method with draft tables) again, on ``cache``, priced and decided by ``costs``;
    an AR step at ``ar_scale`` × its fitted price (`ar_step_scale`). ``drafts``: per prompt, its
    rows by text position (`redraw`); None: the trace's tables."""
    s = run.get("settings") or {}
    cap, theta, lookahead = int(s.get("draft_cap", 8)), float(s.get("utility_threshold", 1.0)), int(s.get("ae_lookahead", 2))
    learned, prefetch = s.get("acceptance", "learned") == "learned", bool(s.get("prefetch", True))
    backoff = bool(s.get("backoff", True))
    acceptance = AcceptanceModel()
    guard = RateGuard() if s.get("rate_guard") else None
    pair = lambda k: (k // E, k % E)  # noqa: E731
    seconds = {"ar": 0.0, "verify": 0.0, "draft": 0.0}
    hits = misses = tokens = drafted_total = verifications = accepted = backoffs = 0
    ar_steps = 0
    fetch = max(costs.t_exp_miss - costs.t_exp_hit, 0.0)  # a read, beyond the expert's compute

    prompts = per_prompt(ar_run["passes"])
    drafts = run["drafts"] if drafts is None else drafts
    tables = len(drafts) if isinstance(drafts, list) else len(prompts)  # a generator (redraw) has one a prompt
    if not ar_steers(prompts, ar_run["texts"], tables):
        raise UsageError(f"the trace's AR run has {len(prompts)} prompts and {[len(k) for _, k in prompts]} AR steps "
                         f"for texts of {[len(t) for t in ar_run['texts']]} tokens: it cannot steer {run['method']}'s "
                         "replay; record it again with s2moe bench --trace, or predict --as-recorded")
    for (prefill, ar_keys), text, table in zip(prompts, ar_run["texts"], drafts):
        for chunk in prefill:
            serve(cache, "prefill", 0, [pair(k) for k in chunk])
        n_text = len(text)
        tokens += n_text - 1
        out, skip, wait = 1, 0, 1
        while out < n_text:
            j = out - 1
            length = cap
            if skip > 0:
                skip, length, backoffs = skip - 1, 0, backoffs + 1
            elif guard is not None and not guard.speculate():
                length = 0
            if length == 0:  # an AR step
                h, m = serve(cache, "ar", 1, [pair(k) for k in ar_keys[j]])
                t = ar_scale * price(costs, 1, h, m)
                seconds["ar"] += t
                hits, misses, out, ar_steps = hits + h, misses + m, out + 1, ar_steps + 1
                if guard is not None:
                    guard.observe(False, 1, t)
                continue
            root_keys, chain, verified, kept = table[j]
            held = lambda k: cache.contains(*pair(k))  # noqa: E731
            reading = {k for k in root_keys if not held(k)} if prefetch else set()
            selected = set(root_keys)
            rule = UtilityRule(costs, theta, lookahead, length)
            passes, admitted = 1, []
            for i, (token, q, plain, keys) in enumerate(chain[:length]):
                p_acc = max(acceptance.p(q), q) if learned else q
                ceiling = rule.ceiling(p_acc)
                if ceiling < 0:
                    break
                passes += 1
                new = set(keys) - selected
                if prefetch:
                    reading |= {k for k in plain if not held(k)}
                delta = sum(costs.expert_cost("held" if held(k) else "in_flight" if k in reading else "missing")
                            for k in new)
                stop = rule.add(i + 1, p_acc, ceiling, delta)
                selected |= new
                admitted.append((token, q, p_acc))
                if stop:
                    break
            admitted = admitted[:rule.best_n]
            draft_s = passes * costs.c_draft
            seconds["draft"] += draft_s
            if backoff:  # after a draft that admitted nothing, AR steps for a while (SpecSettings)
                skip, wait = (wait, min(2 * wait, 16)) if not admitted else (0, 1)
            a = min(len(admitted), kept, n_text - 1 - j)
            for i in range(min(a + 1, len(admitted))):
                acceptance.observe(admitted[i][1], i < a)
            rows = verified[:len(admitted) + 1]
            keys = list(dict.fromkeys(k for row in rows for k in row))
            # a prefetched expert verification asks for costs a hit, plus what the tier had not read
            # by the time the draft ended (reads serial, the used ones first)
            ahead = sum(1 for k in keys if k in reading and not held(k))
            h, m = serve(cache, "verify", len(rows), [pair(k) for k in keys])
            t = price(costs, len(rows), h + ahead, m - ahead) + max(ahead * fetch - draft_s, 0.0)
            seconds["verify"] += t
            hits, misses = hits + h, misses + m
            drafted_total, verifications, out = drafted_total + len(admitted), verifications + 1, out + a + 1
            accepted += a
            if guard is not None:
                guard.observe(True, a + 1, draft_s + t, expected_tokens([x[2] for x in admitted]))
    total = sum(seconds.values())
    return {"method": run["method"], "tokens": tokens, "predicted_seconds": total,
            "predicted_tokens_per_s": tokens / total if total else None,
            "recorded_tokens_per_s": run["tokens"] / run["decode_seconds"] if run.get("decode_seconds") else None,
            "miss_rate": misses / (hits + misses) if hits + misses else None,
            "seconds": {k: round(v, 6) for k, v in seconds.items()}, "decisions": "re-made",
            "verifications": verifications, "drafted": drafted_total, "accepted": accepted, "ar_steps": ar_steps,
            "backoff_steps": backoffs, "rate_guard": guard.to_dict() if guard is not None else None}
