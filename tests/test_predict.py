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


def _profile(tmp_path, budget="16g", shape=None):
    """The Orin preset with test costs, for a model of the embedded model's shape (its T_AR then
    prices the trace's AR steps) or of ``shape`` (layers, experts, top_k)."""
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.model.loader import load_model

    c = load_model(str(DEFAULT_MODEL), dense=False).config
    data = json.load(open(os.path.join(ROOT, "profiles", "orin-16g.json")))
    data.pop("published")
    data.update(source="measured", budget={"spec": budget})
    data["model"].update(zip(("layers", "experts", "top_k"), shape or (c.num_layers, c.num_experts, c.top_k)))
    data["cost_model"].update(COSTS)
    data["hot_experts"] = {"gpu_experts": []}
    path = tmp_path / f"p-{budget}{'-other' if shape else ''}.json"
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
    r = cli("s2moe.calib", "predict", "--trace", str(trace), "--profile", _profile(tmp_path), "--json", "--as-recorded")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    got = {m["method"]: m for m in result["methods"]}
    runs = json.loads(trace.read_text())["runs"]

    def priced(run):  # everything fits: an expert misses once, the first time any pass asks
        seen, out = set(), []
        for phase, n, keys in run["passes"]:
            new = [k for k in keys if k not in seen]
            seen.update(keys)
            fitted = (COSTS["t_base_ms"] + COSTS["t_token_ms"] * n + COSTS["t_exp_miss_ms"] * len(new)
                      + COSTS["t_exp_hit_ms"] * (len(keys) - len(new))) / 1e3
            out.append((phase, COSTS["c_draft_ms"] / 1e3 if phase == "draft" else fitted))
        return out

    # an AR step costs T_AR at the AR run's mean misses: the fit's price scaled by T_AR / its mean
    ar_steps = [t for phase, t in priced(next(r for r in runs if r["method"] == "ar")) if phase == "ar"]
    scale = COSTS["t_ar_ms"] / 1e3 / (sum(ar_steps) / len(ar_steps))
    assert result["ar_step_scale"] == pytest.approx(scale, rel=1e-5)
    for run in runs:
        seconds = sum(t * (scale if phase == "ar" else 1.0) for phase, t in priced(run) if phase != "prefill")
        assert got[run["method"]]["predicted_seconds"] == pytest.approx(seconds, rel=1e-9)
        assert got[run["method"]]["predicted_tokens_per_s"] == pytest.approx(run["tokens"] / seconds)
    assert got["ar"]["predicted_speedup_vs_ar"] == pytest.approx(1.0)
    assert got["ar"]["predicted_tokens_per_s"] == pytest.approx(1e3 / COSTS["t_ar_ms"])  # at the profile's budget


def test_a_greedy_ae_run_records_a_draft_chain_at_every_position(trace):
    data = json.loads(trace.read_text())
    runs = {r["method"]: r for r in data["runs"]}
    texts, drafts = runs["ar"]["texts"], runs["s2moe"]["drafts"]
    assert [len(t) for t in runs["s2moe"]["texts"]] == [12, 12]
    E, cap = data["model"]["experts_per_layer"], runs["s2moe"]["settings"]["draft_cap"]
    assert [len(t) for t in texts] == [12, 12] and [len(d) for d in drafts] == [11, 11]
    agree = 0
    for text, table in zip(texts, drafts):
        for j, (root_keys, chain, rows, kept) in enumerate(table):
            assert len(chain) == cap and len(rows) == cap + 1 and len(root_keys) == 4 * data["model"]["top_k"]
            assert 0 <= kept <= cap
            assert all(0 < q <= 1 and all(0 <= k < 4 * E for k in plain + gated) for _, q, plain, gated in chain)
            assert all(len(row) == 4 * data["model"]["top_k"] for row in rows)  # each row: top-k a layer
            agree += chain[0][0] == text[j + 1]
    assert agree >= 11  # the draft shares the target's weights: its first token is mostly AR's next


def _redecided(trace, tmp_path, costs, guard=False, tamper=False, drafts="recorded"):
    data = json.loads(trace.read_text())
    for run in data["runs"]:
        if "settings" in run:
            run["settings"]["rate_guard"] = guard
        for table in run.get("drafts", ()) if tamper else ():  # verifications that reject early
            for j, entry in enumerate(table):
                entry[3] = min(entry[3], j % 3)
    path = tmp_path / f"t-{len(os.listdir(tmp_path))}.json"
    path.write_text(json.dumps(data))
    prof = json.loads(open(_profile(tmp_path)).read())
    prof["cost_model"].update(costs)
    ppath = tmp_path / f"p-{len(os.listdir(tmp_path))}.json"
    ppath.write_text(json.dumps(prof))
    r = cli("s2moe.calib", "predict", "--trace", str(path), "--profile", str(ppath), "--json", "--drafts", drafts)
    assert r.returncode == 0, r.stderr
    return data, {m["method"]: m for m in json.loads(r.stdout)["methods"]}


def test_predict_re_makes_ae_decisions_with_the_devices_costs(trace, tmp_path):
    """Drafting free and an AR step dear: AE drafts the whole chain at every iteration, and
    verification keeps what the recorded verification kept; an independent walk of the draft
    tables gives the same count. Drafting dear: AE drafts nothing, whatever the recorded run did."""
    data, got = _redecided(trace, tmp_path, {"t_ar_ms": 10000.0, "c_draft_ms": 0.001}, tamper=True)
    s2, runs = got["s2moe"], {r["method"]: r for r in data["runs"]}
    assert s2["decisions"] == "re-made" and got["ar"]["decisions"] == "as recorded"
    verifications = drafted = 0
    for text, table in zip(runs["ar"]["texts"], runs["s2moe"]["drafts"]):
        out = 1
        while out < len(text):
            j = out - 1
            chain, kept = table[j][1], table[j][3]
            a = min(len(chain), kept, len(text) - 1 - j)
            verifications, drafted, out = verifications + 1, drafted + len(chain), out + a + 1
    assert (s2["verifications"], s2["drafted"]) == (verifications, drafted)
    _, dear = _redecided(trace, tmp_path, {"t_ar_ms": 0.001, "c_draft_ms": 50.0})
    assert dear["s2moe"]["drafted"] == 0 and dear["s2moe"]["backoff_steps"] > 0  # AR steps after empty drafts


def test_a_slow_tier_makes_ae_draft_more_than_a_fast_one(trace, tmp_path):
    fast = {"t_ar_ms": 5.0, "t_exp_miss_ms": 0.3, "t_exp_hit_ms": 0.1}
    slow = {"t_ar_ms": 60.0, "t_exp_miss_ms": 6.0, "t_exp_hit_ms": 0.1}
    drafted = [_redecided(trace, tmp_path, c, guard=True)[1]["s2moe"]["drafted"] for c in (fast, slow)]
    assert drafted[0] < drafted[1]


def test_a_smaller_budget_misses_more(trace, tmp_path):
    rates = []
    for budget in ("16g", "0.25", "0.1"):
        r = cli("s2moe.calib", "predict", "--trace", str(trace), "--profile", _profile(tmp_path, budget), "--json")
        assert r.returncode == 0, r.stderr
        ar = next(m for m in json.loads(r.stdout)["methods"] if m["method"] == "ar")
        rates.append(ar["miss_rate"])
        # at each profile's own budget, AR runs at its T_AR, whatever it misses there
        assert ar["predicted_tokens_per_s"] == pytest.approx(1e3 / COSTS["t_ar_ms"])
    assert rates[0] < rates[1] < rates[2]
    # a profile made at the full budget, asked about 10 %: AR misses more than when T_AR was measured
    r = cli("s2moe.calib", "predict", "--trace", str(trace), "--profile", _profile(tmp_path, "16g"), "--json",
            "--budget", "0.1")
    assert r.returncode == 0, r.stderr
    ar = next(m for m in json.loads(r.stdout)["methods"] if m["method"] == "ar")
    assert ar["miss_rate"] == pytest.approx(rates[2]) and ar["predicted_tokens_per_s"] < 0.9e3 / COSTS["t_ar_ms"]


def test_a_profile_of_another_shape_keeps_the_fitted_ar_price(trace, tmp_path):
    """T_AR belongs to the profile's model: for a trace of another shape an AR step keeps the fit's price."""
    r = cli("s2moe.calib", "predict", "--trace", str(trace), "--profile", _profile(tmp_path, shape=(16, 64, 8)),
            "--json", "--as-recorded")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ar_step_scale"] == 1.0 and "not scaled to its T_AR" in " ".join(r.stderr.split())


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


def test_settings_round_trip_through_a_trace():
    """What a trace keeps of the settings draws the same chains: every field that shapes them."""
    from s2moe.runtime.decoding.methods import SpecSettings

    s = SpecSettings(draft_topk=3, layer_draft_topk={1: 1, 3: 2}, draft_cap=5, utility_threshold=1.5, ae_lookahead=1,
                     backoff=False, acceptance="confidence", prefetch=False, draft_resident=False, draft_fallback="skip",
                     draft_vocab=64, rg_variant="paper", rg_residency=0.5, rg_strength=1.5, reuse_cap=7)
    assert SpecSettings.from_trace(json.loads(json.dumps(s.trace_dict(True)))) == s


@pytest.fixture(scope="module")
def full_trace(tmp_path_factory):
    """A trace with every expert resident: its draft tables were drawn with nothing held back."""
    path = tmp_path_factory.mktemp("trace") / "full.json"
    r = cli("s2moe.runtime.cli", "bench", "--methods", "ar,s2moe", "--n-prompts", "2", "--max-tokens", "12",
            "--trace", str(path))
    assert r.returncode == 0, r.stderr
    return path


def _chains(trace, profile, drafts, *extra):
    r = cli("s2moe.calib", "predict", "--trace", str(trace), "--profile", profile, "--json", "--drafts", drafts, *extra)
    assert r.returncode == 0, r.stderr
    return next(m for m in json.loads(r.stdout)["methods"] if m["method"] == "s2moe")


def test_chains_drawn_again_with_the_same_residency_are_the_tables(full_trace, tmp_path):
    """Everything resident on both sides: the chains drawn again on the model are the trace's
    tables, so the re-made run is the same to the token and the second."""
    profile = _profile(tmp_path, "16g")
    redrawn, recorded = _chains(full_trace, profile, "redraw"), _chains(full_trace, profile, "recorded")
    assert redrawn["chains"] == "redrawn" and recorded["chains"] == "recorded"
    for key in ("verifications", "drafted", "accepted", "ar_steps", "predicted_seconds"):
        assert redrawn[key] == recorded[key], key


def test_a_device_that_holds_fewer_experts_drafts_worse_chains(full_trace, tmp_path):
    """The draft uses resident experts only: at 10 % its chains, drawn with that residency, keep
    fewer tokens than the tables drawn with every expert (and the other settings as recorded)."""
    profile = _profile(tmp_path, "16g")
    costs = ("--budget", "0.1")
    redrawn, recorded = _chains(full_trace, profile, "redraw", *costs), _chains(full_trace, profile, "recorded", *costs)
    assert redrawn["accepted"] / redrawn["drafted"] < recorded["accepted"] / recorded["drafted"]


def test_a_trace_without_prompts_cannot_be_drawn_again(full_trace, tmp_path):
    data = json.loads(full_trace.read_text())
    for run in data["runs"]:
        run.pop("prompts", None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    profile = _profile(tmp_path, "16g")
    r = cli("s2moe.calib", "predict", "--trace", str(old), "--profile", profile, "--drafts", "redraw")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--drafts recorded" in lines[0]
    assert _chains(old, profile, "auto")["chains"] == "recorded"  # auto: the tables it has
