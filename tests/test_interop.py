"""GGUF that llama.cpp reads: every family's export has the tensor shapes llama.cpp's loaders demand
(tests/llama_cpp_shapes.py, written down from its sources), the tokenizer names the pre-tokenizer
llama.cpp must split with, files respect the umask, and a grouped-query OLMoE (the default model)
goes out with its KV heads repeated and comes back as it was.

With a llama.cpp binary (S2MOE_LLAMA_CPP=/path/to/llama-completion, built by
`python benchmarks/peer.py --build`), the binary also loads every family's file and greedy-decodes
the default model's export to the same text as `s2moe run --temperature 0`.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import tiny_models as tm
from helpers import save_families
from llama_cpp_shapes import expected

from s2moe.runtime.model.formats.gguf_tokenizer import pre_tokenizer_name
from s2moe.runtime.model.formats.gguf_writer import write_gguf
from s2moe.runtime.model.loader import load_model
from s2moe.runtime.model.forward import MoEModel
from s2moe.runtime.offload.store import ExpertStore

ALL = tm.FAMILIES + tm.EXTRA_FAMILIES
LLAMA_CPP = os.environ.get("S2MOE_LLAMA_CPP")
needs_binary = pytest.mark.skipif(not LLAMA_CPP, reason="set S2MOE_LLAMA_CPP to a llama-completion binary "
                                  "(python benchmarks/peer.py --build) to run llama.cpp on our exports")


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_tokenizer_json):
    """family -> (per-expert folder, its F32 GGUF export with the tokenizer)."""
    out = {}
    for family, (_, folder, _) in save_families(ALL, tmp_path_factory, tiny_tokenizer_json).items():
        loaded = load_model(folder)
        path = str(tmp_path_factory.mktemp(family + "-gguf") / "m.gguf")
        write_gguf(loaded, path, ExpertStore(loaded).read, "F32", tokenizer_json=loaded.tokenizer_path)
        out[family] = (folder, path)
    return out


@pytest.mark.parametrize("family", ALL)
def test_export_has_the_shapes_llama_cpp_loads(exports, family):
    from gguf import GGUFReader

    reader = GGUFReader(exports[family][1])
    shapes, optional = expected(reader)
    found = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    missing = sorted(set(shapes) - set(found) - optional)
    assert not missing, f"llama.cpp requires {missing[:4]}"
    assert not sorted(set(found) - set(shapes)), "tensors llama.cpp would not load"
    wrong = {n: (found[n], shapes[n]) for n in found if found[n] != shapes[n]}
    assert not wrong, f"shape (found, llama.cpp's) {wrong}"


@pytest.mark.parametrize("family", ALL)
def test_export_reads_back_to_the_same_logits(exports, family, rng):
    """The llama.cpp-shaped file (repeated KV heads, split MLA k_b/v_b, permuted q/k) is the same
    function when s2moe reads it back."""
    folder, path = exports[family]
    ids = rng.integers(0, 380, 12)
    a, b = MoEModel(load_model(folder)), MoEModel(load_model(path))
    assert b.config.num_kv_heads == a.config.num_kv_heads
    la, _ = a.forward(ids, a.new_cache(16))
    lb, _ = b.forward(ids, b.new_cache(16))
    np.testing.assert_allclose(lb, la, atol=2e-5, rtol=0)


def test_grouped_query_olmoe_goes_out_repeated_and_says_so(exports):
    from gguf import GGUFReader

    folder, path = exports["olmoe"]
    c = load_model(folder).config
    assert c.num_kv_heads < c.num_heads, "the tiny OLMoE must be grouped-query for this test"
    fields = GGUFReader(path).fields
    assert fields["olmoe.attention.head_count_kv"].contents() == c.num_heads
    assert fields["s2moe.repeated_kv_heads_from"].contents() == c.num_kv_heads


def test_pre_tokenizer_named_from_tokenizer_json(tiny_tokenizer_json, exports):
    from gguf import GGUFReader

    with open(tiny_tokenizer_json) as f:
        spec = json.load(f)
    assert pre_tokenizer_name(spec) == "gpt-2"  # ByteLevel with its own regex
    assert GGUFReader(exports["olmoe"][1]).fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    from s2moe.runtime.model.formats.gguf_tokenizer import KNOWN_SPLITS

    for pattern, name in KNOWN_SPLITS.items():
        seq = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": pattern}},
                                                     {"type": "ByteLevel", "use_regex": False}]}
        assert pre_tokenizer_name({"pre_tokenizer": seq}) == name
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "Whitespace"}}) is None


def test_unknown_pre_tokenizer_warns(tmp_path, tiny_model_dirs, tiny_tokenizer_json, capsys):
    with open(tiny_tokenizer_json) as f:
        spec = json.load(f)
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\d+"}}, {"type": "ByteLevel", "use_regex": False}]}
    odd = tmp_path / "tokenizer.json"
    odd.write_text(json.dumps(spec))
    loaded = load_model(tiny_model_dirs["olmoe"][1])
    write_gguf(loaded, str(tmp_path / "m.gguf"), ExpertStore(loaded).read, "F16", tokenizer_json=str(odd))
    assert "pre-tokenizer matches none" in capsys.readouterr().err


def test_export_respects_the_umask(tmp_path, tiny_model_dirs):
    loaded = load_model(tiny_model_dirs["olmoe"][1])
    old = os.umask(0o022)
    try:
        write_gguf(loaded, str(tmp_path / "a.gguf"), ExpertStore(loaded).read, "F16")
        os.umask(0o077)
        write_gguf(loaded, str(tmp_path / "b.gguf"), ExpertStore(loaded).read, "F16")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "a.gguf").st_mode & 0o777 == 0o644
    assert os.stat(tmp_path / "b.gguf").st_mode & 0o777 == 0o600


@needs_binary
@pytest.mark.parametrize("family", ALL)
def test_llama_cpp_loads_every_family(exports, family):
    r = subprocess.run([LLAMA_CPP, "-m", exports[family][1], "-p", "def", "-n", "4", "--temp", "0", "-no-cnv",
                        "--simple-io", "-t", "2", "--no-warmup"], capture_output=True, text=True,
                       errors="replace", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@needs_binary
def test_llama_cpp_decodes_the_default_model_as_we_do(tmp_path):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.interop import compare, export

    gguf = str(tmp_path / "default.gguf")
    export(gguf, "F16")
    rows = compare(LLAMA_CPP, gguf, tokens=32)
    assert all(r["tokens"] == 32 for r in rows)
    # llama.cpp decodes 8 tokens more (its printed text may end a token early or late under load):
    # ours must be its beginning, all 32 tokens of it
    assert [r["llama.cpp"][:len(r["s2moe"])] for r in rows] == [r["s2moe"] for r in rows]
    assert all(r["equal"] for r in rows)


@pytest.mark.parametrize("preset", ["olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "deepseek-v2-lite"])
def test_real_shape_benchmark_files_are_what_llama_cpp_and_s2moe_load(preset, tmp_path, monkeypatch):
    """benchmarks/real_models.py, its presets scaled down (the real sizes are 4-26 GB, made by
    benchmarks only): llama.cpp's tensor shapes, the stored type kept (Q8_0 where a row is not
    whole blocks: GPT-OSS's width here is 288, as its real 2880, not whole super-blocks), each
    expert at its stored bytes, and a run that decodes."""
    import sys

    from gguf import GGUFReader

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks import real_models
    from helpers import s2moe
    from s2moe.runtime.kernels.stored import row_bytes

    small = dict(real_models.PRESETS[preset], hidden=288 if preset == "gpt-oss-20b" else 256, layers=2, experts=8,
                 ffn=256, vocab=6144, ctx=256, heads=4, head_dim=64)
    small["kv_heads"] = 4 if preset == "deepseek-v2-lite" else min(small["kv_heads"], 4)
    if preset == "deepseek-v2-lite":  # MLA: q/k heads of 32 + 32 (RoPE), a latent of 128, one dense layer
        small.update(kv_lora=128, rope_dim=32, v_dim=64, dense_ffn=512)
    monkeypatch.setitem(real_models.PRESETS, preset, small)
    H, I = small["hidden"], small["ffn"]
    for kind in ("Q4_K", "Q6_K", "IQ4_XS", "Q4_0") + (("MXFP4",) if preset == "gpt-oss-20b" else ()):
        path = str(tmp_path / f"{kind}.gguf")
        real_models.write(preset, kind, path)
        reader = GGUFReader(path)
        shapes, optional = expected(reader)
        found = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
        assert not sorted(set(shapes) - set(found) - optional) and found == {n: shapes[n] for n in found}, kind
        g = load_model(path)
        expert = g.experts[(1, 3)]
        want = real_models.stored_type(kind, "expert", H)
        # (page-aligned tensors: an expert of whole pages is held at its stored size, as at real
        # sizes; one of blocks that end inside a page takes at most a page more per part: GPT-OSS's
        # biases are parts too)
        whole = all(n * row_bytes(want, k) % 4096 == 0 for n, k in ((I, H), (I, H), (H, I))) and len(expert.parts) == 3
        pages = 0 if whole else len(expert.parts) * 4096
        assert expert.storage_type == want and 0 <= expert.resident_bytes - expert.stored_bytes < pages + 1, kind
        assert g.without_kernel() == {}
    code, out, err = s2moe("run", "--model", path, "--prompt", "hi", "-n", "4", "--method", "ar", "--json",
                           "--ignore-eos", "--temperature", "0")
    assert code == 0 and json.loads(out)["stats"]["generated_tokens"] == 4, err
