"""`s2moe bench`: methods side by side on a workload; table on stderr, records as JSON/CSV."""

from __future__ import annotations

from typing import Optional

import typer

from .common import err, resolve_model, say
from ..decoding.methods import SpecSettings
from .errors import cli_errors


def bench(
    workload: str = typer.Option("default", "--workload", "-w", help="JSONL file, 'default', or humaneval / gsm8k / mt-bench / specbench."),
    methods: str = typer.Option("ar,es,confidence,cascade,s2moe", "--methods", help="Comma-separated method names."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF folder or .gguf file (default: the embedded model)."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Memory budget for the model (16g, 512m, 0.25 = a share of the experts, bytes). Default: full."),
    expert_budget: Optional[str] = typer.Option(None, "--expert-budget", help="Memory for resident experts only (same forms)."),
    kernels: str = typer.Option("auto", "--kernels", help="auto, cpu (compiled) or numpy (reference)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Compute threads (default: available cores)."),
    n_prompts: int = typer.Option(8, "--n-prompts", min=1, help="Prompts taken from the start of the workload."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", min=2, help="Tokens per prompt (EOS ignored, as in the paper's runs)."),
    draft_topk: Optional[str] = typer.Option(None, "--draft-topk", help="Draft experts per token: K or K,LAYER:K,…"),
    draft_cap: Optional[int] = typer.Option(None, "--draft-cap"),
    reuse_cap: Optional[int] = typer.Option(None, "--reuse-cap"),
    utility_threshold: Optional[float] = typer.Option(None, "--utility-threshold"),
    ae_lookahead: int = typer.Option(SpecSettings.ae_lookahead, "--ae-lookahead", help="AE drafts until this many tokens past the prefix of largest summed gain, and verifies that prefix (1: stop at the first token with U_i < threshold, the paper's rule)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Device profile (cost constants, settings, budget, hot list)."),
    rg_variant: str = typer.Option(SpecSettings.rg_variant, "--rg-variant", help="Reuse-aware gating: resident (the paper's, E* also favouring experts the fast tier holds), paper or code (published code)."),
    rg_residency: float = typer.Option(SpecSettings.rg_residency, "--rg-residency", help="Reuse gating 'resident' variant: bonus of experts the fast tier holds or is reading (0 = the paper's preferred set)."),
    rg_strength: float = typer.Option(SpecSettings.rg_strength, "--rg-strength", help="Reuse gating's bias: a multiple of each token's top-1 − (k+1)-th logit gap (1 = the paper's; 0 = no gating). Above 1 verification reads less and the output drifts from the target's: docs/performance/s2moe-gating.md prices it."),
    draft_fallback: str = typer.Option(SpecSettings.draft_fallback, "--draft-fallback", help="A draft token whose experts are all absent: best (the best resident expert) or skip (no experts in that layer)."),
    draft_any_expert: bool = typer.Option(False, "--draft-any-expert", help="Let the draft fetch absent experts (default: resident ones only under a budget)."),
    no_prefetch: bool = typer.Option(False, "--no-prefetch", help="Do not read the experts the draft predicts for verification ahead of time."),
    prefetch_slots: Optional[int] = typer.Option(None, "--prefetch-slots", min=0, help="Prefetches in flight at most (default 2 × top-k under a budget); each takes its room in the expert cache."),
    always_prefetch: bool = typer.Option(True, "--always-prefetch/--prefetch-trial", help="Prefetch on every iteration (the default), or, on the CPU with live costs, only where a trial in the run measures it taking fewer seconds per token."),
    no_live_costs: bool = typer.Option(False, "--no-live-costs", help="Keep the cost constants fixed instead of following the passes the run makes."),
    no_rate_guard: bool = typer.Option(False, "--no-rate-guard", help="AE keeps speculating even where speculation is measured slower than AR steps (the guard needs live costs)."),
    acceptance: str = typer.Option(SpecSettings.acceptance, "--acceptance", help="AE's acceptance probability of a draft token: learned (from the verifications made so far) or confidence (the draft's own probability, as in the paper)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", min=0, help="FR-Spec: the draft's lm head covers only the N most frequent tokens of the model's token_ranks.json (0 = all; default: the profile's, else 0); verification keeps the full head, so the output is unchanged."),
    token_ranks: Optional[str] = typer.Option(None, "--token-ranks", help="Token-ranks file for --draft-vocab (default: token_ranks.json beside the model; write one with s2moe vocab)."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy (argmax), as in the paper's runs."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p × the top probability."),
    seed: Optional[int] = typer.Option(0, "--seed"),
    sampler: str = typer.Option("auto", "--sampler", help="Sampled speculation: coupled (a seed gives AR's text whatever was drafted), standard (accepts more; the text can follow draft decisions) or auto (coupled with --seed, else standard)."),
    emulate_bandwidth: Optional[float] = typer.Option(None, "--emulate-bandwidth", help="Emulated slow tier MB/s."),
    emulate_latency: float = typer.Option(0.0, "--emulate-latency", help="Emulated request latency µs."),
    backend: str = typer.Option("auto", "--backend", help="auto (CuPy when a CUDA device is usable, else NumPy), numpy or cupy."),
    offload_tier: str = typer.Option("file", "--offload-tier", help="file (SSD/disk) or host (pinned host RAM)."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the records (JSON) here; '-' for stdout."),
    csv_path: Optional[str] = typer.Option(None, "--csv", help="Write the records as CSV here."),
    trace_path: Optional[str] = typer.Option(None, "--trace", help="Record each method's passes (experts per pass) here, for s2moe-calib predict."),
):
    """Benchmark decoding methods on the same prompts (AR first, warm-up untimed)."""
    with cli_errors():
        from rich.progress import Progress
        from rich.table import Table

        from ..bench import run_bench
        from ..decoding.estimate import estimate_costs
        from ..model.loader import load_model
        from ..records import machine_info, to_csv, to_json
        from ..decoding.sampling import SamplingParams
        from ..model.tokenizer import load_tokenizer
        from .spec_options import apply_profile, check_draft_vocab, make_settings, say_strength_note

        from ..outputs import check_output, write_atomic

        for path, flag in ((json_path, "--json"), (csv_path, "--csv"), (trace_path, "--trace")):  # fail now, not after the run
            if path and path != "-":
                check_output(path, flag)
        names = [m.strip() for m in methods.split(",") if m.strip()]
        from ..decoding.methods import get_method

        for name in names:
            get_method(name)  # fail fast on a typo
        from ..bench import resolve_workload
        from ..prompts import load_workload

        load_workload(resolve_workload(workload))  # and on a workload that cannot be read
        from ..kernels.backend import select_backend

        arrays = select_backend(backend)
        say(f"backend {arrays.name} ({arrays.reason})", "dim")
        loaded = load_model(resolve_model(model), dense=False)
        tok = load_tokenizer(loaded)
        chosen = apply_profile(profile, loaded, budget, None)
        settings = make_settings(loaded.config, draft_topk, draft_cap, reuse_cap, utility_threshold, rg_variant,
                                 chosen.profile, rg_residency=rg_residency, rg_strength=rg_strength, draft_fallback=draft_fallback,
                                 draft_resident=not draft_any_expert, prefetch=not no_prefetch, prefetch_slots=prefetch_slots,
                                 prefetch_always=always_prefetch,
                                 acceptance=acceptance, draft_vocab=draft_vocab, token_ranks=token_ranks,
                                 ae_lookahead=ae_lookahead, rate_guard=not no_rate_guard)
        check_draft_vocab(loaded, settings, draft_vocab)
        say_strength_note(settings, any(get_method(m).reuse_gating for m in names))
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, sampler=sampler)
        recorder = None
        if trace_path:
            from ..decoding.trace import TraceRecorder

            recorder = TraceRecorder(loaded, chosen.budget, f"{emulate_bandwidth} MB/s, {emulate_latency} µs"
                                     if emulate_bandwidth else None)
        with Progress(console=err, transient=True) as progress:
            task = progress.add_task("bench", total=len(names) * n_prompts)
            costs = chosen.profile.costs if chosen.profile is not None else None
            records = run_bench(loaded, tok, workload, names, chosen.budget, n_prompts, max_tokens, settings, costs,
                                params, hot=chosen.hot_experts,
                                engine_kw={"emulate_bandwidth": emulate_bandwidth, "emulate_latency": emulate_latency,
                                           "backend": arrays, "offload_tier": offload_tier,
                                           "expert_budget": expert_budget, "kernels": kernels, "threads": threads,
                                           "preload": True, "budget_from": chosen.budget_from,
                                           "trim_hot": chosen.trim_hot},
                                progress=lambda name: progress.update(task, advance=1, description=name),
                                estimate=estimate_costs, live=not no_live_costs, trace=recorder)
        emulated = records[0].params.get("emulation")
        table = Table(title=f"{records[0].params['workload']} · budget {chosen.budget or 'full'} · "
                            f"{records[0].params['n_prompts']} prompts × {max_tokens} tokens"
                            + (f" · {emulated}" if emulated else ""))
        for col in ("method", "tok/s (median)", "speedup vs AR", "acceptance length", "reuse ratio", "KiB fetched/token"):
            table.add_column(col, justify="right")
        for r in records:
            x = r.extra
            table.add_row(r.name, f"{r.median:.1f}", "-" if x["speedup_vs_ar"] is None else f"{x['speedup_vs_ar']:.2f}×",
                          f"{x['acceptance_length']:.2f}", "-" if x["reuse_ratio"] is None else f"{x['reuse_ratio']:.3f}",
                          f"{x['bytes_fetched_per_token'] / 1024:.1f}")
        err.print(table)
        machine = machine_info()
        if json_path == "-":
            print(to_json(records, machine))
        elif json_path:
            write_atomic(json_path, to_json(records, machine))
        if csv_path:
            write_atomic(csv_path, to_csv(records))
        if recorder is not None:
            recorder.write(trace_path)
            say(f"wrote the routing trace {trace_path} (replay it: s2moe-calib predict --trace {trace_path} "
                "--profile DEVICE.json)", "dim")
