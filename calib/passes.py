"""Real S²-MoE decoding passes for calibration: captured while decoding, timed later by
`replay.replay` in the same interleaved rounds as any other group of the run (see replay.py)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from .replay import CapturedPass, WeightPool, capture_passes


@contextmanager
def decode_passes(loaded, prompts: list[list[int]], budget: str | None, hot, spec: dict, costs,
                  emulation: dict | None, tokens: int, pool: WeightPool, progress=None,
                  fetch_threads: int | None = None, backend=None, offload_tier: str = "file",
                  kv_positions: int = 4096, batch: int | None = None, budget_from: str = "--budget"
                  ) -> Iterator[tuple[list[CapturedPass], object]]:
    """Every verification pass of real S²-MoE decoding (reuse-aware gating on) at a budget, draft
    caps cycling 1..cap so every batch size occurs, captured for replay. The engine stays open
    (the passes replay on it) until the block ends. ``kv_positions`` and ``batch``: the memory plan
    of the run the passes stand for (calib/plan.py), and its draft head's rows (``spec["draft_vocab"]``),
    so the experts get the capacity that run has. The draft here keeps the full head: what a
    verification pass costs does not depend on it, only which tokens get drafted. Yields the passes
    and the engine's model (the speed probe's pass runs on it too)."""
    from s2moe.runtime.kernels.backend import NUMPY
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder

    emulation = emulation or {}
    engine = build_engine(loaded.path, budget, kv_positions, hot, emulate_bandwidth=emulation.get("bandwidth_mb_s"),
                          emulate_latency=emulation.get("latency_us") or 0.0, loaded=loaded, fetch_threads=fetch_threads,
                          backend=backend or NUMPY, offload_tier=offload_tier, batch=batch,
                          budget_from=budget_from, draft_vocab=spec.get("draft_vocab", 0))
    # no draft-guided prefetch: reuse-aware gating routes toward experts in flight as well as resident
    # ones, and a replay cannot put a read back in flight, so its routing would differ. The plan is
    # the run's (same expert capacity); T_exp is the cost on the critical path.
    engine.model.experts.prefetch_slots = 0
    try:
        task = progress.add_task("decode passes (capture)", total=len(prompts)) if progress else None
        with capture_passes(engine.model, "verify", pool) as passes:
            for i, ids in enumerate(prompts):
                settings = SpecSettings(draft_topk=spec["draft_topk"], draft_cap=1 + i % spec["draft_cap"],
                                        reuse_cap=spec["reuse_cap"], utility_threshold=0.0, backoff=False)
                SpeculativeDecoder(engine.model, get_method("s2moe"), settings, costs).generate(ids, tokens)
                if progress:
                    progress.advance(task)
        yield passes, engine.model
    finally:
        engine.close()
