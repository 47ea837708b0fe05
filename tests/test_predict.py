"""`s2moe-calib predict`: a routing trace recorded by `s2moe bench --trace`, replayed through
another device's cache and cost model. The replay's arithmetic is checked against an independent
count from the trace itself; a smaller budget misses more; bad traces are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSTS = {"t_ar_ms": 5.0, "c_draft_ms": 2.0, "t_exp_miss_ms": 3.0, "t_exp_hit_ms": 0.1, "t_base_ms": 1.0,
         "t_token_ms": 0.5}


def cli(tool, *args):
    return subprocess.run([sys.executable, "-m", tool, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.json"
    r = cli("s2moe.runtime.cli", "bench", "--methods", "ar,s2moe", "--n-prompts", "2", "--max-tokens", "12",
            "--budget", "0.25", "--trace", str(path))
    assert r.returncode == 0, r.stderr
    return path


def _profile(tmp_path, budget="16g"):
    data = json.load(open(os.path.join(ROOT, "profiles", "orin-16g.json")))
    data.pop("published")
    data.update(source="measured", budget={"spec": budget})
    data["cost_model"].update(COSTS)
    data["hot_experts"] = {"gpu_experts": []}
    path = tmp_path / f"p-{budget}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_trace_records_every_decode_pass(trace):
    data = json.loads(trace.read_text())
    runs = {r["method"]: r for r in data["runs"]}
    assert set(runs) == {"ar", "s2moe"} and runs["ar"]["tokens"] == 2 * 11
    ar_passes = [p for p in runs["ar"]["passes"] if p[0] == "ar"]
    assert len(ar_passes) == runs["ar"]["tokens"]  # one AR step per decode token
    top_k, E = data["model"]["top_k"], data["model"]["experts_per_layer"]
    assert all(len(p[2]) == 4 * top_k for p in ar_passes)  # 4 MoE layers, top-k distinct experts each
    assert {p[0] for p in runs["s2moe"]["passes"]} >= {"prefill", "draft", "verify"}
    assert all(0 <= k < 4 * E for p in runs["s2moe"]["passes"] for k in p[2])


def test_full_budget_replay_matches_an_independent_count(trace, tmp_path):
    r = cli("s2moe.calib", "predict", "--trace", str(trace), "--profile", _profile(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    got = {m["method"]: m for m in json.loads(r.stdout)["methods"]}
    for run in json.loads(trace.read_text())["runs"]:
        seen, seconds = set(), 0.0  # everything fits: an expert misses once, the first time any pass asks
        for phase, n, keys in run["passes"]:
            if phase == "draft":
                seconds += COSTS["c_draft_ms"] / 1e3
                continue
            new = [k for k in keys if k not in seen]
            seen.update(keys)
            if phase in ("ar", "verify"):
                seconds += (COSTS["t_base_ms"] + COSTS["t_token_ms"] * n + COSTS["t_exp_miss_ms"] * len(new)
                            + COSTS["t_exp_hit_ms"] * (len(keys) - len(new))) / 1e3
        assert got[run["method"]]["predicted_seconds"] == pytest.approx(seconds, rel=1e-9)
        assert got[run["method"]]["predicted_tokens_per_s"] == pytest.approx(run["tokens"] / seconds)
    assert got["ar"]["predicted_speedup_vs_ar"] == pytest.approx(1.0)


def test_a_smaller_budget_misses_more(trace, tmp_path):
    rates = []
    for budget in ("16g", "0.25", "0.1"):
        r = cli("s2moe.calib", "predict", "--trace", str(trace), "--profile", _profile(tmp_path, budget), "--json")
        assert r.returncode == 0, r.stderr
        ar = next(m for m in json.loads(r.stdout)["methods"] if m["method"] == "ar")
        rates.append(ar["miss_rate"])
    assert rates[0] < rates[1] < rates[2]


@pytest.mark.parametrize("content, needle", [
    ("not json", "not JSON"),
    ('{"s2moe_trace": 99}', "version"),
    ('{"s2moe_trace": 1, "model": {"experts_per_layer": 32}, "runs": [{"method": "ar", "tokens": 3, '
     '"passes": [["ar", 1, [-1]]]}]}', "runs[0].passes[0]"),
])
def test_bad_trace_is_one_line(tmp_path, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = cli("s2moe.calib", "predict", "--trace", str(bad), "--profile", _profile(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_a_smaller_budget_than_the_profiles_pins_the_head_of_its_hot_list(trace, tmp_path):
    """As `s2moe run --profile P --budget B` does: the rank-ordered hot list is cut to what B holds."""
    path = _profile(tmp_path, "0.5")
    data = json.loads(open(path).read())
    data["model"]["fingerprint"] = json.loads(trace.read_text())["model"]["fingerprint"]  # the traced model's
    data["hot_experts"] = {"gpu_experts": [[L, e] for L in range(4) for e in range(32)][:96]}
    open(path, "w").write(json.dumps(data))
    r = cli("s2moe.calib", "predict", "--trace", str(trace), "--profile", path, "--budget", "0.1", "--json")
    assert r.returncode == 0, r.stderr
    note = [line for line in r.stderr.splitlines() if "hot experts" in line]
    assert len(note) == 1 and "of the profile's 96 hot experts" in note[0]
    kept = int(note[0].split("the first ")[1].split(" ")[0])
    assert 0 < kept < 96


def test_a_profile_of_another_model_lends_no_hot_list_to_the_replay(trace, tmp_path):
    path = _profile(tmp_path, "0.25")
    data = json.loads(open(path).read())
    data["hot_experts"] = {"gpu_experts": [[0, 1], [1, 2]]}  # orin's fingerprint: not the traced model
    open(path, "w").write(json.dumps(data))
    r = cli("s2moe.calib", "predict", "--trace", str(trace), "--profile", path, "--json")
    assert r.returncode == 0, r.stderr
    assert "its hot list is not pinned in the replay" in " ".join(r.stderr.split())
