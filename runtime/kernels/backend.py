"""Array backends: NumPy on the CPU, CuPy on a CUDA device.

Model code is written once against the NumPy API and asks `xp_of(array)` which module owns an
array, so the same functions run on host or device arrays. What stays on the host, on purpose:
token ids, positions, RoPE tables and attention masks (small, built per pass, then copied up),
and routing. A pass has exactly these device → host reads (the synchronisations):

- per MoE layer, the router logits [T, E]: the host chooses the experts (the fast tier must know
  which experts to fetch before computing them, and the reuse-aware gating code stays one NumPy
  implementation for both backends); experts and mixture weights go back up asynchronously;
- at the end, the logits [T or 1, V] for sampling and acceptance.

Expert weights reach the device through `Backend.upload_expert`: decoded weights are staged in
pinned host memory (orin mode: file → pinned → device; in rtx4090 mode, `HostTier`, they already
live there) and copied on a separate stream with one event per expert; `wait` makes the compute
stream wait for that event only, so the next expert's copy overlaps the current expert's compute
(the cache fetches a layer's misses together). Weights stay in their stored encoding on the device
too (`kernels/stored.py` `DeviceStored`): a product decodes a few MiB of rows at a time on the
device (the block decoders are written on the array namespace) and multiplies with cuBLAS.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np

from ..errors import UsageError

BACKENDS = ("auto", "numpy", "cupy")

# (array type, module) of device backends in use; checked before NumPy so that a device array
# type deriving from np.ndarray (the test double) is still routed to its module.
_DEVICE_TYPES: list[tuple[type, Any]] = []


def xp_of(*arrays) -> Any:
    """The array module owning the first device array among ``arrays``, else NumPy."""
    for a in arrays:
        for kind, module in _DEVICE_TYPES:
            if isinstance(a, kind):
                return module
    return np


def _register(kind: type, module) -> None:
    if (kind, module) not in _DEVICE_TYPES:
        _DEVICE_TYPES.append((kind, module))


@dataclass
class Backend:
    name: str  # "numpy" | "cupy"
    xp: Any
    reason: str  # why this backend (for the run summary)
    host_reads: int = 0  # device → host copies so far (the synchronisations)
    empty_pinned: Any = field(default=None, repr=False)  # page-locked host allocator (cupyx.empty_pinned)
    _copy_stream: Any = field(default=None, repr=False)
    _in_flight: list = field(default_factory=list, repr=False)  # (event, staging buffers) until copied

    @property
    def on_device(self) -> bool:
        return self.xp is not np

    def to_device(self, a):
        """Host array → this backend (no copy on NumPy). A stored matrix goes up as its bytes
        (`DeviceStored`): the device holds weights at their stored size too."""
        if not self.on_device or a is None:
            return a
        if _stored(a):
            from .stored import DeviceStored

            return DeviceStored(self.xp.asarray(a.data), a.dtype, a.shape, self.xp)
        return self.xp.asarray(a)

    def to_host(self, a) -> np.ndarray:
        """Device array → NumPy; on a device this waits for the producing work (a sync)."""
        if not self.on_device:
            return a
        self.host_reads += 1
        return self.xp.asnumpy(a)

    @contextmanager
    def timed(self) -> Iterator[list]:
        """``with backend.timed() as t: …`` leaves the block's seconds in ``t[0]``: CUDA events on
        the compute stream on a device (its work is asynchronous), ``perf_counter`` on the host."""
        box = [0.0]
        if not self.on_device:
            t0 = time.perf_counter()
            yield box
            box[0] = time.perf_counter() - t0
            return
        cuda = self.xp.cuda
        start, end = cuda.Event(), cuda.Event()
        start.record()
        yield box
        end.record()
        end.synchronize()
        box[0] = cuda.get_elapsed_time(start, end) / 1e3  # ms → s

    def synchronize(self) -> None:
        """Wait for the compute stream (timing only; decoding never needs it)."""
        if self.on_device:
            self.xp.cuda.get_current_stream().synchronize()

    def pin(self, a: np.ndarray) -> np.ndarray:
        """A C-ordered copy of ``a`` in page-locked host memory (asynchronous copies need it)."""
        buf = self.empty_pinned(a.shape, a.dtype) if self.empty_pinned else np.empty(a.shape, a.dtype)
        buf[...] = a
        return buf

    def pin_expert(self, w):
        """`ExpertWeights` with every part in pinned host memory (`HostTier`; copies skip staging);
        stored matrices keep their encoding (their bytes are pinned)."""
        from .stored import StoredMatrix

        parts = {}
        for name, a in _parts(w).items():
            if a is None:
                parts[name] = None
            elif _stored(a):
                parts[name] = StoredMatrix(self.pin(a.data), a.dtype, a.shape)
            else:
                parts[name] = self.pin(a)
        return replace(w, **parts, pinned=True, alloc_bytes=None)

    def upload_expert(self, w):
        """Host `ExpertWeights` → device, copied on the copy stream; the result carries the event
        its consumer must wait for (`wait`). Identity on NumPy."""
        if not self.on_device or w is None:
            return w
        xp = self.xp
        if self._copy_stream is None:
            self._copy_stream = xp.cuda.Stream(non_blocking=True)
        self._in_flight = [(e, bufs) for e, bufs in self._in_flight if not e.done]  # staging buffers free again
        staged, parts = [], {}
        for name, a in _parts(w).items():
            if a is None:
                parts[name] = None
                continue
            host = a.data if _stored(a) else a  # a stored matrix travels as its bytes
            src = host if getattr(w, "pinned", False) else self.pin(host)  # rtx4090 mode: already pinned
            staged.append(src)
            dev = xp.empty(host.shape, host.dtype)
            dev.set(src, stream=self._copy_stream)
            if _stored(a):
                from .stored import DeviceStored

                dev = DeviceStored(dev, a.dtype, a.shape, xp)
            parts[name] = dev
        event = self._copy_stream.record()
        self._in_flight.append((event, staged))
        return replace(w, **parts, ready=event, pinned=False, alloc_bytes=None)

    def wait(self, w) -> None:
        """Make the compute stream wait until ``w``'s copy has landed (no host sync)."""
        event = getattr(w, "ready", None)
        if event is not None and self.on_device:
            self.xp.cuda.get_current_stream().wait_event(event)


def _stored(a) -> bool:
    from .stored import StoredMatrix

    return isinstance(a, StoredMatrix)


def _parts(w) -> dict:
    return {"gate": w.gate, "up": w.up, "down": w.down, "gate_bias": w.gate_bias, "up_bias": w.up_bias,
            "down_bias": w.down_bias}


NUMPY = Backend("numpy", np, "requested")


def cuda_unusable_reason() -> str | None:
    """None when CuPy and a CUDA device are usable, else why not (one line)."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 's2moe[cuda]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # CUDARuntimeError when there is no driver
        return f"no usable CUDA device ({exc.__class__.__name__})"
    return None


def select_backend(name: str = "auto", module=None) -> Backend:
    """``auto``: CuPy when a CUDA device is usable, else NumPy (the reason says which and why).
    ``module`` substitutes the CuPy module (tests run the device code paths on a CPU double)."""
    if name not in BACKENDS:
        raise UsageError(f"--backend {name!r}: choose from {', '.join(BACKENDS)}")
    if name == "numpy":
        return Backend("numpy", np, "requested")
    if module is None:
        reason = cuda_unusable_reason()
        if reason is not None:
            if name == "cupy":
                raise UsageError(f"--backend cupy: {reason}; use --backend numpy or auto")
            return Backend("numpy", np, f"auto: {reason}")
        import cupy as module
        import cupyx

        empty_pinned = cupyx.empty_pinned
    else:
        empty_pinned = getattr(module, "empty_pinned", None)
    _register(module.ndarray, module)
    return Backend("cupy", module, "requested" if name == "cupy" else "auto: CUDA device found",
                   empty_pinned=empty_pinned)
