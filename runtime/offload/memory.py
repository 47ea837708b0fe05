"""The memory plan: what a run will hold, computed before anything is loaded, and the budget it
promises to keep.

``--budget`` bounds the model's memory: dense weights (as stored) + resident experts + KV cache +
workspace (activations, kernel scratch, experts streaming through). ``--expert-budget`` sets only
the experts. Both take bytes with a unit (16g, 512m), a share (0.25) or a percent (25%); a share
means that share of the experts' stored bytes, on top of the rest (less a draft head's copied
rows, which not every method holds). The interpreter and its libraries (the baseline, measured)
come on top of the budget; the plan's ``total_bytes`` is what the process should peak at, and runs
report the measured peak beside it (VmHWM, and the memory cgroup's peak where the process runs in
one: every process in that cgroup counts there).
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass, field

from ..errors import UsageError
from ..model.loader import LoadedModel

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


@dataclass(frozen=True)
class Budget:
    share: float | None = None  # of the expert bytes
    total_bytes: int | None = None

    @classmethod
    def parse(cls, text: str | None, flag: str = "--budget") -> "Budget":
        try:
            return cls._parse(text)
        except UsageError as exc:
            raise UsageError(str(exc).replace("--budget", flag, 1)) from None

    @classmethod
    def _parse(cls, text: str | None) -> "Budget":
        if text is None or str(text).strip().lower() in ("", "full", "1", "1.0", "100%"):
            return cls(share=1.0)
        s = str(text).strip().lower()
        if s.endswith("%"):
            try:
                return cls._share(float(s[:-1]) / 100, text)
            except ValueError:
                pass
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", s)
        if not m or m.group(2) not in _UNITS:
            raise UsageError(f"--budget {text!r}: use bytes with a unit (16g, 512m), a share (0.25) or a percent (25%)")
        value, unit = float(m.group(1)), m.group(2)
        if unit == "" and value <= 1:
            return cls._share(value, text)
        if unit == "" and not value.is_integer():
            raise UsageError(f"--budget {text!r}: a share must be in (0, 1]; bytes must be a whole number")
        return cls(total_bytes=int(value * _UNITS[unit]))

    @classmethod
    def _share(cls, x: float, text) -> "Budget":
        if not 0 < x <= 1:
            raise UsageError(f"--budget {text!r}: a share must be in (0, 1]")
        return cls(share=x)

    def describe(self) -> str:
        return f"{self.share:.0%} of expert bytes" if self.share is not None else fmt_bytes(self.total_bytes)

    @property
    def full(self) -> bool:
        return self.share is not None and self.share >= 1.0


@dataclass(frozen=True)
class Workspace:
    """Transient bytes of a pass at its largest (``batch`` tokens against ``positions`` slots)."""

    activations: int  # residual stream, norms, q/k/v, attention output, MoE output
    attention: int  # scores, their exponentials and probabilities, masks
    logits: int  # the head's output, its host copy, sampling in float64
    experts: int  # kernel scratch (gate/up/down outputs) for the batch's token-expert pairs
    streaming: int  # experts read but not kept: reads in flight, the group in compute, and on a
    # device backend prefetches waiting on the host for their upload. On the host a prefetch reads
    # into the room it takes in the cache, or, with none, into this workspace while no pass streams
    # (offload/cache.py)
    reference: int  # the NumPy path's decoded-rows scratch (0 on the compiled kernels)

    @property
    def total(self) -> int:
        return self.activations + self.attention + self.logits + self.experts + self.streaming + self.reference


def workspace(model: LoadedModel, batch: int, positions: int, window: int, largest_expert: int,
              reference: bool, staged: int = 0, cache_type: str = "f32") -> Workspace:
    c = model.config
    heads, kd, vd = c.kv_shape
    # a cache in f16/q8_0 read on the NumPy path (and MLA's): one layer's keys and values decoded
    decoded = 2 * heads * positions * max(kd, vd) * 4 if cache_type != "f32" and (reference or c.attention == "mla") \
        else 0
    T, H, V = batch, c.hidden_size, c.vocab_size
    width = max(H, c.num_heads * c.head_dim, c.kv_floats_per_position // max(c.num_layers, 1))
    windows = 2 if c.sliding_window else 1
    I = c.expert_intermediate_size
    return Workspace(
        activations=16 * T * width * 4,
        attention=3 * c.num_heads * T * positions * 4 + windows * T * positions + decoded,
        logits=2 * T * V * 4 + 2 * V * 8,
        experts=T * c.top_k * (2 * I + H) * 4 * 2 + 2 * T * c.top_k * H * 4,  # + per-choice inputs and outputs
        streaming=(2 * window + staged) * largest_expert,
        reference=(4 << 20) + T * max(V, I, H) * 4 if reference else 0,
    )


@dataclass(frozen=True)
class MemoryPlan:
    dense_bytes: int  # dense part as resident: stored encodings, float32 copies of small tensors
    kv_bytes: int
    work_bytes: int
    expert_capacity: int  # bytes the expert cache may hold
    expert_total: int  # all experts as resident
    expert_stored: int = 0  # all experts as stored in the file
    baseline_bytes: int = 0  # interpreter, libraries, tokenizer: measured before loading
    work: Workspace | None = field(default=None, compare=False)
    limit: dict | None = field(default=None, compare=False)  # the process limit planned to (limits.py)

    @property
    def model_bytes(self) -> int:
        """What --budget bounds."""
        return self.dense_bytes + self.kv_bytes + self.work_bytes + self.expert_capacity

    @property
    def total(self) -> int:
        """What the process should peak at: the baseline plus the model's memory."""
        return self.baseline_bytes + self.model_bytes

    @property
    def expert_share(self) -> float:
        return self.expert_capacity / self.expert_total if self.expert_total else 1.0

    def to_dict(self) -> dict:
        out = {"dense_bytes": self.dense_bytes, "kv_bytes": self.kv_bytes, "work_bytes": self.work_bytes,
               "expert_capacity_bytes": self.expert_capacity, "expert_total_bytes": self.expert_total,
               "expert_stored_bytes": self.expert_stored, "expert_share": round(self.expert_share, 4),
               "model_bytes": self.model_bytes, "baseline_bytes": self.baseline_bytes, "total_bytes": self.total}
        if self.work is not None:
            out["workspace"] = {k: getattr(self.work, k) for k in
                                ("activations", "attention", "logits", "experts", "streaming", "reference")}
        if self.limit is not None:
            out["limit"] = self.limit
        return out


def plan_memory(model: LoadedModel, budget: Budget, kv_positions: int, expert_budget: Budget | None = None,
                batch: int | None = None, window: int = 4, reference_kernels: bool = False,
                expert_bytes=None, baseline: int | None = None, direct: bool = True, staged_prefetches: int = 0,
                draft_head: int = 0, cache_type: str = "f32") -> MemoryPlan:
    """The plan for ``budget`` (and ``expert_budget``). ``expert_bytes(refs)`` is one expert's
    resident cost where it differs from the host's (a device: stored bytes, no page rounding); ``batch`` is
    the most tokens one pass runs (prompt chunks, verification batches); ``draft_head`` the bytes of
    a FR-Spec draft head's copied rows, held beside the dense part; ``staged_prefetches`` the
    prefetches a device backend holds in host buffers until verification uploads them;
    ``cache_type`` the KV cache's (f32, f16, q8_0: model/kv_cache.py)."""
    from ..model.forward import PREFILL_CHUNK
    from ..model.kv_cache import kv_bytes_per_position

    c = model.config
    cost = expert_bytes or (lambda refs: refs.resident_bytes_for(direct))
    sizes = [cost(refs) for refs in model.experts.values()]
    total_experts, largest = sum(sizes), max(sizes)
    stored = model.expert_stored_bytes
    dense = model.dense_bytes + draft_head
    kv = kv_bytes_per_position(c, cache_type) * kv_positions
    work = workspace(model, max(batch or PREFILL_CHUNK, 1), kv_positions, window, largest, reference_kernels,
                     staged_prefetches, cache_type)
    rest = dense + kv + work.total
    baseline = interpreter_baseline() if baseline is None else baseline

    def share_of_experts(b: Budget) -> int:
        # that share of the experts, each at its resident cost: its stored bytes (plus at most 8 KiB
        # of page rounding under O_DIRECT; exactly its stored bytes on a device)
        return min(total_experts, int(b.share * total_experts))

    if expert_budget is not None:
        capacity = share_of_experts(expert_budget) if expert_budget.share is not None else \
            min(expert_budget.total_bytes, total_experts)
        if budget.total_bytes is not None and rest + capacity > budget.total_bytes:
            raise UsageError(f"--expert-budget {fmt_bytes(capacity)} does not fit --budget "
                             f"{fmt_bytes(budget.total_bytes)}: the rest of the model needs {fmt_bytes(rest)}; "
                             f"use --budget {fmt_bytes(rest + capacity)} or a smaller --expert-budget")
    elif budget.share is not None:
        # a draft head's rows come out of the experts' share, as prefetches take their room in the
        # cache, so every method runs in the same memory. On top of it, the embedded model's 1 MiB
        # head at 25 % looked a gain on two of three workloads; out of the share it cost 9-15 % on
        # all three (docs/performance/s2moe-draft.md)
        capacity = max(0, share_of_experts(budget) - draft_head)
    else:
        capacity = budget.total_bytes - rest
        if capacity < 0:
            raise UsageError(
                f"--budget {fmt_bytes(budget.total_bytes)} is below the dense part: dense weights {fmt_bytes(dense)} + "
                f"KV cache {fmt_bytes(kv)} + workspace {fmt_bytes(work.total)} need at least {fmt_bytes(rest)} "
                f"({rest} bytes); use --budget {-(-rest // (1 << 20))}m or more")
        capacity = min(capacity, total_experts)
    return MemoryPlan(dense, kv, work.total, capacity, total_experts, stored, baseline, work)


# -- measuring what the process holds -------------------------------------------------------------

def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def interpreter_baseline() -> int:
    """Resident bytes of this process now (before the model is loaded): Python, NumPy, the
    tokenizer, the kernels. 0 where /proc is missing."""
    return _status_kib("VmRSS") or 0


def memory_cgroup() -> str | None:
    """This process's memory cgroup folder (v1 `memory` controller, or v2 unified), if readable."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = "/sys/fs/cgroup/memory" + path
            if os.path.exists(os.path.join(folder, "memory.max_usage_in_bytes")):
                return folder
    for line in lines:
        if line.startswith("0::"):
            folder = "/sys/fs/cgroup" + line[3:]
            if os.path.exists(os.path.join(folder, "memory.peak")):
                return folder
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def measured_peak() -> dict:
    """Peak resident bytes so far (VmHWM), and the memory cgroup's peak and limit where this process
    is in a cgroup that reports them (the root cgroup's peak is the whole machine's: left out)."""
    out = {"vmhwm_bytes": _status_kib("VmHWM"), "cgroup": None, "cgroup_peak_bytes": None,
           "cgroup_limit_bytes": None}
    folder = memory_cgroup()
    if folder and folder.rstrip("/") not in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup"):
        v1 = os.path.exists(os.path.join(folder, "memory.max_usage_in_bytes"))
        out["cgroup"] = folder
        out["cgroup_peak_bytes"] = _read_int(os.path.join(folder, "memory.max_usage_in_bytes" if v1 else "memory.peak"))
        limit = _read_int(os.path.join(folder, "memory.limit_in_bytes" if v1 else "memory.max"))
        out["cgroup_limit_bytes"] = limit if limit is None or limit < 1 << 60 else None
    return out


def release_freed_memory_promptly() -> None:
    """glibc keeps freed blocks below a moving threshold in its heap, where RSS does not shrink:
    fix the mmap threshold at 128 KiB so freed expert buffers and large temporaries go back to the
    system at once, and the resident set tracks the plan. No-op on other C libraries."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD (also stops glibc raising it dynamically)
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD: return heap tops above 1 MiB
    except (OSError, AttributeError):
        pass
