"""A run's timed passes, kept for `s2moe-calib profile --update` (`s2moe run --record-passes FILE`).

A profile's constants are measured once. The passes a real run makes are the best evidence of what
the device costs now, so a run can write them down and the profile can be refitted from them
without a new measurement session. One JSON object:

    format, version                "s2moe-passes", 1
    model, fingerprint             what the passes ran on (a profile takes only its own model's)
    backend, emulation, budget     how they ran (a profile takes only passes made as it was measured)
    verification, ar               one row per pass: n_tokens, n_missing, n_resident, seconds
                                   (AR steps are passes of one token)
    draft                          one row per draft phase: tokens, seconds
"""

from __future__ import annotations

import math

from .. import jsonfile
from .cost_model import FEATURES

FORMAT, VERSION = "s2moe-passes", 1


def pass_log(metrics, loaded, fingerprint: str, backend: str, emulation: str | None, budget: str | None) -> dict:
    """The JSON object for a finished run's ``SpecMetrics``."""
    def rows(samples):
        return [dict(zip((*FEATURES, "seconds"), (int(n), int(miss), int(hit), float(s))))
                for n, miss, hit, s in samples if math.isfinite(s) and s > 0]

    return {"format": FORMAT, "version": VERSION, "model": loaded.path, "fingerprint": fingerprint,
            "backend": backend, "emulation": emulation, "budget": budget or "1.0",
            "draft_vocab": int(metrics.draft_vocab),  # the draft's lm head: C_draft depends on it
            "verification": rows(metrics.verify_samples), "ar": rows(metrics.ar_samples),
            "draft": [{"tokens": int(n), "seconds": float(s)} for n, s in metrics.draft_samples
                      if n > 0 and math.isfinite(s) and s > 0]}


def check_pass_rows(where: str, rows, field: str, hint: str = "") -> None:
    """Every timed pass: the cost model's features and its seconds, finite and non-negative; else one
    line naming ``where``, the row and the key (and ``hint``, the fix)."""
    from ..checks import number
    from ..errors import UsageError

    if not isinstance(rows, list):
        raise UsageError(f"{where}: field {field} must be a list of passes{hint}")
    for i, row in enumerate(rows):
        for key in (*FEATURES, "seconds"):
            if not isinstance(row, dict) or key not in row:
                raise UsageError(f"{where}: {field}[{i}] has no {key!r}{hint}")
            # a pass takes time: 0 s would stop the relative-loss fit (and a 0 ms constant is refused)
            number(f"{where}: {field}[{i}].{key}", row[key], low=0, low_open=key == "seconds")


def read_pass_log(path: str) -> dict:
    """A pass log, checked field by field: one line naming the file and field, else the object."""
    from ..checks import number
    from ..errors import UsageError

    try:
        with open(path, encoding="utf-8") as f:
            data = jsonfile.load(f)
    except FileNotFoundError:
        raise UsageError(f"--passes {path}: not found; record one with s2moe run --record-passes FILE") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"--passes {path}: not a JSON pass log ({e}); record one with s2moe run --record-passes FILE") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"--passes {path}: not an s2moe pass log (no \"format\": \"{FORMAT}\"); "
                         "record one with s2moe run --record-passes FILE")
    if data.get("version") != VERSION:
        raise UsageError(f"--passes {path}: version {data.get('version')!r} is not supported (this tool reads "
                         f"{VERSION}); record it again with this version")
    for field in ("verification", "ar"):
        check_pass_rows(f"--passes {path}", data.get(field), field)
    draft = data.get("draft")
    if not isinstance(draft, list):
        raise UsageError(f"--passes {path}: field draft must be a list")
    for i, row in enumerate(draft):
        for key in ("tokens", "seconds"):
            if not isinstance(row, dict) or key not in row:
                raise UsageError(f"--passes {path}: draft[{i}] has no {key!r}")
            number(f"--passes {path}: draft[{i}].{key}", row[key], low=0, low_open=key == "seconds")
    if "draft_vocab" in data:  # logs written before it was recorded drafted with the full head
        number(f"--passes {path}: draft_vocab", data["draft_vocab"], low=0, integer=True)
    return data
