"""Expert weights behind one interface: ``provider.get(layer, expert_ids) -> [ExpertWeights]``.

The forward pass calls ``get`` once per MoE layer per pass with the distinct experts that layer's
tokens chose, so each expert's weights are fetched at most once per pass. `ExpertCache`
(runtime/offload/cache.py) is the provider; `ExpertStore` (runtime/offload/store.py) the slow tier
behind it.

An expert stays in its stored encoding: gate/up/down are `StoredMatrix` views of the bytes read
from the file (zero copy), so a resident expert costs its stored bytes (plus page rounding under
O_DIRECT). Only what has no kernel is converted: biases (tiny) to float32, block types without a
kernel to F32, and GPT-OSS's input-major plain experts, which must be transposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from ..kernels.stored import StoredMatrix, kernel_type
from ..model.formats.mxfp4 import hf_to_ggml_blocks
from ..model.formats.tensors import TensorRef, decode_array


@dataclass
class ExpertWeights:
    gate: StoredMatrix | np.ndarray  # [I, H]; `DeviceStored` (or a device array) on a device backend
    up: StoredMatrix | np.ndarray  # [I, H]
    down: StoredMatrix | np.ndarray  # [H, I]
    gate_bias: np.ndarray | None = None  # [I] float32
    up_bias: np.ndarray | None = None  # [I]
    down_bias: np.ndarray | None = None  # [H]
    ready: object = None  # device backends: the copy-stream event to wait for before use
    pinned: bool = False  # host arrays already in page-locked memory (HostTier)
    alloc_bytes: int | None = None  # memory actually held (read buffers, page-rounded), when known
    kernel_args: tuple | None = None  # the CPU kernels' view of these parts and the parts it was built from (kernels/cpu.py)

    @property
    def nbytes(self) -> int:
        if self.alloc_bytes is not None:
            return self.alloc_bytes
        arrays = (self.gate, self.up, self.down, self.gate_bias, self.up_bias, self.down_bias)
        return sum(a.nbytes for a in arrays if a is not None)


# How the parts of one expert become `ExpertWeights` (the names are the parts' roles):
#   "split"       gate [I, H], up [I, H], down [H, I] (+ gate_bias, up_bias, down_bias): per-expert
#                 tensors, GGUF merged/split, and the other families' fused gate_up (split by rows)
#   "interleaved" GPT-OSS: gate_up [H, 2I] input-major, gate = even columns, up = odd; down [I, H];
#                 gate_up_bias [2I] interleaved the same way; down_bias [H]
#   "interleaved_mxfp4"  GPT-OSS MXFP4 safetensors: gate_up_blocks/_scales [2I, H/32, 16]/[2I, H/32]
#                 (output-major, gate = even rows), down_blocks/_scales [H, I/32, 16]/[H, I/32];
#                 repacked into GGML MXFP4 rows (same bytes, same numbers); biases as above
LAYOUTS = ("split", "interleaved", "interleaved_mxfp4")
WEIGHTS = ("gate", "up", "down")


def _float(ref: TensorRef, raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(decode_array(ref.dtype, ref.shape, raw, f"{ref.path}: tensor {ref.name}"),
                                dtype=np.float32)


def stored(ref: TensorRef, raw: np.ndarray) -> StoredMatrix:
    """A 2-D weight as stored (zero copy), or decoded to F32 when its type has no kernel."""
    if kernel_type(ref.dtype, ref.shape[-1]):
        return StoredMatrix(raw, ref.dtype, tuple(ref.shape))
    return StoredMatrix.from_float(_float(ref, raw))


def kept_stored(layout: str, role: str, ref: TensorRef) -> bool:
    """Does this part stay in its read buffer (True), or become a new array (False)?"""
    return layout == "split" and role in WEIGHTS and kernel_type(ref.dtype, ref.shape[-1])


def converted_bytes(layout: str, role: str, ref: TensorRef) -> int:
    """Bytes of the new array a converted part becomes (0 for a part kept stored)."""
    if kept_stored(layout, role, ref):
        return 0
    if layout == "interleaved_mxfp4" and not role.endswith("_bias"):
        return ref.nbytes if role.endswith("_blocks") else ref.n_elements  # 16 + 1 bytes per 32 values
    return 4 * ref.n_elements  # float32


def assemble(layout: str, parts: dict[str, tuple[TensorRef, np.ndarray]]) -> ExpertWeights:
    """Parts (role → (ref, raw uint8 bytes)) → `ExpertWeights`."""
    bias = {role: _float(ref, raw) for role, (ref, raw) in parts.items() if role.endswith("_bias")}
    if layout == "split":
        gate, up, down = (stored(*parts[role]) for role in WEIGHTS)
        return ExpertWeights(gate, up, down, bias.get("gate_bias"), bias.get("up_bias"), bias.get("down_bias"))
    if layout == "interleaved":  # input-major plain weights: transpose once, F32
        gate_up = _float(*parts["gate_up"]).T  # [2I, H]
        down = _float(*parts["down"]).T  # [H, I]
        gate, up = StoredMatrix.from_float(gate_up[0::2]), StoredMatrix.from_float(gate_up[1::2])
        down = StoredMatrix.from_float(down)
    elif layout == "interleaved_mxfp4":
        gate_up = _mxfp4(parts["gate_up_blocks"], parts["gate_up_scales"])
        gate, up, down = gate_up.rows(slice(0, None, 2)), gate_up.rows(slice(1, None, 2)), \
            _mxfp4(parts["down_blocks"], parts["down_scales"])
    else:
        raise ValueError(f"unknown expert layout {layout!r}")
    gub = bias.get("gate_up_bias")
    return ExpertWeights(gate, up, down, None if gub is None else np.ascontiguousarray(gub[0::2]),
                         None if gub is None else np.ascontiguousarray(gub[1::2]), bias.get("down_bias"))


def _mxfp4(blocks: tuple[TensorRef, np.ndarray], scales: tuple[TensorRef, np.ndarray]) -> StoredMatrix:
    (_, braw), (sref, sraw) = blocks, scales
    rows, groups = sref.shape
    packed = hf_to_ggml_blocks(braw.reshape(rows, groups, 16), sraw.reshape(rows, groups))
    return StoredMatrix(packed.reshape(-1), "MXFP4", (rows, groups * 32))


class ExpertProvider(Protocol):
    def get(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]: ...
