"""Write a loaded model as GGUF with llama.cpp's names and conventions (via the `gguf` writer).

Experts can be written merged (`blk.L.ffn_gate_exps.weight`, llama.cpp's default) or split one
tensor per (layer, expert, projection) (`blk.L.ffn_gate.NNN.weight`, the published S²-MoE fork).
Tensor names come from the architecture files' GGUF tables (one source of truth with the loader).
Norms, biases, sinks and the router stay F32 (llama.cpp's habit); 2-D weights take the requested
type where their rows divide into its blocks, else F16. The file is written to a temp name, then
renamed, streaming: tensors are planned first and written one at a time (a merged expert tensor
one expert at a time), read with O_DIRECT, so converting needs about one tensor's memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ...errors import UsageError
from ...outputs import publish, temp_beside
from ..loader import BIASES, PROJECTIONS, LoadedModel
from ..models import BY_GGUF_ARCH, names_for
from .gguf_tokenizer import add_tokenizer

GGUF_ARCH = {"olmoe": "olmoe", "qwen3_moe": "qwen3moe", "mixtral": "llama", "deepseek_v2": "deepseek2",
             "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss"}
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
# Tensor data aligned to pages: every expert slice of a merged tensor whose size is a multiple of
# 4 KiB starts on a page, so O_DIRECT reads it with no rounding and a resident expert costs exactly
# its stored bytes. llama.cpp honours `general.alignment`.
ALIGNMENT = 4096


def repeated_kv_heads(c) -> bool:
    """llama.cpp's OLMoE loader wants k_norm as wide as q (it assumes as many KV heads as query
    heads): a grouped-query OLMoE is written with each KV head repeated for its query heads. The
    function is the same: RMSNorm over repeated values keeps their mean square, and every query
    head sees a copy of its group's key and value."""
    return c.arch == "olmoe" and c.qk_norm == "full" and c.num_kv_heads < c.num_heads


def _repeat_kv(w: np.ndarray, c) -> np.ndarray:
    """[kv_heads · D, …] → [heads · D, …]: each KV head's rows repeated for its query heads."""
    D, g = c.head_dim, c.num_heads // c.num_kv_heads
    return np.ascontiguousarray(np.repeat(w.reshape(c.num_kv_heads, D, *w.shape[1:]), g, axis=0)
                                .reshape(c.num_heads * D, *w.shape[1:]))


def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for interleaved RoPE (arch `llama`)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _f32(a) -> np.ndarray:
    """A tensor as float32 (stored matrices decoded by the reference path)."""
    from ...kernels.stored import StoredMatrix

    return a.dequantize() if isinstance(a, StoredMatrix) else np.asarray(a, dtype=np.float32)


@dataclass
class _Tensor:
    """One GGUF tensor, planned before any data is read: ``pieces()`` yields float32 arrays whose
    concatenation along axis 0 is the tensor (a merged expert tensor: one expert at a time), so
    the writer holds one piece and one encoded tensor at most."""

    name: str
    shape: tuple[int, ...]  # numpy order
    is_expert: bool
    pieces: Callable[[], Iterator[np.ndarray]]


def _named_tensors(model: LoadedModel, read_expert, split_experts: bool, read_dense) -> Iterator[_Tensor]:
    """Every tensor in llama.cpp's order. ``read_dense(spec)`` builds one dense tensor."""
    c = model.config
    names = names_for(BY_GGUF_ARCH[GGUF_ARCH[c.arch]], "gguf")
    permute = c.arch == "mixtral"
    specs = model.dense_specs

    def dense(key: str, transform=lambda w: w) -> Callable[[], Iterator[np.ndarray]]:
        return lambda: iter([transform(_f32(read_dense(specs[key])))])

    def shape_of(key: str) -> tuple[int, ...]:
        spec = specs[key]
        return tuple(spec.shape or spec.refs[0].shape)

    yield _Tensor("token_embd.weight", shape_of("embed"), False, dense("embed"))
    yield _Tensor("output_norm.weight", shape_of("norm"), False, dense("norm"))
    if not c.tie_word_embeddings:
        yield _Tensor("output.weight", shape_of("lm_head"), False, dense("lm_head"))
    repeat = repeated_kv_heads(c)
    for L in range(c.num_layers):
        prefix = f"layers.{L}."
        for key in [k for k in specs if k.startswith(prefix)]:
            canon = key[len(prefix):]
            shape = shape_of(key)
            transform = (lambda w, h=(c.num_heads if canon == "q" else c.num_kv_heads): _permute_qk(w, h)) \
                if permute and canon in ("q", "k") else (lambda w: w)
            if repeat and canon in ("k", "v", "k_norm", "k_bias", "v_bias"):
                transform = lambda w: _repeat_kv(w, c)  # noqa: E731
                shape = (shape[0] * c.num_heads // c.num_kv_heads, *shape[1:])
            if canon != "kv_b":  # MLA's kv_b goes split per head (below): llama.cpp loads only that
                yield _Tensor(names[canon][0].format(L=L), shape, False, dense(key, transform))
            if canon == "kv_b":  # attn_k_b / attn_v_b, as llama.cpp's absorbed MLA reads it
                nh, dn = c.num_heads, c.head_dim - c.qk_rope_head_dim
                r = shape[1]
                dv = shape[0] // nh - dn

                def k_b(w, nh=nh, dn=dn):
                    return np.ascontiguousarray(w.reshape(nh, -1, w.shape[1])[:, :dn].transpose(0, 2, 1))

                def v_b(w, nh=nh, dn=dn):
                    return np.ascontiguousarray(w.reshape(nh, -1, w.shape[1])[:, dn:])

                yield _Tensor(names["k_b"][0].format(L=L), (nh, r, dn), False, dense(key, k_b))
                yield _Tensor(names["v_b"][0].format(L=L), (nh, dv, r), False, dense(key, v_b))
        if not c.moe_layers[L]:
            continue
        first = read_expert(L, 0)
        for part in PROJECTIONS + BIASES:
            if getattr(first, part) is None:
                continue
            shape = tuple(getattr(first, part).shape)

            def piece(e: int, part=part, L=L) -> np.ndarray:
                return _f32(getattr(read_expert(L, e), part))

            if split_experts:
                for e in range(c.num_experts):
                    yield _Tensor(names[f"expert.{part}"][0].format(L=L, E=e), shape, True,
                                  lambda e=e, piece=piece: iter([piece(e)]))
            else:
                yield _Tensor(names[f"experts.{part}"][0].format(L=L), (c.num_experts, *shape), True,
                              lambda piece=piece: (piece(e)[None] for e in range(c.num_experts)))


def _target(name: str, shape: tuple[int, ...], kind: str):
    """(numpy dtype, GGML quantisation type or None) the tensor is written as."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(shape) == 1 or "ffn_gate_inp" in name or "norm" in name or name.endswith(".bias") or "sinks" in name:
        return np.float32, None
    if kind == "F32":
        return np.float32, None
    if kind == "F16":
        return np.float16, None
    qtype = GGMLQuantizationType[kind]
    if shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return np.float16, None  # rows too short for this block size: llama.cpp falls back too
    return np.uint8, qtype


def _nbytes(shape: tuple[int, ...], dtype, qtype) -> int:
    from gguf import GGML_QUANT_SIZES

    n = int(np.prod(shape, dtype=np.int64))
    if qtype is None:
        return n * np.dtype(dtype).itemsize
    block, size = GGML_QUANT_SIZES[qtype]
    return n // block * size


def _encode(piece: np.ndarray, dtype, qtype) -> np.ndarray:
    if qtype is None:
        return np.ascontiguousarray(piece, dtype=dtype)
    from gguf.quants import quantize

    return quantize(np.ascontiguousarray(piece, dtype=np.float32), qtype)


def write_gguf(
    model: LoadedModel,
    out_path: str,
    read_expert,
    tensor_type: str = "F16",
    expert_type: str | None = None,
    split_experts: bool = False,
    tokenizer_json: str | None = None,
    raw_overrides: dict | None = None,
) -> str:
    """Write ``model`` to ``out_path``. ``read_expert(L, e)`` returns an `ExpertWeights`.

    ``raw_overrides`` maps a GGUF tensor name to (uint8 block data, GGMLQuantizationType) written
    as-is (used by tests to store block types the `gguf` package cannot quantise, such as Q4_K).
    """
    import gguf

    tensor_type = tensor_type.upper()
    expert_type = (expert_type or tensor_type).upper()
    for t in (tensor_type, expert_type):
        if t not in TYPES:
            raise UsageError(f"--type {t}: not a GGUF type this writer can produce (choose from {', '.join(TYPES)})")
    from ...offload.reader import FileReader
    from .. import dense as D

    c = model.config
    arch = GGUF_ARCH[c.arch]
    reader = FileReader(direct=True)
    tmp = temp_beside(out_path, ".gguf.tmp")
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(os.path.basename(model.path.rstrip("/")))
        w.add_block_count(c.num_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_head_count(c.num_heads)
        if c.attention != "mla":  # MLA: llama.cpp's own spellings, in _add_arch_metadata
            w.add_head_count_kv(c.num_heads if repeated_kv_heads(c) else c.num_kv_heads)
            if repeated_kv_heads(c):  # say so: the file's KV heads are copies
                w.add_uint32("s2moe.repeated_kv_heads_from", c.num_kv_heads)
            w.add_key_length(c.head_dim)
            w.add_value_length(c.head_dim)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_rope_freq_base(c.rope_theta)
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_vocab_size(c.vocab_size)
        w.add_expert_feed_forward_length(c.expert_intermediate_size)
        w.add_feed_forward_length(c.dense_intermediate_size or c.expert_intermediate_size)
        if c.clip_qkv is not None:
            w.add_clamp_kqv(c.clip_qkv)
        if c.bos_token_id is not None:
            w.add_bos_token_id(c.bos_token_id)
        if c.eos_token_ids:
            w.add_eos_token_id(c.eos_token_ids[0])
        _add_arch_metadata(w, c)
        if tokenizer_json:
            add_tokenizer(w, tokenizer_json, c.vocab_size)
        _add_chat_template(w, model.path)
        _add_sampling_defaults(w, model.generation_defaults)
        overrides = raw_overrides or {}
        w.add_custom_alignment(ALIGNMENT)
        planned = []
        for t in _named_tensors(model, read_expert, split_experts, lambda spec: D.build(spec, reader.read_ref)):
            if t.name in overrides:
                data, qtype = overrides[t.name]
                w.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, raw_dtype=qtype)
                planned.append((t, None, None, data))
                continue
            dtype, qtype = _target(t.name, t.shape, expert_type if t.is_expert else tensor_type)
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32) if qtype else np.dtype(dtype),
                              _nbytes(t.shape, dtype, qtype), raw_dtype=qtype)
            planned.append((t, dtype, qtype, None))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t, dtype, qtype, data in planned:  # one tensor in memory at a time
            if data is None:
                data = np.concatenate([_encode(p, dtype, qtype) for p in t.pieces()])
            w.write_tensor_data(data)
            data = None
            _drop_written(w)
        w.close()
        publish(tmp, out_path)  # a temp file is 0600: the result gets the umask's mode
    finally:
        reader.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_path


def _drop_written(w) -> None:
    """Write back what is written so far and drop it from the page cache: a conversion must not
    fill the memory it runs in (a cgroup charges dirty pages to the writer) with the output file."""
    for f in getattr(w, "fout", None) or []:
        f.flush()
        os.fdatasync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _add_arch_metadata(w, c) -> None:
    """RoPE scaling and the DeepSeek / GPT-OSS keys, spelled as llama.cpp's converter writes them."""
    import gguf

    if c.rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(c.rope_factor)
        w.add_rope_scaling_orig_ctx_len(c.rope_original_max_position or c.max_position_embeddings)
        if (c.rope_beta_fast, c.rope_beta_slow) != (32.0, 1.0):
            w.add_rope_scaling_yarn_beta_fast(c.rope_beta_fast)
            w.add_rope_scaling_yarn_beta_slow(c.rope_beta_slow)
        if c.rope_attention_factor is not None:
            w.add_rope_scaling_attn_factors(c.rope_attention_factor)
    if c.attention == "mla":
        if not c.rope_interleave:
            raise UsageError("llama.cpp's deepseek2 rotates adjacent RoPE pairs; this model (rope_interleave "
                             "false) rotates halves and cannot be written as GGUF yet")
        if c.rope_type == "yarn" and (c.rope_mscale or 0) != (c.rope_mscale_all_dim or 0):
            raise UsageError("llama.cpp's deepseek2 assumes YaRN mscale = mscale_all_dim; this model differs")
        if c.rope_type == "yarn" and c.rope_mscale_all_dim:
            w.add_rope_scaling_yarn_log_mul(0.1 * c.rope_mscale_all_dim)
        w.add_head_count_kv(1)  # llama.cpp's absorbed MLA: one shared latent "head"
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        w.add_q_lora_rank(c.q_lora_rank or 0)  # llama.cpp requires the key; 0 = q without LoRA
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_leading_dense_block_count(c.moe_layers.index(True) if any(c.moe_layers) else c.num_layers)
        shared = c.shared_expert_intermediate_size or 0
        if shared % c.expert_intermediate_size:
            raise UsageError("shared expert width is not a multiple of the expert width; GGUF cannot say so")
        w.add_expert_shared_count(shared // c.expert_intermediate_size)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        sigmoid = c.router == "sigmoid_topk"
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
        if c.expert_groups:
            w.add_expert_group_count(c.expert_groups)
            w.add_expert_group_used_count(c.expert_groups_used)
    if c.arch == "gpt_oss":
        from ..models.gpt_oss import SWIGLU

        if (c.swiglu_alpha, c.swiglu_limit) != SWIGLU:
            raise UsageError(f"llama.cpp's gpt-oss fixes SwiGLU alpha {SWIGLU[0]} and limit {SWIGLU[1]}; "
                             f"this model has {c.swiglu_alpha} and {c.swiglu_limit}")
        if c.sliding_window:
            w.add_sliding_window(c.sliding_window)
            if c.sliding_layers != tuple(i % 2 == 0 for i in range(c.num_layers)):
                w.add_sliding_window_pattern(list(c.sliding_layers))


def _add_chat_template(w, model_path: str) -> None:
    """The folder's chat template, as `tokenizer.chat_template` (llama.cpp and s2moe read it there)."""
    from ...serve.chat import config_chat_template

    path = os.path.join(model_path, "tokenizer_config.json")
    if os.path.isdir(model_path) and os.path.isfile(path):
        template, _ = config_chat_template(path)
        if template:
            w.add_chat_template(template)


def _add_sampling_defaults(w, defaults: dict) -> None:
    """The model's sampling defaults (`LoadedModel.generation_defaults`) as llama.cpp's
    `general.sampling.*` keys."""
    if defaults.get("temperature") is not None:
        w.add_sampling_temp(float(defaults["temperature"]))
    if defaults.get("top_p") is not None:
        w.add_sampling_top_p(float(defaults["top_p"]))
    if defaults.get("top_k"):
        w.add_sampling_top_k(int(defaults["top_k"]))
