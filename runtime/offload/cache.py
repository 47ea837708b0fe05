"""The fast tier: resident experts (stored encoding) within a byte budget.

Hot experts (from a profile or a published-format hot list) are pinned; the rest of the space is
managed by a replacement policy (`offload/policies.py`: `lru`, or `lfu`, frequency with exponential
decay). The experts a request asks for are protected while it is served, so nothing the current
pass needs is evicted; when pinned and protected experts leave no room, a fetched expert streams
through (used once, not kept) and the resident bytes never exceed the budget.

`stream` hands a layer's experts to the forward pass as they become available: the resident ones
at once, then the missing ones as their reads complete, with at most ``window`` reads in flight.
The kernels compute the first groups (GIL released) while the fetch threads read the next, and
experts that stream through occupy at most 2 × window experts' memory (the plan counts this).

Accounting is per phase (prefill / draft / verify / ar / load): hits, misses, bytes read, fetch
seconds, achieved bandwidth, unique experts per pass; plus peak resident bytes.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..errors import UsageError
from .experts import ExpertWeights
from .fill import BackgroundFill, future_done as _done
from .policies import LRU, POLICIES, DecayedLFU  # noqa: F401 (LRU, DecayedLFU: imported from here too)

Key = tuple[int, int]


@dataclass
class PhaseStats:
    hits: int = 0
    misses: int = 0
    streamed: int = 0  # misses that could not be kept (no evictable room)
    bytes_read: int = 0
    fetch_seconds: float = 0.0
    passes: int = 0
    unique_experts: int = 0  # summed over passes

    def to_dict(self) -> dict:
        looked_up = self.hits + self.misses
        return {
            "hits": self.hits, "misses": self.misses, "streamed": self.streamed,
            "hit_rate": round(self.hits / looked_up, 4) if looked_up else None,
            "bytes_read": self.bytes_read, "fetch_seconds": round(self.fetch_seconds, 6),
            "bandwidth_mb_s": round(self.bytes_read / self.fetch_seconds / 1e6, 2) if self.fetch_seconds else None,
            "passes": self.passes,
            "unique_experts_per_pass": round(self.unique_experts / self.passes, 3) if self.passes else None,
        }


@dataclass
class PrefetchStats:
    """Draft-guided prefetch: experts read ahead of the verification pass that needs them."""

    issued: int = 0
    used: int = 0  # served a verification miss (no read on the critical path, or a shorter one)
    kept: int = 0  # not used, kept in the cache (in the room it took, or free room for a borrowed one)
    wasted: int = 0  # not used, dropped
    wasted_bytes: int = 0
    refused: int = 0  # not started: no room in the cache (see borrowed) and no idle read buffer
    refused_keys: int = 0  # of those, distinct experts per iteration (a guess is refused after each draft token)
    borrowed: int = 0  # of those issued: read into the idle streaming workspace, the cache having no room
    gated: int = 0  # calls (a draft token's guesses) held back by the prefetch trial
    read_seconds: float = 0.0  # of the prefetches used: issue to completion
    waited_seconds: float = 0.0  # of those, what a pass still waited
    # verification's reads no prefetch had started, by why: the guess was refused (no room), left
    # past the reads-in-flight cap, predicted while resident (or used by the draft) and evicted
    # since, or never predicted (another token's choice, or gating's)
    missed_refused: int = 0
    missed_capped: int = 0
    missed_evicted: int = 0
    missed_unpredicted: int = 0
    missed_gated: int = 0  # predicted, but this iteration's guesses were held back (see `hold_back`)

    def to_dict(self) -> dict:
        return {"issued": self.issued, "used": self.used, "kept": self.kept, "wasted": self.wasted,
                "wasted_bytes": self.wasted_bytes, "refused": self.refused, "refused_keys": self.refused_keys,
                "borrowed": self.borrowed, "gated": self.gated, "missed_refused": self.missed_refused,
                "missed_capped": self.missed_capped, "missed_evicted": self.missed_evicted,
                "missed_unpredicted": self.missed_unpredicted, "missed_gated": self.missed_gated,
                "hidden_seconds": round(self.read_seconds - self.waited_seconds, 6),
                "waited_seconds": round(self.waited_seconds, 6)}


def _landed(item, done: list) -> float | None:
    """When a prefetch's read finished (perf_counter seconds), if known: the future's own record
    (`NativeFetch.done_at`), else what its done-callback noted."""
    at = getattr(item, "done_at", None)
    return at if at is not None else (done[0] if done else None)


DEFAULT_POLICY = "lfu"


class ExpertCache:
    def __init__(self, store, capacity_bytes: int | None = None, policy: str = DEFAULT_POLICY,
                 hot: Iterable[Key] = (), resident_size=None, place=None, window: int = 4,
                 prefetch_slots: int = 0):
        """``capacity_bytes`` None = unlimited (full residency). ``resident_size(key)`` gives an
        expert's compute-format bytes, used to check the hot set fits before reading it.
        ``place`` moves fetched weights into the fast tier's memory (`Backend.upload_expert`:
        device memory on CuPy; None keeps them in host memory)."""
        if policy not in POLICIES:
            raise UsageError(f"--cache-policy {policy!r}: choose from {', '.join(POLICIES)}")
        self.store = store
        self.capacity = capacity_bytes
        self.policy = POLICIES[policy]()
        self.place = place or (lambda w: w)
        self.window = max(1, window)
        # experts read ahead at most (0: no prefetch). A prefetch takes its room in the cache when it
        # starts, evicting colder experts the policy ranks below it (never the ones this iteration
        # predicts), so it needs no memory of its own: slots of their own had cost the cache more
        # than they hid (docs/performance.md, "Prefetch into the cache, one plan for every method")
        self.prefetch_slots = prefetch_slots
        self._reserved: dict[Key, int] = {}  # bytes held in the cache for each prefetch in flight
        # a guess the cache has no room for (the policy ranks what it would evict above it) is read
        # into the streaming workspace instead, which sits idle while a resident-only draft runs.
        # A pass streams with a window shrunk by half of the guesses held (at least 1), so its reads
        # (2 × its window: a group in compute, the next in flight) plus theirs stay within the plan's
        # 2 × window of experts, which holds for up to 2 × window − 2 guesses. A window of them:
        # 2 × window − 2 hid more reads but left the critical path where it was, the pass beside
        # them streaming one read at a time (docs/performance.md, "Why verification still reads")
        self.staging = min(self.window, 2 * self.window - 2)
        self._borrowed: set[Key] = set()
        self._predicted: set[Key] = set()  # this iteration's predictions and draft experts: not evicted for a prefetch
        self._refused: set[Key] = set()  # this iteration's guesses refused (PrefetchStats.missed_refused)
        self._capped: set[Key] = set()  # and those left past the cap on reads in flight
        self._gated: set[Key] = set()  # and those held back
        self._size = resident_size
        self._prefetched: dict[Key, tuple[object, float, list]] = {}  # future, issued at, [done at]
        self.prefetch_stats = PrefetchStats()
        self.held: dict[Key, ExpertWeights] = {}
        self._by_layer: dict[int, set[int]] = defaultdict(set)  # resident experts per layer
        self._masks: dict[int, np.ndarray] = {}  # resident_mask's, kept until the layer's residency changes
        self._tables: dict[int, tuple] = {}  # resident_table's, the same
        self._avail: dict[tuple, np.ndarray] = {}  # available_masks' resident part per layer list: the same
        self.pinned: set[Key] = set()
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self.stats: dict[str, PhaseStats] = defaultdict(PhaseStats)
        self.phase = "ar"
        self._pass_keys: set[Key] | None = None
        self.trace: list | None = None  # set to a list to record every pass's experts, in request order
        self.fill: BackgroundFill | None = None  # the rest of a full residency, read after the prompt (fill.py)
        self.pin(list(hot), resident_size)

    # -- phases and passes ----------------------------------------------------------------------
    @contextmanager
    def in_phase(self, name: str):
        previous, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = previous

    def begin_pass(self, n_tokens: int = 0) -> None:
        if self.fill is not None and self.fill.active:
            self.fill.step()
        self._pass_keys = set()
        if self.trace is not None:  # a routing trace (runtime/decoding/trace.py): [phase, tokens, keys]
            self.trace.append([self.phase, int(n_tokens), []])

    def end_pass(self) -> None:
        if self._pass_keys is not None:
            s = self.stats[self.phase]
            s.passes += 1
            s.unique_experts += len(self._pass_keys)
        self._pass_keys = None

    # -- residency ------------------------------------------------------------------------------
    def contains(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.held

    def resident_mask(self, layer: int, num_experts: int):
        """[E] bool of the layer's resident experts (a copy); None when every expert fits (no
        budget): then nothing needs restricting."""
        if self.capacity is None:
            return None
        mask = self._masks.get(layer)
        if mask is None or mask.size != num_experts:  # rebuilt after the layer's residency changed
            mask = np.zeros(num_experts, dtype=bool)
            mask[list(self._by_layer.get(layer, ()))] = True
            self._masks[layer] = mask
        return mask.copy()

    def pin(self, keys: Sequence[Key], resident_size=None) -> None:
        if not keys:
            return
        if resident_size is not None and self.capacity is not None:
            need = sum(resident_size(k) for k in keys)
            if need > self.capacity:
                raise UsageError(f"hot experts need {need} bytes, the expert budget holds {self.capacity}; "
                                 "shorten the hot list or raise --budget")
        with self.in_phase("load"):
            by_layer: dict[int, list[int]] = defaultdict(list)
            for L, e in keys:
                by_layer[L].append(e)
            for L, experts in sorted(by_layer.items()):
                self.get(L, experts)
        self.pinned.update(keys)
        for k in keys:
            self.policy.remove(k)  # pinned experts are never victims

    def preload(self, keys: Sequence[Key], progress=None) -> None:
        """Read ``keys`` now (phase "load"), a layer at a time: full residency starts warm, as a
        llama.cpp load does, instead of paying each first use during decoding."""
        by_layer: dict[int, list[int]] = defaultdict(list)
        for L, e in keys:
            by_layer[L].append(e)
        with self.in_phase("load"):
            for L, experts in sorted(by_layer.items()):
                self.get(L, experts)
                if progress:
                    progress(len(experts))

    def fill_in_background(self, keys: Sequence[Key]) -> None:
        """Make ``keys`` resident after the prompt, on the fetch threads (fill.py); now, where the
        store has no fetch threads."""
        if getattr(self.store, "submit", None) is None:
            return self.preload(keys)
        self.fill = BackgroundFill(self, [k for k in keys if k not in self.held])

    def stop_fill(self) -> None:
        if self.fill is not None:
            self.fill.stop()

    def clear(self) -> None:
        """Evict every expert that is not pinned (calibration sets cache states this way)."""
        for key in [k for k in self.held if k not in self.pinned]:
            self.policy.remove(key)
            self._drop(key)

    def hold(self, key: Key, weights: ExpertWeights) -> None:
        """Make ``key`` resident with weights decoded earlier: no read, no accounting. Calibration
        uses it to put the cache back into the state a captured pass ran in."""
        if key in self.held:
            return
        if self.capacity is not None and self.resident_bytes + weights.nbytes > self.capacity:
            raise UsageError(f"expert {key[1]} of layer {key[0]} does not fit the budget it was resident under")
        self._keep(key, weights)

    def _keep(self, key: Key, weights: ExpertWeights) -> None:
        self.held[key] = weights
        self._by_layer[key[0]].add(key[1])
        self._residency_changed(key[0])
        self.resident_bytes += weights.nbytes
        self.policy.insert(key)

    def _drop(self, key: Key) -> None:
        self.resident_bytes -= self.held.pop(key).nbytes
        self._by_layer[key[0]].discard(key[1])
        self._residency_changed(key[0])

    def _residency_changed(self, layer: int) -> None:
        """What is kept from residency goes when ``layer``'s changes: its resident mask, its one-call
        table, and AE's all-layer masks (they hold every layer)."""
        self._masks.pop(layer, None)
        self._tables.pop(layer, None)
        self._avail.clear()

    def _make_room(self, key: Key, size: int, protected: set[Key], coming: bool = False) -> bool:
        """Evict until ``key`` fits, if the policy admits it over each victim; False at the first
        victim it does not (victims already evicted stay evicted: with experts of one size there are
        none). ``coming``: a prefetch, ranked with the use it is read for."""
        if self.capacity is None:
            return True
        while self.resident_bytes + size > self.capacity:
            victim = self.policy.victim(protected | self.pinned)
            if victim is None or not self.policy.admit(key, victim, coming):
                return False
            self.policy.remove(victim)
            self._drop(victim)
        return True

    def get(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        """All of ``experts`` at once, in order (reads in flight together: no window)."""
        got = dict(item for group in self.stream(layer, experts, window=len(experts) or 1) for item in group)
        return [got[int(e)] for e in experts]

    def resident_group(self, layer: int, experts: Sequence[int]) -> list[tuple[int, ExpertWeights]] | None:
        """`stream` when every one of ``experts`` is resident: the same bookkeeping, the one group
        returned without a generator (a decode step asks once per layer). None, with nothing
        noted, when one is missing: the caller then streams."""
        held = self.held
        if not all((layer, e) in held for e in experts):
            return None
        return self._look_up([(layer, int(e)) for e in experts])[2]

    def resident_table(self, layer: int, num_experts: int, convert) -> list:
        """[E]: ``convert(weights)`` of each resident expert of ``layer``, None for the others, kept
        until the layer's residency changes (a decode step's one C call looks its experts up here:
        kernels/cpu.py `moe_step`). Not a use: `note_resident` notes the ones a pass computed."""
        kept = self._tables.get(layer)
        if kept is None or kept[0] is not convert or len(kept[1]) != num_experts:
            held = self.held
            table = [None] * num_experts
            for e in self._by_layer.get(layer, ()):
                if e < num_experts:
                    table[e] = convert(held[(layer, e)])
            kept = self._tables[layer] = (convert, table)
        return kept[1]

    def note_resident(self, layer: int, experts: Sequence[int]) -> None:
        """A pass computed ``experts``, all resident, from `resident_table`: `stream`'s bookkeeping."""
        self._look_up([(layer, int(e)) for e in experts])

    def note_resident_keys(self, keys: list[Key]) -> None:
        """`note_resident` of several layers at once, ``keys`` in the order the layers ran (a one-call
        pass: one bookkeeping call instead of one a layer)."""
        self._look_up(keys)

    def _look_up(self, keys: list[Key]):
        """A pass asks for ``keys``: note them (the pass's keys, the draft's predictions, the
        trace), touch the resident ones and count hits and misses. (stats, keys, hits, missing)."""
        stats = self.stats[self.phase]
        if self.phase == "draft" and self.prefetch_slots:  # the draft's next tokens route among these
            self._predicted.update(keys)
        if self._pass_keys is not None:
            if self.trace:
                self.trace[-1][2].extend(k for k in dict.fromkeys(keys) if k not in self._pass_keys)
            self._pass_keys.update(keys)
        hits, missing = [], []
        for key in keys:
            w = self.held.get(key)
            if w is None:
                missing.append(key)
            else:
                hits.append((key[1], w))
                if self.capacity is not None and key not in self.pinned:  # no budget: nothing is evicted
                    self.policy.touch(key)
        stats.hits += len(hits)
        stats.misses += len(missing)
        for key in missing:
            self.policy.access(key)
        return stats, keys, hits, missing

    def stream(self, layer: int, experts: Sequence[int], window: int | None = None
               ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Groups of (expert, weights): the resident ones first (the first reads already queued),
        then the missing ones in the order their reads complete, at most ``window`` (default: the
        cache's) in flight."""
        stats, keys, hits, missing = self._look_up([(layer, int(e)) for e in experts])
        if not missing:
            if hits:
                yield hits
            return
        window = window or self.window
        if self._borrowed:  # guesses held in the streaming workspace: this pass gets the rest of it
            window = max(1, window - (len(self._borrowed) + 1) // 2)
            self._borrowed.difference_update(missing)  # this layer's are used now, in its group
        submit = getattr(self.store, "submit", None)
        protected = set(keys)
        # experts a draft prefetched are in flight or read already: they go first, outside the window
        ahead = [(key, self._prefetched.pop(key)) for key in missing if key in self._prefetched]
        filling = [(key, f) for key in missing if self.fill is not None and (f := self.fill.take(key)) is not None]
        taken = {key for key, _ in ahead} | {key for key, _ in filling}
        pending = deque(key for key in missing if key not in taken)
        inflight = deque([(key, future) for key, (future, _, _) in ahead] + filling)
        issued = {key: (t, done) for key, (_, t, done) in ahead}
        self.prefetch_stats.used += len(ahead)
        if self.phase == "verify" and self.prefetch_slots:
            self._classify_misses(pending)

        def fill() -> None:  # keep up to ``window`` reads of our own in flight
            while pending and len(inflight) < window + len(issued):
                key = pending.popleft()
                inflight.append((key, submit(layer, [key[1]])[0] if submit else self.store.read_many(layer, [key[1]])[0]))

        # the first reads start before the caller computes the resident experts, so the two overlap
        # (hits first, then reads, had cost AR 1.2-1.3x on the widened model: docs/performance.md)
        try:
            t0 = time.perf_counter()
            fill()  # (inside: a submit that fails still cancels the prefetches taken over above)
            stats.fetch_seconds += time.perf_counter() - t0  # (without fetch threads: the reads themselves)
            if hits:
                yield hits
            while pending or inflight:
                t0 = time.perf_counter()
                fill()
                group = []
                while inflight and (not group or _done(inflight[0][1])):  # the next, and any others already read
                    key, item = inflight.popleft()
                    self._release(key)  # a prefetch's room: the read below takes it (or fails)
                    waited = time.perf_counter()
                    w = self.place(item.result() if hasattr(item, "result") else item)
                    if key in issued:  # a prefetch: how much of its read the pass did not wait for
                        t_issue, done = issued.pop(key)
                        landed = _landed(item, done)
                        self.prefetch_stats.waited_seconds += max(0.0, (landed or waited) - waited)
                        self.prefetch_stats.read_seconds += (landed or time.perf_counter()) - t_issue
                    stats.bytes_read += self.store.stored_bytes(*key)
                    if self._make_room(key, w.nbytes, protected):
                        self._keep(key, w)
                    else:
                        stats.streamed += 1
                    group.append((key[1], w))
                if not pending and not inflight:  # the last group: its copies (device) timed to completion
                    self._land(group)
                stats.fetch_seconds += time.perf_counter() - t0  # time the pass waited for reads
                self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
                yield group
        finally:  # a caller that stops early (an error in its compute) leaves no reads queued
            for key, item in inflight:
                self._release(key)
                if hasattr(item, "cancel"):
                    item.cancel()

    def _land(self, group) -> None:
        """Wait until the device copies of a layer's fetched experts have landed (one host sync on
        the last copy event; the copy stream runs in order, so earlier groups have landed too):
        without it an asynchronous copy is timed at its issue and a miss looks like a hit."""
        land = getattr(getattr(self.place, "__self__", None), "land", None)
        if land is not None:
            land([w for _, w in group])

    # -- draft-guided prefetch --------------------------------------------------------------------
    def prefetch(self, keys: Iterable[Key]) -> int:
        """Start reading experts a coming pass will need (a draft's prediction of verification's
        experts) on the fetch threads, at most ``prefetch_slots`` at a time; `stream` then finds
        them in flight or read. Returns how many reads started."""
        submit = getattr(self.store, "submit", None)
        if submit is None or self.prefetch_slots <= 0:
            return 0
        started = 0
        keys = list(keys)
        self._predicted.update(keys)
        for i, key in enumerate(keys):
            if len(self._prefetched) >= self.prefetch_slots:
                self._capped.update(k for k in keys[i:] if k not in self.held and k not in self._prefetched)
                break
            if key in self.held or key in self._prefetched:
                continue
            borrow = not self._reserve(key, self._predicted)  # the policy keeps what it holds over this guess
            if borrow and len(self._borrowed) >= self.staging:
                self.prefetch_stats.refused += 1
                if key not in self._refused:
                    self._refused.add(key)
                    self.prefetch_stats.refused_keys += 1
                continue
            issued_at = time.perf_counter()  # before the submit: a native read may land before it returns
            try:
                future = submit(key[0], [key[1]])[0]
            except BaseException:
                self._release(key)
                raise
            if borrow:
                self.prefetch_stats.borrowed += 1
            done: list = []
            if hasattr(future, "add_done_callback"):
                future.add_done_callback(lambda _f, done=done: done.append(time.perf_counter()))
            self._prefetched[key] = (future, issued_at, done)
            if borrow:
                self._borrowed.add(key)
            started += 1
        self.prefetch_stats.issued += started
        return started

    def hold_back(self, keys: Iterable[Key]) -> None:
        """A draft's guesses not read ahead (the decoder's trial measured prefetch slower, or is
        trying the way without it: decoding/prefetch_trial.py); verification's reads of them count
        as ``missed_gated``."""
        self.prefetch_stats.gated += 1
        self._gated.update(keys)

    def _classify_misses(self, keys) -> None:
        """Why verification reads ``keys`` on its critical path (no prefetch started them)."""
        st = self.prefetch_stats
        for key in keys:
            if key in self._gated:
                st.missed_gated += 1
            elif key in self._refused:
                st.missed_refused += 1
            elif key in self._capped:
                st.missed_capped += 1
            elif key in self._predicted:
                st.missed_evicted += 1
            else:
                st.missed_unpredicted += 1

    def _reserve(self, key: Key, protected: set[Key]) -> bool:
        """Room in the cache for a prefetch of ``key``, made now: colder experts the policy ranks
        below it are evicted, never pinned ones or ``protected`` (this iteration's predictions and
        the experts its draft passes used)."""
        if self.capacity is None:
            return True
        size = self._size(key) if self._size else self.store.stored_bytes(*key)
        if not self._make_room(key, size, protected, coming=True):
            return False
        self._reserved[key] = size
        self.resident_bytes += size
        return True

    def _release(self, key: Key) -> None:
        self.resident_bytes -= self._reserved.pop(key, 0)

    def settle_prefetches(self) -> None:
        """After the pass they were for: the ones it did not use are kept in the room they hold
        (nothing more is evicted for a guess); unstarted reads are cancelled. Reads still running
        are waited for (a buffer dropped here would land outside the budget), in the current
        phase's fetch time; a guess whose read failed is dropped (a pass that needs it reads again)."""
        self._predicted, self._refused, self._capped, self._gated = set(), set(), set(), set()
        for key, (future, _, _) in list(self._prefetched.items()):
            del self._prefetched[key]
            self._release(key)
            self._borrowed.discard(key)
            if hasattr(future, "done") and not future.done() and future.cancel():
                self.prefetch_stats.wasted += 1  # not started: nothing was read
                continue
            t0 = time.perf_counter()
            try:
                w = future.result() if hasattr(future, "result") else future
            except Exception:
                self.prefetch_stats.wasted += 1
                continue
            finally:
                self.stats[self.phase].fetch_seconds += time.perf_counter() - t0
            self.stats["prefetch"].bytes_read += self.store.stored_bytes(*key)
            if key not in self.held and (self.capacity is None or self.resident_bytes + w.nbytes <= self.capacity):
                self._keep(key, self.place(w))  # a guess: resident, but not counted as a use
                self.prefetch_stats.kept += 1
            else:
                self.prefetch_stats.wasted += 1
                self.prefetch_stats.wasted_bytes += self.store.stored_bytes(*key)

    @property
    def prefetching(self) -> int:
        """Prefetches issued and not yet used or settled."""
        return len(self._prefetched)

    def in_flight(self, key: Key) -> bool:
        return key in self._prefetched

    def available_masks(self, layers: Sequence[int], num_experts: int):
        """[len(layers), E] bool, each row `available_mask` of that layer, built at once (AE asks
        for every layer on each draft token); None without a budget. The resident part is kept
        until residency changes, as `resident_mask` is; the prefetches in flight join each copy."""
        if self.capacity is None:
            return None
        row = {L: i for i, L in enumerate(layers)}
        key = (tuple(layers), num_experts)
        base = self._avail.get(key)
        if base is None:
            rows, cols = [], []
            for L, i in row.items():
                experts = self._by_layer.get(L, ())
                rows.extend([i] * len(experts))
                cols.extend(experts)
            base = np.zeros((len(layers), num_experts), dtype=bool)
            base[rows, cols] = True
            base.flags.writeable = False
            self._avail[key] = base
        mask = base.copy()
        inflight = [(row[L], e) for L, e in self._prefetched if L in row]
        if inflight:  # one assignment: one per guess in flight was most of this call
            rows_in, cols_in = zip(*inflight)
            mask[list(rows_in), list(cols_in)] = True
        return mask

    def available_mask(self, layer: int, num_experts: int):
        """[E] bool: resident or being prefetched (None without a budget)."""
        mask = self.resident_mask(layer, num_experts)
        if mask is not None:
            for L, e in self._prefetched:
                if L == layer:
                    mask[e] = True
        return mask

    def report(self) -> dict:
        pool = getattr(getattr(self.store, "reader", None), "pool", None)
        return {
            **({"read_buffers": pool.stats()} if pool is not None else {}),
            "prefetch": self.prefetch_stats.to_dict(),
            **({"fill": self.fill.report()} if self.fill is not None else {}),
            "policy": self.policy.name,
            "capacity_bytes": self.capacity,
            "pinned": len(self.pinned),
            "resident_experts": len(self.held),
            "resident_bytes": self.resident_bytes,
            "peak_resident_bytes": self.peak_resident_bytes,
            "phases": {name: s.to_dict() for name, s in sorted(self.stats.items())},
        }
