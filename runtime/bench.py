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


class MethodRun:
    """One method's engine, decoder and tallies over a workload's prompts. `s2moe bench` runs one
    method after another; benchmarks/tune.py runs several settings prompt by prompt, taking turns.

    ``costs`` None with ``estimate``: AE's start-up constants are estimated on this engine (then
    ``self.costs``); ``live``: they follow the passes (LiveCosts)."""

    def __init__(self, loaded, name: str, settings: SpecSettings, budget: str | None, kv_positions: int,
                 first: list[int], costs: CostConstants | None, params: SamplingParams, *, hot=None,
                 engine_kw: dict | None = None, estimate=None, live: bool = False):
        self.name, self.settings, self.spec = name, settings, get_method(name)
        self.engine = build_engine(loaded.path, budget, kv_positions, hot, loaded=loaded, **(engine_kw or {}),
                                   prefetch_slots=settings.slots_for(self.spec),
                                   draft_vocab=0 if self.spec.admit == "none" else settings.draft_vocab)
        if costs is None and estimate is not None:
            policy = RoutingPolicy(top_k=settings.draft_topk, layer_top_k=dict(settings.layer_draft_topk))
            costs = estimate(self.engine.model, first, policy,
                             draft_head=self.engine.model.draft_head(settings.draft_vocab, settings.token_ranks))
        self.costs, self.params = costs, params
        self.decoder = SpeculativeDecoder(self.engine.model, self.spec, settings, costs, params,
                                          live=live and costs is not None)
        self.decoder.generate(first[:16], 4)  # warm-up, untimed
        self.samples, self.acc, self.reuse, self.texts = [], [], [], []
        self.tokens, self.seconds = 0, 0.0
        self.start = self.engine.cache.report()
        self.spent = {"draft": 0.0, "verify": 0.0}
        self.ae = [0, 0.0, 0]  # AE's verified draft tokens: count, predicted acceptance summed, kept
        self.vocab = [0, 0]  # emitted tokens inside the draft head, all emitted tokens
        # acceptance length counts an AR step (the rate guard's, a back-off's) as one token: these
        # counts tell the draft's own acceptance apart from how often AE chose not to draft
        self.steps = dict.fromkeys(("verifications", "ar_steps", "guard_steps", "backoff_steps", "draft_passes",
                                    "drafted", "accepted"), 0)

    def run(self, prompt: list[int], max_tokens: int):
        result = self.decoder.generate(prompt, max_tokens)
        m = result.metrics
        self.texts.append(result.tokens)
        self.spent["draft"] += m.draft_seconds
        self.spent["verify"] += m.verify_seconds
        self.ae = [self.ae[0] + m.ae_tokens, self.ae[1] + m.ae_predicted, self.ae[2] + m.ae_kept]
        self.vocab = [self.vocab[0] + m.vocab_covered, self.vocab[1] + m.vocab_tokens]
        for k in self.steps:
            self.steps[k] += getattr(m, k)
        st = result.stats()
        self.samples.append(result.decode_tokens_per_s)
        self.acc.append(st["acceptance_length"])
        if st["reuse_ratio"] is not None:
            self.reuse.append(st["reuse_ratio"])
        self.tokens += len(result.tokens) - 1
        self.seconds += result.decode_seconds
        return result

    def finish(self, workload: str, budget: str | None, top_k: int, max_tokens: int) -> Record:
        """Close the engine and give the record (speedup fields are the caller's)."""
        end = self.engine.cache.report()
        fetched = phase_bytes(end) - phase_bytes(self.start)
        breakdown = time_breakdown(self.start, end, self.spent, self.seconds, self.tokens)
        self.engine.close()
        d, s, steps = self.decoder, self.settings, self.steps
        emulation = self.engine.emulation.describe() if self.engine.emulation.active else None
        live_now = d.live.current().to_dict() if d.live else None
        guard = d.guard.to_dict() if d.guard else None  # its state carries across the prompts
        trial = d.trial.to_dict() if d.trial else None  # (so does the prefetch trial's)
        self.engine = self.decoder = None  # the next method's engine loads its experts into freed memory
        p = self.params
        return Record(
            "bench", self.name, "tok/s", self.samples,
            params={"method": self.name, "workload": workload, "budget": budget or "1.0", "n_prompts": len(self.samples),
                    "emulation": emulation,
                    "max_tokens": max_tokens, "draft_topk": s.draft_topk, "draft_cap": s.draft_cap,
                    "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                    "min_p": p.min_p, "draws": p.draws, "acceptance": s.acceptance,
                    "draft_vocab": s.draft_vocab, "gating": s.gating(self.spec, top_k)},
            extra={"acceptance_length": statistics.mean(a for a in self.acc if a is not None),
                   "reuse_ratio": statistics.mean(self.reuse) if self.reuse else None,
                   "bytes_fetched_per_token": fetched / max(self.tokens, 1),
                   "decode_tokens_per_s_aggregate": self.tokens / self.seconds if self.seconds else 0.0,
                   "ms_per_token": breakdown,
                   "prefetch": prefetch_counts(self.start, end),
                   "prefetch_trial": trial,
                   "cost_constants": self.costs.to_dict() if self.costs else None,
                   "live_costs": live_now,
                   "rate_guard": guard,
                   "steps": steps,
                   "tokens_per_verification": ((steps["accepted"] + steps["verifications"]) / steps["verifications"]
                                               if steps["verifications"] else None),
                   # how well AE's acceptance probabilities matched what verification kept
                   "ae_acceptance": acceptance_summary(*self.ae),
                   # FR-Spec: the share of emitted tokens the draft head could have proposed
                   "draft_vocab_coverage": self.vocab[0] / self.vocab[1] if self.vocab[1] else None},
        )


def workload_ids(tokenizer, workload: str, n_prompts: int) -> tuple[Path, list[list[int]]]:
    """The workload's first ``n_prompts`` prompts as token ids (a long prompt keeps its tail)."""
    path = resolve_workload(workload)
    ids = [tokenizer.encode(p).ids[-512:] for p in load_workload(path)[:n_prompts]]
    return path, [p for p in ids if p]


def kv_positions_for(ids: list[list[int]], max_tokens: int, settings: SpecSettings) -> int:
    return max(len(p) for p in ids) + max_tokens + 4 * settings.draft_cap + 8


def run_bench(loaded, tokenizer, workload: str, methods: list[str], budget: str | None, n_prompts: int,
              max_tokens: int, settings: SpecSettings, costs: CostConstants | None, params: SamplingParams,
              progress=None, estimate=None, hot=None, engine_kw: dict | None = None,
              live: bool = False, trace=None) -> list[Record]:
    """``live``: AE's constants follow each method's passes (LiveCosts), from ``costs`` or the estimate.
    ``trace``: a `TraceRecorder` that records each method's timed passes."""
    path, ids = workload_ids(tokenizer, workload, n_prompts)
    if "ar" in methods:
        methods = ["ar"] + [m for m in methods if m != "ar"]  # AR first: the speedup's denominator
    kv_positions = kv_positions_for(ids, max_tokens, settings)
    records = []
    ar_texts = None  # AR's text per prompt: a trace's draft tables follow it
    for name in methods:
        run = MethodRun(loaded, name, settings, budget, kv_positions, ids[0], costs, params, hot=hot,
                        engine_kw=engine_kw, estimate=estimate, live=live)
        costs = run.costs  # estimated once, for every method
        if trace is not None:
            trace.start(run.engine.cache)
        for p in ids:
            run.run(p, max_tokens)
            if progress:
                progress(name)
        if trace is not None:
            trace.stop(name, run.tokens, run.seconds, run.texts, settings.trace_dict(run.decoder.guard is not None), ids)
            if name == "ar":
                ar_texts = run.texts
            elif run.spec.admit == "utility" and params.greedy and ar_texts is not None:
                trace.record_drafts(run.decoder, ids, ar_texts)  # untimed, after the run
        records.append(run.finish(path.name, budget, loaded.config.top_k, max_tokens))
    with_speedups(records)
    return records


def with_speedups(records: list[Record], base_name: str = "ar") -> None:
    """Each record's tok/s summary and its aggregate throughput over ``base_name``'s (None without it)."""
    base = next((r.extra["decode_tokens_per_s_aggregate"] for r in records if r.name == base_name), None)
    for r in records:
        r.extra["decode_tokens_per_s"] = {"median": r.median, "samples": r.samples}
        r.extra["speedup_vs_ar"] = r.extra["decode_tokens_per_s_aggregate"] / base if base else None
