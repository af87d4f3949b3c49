"""Invariant 5: privacy state survives checkpoints (kill-and-resume = uninterrupted run)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.callbacks import AllowPrivacySpecChange
from pl_dp.data import PrivatePublicDataModule
from pl_dp.methods import DPSGD, PAZOM, PAZOS, Coupling, DPZero
from pl_dp.privacy.accountants import create_accountant
from tests.conftest import blobs, make_trainer


class Crash(L.Callback):
    """Kills the run (an exception) after ``step`` private steps."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.private_steps == self.step:
            raise RuntimeError("simulated crash")


def assert_resume_is_exact(tmp_path, make_model, make_dm, make_callbacks, max_steps, crash_at, resume_step):
    """Crash a run at ``crash_at`` private steps, resume from the checkpoint of ``resume_step`` in a new
    Trainer, and compare ε and every parameter with an uninterrupted run (bit for bit)."""
    reference = make_model()
    make_trainer(max_steps=max_steps, callbacks=make_callbacks()).fit(reference, make_dm())
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(
            max_steps=max_steps, callbacks=[*make_callbacks(), ckpt, Crash(crash_at)], enable_checkpointing=True
        ).fit(make_model(), make_dm())
    resumed = make_model()
    path = str(tmp_path / f"step={resume_step}.ckpt")
    make_trainer(max_steps=max_steps, callbacks=make_callbacks()).fit(resumed, make_dm(), ckpt_path=path)
    assert resumed.epsilon == reference.epsilon
    for a, b in zip(resumed.net.parameters(), reference.net.parameters()):
        assert torch.equal(a, b)


def _model(spec=None, **kw):
    L.seed_everything(0)
    args = dict(lr=0.1, clip=1.0, smoothing=1e-3, queries=2, privacy=spec, noise_seed=123)
    args.update(kw)
    return DPZero(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), **args)


def _dm():
    return PrivatePublicDataModule(blobs(120), batch_size=20)  # 6 steps per epoch


@pytest.mark.parametrize("crash_at", [12, 9])  # an epoch boundary, and mid-epoch
def test_kill_and_resume_gives_the_same_epsilon_and_parameters(tmp_path, crash_at):
    spec = PrivacySpec(epsilon=3.0, accountant="rdp")
    reference = _model(spec)
    make_trainer(max_epochs=4).fit(reference, _dm())

    killed = _model(spec)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_epochs=4, callbacks=[ckpt, Crash(crash_at + 1)], enable_checkpointing=True).fit(killed, _dm())

    resumed = _model(spec, noise_seed=999)  # the noise state must come from the checkpoint
    path = tmp_path / f"step={crash_at}.ckpt"
    make_trainer(max_epochs=4).fit(resumed, _dm(), ckpt_path=str(path))

    assert resumed.private_steps == reference.private_steps == 24
    assert resumed.accountant.history == reference.accountant.history
    assert resumed.epsilon == reference.epsilon
    for a, b in zip(resumed.net.parameters(), reference.net.parameters()):
        assert torch.equal(a, b)


def test_resume_past_the_plan_is_stopped_by_the_module_itself(tmp_path):
    spec = PrivacySpec(epsilon=1.0, accountant="rdp")
    first = _model(spec)
    trainer = make_trainer(max_epochs=2)
    trainer.fit(first, _dm())
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    resumed = _model(spec)
    make_trainer(max_epochs=6).fit(resumed, _dm(), ckpt_path=str(tmp_path / "end.ckpt"))
    assert resumed.noise_multiplier == first.noise_multiplier  # not re-calibrated
    assert resumed.epsilon <= 1.0
    assert resumed.privacy_exhausted


def test_checkpoint_without_privacy_state_is_refused(tmp_path):
    trainer = make_trainer(max_steps=2)
    model = _model(PrivacySpec(epsilon=2.0, accountant="rdp"))
    trainer.fit(model, _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    ckpt = torch.load(tmp_path / "a.ckpt", weights_only=False)
    del ckpt["pl_dp"]
    torch.save(ckpt, tmp_path / "stripped.ckpt")
    with pytest.raises(ValueError, match="no pl_dp privacy state"):
        make_trainer(max_steps=4).fit(
            _model(PrivacySpec(epsilon=2.0, accountant="rdp")), _dm(), ckpt_path=str(tmp_path / "stripped.ckpt")
        )


def test_resume_with_another_privacy_spec_is_refused(tmp_path):
    trainer = make_trainer(max_steps=2)
    trainer.fit(_model(PrivacySpec(epsilon=2.0, accountant="rdp")), _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match="different privacy spec"):
        make_trainer(max_steps=4).fit(
            _model(PrivacySpec(epsilon=5.0, accountant="rdp")), _dm(), ckpt_path=str(tmp_path / "a.ckpt")
        )


def test_an_explicit_override_keeps_the_spent_history_and_replans_sigma(tmp_path):
    trainer = make_trainer(max_epochs=2)
    first = _model(PrivacySpec(epsilon=1.0, accountant="rdp"))
    trainer.fit(first, _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    spent = first.epsilon
    resumed = _model(PrivacySpec(epsilon=2.0, accountant="rdp"))
    with pytest.warns(UserWarning, match="epsilon spent so far"):
        make_trainer(max_epochs=4, callbacks=[AllowPrivacySpecChange()]).fit(
            resumed, _dm(), ckpt_path=str(tmp_path / "a.ckpt")
        )
    assert resumed.accountant.history[0] == first.accountant.history[0]  # never restarted from zero
    assert resumed.private_steps == 24
    assert spent < resumed.epsilon <= 2.0
    assert resumed.noise_multiplier < first.noise_multiplier  # the 12 steps left share the new budget
    # a fresh accountant with only the new σ would under-report what this run spent
    fresh = create_accountant("rdp").epsilon_after(resumed.delta, 12, resumed.noise_multiplier, _dm().sample_rate)
    assert fresh < resumed.epsilon


def test_an_override_cannot_go_below_what_was_already_spent(tmp_path):
    trainer = make_trainer(max_epochs=2)
    first = _model(PrivacySpec(epsilon=2.0, accountant="rdp"))
    trainer.fit(first, _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert first.epsilon > 0.5
    with pytest.raises(ValueError, match="already spent"):
        make_trainer(max_epochs=4, callbacks=[AllowPrivacySpecChange()]).fit(
            _model(PrivacySpec(epsilon=0.5, accountant="rdp")), _dm(), ckpt_path=str(tmp_path / "a.ckpt")
        )


def test_checkpoint_from_another_method_is_refused(tmp_path):
    class OtherMethod(DPZero):
        pass

    trainer = make_trainer(max_steps=2)
    trainer.fit(_model(PrivacySpec(epsilon=2.0, accountant="rdp")), _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    L.seed_everything(0)
    other = OtherMethod(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)),
        lr=0.1,
        clip=1.0,
        privacy=PrivacySpec(epsilon=2.0, accountant="rdp"),
    )
    with pytest.raises(ValueError, match="written by 'DPZero'"):
        make_trainer(max_steps=4).fit(other, _dm(), ckpt_path=str(tmp_path / "a.ckpt"))


def test_resume_with_another_sample_rate_is_refused(tmp_path):
    spec = PrivacySpec(epsilon=2.0, accountant="rdp")
    trainer = make_trainer(max_steps=2)
    trainer.fit(_model(spec), _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    other_rate = PrivatePublicDataModule(blobs(120), batch_size=30)
    with pytest.raises(ValueError, match="sample rate"):
        make_trainer(max_steps=4).fit(_model(spec), other_rate, ckpt_path=str(tmp_path / "a.ckpt"))


def test_validation_and_test_never_reach_the_accountant():
    spec = PrivacySpec(epsilon=2.0, accountant="rdp")
    model = _model(spec)
    dm = PrivatePublicDataModule(blobs(120), val=blobs(40, seed=1), test=blobs(40, seed=2), batch_size=20)
    trainer = make_trainer(max_steps=3)
    trainer.fit(model, dm)
    history, eps = list(model.accountant.history), model.epsilon
    trainer.validate(model, dm, verbose=False)
    trainer.test(model, dm, verbose=False)
    assert model.accountant.history == history and model.epsilon == eps and model.private_steps == 3


FAMILIES = {
    "pazo-m": (PAZOM, dict(lr=0.05, clip=1.0, alpha=0.5, queries=2)),
    "pazo-s": (PAZOS, dict(lr=0.1, clip=2.0, k=2)),
    "dpsgd-psac-adam": (DPSGD, dict(lr=0.05, clip=1.0, clip_fn="psac", optimizer="adam")),
    "coupling-adamix": (
        Coupling,
        dict(lr=0.1, clip=1.0, alpha=0.5, clip_fn="constant", clip_quantile=0.5, quantile_noise=5.0),
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kill_and_resume_is_exact_for_every_method_family(tmp_path, family):
    """Public-loader position, optimizer moments, the adaptive clip threshold and the noise all resume."""
    cls, kwargs = FAMILIES[family]

    def make_model():
        L.seed_everything(0)
        return cls(nn.Linear(4, 3), privacy=PrivacySpec(epsilon=3.0, accountant="rdp"), noise_seed=5, **kwargs)

    def make_dm():
        return PrivatePublicDataModule(blobs(60), public=blobs(30, seed=5), batch_size=10, public_batch_size=5)

    assert_resume_is_exact(tmp_path, make_model, make_dm, list, max_steps=10, crash_at=8, resume_step=7)
