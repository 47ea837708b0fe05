"""Write a loaded model as GGUF with llama.cpp's names and conventions (via the `gguf` writer).

Experts can be written merged (`blk.L.ffn_gate_exps.weight`, llama.cpp's default) or split one
tensor per (layer, expert, projection) (`blk.L.ffn_gate.NNN.weight`, the published S²-MoE fork).
Tensor names come from the architecture files' GGUF tables (one source of truth with the loader).
Norms, biases, sinks and the router stay F32 (llama.cpp's habit); 2-D weights take the requested
type where their rows divide into its blocks, else F16. The file is written to a temp name, then
renamed.
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterator

import numpy as np

from ...errors import UsageError
from ..loader import BIASES, PROJECTIONS, LoadedModel
from ..models import BY_GGUF_ARCH, names_for

GGUF_ARCH = {"olmoe": "olmoe", "qwen3_moe": "qwen3moe", "mixtral": "llama", "deepseek_v2": "deepseek2",
             "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss"}
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")


def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for interleaved RoPE (arch `llama`)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _f32(a) -> np.ndarray:
    """A tensor as float32 (stored matrices decoded by the reference path)."""
    from ...kernels.stored import StoredMatrix

    return a.dequantize() if isinstance(a, StoredMatrix) else a


def _named_tensors(model: LoadedModel, read_expert, split_experts: bool) -> Iterator[tuple[str, np.ndarray, bool]]:
    """(GGUF name, float32 array, is_expert) in llama.cpp's order."""
    c = model.config
    d = {k: _f32(v) for k, v in model.load_dense().items()}
    names = names_for(BY_GGUF_ARCH[GGUF_ARCH[c.arch]], "gguf")
    permute = c.arch == "mixtral"
    yield "token_embd.weight", d["embed"], False
    yield "output_norm.weight", d["norm"], False
    if not c.tie_word_embeddings:
        yield "output.weight", d["lm_head"], False
    for L in range(c.num_layers):
        prefix = f"layers.{L}."
        for key, w in d.items():
            if not key.startswith(prefix):
                continue
            canon = key[len(prefix):]
            if permute and canon in ("q", "k"):
                w = _permute_qk(w, c.num_heads if canon == "q" else c.num_kv_heads)
            yield names[canon][0].format(L=L), w, False
            if canon == "kv_b":  # llama.cpp also writes kv_b split per head for its absorbed MLA
                nh, dn = c.num_heads, c.head_dim - c.qk_rope_head_dim
                per_head = w.reshape(nh, -1, w.shape[1])
                yield names["k_b"][0].format(L=L), np.ascontiguousarray(per_head[:, :dn].transpose(0, 2, 1)), False
                yield names["v_b"][0].format(L=L), np.ascontiguousarray(per_head[:, dn:]), False
        if not c.moe_layers[L]:
            continue
        experts = [read_expert(L, e) for e in range(c.num_experts)]
        for part in PROJECTIONS + BIASES:
            if getattr(experts[0], part) is None:
                continue
            if split_experts:
                for e, w in enumerate(experts):
                    yield names[f"expert.{part}"][0].format(L=L, E=e), _f32(getattr(w, part)), True
            else:
                yield names[f"experts.{part}"][0].format(L=L), np.stack([_f32(getattr(w, part)) for w in experts]), True


def _encode(name: str, w: np.ndarray, kind: str):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    w = np.ascontiguousarray(w)  # the runtime keeps linear weights input-major (Fortran order)
    if w.ndim == 1 or "ffn_gate_inp" in name or "norm" in name or name.endswith(".bias") or "sinks" in name:
        return w.astype(np.float32), None
    if kind == "F32":
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    qtype = GGMLQuantizationType[kind]
    block = GGML_QUANT_SIZES[qtype][0]
    if w.shape[-1] % block:
        return w.astype(np.float16), None  # rows too short for this block size: llama.cpp falls back too
    return quantize(w.astype(np.float32), qtype), qtype


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
    c = model.config
    arch = GGUF_ARCH[c.arch]
    folder = os.path.dirname(os.path.abspath(out_path))
    fd, tmp = tempfile.mkstemp(prefix=".s2moe-", suffix=".gguf.tmp", dir=folder)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(os.path.basename(model.path.rstrip("/")))
        w.add_block_count(c.num_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_head_count(c.num_heads)
        if c.attention != "mla":  # MLA: llama.cpp's own spellings, in _add_arch_metadata
            w.add_head_count_kv(c.num_kv_heads)
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
            _add_tokenizer(w, tokenizer_json)
        _add_sampling_defaults(w, model.generation_defaults)
        overrides = raw_overrides or {}
        for name, tensor, is_expert in _named_tensors(model, read_expert, split_experts):
            if name in overrides:
                data, qtype = overrides[name]
                w.add_tensor(name, data, raw_dtype=qtype)
                continue
            data, qtype = _encode(name, tensor, expert_type if is_expert else tensor_type)
            w.add_tensor(name, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_path


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
        if c.q_lora_rank:
            w.add_q_lora_rank(c.q_lora_rank)
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


def _add_sampling_defaults(w, defaults: dict) -> None:
    """The model's sampling defaults (`LoadedModel.generation_defaults`) as llama.cpp's
    `general.sampling.*` keys."""
    if defaults.get("temperature") is not None:
        w.add_sampling_temp(float(defaults["temperature"]))
    if defaults.get("top_p") is not None:
        w.add_sampling_top_p(float(defaults["top_p"]))
    if defaults.get("top_k"):
        w.add_sampling_top_k(int(defaults["top_k"]))


def _add_tokenizer(w, tokenizer_json: str) -> None:
    """A byte-level BPE `tokenizer.json` as GGUF's `gpt2` tokenizer (tokens, merges, types)."""
    import json

    with open(tokenizer_json, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise UsageError(f"{tokenizer_json}: only BPE tokenizers can be embedded in GGUF (found {model.get('type')})")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for tok, i in vocab.items():
        tokens[i] = tok
    types = [3 if t in special else 1 for t in tokens]  # 3 = control, 1 = normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
