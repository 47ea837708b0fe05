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

from ..kernels.stored import StoredMatrix, kernel_type, row_bytes
from ..model.loader import PROJECTIONS, ExpertRefs, LoadedModel
from .experts import ExpertWeights, assemble
from .reader import (ALIGN, BufferPool, FileReader, aligned_empty, coalesce, read_failed, reset_warnings,  # noqa: F401
                     short_read, warn_once)

try:  # the extension's I/O threads (csrc/cpu/aio.c); without it, fetches run on Python threads
    from s2moe._cpu import Read as _NativeRead, io_threads as _io_threads
except ImportError:
    _NativeRead = _io_threads = None


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
        self._plans: dict[tuple[int, int], tuple] = {}
        self._alloc: dict[tuple[int, int], int] = {}  # resident bytes per expert, as read here
        # per expert, worked out once: its stored bytes, whether its files read with O_DIRECT, and
        # how its parts become weights (`_template`): a verification streams several a layer
        self._bytes: dict[tuple[int, int], int] = {}
        self._direct: dict[tuple[int, int], bool] = {}
        self._templates: dict[tuple[int, int], tuple | None] = {}
        # O_DIRECT fetches on the extension's I/O threads, which never take the GIL: a Python fetch
        # thread runs each read's Python with the GIL held, and a draft beside prefetches on them
        # ran 1.42x its time without prefetch, against 1.13x on these threads (docs/performance/
        # kernels.md, "Reads off the GIL"). Emulated links and buffered files keep the Python
        # threads (their waits and page dropping are written there).
        self.native = _NativeRead is not None and threads > 1 and not emulation.active
        if self.native:
            _io_threads(threads)

    def plan(self, layer: int, expert: int) -> tuple:
        """(refs, spans to read, files they touch, aligned reads), worked out once per expert: a
        fetch then runs little Python (a read used to spend ~35 us coalescing and sizing)."""
        key = (layer, expert)
        plan = self._plans.get(key)
        if plan is None:
            refs = self.refs[key]
            spans = coalesce(refs.refs)
            # per span, what an aligned read of it takes: (span, members, alignment head, bytes to read)
            reads = [(span, members, span.offset % ALIGN, span.offset % ALIGN + span.nbytes) for span, members in spans]
            plan = self._plans[key] = (refs, spans, sorted({r.path for r in refs.refs}), reads)
        return plan

    def _assemble(self, refs: ExpertRefs, raws: list) -> ExpertWeights:
        key = (refs.layer, refs.expert)
        template = self._templates.get(key, False)
        if template is False:
            template = self._templates[key] = _template(refs)
        if template is not None:  # views of the read buffer, checked once in `_template`
            gate, up, down = (StoredMatrix.checked_before(raws[i], dtype, shape) for i, dtype, shape in template)
            weights = ExpertWeights(gate, up, down)
        else:
            weights = assemble(refs.layout, {role: (ref, raw) for (role, ref), raw in zip(refs.parts, raws)})
        alloc = self._alloc.get(key)
        if alloc is None:
            alloc = self._alloc[key] = refs.resident_bytes_for(self.reader.is_direct(refs.gate.path))
        weights.alloc_bytes = alloc
        return weights

    @property
    def direct_files(self) -> dict[str, bool]:
        return self.reader.direct_files

    def read(self, layer: int, expert: int) -> ExpertWeights:
        refs, spans, paths, _ = self.plan(layer, expert)
        where = f"expert {expert} of layer {layer}"
        t0 = time.perf_counter()
        raws: list = [None] * len(refs.parts)
        for span, members in spans:
            split(self.reader.read(span.path, span.offset, span.nbytes, where), span, members, raws)
        for path in paths:
            self.reader.check_unchanged(path, where)
        if self.emulation.active:  # the real read happened; now wait out the emulated link
            _wait_until(self.emulation.finish_time(t0, refs.stored_bytes))
        return self._assemble(refs, raws)

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
        if self.native:
            return [NativeFetch(self, layer, e) if self.direct(layer, e) else self._pool.submit(self.read, layer, e)
                    for e in experts]
        if self._pool is None:
            from concurrent.futures import Future

            futures = []
            for e in experts:
                f = Future()
                f.set_result(self.read(layer, e))
                futures.append(f)
            return futures
        return [self._pool.submit(self.read, layer, e) for e in experts]

    def direct(self, layer: int, expert: int) -> bool:
        """Whether every file of the expert is read with O_DIRECT."""
        got = self._direct.get((layer, expert))
        if got is None:  # (a file's mode is settled when it is first opened)
            got = self._direct[layer, expert] = all(self.reader.is_direct(path) for path in self.plan(layer, expert)[2])
        return got

    def stored_bytes(self, layer: int, expert: int) -> int:
        got = self._bytes.get((layer, expert))
        if got is None:
            got = self._bytes[layer, expert] = self.refs[layer, expert].stored_bytes
        return got

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=True)
        self.reader.close()


def _template(refs: ExpertRefs) -> tuple | None:
    """(part index, dtype, shape) of gate, up and down where an expert's parts are those three
    weights, each kept stored whole (the "split" layout, no biases: most files): they become
    `StoredMatrix` views with no further checks. None: `assemble` decides."""
    if refs.layout != "split" or tuple(role for role, _ in refs.parts) != PROJECTIONS:
        return None
    out = []
    for i, (_, ref) in enumerate(refs.parts):
        if len(ref.shape) != 2 or not kernel_type(ref.dtype, ref.shape[-1]) or \
                ref.nbytes != ref.shape[0] * row_bytes(ref.dtype, ref.shape[1]):
            return None
        out.append((i, ref.dtype, tuple(ref.shape)))
    return tuple(out)


def split(buf, span, members, raws: list) -> None:
    """The parts a span's buffer holds, as views (no copy), into ``raws`` by part index."""
    for i, ref in members:
        raws[i] = buf[ref.offset - span.offset: ref.offset - span.offset + ref.nbytes]


class NativeFetch:
    """One expert read on the extension's I/O threads (`_cpu.Read`), as a future: `done`, `result`,
    `cancel`, and `done_at` (when the bytes landed, in `time.perf_counter` seconds). No Python
    runs for it until the pass collects it; `result` then checks and assembles the weights."""

    def __init__(self, store: ExpertStore, layer: int, expert: int):
        self.store, self.layer, self.expert = store, layer, expert
        reader = store.reader
        self._parts = []  # (span, members, buffer, head, read)
        for span, members, head, size in store.plan(layer, expert)[3]:
            buf = reader.pool.take(size) if reader.pool else aligned_empty(size)
            self._parts.append((span, members, buf, head, _NativeRead(reader.fd(span.path), span.offset - head, buf)))
        self._weights: ExpertWeights | None = None
        self._done_at: float | None = None

    def done(self) -> bool:
        return self._weights is not None or all(part[4].done() for part in self._parts)

    def cancel(self) -> bool:
        """True if no part had started (none will); a part cancelled beside one that had started is
        read again, in `result`, so the future stays whole."""
        cancelled = [part[4].cancel() for part in self._parts]
        return all(cancelled)

    @property
    def done_at(self) -> float | None:
        if self._done_at is None and self._parts:
            times = [part[4].done_at for part in self._parts]
            self._done_at = None if None in times else max(times)
        return self._done_at

    def result(self) -> ExpertWeights:
        if self._weights is not None:
            return self._weights
        store, reader = self.store, self.store.reader
        refs, _, paths, _ = store.plan(self.layer, self.expert)
        where = f"expert {self.expert} of layer {self.layer}"
        raws: list = [None] * len(refs.parts)
        for span, members, buf, head, read in self._parts:
            try:
                got = read.wait()
            except RuntimeError:  # cancelled while another part ran: read it here
                split(reader.read(span.path, span.offset, span.nbytes, where), span, members, raws)
                continue
            except OSError as exc:
                raise read_failed(span.path, where, exc) from None
            if got < head + span.nbytes:
                raise short_read(span.path, where, got - head, span.nbytes)
            split(buf[head: head + span.nbytes], span, members, raws)
        landed = self.done_at
        for path in paths:
            reader.check_unchanged(path, where, landed)
        self._weights = store._assemble(refs, raws)
        self._done_at = self.done_at  # (kept: the parts go)
        self._parts = []  # the buffers now belong to the weights
        return self._weights
