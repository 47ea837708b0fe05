"""Backs docs/performance/peer.md, "At OLMoE-1B-7B's size, every common type" (and the GPT-OSS-20B,
DeepSeek-V2-Lite and Qwen3-30B-A3B sections; docs/performance/quant-types.md): the random-weight files
in released models' shapes that peer.py and quant_types.py time.

Random-weight GGUFs in the shapes of released MoE models, for speed and memory benchmarks.

    python benchmarks/real_models.py --preset olmoe-1b-7b --type Q4_0 --out /data/olmoe-q4_0.gguf
    python benchmarks/real_models.py --preset olmoe-1b-7b --type Q4_K_M --out /data/olmoe-q4_k_m.gguf \\
        --quantize ~/.cache/s2moe-peer/build/bin/llama-quantize
    python benchmarks/real_models.py --preset gpt-oss-20b --type MXFP4 --out /data/gpt-oss-20b-mxfp4.gguf

Presets: olmoe-1b-7b, qwen3-30b-a3b, mixtral-8x7b, gpt-oss-20b (MXFP4: experts MXFP4, the rest
Q8_0, as the released file) and deepseek-v2-lite (MLA, a dense first layer, shared experts). A
tensor whose rows are not whole blocks of the type (GPT-OSS's 2880, DeepSeek's 128-wide k_b
against the super-block types) is written as Q8_0, as llama-quantize falls back.

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
    # biases on q/k/v/o, the router and the experts, a sink per head, sliding window on every other
    # layer, YaRN; rows of 2880 are not whole super-blocks, so K-quant files keep them as Q8_0
    "gpt-oss-20b": dict(arch="gpt-oss", hidden=2880, layers=24, experts=32, top_k=4, ffn=2880, heads=64, kv_heads=8,
                        head_dim=64, vocab=201088, ctx=131072, qk_norm="none", norm_topk=True, rope_theta=150000.0,
                        window=128, yarn=(32.0, 4096)),
    # multi-head latent attention (q without LoRA), a dense first layer, two shared experts, YaRN
    "deepseek-v2-lite": dict(arch="deepseek2", hidden=2048, layers=27, experts=64, top_k=6, ffn=1408, heads=16,
                             kv_heads=16, head_dim=192, vocab=102400, ctx=163840, qk_norm="none", norm_topk=False,
                             rope_theta=10000.0, kv_lora=512, rope_dim=64, v_dim=128, dense_layers=1,
                             dense_ffn=10944, shared=2, yarn=(40.0, 4096), mscale=0.707),
}
# Types written directly; the mixes go through llama-quantize. Q4_K_MIX is written directly too:
# Q4_K with Q6_K for the experts' down projections, attn_v and the output, the tensors Q4_K_M
# raises (it raises half the layers' down projections; this every layer): a file with Q4_K_M's
# two types and no llama.cpp build (the GPU benchmark, tests)
DIRECT = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4",
          "Q4_K_MIX")
_MIX_Q6_K = ("ffn_down_exps.weight", "attn_v.weight", "output.weight")
MIXES = ("Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M")
# Where each type keeps its f16 block scale, and its min's scale if any (the rest: codes, sub-scales)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
              "MXFP4": ()}  # (MXFP4's scale is one E8M0 byte, set in _blocks)


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
    if dtype == "MXFP4":  # 2^(e − 127): the nearest power of two
        raw[:, 0] = np.clip(127 + np.round(np.log2(scale)) + rng.integers(-1, 1, n, endpoint=True), 1, 254)
    for i, at in enumerate(F16_FIELDS[dtype]):
        s = scale * (1.0 if i == 0 else 0.1)
        raw[:, at:at + 2] = rng.uniform(0.8 * s, 1.2 * s, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(-1)


def tensors(p: dict):
    """(GGUF name, numpy shape, kind) in llama.cpp's order; kind: weight, expert (a weight of the
    experts), norm (F32 ones), router and bias (F32, small)."""
    H, D, E, I = p["hidden"], p["head_dim"], p["experts"], p["ffn"]
    yield "token_embd.weight", (p["vocab"], H), "embed"
    yield "output_norm.weight", (H,), "norm"
    yield "output.weight", (p["vocab"], H), "weight"
    if p["arch"] in ("gpt-oss", "deepseek2"):
        yield from (_gpt_oss if p["arch"] == "gpt-oss" else _deepseek2)(p)
        return
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
        yield from _experts(b, E, I, H)


def _experts(b: str, E: int, I: int, H: int, bias: bool = False):
    yield b + "ffn_gate_exps.weight", (E, I, H), "expert"
    yield b + "ffn_up_exps.weight", (E, I, H), "expert"
    yield b + "ffn_down_exps.weight", (E, H, I), "expert"
    if bias:
        yield b + "ffn_gate_exps.bias", (E, I), "bias"
        yield b + "ffn_up_exps.bias", (E, I), "bias"
        yield b + "ffn_down_exps.bias", (E, H), "bias"


def _gpt_oss(p: dict):
    H, D, E, I, nh, nkv = p["hidden"], p["head_dim"], p["experts"], p["ffn"], p["heads"], p["kv_heads"]
    for L in range(p["layers"]):
        b = f"blk.{L}."
        yield b + "attn_norm.weight", (H,), "norm"
        for name, rows in (("attn_q", nh * D), ("attn_k", nkv * D), ("attn_v", nkv * D)):
            yield b + name + ".weight", (rows, H), "weight"
            yield b + name + ".bias", (rows,), "bias"
        yield b + "attn_output.weight", (H, nh * D), "weight"
        yield b + "attn_output.bias", (H,), "bias"
        yield b + "attn_sinks.weight", (nh,), "bias"
        yield b + "post_attention_norm.weight", (H,), "norm"
        yield b + "ffn_gate_inp.weight", (E, H), "router"
        yield b + "ffn_gate_inp.bias", (E,), "bias"
        yield from _experts(b, E, I, H, bias=True)


def _deepseek2(p: dict):
    H, E, I, nh = p["hidden"], p["experts"], p["ffn"], p["heads"]
    dk, dv, r, kv = p["head_dim"], p["v_dim"], p["rope_dim"], p["kv_lora"]
    for L in range(p["layers"]):
        b = f"blk.{L}."
        yield b + "attn_norm.weight", (H,), "norm"
        yield b + "attn_q.weight", (nh * dk, H), "weight"
        yield b + "attn_kv_a_mqa.weight", (kv + r, H), "weight"
        yield b + "attn_kv_a_norm.weight", (kv,), "norm"
        yield b + "attn_k_b.weight", (nh, kv, dk - r), "weight"
        yield b + "attn_v_b.weight", (nh, dv, kv), "weight"
        yield b + "attn_output.weight", (H, nh * dv), "weight"
        yield b + "ffn_norm.weight", (H,), "norm"
        if L < p["dense_layers"]:
            F = p["dense_ffn"]
            yield b + "ffn_gate.weight", (F, H), "weight"
            yield b + "ffn_up.weight", (F, H), "weight"
            yield b + "ffn_down.weight", (H, F), "weight"
            continue
        yield b + "ffn_gate_inp.weight", (E, H), "router"
        yield from _experts(b, E, I, H)
        S = I * p["shared"]
        yield b + "ffn_gate_shexp.weight", (S, H), "weight"
        yield b + "ffn_up_shexp.weight", (S, H), "weight"
        yield b + "ffn_down_shexp.weight", (H, S), "weight"


def stored_type(dtype: str, kind: str, row: int, name: str = "") -> str:
    """The type a tensor is written in: ``dtype``, MXFP4 for the experts only (as the released
    GPT-OSS files: the rest Q8_0), and Q8_0 where a row is not whole blocks of ``dtype`` (as
    llama-quantize falls back: GPT-OSS's 2880, DeepSeek's 128-wide k_b)."""
    from s2moe.runtime.kernels.stored import BLOCKS

    if dtype == "Q4_K_MIX":
        dtype = "Q6_K" if name.endswith(_MIX_Q6_K) else "Q4_K"
    if dtype == "MXFP4" and kind != "expert":
        dtype = "Q8_0"
    return dtype if row % BLOCKS[dtype][0] == 0 else "Q8_0"


def _metadata(w, p: dict) -> None:
    """The keys llama.cpp's gpt-oss and deepseek2 loaders read past the common ones."""
    import gguf

    if "yarn" in p:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(p["yarn"][0])
        w.add_rope_scaling_orig_ctx_len(p["yarn"][1])
    if p["arch"] == "gpt-oss":
        w.add_sliding_window(p["window"])
    if p["arch"] == "deepseek2":
        w.add_rope_scaling_yarn_log_mul(0.1 * p["mscale"])
        w.add_head_count_kv(1)  # llama.cpp's absorbed MLA: one latent "head"
        w.add_key_length(p["kv_lora"] + p["rope_dim"])
        w.add_value_length(p["kv_lora"])
        w.add_key_length_mla(p["head_dim"])
        w.add_value_length_mla(p["v_dim"])
        w.add_rope_dimension_count(p["rope_dim"])
        w.add_q_lora_rank(0)
        w.add_kv_lora_rank(p["kv_lora"])
        w.add_leading_dense_block_count(p["dense_layers"])
        w.add_feed_forward_length(p["dense_ffn"])
        w.add_expert_shared_count(p["shared"])
        w.add_expert_weights_scale(1.0)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)


def write(preset: str, dtype: str, out: str, seed: int = 0, progress=None, aligned: bool = True,
          override: dict | None = None, sparse: bool = False) -> str:
    """Write ``preset`` with every weight matrix stored as ``dtype`` (one of DIRECT) to ``out``, its
    tensors on page boundaries (``aligned``: as `s2moe convert` writes, so O_DIRECT reads hold each
    expert at its stored size) or on GGUF's default 32 bytes. ``override`` replaces preset fields
    (``layers``, ``vocab``: a real-shaped layer in a small file). ``sparse`` leaves the tensor data
    as holes (zeros that take no disk): a file for sizes and memory plans (`s2moe info`), not runs."""
    import gguf

    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.kernels.stored import BLOCKS, row_bytes
    from s2moe.runtime.model.formats.gguf_tokenizer import add_tokenizer
    from s2moe.runtime.model.formats.gguf_writer import ALIGNMENT, _drop_written
    from s2moe.runtime.outputs import publish, temp_beside

    p = {**PRESETS[preset], **(override or {})}
    rng = np.random.default_rng(seed)
    tmp = temp_beside(out, ".gguf.tmp")
    try:
        w = gguf.GGUFWriter(tmp, p["arch"])
        w.add_name(f"{preset} (random weights, s2moe benchmarks/real_models.py)")
        w.add_block_count(p["layers"])
        w.add_context_length(p["ctx"])
        w.add_embedding_length(p["hidden"])
        if p["arch"] != "deepseek2":  # (its feed_forward_length is the dense layers': _metadata)
            w.add_feed_forward_length(p["ffn"])
        w.add_expert_feed_forward_length(p["ffn"])
        w.add_head_count(p["heads"])
        if p["arch"] != "deepseek2":  # (MLA's are its latent's: _metadata)
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
        _metadata(w, p)
        if aligned:
            w.add_custom_alignment(ALIGNMENT)
        planned = list(tensors(p))
        types = {name: stored_type(dtype, kind, dims[-1], name) for name, dims, kind in planned}
        units: dict[str, float] = {}
        for name, shape, kind in planned:
            if kind in ("weight", "expert", "embed"):
                nbytes = int(np.prod(shape[:-1])) * row_bytes(types[name], shape[-1])
                w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes,
                                  raw_dtype=gguf.GGMLQuantizationType[types[name]])
            else:
                w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, shape, kind) in enumerate(planned):
            if sparse:  # what write_tensor_data does, with a hole for the bytes
                fout = w.fout[0]
                ti = w.tensors[0].pop(name)
                w.write_padding(fout, fout.tell())
                fout.seek(ti.nbytes, os.SEEK_CUR)
                w.write_padding(fout, ti.nbytes)
                fout.truncate(fout.tell())
                continue
            if kind == "norm":
                data = np.ones(shape, np.float32)
            elif kind == "router":
                data = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
            elif kind == "bias":
                data = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
            else:  # the embedding's rows have std 1, a product's weights std 1/sqrt(fan-in)
                t = types[name]
                if t not in units:
                    units[t] = _unit_std(t)
                std = 1.0 if kind == "embed" else 1.0 / np.sqrt(shape[-1])
                per = BLOCKS[t][1] * shape[-1] // BLOCKS[t][0]
                data = _blocks(rng, t, int(np.prod(shape)), std / units[t]).reshape(*shape[:-1], per)
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
    ap.add_argument("--sparse", action="store_true", help="tensor data as holes: sizes only (s2moe info)")
    a = ap.parse_args()
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(f"{a.preset} {a.type}", total=None)
        progress = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
        if a.sparse:
            if a.type.upper() not in DIRECT:
                raise SystemExit(f"error: --sparse writes a direct type ({', '.join(DIRECT)}), not {a.type}")
            write(a.preset, a.type.upper(), a.out, a.seed, progress, sparse=True)
        else:
            make(a.preset, a.type.upper(), a.out, a.quantize, a.seed, progress)
    print(a.out)


if __name__ == "__main__":
    main()
