"""`s2moe serve`: the model behind an OpenAI-compatible HTTP API (runtime/serve), one decode at a
time, requests in arrival order. Needs the `serve` extra: pip install 's2moe[serve]'."""

from __future__ import annotations

from typing import Optional

import typer

from .common import resolve_model, say
from ..decoding.methods import SpecSettings
from .errors import cli_errors


def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF folder, .gguf file or Hugging Face id (default: the embedded model)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Device profile (budget, hot experts, cost constants, speculative settings)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on."),
    name: Optional[str] = typer.Option(None, "--name", help="Model id the API reports (default: the model folder's name)."),
    ctx_size: Optional[int] = typer.Option(None, "--ctx-size", "-c", min=16, help="Context length in tokens (default: the model's trained length)."),
    method: str = typer.Option("s2moe", "--method", help="ar, es, confidence, cascade, ca, ca+ae, s2moe."),
    no_rg: bool = typer.Option(False, "--no-rg", help="Turn reuse-aware gating off (lossless: greedy output equals AR)."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Memory budget for the model (as in run)."),
    expert_budget: Optional[str] = typer.Option(None, "--expert-budget", help="Memory for resident experts only."),
    kernels: str = typer.Option("auto", "--kernels", help="auto, cpu or numpy."),
    load: str = typer.Option("background", "--load", help="Every expert resident: read the ones the prompt needs, then the rest while decoding (background, as mmap starts), or all before the prompt (now)."),
    cache_type: str = typer.Option("auto", "--cache-type", help="KV cache type: f32, f16 or q8_0 (llama.cpp's block of 32). auto: f16, or f32 on a GPU backend."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Compute threads."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="Jinja chat template file (default: the GGUF's tokenizer.chat_template, else tokenizer_config.json's)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer.json (or its folder) instead of the model's."),
    acceptance: str = typer.Option(SpecSettings.acceptance, "--acceptance", help="AE's acceptance probability: learned (from this server's verifications) or confidence (the paper's)."),
    ae_lookahead: int = typer.Option(SpecSettings.ae_lookahead, "--ae-lookahead", help="AE drafts until this many tokens past the prefix of largest summed gain (1: the paper's rule)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", min=0, help="FR-Spec: the draft's lm head covers the N most frequent tokens (0: all; default: the profile's, else 0)."),
    token_ranks: Optional[str] = typer.Option(None, "--token-ranks", help="Token-ranks file for --draft-vocab (default: token_ranks.json beside the model)."),
):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    with cli_errors():
        try:
            import uvicorn  # checked before the model loads
            from ..serve.app import create_app
        except ImportError as exc:
            from ..errors import UsageError

            raise UsageError(f"s2moe serve needs {exc.name}: pip install 's2moe[serve]'") from None
        import os

        from ..decoding.methods import get_method
        from ..decoding.speculative import SpeculativeDecoder
        from ..kernels.backend import select_backend
        from ..model.loader import load_model
        from ..model.tokenizer import load_tokenizer
        from ..serve.chat import load_chat_template
        from ..serve.worker import Worker
        from .run import _unused_costs, open_engine, start_costs
        from ..model.kv_cache import resolve_cache_type
        from .spec_options import apply_profile, check_draft_vocab, make_settings

        spec = get_method(method, reuse_gating=False if no_rg else None)
        loaded = load_model(resolve_model(model), dense=False)
        c = loaded.config
        if ctx_size and ctx_size > c.max_position_embeddings:
            say(f"warning: --ctx-size {ctx_size} is above the {c.max_position_embeddings} positions the model was "
                "trained for; quality past them is not known", "yellow")
        chosen = apply_profile(profile, loaded, budget, None)
        arrays = select_backend("auto")
        context = ctx_size or default_context(loaded, chosen.budget, resolve_cache_type(cache_type, c))
        settings = make_settings(c, None, None, None, None, SpecSettings.rg_variant, chosen.profile, acceptance=acceptance,
                                 ae_lookahead=ae_lookahead, draft_vocab=draft_vocab, token_ranks=token_ranks)
        check_draft_vocab(loaded, settings, draft_vocab)
        tok = load_tokenizer(loaded, tokenizer)
        template = load_chat_template(loaded.path, chat_template)
        slack = 2 * max(settings.draft_cap, 8) + 2  # drafted positions past the context, rolled back
        engine = open_engine(loaded, spec, settings, chosen, arrays, context + slack,
                             batch=max(64, 1 + 2 * settings.draft_cap), cache_policy="lfu", emulate_bandwidth=None,
                             emulate_latency=0.0, offload_tier=None, expert_budget=expert_budget, kernels=kernels,
                             threads=threads, cache_type=cache_type, load=load)
        costs = start_costs(engine, spec, settings, chosen, tok.encode("def main():\n    return 0\n").ids)
        decoder = SpeculativeDecoder(engine.model, spec, settings, costs or _unused_costs(), live=costs is not None)
        label = name or os.path.basename(os.path.normpath(loaded.path))
        worker = Worker(engine, decoder, tok, c.eos_token_ids, context, label)
        app = create_app(worker, template, loaded.generation_defaults)
        say(f"serving {label} ({spec.name}, context {context}, chat template: {template.name}) on "
            f"http://{host}:{port}/v1", "green")
        try:
            uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
        finally:
            app.state.pool.shutdown(wait=False, cancel_futures=True)
            engine.close()


KV_SHARE = 0.25  # a default context's KV cache takes at most this share of the model's memory


def default_context(loaded, budget: str | None, cache_type: str) -> int:
    """The model's trained context, capped so its KV cache takes at most a quarter of the memory
    the model may use (a --budget in bytes, else the memory cgroup's limit or MemAvailable), in
    whole 256s; the cap is said in one line. A share budget puts the KV on top of the experts'
    share: no cap."""
    from ..model.kv_cache import kv_bytes_per_position
    from ..offload.limits import find_headroom
    from ..offload.memory import Budget, fmt_bytes

    trained = loaded.config.max_position_embeddings
    parsed = Budget.parse(budget)
    if parsed.total_bytes is not None:
        room, where = parsed.total_bytes, "--budget"
    elif parsed.full:
        found = find_headroom("auto")
        if found is None:
            return trained
        room, where = found.model_budget(), found.source
    else:
        return trained
    per = kv_bytes_per_position(loaded.config, cache_type)
    fits = max(256, int(KV_SHARE * room / per) // 256 * 256)
    if fits >= trained:
        return trained
    say(f"note: context {fits} of the model's {trained}: a {cache_type} KV cache of {fmt_bytes(fits * per)}, a "
        f"quarter of the {fmt_bytes(room)} the model may use ({where}); --ctx-size sets it", "yellow")
    return fits
