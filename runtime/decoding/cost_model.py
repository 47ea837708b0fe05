"""The verification-cost model and the cost constants that drive adaptive expansion.

``VerificationCostModel`` follows scikit-learn's estimator conventions (``fit`` returns self,
learned values end in ``_``, ``score`` is R²) without importing scikit-learn at run time:
    latency ≈ t_base + t_token · n_tokens + t_exp_miss · n_missing + t_exp_hit · n_resident
where n_missing / n_resident count the distinct experts a pass needs that are not / are already
in the fast tier. Coefficients are fitted non-negative (a negative cost is never physical).

Two prices AE takes from these constants live here too: ``marginal_verification_cost`` (what a
draft token adds to its verification) and ``expected_tokens`` (what a verification should emit).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

FEATURES = ("n_tokens", "n_missing", "n_resident")


@dataclass(frozen=True)
class CostConstants:
    """Seconds. ``source``: where they came from (profile, estimated, published)."""

    t_ar: float
    c_draft: float
    t_exp_miss: float
    t_exp_hit: float
    t_base: float = 0.0
    t_token: float = 0.0
    source: str = "estimated"
    # what verification still waits for an expert a prefetch was reading (beyond a hit): 0 on a
    # fast tier, where prefetches land during the draft; live runs measure it
    t_exp_inflight: float = 0.0

    def expert_cost(self, where: str) -> float:
        """``where``: "held", "in_flight" (a prefetch is reading it) or "missing"."""
        if where == "in_flight":
            return self.t_exp_hit + self.t_exp_inflight
        return self.t_exp_hit if where == "held" else self.t_exp_miss

    def to_dict(self) -> dict:
        return asdict(self)


LOSSES = ("relative", "absolute")


class VerificationCostModel:
    """``loss="relative"`` (default) minimises squared relative error: timing noise on a shared or
    thermally throttled machine is multiplicative (one speed factor scales a whole pass), and MAPE
    is the figure validation reports. ``sample_weight`` weighs rows, as in scikit-learn."""

    def __init__(self, nonnegative: bool = True, loss: str = "relative"):
        self.nonnegative = nonnegative
        self.loss = loss

    def get_params(self, deep: bool = True) -> dict:
        return {"nonnegative": self.nonnegative, "loss": self.loss}

    def set_params(self, **params) -> "VerificationCostModel":
        for k, v in params.items():
            setattr(self, k, v)
        return self

    @staticmethod
    def _design(X) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != len(FEATURES):
            raise ValueError(f"X must be [n, {len(FEATURES)}] with columns {FEATURES}")
        return np.hstack([np.ones((X.shape[0], 1)), X])

    def fit(self, X, y, sample_weight=None) -> "VerificationCostModel":
        if self.loss not in LOSSES:
            raise ValueError(f"loss {self.loss!r} not in {LOSSES}")
        A, y = self._design(X), np.asarray(y, dtype=np.float64)
        # weighted least squares: minimise Σ s_i · r_i², r_i the absolute or relative residual
        scale = np.sqrt(np.ones_like(y) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64))
        if self.loss == "relative":
            if np.any(y <= 0):
                raise ValueError("relative loss needs positive latencies")
            scale = scale / y
        A, y = A * scale[:, None], y * scale
        if self.nonnegative:
            from scipy.optimize import nnls

            coef, _ = nnls(A, y)
        else:
            coef = np.linalg.lstsq(A, y, rcond=None)[0]
        self.intercept_ = float(coef[0])
        self.coef_ = coef[1:]
        self.n_samples_ = len(y)
        return self

    def predict(self, X) -> np.ndarray:
        return self._design(X) @ np.concatenate([[self.intercept_], self.coef_])

    @classmethod
    def from_constants(cls, c: CostConstants) -> "VerificationCostModel":
        """The model a profile's constants make (validation predicts with it)."""
        model = cls()
        model.intercept_ = c.t_base
        model.coef_ = np.array([c.t_token, c.t_exp_miss, c.t_exp_hit])
        return model

    def score(self, X, y) -> float:
        """R² of the prediction."""
        return r2(y, self.predict(X))

    def mape(self, X, y) -> float:
        """Mean absolute percentage error as a fraction (0.02 = 2 %)."""
        return mape(y, self.predict(X))


    def constants(self, t_ar: float, c_draft: float, source: str) -> CostConstants:
        t_token, t_miss, t_hit = (float(v) for v in self.coef_)
        return CostConstants(t_ar, c_draft, t_miss, t_hit, self.intercept_, t_token, source)



def r2(y, predicted) -> float:
    """R² of ``predicted`` against ``y`` (0 where ``y`` does not vary)."""
    y = np.asarray(y, dtype=np.float64)
    total = ((y - y.mean()) ** 2).sum()
    return float(1 - ((y - predicted) ** 2).sum() / total) if total > 0 else 0.0


def mape(y, predicted) -> float:
    """Mean absolute percentage error of ``predicted`` as a fraction (0.02 = 2 %)."""
    y = np.asarray(y, dtype=np.float64)
    return float(np.mean(np.abs(y - predicted) / np.abs(y)))

def marginal_verification_cost(new_experts: set[tuple[int, int]], state, costs: CostConstants) -> float:
    """ΔC_ver(i|S): the cost of the experts token i adds to the verification batch (``new_experts``
    = E_i minus those S already brings). ``state(key)``: "held", "in_flight" (a prefetch is
    reading it) or "missing". A held expert costs compute only, one in flight also what
    verification still waits for it, a missing one its whole fetch."""
    return sum(costs.expert_cost(state(key)) for key in new_experts)


def expected_tokens(p_accept: list[float]) -> float:
    """Tokens a verification of this branch emits by AE's acceptance model: the bonus token plus
    each drafted token's probability that it and every one before it are kept."""
    total, prefix = 1.0, 1.0
    for p in p_accept:
        prefix *= p
        total += prefix
    return total


class UtilityRule:
    """AE's admission over one chain of draft tokens, the arithmetic only (no model passes), so the
    decoder and `s2moe-calib predict`'s re-decided replay make the same decisions from the same prices.

    It keeps the net gain Σ_j P_j·T_AR − θ·(ΔC_ver(j|S) + C_draft) (U_j ≥ θ is g_j ≥ 0) and the
    prefix where it peaked. Drafting goes on until ``lookahead`` tokens past that peak: a token that
    brings new experts may not pay alone and still open a run of tokens that reuse them and do.
    Lookahead 1 is the paper's rule. The admitted draft is the peak's prefix (``best_n``)."""

    def __init__(self, costs: CostConstants, threshold: float, lookahead: int, length: int):
        self.costs, self.threshold, self.lookahead, self.length = costs, threshold, lookahead, length
        self.prefix, self.gain, self.best, self.best_n = 1.0, 0.0, 0.0, 0

    def ceiling(self, p_accept: float) -> float:
        """The most the next token, or any later one, can gain: P_j·T_AR − θ·C_draft (P only falls,
        ΔC_ver ≥ 0). Below 0 even a token that brings no new expert cannot pay."""
        return self.prefix * p_accept * self.costs.t_ar - self.threshold * self.costs.c_draft

    def add(self, n: int, p_accept: float, ceiling: float, delta: float) -> bool:
        """Token number ``n`` (1-based) drafted at ``p_accept``, bringing ``delta`` = ΔC_ver(n|S).
        True when drafting should stop after it: the tokens the lookahead and the draft cap leave
        cannot climb back to the peak, so their passes would be waste."""
        self.gain += ceiling - self.threshold * delta
        self.prefix *= p_accept
        if self.gain >= self.best:
            self.best, self.best_n = self.gain, n
            return False
        left = min(self.lookahead - (n - self.best_n), self.length - n)
        return left <= 0 or self.best - self.gain >= left * ceiling
