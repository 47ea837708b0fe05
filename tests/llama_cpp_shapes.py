"""The tensor shapes llama.cpp's loaders demand of a GGUF file, written down from its sources
(vendor/llama.cpp/src/models/{olmoe,qwen3moe,llama,deepseek2,openai-moe}.cpp in llama-cpp-python
0.3.36) so that a test can hold our export to them without a llama.cpp binary.

Shapes are in ggml order (ne0 first), as `create_tensor` states them and `GGUFReader` reports them,
and are derived from the file's own metadata the way llama.cpp derives its hyperparameters. A
tensor llama.cpp marks as not required is listed under ``optional``.
"""

from __future__ import annotations


def _meta(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def expected(reader) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(required and optional tensor name → shape, the optional names) for this file."""
    m = _meta(reader)
    arch = m["general.architecture"]

    def get(key, default=None):
        return m.get(f"{arch}.{key}", default)

    E, L = get("embedding_length"), get("block_count")
    H = get("attention.head_count")
    Hkv = get("attention.head_count_kv", H)
    D = get("attention.key_length", E // H)
    n_exp = get("expert_count")
    V = len(m["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in m else \
        next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight")
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (E, V), "output_norm.weight": (E,),
                                          "output.weight": (E, V)}
    optional: set[str] = set()
    if arch in ("qwen3moe", "llama", "deepseek2"):
        optional.add("output.weight")  # tied: token_embd serves as the output
    for i in range(L):
        b = f"blk.{i}."
        s = {"attn_norm.weight": (E,), "ffn_norm.weight": (E,)}
        if arch == "olmoe":
            F = get("feed_forward_length")
            s |= {"attn_q.weight": (E, E), "attn_k.weight": (E, Hkv * D), "attn_v.weight": (E, Hkv * D),
                  "attn_output.weight": (E, E), "attn_q_norm.weight": (E,), "attn_k_norm.weight": (E,),
                  "ffn_gate_inp.weight": (E, n_exp), "ffn_gate_exps.weight": (E, F, n_exp),
                  "ffn_down_exps.weight": (F, E, n_exp), "ffn_up_exps.weight": (E, F, n_exp)}
        elif arch in ("qwen3moe", "llama"):
            F = get("expert_feed_forward_length") if arch == "qwen3moe" else get("feed_forward_length")
            s |= {"attn_q.weight": (E, D * H), "attn_k.weight": (E, D * Hkv), "attn_v.weight": (E, D * Hkv),
                  "attn_output.weight": (D * H, E), "ffn_gate_inp.weight": (E, n_exp),
                  "ffn_gate_exps.weight": (E, F, n_exp), "ffn_down_exps.weight": (F, E, n_exp),
                  "ffn_up_exps.weight": (E, F, n_exp)}
            if arch == "qwen3moe":
                s |= {"attn_q_norm.weight": (D,), "attn_k_norm.weight": (D,)}
        elif arch == "gpt-oss":
            F, R = get("expert_feed_forward_length"), get("rope.dimension_count", D)
            s = {"attn_norm.weight": (E,), "post_attention_norm.weight": (E,),
                 "attn_q.weight": (E, H * R), "attn_k.weight": (E, Hkv * R), "attn_v.weight": (E, Hkv * R),
                 "attn_q.bias": (H * R,), "attn_k.bias": (Hkv * R,), "attn_v.bias": (Hkv * R,),
                 "attn_output.weight": (H * R, E), "attn_output.bias": (E,), "attn_sinks.weight": (H,),
                 "ffn_gate_inp.weight": (E, n_exp), "ffn_gate_inp.bias": (n_exp,),
                 "ffn_gate_exps.weight": (E, F, n_exp), "ffn_down_exps.weight": (F, E, n_exp),
                 "ffn_up_exps.weight": (E, F, n_exp), "ffn_gate_exps.bias": (F, n_exp),
                 "ffn_down_exps.bias": (E, n_exp), "ffn_up_exps.bias": (F, n_exp)}
        elif arch == "deepseek2":
            dk, dv = get("attention.key_length_mla"), get("attention.value_length_mla")
            rope, q_r, kv_r = get("rope.dimension_count"), get("attention.q_lora_rank", 0), \
                get("attention.kv_lora_rank")
            nope = dk - rope
            s |= {"attn_kv_a_norm.weight": (kv_r,), "attn_kv_a_mqa.weight": (E, kv_r + rope),
                  "attn_k_b.weight": (nope, kv_r, H), "attn_v_b.weight": (kv_r, dv, H),
                  "attn_output.weight": (H * dv, E)}
            if q_r:
                s |= {"attn_q_a_norm.weight": (q_r,), "attn_q_a.weight": (E, q_r), "attn_q_b.weight": (q_r, H * dk)}
            else:
                s |= {"attn_q.weight": (E, H * dk)}
            if i < get("leading_dense_block_count"):
                F = get("feed_forward_length")
                s |= {"ffn_gate.weight": (E, F), "ffn_down.weight": (F, E), "ffn_up.weight": (E, F)}
            else:
                F, shared = get("expert_feed_forward_length"), get("expert_shared_count")
                s |= {"ffn_gate_inp.weight": (E, n_exp), "ffn_gate_exps.weight": (E, F, n_exp),
                      "ffn_down_exps.weight": (F, E, n_exp), "ffn_up_exps.weight": (E, F, n_exp),
                      "ffn_gate_shexp.weight": (E, F * shared), "ffn_down_shexp.weight": (F * shared, E),
                      "ffn_up_shexp.weight": (E, F * shared), "exp_probs_b.bias": (n_exp,)}
                optional.add(b + "exp_probs_b.bias")
        else:
            raise AssertionError(f"no llama.cpp shape table for architecture {arch!r}")
        shapes |= {b + k: v for k, v in s.items()}
    return shapes, optional
