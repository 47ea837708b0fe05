"""Benchmark records (llama-bench style): raw per-repetition samples, machine info, commit.

One list of records renders as a rich table, JSON or CSV; the record is the schema.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field


def machine_info() -> dict:
    from .device import probe

    facts = probe().to_dict()
    facts.update(python=sys.version.split()[0], numpy=_version("numpy"))
    facts["blas"] = _blas()
    return facts


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except Exception:
        return "?"


def _blas() -> str:
    try:
        from threadpoolctl import threadpool_info

        return ", ".join(f"{i['internal_api']} {i.get('version')} ({i['num_threads']} threads)" for i in threadpool_info())
    except Exception:
        return "?"


def git_commit() -> str:
    """The checkout's commit when run from one (editable install), else "unknown"."""
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        # docs/ holds the benchmarks' own outputs: a run that wrote its records is not "dirty" code
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "") if sha else "unknown"
    except OSError:
        return "unknown"


@dataclass
class Record:
    benchmark: str
    name: str  # what was measured (method, configuration)
    unit: str
    samples: list[float]
    params: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    commit: str = field(default_factory=git_commit)
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    def to_dict(self) -> dict:
        """The record with its params and extra also flat at the top level (a reader can ask for
        ``record["method"]`` or ``record["speedup_vs_ar"]`` without knowing the nesting)."""
        d = asdict(self)
        d["median"] = self.median
        for key, value in {**self.params, **self.extra}.items():
            d.setdefault(key, value)
        return d


def to_json(records: list[Record], machine: dict) -> str:
    return json.dumps({"machine": machine, "records": [r.to_dict() for r in records]}, indent=2)


def to_csv(records: list[Record]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["benchmark", "name", "unit", "median", "n", "samples", "params", "commit", "date"])
    for r in records:
        w.writerow([r.benchmark, r.name, r.unit, f"{r.median:.6g}", len(r.samples),
                    " ".join(f"{s:.6g}" for s in r.samples), json.dumps(r.params), r.commit, r.date])
    return buf.getvalue()


def to_table(records: list[Record], title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("name", "median", "unit", "n", "min", "max"):
        t.add_column(col, justify="right" if col != "name" else "left")
    for r in records:
        t.add_row(r.name, f"{r.median:.4g}", r.unit, str(len(r.samples)),
                  f"{min(r.samples):.4g}" if r.samples else "-", f"{max(r.samples):.4g}" if r.samples else "-")
    return t


def to_markdown(records: list[Record]) -> str:
    lines = ["| benchmark | name | median | unit | n | commit |", "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r.benchmark} | {r.name} | {r.median:.4g} | {r.unit} | {len(r.samples)} | {r.commit} |")
    return "\n".join(lines)


def write_outputs(records: list[Record], machine: dict, stem: str, title: str) -> None:
    """Table to stderr; JSON and CSV next to ``stem``, each written whole or not at all."""
    from rich.console import Console

    from .outputs import write_atomic

    Console(stderr=True).print(to_table(records, title))
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    write_atomic(stem + ".json", to_json(records, machine))
    write_atomic(stem + ".csv", to_csv(records))
