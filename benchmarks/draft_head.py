"""What a FR-Spec draft head (`--draft-vocab N`) buys: acceptance kept (counts) and draft-pass time.

    python benchmarks/draft_head.py [--widened DIR] [--sizes 4096,3072,2048,1024] [--reps 7]

Both parts also run the other cheap lever, one draft expert per layer instead of two (full head).

Part A, counts (the same on any machine for one commit): method `ca` (a fixed draft of 8, no AE,
no gating) on the embedded model, 4 prompts each of HumanEval, GSM8K and MT-Bench, 64 tokens, greedy
and T = 1 (standard sampling, seed = prompt number); tokens generated per verification, and the share
of emitted tokens inside the head, for the full head and each size.

Part B, time: one draft pass (draft top-2, one token, every expert resident, logits of the last
token) with the full head and with each size, the configurations taking turns within each
repetition; median ms and the median of the per-repetition ratios to the full head. On two models of
one width (hidden 1024, 4 layers, 32 experts top-4, F16): the widened embedded model (vocab 6144,
`tools/widen_model.py`) and a random one with OLMoE's vocabulary (50304; `benchmarks/synthetic.py`,
random ranks: for timing any subset is as good as another). Writes docs/results/draft-head.json/.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.counting import prompts_of, resident_model, unused_costs  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

WORKLOADS = ("humaneval", "gsm8k", "mt-bench")


def acceptance(sizes: list[int]) -> list[Record]:
    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.sampling import SamplingParams
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder

    path, engine, tok = resident_model(None)
    prompts = prompts_of(tok, WORKLOADS, 4, tail=512)
    records = []
    for temperature in (0.0, 1.0):
        for n, k in [(0, 2)] + [(n, 2) for n in sizes] + [(0, 1)]:  # top-1 experts: the other cheap lever
            per_verification, covered, emitted = [], 0, 0
            for i, ids in enumerate(prompts):
                params = SamplingParams(temperature=temperature, seed=i if temperature > 0 else None, sampler="standard")
                dec = SpeculativeDecoder(engine.model, get_method("ca", reuse_gating=False),
                                         SpecSettings(draft_topk=k, draft_cap=8, draft_vocab=n), unused_costs(), params)
                result = dec.generate(ids, 64)
                m = result.metrics
                per_verification.append((m.accepted + m.verifications) / max(m.verifications, 1))
                covered += m.vocab_covered if n else len(result.tokens)  # the decoder counts it
                emitted += len(result.tokens)
            label = f"{'full' if not n else n}{' top-1' if k == 1 else ''} T{temperature:g}"
            records.append(Record("draft-head", label, "tokens per verification",
                                  per_verification, params={"draft_vocab": n, "draft_topk": k, "temperature": temperature,
                                                            "method": "ca", "draft_cap": 8, "prompts": len(prompts)},
                                  extra={"mean": round(float(np.mean(per_verification)), 4),
                                         "coverage": round(covered / emitted, 4)}))
    engine.close()
    return records


def draft_pass_times(model_path: str, label: str, sizes: list[int], reps: int, ranks_path: str | None = None) -> list[Record]:
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.routing import RoutingPolicy

    engine = build_engine(model_path, preload=True)
    m = engine.model
    heads = {"full": None, **{str(n): m.draft_head(n, ranks_path) for n in sizes}, "full top-1": None}
    rng = np.random.default_rng(0)
    V = m.config.vocab_size
    prompt = [int(t) for t in rng.integers(0, V, 40)]
    times: dict[str, list[float]] = {k: [] for k in heads}
    for _ in range(reps):
        for name, head in heads.items():  # alternating within each repetition
            kv = m.new_cache(128)
            m.forward(prompt, kv, logits="last", record=False)
            kv.commit(kv.filled)
            t0 = time.perf_counter()
            for _ in range(24):
                m.forward([int(rng.integers(0, V))], kv, policy=RoutingPolicy(top_k=1 if "top-1" in name else 2),
                          logits="last", record=False, head=head)
                kv.commit(kv.filled)
            times[name].append((time.perf_counter() - t0) / 24 * 1e3)
    engine.close()
    full = np.array(times["full"])
    return [Record("draft-head", f"{label} {name}", "ms per draft pass", t,
                   params={"model": label, "vocab": V, "draft_vocab": int(name) if name.isdigit() else 0,
                           "draft_topk": 1 if "top-1" in name else 2},
                   extra={"ratio_to_full": round(float(np.median(np.array(t) / full)), 4)})
            for name, t in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widened", default="/work/models/widened", help="tools/widen_model.py output (hidden 1024)")
    ap.add_argument("--sizes", default="4096,3072,2048,1024")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="docs/results/draft-head")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    records = acceptance(sizes)
    records += draft_pass_times(args.widened, "widened (vocab 6144)", sizes, args.reps)
    from benchmarks.synthetic import write_olmoe
    from s2moe.runtime.model.draft_head import ranks_document, write_ranks

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_olmoe(os.path.join(tmp, "olmoe-vocab"), vocab=50304, heads=8)
        ranks = os.path.join(tmp, "ranks.json")
        write_ranks(ranks, ranks_document(np.random.default_rng(1).permutation(50304) + 1, "random"))
        big = [50304 // 4, 50304 // 8]  # FR-Spec's 32k of 128k, and half that
        records += draft_pass_times(folder, "random (vocab 50304)", big, args.reps, ranks)
    write_outputs(records, machine_info(), args.out, "FR-Spec draft heads")
    for r in records:
        print(f"| {r.name} | {r.unit} | {r.median:.3f} | {r.extra} |")


if __name__ == "__main__":
    main()
