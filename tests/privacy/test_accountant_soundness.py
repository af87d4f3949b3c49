"""Only sound accountants: every accountant on offer reports at least the true ε (a rigorous PLD lower bound).

The reference is Google's dp-accounting privacy loss distribution (PLD) of the Poisson-subsampled
Gaussian under add/remove-one adjacency, discretized *optimistically* (``pessimistic_estimate=False``,
privacy buckets): every loss is rounded down and truncated mass is dropped, so its ε is a lower bound
on the true ε. An accountant that reports less than it under-reports, whatever its error model.
"""

from functools import cache

import dp_accounting
import pytest
from dp_accounting.pld import privacy_loss_distribution
from opacus.accountants.analysis import gdp as opacus_gdp

from pl_dp import PrivacySpec
from pl_dp.errors import PrivacyConfigError
from pl_dp.privacy import (
    PLD,
    RDP,
    SubsampledGaussian,
    accountant_class,
    accountant_names,
    calibrate_noise_multiplier,
    create_accountant,
)

DELTA = 1e-5
INTERVAL = 2e-4  # the optimistic reference's discretization: its ε is below the true one by at most about T·2e-4/2
SIGMAS, RATES, STEPS = (0.6, 1.0, 2.0, 5.0), (0.001, 0.01, 0.1, 1.0), (1, 100, 1000)
# ε from 33 to 1614 there: no privacy to speak of, and PRV takes seconds to a minute per point
NO_PRIVACY = {
    (0.6, 0.1, 1000),
    (0.6, 1.0, 100),
    (0.6, 1.0, 1000),
    (1.0, 1.0, 100),
    (1.0, 1.0, 1000),
    (2.0, 1.0, 100),
    (2.0, 1.0, 1000),
    (5.0, 1.0, 1000),
}
GRID = [(s, q, t) for s in SIGMAS for q in RATES for t in STEPS if (s, q, t) not in NO_PRIVACY]
WORST_GDP_POINT = (0.6, 0.001, 100)  # the audit's worst point: GDP says 0.121, the PLD 0.780

#: every registered accountant of Poisson-subsampled Gaussian steps (a new one is checked here without an edit)
POISSON_ACCOUNTANTS = [name for name in accountant_names() if accountant_class(name).supports(SubsampledGaussian)]


@cache
def _optimistic_step(sigma: float, rate: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    return privacy_loss_distribution.from_gaussian_mechanism(
        sigma,
        pessimistic_estimate=False,
        sampling_prob=rate,
        value_discretization_interval=INTERVAL,
        use_connect_dots=False,
    )


@cache
def lower_bound(sigma: float, rate: float, steps: int) -> float:
    """A rigorous lower bound on the true ε of ``steps`` Poisson-subsampled Gaussian steps."""
    step = _optimistic_step(sigma, rate)
    return (step if steps == 1 else step.self_compose(steps)).get_epsilon_for_delta(DELTA)


def pessimistic_pld(sigma: float, rate: float, steps: int, interval: float = INTERVAL) -> float:
    """dp-accounting's own PLD accountant (pessimistic connect-the-dots): an upper bound on the true ε."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(DELTA)


def opacus_gdp_epsilon(sigma: float, rate: float, steps: int) -> float:
    """What the removed ``accountant="gdp"`` reported: Opacus' central-limit Gaussian-DP approximation."""
    mu = opacus_gdp.compute_mu_poisson(steps=steps, noise_multiplier=sigma, sample_rate=rate)
    return opacus_gdp.eps_from_mu(mu=mu, delta=DELTA)


def test_gdp_is_not_offered_and_every_poisson_accountant_is_under_test():
    assert set(POISSON_ACCOUNTANTS) == {"prv", "rdp", "pld"}
    assert "gdp" not in accountant_names()


@pytest.mark.parametrize("name", POISSON_ACCOUNTANTS)
def test_accountant_never_reports_less_than_the_optimistic_pld(name):
    accountant = create_accountant(name)
    shortfalls, margins = [], []
    for sigma, rate, steps in GRID:
        reported, floor = (
            accountant.epsilon_after(DELTA, steps, noise_multiplier=sigma, sample_rate=rate),
            lower_bound(sigma, rate, steps),
        )
        margins.append(reported - floor)
        if reported < floor:
            shortfalls.append(f"sigma={sigma} q={rate} T={steps}: {reported:.4f} < {floor:.4f}")
    assert not shortfalls, f"{name} under-reports epsilon at " + "; ".join(shortfalls)
    assert min(margins) >= 0


def test_the_soundness_test_has_teeth_the_removed_gdp_accountant_fails_it():
    sigma, rate, steps = WORST_GDP_POINT
    assert opacus_gdp_epsilon(sigma, rate, steps) == pytest.approx(0.121, abs=1e-3)
    assert 0.77 < lower_bound(sigma, rate, steps) <= pessimistic_pld(sigma, rate, steps) < 0.78
    assert opacus_gdp_epsilon(sigma, rate, steps) < lower_bound(sigma, rate, steps) / 6


def test_the_reference_pins_the_true_epsilon_tightly():
    """The pessimistic PLD (an upper bound) exceeds the optimistic one (a lower bound) by little: the true ε is
    known to within the discretization, so "at least the optimistic PLD" is a sharp test."""
    for sigma, rate, steps in [(0.6, 0.001, 100), (1.0, 0.01, 1000), (2.0, 0.1, 100), (5.0, 1.0, 100)]:
        upper, lower = pessimistic_pld(sigma, rate, steps), lower_bound(sigma, rate, steps)
        assert lower <= upper <= lower + steps * INTERVAL / 2 + 1e-3


def test_pld_calibration_meets_the_target_measured_independently():
    steps, rate, target = 2250, 0.04, 8.0
    sigma = calibrate_noise_multiplier(target, DELTA, rate, steps, PLD())
    spent = pessimistic_pld(sigma, rate, steps, interval=1e-4)  # dp-accounting's PLD accountant, its default interval
    assert lower_bound(sigma, rate, steps) <= spent <= target
    assert spent == pytest.approx(target, rel=0.01)  # calibrated, not over-noised


def test_removed_gdp_gets_a_clear_error_from_a_spec_a_name_and_a_checkpoint():
    for attempt in (
        lambda: PrivacySpec(epsilon=1.0, accountant="gdp"),
        lambda: create_accountant("gdp"),
        lambda: RDP().load_state_dict({"mechanism": "gdp", "history": [[1.0, 0.01, 10]]}),
    ):
        with pytest.raises(PrivacyConfigError, match="'gdp' accountant was removed.*under-reports.*'pld'"):
            attempt()
