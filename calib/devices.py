"""`--device` resolution: auto picks what the probe finds; a named device must be what is here."""

from __future__ import annotations

from s2moe.runtime.device import probe
from s2moe.runtime.errors import UsageError

KINDS = ("auto", "cpu", "cuda", "orin", "rtx4090")


def resolve_device(device: str, model_path: str | None = None) -> tuple[str, dict]:
    if device not in KINDS:
        raise UsageError(f"--device {device!r}: choose from {', '.join(KINDS)}")
    facts = probe(model_path).to_dict()
    gpus = [g["name"] for g in facts["gpus"]]
    found = facts["jetson"] or (gpus[0] if gpus else f"CPU {facts['cpu_model']} without a CUDA GPU")
    kind = device
    if device == "auto":
        kind = "orin" if facts["jetson"] else ("cuda" if gpus else "cpu")
    elif device == "orin" and not facts["jetson"]:
        raise UsageError(f"--device orin: this machine is not a Jetson (found {found}); use --device auto")
    elif device == "rtx4090" and not any("4090" in g for g in gpus):
        raise UsageError(f"--device rtx4090: no RTX 4090 here (found {found}); use --device auto")
    elif device == "cuda" and not gpus:
        raise UsageError(f"--device cuda: no CUDA GPU visible to NVML (found {found}); use --device auto")
    name = facts["jetson"] or (gpus[0] if kind in ("cuda", "rtx4090") else facts["cpu_model"])
    facts["name"] = name
    return kind, facts
