"""Backs no claim itself: the plumbing every benchmark shares (docs/performance.md names it), so a
record, a memory cap or a round of turns means the same in every script.

- Records (the schema is s2moe.runtime.records: raw per-repetition samples, machine facts, commit):
  ``Record``, ``machine_info``, ``git_commit``, ``write_outputs`` (table on stderr, JSON + CSV), and
  ``write_json`` for a free-form record with the same machine facts and commit (calibration.py,
  interop.py).
- Memory cgroups: ``available``, ``run_in_cgroup``, ``drop_page_cache`` (peer.py,
  tests/test_memory.py).
- Alternating rounds: ``rounds`` (ab.py, gating_price.py, peer.py, prefill_paths.py, quant_types.py).
- Count-only set-up: ``resident_model``, ``prompts_of``, ``unused_costs`` (samplers.py).

A memory budget is a promise about the whole process, so it is checked the way a user's device
enforces memory: a cgroup (v1 `memory` controller here; v2 `memory.max`/`memory.peak` elsewhere)
that holds only the command. With a limit, the kernel reclaims the group's page cache first and
OOM-kills it if its anonymous memory does not fit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Iterable, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from s2moe.runtime.records import Record, git_commit, machine_info, write_outputs  # noqa: E402,F401

# --- records ---------------------------------------------------------------------------------------


def write_json(path: str, payload: dict, indent: int = 2) -> None:
    """A free-form record: ``{"machine": ..., "commit": ..., **payload}``, written whole or not at all."""
    from s2moe.runtime.outputs import write_atomic

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps({"machine": machine_info(), "commit": git_commit(), **payload}, indent=indent))


# --- alternating rounds ----------------------------------------------------------------------------


def rounds(names: Iterable, reps: int, reverse: bool = False) -> Iterator[tuple[int, object]]:
    """(repetition, name): every name once per round, for ``reps`` rounds. This machine drifts by
    tens of percent within seconds, so sides take turns and only ratios within a round mean
    anything; with ``reverse`` every other round runs the names in reverse order, so no side is
    always first."""
    names = list(names)
    for rep in range(reps):
        for name in (names[::-1] if reverse and rep % 2 else names):
            yield rep, name


# --- memory cgroups --------------------------------------------------------------------------------

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


# --- count-only set-up -----------------------------------------------------------------------------


def resident_model(model: str | None):
    """(path, engine, tokenizer) for ``model`` (default: the embedded one), every expert resident."""
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    path = model or str(DEFAULT_MODEL)
    loaded = load_model(path)
    return path, build_engine(path, loaded=loaded), load_tokenizer(loaded)


def prompts_of(tok, workloads, n_prompts: int, tail: int | None = None) -> list[list[int]]:
    """Token ids of the first ``n_prompts`` prompts of each workload (their last ``tail`` tokens)."""
    from s2moe.runtime.bench import resolve_workload
    from s2moe.runtime.prompts import load_workload

    return [tok.encode(p).ids[-tail if tail else 0:] for w in workloads
            for p in load_workload(resolve_workload(w))[:n_prompts]]


def unused_costs():
    """AE's constants, for methods that never read them (`ca` drafts a fixed length)."""
    from s2moe.runtime.decoding.cost_model import CostConstants

    return CostConstants(t_ar=1.0, c_draft=0.1, t_exp_miss=0.0, t_exp_hit=0.0)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"memory cgroups: {available() or 'not writable here'}")
