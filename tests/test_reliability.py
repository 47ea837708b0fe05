"""docs/reliability.md, row by row: each hostile input gets its documented outcome (the error, its
text and the exit code), asserted through the public entry points (`s2moe` commands run in-process,
`load_model`, `build_engine`). Rows tested elsewhere name their test in the document; GGUF
headers are in test_gguf_hostile.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import tracemalloc

import pytest

from s2moe.runtime.cli.errors import cli_errors
from s2moe.runtime.errors import ExpertReadError, KVCacheError, S2MoEError
from s2moe.runtime.model.loader import load_model

from helpers import one_line_error, s2moe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- safetensors headers --------------------------------------------------------------------------
def _safetensors_folder(tiny_model_dirs, tmp_path, header: bytes | dict, data: bytes = b"", length=None):
    """A model folder (a real config and tokenizer) whose only weights file has this header."""
    src = tiny_model_dirs["olmoe"][1]
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(src, name), folder / name)
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", n) + raw + data)
    return folder


F32x4 = {"dtype": "F32", "shape": [4]}
SAFETENSORS_CASES = {
    # row: header claiming 10¹² bytes (refused before reading or allocating it)
    "huge header length": (b"{}", b"", 10**12, "header claims 1000000000000 bytes"),
    "header longer than the file": (b"{}", b"", 1000, "header claims 1000 bytes"),
    # the 8 length bytes count too: a 2-byte header claimed as 5 in a 10-byte file runs 3 bytes past it
    "header past the end by less than 8": (b"{}", b"", 5, "header claims 5 bytes, file has 10"),
    "header not an object": (b"[1, 2]", b"", None, "safetensors header is not a JSON object"),
    # row: nested-JSON bomb (the parser's recursion limit becomes our error, not a crash)
    "nested JSON bomb": (b"[" * 200_000 + b"]" * 200_000, b"", None, "header is not valid JSON"),
    # row: non-integer shapes / offsets
    "float shape": ({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 10]}}, bytes(16), None,
                    "tensor w: malformed header entry"),
    "string offsets": ({"w": {**F32x4, "data_offsets": ["0", "16"]}}, bytes(16), None, "tensor w: malformed header entry"),
    "bool shape": ({"w": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}}, bytes(16), None,
                   "tensor w: malformed header entry"),
    # row: overlapping tensors
    "overlap": ({"a": {**F32x4, "data_offsets": [0, 16]}, "b": {**F32x4, "data_offsets": [8, 24]}}, bytes(24), None,
                "tensors a and b overlap"),
    # row: unknown dtypes
    "unknown dtype": ({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), None,
                      "tensor w: unsupported dtype Q9"),
    # row: offsets that do not hold the shape, negative dimensions, data past the end of the file
    "offsets vs shape": ({"w": {**F32x4, "data_offsets": [0, 12]}}, bytes(16), None, "do not hold shape [4] of F32"),
    "negative dim": ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 0]}}, b"", None, "negative dimension"),
    "past the end": ({"w": {**F32x4, "data_offsets": [0, 16]}}, bytes(8), None, "truncated: tensor w ends at byte"),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_hostile_safetensors_header_is_one_line_exit_2(tiny_model_dirs, tmp_path, case):
    header, data, length, needle = SAFETENSORS_CASES[case]
    folder = _safetensors_folder(tiny_model_dirs, tmp_path, header, data, length)
    code, _, stderr = s2moe("info", "--model", folder)
    one_line_error(code, stderr, needle, "model.safetensors")
    # refused while parsing the header: nothing allocated for what the header claims
    tracemalloc.start()
    try:
        with pytest.raises(S2MoEError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            load_model(str(folder))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_a_header_over_the_limit_is_refused_unread(tiny_model_dirs, tmp_path):
    """The spec's 100 MiB header limit holds even in a file long enough for the claim."""
    folder = _safetensors_folder(tiny_model_dirs, tmp_path, b"{}", length=(100 << 20) + 1)
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(101 << 20)  # sparse: long enough to hold what the header claims
    tracemalloc.start()
    try:
        with pytest.raises(S2MoEError, match="header claims 104857601 bytes"):
            load_model(str(folder))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def _sharded(tiny_model_dirs, tmp_path, weight_map) -> str:
    src = tiny_model_dirs["olmoe"][1]
    folder = tmp_path / "sharded"
    shutil.copytree(src, folder)
    os.rename(folder / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(folder)


@pytest.mark.parametrize("case", ["missing shard", "tensor not in its shard", "no weight_map"])
def test_bad_safetensors_index_is_one_line_exit_2(tiny_model_dirs, tmp_path, case):
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_model_dirs["olmoe"][1], "model.safetensors"), "np") as f:
        names = list(f.keys())
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    if case == "missing shard":
        weight_map[names[0]] = "model-00002-of-00002.safetensors"
        needle = "lists model-00002-of-00002.safetensors, which is missing from the folder"
    elif case == "tensor not in its shard":
        weight_map["model.layers.9.mlp.gate.weight"] = "model-00001-of-00002.safetensors"
        needle = "tensor model.layers.9.mlp.gate.weight is listed but not in model-00001-of-00002.safetensors"
    else:
        weight_map = None
        needle = "not a valid safetensors index"
    folder = _sharded(tiny_model_dirs, tmp_path, weight_map)
    code, _, stderr = s2moe("info", "--model", folder)
    one_line_error(code, stderr, needle, "model.safetensors.index.json")


def test_a_sharded_folder_loads(tiny_model_dirs, tmp_path):
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_model_dirs["olmoe"][1], "model.safetensors"), "np") as f:
        weight_map = {n: "model-00001-of-00002.safetensors" for n in f.keys()}
    code, stdout, stderr = s2moe("info", "--model", _sharded(tiny_model_dirs, tmp_path, weight_map), "--json")
    assert code == 0, stderr


# -- O_DIRECT refused -----------------------------------------------------------------------------
@pytest.mark.parametrize("run", ["first", "again"])  # "again": the note is not lost to the previous test
def test_o_direct_refused_falls_back_to_buffered_reads_and_says_so_once(tiny_model_dirs, monkeypatch, capsys, run):
    """A file system that refuses O_DIRECT (open fails with EINVAL, as on tmpfs): reads are
    buffered, give the same bytes, drop the pages they read with posix_fadvise(DONTNEED), are
    counted at their exact size against the budget, and one note on stderr says so, once, however
    many reads and stores follow. Run twice in one process: the warn-once memory is reset between
    tests (conftest.py), so the order of tests does not matter."""
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.decoding.generate import generate_ar

    folder = tiny_model_dirs["olmoe"][1]
    expected = generate_ar(build_engine(folder, "0.25", direct_io=False).model, [1, 2, 3], 6).tokens
    capsys.readouterr()
    real_open, real_fadvise, real_pread = os.open, getattr(os, "posix_fadvise", None), os.pread
    refused, dropped, dropped_ranges, read_ranges = [], [], set(), set()

    def open_refusing_direct(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    def pread(fd, nbytes, offset):
        read_ranges.add((fd, offset, nbytes))
        return real_pread(fd, nbytes, offset)

    def fadvise(fd, offset, length, advice):
        dropped.append(advice)
        dropped_ranges.add((fd, offset, length))
        if real_fadvise is not None:
            real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "O_DIRECT", getattr(os, "O_DIRECT", 0o40000), raising=False)
    monkeypatch.setattr(os, "open", open_refusing_direct)
    monkeypatch.setattr(os, "posix_fadvise", fadvise, raising=False)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "POSIX_FADV_DONTNEED", getattr(os, "POSIX_FADV_DONTNEED", 4), raising=False)
    for _ in range(2):  # two engines, two stores: still one note
        engine = build_engine(folder, "0.25")
        assert generate_ar(engine.model, [1, 2, 3], 6).tokens == expected
    assert refused
    assert dropped and set(dropped) == {os.POSIX_FADV_DONTNEED}
    assert dropped_ranges and dropped_ranges <= read_ranges  # the pages of what was read, no others
    # buffered reads hold exact buffers: the budget counts each expert at its bytes, not page-rounded
    held = engine.cache.held
    assert held and engine.cache.resident_bytes == sum(w.nbytes for w in held.values())
    refs = engine.cache.store.refs
    assert all(w.nbytes == refs[key].resident_bytes_for(False) for key, w in held.items())
    assert any(refs[key].resident_bytes_for(False) < refs[key].resident_bytes_for(True) for key in held)
    notes = [line for line in capsys.readouterr().err.splitlines() if "O_DIRECT refused" in line]
    assert len(notes) == 1 and "posix_fadvise(DONTNEED)" in notes[0], notes


# -- the model file replaced while running --------------------------------------------------------
def test_model_file_replaced_keeps_reading_the_original(tiny_model_dirs, tmp_path):
    """A new file renamed over the model (a new inode) does not change a running engine: its
    descriptor still reads the original, so output stays that of the model loaded."""
    import tiny_models as tm

    from s2moe.runtime.decoding.generate import generate_ar
    from s2moe.runtime.engine import build_engine

    folder = shutil.copytree(tiny_model_dirs["olmoe"][1], tmp_path / "m")
    other = tm.save(tm.build("olmoe", seed=1), tmp_path / "other", fused=False)
    engine = build_engine(str(folder), "0.25")
    before = generate_ar(engine.model, [7, 8, 9], 8).tokens
    os.replace(os.path.join(other, "model.safetensors"), folder / "model.safetensors")
    engine.cache.clear()  # every expert is read again, after the replacement
    assert generate_ar(engine.model, [7, 8, 9], 8).tokens == before
    fresh = build_engine(str(folder), "0.25")  # the new file really is another model
    assert generate_ar(fresh.model, [7, 8, 9], 8).tokens != before


# -- a profile made for another model -------------------------------------------------------------
def _profile(tmp_path, fingerprint=None, policy="warn") -> str:
    data = json.load(open(os.path.join(ROOT, "profiles", "orin-16g.json")))
    data.pop("published")
    data["source"] = "measured"
    data["budget"] = {"spec": "0.5"}
    data["hot_experts"] = {"gpu_experts": [[0, 1], [1, 2]]}
    data["model"]["fingerprint_policy"] = policy
    if fingerprint:
        data["model"]["fingerprint"] = fingerprint
    path = tmp_path / f"profile-{policy}-{bool(fingerprint)}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _run_with_profile(folder, profile):
    code, stdout, stderr = s2moe("run", "-m", folder, "-p", "def f", "-n", "3", "--json", "--profile", profile)
    return code, (json.loads(stdout)["stats"] if code == 0 else None), " ".join(stderr.split())


def test_profile_for_another_model_warns_once_and_ignores_its_hot_list(tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["olmoe"][1]
    code, stats, stderr = _run_with_profile(folder, _profile(tmp_path))
    assert code == 0, stderr
    assert stderr.count("was made for OLMoE-1B-7B, not this model") == 1
    assert "ignoring its hot-expert list" in stderr
    assert stats["cost_constants"]["source"].startswith("profile")  # its constants are used
    assert stats["cost_constants"]["t_ar"] == pytest.approx(0.1)  # orin-16g: T_AR 100 ms
    assert stats["offload"]["budget"] == "50% of expert bytes"  # and its settings
    assert stats["offload"]["cache"]["pinned"] == 0  # its hot list is not


def test_profile_for_this_model_pins_its_hot_list_without_warning(tiny_model_dirs, tmp_path):
    from s2moe.runtime.profile import model_fingerprint

    folder = tiny_model_dirs["olmoe"][1]
    profile = _profile(tmp_path, fingerprint=model_fingerprint(load_model(folder)))
    code, stats, stderr = _run_with_profile(folder, profile)
    assert code == 0, stderr
    assert "was made for" not in stderr
    assert stats["offload"]["cache"]["pinned"] == 2


def test_fingerprint_tells_models_apart(tiny_model_dirs, tmp_path):
    """Same config and tensor table, other weights: another fingerprint; a byte-identical copy: the
    same one."""
    import tiny_models as tm

    from s2moe.runtime.profile import model_fingerprint

    folder = tiny_model_dirs["olmoe"][1]
    copy = shutil.copytree(folder, tmp_path / "copy")
    other = tm.save(tm.build("olmoe", seed=1), tmp_path / "other", fused=False)
    mine = model_fingerprint(load_model(folder))
    assert model_fingerprint(load_model(str(copy))) == mine
    assert model_fingerprint(load_model(other)) != mine


def test_fingerprint_samples_past_the_first_mib_of_a_large_file(tmp_path):
    """Multi-GB files are sampled (the first MiB, then 64 KiB every 64 MiB), not hashed whole: two
    sparse 130 MiB files that differ only at 64 MiB + 10 bytes must get different fingerprints.
    (The suite's models are all under 64 MiB, where only the first MiB is read.)"""
    from types import SimpleNamespace

    from s2moe.runtime.profile import model_fingerprint

    def fake_model(name: str, poke: int | None, config=None):
        path = tmp_path / name
        with open(path, "wb") as f:
            f.truncate(130 << 20)
            if poke is not None:
                f.seek(poke)
                f.write(b"\x01")
        ref = SimpleNamespace(path=str(path), name="blk.0.ffn_up_exps.weight", dtype="F16", shape=(2,), nbytes=4)
        return SimpleNamespace(config=SimpleNamespace(to_dict=lambda: config or {"arch": "test"}),
                               experts={(0, 0): SimpleNamespace(refs=[ref])})

    base = model_fingerprint(fake_model("a.gguf", None))
    assert model_fingerprint(fake_model("b.gguf", None)) == base  # same bytes, another name: same model
    assert model_fingerprint(fake_model("c.gguf", (64 << 20) + 10)) != base
    assert model_fingerprint(fake_model("d.gguf", (128 << 20) + 10)) != base
    assert model_fingerprint(fake_model("e.gguf", (1 << 20) - 1)) != base  # the first MiB, to its last byte
    # same bytes, another config (a changed rms_norm_eps or rope changes every logit): another model
    assert model_fingerprint(fake_model("f.gguf", None, {"arch": "test", "rms_norm_eps": 1e-5})) != base


def test_a_profile_without_a_policy_for_another_model_only_warns(tiny_model_dirs, tmp_path):
    path = _profile(tmp_path)
    data = json.loads(open(path).read())
    del data["model"]["fingerprint_policy"]  # older profiles: warn, as documented
    open(path, "w").write(json.dumps(data))
    code, stats, stderr = _run_with_profile(tiny_model_dirs["olmoe"][1], path)
    assert code == 0, stderr
    assert stderr.count("was made for OLMoE-1B-7B, not this model") == 1 and stats["offload"]["cache"]["pinned"] == 0


def test_a_sharded_models_fingerprint_does_not_depend_on_the_process(tiny_model_dirs, tmp_path):
    """Shards hashed in name order: a profile made by one process matches the model in the next
    (a set's order changes with PYTHONHASHSEED)."""
    import subprocess
    import sys

    from safetensors.numpy import load_file, save_file

    folder = shutil.copytree(tiny_model_dirs["olmoe"][1], tmp_path / "sharded")
    tensors = load_file(str(folder / "model.safetensors"))
    os.remove(folder / "model.safetensors")
    names, weight_map = sorted(tensors), {}
    for i in range(4):
        shard = f"model-0000{i + 1}-of-00004.safetensors"
        save_file({n: tensors[n] for n in names[i::4]}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in names[i::4]})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code = ("import sys; from s2moe.runtime.model.loader import load_model; "
            "from s2moe.runtime.profile import model_fingerprint; print(model_fingerprint(load_model(sys.argv[1])))")
    prints = {subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": str(s)}).stdout for s in range(3)}
    assert len(prints) == 1


def test_profile_for_another_model_is_refused_when_it_says_so(tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["olmoe"][1]
    profile = _profile(tmp_path, policy="refuse")
    code, _, stderr = s2moe("run", "-m", folder, "-p", "def f", "-n", "3", "--profile", profile)
    one_line_error(code, stderr, os.path.basename(profile), "made for model OLMoE-1B-7B",
                   "run s2moe-calib profile for this model")


# -- the exit-code table --------------------------------------------------------------------------
@pytest.mark.parametrize("exc,code", [
    (S2MoEError("bad input"), 2), (KVCacheError("cannot roll back to 9"), 3),
    (ExpertReadError("model.safetensors: reading expert 3 of layer 1 failed"), 4), (KeyboardInterrupt(), 130),
])
def test_exit_codes(exc, code, capsys, monkeypatch):
    import typer

    monkeypatch.delenv("S2MOE_DEBUG", raising=False)
    with pytest.raises(typer.Exit) as info:
        with cli_errors():
            raise exc
    assert info.value.exit_code == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == (["error: interrupted"] if code == 130 else [f"error: {exc}"])


def test_interrupt_during_a_run_exits_130(tiny_model_dirs, monkeypatch):
    from s2moe.runtime.decoding import speculative

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(speculative.SpeculativeDecoder, "generate", interrupted)
    code, _, stderr = s2moe("run", "-m", tiny_model_dirs["olmoe"][1], "-p", "def f", "-n", "3")
    assert code == 130 and stderr.strip().splitlines()[-1] == "error: interrupted", stderr
    assert "Traceback" not in stderr


def test_every_documented_row_names_a_test_that_exists():
    """docs/reliability.md: every row names a test (or says 'by construction'), and each named
    test exists, so the table cannot silently lose its backing."""
    import re

    text = open(os.path.join(ROOT, "docs", "reliability.md"), encoding="utf-8").read()
    rows, table = [], None
    for line in text.splitlines():
        table = (table or line) if line.startswith("|") else None  # a table's first row is its header
        if table and table.startswith("| hostile") and not line.startswith(("| hostile", "|---")):
            rows.append(line)
    assert len(rows) >= 20
    tests_dir = os.path.join(ROOT, "tests")
    for row in rows:
        cell = row.rstrip("|").split("|")[-1].strip()
        refs = re.findall(r"(test_\w+\.py)(?:::(\w+))?", cell)
        assert refs, f"row without a test: {row}"
        for file, name in refs:
            source = open(os.path.join(tests_dir, file), encoding="utf-8").read()
            if name:
                assert re.search(rf"def {name}\b", source), f"{file}::{name} named in docs/reliability.md is missing"


def test_every_exit_code_is_documented():
    """The exit-code table of docs/reliability.md holds every code the error table can return."""
    import re

    from s2moe.runtime.cli.errors import ERROR_TABLE
    from s2moe.runtime.errors import S2MoEError

    text = open(os.path.join(ROOT, "docs", "reliability.md"), encoding="utf-8").read()
    documented = {int(c) for c in re.findall(r"^\| (\d+) \|", text, flags=re.M)}
    codes = {code for _, code, _ in ERROR_TABLE} | {130, 0, 1}
    codes |= {getattr(cls, "exit_code", 2) for cls in _subclasses(S2MoEError)}
    assert codes <= documented, f"undocumented exit codes {codes - documented}"


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


# -- budgets and hot-expert files through `s2moe run` ---------------------------------------------
@pytest.mark.parametrize("budget,needles", [
    ("lots", ["--budget"]), ("1.5", ["--budget"]), ("-1", ["--budget"]),
    ("10k", ["--budget", "below the dense part", "need at least"]),
])
def test_bad_budget_is_one_line_exit_2(tiny_model_dirs, budget, needles):
    code, _, stderr = s2moe("run", "-m", tiny_model_dirs["olmoe"][1], "-p", "def f", "-n", "2", "--budget", budget)
    one_line_error(code, stderr, *needles)


@pytest.mark.parametrize("entries,needle", [
    ([[0, 1], [0, 1]], "gpu_experts[1]: duplicate entry [0, 1]"),
    ([[0, 1], [0, 99]], "gpu_experts[1]: expert 99 out of range"),
    ([[5, 1]], "gpu_experts[0]: layer 5 is not a MoE layer"),
    ([[0, "a"]], "gpu_experts[0] = [0, 'a'] is not a [layer, expert] pair"),
])
def test_bad_hot_expert_file_names_file_and_entry(tiny_model_dirs, tmp_path, entries, needle):
    path = tmp_path / "hot.json"
    path.write_text(json.dumps({"gpu_experts": entries}))
    code, _, stderr = s2moe("run", "-m", tiny_model_dirs["olmoe"][1], "-p", "def f", "-n", "2", "--budget", "0.5",
                            "--hot-experts", path)
    one_line_error(code, stderr, str(path), needle)
