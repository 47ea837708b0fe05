"""Shared set-up of the benchmarks that count rather than time (samplers.py, acceptance.py): a model
fully resident, its tokenizer, prompts of named workloads, and constants `ca` never reads."""

from __future__ import annotations


def resident_model(model: str | None):
    """(path, engine, tokenizer) for ``model`` (default: the embedded one), every expert resident."""
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    path = model or str(DEFAULT_MODEL)
    loaded = load_model(path)
    return path, build_engine(path, loaded=loaded), load_tokenizer(loaded)


def prompts_of(tok, workloads, n_prompts: int, tail: int | None = None) -> list[list[int]]:
    """Token ids of the first ``n_prompts`` prompts of each workload (their last ``tail`` tokens)."""
    from s2moe.runtime.bench import resolve_workload
    from s2moe.runtime.prompts import load_workload

    return [tok.encode(p).ids[-tail if tail else 0:] for w in workloads
            for p in load_workload(resolve_workload(w))[:n_prompts]]


def unused_costs():
    """AE's constants, for methods that never read them (`ca` drafts a fixed length)."""
    from s2moe.runtime.decoding.cost_model import CostConstants

    return CostConstants(t_ar=1.0, c_draft=0.1, t_exp_miss=0.0, t_exp_hit=0.0)
