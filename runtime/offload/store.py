"""The slow tier: read one expert's byte ranges from the model file, honestly timed.

Reads go through `FileReader` (runtime/offload/reader.py): ``O_DIRECT`` into page-aligned buffers
where the file system allows it, so a fetch costs what the storage costs and not what the page
cache costs, else buffered reads whose pages are dropped afterwards. The bytes read are the
expert's resident form (stored encoding, zero copy; see experts.py). The missing experts of one
layer are fetched concurrently: ``pread`` releases the GIL, and so do the compute kernels.

Slow-tier emulation (``emulate_bandwidth`` MB/s, ``emulate_latency`` µs) makes each fetch take at
least latency + bytes / bandwidth, for what-if runs and for checking calibration; it is never on
by default and every report produced under it says so.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..model.loader import ExpertRefs, LoadedModel
from .experts import ExpertWeights, assemble
from .reader import ALIGN, BufferPool, FileReader, coalesce, reset_warnings, warn_once  # noqa: F401 (re-exported)


@dataclass
class Emulation:
    """A virtual link: each request waits ``latency``, then transfers at ``bandwidth`` shared by all
    requests in flight (concurrent fetches overlap their latencies, not their bytes)."""

    bandwidth_mb_s: float | None = None  # MB/s = 1e6 bytes/s
    latency_us: float = 0.0

    def __post_init__(self):
        self._lock = threading.Lock()
        self._link_free_at = 0.0

    @property
    def active(self) -> bool:
        return bool(self.bandwidth_mb_s) or self.latency_us > 0

    def finish_time(self, issued_at: float, nbytes: int) -> float:
        """When a request of ``nbytes`` issued at ``issued_at`` (perf_counter seconds) completes."""
        transfer = nbytes / (self.bandwidth_mb_s * 1e6) if self.bandwidth_mb_s else 0.0
        with self._lock:
            start = max(issued_at + self.latency_us * 1e-6, self._link_free_at)
            self._link_free_at = start + transfer
            return self._link_free_at

    def describe(self) -> str:
        parts = []
        if self.bandwidth_mb_s:
            parts.append(f"{self.bandwidth_mb_s:g} MB/s")
        if self.latency_us:
            parts.append(f"{self.latency_us:g} µs latency")
        return "EMULATED slow tier (" + ", ".join(parts) + ")"


_precise = threading.local()


def _precise_sleeps() -> None:
    """Linux lets a sleeping thread wake up to its "timer slack" (50 µs by default) late, which
    would bias an emulated latency of a few hundred µs by tens of percent. One ns of slack on this
    thread makes sleeps end ~6 µs late instead. (Spinning out the last 0.3 ms, as before, held the
    GIL and a core that the compute beside the emulated reads needed.)"""
    if getattr(_precise, "done", False):
        return
    _precise.done = True
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns
        except (OSError, AttributeError):
            pass


def _wait_until(deadline: float) -> None:
    """Sleep until ``deadline`` (perf_counter seconds); never returns before it."""
    _precise_sleeps()
    left = deadline - time.perf_counter()
    while left > 0:
        time.sleep(left)
        left = deadline - time.perf_counter()


class ExpertStore:
    """Reads (layer, expert) byte ranges; ``read`` is thread-safe, ``read_many`` is concurrent."""

    def __init__(self, model: LoadedModel, direct: bool = True, emulation: Emulation = Emulation(),
                 threads: int = 8, pool_bytes: int = 0):
        """``pool_bytes``: reuse read buffers, holding at most this many bytes in them (in use or
        free); 0 maps a fresh buffer per read."""
        self.refs: dict[tuple[int, int], ExpertRefs] = model.experts
        self.emulation = emulation
        self.reader = FileReader(direct, BufferPool(pool_bytes) if pool_bytes > 0 else None)
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="s2moe-fetch") if threads > 1 else None

    @property
    def direct_files(self) -> dict[str, bool]:
        return self.reader.direct_files

    def read(self, layer: int, expert: int) -> ExpertWeights:
        refs = self.refs[layer, expert]
        where = f"expert {expert} of layer {layer}"
        t0 = time.perf_counter()
        raws: list = [None] * len(refs.parts)
        for span, members in coalesce(refs.refs):
            buf = self.reader.read(span.path, span.offset, span.nbytes, where)
            for i, ref in members:  # views into the span's buffer: no copy
                raws[i] = buf[ref.offset - span.offset: ref.offset - span.offset + ref.nbytes]
        for path in {r.path for r in refs.refs}:
            self.reader.check_unchanged(path, where)
        if self.emulation.active:  # the real read happened; now wait out the emulated link
            _wait_until(self.emulation.finish_time(t0, refs.stored_bytes))
        weights = assemble(refs.layout, {role: (ref, raw) for (role, ref), raw in zip(refs.parts, raws)})
        weights.alloc_bytes = refs.resident_bytes_for(self.reader.is_direct(refs.gate.path))
        return weights

    def read_undecoded(self, layer: int, expert: int) -> int:
        """The same reads as ``read`` without assembling (benchmarks separate I/O from the rest)."""
        refs = self.refs[layer, expert]
        for span, _ in coalesce(refs.refs):
            self.reader.read(span.path, span.offset, span.nbytes, f"expert {expert} of layer {layer}")
        return refs.stored_bytes

    def timed_read(self, path: str, offset: int, nbytes: int) -> float:
        """Seconds for one raw request through this tier (O_DIRECT and emulation as configured)."""
        t0 = time.perf_counter()
        self.reader.read(path, offset, nbytes, f"bandwidth probe at byte {offset}")
        if self.emulation.active:
            _wait_until(self.emulation.finish_time(t0, nbytes))
        return time.perf_counter() - t0

    def read_many(self, layer: int, experts: list[int]) -> list[ExpertWeights]:
        if self._pool is None or len(experts) < 2:
            return [self.read(layer, e) for e in experts]
        return list(self._pool.map(lambda e: self.read(layer, e), experts))

    def submit(self, layer: int, experts: list[int]):
        """Start reading ``experts`` on the fetch threads; returns futures (one per expert)."""
        if self._pool is None:
            from concurrent.futures import Future

            futures = []
            for e in experts:
                f = Future()
                f.set_result(self.read(layer, e))
                futures.append(f)
            return futures
        return [self._pool.submit(self.read, layer, e) for e in experts]

    def stored_bytes(self, layer: int, expert: int) -> int:
        return self.refs[layer, expert].stored_bytes

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=True)
        self.reader.close()
