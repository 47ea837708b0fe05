"""rtx4090 mode: the slow tier is host RAM. Every expert is read and decoded once, at start-up,
into page-locked (pinned) host memory; a fetch is then only a host → device copy, which the
backend issues asynchronously on its copy stream. Behind the same `read_many` as `ExpertStore`.

A fetch through this tier is that copy: `read_many` (what start-up estimates time) copies to the
device and returns once the copies have landed, so a miss is not priced as a hit; `submit` (the
cache's path) hands over the pinned weights and the cache issues their copies asynchronously.
On an integrated GPU nothing is pinned (`Backend.pin_expert`): the device reads the same DRAM.
"""

from __future__ import annotations


class HostTier:
    tier = "host"

    def __init__(self, store, backend):
        self.store = store
        self.backend = backend
        # NumPy computes from host memory as it is: nothing to pin
        keep = backend.pin_expert if backend.on_device else (lambda w: w)
        self.weights = {key: keep(store.read(*key)) for key in sorted(store.refs)}
        self.nbytes = sum(refs.resident_bytes for refs in store.refs.values())

    def read_many(self, layer: int, experts: list[int]) -> list:
        """The experts where the math runs, copies complete (on NumPy: the host weights)."""
        got = [self.backend.upload_expert(self.weights[layer, e]) for e in experts]
        self.backend.land(got)
        return got

    def read(self, layer: int, expert: int):
        return self.weights[layer, expert]

    def submit(self, layer: int, experts: list[int]) -> list:
        # already in host memory: plain results, no futures; the cache places (copies) them
        return [self.weights[layer, e] for e in experts]

    def stored_bytes(self, layer: int, expert: int) -> int:
        return self.store.stored_bytes(layer, expert)

    @property
    def direct_files(self) -> dict:
        return self.store.direct_files

    def close(self) -> None:
        self.store.close()
