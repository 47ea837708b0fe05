"""Cost constants that follow the device during a run (issue 16: live recalibration).

A profile's T_AR, C_draft and T_exp are measured once; a device that warms up, throttles or shares
its disk drifts away from them within minutes. `LiveCosts` keeps running estimates from the passes
the run actually makes:

- verification passes: an exponentially weighted least-squares fit of pass seconds on the profile's
  features (1, n_tokens, n_missing, n_resident), pulled toward the profile's coefficients by a
  prior worth ``prior_passes`` passes, so the estimate is defined from the first pass and moves as
  evidence arrives (weight of a pass halves every ``half_life`` passes). A change of regime (the
  predictions off by more than 15 % for 4 passes running, as when a disk slows down) forgets the
  old passes at once instead of averaging them away slowly;
- draft passes: an exponentially weighted mean of seconds per drafted token (C_draft);
- single-token passes (AR steps, empty drafts): the same for T_AR;
- prefetched experts a verification used: an exponentially weighted mean of how long it still
  waited for each (t_exp_inflight). AE prices an expert a prefetch is reading at a hit plus that:
  on a fast tier the reads land during the draft, on a slow link verification waits for most of them.

`current()` returns `CostConstants` for AE; `drift()` compares them with the profile's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .cost_model import CostConstants


class _EwMean:
    def __init__(self, prior: float, prior_weight: float, decay: float):
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.total, self.weight, self.n = 0.0, 0.0, 0

    def observe(self, value: float) -> None:
        self.total = self.total * self.decay + value
        self.weight = self.weight * self.decay + 1.0
        self.n += 1

    @property
    def value(self) -> float:
        return (self.total + self.prior * self.prior_weight) / (self.weight + self.prior_weight)


class LiveCosts:
    SHIFT, RUN = 0.15, 4  # a regime change: predictions this far off, this many passes running

    def __init__(self, prior: CostConstants, half_life: float = 10.0, prior_passes: float = 0.1):
        self.prior = prior
        self.decay = 0.5 ** (1.0 / half_life)
        self.prior_passes = prior_passes
        self.theta0 = np.array([prior.t_base, prior.t_token, prior.t_exp_miss, prior.t_exp_hit])
        self.G = np.zeros((4, 4))
        self.b = np.zeros(4)
        self.scale = np.zeros(4)  # running mean of each feature's square: the prior's units
        self.passes = 0
        self.residual, self.off_run, self.restarts = 0.0, 0, 0
        self.t_ar = _EwMean(prior.t_ar, prior_passes, self.decay)
        self.c_draft = _EwMean(prior.c_draft, prior_passes, self.decay)
        self.inflight = _EwMean(prior.t_exp_inflight, prior_passes, self.decay)
        self._theta: np.ndarray | None = None  # the fit for the current G, b (AR steps do not move it)
        from scipy.optimize import nnls  # here, not in the first verification: importing takes 0.5 s

        self._nnls = nnls

    def observe_verify(self, n_tokens: int, n_missing: int, n_resident: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        a = np.array([1.0, n_tokens, n_missing, n_resident])
        predicted = float(a @ self.coefficients())
        if predicted > 0:  # how far off the current constants are, smoothed over a few passes
            self.residual = 0.6 * self.residual + 0.4 * (seconds / predicted - 1.0)
            self.off_run = self.off_run + 1 if abs(self.residual) > self.SHIFT else 0
            if self.off_run >= self.RUN:  # the device changed: keep little of what it was
                self.G *= 0.05
                self.b *= 0.05
                self.off_run, self.residual = 0, 0.0
                self.restarts += 1
        self._theta = None
        self.G = self.G * self.decay + np.outer(a, a)
        self.b = self.b * self.decay + a * seconds
        self.passes += 1
        self.scale += (a * a - self.scale) / self.passes
        if n_tokens == 1:
            self.t_ar.observe(seconds)

    def observe_ar(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0:
            self.t_ar.observe(seconds)

    def observe_draft(self, seconds: float, passes: int) -> None:
        if passes > 0 and math.isfinite(seconds) and seconds > 0:
            self.c_draft.observe(seconds / passes)

    def observe_prefetch_wait(self, used: int, waited_seconds: float) -> None:
        """A verification used ``used`` prefetched experts and waited ``waited_seconds`` for them."""
        if used > 0 and math.isfinite(waited_seconds) and waited_seconds >= 0:
            self.inflight.observe(waited_seconds / used)

    def coefficients(self) -> np.ndarray:
        """(t_base, t_token, t_exp_miss, t_exp_hit): the ridge fit toward the profile's, ≥ 0.

        The constraint is part of the fit (non-negative least squares on the Cholesky factor of the
        normal equations), not a clip afterwards: in one-token passes n_missing + n_resident is
        constant, so the unconstrained fit can trade a negative hit or token price against the base
        and a miss price several times what a miss adds; clipping kept that miss price."""
        if self.passes == 0:
            return self.theta0.copy()
        if self._theta is None:
            D = np.diag(self.prior_passes * np.maximum(self.scale, 1e-9))
            # minimise θᵀ(G + D)θ − 2θᵀ(b + Dθ₀) over θ ≥ 0, i.e. ‖Lᵀθ − L⁻¹(b + Dθ₀)‖² with G + D = LLᵀ
            L = np.linalg.cholesky(self.G + D)
            self._theta, _ = self._nnls(L.T, np.linalg.solve(L, self.b + D @ self.theta0))
        return self._theta.copy()

    def current(self) -> CostConstants:
        base, token, miss, hit = (float(x) for x in self.coefficients())
        return replace(self.prior, t_base=base, t_token=token, t_exp_miss=miss, t_exp_hit=hit,
                       t_ar=self.t_ar.value, c_draft=self.c_draft.value, t_exp_inflight=self.inflight.value,
                       source="live")

    def drift(self) -> dict[str, float]:
        """Relative change of each constant from the profile's (only those the profile set)."""
        now = self.current()
        out = {}
        for name in ("t_ar", "c_draft", "t_exp_miss", "t_exp_hit"):
            was = getattr(self.prior, name)
            if was > 0:
                out[name] = getattr(now, name) / was - 1.0
        return out
