"""`s2moe bench` run inside a benchmark's own process (ae_predict.py, decode_pass.py), so that what
the benchmark switched or timed (a path, a function) is what the bench runs."""

from __future__ import annotations

import json
import os
import sys
import tempfile


def bench_records(methods: str, budget: str, workload: str, model: str | None, extra: list[str]) -> list[dict]:
    """The records of one `s2moe bench` (6 prompts, greedy): one per method, in order."""
    from s2moe.runtime.cli import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        sys.argv = ["s2moe", "bench", "--methods", methods, "--budget", budget, "-w", workload, "--n-prompts", "6",
                    "--json", out] + (["--model", model] if model else []) + list(extra)
        try:
            cli()
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        with open(out) as f:
            return json.load(f)["records"]
