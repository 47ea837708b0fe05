"""`StoredMatrix`: a weight matrix kept in memory in its stored encoding (F16, BF16, Q8_0, Q4_0,
Q4_K, MXFP4, F32), so a resident weight costs its stored bytes.

Rows are whole blocks (GGML's rule: blocks run along a row), so row r is bytes
[r · row_bytes, (r + 1) · row_bytes) of ``data``. The kernels (`cpu.py`) compute on these bytes,
dequantising in registers; `dequantize` is the NumPy reference they are tested against, built on
the format decoders (`gguf.quants` for the GGML blocks: llama.cpp's own reference code).
Types without a kernel (Q5_K, Q6_K, …) are decoded once at load into F32 and counted at that size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# GGML type ids (the C kernels' type argument) and (values, bytes) per block
GGML_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "BF16": 30, "MXFP4": 39}
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144),
          "MXFP4": (32, 17)}
# Reference decoding reads at most this many bytes of float32 at a time (bounded scratch)
_CHUNK_BYTES = 4 << 20


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

    def __repr__(self) -> str:
        return f"StoredMatrix({self.dtype}, {list(self.shape)}, {self.nbytes} bytes)"
