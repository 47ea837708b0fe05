"""The memory plan a profile is made for: the one `s2moe run` makes for its decode.

`s2moe run` reserves KV for ``len(prompt) + --max-tokens + 2 × max(draft cap, 8) + 2`` positions
and plans its workspace for passes of ``max(min(len(prompt), 64), 1 + 2 × draft cap)`` tokens
(runtime/cli/run.py), then `build_engine` turns the budget into the experts' capacity. A profile
plans for a *context* (prompt + generated tokens, ``--ctx-size``) the same way, so the hot list it
sizes fits what a run of that context (or a shorter one) gets, and the profile's decode passes run
at the capacity such a run has. The context is recorded in the profile (``budget.context_tokens``,
``budget.kv_positions``); `validate` plans for the same one.
"""

from __future__ import annotations

from s2moe.runtime.checks import number

RUN_MAX_TOKENS = 64  # `s2moe run`'s default --max-tokens
DEFAULT_CONTEXT = 2 * RUN_MAX_TOKENS  # a prompt of up to 64 tokens and run's default 64 generated
PREFILL_BATCH = 64  # runtime.model.forward.PREFILL_CHUNK: the most prompt tokens one pass runs


def context_tokens(ctx, model_context: int | None, where: str = "--ctx-size") -> int:
    """``--ctx-size`` checked: a whole number of at least 2 and at most the model's context."""
    return int(number(where, ctx, low=2, high=model_context or None, integer=True))


def kv_positions(ctx: int, draft_cap: int) -> int:
    """KV positions `s2moe run` reserves for a prompt plus --max-tokens of ``ctx`` tokens."""
    return ctx + 2 * max(draft_cap, 8) + 2


def batch(ctx: int, draft_cap: int) -> int:
    """The largest pass such a run plans for (its prompt is at most ``ctx`` tokens)."""
    return max(min(ctx, PREFILL_BATCH), 1 + 2 * draft_cap)


def expert_size(backend):
    """One expert's cost in the fast tier, as `build_engine` counts it for this backend."""
    if backend.on_device:
        return lambda refs: refs.resident_bytes_for(False)
    return lambda refs: refs.resident_bytes_for(True)


def run_plan(loaded, budget: str | None, ctx: int, draft_cap: int, backend, kernels: str = "auto",
             where: str = "--budget", draft_vocab: int = 0, cache_type: str = "auto"):
    """The `MemoryPlan` `build_engine` makes for an S²-MoE run of ``ctx`` tokens (a draft head of
    ``draft_vocab`` rows; prefetches take their room in the expert cache)."""
    from s2moe.runtime.engine import default_prefetch_slots, draft_head_bytes
    from s2moe.runtime.kernels import select_ops
    from s2moe.runtime.offload.memory import Budget, plan_memory
    from s2moe.runtime.model.kv_cache import resolve_cache_type

    parsed = Budget.parse(budget, where)
    ops = select_ops(kernels, None, backend)
    return plan_memory(loaded, parsed, kv_positions(ctx, draft_cap), batch=batch(ctx, draft_cap), window=4,
                       reference_kernels=ops.name == "numpy", expert_bytes=expert_size(backend), direct=True,
                       draft_head=draft_head_bytes(loaded, draft_vocab, backend.on_device),
                       staged_prefetches=default_prefetch_slots(loaded.config, parsed.full) if backend.on_device else 0,
                       cache_type=resolve_cache_type(cache_type, loaded.config))


def profile_context(data: dict, where: str) -> int:
    """The context a profile was planned for (checked, naming ``where``'s field); profiles written
    before it was recorded: the default (their hot lists were planned for more KV, so they fit)."""
    ctx = (data.get("budget") or {}).get("context_tokens")
    return DEFAULT_CONTEXT if ctx is None else context_tokens(ctx, None, f"{where}: budget.context_tokens")
