"""`TensorRef`: where a tensor's bytes live, and how to turn those bytes into float32.

Loaders never hold expert weights; they hold refs. A ref is (file, absolute byte offset, byte
count, storage type, logical shape), which is exactly what an expert store needs to `pread` one
expert and nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ...errors import ModelFormatError, UnsupportedModelError

# Plain (unquantised) storage types and their numpy dtypes. BF16 has no numpy dtype: it is read
# as uint16 and widened by a 16-bit shift. U8 holds packed data (MXFP4 blocks and scales in
# safetensors) and decodes to raw bytes for the expert assembler, not to float32.
PLAIN_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
}


@dataclass(frozen=True)
class TensorRef:
    """A tensor's bytes in a file. ``shape`` is the logical (numpy-order, dequantised) shape."""

    path: str
    name: str
    offset: int
    nbytes: int
    dtype: str  # "F32", "F16", "BF16", or a GGML quantisation type name such as "Q4_K"
    shape: tuple[int, ...]

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def quantized(self) -> bool:
        return self.dtype not in PLAIN_DTYPES

    def slice_leading(self, index: int) -> "TensorRef":
        """The ``index``-th sub-tensor along axis 0 (one expert of a fused/merged tensor).

        Axis 0 is the slowest-varying axis in both formats, so the slice is one contiguous byte
        range; for quantised types, blocks run along the last axis and never straddle it.
        """
        count = self.shape[0]
        if not 0 <= index < count:
            raise IndexError(f"{self.name}: index {index} outside 0..{count - 1}")
        if self.nbytes % count:
            raise ModelFormatError(
                f"{self.path}: tensor {self.name} ({self.nbytes} bytes) does not split into {count} equal parts"
            )
        step = self.nbytes // count
        return TensorRef(self.path, f"{self.name}[{index}]", self.offset + index * step, step, self.dtype, self.shape[1:])

    def split_rows(self, parts: int, index: int) -> "TensorRef":
        """Part ``index`` of ``parts`` equal row blocks of a 2-D tensor (gate/up halves of gate_up)."""
        rows = self.shape[0]
        if rows % parts or self.nbytes % parts:
            raise ModelFormatError(f"{self.path}: tensor {self.name} rows {rows} do not split into {parts} parts")
        step = self.nbytes // parts
        return TensorRef(
            self.path, f"{self.name}.part{index}", self.offset + index * step, step, self.dtype,
            (rows // parts, *self.shape[1:]),
        )


def decode(ref: TensorRef, raw: bytes | bytearray | memoryview | np.ndarray, order: str = "C") -> np.ndarray:
    """Bytes of ``ref`` → float32 array of ``ref.shape`` (dequantising GGML blocks); U8 → a uint8 copy.

    ``order="F"`` returns a 2-D float matrix input-major (Fortran order)."""
    out = decode_array(ref.dtype, ref.shape, np.frombuffer(raw, dtype=np.uint8, count=ref.nbytes),
                       f"{ref.path}: tensor {ref.name}")
    return np.asfortranarray(out) if order == "F" and out.ndim == 2 and ref.dtype != "U8" else out


def decode_array(dtype: str, shape: tuple[int, ...], buf: np.ndarray, where: str = "weights") -> np.ndarray:
    """uint8 bytes of ``dtype`` → float32 array of ``shape`` (U8 → a uint8 copy). The reference
    decoding: plain types by NumPy, GGML blocks by `gguf.quants` (MXFP4 by our bit-identical copy)."""
    n_elements = int(np.prod(shape, dtype=np.int64))
    buf = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    if dtype == "U8":  # a copy: the expert store reuses its read buffer
        out = buf.copy()
    elif dtype == "BF16":
        wide = buf.view("<u2").astype(np.uint32) << 16
        out = wide.view(np.float32)
    elif dtype in PLAIN_DTYPES:
        out = buf.view(PLAIN_DTYPES[dtype]).astype(np.float32)
    else:
        out = _dequantize_ggml(dtype, buf, where)
    if out.size != n_elements:
        raise ModelFormatError(f"{where} holds {out.size} values, its shape {list(shape)} needs {n_elements}")
    return out.reshape(shape)


def _dequantize_ggml(dtype: str, buf: np.ndarray, where: str) -> np.ndarray:
    # Imported lazily: gguf pulls in more than a safetensors-only run needs.
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if dtype == "MXFP4":  # our own, bit-identical to gguf.quants (tests/test_families_extra.py)
        from .mxfp4 import dequantize_ggml

        return dequantize_ggml(buf)
    try:
        qtype = GGMLQuantizationType[dtype]
    except KeyError:
        raise UnsupportedModelError(f"{where} has unknown type {dtype}") from None
    try:
        return dequantize(buf, qtype).astype(np.float32, copy=False).reshape(-1)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"{where} uses {dtype}, which the gguf package cannot dequantise; "
            "re-export the model as F16, BF16, Q8_0, Q4_0 or Q4_K"
        ) from None


def read_bytes(ref: TensorRef, fd: int | None = None) -> bytes:
    """One ``pread`` of the tensor's byte range (buffered; the expert store does O_DIRECT)."""
    own = fd is None
    if own:
        fd = os.open(ref.path, os.O_RDONLY)
    try:
        data = os.pread(fd, ref.nbytes, ref.offset)
    finally:
        if own:
            os.close(fd)
    if len(data) != ref.nbytes:
        raise ModelFormatError(
            f"{ref.path}: short read of tensor {ref.name} ({len(data)} of {ref.nbytes} bytes): the file is truncated"
        )
    return data


def load(ref: TensorRef, fd: int | None = None) -> np.ndarray:
    return decode(ref, read_bytes(ref, fd))
