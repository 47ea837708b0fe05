"""Memory budgets: ``--budget 16g | 512m | 0.25 | 123456789``.

Dense weights, the KV cache and work buffers are counted first; what remains holds experts. A share
(0 < x ≤ 1) means that share of the model's expert bytes in compute format, on top of the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    def parse(cls, text: str | None) -> "Budget":
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


@dataclass(frozen=True)
class MemoryPlan:
    dense_bytes: int
    kv_bytes: int
    work_bytes: int
    expert_capacity: int  # bytes the expert cache may hold
    expert_total: int  # all experts, compute format

    @property
    def total(self) -> int:
        return self.dense_bytes + self.kv_bytes + self.work_bytes + self.expert_capacity

    @property
    def expert_share(self) -> float:
        return self.expert_capacity / self.expert_total if self.expert_total else 1.0

    def to_dict(self) -> dict:
        return {"dense_bytes": self.dense_bytes, "kv_bytes": self.kv_bytes, "work_bytes": self.work_bytes,
                "expert_capacity_bytes": self.expert_capacity, "expert_total_bytes": self.expert_total,
                "expert_share": round(self.expert_share, 4), "total_bytes": self.total}


def plan_memory(model: LoadedModel, budget: Budget, kv_positions: int) -> MemoryPlan:
    c = model.config
    dense = model.dense_bytes
    kv = c.kv_floats_per_position * kv_positions * 4
    largest = max(e.resident_bytes for e in model.experts.values())
    # Staging for one token's experts of one layer: what streams through when the cache is full.
    work = c.top_k * largest
    total_experts = model.expert_resident_bytes
    if budget.share is not None:
        return MemoryPlan(dense, kv, work, int(budget.share * total_experts), total_experts)
    capacity = budget.total_bytes - dense - kv - work
    if capacity < 0:
        minimum = dense + kv + work
        raise UsageError(
            f"--budget {fmt_bytes(budget.total_bytes)} is below the dense part: dense weights {fmt_bytes(dense)} + "
            f"KV cache {fmt_bytes(kv)} + work buffers {fmt_bytes(work)} need at least {fmt_bytes(minimum)} ({minimum} bytes)"
        )
    return MemoryPlan(dense, kv, work, min(capacity, total_experts), total_experts)
