"""Routing traces (`s2moe run|bench --trace FILE`): what each pass of a run asked of the expert
cache, so that `s2moe-calib predict` can replay it through another device's cost model and budget.

One record per method: its generated tokens, its measured decode seconds here, and its passes in
order, each ``[phase, n_tokens, keys]`` with ``phase`` one of prefill / ar / draft / verify and
``keys`` the distinct experts the pass requested, in request order, as ``layer * E + expert``.
Written as JSON (temp file + rename, the umask's mode).
"""

from __future__ import annotations

import json

from .. import jsonfile
from ..errors import UsageError

VERSION = 1


class TraceRecorder:
    def __init__(self, loaded, budget: str | None, emulation: str | None = None):
        from ..profile import model_fingerprint

        c = loaded.config
        self.data = {"s2moe_trace": VERSION, "model": {"path": loaded.path, "fingerprint": model_fingerprint(loaded),
                                                       "experts_per_layer": c.num_experts, "top_k": c.top_k},
                     "recorded": {"budget": budget or "1.0", "emulation": emulation}, "runs": []}
        self._cache = None

    def start(self, cache) -> None:
        """Record the passes ``cache`` serves from now on."""
        cache.trace = []
        self._cache = cache

    def stop(self, method: str, tokens: int, decode_seconds: float) -> None:
        cache, self._cache = self._cache, None
        E = self.data["model"]["experts_per_layer"]
        passes = [[phase, n, [L * E + e for L, e in keys]] for phase, n, keys in cache.trace]
        cache.trace = None
        self.data["runs"].append({"method": method, "tokens": int(tokens), "decode_seconds": float(decode_seconds),
                                  "passes": passes})

    def write(self, path: str) -> None:
        from ..outputs import write_atomic

        write_atomic(path, json.dumps(self.data, separators=(",", ":")) + "\n")


def load_trace(path: str) -> dict:
    """A trace file, checked enough that a replay cannot fail half-way."""
    try:
        with open(path, encoding="utf-8") as f:
            data = jsonfile.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such trace; record one with s2moe bench --trace {path}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not a trace (not JSON: {exc}); record one with s2moe bench --trace") from None
    if not isinstance(data, dict) or data.get("s2moe_trace") != VERSION:
        raise UsageError(f"{path}: not an s2moe trace of version {VERSION}; record it again with s2moe bench --trace")
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs:
        raise UsageError(f"{path}: runs: no recorded runs")
    E = data.get("model", {}).get("experts_per_layer")
    if not isinstance(E, int) or E <= 0:
        raise UsageError(f"{path}: model.experts_per_layer must be a positive integer")
    for i, run in enumerate(runs):
        where = f"{path}: runs[{i}]"
        if not isinstance(run, dict) or not isinstance(run.get("method"), str):
            raise UsageError(f"{where}.method: missing")
        if not isinstance(run.get("tokens"), int) or run["tokens"] < 1:
            raise UsageError(f"{where}.tokens: must be a positive integer")
        for j, p in enumerate(run.get("passes") or []):
            if not (isinstance(p, list) and len(p) == 3 and p[0] in ("prefill", "ar", "draft", "verify", "estimate")
                    and isinstance(p[1], int) and isinstance(p[2], list)
                    and all(isinstance(k, int) and k >= 0 for k in p[2])):
                raise UsageError(f"{where}.passes[{j}]: expected [phase, n_tokens, [expert keys]]")
    return data
