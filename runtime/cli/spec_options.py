"""Options shared by `s2moe run` and `s2moe bench`: speculative settings and cost constants."""

from __future__ import annotations

from ..methods import SpecSettings, parse_draft_topk


def default_draft_topk(top_k: int) -> int:
    """The paper's ratios: k=8 → 2 (OLMoE), 6 → 1 (DeepSeek), 4 → 1 (GPT-OSS); small k → k/2."""
    return max(1, top_k // 4) if top_k >= 6 else max(1, top_k // 2)


def make_settings(config, draft_topk: str | None, draft_cap: int, reuse_cap: int | None, threshold: float,
                  rg_variant: str) -> SpecSettings:
    default, overrides = parse_draft_topk(draft_topk) if draft_topk else (default_draft_topk(config.top_k), {})
    return SpecSettings(draft_topk=default, layer_draft_topk=overrides, draft_cap=draft_cap, reuse_cap=reuse_cap,
                        utility_threshold=threshold, rg_variant=rg_variant).validate(config.top_k, config.num_experts)


def describe_costs(costs) -> str:
    return (f"T_AR {costs.t_ar * 1e3:.2f} ms · C_draft {costs.c_draft * 1e3:.2f} ms · "
            f"T_exp miss {costs.t_exp_miss * 1e3:.3f} ms / hit {costs.t_exp_hit * 1e3:.3f} ms ({costs.source})")
