"""Per-run speculative decoding metrics (definitions from the paper's metrics section).

- acceptance length: tokens produced per verification, the target's own token included (AR = 1);
- acceptance rate: accepted draft tokens / drafted tokens;
- reuse ratio over a verified window of s tokens: unique experts activated / (s · k), per MoE
  layer, averaged (ideal 1/s);
- effective verification cost: share of the distinct experts a verification loaded that the
  accepted tokens (root included) needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def acceptance_summary(tokens: int, predicted: float, kept: int) -> dict | None:
    """AE's verified draft tokens: how many, the mean acceptance it predicted, the share kept."""
    return {"tokens": tokens, "predicted": round(predicted / tokens, 4),
            "observed": round(kept / tokens, 4)} if tokens else None


@dataclass
class SpecMetrics:
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    ar_steps: int = 0
    empty_drafts: int = 0
    backoff_steps: int = 0  # AR steps taken while AE backs off
    guard_steps: int = 0  # AR steps the rate guard took (speculation measured slower than AR)
    draft_passes: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    reuse_ratios: list[float] = field(default_factory=list)
    effective_costs: list[float] = field(default_factory=list)
    cascade_choices: list[int] = field(default_factory=list)
    # one row per verification pass: (n_tokens, n_missing, n_resident, seconds) for the cost model
    verify_samples: list[tuple[int, int, int, float]] = field(default_factory=list)
    # AR steps, the same row with n_tokens = 1; draft phases: (tokens drafted, seconds)
    ar_samples: list[tuple[int, int, int, float]] = field(default_factory=list)
    draft_samples: list[tuple[int, float]] = field(default_factory=list)
    # AE's verified draft tokens: how many, the acceptance it predicted for them (summed), how many kept
    ae_tokens: int = 0
    ae_predicted: float = 0.0
    ae_kept: int = 0
    # FR-Spec: the draft head's size, and the emitted tokens inside it (what it could propose)
    draft_vocab: int = 0
    vocab_tokens: int = 0
    vocab_covered: int = 0

    def record_acceptance(self, predicted: float, kept: bool) -> None:
        self.ae_tokens += 1
        self.ae_predicted += predicted
        self.ae_kept += int(kept)

    def record_verification(self, record, batch: int, accepted_rows: list[int], drafted: int, accepted: int,
                            top_k: int) -> None:
        self.verifications += 1
        self.drafted += drafted
        self.accepted += accepted
        if record is None or not record.layers:
            return
        ratios, used, needed = [], 0, 0
        for L, r in record.layers.items():  # (sets of a few dozen ids: np.unique cost 10x as much)
            experts = np.asarray(r.experts)
            all_experts = set(experts.ravel().tolist())
            ratios.append(len(all_experts) / (batch * top_k))
            used += len(all_experts)
            needed += len(set(experts[accepted_rows].ravel().tolist()))
        self.reuse_ratios.append(sum(ratios) / len(ratios))
        self.effective_costs.append(needed / used if used else 1.0)

    def to_dict(self, generated: int) -> dict:
        steps = self.verifications + self.ar_steps
        return {
            "verifications": self.verifications,
            "ar_steps": self.ar_steps,
            "acceptance_length": round((self.accepted + self.verifications + self.ar_steps) / steps, 4) if steps else None,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "mean_draft_length": round(self.drafted / self.verifications, 4) if self.verifications else 0.0,
            "empty_drafts": self.empty_drafts,
            "backoff_steps": self.backoff_steps,
            "guard_steps": self.guard_steps,
            "draft_passes": self.draft_passes,
            "reuse_ratio": round(float(np.mean(self.reuse_ratios)), 4) if self.reuse_ratios else None,
            "effective_verification_cost": round(float(np.mean(self.effective_costs)), 4) if self.effective_costs else None,
            "draft_seconds": round(self.draft_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
            **({"cascade_choices": self.cascade_choices} if self.cascade_choices else {}),
            # calibration of AE's acceptance probabilities: mean predicted vs observed, same tokens
            **({"ae_acceptance": acceptance_summary(self.ae_tokens, self.ae_predicted, self.ae_kept)}
               if self.ae_tokens else {}),
            **({"draft_vocab": {"size": self.draft_vocab, "coverage": round(self.vocab_covered / self.vocab_tokens, 4)
                                if self.vocab_tokens else None}} if self.draft_vocab else {}),
        }
