"""The verification-cost model and the cost constants that drive adaptive expansion.

``VerificationCostModel`` follows scikit-learn's estimator conventions (``fit`` returns self,
learned values end in ``_``, ``score`` is R²) without importing scikit-learn at run time:
    latency ≈ t_base + t_token · n_tokens + t_exp_miss · n_missing + t_exp_hit · n_resident
where n_missing / n_resident count the distinct experts a pass needs that are not / are already
in the fast tier. Coefficients are fitted non-negative (a negative cost is never physical).
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

    def expert_cost(self, resident: bool) -> float:
        return self.t_exp_hit if resident else self.t_exp_miss

    def to_dict(self) -> dict:
        return asdict(self)


class VerificationCostModel:
    def __init__(self, nonnegative: bool = True):
        self.nonnegative = nonnegative

    def get_params(self, deep: bool = True) -> dict:
        return {"nonnegative": self.nonnegative}

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

    def fit(self, X, y) -> "VerificationCostModel":
        A, y = self._design(X), np.asarray(y, dtype=np.float64)
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

    def score(self, X, y) -> float:
        """R² of the prediction."""
        y = np.asarray(y, dtype=np.float64)
        resid = y - self.predict(X)
        total = ((y - y.mean()) ** 2).sum()
        return float(1 - (resid ** 2).sum() / total) if total > 0 else 0.0

    def mape(self, X, y) -> float:
        """Mean absolute percentage error as a fraction (0.02 = 2 %)."""
        y = np.asarray(y, dtype=np.float64)
        return float(np.mean(np.abs(y - self.predict(X)) / np.abs(y)))

    def constants(self, t_ar: float, c_draft: float, source: str) -> CostConstants:
        t_token, t_miss, t_hit = (float(v) for v in self.coef_)
        return CostConstants(t_ar, c_draft, t_miss, t_hit, self.intercept_, t_token, source)
