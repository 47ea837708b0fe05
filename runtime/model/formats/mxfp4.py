"""MXFP4 (OCP microscaling FP4): blocks of 32 E2M1 values sharing one E8M0 power-of-two scale.

Two byte layouts of the same numbers:
- Hugging Face (GPT-OSS safetensors): `*_blocks` uint8 [..., G, 16] and `*_scales` uint8 [..., G].
  In each byte the low nibble is the even element, the high nibble the odd one; a value is
  FP4 · 2^(scale − 127). Bit-identical to transformers' `_convert_moe_packed_tensors` (float32).
- GGML (`MXFP4` in GGUF): 17-byte blocks, the E8M0 byte first, then 16 bytes whose low nibbles are
  elements 0–15 and high nibbles elements 16–31. ggml multiplies doubled E2M1 values by half the
  scale (`ggml_e8m0_to_fp32_half`); doing the same keeps the products bit-identical to gguf.quants.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
GGML_BLOCK_BYTES = 17
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)
# ggml's kvalues_mxfp4: doubled E2M1 as int8, so its "-0" is a plain 0 (kept for bit equality)
_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def dequantize_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] → float32 [..., G · 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    values = np.empty(blocks.shape[:-1] + (BLOCK,), dtype=np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*scales.shape[:-1], -1)


def dequantize_ggml(raw: np.ndarray) -> np.ndarray:
    """uint8 bytes of n GGML MXFP4 blocks → float32 [n · 32]."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, GGML_BLOCK_BYTES)
    e = blocks[:, :1].astype(np.uint32)
    half_scale = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).view(np.float32)
    qs = blocks[:, 1:]
    idx = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    with np.errstate(over="ignore"):  # E8M0 254/255 × 12 overflows to inf, as in ggml
        return (half_scale * _DOUBLED[idx]).reshape(-1)


def hf_to_ggml_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hugging Face blocks uint8 [..., G, 16] + scales [..., G] → GGML MXFP4 bytes [..., G · 17]:
    the same codes and scales, nibbles regrouped (HF pairs elements 2j, 2j+1 in byte j; GGML pairs
    j and j + 16) and the E8M0 byte put first, so the CPU kernels read GPT-OSS's experts as stored."""
    b = np.asarray(blocks, dtype=np.uint8)
    codes = np.empty(b.shape[:-1] + (BLOCK,), dtype=np.uint8)
    codes[..., 0::2] = b & 0x0F
    codes[..., 1::2] = b >> 4
    out = np.empty(b.shape[:-1] + (GGML_BLOCK_BYTES,), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(*b.shape[:-2], -1)
