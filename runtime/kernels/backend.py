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
pinned host memory, in the layout they have (a C-ordered buffer for a Fortran-ordered matrix would
make CuPy transpose it through pageable memory), and copied on a separate stream with one event per
expert (file tier: file → pinned → device, an expert's parts staged together and copied at once;
host tier, `HostTier`: they already live pinned, a copy per part);
`wait` makes the compute stream wait for that event only, so the next expert's copy overlaps the
current expert's compute (the cache fetches a layer's misses together). Staging buffers and the
device arrays stay referenced until their event has completed: neither CuPy's pinned pool nor its
per-stream device pool may hand them out while the copy stream still uses them. On an integrated
GPU (Jetson Orin: the device property ``integrated``; host and device share DRAM) nothing is staged
or pinned: pinning would only hold each expert twice in the same memory. Weights stay in their stored encoding on the device
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
    integrated: bool = False  # the device shares the host's memory (Jetson Orin): no pinned staging
    empty_pinned: Any = field(default=None, repr=False)  # page-locked host allocator (cupyx.empty_pinned)
    _copy_stream: Any = field(default=None, repr=False)
    _in_flight: list = field(default_factory=list, repr=False)  # (event, buffers it uses) until copied

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

    def to_device_together(self, parts: list) -> list:
        """Host arrays (nested in lists and dicts) → device views of one buffer: one copy for a
        pass's token ids, RoPE tables and masks instead of one each. Parts start 256-byte aligned."""
        flat: list[np.ndarray] = []

        def collect(p):
            if isinstance(p, (dict, list)):
                items = p.items() if isinstance(p, dict) else enumerate(p)
                out = {k: collect(v) for k, v in items}
                return out if isinstance(p, dict) else list(out.values())
            flat.append(np.ascontiguousarray(p))
            return len(flat) - 1

        layout = collect(parts)
        offsets, at = [], 0
        for a in flat:
            offsets.append(at)
            at += -(-a.nbytes // 256) * 256
        buf = np.zeros(max(at, 1), dtype=np.uint8)
        for a, o in zip(flat, offsets):
            buf[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
        up = self.to_device(buf)
        views = [up[o:o + a.nbytes].view(a.dtype).reshape(a.shape) for a, o in zip(flat, offsets)]

        def build(p):
            if isinstance(p, dict):
                return {k: build(v) for k, v in p.items()}
            return [build(v) for v in p] if isinstance(p, list) else views[p]

        return build(layout)

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
        """A copy of ``a`` in page-locked host memory (asynchronous copies need it), in ``a``'s
        layout (Fortran-ordered stays Fortran-ordered: the copy to the device is then a memcpy)."""
        order = _order(a)
        if self.empty_pinned:
            buf = self.empty_pinned(a.shape, a.dtype, order=order)
        else:
            buf = np.empty(a.shape, a.dtype, order=order)
        buf[...] = a
        return buf

    def pin_expert(self, w):
        """`ExpertWeights` with every part in pinned host memory (`HostTier`; copies skip staging);
        stored matrices keep their encoding (their bytes are pinned). On an integrated GPU the
        weights stay as they are: the device reads the same DRAM, pinning would add a copy."""
        from .stored import StoredMatrix

        if self.integrated:
            return w
        parts = {}
        for name, a in _parts(w).items():
            if a is None:
                parts[name] = None
            elif _stored(a):
                parts[name] = StoredMatrix(self.pin(a.data), a.dtype, a.shape)
            else:
                parts[name] = self.pin(a)
        return replace(w, **parts, pinned=True, alloc_bytes=None, kernel_args=None)  # (no hold on the old parts)

    def limit_memory(self, nbytes: int | None) -> None:
        """Cap CuPy's memory pool at ``nbytes`` (the budget), so the budget binds on the device
        and is not bookkeeping only; None lifts the cap."""
        if self.on_device:
            self.xp.get_default_memory_pool().set_limit(size=int(nbytes or 0))

    def upload_expert(self, w):
        """Host `ExpertWeights` → device, copied on the copy stream; the result carries the event
        its consumer must wait for (`wait`). Identity on NumPy and for weights already uploaded."""
        if not self.on_device or w is None or getattr(w, "ready", None) is not None or _on_device(w):
            return w
        xp = self.xp
        if self._copy_stream is None:
            self._copy_stream = xp.cuda.Stream(non_blocking=True)
        self._in_flight = [(e, held) for e, held in self._in_flight if not e.done]  # copied: free to go
        held, parts = [], {}
        hosts = {name: (a.data if _stored(a) else a) for name, a in _parts(w).items() if a is not None}  # bytes
        if self.integrated or getattr(w, "pinned", False):
            # shared memory: nothing to stage / host tier: already pinned; a copy per part
            devs = {}
            for name, host in hosts.items():
                dev = xp.empty(host.shape, host.dtype, order=_order(host))  # the source's layout: a memcpy
                dev.set(host, stream=self._copy_stream)
                held += [host, dev]  # both in use by the copy stream until its event
                devs[name] = dev
        else:  # staged: every part into one pinned buffer, one copy (one launch, not three)
            src, dev, devs = self._staged(hosts)
            held += [src, dev]
        for name, a in _parts(w).items():
            parts[name] = None if a is None else devs[name]
            if _stored(a):
                from .stored import DeviceStored

                parts[name] = DeviceStored(devs[name], a.dtype, a.shape, xp)
        event = self._copy_stream.record()
        self._in_flight.append((event, held))
        return replace(w, **parts, ready=event, pinned=False, alloc_bytes=None, kernel_args=None)

    def _staged(self, hosts: dict):
        """(pinned buffer, device buffer, {name: device view}) holding every array of ``hosts``,
        each at a 256-byte aligned offset in its own layout; the copy is issued on the copy stream."""
        offsets, total = {}, 0
        for name, host in hosts.items():
            offsets[name] = total
            total += -(-host.nbytes // 256) * 256
        total = max(total, 1)
        src = self.empty_pinned((total,), np.uint8) if self.empty_pinned else np.empty(total, np.uint8)
        for name, host in hosts.items():
            src[offsets[name]:offsets[name] + host.nbytes] = host.ravel(order="K").view(np.uint8)
        dev = self.xp.empty((total,), np.uint8)
        dev.set(src, stream=self._copy_stream)
        views = {name: dev[offsets[name]:offsets[name] + host.nbytes].view(host.dtype)
                 .reshape(host.shape, order=_order(host)) for name, host in hosts.items()}
        return src, dev, views

    def land(self, ws) -> None:
        """Wait on the host until the copies of ``ws`` have landed (one sync on the last event:
        the copy stream runs in order). Fetches are timed to completion with this."""
        events = [w.ready for w in ws if getattr(w, "ready", None) is not None]
        if events and self.on_device:
            events[-1].synchronize()

    def wait(self, w) -> None:
        """Make the compute stream wait until ``w``'s copy has landed (no host sync)."""
        event = getattr(w, "ready", None)
        if event is not None and self.on_device:
            self.xp.cuda.get_current_stream().wait_event(event)


def _order(a) -> str:
    """"F" for an array that is Fortran- but not C-contiguous, else "C"."""
    return "F" if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous else "C"


def _on_device(w) -> bool:
    from .stored import DeviceStored

    return isinstance(w.gate, DeviceStored) or xp_of(w.gate) is not np


def _stored(a) -> bool:
    from .stored import StoredMatrix

    return isinstance(a, StoredMatrix)


def _parts(w) -> dict:
    return {"gate": w.gate, "up": w.up, "down": w.down, "gate_bias": w.gate_bias, "up_bias": w.up_bias,
            "down_bias": w.down_bias}


NUMPY = Backend("numpy", np, "requested")


def cuda_unusable_reason(module=None) -> str | None:
    """None when CuPy and a CUDA device are usable, else why not (one line). Usable means more than
    a device being visible: a tiny matmul (cuBLAS) and a tiny RawKernel (NVRTC) must run, since a
    cupy-cuda12x wheel without its CUDA libraries sees the device and fails at the first product
    (DynamicLibNotFoundError). ``module`` substitutes the CuPy module (tests)."""
    if module is None:
        try:
            import cupy as module
        except ImportError:
            return "CuPy is not installed (pip install 's2moe[cuda]')"
        except Exception as exc:  # a broken install
            return f"CuPy does not import ({_one_line(exc)})"
    try:
        if module.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # CUDARuntimeError when there is no driver
        return f"no usable CUDA device ({exc.__class__.__name__})"
    step = "a matmul (cuBLAS)"
    try:
        a = module.asarray(np.eye(2, dtype=np.float32))
        got = module.asnumpy(a @ a)
        step = "a RawKernel (NVRTC)"
        kernel = module.RawKernel(_PROBE, "s2_probe")
        x = module.asarray(np.zeros(32, dtype=np.float32))
        kernel((1,), (32,), (x,))
        if not (np.array_equal(got, np.eye(2)) and np.array_equal(module.asnumpy(x), np.ones(32))):
            return f"CuPy's CUDA device computes wrong results ({step} check)"
    except Exception as exc:
        return (f"CuPy cannot run {step} on the CUDA device ({_one_line(exc)}); its CUDA libraries are "
                "missing: pip install 's2moe[cuda]' installs them (cupy-cuda12x[ctk])")
    return None


_PROBE = 'extern "C" __global__ void s2_probe(float* x) { x[threadIdx.x] += 1.0f; }'


def _one_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or "no message"
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return f"{exc.__class__.__name__}: {text}"


def _integrated(module) -> bool:
    try:
        rt = module.cuda.runtime
        props = rt.getDeviceProperties(rt.getDevice())
        return bool(props.get("integrated", props.get(b"integrated", 0)))
    except Exception:
        return False


def select_backend(name: str = "auto", module=None) -> Backend:
    """``auto``: CuPy when a CUDA device is usable, else NumPy (the reason says which and why).
    ``module`` substitutes the CuPy module (tests run the device code paths on a CPU double)."""
    if name not in BACKENDS:
        raise UsageError(f"--backend {name!r}: choose from {', '.join(BACKENDS)}")
    if name == "numpy":
        return Backend("numpy", np, "requested")
    reason = cuda_unusable_reason(module)
    if reason is not None:
        if name == "cupy":
            raise UsageError(f"--backend cupy: {reason}; use --backend numpy or auto")
        return Backend("numpy", np, f"auto: {reason}")
    if module is None:
        import cupy as module
        import cupyx

        empty_pinned = cupyx.empty_pinned
    else:
        empty_pinned = getattr(module, "empty_pinned", None)
    _register(module.ndarray, module)
    integrated = _integrated(module)
    why = "requested" if name == "cupy" else "auto: CUDA device found"
    if integrated:
        why += " (integrated GPU: memory shared with the host, no pinned staging)"
    return Backend("cupy", module, why, empty_pinned=empty_pinned, integrated=integrated)
