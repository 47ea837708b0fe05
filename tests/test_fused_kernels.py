"""The fused decode kernels (csrc/decode.cuh through kernels/device.py), their CUDA source run on the
CPU stand-in (tests/fake_cupy.py), against the NumPy reference ops: every weight type they take,
norms, biases, residuals, input-major matrices, q/k norms, both RoPE layouts, sinks, cached
context and tree masks, batches of 1 to 16 tokens, and the reference path beyond their limits.
Block types are checked against the reference on the same stored blocks (gguf.quants decodes them)
with float activations: the kernels decode weights in registers and keep activations float32."""

from __future__ import annotations

import numpy as np
import pytest

import fake_cupy
from s2moe.runtime.kernels import ExpertAct
from s2moe.runtime.kernels import backend as B
from s2moe.runtime.kernels.device import MAX_HEAD_DIM, MAX_TOKENS, WEIGHT_TYPES, DeviceOps
from s2moe.runtime.kernels.reference import ReferenceOps
from s2moe.runtime.kernels.stored import StoredMatrix
from s2moe.runtime.model.attention import gqa, rms_norm
from s2moe.runtime.model.config import ModelConfig
from s2moe.runtime.model.kv_cache import KVCache
from s2moe.runtime.offload.experts import ExpertWeights
from test_kernels import random_matrix
from csrc_host import dequant, to_half

fake = fake_cupy.module
ref = ReferenceOps()
TOL = dict(rtol=1e-5, atol=2e-5)
BLOCK_TYPES = [t for t in WEIGHT_TYPES if t not in ("F32", "F16", "BF16")]
Q4_K_M = ("Q4_K", "Q4_K", "Q6_K")  # gate, up, down (and q, k, v) as a Q4_K_M file mixes them
MIXED = ("Q6_K", "Q8_0", "MXFP4")  # three types in one launch


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    monkeypatch.setenv("S2MOE_FLOAT_ACTIVATIONS", "1")  # the reference: dequantised blocks · float32 x


def _matrix(rng, dtype, rows, cols):
    return random_matrix(rng, dtype, rows, cols) if dtype in BLOCK_TYPES else StoredMatrix.from_float(
        rng.standard_normal((rows, cols)), dtype)


def _close(got, want, rel=1e-4):  # block types: the reference sums in another order
    assert np.abs(got - want).max() <= rel * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()


@pytest.fixture
def dev():
    return B.select_backend("cupy", module=fake)


def _launched(fn):
    names = []
    real = fake_cupy._Function.__call__

    def spy(self, *args, **kwargs):
        names.append(self.name)
        return real(self, *args, **kwargs)

    fake_cupy._Function.__call__ = spy
    try:
        return fn(), names
    finally:
        fake_cupy._Function.__call__ = real


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("T", [1, 5, MAX_TOKENS, MAX_TOKENS + 1])
def test_linear_norm_and_embed_equal_the_reference(dev, dtype, T):
    rng = np.random.default_rng(T)
    ops, up = DeviceOps(dev, "test"), dev.to_device
    x = rng.standard_normal((T, 48)).astype(np.float32)
    mats = [StoredMatrix.from_float(rng.standard_normal((n, 48)), dtype) for n in (32, 16, 16)]
    bias, res = rng.standard_normal(16).astype(np.float32), rng.standard_normal((T, 16)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, 48).astype(np.float32)
    got, names = _launched(lambda: ops.linear(up(x), up(mats[1]), up(bias), residual=up(res), norm=(up(norm), 1e-5)))
    np.testing.assert_allclose(fake.asnumpy(got), res + ref.linear(rms_norm(x, norm, 1e-5), mats[1], bias), **TOL)
    assert names == (["s2_linear"] if T <= MAX_TOKENS else ["s2_rms_norm"])  # beyond: norm kernel + cuBLAS
    both = ops.linear_parts(up(x), [(up(m), None) for m in mats])
    if T > MAX_TOKENS:
        assert both is None
    else:
        np.testing.assert_allclose(fake.asnumpy(both), np.concatenate([ref.linear(x, m) for m in mats], 1), **TOL)
    xn, y = ops.norm_linear(up(x), up(norm), 1e-5, up(np.asfortranarray(mats[0].dequantize())))  # input-major
    np.testing.assert_allclose(fake.asnumpy(xn), rms_norm(x, norm, 1e-5), **TOL)
    np.testing.assert_allclose(fake.asnumpy(y), rms_norm(x, norm, 1e-5) @ mats[0].dequantize().T, **TOL)
    ids = rng.integers(0, 32, T)
    np.testing.assert_array_equal(fake.asnumpy(ops.embed(up(mats[0]), up(ids))), ref.embed(mats[0], ids))


@pytest.mark.parametrize("dtype", list(WEIGHT_TYPES))
def test_the_device_decodes_every_block_as_gguf_does(dtype):
    rng = np.random.default_rng(3)
    m = _matrix(rng, dtype, 5, 512)
    np.testing.assert_array_equal(dequant(m.data, WEIGHT_TYPES[dtype], 5, 512), m.dequantize())


def test_the_device_rounds_to_half_as_numpy_does():  # the f16 KV cache's writes
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        np.float32([0, -0.0, 65504, 65519.99, 65520, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 2 ** -14,
                                    np.inf, -np.inf, np.nan, 1 + 2 ** -11, 1 + 3 * 2 ** -11])])  # the last: ties
    with np.errstate(all="ignore"):
        want = x.astype(np.float16)
    got = to_half(x)
    same = (got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), x[~same][:5]


@pytest.mark.parametrize("dtypes", [(t,) * 3 for t in BLOCK_TYPES] + [Q4_K_M, MIXED])
@pytest.mark.parametrize("T", [1, 7, MAX_TOKENS])
def test_linear_on_stored_blocks_equals_the_reference(dev, dtypes, T):
    rng = np.random.default_rng(T)
    ops, up = DeviceOps(dev, "test"), dev.to_device
    K = 512
    x = rng.standard_normal((T, K)).astype(np.float32)
    mats = [_matrix(rng, d, n, K) for d, n in zip(dtypes, (40, 8, 8))]
    norm = rng.uniform(0.5, 1.5, K).astype(np.float32)
    res = rng.standard_normal((T, 8)).astype(np.float32)
    (y, names) = _launched(lambda: ops.linear_parts(up(x), [(up(m), None) for m in mats], norm=(up(norm), 1e-5)))
    assert names == ["s2_linear"]  # q | k | v of mixed types: one launch
    xn = rms_norm(x, norm, 1e-5)
    _close(fake.asnumpy(y), np.concatenate([ref.linear(xn, m) for m in mats], 1))
    _close(fake.asnumpy(ops.linear(up(x), up(mats[2]), residual=up(res))), res + ref.linear(x, mats[2]))
    ids = rng.integers(0, 40, T)
    np.testing.assert_array_equal(fake.asnumpy(ops.embed(up(mats[0]), up(ids))), ref.embed(mats[0], ids))


@pytest.mark.parametrize("dtypes", [(t,) * 3 for t in WEIGHT_TYPES] + [Q4_K_M, MIXED])
def test_grouped_experts_equal_the_reference(dev, dtypes):
    rng = np.random.default_rng(1)
    ops, up = DeviceOps(dev, "test"), dev.to_device
    T, H, I = 6, 256, 1024  # down rows of 32 units: more than a warp's lanes
    x = rng.standard_normal((T, H)).astype(np.float32)
    base = rng.standard_normal((T, H)).astype(np.float32)
    host = [ExpertWeights(*(_matrix(rng, d, *s) for d, s in zip(dtypes, ((I, H), (I, H), (H, I))))) for _ in range(3)]
    group = [([0, 2, 3], [0.5, 0.25, 0.125]), ([2], [0.75]), ([0, 5], [0.3, 0.6])]  # token 1 and 4: no expert
    want = base.copy()
    ref.experts(x, [(w, np.array(ts), np.array(ws, np.float32)) for w, (ts, ws) in zip(host, group)],
                ExpertAct(), want)
    on_device = [dev.upload_expert(w) for w in host]
    for w in on_device:
        dev.wait(w)
    got, names = _launched(lambda: ops.experts_grouped(up(x), [(w, *g) for w, g in zip(on_device, group)], ExpertAct(),
                                                       up(base)))
    _close(fake.asnumpy(got), want)
    assert names == ["s2_experts_gate_up", "s2_experts_down"]
    for w, h in zip(on_device, host):  # resident on the device at their stored bytes
        assert sum(getattr(w, n).nbytes for n in ("gate", "up", "down")) == sum(
            getattr(h, n).data.nbytes for n in ("gate", "up", "down"))


@pytest.mark.parametrize("act", [ExpertAct(), ExpertAct("swiglu_clamped", 1.702, 7.0)])
def test_grouped_gpt_oss_experts_with_biases_equal_the_reference(dev, act):
    """GPT-OSS's experts: MXFP4 blocks, a bias on each projection, the clamped SwiGLU (the limit
    reached: pre-activations of several units) in the same two launches."""
    rng = np.random.default_rng(5)
    ops, up = DeviceOps(dev, "test"), dev.to_device
    T, H, I = 5, 288, 320  # GPT-OSS's rows (2880) are whole MXFP4 blocks, not whole super-blocks
    x = 3 * rng.standard_normal((T, H)).astype(np.float32)
    base = rng.standard_normal((T, H)).astype(np.float32)
    host = []
    for _ in range(2):
        mats = [StoredMatrix.from_float(rng.standard_normal(s) / 4, "MXFP4") for s in ((I, H), (I, H), (H, I))]
        bias = [rng.standard_normal(n).astype(np.float32) for n in (I, I, H)]
        host.append(ExpertWeights(*mats, *bias))
    group = [([0, 1, 4], [0.5, 0.25, 0.125]), ([1, 3], [0.75, 0.5])]
    want = base.copy()
    ref.experts(x, [(w, np.array(ts), np.array(ws, np.float32)) for w, (ts, ws) in zip(host, group)], act, want)
    on_device = [dev.upload_expert(w) for w in host]
    for w in on_device:
        dev.wait(w)
    got, names = _launched(lambda: ops.experts_grouped(up(x), [(w, *g) for w, g in zip(on_device, group)], act,
                                                       up(base)))
    assert names == ["s2_experts_gate_up", "s2_experts_down"]
    _close(fake.asnumpy(got), want)


def _config(qk_norm: str, interleave: bool, sinks: bool) -> ModelConfig:
    return ModelConfig(arch="test", vocab_size=64, hidden_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                       head_dim=16, num_experts=4, top_k=2, expert_intermediate_size=32, qk_norm=qk_norm,
                       rope_interleave=interleave, attention_sinks=sinks, attention_bias=sinks)


@pytest.mark.parametrize("qk_norm,interleave,sinks", [("none", False, False), ("full", False, False),
                                                      ("per_head", True, False), ("none", True, True)])
@pytest.mark.parametrize("start,T,tree", [(0, 1, False), (5, 1, False), (3, 7, True), (2, MAX_TOKENS, False),
                                          (3000, 9, True)])  # thousands of positions: split-K over 12 chunks
@pytest.mark.parametrize("chunk,cache", [(256, "f32"), (3, "f32"), (256, "f16")])  # 3: contexts longer than a
def test_attention_block_equals_the_reference(dev, monkeypatch, qk_norm, interleave, sinks, start, T, tree, chunk,
                                              cache):  # chunk, split over threads and merged
    from s2moe.runtime.kernels import device

    monkeypatch.setattr(device, "ATTEND_CHUNK", chunk)
    rng = np.random.default_rng(start * 31 + T)
    c = _config(qk_norm, interleave, sinks)
    ops, up = DeviceOps(dev, "test"), dev.to_device
    nh, nkv, D, Hd = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
    W = {"layers.0.q": rng.standard_normal((nh * D, Hd)) * 0.3, "layers.0.k": rng.standard_normal((nkv * D, Hd)) * 0.3,
         "layers.0.v": rng.standard_normal((nkv * D, Hd)) * 0.3, "layers.0.o": rng.standard_normal((Hd, nh * D)) * 0.1}
    W = {k: StoredMatrix.from_float(v, "F16") for k, v in W.items()}
    if qk_norm != "none":
        widths = (nh * D, nkv * D) if qk_norm == "full" else (D, D)
        W.update({f"layers.0.{n}_norm": rng.uniform(0.5, 1.5, w).astype(np.float32) for n, w in zip("qk", widths)})
    if sinks:
        W["layers.0.sinks"] = rng.standard_normal(nh).astype(np.float32)
        W.update({f"layers.0.{n}_bias": rng.standard_normal(m).astype(np.float32)
                  for n, m in (("q", nh * D), ("k", nkv * D), ("v", nkv * D), ("o", Hd))})
    h = rng.standard_normal((T, Hd)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, Hd).astype(np.float32)
    angles = np.outer(np.arange(start, start + T), 1.0 / 10000 ** (np.arange(0, D, 2) / D))
    cs = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
    allowed = np.ones((T, start + T), dtype=bool)
    allowed[:, start:] = np.tril(rng.random((T, T)) < 0.6) | np.eye(T, dtype=bool) if tree else np.tril(np.ones((T, T)))
    cap = max(32, start + T)
    kv_h, kv_d = KVCache(1, nkv, D, cap, cache_type=cache), KVCache(1, nkv, D, cap, xp=fake, cache_type=cache)
    context = rng.standard_normal((2, nkv, start, D)).astype(np.float32)
    for kv, put in ((kv_h, lambda a: a), (kv_d, up)):
        kv.begin_write(0, start + T)
        kv.write(0, 0, put(context[0]), put(context[1]))
    want = h + gqa(c, W, ref, 0, rms_norm(h, norm, c.rms_norm_eps), start, kv_h, cs, allowed)
    got, names = _launched(lambda: ops.gqa_block(c, {k: up(v) for k, v in W.items()}, 0, up(h), up(norm), start, kv_d,
                                                 tuple(map(up, cs)), up(allowed)))
    merge = ["s2_attend_merge"] if start + T > chunk else []
    assert names == ["s2_linear", "s2_qk_rope_kv", "s2_attend", *merge, "s2_linear"]
    # an f16 cache: a key whose float32 value differs in its last bit may round to the next half
    tol = TOL if cache == "f32" else dict(rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(fake.asnumpy(got), want, **tol)
    for cached, written in zip((kv_h.keys[0], kv_h.values[0]), (kv_d.keys[0], kv_d.values[0])):
        assert written.dtype == cached.dtype  # the kernel wrote the cache in its own type
        np.testing.assert_allclose(fake.asnumpy(written)[:, :start + T].astype(np.float32),
                                   cached[:, :start + T].astype(np.float32), **tol)


def test_attention_block_declines_what_it_does_not_take(dev):
    c = _config("none", False, False)
    ops = DeviceOps(dev, "test")
    h = fake.asarray(np.zeros((MAX_TOKENS + 1, 48), np.float32))
    assert ops.gqa_block(c, {}, 0, h, None, 0, None, None, None) is None  # a prefill chunk: cuBLAS
    clipped = ModelConfig(**{**c.__dict__, "clip_qkv": 8.0})
    assert ops.gqa_block(clipped, {}, 0, h[:1], None, 0, None, None, None) is None


def test_the_host_checks_the_limits_the_kernels_were_built_with():
    import re

    import s2moe.csrc

    src = (s2moe.csrc.SOURCE_DIR / "decode.cuh").read_text()
    limits = dict(re.findall(r"#define (S2_MAX_\w+) (\d+)", src))
    assert int(limits["S2_MAX_TOKENS"]) == MAX_TOKENS and int(limits["S2_MAX_HEAD_DIM"]) == MAX_HEAD_DIM
