"""`s2moe-calib` against what a new user hits (issue 18): the profile plans memory as `run` does,
validate and fit check the model, export writes only where asked, bad input is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from s2moe.runtime.profile import load_profile, save_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "profiles", "orin-16g.json")
QUICK = ("--samples", "10", "--n-prompts", "4", "--decode-tokens", "4", "--rounds", "1")  # a profile of the embedded model in ~8 s
# 77 tokens with the embedded model's tokenizer: prompt chunks of 64, as a long prompt has
LONG_PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
               "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
               "        self.items.append(x)\n")


def calib(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "s2moe.calib", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd)


def s2moe(*args):
    return subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", *args], capture_output=True, text=True,
                          timeout=600)


def one_line_error(r, code: int, *needles: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def hot_bytes(data: dict) -> int:
    from s2moe.runtime.cli.common import resolve_model
    from s2moe.runtime.model.loader import load_model

    loaded = load_model(resolve_model(None), dense=False)
    return sum(loaded.experts[tuple(k)].resident_bytes for k in data["hot_experts"]["gpu_experts"])


# -- item 5: the profile reserves the KV a run reserves -------------------------------------------

@pytest.fixture(scope="module")
def profile_18m(tmp_path_factory):
    out = tmp_path_factory.mktemp("p18") / "p18.json"
    r = calib("profile", "--device", "cpu", "--budget", "18m", "--out", str(out), *QUICK)
    return out, r


def test_profile_at_18m_is_not_refused_where_run_works(profile_18m):
    run = s2moe("run", "--budget", "18m", "-p", "def add(a, b):", "-n", "8", "--backend", "numpy", "--json")
    assert run.returncode == 0, run.stderr
    out, r = profile_18m
    assert r.returncode == 0, r.stderr
    data = load_profile(str(out)).data
    assert data["budget"]["spec"] == "18m" and data["budget"]["context_tokens"] == 128
    assert data["budget"]["kv_positions"] == 128 + 2 * 8 + 2  # as run reserves: ctx + 2 × max(cap, 8) + 2
    # the profile's own budget and hot list work for a run of that context
    run = s2moe("run", "--profile", str(out), "-p", "def add(a, b):", "-n", "8", "--backend", "numpy", "--json")
    assert run.returncode == 0, run.stderr
    assert hot_bytes(data) <= json.loads(run.stdout)["stats"]["offload"]["memory"]["expert_capacity_bytes"]


def test_hot_list_is_sized_for_the_capacity_run_plans(tmp_path):
    """A run of the context the profile planned for gets exactly the profile's expert capacity, and
    the hot list fits it (the profile used to plan 4,096 positions: far less room, or a refusal)."""
    from s2moe.runtime.cli.common import resolve_model
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    prompt_tokens = len(load_tokenizer(load_model(resolve_model(None), dense=False)).encode(LONG_PROMPT).ids)
    assert prompt_tokens >= 64
    out = tmp_path / "p25.json"
    r = calib("profile", "--device", "cpu", "--budget", "25m", "--ctx-size", str(prompt_tokens + 8),
              "--out", str(out), *QUICK)
    assert r.returncode == 0, r.stderr
    data = load_profile(str(out)).data
    run = s2moe("run", "--profile", str(out), "-p", LONG_PROMPT, "-n", "8", "--backend", "numpy", "--json")
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)["stats"]["offload"]["memory"]
    assert plan["kv_bytes"] // (prompt_tokens + 8 + 18) * (prompt_tokens + 8 + 18) == plan["kv_bytes"]
    assert 0 < plan["expert_capacity_bytes"] < plan["expert_total_bytes"]  # a budget that offloads
    assert data["budget"]["expert_capacity_bytes"] == plan["expert_capacity_bytes"]
    # the hot list fits (it may be empty: a list is pinned only where it clearly beats the LFU cache)
    assert hot_bytes(data) <= plan["expert_capacity_bytes"]


# -- item 7: validate checks the profile's model ---------------------------------------------------

def test_validate_uses_the_profiles_model_and_records_its_verdict(profile_18m, tmp_path):
    out, r = profile_18m
    assert r.returncode == 0, r.stderr
    assert f"next: s2moe-calib validate --profile {out}" in r.stderr
    other = tmp_path / "elsewhere.json"  # the recorded model path is absolute, wherever the profile goes
    data = load_profile(str(out)).data
    from s2moe.runtime.cli.common import resolve_model

    assert data["model"]["path"] == os.path.abspath(resolve_model(None))
    data["model"]["path"] = "/nonexistent/model"
    save_profile(str(other), data)
    r = calib("validate", "--profile", str(other), "--n-prompts", "2", "--max-tokens", "8", "--rounds", "1")
    one_line_error(r, 2, str(other), "model.path", "--model")
    before = load_profile(str(out)).data["validation"]
    r = calib("validate", "--profile", str(out), "--n-prompts", "2", "--max-tokens", "8", "--rounds", "1",
              "--min-r2", "-1e9", "--max-mape", "1e9", "--max-bias", "1e9", "--json")
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr
    res = json.loads(r.stdout)
    val = load_profile(str(out)).data["validation"]
    assert before is None and val["r2"] == res["r2"] and val["mape_percent"] == res["mape_percent"]
    assert val["passed"] is True and val["date"] and val["model"] == os.path.abspath(resolve_model(None))


def test_validate_warns_when_the_model_is_not_the_profiles(tmp_path):
    """A profile of another model (the published OLMoE preset) validated on the embedded model: one
    warning line, its hot list unused, nothing recorded in the profile."""
    path = tmp_path / "preset.json"
    path.write_bytes(open(PRESET, "rb").read())
    data = json.loads(path.read_text())
    data["budget"]["spec"] = "0.5"
    data["device"].update(kind="cpu", offload_tier="file")
    path.write_text(json.dumps(data))
    r = calib("validate", "--profile", str(path), "--n-prompts", "2", "--max-tokens", "8", "--rounds", "1",
              "--min-r2", "-1e9", "--max-mape", "1e9", "--max-bias", "1e9", "--json")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "OLMoE-1B-7B" in warnings[0] and str(path) in warnings[0]
    assert json.loads(path.read_text())["validation"] is None


# -- item 8: fit checks the model and device -------------------------------------------------------

def _samples(fingerprint: str | None, device: str, model: str = "/somewhere/else") -> dict:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        n_tokens, n_missing, n_resident = (int(x) for x in rng.integers(1, 20, 3))
        rows.append({"n_tokens": n_tokens, "n_missing": n_missing, "n_resident": n_resident,
                     "seconds": 1e-3 + 2e-4 * n_tokens + 5e-4 * n_missing + 3e-5 * n_resident})
    out = {"model": model, "device": device, "verification": rows, "decode_verification": []}
    if fingerprint is not None:
        out["fingerprint"] = fingerprint
    return out


def test_fit_refuses_samples_of_another_model(tmp_path):
    prof = tmp_path / "preset.json"
    prof.write_bytes(open(PRESET, "rb").read())
    before = prof.read_bytes()
    samples = tmp_path / "s.samples.json"
    samples.write_text(json.dumps(_samples("sha256:0123456789abcdef", "orin")))
    r = calib("fit", str(samples), "--profile", str(prof))
    one_line_error(r, 2, str(prof), "OLMoE-1B-7B", "re-run s2moe-calib profile")
    assert prof.read_bytes() == before
    samples.write_text(json.dumps(_samples("published:OLMoE-1B-7B-0924", "cpu")))  # right model, wrong device
    r = calib("fit", str(samples), "--profile", str(prof))
    one_line_error(r, 2, str(prof), "cpu")
    samples.write_text(json.dumps(_samples(None, "orin")))  # an older samples file whose model is gone
    one_line_error(calib("fit", str(samples), "--profile", str(prof)), 2, str(samples), "fingerprint")
    assert prof.read_bytes() == before
    # without --profile nothing is written into, so nothing to match
    assert calib("fit", str(samples), "--json").returncode == 0


def test_fit_into_a_preset_makes_it_measured(tmp_path):
    prof = tmp_path / "preset.json"
    prof.write_bytes(open(PRESET, "rb").read())
    samples = tmp_path / "s.samples.json"
    samples.write_text(json.dumps(_samples("published:OLMoE-1B-7B-0924", "orin")))
    r = calib("fit", str(samples), "--profile", str(prof))
    assert r.returncode == 0, r.stderr
    data = load_profile(str(prof)).data
    assert data["source"] == "measured" and "published" not in data
    assert data["cost_model"]["t_exp_miss_ms"] == pytest.approx(0.5, rel=1e-3)
    # export now prints the fitted constants, not the published flags
    r = calib("export", "--profile", str(prof), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["prune_bandwidth"] == pytest.approx(
        data["model"]["expert_bytes_stored"] / (1 << 20) / 0.5, rel=1e-3)


@pytest.mark.parametrize("field,value", [("seconds", float("nan")), ("n_missing", -1), ("seconds", "fast"),
                                         ("seconds", 0.0)])
def test_fit_names_a_bad_sample(tmp_path, field, value):
    data = _samples(None, "cpu")
    data["verification"][3][field] = value
    samples = tmp_path / "bad.samples.json"
    samples.write_text(json.dumps(data))  # NaN as the bare token Python writes
    one_line_error(calib("fit", str(samples)), 2, str(samples), f"verification[3].{field}")


def test_fit_needs_enough_passes(tmp_path):
    """Four constants from 3 passes (or none: NNLS on an empty matrix returns subnormal garbage and a
    NaN MAPE) are refused in one line; 10 is what profile --update asks too."""
    for n in (0, 3):
        data = _samples(None, "cpu")
        data["verification"] = data["verification"][:n]
        samples = tmp_path / f"few{n}.samples.json"
        samples.write_text(json.dumps(data))
        one_line_error(calib("fit", str(samples)), 2, str(samples), "at least 10 are needed")


# -- item 10: export writes only where asked ------------------------------------------------------

def test_export_writes_no_file_unasked(tmp_path):
    folder = tmp_path / "work"
    (folder / "profiles").mkdir(parents=True)
    prof = folder / "profiles" / "mine.json"
    data = json.loads(open(PRESET).read())
    data.pop("published")
    data["source"] = "measured"
    data["hot_experts"] = {"gpu_experts": [[0, 3], [1, 5]]}
    save_profile(str(prof), data)
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    for args in ((), ("--json",)):
        r = calib("export", "--profile", str(prof), *args, cwd=str(folder))
        assert r.returncode == 0, r.stderr
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
        assert "--hot-out" in r.stderr  # says how to get the hot list
    hot = tmp_path / "hot.json"
    assert calib("export", "--profile", str(prof), "--hot-out", str(hot)).returncode == 0
    assert json.loads(hot.read_text()) == {"gpu_experts": [[0, 3], [1, 5]]}
    one_line_error(calib("export", "--profile", str(prof), "--hot-out", str(prof)), 2, "--hot-out")
    assert load_profile(str(prof)).data == data


# -- item 14 and flags: one line, exit 2 ----------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (("probe", "--model", "/nonexistent"), "--model /nonexistent"),
    (("profile", "--device", "cpu", "--model", "/nonexistent"), "--model /nonexistent"),
    (("profile", "--device", "cpu", "--samples", "5"), "--samples"),
    (("profile", "--device", "cpu", "--n-prompts", "0"), "--n-prompts"),
    (("profile", "--device", "cpu", "--ctx-size", "0"), "--ctx-size"),
    (("profile", "--device", "cpu", "--ctx-size", "999999"), "--ctx-size"),  # beyond the model's 2,048
    (("profile", "--device", "cpu", "--draft-topk", "99"), "--draft-topk"),  # the model's top-k is 4
    (("profile", "--device", "cpu", "--draft-vocab", "99999"), "--draft-vocab 99999"),  # 6,144 tokens
    (("profile", "--device", "cpu", "--draft-vocab", "8", "--token-ranks", "/nonexistent.json"), "/nonexistent.json"),
    (("profile", "--device", "cpu", "--emulate-bandwidth", "nan"), "--emulate-bandwidth"),
    (("profile", "--device", "cpu", "--emulate-latency", "-1"), "--emulate-latency"),
    (("profile", "--device", "cpu", "--fetch-threads", "0"), "--fetch-threads"),
    (("profile", "--device", "cpu", "--budget", "1m"), "--budget"),
    (("validate", "--profile", PRESET, "--max-mape", "nan"), "--max-mape"),
    (("validate", "--profile", PRESET, "--min-r2", "inf"), "--min-r2"),
    (("validate", "--profile", PRESET, "--max-bias", "-1"), "--max-bias"),
    (("validate", "--profile", PRESET, "--n-prompts", "0"), "--n-prompts"),
    (("validate", "--profile", PRESET, "--model", "/nonexistent"), "--model /nonexistent"),
])
def test_bad_calib_input_is_one_line(tmp_path, args, needle):
    one_line_error(calib(*args, "--out", str(tmp_path / "x.json")) if args[0] == "profile" else calib(*args),
                   2, needle)
    assert not os.path.exists(tmp_path / "x.json")


def test_profile_context_in_a_profile_is_checked(tmp_path):
    from s2moe.calib.plan import DEFAULT_CONTEXT, profile_context
    from s2moe.runtime.errors import UsageError

    assert profile_context({"budget": {"spec": "1.0"}}, "p.json") == DEFAULT_CONTEXT  # older profiles
    assert profile_context({"budget": {"spec": "1.0", "context_tokens": 300}}, "p.json") == 300
    with pytest.raises(UsageError, match=r"p\.json: budget\.context_tokens"):
        profile_context({"budget": {"spec": "1.0", "context_tokens": -3}}, "p.json")


# -- rough edges: default name, poor-fit warning --------------------------------------------------

def test_default_profile_name_names_the_detected_device(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from s2moe.calib import profile_cmd
    from s2moe.calib.cli import app
    from s2moe.calib.devices import resolve_device

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(profile_cmd, "run_profile", interrupted)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["profile"])
    kind = resolve_device("auto")[0]
    assert r.exit_code == 130
    assert f"profiles/{kind}-default-moe.json is unchanged" in r.output and "auto-" not in r.output


def test_profile_warns_when_its_own_fit_is_poor(profile_18m, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from s2moe.calib import profile_cmd
    from s2moe.calib.cli import app

    data = load_profile(str(profile_18m[0])).data
    for r2, mape, warned in ((0.99, 2.0, False), (0.5, 2.0, True), (0.99, 25.0, True)):
        data["cost_model"]["fit"].update(r2=r2, mape_percent=mape)
        monkeypatch.setattr(profile_cmd, "run_profile", lambda *a, **k: data)
        r = CliRunner().invoke(app, ["profile", "--device", "cpu", "--out", str(tmp_path / "p.json")])
        assert r.exit_code == 0, r.output
        lines = [line for line in r.output.splitlines() if "cost fit is poor" in line]
        assert len(lines) == (1 if warned else 0), r.output


# -- C_draft is timed as the run drafts: resident experts only, no fetches -------------------------

def test_profile_times_c_draft_without_fetches(tmp_path, monkeypatch):
    """The run's draft routes to resident experts only and never fetches, so `profile` must time
    C_draft the same way: timed with fetches it came out at half of T_AR under a slow tier. Counted,
    not timed: which steps read experts does not depend on how busy the machine is (a ratio of
    C_draft to T_AR did, under load). With --draft-vocab, C_draft is timed with that draft head
    (as the run drafts), T_AR with the full one."""
    from typer.testing import CliRunner

    from s2moe.calib import measure
    from s2moe.calib.cli import app

    timed = measure.decode_step_times
    reads = []  # (steps timed, expert reads during them), one per call: T_AR's, then C_draft's
    heads = []  # the lm head each call timed with: None (full) or the draft head's size

    def counting(model, prompts, tokens, policy, tick=lambda: None, head=None):
        phases = lambda: sum(s.misses for s in model.experts.stats.values())  # noqa: E731
        before = phases()
        steps = timed(model, prompts, tokens, policy, tick, head=head)
        reads.append((len(steps), phases() - before))
        heads.append(None if head is None else head.size)
        return steps

    monkeypatch.setattr(measure, "decode_step_times", counting)
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", "--device", "cpu", "--budget", "0.25", "--out", str(out),
                                 "--samples", "10", "--n-prompts", "1", "--decode-tokens", "4", "--rounds", "1",
                                 "--draft-vocab", "1024"])
    assert r.exit_code == 0, r.output
    assert len(reads) == 2, reads
    (ar_steps, ar_reads), (draft_steps, draft_reads) = reads
    assert ar_steps > 0 and ar_reads > 0  # at 25 % an AR step misses: the count can see fetches
    assert draft_steps > 0 and draft_reads == 0, reads
    assert heads == [None, 1024], heads
    assert json.loads(out.read_text())["speculative"]["draft_vocab"] == 1024


def test_fit_matches_older_samples_by_the_model_they_name(tmp_path):
    """Samples files from before fingerprints were recorded: fit fingerprints the model they name."""
    from s2moe.runtime.cli.common import resolve_model
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.profile import model_fingerprint

    model = resolve_model(None)
    data = json.loads(open(PRESET).read())
    data["model"]["fingerprint"] = model_fingerprint(load_model(model, dense=False))
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(data))
    samples = tmp_path / "old.samples.json"
    samples.write_text(json.dumps(_samples(None, "orin", model=model)))  # no fingerprint field
    r = calib("fit", str(samples), "--profile", str(prof))
    assert r.returncode == 0, r.stderr


def test_validate_plot_without_matplotlib_fails_before_any_work(tmp_path):
    """--plot without matplotlib is refused before the profile is even read, not after minutes of
    decoding (at OLMoE-1B-7B's size, validate ran 12 minutes, then failed on the plot)."""
    code = "import sys; sys.modules['matplotlib'] = None; from s2moe.calib.cli import app; app()"
    r = subprocess.run([sys.executable, "-c", code, "validate", "--profile", str(tmp_path / "absent.json"),
                        "--plot", str(tmp_path / "v.png")], capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--plot needs matplotlib" in lines[0]
    assert not (tmp_path / "v.png").exists()
