"""Device profiles: the JSON that `s2moe-calib profile` writes and `s2moe run --profile` reads.

The schema lives here (the runtime is the consumer); `profiles/schema.json` is generated from it
(`s2moe-calib schema`) and a test keeps the two equal. Profiles are written atomically (temp file
in the same folder, fsync, rename), so an interrupted run never leaves a half-written profile.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

from .decoding.cost_model import CostConstants
from . import jsonfile
from .errors import S2MoEError
from .schema_check import SchemaViolation, check

SCHEMA_VERSION = 1


class ProfileError(S2MoEError):
    """A profile that cannot be used: unreadable, malformed, wrong version, or not for this model."""


_num = {"type": "number"}
_pos = {"type": "number", "exclusiveMinimum": 0}
_nonneg = {"type": "number", "minimum": 0}
_opt = lambda s: {**s, "type": [s["type"], "null"]}  # noqa: E731

SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "s2moe device profile",
    "type": "object",
    "required": ["schema_version", "source", "device", "model", "budget", "cost_model", "speculative", "provenance"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "source": {"enum": ["measured", "published"]},
        "note": {"type": "string"},
        "device": {
            "type": "object", "required": ["kind", "name", "offload_tier"],
            "properties": {
                "kind": {"enum": ["cpu", "cuda", "orin", "rtx4090"]},
                "name": {"type": "string"},
                "memory_bytes": _opt({"type": "integer", "minimum": 0}),
                "offload_tier": {"enum": ["ssd", "host", "file"]},
                "backend": {"enum": ["numpy", "cupy"]},
                "how_measured": {"type": "string"},
                "emulation": {"type": ["string", "null"]},
                "facts": {"type": "object"},
            },
        },
        "model": {
            "type": "object", "required": ["name", "fingerprint", "layers", "experts", "top_k", "expert_bytes_stored"],
            "properties": {
                "name": {"type": "string"},
                "fingerprint": {"type": "string"},
                "fingerprint_policy": {"enum": ["warn", "refuse"]},
                "architecture": {"type": "string"},
                "layers": {"type": "integer", "minimum": 1},
                "experts": {"type": "integer", "minimum": 1},
                "top_k": {"type": "integer", "minimum": 1},
                "expert_bytes_stored": _pos,
                "expert_bytes_resident": _opt(_pos),
                "expert_bytes_per_layer": {"type": "array", "items": {"type": "object"}},
            },
        },
        "budget": {
            "type": "object", "required": ["spec"],
            "properties": {
                "spec": {"type": "string"},
                "expert_capacity_bytes": _opt({"type": "integer", "minimum": 0}),
                "total_bytes": _opt({"type": "integer", "minimum": 0}),
            },
        },
        "offload": {
            "type": "object", "required": ["bandwidth_mb_s", "latency_us"],
            "properties": {
                "bandwidth_mb_s": _pos, "latency_us": _nonneg, "fit_r2": _opt(_num),
                "bandwidth_is_bound": {"type": "boolean"}, "host_to_device_is_bound": {"type": "boolean"},
                "fetch_threads": {"type": "integer", "minimum": 1}, "request_sizes": {"type": "array"},
                "host_to_device_mb_s": _opt(_pos), "host_to_device_latency_us": _opt(_nonneg),
            },
        },
        "cost_model": {
            "type": "object", "required": ["t_ar_ms", "c_draft_ms", "t_exp_miss_ms", "t_exp_hit_ms"],
            "properties": {
                "t_ar_ms": _pos, "t_ar_p90_ms": _opt(_pos), "c_draft_ms": _pos,
                "t_exp_miss_ms": _nonneg, "t_exp_hit_ms": _nonneg, "t_base_ms": _nonneg, "t_token_ms": _nonneg,
                "fit": {"type": ["object", "null"]},
            },
        },
        "hot_experts": {
            "type": ["object", "null"],
            "properties": {
                "gpu_experts": {"type": "array", "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                                           "items": {"type": "integer", "minimum": 0}}},
            },
        },
        "speculative": {
            "type": "object", "required": ["draft_topk", "draft_cap", "reuse_cap", "utility_threshold"],
            "properties": {
                "draft_topk": {"type": "integer", "minimum": 1}, "draft_cap": {"type": "integer", "minimum": 1},
                "reuse_cap": {"type": "integer", "minimum": 0}, "utility_threshold": _nonneg,
                "draft_vocab": {"type": "integer", "minimum": 0},
                # how `profile` chose draft_topk (calib/draft_k.py): every candidate's figures
                "draft_topk_choice": {"type": "object", "required": ["chosen", "default", "candidates"]},
            },
        },
        "validation": {"type": ["object", "null"]},
        "published": {"type": "object"},
        "provenance": {"type": "object", "required": ["tool_version", "date"]},
    },
}


def schema_json() -> str:
    return json.dumps(SCHEMA, indent=2) + "\n"


@dataclass
class Profile:
    data: dict
    path: str | None = None

    @property
    def costs(self) -> CostConstants:
        c = self.data["cost_model"]
        ms = 1e-3
        return CostConstants(
            t_ar=c["t_ar_ms"] * ms, c_draft=c["c_draft_ms"] * ms, t_exp_miss=c["t_exp_miss_ms"] * ms,
            t_exp_hit=c["t_exp_hit_ms"] * ms, t_base=c.get("t_base_ms", 0.0) * ms,
            t_token=c.get("t_token_ms", 0.0) * ms, source=f"profile {os.path.basename(self.path or '?')}",
        )

    @property
    def hot_experts(self) -> list[tuple[int, int]]:
        hot = self.data.get("hot_experts") or {}
        return [(int(a), int(b)) for a, b in hot.get("gpu_experts", [])]

    @property
    def speculative(self) -> dict:
        return self.data["speculative"]

    @property
    def budget_spec(self) -> str:
        return self.data["budget"]["spec"]


def validate(data, where: str) -> None:
    if isinstance(data, dict) and "schema_version" in data and data["schema_version"] != SCHEMA_VERSION:
        raise ProfileError(f"{where}: schema_version {data['schema_version']!r} is not supported (this tool reads "
                           f"{SCHEMA_VERSION}); re-run s2moe-calib profile")
    try:
        check(data, SCHEMA)
    except SchemaViolation as exc:
        raise ProfileError(f"{where}: field {exc.path or '(top level)'}: {exc.message}; fix it or re-run "
                           "s2moe-calib profile") from None


def load_profile(path: str) -> Profile:
    try:
        with open(path, encoding="utf-8") as f:
            data = jsonfile.load(f)
    except FileNotFoundError:
        raise ProfileError(f"{path}: profile not found; create one with s2moe-calib profile") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc}); re-run s2moe-calib profile") from None
    validate(data, path)
    return Profile(data, path)


def write_json_atomic(path: str, obj) -> None:
    """Temp file in the target folder, fsync, rename: readers see the old file or the new one."""
    from .outputs import write_atomic

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(obj, indent=2) + "\n")  # the umask's mode, like any new file


def _first_non_finite(obj, where: str = "") -> str | None:
    """The path of the first NaN or infinity anywhere in ``obj`` (the schema does not look inside
    every sub-object: a fit's details, a validation verdict, pin margins)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "(top level)"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        found = _first_non_finite(value, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def save_profile(path: str, data: dict) -> None:
    """Checked, then written whole: never a profile its own loader refuses, nor one holding a NaN
    (which JSON cannot hold; Python would write a bare NaN token)."""
    validate(data, path)
    bad = _first_non_finite(data)
    if bad:
        raise ProfileError(f"{path}: field {bad} is not a finite number; nothing was written (the measurement "
                           "behind it is degenerate: re-run s2moe-calib profile)")
    write_json_atomic(path, data)


def model_fingerprint(loaded) -> str:
    """Identity of a model: config, tensor table, file sizes and sampled bytes of every file.

    Sampling (the first MiB and 64 KiB every 64 MiB) keeps this fast on multi-GB files while any
    re-quantisation, truncation or config change alters it.
    """
    h = hashlib.sha256()
    h.update(json.dumps(loaded.config.to_dict(), sort_keys=True, default=str).encode())
    files = sorted({r.path for e in loaded.experts.values() for r in e.refs})
    for e in sorted(loaded.experts):
        for r in loaded.experts[e].refs:
            h.update(f"{r.name}:{r.dtype}:{r.shape}:{r.nbytes}".encode())
    for path in files:
        size = os.path.getsize(path)
        h.update(str(size).encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            for off in range(64 << 20, size, 64 << 20):
                f.seek(off)
                h.update(f.read(64 << 10))
    return "sha256:" + h.hexdigest()[:32]
