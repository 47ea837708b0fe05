"""`s2moe-calib predict`: tokens/s of AR and each method on a device we do not have.

A routing trace recorded here (`s2moe bench --trace FILE`) says which experts every pass of each
method asked for. The replay runs those passes, in order, through the other device's fast tier (the
real `ExpertCache`, its replacement policy and pinned hot list, at the capacity that device's profile
budget leaves for experts; a store that reads nothing) and prices each pass with that device's
fitted cost model:

    verification:  t_base + t_token · n_tokens + t_exp_miss · n_missing + t_exp_hit · n_resident
    AR step:       the same at one token, × T_AR / (its price at the AR run's mean misses at the
                   profile's own budget): the fit is made on verifications, and T_AR is measured
    draft pass:    C_draft   (the draft uses resident experts only and fetches nothing)

Prefill passes update the cache but are not priced (decode tokens/s, as `s2moe bench` reports).
As recorded, the passes carry this device's drafting decisions. For a greedy AE method whose trace
holds draft tables (`s2moe bench --trace` records them), `redecide.simulate` re-makes the draft
lengths, AE's admissions, the back-off and the rate guard with the other device's costs, and
models prefetch overlap. The drafts use resident experts only, so by default (`--drafts auto`,
where the trace kept its prompts and settings) each chain is drawn again on the model here with
the other device's simulated residency; `--drafts recorded` takes the trace's tables, drawn with
this device's. `--as-recorded` prices the recorded passes instead (docs/performance/calibration.md
measures how close each comes).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import typer

from s2moe.runtime.cli.common import err, print_json, say
from s2moe.runtime.cli.errors import cli_errors
from s2moe.runtime.errors import UsageError

from .redecide import ar_step_scale, price, redraw, redrawable, serve, simulate

PRICED = ("ar", "verify", "draft")


class _NoStore:
    """A slow tier that reads nothing: a fetched expert is a placeholder of its resident size."""

    def __init__(self, size):
        self.size = size

    def read_many(self, layer, experts):
        return [SimpleNamespace(nbytes=self.size((layer, int(e)))) for e in experts]

    def stored_bytes(self, layer, expert):
        return self.size((layer, expert))


def new_cache(capacity: int | None, size, hot=(), policy: str = "lfu"):
    """The other device's fast tier: the real `ExpertCache` over a store that reads nothing."""
    from s2moe.runtime.offload.cache import ExpertCache

    return ExpertCache(_NoStore(size), capacity, policy, hot=list(hot), resident_size=size)


def replay(run: dict, E: int, cache, costs, ar_scale: float = 1.0) -> dict:
    """One method's passes, as recorded, through ``cache``, priced by ``costs`` (an AR step × ``ar_scale``)."""
    seconds = {"ar": 0.0, "verify": 0.0, "draft": 0.0}
    misses = hits = 0
    for phase, n_tokens, keys in run["passes"]:
        pairs = [(k // E, k % E) for k in keys]
        if phase == "draft":  # resident experts only: the draft never waits on the slow tier
            pairs = [key for key in pairs if cache.contains(*key)]
        h, m = serve(cache, phase, n_tokens, pairs)
        if phase == "draft":
            seconds["draft"] += costs.c_draft
        elif phase in ("ar", "verify"):
            seconds[phase] += price(costs, n_tokens, h, m) * (ar_scale if phase == "ar" else 1.0)
            hits, misses = hits + h, misses + m
    total = sum(seconds.values())
    return {"method": run["method"], "tokens": run["tokens"], "predicted_seconds": total,
            "predicted_tokens_per_s": run["tokens"] / total if total else None,
            "recorded_tokens_per_s": run["tokens"] / run["decode_seconds"] if run.get("decode_seconds") else None,
            "miss_rate": misses / (hits + misses) if hits + misses else None,
            "seconds": {k: round(v, 6) for k, v in seconds.items()}, "decisions": "as recorded"}


def predict(
    trace: str = typer.Option(..., "--trace", help="Routing trace: s2moe bench --trace FILE."),
    profile: str = typer.Option(..., "--profile", help="Profile of the device to predict for (e.g. profiles/orin-16g.json)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="The traced model (default: the path the trace recorded)."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Budget on that device (default: the profile's)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    redo_off: bool = typer.Option(False, "--as-recorded", help="Price every method's passes as recorded, "
                                  "even where the trace lets AE's decisions be re-made for this device."),
    drafts: str = typer.Option("auto", "--drafts", help="Where re-made decisions take their draft chains: "
                               "redraw (drawn again on the model here, with that device's residency: a model "
                               "run's time), recorded (the trace's tables, drawn with this device's residency), "
                               "or auto (redraw where the trace kept its prompts and settings)."),
):
    """Predict AR and S²-MoE tokens/s on another device from a trace recorded here."""
    with cli_errors():
        if drafts not in ("auto", "redraw", "recorded"):
            raise UsageError(f"--drafts {drafts!r}: choose auto, redraw or recorded")
        from rich.table import Table

        from s2moe.runtime.decoding.trace import load_trace
        from s2moe.runtime.engine import default_prefetch_slots, draft_head_bytes
        from s2moe.runtime.model.kv_cache import resolve_cache_type
        from s2moe.runtime.model.loader import load_model
        from s2moe.runtime.offload.memory import Budget, plan_memory
        from s2moe.runtime.profile import load_profile, model_fingerprint

        data = load_trace(trace)
        prof = load_profile(profile)
        loaded = load_model(model or data["model"]["path"], dense=False)
        E = data["model"]["experts_per_layer"]
        fingerprint = model_fingerprint(loaded)
        if fingerprint != data["model"]["fingerprint"]:
            say(f"warning: {trace} was recorded on another model than {loaded.path}; expert sizes may not match",
                "yellow")
        hot = prof.hot_experts if prof.data["model"].get("fingerprint") == fingerprint else []
        if prof.hot_experts and not hot:
            say(f"note: {profile} was made for another model: its hot list is not pinned in the replay", "dim")
        spec = budget or prof.budget_spec
        settings = prof.speculative
        context = (prof.data.get("budget") or {}).get("context_tokens") or 128
        cap = int(settings.get("draft_cap") or 8)
        device = (prof.data.get("device") or {}).get("kind", "cpu")
        on_device = device not in ("cpu",)
        size = (lambda key: loaded.experts[key].resident_bytes_for(False)) if on_device else \
            (lambda key: loaded.experts[key].resident_bytes_for(True))

        def fast_tier(spec: str, field: str, quiet: bool = False) -> tuple[int | None, list]:
            """The expert capacity a budget leaves on that device, and the hot experts pinned in it.
            One plan for every method, a drafting run's: an AR run, with no draft head, would give
            the head's rows to experts too, so under a byte budget it may count a few misses too many."""
            parsed = Budget.parse(spec, field)
            plan = plan_memory(loaded, parsed, context + 2 * max(cap, 8) + 2, batch=max(min(context, 64), 1 + 2 * cap),
                               expert_bytes=(lambda refs: refs.resident_bytes_for(not on_device)),
                               draft_head=draft_head_bytes(loaded, int(settings.get("draft_vocab") or 0), on_device),
                               staged_prefetches=default_prefetch_slots(loaded.config, parsed.full) if on_device else 0,
                               cache_type=resolve_cache_type("auto", loaded.config))
            capacity = None if plan.expert_capacity >= plan.expert_total else plan.expert_capacity
            if capacity is None or sum(map(size, hot)) <= capacity:
                return capacity, hot
            from s2moe.runtime.engine import head_that_fits  # another budget than the profile's

            kept = head_that_fits(hot, size, capacity)
            if not quiet:
                say(f"note: budget {spec} leaves room for the first {len(kept)} of the profile's {len(hot)} hot "
                    "experts; the replay pins those, as s2moe run would", "dim")
            return capacity, kept

        capacity, pinned = fast_tier(spec, "--budget" if budget else f"{profile}: budget.spec")
        # T_AR was measured at the profile's own budget: the AR step's scale is found there
        at_profile = (capacity, pinned) if spec == prof.budget_spec else \
            fast_tier(prof.budget_spec, f"{profile}: budget.spec", quiet=True)
        # T_AR is the profile's model's: it prices this trace's AR steps only for that model, or one
        # of its shape (a published preset names the released model whose shape it was measured on)
        c, pm = loaded.config, prof.data["model"]
        same_shape = (pm.get("layers"), pm.get("experts"), pm.get("top_k")) == (c.num_layers, c.num_experts, c.top_k)
        any_ar = next((r for r in data["runs"] if r["method"] == "ar"), None)
        if pm.get("fingerprint") != fingerprint and not same_shape:
            any_ar = None
            say(f"note: {profile} was made for a model of another shape: AR steps are priced by its fitted "
                "cost model, not scaled to its T_AR", "dim")
        scale = ar_step_scale(any_ar, E, new_cache(at_profile[0], size, at_profile[1]), prof.costs)
        ar_run = next((r for r in data["runs"] if r["method"] == "ar" and r.get("texts")), None)
        engine = None  # the model, for chains drawn again (one for every method)

        def row(run: dict) -> dict:
            nonlocal engine
            cache = new_cache(capacity, size, pinned)
            if not run.get("drafts") or ar_run is None or redo_off:
                return replay(run, E, cache, prof.costs, scale)
            if drafts == "recorded" or (drafts == "auto" and not redrawable(ar_run, run)):
                return {**simulate(ar_run, run, E, cache, prof.costs, scale), "chains": "recorded"}
            if not redrawable(ar_run, run):
                raise UsageError(f"{trace}: {run['method']}'s run has no prompts or draft settings to draw its "
                                 "chains again; record it again with s2moe bench --trace, or use --drafts recorded")
            if engine is None:
                from s2moe.runtime.engine import build_engine

                positions = max(len(p) + len(t) for p, t in zip(ar_run["prompts"], ar_run["texts"])) + cap + 8
                vocab = max(int(r["settings"]["draw"].get("draft_vocab") or 0) for r in data["runs"] if redrawable(ar_run, r))
                engine = build_engine(loaded.path, (data.get("recorded") or {}).get("budget"), positions, draft_vocab=vocab)
            with err.status(f"drawing {run['method']}'s drafts again with {device}'s residency"):
                return {**simulate(ar_run, run, E, cache, prof.costs, scale, redraw(ar_run, run, cache, engine)),
                        "chains": "redrawn"}

        try:
            rows = [row(run) for run in data["runs"]]
        finally:
            if engine is not None:
                engine.close()
        ar = next((r["predicted_tokens_per_s"] for r in rows if r["method"] == "ar"), None)
        for r in rows:
            r["predicted_speedup_vs_ar"] = r["predicted_tokens_per_s"] / ar if ar and r["predicted_tokens_per_s"] else None
        result = {"trace": trace, "profile": profile, "device": device, "budget": spec,
                  "expert_capacity_bytes": capacity, "ar_step_scale": round(scale, 6), "recorded": data.get("recorded"),
                  "methods": rows}
        if json_out:
            print_json(result)
            return
        table = Table(title=f"predicted on {device} ({profile}) · budget {spec} · trace {trace}")
        for col in ("method", "tokens", "tok/s here", "predicted tok/s", "predicted speedup", "miss rate", "decisions"):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(r["method"], str(r["tokens"]), _fmt(r["recorded_tokens_per_s"]), _fmt(r["predicted_tokens_per_s"]),
                          "-" if r["predicted_speedup_vs_ar"] is None else f"{r['predicted_speedup_vs_ar']:.2f}×",
                          "-" if r["miss_rate"] is None else f"{r['miss_rate']:.1%}",
                          r["decisions"] + (f", chains {r['chains']}" if "chains" in r else ""))
        err.print(table)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"
