"""rtx4090 mode: the slow tier is host RAM. Every expert is read and decoded once, at start-up,
into page-locked (pinned) host memory; a fetch is then only a host → device copy, which the
backend issues asynchronously on its copy stream. Behind the same `read_many` as `ExpertStore`.
"""

from __future__ import annotations

from dataclasses import replace

from .budget import fmt_bytes
from .errors import UsageError


class HostTier:
    tier = "host"

    def __init__(self, store, backend, host_limit_bytes: int | None = None):
        need = sum(refs.resident_bytes for refs in store.refs.values())
        if host_limit_bytes is not None and need > host_limit_bytes:
            raise UsageError(f"--offload-tier host needs {fmt_bytes(need)} of host memory for the experts, "
                             f"{fmt_bytes(host_limit_bytes)} is available; use --offload-tier file")
        self.store = store
        self.weights = {}
        for layer, expert in sorted(store.refs):
            w = store.read(layer, expert)
            if not backend.on_device:  # NumPy computes from host memory as it is: nothing to pin
                self.weights[layer, expert] = w
                continue
            parts = {name: None if a is None else backend.pin(a)
                     for name, a in (("gate", w.gate), ("up", w.up), ("down", w.down), ("gate_bias", w.gate_bias),
                                     ("up_bias", w.up_bias), ("down_bias", w.down_bias))}
            self.weights[layer, expert] = replace(w, **parts, pinned=True)
        self.nbytes = need

    def read_many(self, layer: int, experts: list[int]) -> list:
        return [self.weights[layer, e] for e in experts]

    def read(self, layer: int, expert: int):
        return self.weights[layer, expert]

    def stored_bytes(self, layer: int, expert: int) -> int:
        return self.store.stored_bytes(layer, expert)

    @property
    def direct_files(self) -> dict:
        return self.store.direct_files

    def close(self) -> None:
        self.store.close()
