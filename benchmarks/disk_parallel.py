"""Backs docs/performance/s2moe-targets.md, "Where a token's time goes at the default gating, and the
ceiling of full overlap": the disk's read rate with 1, 2 and 4 expert-sized reads in flight
(`docs/results/gating-strength/disk-parallel.json`, the rate `time_split.py --gb-s` takes).

Does the disk give more bandwidth to reads in flight together? (O_DIRECT, expert-sized reads.)

    python benchmarks/disk_parallel.py FILE [--mib 3] [--reads 48] [--reps 5]

Reads ``--reads`` chunks of ``--mib`` MiB at random 4 KiB-aligned offsets of FILE with O_DIRECT
(no page cache), from 1, 2 and 4 threads at once, the three taking turns for ``--reps`` rounds,
and reports the aggregate GB/s of each round. If 2 or 4 in flight give no more than 1, the disk is
bandwidth-bound at expert size: reads started earlier (a layer ahead, a deeper window) cannot
shorten a pass whose reads already keep it busy. Writes docs/results/disk-parallel.json/.csv.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Record, machine_info, write_outputs  # noqa: E402

IN_FLIGHT = (1, 2, 4)


def one_round(fd: int, size: int, chunk: int, reads: int, threads: int, rng: random.Random) -> float:
    offsets = iter([rng.randrange(0, (size - chunk) // 4096) * 4096 for _ in range(reads)])
    buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page-aligned, as O_DIRECT needs
    lock = threading.Lock()

    def worker(buf) -> None:
        while True:
            with lock:
                at = next(offsets, None)
            if at is None:
                return
            if os.preadv(fd, [buf], at) != chunk:
                raise SystemExit(f"error: short read at {at} of {chunk} bytes")

    workers = [threading.Thread(target=worker, args=(b,)) for b in buffers]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return reads * chunk / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="a file on the disk under test, larger than one chunk (a model file)")
    ap.add_argument("--mib", type=float, default=3.0, help="MiB per read (the widened model's F16 expert: 3)")
    ap.add_argument("--reads", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="docs/results/disk-parallel")
    args = ap.parse_args()
    chunk = int(args.mib * (1 << 20)) // 4096 * 4096
    size = os.path.getsize(args.file)
    if size < 2 * chunk:
        raise SystemExit(f"error: {args.file} holds {size} bytes; use a file of at least two {args.mib} MiB reads")
    try:
        fd = os.open(args.file, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        raise SystemExit(f"error: {args.file}: O_DIRECT refused ({exc.strerror}); use a file on a local disk")
    rng = random.Random(0)
    samples: dict[int, list[float]] = {n: [] for n in IN_FLIGHT}
    try:
        for rep in range(args.reps):
            for n in (IN_FLIGHT if rep % 2 == 0 else IN_FLIGHT[::-1]):
                samples[n].append(one_round(fd, size, chunk, args.reads, n, rng))
    finally:
        os.close(fd)
    records = [Record("disk-parallel", f"{n} in flight", "GB/s", samples[n],
                      params={"file": os.path.basename(args.file), "mib": args.mib, "reads": args.reads, "in_flight": n})
               for n in IN_FLIGHT]
    write_outputs(records, machine_info(), args.out, "O_DIRECT reads in flight together")


if __name__ == "__main__":
    main()
