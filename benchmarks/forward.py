"""Decode speed of the NumPy forward pass and where the time goes (attention, router, experts, lm head).

    python benchmarks/forward.py [--hidden 1024 --experts 32 --layers 4 --tokens 32 --reps 5]

Generates a random OLMoE-style model at a realistic width (cached under --workdir), prefills a
prompt, then decodes --tokens tokens one at a time, --reps times. Full expert residency (warm-up
pass reads every expert first), so this measures compute, not I/O. Results: a table on stderr,
JSON/CSV under docs/results/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402
from benchmarks.synthetic import write_olmoe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workdir", default="/tmp/s2moe-bench")
    ap.add_argument("--out", default="docs/results/forward")
    args = ap.parse_args()

    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.forward import MoEModel, TimeSplit

    name = f"olmoe-h{args.hidden}-e{args.experts}k{args.top_k}-i{args.intermediate}-l{args.layers}"
    folder = os.path.join(args.workdir, name)
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        print(f"generating {name} …", file=sys.stderr)
        write_olmoe(folder, args.hidden, args.layers, args.experts, args.top_k, args.intermediate)
    loaded = load_model(folder)
    model = MoEModel(loaded)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, loaded.config.vocab_size - 1, args.prompt)
    for L in loaded.config.moe_layer_ids:  # warm: every expert resident
        model.experts.get(L, list(range(loaded.config.num_experts)))

    tok_s, prefill_ms, splits = [], [], []
    for _ in range(args.reps):
        kv = model.new_cache(args.prompt + args.tokens + 1)
        t0 = time.perf_counter()
        logits, _ = model.forward(prompt, kv, logits="last", record=False)
        kv.commit(args.prompt)
        prefill_ms.append((time.perf_counter() - t0) * 1e3)
        model.split = TimeSplit()
        t1 = time.perf_counter()
        for _ in range(args.tokens):
            token = int(np.argmax(logits[-1]))
            logits, _ = model.forward([token], kv, logits="last", record=False)
            kv.commit(kv.filled)
        dt = time.perf_counter() - t1
        tok_s.append(args.tokens / dt)
        splits.append({k: v / dt for k, v in model.split.seconds.items()})
    share = {k: float(np.median([s.get(k, 0.0) for s in splits])) for k in splits[0]}
    params = {"model": name, "prompt_tokens": args.prompt, "decode_tokens": args.tokens}
    records = [
        Record("forward", "decode", "tok/s", tok_s, params, {"time_share": share}),
        Record("forward", "prefill", "ms", prefill_ms, params),
    ] + [Record("forward", f"decode share: {k}", "fraction", [s.get(k, 0.0) for s in splits], params) for k in share]
    write_outputs(records, machine_info(), args.out, f"forward pass — {name}")


if __name__ == "__main__":
    main()
