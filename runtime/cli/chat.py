"""`s2moe chat`: an interactive conversation with the model in the terminal.

Each turn renders the whole history (system message, earlier turns, the new user message) with the
model's chat template, as `s2moe serve` does (runtime/serve/chat.py: --chat-template, the GGUF's
tokenizer.chat_template or tokenizer_config.json's, in a Jinja sandbox; else the messages joined by
newlines, which needs no jinja2), and decodes the
reply from a fresh prefill of that text: the decoder starts a new KV cache per generation, so the
history is re-read every turn (exact; a prefix cache would save the prefill, not change the text).
The reply streams on stdout; one line on stderr gives its tokens, decode tok/s, acceptance and the
expert bytes its passes read from the slow tier (prefill, draft, verify and AR phases; the
background load of an all-resident run and start-up's cost estimate are not a reply's). A reply
stops at end-of-sequence, at --max-tokens or at the context (--ctx-size, else serve's default: the
trained length, capped so the KV cache takes a quarter of the memory); a history that fills the
context is refused in one line that suggests /reset.

Commands: /reset clears the history (a --system message stays), /exit or Ctrl-D leaves, /help.
Ctrl-C during a reply stops it at the next token and returns to the prompt; the partial reply is kept
in the history, as shown (llama-cli keeps it too). A second Ctrl-C in the same reply leaves at once;
Ctrl-C at the prompt leaves with exit code 130.

The options are `s2moe run`'s (the same definitions, read from its signature) less those that mean
nothing here, and --chat-template from `s2moe serve`; --max-tokens bounds each reply.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import sys
import time
from copy import copy
from types import SimpleNamespace
from typing import Optional

import typer

from . import run as _run
from . import serve as _serve
from .common import say
from .errors import cli_errors

# run's options that have no meaning in an interactive session
OMITTED = ("prompt", "prompt_file", "json_out", "trace_path", "record_passes")
# run's options chat reads (tests check this covers every run option not OMITTED, so a flag added
# to run is either handled here or left out on purpose)
HANDLED = frozenset({
    "model", "tokenizer", "max_tokens", "ctx_size", "method", "draft_topk", "draft_cap", "reuse_cap",
    "utility_threshold", "ae_lookahead", "profile", "rg_variant", "no_rg", "rg_residency", "rg_strength",
    "draft_fallback", "draft_any_expert", "no_prefetch", "prefetch_slots", "always_prefetch", "no_live_costs",
    "no_rate_guard", "acceptance", "draft_vocab", "token_ranks", "no_share_kv", "temperature", "top_k", "top_p",
    "min_p", "seed", "sampler", "budget", "expert_budget", "memory_limit", "kernels", "load", "cache_type",
    "threads", "hot_experts", "cache_policy", "emulate_bandwidth", "emulate_latency", "offload_tier", "backend",
    "ignore_eos",
})
DEFAULT_MAX_TOKENS = 256
REPLY_PHASES = ("prefill", "ar", "draft", "verify")  # the passes a reply makes (its MB fetched)
HELP = "/reset clears the history, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply"


def chat(**opts) -> None:
    """Chat with the model: its chat template and history, streamed replies, /reset and /exit."""
    with cli_errors():
        session = Session(SimpleNamespace(**opts))
        try:
            code = session.loop()
        finally:
            session.close()
    if code:
        raise typer.Exit(code)


def _signature() -> inspect.Signature:
    """run's parameters (less OMITTED; --max-tokens per reply, default 256), serve's --chat-template,
    and chat's own --system and --verbose."""
    params = []
    for name, p in inspect.signature(_run.run, eval_str=True).parameters.items():
        if name in OMITTED:
            continue
        if name == "max_tokens":
            info = copy(p.default)
            info.default = DEFAULT_MAX_TOKENS
            info.help = "Tokens per reply at most (a reply also stops at end-of-sequence and at the context)."
            p = p.replace(default=info)
        params.append(p)
    params.append(inspect.signature(_serve.serve, eval_str=True).parameters["chat_template"])
    own = {
        "system": (Optional[str], typer.Option(None, "--system", "-s", help="A system message that opens the conversation (kept by /reset).")),
        "verbose": (bool, typer.Option(False, "--verbose", "-v", help="Print each turn's rendered prompt (JSON string) and its token count on stderr.")),
    }
    params += [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d, annotation=a)
               for n, (a, d) in own.items()]
    return inspect.Signature(params)


chat.__signature__ = _signature()  # typer reads the options from here


class _Stop(Exception):
    """Raised from the token callback: Ctrl-C asked the reply to stop."""


class Session:
    """The engine, decoder, tokenizer and template of one chat, built as `s2moe run` builds them."""

    def __init__(self, o):
        from ..decoding.speculative import SpeculativeDecoder
        from ..model.kv_cache import resolve_cache_type
        from ..model.tokenizer import load_tokenizer
        from ..serve.chat import load_chat_template

        self.o, self.engine = o, None
        spec, arrays, loaded, params, chosen, settings = _run.decoding_setup(o)
        c = loaded.config
        self.tok = load_tokenizer(loaded, o.tokenizer)
        self.template = load_chat_template(loaded.path, o.chat_template)  # before the engine: fail fast
        if o.ctx_size:
            self.context = _run.context_length(c, o.ctx_size)
        else:  # as serve: the trained length, capped so the KV cache takes a quarter of the memory
            self.context = _serve.default_context(loaded, chosen.budget,
                                                  resolve_cache_type(o.cache_type, c))
        slack = 2 * max(settings.draft_cap, 8) + 2  # drafted positions past the context, rolled back
        self.engine = _run.open_engine(
            loaded, spec, settings, chosen, arrays, self.context + slack, batch=max(64, 1 + 2 * settings.draft_cap),
            cache_policy=o.cache_policy, emulate_bandwidth=o.emulate_bandwidth, emulate_latency=o.emulate_latency,
            offload_tier=o.offload_tier, expert_budget=o.expert_budget, kernels=o.kernels, threads=o.threads,
            memory_limit=o.memory_limit, cache_type=o.cache_type, load=o.load)
        costs = _run.start_costs(self.engine, spec, settings, chosen, self.tok.encode("def main():\n    return 0\n").ids)
        self.decoder = SpeculativeDecoder(self.engine.model, spec, settings, costs or _run._unused_costs(), params,
                                          live=costs is not None and not o.no_live_costs)
        self.stop_ids = () if o.ignore_eos else tuple(c.eos_token_ids)
        self.opening = [{"role": "system", "content": o.system}] if o.system else []
        self.history: list[dict] = []
        self.label = os.path.basename(os.path.normpath(loaded.path))
        self.spec_name = spec.name

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # -- the loop -------------------------------------------------------------------------------
    def loop(self) -> int:
        """Turns until /exit or EOF (exit code 0) or Ctrl-C at the prompt (130)."""
        tty = sys.stdin.isatty()
        if tty:
            try:
                import readline  # noqa: F401  (line editing and recall for input())
            except ImportError:
                pass
        say(f"chat with {self.label} ({self.spec_name}, context {self.context}, chat template: "
            f"{self.template.name}); {HELP}", "dim")
        while True:
            try:
                line = input("> " if tty else "")
            except EOFError:
                if tty:
                    print()
                return 0
            except KeyboardInterrupt:
                print()
                return 130
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                self.history.clear()
                say("history cleared", "dim")
                continue
            if text == "/help":
                say(HELP, "dim")
                continue
            if text.startswith("/") and text[1:].isalpha():
                say(f"unknown command {text}: {HELP}", "yellow")
                continue
            self.turn(line)

    def turn(self, message: str) -> None:
        """One user message and the model's reply (whole, or as far as Ctrl-C let it go); the history
        grows by both only when decoding started."""
        user = {"role": "user", "content": message}
        messages = self.opening + self.history + [user]
        try:
            prompt = self.template.render(messages)
        except Exception as exc:  # a template's raise_exception, or a render error
            say(f"error: the chat template refused the messages ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                "/reset to start over", "red")
            return
        ids = self.tok.encode(prompt).ids
        if self.o.verbose:
            say(f"prompt: {len(ids)} tokens, {len(messages)} messages: {json.dumps(prompt, ensure_ascii=False)}", "dim")
        if not ids:
            say("error: the message encodes to no tokens", "red")
            return
        room = self.context - len(ids)
        if room < 1:
            say(f"error: the conversation is {len(ids)} tokens and the context holds {self.context}: /reset to start "
                "over (or restart with a larger --ctx-size)", "red")
            return
        text, _ = self.reply(ids, min(self.o.max_tokens, room), cut=room < self.o.max_tokens)
        self.history += [user, {"role": "assistant", "content": text}]

    def reply(self, ids: list[int], limit: int, cut: bool = False) -> tuple[str, list[int]]:
        """Decode, streaming text on stdout; the stats line on stderr. Returns the reply's text and
        tokens (the end-of-sequence token included, its text not)."""
        from ..serve.worker import StopText

        stream, stops, tokens = StopText(self.tok, ()), set(self.stop_ids), []
        clock = {"first": None, "last": None}
        asked = {"stop": False}

        def on_token(t: int) -> None:
            if asked["stop"]:
                clock["last"] = time.perf_counter()  # the decode ran until here
                raise _Stop()
            clock["last"] = time.perf_counter()
            clock["first"] = clock["first"] or clock["last"]
            tokens.append(t)
            if t not in stops:
                _write(stream.push(t))

        def on_sigint(signum, frame):
            if asked["stop"]:  # a second Ctrl-C: the reply did not stop, leave now
                raise KeyboardInterrupt
            asked["stop"] = True

        before = self._bytes_read()
        previous = signal.getsignal(signal.SIGINT)
        catch = previous not in (signal.SIG_IGN, None)  # Ctrl-C ignored (nohup) or not Python's: left alone
        if catch:
            signal.signal(signal.SIGINT, on_sigint)
        result, reason = None, "interrupted"
        try:
            result = self.decoder.generate(ids, limit, self.stop_ids, on_token=on_token)
            reason = "context" if cut and result.stop_reason == "max_tokens" else result.stop_reason
        except _Stop:
            settle = getattr(self.engine.cache, "settle_prefetches", None)
            if settle:  # reads the stopped draft started: kept or dropped as after any pass
                settle()
        finally:
            if catch:
                signal.signal(signal.SIGINT, previous)
        _write(stream.finish())
        if not stream.text.endswith("\n"):
            _write("\n")  # the stats line starts a line of its own
        fetched = self._bytes_read() - before
        if result is not None:
            rate = result.decode_tokens_per_s if len(tokens) > 1 else None
        else:  # stopped: the tokens after the first over the time from the first to the stop
            span = (clock["last"] or 0) - (clock["first"] or 0)
            rate = (len(tokens) - 1) / span if len(tokens) > 1 and span > 0 else None
        say(stats_line(len(ids), len(tokens), rate, self.decoder.metrics.to_dict(len(tokens)), fetched,
                       result.prefill_seconds if result is not None else None, reason), "dim")
        return stream.text, tokens

    def _bytes_read(self) -> int:
        phases = self.engine.cache.report()["phases"]
        return sum(p["bytes_read"] for name, p in phases.items() if name in REPLY_PHASES)


def stats_line(prompt_tokens: int, tokens: int, rate: float | None, metrics: dict, fetched: int, prefill: float | None,
               reason: str) -> str:
    """The per-reply line: ``[N tok · R tok/s · acceptance length L (accepted P%) · M MB fetched · …]``;
    R is decode tokens (the first comes from the prefill) per second, "-" with fewer than two tokens."""
    length, accepted = metrics.get("acceptance_length"), metrics.get("acceptance_rate")
    acceptance = "acceptance length -" if length is None else f"acceptance length {length:.2f}"
    if accepted is not None:
        acceptance += f" (accepted {accepted:.0%})"
    prefill_part = f", prefill {prefill * 1e3:.1f} ms" if prefill is not None else ""
    return (f"[{tokens} tok · {'-' if rate is None else f'{rate:.1f}'} tok/s · {acceptance} · {fetched / 1e6:.2f} MB fetched · "
            f"prompt {prompt_tokens} tok{prefill_part} · stop: {reason}]")


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
