"""Reads byte ranges of model files without leaving them in the page cache.

`O_DIRECT` where the file system allows it: the request goes from the device straight into a
page-aligned buffer of ours, which the caller keeps (zero copy). The range's first byte is placed at
its offset within the page, so a kept range costs its bytes rounded out to whole pages (at most
8 KiB more; nothing more when the file aligns its tensors to pages, as `s2moe convert` does). Where
O_DIRECT is refused (tmpfs, some overlay file systems) we read buffered into an exact buffer and drop
the file's pages afterwards with ``posix_fadvise(DONTNEED)``, and say so once.

Nothing here maps a model file: the only mappings are anonymous buffers, released when the last
array viewing them goes away, or kept by a `BufferPool` for the next read.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
import weakref

import numpy as np

from ..errors import ExpertReadError

ALIGN = 4096  # O_DIRECT needs offset, length and buffer aligned to the logical block size (≤ 4 KiB)

_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"note: {message}", file=sys.stderr)


def reset_warnings() -> None:
    """Forget which notes were printed (tests: no state leaks from one test into the next)."""
    _WARNED.clear()


# Ranges this close are read as one request (a GGUF's alignment padding between an expert's
# tensors); a wider gap would be read and then kept resident with the expert, so it splits.
_MAX_GAP = 256


def short_read(path: str, where: str, got: int, nbytes: int) -> ExpertReadError:
    return ExpertReadError(f"{path}: short read of {where} ({max(got, 0)} of {nbytes} bytes); "
                           "was the file truncated or replaced?")


def read_failed(path: str, where: str, exc: OSError) -> ExpertReadError:
    return ExpertReadError(f"{path}: reading {where} failed ({exc.strerror or exc})")


def coalesce(refs):
    """Merge byte ranges that lie next to each other in one file into single reads (per-expert
    checkpoints store gate/up/down of an expert back to back): [(span ref, [(index, ref), ...])]."""
    from ..model.formats.tensors import TensorRef

    order = sorted(enumerate(refs), key=lambda item: (item[1].path, item[1].offset))
    spans: list = []
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


def span_cost(offset: int, nbytes: int, direct: bool) -> int:
    """Bytes of memory a kept range costs: whole pages around it under O_DIRECT, else exact."""
    if not direct:
        return nbytes
    head = offset % ALIGN
    return -(-(head + nbytes) // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of ``nbytes`` (rounded up to pages), backed by an anonymous map."""
    size = max(-(-nbytes // ALIGN) * ALIGN, ALIGN)
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)


class BufferPool:
    """Page-aligned read buffers, reused once the last array viewing one is gone.

    A fresh anonymous map per read costs a page fault per 4 KiB when the device writes into it, and
    an unmap when it is freed. On a 2-core VM that CPU time is taken from the matmuls running beside
    the read: 3 MiB reads every 2 ms slowed a matvec loop 1.60x with fresh maps and 1.08x with
    reused buffers (`benchmarks/read_buffers.py` at commit 807e4cc). A buffer whose array dies goes
    back to a free list (one per size in pages) instead, as long as the buffers handed out plus those
    kept stay within ``limit_bytes``: the engine passes the plan's expert capacity plus its streaming workspace, so
    keeping them never takes the process past its plan."""

    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self._free: dict[int, list[mmap.mmap]] = {}
        self.free_bytes = 0
        self.outstanding = 0  # bytes handed out whose arrays are still alive
        self.created = self.reused = 0
        self._lock = threading.RLock()  # a collection inside take() may run _give_back on this thread

    def take(self, nbytes: int) -> np.ndarray:
        """A page-aligned uint8 array of ``nbytes`` rounded up to pages."""
        size = max(-(-nbytes // ALIGN) * ALIGN, ALIGN)
        with self._lock:
            stack = self._free.get(size)
            mm = stack.pop() if stack else None
            if mm is not None:
                self.free_bytes -= size
                self.reused += 1
            else:  # other sizes kept free make way, so the pool stays within its limit
                while self.free_bytes and self.free_bytes + self.outstanding + size > self.limit:
                    self._drop_one()
                self.created += 1
            self.outstanding += size
        if mm is None:
            mm = mmap.mmap(-1, size)
        arr = np.frombuffer(mm, dtype=np.uint8)
        # views (slices, dtype views, reshapes) keep `arr` as their base: it dies with the last one
        weakref.finalize(arr, self._give_back, mm, size).atexit = False  # nothing to give back at exit
        return arr

    def _give_back(self, mm: mmap.mmap, size: int) -> None:
        with self._lock:
            self.outstanding -= size
            if self.free_bytes + self.outstanding + size <= self.limit:
                self._free.setdefault(size, []).append(mm)
                self.free_bytes += size
        # not kept: dropping our reference unmaps it once the dying array's export is released

    def _drop_one(self) -> None:
        size = max(s for s, stack in self._free.items() if stack)  # the largest goes first
        self._free[size].pop()
        self.free_bytes -= size

    def stats(self) -> dict:
        return {"limit_bytes": self.limit, "created": self.created, "reused": self.reused,
                "free_bytes": self.free_bytes, "outstanding_bytes": self.outstanding}


class FileReader:
    """Thread-safe reads of (path, offset, nbytes) ranges, O_DIRECT where allowed; ``pool`` reuses
    the page-aligned buffers of O_DIRECT reads (None: a fresh map per read)."""

    def __init__(self, direct: bool = True, pool: BufferPool | None = None):
        self.pool = pool
        self.want_direct = direct
        self.direct_files: dict[str, bool] = {}
        self._fds: dict[str, int] = {}
        self._identity: dict[str, tuple[int, int]] = {}  # (size, mtime) when opened
        self._checked: dict[str, float] = {}  # when each file last passed `check_unchanged`
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
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
                    warn_once(f"{path}: O_DIRECT refused by this file system; reading buffered and "
                              "dropping pages with posix_fadvise(DONTNEED) instead")
            if not direct:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise ExpertReadError(f"{path}: cannot open for reading ({exc.strerror})") from None
            self.direct_files[path] = direct
            st = os.fstat(fd)
            self._identity[path] = (st.st_size, st.st_mtime_ns)
            self._fds[path] = fd
            return fd

    def is_direct(self, path: str) -> bool:
        self.fd(path)
        return self.direct_files[path]

    def read(self, path: str, offset: int, nbytes: int, where: str) -> np.ndarray:
        """The bytes as a uint8 array that owns (a view of) its own buffer: keep it, no copy."""
        fd = self.fd(path)
        try:
            if self.direct_files[path]:
                head = offset % ALIGN
                buf = self.pool.take(head + nbytes) if self.pool else aligned_empty(head + nbytes)
                got = os.preadv(fd, [memoryview(buf)], offset - head)
                if got < head + nbytes:
                    raise short_read(path, where, got - head, nbytes)
                return buf[head: head + nbytes]
            data = os.pread(fd, nbytes, offset)  # the bytes object is the buffer: no copy
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise read_failed(path, where, exc) from None
        if len(data) != nbytes:
            raise short_read(path, where, len(data), nbytes)
        return np.frombuffer(data, dtype=np.uint8)

    def read_ref(self, ref) -> np.ndarray:
        """One `TensorRef`'s bytes."""
        return self.read(ref.path, ref.offset, ref.nbytes, f"tensor {ref.name}")

    def check_unchanged(self, path: str, where: str, landed: float | None = None) -> None:
        """A file rewritten in place under us would silently change the weights: refuse instead.
        ``landed``: when the read being checked finished (`time.perf_counter`); a check of the
        file that passed after that covers it, so a layer's reads landed together cost one fstat."""
        if landed is not None and self._checked.get(path, -1.0) >= landed:
            return
        t = time.perf_counter()
        st = os.fstat(self._fds[path])
        if (st.st_size, st.st_mtime_ns) != self._identity[path]:
            raise ExpertReadError(f"{path}: the model file changed while running (size or mtime differs) while "
                                  f"reading {where}; restart with the new file")
        self._checked[path] = t

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
