"""A CPU stand-in for the part of CuPy the device code paths use, so CI runs them without a GPU.

Arrays are `DeviceArray`, an np.ndarray subclass that behaves like device memory where it matters
for correctness of the plumbing: a ufunc (matmul included) that mixes it with a host array of one or
more dimensions raises `MixedMemory` (CuPy raises TypeError there), and an implicit read to the host
(`int()`, `float()`, `bool()`, `.item()`, `.tolist()`, iteration) raises `ImplicitSync`. Only
`asnumpy` reads to the host, and it is counted. Streams and events only record what happened.
What this cannot check: kernel speed, real asynchrony, and CuPy's own numerics (tests/gpu does).
"""

from __future__ import annotations

import sys
import types

import numpy as np


class MixedMemory(AssertionError):
    pass


class ImplicitSync(AssertionError):
    pass


def _host(a):
    return a.view(np.ndarray) if isinstance(a, DeviceArray) else a


def _device(a):
    return a.view(DeviceArray) if type(a) is np.ndarray else a


class DeviceArray(np.ndarray):
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        for a in inputs + (out or ()):
            if type(a) is np.ndarray and a.ndim > 0:
                raise MixedMemory(f"np.{ufunc.__name__}: a host array {a.shape} meets a device array")
        if out is not None:
            kwargs["out"] = tuple(_host(o) for o in out)
        result = getattr(ufunc, method)(*(_host(a) for a in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return tuple(_device(r) for r in result) if isinstance(result, tuple) else _device(result)

    def __getitem__(self, index):  # an element stays on the device as a 0-d array, as in CuPy
        out = super().__getitem__(index)
        return out if isinstance(out, np.ndarray) else np.asarray(out).view(DeviceArray)

    def _sync(self, *_, **__):
        raise ImplicitSync("implicit device → host read; use Backend.to_host")

    __int__ = __float__ = __bool__ = __iter__ = item = tolist = _sync

    def set(self, arr, stream=None):  # host → device copy (CuPy: asynchronous on ``stream``)
        if type(arr) is not np.ndarray or arr.shape != self.shape:
            raise TypeError("set() takes a host array of the same shape")
        module.copies.append((stream, arr))
        self.view(np.ndarray)[...] = arr


class Event:
    done = True

    def __init__(self, stream=None):
        self.stream = stream
        self.time = None

    def record(self, stream=None):
        import time

        self.time = time.perf_counter()

    def synchronize(self):
        pass


class Stream:
    def __init__(self, non_blocking: bool = False):
        self.non_blocking = non_blocking
        self.recorded: list[Event] = []
        self.waited: list[Event] = []

    def __enter__(self):
        module.cuda.current.append(self)
        return self

    def __exit__(self, *exc):
        module.cuda.current.pop()

    def record(self) -> Event:
        event = Event(self)
        self.recorded.append(event)
        return event

    def wait_event(self, event: Event) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        pass


def _make_module() -> types.ModuleType:
    m = types.ModuleType("fake_cupy")
    m.ndarray = DeviceArray
    m.host_reads = 0
    m.uploads = 0
    m.copies = []  # (stream, host array) of every set()
    m.empty_pinned = lambda shape, dtype=np.float32: np.empty(shape, dtype)

    def asarray(a, dtype=None):
        if isinstance(a, DeviceArray) and dtype is None:
            return a
        m.uploads += 1
        return np.array(_host(a), dtype=dtype, copy=True, order="K").view(DeviceArray)

    def asnumpy(a):
        m.host_reads += 1
        return np.array(_host(a), copy=True)

    def delegate(name):
        fn = getattr(np, name)

        def call(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                if type(a) is np.ndarray and a.ndim > 0:
                    raise MixedMemory(f"fake_cupy.{name}: got a host array {a.shape}")
            result = fn(*(_host(a) for a in args), **{k: _host(v) for k, v in kwargs.items()})
            return _device(result) if isinstance(result, np.ndarray) else result
        return call

    for name in ("empty", "zeros", "zeros_like", "empty_like", "where", "exp", "mean", "sqrt", "maximum", "minimum", "clip",
                 "concatenate", "ascontiguousarray", "stack"):
        setattr(m, name, delegate(name))
    m.asarray, m.asnumpy = asarray, asnumpy
    m.inf = np.inf
    for name in ("float32", "float16", "int8", "int32", "uint16", "uint32", "uint8", "int64", "bool_"):
        setattr(m, name, getattr(np, name))
    cuda = types.SimpleNamespace(Stream=Stream, Event=Event, current=[], default=Stream())
    cuda.get_elapsed_time = lambda start, end: (end.time - start.time) * 1e3
    cuda.get_current_stream = lambda: cuda.current[-1] if cuda.current else cuda.default
    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)
    m.cuda = cuda
    return m


module = _make_module()
sys.modules.setdefault("fake_cupy", module)
