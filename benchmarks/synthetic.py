"""Backs docs/performance/peer.md, "Memory: plan against the kernel's peak" (tests/test_memory.py) and
"Earlier runs" (peer.py's hidden-1024 file): random-weight OLMoE-style checkpoints.

Random-weight OLMoE-style checkpoints at realistic widths, written with NumPy + safetensors only.

For speed and I/O benchmarks (never for acceptance figures: random weights make drafts agree for
the wrong reasons). Weights are scaled 1/sqrt(fan_in) so activations stay finite over many layers.
"""

from __future__ import annotations

import json
import os

import numpy as np


def write_olmoe(folder: str, hidden=1024, layers=4, experts=32, top_k=4, intermediate=512, vocab=8192,
                heads=16, kv_heads=4, dtype="float16", seed=0) -> str:
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    config = {
        "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate, "num_experts": experts, "num_experts_per_tok": top_k,
        "norm_topk_prob": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "eos_token_id": vocab - 1, "tie_word_embeddings": False,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    t = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0), "model.norm.weight": np.ones(hidden, dtype),
         "lm_head.weight": w(vocab, hidden)}
    for L in range(layers):
        p = f"model.layers.{L}."
        t |= {
            p + "input_layernorm.weight": np.ones(hidden, dtype),
            p + "post_attention_layernorm.weight": np.ones(hidden, dtype),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": np.ones(heads * head_dim, dtype),
            p + "self_attn.k_norm.weight": np.ones(kv_heads * head_dim, dtype),
            p + "mlp.gate.weight": w(experts, hidden, scale=3.0 / np.sqrt(hidden)),
        }
        for e in range(experts):
            q = p + f"mlp.experts.{e}."
            t |= {q + "gate_proj.weight": w(intermediate, hidden), q + "up_proj.weight": w(intermediate, hidden),
                  q + "down_proj.weight": w(hidden, intermediate)}
    save_file(t, os.path.join(folder, "model.safetensors"))
    return folder


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="where config.json and model.safetensors are written")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="float16")
    a = ap.parse_args()
    print(write_olmoe(a.folder, hidden=a.hidden, layers=a.layers, experts=a.experts, top_k=a.top_k,
                      intermediate=a.intermediate, vocab=a.vocab, dtype=a.dtype))


if __name__ == "__main__":
    main()
