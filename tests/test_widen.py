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
