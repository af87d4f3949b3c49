"""PrivacyLedger alone, without Lightning: plan, record, guard and checkpoint state."""

from types import SimpleNamespace

import pytest

from pl_dp.errors import PrivacyConfigError
from pl_dp.privacy import PrivacySpec, SubsampledGaussian
from pl_dp.privacy.ledger import PrivacyLedger
from pl_dp.privacy.units import PrivacyUnit


def _sampler(rate=0.1, n=100, seeded=False):
    return SimpleNamespace(
        sample_rate=rate, expected_batch_size=rate * n, num_samples=n, seeded=seeded, unit=PrivacyUnit("example", n)
    )


def _planned(spec, steps=50, restored=None, allow_change=False):
    ledger = PrivacyLedger(spec, "rdp")
    ledger.observe_sampler(_sampler(), noise_seeded=False)
    ledger.fix_delta()
    ledger.open_journal(restored, None, lambda obj: obj)
    if restored is not None:
        ledger.load_state_dict(restored)
    ledger.plan(steps, restored, allow_change, steps)
    return ledger


def _step(ledger):
    ledger.record(SubsampledGaussian(ledger.noise_multiplier, ledger.sample_rate, 1.0, ledger.expected_batch_size))


def test_a_calibrated_plan_runs_to_its_end_and_the_guard_stops_the_step_after():
    ledger = _planned(PrivacySpec(epsilon=2.0))
    for _ in range(50):
        assert ledger.allows_next_step()
        _step(ledger)
    assert ledger.private_steps == 50 and ledger.epsilon <= 2.0
    ledger.add_target(ledger.epsilon)  # a target at exactly what was spent: no step fits
    assert not ledger.allows_next_step() and ledger.exhausted


def test_a_tighter_target_stops_early_and_a_fixed_sigma_over_it_is_refused():
    ledger = _planned(PrivacySpec(epsilon=2.0))
    assert ledger.add_target(1.0) > 1.0  # the plan would overshoot: the guard will stop it
    steps = 0
    while ledger.allows_next_step():
        _step(ledger)
        steps += 1
    assert 0 < steps < 50 and ledger.epsilon <= 1.0
    fixed = _planned(PrivacySpec(epsilon=50.0, noise_multiplier=1.0))
    with pytest.raises(PrivacyConfigError, match="refusing to start"):
        fixed.add_target(0.5)


def test_the_state_round_trips_and_a_resume_under_another_spec_is_refused_unless_allowed():
    ledger = _planned(PrivacySpec(epsilon=2.0))
    for _ in range(10):
        _step(ledger)
    state = ledger.state_dict()
    assert "noise" not in state and "seed" not in state and "key" not in state  # never a secret
    resumed = _planned(PrivacySpec(epsilon=2.0), steps=40, restored=state)
    assert resumed.noise_multiplier == ledger.noise_multiplier
    assert resumed.accountant.history == ledger.accountant.history
    with pytest.raises(PrivacyConfigError, match="different privacy spec"):
        _planned(PrivacySpec(epsilon=3.0), steps=40, restored=state)
    with pytest.warns(UserWarning, match="epsilon spent so far"):
        changed = _planned(PrivacySpec(epsilon=3.0), steps=40, restored=state, allow_change=True)
    assert changed.accountant.steps == 10 and changed.noise_multiplier < ledger.noise_multiplier


def test_user_seeded_secrets_are_sticky_and_make_the_report_no_guarantee():
    ledger = PrivacyLedger(PrivacySpec(epsilon=2.0), "rdp")
    ledger.observe_sampler(_sampler(seeded=True), noise_seeded=False)
    ledger.observe_sampler(_sampler(seeded=False), noise_seeded=False)
    report = ledger.report("DPSGD", secure_rng=False, noise_seeded=True)
    assert report.user_seeded == ("noise", "sampling") and not report.is_guarantee


def test_a_search_release_spends_the_whole_search_and_is_not_trained_further():
    """A ledger restored from a search's release (pl-dp tune's best.ckpt): its ε — model.epsilon, the fit summary — is
    the whole search's, the report's, not the one trial's (found by review: a further fit planned, guarded and
    printed the trial's ε only); a further fit is refused."""
    from pl_dp.privacy.selection import TrialCount, search_epsilon

    trial = _planned(PrivacySpec(epsilon=2.0))
    for _ in range(50):
        _step(trial)
    state = trial.state_dict()
    history = [list(row) for row in state["accountant"]["history"]]
    count = TrialCount(mean=4.0, shape=1.0)
    state["search"] = {"mean": 4.0, "shape": 1.0, "metric": "val/acc", "score": 0.9, "candidate": {"lr": 0.1}}
    state["search"] |= {"history": history, "released_steps": 50}
    released = PrivacyLedger(PrivacySpec(epsilon=2.0), "rdp")
    released.load_state_dict(state)
    expected = search_epsilon(history, count, state["delta"])
    assert released.epsilon == pytest.approx(expected, rel=1e-12) and expected > trial.epsilon
    assert released.report("DPSGD", True, False).epsilon == pytest.approx(released.epsilon, rel=1e-12)
    with pytest.raises(PrivacyConfigError, match="release of a hyperparameter search"):
        _planned(PrivacySpec(epsilon=3.0), steps=40, restored=state, allow_change=True)
