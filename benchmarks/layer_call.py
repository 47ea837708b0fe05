"""A decode token's MoE layer in one C call (`MoEModel._moe_step`, csrc/cpu/step.c) against the
step-by-step path it replaces (route, restrict, the cache's group, the expert kernel, the sum from
Python), taking turns in one process: this machine drifts by tens of percent within seconds.

    python benchmarks/layer_call.py [--model DIR] [--budget 0.25] [--reps 7] [--out docs/results/layer-call/default]

Both paths give the same bits and the same cache bookkeeping (tests/test_decode_step.py), so the
switch is the model's ``_steps`` flag. Each repetition times, per side, a resident-only draft pass
(top-2, the S²-MoE draft) and an AR pass at one position after a 60-token prompt, over the
default prompts' tokens, rolled back after each pass. AR passes that miss still stream their reads on
either side, so the AR figure includes whatever the cache lacked. With ``--stub`` the kernels
return at once: what is left is the Python of a pass. Results: a markdown table on stdout,
JSON/CSV under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402


class _Stubbed:
    """The extension with its compute calls returning at once (``--stub``): a pass's Python."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        if name in ("moe", "matmul", "attn_block", "rms_norm", "attend"):
            return lambda *a, **k: None
        if name == "moe_step":
            return lambda *a, **k: 0
        return getattr(self._real, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder (default: the embedded model)")
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--passes", type=int, default=200, help="passes of each kind per side and repetition")
    ap.add_argument("--stub", action="store_true", help="kernels return at once: the Python of a pass")
    ap.add_argument("--out", default="docs/results/layer-call/default")
    args = ap.parse_args()

    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.engine import build_engine, phase_of
    from s2moe.runtime.kernels import cpu
    from s2moe.runtime.model.routing import RoutingPolicy
    from s2moe.runtime.model.tokenizer import load_tokenizer
    from s2moe.runtime.prompts import default_prompts

    model = build_engine(args.model or str(DEFAULT_MODEL), budget=args.budget).model
    if not model._steps:
        sys.exit("layer_call: this model does not take the one-call path (CPU kernels, a cache, a plain router)")
    c, cache = model.config, model.experts
    draft = RoutingPolicy(top_k=2, allowed=lambda L: cache.resident_mask(L, c.num_experts))
    prompts, tok = default_prompts(), load_tokenizer(model.loaded)
    ids = tok.encode(prompts[0]).ids[:60]
    tokens = tok.encode(" ".join(prompts[1:4])).ids  # the decode tokens: real text, so routing varies
    kv = model.new_cache(256)
    model.forward(ids, kv, logits="last")
    kv.commit(len(ids))
    if args.stub:
        cpu._cpu = _Stubbed(cpu._cpu)

    def passes(policy) -> float:
        t0 = time.perf_counter()
        with phase_of(model, "draft" if policy else "ar"):
            for i in range(args.passes):
                tok = [tokens[i % len(tokens)]]
                model.forward(tok, kv, policy=policy, logits="last") if policy else \
                    model.forward(tok, kv, logits="last", record=False)
                kv.rollback(len(ids))
        return (time.perf_counter() - t0) / args.passes * 1e6

    samples = {(side, kind): [] for side in ("steps", "one call") for kind in ("draft", "AR")}
    for rep in range(args.reps):  # A then B, then B then A: drift falls on both
        for side in (("steps", "one call") if rep % 2 == 0 else ("one call", "steps")):
            model._steps = side == "one call"
            samples[(side, "draft")].append(passes(draft))
            samples[(side, "AR")].append(passes(None))
        print(rep, {k: round(v[-1]) for k, v in samples.items()}, file=sys.stderr, flush=True)

    where = f"{os.path.basename(os.path.normpath(args.model)) if args.model else 'embedded'} at {args.budget}"
    where += ", kernels stubbed" if args.stub else ""
    records, rows = [], []
    for kind in ("draft", "AR"):
        a, b = samples[("steps", kind)], samples[("one call", kind)]
        ratio = [y / x for x, y in zip(a, b)]
        for side, s in (("steps", a), ("one call", b)):
            records.append(Record("layer-call", f"{kind} pass, {side}", "us", s,
                                  params={"model": where, "kind": kind, "side": side, "budget": args.budget},
                                  extra={"one_call_over_steps": ratio} if side == "one call" else {}))
        rows.append((kind, statistics.median(a), statistics.median(b), statistics.median(ratio), min(ratio), max(ratio)))
    write_outputs(records, machine_info(), args.out, f"A decode layer in one call ({where})")
    print(f"| pass ({where}) | step by step | one call | one call / steps, median (range) |")
    print("|---|---|---|---|")
    for kind, a, b, r, lo, hi in rows:
        print(f"| {kind} | {a:.0f} µs | {b:.0f} µs | **{r:.2f}×** ({lo:.2f}–{hi:.2f}) |")


if __name__ == "__main__":
    main()
