"""One model, one decode at a time: the part of `s2moe serve` that generates, free of HTTP.

A `Job` carries token ids, limits and sampling settings; `Worker.run` decodes it on the calling
thread (the server gives it one thread, so jobs run in arrival order) and reports text as it
becomes final through ``on_text``. Stop strings are cut from the text, and text that might still
become one is held back until it cannot. A job whose ``cancelled`` event is set (its client went
away) stops at its next token, and the decoder is free for the next job.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..decoding.sampling import SamplingParams


class _Stop(Exception):
    """Raised from the token callback to end a generation early (stop string or cancellation)."""


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: tuple[str, ...] = ()
    on_text: Callable[[str], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" or "cancelled"
    stats: dict


class StopText:
    """Text as tokens arrive, with stop strings cut off. ``push`` returns the text that is final:
    a tail that could be the start of a stop string waits, as does an incomplete UTF-8 sequence."""

    def __init__(self, tok, stop: tuple[str, ...]):
        self.tok, self.stop, self.ids, self.sent, self.stopped = tok, tuple(s for s in stop if s), [], 0, False
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return ""
        hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, text = True, text[: min(hits)]
        self.text = text
        safe = len(text) if self.stopped else len(text) - self._partial(text)
        delta, self.sent = text[self.sent:safe], max(self.sent, safe)
        return delta

    def _partial(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins a stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)

    def finish(self) -> str:
        """The held-back tail, once generation has ended without a stop string."""
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta


class Worker:
    def __init__(self, engine, decoder, tok, eos_ids, context: int, name: str):
        self.engine, self.decoder, self.tok = engine, decoder, tok
        self.eos, self.context, self.name = tuple(eos_ids), context, name
        self.seq, self.born = 0, time.monotonic()  # stats' times are seconds since the worker began
        self.lock = threading.Lock()  # the decoder is not reentrant: one job at a time, whoever calls
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.busy = False
        self.last: dict | None = None

    def run(self, job: Job) -> Outcome:
        with self.lock:
            self.seq += 1
            seq, started = self.seq, time.monotonic()
            self.busy = True
            try:
                out = self._run(job, seq, started)
            except BaseException:
                self.counts["failed"] += 1
                raise
            finally:
                self.busy = False
            self.counts["cancelled" if out.finish_reason == "cancelled" else "completed"] += 1
            self.last = {"seq": seq, "tokens": len(out.tokens), "finish_reason": out.finish_reason}
            return out

    def _run(self, job: Job, seq: int, started: float) -> Outcome:
        before = _expert_totals(self.engine)
        text = StopText(self.tok, job.stop)
        tokens: list[int] = []

        def on_token(t: int) -> None:
            if job.cancelled.is_set():
                raise _Stop("cancelled")
            tokens.append(t)
            delta = text.push(t)
            if delta and job.on_text:
                job.on_text(delta)
            if text.stopped:
                raise _Stop("stop")

        self.decoder.params = job.params
        reason, result = "length", None
        if not job.cancelled.is_set():
            try:
                result = self.decoder.generate(job.ids, job.max_tokens, self.eos, on_token=on_token)
                reason = "stop" if result.stop_reason == "eos" else "length"
            except _Stop as why:
                reason = str(why)
                settle = getattr(self.engine.cache, "settle_prefetches", None)
                if settle:  # reads the interrupted draft started: kept or dropped as after any pass
                    settle()
        else:
            reason = "cancelled"
        if reason != "cancelled":
            tail = text.finish()
            if tail and job.on_text:
                job.on_text(tail)
        after = _expert_totals(self.engine)
        metrics = self.decoder.metrics.to_dict(len(tokens))
        stats = {"method": self.decoder.method.name, "seq": seq,
                 "queued_ms": round(1e3 * (started - job.arrived), 1),
                 "decode_ms": round(1e3 * (time.monotonic() - started), 1),
                 "started_s": round(started - self.born, 4), "finished_s": round(time.monotonic() - self.born, 4),
                 "acceptance_length": metrics.get("acceptance_length"),
                 "verifications": metrics.get("verifications"),
                 **{k: after[k] - before[k] for k in after}}
        return Outcome(text.text, tokens, reason, stats)


def _expert_totals(engine) -> dict:
    """Expert hits, misses and bytes read so far, over every phase (a request's are the difference)."""
    phases = engine.cache.report()["phases"]
    return {"expert_hits": sum(p["hits"] for p in phases.values()),
            "expert_misses": sum(p["misses"] for p in phases.values()),
            "bytes_fetched": sum(p["bytes_read"] for p in phases.values())}
