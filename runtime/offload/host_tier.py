"""rtx4090 mode: the slow tier is host RAM. Every expert is read and decoded once, at start-up,
into page-locked (pinned) host memory; a fetch is then only a host → device copy, which the
backend issues asynchronously on its copy stream. Behind the same `read_many` as `ExpertStore`.
"""

from __future__ import annotations


class HostTier:
    tier = "host"

    def __init__(self, store, backend):
        self.store = store
        # NumPy computes from host memory as it is: nothing to pin
        keep = backend.pin_expert if backend.on_device else (lambda w: w)
        self.weights = {key: keep(store.read(*key)) for key in sorted(store.refs)}
        self.nbytes = sum(refs.resident_bytes for refs in store.refs.values())

    def read_many(self, layer: int, experts: list[int]) -> list:
        return [self.weights[layer, e] for e in experts]

    def read(self, layer: int, expert: int):
        return self.weights[layer, expert]

    def submit(self, layer: int, experts: list[int]) -> list:
        return self.read_many(layer, experts)  # already in memory: plain results, no futures

    def stored_bytes(self, layer: int, expert: int) -> int:
        return self.store.stored_bytes(layer, expert)

    @property
    def direct_files(self) -> dict:
        return self.store.direct_files

    def close(self) -> None:
        self.store.close()
