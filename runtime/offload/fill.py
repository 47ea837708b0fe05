"""Start like mmap: at full residency a run's first token does not wait for experts it does not use.

The prompt's passes (phase "prefill") read the experts they need, as any miss is read. From the
first pass after them, the rest are read on the fetch threads, a few at a time (reads stay
O_DIRECT, into the room the plan gives every expert: nothing is counted twice), and made
resident at the start of each pass: only the decoding thread changes the cache. A pass that needs
an expert whose read is in flight takes that read over; one not started yet it reads itself, and
the fill then skips it. llama.cpp maps the file and faults pages in on first use; this reads in
the background too, so decoding is warm after a few seconds instead of after every expert's
first use (docs/performance/peer.md, "Start like mmap").
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable

Key = tuple[int, int]

# the fill waits while these run: their reads come first, and start-up's cost estimate times
# passes that background reads would slow
WAIT_PHASES = ("prefill", "load", "estimate")
DEPTH = 8  # reads in flight: enough to keep the disk busy, few enough to leave a pass's reads room


class BackgroundFill:
    def __init__(self, cache, keys: Iterable[Key], depth: int = DEPTH):
        self.cache = cache
        self.pending: deque[Key] = deque(keys)
        self.inflight: dict[Key, object] = {}
        self.depth = depth
        self.started_at: float | None = None
        self.done_at: float | None = None
        self.kept = 0
        self.taken = 0  # reads a pass took over
        self.abandoned = 0  # experts still to read when the run ended (`stop`)

    @property
    def active(self) -> bool:
        return bool(self.pending or self.inflight)

    def step(self) -> None:
        """At a pass's start: keep the reads that landed, start more (not while the prompt runs)."""
        cache = self.cache
        if self.started_at is None:
            if cache.phase in WAIT_PHASES:
                return
            self.started_at = time.perf_counter()
        for key, future in [(k, f) for k, f in self.inflight.items() if future_done(f)]:
            del self.inflight[key]
            try:
                weights = future.result() if hasattr(future, "result") else future
            except Exception:  # a failed read: the pass that needs this expert reads it again
                continue
            cache.stats["load"].bytes_read += cache.store.stored_bytes(*key)
            if key not in cache.held:
                cache._keep(key, cache.place(weights))
                self.kept += 1
        cache.peak_resident_bytes = max(cache.peak_resident_bytes, cache.resident_bytes)
        while self.pending and len(self.inflight) < self.depth:
            key = self.pending.popleft()
            if key not in cache.held and not cache.in_flight(key):
                self.inflight[key] = cache.store.submit(key[0], [key[1]])[0]
        self._note_done()

    def _note_done(self) -> None:
        if not self.active and self.done_at is None and self.started_at is not None:
            self.done_at = time.perf_counter()

    def take(self, key: Key):
        """``key``'s read in flight (a pass needs it now), or None."""
        future = self.inflight.pop(key, None)
        if future is not None:
            self.taken += 1
            self._note_done()
        return future

    def stop(self) -> None:
        """No more reads: unstarted ones cancelled, running ones waited for (their buffers)."""
        self.abandoned += len(self.pending) + len(self.inflight)
        self.pending.clear()
        for future in self.inflight.values():
            if hasattr(future, "cancel") and not future.cancel():
                try:
                    future.result()
                except Exception:
                    pass
        self.inflight.clear()

    def report(self) -> dict:
        seconds = None if self.started_at is None or self.done_at is None else self.done_at - self.started_at
        return {"kept": self.kept, "taken_by_passes": self.taken,
                "left": len(self.pending) + len(self.inflight) + self.abandoned,
                "seconds": None if seconds is None else round(seconds, 3)}


def future_done(item) -> bool:
    """A read's future has landed (a plain value: at once). offload/cache.py uses it too."""
    return item.done() if hasattr(item, "done") else True
