"""Tiny random-weight MoE models built with `transformers` (the reference no one here wrote)."""

from __future__ import annotations

import torch

FAMILIES = ("olmoe", "qwen3_moe", "mixtral")
# DeepSeek (MLA, shared experts, dense first layer) and GPT-OSS (sinks, sliding window, biases,
# clamped SwiGLU, interleaved experts): tested in tests/test_families_extra.py.
#   deepseek_v2        q LoRA, group-limited routing (16 experts, 4 groups, 2 used, top-4), 2 shared
#                      experts, YaRN with mscale
#   deepseek_v2_plain  no q LoRA, greedy routing (8 experts, top-2), 1 shared expert
#   deepseek_v3        sigmoid routing with e_score_correction_bias, groups as deepseek_v2, renormalised
#   gpt_oss            window 8 on alternate layers, sinks, YaRN, wide expert weights (clamp active)
EXTRA_FAMILIES = ("deepseek_v2", "deepseek_v2_plain", "deepseek_v3", "gpt_oss")


def make_config(family: str, vocab: int = 384, layers: int = 2, hidden: int = 64, experts: int = 8, top_k: int = 2):
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=top_k,
        eos_token_id=vocab - 1, bos_token_id=vocab - 2, pad_token_id=vocab - 3,
    )
    if family == "olmoe":
        return OlmoeConfig(**common, intermediate_size=32, num_experts=experts, clip_qkv=None)
    if family == "qwen3_moe":
        # head_dim set explicitly (Qwen3 decouples it from hidden / heads); renormalised top-k.
        return Qwen3MoeConfig(**common, head_dim=24, intermediate_size=96, moe_intermediate_size=32,
                              num_experts=experts, norm_topk_prob=True)
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=32, num_local_experts=experts, rope_theta=10000.0)
    return _extra_config(family, common, layers, experts, top_k)


def _extra_config(family: str, common: dict, layers: int, experts: int, top_k: int):
    from transformers import DeepseekV2Config, DeepseekV3Config, GptOssConfig

    common = {**common, "num_hidden_layers": max(layers, 3)}
    mla = dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, first_k_dense_replace=1,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    common.pop("num_key_value_heads")
    if family == "deepseek_v2":
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}
        return DeepseekV2Config(**{**common, "num_experts_per_tok": 4}, **mla, n_routed_experts=16, n_shared_experts=2,
                                q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                routed_scaling_factor=1.5, rope_parameters=yarn)
    if family == "deepseek_v2_plain":
        return DeepseekV2Config(**common, **mla, n_routed_experts=experts, n_shared_experts=1,
                                q_lora_rank=None, topk_method="greedy")
    if family == "deepseek_v3":
        return DeepseekV3Config(**{**common, "num_experts_per_tok": 4}, **mla, n_routed_experts=16, n_shared_experts=1,
                                q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    if family == "gpt_oss":
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
        common["max_position_embeddings"] = 131072  # consistent with the YaRN factor (no warning)
        return GptOssConfig(**common, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                            num_local_experts=experts, sliding_window=8, rope_parameters=yarn)
    raise ValueError(family)


def build(family: str, seed: int = 0, **kw):
    from transformers import (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, GptOssForCausalLM, MixtralForCausalLM,
                              OlmoeForCausalLM, Qwen3MoeForCausalLM)

    cls = {"olmoe": OlmoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM,
           "deepseek_v2": DeepseekV2ForCausalLM, "deepseek_v2_plain": DeepseekV2ForCausalLM,
           "deepseek_v3": DeepseekV3ForCausalLM, "gpt_oss": GptOssForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(make_config(family, **kw)).eval()
    # Default init (std 0.02) makes routers near-uniform; widen the routers and norms so routing
    # decisions and q/k norms actually matter in the comparison. The extra families' sinks, biases
    # and score-correction biases start at zero or near it: make them matter too, and make GPT-OSS's
    # expert inputs wide enough that its SwiGLU clamp (|x| ≤ 7) is active.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "router" in name:
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif name.endswith("_bias"):  # expert biases
                p.normal_(0, 0.1)
            elif name.endswith("experts.gate_up_proj") and family == "gpt_oss":
                p.normal_(0, 0.8)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    return model


def save(model, folder, fused: bool = False) -> str:
    model.save_pretrained(folder, save_original_format=not fused)
    return str(folder)


def torch_logits(model, ids) -> "torch.Tensor":
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()
