import numpy as np
import pytest

from s2moe.runtime.errors import UsageError
from s2moe.runtime.decoding.sampling import SamplingParams, probabilities, sample


def test_temperature_zero_is_argmax(rng):
    logits = rng.normal(size=50)
    assert sample(logits, SamplingParams(), rng) == int(np.argmax(logits))


def test_truncations():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.2))  # keeps p >= 0.1
    np.testing.assert_allclose(p, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


def test_sampling_follows_the_distribution():
    # seeds are the decoders' business: test_sampled_speculation.py::test_same_seed_same_tokens_different_seeds_differ
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [sample(logits, params, np.random.default_rng(i)) for i in range(3000)]
    freq = np.bincount(draws, minlength=3) / 3000
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)


def test_temperature_scales_the_logits():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    for t in (0.5, 2.0):
        p = probabilities(logits, SamplingParams(temperature=t))
        expected = np.array([0.6, 0.3, 0.1]) ** (1 / t)
        np.testing.assert_allclose(p, expected / expected.sum(), rtol=1e-12)


def test_truncations_combine_and_keep_ties():
    p = np.array([0.4, 0.2, 0.2, 0.1, 0.1])
    logits = np.log(p)
    # top-k 2 with a tie at the 2nd place keeps both tied tokens (no arbitrary pick between them)
    np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=1.0, top_k=2)), [.5, .25, .25, 0, 0])
    # top-p 0.6 keeps the smallest prefix reaching 0.6: 0.4 + 0.2 (the first of the tied pair)
    np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=1.0, top_p=0.6)), [2 / 3, 1 / 3, 0, 0, 0])
    # min-p 0.5 keeps p ≥ 0.2; with top-k 4 as well, both apply
    np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=1.0, min_p=0.5, top_k=4)),
                               [.5, .25, .25, 0, 0])


def test_large_logits_at_low_temperature_stay_finite():
    # logits / T of 800 overflow exp() unless the maximum is subtracted first (real models at
    # T = 0.05 reach such values); the result must be the exact law, not NaN
    logits = np.array([40.0, 39.9, 0.0])
    p = probabilities(logits, SamplingParams(temperature=0.05))
    e = np.exp(np.array([0.0, -2.0, -800.0]))
    np.testing.assert_allclose(p, e / e.sum(), rtol=1e-12)


def test_top_k_one_is_argmax_sampling():
    logits = np.log(np.array([0.3, 0.5, 0.2]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=1))
    np.testing.assert_array_equal(p, [0, 1, 0])


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(min_p=1.0), dict(top_k=-1)])
def test_bad_params_raise_usage_error(kw):
    with pytest.raises(UsageError):
        SamplingParams(**kw)
