"""The expert cache's counters: per phase (hits, misses, bytes, time waited), draft-guided
prefetch's, and the reads a layer ahead's. Each says what it counts; `to_dict` is what reports carry."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass
class ReadAheadStats:
    issued: int = 0
    used: int = 0  # taken by the layer they were guessed for
    wasted: int = 0  # not needed there: dropped (cancelled before starting, or read and dropped)
    wasted_bytes: int = 0  # of those, what the disk read for nothing
    read_seconds: float = 0.0  # of the used ones: issue to completion
    waited_seconds: float = 0.0  # of those, what the pass still waited

    def to_dict(self) -> dict:
        return {"issued": self.issued, "used": self.used, "wasted": self.wasted, "wasted_bytes": self.wasted_bytes,
                "hidden_seconds": round(self.read_seconds - self.waited_seconds, 6),
                "waited_seconds": round(self.waited_seconds, 6)}
