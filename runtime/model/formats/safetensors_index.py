"""Read safetensors headers into `TensorRef`s without loading any tensor data.

The safetensors library loads tensors; we need byte ranges (for expert offloading), so the header
(8-byte little-endian length + JSON) is parsed here and validated against the file size before
anything is allocated.
"""

from __future__ import annotations

import json
import os
import struct

from ... import jsonfile
from ...errors import ModelFormatError
from .tensors import PLAIN_DTYPES, TensorRef

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors spec's own limit


def read_header(path: str) -> dict[str, TensorRef]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFormatError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ModelFormatError(
                f"{path}: not a safetensors file or truncated (header claims {n} bytes, file has {size})"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ModelFormatError(f"{path}: safetensors header is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + n
    refs: dict[str, TensorRef] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (*shape, begin, end)):
                raise TypeError
        except (TypeError, KeyError, ValueError):
            raise ModelFormatError(f"{path}: tensor {name}: malformed header entry (needs dtype, integer shape "
                                   "and data_offsets)") from None
        if not isinstance(dtype, str):
            raise ModelFormatError(f"{path}: tensor {name}: dtype must be a string")
        if dtype not in PLAIN_DTYPES:
            raise ModelFormatError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        if any(d < 0 for d in shape):
            raise ModelFormatError(f"{path}: tensor {name}: negative dimension in shape {list(shape)}")
        count = 1
        for d in shape:
            count *= d
        expected = count * PLAIN_DTYPES[dtype].itemsize
        if not 0 <= begin <= end or end - begin != expected:
            raise ModelFormatError(
                f"{path}: tensor {name}: data_offsets {begin}..{end} do not hold shape {list(shape)} of {dtype}"
            )
        if data_start + end > size:
            raise ModelFormatError(
                f"{path}: truncated: tensor {name} ends at byte {data_start + end}, the file has {size}"
            )
        spans.append((begin, end, name))
        refs[name] = TensorRef(path, name, data_start + begin, end - begin, dtype, shape)
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ModelFormatError(f"{path}: tensors {n0} and {n1} overlap")
    return refs


def index_folder(folder: str) -> dict[str, TensorRef]:
    """All tensors of a Hugging Face folder (single file or sharded with an index)."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = jsonfile.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelFormatError(f"{index_path}: not a valid safetensors index (needs a 'weight_map' object)") from None
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        weight_map = None
    if not files:
        raise ModelFormatError(f"{folder}: no *.safetensors files found")
    refs: dict[str, TensorRef] = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise ModelFormatError(f"{index_path}: lists {name}, which is missing from the folder")
        refs.update(read_header(path))
    if weight_map is not None:
        missing = [t for t in weight_map if t not in refs]
        if missing:
            raise ModelFormatError(f"{index_path}: tensor {missing[0]} is listed but not in {weight_map[missing[0]]}")
    return refs
