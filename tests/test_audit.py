"""pl_dp.audit: honest mechanisms pass with the noise they claim; a broken one is caught."""

import dataclasses
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.audit import audit, clopper_pearson_upper, release_shift
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError
from pl_dp.methods import O2NC, DPZero
from pl_dp.methods.first_order import FirstOrderModule
from pl_dp.privacy.accountants import create_accountant
from pl_dp.privacy.mechanisms import SubsampledGaussian
from tests import catalog
from tests.conftest import blobs, make_trainer

SIGMA = 1.5
TRIALS = 300


def _spec():
    return PrivacySpec(epsilon=100.0, accountant="rdp", noise_multiplier=SIGMA)


def _data():
    return PrivatePublicDataModule(blobs(40), public=blobs(30, seed=5), batch_size=8, public_batch_size=8)


#: every release a subsampled-Gaussian accountant accounts (O2NC's tree is refused, below), and the other clip
#: functions (joint, automatic, PSAC); the per-sample modes release the same sum (tests/per_sample compares them)
METHODS = {
    entry.id: (entry.cls, entry.kwargs())
    for entry in catalog.select([*catalog.METHODS, *catalog.VARIANTS], aspects=(None, "clip"), accountable="rdp")
}


def _model(cls=DPZero, **kwargs):
    kwargs.setdefault("clip", 1.0)
    return cls(nn.Linear(4, 3), privacy=_spec(), noise_seed=0, **kwargs)


@pytest.mark.parametrize("name", list(METHODS))
def test_honest_mechanisms_stay_below_their_claim_with_the_claimed_noise(name):
    torch.manual_seed(0)
    cls, kwargs = METHODS[name]
    result = audit(_model(cls, **kwargs), _data(), trials=TRIALS)
    assert result.canary_influence == pytest.approx(1.0, abs=0.02)  # the canary saturates C
    assert result.epsilon_lower_bound <= result.claimed_epsilon, result
    assert not result.violated
    # the empirical noise check: a saturating canary moves the statistic by C/(σC) = 1/σ noise stds; with
    # 300 trials per world the estimate's standard error is ≈ 0.13 on this scale (tolerance: 3.5 of them)
    assert result.separation * SIGMA == pytest.approx(1.0, abs=0.45), result


class _ThinNoise(SubsampledGaussian):
    @property
    def noise_std(self) -> float:
        return 0.3 * super().noise_std


class _BrokenDPZero(DPZero):
    """Accounts σ but adds 0.3·σ: the bug the audit exists to catch."""

    def mechanism(self, batch_size):
        return _ThinNoise(**dataclasses.asdict(super().mechanism(batch_size)))


def test_a_mechanism_with_too_little_noise_is_caught():
    torch.manual_seed(0)
    model = _model(_BrokenDPZero)
    result = audit(model, _data(), trials=2 * TRIALS)
    assert result.violated and result.epsilon_lower_bound > result.claimed_epsilon, result
    assert "VIOLATION" in str(result)


def test_clopper_pearson_upper_bound():
    assert clopper_pearson_upper(0, 100, 0.05) == pytest.approx(1 - 0.05 ** (1 / 100))
    assert clopper_pearson_upper(100, 100, 0.05) == 1.0


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (lambda: DPZero(nn.Linear(4, 3), clip=1.0, privacy=None), {}, "private model"),
        (lambda: O2NC(nn.Linear(4, 3), privacy=PrivacySpec(epsilon=1.0, accountant="tree")), {}, "tree"),
        (_model, {"trials": 5}, "trials"),
        (_model, {"confidence": 1.0}, "confidence"),
        (_model, {"reference_size": 0}, "reference_size"),
    ],
)
def test_bad_audit_requests_raise(make, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        audit(make(), _data(), **kwargs)


def test_too_small_private_set_raises():
    with pytest.raises(ConfigError, match="reference_size"):
        audit(_model(), _data(), reference_size=40, trials=20)


def test_claimed_epsilon_is_one_full_batch_step_of_the_accountant():
    torch.manual_seed(0)
    result = audit(_model(), _data(), trials=40)
    assert result.claimed_epsilon == pytest.approx(
        create_accountant("rdp").epsilon_after(1 / 40, 1, noise_multiplier=SIGMA, sample_rate=1.0)
    )
    assert math.isfinite(result.epsilon_lower_bound)


def test_release_shift_measures_the_canary_influence_and_may_be_zero():
    torch.manual_seed(0)
    assert release_shift(_model(), _data()) == pytest.approx(1.0, abs=0.02)  # the default canary saturates C
    # logits 0 at every θ (no bias, input 0): a canary whose own contribution is 0, and nothing else moves
    silent = (torch.zeros(4), torch.tensor(0))
    model = DPZero(nn.Linear(4, 3, bias=False), clip=1.0, queries=2, privacy=_spec(), noise_seed=0)
    assert release_shift(model, _data(), silent) == 0.0
    assert model.private_steps == 1  # measured at the first batch, before its step
    # first in the batch, it moves every other example one row down: the sums add in another order (fp32 rounding)
    assert release_shift(model, _data(), silent, canary_row=0) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ConfigError, match="canary_row"):
        release_shift(model, _data(), silent, canary_row=9)
    model = DPZero(nn.Linear(4, 3, bias=False), clip=1.0, queries=2, privacy=_spec(), noise_seed=0)
    with pytest.raises(ValueError, match="does not change the step's release"):
        audit(model, _data(), canary=silent, trials=20)


@pytest.mark.parametrize("name", [entry.id for entry in catalog.REPRESENTATIVES])
def test_the_trials_run_in_the_precision_the_run_trains_in(name):
    """Lightning runs ``training_step`` inside the precision plugin's context (autocast for bf16-mixed); the audit's
    trials, run from a callback before it, must run in the same context, or a bf16-mixed run is audited in fp32."""
    torch.manual_seed(0)
    cls, kwargs = METHODS[name]
    if issubclass(cls, FirstOrderModule):  # a per-sample mode whose passes autocast (ghost and bk compute in fp32)
        kwargs = {**kwargs, "per_sample": "hooks"}
    model = _model(cls, **kwargs)
    armed, outputs = [], []

    class Arm(Callback):  # runs before the audit's callback: from then on every forward is a trial's (or the step's)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            armed.append(True)

    model.net.register_forward_hook(lambda module, inputs, out: outputs.append(out.dtype) if armed else None)
    trainer = make_trainer(max_steps=1, precision="bf16-mixed", callbacks=[Arm()])
    result = audit(model, _data(), trainer=trainer, trials=20)
    assert outputs and set(outputs) == {torch.bfloat16}, outputs  # every private forward ran under autocast
    assert result.canary_influence == pytest.approx(1.0, abs=0.05)
