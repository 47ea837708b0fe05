"""What a background read of an expert costs the thread that starts it, against how long it takes to land.

Draft-guided prefetch hides a read's time behind the draft's compute, but starting a read and
taking it in cost CPU, and on a CPU whose cores all compute that comes out of the draft. Which one
wins depends on the tier, not on the method. Measured on this 2-vCPU VM inside runs
(docs/performance/s2moe-prefetch.md, "A gate on what a prefetch costs to start"):
- the embedded model's 168 KiB experts land 250-320 µs after a start that costs the caller
  22-25 µs (medians, a ratio of 11-13). Prefetch there made S²-MoE 4-11 % slower: a draft pass
  took 96 µs more and hid only ~55 µs of reads per used prefetch;
- in S²-MoE runs on the widened model, 3 MiB experts land 4.3-7.4 ms after a 26-79 µs start
  (54-282), and prefetch hides 8-13 ms of reads per token.

`ReadCosts` keeps both over the last reads (medians: one start preempted by the thread it wakes, or
one read queued behind others, does not swing it); `ExpertCache.prefetch` starts guesses only
while landing takes at least ``prefetch_gate`` times what starting takes. Every read of the store
counts (verification's and AR's too), so the ratio stays measured while prefetch is held off.
"""

from __future__ import annotations

import statistics
from collections import deque

# where the gate sits: between the two regimes measured (11-13 and 54-282), a factor of about two
# from each; 0 turns the gate off (always prefetch)
DEFAULT_PREFETCH_GATE = 24.0


class ReadCosts:
    def __init__(self, window: int = 64, min_reads: int = 8):
        self.starts: deque[float] = deque(maxlen=window)  # seconds the caller spent starting one read
        self.landings: deque[float] = deque(maxlen=window)  # seconds from its start until its bytes landed
        self.min_reads = min_reads
        self._ratio: float | None = None
        self._fresh = 0  # observations since the ratio was worked out

    def observe_start(self, seconds: float, reads: int = 1) -> None:
        """``reads`` reads were started in ``seconds`` (one call), each counted at the mean."""
        if reads > 0 and seconds >= 0:
            self.starts.extend([seconds / reads] * min(reads, self.starts.maxlen or reads))
            self._fresh += reads

    def observe_landing(self, seconds: float) -> None:
        """(a Python fetch thread's done-callback may call it: deque appends are atomic, and a lost
        count of ``_fresh`` only delays the next refresh)"""
        if seconds >= 0:
            self.landings.append(seconds)
            self._fresh += 1

    def ratio(self) -> float | None:
        """Median landing over median start; None until ``min_reads`` of each are measured. Worked
        out again after every 8 new observations (a prefetch asks after each draft token)."""
        if self._fresh >= 8 or self._ratio is None:
            starts, landings = list(self.starts), list(self.landings)
            if len(starts) < self.min_reads or len(landings) < self.min_reads:
                return None
            self._ratio = statistics.median(landings) / max(statistics.median(starts), 1e-7)
            self._fresh = 0
        return self._ratio

    def to_dict(self) -> dict:
        r = self.ratio()
        med = lambda d: round(statistics.median(d) * 1e6, 1) if d else None  # noqa: E731
        return {"start_us": med(list(self.starts)), "landing_us": med(list(self.landings)),
                "ratio": None if r is None else round(r, 2)}
