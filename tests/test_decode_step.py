"""A decode token's own paths through the forward pass (model/forward.py): its rotary tables kept
per position, its attention mask, and the sum of its experts. Each must give what the batch path
gives, bit for bit: a token's output may not depend on how many tokens shared its pass."""

from __future__ import annotations

import numpy as np

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.engine import build_engine
from s2moe.runtime.model import rope


def test_a_decode_tokens_expert_sum_is_the_batch_paths():
    model = build_engine(str(DEFAULT_MODEL)).model  # every expert resident: the batch path streams none
    c, rng = model.config, np.random.default_rng(11)
    for trial in range(40):
        L = trial % c.num_layers
        x = rng.standard_normal((1, c.hidden_size)).astype(np.float32) * rng.uniform(0.1, 10)
        experts = np.array([rng.permutation(c.num_experts)[:c.top_k]], np.int64)
        if trial % 5 == 0:
            experts[0, 1] = -1  # a dropped choice adds a zero row, as in the batch
        weights = rng.random((1, c.top_k)).astype(np.float32)
        one = model._experts(L, x, experts, weights)
        two = model._experts(L, np.repeat(x, 2, axis=0), np.repeat(experts, 2, axis=0), np.repeat(weights, 2, axis=0))
        assert one.shape == (1, c.hidden_size) and np.array_equal(one, two[:1]) and np.array_equal(one, two[1:]), trial


def test_a_decode_tokens_rotary_tables_are_kept_per_position_and_read_only():
    model = build_engine(str(DEFAULT_MODEL)).model
    for at in (0, 1, 17, 4095, 100_000):
        cos, sin = model._rope(np.array([at]))
        want = rope.tables(model._inv_freq, model._rope_factor, np.array([at]))
        assert np.array_equal(cos, want[0]) and np.array_equal(sin, want[1])
        assert model._rope(np.array([at]))[0] is cos and not cos.flags.writeable and not sin.flags.writeable
        batch = model._rope(np.array([at, at + 1]))  # a chain: computed, not kept
        assert np.array_equal(batch[0][:1], cos) and batch[0].flags.writeable
    for at in range(5000):  # bounded: a long generation does not grow it without end
        model._rope(np.array([at]))
    assert len(model._rope_one) <= 4096


def test_a_decode_tokens_mask_is_the_chains():
    model = build_engine(str(DEFAULT_MODEL)).model
    for start in (0, 1, 63, 300):
        pos = np.array([start])
        got = model._visibility(start, 1, pos, None, None)
        assert got.dtype == bool and np.array_equal(got, model._visibility(start, 1, pos, np.ones((1, 1), bool), None))
        windowed = model._visibility(start, 1, pos, None, 8)  # a sliding window still takes the full path
        assert windowed[0].sum() == min(start + 1, 8)
