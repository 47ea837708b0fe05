"""Scratch micro-benchmark of session 23 (needs kernel-aio-not-kept.patch applied and the extension rebuilt): 4 O_DIRECT reads of 168 KiB started one call each on the kernel path, in one read_many call, and on the I/O threads; the time to start them and to land them."""
import os, time, statistics
from s2moe import _cpu
from s2moe.runtime.offload.reader import aligned_empty
import s2moe.runtime as R
path = os.path.join(os.path.dirname(R.__file__), "assets", "default-moe", "model.safetensors")
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
size = os.path.getsize(path)
buf = [aligned_empty(172032) for _ in range(8)]
offs = lambda i, j: ((i * 4 + j) * 7919 * 4096) % (size - 200000) // 4096 * 4096
for rep in range(2):
  for mode in ("kernel single", "kernel batch", "thread single"):
    _cpu.io_kernel(0 if mode.startswith("thread") else 1)
    init, total = [], []
    for i in range(300):
        t = time.perf_counter()
        if mode.endswith("batch"):
            rs = _cpu.read_many([(fd, offs(i, j), buf[j]) for j in range(4)])
        else:
            rs = [_cpu.Read(fd, offs(i, j), buf[j]) for j in range(4)]
        t1 = time.perf_counter()
        for r in rs: r.wait()
        t2 = time.perf_counter(); init.append(t1 - t); total.append(t2 - t)
    print(f"{mode:14s} kernel={rs[0].kernel} submit 4: med {statistics.median(init)*1e6:.1f} mean {statistics.mean(init)*1e6:.1f} us; 4 reads total med {statistics.median(total)*1e6:.0f}")
