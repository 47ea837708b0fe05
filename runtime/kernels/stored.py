"""`StoredMatrix`: a weight matrix kept in memory in its stored encoding (F32, F16, BF16, MXFP4 and
the llama.cpp blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K … Q6_K, IQ4_XS), so a resident
weight costs its stored bytes.

Rows are whole blocks (GGML's rule: blocks run along a row), so row r is bytes
[r · row_bytes, (r + 1) · row_bytes) of ``data``. The kernels (`cpu.py`) compute on these bytes,
dequantising in registers; `dequantize` is the NumPy reference they are tested against, built on
the format decoders (`gguf.quants` for the GGML blocks: llama.cpp's own reference code).
Types without a kernel (IQ2_XXS, IQ3_S, TQ1_0, …) are decoded once at load into F32 and counted at
that size (the load says so).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

# GGML type ids (the C kernels' type argument) and (values, bytes) per block
GGML_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
             "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30, "MXFP4": 39}
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
          "Q5_0": (32, 22), "Q5_1": (32, 24), "IQ4_NL": (32, 18), "Q2_K": (256, 84), "Q3_K": (256, 110),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_XS": (256, 136), "MXFP4": (32, 17)}
# Reference decoding reads at most this many bytes of float32 at a time (bounded scratch)
_CHUNK_BYTES = 4 << 20
# Rows of these types meet activations quantised to int8 blocks of 32, as in llama.cpp's CPU
# backend (csrc/cpu/dot.c says how, and why: 1.6x at one token)
INT8_ACTIVATION_TYPES = ("Q8_0", "Q4_0")
# ... and these, in runs of 16 with a scale and an offset each (csrc/cpu/kquant.c; `decode_runs`)
RUN_TYPES = ("Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


def activation_block(dtype: str) -> int:
    """Values per activation scale against ``dtype`` rows: 256 for the super-block types (one
    scale per super-block, as llama.cpp's q8_K), 32 for the rest (kquant.h `kq_act_block`)."""
    return 256 if BLOCKS[dtype][0] == 256 else 32


def int8_activations() -> bool:
    """Whether Q8_0 / Q4_0 (and `RUN_TYPES`) products quantise their activations (the default, on both the compiled
    and the reference path); S2MOE_FLOAT_ACTIVATIONS=1 keeps float32 activations, as the tests that
    hold a GGUF's layout to transformers on dequantised weights need."""
    return os.environ.get("S2MOE_FLOAT_ACTIVATIONS", "") not in ("1", "true", "yes")


def kernel_type(dtype: str, row_len: int) -> bool:
    """Can a row of ``row_len`` values of ``dtype`` stay stored (a kernel exists, whole blocks)?"""
    block = BLOCKS.get(dtype)
    return block is not None and row_len % block[0] == 0


def row_bytes(dtype: str, row_len: int) -> int:
    values, nbytes = BLOCKS[dtype]
    return row_len // values * nbytes


@dataclass(frozen=True, eq=False)
class StoredMatrix:
    data: np.ndarray  # uint8, N · row_bytes bytes, C-contiguous
    dtype: str  # a key of BLOCKS
    shape: tuple[int, int]  # (N rows, K values per row): y = x @ W.T maps K → N

    def __post_init__(self):
        N, K = self.shape
        if self.data.dtype != np.uint8 or self.data.ndim != 1 or not self.data.flags.c_contiguous:
            raise ValueError("StoredMatrix data must be a 1-D C-contiguous uint8 array")
        if self.data.size != N * row_bytes(self.dtype, K):
            raise ValueError(f"{self.dtype} [{N}, {K}] needs {N * row_bytes(self.dtype, K)} bytes, got {self.data.size}")

    @classmethod
    def from_float(cls, a: np.ndarray, dtype: str = "F32") -> "StoredMatrix":
        """Encode a float matrix (tests, and types decoded at load): F32, F16, BF16 (truncated),
        or a GGML block type the `gguf` package can quantise (Q8_0, Q4_0, MXFP4)."""
        a = np.ascontiguousarray(a, dtype=np.float32)
        if dtype == "F32":
            raw = a.view(np.uint8)
        elif dtype == "F16":
            raw = a.astype(np.float16).view(np.uint8)
        elif dtype == "BF16":
            raw = (a.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import quantize

            raw = quantize(a, GGMLQuantizationType[dtype])
        return cls(np.ascontiguousarray(raw).reshape(-1), dtype, tuple(a.shape))

    @classmethod
    def checked_before(cls, data: np.ndarray, dtype: str, shape: tuple[int, int]) -> "StoredMatrix":
        """A matrix whose part of a read buffer was checked once already (offload/store.py
        `_template`): no validation, so a streamed expert's three matrices cost
        microseconds, not tens of them."""
        m = object.__new__(cls)
        object.__setattr__(m, "data", data)
        object.__setattr__(m, "dtype", dtype)
        object.__setattr__(m, "shape", shape)
        return m

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def type_id(self) -> int:
        return GGML_TYPE[self.dtype]

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.dtype, self.shape[1])

    def rows(self, index) -> "StoredMatrix":
        """The rows ``index`` (a slice or integer array) as a new matrix (a copy of their bytes)."""
        N, K = self.shape
        picked = self.data.reshape(N, self.row_bytes)[index]
        return StoredMatrix(np.ascontiguousarray(picked).reshape(-1), self.dtype, (picked.shape[0], K))

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 [n, K] of ``rows`` (all by default): the NumPy reference decoding."""
        from ..model.formats.tensors import decode_array

        N, K = self.shape
        if rows is None:
            rows = slice(0, N)
        raw = self.data.reshape(N, self.row_bytes)[rows]
        return decode_array(self.dtype, (raw.shape[0], K), np.ascontiguousarray(raw).reshape(-1))

    def chunks(self):
        """(row slice, float32 rows) in pieces of at most ~4 MiB: reference math in bounded scratch."""
        N, K = self.shape
        step = max(1, _CHUNK_BYTES // (4 * K))
        for r in range(0, N, step):
            rows = slice(r, min(N, r + step))
            yield rows, self.dequantize(rows)

    def code_chunks(self, tokens: int):
        """(row slice, codes [n, G, 32], scales [n, G]) of Q8_0 / Q4_0 rows, bounded like `chunks`."""
        yield from _code_chunks(np, self.data, self.dtype, self.shape, tokens)

    def run_chunks(self, tokens: int):
        """(row slice, codes [n, J, 16], scales [n, J], offsets [n, J]) of `RUN_TYPES` rows."""
        yield from _code_chunks(np, self.data, self.dtype, self.shape, tokens, decode_runs)

    def __repr__(self) -> str:
        return f"StoredMatrix({self.dtype}, {list(self.shape)}, {self.nbytes} bytes)"


def _code_chunks(xp, data, dtype: str, shape, tokens: int, decode=None):
    N, K = shape
    raw = data.reshape(N, row_bytes(dtype, K))
    step = max(1, _CHUNK_BYTES // (8 * K * max(1, tokens)))  # the per-run sums are [K/16, T, n]
    for r in range(0, N, step):
        rows = slice(r, min(N, r + step))
        yield (rows, *(decode or decode_codes)(xp, dtype, raw[rows], K))


# -- block decoding on any array namespace (NumPy or CuPy) -------------------------------------------
#
# The device keeps weights stored too: their bytes go up as uint8, and a product decodes a few MiB
# of rows at a time on the device, then multiplies with cuBLAS. These decoders are written once
# against the array namespace; tests/test_kernels.py holds them to the reference (gguf.quants) on
# NumPy, and the device runs the same code on CuPy.

_KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def _f16(xp, two_bytes):
    """[..., 2] uint8 → float32 [..., 1] (an f16 per block)."""
    return xp.ascontiguousarray(two_bytes).view(xp.float16).astype(xp.float32)


def decode_rows(xp, dtype: str, raw, K: int):
    """uint8 [n, row_bytes] of ``dtype`` rows → float32 [n, K], with array module ``xp``."""
    n = raw.shape[0]
    if dtype == "F32":
        return xp.ascontiguousarray(raw).view(xp.float32).reshape(n, K)
    if dtype == "F16":
        return xp.ascontiguousarray(raw).view(xp.float16).astype(xp.float32).reshape(n, K)
    if dtype == "BF16":
        return (xp.ascontiguousarray(raw).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32).reshape(n, K)
    if dtype in ("Q8_0", "Q4_0"):  # scale × signed code
        codes, scales = decode_codes(xp, dtype, raw, K)
        return (scales[..., None] * codes).reshape(n, K)
    values, nbytes = BLOCKS[dtype]
    blocks = raw.reshape(n, K // values, nbytes)
    if dtype == "MXFP4":
        codes = _nibbles(xp, blocks[..., 1:])
        e = blocks[..., :1].astype(xp.uint32)
        half = xp.where(e < 2, xp.uint32(0x00200000) << e, (e - 1) << xp.uint32(23)).view(xp.float32)
        table = xp.asarray(_KVALUES_MXFP4)
        return (half * table[codes.astype(xp.int32)]).reshape(n, K)
    if dtype in RUN_TYPES:
        codes, scale, offset = decode_runs(xp, dtype, raw, K)
        return (codes * scale[..., None] + offset[..., None]).reshape(n, K)
    raise ValueError(f"no block decoder for {dtype}")


def decode_codes(xp, dtype: str, raw, K: int):
    """uint8 [n, row_bytes] of Q8_0 / Q4_0 rows → (codes, scales): float32 [n, G, 32] holding the
    signed integer codes (Q4_0: nibble − 8), float32 [n, G] the blocks' scales."""
    n = raw.shape[0]
    blocks = raw.reshape(n, K // 32, BLOCKS[dtype][1])
    scales = _f16(xp, blocks[..., :2])[..., 0]
    if dtype == "Q8_0":
        return xp.ascontiguousarray(blocks[..., 2:]).view(xp.int8).astype(xp.float32), scales
    if dtype == "Q4_0":
        return _nibbles(xp, blocks[..., 2:]).astype(xp.float32) - 8.0, scales
    raise ValueError(f"{dtype} rows do not meet int8 activations")


_KVALUES_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int32)


def decode_runs(xp, dtype: str, raw, K: int):
    """uint8 [n, row_bytes] of a `RUN_TYPES` type → (codes, scales, offsets): float32 [n, K/16, 16]
    integer codes and float32 [n, K/16] per run of 16 values, with w = scale · code + offset, as
    csrc/cpu/kquant.c unpacks them. Layouts: gguf.quants (tests hold every type to it)."""
    n = raw.shape[0]
    values, nbytes = BLOCKS[dtype]
    b = raw.reshape(n, K // values, nbytes).astype(xp.int32)  # [n, B, bytes]
    B = b.shape[1]
    sh = xp.asarray  # (shifts as arrays broadcast along the block's axes)
    if dtype == "MXFP4":  # e (E8M0), qs[16]: the doubled E2M1 values times 2^(e − 128)
        e = b[..., :1].astype(xp.uint32)
        d = xp.where(e < 2, xp.uint32(0x00200000) << e, (e - 1) << xp.uint32(23)).view(xp.float32)
        c = xp.asarray(_KVALUES_MXFP4)[_nibbles(xp, b[..., 1:17])]
        scale, offset = xp.repeat(d, 2, axis=-1), xp.zeros((n, B, 2), xp.float32)
    elif dtype in ("Q4_1", "Q5_0", "Q5_1", "IQ4_NL"):
        d = _f16(xp, raw.reshape(n, B, nbytes)[..., 0:2])  # [n, B, 1]
        has_m = dtype in ("Q4_1", "Q5_1")
        m = _f16(xp, raw.reshape(n, B, nbytes)[..., 2:4]) if has_m else xp.zeros_like(d)
        start = {"Q4_1": 4, "Q5_0": 6, "Q5_1": 8, "IQ4_NL": 2}[dtype]
        c = _nibbles(xp, b[..., start:start + 16])  # [n, B, 32]
        if dtype in ("Q5_0", "Q5_1"):
            at = 2 if dtype == "Q5_0" else 4
            qh = xp.ascontiguousarray(raw.reshape(n, B, nbytes)[..., at:at + 4]).view(xp.uint32).astype(xp.int64)
            c = c | (((qh >> sh(np.arange(32))) & 1) << 4).astype(xp.int32)
            c = c - 16 if dtype == "Q5_0" else c
        if dtype == "IQ4_NL":
            c = xp.asarray(_KVALUES_IQ4)[c]
        scale, offset = xp.repeat(d, 2, axis=-1), xp.repeat(m, 2, axis=-1)  # [n, B, 2]
    elif dtype == "Q2_K":  # scales[16] (scale | min << 4), qs[64], d, dmin
        d, dmin = _f16(xp, raw.reshape(n, B, nbytes)[..., 80:82]), _f16(xp, raw.reshape(n, B, nbytes)[..., 82:84])
        c = (b[..., 16:80].reshape(n, B, 2, 1, 32) >> sh(np.array([0, 2, 4, 6]).reshape(4, 1))) & 3
        scale, offset = d * (b[..., :16] & 0xF), -(dmin * (b[..., :16] >> 4))
    elif dtype == "Q3_K":  # hmask[32], qs[64], scales[12] (6-bit, less 32), d
        d = _f16(xp, raw.reshape(n, B, nbytes)[..., 108:110])
        low = (b[..., 32:96].reshape(n, B, 2, 1, 32) >> sh(np.array([0, 2, 4, 6]).reshape(4, 1))) & 3
        high = (b[..., :32].reshape(n, B, 1, 1, 32) >> sh(np.arange(8).reshape(2, 4, 1))) & 1
        c = low - 4 * (1 - high)
        sc = b[..., 96:108]
        lo = xp.concatenate([sc[..., :8] & 0xF, sc[..., :8] >> 4], axis=-1)
        hi = (sc[..., None, 8:12] >> sh(np.array([0, 2, 4, 6]).reshape(4, 1))) & 3  # [n, B, j // 4, j % 4]
        scale = d * ((lo | (hi.reshape(n, B, 16) << 4)) - 32)
        offset = xp.zeros_like(scale)
    elif dtype in ("Q4_K", "Q5_K"):  # d, dmin, scales[12], (Q5_K: qh[32],) qs[128]
        d, dmin = _f16(xp, raw.reshape(n, B, nbytes)[..., 0:2]), _f16(xp, raw.reshape(n, B, nbytes)[..., 2:4])
        s = b[..., 4:16]
        sc = xp.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        mn = xp.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        qs = b[..., 48:] if dtype == "Q5_K" else b[..., 16:]
        c = xp.stack([qs.reshape(n, B, 4, 32) & 0xF, qs.reshape(n, B, 4, 32) >> 4], axis=3)  # [n, B, 4, 2, 32]
        if dtype == "Q5_K":
            c = c | (((b[..., 16:48].reshape(n, B, 1, 1, 32) >> sh(np.arange(8).reshape(4, 2, 1))) & 1) << 4)
        scale, offset = xp.repeat(d * sc, 2, axis=-1), xp.repeat(-(dmin * mn), 2, axis=-1)
    elif dtype == "Q6_K":  # ql[128], qh[64], int8 scales[16], d
        d = _f16(xp, raw.reshape(n, B, nbytes)[..., 208:210])
        low = (b[..., :128].reshape(n, B, 2, 1, 2, 32) >> sh(np.array([0, 4]).reshape(2, 1, 1))) & 0xF  # [h, s>>1, s&1]
        high = (b[..., 128:192].reshape(n, B, 2, 1, 32) >> sh(np.array([0, 2, 4, 6]).reshape(4, 1))) & 3
        c = (low.reshape(n, B, 2, 4, 32) | (high << 4)) - 32
        scale = d * ((b[..., 192:208] ^ 0x80) - 0x80)  # the int8 scales
        offset = xp.zeros_like(scale)
    elif dtype == "IQ4_XS":  # d, scales_h (u16), scales_l[4], qs[128]
        d = _f16(xp, raw.reshape(n, B, nbytes)[..., 0:2])
        low = (b[..., 4:8, None] >> sh(np.array([0, 4]))) & 0xF  # [n, B, 4, 2]
        high = ((b[..., 2:3] | (b[..., 3:4] << 8)) >> sh(2 * np.arange(8))) & 3  # [n, B, 8]
        ls = low.reshape(n, B, 8) | (high << 4)
        c = xp.asarray(_KVALUES_IQ4)[_nibbles(xp, b[..., 8:].reshape(n, B, 8, 16))]
        scale = xp.repeat(d * (ls - 32), 2, axis=-1)
        offset = xp.zeros_like(scale)
    else:
        raise ValueError(f"{dtype} has no runs of 16")
    J = K // 16
    return (c.reshape(n, J, 16).astype(xp.float32), scale.reshape(n, J).astype(xp.float32),
            offset.reshape(n, J).astype(xp.float32))


def int8_runs_product(xp, xq, dx, codes, scale, offset):
    """[T, n]: Σ over runs of 16 of dx · (scale · Σ code · q + offset · Σ q), as kquant.c computes it
    (here in float64 from exact integer sums: the reference the kernels are held to). ``xq``, ``dx``:
    `quantize_activations` in blocks of `activation_block`."""
    T, G, block = xq.shape
    q16 = xq.reshape(T, G * block // 16, 16)
    isum = xp.matmul(q16.transpose(1, 0, 2), codes.transpose(1, 2, 0)).astype(xp.float64)  # [J, T, n], exact
    dx16 = xp.repeat(dx, block // 16, axis=1).T.astype(xp.float64)[:, :, None]  # [J, T, 1]
    qsum = q16.sum(axis=-1).T.astype(xp.float64)[:, :, None]  # [J, T, 1]
    part = scale.T.astype(xp.float64)[:, None, :] * isum + offset.T.astype(xp.float64)[:, None, :] * qsum
    return (dx16 * part).sum(axis=0).astype(xp.float32)


def _nibbles(xp, qs):
    """[..., 16] bytes → [..., 32] codes: elements 0-15 in the low nibbles, 16-31 in the high."""
    return xp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def quantize_activations(xp, x, block: int = 32):
    """float32 [T, K] → (codes float32 [T, G, block], scales float32 [T, G]), rounded exactly as
    csrc/cpu does: d = max|x| / 127 and q = round-half-even(x · (1/d)), each in float32."""
    T, K = x.shape
    blocks = x.reshape(T, K // block, block).astype(xp.float32, copy=False)
    d = (xp.abs(blocks).max(axis=-1) / xp.float32(127.0)).astype(xp.float32)
    inv = (xp.float32(1.0) / xp.where(d > 0, d, xp.float32(1.0))).astype(xp.float32)
    inv = xp.where(d > 0, inv, xp.float32(0.0))
    return xp.rint(blocks * inv[..., None]), d


def int8_product(xp, xq, dx, codes, dw):
    """[T, n]: Σ over blocks of (d_w · d_x) · Σ code · code. The block sums are exact in float32
    (at most 32 · 128 · 127 < 2^24), so BLAS computes them; the blocks are added in float64."""
    isum = xp.matmul(xq.transpose(1, 0, 2), codes.transpose(1, 2, 0))  # [G, T, n]
    scale = dx.T[:, :, None] * dw.T[:, None, :]  # float32, as the kernel's d_w · d_x
    return (scale * isum).astype(xp.float64).sum(axis=0).astype(xp.float32)


@dataclass(frozen=True, eq=False)
class DeviceStored:
    """A `StoredMatrix` whose bytes live on a device (uint8 array of the backend's module)."""

    data: object
    dtype: str
    shape: tuple[int, int]
    xp: object

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.dtype, self.shape[1])

    def rows(self, index) -> "DeviceStored":
        """The rows ``index`` (host ints or a slice) as a new matrix on the device (a copy)."""
        N, K = self.shape
        if not isinstance(index, slice):
            index = self.xp.asarray(index)
        picked = self.data.reshape(N, self.row_bytes)[index]
        return DeviceStored(self.xp.ascontiguousarray(picked).reshape(-1), self.dtype, (int(picked.shape[0]), K), self.xp)

    def dequantize(self, rows=None):
        N, K = self.shape
        raw = self.data.reshape(N, self.row_bytes)
        return decode_rows(self.xp, self.dtype, raw if rows is None else raw[rows], K)

    def chunks(self):
        N, K = self.shape
        step = max(1, _CHUNK_BYTES // (4 * K))
        for r in range(0, N, step):
            rows = slice(r, min(N, r + step))
            yield rows, self.dequantize(rows)

    def code_chunks(self, tokens: int):
        yield from _code_chunks(self.xp, self.data, self.dtype, self.shape, tokens)

    def run_chunks(self, tokens: int):
        yield from _code_chunks(self.xp, self.data, self.dtype, self.shape, tokens, decode_runs)
