"""The kernel room: array backends and the linear/expert seam.

Model code calls matmuls through one object (`ops`): ``ops.linear(x, W, bias)``,
``ops.embed(W, ids)`` and ``ops.experts(x, groups, act, out)`` for one layer's routed experts.
W is a `StoredMatrix` (stored encoding) or a float32 array. Behind the seam:
- ``cpu``: the compiled extension (csrc/cpu), computing on stored blocks;
- ``numpy``: the reference (`reference.py`), which the tests compare every kernel with;
- on a CUDA device the same reference code runs on CuPy arrays (`backend.py`), with fused decode
  kernels (csrc/decode.cuh) where they apply (`device.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

KERNELS = ("auto", "cpu", "numpy")


@dataclass(frozen=True)
class ExpertAct:
    """The expert activation: SwiGLU, or GPT-OSS's clamped SwiGLU with its alpha and limit."""

    kind: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, config) -> "ExpertAct":
        if config.expert_act == "swiglu_clamped":
            return cls("swiglu_clamped", float(config.swiglu_alpha), float(config.swiglu_limit))
        return cls()


def select_ops(name: str = "auto", threads: int | None = None, backend=None):
    """``auto``: the compiled CPU kernels when built, else NumPy (the reason says why); device
    backends always use the reference code on device arrays. ``S2MOE_KERNELS`` (numpy or cpu)
    replaces ``auto``: the test suite runs the reference path this way too."""
    import os

    from . import cpu
    from .reference import ReferenceOps

    if name == "auto" and os.environ.get("S2MOE_KERNELS"):
        name = os.environ["S2MOE_KERNELS"]

    if name not in KERNELS:
        raise UsageError(f"--kernels {name!r}: choose from {', '.join(KERNELS)}")
    if backend is not None and backend.on_device:
        from .device import DeviceOps

        return DeviceOps(backend, f"{backend.name} arrays")
    if name == "numpy":
        return ReferenceOps("requested")
    if not cpu.available():
        reason = f"the compiled CPU kernels are missing ({cpu.IMPORT_ERROR}); reinstall with a C compiler"
        if name == "cpu":
            raise UsageError(f"--kernels cpu: {reason}")
        return ReferenceOps(f"auto: {reason}")
    return cpu.CpuOps(threads, "requested" if name == "cpu" else "auto: compiled kernels built")
