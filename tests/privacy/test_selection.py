"""The number of trials of a private search and the search's ε (Papernot & Steinke 2022, dp-accounting)."""

import math

import dp_accounting
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp_module
from scipy import stats

from pl_dp.errors import PrivacyConfigError
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.selection import POISSON, SecretCoin, TrialCount, search_epsilon, truncated_negative_binomial_mean

SHAPES = [0.0, 0.5, 1.0, 3.0, POISSON]
HISTORY = [[1.1, 0.05, 120], [1.3, 0.04, 30]]


def _independent_epsilon(history, mean, shape, delta):
    """dp-accounting alone: the trial as Poisson-subsampled Gaussian steps, repeated and selected, RDP."""
    steps = [
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), n)
        for sigma, q, n in history
    ]
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_event.RepeatAndSelectDpEvent(dp_event.ComposedDpEvent(steps), mean, shape))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("shape", [0.0, 1.0, POISSON])
def test_the_reported_epsilon_is_dp_accountings_repeat_and_select(shape):
    """The ε a search's released checkpoint reports is dp-accounting's RepeatAndSelectDpEvent of the trial's event,
    and more than one trial's ε (the search costs privacy)."""
    delta = 1e-5
    expected = _independent_epsilon(HISTORY, 4.0, shape, delta)
    assert search_epsilon(HISTORY, TrialCount(mean=4.0, shape=shape), delta) == pytest.approx(expected, rel=1e-12)
    state = {
        "method": "DPSGD",
        "privacy": {"epsilon": 3.0},
        "accountant": {"mechanism": "rdp", "history": HISTORY},
        "delta": delta,
        "search": {"mean": 4.0, "shape": shape, "metric": "val/acc", "score": 0.9, "candidate": {"lr": 0.1}},
    }
    report = PrivacyReport.from_state(state)
    assert report.epsilon == pytest.approx(expected, rel=1e-12)
    assert report.trial_epsilon == pytest.approx(PrivacyReport.from_state(state | {"search": None}).epsilon)
    assert report.epsilon > report.trial_epsilon
    text = str(report)
    assert f"({report.epsilon:.4g}, {delta:.3g})-DP" in text and "RepeatAndSelectDpEvent" in text
    assert "how many trials ran" in text  # the working state is named as not protected


def test_a_release_trained_on_after_the_search_composes_the_steps_since():
    """A checkpoint of the released model trained further: ε composes the search with the model's whole history (it
    holds the later steps), never the search alone."""
    count, delta = TrialCount(mean=4.0, shape=1.0), 1e-5
    search = {"mean": 4.0, "shape": 1.0, "metric": "val/acc", "score": 0.9, "candidate": {"lr": 0.1}}
    later = [[1.1, 0.05, 150]]
    state = {
        "method": "DPSGD",
        "privacy": {"epsilon": 3.0},
        "accountant": {"mechanism": "rdp", "history": later},
        "delta": delta,
        "private_steps": 150,
        "search": search | {"history": [[1.1, 0.05, 120]]},
    }
    report = PrivacyReport.from_state(state)
    assert report.epsilon == pytest.approx(search_epsilon([[1.1, 0.05, 120]], count, delta, then=later), rel=1e-12)
    assert report.epsilon > search_epsilon([[1.1, 0.05, 120]], count, delta)
    assert "30 private steps after the search" in str(report)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_distribution_sums_to_one_and_its_mean_is_at_most_the_accounted_one(shape):
    count = TrialCount(mean=4.0, shape=shape)
    support = range(0, 400)
    assert math.fsum(count.probability(k) for k in support) == pytest.approx(1.0, abs=1e-12)
    mean = math.fsum(k * count.probability(k) for k in support)
    assert mean <= 4.0 * (1 + 1e-12) and mean == pytest.approx(4.0, rel=1e-8)
    if not count.is_poisson:  # the γ drawn is at least the γ dp-accounting accounts (Theorem 2 grows with log 1/γ)
        assert count.gamma >= rdp_module._gamma_truncated_negative_binomial(shape, 4.0)
        assert truncated_negative_binomial_mean(count.gamma, shape) == pytest.approx(
            rdp_module._truncated_negative_binomial_mean(count.gamma, shape), rel=1e-12
        )
    for k in (1, 3, 10):
        assert count.survival(k) == pytest.approx(1 - math.fsum(count.probability(j) for j in range(k)), abs=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_drawing_one_more_trial_at_a_time_gives_the_distribution(shape):
    """Going on after each trial with P[K > k | K ≥ k] gives K its distribution (chi-square over 20,000 searches
    with a fixed seed): the search draws K this way and never whole."""
    count, coin = TrialCount(mean=3.0, shape=shape), SecretCoin(seed=7)
    draws = []
    for _ in range(20_000):
        finished = 0
        while coin.one_more(count, finished):
            finished += 1
        draws.append(finished)
    cells = list(range(0 if count.is_poisson else 1, 9))
    observed = [draws.count(k) for k in cells] + [sum(k > cells[-1] for k in draws)]
    expected = [len(draws) * count.probability(k) for k in cells]
    expected.append(len(draws) - sum(expected))
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_a_coin_is_a_secret_and_refuses_to_be_copied():
    import pickle

    assert not SecretCoin().seeded and SecretCoin(seed=1).seeded
    with pytest.raises(TypeError, match="secret"):
        pickle.dumps(SecretCoin())


@pytest.mark.parametrize("mean, shape", [(1.0, 1.0), (0.5, POISSON), (math.inf, 1.0), (4.0, -1.0)])
def test_a_distribution_that_is_no_search_is_refused(mean, shape):
    with pytest.raises(PrivacyConfigError, match="trials"):
        TrialCount(mean=mean, shape=shape)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("mean", [1.5, 4.0, 37.0])
def test_the_first_trial_always_runs_without_a_poisson_count(shape, mean):
    """The truncated negative binomial has no K = 0: the first continuation probability is exactly 1 (not the
    survival sum rounded below 1, which left P[K = 0] ~ 1e-14)."""
    assert TrialCount(mean=mean, shape=shape).more_probability(0) == 1.0
