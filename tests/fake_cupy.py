"""A CPU stand-in for the part of CuPy the device code paths use, so CI runs them without a GPU.

Arrays are `DeviceArray`, an np.ndarray subclass that behaves like device memory where it matters
for correctness of the plumbing: a ufunc (matmul included) that mixes it with a host array of one or
more dimensions raises `MixedMemory` (CuPy raises TypeError there), and an implicit read to the host
(`int()`, `float()`, `bool()`, `.item()`, `.tolist()`, iteration) raises `ImplicitSync`. Only
`asnumpy` reads to the host, and it is counted.

As strict as the real thing where the device code can go wrong:
- a host → device copy on a stream other than the default one is asynchronous: the destination
  holds garbage (NaN, 0xCD) until the copy lands, and it lands only when a stream waits on an event
  recorded after it, or the host synchronises that event or stream. A copy from pageable memory
  reads its source at once (CUDA stages it), a copy from pinned memory reads it when it lands;
- pinned buffers (`empty_pinned`) are reused as soon as they are freed: a freed buffer is scribbled
  over and handed to the next request of its size, even while a copy from it is still pending;
- `ndarray.set` follows CuPy: a source whose layout differs from the destination's is copied into a
  new pageable array first (`transposing_copies` counts that slow path);
- kernel launches (ufuncs, gathers, scatters, copies, `RawModule` kernels) and host syncs are
  counted (`counting()`), a block of more than 1024 threads is refused as CUDA refuses it;
- `mode(missing_library=...)`: CuPy imports and sees a device, but every kernel fails with
  `DynamicLibNotFoundError`, as the cupy-cuda12x wheel does without its CUDA libraries;
- `mode(integrated=True)`: the device reports ``integrated`` (Jetson Orin: memory shared with the
  host); pinned allocations are counted so tests can check there are none.
`ndarray.data.ptr` is an array's address, as in CuPy (kernels read tables of them).
`RawModule` runs the CUDA source itself on the CPU when a test registers an emulator for it
(`kernel_emulator`, tests/test_gpu_standin.py). What this cannot check: speed and CuPy's numerics.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
import types
import weakref
from contextlib import contextmanager

import numpy as np


class MixedMemory(AssertionError):
    pass


class ImplicitSync(AssertionError):
    pass


class DynamicLibNotFoundError(RuntimeError):
    """What cuda.pathfinder raises when CuPy cannot load a CUDA library (libnvrtc, libcublasLt)."""


class CUDADriverError(RuntimeError):
    pass


def _host(a):
    return a.view(np.ndarray) if isinstance(a, DeviceArray) else a


def _device(a):
    return a.view(DeviceArray) if type(a) is np.ndarray else a


def _launch(n: int = 1) -> None:
    if module.missing_library:
        raise DynamicLibNotFoundError(f"Failure finding \"{module.missing_library}\": no such file")
    module.launches += n


def _advanced(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (np.ndarray, list)) for p in parts)


class DeviceArray(np.ndarray):
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        for a in inputs + (out or ()):
            if type(a) is np.ndarray and a.ndim > 0:
                raise MixedMemory(f"np.{ufunc.__name__}: a host array {a.shape} meets a device array")
        _launch()
        if out is not None:
            kwargs["out"] = tuple(_host(o) for o in out)
        result = getattr(ufunc, method)(*(_host(a) for a in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return tuple(_device(r) for r in result) if isinstance(result, tuple) else _device(result)

    def __getitem__(self, index):  # an element stays on the device as a 0-d array, as in CuPy
        if _advanced(index):
            _launch()  # a gather kernel (basic indexing is a view)
        out = super().__getitem__(index)
        return out if isinstance(out, np.ndarray) else np.asarray(out).view(DeviceArray)

    def __setitem__(self, index, value):
        if type(value) is np.ndarray and value.ndim > 0:
            raise MixedMemory(f"setitem: a host array {value.shape} into a device array")
        _launch()
        super().__setitem__(index, _host(value))

    def astype(self, dtype, *args, copy=True, **kwargs):
        if copy or np.dtype(dtype) != self.dtype:
            _launch()
        return super().astype(dtype, *args, copy=copy, **kwargs)

    def copy(self, order="C"):
        _launch()
        return super().copy(order)

    def reshape(self, *shape, **kwargs):
        out = super().reshape(*shape, **kwargs)
        if out.size and not np.shares_memory(_host(out), _host(self)):
            _launch()
        return out

    @property
    def data(self):  # CuPy's ndarray.data: a MemoryPointer whose ptr is the first element's address
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def _sync(self, *_, **__):
        raise ImplicitSync("implicit device → host read; use Backend.to_host")

    __int__ = __float__ = __bool__ = __iter__ = item = tolist = _sync

    def set(self, arr, stream=None):  # host → device copy (CuPy: asynchronous on ``stream``)
        if type(arr) is not np.ndarray:
            raise TypeError("set() takes a host array")
        if arr.shape != self.shape:
            raise ValueError("set() takes a host array of the same shape")
        if arr.dtype != self.dtype:
            raise TypeError(f"set(): dtype {arr.dtype} into {self.dtype}")
        # CuPy's ndarray.set: the source is made contiguous in the destination's order first (a
        # transposing copy into new pageable memory when the layouts differ)
        want_c = self.flags.c_contiguous
        if want_c and not arr.flags.c_contiguous:
            arr, module.transposing_copies = np.ascontiguousarray(arr), module.transposing_copies + 1
        elif not want_c and self.flags.f_contiguous and not arr.flags.f_contiguous:
            arr, module.transposing_copies = np.asfortranarray(arr), module.transposing_copies + 1
        elif not (self.flags.c_contiguous or self.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        module.launches += 1
        module.copies.append((stream, (arr.shape, arr.dtype)))  # not the array: it must be free to go
        pinned = _pinned_block(arr) is not None
        if not pinned:
            module.pageable_copies += 1
        if stream is None or stream is module.cuda.default or not module.strict:
            self.view(np.ndarray)[...] = arr  # the compute stream: in order with the kernels
            return
        source = _Source(arr) if pinned else _Source(arr.copy())  # pageable: staged by CUDA at once
        self.view(np.ndarray)[...] = np.nan if self.dtype.kind == "f" else 0xCD  # not landed yet
        stream.pending.append(_Copy(self, source))


# -- pinned memory: reused as soon as it is freed ---------------------------------------------------

class _Pinned:
    """Owner of a pinned block (views of the array keep it alive, as CuPy's PinnedMemoryPointer)."""

    def __init__(self, block: np.ndarray):
        self.block = block
        self.__array_interface__ = block.__array_interface__


def _pinned_block(a: np.ndarray):
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    return base.block if isinstance(base, _Pinned) else None


def _free_pinned(block: np.ndarray) -> None:
    block[...] = 0xCD  # scribbled: a copy still reading it sees garbage
    module.pinned_free.setdefault(block.nbytes, []).append(block)


def empty_pinned(shape, dtype=np.float32, order="C"):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    free = module.pinned_free.get(nbytes)
    block = free.pop() if free else np.empty(max(nbytes, 1), np.uint8)
    module.pinned_allocs += 1
    owner = _Pinned(block)
    weakref.finalize(owner, _free_pinned, block)
    flat = np.asarray(owner)[:nbytes].view(dtype)
    return flat.reshape(shape, order=order)


class _Copy:
    def __init__(self, dst, src):
        self.dst, self.src = dst, src

    def land(self) -> None:
        self.dst.view(np.ndarray)[...] = self.src.read()


class _Source:
    """What a pending copy reads when it lands: the memory, not a reference keeping it alive."""

    def __init__(self, arr: np.ndarray):
        block = _pinned_block(arr)
        if block is None:
            self.keep, self.array = arr, None
        else:
            offset = arr.__array_interface__["data"][0] - block.__array_interface__["data"][0]
            self.keep = None
            self.array = (block, offset, arr.shape, arr.dtype, arr.strides)

    def read(self) -> np.ndarray:
        if self.array is None:
            return self.keep
        block, offset, shape, dtype, strides = self.array
        return np.ndarray(shape, dtype, buffer=block, offset=offset, strides=strides)


# -- streams and events -----------------------------------------------------------------------------

class Event:
    def __init__(self, stream=None, **_):
        self.stream = stream
        self.time = None
        self.pending: list = []

    def record(self, stream=None):
        self.stream = stream or module.cuda.get_current_stream()
        self.pending = list(self.stream.pending)
        self.time = time.perf_counter()

    def _land(self) -> None:
        for item in self.pending:
            if item in self.stream.pending:  # (identity: _Copy has no __eq__)
                item.land()
                self.stream.pending.remove(item)
        self.pending = []

    @property
    def done(self) -> bool:  # cudaEventQuery: only once its copies have landed
        return not any(item in self.stream.pending for item in self.pending) if self.stream else True

    def synchronize(self):
        module.syncs += 1
        if self.stream is not None:
            self._land()


class Stream:
    def __init__(self, non_blocking: bool = False):
        self.non_blocking = non_blocking
        self.recorded: list[Event] = []
        self.waited: list[Event] = []
        self.pending: list = []

    def __enter__(self):
        module.cuda.current.append(self)
        return self

    def __exit__(self, *exc):
        module.cuda.current.pop()

    def record(self, event=None) -> Event:
        event = event or Event()
        event.record(self)
        self.recorded.append(event)
        return event

    def wait_event(self, event: Event) -> None:
        self.waited.append(event)
        if event.stream is not None:
            event._land()  # this stream's next work runs after the copy: it has landed for it

    def synchronize(self) -> None:
        module.syncs += 1
        for item in self.pending:
            item.land()
        self.pending.clear()


class MemoryPool:
    def __init__(self):
        self.limit = 0

    def set_limit(self, size=None, fraction=None):
        self.limit = int(size or 0)

    def get_limit(self) -> int:
        return self.limit

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0


# -- RawModule / RawKernel ----------------------------------------------------------------------------

class _Function:
    def __init__(self, raw, name):
        self.raw, self.name = raw, name

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        threads = int(np.prod(block))
        if threads > 1024 or threads < 1:
            raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: block of {threads} threads (at most 1024)")
        _launch()
        impl = module.kernels.get(self.name, _emulate)
        impl(self.raw, tuple(grid), tuple(block), tuple(args), **({"name": self.name} if impl is _emulate else {}))


class RawModule:
    def __init__(self, code: str = "", options=(), name_expressions=None, **_):
        if module.missing_library:
            raise DynamicLibNotFoundError(f"Failure finding \"{module.missing_library}\": no such file")
        self.code, self.options = code, tuple(options)
        module.compiled.append((code, self.options))

    def get_function(self, name):
        if f" {name}(" not in self.code:
            raise CUDADriverError(f"CUDA_ERROR_NOT_FOUND: named symbol not found ({name})")
        return _Function(self, name)


def RawKernel(code: str, name: str, options=(), **_):
    return RawModule(code=code, options=options).get_function(name)


# The CUDA source itself, run on the CPU: g++ compiles the string CuPy was given (so it must be
# self-contained: headers inlined) with a shim that makes __global__ functions plain functions and
# __shared__ variables statics. A launcher per kernel runs block after block; a block's threads run
# as fibers (a register switch; ucontext elsewhere), each until it ends or waits: at __syncthreads()
# for the block, at s2_warp_sum (the shuffle butterfly of decode.cuh) for its warp. Waiters go on
# when every live thread of their block (warp) waits, so cooperation is checked as CUDA runs it, not
# assumed: a warp sum missing a lane that has returned, or a deadlock, aborts the test run with a
# message.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cupy_shim.cpp"), encoding="utf-8") as _f:
    _SHIM = _f.read()
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)


def _ctype(param: str):
    import ctypes

    if "*" in param:
        return ctypes.c_void_p
    return {"int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double, "long": ctypes.c_long}[
        param.replace("const", "").split()[0]]


@functools.lru_cache(maxsize=8)
def _emulator(code: str):
    import ctypes
    import hashlib
    import shutil
    import subprocess
    import tempfile

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NotImplementedError("fake_cupy: no C++ compiler to run the CUDA source on the CPU")
    launchers, signatures = [], {}
    for name, params in _KERNEL.findall(code):
        params = [" ".join(p.split()) for p in params.split(",")]
        names = [re.findall(r"\w+", p)[-1] for p in params]
        launchers.append(f'extern "C" void emu_{name}(unsigned gx, unsigned bx, {", ".join(params)}) {{\n'
                         f"  emu::body = [=] {{ {name}({', '.join(names)}); }};\n"
                         f"  emu::launch(gx, bx);\n}}")
        signatures[name] = [_ctype(p) for p in params]
    folder = tempfile.mkdtemp(prefix="fake_cupy_")
    src = os.path.join(folder, "k.cpp")
    with open(src, "w") as f:
        f.write(_SHIM + code + "\n" + "\n".join(launchers) + "\n")
    lib = os.path.join(folder, f"k{hashlib.sha1(code.encode()).hexdigest()[:12]}.so")
    try:
        r = subprocess.run([compiler, "-O2", "-std=c++17", "-shared", "-fPIC", src, "-o", lib], capture_output=True,
                           text=True, cwd=folder)  # no -I: the source must not need its headers
        if r.returncode:
            raise CUDADriverError(f"NVRTC_ERROR_COMPILATION (fake_cupy emulation):\n{r.stderr[-3000:]}")
        return ctypes.CDLL(lib), signatures  # (a loaded library stays mapped once its file is gone)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # one folder per test run used to stay in /tmp


def _emulate(raw, grid, block, args, name):
    import ctypes

    lib, signatures = _emulator(raw.code)
    types_ = signatures[name]
    if len(types_) != len(args):
        raise CUDADriverError(f"{name}: {len(args)} arguments for {len(types_)} parameters")
    values = []
    for t, a in zip(types_, args):
        if t is ctypes.c_void_p:
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise CUDADriverError(f"{name}: a non-contiguous array passed as a pointer")
                values.append(a.ctypes.data)
            else:
                values.append(int(a) or None)  # cp.intp(0): a null pointer
        else:
            values.append(t(a.item() if isinstance(a, np.generic) else a))
    fn = getattr(lib, f"emu_{name}")
    fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + types_
    fn(int(np.prod(grid)), int(np.prod(block)), *values)


def _probe(raw, grid, block, args):  # the usability check's kernel: x[i] += 1
    x = args[0]
    x.view(np.ndarray).reshape(-1)[:int(np.prod(block))] += 1


def _make_module() -> types.ModuleType:
    m = types.ModuleType("fake_cupy")
    m.ndarray = DeviceArray
    m.strict, m.missing_library, m.integrated = True, None, False
    m.kernels = {}  # kernel name → CPU implementation (raw module, grid, block, args)

    def reset() -> None:
        m.host_reads = m.uploads = m.launches = m.syncs = 0
        m.pinned_allocs = m.pageable_copies = m.transposing_copies = 0
        m.copies = []  # (stream, (shape, dtype)) of every set()
        m.compiled = []  # (source, options) of every RawModule
        m.pinned_free = {}
        m.pool = MemoryPool()

    m.reset = reset
    reset()
    m.empty_pinned = empty_pinned

    def asarray(a, dtype=None, order="K"):
        if isinstance(a, DeviceArray) and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        if isinstance(a, DeviceArray):
            _launch()
        else:
            m.uploads += 1
            m.launches += 1  # a host → device copy on the compute stream
        return np.array(_host(a), dtype=dtype, copy=True, order=order).view(DeviceArray)

    def asnumpy(a, stream=None):
        m.host_reads += 1
        m.syncs += 1
        m.launches += 1
        return np.array(_host(a), copy=True)

    def delegate(name, ops=1):
        fn = getattr(np, name)

        def call(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                if type(a) is np.ndarray and a.ndim > 0:
                    raise MixedMemory(f"fake_cupy.{name}: got a host array {a.shape}")
            host_args = [_host(a) for a in args]
            result = fn(*host_args, **{k: _host(v) for k, v in kwargs.items()})
            copied = not (name == "ascontiguousarray" and isinstance(result, np.ndarray) and host_args
                          and isinstance(host_args[0], np.ndarray) and np.shares_memory(result, host_args[0]))
            if ops and copied:
                _launch(ops)
            if name in ("empty", "empty_like") and isinstance(result, np.ndarray):
                result[...] = np.nan if result.dtype.kind == "f" else 0  # never read before written
            return _device(result) if isinstance(result, np.ndarray) else result
        return call

    for name in ("zeros", "zeros_like", "where", "exp", "mean", "sqrt", "maximum", "minimum", "clip",
                 "concatenate", "ascontiguousarray", "stack", "repeat", "abs", "rint", "matmul"):
        setattr(m, name, delegate(name))
    for name in ("empty", "empty_like"):  # an allocation, no kernel
        setattr(m, name, delegate(name, ops=0))
    m.asarray, m.asnumpy = asarray, asnumpy
    m.inf = np.inf
    m.intp = np.intp
    for name in ("float32", "float16", "float64", "int8", "int32", "uint16", "uint32", "uint8", "int64", "bool_"):
        setattr(m, name, getattr(np, name))
    m.RawModule, m.RawKernel = RawModule, RawKernel
    m.kernels["s2_probe"] = _probe  # the others run their CUDA source on the CPU (_emulate)
    m.get_default_memory_pool = lambda: m.pool
    cuda = types.SimpleNamespace(Stream=Stream, Event=Event, current=[], default=Stream())
    cuda.get_elapsed_time = lambda start, end: (end.time - start.time) * 1e3
    cuda.get_current_stream = lambda: cuda.current[-1] if cuda.current else cuda.default

    def properties(device=0):
        return {"name": b"fake (CPU stand-in)", "integrated": int(m.integrated), "totalGlobalMem": 1 << 34}

    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0,
                                         getDeviceProperties=properties)
    m.cuda = cuda
    return m


@contextmanager
def mode(integrated: bool = False, missing_library: str | None = None, strict: bool = True):
    """Run the block with the stand-in as an integrated GPU, without a CUDA library, or lenient."""
    saved = (module.integrated, module.missing_library, module.strict)
    module.integrated, module.missing_library, module.strict = integrated, missing_library, strict
    try:
        yield module
    finally:
        module.integrated, module.missing_library, module.strict = saved


class Tally:
    def __init__(self):
        self.launches = self.syncs = 0


@contextmanager
def counting():
    """``with counting() as n:`` leaves the block's kernel launches and host syncs in ``n``."""
    tally = Tally()
    l0, s0 = module.launches, module.syncs
    try:
        yield tally
    finally:
        tally.launches, tally.syncs = module.launches - l0, module.syncs - s0


module = _make_module()
sys.modules.setdefault("fake_cupy", module)
