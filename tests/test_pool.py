"""The kernels' thread pool (csrc/cpu/pool.c): concurrent callers, resizes, workers that join late or
not at all, and the same bits pooled or on the caller. Split from test_kernels.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from s2moe.runtime.kernels import ExpertAct, cpu
from s2moe.runtime.kernels.reference import ReferenceOps
from test_kernels import REL, _experts, random_matrix, rel_err


def test_concurrent_callers_and_pool_resizes_give_correct_results(rng):
    """Kernels release the GIL: several Python threads call in at once while the pool is resized
    between rounds. (A lost wake-up here once hung `s2moe run`; wrong sharing gave wrong sums.)"""
    from s2moe import _cpu

    W = random_matrix(rng, "F16", 512, 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    want = ReferenceOps().linear(x, W)
    bad = []

    def work():
        for _ in range(25):
            y = np.empty((3, 512), np.float32)
            _cpu.matmul(W.data, W.type_id, 512, 512, x, y)
            if rel_err(y, want) > REL:
                bad.append(1)

    try:
        for round_ in range(30):
            _cpu.set_threads(1 + round_ % 3)
            threads = [threading.Thread(target=work) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not any(t.is_alive() for t in threads), "a kernel call never returned"
    finally:
        _cpu.set_threads(cpu.default_threads())
    assert not bad


def _pooled_calls(rng):
    """A product and a layer's experts big enough for the pool, with their reference results."""
    W = random_matrix(rng, "F16", 512, 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    experts = _experts(rng, "F16", 3, 256, 512)
    groups = [(w, np.array(r, np.int32), np.full(len(r), 0.5, np.float32)) for w, r in zip(experts, ([0, 2], [1], [0, 1, 2]))]
    act, ref = ExpertAct(), ReferenceOps()
    want = (ref.linear(x, W), ref.experts(x, groups, act, np.zeros((3, 512), np.float32)))

    def call(ops):
        return ops.linear(x, W), ops.experts(x, groups, act, np.zeros((3, 512), np.float32))

    return call, want


def test_a_job_finishes_on_the_caller_when_no_worker_joins(rng):
    """A worker the OS has not woken yet (held here) must not hold up a call: the caller takes every
    chunk. Waiting for it cost ~300 us per call after each read on this VM; waiting for a worker
    that never comes would hang."""
    from s2moe import _cpu

    call, want = _pooled_calls(rng)
    ops = cpu.CpuOps(threads=2)
    got = []
    _cpu.hold_workers(True)
    try:
        t = threading.Thread(target=lambda: got.extend(call(ops) for _ in range(20)), daemon=True)
        t.start()
        t.join(timeout=10)
        waited = t.is_alive()
    finally:
        _cpu.hold_workers(False)  # a call stuck waiting for them finishes once they join
    t.join(timeout=60)
    _cpu.set_threads(cpu.default_threads())
    assert not waited, "a call waited for workers that had not joined"
    assert len(got) == 20
    for y, out in got:
        assert rel_err(y, want[0]) <= REL and rel_err(out, want[1]) <= REL


def test_workers_that_wake_during_a_job_join_it_correctly(rng):
    """Calls spaced on both sides of the workers' spin (set to 50 us here; the default keeps them
    awake through a pass), so a worker is spinning, just asleep or long asleep when a job starts,
    and wakes while it runs or after it: a late worker takes the chunks left, or none, and never a
    closed job's."""
    from s2moe import _cpu

    call, want = _pooled_calls(rng)
    ops = cpu.CpuOps(threads=2)
    spin = _cpu.pool_spin_us(50)
    try:
        for i in range(48):
            pause = (0.0, 0.00002, 0.00005, 0.0001, 0.0003, 0.001)[i % 6]
            if pause:
                time.sleep(pause)
            y, out = call(ops)
            assert rel_err(y, want[0]) <= REL and rel_err(out, want[1]) <= REL, i
    finally:
        _cpu.pool_spin_us(spin)
        _cpu.set_threads(cpu.default_threads())


def test_a_job_gives_the_same_bits_pooled_or_on_the_caller(rng):
    """The pool splits products by output rows, so moving the threshold (`pool_min_work`) moves
    work between threads without changing a bit: every small call below once all on the caller,
    once split."""
    from s2moe import _cpu

    W = random_matrix(rng, "F16", 96, 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    experts = _experts(rng, "Q8_0", 3, 32, 64)
    groups = [(w, np.array(r, np.int32), np.full(len(r), 0.5, np.float32)) for w, r in zip(experts, ([0], [1], [0, 1]))]
    ops, act = cpu.CpuOps(threads=2), ExpertAct()
    before = _cpu.pool_min_work()
    try:
        got = []
        for threshold in (1 << 40, 0):
            _cpu.pool_min_work(threshold)
            got.append((ops.linear(x, W), ops.experts(x, groups, act, np.zeros((2, 64), np.float32))))
    finally:
        _cpu.pool_min_work(before)
        _cpu.set_threads(cpu.default_threads())
    for a, b in zip(*got):
        assert np.array_equal(a, b)


def test_the_workers_spin_follows_s2moe_spin_us(monkeypatch):
    from s2moe import _cpu
    from s2moe.runtime.errors import UsageError

    before = _cpu.pool_spin_us()
    try:
        monkeypatch.setenv("S2MOE_SPIN_US", "120")
        cpu.CpuOps(threads=2)
        assert _cpu.pool_spin_us() == 120
        for bad in ("-1", "fast", "1.5"):
            monkeypatch.setenv("S2MOE_SPIN_US", bad)
            with pytest.raises(UsageError, match="S2MOE_SPIN_US"):
                cpu.CpuOps(threads=2)
    finally:
        _cpu.pool_spin_us(before)
        _cpu.set_threads(cpu.default_threads())
