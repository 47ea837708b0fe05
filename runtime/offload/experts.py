"""Expert weights behind one interface: ``provider.get(layer, expert_ids) -> [ExpertWeights]``.

The forward pass calls ``get`` once per MoE layer per pass with the distinct experts that layer's
tokens chose, so each expert's weights are fetched at most once per pass. `ExpertCache`
(runtime/offload/cache.py) is the provider; `ExpertStore` (runtime/offload/store.py) the slow tier behind it.

On disk an expert is a few named byte ranges in one of several layouts; `assemble` turns the
decoded parts into the one compute format (float32, gate/up [I, H], down [H, I], optional biases).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import numpy as np

from ..model.formats.mxfp4 import dequantize_hf


@dataclass
class ExpertWeights:
    gate: np.ndarray  # [I, H]
    up: np.ndarray  # [I, H]
    down: np.ndarray  # [H, I]
    gate_bias: np.ndarray | None = None  # [I]
    up_bias: np.ndarray | None = None  # [I]
    down_bias: np.ndarray | None = None  # [H]
    ready: object = None  # device backends: the copy-stream event to wait for before use
    pinned: bool = False  # host arrays already in page-locked memory (HostTier)

    @property
    def nbytes(self) -> int:
        arrays = (self.gate, self.up, self.down, self.gate_bias, self.up_bias, self.down_bias)
        return sum(a.nbytes for a in arrays if a is not None)


# How the decoded parts of one expert become `ExpertWeights` (the names are the parts' roles):
#   "split"       gate [I, H], up [I, H], down [H, I] (+ gate_bias, up_bias, down_bias): per-expert
#                 tensors, GGUF merged/split, and the other families' fused gate_up (split by rows)
#   "interleaved" GPT-OSS: gate_up [H, 2I] input-major, gate = even columns, up = odd; down [I, H];
#                 gate_up_bias [2I] interleaved the same way; down_bias [H]
#   "interleaved_mxfp4"  GPT-OSS MXFP4 safetensors: gate_up_blocks/_scales dequantise to [2I, H]
#                 (output-major, gate = even rows), down_blocks/_scales to [H, I]; biases as above
LAYOUTS = ("split", "interleaved", "interleaved_mxfp4")


def _c(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _input_major(w: np.ndarray) -> np.ndarray:
    """[out, in] with ``w.T`` C-contiguous: what ``h @ w.T`` wants (see loader.LINEAR)."""
    return np.asfortranarray(w, dtype=np.float32)


def assemble(layout: str, parts: Mapping[str, np.ndarray]) -> ExpertWeights:
    if layout == "split":
        return ExpertWeights(_input_major(parts["gate"]), _input_major(parts["up"]), _input_major(parts["down"]),
                             parts.get("gate_bias"), parts.get("up_bias"), parts.get("down_bias"))
    if layout == "interleaved":
        gate_up, down = parts["gate_up"].T, parts["down"].T  # [2I, H], [H, I]
    elif layout == "interleaved_mxfp4":
        gate_up = dequantize_hf(parts["gate_up_blocks"], parts["gate_up_scales"])
        down = dequantize_hf(parts["down_blocks"], parts["down_scales"])
    else:
        raise ValueError(f"unknown expert layout {layout!r}")
    bias = parts.get("gate_up_bias")
    return ExpertWeights(
        _input_major(gate_up[0::2]), _input_major(gate_up[1::2]), _input_major(down),
        None if bias is None else _c(bias[0::2]), None if bias is None else _c(bias[1::2]),
        None if parts.get("down_bias") is None else _c(parts["down_bias"]),
    )


def resident_elements(role: str, n_elements: int) -> int:
    """Float32 values a stored part becomes: MXFP4 blocks hold two per byte, scales none."""
    if role.endswith("_blocks"):
        return 2 * n_elements
    if role.endswith("_scales"):
        return 0
    return n_elements


class ExpertProvider(Protocol):
    def get(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]: ...
