"""A guard on measured speed: AE speculates only while speculation emits tokens faster than AR steps.

AE admits a draft token when its priced utility U = p·T_AR / (ΔC_ver + C_draft) reaches the
threshold, but those prices leave out costs no single token carries: the root draft pass of every
verification, lookahead tokens drafted and dropped, the interpreter between passes. Where they make
speculation slower than plain steps (the embedded model with every expert resident, on this CPU:
about 0.8× AR), AE alone keeps paying for it. The guard keeps what each way of stepping actually
cost, in seconds per emitted token, and when speculation is the slower one it takes AR steps for a
hold that doubles each time a probe finds speculation still slower (4, 8, … 64 steps). AR steps stay
measured: natural ones (AE's back-off, the holds), and one probe after ``probe_every`` speculative
iterations without any. Until ``min_ar`` AR steps are measured a probe comes every
``early_probe_every`` iterations: with every expert resident AE never backs off, and at one probe
per 32 iterations the evidence took 128 iterations, so a 256-token run ended before any hold.
Evidence on each side also ages with the other side's iterations (half-life 16): without that, the
probe after a 64-step hold weighed 1/9 against speculation as it was before the hold, and a slow
start kept speculation held for most of a run after it had become twice as fast. A speculative
iteration counts the tokens AE expected of it (scaled by how many iterations kept against that),
not the ones it happened to keep: see `RateGuard.observe`.

It follows the clock, so it runs only with live cost constants (runs whose constants are fixed
make the same decisions on any machine, and keep doing so).
"""

from __future__ import annotations

import math


class _Rate:
    """Exponentially weighted seconds per token over observations (whole iterations)."""

    def __init__(self, decay: float):
        self.decay, self.seconds, self.tokens, self.n = decay, 0.0, 0.0, 0

    def age(self, factor: float) -> None:
        """Older evidence counts less, whatever the value it gives (both sums shrink alike)."""
        self.seconds *= factor
        self.tokens *= factor

    def observe(self, tokens: int, seconds: float) -> None:
        self.seconds = self.seconds * self.decay + seconds
        self.tokens = self.tokens * self.decay + tokens
        self.n += 1

    @property
    def value(self) -> float:
        return self.seconds / self.tokens if self.tokens > 0 else math.inf


class RateGuard:
    BASE_HOLD = 4

    def __init__(self, half_life: float = 6.0, margin: float = 0.05, min_spec: int = 8, min_ar: int = 4,
                 probe_every: int = 32, max_hold: int = 64, early_probe_every: int = 2, age_half_life: float = 16.0,
                 calibration_half_life: float = 64.0, calibration_prior: float = 32.0):
        decay = 0.5 ** (1.0 / half_life)
        self.spec, self.ar = _Rate(decay), _Rate(decay)
        # evidence also ages with the run's iterations of the other kind: a side the guard keeps off
        # (speculation through a hold, AR between probes) would otherwise be judged on what it cost
        # 64 steps ago, against one fresh probe worth about 1/9 of it
        self.aging = 0.5 ** (1.0 / age_half_life) if age_half_life > 0 else 1.0
        self.margin, self.min_spec, self.min_ar = margin, min_spec, min_ar
        self.probe_every, self.max_hold, self.early_probe_every = probe_every, max_hold, early_probe_every
        self.hold, self.next_hold, self.since_ar = 0, self.BASE_HOLD, 0
        # tokens kept against AE's expectation of them, over many iterations (see `observe`)
        self.calibration_decay = 0.5 ** (1.0 / calibration_half_life)
        self.kept = self.expected = calibration_prior  # pseudo-tokens: AE taken as calibrated at first
        self.holds = self.held_steps = self.probes = 0

    def speculate(self) -> bool:
        """Once per iteration: False means take an AR step (a hold, or a probe of AR's speed)."""
        if self.hold > 0:
            self.hold -= 1
            self.held_steps += 1
            return False
        if self.since_ar >= (self.probe_every if self.ar.n >= self.min_ar else self.early_probe_every):
            self.probes += 1
            self.since_ar = 0
            return False
        return True

    def observe(self, speculated: bool, tokens: int, seconds: float, expected: float | None = None) -> None:
        """An iteration emitted ``tokens`` in ``seconds``: a speculative one (drafted, verified) or
        an AR step (whatever took it: the guard, AE's back-off).

        ``expected``: the tokens AE expected the speculative iteration to emit (1 + the sum of its
        drafted tokens' prefix acceptance probabilities). How many drafted tokens one iteration
        keeps swings its rate several-fold, so a decision on one iteration (the probe after a hold)
        was a coin toss: on a simulated clock where speculation was 1.15× faster than AR, the holds
        still took a median 81 of 378 steps (219 at p90; benchmarks/guard_sim.py). The rate counts
        the expectation instead, scaled by the tokens iterations kept against what AE expected over
        a long memory (half-life ``calibration_half_life`` iterations, starting from
        ``calibration_prior`` tokens as expected), so it stays unbiased where AE is not calibrated.
        """
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        if speculated and expected is not None and math.isfinite(expected) and expected > 0:
            self.kept = self.kept * self.calibration_decay + tokens
            self.expected = self.expected * self.calibration_decay + expected
            tokens = expected * self.kept / self.expected
        (self.spec if not speculated else self.ar).age(self.aging)
        if not speculated:
            self.ar.observe(tokens, seconds)
            self.since_ar = 0
            return
        self.spec.observe(tokens, seconds)
        self.since_ar += 1
        if self.spec.n < self.min_spec or self.ar.n < self.min_ar:
            return
        if self.spec.value > self.ar.value * (1.0 + self.margin):
            self.hold, self.holds = self.next_hold, self.holds + 1
            self.next_hold = min(2 * self.next_hold, self.max_hold)
        elif self.spec.value <= self.ar.value:
            self.next_hold = self.BASE_HOLD

    def to_dict(self) -> dict:
        finite = lambda v: round(v * 1e3, 4) if math.isfinite(v) else None  # noqa: E731
        return {"holds": self.holds, "held_steps": self.held_steps, "probes": self.probes,
                "kept_per_expected": round(self.kept / self.expected, 4),
                "ms_per_token": {"speculative": finite(self.spec.value), "ar": finite(self.ar.value)}}
