"""Replacement policies of the expert cache (offload/cache.py): which resident expert leaves when a
fetched one needs the room. `lru`, or `lfu` (frequency with exponential decay, the default)."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, defaultdict

Key = tuple[int, int]


class LRU:
    """Evicts the least recently used expert; admits every fetched expert."""

    name = "lru"

    def __init__(self):
        self.order: OrderedDict[Key, None] = OrderedDict()

    def access(self, key: Key) -> None:  # a miss: LRU keeps no history of absent keys
        pass

    def insert(self, key: Key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    touch = insert  # a hit

    def admit(self, key: Key, victim: Key, coming: bool = False) -> bool:
        return True

    def remove(self, key: Key) -> None:
        self.order.pop(key, None)

    def victim(self, protected: set[Key]) -> Key | None:
        return next((k for k in self.order if k not in protected), None)


class DecayedLFU:
    """Evicts the resident expert with the lowest exponentially decayed use count, and admits a
    fetched expert only if it has been used more than that victim (TinyLFU-style admission).

    Counts are kept for absent experts too and survive eviction (routing skew is persistent), so
    a verification batch that touches many rarely used experts streams them through instead of
    flushing the experts every pass needs; ties go to the least recently used.

    The victim comes from a heap, O(log n) per eviction: decay multiplies every score by the same
    factor as the clock advances, so log2(count) + last / half_life orders experts exactly as the
    decayed score does and changes only when an expert is used. Superseded entries are skipped
    when they surface and dropped when the heap outgrows the resident set.
    """

    name = "lfu"

    def __init__(self, half_life: float = 512.0):
        self.half_life = half_life
        self.clock = 0
        self.count: dict[Key, float] = defaultdict(float)
        self.last: dict[Key, int] = {}
        self.resident: set[Key] = set()
        self._heap: list[tuple[float, int, Key]] = []
        self._entry: dict[Key, tuple[float, int, Key]] = {}  # the live heap entry of each resident key

    def _score(self, key: Key) -> float:
        return self.count[key] * 0.5 ** ((self.clock - self.last.get(key, self.clock)) / self.half_life)

    def _push(self, key: Key) -> None:
        count, last = self.count[key], self.last.get(key, 0)
        entry = (math.log2(count) + last / self.half_life if count > 0 else -math.inf, last, key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._entry) + 64:
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)

    def access(self, key: Key) -> None:
        self.clock += 1
        self.count[key] = self._score(key) + 1.0
        self.last[key] = self.clock
        if key in self.resident:
            self._push(key)

    def insert(self, key: Key) -> None:
        self.resident.add(key)
        self._push(key)

    def touch(self, key: Key) -> None:  # a hit
        self.resident.add(key)
        self.access(key)

    def admit(self, key: Key, victim: Key, coming: bool = False) -> bool:
        """``coming``: ``key`` is predicted, not used yet: ranked as it will be when its use comes."""
        return self._score(key) + coming > self._score(victim)

    def remove(self, key: Key) -> None:
        self.resident.discard(key)
        self._entry.pop(key, None)

    def victim(self, protected: set[Key]) -> Key | None:
        skipped, found = [], None
        while self._heap:
            entry = self._heap[0]
            key = entry[2]
            if self._entry.get(key) is not entry:  # superseded, or no longer resident
                heapq.heappop(self._heap)
            elif key in protected:
                skipped.append(heapq.heappop(self._heap))
            else:
                found = key
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found


POLICIES = {"lru": LRU, "lfu": DecayedLFU}
