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
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
):
    """Generate text with the model (autoregressive decoding)."""
    with cli_errors():
        from ..generate import generate_ar
        from ..loader import load_model
        from ..model import MoEModel
        from ..sampling import SamplingParams
        from ..tokenizer import load_tokenizer

        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        loaded = load_model(resolve_model(model))
        tok = load_tokenizer(loaded, tokenizer)
        ids = tok.encode(prompt).ids
        if not ids:
            raise typer.BadParameter("the prompt encodes to no tokens", param_hint="--prompt")
        engine = MoEModel(loaded)
        stream = _Streamer(tok) if not json_out else None
        result = generate_ar(engine, ids, max_tokens, params, loaded.config.eos_token_ids,
                             on_token=stream.push if stream else None)
        text = tok.decode(result.tokens)
        if json_out:
            print_json({"text": text, "prompt_tokens": ids, "tokens": result.tokens, "stats": result.stats()})
            return
        stream.finish()
        s = result.stats()
        err.print(
            f"[dim]prompt {s['prompt_tokens']} tok · generated {s['generated_tokens']} tok · "
            f"prefill {s['prefill_ms']:.1f} ms · decode {s['decode_tokens_per_s']:.1f} tok/s · "
            f"stop: {s['stop_reason']}[/dim]"
        )


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
