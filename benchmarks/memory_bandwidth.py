"""How fast this machine reads memory, as the decode kernels see it: the numerator of the
memory-to-slow-tier ratio that sets how much hiding a fetch is worth (docs/performance.md, "In the
paper's regime").

    python benchmarks/memory_bandwidth.py MODEL_DIR

Loads every expert of MODEL_DIR (all resident), then multiplies one token by every gate, up and
down matrix in turn: each matrix is read once from DRAM, because the whole set is far larger than
the last-level cache. It prints GB/s for 1 and 2 kernel threads (3 passes each), then for NumPy's
sum over 256 MiB. Run it just before and just after a timed run: this VM's bandwidth drifts by
tens of percent within minutes.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from s2moe.runtime.engine import build_engine
from s2moe.runtime.kernels.cpu import _cpu


def main() -> None:
    engine = build_engine(sys.argv[1], preload=True)
    m = engine.model
    c = m.config
    mats = []
    for L in range(c.num_layers):
        for e in range(c.num_experts):
            w = m.experts.get(L, [e])[0]
            mats += [w.gate, w.up, w.down]
    print(len(mats), "matrices,", type(mats[0]).__name__)
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in {W.shape[1] for W in mats}}
    for threads in (1, 2):
        _cpu.set_threads(threads)
        for _ in range(3):
            t0, nbytes = time.perf_counter(), 0
            for W in mats:
                m.ops.linear(inputs[W.shape[1]], W)
                nbytes += W.data.nbytes
            dt = time.perf_counter() - t0
            print(f"{threads} threads: {nbytes / dt / 1e9:.2f} GB/s over {nbytes >> 20} MiB")
    a = np.ones(64 << 20, dtype=np.float32)
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        print(f"numpy sum: {a.nbytes / (time.perf_counter() - t0) / 1e9:.2f} GB/s")
    engine.close()


if __name__ == "__main__":
    main()
