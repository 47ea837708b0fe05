"""tools/widen_model.py: the zero-padded copy computes the embedded model's function, so it keeps
its tokens, routing and acceptance at the bytes of a wider MoE."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.model.forward import MoEModel
from s2moe.runtime.model.loader import load_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import widen_model  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("widened"))
    widen_model.widen(str(DEFAULT_MODEL), out, hidden=512, intermediate=224)  # 2× wider: quick to write
    return load_model(str(DEFAULT_MODEL)), load_model(out)


def test_widened_model_has_the_new_widths_and_says_what_it_is(pair):
    small, wide = pair
    c = wide.config
    assert (c.hidden_size, c.expert_intermediate_size) == (512, 224)
    assert c.num_heads * c.head_dim == small.config.num_heads * small.config.head_dim  # attention unchanged
    assert wide.experts[0, 0].stored_bytes == 3 * 512 * 224 * 2  # F16
    with open(os.path.join(wide.path, "config.json")) as f:
        assert json.load(f)["s2moe_widened_from"]["hidden_size"] == 256


def test_widened_model_routes_and_decodes_exactly_as_the_original(pair):
    small, wide = pair
    a, b = MoEModel(small), MoEModel(wide)
    rng = np.random.default_rng(7)
    for _ in range(3):
        ids = [int(t) for t in rng.integers(10, small.config.vocab_size, 24)]
        la, ra = a.forward(ids, a.new_cache(32))
        lb, rb = b.forward(ids, b.new_cache(32))
        for L in ra.layers:  # the router chooses the same experts, token by token (the order of two
            # near-equal scores may swap: compare the sets)
            np.testing.assert_array_equal(np.sort(ra.layers[L].experts, -1), np.sort(rb.layers[L].experts, -1))
        # float32 sums over more (zero) terms and the q/k norms' eps: measured ≤ 3e-5 on logits ≤ 14
        np.testing.assert_allclose(lb, la, atol=2e-4, rtol=0)
        assert generate_ar(a, ids[:8], 32).tokens == generate_ar(b, ids[:8], 32).tokens


@pytest.fixture(scope="module")
def real_shape(tmp_path_factory):
    """The real-shape construction (tools/widen_model.py --preset) at a size a test can write: 2× the
    experts (each split in two), 2× the layers (an identity copy before each trained layer), heads of
    64 (RoPE pairs moved to keep their frequencies), and the query/KV heads ungrouped."""
    out = str(tmp_path_factory.mktemp("real-shape"))
    widen_model.widen(str(DEFAULT_MODEL), out, hidden=512, intermediate=112, layers=8, experts=64, heads=8, head_dim=64)
    return load_model(str(DEFAULT_MODEL)), load_model(out)


def test_real_shape_widening_has_the_shape_and_names_its_trained_layers(real_shape):
    small, wide = real_shape
    c = wide.config
    assert (c.hidden_size, c.num_layers, c.num_experts, c.top_k) == (512, 8, 64, 8)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.expert_intermediate_size) == (8, 8, 64, 112)
    with open(os.path.join(wide.path, "config.json")) as f:
        made = json.load(f)["s2moe_widened_from"]
    assert made["trained_layers"] == [1, 3, 5, 7] and made["experts_per_trained_expert"] == 2
    assert os.path.exists(os.path.join(wide.path, "model.safetensors.index.json"))  # one shard a layer


def test_real_shape_widening_keeps_tokens_and_the_trained_layers_routing(real_shape):
    small, wide = real_shape
    a, b = MoEModel(small), MoEModel(wide)
    rng = np.random.default_rng(11)
    for _ in range(3):
        ids = [int(t) for t in rng.integers(10, small.config.vocab_size, 24)]
        la, ra = a.forward(ids, a.new_cache(32))
        lb, rb = b.forward(ids, b.new_cache(32))
        for i in range(small.config.num_layers):  # trained layer i is layer 2i + 1; expert e is parts 2e, 2e + 1
            parts = np.sort(rb.layers[2 * i + 1].experts, -1)
            np.testing.assert_array_equal(parts // 2, np.repeat(np.sort(ra.layers[i].experts, -1), 2, -1))
            np.testing.assert_array_equal(parts % 2, np.tile([0, 1], parts.shape[-1] // 2)[None].repeat(len(ids), 0))
        np.testing.assert_allclose(lb, la, atol=2e-4, rtol=0)  # measured ≤ 5e-6 on logits ≤ 11
        assert generate_ar(a, ids[:8], 32).tokens == generate_ar(b, ids[:8], 32).tokens


def test_real_shape_widening_as_q8_0_gguf_keeps_the_first_tokens(real_shape):
    small, wide = real_shape
    (path,) = widen_model.export(wide.path, ["Q8_0"], None)
    assert path == os.path.normpath(wide.path) + "-q8_0.gguf"
    with pytest.raises(SystemExit, match="llama-quantize"):  # a mix needs llama.cpp's tool
        widen_model.export(wide.path, ["Q4_K_M"], None)
    a, q = MoEModel(small), MoEModel(load_model(path))
    same = total = 0
    for seed in range(4):
        ids = [int(t) for t in np.random.default_rng(seed).integers(10, small.config.vocab_size, 8)]
        x, y = generate_ar(a, ids, 32).tokens, generate_ar(q, ids, 32).tokens
        assert x[:16] == y[:16], seed  # measured: all 32 identical on 5 of 5 prompts
        same, total = same + sum(u == v for u, v in zip(x, y)), total + len(x)
    assert same >= 0.9 * total
