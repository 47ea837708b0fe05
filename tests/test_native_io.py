"""Expert reads on the extension's I/O threads (`_cpu.Read`, `store.NativeFetch`): the same bytes as
the Python path, cancellation, buffers kept alive under a running read, timing, and fork.
Faults (EIO, short reads) on this path are in test_faults.py."""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import pytest

from s2moe.runtime.model.loader import load_model
from s2moe.runtime.offload.reader import aligned_empty
from s2moe.runtime.offload.store import ExpertStore, NativeFetch

_cpu = pytest.importorskip("s2moe._cpu", reason="the CPU extension is not built (no compiler at install)")


@pytest.fixture
def olmoe(tiny_model_dirs):
    return load_model(tiny_model_dirs["olmoe"][1])


@pytest.fixture
def held():
    """Queued reads wait (and can be cancelled) until the test lets them go."""
    _cpu.io_hold(True)
    try:
        yield
    finally:
        _cpu.io_hold(False)


def _parts(w):
    return [np.asarray(m.data).tobytes() for m in (w.gate, w.up, w.down)]


def test_native_fetches_give_the_python_paths_weights(olmoe):
    native, python = ExpertStore(olmoe), ExpertStore(olmoe, threads=1)
    assert native.native and not python.native
    keys = sorted(native.refs)
    futures = {key: native.submit(key[0], [key[1]])[0] for key in keys}
    assert all(isinstance(f, NativeFetch) for f in futures.values())
    for key in keys:
        got, want = futures[key].result(), python.read(*key)
        assert _parts(got) == _parts(want), key
        assert got.alloc_bytes == want.alloc_bytes and got.nbytes == want.nbytes
        assert futures[key].done() and futures[key].result() is got  # one assembly per fetch


def test_a_read_lands_its_bytes_and_records_when(tmp_path):
    path = tmp_path / "blob"
    blob = np.random.default_rng(1).integers(0, 256, 3 * 4096 + 10, dtype=np.uint8).tobytes()
    path.write_bytes(blob)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = np.zeros(8192, np.uint8)
        t0 = time.perf_counter()
        read = _cpu.Read(fd, 4096, buf)
        assert read.wait() == 8192
        assert t0 <= read.done_at <= time.perf_counter()  # the same clock as perf_counter
        assert buf.tobytes() == blob[4096:4096 + 8192]
        tail = _cpu.Read(fd, 3 * 4096, np.zeros(4096, np.uint8))
        assert tail.wait() == 10  # end of file: fewer bytes, for the caller to judge
    finally:
        os.close(fd)


def test_a_queued_read_cancels_and_never_writes(tmp_path, held):
    path = tmp_path / "blob"
    path.write_bytes(b"\x07" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = np.zeros(4096, np.uint8)
        read = _cpu.Read(fd, 0, buf)
        assert not read.done()
        assert read.cancel() and read.done() and read.done_at is None
        with pytest.raises(RuntimeError, match="cancelled"):
            read.wait()
        _cpu.io_hold(False)
        time.sleep(0.05)
        assert not buf.any()
        started = _cpu.Read(fd, 0, np.zeros(4096, np.uint8))
        started.wait()
        assert not started.cancel()  # over already: nothing to cancel
    finally:
        os.close(fd)


def test_a_running_read_does_not_cancel_and_lands(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"\x05" * 4096)
    fd = os.open(path, os.O_RDONLY)
    _cpu.io_inject(0, -1, 300_000)  # each read, once taken by a thread, takes 0.3 s more
    try:
        buf = np.zeros(4096, np.uint8)
        read = _cpu.Read(fd, 0, buf)
        time.sleep(0.1)  # a thread has it now
        assert not read.cancel() and not read.done()
        assert read.wait() == 4096 and (buf == 5).all()
    finally:
        _cpu.io_inject()
        os.close(fd)


def test_dropping_a_read_in_flight_keeps_its_buffer_until_it_lands(tmp_path, held):
    """The Read holds a view of its buffer: dropping both, queued or running, must not free the
    memory under the I/O thread (a crash or a write into freed memory)."""
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(3):
            reads = [_cpu.Read(fd, 0, aligned_empty(1 << 20)) for _ in range(8)]
            del reads  # queued: taken off the queue
        _cpu.io_hold(False)
        for _ in range(50):
            _cpu.Read(fd, 0, aligned_empty(1 << 20))  # running or done: dropped at once
        assert _cpu.Read(fd, 0, np.zeros(16, np.uint8)).wait() == 16
    finally:
        os.close(fd)


def test_a_fetch_cancelled_in_part_is_read_whole(olmoe, held):
    """A fetch whose part was cancelled while another ran reads that part itself, so its result is
    the expert's weights, never a buffer of zeros."""
    store = ExpertStore(olmoe)
    fetch = NativeFetch(store, 1, 3)
    fetch._parts[0][4].cancel()  # as if `cancel` had reached it while a later part ran
    _cpu.io_hold(False)
    assert _parts(fetch.result()) == _parts(ExpertStore(olmoe, threads=1).read(1, 3))


def test_a_whole_fetch_cancels_while_queued(olmoe, held):
    store = ExpertStore(olmoe)
    fetch = store.submit(0, [2])[0]
    assert fetch.cancel() and fetch.done()


def _read_in_child(path, queue):
    fd = os.open(path, os.O_RDONLY)
    queue.put(_cpu.Read(fd, 0, np.zeros(64, np.uint8)).wait())


def test_a_forked_child_reads_with_threads_of_its_own(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    _cpu.Read(fd, 0, np.zeros(64, np.uint8)).wait()  # the parent's threads are running
    os.close(fd)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(str(path), queue))
    child.start()
    child.join(timeout=30)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "a read in a forked child never finished (no I/O threads there)"
    assert queue.get(timeout=5) == 64
