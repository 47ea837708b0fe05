"""benchmarks/tune.py: arms parse into a method and SpecSettings changes, bad ones stop before the
model loads, and the summary names each arm's method and settings and pools its prompts."""

from __future__ import annotations

import os
import sys

import pytest

from s2moe.runtime.decoding.methods import SpecSettings
from s2moe.runtime.records import Record

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import tune  # noqa: E402


def _parse(text):
    return tune.parse_arm(text, SpecSettings(), lambda s: s)


def test_arms_parse_into_method_and_changes():
    assert _parse("default")[1:] == ("s2moe", SpecSettings(), {})
    label, method, settings, changed = _parse("wide:method=cascade,prefetch_slots=32")
    assert (label, method, changed) == ("wide", "cascade", {"prefetch_slots": 32})
    assert settings.prefetch_slots == 32
    for bad in ("x:method=nope", "x:no_such_field=1", "x:draft_cap"):
        with pytest.raises(SystemExit, match="--arm"):
            _parse(bad)


def _record(workload, label, method, changed, seconds):
    extra = {"prompt_seconds": seconds, "reuse_ratio": None, "decode_tokens_per_s_aggregate": 1.0,
             "acceptance_length": 1.0, "bytes_fetched_per_token": 1024,
             "ms_per_token": dict.fromkeys(tune.PARTS, 1.0)}
    return Record("bench", label, "tok/s", [1.0], params={"workload": workload, "method": method,
                                                          "changed": changed}, extra=extra)


def test_summary_names_each_arms_method_and_pools_prompts(capsys):
    arms = [("ar", "ar", {}, [4.0, 4.0]), ("default", "s2moe", {}, [2.0, 2.0]),
            ("cascade", "cascade", {}, [4.0, 4.0]), ("slots32", "s2moe", {"prefetch_slots": 32}, [1.0, 1.0])]
    records = [_record(w, *arm) for w in ("a.jsonl", "b.jsonl") for arm in arms]
    tune.print_summary(records, [a[0] for a in arms], "default")
    first_table = capsys.readouterr().out.split("\n\n")[0].splitlines()[2:]  # the ratios, not the time split
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in first_table}
    assert [rows[k][1] for k in ("ar", "default", "cascade", "slots32")] == \
        ["AR", "defaults", "method=cascade", "prefetch_slots=32"]
    assert rows["ar"][4] == "**0.50× [0.50, 0.50]**"  # Σ default seconds / Σ arm seconds over both workloads
    assert rows["slots32"][4] == "**2.00× [2.00, 2.00]**"
