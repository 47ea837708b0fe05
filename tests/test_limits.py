"""offload/limits.py: the memory a process may still take, found in fake cgroup trees (v1 and v2,
the tightest level of the hierarchy), /proc/meminfo, or --memory-limit; and what a run does with it."""

from __future__ import annotations

import pytest

from s2moe.runtime.errors import UsageError
from s2moe.runtime.offload import limits


def _files(root, folder: str, **values) -> None:
    d = root / folder.strip("/")
    d.mkdir(parents=True, exist_ok=True)
    for name, value in values.items():
        (d / name.replace("_", ".", 1)).write_text(f"{value}\n")


def test_v1_takes_the_level_with_the_least_room(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpu,cpuacct:/job\n7:memory:/runner/job\n0::/\n")
    v1 = tmp_path / "v1"
    _files(v1, "runner", memory_limit_in_bytes=1000 << 20, memory_usage_in_bytes=900 << 20)  # 100 MiB left
    _files(v1, "runner/job", memory_limit_in_bytes=500 << 20, memory_usage_in_bytes=100 << 20)  # 400 left
    room = limits.cgroup_headroom(str(v1), str(tmp_path / "v2"), str(proc))
    assert (room.limit, room.in_use, room.free) == (1000 << 20, 900 << 20, 100 << 20)
    assert room.source.endswith("/runner") and room.model_budget() == (100 << 20) - limits.MARGIN - (4 << 20)


def test_v1_without_a_limit_and_v2_max_mean_none(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("7:memory:/job\n")
    v1 = tmp_path / "v1"
    _files(v1, "job", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=1 << 30)
    assert limits.cgroup_headroom(str(v1), str(tmp_path / "v2"), str(proc)) is None
    proc.write_text("0::/a/b\n")
    v2 = tmp_path / "v2"
    _files(v2, "a", memory_max="max", memory_current=5 << 30)
    _files(v2, "a/b", memory_max=2 << 30, memory_current=1 << 30)
    room = limits.cgroup_headroom(str(v1), str(v2), str(proc))
    assert (room.limit, room.in_use) == (2 << 30, 1 << 30) and room.source.startswith("cgroup v2")
    _files(v2, "a/b", memory_max="max", memory_current=1 << 30)
    assert limits.cgroup_headroom(str(v1), str(v2), str(proc)) is None


def test_meminfo_and_explicit_limits(tmp_path, monkeypatch):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000000 kB\n")
    assert limits.mem_available(str(info)) == 1000000 * 1024
    assert limits.mem_available(str(tmp_path / "missing")) is None
    room = limits.find_headroom("2g")
    assert room.limit == 2 << 30 and room.source == "--memory-limit" and 0 < room.in_use < 2 << 30
    assert limits.find_headroom("none") is None
    with pytest.raises(UsageError, match="--memory-limit"):
        limits.find_headroom("0.5")  # a share means nothing for a whole process
    with pytest.raises(UsageError, match="--memory-limit"):
        limits.find_headroom("lots")
    monkeypatch.setattr(limits, "cgroup_headroom", lambda: None)
    monkeypatch.setattr(limits, "mem_available", lambda: 3 << 30)
    assert limits.find_headroom("auto").source == "MemAvailable"


def test_a_run_plans_to_an_explicit_limit_and_refuses_one_with_a_budget():
    from helpers import s2moe

    from s2moe.runtime.offload.memory import interpreter_baseline

    assert s2moe("run", "--prompt", "hi", "-n", "2", "--memory-limit", "none")[0] == 0  # imports, first load
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier tests freed leaves RSS before it is measured
    held = interpreter_baseline() >> 20  # (in-process: the test runner's own memory counts too)
    code, out, err = s2moe("run", "--prompt", "hi", "-n", "2", "--method", "ar", "--json", "--memory-limit",
                           f"{held + 40}m")
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: memory limit")]
    assert len(notes) == 1 and "--memory-limit" in notes[0], err
    code, _, err = s2moe("run", "--prompt", "hi", "-n", "2", "--memory-limit", "1g", "--budget", "0.5")
    assert code == 2 and "give one of them" in err and err.count("\n") == 1
    code, _, err = s2moe("run", "--prompt", "hi", "-n", "2", "--memory-limit", f"{held + 4}m")
    assert code == 2 and "raise the limit by" in err and err.count("\n") == 1
