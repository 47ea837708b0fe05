"""Pieces the commands share: model resolution, the stderr console, JSON output."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console

from ..errors import UsageError

# stdout stays parseable (generated text, JSON); tables, progress and hints go to stderr. Lines are
# never hard-wrapped (soft_wrap): redirected output keeps a number next to its unit.
err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


def say(message: str, style: str | None = None) -> None:
    """One line on stderr, styled as a whole. The text is never read as markup: paths, reasons and
    hints such as ``pip install 's2moe[cuda]'`` print as written."""
    err.print(message, style=style, markup=False)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL = ASSETS / "default-moe"


def resolve_model(model: str | None) -> str:
    """--model as a local path: a folder or file as given, a Hugging Face id (org/name[@revision])
    as its snapshot in the local cache (fetched first when online), else the embedded default."""
    if model:
        from ..model import hub

        parsed = hub.parse_id(model)
        return hub.resolve(*parsed) if parsed else model
    if (DEFAULT_MODEL / "config.json").exists():
        return str(DEFAULT_MODEL)
    raise UsageError("no --model given and no default model is installed; pass --model PATH (HF folder or .gguf)")


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(x):
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    raise TypeError(type(x).__name__)
