"""What-if: a draft that reads lower-precision copies of its weights. An instrument, not a feature.

    python benchmarks/draft_precision.py [--widened DIR] [--types Q8_0,Q4_0] [--reps 7]

A draft pass on this CPU reads its weights once per token (resident experts, attention, lm head) at
the memory bandwidth, so a cheaper pass needs fewer bytes. This builds Q8_0 / Q4_0 copies of every
expert and of the attention and lm-head matrices of the widened model (all experts resident), runs
draft passes on them, and verifies with the F16 target as usual (lossless: only what is drafted
changes). Part A times one draft pass (top-2, one token) per precision, the precisions taking turns,
median of 7 repetitions of 24 passes and the median per-repetition ratio to F16. Part B counts
tokens generated per verification (`ca`, a fixed draft of 8; 4 prompts each of HumanEval, GSM8K and
MT-Bench, 64 tokens; greedy and T = 1 with standard sampling, seed = prompt number). The copies
would cost memory beside the F16 weights the target needs (Q8_0: 53 % of their bytes), which is
why this is measured before it is built. Writes docs/results/draft-precision.json/.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.counting import prompts_of, unused_costs  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

WORKLOADS = ("humaneval", "gsm8k", "mt-bench")
DRAFT_READS = ("qkv", "o", "lm_head")  # the dense matrices a draft pass multiplies by (router: float32, tiny)


class _Copies:
    """An expert provider over fixed copies (every expert resident)."""

    def __init__(self, experts: dict):
        self.experts = experts

    def get(self, layer, ids):
        return [self.experts[(layer, e)] for e in ids]


def draft_model(engine, dtype: str):
    """A `MoEModel` on ``dtype`` copies of the draft's weights, sharing everything else."""
    from s2moe.runtime.kernels.stored import StoredMatrix
    from s2moe.runtime.model.forward import MoEModel

    m = engine.model

    def copy(M):
        return StoredMatrix.from_float(M.dequantize(), dtype) if isinstance(M, StoredMatrix) else M

    experts = {}
    for L, e in engine.loaded.experts:
        w = m.experts.get(L, [e])[0]
        experts[(L, e)] = dataclasses.replace(w, gate=copy(w.gate), up=copy(w.up), down=copy(w.down), alloc_bytes=None)
    draft = MoEModel(engine.loaded, _Copies(experts), m.backend, m.ops)
    draft.W = {k: copy(v) if k.split(".")[-1] in DRAFT_READS else v for k, v in m.W.items()}
    return draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widened", default="/work/models/widened", help="tools/widen_model.py output (hidden 1024)")
    ap.add_argument("--types", default="Q8_0,Q4_0")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="docs/results/draft-precision")
    args = ap.parse_args()

    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.sampling import SamplingParams
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.routing import TARGET, RoutingPolicy
    from s2moe.runtime.model.tokenizer import load_tokenizer

    engine = build_engine(args.widened, preload=True)
    m = engine.model
    drafts = {"F16": m, **{t: draft_model(engine, t) for t in args.types.split(",")}}
    policy, rng = RoutingPolicy(top_k=2), np.random.default_rng(0)
    V = m.config.vocab_size
    prompt = [int(t) for t in rng.integers(0, V, 40)]
    times: dict[str, list[float]] = {k: [] for k in drafts}
    for _ in range(args.reps):
        for name, d in drafts.items():  # taking turns within each repetition
            kv = m.new_cache(128)
            m.forward(prompt, kv, logits="last", record=False)
            kv.commit(kv.filled)
            t0 = time.perf_counter()
            for _ in range(24):
                d.forward([int(rng.integers(0, V))], kv, policy=policy, logits="last", record=False)
                kv.commit(kv.filled)
            times[name].append((time.perf_counter() - t0) / 24 * 1e3)
    base = np.array(times["F16"])
    records = [Record("draft-precision", f"{name} draft pass", "ms", t, params={"dtype": name},
                      extra={"ratio_to_f16": round(float(np.median(np.array(t) / base)), 4)})
               for name, t in times.items()]

    prompts = prompts_of(load_tokenizer(engine.loaded), WORKLOADS, 4, tail=512)
    target = m.forward
    for name, d in drafts.items():
        draft_forward = target if d is m else d.forward

        def forward(tokens, kv, *a, policy=TARGET, _draft=draft_forward, **kw):  # draft passes: the copies
            return (_draft if policy.top_k else target)(tokens, kv, *a, policy=policy, **kw)

        m.forward = forward
        for temperature in (0.0, 1.0):
            per = []
            for i, ids in enumerate(prompts):
                params = SamplingParams(temperature=temperature, seed=i if temperature > 0 else None, sampler="standard")
                dec = SpeculativeDecoder(m, get_method("ca", reuse_gating=False), SpecSettings(draft_cap=8),
                                         unused_costs(), params)
                dec.generate(ids, 64)
                per.append((dec.metrics.accepted + dec.metrics.verifications) / max(dec.metrics.verifications, 1))
            records.append(Record("draft-precision", f"{name} T{temperature:g}", "tokens per verification", per,
                                  params={"dtype": name, "temperature": temperature, "method": "ca", "draft_cap": 8},
                                  extra={"mean": round(float(np.mean(per)), 4)}))
        m.forward = target
    engine.close()
    write_outputs(records, machine_info(), args.out, "draft precision (what-if)")
    for r in records:
        print(f"| {r.name} | {r.unit} | {r.median:.3f} | {r.extra} |")


if __name__ == "__main__":
    main()
