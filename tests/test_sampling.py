import numpy as np
import pytest

from s2moe.runtime.errors import UsageError
from s2moe.runtime.decoding.sampling import CoupledDraws, SamplingParams, StandardDraws, probabilities, sample


def test_temperature_zero_is_argmax(rng):
    logits = rng.normal(size=50)
    for draws in (StandardDraws(0), CoupledDraws(0)):
        assert sample(logits, SamplingParams(), draws, 3) == int(np.argmax(logits))


def test_truncations():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.2))  # keeps p >= 0.1
    np.testing.assert_allclose(p, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


@pytest.mark.parametrize("kind", ["standard", "coupled"])
def test_sampling_follows_the_distribution(kind):
    """3000 draws (one generator's, or one seed's 3000 positions) have the law p: ±3.3 sd."""
    # seeds are the decoders' business: test_sampled_speculation.py::test_same_seed_same_tokens_different_seeds_differ
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, seed=7)
    draws = StandardDraws(7) if kind == "standard" else CoupledDraws(7)
    tokens = [sample(logits, params, draws, j) for j in range(3000)]
    freq = np.bincount(tokens, minlength=3) / 3000
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)


def test_coupled_draws_depend_on_seed_and_position_only():
    """Position j's token does not depend on what was drawn before, or from which law: the target's
    draw at j is the same whether a draft drew at j first or not."""
    p = np.array([0.2, 0.3, 0.1, 0.4])
    q = np.array([0.5, 0.1, 0.3, 0.1])
    fresh = [CoupledDraws(3).token(p, j) for j in range(40)]
    busy = CoupledDraws(3)
    mixed = []
    for j in range(40):
        busy.token(q, j + 1), busy.token(q, j)  # a draft looking ahead, in either order
        mixed.append(busy.token(p, j))
        busy.forget_before(j)
    assert fresh == mixed
    assert fresh != [CoupledDraws(4).token(p, j) for j in range(40)]  # another seed, other tokens
    assert len(set(fresh)) == 4  # positions get independent noise (one shared g would repeat one token)


def test_coupled_noise_never_repeats_across_seeds_and_positions():
    """(seed, position) pairs that a naive [seed, position] entropy would alias: seed s + 2^32·j at
    position 0 and seed s at position j; and neighbours (s, j) vs (s + 1, j − 1)."""
    p = np.full(64, 1 / 64)

    def keys(seed, j):
        return CoupledDraws(seed).scores(p, j)

    for a, b in [((5 + (3 << 32), 0), (5, 3)), ((7, 4), (8, 3)), ((0, 1), (1, 0)), ((9, 0), (9, 1))]:
        assert not np.array_equal(keys(*a), keys(*b)), (a, b)
    assert np.array_equal(keys(5, 3), keys(5, 3))


def test_coupled_noise_is_exponential():
    """The race keys p / E need E ~ Exp(1) exactly (−log E is then Gumbel): a Kolmogorov–Smirnov
    test over 2000 positions × 50 tokens. E^0.95 (a 5 % temperature error) gives D ≈ 0.014, twice
    the critical value at α = 1e-4 (p ≈ 1e-16)."""
    from scipy import stats

    p = np.full(50, 1 / 50)
    draws = CoupledDraws(21)
    e = np.concatenate([p / draws.scores(p, j) for j in range(2000)])
    assert stats.kstest(e, "expon").pvalue > 1e-4


def test_coupled_without_a_seed_differs_between_runs():
    p = np.full(8, 1 / 8)
    runs = {tuple(CoupledDraws(None).token(p, j) for j in range(24)) for _ in range(3)}
    assert len(runs) == 3


def test_coupled_agreement_rate_is_the_gumbel_coupling_rate():
    """Draft and target agree at a position with probability Σ_i 1 / Σ_j max(p_j/p_i, q_j/q_i) (i wins
    both argmaxes iff g_i − g_j ≥ log max(p_j/p_i, q_j/q_i) for every j). Here (TV 0.5) that is 0.493,
    just below standard speculation's Σ min(p, q) = 0.5; independent draws would agree with Σ p·q = 0.2."""
    p = np.array([0.2, 0.3, 0.1, 0.4])
    q = np.array([0.5, 0.1, 0.3, 0.1])
    exact = sum(1 / np.maximum(p / p[i], q / q[i]).sum() for i in range(4))
    assert abs(exact - 0.4929) < 0.0001 and (1 - 0.5) / (1 + 0.5) <= exact <= 0.5  # the (1 − TV)/(1 + TV) bound
    n = 4000
    draws = CoupledDraws(11)
    agree = sum(draws.token(p, j) == draws.token(q, j) for j in range(n))
    assert abs(agree / n - exact) < 4 * np.sqrt(exact * (1 - exact) / n), (agree / n, exact)


@pytest.mark.parametrize("kw, coupled", [(dict(temperature=1.0, seed=0), True), (dict(temperature=1.0), False),
                                         (dict(temperature=1.0, sampler="coupled"), True),
                                         (dict(temperature=1.0, seed=0, sampler="standard"), False),
                                         (dict(temperature=0.0, seed=0, sampler="coupled"), False)])
def test_auto_sampler_is_coupled_when_a_seed_is_given(kw, coupled):
    assert SamplingParams(**kw).coupled is coupled


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


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(min_p=1.0), dict(top_k=-1),
                                dict(sampler="gumbel")])
def test_bad_params_raise_usage_error(kw):
    with pytest.raises(UsageError):
        SamplingParams(**kw)


def _nucleus_by_full_sort(p, top_p):
    """The reference: a stable sort of the whole vocabulary (what `probabilities` did before)."""
    order = np.argsort(-p, kind="stable")
    cutoff = np.searchsorted(np.cumsum(p[order]), top_p - 1e-12) + 1
    out = np.ones(p.size, dtype=bool)
    out[order[:cutoff]] = False
    return out


@pytest.mark.parametrize("first", [1, 3, 64])
def test_nucleus_without_a_full_sort_is_the_full_sorts_prefix(rng, first):
    """Flat and peaked laws, with ties at every place (logits rounded to a few levels), so the prefix
    often ends in a tie, across the doubling boundary, or needs the whole vocabulary."""
    from s2moe.runtime.decoding.sampling import nucleus_outside

    for case in range(400):
        n = int(rng.integers(1, 300))
        logits = rng.normal(size=n) * rng.choice([0.1, 1.0, 4.0])
        if case % 2:
            logits = np.round(logits * 2) / 2  # ties
        z = np.exp(logits - logits.max())
        p = z / z.sum()
        top_p = float(rng.choice([0.05, 0.5, 0.9, 0.95, 0.999, 1.0 - 1e-13]))
        np.testing.assert_array_equal(nucleus_outside(p, top_p, first=first), _nucleus_by_full_sort(p, top_p),
                                      err_msg=f"case {case}: n={n} top_p={top_p}")


def test_nucleus_keeps_the_first_index_of_a_tie_across_the_candidates_boundary():
    # 0.3, then five tokens at 0.14: top_p 0.5 needs two of the tied ones, the lowest indices (1, 2),
    # whatever the partial sort picked as its first candidates
    from s2moe.runtime.decoding.sampling import nucleus_outside

    p = np.array([0.3] + [0.14] * 5)
    for first in (1, 2, 3, 6):
        assert np.flatnonzero(~nucleus_outside(p, 0.5, first=first)).tolist() == [0, 1, 2]
