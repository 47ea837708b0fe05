"""JSON that users hand us (configs, indexes, profiles, traces, hot lists, workloads), parsed with
one rule: nesting too deep for Python's recursive parser (a nested-JSON bomb) is a ValueError
like any other malformed JSON, so each reader's one-line error covers it. Python raises
RecursionError there, which no reader caught: a traceback, or a crash inside a worker."""

from __future__ import annotations

import json
from typing import IO, Any

TOO_DEEP = "nested too deeply to parse"


def load(f: IO) -> Any:
    try:
        return json.load(f)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None


def raw_decode(decoder: json.JSONDecoder, text: str, pos: int) -> tuple[Any, int]:
    """`JSONDecoder.raw_decode`, with a bomb as a `JSONDecodeError` at ``pos``."""
    try:
        return decoder.raw_decode(text, pos)
    except RecursionError:
        raise json.JSONDecodeError(TOO_DEEP, text, pos) from None
