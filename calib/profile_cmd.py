"""`s2moe-calib profile`: measure this device for one model and budget; write a device profile.

Stages (each with a progress bar, stderr): device probe → offload bandwidth and latency → expert
bytes → verification cost (T_exp miss/hit, base, per token) → hot experts → T_AR and C_draft.
Raw samples are written beside the profile after every stage (`NAME.samples.json`); the profile
itself is written once, atomically, at the end.
"""

from __future__ import annotations

import datetime
import os
import shlex
from contextlib import contextmanager
from typing import Optional

import numpy as np
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from s2moe import __version__
from s2moe.runtime.cli.common import err, print_json, resolve_model, say
from s2moe.runtime import jsonfile
from s2moe.runtime.checks import number
from s2moe.runtime.cli.errors import cli_errors
from s2moe.runtime.cli.spec_options import default_draft_topk
from s2moe.runtime.decoding.cost_model import FEATURES, VerificationCostModel
from s2moe.runtime.decoding.methods import SpecSettings
from s2moe.runtime.engine import engine_tier
from s2moe.runtime.errors import UsageError
from s2moe.runtime.model.kv_cache import resolve_cache_type
from s2moe.runtime.profile import model_fingerprint, save_profile, write_json_atomic
from s2moe.runtime.records import git_commit
from s2moe.runtime.model.routing import TARGET, RoutingPolicy

from . import hot as hot_mod
from . import draft_k as draft_k_mod
from . import measure
from . import plan as plan_mod
from . import replay as replay_mod
from . import speed_probe
from .devices import resolve_device
from .passes import decode_passes


def _workload_tokens(tok, workload: str | None, max_len: int = 192, max_records: int = 96
                     ) -> tuple[list[list[int]], list[list[int]], str]:
    """Profiling split (even records) and held-out split (odd records) of a workload's first records."""
    from s2moe.runtime.bench import resolve_workload
    from s2moe.runtime.prompts import load_workload

    path = resolve_workload(workload or "default")
    ids = [tok.encode(p).ids[:max_len] for p in load_workload(path)[:max_records]]
    ids = [i for i in ids if len(i) >= 8]
    if len(ids) < 4:
        raise UsageError(f"{path}: need at least 4 prompts of 8+ tokens for profiling")
    return ids[0::2], ids[1::2], str(path)


@contextmanager
def _progress():
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=False) as p:
        yield p


def _resumable(samples_path: str, fresh: dict) -> dict:
    """Samples of an interrupted run, if they were taken under the same conditions."""
    try:
        with open(samples_path) as f:
            old = jsonfile.load(f)
    except (OSError, ValueError):
        raise UsageError(f"{samples_path}: nothing to resume (no readable samples file); run without --resume") from None
    # samples files from before --draft-vocab timed C_draft with the full head, and before
    # --draft-cap timed passes up to a cap of 8
    same = all(old.get(k, {"draft_vocab": 0, "draft_cap": 8}.get(k)) == v for k, v in fresh.items())
    if not same:
        raise UsageError(f"{samples_path}: samples were taken for another model, device, budget, slow tier, draft head, "
                         "--draft-topk or --draft-cap; "
                         "run without --resume")
    say(f"resuming from {samples_path}: {', '.join(k for k in old if k not in fresh)} already measured")
    return old


DECODE_PROMPTS = 16  # profiling prompts decoded for in-situ passes (32 tokens each, draft caps cycling)

# Controlled passes pin down directions real decoding does not vary (no misses at a 100 % budget,
# all misses in a 10 % one) but run under conditions decoding never has (no budget, every fetched
# expert kept). How much they may pull the fit depends on the device: on the embedded model 0.1
# cost nothing, on a hidden-1024 model under a budget their hit cost was 4x lower than decoding's,
# and at 0.1 they added 1.3 points of MAPE. So the weight is chosen per profile, by 5-fold
# cross-validation on the decode passes the model must predict; never 0, or a 100 % budget (no
# misses while decoding) would leave the miss cost unset (docs/performance.md, "Calibration").
CONTROLLED_WEIGHTS = (0.01, 0.03, 0.1, 0.3, 1.0)
CONTROLLED_WEIGHT = 0.1  # too few decode passes to cross-validate
CV_MIN_DECODE = 20


def profile_backend(name: str, kind: str):
    """``auto``: a CPU profile times the NumPy backend; a GPU profile CuPy when it is usable."""
    from s2moe.runtime.kernels.backend import NUMPY, select_backend

    return NUMPY if name == "auto" and kind == "cpu" else select_backend(name)


def offload_tier_of(kind: str) -> str:
    """The profile's name for where missing experts come from on this kind of device."""
    return "file" if kind == "cpu" else ("host" if kind in ("cuda", "rtx4090") else "ssd")


def _xy(samples) -> tuple[np.ndarray, np.ndarray]:
    X = np.array([[s[f] for f in FEATURES] for s in samples], dtype=np.float64).reshape(-1, len(FEATURES))
    return X, np.array([s["seconds"] for s in samples], dtype=np.float64)


def fit_cost_model(controlled: list[dict], decode: list[dict] = ()) -> tuple[VerificationCostModel, float, float]:
    """The cost model, and its R² and MAPE on the decode passes (on the controlled ones when there
    are none). The model carries ``controlled_weight_`` and ``cv_mape_`` (None unless chosen by CV)."""
    (Xc, yc), (Xd, yd) = _xy(controlled), _xy(decode)
    X, y = np.vstack([Xc, Xd]), np.concatenate([yc, yd])

    def fitted(w: float, keep=slice(None)) -> VerificationCostModel:
        rows = np.arange(len(yd))[keep]
        sw = np.concatenate([np.full(len(yc), w), np.ones(len(rows))])
        return VerificationCostModel().fit(np.vstack([Xc, Xd[rows]]), np.concatenate([yc, yd[rows]]), sample_weight=sw)

    cv = None
    if not len(yd):
        weight = 1.0
    elif len(yd) < CV_MIN_DECODE or not len(yc):
        weight = CONTROLLED_WEIGHT
    else:
        fold = np.arange(len(yd)) % 5
        cv = {w: float(np.mean([fitted(w, fold != f).mape(Xd[fold == f], yd[fold == f]) for f in range(5)]))
              for w in CONTROLLED_WEIGHTS}
        weight = min(cv, key=lambda w: (cv[w], -w))  # ties: the larger weight, the better-posed fit
    model = fitted(weight)
    model.controlled_weight_ = weight
    model.cv_mape_ = cv[weight] if cv else None
    Xs, ys = (Xd, yd) if len(yd) else (X, y)
    return model, model.score(Xs, ys), model.mape(Xs, ys)


def fit_details(model: VerificationCostModel, scored_on: str) -> dict:
    """What a profile's ``cost_model.fit`` records of how `fit_cost_model` weighed its passes."""
    cv = model.cv_mape_
    return {"scored_on": scored_on, "controlled_weight": model.controlled_weight_,
            "cv_mape_percent": None if cv is None else round(cv * 100, 3)}


def run_profile(model_path: str, device: str, budget: str | None, workload: str | None, out: str,
                draft_topk: int | None, samples_n: int, emulate_bandwidth: float | None, emulate_latency: float,
                fetch_threads: int, decode_tokens: int, policy: str = "lfu", resume: bool = False,
                rounds: int = replay_mod.DEFAULT_ROUNDS, backend="auto", context: int | None = None,
                n_prompts: int = DECODE_PROMPTS, draft_vocab: int = 0, token_ranks: str | None = None,
                draft_cap: int | None = None) -> dict:
    """``backend``: a name for `profile_backend`, or a `Backend` (tests pass a CPU stand-in).
    ``draft_vocab``: C_draft is timed with a FR-Spec head of that many rows (``token_ranks``: its
    ranks file, default the model's), as `s2moe run --draft-vocab` drafts; the profile records it.
    ``n_prompts``: profiling prompts decoded (32 tokens each) for the fit's in-situ passes.
    ``context``: prompt + generated tokens the runs will use; the KV reservation, the hot list and
    the decode passes are planned for it as `s2moe run` plans (see plan.py). ``draft_cap``: the
    longest draft runs with this profile make (default `SpecSettings.draft_cap`); the passes are
    timed up to it and the profile carries it, since the best cap differs by model size."""
    from s2moe.runtime.offload.cache import ExpertCache
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.forward import MoEModel
    from s2moe.runtime.offload.store import Emulation, ExpertStore
    from s2moe.runtime.model.tokenizer import load_tokenizer

    kind, facts = resolve_device(device, model_path)
    arrays = backend if not isinstance(backend, str) else profile_backend(backend, kind)
    tier = engine_tier(offload_tier_of(kind))
    loaded = load_model(model_path)
    c = loaded.config
    tok = load_tokenizer(loaded)
    profiling, heldout, workload_path = _workload_tokens(tok, workload)
    draft_k = default_draft_topk(c.top_k) if draft_topk is None else \
        int(number("--draft-topk", draft_topk, low=1, high=c.top_k, integer=True))
    draft_cap = SpecSettings.draft_cap if draft_cap is None else \
        int(number("--draft-cap", draft_cap, low=1, high=256, integer=True))
    if draft_vocab:  # a ranks file that cannot serve the head fails here, before any timing
        from s2moe.runtime.model.draft_head import head_ids, ranks_file

        head_ids(ranks_file(loaded.path, token_ranks), c.vocab_size, draft_vocab)
    ctx = plan_mod.context_tokens(plan_mod.DEFAULT_CONTEXT if context is None else context,
                                  c.max_position_embeddings)
    # the plan `s2moe run` makes for a run of ctx tokens: a budget too small fails here, at once
    plan = plan_mod.run_plan(loaded, budget, ctx, draft_cap, arrays, draft_vocab=draft_vocab)
    kv_positions, pass_batch = plan_mod.kv_positions(ctx, draft_cap), plan_mod.batch(ctx, draft_cap)
    fingerprint = model_fingerprint(loaded)
    emulation = Emulation(emulate_bandwidth, emulate_latency)
    samples_path = os.path.splitext(out)[0] + ".samples.json"
    gathered: dict = {"model": loaded.path, "fingerprint": fingerprint, "device": kind, "budget": budget or "1.0",
                      "context_tokens": ctx,
                      "emulation": [emulate_bandwidth, emulate_latency], "fetch_threads": fetch_threads,
                      "rounds": rounds, "backend": arrays.name, "draft_vocab": draft_vocab, "draft_topk_asked": draft_topk,
                      "draft_cap": draft_cap}
    if resume:
        gathered = _resumable(samples_path, gathered)

    def keep(stage: str, value) -> None:  # samples survive an interrupted run
        gathered[stage] = value
        write_json_atomic(samples_path, gathered)

    with _progress() as progress:
        # offload tier: raw requests at sizes around the expert size
        # buffers reused as at run time (the probes read up to 4 experts' worth, one at a time)
        probe = max(max(e.stored_bytes for e in loaded.experts.values()), 64 << 10)
        store = ExpertStore(loaded, direct=True, emulation=emulation, threads=fetch_threads, pool_bytes=9 * probe)
        reps = 6
        t = progress.add_task("offload bandwidth", total=reps * 5)
        bw = measure.refit_if_old(gathered.get("offload")
                                  or measure.offload_bandwidth(store, loaded, reps, lambda: progress.advance(t)))
        progress.update(t, completed=reps * 5)
        keep("offload", bw)
        if arrays.on_device:  # the device's own slow link: pinned host → device copies
            t = progress.add_task("host → device copies", total=10 * 5)
            h2d = measure.refit_if_old(gathered.get("host_to_device") or measure.host_to_device(
                arrays, next(iter(loaded.experts.values())).resident_bytes, 10, lambda: progress.advance(t)))
            keep("host_to_device", h2d)
        if tier == "host":
            from s2moe.runtime.offload.host_tier import HostTier

            store = HostTier(store, arrays)

        # hot experts for the budget (traces run with no budget in the way)
        model = MoEModel(loaded, ExpertCache(store, capacity_bytes=None, place=arrays.upload_expert), arrays)
        model.cache_type = resolve_cache_type("auto", loaded.config)  # as runs hold it
        t = progress.add_task("routing traces (hot experts)", total=len(profiling) + len(heldout))
        tick = lambda: progress.advance(t)  # noqa: E731
        residency = gathered.get("hot_experts")
        if residency is None:
            traces = (measure.routing_traces(model, profiling, tick), measure.routing_traces(model, heldout, tick))
            size_of = plan_mod.expert_size(arrays)
            sizes = {k: size_of(e) for k, e in loaded.experts.items()}
            residency = hot_mod.plan_residency(*traces, sizes, plan.expert_capacity)
        progress.update(t, completed=len(profiling) + len(heldout))
        keep("hot_experts", residency)

        # T_AR and C_draft at the budget, with the chosen residency
        pinned = [tuple(k) for k in residency["gpu_experts"]]
        prompts = heldout[:6]
        draft_choice = gathered.get("draft_k_choice")
        if draft_topk is None and draft_choice is None:  # how many experts the draft takes: measured
            ks = draft_k_mod.candidates(c.top_k, draft_k)
            # tokens kept vary a lot between steps: more prompts and steps than the decode timings take
            k_prompts, k_tokens = heldout[:12], max(2 * decode_tokens, draft_cap + 4)
            t = progress.add_task(f"draft k ({', '.join(map(str, ks))})", total=len(k_prompts))
            engine = build_engine(loaded.path, budget, kv_positions, pinned, policy, emulate_bandwidth,
                                  emulate_latency, loaded=loaded, fetch_threads=fetch_threads, backend=arrays,
                                  offload_tier=tier, batch=pass_batch, draft_vocab=draft_vocab)
            got = draft_k_mod.measure(engine.model, k_prompts, k_tokens, ks, draft_cap,
                                      lambda k: draft_policy(engine.model, k), lambda: progress.advance(t))
            engine.close()
            draft_choice = draft_k_mod.choose(got, draft_cap, draft_k)[1]
            keep("draft_k_choice", draft_choice)
        if draft_choice is not None:
            draft_k = draft_choice["chosen"]
        t = progress.add_task("decode steps (T_AR, C_draft)", total=2 * len(prompts))
        tick = lambda: progress.advance(t)  # noqa: E731
        steps = gathered.get("decode_steps") or {}
        for name in ("t_ar", "c_draft"):
            if name not in steps:
                engine = build_engine(loaded.path, budget, kv_positions, pinned, policy, emulate_bandwidth,
                                      emulate_latency, loaded=loaded, fetch_threads=fetch_threads, backend=arrays,
                                      offload_tier=tier, batch=pass_batch, draft_vocab=draft_vocab)
                assert engine.plan.expert_capacity == plan.expert_capacity, "profile and run plans differ"
                policy_for = TARGET if name == "t_ar" else draft_policy(engine.model, draft_k)
                head = engine.model.draft_head(draft_vocab, token_ranks) if name == "c_draft" else None
                steps[name] = measure.decode_step_times(engine.model, prompts, decode_tokens, policy_for, tick,
                                                        head=head)
                engine.close()
                keep("decode_steps", steps)
        progress.update(t, completed=2 * len(prompts))
        t_ar, c_draft = steps["t_ar"], steps["c_draft"]

        # verification cost: cache states under control, no budget in the way
        pool = replay_mod.WeightPool()
        ver = gathered.get("verification")
        controlled = []
        if ver is None:  # timed below, in the same replay rounds as the decode passes
            t = progress.add_task("verification passes (T_exp)", total=samples_n)
            controlled = measure.controlled_passes(model, profiling, draft_cap + 1, samples_n, pool,
                                                   lambda: progress.advance(t), reuse_cap=2 * c.top_k)

        # verification passes of real S²-MoE decoding at the budget (profiling half of the workload):
        # the controlled passes pin down miss vs hit costs, these add the operating distribution
        # (eviction, streaming, gating) the model must predict; validate uses the other half
        in_situ = gathered.get("decode_verification")
        if in_situ is None or ver is None:
            from s2moe.runtime.decoding.cost_model import CostConstants

            spec = {"draft_topk": draft_k, "draft_cap": draft_cap, "reuse_cap": 2 * c.top_k, "draft_vocab": draft_vocab}
            placeholder = CostConstants(t_ar=1.0, c_draft=1.0, t_exp_miss=0.0, t_exp_hit=0.0)  # threshold 0: unused
            emu = {"bandwidth_mb_s": emulate_bandwidth, "latency_us": emulate_latency}
            with decode_passes(loaded, profiling[:n_prompts] if in_situ is None else [], budget, pinned, spec, placeholder,
                               emu, 32, pool, progress, fetch_threads, arrays, tier,
                               kv_positions=kv_positions, batch=pass_batch) as (decoded, engine_model):
                # the reference passes validate times too: how far the machine moves in between
                probes = speed_probe.reference_passes(engine_model, pool)
                timed = decoded + speed_probe.every_pass(probes)
                t = progress.add_task(f"replays ({rounds} rounds)", total=rounds * (len(controlled) + len(timed)))
                replay_mod.replay(timed, pool, rounds, lambda: progress.advance(t), groups=[controlled])
            ver = ver if ver is not None else [p.sample() for p in controlled]
            in_situ = in_situ if in_situ is not None else [p.sample() for p in decoded]
            keep("verification", ver)
            keep("decode_verification", in_situ)
            keep("probe", speed_probe.summarize(probes))
        store.close()

    cost_model, fit_r2, fit_mape = fit_cost_model(ver, in_situ)
    ar, dr = measure.summarize(t_ar), measure.summarize(c_draft)
    const = cost_model.constants(ar["median"], dr["median"], "profile")
    per_layer = [{"layer": L, "stored": loaded.experts[L, 0].stored_bytes, "resident": loaded.experts[L, 0].resident_bytes}
                 for L in c.moe_layer_ids]
    ms = 1e3
    return {
        "schema_version": 1,
        "source": "measured",
        "device": {"kind": kind, "name": facts["name"], "memory_bytes": facts.get("memory_bytes"),
                   "offload_tier": offload_tier_of(kind), "backend": arrays.name,
                   "how_measured": f"{arrays.name} backend; O_DIRECT reads of the model file; "
                                   + ("CUDA-event timing" if arrays.on_device else "perf_counter wall time"),
                   "emulation": emulation.describe() if emulation.active else None, "facts": facts},
        "model": {"name": os.path.basename(loaded.path.rstrip("/")), "architecture": c.arch,
                  "path": os.path.abspath(loaded.path), "fingerprint": fingerprint, "fingerprint_policy": "warn",
                  "layers": c.num_layers,
                  "experts": c.num_experts, "top_k": c.top_k,
                  "expert_bytes_stored": next(iter(loaded.experts.values())).stored_bytes,
                  "expert_bytes_resident": next(iter(loaded.experts.values())).resident_bytes,
                  "expert_bytes_per_layer": per_layer},
        "budget": {"spec": budget or "1.0", "expert_capacity_bytes": plan.expert_capacity, "total_bytes": plan.total,
                   "context_tokens": ctx, "kv_positions": kv_positions},
        "offload": {"bandwidth_mb_s": round(bw["bandwidth_mb_s"], 3), "latency_us": round(bw["latency_us"], 3),
                    "fit_r2": None if bw["fit_r2"] is None else round(bw["fit_r2"], 5),
                    "bandwidth_is_bound": bw["bandwidth_is_bound"],
                    "fetch_threads": fetch_threads,
                    "request_sizes": bw["request_sizes"],
                    **({"host_to_device_mb_s": round(h2d["bandwidth_mb_s"], 3),
                        "host_to_device_latency_us": round(h2d["latency_us"], 3),
                        "host_to_device_is_bound": h2d["bandwidth_is_bound"]} if arrays.on_device else {}),
                    "emulation": {"bandwidth_mb_s": emulate_bandwidth, "latency_us": emulate_latency}
                    if emulation.active else None},
        "cost_model": {"t_ar_ms": ar["median"] * ms, "t_ar_p90_ms": ar["p90"] * ms, "c_draft_ms": dr["median"] * ms,
                       "c_draft_routing": "resident experts only (else the best resident one), as s2moe run drafts",
                       "c_draft_head": f"the {draft_vocab} most frequent tokens" if draft_vocab else "the full vocabulary",
                       "t_exp_miss_ms": const.t_exp_miss * ms, "t_exp_hit_ms": const.t_exp_hit * ms,
                       "t_base_ms": const.t_base * ms, "t_token_ms": const.t_token * ms,
                       "fit": {"r2": round(fit_r2, 5), "mape_percent": round(fit_mape * 100, 3),
                               "n": len(ver) + len(in_situ), "n_controlled": len(ver), "n_decode": len(in_situ),
                               "features": list(FEATURES),
                               "timing": f"fastest of {rounds} interleaved replays per pass",
                               "loss": "relative",
                               **fit_details(cost_model, "decode passes" if in_situ else "controlled passes"),
                               "probe": gathered.get("probe")}},
        "hot_experts": residency,
        "speculative": {"draft_topk": draft_k, "draft_cap": draft_cap, "reuse_cap": 2 * c.top_k,
                        "utility_threshold": 1.0, "draft_vocab": draft_vocab,
                        **({"draft_topk_choice": draft_choice} if draft_choice is not None else {})},
        "validation": None,
        "provenance": {"tool_version": __version__, "commit": git_commit(),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "workload": workload_path, "samples": os.path.basename(samples_path)},
    }


def draft_policy(model, draft_k: int) -> RoutingPolicy:
    """The draft as `s2moe run` drafts by default: its top experts among the resident ones (the best
    resident expert where none is), so C_draft is timed without fetches, as the run pays it."""
    resident = getattr(model.experts, "resident_mask", None)
    E = model.config.num_experts
    if resident is None:  # everything resident: no restriction to make
        return RoutingPolicy(top_k=draft_k)
    return RoutingPolicy(top_k=draft_k, allowed=lambda L: resident(L, E), fallback="best")


def summary_table(profile: dict) -> Table:
    c, o, h = profile["cost_model"], profile["offload"], profile["hot_experts"] or {}
    b, s = profile["budget"], profile["speculative"]
    t = Table(title=f"device profile · {profile['device']['kind']} · {profile['model']['name']} · "
                    f"budget {profile['budget']['spec']}")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    rows = [
        ("offload bandwidth", f"{o['bandwidth_mb_s']:.1f} MB/s"
                              + (" (a lower bound: read times did not grow with size)" if o.get("bandwidth_is_bound") else "")),
        ("request latency", f"{o['latency_us']:.1f} µs"
                            + (f" (fit R² {o['fit_r2']:.3f})" if o.get("fit_r2") is not None else "")),
        ("expert bytes stored / resident", f"{profile['model']['expert_bytes_stored']:,} / "
                                           f"{profile['model'].get('expert_bytes_resident') or 0:,}"),
        ("T_exp miss / hit", f"{c['t_exp_miss_ms']:.4f} / {c['t_exp_hit_ms']:.4f} ms"),
        ("verification base / per token", f"{c['t_base_ms']:.3f} / {c['t_token_ms']:.4f} ms"),
        ("cost fit (in-sample)", f"R² {c['fit']['r2']:.4f} · MAPE {c['fit']['mape_percent']:.2f} % · n {c['fit']['n']}"),
        ("T_AR median / p90", f"{c['t_ar_ms']:.3f} / {c['t_ar_p90_ms']:.3f} ms"),
        (f"C_draft (draft k {s['draft_topk']}" + (f", head of {s['draft_vocab']} tokens)" if s.get("draft_vocab") else ")"),
         f"{c['c_draft_ms']:.3f} ms"),
        ("budget plan", f"{b['spec']}: {b['expert_capacity_bytes']:,} bytes for experts, runs of up to "
                        f"{b['context_tokens']} tokens ({b['kv_positions']} KV positions)"),
        ("residency strategy", f"{h.get('strategy')} ({len(h.get('gpu_experts', []))} pinned)"),
        ("held-out hit rates", ", ".join(f"{k} {v:.1%}" for k, v in (h.get("heldout_hit_rates") or {}).items())),
    ]
    choice = s.get("draft_topk_choice")
    if choice:  # what each candidate k modeled (tokens per T_AR), the chosen one marked
        rows.append(("draft k, measured", "  ".join(
            f"{k}{'*' if int(k) == choice['chosen'] else ''}: {v['modeled_tokens_per_t_ar']:.2f}"
            for k, v in choice["candidates"].items()) + " tokens per T_AR"))
    for name, m in (h.get("pin_margins") or {}).items():  # pinned only when it wins by more than 2 SE
        rows.append((f"{name} vs {m['over']}", f"{m['mean']:+.1%} ± {m['standard_error']:.1%} (pinned if > 2 SE)"))
    for row in rows:
        t.add_row(*row)
    return t


# the in-sample fit below these is worth a warning: validate will most likely fail too
POOR_FIT_R2 = 0.9
POOR_FIT_MAPE_PERCENT = 10.0


def fit_warning(profile: dict) -> str | None:
    """One line when the profile's own cost fit is poor, naming what to do; else None."""
    fit = profile["cost_model"].get("fit") or {}
    r2, mape = fit.get("r2"), fit.get("mape_percent")
    if r2 is None or mape is None or (r2 >= POOR_FIT_R2 and mape <= POOR_FIT_MAPE_PERCENT):
        return None
    return (f"warning: the cost fit is poor (R² {r2:.3f}, MAPE {mape:.1f} %; wanted R² ≥ {POOR_FIT_R2}, "
            f"MAPE ≤ {POOR_FIT_MAPE_PERCENT:g} %): raise --samples or --rounds, profile on an idle machine, "
            "and check it with s2moe-calib validate")


def check_counts(**flags) -> None:
    """Whole-number flags with their least value, through the one validation path (checks.py)."""
    for flag, (value, low) in flags.items():
        number(flag, value, low=low, integer=True)


def profile(
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, orin or rtx4090."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model to profile (default: the embedded model)."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Memory budget the profile is for (16g, 0.25, …)."),
    ctx_size: int = typer.Option(plan_mod.DEFAULT_CONTEXT, "--ctx-size", help="Context the runs will use (prompt + generated tokens): KV, workspace and the hot list are planned for it as s2moe run plans; longer runs leave less room for experts."),
    workload: Optional[str] = typer.Option(None, "--workload", "-w", help="JSONL prompts (default: the packaged set)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Profile path (default profiles/<detected device>-<model>.json)."),
    draft_topk: Optional[int] = typer.Option(None, "--draft-topk", help="Draft experts per token (default: measured: every k from 1 to twice the paper's k/2 drafts beside a greedy decode; k/2 stays unless another k models faster by more than 2 standard errors; calib/draft_k.py)."),
    draft_cap: Optional[int] = typer.Option(None, "--draft-cap", help="Longest draft runs with this profile make (default 4, which beat 8 by 1.06-1.17x: docs/performance/s2moe-real-size.md); verification passes are timed up to it."),
    draft_vocab: int = typer.Option(0, "--draft-vocab", min=0, help="Time C_draft with a FR-Spec draft head of the N most frequent tokens, as s2moe run --draft-vocab N drafts (0: the full head); runs with this profile draft with it unless --draft-vocab says otherwise."),
    token_ranks: Optional[str] = typer.Option(None, "--token-ranks", help="Token-ranks file for --draft-vocab (default: token_ranks.json beside the model)."),
    samples: int = typer.Option(150, "--samples", help="Timed verification passes for the cost fit (at least 10)."),
    n_prompts: int = typer.Option(DECODE_PROMPTS, "--n-prompts", help="Profiling prompts decoded for the fit's in-situ verification passes, 32 tokens each (at least 1; validate decodes held-out ones)."),
    decode_tokens: int = typer.Option(24, "--decode-tokens", help="Decode steps per prompt for T_AR / C_draft (at least 4)."),
    backend: str = typer.Option("auto", "--backend", help="Backend to time: auto (NumPy for --device cpu, else CuPy when usable), numpy or cupy."),
    rounds: int = typer.Option(replay_mod.DEFAULT_ROUNDS, "--rounds",
                               help="Interleaved replays per timed pass; its time is the fastest."),
    fetch_threads: int = typer.Option(8, "--fetch-threads", help="Concurrent expert reads (the runtime's default is 8; the profile records it and validate uses it)."),
    emulate_bandwidth: Optional[float] = typer.Option(None, "--emulate-bandwidth", help="Emulated slow tier MB/s."),
    emulate_latency: float = typer.Option(0.0, "--emulate-latency", help="Emulated request latency µs."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its samples file."),
    json_out: bool = typer.Option(False, "--json", help="Print the profile JSON on stdout too."),
    update: Optional[str] = typer.Option(None, "--update", help="Refit this profile from a run's passes (--passes) instead of measuring."),
    passes: Optional[str] = typer.Option(None, "--passes", help="With --update: passes written by s2moe run --record-passes FILE."),
):
    """Measure T_exp, T_AR, C_draft, expert bytes, bandwidth and hot experts; write a profile."""
    with cli_errors():
        if update is not None or passes is not None:
            return update_command(update, passes, json_out)
        check_counts(**{"--samples": (samples, 10), "--n-prompts": (n_prompts, 1),
                        "--decode-tokens": (decode_tokens, 4), "--rounds": (rounds, 1),
                        "--fetch-threads": (fetch_threads, 1), "--ctx-size": (ctx_size, 2)})
        if draft_cap is not None:
            number("--draft-cap", draft_cap, low=1, high=256, integer=True)
        if draft_topk is not None:
            number("--draft-topk", draft_topk, low=1, integer=True)  # and at most top-k, once the model is read
        if emulate_bandwidth is not None:
            number("--emulate-bandwidth", emulate_bandwidth, low=0, low_open=True)
        number("--emulate-latency", emulate_latency, low=0)
        kind, _ = resolve_device(device)  # a wrong --device fails before any model work
        path = resolve_model(model)
        if not os.path.exists(path):
            raise UsageError(f"--model {model}: no such file or folder; pass an HF folder or a .gguf file")
        name = os.path.basename(path.rstrip("/")).removesuffix(".gguf")
        target = out or os.path.join("profiles", f"{kind}-{name}.json")  # the device found, not "auto"
        try:
            data = run_profile(path, device, budget, workload, target, draft_topk, samples, emulate_bandwidth,
                               emulate_latency, fetch_threads, decode_tokens, resume=resume, rounds=rounds,
                               backend=backend, context=ctx_size, n_prompts=n_prompts, draft_vocab=draft_vocab,
                               token_ranks=token_ranks, draft_cap=draft_cap)
        except KeyboardInterrupt:
            samples_path = os.path.splitext(target)[0] + ".samples.json"
            say(f"interrupted: {target} is unchanged; samples so far are in {samples_path}; "
                      "continue with --resume")
            raise
        save_profile(target, data)
        err.print(summary_table(data))
        warning = fit_warning(data)
        if warning:
            say(warning, "yellow")
        say(f"wrote {target} (samples beside it; planned for runs of up to {data['budget']['context_tokens']} "
            f"tokens of context); next: s2moe-calib validate --profile {shlex.quote(target)}")
        if json_out:
            print_json(data)


def update_command(profile_path: str | None, passes_path: str | None, json_out: bool) -> None:
    """`profile --update PROFILE --passes FILE`: the refit, a before/after table, the next step."""
    from .update import run_update

    if profile_path is None or passes_path is None:
        raise UsageError("--update PROFILE and --passes FILE go together: s2moe-calib profile --update "
                         "PROFILE --passes FILE (record FILE with s2moe run --record-passes FILE)")
    summary = run_update(profile_path, passes_path)
    t = Table(title=f"{profile_path} refitted from {passes_path}")
    for col in ("constant", "before (ms)", "after (ms)"):
        t.add_column(col, justify="left" if col == "constant" else "right")
    for k, before in summary["before"].items():
        t.add_row(k.removesuffix("_ms"), f"{before:.4f}", f"{summary['after'][k]:.4f}")
    err.print(t)
    fit = summary["fit"]
    say(f"updated {profile_path}: fit R² {fit['run_r2']:.3f}, MAPE {fit['run_mape_percent']:.1f} % on the run's "
        f"{fit['n_decode']} passes" + (f"; kept {', '.join(summary['kept'])}" if summary["kept"] else "")
        + f"; next: s2moe-calib validate --profile {shlex.quote(profile_path)}")
    if json_out:
        print_json(summary)
