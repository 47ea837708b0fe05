"""The slow tier: read one expert's byte ranges from the model file, honestly timed.

Reads use ``O_DIRECT`` into page-aligned buffers where the file system allows it, so a fetch costs
what the storage costs and not what the page cache costs; where O_DIRECT is refused (tmpfs, some
overlay file systems) we read buffered and drop the pages afterwards with
``posix_fadvise(DONTNEED)``, and say so once. GGUF blocks are dequantised after the read. The
missing experts of one layer are fetched concurrently: ``pread`` releases the GIL.

Slow-tier emulation (``emulate_bandwidth`` MB/s, ``emulate_latency`` µs) makes each fetch take at
least latency + bytes / bandwidth, for what-if runs and for checking calibration; it is never on
by default and every report produced under it says so.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import ExpertReadError
from .experts import ExpertWeights
from ..model.formats.tensors import TensorRef, decode
from ..model.loader import ExpertRefs, LoadedModel

ALIGN = 4096  # O_DIRECT needs offset, length and buffer aligned to the logical block size (≤ 4 KiB)


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


def _wait_until(deadline: float) -> None:
    """Sleep most of the way, then spin: time.sleep overshoots by ~0.1 ms, which would bias an
    emulated latency of a few hundred µs by tens of percent."""
    left = deadline - time.perf_counter()
    if left > 3e-4:
        time.sleep(left - 3e-4)
    while time.perf_counter() < deadline:
        pass


def _warn_once(message: str, _seen: set = set()) -> None:
    if message not in _seen:
        _seen.add(message)
        print(f"note: {message}", file=sys.stderr)


_MAX_GAP = 64 << 10  # reading a small gap costs less than another request


def _coalesce(refs) -> list[tuple[TensorRef, list[tuple[int, TensorRef]]]]:
    """Merge an expert's byte ranges that lie next to each other in one file into single reads
    (per-expert checkpoints store gate/up/down of an expert back to back)."""
    order = sorted(enumerate(refs), key=lambda item: (item[1].path, item[1].offset))
    spans: list[tuple[TensorRef, list[tuple[int, TensorRef]]]] = []
    for i, ref in order:
        if spans:
            span, members = spans[-1]
            end = span.offset + span.nbytes
            if ref.path == span.path and 0 <= ref.offset - end <= _MAX_GAP:
                new_end = max(end, ref.offset + ref.nbytes)
                spans[-1] = (TensorRef(span.path, span.name, span.offset, new_end - span.offset, "U8",
                                       (new_end - span.offset,)), members + [(i, ref)])
                continue
        spans.append((TensorRef(ref.path, ref.name, ref.offset, ref.nbytes, "U8", (ref.nbytes,)), [(i, ref)]))
    return spans


class _AlignedBuffers(threading.local):
    """One growing page-aligned buffer per thread (anonymous mmaps are page-aligned)."""

    def get(self, size: int) -> mmap.mmap:
        buf = getattr(self, "buf", None)
        if buf is None or len(buf) < size:
            # the old map is released once the views decoding still holds are gone (no close():
            # it would fail while a view exists)
            buf = self.buf = mmap.mmap(-1, max(size, ALIGN))
        return buf


class ExpertStore:
    """Reads (layer, expert) byte ranges; ``read`` is thread-safe, ``read_many`` is concurrent."""

    def __init__(self, model: LoadedModel, direct: bool = True, emulation: Emulation = Emulation(),
                 threads: int = 8):
        self.refs: dict[tuple[int, int], ExpertRefs] = model.experts
        self.emulation = emulation
        self.want_direct = direct
        self.direct_files: dict[str, bool] = {}
        self._fds: dict[str, int] = {}
        self._identity: dict[str, tuple[int, int]] = {}  # (size, mtime) when opened
        self._lock = threading.Lock()
        self._buffers = _AlignedBuffers()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="s2moe-fetch") if threads > 1 else None

    # -- file handles ---------------------------------------------------------------------------
    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        with self._lock:
            if path in self._fds:
                return self._fds[path]
            direct = False
            if self.want_direct and hasattr(os, "O_DIRECT"):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    direct = True
                except OSError:
                    _warn_once(f"{path}: O_DIRECT refused by this file system; reading buffered and "
                               "dropping pages with posix_fadvise(DONTNEED) instead")
            if not direct:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise ExpertReadError(f"{path}: cannot open for expert reads ({exc.strerror})") from None
            self.direct_files[path] = direct
            st = os.fstat(fd)
            self._identity[path] = (st.st_size, st.st_mtime_ns)
            self._fds[path] = fd
            return fd

    # -- reads ----------------------------------------------------------------------------------
    def _read_range(self, ref: TensorRef, where: str) -> memoryview:
        fd = self._fd(ref.path)
        try:
            if self.direct_files[ref.path]:
                start = ref.offset - ref.offset % ALIGN
                end = -(-(ref.offset + ref.nbytes) // ALIGN) * ALIGN
                buf = self._buffers.get(end - start)
                got = os.preadv(fd, [memoryview(buf)[: end - start]], start)
                skip = ref.offset - start
                if got < skip + ref.nbytes:
                    raise ExpertReadError(f"{ref.path}: short read of {where} ({max(got - skip, 0)} of {ref.nbytes} "
                                          "bytes); was the file truncated or replaced?")
                return memoryview(buf)[skip: skip + ref.nbytes]
            data = os.pread(fd, ref.nbytes, ref.offset)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, ref.offset, ref.nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise ExpertReadError(f"{ref.path}: reading {where} failed ({exc.strerror or exc})") from None
        if len(data) != ref.nbytes:
            raise ExpertReadError(f"{ref.path}: short read of {where} ({len(data)} of {ref.nbytes} bytes); "
                                  "was the file truncated or replaced?")
        return memoryview(data)

    def _check_unchanged(self, path: str, where: str) -> None:
        """A file rewritten in place under us would silently change the weights: refuse instead."""
        st = os.fstat(self._fds[path])
        if (st.st_size, st.st_mtime_ns) != self._identity[path]:
            raise ExpertReadError(f"{path}: the model file changed while running (size or mtime differs) while "
                                  f"reading {where}; restart with the new file")

    def read(self, layer: int, expert: int) -> ExpertWeights:
        refs = self.refs[layer, expert]
        where = f"expert {expert} of layer {layer}"
        t0 = time.perf_counter()
        arrays: list = [None] * len(refs.refs)
        for span, members in _coalesce(refs.refs):
            raw = self._read_range(span, where)
            # decode copies out of the (reused) aligned buffer before this thread reads again
            for i, ref in members:
                arrays[i] = decode(ref, raw[ref.offset - span.offset: ref.offset - span.offset + ref.nbytes], order="F")
        for path in {r.path for r in refs.refs}:
            self._check_unchanged(path, where)
        if self.emulation.active:  # the real read happened; now wait out the emulated link
            _wait_until(self.emulation.finish_time(t0, refs.stored_bytes))
        return refs.assemble(arrays)  # layout-specific: split, de-interleave, MXFP4

    def read_undecoded(self, layer: int, expert: int) -> int:
        """The same reads as ``read`` without decoding (benchmarks separate I/O from decode)."""
        refs = self.refs[layer, expert]
        for span, _ in _coalesce(refs.refs):
            self._read_range(span, f"expert {expert} of layer {layer}")
        return refs.stored_bytes

    def timed_read(self, path: str, offset: int, nbytes: int) -> float:
        """Seconds for one raw request through this tier (O_DIRECT and emulation as configured)."""
        ref = TensorRef(path, f"probe@{offset}", offset, nbytes, "F32", (nbytes // 4,))
        t0 = time.perf_counter()
        self._read_range(ref, f"bandwidth probe at byte {offset}")
        if self.emulation.active:
            _wait_until(self.emulation.finish_time(t0, nbytes))
        return time.perf_counter() - t0

    def read_many(self, layer: int, experts: list[int]) -> list[ExpertWeights]:
        if self._pool is None or len(experts) < 2:
            return [self.read(layer, e) for e in experts]
        return list(self._pool.map(lambda e: self.read(layer, e), experts))

    def stored_bytes(self, layer: int, expert: int) -> int:
        return self.refs[layer, expert].stored_bytes

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
