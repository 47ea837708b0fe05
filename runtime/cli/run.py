"""`s2moe run`: generate from a prompt, streaming text; a one-line summary (or JSON) at the end."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from .common import err, print_json, resolve_model
from .errors import cli_errors


def run(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF folder or .gguf file (default: the embedded model)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer.json (or its folder) to use instead of the model's."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", min=1, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy (argmax)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p × the top probability."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Memory budget: 16g, 512m, 0.25 (share of expert bytes), or bytes. Default: everything resident."),
    hot_experts: Optional[str] = typer.Option(None, "--hot-experts", help='Pinned experts, JSON {"gpu_experts": [[layer, expert], ...]}.'),
    cache_policy: str = typer.Option("lfu", "--cache-policy", help="Replacement policy for non-pinned experts: lfu or lru."),
    emulate_bandwidth: Optional[float] = typer.Option(None, "--emulate-bandwidth", help="Emulate a slow tier of this many MB/s (what-if runs)."),
    emulate_latency: float = typer.Option(0.0, "--emulate-latency", help="Emulated per-request latency in µs."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
):
    """Generate text with the model (autoregressive decoding)."""
    with cli_errors():
        from ..engine import build_engine
        from ..generate import generate_ar
        from ..loader import load_model
        from ..sampling import SamplingParams
        from ..tokenizer import load_tokenizer

        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        loaded = load_model(resolve_model(model))
        tok = load_tokenizer(loaded, tokenizer)
        ids = tok.encode(prompt).ids
        if not ids:
            raise typer.BadParameter("the prompt encodes to no tokens", param_hint="--prompt")
        engine = build_engine(loaded.path, budget, len(ids) + max_tokens + 1, hot_experts, cache_policy,
                              emulate_bandwidth, emulate_latency, loaded=loaded)
        if engine.emulation.active:
            err.print(f"[yellow]{engine.emulation.describe()}: timings are not this machine's[/yellow]")
        stream = _Streamer(tok) if not json_out else None
        result = generate_ar(engine.model, ids, max_tokens, params, loaded.config.eos_token_ids,
                             on_token=stream.push if stream else None)
        engine.close()
        text = tok.decode(result.tokens)
        stats = {**result.stats(), "offload": engine.report()}
        if json_out:
            print_json({"text": text, "prompt_tokens": ids, "tokens": result.tokens, "stats": stats})
            return
        stream.finish()
        print_summary(stats)


def print_summary(stats: dict) -> None:
    """One summary line, then the per-phase expert accounting as a table (both on stderr)."""
    from rich.table import Table

    from ..budget import fmt_bytes

    off = stats["offload"]
    cache = off["cache"]
    err.print(
        f"[dim]prompt {stats['prompt_tokens']} tok · generated {stats['generated_tokens']} tok · "
        f"prefill {stats['prefill_ms']:.1f} ms · decode {stats['decode_tokens_per_s']:.1f} tok/s · "
        f"stop: {stats['stop_reason']} · budget {off['budget']} · peak experts "
        f"{fmt_bytes(cache['peak_resident_bytes'])} · {cache['policy']}[/dim]"
        + (f" · [yellow]{off['emulation']}[/yellow]" if "emulation" in off else "")
    )
    table = Table(title="expert cache by phase", title_style="dim")
    for col in ("phase", "hits", "misses", "hit rate", "read", "fetch s", "MB/s", "experts/pass"):
        table.add_column(col, justify="right")
    for name, p in cache["phases"].items():
        table.add_row(name, str(p["hits"]), str(p["misses"]),
                      "-" if p["hit_rate"] is None else f"{p['hit_rate']:.1%}", fmt_bytes(p["bytes_read"]),
                      f"{p['fetch_seconds']:.3f}", "-" if p["bandwidth_mb_s"] is None else f"{p['bandwidth_mb_s']:.0f}",
                      "-" if p["unique_experts_per_pass"] is None else f"{p['unique_experts_per_pass']:.1f}")
    err.print(table)


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
