"""Build and load the host-compiled kernel math (csrc/host_api.cpp) for tests."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache

import numpy as np

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
_f32 = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
_i32 = np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS")


@lru_cache(maxsize=1)
def library():
    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler, "a C++ compiler (g++) is needed to test csrc/ on the host"
    out = os.path.join(tempfile.mkdtemp(prefix="s2moe-csrc-"), "libs2host.so")
    subprocess.run([compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{CSRC}",
                    os.path.join(CSRC, "host_api.cpp"), "-o", out], check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(out)
    lib.s2_host_route.argtypes = [_f32, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, _i32, _f32]
    lib.s2_host_reuse_gating.argtypes = [_f32, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                         _i32, _f32]
    lib.s2_host_reuse_gating.restype = ctypes.c_int
    lib.s2_host_dequant.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long, _f32]
    lib.s2_host_to_half.argtypes = [_f32, ctypes.c_long, np.ctypeslib.ndpointer(np.uint16, flags="C_CONTIGUOUS")]
    return lib


def _ptr(a):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def route(logits, k, kind, renorm, bias=None):
    B, E = logits.shape
    ids = np.zeros((B, k), np.int32)
    w = np.zeros((B, k), np.float32)
    logits = np.ascontiguousarray(logits, np.float32)
    bias = None if bias is None else np.ascontiguousarray(bias, np.float32)
    library().s2_host_route(logits, _ptr(bias), B, E, k, {"softmax_topk": 0, "topk_softmax": 1}[kind], int(renorm),
                            ids, w)
    return ids, w


def reuse_gating(logits, k, cap, variant, strength, kind, renorm, confidence=None):
    B, E = logits.shape
    ids = np.zeros((B, k), np.int32)
    w = np.zeros((B, k), np.float32)
    logits = np.ascontiguousarray(logits, np.float32)
    conf = None if confidence is None else np.ascontiguousarray(confidence, np.float32)
    n = library().s2_host_reuse_gating(logits, _ptr(conf), B, E, k, cap, {"paper": 0, "code": 1}[variant],
                                       strength, {"softmax_topk": 0, "topk_softmax": 1}[kind], int(renorm), ids, w)
    return n, ids, w


def dequant(data: np.ndarray, type_id: int, N: int, K: int) -> np.ndarray:
    """The rows of stored bytes ``data`` as the device kernels decode them (csrc/quant.cuh)."""
    out = np.zeros((N, K), np.float32)
    data = np.ascontiguousarray(data, np.uint8)
    library().s2_host_dequant(data.ctypes.data_as(ctypes.c_void_p), type_id, N, K, out)
    return out


def to_half(x: np.ndarray) -> np.ndarray:
    """float32 → float16 as the device kernels round (csrc/quant.cuh s2_float_to_half)."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.zeros(x.size, np.uint16)
    library().s2_host_to_half(x, x.size, out)
    return out.view(np.float16)
