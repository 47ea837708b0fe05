"""Random-weight GGUFs in the shapes of released MoE models, for speed and memory benchmarks.

    python benchmarks/real_models.py --preset olmoe-1b-7b --type Q4_0 --out /data/olmoe-q4_0.gguf
    python benchmarks/real_models.py --preset olmoe-1b-7b --type Q4_K_M --out /data/olmoe-q4_k_m.gguf \\
        --quantize ~/.cache/s2moe-peer/build/bin/llama-quantize

Blocks are written directly as random valid bytes of the stored type (no float weights, no
quantiser): random codes and packed sub-scales, block scales drawn so each weight matrix has a
standard deviation near 1/sqrt(fan-in), so activations stay finite through every layer. Tensors are
made and written one at a time (the largest, a merged expert tensor or the embedding, bounds the
memory: 0.3 GB for Qwen3-30B-A3B at Q8_0) and the written pages are dropped from the page cache.

A K-quant mix (Q4_K_M, Q5_K_M, Q3_K_M, …) is llama.cpp's own choice of types per tensor: the file is
written as Q8_0, then `llama-quantize --allow-requantize` makes the mix (peer.py --build builds it).
Random weights carry no text: for speed and memory only, never for quality or acceptance.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The shapes of the released models (their config.json), in GGUF's architecture names
PRESETS = {
    "olmoe-1b-7b": dict(arch="olmoe", hidden=2048, layers=16, experts=64, top_k=8, ffn=1024, heads=16, kv_heads=16,
                        head_dim=128, vocab=50304, ctx=4096, qk_norm="full", norm_topk=False, rope_theta=10000.0),
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, layers=48, experts=128, top_k=8, ffn=768, heads=32,
                          kv_heads=4, head_dim=128, vocab=151936, ctx=40960, qk_norm="per_head", norm_topk=True,
                          rope_theta=1e6),
    "mixtral-8x7b": dict(arch="llama", hidden=4096, layers=32, experts=8, top_k=2, ffn=14336, heads=32, kv_heads=8,
                         head_dim=128, vocab=32000, ctx=32768, qk_norm="none", norm_topk=True, rope_theta=1e6),
}
# Types written directly; the mixes go through llama-quantize
DIRECT = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
MIXES = ("Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M")
# Where each type keeps its f16 block scale, and its min's scale if any (the rest: codes, sub-scales)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def _unit_std(dtype: str) -> float:
    """The standard deviation of a weight whose block scale is 1 (its min's 0.1)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from s2moe.runtime.kernels.stored import BLOCKS

    rng = np.random.default_rng(0)
    raw = _blocks(rng, dtype, 64 * BLOCKS[dtype][0], 1.0)
    return float(dequantize(raw, GGMLQuantizationType[dtype]).std())


def _blocks(rng, dtype: str, n_values: int, scale: float) -> np.ndarray:
    """Random valid blocks of ``dtype`` holding ``n_values`` values, block scales near ``scale``."""
    from s2moe.runtime.kernels.stored import BLOCKS

    values, nbytes = BLOCKS[dtype]
    n = n_values // values
    raw = np.frombuffer(rng.bytes(n * nbytes), dtype=np.uint8).reshape(n, nbytes).copy()
    for i, at in enumerate(F16_FIELDS[dtype]):
        s = scale * (1.0 if i == 0 else 0.1)
        raw[:, at:at + 2] = rng.uniform(0.8 * s, 1.2 * s, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(-1)


def tensors(p: dict):
    """(GGUF name, numpy shape, kind) in llama.cpp's order; kind: weight, norm (F32 ones), router (F32)."""
    H, D, E, I = p["hidden"], p["head_dim"], p["experts"], p["ffn"]
    yield "token_embd.weight", (p["vocab"], H), "embed"
    yield "output_norm.weight", (H,), "norm"
    yield "output.weight", (p["vocab"], H), "weight"
    for L in range(p["layers"]):
        b = f"blk.{L}."
        yield b + "attn_norm.weight", (H,), "norm"
        yield b + "attn_q.weight", (p["heads"] * D, H), "weight"
        yield b + "attn_k.weight", (p["kv_heads"] * D, H), "weight"
        yield b + "attn_v.weight", (p["kv_heads"] * D, H), "weight"
        yield b + "attn_output.weight", (H, p["heads"] * D), "weight"
        if p["qk_norm"] == "full":
            yield b + "attn_q_norm.weight", (p["heads"] * D,), "norm"
            yield b + "attn_k_norm.weight", (p["kv_heads"] * D,), "norm"
        elif p["qk_norm"] == "per_head":
            yield b + "attn_q_norm.weight", (D,), "norm"
            yield b + "attn_k_norm.weight", (D,), "norm"
        yield b + "ffn_norm.weight", (H,), "norm"
        yield b + "ffn_gate_inp.weight", (E, H), "router"
        yield b + "ffn_gate_exps.weight", (E, I, H), "weight"
        yield b + "ffn_up_exps.weight", (E, I, H), "weight"
        yield b + "ffn_down_exps.weight", (E, H, I), "weight"


def write(preset: str, dtype: str, out: str, seed: int = 0, progress=None, aligned: bool = True) -> str:
    """Write ``preset`` with every weight matrix stored as ``dtype`` (one of DIRECT) to ``out``, its
    tensors on page boundaries (``aligned``: as `s2moe convert` writes, so O_DIRECT reads hold each
    expert at its stored size) or on GGUF's default 32 bytes."""
    import gguf

    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.kernels.stored import BLOCKS, row_bytes
    from s2moe.runtime.model.formats.gguf_tokenizer import add_tokenizer
    from s2moe.runtime.model.formats.gguf_writer import ALIGNMENT, _drop_written
    from s2moe.runtime.outputs import publish, temp_beside

    p = PRESETS[preset]
    rng = np.random.default_rng(seed)
    unit = _unit_std(dtype)
    tmp = temp_beside(out, ".gguf.tmp")
    try:
        w = gguf.GGUFWriter(tmp, p["arch"])
        w.add_name(f"{preset} (random weights, s2moe benchmarks/real_models.py)")
        w.add_block_count(p["layers"])
        w.add_context_length(p["ctx"])
        w.add_embedding_length(p["hidden"])
        w.add_feed_forward_length(p["ffn"])
        w.add_expert_feed_forward_length(p["ffn"])
        w.add_head_count(p["heads"])
        w.add_head_count_kv(p["kv_heads"])
        w.add_key_length(p["head_dim"])
        w.add_value_length(p["head_dim"])
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(p["rope_theta"])
        w.add_expert_count(p["experts"])
        w.add_expert_used_count(p["top_k"])
        w.add_expert_weights_norm(p["norm_topk"])
        w.add_vocab_size(p["vocab"])
        add_tokenizer(w, os.path.join(str(DEFAULT_MODEL), "tokenizer.json"), p["vocab"])
        if aligned:
            w.add_custom_alignment(ALIGNMENT)
        qtype = gguf.GGMLQuantizationType[dtype]
        planned = list(tensors(p))
        for name, shape, kind in planned:
            if kind == "weight" or kind == "embed":
                nbytes = int(np.prod(shape[:-1])) * row_bytes(dtype, shape[-1])
                w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
            else:
                w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, shape, kind) in enumerate(planned):
            if kind == "norm":
                data = np.ones(shape, np.float32)
            elif kind == "router":
                data = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
            else:  # the embedding's rows have std 1, a product's weights std 1/sqrt(fan-in)
                std = 1.0 if kind == "embed" else 1.0 / np.sqrt(shape[-1])
                per = BLOCKS[dtype][1] * shape[-1] // BLOCKS[dtype][0]
                data = _blocks(rng, dtype, int(np.prod(shape)), std / unit).reshape(*shape[:-1], per)
            w.write_tensor_data(data)
            data = None
            _drop_written(w)
            if progress:
                progress(i + 1, len(planned))
        w.close()
        publish(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def make(preset: str, kind: str, out: str, quantize: str | None = None, seed: int = 0, progress=None) -> str:
    """``kind``: a DIRECT type, or a llama-quantize mix (written as Q8_0, then requantised)."""
    if kind in DIRECT:
        return write(preset, kind, out, seed, progress)
    if kind not in MIXES:
        raise SystemExit(f"error: --type {kind}: choose one of {', '.join(sorted(set(DIRECT + MIXES)))}")
    if not quantize or not os.path.exists(quantize):
        raise SystemExit(f"error: --type {kind} is a llama.cpp mix: give --quantize PATH/llama-quantize "
                         "(python benchmarks/peer.py --build makes it)")
    source = out + ".q8_0.tmp"
    # (llama-quantize keeps a source's general.alignment but does not align its data to it: the
    # source keeps GGUF's default, and so does the mix)
    write(preset, "Q8_0", source, seed, progress, aligned=False)
    try:
        r = subprocess.run([quantize, "--allow-requantize", source, out, kind, str(os.cpu_count() or 2)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"error: llama-quantize failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
    finally:
        os.unlink(source)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--type", default="Q4_0", help="a stored type (Q8_0, Q4_0, Q6_K, …) or a mix (Q4_K_M, …)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quantize", help="llama-quantize, for the mixes")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(f"{a.preset} {a.type}", total=None)
        make(a.preset, a.type.upper(), a.out, a.quantize, a.seed,
             lambda done, total: bar.update(task, completed=done, total=total))
    print(a.out)


if __name__ == "__main__":
    main()
