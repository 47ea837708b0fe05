"""Options shared by `s2moe run` and `s2moe bench`: speculative settings, profiles, cost constants.

Precedence: an explicit flag, then the profile, then the built-in default.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decoding.methods import SpecSettings, parse_draft_topk
from .common import say

# what a run uses where neither a flag nor the profile says
DEFAULTS = {k: getattr(SpecSettings, k) for k in ("draft_cap", "utility_threshold", "draft_vocab")}


def default_draft_topk(top_k: int) -> int:
    """The paper's ratios: k=8 → 2 (OLMoE), 6 → 1 (DeepSeek), 4 → 1 (GPT-OSS); small k → k/2."""
    return max(1, top_k // 4) if top_k >= 6 else max(1, top_k // 2)


def make_settings(config, draft_topk: str | None, draft_cap: int | None, reuse_cap: int | None,
                  threshold: float | None, rg_variant: str, profile=None, **switches) -> SpecSettings:
    """``switches``: further `SpecSettings` fields given on the command line (rg_residency,
    rg_strength, draft_fallback, draft_resident, prefetch, prefetch_slots, acceptance, ae_lookahead, rate_guard, draft_vocab,
    token_ranks)."""
    spec = profile.speculative if profile is not None else {}
    if draft_topk:
        default, overrides = parse_draft_topk(draft_topk)
    else:
        default, overrides = spec.get("draft_topk") or default_draft_topk(config.top_k), {}
    pick = lambda flag, key: flag if flag is not None else spec.get(key, DEFAULTS.get(key))  # noqa: E731
    # the profile's C_draft was timed with its draft head: draft with that head unless told otherwise
    switches["draft_vocab"] = pick(switches.get("draft_vocab"), "draft_vocab")
    return SpecSettings(draft_topk=default, layer_draft_topk=overrides, draft_cap=pick(draft_cap, "draft_cap"),
                        reuse_cap=pick(reuse_cap, "reuse_cap"), utility_threshold=pick(threshold, "utility_threshold"),
                        rg_variant=rg_variant, **switches).validate(config.top_k, config.num_experts,
                                                                    config.moe_layer_ids)


def say_strength_note(settings, gates: bool) -> None:
    """On stderr, where a method that ``gates`` does so past the paper's bias: it buys bytes with
    quality, priced in the docs."""
    note = strength_note(settings) if gates else None
    if note:
        say(note, "yellow")


def strength_note(settings) -> str | None:
    """The hint for a gating bias past the paper's (None at or below it)."""
    if settings.rg_strength <= 1:
        return None
    return (f"note: --rg-strength {settings.rg_strength:g} gates past the paper's bias (1): verification reads "
            "less and the text drifts from the target's (PPL ratio with --rg-residency 1: 1.05 at 1.1, 1.13 "
            "at 2; docs/performance/s2moe-gating.md)")


def check_draft_vocab(loaded, settings, flag: int | None = None) -> None:
    """Fail before any weight is read when --draft-vocab cannot be served by the ranks file;
    ``flag``: the command line's value (None: the head came from the profile, which the error says)."""
    if settings.draft_vocab:
        from ..errors import UsageError
        from ..model.draft_head import head_ids, ranks_file

        try:
            head_ids(ranks_file(loaded.path, settings.token_ranks), loaded.config.vocab_size, settings.draft_vocab)
        except UsageError as exc:
            if flag is not None:
                raise
            raise UsageError(f"{exc} (the profile's speculative.draft_vocab is {settings.draft_vocab}: pass "
                             "--token-ranks FILE, or --draft-vocab 0 to draft with the full head)") from None


@dataclass
class ProfileChoice:
    """What a profile contributes to a run once checked against the model."""

    profile: object | None
    budget: str | None
    hot_experts: object | None
    budget_from: str = "--budget"  # where the budget came from (a flag or the profile's field)
    trim_hot: bool = False  # the hot list is the profile's and the budget the user's: trim to fit


def apply_profile(profile_path: str | None, loaded, budget: str | None, hot_experts) -> ProfileChoice:
    if not profile_path:
        return ProfileChoice(None, budget, hot_experts)
    from ..profile import ProfileError, load_profile, model_fingerprint

    prof = load_profile(profile_path)
    matches = prof.data["model"]["fingerprint"] == model_fingerprint(loaded)
    hot = hot_experts
    if not matches:
        if prof.data["model"].get("fingerprint_policy") == "refuse":
            raise ProfileError(f"{profile_path}: made for model {prof.data['model']['name']}, not {loaded.path}; "
                               "run s2moe-calib profile for this model")
        say(f"warning: {profile_path} was made for {prof.data['model']['name']}, not this model: using "
                  "its cost constants and settings, ignoring its hot-expert list", "yellow")
    elif hot is None and prof.hot_experts:
        from ..checks import expert_pairs

        hot = expert_pairs(prof.hot_experts, loaded.config, f"{profile_path}: hot_experts.gpu_experts")
    from_profile = budget is None
    return ProfileChoice(prof, prof.budget_spec if from_profile else budget, hot,
                         f"{profile_path}: budget.spec" if from_profile else "--budget",
                         # the profile's own list is trimmed by rank to what this run's plan leaves
                         # (another budget, or a longer context than the profile planned for)
                         trim_hot=hot is not None and hot_experts is None)


def describe_costs(costs) -> str:
    return (f"T_AR {costs.t_ar * 1e3:.2f} ms · C_draft {costs.c_draft * 1e3:.2f} ms · "
            f"T_exp miss {costs.t_exp_miss * 1e3:.3f} ms / hit {costs.t_exp_hit * 1e3:.3f} ms ({costs.source})")
