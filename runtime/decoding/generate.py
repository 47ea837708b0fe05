"""Autoregressive generation: prefill, then one target pass per token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..model.forward import MoEModel
from ..model.routing import TARGET, RoutingPolicy
from .sampling import SamplingParams, draws_for, sample


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = "max_tokens"
    step_seconds: list[float] = field(default_factory=list)  # each decode step's wall time

    @property
    def decode_tokens_per_s(self) -> float:
        # The first generated token comes from the prefill; decode covers the rest.
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def stats(self) -> dict:
        return {
            "prompt_tokens": len(self.prompt_tokens),
            "generated_tokens": len(self.tokens),
            "prefill_ms": round(self.prefill_seconds * 1e3, 3),
            "decode_seconds": round(self.decode_seconds, 6),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "stop_reason": self.stop_reason,
        }


def generate_ar(
    model: MoEModel,
    prompt: Iterable[int],
    max_tokens: int,
    params: SamplingParams = SamplingParams(),
    stop_ids: Iterable[int] = (),
    on_token: Callable[[int], None] | None = None,
    policy: RoutingPolicy = TARGET,
    head=None,
) -> GenerationResult:
    """Greedy or sampled AR decoding. ``policy`` and ``head`` (a FR-Spec `DraftHead`) let
    calibration time the draft configuration."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("empty prompt")
    stop = set(stop_ids)
    draws = draws_for(params)
    kv = model.new_cache(len(prompt) + max_tokens)
    result = GenerationResult(prompt)
    from ..engine import phase_of

    t0 = time.perf_counter()
    with phase_of(model, "prefill"):
        logits, _ = model.forward(prompt, kv, logits="last", record=False, policy=policy, head=head)
    kv.commit(len(prompt))
    result.prefill_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    while max_tokens > 0:
        token = sample(logits[-1], params, draws, len(result.tokens))
        draws.forget_before(len(result.tokens))
        result.tokens.append(token)
        if on_token:
            on_token(token)
        if token in stop:
            result.stop_reason = "eos"
            break
        if len(result.tokens) >= max_tokens:
            break
        ts = time.perf_counter()
        with phase_of(model, "ar"):
            logits, _ = model.forward([token], kv, logits="last", record=False, policy=policy, head=head)
        kv.commit(kv.filled)
        result.step_seconds.append(time.perf_counter() - ts)
    result.decode_seconds = time.perf_counter() - t1
    return result
