"""A nested-JSON bomb in any JSON file a user hands s2moe is that file's one-line error, exit 2.

Python's json parser recurses once per nesting level, so 200,000 ``[`` raise RecursionError, which
is not a ValueError: each reader's "not valid JSON" branch missed it and the user got a traceback
(config.json, the shard index, profiles, hot lists, traces, pass logs, samples, workloads,
tokenizer.json in convert). `runtime/jsonfile.py` makes it a ValueError; these tests drive every
reader through its command, in-process (an exception the CLI's error table does not handle
fails the test as itself)."""

from __future__ import annotations

import os
import shutil

import pytest

from s2moe.calib.cli import app as calib_app
from s2moe.runtime.cli import app
from s2moe.runtime.cli.common import DEFAULT_MODEL

from helpers import invoke, one_line_error

BOMB = "[" * 200_000 + "]" * 200_000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "profiles", "orin-16g.json")


def _model_copy(tiny_model_dirs, tmp_path, replace: str) -> str:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["olmoe"][1], folder)
    (folder / replace).write_text(BOMB)
    return str(folder)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_bomb_in_a_model_folder(tiny_model_dirs, tmp_path, name):
    folder = _model_copy(tiny_model_dirs, tmp_path, name)
    code, _, stderr = invoke(app, "info", "--model", folder)
    one_line_error(code, stderr, name)


def test_a_bomb_in_generation_config_is_no_sampling_defaults(tiny_model_dirs, tmp_path):
    folder = _model_copy(tiny_model_dirs, tmp_path, "generation_config.json")  # optional: read as absent
    code, _, stderr = invoke(app, "info", "--model", folder)
    assert code == 0, stderr


def test_a_bomb_as_tokenizer_json_in_convert(tiny_model_dirs, tmp_path):
    folder = _model_copy(tiny_model_dirs, tmp_path, "tokenizer.json")
    out = tmp_path / "m.gguf"
    code, _, stderr = invoke(app, "convert", "--model", folder, "--out", out)
    one_line_error(code, stderr, "tokenizer.json", "not a readable")
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--profile", "--hot-experts"])
def test_a_bomb_as_a_runs_input_file(tmp_path, flag):
    bomb = tmp_path / "bomb.json"
    bomb.write_text(BOMB)
    code, _, stderr = invoke(app, "run", "--model", DEFAULT_MODEL, "-p", "def f", "-n", "1", "--method", "ar", flag, bomb)
    one_line_error(code, stderr, str(bomb), "not valid JSON")


def test_a_bomb_in_a_workload(tmp_path):
    bomb = tmp_path / "bomb.jsonl"
    bomb.write_text('{"prompt": "def f"}\n' + BOMB + "\n")
    code, _, stderr = invoke(app, "bench", "--model", DEFAULT_MODEL, "-w", bomb, "--methods", "ar", "--n-prompts", "1",
                          "--max-tokens", "2")
    one_line_error(code, stderr, f"{bomb}:2", "not valid JSON")


@pytest.mark.parametrize("command", ["predict", "update", "fit"])
def test_a_bomb_in_a_calib_input(tmp_path, command):
    bomb = tmp_path / "bomb.samples.json"
    bomb.write_text(BOMB)
    if command == "predict":
        args = ("predict", "--trace", bomb, "--profile", PRESET)
    elif command == "update":
        profile = tmp_path / "p.json"
        shutil.copy(PRESET, profile)
        args = ("profile", "--update", profile, "--passes", bomb)
    else:
        args = ("fit", bomb)
    code, _, stderr = invoke(calib_app, *args)
    one_line_error(code, stderr, str(bomb))


def test_a_bomb_as_tokenizer_config_of_the_server(tmp_path):
    from s2moe.runtime.errors import UsageError
    from s2moe.runtime.serve.chat import load_chat_template

    (tmp_path / "tokenizer_config.json").write_text(BOMB)
    with pytest.raises(UsageError, match="tokenizer_config.json: not readable JSON"):
        load_chat_template(str(tmp_path))


def test_a_bomb_as_the_samples_file_to_resume(tmp_path):
    (tmp_path / "p.samples.json").write_text(BOMB)
    code, _, stderr = invoke(calib_app, "profile", "--device", "cpu", "--out", tmp_path / "p.json", "--resume")
    one_line_error(code, stderr, "p.samples.json", "nothing to resume")
    assert not (tmp_path / "p.json").exists()
