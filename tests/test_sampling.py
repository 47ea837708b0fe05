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


def test_sampling_follows_the_distribution_and_seed():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [sample(logits, params, np.random.default_rng(i)) for i in range(3000)]
    freq = np.bincount(draws, minlength=3) / 3000
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)
    a = [sample(logits, params, np.random.default_rng(7)) for _ in range(5)]
    assert len(set(a)) == 1


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(min_p=1.0), dict(top_k=-1)])
def test_bad_params_raise_usage_error(kw):
    with pytest.raises(UsageError):
        SamplingParams(**kw)
