"""The compiled kernels' SIMD paths against each other: a token's bits alone and inside a batch on
AVX2 and on the best path this CPU has (AVX-512 for plain rows, VNNI for int8 rows), and VNNI's
products against AVX2's. `test_kernels.py` holds every path to the NumPy reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from s2moe.runtime.kernels.reference import ReferenceOps
from test_kernels import REL, random_matrix, rel_err


@pytest.mark.parametrize("best", (1, 0), ids=("best", "avx2"))
@pytest.mark.parametrize("dtype", ("F32", "F16", "BF16", "Q8_0", "Q4_0"))
def test_one_tokens_products_give_the_same_bits_four_rows_at_a_time_and_in_a_batch(dtype, best, rng):
    """A token's row products must not depend on how they are scheduled: greedy speculation equals
    AR only if a verification batch's rows give each token the bits its own pass gives. One token
    takes rows four at a time (`_cpu.rows4`), a batch one row at a time; both, and the rows left
    over past a multiple of four, must give the same bits, beside the reference. So on AVX2, and
    so on the best path this CPU has: AVX-512 for plain rows (its sums differ from AVX2's by
    rounding), VNNI for int8 rows against int8 activations."""
    from s2moe import _cpu

    if not _cpu.use_simd(True):
        pytest.skip("this CPU has no AVX2+FMA+F16C: the portable path has no four-row form")
    plain = dtype in ("F32", "F16", "BF16")
    if best:
        if plain and not _cpu.use_avx512(1):
            assert not {"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags(), "the CPU lists AVX-512 (F, BW, VL), refused"
            pytest.skip("this CPU has no AVX-512 (F, BW, VL): the AVX2 case covers plain rows")
        if not plain and not _cpu.use_vnni(1):
            pytest.skip("this CPU or build has no VNNI: the AVX2 case covers int8 rows")
    else:
        assert not _cpu.use_avx512(0) and not _cpu.use_vnni(0)
    if plain:
        assert ("+avx512" in _cpu.path().replace("+avx512vnni", "")) == bool(best)
    # rows: whole fours, fours and a rest; K: whole groups of 32, groups + 8s + a scalar rest, masked
    # tails of AVX-512 (int8 rows are whole groups)
    Ks = (256, 112, 75, 1024, 17, 48) if plain else (256, 1024, 96, 32)
    try:
        for N, K in itertools.product((4, 64, 67, 6), Ks):
            W = random_matrix(rng, dtype, N, K)
            x = rng.standard_normal((5, K)).astype(np.float32)
            one = {}
            for on in (1, 0):
                assert _cpu.rows4(on) == bool(on)
                one[on] = np.empty((1, N), np.float32)
                _cpu.matmul(W.data, W.type_id, N, K, x[:1], one[on])
            assert np.array_equal(one[1], one[0]), (dtype, N, K)
            _cpu.rows4(1)
            for T in (2, 4, 5):  # the token inside a batch, with other tokens beside it
                batch = np.empty((T, N), np.float32)
                _cpu.matmul(W.data, W.type_id, N, K, x[:T], batch)
                assert np.array_equal(batch[:1], one[1]), (dtype, N, K, T)
                assert rel_err(batch, ReferenceOps().linear(x[:T], W)) <= REL, (dtype, N, K, T)
    finally:
        _cpu.rows4(1)
        _cpu.use_avx512(1)
        _cpu.use_vnni(1)


@pytest.mark.parametrize("form", [1, 2], ids=["avxvnni", "avx512vnni"])
@pytest.mark.parametrize("dtype", ("Q8_0", "Q4_0"))
def test_vnni_products_give_the_avx2_paths_bits(rng, dtype, form):
    """int8 rows against int8 activations: VNNI's one-step products (AVX-VNNI, or the EVEX form of
    AVX-512 VNNI) sum the same integers as AVX2's three steps, so the outputs are the same bits, at
    every token count (1..4 in a register block and the rest)."""
    from s2moe import _cpu

    name = {1: "+avxvnni", 2: "+avx512vnni"}[form]
    flags = _cpu_flags()
    has = {1: {"avx_vnni"}, 2: {"avx512_vnni", "avx512vl"}}[form] <= flags
    if not (_cpu.use_simd(True) and _cpu.vnni_built and (has or not flags)):
        pytest.skip(f"this CPU or build has no {name[1:]} (built: {bool(_cpu.vnni_built)}): another SIMD path serves it")
    chosen = _cpu.use_vnni(form)
    if chosen != form:
        _cpu.use_vnni(1)
        assert not flags, f"the CPU lists {sorted(has)} but use_vnni({form}) chose {chosen}"
        pytest.skip(f"this CPU has no {name[1:]} (no /proc/cpuinfo to say otherwise)")
    assert _cpu.path().endswith(name)
    try:
        for N, K, T in ((96, 1024, 1), (33, 64, 2), (7, 256, 3), (64, 512, 4), (40, 1024, 5), (17, 96, 9)):
            W = random_matrix(rng, dtype, N, K)
            x = (rng.standard_normal((T, K)) * rng.uniform(0.1, 10)).astype(np.float32)
            out = {}
            for vnni in (form, 0):
                assert _cpu.use_vnni(vnni) == vnni
                out[vnni] = np.empty((T, N), np.float32)
                _cpu.matmul(W.data, W.type_id, N, K, x, out[vnni])
            assert np.array_equal(out[form], out[0]), (N, K, T)
            assert rel_err(out[form], ReferenceOps().linear(x, W)) <= REL
        _cpu.use_vnni(0)  # a test's choice outlives a switch of the SIMD path
        _cpu.use_simd(False)
        _cpu.use_simd(True)
        assert not _cpu.path().endswith("vnni")
    finally:
        _cpu.use_simd(True)
        _cpu.use_vnni(1)


AMX_TYPES = ("Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K")


def test_amx_tiles_give_the_avx512_tiles_bits(rng):
    """A prompt's K-quant rows on AMX tiles (kquant_amx.c) sum the same integers as the AVX-512
    tiles and the one-token rows, and take the same float steps: the same bits at every token count
    from the threshold up (whole tiles of 16 and padded ones), for row counts and ranges that are
    not whole panels of 16, and at the reference's values. IQ4_XS (signed codes) keeps the AVX-512
    tiles, and a batch under the threshold too."""
    from s2moe import _cpu

    flags = _cpu_flags()
    if not (_cpu.use_simd(True) and _cpu.use_avx512(1) and _cpu.use_amx(1)):
        assert not ({"amx_int8", "amx_tile", "avx512_vnni"} <= flags and _cpu.amx_built), \
            "the CPU lists AMX-INT8 and this build has the tiles, yet use_amx(1) refused (did the OS deny the tile state?)"
        pytest.skip(f"this CPU, OS or build has no AMX-INT8 (built: {bool(_cpu.amx_built)}): the AVX-512 tiles serve it")
    try:
        for dtype in AMX_TYPES + ("IQ4_XS",):
            for N, K, T in ((42, 512, 70), (16, 256, 16), (5, 1024, 17), (33, 2048, 40)):
                W = random_matrix(rng, dtype, N, K)
                x = (rng.standard_normal((T, K)) * rng.uniform(0.1, 10)).astype(np.float32)
                x[T // 2, :256] *= 1000.0  # a loud super-block: its neighbours keep their scales
                out = {}
                for amx in (1, 0):
                    assert _cpu.use_amx(amx) == bool(amx)
                    out[amx] = np.empty((T, N), np.float32)
                    _cpu.matmul(W.data, W.type_id, N, K, x, out[amx])
                _cpu.use_amx(1)
                assert np.array_equal(out[1], out[0]), (dtype, N, K, T)
                assert rel_err(out[1], ReferenceOps().linear(x, W)) <= REL, (dtype, N, K, T)
                alone = np.empty((1, N), np.float32)
                _cpu.matmul(W.data, W.type_id, N, K, x[T - 1:].copy(), alone)
                assert np.array_equal(alone[0], out[1][T - 1]), (dtype, N, K, T)
                lo, hi = (3, N - 1) if N > 4 else (0, N)  # a row range that starts inside a panel
                part = np.empty((T, hi - lo), np.float32)
                _cpu.matmul(W.rows(slice(lo, hi)).data, W.type_id, hi - lo, K, x, part)
                assert np.array_equal(part, out[1][:, lo:hi]), (dtype, N, K, T)
        W = random_matrix(rng, "Q4_K", 24, 512)  # the threshold: 20 tokens take the tiles only from 20 up
        x = rng.standard_normal((20, 512)).astype(np.float32)
        got = {}
        for least in (21, 20):
            _cpu.use_amx(1, least)
            got[least] = np.empty((20, 24), np.float32)
            _cpu.matmul(W.data, W.type_id, 24, 512, x, got[least])
        assert np.array_equal(got[21], got[20])
    finally:
        _cpu.use_amx(1, 16)


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()
