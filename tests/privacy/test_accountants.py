"""Accountant values pinned to Opacus' known numbers (Opacus 1.6 and its own tests) and calibration round trips."""

import time
import warnings

import numpy as np
import pytest
from dp_accounting import NeighboringRelation
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods import O2NC, DPZero
from pl_dp.privacy import (
    PLD,
    PRV,
    RDP,
    Accountant,
    PrivacyReport,
    StepBudget,
    SubsampledGaussian,
    TreeAggregatedGaussian,
    accountant_class,
    accountants,
    calibrate_noise_multiplier,
    create_accountant,
    register_accountant,
)
from pl_dp.privacy.accountants import opacus_rdp_conversion, rdp_epsilon
from pl_dp.privacy.calibration import EpsilonTracker
from pl_dp.privacy.tree import TreeAccountant, TreeLeaf


def _eps(acc, sigma, q, steps, delta=1e-5):
    acc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize(
    ("name", "sigma", "q", "steps", "expected"),
    [
        ("rdp", 1.5, 0.04, 2250, 7.3291),
        ("rdp", 1.1, 256 / 60000, 14062, 2.5966),
        ("prv", 1.5, 0.04, 2250, 6.7791),
        ("prv", 1.5, 0.04, 2249, 6.777395712150674),
        ("pld", 1.5, 0.04, 2250, 6.7690),
    ],
)
def test_accountant_matches_known_values(name, sigma, q, steps, expected):
    assert _eps(create_accountant(name), sigma, q, steps) == pytest.approx(expected, abs=2e-4)


def test_tf_privacy_value():
    # TF-Privacy: n=60000, B=150, sigma=1.3, 15 epochs, delta=1e-5 -> 0.7242234 (RDP)
    steps = 15 * 60000 // 150
    assert _eps(RDP(), 1.3, 150 / 60000, steps) == pytest.approx(0.7242234, rel=2e-3)


def test_step_by_step_equals_bulk():
    a, b = RDP(), RDP()
    for _ in range(50):
        a.step(noise_multiplier=1.2, sample_rate=0.01)
    b.step(noise_multiplier=1.2, sample_rate=0.01, num_steps=50)
    assert a.history == b.history == [(1.2, 0.01, 50)]
    assert a.get_epsilon(1e-5) == b.get_epsilon(1e-5)


def test_heterogeneous_history_composes():
    acc = RDP()
    acc.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=100)
    acc.step(noise_multiplier=2.0, sample_rate=0.02, num_steps=100)
    assert len(acc.history) == 2
    one = RDP()
    one.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=100)
    assert acc.get_epsilon(1e-5) > one.get_epsilon(1e-5)


@pytest.mark.parametrize(("name", "expected"), [("rdp", 1.416), ("prv", 1.34765625), ("pld", 1.3477)])
def test_calibration_matches_opacus_and_round_trips(name, expected):
    steps = int(90 / 0.04)
    acc = create_accountant(name)
    sigma = calibrate_noise_multiplier(8.0, 1e-5, 0.04, steps, acc)
    assert sigma == pytest.approx(expected, rel=0.01)
    eps = acc.epsilon_after(1e-5, steps, noise_multiplier=sigma, sample_rate=0.04)
    assert eps <= 8.0
    assert eps == pytest.approx(8.0, rel=0.01)


@pytest.mark.parametrize("cls", [RDP, PLD])
def test_state_dict_round_trip_and_mechanism_check(cls):
    acc = cls()
    acc.step(noise_multiplier=1.1, sample_rate=0.05, num_steps=7)
    clone = cls()
    clone.load_state_dict(acc.state_dict())
    assert clone.history == acc.history
    assert clone.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    with pytest.raises(PrivacyConfigError, match=acc.name):
        PRV().load_state_dict(acc.state_dict())


def test_step_budget_stops_exactly_at_the_limit():
    acc = RDP()
    budget = StepBudget(acc, target_epsilon=1.0, delta=1e-5, horizon=10)
    steps = 0
    while budget.allows(3.0, 0.05):
        acc.step(noise_multiplier=3.0, sample_rate=0.05)
        steps += 1
    assert acc.get_epsilon(1e-5) <= 1.0
    # the refused step would have overshot
    assert acc.epsilon_after(1e-5, 1, noise_multiplier=3.0, sample_rate=0.05) > 1.0
    assert steps > 10


@pytest.mark.parametrize("cls", [PRV, PLD])
def test_epsilon_tracker_logs_the_exact_epsilon_on_a_grid_and_the_rdp_curve_under_its_own_name(cls, monkeypatch):
    acc = cls()
    exact_calls = []
    evaluate = cls._epsilon
    monkeypatch.setattr(cls, "_epsilon", lambda self, h, d: exact_calls.append(h) or evaluate(self, h, d))
    tracker = EpsilonTracker(acc, 1e-5, planned_steps=400, evaluations=4)
    exact_at = []
    for t in range(1, 401):
        acc.step(noise_multiplier=1.0, sample_rate=0.05)
        logged = tracker.metrics(final=t == 400, written=t % 25 == 0 or t == 101)
        assert logged["epsilon_rdp"] == pytest.approx(rdp_epsilon([(1.0, 0.05, t)], 1e-5), rel=1e-12)
        if "epsilon" in logged:
            exact_at.append(t)
            # exactly the accountant's own epsilon of the history so far: what model.epsilon and the report give
            assert logged["epsilon"] == pytest.approx(evaluate(acc, [(1.0, 0.05, t)], 1e-5), rel=1e-12)
            assert logged["epsilon"] < logged["epsilon_rdp"]
    assert exact_at == [100, 200, 300, 400]  # once per grid point, whatever the logging cadence
    assert len(exact_calls) == 4


def test_the_planned_history_is_evaluated_once_for_the_plan_the_guard_and_the_final_epsilon(monkeypatch):
    """A fit with σ given checks the plan's ε, the budget guard looks ahead to the horizon, and the run ends with
    the final ε: one (history, δ), so one PRV evaluation (each 0.05–0.5 s), remembered exactly."""
    calls = []
    evaluate = PRV._epsilon
    monkeypatch.setattr(PRV, "_epsilon", lambda self, h, d: calls.append(list(h)) or evaluate(self, h, d))
    acc = PRV()
    planned = acc.epsilon_after(1e-5, 50, noise_multiplier=1.0, sample_rate=0.05)
    guard = StepBudget(acc, 10.0, 1e-5, horizon=50)
    for _ in range(50):
        assert guard.allows(1.0, 0.05)
        acc.step(noise_multiplier=1.0, sample_rate=0.05)
    assert acc.get_epsilon(1e-5) == planned == evaluate(PRV(), [(1.0, 0.05, 50)], 1e-5)
    assert calls == [[(1.0, 0.05, 50)]]
    assert acc.get_epsilon(1e-3) < planned and len(calls) == 2  # another δ: another evaluation
    acc.step(noise_multiplier=1.0, sample_rate=0.05)
    assert acc.get_epsilon(1e-5) > planned and len(calls) == 3  # another history: another evaluation


def test_epsilon_tracker_waits_for_a_written_step_and_is_exact_at_the_last_one():
    acc = PRV()
    tracker = EpsilonTracker(acc, 1e-5, planned_steps=40, evaluations=4)  # grid: 10, 20, 30, 40
    exact_at = []
    for t in range(1, 31):
        acc.step(noise_multiplier=1.0, sample_rate=0.05)
        if "epsilon" in tracker.metrics(final=t == 27, written=t % 7 == 0):
            exact_at.append(t)
    assert exact_at == [14, 21, 27]  # the first written step past 10 and 20, and the fit's last step


def test_segments_are_the_history_grouped_by_plan_for_every_accountant():
    """What the privacy report shows: consecutive steps of one (σ, q), also across composed journal segments."""
    acc, later = create_accountant("prv"), create_accountant("prv")
    acc.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=3)
    later.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=2)
    acc.compose(later)  # a resume's steps, appended as their own entry
    assert len(acc.history) == 2 and acc.segments() == [(1.0, 0.05, 5)]
    acc.step(noise_multiplier=0.8, sample_rate=0.05)
    acc.step(noise_multiplier=0.8, sample_rate=0.1)
    assert acc.segments() == [(1.0, 0.05, 5), (0.8, 0.05, 1), (0.8, 0.1, 1)]
    tree = TreeAccountant()
    for tree_index, leaves, sigma in ((0, 4, 1.0), (1, 2, 1.0), (2, 1, 0.5)):
        for leaf in range(1, leaves + 1):
            tree.record(sigma, TreeLeaf("p", 0, tree_index, 4, leaf))
    assert tree.segments() == [(1.0, None, 6), (0.5, None, 1)]  # not subsampled: no sample rate


def test_epsilon_tracker_of_a_cheap_accountant_is_exact_at_every_step():
    acc = create_accountant("rdp")
    tracker = EpsilonTracker(acc, 1e-5, planned_steps=30, evaluations=3)
    for _ in range(15):
        acc.step(noise_multiplier=1.0, sample_rate=0.05)
        assert tracker.metrics(written=False) == {"epsilon": acc.get_epsilon(1e-5)}  # no second curve to log


def test_pld_composes_a_constant_stretch_in_one_evaluation_and_memoizes_it():
    acc = PLD()
    acc.step(
        noise_multiplier=1.1, sample_rate=256 / 60000, num_steps=14062
    )  # 30 MNIST epochs as one history entry: one FFT self-composition
    start = time.perf_counter()
    eps = acc.get_epsilon(1e-5)
    assert time.perf_counter() - start < 1.0
    assert eps == pytest.approx(2.3838, abs=2e-3)  # 2.3817 at dp-accounting's default interval 1e-4
    start = time.perf_counter()
    again = PLD().epsilon_after(
        1e-5, 14062, noise_multiplier=1.1, sample_rate=256 / 60000
    )  # a fresh accountant, the same history
    assert again == eps and time.perf_counter() - start < 0.01


def test_opacus_largest_alpha_warning_is_filtered_only_around_pl_dps_conversions():
    """Opacus warns when the best RDP order is the largest one (harmless: ε stays an upper bound); pl_dp's own
    conversions hide that one warning and nothing else."""
    orders = np.asarray(RDPAccountant.DEFAULT_ALPHAS, dtype=float)
    tiny = rdp_analysis.compute_rdp(q=0.001, noise_multiplier=10.0, steps=1, orders=orders)
    tree = TreeAccountant()
    tree.plan("partition", steps_per_pass=4, tree_length=4, next_position=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rdp_analysis.get_privacy_spent(orders=orders, rdp=tiny, delta=1e-5)  # Opacus alone warns here
        rdp_analysis.get_privacy_spent(orders=orders, rdp=orders / 2 / 30.0**2, delta=1e-5)  # one tree leaf, z = 30
        assert sum("Optimal order is the largest alpha" in str(w.message) for w in caught) == 2
        caught.clear()
        assert RDP().epsilon_after(1e-5, 1, noise_multiplier=10.0, sample_rate=0.001) > 0
        assert tree.epsilon_after(1e-5, 1, noise_multiplier=30.0, sample_rate=1.0) > 0
        with opacus_rdp_conversion():
            warnings.warn("a privacy warning of pl_dp's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a privacy warning of pl_dp's own"]


def test_an_accountant_declares_what_it_is():
    """Adjacency, the mechanisms accounted and the cost are the accountant's own facts, asked — never its name."""
    for name in ("rdp", "prv", "pld"):
        cls = accountant_class(name)
        assert cls.name == name and cls.adjacency == NeighboringRelation.ADD_OR_REMOVE_ONE
        assert cls.supports(SubsampledGaussian) and not cls.supports(TreeAggregatedGaussian)
    tree = accountant_class("tree")
    assert tree.adjacency == NeighboringRelation.REPLACE_ONE and tree.is_cheap
    assert tree.supports(TreeAggregatedGaussian(1.0, 1.0)) and not tree.supports(SubsampledGaussian)
    assert RDP.is_cheap and not PRV.is_cheap and not PLD.is_cheap


def test_the_interface_is_abstract_and_steps_are_named():
    with pytest.raises(TypeError):
        Accountant()
    with pytest.raises(TypeError):
        RDP().step(0.01, 1.0)  # a sample rate and a noise multiplier swapped: refused, not accounted
    with pytest.raises(TypeError):
        RDP().epsilon_after(1e-5, 1, 0.01, 1.0)


def test_the_registry_never_overwrites_a_name(monkeypatch):
    monkeypatch.setattr(accountants, "_BACKENDS", dict(accountants._BACKENDS))

    class Impostor(RDP):
        name = "prv"

    with pytest.raises(ConfigError, match="'prv' is taken by PRV"):
        register_accountant(Impostor)
    assert create_accountant("prv").__class__ is PRV
    register_accountant(RDP)  # the same class again: nothing changes

    class Nameless(RDP):
        name = ""

    with pytest.raises(TypeError, match="declares no name"):
        register_accountant(Nameless)
    with pytest.raises(TypeError, match="concrete subclass"):
        register_accountant(Accountant)

    class Removed(RDP):
        name = "gdp"

    with pytest.raises(PrivacyConfigError, match="removed"):
        register_accountant(Removed)


def test_a_registered_accountant_works_everywhere_without_another_file(monkeypatch):
    """One class and its registration: specs accept it, methods whose releases it supports use it, others refuse it."""
    monkeypatch.setattr(accountants, "_BACKENDS", dict(accountants._BACKENDS))

    @register_accountant
    class Conservative(RDP):
        name = "conservative-rdp"

    spec = PrivacySpec(epsilon=1.0, accountant="conservative-rdp")
    assert isinstance(DPZero(nn.Linear(2, 2), privacy=spec).accountant, Conservative)
    with pytest.raises(PrivacyConfigError, match="does not account O2NC's releases"):
        O2NC(nn.Linear(2, 2), privacy=spec)
    state = {"method": "DPZero", "privacy": spec.to_dict(), "delta": 1e-5, "accountant": Conservative().state_dict()}
    assert PrivacyReport.from_state(state).adjacency == "add/remove-one"


@pytest.mark.parametrize("target", [0.3, 1.0, 3.0, 8.0, 40.0])
@pytest.mark.parametrize(("rate", "steps"), [(0.002, 30), (0.04, 2250), (0.3, 400), (1.0, 5)])
def test_calibration_lands_in_its_window_with_few_accountant_evaluations(monkeypatch, target, rate, steps):
    """The σ returned was evaluated by the accountant at an ε in [(1 − tolerance)·target, target], found by
    regula falsi in the bracket (≤ 10 evaluations; bisection took up to 15 on this grid, 11 or more in 12 of 20)."""
    acc = RDP()
    evaluated: dict[float, float] = {}
    real = RDP.epsilon_after

    def counted(self, delta, num_steps, *, noise_multiplier, sample_rate):
        evaluated[noise_multiplier] = real(
            self, delta, num_steps, noise_multiplier=noise_multiplier, sample_rate=sample_rate
        )
        return evaluated[noise_multiplier]

    monkeypatch.setattr(RDP, "epsilon_after", counted)
    sigma = calibrate_noise_multiplier(target, 1e-5, rate, steps, acc, tolerance=0.005)
    assert (1 - 0.005) * target <= evaluated[sigma] <= target
    assert len(evaluated) <= 10


def test_the_report_states_epsilon_at_its_release_tolerance_as_opacus_computes_it():
    """The report says one record moves a release by at most 1.01·C; ε at that sensitivity is each noise multiplier
    over 1.01, which Opacus' RDP accountant computes independently."""
    accountant = RDP()
    accountant.step(noise_multiplier=1.0, sample_rate=0.04, num_steps=250)
    spec = PrivacySpec(epsilon=10.0, accountant="rdp")
    state = {"method": "DPSGD", "privacy": spec.to_dict(), "delta": 1e-5, "accountant": accountant.state_dict()}
    report = PrivacyReport.from_state(state)
    opacus = RDPAccountant()
    opacus.history = [(1.0 / 1.01, 0.04, 250)]
    with opacus_rdp_conversion():
        expected = opacus.get_epsilon(1e-5)
    assert report.epsilon_at_tolerance == pytest.approx(expected, rel=1e-9)
    assert report.epsilon < report.epsilon_at_tolerance < 1.03 * report.epsilon
    assert f"epsilon {report.epsilon_at_tolerance:.4g} if it moved every release by that much" in str(report)
    tree = TreeAccountant()  # a ledger of trees: its noise multipliers scaled alike
    for leaf in range(1, 5):
        tree.record(1.0, TreeLeaf("p", 0, 0, 4, leaf))
    assert tree.epsilon_at_sensitivity(1.01, 1e-5) > tree.get_epsilon(1e-5)
