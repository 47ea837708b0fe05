"""`s2moe bench` logic: every method on the same prompts in one process, AR first.

One `Record` per (method, workload, budget): raw per-prompt decode tokens/s, plus acceptance
length, reuse ratio and bytes fetched per generated token; speedup is the ratio of total decode
throughput (tokens / seconds over all prompts) to AR's on the same prompts and budget.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from .decoding.cost_model import CostConstants
from .engine import build_engine
from .errors import UsageError
from .decoding.methods import SpecSettings, get_method
from .decoding.metrics import acceptance_summary
from .prompts import ASSET_PROMPTS, load_workload
from .records import Record
from .model.routing import RoutingPolicy
from .decoding.sampling import SamplingParams
from .decoding.speculative import SpeculativeDecoder

SHIPPED = Path(__file__).resolve().parent / "assets" / "workloads"
WORKLOAD_ALIASES = {
    "humaneval": "human-eval.jsonl", "human-eval": "human-eval.jsonl", "gsm8k": "gsm8K.jsonl",
    "mt-bench": "mt_bench.jsonl", "mt_bench": "mt_bench.jsonl", "specbench": "specbench.jsonl",
}


def resolve_workload(name: str) -> Path:
    if name == "default":
        return ASSET_PROMPTS
    path = Path(name)
    if path.exists():
        return path
    alias = WORKLOAD_ALIASES.get(name.lower())
    # $S2MOE_WORKLOADS first (a user's own copies), then the sets shipped in the package
    # (HumanEval, GSM8K, MT-Bench: assets/workloads/LICENSES.md), then a checkout's ../shared
    search = [os.environ.get("S2MOE_WORKLOADS", ""), str(SHIPPED), "../shared/workloads", "shared/workloads"]
    for folder in filter(None, search):
        for candidate in (Path(folder) / name, Path(folder) / (alias or "")):
            if candidate.is_file():
                return candidate
    raise UsageError(f"--workload {name!r}: not a file, 'default', or one of {', '.join(sorted(WORKLOAD_ALIASES))}; "
                     "specbench is not shipped: pass its .jsonl path or set $S2MOE_WORKLOADS to its folder")


def time_breakdown(start: dict, end: dict, spent: dict, seconds: float, tokens: int) -> dict:
    """Where a generated token's decode time goes, in ms: draft and verification compute, reads the
    pass waited for (the critical path), reads a prefetch hid behind compute, and the rest (AR steps
    of a speculative method, sampling, bookkeeping; all of AR's compute)."""
    def fetch(phase: str) -> float:
        a, b = start["phases"].get(phase), end["phases"].get(phase)
        return (b["fetch_seconds"] if b else 0.0) - (a["fetch_seconds"] if a else 0.0)

    waited = {ph: fetch(ph) for ph in ("draft", "verify", "ar")}
    hidden = end["prefetch"]["hidden_seconds"] - start["prefetch"]["hidden_seconds"]
    n = max(tokens, 1) / 1e3
    parts = {"draft_compute": spent["draft"] - waited["draft"], "verify_compute": spent["verify"] - waited["verify"],
             "fetch_critical": sum(waited.values())}
    parts["other_compute"] = seconds - spent["draft"] - spent["verify"] - waited["ar"]
    out = {k: round(v / n, 3) for k, v in parts.items()}
    out["fetch_hidden"] = round(hidden / n, 3)  # overlapped with compute: not part of the total
    out["total"] = round(seconds / n, 3)
    return out


def prefetch_counts(start: dict, end: dict) -> dict:
    """The run's prefetch counters (PrefetchStats), and verification's misses they split."""
    a, b = start["prefetch"], end["prefetch"]
    out = {k: round(b[k] - a.get(k, 0), 6) for k in b}
    v0, v1 = start["phases"].get("verify"), end["phases"].get("verify")
    out["verify_misses"] = (v1["misses"] if v1 else 0) - (v0["misses"] if v0 else 0)
    return out


def phase_bytes(report: dict) -> int:
    return sum(p["bytes_read"] for name, p in report["phases"].items() if name not in ("load", "estimate", "prefill"))


def run_bench(loaded, tokenizer, workload: str, methods: list[str], budget: str | None, n_prompts: int,
              max_tokens: int, settings: SpecSettings, costs: CostConstants | None, params: SamplingParams,
              progress=None, estimate=None, hot=None, engine_kw: dict | None = None,
              live: bool = False, trace=None) -> list[Record]:
    """``live``: AE's constants follow each method's passes (LiveCosts), from ``costs`` or the estimate.
    ``trace``: a `TraceRecorder` that records each method's timed passes."""
    path = resolve_workload(workload)
    prompts = load_workload(path)[:n_prompts]
    ids = [tokenizer.encode(p).ids[-512:] for p in prompts]  # long prompts: keep the tail
    ids = [p for p in ids if p]
    if "ar" in methods:
        methods = ["ar"] + [m for m in methods if m != "ar"]  # AR first: the speedup's denominator
    kv_positions = max(len(p) for p in ids) + max_tokens + 4 * settings.draft_cap + 8
    draft_policy = RoutingPolicy(top_k=settings.draft_topk, layer_top_k=dict(settings.layer_draft_topk))
    records, throughput = [], {}
    ar_texts = None  # AR's text per prompt: a trace's draft tables follow it
    for name in methods:
        spec = get_method(name)
        engine = build_engine(loaded.path, budget, kv_positions, hot, loaded=loaded, **(engine_kw or {}),
                              prefetch_slots=settings.slots_for(spec),
                              draft_vocab=0 if spec.admit == "none" else settings.draft_vocab)
        if costs is None and estimate is not None:
            costs = estimate(engine.model, ids[0], draft_policy,
                             draft_head=engine.model.draft_head(settings.draft_vocab, settings.token_ranks))
        decoder = SpeculativeDecoder(engine.model, spec, settings, costs, params, live=live and costs is not None)
        decoder.generate(ids[0][:16], 4)  # warm-up, untimed
        samples, acc, reuse, tokens, seconds, fetched = [], [], [], 0, 0.0, 0
        start = engine.cache.report()
        before = phase_bytes(start)
        spent = {"draft": 0.0, "verify": 0.0}
        ae = [0, 0.0, 0]  # AE's verified draft tokens: count, predicted acceptance summed, kept
        vocab = [0, 0]  # emitted tokens inside the draft head, all emitted tokens
        # acceptance length counts an AR step (the rate guard's, a back-off's) as one token: these
        # counts tell the draft's own acceptance apart from how often AE chose not to draft
        steps = dict.fromkeys(("verifications", "ar_steps", "guard_steps", "backoff_steps", "draft_passes",
                               "drafted", "accepted"), 0)
        if trace is not None:
            trace.start(engine.cache)
        texts = []
        for p in ids:
            result = decoder.generate(p, max_tokens)
            texts.append(result.tokens)
            spent["draft"] += result.metrics.draft_seconds
            spent["verify"] += result.metrics.verify_seconds
            ae = [ae[0] + result.metrics.ae_tokens, ae[1] + result.metrics.ae_predicted, ae[2] + result.metrics.ae_kept]
            vocab = [vocab[0] + result.metrics.vocab_covered, vocab[1] + result.metrics.vocab_tokens]
            for k in steps:
                steps[k] += getattr(result.metrics, k)
            st = result.stats()
            samples.append(result.decode_tokens_per_s)
            acc.append(st["acceptance_length"])
            if st["reuse_ratio"] is not None:
                reuse.append(st["reuse_ratio"])
            tokens += len(result.tokens) - 1
            seconds += result.decode_seconds
            if progress:
                progress(name)
        if trace is not None:
            trace.stop(name, tokens, seconds, texts, settings.trace_dict(decoder.guard is not None), ids)
            if name == "ar":
                ar_texts = texts
            elif spec.admit == "utility" and params.greedy and ar_texts is not None:
                trace.record_drafts(decoder, ids, ar_texts)  # untimed, after the run
        end = engine.cache.report()
        fetched = phase_bytes(end) - before
        breakdown = time_breakdown(start, end, spent, seconds, tokens)
        engine.close()
        emulation = engine.emulation.describe() if engine.emulation.active else None
        live_now = decoder.live.current().to_dict() if decoder.live else None
        guard = decoder.guard.to_dict() if decoder.guard else None  # its state carries across the prompts
        trial = decoder.trial.to_dict() if decoder.trial else None  # (so does the prefetch trial's)
        engine = decoder = None  # the next method's engine loads its experts into freed memory
        throughput[name] = tokens / seconds if seconds else 0.0
        records.append(Record(
            "bench", name, "tok/s", samples,
            params={"method": name, "workload": path.name, "budget": budget or "1.0", "n_prompts": len(ids),
                    "emulation": emulation,
                    "max_tokens": max_tokens, "draft_topk": settings.draft_topk, "draft_cap": settings.draft_cap,
                    "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                    "min_p": params.min_p, "draws": params.draws, "acceptance": settings.acceptance,
                    "draft_vocab": settings.draft_vocab, "gating": settings.gating(spec, loaded.config.top_k)},
            extra={"acceptance_length": statistics.mean(a for a in acc if a is not None),
                   "reuse_ratio": statistics.mean(reuse) if reuse else None,
                   "bytes_fetched_per_token": fetched / max(tokens, 1),
                   "decode_tokens_per_s_aggregate": throughput[name],
                   "ms_per_token": breakdown,
                   "prefetch": prefetch_counts(start, end),
                   "prefetch_trial": trial,
                   "cost_constants": costs.to_dict() if costs else None,
                   "live_costs": live_now,
                   "rate_guard": guard,
                   "steps": steps,
                   "tokens_per_verification": ((steps["accepted"] + steps["verifications"]) / steps["verifications"]
                                               if steps["verifications"] else None),
                   # how well AE's acceptance probabilities matched what verification kept
                   "ae_acceptance": acceptance_summary(*ae),
                   # FR-Spec: the share of emitted tokens the draft head could have proposed
                   "draft_vocab_coverage": vocab[0] / vocab[1] if vocab[1] else None},
        ))
    base = throughput.get("ar")
    for r in records:
        r.extra["decode_tokens_per_s"] = {"median": r.median, "samples": r.samples}
        r.extra["speedup_vs_ar"] = r.extra["decode_tokens_per_s_aggregate"] / base if base else None
    return records
