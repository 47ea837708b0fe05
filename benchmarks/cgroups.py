"""Run a command inside its own memory cgroup and read what the kernel charged it.

A memory budget is a promise about the whole process, so it is checked the way a user's device
enforces memory: a cgroup (v1 `memory` controller here; v2 `memory.max`/`memory.peak` elsewhere)
that holds only the command. With a limit, the kernel reclaims the group's page cache first and
OOM-kills it if its anonymous memory does not fit.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass

V1 = "/sys/fs/cgroup/memory"
V2 = "/sys/fs/cgroup"


def available() -> str | None:
    """'v1' or 'v2' when this process may create memory cgroups, else None."""
    if os.path.isdir(V1) and os.access(V1, os.W_OK) and os.path.exists(os.path.join(V1, "memory.limit_in_bytes")):
        return "v1"
    if os.path.exists(os.path.join(V2, "cgroup.controllers")) and os.access(V2, os.W_OK):
        with open(os.path.join(V2, "cgroup.controllers")) as f:
            if "memory" in f.read().split():
                return "v2"
    return None


@dataclass
class CgroupResult:
    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int | None  # the group's peak charge (anonymous + page cache)
    oom_killed: bool


def drop_page_cache(path: str) -> None:
    """Evict one file's pages (the benchmark starts every program cold)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_in_cgroup(cmd: list[str], limit_bytes: int | None = None, timeout: float = 600, env=None,
                  cwd=None) -> CgroupResult:
    """Run ``cmd`` alone in a fresh memory cgroup (with ``limit_bytes`` if given, no swap)."""
    kind = available()
    if kind is None:
        raise RuntimeError("memory cgroups are not writable here")
    root = V1 if kind == "v1" else V2
    folder = os.path.join(root, f"s2moe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(folder)

    def write(name: str, value) -> None:
        with open(os.path.join(folder, name), "w") as f:
            f.write(str(value))

    try:
        if limit_bytes is not None:
            if kind == "v1":
                write("memory.limit_in_bytes", limit_bytes)
                try:
                    write("memory.memsw.limit_in_bytes", limit_bytes)  # no swap either, where accounted
                except OSError:
                    pass
            else:
                write("memory.max", limit_bytes)
                write("memory.swap.max", 0)
        procs = os.path.join(folder, "cgroup.procs")

        def join_group() -> None:  # in the child, before exec: everything it runs is charged here
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                              preexec_fn=join_group)
        peak_file = "memory.max_usage_in_bytes" if kind == "v1" else "memory.peak"
        with open(os.path.join(folder, peak_file)) as f:
            peak = int(f.read().strip())
        oom = proc.returncode in (-9, 137)
        events = os.path.join(folder, "memory.oom_control" if kind == "v1" else "memory.events")
        with open(events) as f:
            for line in f:
                key, _, value = line.partition(" ")
                oom = oom or (key == "oom_kill" and int(value) > 0)
        return CgroupResult(proc.returncode, proc.stdout, proc.stderr, peak, oom)
    finally:
        try:
            os.rmdir(folder)
        except OSError:
            pass
