"""Prompt workloads: Spec-Bench-style JSONL and the small default set shipped with the package.

A record's prompt is, as the reference binary reads it: ``question``, else ``turns[0]``, else
``prompt`` (and ``problem``). Some files hold two JSON objects on one line (mt_bench.jsonl), so
lines are decoded object by object rather than one object per line.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import jsonfile
from .errors import UsageError

ASSET_PROMPTS = Path(__file__).resolve().parent / "assets" / "prompts" / "default.jsonl"
FIELDS = ("question", "turns", "prompt", "problem")


def _prompt_of(record: dict, where: str) -> str:
    for key in FIELDS:
        value = record.get(key)
        if key == "turns" and isinstance(value, list) and value and isinstance(value[0], str):
            return value[0]
        if isinstance(value, str) and value:
            return value
    raise UsageError(f"{where}: record has none of the prompt fields {', '.join(FIELDS)}")


def read_jsonl(path: str | Path) -> list[dict]:
    decoder = json.JSONDecoder()
    records = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"{path}: workload file not found") from None
    for n, line in enumerate(lines, 1):
        pos = 0
        line = line.strip()
        while pos < len(line):
            try:
                obj, end = jsonfile.raw_decode(decoder, line, pos)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise UsageError(f"{path}:{n}: expected a JSON object per record")
            records.append(obj)
            pos = end
            while pos < len(line) and line[pos] in " \t,":
                pos += 1
    return records


def load_workload(path: str | Path) -> list[str]:
    records = read_jsonl(path)
    if not records:
        raise UsageError(f"{path}: no records")
    return [_prompt_of(r, f"{path} record {i}") for i, r in enumerate(records)]


def default_prompts() -> list[str]:
    if not ASSET_PROMPTS.exists():
        raise UsageError(f"{ASSET_PROMPTS}: default prompt set missing from the installation; pass --workload FILE")
    return load_workload(ASSET_PROMPTS)
