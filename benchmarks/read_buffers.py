"""What a background expert read costs the compute beside it: a fresh page-aligned map per read
against a reused buffer (`BufferPool`), and no read at all.

    python benchmarks/read_buffers.py [--file MODEL.safetensors] [--mib 3] [--reps 5]

The main thread times a loop of float32 matvecs (hidden 1024, the widened model's width) while one
thread reads ``--mib`` MiB ranges of ``--file`` with O_DIRECT every 2 ms, as a draft's prefetches
do. The three modes alternate within each repetition (this machine drifts by tens of percent
within seconds). Writes docs/results/read-buffers.json (raw samples, machine, commit).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from s2moe.runtime.offload.reader import BufferPool, FileReader  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

MODES = ("no read", "fresh map per read", "reused buffer")


def loop_ms(mode: str, path: str, nbytes: int, rounds: int = 15) -> tuple[float, int]:
    """Median ms of 200 matvecs while ``mode`` reads in the background; and how many reads ran."""
    reader = FileReader(True, BufferPool(4 * nbytes + (1 << 20)) if mode == "reused buffer" else None)
    size = os.path.getsize(path)
    stop, reads = threading.Event(), [0]

    def read_forever():
        rng = np.random.default_rng(0)
        while not stop.is_set():
            offset = int(rng.integers(0, max((size - nbytes) // 4096, 1))) * 4096
            reader.read(path, offset, nbytes, "benchmark range")  # the array dies here: pooled or unmapped
            reads[0] += 1
            time.sleep(0.002)

    w = np.random.default_rng(1).standard_normal((1024, 1536)).astype(np.float32)
    x = np.random.default_rng(2).standard_normal((1, 1024)).astype(np.float32)
    thread = threading.Thread(target=read_forever, daemon=True) if mode != "no read" else None
    if thread:
        thread.start()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(200):
            x @ w
        times.append(time.perf_counter() - t)
    stop.set()
    if thread:
        thread.join()
    reader.close()
    return 1e3 * statistics.median(times), reads[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default=None, help="a file on the disk to read (default: the embedded model)")
    ap.add_argument("--mib", type=float, default=3.0, help="bytes per read, MiB (a widened expert is 3)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="docs/results/read-buffers")
    args = ap.parse_args()
    if args.file is None:
        from s2moe.runtime.cli.common import DEFAULT_MODEL

        args.file = str(next(p for p in sorted(os.scandir(DEFAULT_MODEL), key=lambda e: e.name)
                             if p.name.endswith(".safetensors")).path)
    nbytes = int(args.mib * (1 << 20)) // 4096 * 4096
    samples = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in MODES:
            ms, reads = loop_ms(mode, args.file, nbytes)
            samples[mode].append(ms)
            print(f"rep {rep + 1} {mode}: {ms:.1f} ms per 200 matvecs ({reads} reads)", file=sys.stderr)
    base = statistics.median(samples["no read"])
    records = [Record("read_buffers", mode, "ms", samples[mode],
                      params={"file": os.path.basename(args.file), "read_bytes": nbytes, "reps": args.reps},
                      extra={"slowdown_vs_no_read": statistics.median(samples[mode]) / base})
               for mode in MODES]
    write_outputs(records, machine_info(), args.out, "background reads beside compute")
    print("| reads beside the matvecs | ms per 200 matvecs (median) | slowdown |")
    print("|---|---|---|")
    for r in records:
        print(f"| {r.name} | {r.median:.1f} | {r.extra['slowdown_vs_no_read']:.2f}× |")


if __name__ == "__main__":
    main()
