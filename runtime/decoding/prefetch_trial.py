"""Prefetch where the run measures it paying: a trial of both ways, then the cheaper one.

Draft-guided prefetch hides verification's reads behind the draft's compute. Starting a read, and
the I/O thread it wakes, cost CPU, and on a host whose cores all compute that comes out of the
draft. Which one wins depends on the model and the machine (docs/performance/s2moe-prefetch.md,
"Prefetch where it is measured to pay"). On this 2-vCPU VM:
- embedded model, 168 KiB experts: prefetch saved verification 70 µs of reads a token and made
  each draft pass 96 µs dearer. S²-MoE ran 4-20 % slower with it;
- widened model, 3 MiB experts: verification waited 0.7-0.8 ms a token less with it, and the draft
  took about as much longer (2 rounds, within noise of each other). The 4.6-10 ms of reads it ran
  beside compute overstate what it saves: verification's own reads overlap much of that time.

A proxy for this (how long a read takes to land against what starting it costs the caller) told
the two apart on a quiet machine (ratios 11-13 against 26-282), but not under load: a start then
took 80-200 µs, and one widened run's ratio fell to 10, below the embedded model's. So the trial
measures the trade itself, per speculative iteration:
- the draft's seconds and passes (what prefetch adds to the draft: its starts, and the I/O threads
  beside its compute);
- the seconds verification waited for reads (what prefetch saves it).
A run starts with ``trial`` iterations each way, taking turns, so drift reaches both alike. It then
prefetches if what prefetch saved per verification exceeds what it added per draft pass times the
draft passes per verification, holds that choice for ``hold`` iterations, and tries again. Evidence
from earlier trials counts half at each new one.

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
        self.iterations = self.passes = 0.0
        self.draft_seconds = self.wait_seconds = 0.0

    def add(self, draft_seconds: float, passes: int, wait_seconds: float) -> None:
        self.iterations += 1
        self.passes += passes
        self.draft_seconds += draft_seconds
        self.wait_seconds += wait_seconds

    def age(self, factor: float) -> None:
        self.iterations *= factor
        self.passes *= factor
        self.draft_seconds *= factor
        self.wait_seconds *= factor


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

    def observe(self, draft_seconds: float, passes: int, wait_seconds: float) -> None:
        """The iteration `prefetch_now` was last asked for: its draft's seconds and passes, and the
        seconds its verification waited for reads."""
        if self.now:
            self.on_iterations += 1
        else:
            self.off_iterations += 1
        if self.step < 2 * self.trial:
            self.sides[self.now].add(draft_seconds, passes, wait_seconds)
        self.step += 1
        if self.step == 2 * self.trial:
            self._decide()
        elif self.step >= 2 * self.trial + self.hold:
            self.step = 0
            for side in self.sides.values():
                side.age(0.5)

    def _decide(self) -> None:
        on, off = self.sides[True], self.sides[False]
        if min(on.iterations, off.iterations) < self.min_iterations or not (on.passes and off.passes):
            return  # too little to go on: keep the last choice
        extra_per_pass = on.draft_seconds / on.passes - off.draft_seconds / off.passes
        passes_per_verification = (on.passes + off.passes) / (on.iterations + off.iterations)
        added = extra_per_pass * passes_per_verification
        saved = off.wait_seconds / off.iterations - on.wait_seconds / on.iterations
        self.choice = saved > added
        self.decisions.append({"saved_ms": round(saved * 1e3, 4), "added_ms": round(added * 1e3, 4),
                               "prefetch": self.choice})

    def to_dict(self) -> dict:
        """Per verification: what prefetch saved verification's reads and added to the draft, at each
        decision; and how many iterations prefetched."""
        return {"decisions": self.decisions, "prefetched_iterations": self.on_iterations,
                "held_back_iterations": self.off_iterations}
