"""The `s2moe` CLI end to end, including bad input: one line, exit 2, no traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import tiny_models as tm


def s2moe(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "s2moe.runtime.cli", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_run_json_equals_transformers_greedy(tiny_model_dirs):
    from tokenizers import Tokenizer

    torch_model, folder, _ = tiny_model_dirs["qwen3_moe"]
    # --no-rg: reuse-aware gating is lossy by design (benchmarks/quality.py prices it); without it the
    # default method gives the AR tokens whatever it drafts, and drafting follows live timings
    r = s2moe("run", "--model", folder, "--prompt", "def add(a, b):", "--max-tokens", "10", "--json", "--no-rg")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    assert out["prompt_tokens"] == tok.encode("def add(a, b):").ids
    with torch.no_grad():
        ref = torch_model.generate(torch.tensor([out["prompt_tokens"]]), max_new_tokens=10, do_sample=False)
    assert out["tokens"] == ref[0, len(out["prompt_tokens"]):].tolist()
    assert out["text"] == tok.decode(out["tokens"])
    assert out["stats"]["generated_tokens"] == len(out["tokens"])


def test_run_streams_text_and_summary(tiny_model_dirs):
    _, folder, _ = tiny_model_dirs["olmoe"]
    # --no-rg: with gating on, a seed's text may follow draft decisions, which follow live timings
    r = s2moe("run", "-m", folder, "-p", "import os", "-n", "6", "--temperature", "0.8", "--seed", "0", "--no-rg")
    assert r.returncode == 0, r.stderr
    assert "decode" in r.stderr and "tok/s" in r.stderr
    again = s2moe("run", "-m", folder, "-p", "import os", "-n", "6", "--temperature", "0.8", "--seed", "0", "--no-rg")
    assert again.stdout == r.stdout  # seeded sampling is reproducible, seed 0 included (a falsy value)


def test_a_seeded_sampled_run_prints_ars_text(tiny_model_dirs):
    """A seed makes the sampler coupled: speculation without gating (ca: a fixed-length draft; AE
    drafts nothing on the tiny models' flat laws), under a budget where the draft reads resident
    experts only, prints the tokens --method ar prints for that seed."""
    _, folder, _ = tiny_model_dirs["olmoe"]
    # T 0.3: the tiny models' laws are flat, and at T 0.8 a draft this close to its target is never refused
    common = ("run", "-m", folder, "-p", "import os", "-n", "16", "-t", "0.3", "--seed", "5", "--json")
    # cap 8: drafts long enough that both verdicts occur in 16 tokens at this seed
    spec = json.loads(s2moe(*common, "--method", "ca", "--budget", "0.5", "--draft-cap", "8").stdout)
    ar = json.loads(s2moe(*common, "--method", "ar").stdout)
    assert spec["tokens"] == ar["tokens"] and spec["stats"]["sampling"]["draws"] == "coupled"
    assert 0 < spec["stats"]["acceptance_rate"] < 1  # it drafted, and both verdicts occurred
    standard = json.loads(s2moe(*common, "--method", "ca", "--sampler", "standard").stdout)
    assert standard["stats"]["sampling"]["draws"] == "standard"


def test_info_json(tiny_model_dirs):
    _, _, fused = tiny_model_dirs["mixtral"]
    r = s2moe("info", "--model", fused, "--json")
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    c = tm.make_config("mixtral")
    assert facts["architecture"] == "mixtral" and facts["expert_layout"] == "fused"
    assert facts["experts_per_layer"] == 8 and facts["top_k"] == 2 and facts["layers"] == 2
    per_expert = 3 * c.hidden_size * c.intermediate_size
    assert facts["expert_bytes_stored"] == per_expert * 4  # float32 checkpoint
    # resident = stored encoding; under O_DIRECT each read range is rounded out to whole pages
    assert per_expert * 4 <= facts["expert_bytes_resident"] <= per_expert * 4 + 2 * 2 * 4096
    table = s2moe("info", "--model", fused)
    assert table.returncode == 0 and "expert_bytes_stored" in table.stdout


def _resave(folder, dst, edit):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def _bad_inputs(folder, tmp):
    def drop(t):
        del t["model.layers.1.self_attn.k_proj.weight"]

    def reshape(t):
        t["model.layers.0.mlp.gate.weight"] = np.zeros((5, 64), np.float32)

    unknown = shutil.copytree(folder, tmp / "unknown")
    cfg = json.load(open(unknown / "config.json"))
    cfg["model_type"] = "gpt2"
    json.dump(cfg, open(unknown / "config.json", "w"))
    truncated = shutil.copytree(folder, tmp / "truncated")
    size = os.path.getsize(truncated / "model.safetensors")
    os.truncate(truncated / "model.safetensors", size // 2)
    text = tmp / "notes.txt"
    text.write_text("not a model\n")
    return {
        "missing tensor": (_resave(folder, tmp / "missing", drop), "missing tensor model.layers.1.self_attn.k_proj.weight"),
        "wrong shape": (_resave(folder, tmp / "shape", reshape), "has shape [5, 64]"),
        "unknown architecture": (str(unknown), "model_type 'gpt2' is not supported"),
        "truncated file": (str(truncated), "truncated"),
        "non-model file": (str(text), "not a model"),
        "truncated gguf": (None, "GGUF"),
    }


@pytest.mark.parametrize("case", ["missing tensor", "wrong shape", "unknown architecture", "truncated file",
                                  "non-model file", "truncated gguf"])
def test_bad_model_gives_one_line_error(tiny_model_dirs, tmp_path, case):
    _, folder, _ = tiny_model_dirs["olmoe"]
    path, needle = _bad_inputs(folder, tmp_path)[case]
    if path is None:
        from s2moe.runtime.offload.store import ExpertStore
        from s2moe.runtime.model.formats.gguf_writer import write_gguf
        from s2moe.runtime.model.loader import load_model

        loaded = load_model(folder)
        path = str(tmp_path / "cut.gguf")
        write_gguf(loaded, path, ExpertStore(loaded).read, "F32")
        os.truncate(path, os.path.getsize(path) - 1000)
    r = s2moe("run", "--model", path, "--prompt", "x")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle in lines[0] and os.path.basename(path) in lines[0]
    assert "Traceback" not in r.stderr
    debug = s2moe("run", "--model", path, "--prompt", "x", env={"S2MOE_DEBUG": "1"})
    assert "Traceback" in debug.stderr


def test_missing_model_and_bad_flag(tmp_path):
    r = s2moe("run", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = s2moe("run", "--model", str(tmp_path), "--prompt", "x", "--top-p", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["run", "bench"])
def test_ae_lookahead_reaches_the_settings(command):
    """The flag is checked with the other speculative settings (so a dropped flag would pass): 0
    is refused in one line naming it, after the model loaded, before any decoding."""
    args = ["--prompt", "x"] if command == "run" else ["--methods", "ar,s2moe", "--n-prompts", "1"]
    r = s2moe(command, *args, "--ae-lookahead", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--ae-lookahead 0: must be >= 1" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["run", "bench"])
def test_rg_strength_reaches_the_settings_and_the_record(command, tmp_path):
    """--rg-strength (the gating bias in multiples of a token's gap) reaches the settings and the
    record says it; past 1 a note on stderr says it costs quality; below 0 is refused in one line
    naming it; a run without gating records none (and notes nothing). That the decoder gates at the
    settings' strength is test_residency_gating.py's."""
    notes = []

    def gating(*flags):
        if command == "run":
            r = s2moe("run", "--prompt", "def f(x):", "-n", "4", "--json", *flags)
            assert r.returncode == 0, r.stderr
            notes.append("note: --rg-strength" in r.stderr)
            return json.loads(r.stdout)["stats"]["gating"]
        out = tmp_path / "g.json"
        r = s2moe("bench", "--methods", "s2moe", "--n-prompts", "1", "--max-tokens", "4", "--json", str(out), *flags)
        assert r.returncode == 0, r.stderr
        notes.append("note: --rg-strength" in r.stderr)
        return json.loads(out.read_text())["records"][0]["params"]["gating"]

    assert gating() == {"variant": "resident", "residency": 0.25, "strength": 1.0, "cap": 8}
    got = gating("--rg-strength", "1.5", "--rg-residency", "1")
    assert (got["strength"], got["residency"]) == (1.5, 1.0)
    assert notes == [False, True]
    if command == "run":
        assert gating("--no-rg", "--rg-strength", "2") is None and notes[-1] is False
    r = s2moe(command, *(["--prompt", "x"] if command == "run" else ["--methods", "s2moe", "--n-prompts", "1"]),
              "--rg-strength", "-0.5")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--rg-strength -0.5: must be >= 0" in r.stderr.strip().splitlines()[-1]


def test_bench_records_carry_the_schema(tiny_model_dirs, tmp_path):
    _, folder, _ = tiny_model_dirs["olmoe"]
    out = tmp_path / "bench.json"
    workload = os.path.join(os.path.dirname(__file__), "data", "prompts.jsonl")
    r = s2moe("bench", "-m", folder, "-w", workload, "--methods", "s2moe,ar,ca", "--budget", "0.5",
              "--n-prompts", "3", "--max-tokens", "6", "--json", str(out), "--csv", str(tmp_path / "b.csv"),
              "--always-prefetch")  # (whatever the trial would choose here: the counters below need prefetches)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert {"cpu_model", "cpu_cores"} <= set(data["machine"])
    records = data["records"]
    assert [rec["method"] for rec in records] == ["ar", "s2moe", "ca"]  # AR first: the denominator
    for rec in records:
        for key in ("method", "workload", "budget", "n_prompts", "decode_tokens_per_s", "speedup_vs_ar",
                    "acceptance_length", "reuse_ratio", "bytes_fetched_per_token", "commit"):
            assert key in rec, key
        assert len(rec["decode_tokens_per_s"]["samples"]) == 3 and rec["budget"] == "0.5"
        t = rec["ms_per_token"]  # the parts on the critical path add up to the decode time
        parts = t["draft_compute"] + t["verify_compute"] + t["other_compute"] + t["fetch_critical"]
        assert parts == pytest.approx(t["total"], abs=0.01) and min(t.values()) >= -0.01
        assert t["total"] == pytest.approx(1e3 / rec["decode_tokens_per_s_aggregate"], rel=0.01)
    assert records[0]["ms_per_token"]["draft_compute"] == records[0]["ms_per_token"]["verify_compute"] == 0
    assert records[1]["ms_per_token"]["draft_compute"] > 0 and records[1]["ms_per_token"]["verify_compute"] > 0
    assert records[0]["speedup_vs_ar"] == pytest.approx(1.0)
    for rec in records:  # the run's prefetch counters: verification's misses split by why, never more than it read
        pf = rec["prefetch"]
        split = pf["missed_refused"] + pf["missed_capped"] + pf["missed_evicted"] + pf["missed_unpredicted"] + \
            pf["missed_gated"]
        assert pf["used"] + split == pf["verify_misses"] and min(pf.values()) >= 0
    assert records[0]["prefetch"]["issued"] == records[0]["prefetch"]["verify_misses"] == 0  # AR
    assert records[1]["prefetch"]["verify_misses"] > 0 and records[1]["prefetch"]["used"] > 0  # s2moe read ahead
    ar_steps = records[0]["steps"]  # 5 tokens a prompt after prefill's: AR makes each in a step of its own
    assert (ar_steps["ar_steps"], ar_steps["verifications"], records[0]["tokens_per_verification"]) == (15, 0, None)
    for rec in records[1:]:  # what acceptance length mixes: verifications' tokens and AR steps'
        st = rec["steps"]
        assert st["verifications"] > 0 and st["draft_passes"] > 0 and 0 <= st["accepted"] <= st["drafted"]
        assert st["accepted"] + st["verifications"] + st["ar_steps"] >= 15  # (a last draft may run past the end)
        assert rec["tokens_per_verification"] == pytest.approx((st["accepted"] + st["verifications"]) / st["verifications"])
    assert (tmp_path / "b.csv").read_text().count("\n") == 4


def test_a_sampled_bench_is_reproducible_with_its_seed(tiny_model_dirs, tmp_path):
    _, folder, _ = tiny_model_dirs["olmoe"]
    workload = os.path.join(os.path.dirname(__file__), "data", "prompts.jsonl")

    def outcome(i):
        out = tmp_path / f"b{i}.json"
        r = s2moe("bench", "-m", folder, "-w", workload, "--methods", "ca", "--budget", "0.5", "--n-prompts", "3",
                  "--max-tokens", "12", "--temperature", "0.9", "--seed", "3", "--json", str(out),
                  "--no-prefetch")  # a wasted prefetch's bytes count or not by thread timing
        assert r.returncode == 0, r.stderr
        return [(rec["acceptance_length"], rec["bytes_fetched_per_token"]) for rec in json.loads(out.read_text())["records"]]

    assert outcome(0) == outcome(1)  # the tokens (hence acceptance and fetched bytes) are the seed's


def test_bench_takes_the_truncations_run_takes(tiny_model_dirs, tmp_path):
    """--top-k 1 makes sampling argmax: at temperature 0.9 the bench decodes the greedy tokens (same
    acceptance and bytes), which it does not without the flag; records name the truncation."""
    _, folder, _ = tiny_model_dirs["olmoe"]
    workload = os.path.join(os.path.dirname(__file__), "data", "prompts.jsonl")

    def outcome(i, *flags):
        out = tmp_path / f"t{i}.json"
        r = s2moe("bench", "-m", folder, "-w", workload, "--methods", "ca", "--budget", "0.5", "--n-prompts", "3",
                  "--max-tokens", "12", "--seed", "3", "--json", str(out), "--no-prefetch", *flags)
        assert r.returncode == 0, r.stderr
        rec = json.loads(out.read_text())["records"][0]
        return (rec["acceptance_length"], rec["bytes_fetched_per_token"]), rec

    greedy, _ = outcome(0)
    top1, rec = outcome(1, "-t", "0.9", "--top-k", "1", "--top-p", "0.9", "--min-p", "0.01")
    sampled, _ = outcome(2, "-t", "0.9")
    assert top1 == greedy and sampled != greedy
    assert (rec["temperature"], rec["top_k"], rec["top_p"], rec["min_p"]) == (0.9, 1, 0.9, 0.01)
    r = s2moe("bench", "-m", folder, "-w", workload, "--methods", "ar", "--n-prompts", "1", "--top-p", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--top-p" in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.parametrize("command", ["run", "bench"])
def test_no_rate_guard_reaches_the_decoder(command, tiny_model_dirs, tmp_path):
    """The guard runs with live costs (the default) and reports its counts; --no-rate-guard removes it."""
    _, folder, _ = tiny_model_dirs["olmoe"]
    workload = os.path.join(os.path.dirname(__file__), "data", "prompts.jsonl")

    def guard(*flags):
        if command == "run":
            r = s2moe("run", "-m", folder, "--prompt", "x y", "-n", "6", "-t", "0", "--json", *flags)
            assert r.returncode == 0, r.stderr
            return (json.loads(r.stdout)["stats"]["live_costs"] or {}).get("rate_guard")
        out = tmp_path / f"g{len(flags)}.json"
        r = s2moe("bench", "-m", folder, "-w", workload, "--methods", "s2moe", "--n-prompts", "1", "--max-tokens", "6",
                  "--json", str(out), *flags)
        assert r.returncode == 0, r.stderr
        return json.loads(out.read_text())["records"][0]["rate_guard"]

    on = guard()
    assert set(on) == {"holds", "held_steps", "probes", "kept_per_expected", "ms_per_token"}
    assert guard("--no-rate-guard") is None


def test_runtime_never_imports_torch_or_transformers():
    code = ("import sys\nfrom s2moe.runtime.cli import app\nimport s2moe.calib.cli\n"
            "from typer.testing import CliRunner\n"
            "r = CliRunner().invoke(app, ['run', '--prompt', 'def f(x):', '-n', '4', '--seed', '0'])\n"
            "assert r.exit_code == 0, r.output\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
