"""Decoding methods by name, and the settings they share.

| name        | draft length rule                         | KV           | RG  | tree |
|-------------|-------------------------------------------|--------------|-----|------|
| ar          | none: one target pass per token           | -            | -   | -    |
| es          | fixed 8 (expert-skip self-spec baseline)  | draft's own  | no  | 2    |
| confidence  | chain until draft prob < 0.5 (EAGLE-3)    | shared (CA)  | no  | 1    |
| cascade     | utility-chosen K ∈ {0, 1, cap/2, cap}     | shared (CA)  | no  | 1    |
| ca          | fixed = draft cap                         | shared (CA)  | no  | 1    |
| ca+ae       | utility test U_i ≥ threshold (AE)         | shared (CA)  | no  | 1    |
| s2moe       | utility test (AE)                         | shared (CA)  | yes | 1    |
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..checks import number
from ..errors import UsageError


@dataclass(frozen=True)
class MethodSpec:
    name: str
    admit: str  # "none" | "fixed" | "confidence" | "utility" | "cascade"
    share_kv: bool = True
    reuse_gating: bool = False
    tree_width: int = 1
    fixed_length: int | None = None  # None: the draft cap


METHODS: dict[str, MethodSpec] = {
    "ar": MethodSpec("ar", "none"),
    "es": MethodSpec("es", "fixed", share_kv=False, tree_width=2, fixed_length=8),
    "confidence": MethodSpec("confidence", "confidence"),
    "cascade": MethodSpec("cascade", "cascade"),
    "ca": MethodSpec("ca", "fixed"),
    "ca+ae": MethodSpec("ca+ae", "utility"),
    "s2moe": MethodSpec("s2moe", "utility", reuse_gating=True),
}


def get_method(name: str, share_kv: bool | None = None, reuse_gating: bool | None = None) -> MethodSpec:
    try:
        spec = METHODS[name]
    except KeyError:
        raise UsageError(f"--method {name!r}: choose from {', '.join(METHODS)}") from None
    if share_kv is not None:
        spec = replace(spec, share_kv=share_kv)
    if reuse_gating is not None:
        spec = replace(spec, reuse_gating=reuse_gating)
    return spec


# the settings that shape a draft chain and verification's routing (`SpecSettings.trace_dict`)
_DRAW = ("draft_topk", "draft_resident", "draft_fallback", "draft_vocab", "token_ranks", "rg_variant",
         "rg_residency", "rg_strength", "reuse_cap")


@dataclass(frozen=True)
class SpecSettings:
    draft_topk: int = 2
    layer_draft_topk: dict = field(default_factory=dict)  # per-layer override
    # 4, not the paper's longer drafts: side by side, cap 4 ran 1.17x cap 8 at OLMoE-1B-7B's size
    # (25 %), 1.06x at 10 %, 1.08x on the embedded model (benchmarks/tune.py, s2moe-real-size.md)
    draft_cap: int = 4
    reuse_cap: int | None = None  # None: 2 × target k
    utility_threshold: float = 1.0
    # AE drafts until this many tokens past the prefix of largest summed gain (or until the tokens
    # left cannot climb back to it) and verifies that prefix. 1 is the paper's rule (stop at the
    # first token that does not pay for itself); 2 lets a token that opens new experts be followed
    # by one that reuses them (docs/performance.md, "AE's lookahead")
    ae_lookahead: int = 2
    # "resident": the paper's gating with E* also favouring experts the fast tier holds or is reading,
    # at a bonus ρ = rg_residency. At ρ = 0.25 its quality is the paper variant's within paired bootstrap
    # intervals, and a token under a 25 % budget reads 28-31 % fewer bytes (docs/performance.md,
    # "Residency-aware gating by default"); without a budget it is the paper's. Or "paper", or "code"
    # (published code: router peakedness, batch-mean λ)
    rg_variant: str = "resident"
    rg_residency: float = 0.25
    # the bias, in multiples of each token's top-1 − (k+1)-th gap (1: the paper's). Past 1 quality
    # falls off a cliff: at ρ = 1 the PPL ratio is 1.02 at 1×, 1.05 at 1.1×, 1.13-1.16 at 2×
    # (docs/performance/s2moe-gating.md, "The price of a stronger bias")
    rg_strength: float = 1.0
    confidence_threshold: float = 0.5
    cascade_test_iters: int = 2
    cascade_set_iters: int = 16
    # AE: after an iteration that admits nothing, run 1, 2, 4 … (≤ 16) plain AR steps before drafting
    # again, so a draft that cannot pay for itself stops costing a draft pass per token
    backoff: bool = True
    # AE with live costs: take AR steps while speculation emits tokens more slowly than AR steps do,
    # as measured (rate_guard.py); its prices miss costs no single token carries
    rate_guard: bool = True
    # the draft uses only resident experts (under a budget): it never waits on the slow tier. A
    # token whose draft choices are all absent takes the best resident expert ("best") or skips
    # the layer's experts ("skip")
    draft_resident: bool = True
    draft_fallback: str = "best"
    # read the experts the draft predicts for verification while it drafts, at most this many in
    # flight (None: 2 × top-k under a budget); each takes its room in the expert cache
    prefetch: bool = True
    prefetch_slots: int | None = None
    # True: prefetch on every iteration. False: on the host with live costs, only where a trial in
    # the run measures it taking fewer seconds per token (prefetch_trial.py). On 12 prompts a
    # workload the trial was never faster: every iteration ran 0.99-1.12x its speed on the widened
    # model at 25 % and 1.08x at 10 %, 1.01-1.06x on the embedded model (the 3-prompt runs that had
    # favoured it followed a few texts: docs/performance/s2moe-prefetch.md, "Prefetch on every
    # iteration by default")
    prefetch_always: bool = True
    # AE's p_i: "learned" (P(accepted | draft confidence) from the run's verifications; see
    # acceptance.py) or "confidence" (the draft's own probability, as the paper has it)
    acceptance: str = "learned"
    # FR-Spec: the draft's lm head covers the N most frequent tokens of a ranks file (0: all of
    # them); verification keeps the full head (model/draft_head.py). None: the model's own file
    draft_vocab: int = 0
    token_ranks: str | None = None

    def validate(self, top_k: int, num_experts: int, moe_layers=None) -> "SpecSettings":
        """Every setting through `checks.number`; ``moe_layers`` (the model's MoE layer ids)
        checks the layers of per-layer draft top-k overrides."""
        number("--draft-topk", self.draft_topk, low=1, high=num_experts, integer=True)
        for layer, k in self.layer_draft_topk.items():
            if moe_layers is not None and layer not in set(moe_layers):
                raise UsageError(f"--draft-topk {layer}:{k}: layer {layer} is not a MoE layer of this model "
                                 f"(MoE layers: {min(moe_layers)}..{max(moe_layers)})")
            number(f"--draft-topk {layer}:", k, low=1, high=num_experts, integer=True)
        number("--draft-cap", self.draft_cap, low=1, high=256, integer=True)
        if self.reuse_cap is not None:
            number("--reuse-cap", self.reuse_cap, low=1, integer=True)  # above E: E* is every expert
        number("--utility-threshold", self.utility_threshold, low=0)
        number("--ae-lookahead", self.ae_lookahead, low=1, high=256, integer=True)
        number("--rg-residency", self.rg_residency, low=0)
        number("--rg-strength", self.rg_strength, low=0)
        number("confidence threshold", self.confidence_threshold, low=0, high=1)
        number("--draft-vocab", self.draft_vocab, low=0, integer=True)
        if self.prefetch_slots is not None:
            number("--prefetch-slots", self.prefetch_slots, low=0, high=4096, integer=True)
        if self.rg_variant not in ("paper", "code", "resident"):
            raise UsageError(f"--rg-variant {self.rg_variant!r}: choose paper, code or resident")
        if self.acceptance not in ("learned", "confidence"):
            raise UsageError(f"--acceptance {self.acceptance!r}: choose learned or confidence")
        if self.draft_fallback not in ("best", "skip"):
            raise UsageError(f"--draft-fallback {self.draft_fallback!r}: choose best or skip")
        return self

    def trace_dict(self, guarded: bool) -> dict:
        """What `s2moe-calib predict` needs to re-make AE's decisions (``guarded``: the run had a
        rate guard, which needs live costs)."""
        return {"draft_cap": self.draft_cap, "utility_threshold": self.utility_threshold,
                "ae_lookahead": self.ae_lookahead, "backoff": self.backoff, "rate_guard": guarded,
                "acceptance": self.acceptance, "prefetch": self.prefetch,
                # how the drafts and gating were drawn: predict draws them again with these
                "draw": {**{k: getattr(self, k) for k in _DRAW}, "layer_draft_topk": sorted(self.layer_draft_topk.items())}}

    @classmethod
    def from_trace(cls, d: dict) -> "SpecSettings":
        """The settings a traced run drafted with (`trace_dict`); KeyError where it has no "draw"."""
        draw = dict(d["draw"])
        layers = {int(L): int(k) for L, k in draw.pop("layer_draft_topk", [])}
        return cls(draft_cap=int(d["draft_cap"]), utility_threshold=float(d["utility_threshold"]),
                   ae_lookahead=int(d["ae_lookahead"]), backoff=bool(d["backoff"]), acceptance=d["acceptance"],
                   prefetch=bool(d["prefetch"]), layer_draft_topk=layers, **{k: draw[k] for k in _DRAW})

    def slots_for(self, spec: "MethodSpec") -> int | None:
        """Prefetches ``spec`` may have in flight: none where it does not draft or prefetch is off,
        else ``prefetch_slots`` (None: the engine's default)."""
        return 0 if spec.admit == "none" or not self.prefetch else self.prefetch_slots

    def reuse_cap_for(self, top_k: int) -> int:
        return self.reuse_cap if self.reuse_cap is not None else 2 * top_k

    def gating(self, spec: "MethodSpec", top_k: int) -> dict | None:
        """What a record says of reuse-aware gating (None: the method verifies without it, so its
        output is the target's)."""
        if not spec.reuse_gating:
            return None
        return {"variant": self.rg_variant, "residency": self.rg_residency, "strength": self.rg_strength,
                "cap": self.reuse_cap_for(top_k)}


def parse_draft_topk(text: str) -> tuple[int, dict]:
    """``2`` or ``2,0:1,5:3`` (default, then layer:k overrides)."""
    default, overrides = None, {}
    for part in str(text).split(","):
        part = part.strip()
        try:
            if ":" in part:
                layer, k = part.split(":")
                overrides[int(layer)] = int(k)
            else:
                default = int(part)
        except ValueError:
            raise UsageError(f"--draft-topk {text!r}: use K or K,LAYER:K,…") from None
    if default is None:
        raise UsageError(f"--draft-topk {text!r}: give a default K first (e.g. 2,0:1)")
    return default, overrides
