"""How likely a draft token is to be accepted, learned from the verifications a run makes.

AE's utility U_i = p_i · T_AR / (ΔC_ver + C_draft) needs p_i, the probability that verification
accepts draft token i given that the tokens before it were. The paper takes the draft's own
confidence q(d_i). Under greedy verification that is not a probability of acceptance: a token is
accepted when it is also the target's argmax, and a draft that shares the target's weights agrees
on the argmax far more often than its flat distribution suggests. Measured on the embedded model
(`ca`, draft top-2 of 4, 12 prompts × 64 tokens, 736 drafted tokens): tokens drafted at q < 0.1
were accepted 79 % of the time, at 0.1–0.2 89 %, at ≥ 0.6 100 %. AE fed with q declines drafts
that would have paid.

`AcceptanceModel` keeps decayed counts of (accepted, drafted) per confidence bin and returns a
shrunk estimate: a bin's rate pulled toward the pooled rate of every bin, which is in turn pulled
toward q. With no evidence it returns q (the paper's rule). The pooled rate moves with the first
verified tokens, so bins AE has not drafted from yet start from what the run has seen elsewhere
rather than from q (which would never draft them and so never learn them). AE never takes less
than q itself (`SpeculativeDecoder._p_accept`): a model that learned "rarely kept" would otherwise
stop drafting and so never learn otherwise, so it drafts at least what the paper's rule would.

Only how much is drafted changes. Which tokens are verified is decided before the target runs,
from past verifications and the draft alone, so sampled verification stays exact; with gating off
the greedy tokens (and a seed's coupled sample) are unchanged. With reuse-aware gating on (the
default `s2moe` method) the drafted batch steers the target's routing, so there the text can change.
`benchmarks/acceptance.py` (at commit 807e4cc; docs/performance/s2moe-ae.md) measured the calibration
this corrects.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

# bin edges over the draft's confidence: finer at the low end, where the disagreement is
EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
_EDGES = EDGES.tolist()  # `bin` bisects a list: searchsorted's per-call cost was most of `p` (a draft token each)


class AcceptanceModel:
    def __init__(self, prior_weight: float = 2.0, half_life: float = 256.0):
        self.prior_weight = prior_weight  # pseudo-observations behind each shrinkage step
        self.decay = 0.5 ** (1.0 / half_life)  # the run's recent verifications count most
        self.accepted = np.zeros(len(EDGES) + 1)
        self.drafted = np.zeros(len(EDGES) + 1)
        self._sums: tuple | None = None  # (accepted, drafted) over every bin, until the next observation

    @staticmethod
    def bin(q: float) -> int:
        return bisect_right(_EDGES, q)  # searchsorted(EDGES, q, side="right"), a NaN included (last bin)

    def observe(self, q: float, accepted: bool) -> None:
        """One verified draft token: its draft confidence and whether verification kept it."""
        self.accepted *= self.decay
        self.drafted *= self.decay
        b = self.bin(q)
        self.accepted[b] += float(accepted)
        self.drafted[b] += 1.0
        self._sums = None

    def p(self, q: float) -> float:
        """P(accepted | confidence q, the tokens before it accepted)."""
        w = self.prior_weight
        if self._sums is None:  # AE asks for every draft token, the counts change once a verification
            self._sums = (self.accepted.sum(), self.drafted.sum())
        pooled = (self._sums[0] + w * q) / (self._sums[1] + w)
        b = self.bin(q)
        return float((self.accepted[b] + w * pooled) / (self.drafted[b] + w))

    def table(self) -> list[dict]:
        """Per bin with evidence: its confidence range, weight of evidence and estimate."""
        lows = np.concatenate([[0.0], EDGES])
        highs = np.concatenate([EDGES, [1.0]])
        return [{"q": [float(lo), float(hi)], "drafted": round(float(n), 2),
                 "p_accept": round(self.p((lo + hi) / 2), 4)}
                for lo, hi, n in zip(lows, highs, self.drafted) if n > 0]
