"""KV cache types (model/kv_cache.py, csrc/cpu/attend.c): f32, f16 (the default of runs) and q8_0.

Rows are rounded once, when written: the C attention must write the bytes the NumPy path writes
(q8_0 as `gguf.quants`, llama.cpp's own reference, encodes it), read them back as it does, and the
memory plan must count exactly what the cache allocates."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.kernels import cpu
from s2moe.runtime.kernels.reference import ReferenceOps
from s2moe.runtime.model import rope
from s2moe.runtime.model.kv_cache import (CACHE_TYPES, KVCache, kv_bytes_per_position, q8_0_decode, q8_0_encode,
                                          resolve_cache_type)

TYPED = ("f16", "q8_0")


@pytest.fixture(params=["simd", "portable"])
def c_ops(request):
    from s2moe import _cpu

    if request.param == "simd" and not _cpu.use_simd(True):
        pytest.skip("this CPU has no AVX2+FMA+F16C: only the portable path exists here")
    _cpu.use_simd(request.param == "simd")
    yield cpu.CpuOps(threads=2)
    _cpu.use_simd(True)


def test_q8_0_rows_are_ggml_blocks_bit_for_bit(rng):
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    x = (rng.standard_normal((3, 7, 128)) * np.exp(rng.standard_normal((3, 7, 1)) * 3)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    raw = q8_0_encode(x)
    assert raw.shape == (3, 7, 4 * 34) and raw.dtype == np.uint8
    np.testing.assert_array_equal(raw, quants.quantize(x, Q.Q8_0).reshape(raw.shape))
    np.testing.assert_array_equal(q8_0_decode(raw), quants.dequantize(raw, Q.Q8_0).reshape(x.shape))


@pytest.mark.parametrize("cache_type", CACHE_TYPES)
@pytest.mark.parametrize("D,start", [(64, 9), (128, 300), (96, 40)])
def test_c_attention_writes_and_reads_each_type_as_the_reference(c_ops, cache_type, D, start, rng):
    """A 3-token verification after ``start`` cached positions (300: the thread pool): the C call
    writes V bit for bit as the NumPy path does (f16 rounding and q8_0 blocks in C), K within one
    rounding step (RoPE's float order differs), and attends over the stored rows as the reference
    attends over the decoded ones."""
    nh, nkv, T = 8, 2, 3
    q = rng.standard_normal((T, nh * D)).astype(np.float32)
    k = rng.standard_normal((T, nkv * D)).astype(np.float32)
    v = (rng.standard_normal((T, nkv * D)) * 3).astype(np.float32)
    cs = rope.tables(1.0 / 10000 ** (np.arange(0, D, 2) / D), 1.0, np.arange(start, start + T))
    allowed = np.ones((T, start + T), bool)
    allowed[:, start:] = np.tril(np.ones((T, T), bool))
    allowed[2, start + 1] = False
    kvs = [KVCache(1, nkv, D, start + 8, cache_type=cache_type) for _ in range(2)]
    kvs[0].write(0, 0, rng.standard_normal((nkv, start, D)).astype(np.float32),
                 rng.standard_normal((nkv, start, D)).astype(np.float32))
    kvs[1].keys[0][:], kvs[1].values[0][:] = kvs[0].keys[0], kvs[0].values[0]
    outs = [each.attend(q, k, v, kv, 0, start, cs, allowed, None, nh, nkv, D, D ** -0.5, False)
            for each, kv in zip((c_ops, ReferenceOps()), kvs)]
    err = np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max()
    assert err <= (1e-5 if cache_type == "f32" else 2e-3), err
    np.testing.assert_array_equal(kvs[0].values[0], kvs[1].values[0])  # the C rounding is NumPy's / ggml's
    step = {"f32": 1e-6, "f16": 2.0 ** -10, "q8_0": 1 / 127}[cache_type]
    keys = [kv.view(0, start + T)[0] for kv in kvs]
    assert np.abs(keys[0] - keys[1]).max() <= step * np.abs(keys[1]).max() * 1.01
    if cache_type == "f32":
        return
    exact = [ReferenceOps().attend(q, k, v, KVCache(1, nkv, D, start + 8), 0, start, cs, allowed, None, nh, nkv, D,
                                   D ** -0.5, False)]
    assert np.abs(outs[0] - exact[0]).max() > 0, "a rounded cache gave float32's bits: nothing was rounded"


def test_c_half_rounding_matches_numpy_at_the_edges(c_ops):
    """Values written through the C f16 path: subnormals, the largest half, the first value that
    overflows to infinity, ties to even, signed zeros."""
    specials = np.array([0.0, -0.0, 1e-8, -3e-6, 6.1e-5, 5.96e-8, 2.98e-8, 65504, 65519.9, 65520, -70000, 1e9,
                         1 + 2 ** -11, 1 + 3 * 2 ** -11, 0.1, -0.333333, 2049.0, 2051.0], np.float32)
    D, nkv = 32, 1
    v = np.resize(specials, D).astype(np.float32)[None]
    kv = KVCache(1, nkv, D, 4, cache_type="f16")
    cs = rope.tables(1.0 / 10000 ** (np.arange(0, D, 2) / D), 1.0, np.arange(0, 1))
    with np.errstate(all="ignore"):
        c_ops.attend(np.ones((1, D), np.float32), np.zeros((1, D), np.float32), v, kv, 0, 0, cs,
                     np.ones((1, 1), bool), None, 1, nkv, D, 1.0, False)
        want = v[0].astype(np.float16)  # (overflows to infinity on purpose)
    np.testing.assert_array_equal(kv.values[0][0, 0].view(np.uint16), want.view(np.uint16))


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory, tiny_tokenizer_json):
    from helpers import save_families

    return save_families(("deepseek_v2",), tmp_path_factory, tiny_tokenizer_json)["deepseek_v2"][1]


@pytest.mark.parametrize("cache_type", CACHE_TYPES)
def test_the_plans_kv_term_is_what_the_cache_allocates(cache_type, mla_dir):
    """For a GQA model (the embedded one) and an MLA one (tiny DeepSeek): plan bytes = allocation,
    per type; f16 is half of f32, q8_0 34/128 of it."""
    from types import SimpleNamespace

    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.offload.memory import Budget, plan_memory

    for path in (str(DEFAULT_MODEL), mla_dir):
        loaded = load_model(path, dense=False)
        c = loaded.config
        if cache_type == "q8_0" and any(w % 32 for w in c.kv_shape[1:]):
            continue  # the tiny MLA's 8-wide RoPE key holds no whole q8_0 block (DeepSeek's own below)
        plan = plan_memory(loaded, Budget.parse(None), 300, baseline=0, cache_type=cache_type)
        assert plan.kv_bytes == KVCache.for_config(c, 300, cache_type=cache_type).nbytes, (path, cache_type)
        f32 = plan_memory(loaded, Budget.parse(None), 300, baseline=0).kv_bytes
        assert plan.kv_bytes * {"f32": 1, "f16": 2, "q8_0": 128 / 34}[cache_type] == pytest.approx(f32)
    v2_lite = SimpleNamespace(num_layers=27, kv_shape=(1, 512, 64))  # DeepSeek-V2-Lite's latent and RoPE key
    assert kv_bytes_per_position(v2_lite, cache_type) * 10 == KVCache.for_config(v2_lite, 10, cache_type=cache_type).nbytes


def test_a_run_defaults_to_f16_and_plans_what_it_holds():
    from s2moe.runtime.engine import build_engine

    engine = build_engine(str(DEFAULT_MODEL), kv_positions=200)
    assert engine.model.cache_type == "f16" and engine.report()["kv_cache_type"] == "f16"
    kv = engine.model.new_cache(200)
    assert kv.keys[0].dtype == np.float16 and kv.nbytes == engine.plan.kv_bytes


@pytest.mark.parametrize("cache_type", TYPED)
def test_one_call_decode_gives_the_step_path_bits_for_each_type(cache_type):
    import test_decode_pass as tdp

    one, plain = tdp._run(True, "1.0", cache_type=cache_type), tdp._run(False, "1.0", cache_type=cache_type)
    tdp._same(one, plain, cache_type)
    assert all(reached == [4] for reached in one[3])


@pytest.mark.parametrize("cache_type", TYPED)
def test_greedy_speculation_equals_ar_with_a_rounded_cache(cache_type):
    """Draft and target read one cache; a rolled-back draft's positions are written again by the
    verification. Lossless S²-MoE must still give AR's tokens, on the C path and the NumPy one."""
    def tokens(method, kernels):
        r = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "run", "-p", "def fib(n):", "-n", "40", "-t", "0",
                            "--no-rg", "--method", method, "--cache-type", cache_type, "--kernels", kernels, "--json",
                            "--budget", "0.5"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["stats"]["offload"]["kv_cache_type"] == cache_type
        return out["tokens"]

    for kernels in ("cpu", "numpy"):
        assert tokens("s2moe", kernels) == tokens("ar", kernels), kernels


def test_q8_0_on_widths_without_whole_blocks_is_one_line(tiny_model_dirs):
    """The tiny Qwen3's 24-wide heads."""
    from s2moe.runtime.model.loader import load_model

    c = load_model(tiny_model_dirs["qwen3_moe"][1], dense=False).config
    assert resolve_cache_type("auto", c) == "f16"
    r = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "run", "-m", tiny_model_dirs["qwen3_moe"][1],
                        "-p", "def", "-n", "2", "--cache-type", "q8_0"], capture_output=True, text=True, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "q8_0" in lines[0] and "--cache-type f16" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_serve_caps_its_default_context_so_the_kv_takes_a_quarter(capsys):
    """`s2moe serve` without --ctx-size: the trained context, unless its KV would take more than a
    quarter of the memory the model may use; then the cap, in whole 256s, said in one line."""
    from s2moe.runtime.cli.serve import default_context
    from s2moe.runtime.model.loader import load_model

    loaded = load_model(str(DEFAULT_MODEL), dense=False)
    trained, per = loaded.config.max_position_embeddings, kv_bytes_per_position(loaded.config, "f16")
    assert default_context(loaded, "0.25", "f16") == trained  # a share: the KV comes on top
    assert default_context(loaded, str(4 * per * trained), "f16") == trained
    assert capsys.readouterr().err == ""
    room = 4 * per * 1000
    assert default_context(loaded, str(room), "f16") == 768
    assert default_context(loaded, str(room), "q8_0") == room // 4 // kv_bytes_per_position(loaded.config, "q8_0") // 256 * 256
    err = capsys.readouterr().err
    assert "context 768 of the model's" in err and "--ctx-size" in err
