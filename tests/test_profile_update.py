"""`s2moe run --record-passes` and `s2moe-calib profile --update` (issue 16): a profile refitted from a
run's own passes, never from another model's or another setting's, and never half-written."""

from __future__ import annotations

import json
import os
import shutil
import stat
from types import SimpleNamespace

import numpy as np
import pytest

from s2moe.runtime.profile import load_profile

from test_calib_inputs import QUICK, calib, one_line_error, s2moe

PROMPT = "def add(a, b):\n    return"
# known constants for synthetic passes (seconds): base, per token, per missing expert, per resident one
TRUE = {"t_base_ms": 2.0, "t_token_ms": 0.3, "t_exp_miss_ms": 1.5, "t_exp_hit_ms": 0.1}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A quick profile at 25 % and the pass logs of an AR run and a drafting run made with it."""
    d = tmp_path_factory.mktemp("update")
    prof = d / "p.json"
    r = calib("profile", "--device", "cpu", "--budget", "0.25", "--out", str(prof), *QUICK)
    assert r.returncode == 0, r.stderr
    logs, runs = {}, {}
    # the drafting run makes fewer passes than tokens (8 passes for 40 tokens): 80 leave --update its 10
    for name, n, extra in (("ar", "40", ("--method", "ar")),
                           ("s2moe", "80", ("--method", "s2moe", "--utility-threshold", "0", "--always-prefetch"))):
        logs[name] = d / f"{name}.passes.json"
        r = s2moe("run", "--profile", str(prof), "-p", PROMPT, "-n", n, "--ignore-eos", "--backend", "numpy",
                  "--temperature", "0", "--record-passes", str(logs[name]), "--json", *extra)
        assert r.returncode == 0, r.stderr
        assert "timed passes written to" in r.stderr
        runs[name] = json.loads(r.stdout)["stats"]
    return SimpleNamespace(dir=d, prof=prof, logs=logs, runs=runs)


def _copy(setup, tmp_path, with_samples=True):
    d, prof = setup.dir, setup.prof
    out = tmp_path / "p.json"
    shutil.copy(prof, out)
    if with_samples:
        shutil.copy(d / "p.samples.json", tmp_path / "p.samples.json")
    return out


def test_a_run_records_its_passes(setup):
    logs = setup.logs
    ar = json.loads(logs["ar"].read_text())
    assert ar["format"] == "s2moe-passes" and ar["budget"] == "0.25" and ar["backend"] == "numpy"
    assert len(ar["ar"]) == 39 and ar["verification"] == [] and ar["draft"] == []  # 40 tokens: the 1st from prefill
    assert all(p["n_tokens"] == 1 and p["seconds"] > 0 for p in ar["ar"])
    # at 25 % an AR step misses some of its 4 layers × 4 experts and finds the rest
    assert all(p["n_missing"] + p["n_resident"] == 16 for p in ar["ar"])
    # the cache's own counters for the AR phase: misses are misses, hits are hits
    phase = setup.runs["ar"]["offload"]["cache"]["phases"]["ar"]
    assert sum(p["n_missing"] for p in ar["ar"]) == phase["misses"] > 0
    assert sum(p["n_resident"] for p in ar["ar"]) == phase["hits"] > 0
    spec = json.loads(logs["s2moe"].read_text())
    assert spec["verification"] and spec["draft"] and max(p["n_tokens"] for p in spec["verification"]) > 1
    # as the profile's passes (prefetch off) see them: an expert a draft's prefetch read is no cold
    # miss, so it is recorded as resident (its wait left out), or --update would price a miss low
    cache = setup.runs["s2moe"]["offload"]["cache"]
    used, verify = cache["prefetch"]["used"], cache["phases"]["verify"]
    assert used > 0
    assert sum(p["n_missing"] for p in spec["verification"]) == verify["misses"] - used
    assert sum(p["n_resident"] for p in spec["verification"]) == verify["hits"] + used
    assert stat.S_IMODE(os.stat(logs["ar"]).st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_update_takes_t_ar_and_c_draft_from_the_run(setup, tmp_path):
    logs = setup.logs
    prof = _copy(setup, tmp_path)
    assert load_profile(str(prof)).data["cost_model"]["fit"]["probe"]["reads"]["ms"] > 0
    for log in (logs["ar"], logs["s2moe"]):
        r = calib("profile", "--update", str(prof), "--passes", str(log), "--json")
        assert r.returncode == 0, r.stderr
    data = load_profile(str(prof)).data
    ar = json.loads(logs["ar"].read_text())["ar"]
    spec = json.loads(logs["s2moe"].read_text())
    c = data["cost_model"]
    steps = [p["seconds"] for p in spec["ar"]] or [p["seconds"] for p in spec["verification"] if p["n_tokens"] == 1]
    if len(steps) >= 4:  # the drafting run's own AR steps, else the AR run's
        assert c["t_ar_ms"] == pytest.approx(np.median(steps) * 1e3, rel=1e-9)
    else:
        assert c["t_ar_ms"] == pytest.approx(np.median([p["seconds"] for p in ar]) * 1e3, rel=1e-9)
    per_token = [d["seconds"] / d["tokens"] for d in spec["draft"]]
    assert c["c_draft_ms"] == pytest.approx(np.median(per_token) * 1e3, rel=1e-9)
    assert data["validation"] is None and data["provenance"]["updated"]["passes"] == logs["s2moe"].name
    assert c["fit"]["n_controlled"] == 10 and c["fit"]["n_decode"] == len(spec["verification"]) + len(spec["ar"])
    assert "probe" not in c["fit"]  # the probe timed the machine of the old constants, not the run's


def test_update_recovers_the_constants_of_synthetic_passes(setup, tmp_path):
    """Passes priced by known constants: the refit finds them (a swapped feature would not)."""
    logs = setup.logs
    prof = _copy(setup, tmp_path, with_samples=False)  # only the run's passes in the fit
    log = json.loads(logs["s2moe"].read_text())
    rng = np.random.default_rng(0)

    def seconds(n, miss, hit):
        return (TRUE["t_base_ms"] + TRUE["t_token_ms"] * n + TRUE["t_exp_miss_ms"] * miss
                + TRUE["t_exp_hit_ms"] * hit) * 1e-3

    log["verification"] = []
    for _ in range(60):
        n = int(rng.integers(1, 9))
        miss = int(rng.integers(0, 12 * n // 2 + 2))
        hit = int(rng.integers(4, 16 * n))
        log["verification"].append({"n_tokens": n, "n_missing": miss, "n_resident": hit, "seconds": seconds(n, miss, hit)})
    log["ar"] = [{"n_tokens": 1, "n_missing": 3, "n_resident": 13, "seconds": seconds(1, 3, 13)}] * 6  # 8.1 ms
    log["draft"] = [{"tokens": 4, "seconds": 0.0036}] * 5
    path = tmp_path / "synthetic.passes.json"
    path.write_text(json.dumps(log))
    r = calib("profile", "--update", str(prof), "--passes", str(path))
    assert r.returncode == 0, r.stderr
    c = load_profile(str(prof)).data["cost_model"]
    for key, want in TRUE.items():
        assert c[key] == pytest.approx(want, rel=0.02, abs=0.002), key
    assert c["t_ar_ms"] == pytest.approx(8.1) and c["c_draft_ms"] == pytest.approx(0.9)
    assert c["fit"]["run_r2"] > 0.99


def test_update_keeps_a_constant_the_run_cannot_tell(setup, tmp_path):
    """No controlled passes, and a run that never missed (as at budget 1.0): the miss cost is not
    identifiable, so it stays the profile's (a fit would put 0 there) and the summary says so; the
    constants the run does vary are still recovered."""
    logs = setup.logs
    prof = _copy(setup, tmp_path, with_samples=False)
    before = load_profile(str(prof)).data["cost_model"]["t_exp_miss_ms"]
    log = json.loads(logs["s2moe"].read_text())
    rng = np.random.default_rng(1)
    log["verification"] = []
    log["ar"] = []  # (the rate guard's AR probes missed: this run never does)
    for _ in range(40):
        n, hit = int(rng.integers(1, 9)), int(rng.integers(4, 64))
        seconds = (TRUE["t_base_ms"] + TRUE["t_token_ms"] * n + TRUE["t_exp_hit_ms"] * hit) * 1e-3
        log["verification"].append({"n_tokens": n, "n_missing": 0, "n_resident": hit, "seconds": seconds})
    path = tmp_path / "resident.passes.json"
    path.write_text(json.dumps(log))
    r = calib("profile", "--update", str(prof), "--passes", str(path), "--json")
    assert r.returncode == 0, r.stderr
    c = load_profile(str(prof)).data["cost_model"]
    assert before > 0 and c["t_exp_miss_ms"] == pytest.approx(before, rel=1e-9)
    for key in ("t_base_ms", "t_token_ms", "t_exp_hit_ms"):
        assert c[key] == pytest.approx(TRUE[key], rel=0.02, abs=0.002), key
    assert any("t_exp_miss_ms" in k and "n_missing" in k for k in json.loads(r.stdout)["kept"])


def test_update_keeps_c_draft_timed_with_another_draft_head(setup, tmp_path):
    """A run that drafted with a FR-Spec head of 1024 tokens says nothing about C_draft with the full
    head the profile was timed for: C_draft stays, the summary says why, the rest is refitted."""
    assert json.loads(setup.logs["s2moe"].read_text())["draft_vocab"] == 0  # the profile's head: the full one
    prof = _copy(setup, tmp_path)
    before = load_profile(str(prof)).data["cost_model"]["c_draft_ms"]
    log = json.loads(setup.logs["s2moe"].read_text())
    log["draft_vocab"] = 1024
    log["draft"] = [{"tokens": 4, "seconds": 0.0036}] * 5  # 0.9 ms: what the update would take
    path = tmp_path / "head.passes.json"
    path.write_text(json.dumps(log))
    r = calib("profile", "--update", str(prof), "--passes", str(path), "--json")
    assert r.returncode == 0, r.stderr
    assert load_profile(str(prof)).data["cost_model"]["c_draft_ms"] == before != pytest.approx(0.9)
    assert any("C_draft" in k and "1024" in k for k in json.loads(r.stdout)["kept"]), r.stdout


@pytest.mark.parametrize("change,needle", [
    (lambda log: log.update(fingerprint="0" * 16), "was measured on"),
    (lambda log: log.update(budget="0.5"), "budget"),
    (lambda log: log.update(emulation="EMULATED slow tier (200 MB/s)"), "emulation"),
    (lambda log: log.update(ar=log["ar"][:3], verification=[]), "at least 10 are needed"),
    (lambda log: log["ar"][2].update(seconds=float("nan")), "ar[2].seconds"),
    (lambda log: log["ar"][2].update(seconds=0.0), "ar[2].seconds"),  # a 0 s pass stops the relative fit
    (lambda log: log.update(draft=[{"tokens": 2, "seconds": 0}]), "draft[0].seconds"),
    (lambda log: log.update(format="something"), "not an s2moe pass log"),
    (lambda log: log.update(draft_vocab=-1), "draft_vocab"),
])
def test_update_refuses_passes_it_cannot_use_and_leaves_the_profile(setup, tmp_path, change, needle):
    logs = setup.logs
    prof = _copy(setup, tmp_path)
    before = prof.read_bytes()
    log = json.loads(logs["ar"].read_text())
    change(log)
    path = tmp_path / "bad.passes.json"
    path.write_text(json.dumps(log))
    one_line_error(calib("profile", "--update", str(prof), "--passes", str(path)), 2, needle)
    assert prof.read_bytes() == before


def test_update_needs_both_flags(setup, tmp_path):
    logs = setup.logs
    one_line_error(calib("profile", "--passes", str(logs["ar"])), 2, "--update PROFILE and --passes FILE")


def test_a_failed_write_leaves_the_profile_whole(setup, tmp_path, monkeypatch):
    from s2moe.calib.update import run_update

    logs = setup.logs
    prof = _copy(setup, tmp_path)
    before = prof.read_bytes()

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        run_update(str(prof), str(logs["ar"]))
    assert prof.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "p.samples.json"]  # no temp file left


def test_a_drifted_run_names_the_update_command(setup, tmp_path):
    prof = _copy(setup, tmp_path)
    data = json.loads(prof.read_text())
    # a stale profile that says the device is 20× faster per step than it is: load only slows the
    # run, so the drift stays far past the 10 % mark even if the profile was timed in a slow burst
    # (a 5× faster device would vanish into a 5× burst)
    data["cost_model"]["t_ar_ms"] /= 20
    prof.write_text(json.dumps(data))
    log = tmp_path / "run.passes.json"
    r = s2moe("run", "--profile", str(prof), "-p", PROMPT, "-n", "32", "--ignore-eos", "--backend", "numpy",
              "--method", "ar", "--record-passes", str(log))
    assert r.returncode == 0, r.stderr
    note = [line for line in r.stderr.splitlines() if "drifted from" in line]
    assert len(note) == 1 and "t_ar" in note[0]
    assert f"s2moe-calib profile --update {prof} --passes {log}" in note[0]


def test_a_samples_file_that_cannot_be_read_is_left_out(setup, tmp_path):
    """The profile's own samples file beside it is optional evidence: a nested-JSON bomb there is
    read as no samples (as a missing file is), not a traceback."""
    prof = _copy(setup, tmp_path, with_samples=False)
    (tmp_path / "p.samples.json").write_text("[" * 200_000 + "]" * 200_000)
    r = calib("profile", "--update", str(prof), "--passes", str(setup.logs["ar"]))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_trace_and_passes_must_be_different_files(tmp_path):
    same = str(tmp_path / "x.json")
    one_line_error(s2moe("run", "-p", PROMPT, "-n", "4", "--trace", same, "--record-passes", same), 2,
                   "--trace and --record-passes")
