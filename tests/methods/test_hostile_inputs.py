"""Issue "reliability": every hostile input gets a clear error naming it, or a safe counted fallback;
the budget holds on every way a fit can end."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods import DPSGD, O2NC, PAZOM, PAZOP, PAZOS, Coupling, DPZero
from pl_dp.privacy.accountants import create_accountant
from tests import catalog
from tests.conftest import blobs, make_trainer

SPEC = PrivacySpec(epsilon=2.0, accountant="rdp")


def _dm(**kwargs):
    args = dict(public=blobs(30, seed=5), batch_size=10, public_batch_size=5)
    args.update(kwargs)
    return PrivatePublicDataModule(blobs(60), **args)


# ---- the privacy request -------------------------------------------------------------------------
@pytest.mark.parametrize("epsilon", [0.0, -1.0, float("nan"), float("inf"), "2", True])
def test_bad_epsilon_is_refused(epsilon):
    with pytest.raises(PrivacyConfigError, match="epsilon"):
        PrivacySpec(epsilon=epsilon)


@pytest.mark.parametrize("delta", [1.0, 1.5, 0.0, -1e-5, float("nan")])
def test_bad_delta_is_refused(delta):
    with pytest.raises(PrivacyConfigError, match="delta"):
        PrivacySpec(epsilon=1.0, delta=delta)


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("nan")])
def test_bad_noise_multiplier_is_refused(sigma):
    with pytest.raises(PrivacyConfigError, match="noise_multiplier"):
        PrivacySpec(epsilon=1.0, noise_multiplier=sigma)


def test_delta_above_one_over_n_warns_at_fit_start():
    model = DPZero(nn.Linear(4, 3), clip=1.0, privacy=PrivacySpec(epsilon=2.0, delta=0.1, accountant="rdp"))
    with pytest.warns(UserWarning, match=r"exceeds 1/n=0.0166667 for the n=60 examples"):
        make_trainer(max_steps=1).fit(model, _dm())


# ---- hyperparameters, per family -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (DPSGD, {"lr": 0.0}, "lr"),
        (DPSGD, {"lr": -0.1}, "lr"),
        (DPSGD, {"clip": None}, "clip"),
        (Coupling, {"alpha": 1.5}, "alpha"),
        (PAZOM, {"clip": 0.0}, "clip"),
        (PAZOM, {"smoothing": -1e-3}, "smoothing"),
        (PAZOP, {"k": 0}, "k"),
        (PAZOS, {"k": 0}, "k"),
        (PAZOS, {"clip": -2.0}, "clip"),
        (O2NC, {"smoothing": 0.0}, "smoothing"),
        (O2NC, {"inner_steps": 0}, "inner_steps"),
    ],
)
def test_bad_hyperparameters_name_the_parameter(cls, kwargs, match):
    spec = PrivacySpec(epsilon=2.0, accountant="tree") if cls is O2NC else SPEC
    with pytest.raises(ConfigError, match=match):
        cls(nn.Linear(4, 3), privacy=spec, **kwargs)


# ---- data --------------------------------------------------------------------------------------------
def test_empty_private_dataset_is_refused():
    with pytest.raises(ConfigError, match="private dataset is empty"):
        PrivatePublicDataModule(TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)), batch_size=1)


def test_empty_public_dataset_is_refused():
    empty = TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ConfigError, match="public dataset is empty"):
        _dm(public=empty)


@pytest.mark.parametrize("batch_size", [0, 61, 2.5])
def test_bad_batch_size_is_refused(batch_size):
    with pytest.raises(ConfigError, match="batch_size"):
        _dm(batch_size=batch_size)


# ---- losses ----------------------------------------------------------------------------------------------
def _int_loss(net, batch):
    x, y = batch
    return F.cross_entropy(net(x), y, reduction="none").long()


def _mean_loss(net, batch):
    x, y = batch
    return F.cross_entropy(net(x), y)


@pytest.mark.parametrize("cls", catalog.classes(catalog.REPRESENTATIVES))
@pytest.mark.parametrize(
    ("loss", "error", "match"),
    [(_int_loss, TypeError, "floating point"), (_mean_loss, ValueError, "one value per example")],
)
def test_bad_loss_outputs_raise_for_both_families(cls, loss, error, match):
    model = cls(nn.Linear(4, 3), loss=loss, clip=1.0, privacy=SPEC)
    with pytest.raises(error, match=match):
        make_trainer(max_steps=1).fit(model, _dm())


class _InfForLargeInputs:
    """+inf loss for examples whose first feature is above 1 (a few per batch)."""

    def __call__(self, net, batch):
        x, y = batch
        losses = F.cross_entropy(net(x), y, reduction="none")
        return torch.where(x[:, 0] > 1.0, losses * float("inf"), losses)


@pytest.mark.parametrize("cls", catalog.classes(catalog.REPRESENTATIVES))
def test_nonfinite_per_example_values_contribute_zero_and_are_counted(cls):
    torch.manual_seed(0)
    # preflight=False: the pre-flight pass would name those examples and refuse to train
    model = cls(
        nn.Linear(4, 3), loss=_InfForLargeInputs(), lr=0.05, clip=1.0, privacy=SPEC, noise_seed=0, preflight=False
    )
    make_trainer(max_steps=6).fit(model, _dm(sampling_seed=0))  # seeded: steps that sample a non-finite example
    assert model.nonfinite_total > 0
    assert all(torch.isfinite(p).all() for p in model.net.parameters())
    assert model.private_steps == _steps_accounted(model) == 6


# ---- how a fit can end ------------------------------------------------------------------------------------
def _steps_accounted(model) -> int:
    return model.accountant.steps


def test_gradient_accumulation_is_refused_for_private_runs():
    # one Poisson batch = one private step; summing micro-batches would change the sampling
    model = DPZero(nn.Linear(4, 3), clip=1.0, privacy=SPEC)
    with pytest.raises(Exception, match="accumulat"):
        make_trainer(max_steps=2, accumulate_grad_batches=2).fit(model, _dm())


@pytest.mark.parametrize("plan", [{"max_steps": 7}, {"max_epochs": 2}])
def test_plan_by_steps_or_epochs_is_accounted_per_update_and_within_target(plan):
    model = DPZero(nn.Linear(4, 3), clip=1.0, privacy=SPEC, noise_seed=0)
    make_trainer(**plan).fit(model, _dm())
    expected = plan.get("max_steps", 2 * 6)
    assert model.planned_steps == model.private_steps == _steps_accounted(model) == expected
    assert model.epsilon <= SPEC.epsilon


def test_early_stopping_keeps_the_accountant_in_step():
    model = DPZero(nn.Linear(4, 3), clip=1.0, privacy=SPEC, noise_seed=0)
    stop = EarlyStopping(monitor="val/loss", patience=0, min_delta=10.0)  # stops after the 2nd validation
    make_trainer(max_epochs=10, callbacks=[stop]).fit(model, _dm(val=blobs(30, seed=7)))
    assert model.trainer.current_epoch < 10
    assert model.private_steps == _steps_accounted(model) == model.trainer.global_step
    assert model.epsilon < SPEC.epsilon  # the planned budget was not used up, and none was overspent


class _Interrupt(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.private_steps == 3:
            raise KeyboardInterrupt


def test_manual_interruption_accounts_every_released_step(tmp_path):
    model = DPZero(nn.Linear(4, 3), clip=1.0, privacy=SPEC, noise_seed=0)
    trainer = make_trainer(max_epochs=4, callbacks=[_Interrupt()])
    with pytest.raises(SystemExit):  # Lightning's graceful shutdown on Ctrl+C
        trainer.fit(model, _dm())
    assert trainer.interrupted
    assert model.private_steps == _steps_accounted(model) == 3
    three_steps = create_accountant("rdp").epsilon_after(
        model.delta, 3, noise_multiplier=model.noise_multiplier, sample_rate=model.sample_rate
    )
    assert model.epsilon == three_steps <= SPEC.epsilon
