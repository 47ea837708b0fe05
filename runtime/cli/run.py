"""`s2moe run`: generate from a prompt with S²-MoE (or a baseline), streaming text; a summary
line and the expert-cache table at the end (stderr), or one JSON object with ``--json``."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Optional

import typer

from .common import err, print_json, resolve_model, say
from ..decoding.methods import SpecSettings
from .errors import cli_errors


def run(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text; '-' reads it from stdin."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-f", help="Read the prompt from this UTF-8 file."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF folder or .gguf file (default: the embedded model)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer.json (or its folder) to use instead of the model's."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", min=1, help="Tokens to generate at most (generation also stops at the context)."),
    ctx_size: Optional[int] = typer.Option(None, "--ctx-size", "-c", min=16, help="Context length in tokens, prompt included (default: the model's trained length)."),
    method: str = typer.Option("s2moe", "--method", help="ar, es, confidence, cascade, ca, ca+ae, s2moe."),
    draft_topk: Optional[str] = typer.Option(None, "--draft-topk", help="Draft experts per token: K, or K,LAYER:K,… (default: from the profile, else k/4 for k ≥ 6, k/2 below)."),
    draft_cap: Optional[int] = typer.Option(None, "--draft-cap", help="Most draft tokens per verification (default: profile, else 4)."),
    reuse_cap: Optional[int] = typer.Option(None, "--reuse-cap", help="Reuse-aware gating's preferred-set size (default 2×k)."),
    utility_threshold: Optional[float] = typer.Option(None, "--utility-threshold", help="Admit a draft token while U_i ≥ this (default: profile, else 1)."),
    ae_lookahead: int = typer.Option(SpecSettings.ae_lookahead, "--ae-lookahead", help="AE drafts until this many tokens past the prefix of largest summed gain, and verifies that prefix (1: stop at the first token with U_i < threshold, the paper's rule)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Device profile: budget, hot experts, cost constants, speculative settings (flags override)."),
    rg_variant: str = typer.Option(SpecSettings.rg_variant, "--rg-variant", help="Reuse-aware gating: resident (the paper's, E* also favouring experts the fast tier holds; the default), paper (per-token λ, draft-confidence weights) or code (published code)."),
    no_rg: bool = typer.Option(False, "--no-rg", help="Turn reuse-aware gating off (lossless S²-MoE)."),
    rg_residency: float = typer.Option(SpecSettings.rg_residency, "--rg-residency", help="Reuse gating 'resident' variant: bonus of experts the fast tier holds or is reading (0 = the paper's preferred set)."),
    rg_strength: float = typer.Option(SpecSettings.rg_strength, "--rg-strength", help="Reuse gating's bias: a multiple of each token's top-1 − (k+1)-th logit gap (1 = the paper's; 0 = no gating). Above 1 verification reads less and the output drifts from the target's: docs/performance/s2moe-gating.md prices it."),
    draft_fallback: str = typer.Option(SpecSettings.draft_fallback, "--draft-fallback", help="A draft token whose experts are all absent: best (the best resident expert) or skip (no experts in that layer)."),
    draft_any_expert: bool = typer.Option(False, "--draft-any-expert", help="Let the draft fetch absent experts (default: resident ones only under a budget)."),
    no_prefetch: bool = typer.Option(False, "--no-prefetch", help="Do not read the experts the draft predicts for verification ahead of time."),
    prefetch_slots: Optional[int] = typer.Option(None, "--prefetch-slots", min=0, help="Prefetches in flight at most (default 2 × top-k under a budget); each takes its room in the expert cache."),
    always_prefetch: bool = typer.Option(True, "--always-prefetch/--prefetch-trial", help="Prefetch on every iteration (the default), or, on the CPU with live costs, only where a trial in the run measures it taking fewer seconds per token."),
    no_live_costs: bool = typer.Option(False, "--no-live-costs", help="Keep the profile's (or start-up) cost constants fixed instead of following the passes this run makes."),
    no_rate_guard: bool = typer.Option(False, "--no-rate-guard", help="AE keeps speculating even where speculation is measured slower than AR steps (the guard needs live costs)."),
    acceptance: str = typer.Option(SpecSettings.acceptance, "--acceptance", help="AE's acceptance probability of a draft token: learned (from the verifications made so far) or confidence (the draft's own probability, as in the paper)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", min=0, help="FR-Spec: the draft's lm head covers only the N most frequent tokens of the model's token_ranks.json (0 = all; default: the profile's, else 0); verification keeps the full head, so the output is unchanged."),
    token_ranks: Optional[str] = typer.Option(None, "--token-ranks", help="Token-ranks file for --draft-vocab (default: token_ranks.json beside the model; write one with s2moe vocab)."),
    no_share_kv: bool = typer.Option(False, "--no-share-kv", help="Ablation: the draft keeps its own KV cache."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="0 = greedy (argmax). Default: the model's generation_config.json, else 0."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p × the top probability."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (-1 or absent: a fresh random one)."),
    sampler: str = typer.Option("auto", "--sampler", help="Sampled speculation: coupled (a seed gives AR's text whatever was drafted), standard (accepts more; the text can follow draft decisions) or auto (coupled with --seed, else standard)."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Memory budget for the model (dense + experts + KV + workspace): 16g, 512m, or a share of the experts (0.25) on top of the rest. Default: everything resident."),
    expert_budget: Optional[str] = typer.Option(None, "--expert-budget", help="Memory for resident experts only (same forms as --budget)."),
    memory_limit: str = typer.Option("auto", "--memory-limit", help="Memory for the whole process (16g, 512m); the plan takes it less what the process holds. auto (default): the memory cgroup's limit, else MemAvailable, where the model does not fit; none: off. A --budget given instead wins over auto."),
    kernels: str = typer.Option("auto", "--kernels", help="auto (compiled CPU kernels when built), cpu, or numpy (the reference path)."),
    load: str = typer.Option("background", "--load", help="Every expert resident: read the ones the prompt needs, then the rest while decoding (background, as mmap starts), or all before the prompt (now)."),
    cache_type: str = typer.Option("auto", "--cache-type", help="KV cache type: f32, f16 or q8_0 (llama.cpp's block of 32). auto: f16, or f32 on a GPU backend."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Compute threads (default: the cores this process may use)."),
    hot_experts: Optional[str] = typer.Option(None, "--hot-experts", help='Pinned experts, JSON {"gpu_experts": [[layer, expert], ...]}.'),
    cache_policy: str = typer.Option("lfu", "--cache-policy", help="Replacement policy for non-pinned experts: lfu or lru."),
    emulate_bandwidth: Optional[float] = typer.Option(None, "--emulate-bandwidth", help="Emulate a slow tier of this many MB/s (what-if runs)."),
    emulate_latency: float = typer.Option(0.0, "--emulate-latency", help="Emulated per-request latency in µs."),
    offload_tier: Optional[str] = typer.Option(None, "--offload-tier", help="Where missing experts come from: file (SSD/disk, Orin) or host (all experts decoded once into pinned host RAM, RTX 4090). Default: the profile's tier, else file."),
    backend: str = typer.Option("auto", "--backend", help="auto (CuPy when a CUDA device is usable, else NumPy), numpy or cupy."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate --max-tokens tokens even past end-of-sequence (benchmarks)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    trace_path: Optional[str] = typer.Option(None, "--trace", help="Record the run's passes (experts per pass) here, for s2moe-calib predict."),
    record_passes: Optional[str] = typer.Option(None, "--record-passes", help="Write the run's timed passes here, for s2moe-calib profile --update PROFILE --passes FILE."),
):
    """Generate text with the model (S²-MoE self-speculative decoding by default)."""
    o = SimpleNamespace(**locals())  # the flags, as decoding_setup (shared with chat) reads them
    with cli_errors():
        from ..decoding.speculative import SpeculativeDecoder
        from ..model.tokenizer import load_tokenizer

        text_in = read_prompt(prompt, prompt_file)
        from ..errors import UsageError
        from ..outputs import check_output

        for flag, path in (("--trace", trace_path), ("--record-passes", record_passes)):
            if path:
                check_output(path, flag)
        if trace_path and record_passes and os.path.abspath(trace_path) == os.path.abspath(record_passes):
            raise UsageError(f"--trace and --record-passes both name {trace_path}; give them different files")
        spec, arrays, loaded, params, chosen, settings = decoding_setup(o)
        tok = load_tokenizer(loaded, tokenizer)
        ids = tok.encode(text_in).ids
        if not ids:
            raise typer.BadParameter("the prompt encodes to no tokens", param_hint="--prompt")
        context = context_length(loaded.config, ctx_size)
        limit = fit_context(len(ids), max_tokens, context)
        kv_positions = len(ids) + limit + 2 * max(settings.draft_cap, 8) + 2
        engine = open_engine(loaded, spec, settings, chosen, arrays, kv_positions,
                             batch=max(len(ids) if len(ids) < 64 else 64, 1 + 2 * settings.draft_cap),
                             cache_policy=cache_policy, emulate_bandwidth=emulate_bandwidth,
                             emulate_latency=emulate_latency, offload_tier=offload_tier,
                             expert_budget=expert_budget, kernels=kernels, threads=threads,
                             memory_limit=memory_limit, prompt_tokens=len(ids), cache_type=cache_type, load=load)
        costs = start_costs(engine, spec, settings, chosen, ids)
        decoder = SpeculativeDecoder(engine.model, spec, settings, costs or _unused_costs(), params,
                                     live=costs is not None and not no_live_costs)
        stream = _Streamer(tok) if not json_out else None
        stop_ids = () if ignore_eos else loaded.config.eos_token_ids
        recorder = None
        if trace_path:
            from ..decoding.trace import TraceRecorder

            recorder = TraceRecorder(loaded, chosen.budget, engine.emulation.describe() if engine.emulation.active else None)
            recorder.start(engine.cache)
        result = decoder.generate(ids, limit, stop_ids, on_token=stream.push if stream else None)
        if recorder is not None:
            recorder.stop(spec.name, max(len(result.tokens) - 1, 1), result.decode_seconds)
            recorder.write(trace_path)
        if limit < max_tokens and result.stop_reason == "max_tokens":
            result.stop_reason = "context"  # the context ran out before --max-tokens
        engine.close()
        if record_passes:
            write_pass_log(record_passes, decoder, loaded, arrays.name, engine, chosen.budget)
        report = engine.report()  # after the run: the measured peaks
        text = tok.decode(result.tokens)
        live = live_report(decoder, profile if chosen.profile is not None else None, record_passes)
        stats = {**result.stats(), **_per_token(report, len(result.tokens)), "method": spec.name, "live_costs": live,
                 "context": context, "sampling": {"temperature": params.temperature, "top_k": params.top_k,
                                                  "top_p": params.top_p, "min_p": params.min_p, "seed": params.seed,
                                                  "draws": params.draws},
                 "draft_topk": settings.draft_topk, "gating": settings.gating(spec, loaded.config.top_k),
                 "cost_constants": costs.to_dict() if costs else None, "offload": report,
                 "backend": {"name": arrays.name, "reason": arrays.reason, "host_reads": arrays.host_reads}}
        if json_out:
            print_json({"text": text, "prompt_tokens": ids, "tokens": result.tokens, "stats": stats})
            return
        stream.finish()
        print_summary(stats)


DRIFT = 0.10  # live constants this far from the profile's: say so


def decoding_setup(o):
    """What run and chat build from the same flags (``o``: their values by parameter name) before
    the engine: (method spec, backend, model refs, sampling, profile choice, settings)."""
    from ..decoding.methods import get_method
    from ..kernels.backend import select_backend
    from ..model.loader import load_model
    from .spec_options import apply_profile, check_draft_vocab, make_settings, say_strength_note

    spec = get_method(o.method, share_kv=False if o.no_share_kv else None, reuse_gating=False if o.no_rg else None)
    if o.no_rg and not get_method(o.method).reuse_gating:
        say(f"note: --no-rg has no effect: --method {o.method} does not use reuse-aware gating", "yellow")
    arrays = select_backend(o.backend)
    loaded = load_model(resolve_model(o.model), dense=False)  # the engine plans memory, then loads
    params = sampling_defaults(loaded, o.temperature, o.top_k, o.top_p, o.min_p, o.seed, o.sampler)
    chosen = apply_profile(o.profile, loaded, o.budget, o.hot_experts)
    settings = make_settings(loaded.config, o.draft_topk, o.draft_cap, o.reuse_cap, o.utility_threshold,
                             o.rg_variant, chosen.profile, rg_residency=o.rg_residency, rg_strength=o.rg_strength,
                             draft_fallback=o.draft_fallback, draft_resident=not o.draft_any_expert,
                             prefetch=not o.no_prefetch, prefetch_slots=o.prefetch_slots,
                             prefetch_always=o.always_prefetch, acceptance=o.acceptance, draft_vocab=o.draft_vocab,
                             token_ranks=o.token_ranks, ae_lookahead=o.ae_lookahead, rate_guard=not o.no_rate_guard)
    if spec.admit != "none":  # AR drafts nothing: no draft head to check (nor to build)
        check_draft_vocab(loaded, settings, o.draft_vocab)
    say_strength_note(settings, spec.reuse_gating)
    return spec, arrays, loaded, params, chosen, settings


def start_costs(engine, spec, settings, chosen, ids):
    """The profile's cost constants, else (for a method that prices drafts or gates) ones estimated
    now from timed passes over ``ids``; None where nothing needs them."""
    from ..decoding.estimate import estimate_costs
    from .spec_options import describe_costs

    costs = chosen.profile.costs if chosen.profile is not None else None
    if costs is None and (spec.admit in ("utility", "cascade") or spec.reuse_gating):
        costs = estimate_costs(engine.model, ids, settings_policy(settings),
                               draft_head=engine.model.draft_head(settings.draft_vocab, settings.token_ranks))
        say(f"no --profile: estimated cost constants at start-up from timed passes: {describe_costs(costs)}", "dim")
    return costs


def write_pass_log(path: str, decoder, loaded, backend: str, engine, budget: str | None) -> None:
    from ..decoding.pass_log import pass_log
    from ..profile import model_fingerprint, write_json_atomic

    emulation = engine.emulation.describe() if engine.emulation.active else None
    write_json_atomic(path, pass_log(decoder.metrics, loaded, model_fingerprint(loaded), backend, emulation, budget))
    n = len(decoder.metrics.verify_samples) + len(decoder.metrics.ar_samples)
    say(f"{n} timed passes written to {path}", "dim")


def live_report(decoder, profile_path: str | None, passes_path: str | None = None) -> dict | None:
    """The live cost constants at the end of a run and their drift from the profile's; one line
    when a constant the run measured often enough moved more than 10 %."""
    if decoder.live is None:
        return None
    live = decoder.live
    drift = live.drift()
    evidence = {"t_ar": live.t_ar.n, "c_draft": live.c_draft.n, "t_exp_miss": live.passes, "t_exp_hit": live.passes}
    moved = {k: v for k, v in drift.items() if abs(v) > DRIFT and evidence[k] >= 20}
    if profile_path and moved:
        from .spec_options import describe_costs

        worst = max(moved, key=lambda k: abs(moved[k]))
        say(f"note: this run's costs drifted from {profile_path} ({worst} {moved[worst]:+.0%}; now "
            f"{describe_costs(live.current())}); refresh it: " + refresh_command(profile_path, passes_path), "yellow")
    return {"constants": live.current().to_dict(), "drift": {k: round(v, 4) for k, v in drift.items()},
            "verify_passes": live.passes, **({"rate_guard": decoder.guard.to_dict()} if decoder.guard else {})}


def refresh_command(profile_path: str, passes_path: str | None) -> str:
    """The command that brings a drifted profile up to date: from this run's passes when they were
    recorded, else a run that records them."""
    import shlex

    p = shlex.quote(profile_path)
    if passes_path:
        return f"s2moe-calib profile --update {p} --passes {shlex.quote(passes_path)}"
    return f"re-run with --record-passes FILE, then s2moe-calib profile --update {p} --passes FILE"


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from --prompt (``-``: stdin) or --prompt-file, checked to be UTF-8 text."""
    from ..errors import UsageError

    if (prompt is None) == (prompt_file is None):
        raise UsageError("give the prompt once: --prompt TEXT, --prompt - (stdin) or --prompt-file PATH")
    if prompt_file is not None or prompt == "-":
        where = "--prompt -" if prompt == "-" else f"--prompt-file {prompt_file}"
        if prompt == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(prompt_file, "rb") as f:
                data = f.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                             "convert it to UTF-8") from None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv bytes that are not UTF-8 arrive as lone surrogates
        bad = ord(prompt[exc.start]) - 0xDC00 if 0xDC80 <= ord(prompt[exc.start]) <= 0xDCFF else ord(prompt[exc.start])
        raise UsageError(f"--prompt: not UTF-8 text (byte 0x{bad:02x} at character {exc.start}); pass UTF-8, "
                         "or --prompt-file") from None
    return prompt


def context_length(config, ctx_size: int | None) -> int:
    """--ctx-size, else the trained length; above the trained length with a warning."""
    trained = config.max_position_embeddings
    if ctx_size and ctx_size > trained:
        say(f"warning: --ctx-size {ctx_size} is above the {trained} positions the model was trained for; "
            "quality past them is not known", "yellow")
    return ctx_size or trained


def fit_context(prompt_tokens: int, max_tokens: int, context: int) -> int:
    """Tokens that can be generated: a prompt that fills the context is refused, and a request
    past it is cut there with one note (as llama.cpp does)."""
    from ..errors import UsageError

    if prompt_tokens >= context:
        raise UsageError(f"--prompt: {prompt_tokens} tokens; the context holds {context} positions; shorten the "
                         "prompt or pass --ctx-size (above the trained length at your own risk)")
    if prompt_tokens + max_tokens > context:
        say(f"note: prompt {prompt_tokens} + --max-tokens {max_tokens} tokens exceed the context of {context}; "
            f"generation stops after {context - prompt_tokens} (stop reason: context)", "yellow")
        return context - prompt_tokens
    return max_tokens


def open_engine(loaded, spec, settings, chosen, arrays, kv_positions: int, batch: int, *, cache_policy: str,
                emulate_bandwidth, emulate_latency: float, offload_tier, expert_budget, kernels: str, threads,
                memory_limit: str = "auto", prompt_tokens: int = 0, cache_type: str = "auto",
                load: str = "background"):
    """The engine for one model and method as `run`, `serve` and `bench` build it: the profile's tier
    and fetch threads unless flags say otherwise, prefetch slots only where drafts predict, planned
    to the process's memory limit where no budget is given (offload/limits.py)."""
    from ..engine import build_engine, engine_tier

    device = (chosen.profile.data.get("device") or {}) if chosen.profile is not None else {}
    offload = (chosen.profile.data.get("offload") or {}) if chosen.profile is not None else {}
    engine = build_engine(loaded.path, chosen.budget, kv_positions, chosen.hot_experts, cache_policy,
                          emulate_bandwidth, emulate_latency, loaded=loaded, backend=arrays,
                          offload_tier=offload_tier or engine_tier(device.get("offload_tier")),
                          fetch_threads=offload.get("fetch_threads"), expert_budget=expert_budget,
                          kernels=kernels, threads=threads, preload=_load_mode(load), budget_from=chosen.budget_from,
                          trim_hot=chosen.trim_hot, batch=batch,
                          prefetch_slots=settings.slots_for(spec),
                          draft_vocab=0 if spec.admit == "none" else settings.draft_vocab, memory_limit=memory_limit,
                          prompt_tokens=prompt_tokens, cache_type=cache_type)
    if engine.model.ops.reason.startswith("auto: the compiled"):
        say(f"note: {engine.model.ops.reason}; running on NumPy", "yellow")
    if engine.emulation.active:
        say(f"{engine.emulation.describe()}: timings are not this machine's", "yellow")
    return engine


def _load_mode(load: str):
    from ..errors import UsageError

    if load not in ("background", "now"):
        raise UsageError(f"--load {load!r}: choose background or now")
    return "background" if load == "background" else True


def _per_token(report: dict, generated: int) -> dict:
    """Distinct experts touched and bytes fetched per generated token, decode phases only."""
    phases = [p for name, p in report["cache"]["phases"].items() if name in ("ar", "draft", "verify")]
    n = max(generated - 1, 1)  # the first token comes from the prefill
    unique = sum((p["unique_experts_per_pass"] or 0) * p["passes"] for p in phases)
    return {"unique_experts_per_token": round(unique / n, 3),
            "bytes_fetched_per_token": round(sum(p["bytes_read"] for p in phases) / n, 1)}


def sampling_defaults(loaded, temperature, top_k, top_p, min_p, seed, sampler="auto"):
    """Flags win; otherwise the model's own defaults (generation_config.json with do_sample, or a
    GGUF's `general.sampling.*`), as transformers and llama.cpp do; otherwise greedy."""
    from ..decoding.sampling import SamplingParams

    defaults = loaded.generation_defaults
    pick = lambda flag, key, off: flag if flag is not None else defaults.get(key, off)  # noqa: E731
    return SamplingParams(float(pick(temperature, "temperature", 0.0)), int(pick(top_k, "top_k", 0)),
                          float(pick(top_p, "top_p", 1.0)), min_p,
                          None if seed is None or seed == -1 else seed,  # -1: random, as in llama.cpp
                          sampler)


def settings_policy(settings):
    from ..model.routing import RoutingPolicy

    return RoutingPolicy(top_k=settings.draft_topk, layer_top_k=dict(settings.layer_draft_topk))


def _unused_costs():
    """Methods whose admission rule ignores costs still take the argument."""
    from ..decoding.cost_model import CostConstants

    return CostConstants(t_ar=1.0, c_draft=1.0, t_exp_miss=0.0, t_exp_hit=0.0, source="unused")


def print_summary(stats: dict) -> None:
    """One summary line, then the per-phase expert accounting as a table (both on stderr)."""
    from rich.table import Table

    from ..offload.memory import fmt_bytes

    off = stats["offload"]
    cache = off["cache"]
    spec = ""
    if stats.get("verifications"):
        spec = (f" · acceptance length {stats['acceptance_length']:.2f} · accepted {stats['acceptance_rate'] or 0:.0%}"
                f" · reuse ratio {stats['reuse_ratio'] or 0:.2f}")
    say(f"{stats['method']} · prompt {stats['prompt_tokens']} tok · generated {stats['generated_tokens']} tok · "
        f"prefill {stats['prefill_ms']:.1f} ms · decode {stats['decode_tokens_per_s']:.1f} tok/s{spec} · "
        f"stop: {stats['stop_reason']} · budget {off['budget']} · peak experts "
        f"{fmt_bytes(cache['peak_resident_bytes'])} · {cache['policy']} · backend {stats['backend']['name']} "
        f"({stats['backend']['reason']}) · kernels {off['kernels']['name']} ({off['kernels']['path']}, "
        f"{off['kernels']['threads']} threads)", "dim")
    if "emulation" in off:
        say(off["emulation"], "yellow")
    say(memory_line(off["memory"], off["measured"]), "dim")
    table = Table(title="expert cache by phase", title_style="dim")
    for col in ("phase", "hits", "misses", "hit rate", "read", "fetch s", "MB/s", "experts/pass"):
        table.add_column(col, justify="right")
    for name, p in cache["phases"].items():
        table.add_row(name, str(p["hits"]), str(p["misses"]),
                      "-" if p["hit_rate"] is None else f"{p['hit_rate']:.1%}", fmt_bytes(p["bytes_read"]),
                      f"{p['fetch_seconds']:.3f}", "-" if p["bandwidth_mb_s"] is None else f"{p['bandwidth_mb_s']:.0f}",
                      "-" if p["unique_experts_per_pass"] is None else f"{p['unique_experts_per_pass']:.1f}")
    err.print(table)


def memory_line(plan: dict, measured: dict) -> str:
    """The plan next to the measured peak, one line."""
    from ..offload.memory import fmt_bytes

    line = (f"memory plan {fmt_bytes(plan['total_bytes'])}: dense {fmt_bytes(plan['dense_bytes'])} + experts "
            f"{fmt_bytes(plan['expert_capacity_bytes'])} + KV {fmt_bytes(plan['kv_bytes'])} + workspace "
            f"{fmt_bytes(plan['work_bytes'])} + baseline {fmt_bytes(plan['baseline_bytes'])} · peak VmHWM "
            f"{fmt_bytes(measured['vmhwm_bytes'] or 0)}")
    if measured.get("cgroup_peak_bytes") is not None:
        line += f" · cgroup peak {fmt_bytes(measured['cgroup_peak_bytes'])} (every process in {measured['cgroup']})"
    return line


class _Streamer:
    """Prints text as tokens arrive; decodes the whole tail so multi-byte characters stay intact."""

    def __init__(self, tok):
        self.tok, self.ids, self.printed = tok, [], ""

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for the next token
            return
        sys.stdout.write(text[len(self.printed):])
        sys.stdout.flush()
        self.printed = text

    def finish(self) -> None:
        text = self.tok.decode(self.ids)
        sys.stdout.write(text[len(self.printed):] + "\n")
        sys.stdout.flush()
