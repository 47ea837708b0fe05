"""Reads a layer ahead inside a multi-token pass, into the streaming workspace.

A verification pass computes its layers one after the other, and each layer's misses start reading only
once its routing is known, so the disk sits idle while a layer's last experts, the next attention and
the next router compute. While layer L runs, the pass's guess of the next MoE layer's experts
(`model/read_ahead.py`) starts reading once L's own reads are all queued. The guesses are not the
cache's:
- no expert is evicted for one;
- gating's E* never counts them, so a pass routes as it would without them (the cache may admit its
  reads in another order, the guessed ones first);
- they take slots of the streaming workspace that the plan already holds, never more (`room`).
The next layer's stream takes the ones it needs as reads already in flight; the rest are dropped once
they have landed (a read the disk has started cannot be called back, and its buffer is the plan's).
"""

from __future__ import annotations

import time

from .stats import ReadAheadStats

Key = tuple[int, int]


class ReadAhead:
    """Guessed reads of a coming layer: planned during a layer, started once its reads are queued
    (`start`), taken by the layer they were for (`take`), dropped past it (`drop`)."""

    def __init__(self, store):
        self.store = store
        self.reads: dict[Key, tuple[object, float, list]] = {}  # future, issued at, [done at]
        self.planned: list[Key] = []
        self.stats = ReadAheadStats()

    def __len__(self) -> int:
        return len(self.reads)

    def plan(self, keys) -> None:
        """The next layer's guesses, likeliest first: started by the next `start`."""
        self.planned = list(keys)

    def start(self, room: int, skip) -> int:
        """Start up to ``room`` planned reads (``skip(key)``: resident or already being read); the
        rest stay planned for when the workspace lends more. Returns how many started."""
        submit = getattr(self.store, "submit", None)
        started, left = 0, []
        for key in self.planned:
            if key in self.reads or skip(key):
                continue
            if submit is None or started >= room:
                left.append(key)
                continue
            issued_at = time.perf_counter()  # before the submit: a native read may land before it returns
            try:
                future = submit(key[0], [key[1]])[0]
            except Exception:  # a guess's failure is no one's: a pass that needs the expert reads it itself
                left.append(key)
                continue
            done: list = []
            if hasattr(future, "add_done_callback"):
                future.add_done_callback(lambda _f, done=done: done.append(time.perf_counter()))
            self.reads[key] = (future, issued_at, done)
            started += 1
        self.planned = left
        self.stats.issued += started
        return started

    def take(self, keys) -> list[tuple[Key, tuple[object, float, list]]]:
        """The reads a layer's stream needs among ``keys``: theirs now, counted as used."""
        mine = [(key, self.reads.pop(key)) for key in keys if key in self.reads]
        self.stats.used += len(mine)
        return mine

    def drop(self, through_layer: int | None = None) -> float:
        """Drop the guesses for layers up to ``through_layer`` (all with None): a pass never goes
        back to a layer. A read not started is cancelled; one still running is left to land (its
        buffer stays counted against the workspace until a later call finds it done). Returns the
        seconds spent collecting the landed ones."""
        waited = 0.0
        for key, (future, _, _) in list(self.reads.items()):
            if through_layer is not None and key[0] > through_layer:
                continue
            if hasattr(future, "done") and not future.done():
                if future.cancel():
                    del self.reads[key]
                    self.stats.wasted += 1
                continue
            del self.reads[key]
            self.stats.wasted += 1
            t0 = time.perf_counter()
            try:
                future.result() if hasattr(future, "result") else future
            except Exception:  # a guess nobody needs: its failure is no one's (a pass that needs it reads again)
                continue
            finally:
                waited += time.perf_counter() - t0
            self.stats.wasted_bytes += self.store.stored_bytes(*key)
        return waited
