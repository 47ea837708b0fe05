"""Tiny random-weight MoE models built with `transformers` (the reference no one here wrote)."""

from __future__ import annotations

import torch

FAMILIES = ("olmoe", "qwen3_moe", "mixtral")


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
    raise ValueError(family)


def build(family: str, seed: int = 0, **kw):
    from transformers import MixtralForCausalLM, OlmoeForCausalLM, Qwen3MoeForCausalLM

    cls = {"olmoe": OlmoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(make_config(family, **kw)).eval()
    # Default init (std 0.02) makes routers near-uniform; widen the routers and norms so routing
    # decisions and q/k norms actually matter in the comparison.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "router" in name:
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def save(model, folder, fused: bool = False) -> str:
    model.save_pretrained(folder, save_original_format=not fused)
    return str(folder)


def torch_logits(model, ids) -> "torch.Tensor":
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()
