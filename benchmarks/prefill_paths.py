"""Backs docs/performance/peer.md, "Prefill at OLMoE-1B-7B's size" (AMX tiles, `docs/results/prefill-amx.*`):
prefill tokens/s of each path through the model, the paths taking turns in one process.

What each step of the prefill work gave: one 512-token prompt through the model, the paths
taking turns in one process (this machine drifts by tens of percent within minutes).

    python benchmarks/prefill_paths.py --model ~/.cache/s2moe-peer/olmoe-1b-7b-q4_k_m.gguf

Paths: the K-quant rows on AVX2 alone in 64-token passes (as before the tiles), AVX-512 tiles of
rows x tokens in 64-token passes, the tiles in one 512-token pass (what `run` takes when every
expert is resident), each quantising an expert's inputs in every pool chunk, and the last with
them quantised once per phase, and that with the K-quant rows on AMX tiles (the default where the
CPU has AMX-INT8). Every expert is resident; random prompt tokens. Results: a table, and JSON /
CSV at --out (the AMX run: docs/results/prefill-amx.*); docs/performance/peer.md ("Prefill") cites them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import Record, machine_info, rounds, write_outputs  # noqa: E402

# (AVX-512 tiles, prompt chunk, experts' inputs quantised once per phase, AMX tiles)
PATHS = {"avx2 rows, 64-token passes": (0, 64, 0, 0), "avx512 tiles, 64-token passes": (1, 64, 0, 0),
         "avx512 tiles, 512-token pass": (1, 512, 0, 0), "tiles, 512-token pass, inputs quantised once": (1, 512, 1, 0),
         "amx tiles, 512-token pass": (1, 512, 1, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default=";".join(PATHS), help="a ';'-separated subset of: " + "; ".join(PATHS))
    ap.add_argument("--out", default="docs/results/prefill-paths")
    a = ap.parse_args()
    paths = {name.strip(): PATHS[name.strip()] for name in a.paths.split(";")}
    from s2moe import _cpu
    from s2moe.runtime.engine import build_engine

    engine = build_engine(a.model, None, kv_positions=a.tokens + 8, preload=True, kernels="cpu", threads=a.threads,
                          memory_limit=None)
    model = engine.model
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, a.tokens)
    model.forward(tokens[:8], model.new_cache(a.tokens + 8), logits="last", record=False)  # warm
    samples = {name: [] for name in paths}
    try:
        for _, name in rounds(paths, a.reps):
            tiles, chunk, once, amx = paths[name]
            _cpu.use_avx512(tiles)
            _cpu.act_once(once)
            _cpu.use_amx(amx)
            model.prefill_chunk = chunk
            start = time.perf_counter()
            model.forward(tokens, model.new_cache(a.tokens + 8), logits="last", record=False)
            samples[name].append(a.tokens / (time.perf_counter() - start))
    finally:
        _cpu.use_avx512(1)
        _cpu.act_once(1)
        _cpu.use_amx(1)
        engine.close()
    records = [Record("prefill-paths", name, "tok/s", samples[name],
                      params={"model": os.path.basename(a.model), "tokens": a.tokens, "threads": a.threads})
               for name in paths]
    write_outputs(records, machine_info(), a.out, "prefill by path, one process, alternating")


if __name__ == "__main__":
    main()
