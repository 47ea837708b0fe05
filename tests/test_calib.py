"""Calibration: the cost fit, profiles and their schema, presets, export, interruption safety."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from s2moe.runtime.decoding.cost_model import VerificationCostModel
from s2moe.runtime.profile import SCHEMA, ProfileError, load_profile, save_profile, schema_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ["orin-16g", "orin-32g", "orin-64g", "rtx4090"]


def calib(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "s2moe.calib", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd)


def test_fit_recovers_known_constants_from_noisy_timings():
    rng = np.random.default_rng(0)
    n = 300
    X = np.column_stack([rng.integers(1, 10, n), rng.integers(0, 60, n), rng.integers(0, 60, n)]).astype(float)
    truth = dict(base=2e-3, token=3e-4, miss=8e-4, hit=5e-5)
    y = truth["base"] + X @ np.array([truth["token"], truth["miss"], truth["hit"]])
    y *= rng.normal(1.0, 0.02, n)  # 2 % multiplicative noise
    model = VerificationCostModel().fit(X, y)
    assert model is not None and model.n_samples_ == n
    assert model.intercept_ == pytest.approx(truth["base"], rel=0.1)
    np.testing.assert_allclose(model.coef_, [truth["token"], truth["miss"], truth["hit"]], rtol=0.1)
    assert model.score(X, y) > 0.98
    assert 0 < model.mape(X, y) < 0.03  # a fraction, not percent


def test_cost_model_scores_weights_and_constants_by_hand():
    """Each figure by hand, so a swapped term cannot hide inside a loose bound."""
    model = VerificationCostModel()
    model.intercept_, model.coef_ = 1.0, np.zeros(3)  # predicts 1 s for every pass
    X, y = np.zeros((2, 3)), np.array([2.0, 4.0])
    assert model.mape(X, y) == pytest.approx((1 / 2 + 3 / 4) / 2)  # relative to the measurement
    assert model.score(X, y) == pytest.approx(1 - (1 + 9) / 2)  # R² = 1 − SS_res / SS_tot
    # sample_weight weighs each squared residual once, as in scikit-learn: an intercept-only fit
    # is the weighted mean (absolute loss) or the mean weighted by w/y² (relative loss)
    w = np.array([1.0, 3.0])
    y = np.array([1.0, 2.0])
    absolute = VerificationCostModel(loss="absolute").fit(X, y, sample_weight=w)
    assert absolute.intercept_ == pytest.approx((1 * 1 + 3 * 2) / 4)
    relative = VerificationCostModel().fit(X, y, sample_weight=w)
    assert relative.intercept_ == pytest.approx((1 / 1 + 3 / 4 * 2) / (1 + 3 / 4))
    # the fitted coefficients land in the constants AE reads, each in its own field
    X = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0], [2, 3, 5]], dtype=float)
    y = 0.5 + X @ np.array([0.1, 0.2, 0.03])
    c = VerificationCostModel(loss="absolute").fit(X, y).constants(t_ar=7.0, c_draft=3.0, source="profile")
    assert (c.t_ar, c.c_draft, c.source) == (7.0, 3.0, "profile")
    np.testing.assert_allclose([c.t_base, c.t_token, c.t_exp_miss, c.t_exp_hit], [0.5, 0.1, 0.2, 0.03], rtol=1e-9)


def test_schema_file_is_generated_from_the_code():
    with open(os.path.join(ROOT, "profiles", "schema.json")) as f:
        assert f.read() == schema_json(), "regenerate with: s2moe-calib schema > profiles/schema.json"
    assert json.loads(schema_json()) == json.loads(json.dumps(SCHEMA))


@pytest.mark.parametrize("name", PRESETS)
def test_presets_validate_and_export_reproduces_published_flags(name, tmp_path):
    path = os.path.join(ROOT, "profiles", f"{name}.json")
    prof = load_profile(path)
    assert prof.data["source"] == "published"
    pub = prof.data["published"]
    # the constants the runtime uses are the published ones
    assert prof.costs.t_ar == pytest.approx(pub["prune_tpot"] / 1e3)
    assert prof.costs.t_exp_miss == pytest.approx(pub["prune_expert_bytes"] / pub["prune_bandwidth"] / 1e3, rel=1e-5)
    hot = tmp_path / "hot.json"
    r = calib("export", "--profile", path, "--format", "llama-cpp", "--json", "--hot-out", str(hot))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == pub
    assert json.loads(hot.read_text()) == {"gpu_experts": []}
    line = calib("export", "--profile", path, "--hot-out", str(hot)).stdout
    assert f"--prune-tpot {pub['prune_tpot']}" in line and f"--draft {pub['draft']}" in line


def _measured_like(tmp_path) -> dict:
    data = json.load(open(os.path.join(ROOT, "profiles", "orin-16g.json")))
    data.pop("published")
    data["source"] = "measured"
    return data


def test_profile_round_trips(tmp_path):
    data = _measured_like(tmp_path)
    path = str(tmp_path / "p.json")
    save_profile(path, data)
    assert load_profile(path).data == data


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["cost_model"].pop("t_ar_ms"), "cost_model.t_ar_ms"),
    (lambda d: d["cost_model"].__setitem__("c_draft_ms", "fast"), "cost_model.c_draft_ms"),
    (lambda d: d.__setitem__("schema_version", 7), "schema_version"),
    (lambda d: d["offload"].__setitem__("bandwidth_mb_s", -5.0), "offload.bandwidth_mb_s"),
    (lambda d: d["offload"].__setitem__("bandwidth_mb_s", 0.0), "offload.bandwidth_mb_s"),  # T_exp = bytes / 0
    (lambda d: d["speculative"].__setitem__("draft_topk", 0), "speculative.draft_topk"),
    (lambda d: d.pop("model"), "model"),
])
def test_malformed_profiles_name_the_field(tmp_path, mutate, field):
    data = _measured_like(tmp_path)
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as exc:
        load_profile(str(path))
    assert field in str(exc.value) and str(path) in str(exc.value)
    r = calib("export", "--profile", str(path), "--hot-out", str(tmp_path / "h.json"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and field in r.stderr
    assert "Traceback" not in r.stderr


def test_wrong_device_kind_is_one_line():
    r = calib("profile", "--device", "orin", "--out", "/tmp/never.json")
    assert r.returncode == 2 and "use --device auto" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def calib_model(tiny_model_dirs, tmp_path_factory):
    _, folder, _ = tiny_model_dirs["olmoe"]
    dst = tmp_path_factory.mktemp("calib") / "tiny"
    shutil.copytree(folder, dst)
    return str(dst)


WORKLOAD = os.path.join(ROOT, "tests", "data", "prompts.jsonl")


def test_interrupted_profile_leaves_existing_profile_untouched(calib_model, tmp_path, monkeypatch):
    from s2moe.calib import measure, profile_cmd

    target = tmp_path / "device.json"
    target.write_text("{\"previous\": \"profile\"}\n")
    before = target.read_bytes()

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(measure, "controlled_passes", boom)
    with pytest.raises(KeyboardInterrupt):
        profile_cmd.run_profile(calib_model, "cpu", None, WORKLOAD, str(target), None, 12, None, 0.0, 1, 4)
    assert target.read_bytes() == before
    kept = json.loads((tmp_path / "device.samples.json").read_text())
    assert {"offload", "hot_experts", "decode_steps"} <= set(kept)  # samples gathered so far survive
    assert "verification" not in kept
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
    # a samples file written before bounds were flagged (no "bandwidth_is_bound"), whose reads never
    # grew with size: --resume refits its samples into a flagged, finite bound, not its old slope
    old = json.loads((tmp_path / "device.samples.json").read_text())
    sizes = old["offload"]["request_sizes"]
    old["offload"] = {"samples": [[n, 1e-4] for n in sizes for _ in range(3)], "request_sizes": sizes,
                      "bandwidth_mb_s": 554000.0, "latency_us": 0.0, "fit_r2": 0.1}
    (tmp_path / "device.samples.json").write_text(json.dumps(old))
    # --resume continues: the measured stages are reused, not re-measured
    monkeypatch.undo()
    monkeypatch.setattr(measure, "routing_traces", boom)
    monkeypatch.setattr(measure, "decode_step_times", boom)
    data = profile_cmd.run_profile(calib_model, "cpu", None, WORKLOAD, str(target), None, 12, None, 0.0, 1, 4,
                                   resume=True)
    assert data["cost_model"]["fit"]["n_controlled"] == 12
    fit = data["cost_model"]["fit"]  # how the controlled passes were weighed is on record
    assert fit["scored_on"] == "decode passes" and fit["controlled_weight"] in profile_cmd.CONTROLLED_WEIGHTS
    assert fit["cv_mape_percent"] > 0
    assert data["hot_experts"] == kept["hot_experts"]  # the interrupted run's stages, not re-measured
    assert data["offload"]["bandwidth_is_bound"] is True and data["offload"]["fit_r2"] is None
    assert data["offload"]["bandwidth_mb_s"] == pytest.approx(max(sizes) / 1e-4 / 1e6)


def test_profile_validate_and_run_end_to_end(calib_model, tmp_path):
    """Also a FR-Spec draft head: the profile times C_draft with it and records it, and a run with
    the profile drafts with it (or fails in one line naming the profile when it cannot); and a
    draft cap, which the profile carries to the runs that use it."""
    out = tmp_path / "tiny.json"
    with open(os.path.join(calib_model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    ranks = tmp_path / "ranks.json"
    ranks.write_text(json.dumps({"format": "s2moe-token-ranks", "vocab_size": vocab,
                                 "ranked_ids": list(range(vocab))[::-1]}))
    head = vocab // 2
    r = calib("profile", "--device", "cpu", "-m", calib_model, "-w", WORKLOAD, "--out", str(out),
              "--samples", "30", "--decode-tokens", "6", "--budget", "0.5", "--draft-vocab", str(head),
              "--token-ranks", str(ranks), "--draft-cap", "3")
    assert r.returncode == 0, r.stderr
    prof = load_profile(str(out))
    assert prof.speculative["draft_cap"] == 3
    from s2moe.runtime.cli.spec_options import make_settings
    from s2moe.runtime.model.loader import load_model
    config = load_model(calib_model).config
    assert make_settings(config, None, None, None, None, "paper", profile=prof).draft_cap == 3
    assert make_settings(config, None, 5, None, None, "paper", profile=prof).draft_cap == 5  # a flag wins
    assert prof.data["source"] == "measured" and prof.data["budget"]["spec"] == "0.5"
    assert prof.speculative["draft_vocab"] == head
    assert prof.data["cost_model"]["c_draft_head"] == f"the {head} most frequent tokens"
    assert os.path.exists(tmp_path / "tiny.samples.json")
    # no --model: validate checks the profile's own model (not the embedded one) and records its verdict
    r = calib("validate", "--profile", str(out), "-w", WORKLOAD, "--n-prompts", "4",
              "--max-tokens", "12", "--json", "--min-r2", "-1e9", "--max-mape", "1e9", "--max-bias", "1e9",
              "--rounds", "3")
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr
    res = json.loads(r.stdout)
    recorded = load_profile(str(out)).data["validation"]
    assert recorded["model"] == os.path.abspath(calib_model) and recorded["r2"] == res["r2"]
    assert {"r2", "mape_percent", "n", "single_shot"} <= set(res) and res["n"] >= 3
    assert res["timing"]["rounds"] == 3  # every pass timed by three interleaved replays
    # the points behind R²: one per pass, and R² recomputed from them is the one reported
    points = res["passes"]
    assert len(points) == res["n"] and all(p["n_tokens"] >= 1 for p in points)
    meas = np.array([p["measured_ms"] for p in points])
    pred = np.array([p["predicted_ms"] for p in points])
    r2 = 1 - ((meas - pred) ** 2).sum() / ((meas - meas.mean()) ** 2).sum()
    assert abs(r2 - res["r2"]) < 1e-3 * max(1.0, abs(res["r2"]))
    if "drift_adjusted" in res:  # where the speed probe saw drift, each point carries what it expected
        pred = pred * np.array([p["drift"] for p in points])
        r2 = 1 - ((meas - pred) ** 2).sum() / ((meas - meas.mean()) ** 2).sum()
        assert abs(r2 - res["drift_adjusted"]["r2"]) < 1e-3 * max(1.0, abs(r2))
    strict = calib("validate", "--profile", str(out), "-m", calib_model, "-w", WORKLOAD, "--n-prompts", "2",
                   "--max-tokens", "8", "--min-r2", "1.01")
    assert strict.returncode == 1
    refit = calib("fit", str(tmp_path / "tiny.samples.json"), "--json")
    assert refit.returncode == 0 and "t_exp_miss_ms" in json.loads(refit.stdout)
    args = [sys.executable, "-m", "s2moe.runtime.cli", "run", "-m", calib_model, "-p", "def f", "-n", "6",
            "--profile", str(out), "--json"]
    # the model has no ranks file of its own: the profile's head cannot be built, and the error says whose it is
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "speculative.draft_vocab" in run.stderr and "--draft-vocab 0" in run.stderr, run.stderr
    run = subprocess.run(args + ["--method", "ar"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr  # AR drafts nothing: no head to build
    run = subprocess.run(args + ["--token-ranks", str(ranks)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stdout)["stats"]
    assert stats["cost_constants"]["source"].startswith("profile") and "estimated" not in run.stderr
    assert stats["offload"]["budget"] == "50% of expert bytes"
    assert stats["draft_vocab"]["size"] == head  # drafted with the head the profile timed
    run = subprocess.run(args + ["--draft-vocab", "0"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "draft_vocab" not in json.loads(run.stdout)["stats"], run.stderr


def test_emulated_tier_is_recovered(calib_model):
    """Under a known emulated link the bandwidth stage recovers bandwidth and latency within 10 %.

    Robust to a loaded machine: the link is slow enough (40 MB/s, 3 ms) that a scheduler delay of
    a fraction of a millisecond is a small share of each timed read, each size's median is taken,
    and a run disturbed anyway is retried (at most 4 runs, about 1 s each); load only ever makes
    reads slower, so one undisturbed run shows the measurement is right."""
    from s2moe.calib.measure import offload_bandwidth
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.offload.store import Emulation, ExpertStore

    loaded = load_model(calib_model)
    store = ExpertStore(loaded, emulation=Emulation(40.0, 3000.0), threads=1)
    runs = []
    for _ in range(4):
        bw = offload_bandwidth(store, loaded, reps=6)
        runs.append((round(bw["bandwidth_mb_s"], 2), round(bw["latency_us"], 1)))
        if abs(bw["bandwidth_mb_s"] / 40.0 - 1) < 0.1 and abs(bw["latency_us"] / 3000.0 - 1) < 0.1:
            break
    else:
        pytest.fail(f"bandwidth/latency never within 10 % of 40 MB/s, 3000 µs: {runs}")


def test_bandwidth_fit_recovers_a_line_and_bounds_a_flat_one(tmp_path):
    """Read times that grow with size give latency and bandwidth exactly. Times that do not (all
    latency, or a busy machine: the stress run of issue 13 met this in `profile`, which then wrote
    bandwidth inf, a value its own loader refuses) give a finite lower bound, flagged, that a
    profile can hold."""
    from s2moe.calib.measure import fit_latency_bandwidth

    sizes = [65536, 131072, 262144]
    line = [(n, 200e-6 + n / 500e6) for n in sizes for _ in range(3)]
    fit = fit_latency_bandwidth(line, sizes)
    assert fit["bandwidth_mb_s"] == pytest.approx(500.0) and fit["latency_us"] == pytest.approx(200.0)
    assert fit["bandwidth_is_bound"] is False
    flat = [(65536, 3e-4), (131072, 2.9e-4), (262144, 2.8e-4), (262144, 2.8e-4), (262144, 9e-4)]
    fit = fit_latency_bandwidth(flat, sizes)
    # the largest request's median (0.28 ms) all charged to transfer; the smallest's 0.3 ms less its share
    assert fit["bandwidth_is_bound"] is True
    assert fit["bandwidth_mb_s"] == pytest.approx(262144 / 2.8e-4 / 1e6)
    assert fit["latency_us"] == pytest.approx((3e-4 - 65536 * 2.8e-4 / 262144) * 1e6)
    single = fit_latency_bandwidth([(4096, 1e-4), (4096, 2e-4)], [4096])
    assert single["bandwidth_is_bound"] and single["bandwidth_mb_s"] == pytest.approx(4096 / 1.5e-4 / 1e6)
    # noise around a flat line, with a slightly rising slope: not a line either (it would say 554 GB/s)
    wide = [65536 << i for i in range(5)]
    noisy = fit_latency_bandwidth(list(zip(wide, [1e-4, 1.01e-4, 0.99e-4, 1e-4, 1.02e-4])), wide)
    assert noisy["bandwidth_is_bound"] and noisy["fit_r2"] is None
    assert noisy["bandwidth_mb_s"] == pytest.approx(wide[-1] / 1.02e-4 / 1e6)
    data = _measured_like(tmp_path)
    data["offload"].update({k: fit[k] for k in ("bandwidth_mb_s", "latency_us", "fit_r2", "bandwidth_is_bound")})
    save_profile(str(tmp_path / "p.json"), data)
    assert load_profile(str(tmp_path / "p.json")).data["offload"]["bandwidth_is_bound"] is True


def test_a_profile_holding_a_nan_is_never_written(tmp_path):
    """The schema does not look inside every sub-object (a fit's details, a validation verdict):
    a NaN there is refused in one line naming its path, and no file appears."""
    data = _measured_like(tmp_path)
    data["cost_model"]["fit"] = {"r2": 0.9, "mape_percent": float("nan")}
    path = tmp_path / "p.json"
    with pytest.raises(ProfileError, match=r"field cost_model\.fit\.mape_percent is not a finite number"):
        save_profile(str(path), data)
    assert not path.exists()


def _measured_profile_with(tmp_path, **changes) -> str:
    data = _measured_like(tmp_path)
    data["model"]["expert_bytes_stored"] = 3 << 20  # 3 MiB
    data["cost_model"].update(t_ar_ms=120.5, c_draft_ms=8.25, t_exp_miss_ms=0.75)
    data["speculative"].update(draft_topk=2, reuse_cap=16, draft_cap=6)
    data["hot_experts"] = {"gpu_experts": [[0, 3], [1, 5]]}
    for key, value in changes.items():
        data["cost_model"][key] = value
    path = tmp_path / "measured.json"
    save_profile(str(path), data)
    return str(path)


def test_export_of_a_measured_profile_by_hand(tmp_path):
    """A measured profile exports the published fork's flags computed from its own numbers: the
    true expert size in MiB, and the bandwidth that makes MiB / (MiB/ms) equal the fitted T_exp
    (3 MiB / 0.75 ms = 4 MiB/ms); its hot list goes to the hot file."""
    path = _measured_profile_with(tmp_path)
    hot = tmp_path / "hot.json"
    r = calib("export", "--profile", path, "--format", "llama-cpp", "--json", "--hot-out", str(hot))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"prune_tpot": 120.5, "prune_eps": 8.25, "prune_expert_bytes": 3.0,
                                    "prune_bandwidth": 4.0, "draft_expert_topk": 2, "moe_reuse_expert_cap": 16,
                                    "draft": 6}
    assert json.loads(hot.read_text()) == {"gpu_experts": [[0, 3], [1, 5]]}
    line = calib("export", "--profile", path, "--hot-out", str(hot)).stdout.split()
    assert line == ["--prune-tpot", "120.5", "--prune-eps", "8.25", "--prune-expert-bytes", "3.0",
                    "--prune-bandwidth", "4.0", "--draft-expert-topk", "2", "--moe-reuse-expert-cap", "16",
                    "--draft", "6"]


def test_export_keeps_the_fitted_miss_time_to_the_flags_precision(tmp_path):
    """MiB / bandwidth is what the fork charges per miss: for 3 MiB and T_exp 7 ms the bandwidth is
    0.428571 MiB/ms, and the pair must give back 7 ms (a bandwidth rounded to 0.43 gives 6.98)."""
    from s2moe.calib.fit_export import llama_cpp_flags

    flags = llama_cpp_flags(load_profile(_measured_profile_with(tmp_path, t_exp_miss_ms=7.0)).data)
    assert flags["prune_expert_bytes"] / flags["prune_bandwidth"] == pytest.approx(7.0, rel=1e-5)


def test_export_of_a_profile_whose_misses_cost_nothing(tmp_path):
    """A fully resident profile can fit T_exp miss = 0 (the schema allows it): the export is a
    bandwidth so large that MiB / bandwidth is 0 to the flag's precision, not a division error."""
    from s2moe.calib.fit_export import llama_cpp_flags

    flags = llama_cpp_flags(load_profile(_measured_profile_with(tmp_path, t_exp_miss_ms=0.0)).data)
    assert flags["prune_expert_bytes"] == 3.0 and flags["prune_bandwidth"] >= 1e9
    assert round(flags["prune_expert_bytes"] / flags["prune_bandwidth"], 6) == 0.0


def test_export_keeps_the_flags_precision(tmp_path):
    from s2moe.calib.fit_export import llama_cpp_flags

    data = load_profile(_measured_profile_with(tmp_path, t_ar_ms=1.234567, c_draft_ms=0.123456)).data
    flags = llama_cpp_flags(data)
    assert (flags["prune_tpot"], flags["prune_eps"]) == (1.2346, 0.1235)  # ms to 4 places: 0.1 µs


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_profile_number_names_its_field(tmp_path, value):
    data = _measured_like(tmp_path)
    data["cost_model"]["c_draft_ms"] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))  # NaN / Infinity: the bare tokens Python's json writes and reads
    with pytest.raises(ProfileError, match="cost_model.c_draft_ms"):
        load_profile(str(path))


def test_export_keeps_the_hot_lists_rank_order(tmp_path):
    path = _measured_profile_with(tmp_path)
    data = load_profile(path).data
    data["hot_experts"] = {"gpu_experts": [[1, 5], [0, 3], [1, 0]]}  # most used first
    save_profile(path, data)
    hot = tmp_path / "hot.json"
    assert calib("export", "--profile", path, "--hot-out", str(hot)).returncode == 0
    assert json.loads(hot.read_text()) == {"gpu_experts": [[1, 5], [0, 3], [1, 0]]}
