"""`--model org/name[@revision]`: Hugging Face ids resolve through huggingface_hub from a fake
cache folder in the library's own layout (models--org--name/{refs,snapshots}). Nothing downloads:
every command runs with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.model import hub

MAIN, TAGGED = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def fake_cache(tmp_path_factory):
    """acme/tiny-moe with `main` and tag `v1`, each a snapshot holding the default model's files."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / "models--acme--tiny-moe"
    for ref, commit in (("main", MAIN), ("v1", TAGGED)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in os.listdir(DEFAULT_MODEL):
            if os.path.isfile(DEFAULT_MODEL / f):
                shutil.copy(DEFAULT_MODEL / f, snap / f)
    return cache


def _cli(args, cache, **env):
    full = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", *args], capture_output=True, text=True,
                          env=full, timeout=300)


def test_ids_and_paths_are_told_apart(tmp_path, monkeypatch):
    assert hub.parse_id("allenai/OLMoE-1B-7B-0924") == ("allenai/OLMoE-1B-7B-0924", None)
    assert hub.parse_id("acme/tiny-moe@v1") == ("acme/tiny-moe", "v1")
    assert hub.parse_id("model.gguf") is None and hub.parse_id("./acme/x") is None
    assert hub.parse_id("a/b/c") is None  # a path, left to the loader's own message
    (tmp_path / "acme" / "local").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.parse_id("acme/local") is None  # an existing folder is a path, never an id


@pytest.mark.parametrize("ref, commit", [("", MAIN), ("@v1", TAGGED), ("@" + TAGGED, TAGGED)])
def test_hub_id_resolves_from_the_cache_offline(fake_cache, ref, commit):
    r = _cli(["info", "--model", "acme/tiny-moe" + ref, "--json"], fake_cache)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["path"].endswith(os.path.join("snapshots", commit))


def test_hub_id_runs(fake_cache):
    r = _cli(["run", "--model", "acme/tiny-moe", "-p", "def add(a, b):", "-n", "4", "-t", "0", "--json"], fake_cache)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 4


@pytest.mark.parametrize("model", ["acme/missing", "acme/tiny-moe@nope"])
def test_missing_id_is_one_line_naming_the_cache(fake_cache, model):
    r = _cli(["info", "--model", model], fake_cache)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(fake_cache) in lines[0] and "HF_HUB_OFFLINE=1" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
