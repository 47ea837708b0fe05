import numpy as np
import pytest

from s2moe.runtime.model.routing import RoutingPolicy, route, softmax, top_k_indices


def test_top_k_ties_go_to_lower_expert_id():
    scores = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    assert top_k_indices(scores, 2).tolist() == [[1, 2], [0, 1]]
    assert top_k_indices(scores, 5)[1].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("rows", [200, 600])  # 3,200 scores: the stable-sort path; 9,600: argpartition + tie repair
def test_top_k_matches_full_sort_on_random_rows(rng, rows):
    scores = rng.normal(size=(rows, 16)).round(1)  # rounding makes ties common
    for k in (1, 2, 4, 8, 16):
        expected = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
        assert np.array_equal(top_k_indices(scores, k), expected)
    scores[rng.random(scores.shape) < 0.3] = np.nan  # NaN last, by id (a -inf score scaled: -inf - -inf)
    scores[:3] = np.nan
    for k in (1, 4, 8):
        assert np.array_equal(top_k_indices(scores, k), np.argsort(-scores, axis=-1, kind="stable")[:, :k])


@pytest.mark.parametrize("kind,norm", [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", True)])
def test_weights_follow_the_router_definition(kind, norm, rng):
    logits = rng.normal(size=(5, 8)).astype(np.float32)
    experts, weights = route(logits, 3, kind, norm)
    probs = softmax(logits.copy())
    picked = np.take_along_axis(probs, experts, -1)
    if kind == "topk_softmax" or norm:
        np.testing.assert_allclose(weights, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    else:
        np.testing.assert_allclose(weights, picked, rtol=1e-6)


def test_selection_bias_changes_choice_not_weights(rng):
    logits = rng.normal(size=(4, 8)).astype(np.float32)
    bias = np.zeros_like(logits)
    bias[:, 7] = 100.0  # force expert 7 in
    experts, weights = route(logits, 2, "softmax_topk", False, bias)
    assert (experts[:, 0] == 7).all()
    probs = softmax(logits.copy())
    np.testing.assert_allclose(weights, np.take_along_axis(probs, experts, -1), rtol=1e-6)


def test_policy_top_k_overrides():
    p = RoutingPolicy(top_k=2, layer_top_k={3: 1})
    assert p.k_for(0, 8) == 2 and p.k_for(3, 8) == 1 and RoutingPolicy().k_for(0, 8) == 8
