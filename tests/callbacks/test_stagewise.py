"""StagewiseSchedule (DP-ZOSO): per-stage values, full accounting, a real proximal anchor, exact resume."""

import math

import lightning as L
import pytest
import torch
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.callbacks import StagewiseSchedule
from pl_dp.callbacks.stagewise import stage_lengths
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError
from pl_dp.methods import PAZOS, DPZero
from tests.conftest import blobs, make_trainer
from tests.methods.test_checkpoint import assert_resume_is_exact

SPEC = PrivacySpec(epsilon=3.0, accountant="rdp")


class Record(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        anchor = pl_module.proximal_anchor
        self.rows.append(
            (
                pl_module.lr,
                pl_module.smoothing,
                anchor[0].clone() if anchor else None,
                next(pl_module.net.parameters()).detach().clone(),
            )
        )


def _model(**kw):
    L.seed_everything(0)
    return DPZero(nn.Linear(4, 3), lr=0.08, clip=1.0, smoothing=1e-3, privacy=SPEC, noise_seed=5, **kw)


def _dm():
    return PrivatePublicDataModule(blobs(100), batch_size=10, sampling_seed=1)  # 10 steps per epoch


def test_stage_values_and_all_stages_accounted():
    model, record = _model(), Record()
    schedule = StagewiseSchedule(stages=3, smoothing_growth=10.0, lr_decay=0.5, steps_growth=2.0, proximal=1e-3)
    make_trainer(max_steps=70, callbacks=[schedule, record]).fit(model, _dm())
    assert schedule.lengths == [10, 20, 40]
    for t, (lr, smoothing, _, _) in enumerate(record.rows):
        s = 0 if t < 10 else (1 if t < 30 else 2)
        assert lr == pytest.approx(0.08 * 0.5**s)
        assert smoothing == pytest.approx(1e-3 * 10.0**s)
    assert model.accountant.steps == sum(schedule.lengths) == model.planned_steps == 70
    assert model.epsilon <= 3.0  # sigma was calibrated for all stages


def test_stage_lengths_fill_the_plan_or_refuse():
    assert stage_lengths(100, 3, 2.0, None) == [14, 28, 58]
    assert sum(stage_lengths(1234, 5, 2.0, None)) == 1234
    assert stage_lengths(70, 3, 2.0, 10) == [10, 20, 40]
    with pytest.raises(ConfigError, match="max_steps=70"):
        stage_lengths(60, 3, 2.0, 10)


def test_proximal_anchor_is_a_real_copy_and_pulls_towards_the_stage_start():
    record = Record()
    make_trainer(max_steps=30, callbacks=[StagewiseSchedule(stages=2, proximal=0.5), record]).fit(_model(), _dm())
    anchor_at_stage_2, params_at_stage_2_end = record.rows[10][2], record.rows[-1][3]
    assert torch.equal(record.rows[-1][2], anchor_at_stage_2)  # unchanged through the stage (no aliasing)
    assert not torch.equal(params_at_stage_2_end, anchor_at_stage_2)  # the weights moved away from it
    runs = {}
    for proximal in (0.0, 0.5):
        model = _model()
        make_trainer(max_steps=30, callbacks=[StagewiseSchedule(stages=2, proximal=proximal)]).fit(model, _dm())
        runs[proximal] = next(model.net.parameters()).detach()
    assert not torch.equal(runs[0.0], runs[0.5])  # the proximal term is not a no-op in stage 2


def test_resume_mid_stage_is_bit_identical(tmp_path):
    def callbacks():
        return [StagewiseSchedule(stages=3, proximal=0.2)]

    assert_resume_is_exact(tmp_path, _model, _dm, callbacks, max_steps=70, crash_at=38, resume_step=37)


def test_works_with_pazo_s_without_smoothing():
    L.seed_everything(0)
    dm = PrivatePublicDataModule(blobs(100), public=blobs(30, seed=3), batch_size=10, public_batch_size=8)
    model = PAZOS(nn.Linear(4, 3), lr=0.1, clip=2.0, k=3, privacy=SPEC)
    schedule = StagewiseSchedule(stages=2, proximal=1e-3)
    make_trainer(max_steps=12, callbacks=[schedule]).fit(model, dm)
    assert model.lr == pytest.approx(0.05) and schedule.base_smoothing is None
    assert math.isfinite(model.epsilon)


@pytest.mark.parametrize("method", ["dpsgd", "coupling", "o2nc"])
def test_a_proximal_term_the_method_would_drop_is_refused(method):
    """DP-SGD and Coupling hand the gradient to an optimizer, and O2NC's update is its online learner's projected
    step: none applies the term (``applies_proximal_term``, of the methods that write their own update). The
    schedule's protocol check once passed for all three and the term was dropped silently. Without the term the
    schedule works as usual."""
    from pl_dp.methods import DPSGD, O2NC, Coupling

    if method == "o2nc":  # its own accountant (the tree's); its loader is its partition, asked by the datamodule
        model = O2NC(nn.Linear(4, 3), clip=1.0, inner_steps=2, privacy=PrivacySpec(epsilon=50.0))
    else:
        cls = DPSGD if method == "dpsgd" else Coupling
        model = cls(nn.Linear(4, 3), clip=1.0, privacy=PrivacySpec(epsilon=5.0, accountant="rdp"))
    data = PrivatePublicDataModule(blobs(60), public=blobs(20, seed=5), batch_size=10, public_batch_size=5)
    with pytest.raises(ConfigError, match=r"proximal term, which \w+'s update does not include"):
        make_trainer(max_steps=4, callbacks=[StagewiseSchedule(stages=2, proximal=0.1)]).fit(model, data)
    make_trainer(max_steps=4, callbacks=[StagewiseSchedule(stages=2, proximal=0.0)]).fit(model, data)
    assert model.private_steps == 4
