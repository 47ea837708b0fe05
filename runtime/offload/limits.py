"""The memory a process may still take: its memory cgroup's limit (v1 or v2, the tightest level of
its hierarchy) less what that limit already counts, else the machine's MemAvailable.

`--budget` counts the model (dense part, experts, KV, workspace); the interpreter and its libraries
come on top, and what a cgroup charges for them is not the resident set s2moe measures (shared
library pages already in the page cache are not charged; pages this process faulted in are). So a
user who knows only "this device has X" gets `--memory-limit X`, or nothing at all under a cgroup:
the plan then takes the headroom the limit itself reports, less a margin for the few transient
allocations the plan does not name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UsageError
from .memory import _read_int, _status_kib

V1 = "/sys/fs/cgroup/memory"
V2 = "/sys/fs/cgroup"
NO_LIMIT = 1 << 60  # v1 writes "no limit" as a number near 2^63
# what a run takes beyond its plan after planning (lazy imports, the heap's slack, a tensor's read
# buffer beside its copy): the margin, 8 MiB + 4 % of the room (tests/test_memory.py runs the
# embedded and the widened model under caps and checks no run is killed)
MARGIN = 8 << 20


@dataclass(frozen=True)
class Headroom:
    limit: int  # bytes the binding limit allows in all
    in_use: int  # bytes it counts now
    source: str  # where the limit was found, for the one-line report

    @property
    def free(self) -> int:
        return max(0, self.limit - self.in_use)

    def model_budget(self) -> int:
        """Bytes the model may plan for: the headroom less the margin."""
        return max(0, self.free - MARGIN - self.free // 25)


def _cgroup_paths(proc: str = "/proc/self/cgroup") -> tuple[str | None, str | None]:
    """(v1 memory path, v2 unified path) of this process, relative to their roots."""
    v1 = v2 = None
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    return v1, v2


def _levels(root: str, path: str) -> list[str]:
    """The folder of ``path`` under ``root`` and each of its ancestors up to (not including) root."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [os.path.join(root, *parts[:i]) for i in range(len(parts), 0, -1)]


def cgroup_headroom(v1_root: str = V1, v2_root: str = V2, proc: str = "/proc/self/cgroup") -> Headroom | None:
    """The tightest memory-cgroup limit over this process's hierarchy (the level with the least
    room left), or None where no level sets one."""
    v1, v2 = _cgroup_paths(proc)
    found = []
    if v1 is not None:
        for folder in _levels(v1_root, v1):
            limit = _read_int(os.path.join(folder, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(folder, "memory.usage_in_bytes"))
            if limit is not None and limit < NO_LIMIT and usage is not None:
                found.append(Headroom(limit, usage, f"cgroup v1 {folder}"))
    if v2 is not None and not found:
        for folder in _levels(v2_root, v2):
            limit = _read_int(os.path.join(folder, "memory.max"))  # "max": None
            usage = _read_int(os.path.join(folder, "memory.current"))
            if limit is not None and usage is not None:
                found.append(Headroom(limit, usage, f"cgroup v2 {folder}"))
    return min(found, key=lambda h: h.free) if found else None


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def find_headroom(memory_limit: str | None) -> Headroom | None:
    """``memory_limit``: "auto" (the cgroup's limit, else MemAvailable), "none", or bytes for the
    whole process ("4g": less what it holds now)."""
    from .memory import Budget

    text = (memory_limit or "none").strip().lower()
    if text == "none":
        return None
    if text == "auto":
        found = cgroup_headroom()
        if found is not None:
            return found
        available = mem_available()
        rss = _status_kib("VmRSS") or 0
        return None if available is None else Headroom(available + rss, rss, "MemAvailable")
    parsed = Budget.parse(text, "--memory-limit")
    if parsed.total_bytes is None:
        raise UsageError(f"--memory-limit {memory_limit!r}: give bytes with a unit (16g, 512m), or auto or none")
    return Headroom(parsed.total_bytes, _status_kib("VmRSS") or 0, "--memory-limit")
