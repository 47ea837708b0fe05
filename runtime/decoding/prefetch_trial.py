"""Prefetch where the run measures it paying: a trial of both ways, then the cheaper one.

Asked for with `--prefetch-trial` (`SpecSettings.prefetch_always=False`). Since session 28 every
iteration prefetches by default: on 12 prompts a workload the trial was never faster (0.89-1.01x
prefetching always, docs/performance/s2moe-prefetch.md, "Prefetch on every iteration by default").
The figures below were taken on 3-6 prompts, which follow a few texts under residency-aware gating.

Draft-guided prefetch hides verification's reads behind the draft's compute. Starting a read, and
the I/O thread it wakes, cost CPU, and on a host whose cores all compute that comes out of the
draft. Which one wins depends on the model and the machine (docs/performance/s2moe-prefetch.md,
"Prefetch where it is measured to pay"). On this 2-vCPU VM:
- embedded model, 168 KiB experts: prefetch saved verification 70 µs of reads a token and made
  each draft pass 96 µs dearer. S²-MoE ran 4-20 % slower with it;
- widened model, 3 MiB experts: it cut verification's wait from 2.38 to 2.00 ms a token and added
  0.93 ms of draft compute and 0.22 of verification's; 6 rounds ran 5 % slower with it. The 8 ms
  a token of reads it ran beside compute overstate what it saves: verification's own reads
  overlap much of that time.

So the trial judges each way on the whole iteration: seconds per token, the tokens counted as AE
expected them, as the rate guard counts them (how many one iteration happens to keep swings
several-fold). Two cheaper signals were tried first and misjudged: how long a read takes to land
against what starting it costs (under load the two models' ratios overlapped), and the draft's
added seconds against verification's saved wait (it missed verification's added compute and AE's
shorter drafts). AE's shorter drafts the trial sees only in part: the two ways take turns under
one set of live constants.

A run starts with ``trial`` iterations each way, taking turns, so drift reaches both alike. It then
keeps the way with fewer seconds per expected token for ``hold`` iterations, and tries again.
Evidence from earlier trials counts half at each new one.

Only the host decides so: a device's compute does not wait on the CPU that starts its copies. And
only runs with live cost constants do: it follows the clock, as the rate guard does, and a run
with fixed constants makes the same decisions on any machine (with residency-aware gating, what is
resident can change the tokens).
"""

from __future__ import annotations


def trial_for(model, method, settings, live: bool) -> "PrefetchTrial | None":
    """A trial for a decoder that drafts and prefetches on the host with live costs, else None
    (``settings.prefetch_always``: every iteration prefetches)."""
    on_device = getattr(getattr(model, "backend", None), "on_device", False)
    cache = model.experts
    if (live and settings.prefetch and not settings.prefetch_always and not on_device and method.admit != "none"
            and getattr(cache, "prefetch_slots", 0) > 0 and hasattr(cache, "hold_back")):
        return PrefetchTrial()
    return None


class _Side:
    """Sums over the trial iterations taken one way."""

    def __init__(self):
        self.iterations = self.seconds = self.tokens = 0.0

    def add(self, seconds: float, tokens: float) -> None:
        self.iterations += 1
        self.seconds += seconds
        self.tokens += tokens

    def age(self, factor: float) -> None:
        self.iterations *= factor
        self.seconds *= factor
        self.tokens *= factor

    @property
    def rate(self) -> float:
        """Seconds per token."""
        return self.seconds / self.tokens


class PrefetchTrial:
    def __init__(self, trial: int = 12, hold: int = 96, min_iterations: int = 4):
        self.trial, self.hold, self.min_iterations = trial, hold, min_iterations
        self.sides = {True: _Side(), False: _Side()}
        self.step = 0  # iterations into the current cycle: 2 × trial taking turns, then the hold
        self.choice = True  # prefetch until measured otherwise
        self.now = True
        self.decisions: list[dict] = []
        self.on_iterations = self.off_iterations = 0

    def prefetch_now(self) -> bool:
        """Once per speculative iteration, before its draft: whether it prefetches."""
        self.now = self.step % 2 == 0 if self.step < 2 * self.trial else self.choice
        return self.now

    def observe(self, seconds: float, tokens: float) -> None:
        """The iteration `prefetch_now` was last asked for: what it took, drafting and verifying, and
        the tokens AE expected of it."""
        if self.now:
            self.on_iterations += 1
        else:
            self.off_iterations += 1
        if self.step < 2 * self.trial and seconds > 0 and tokens > 0:
            self.sides[self.now].add(seconds, tokens)
        self.step += 1
        if self.step == 2 * self.trial:
            self._decide()
        elif self.step >= 2 * self.trial + self.hold:
            self.step = 0
            for side in self.sides.values():
                side.age(0.5)

    def _decide(self) -> None:
        on, off = self.sides[True], self.sides[False]
        if min(on.iterations, off.iterations) < self.min_iterations:
            return  # too little to go on: keep the last choice
        self.choice = on.rate < off.rate
        self.decisions.append({"ms_per_token_prefetching": round(on.rate * 1e3, 4),
                               "ms_per_token_not": round(off.rate * 1e3, 4), "prefetch": self.choice})

    def to_dict(self) -> dict:
        """Each decision (ms per expected token each way) and how many iterations went each way."""
        return {"decisions": self.decisions, "prefetched_iterations": self.on_iterations,
                "held_back_iterations": self.off_iterations}
