"""Privacy state survives checkpoints; secrets (the noise key, the sampling seed) do not.

Kill-and-resume gives the same ε and the same distribution of parameters; bit-identical parameters
only in reproduction mode, when the user seeded both secrets (noise and sampling)."""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_dp import PrivacySpec
from pl_dp.callbacks import AllowPrivacySpecChange
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import PrivacyConfigError
from pl_dp.methods import DPSGD, DPZero
from pl_dp.privacy.accountants import create_accountant
from pl_dp.privacy.noise import NoiseSource, _seed63
from pl_dp.privacy.report import PrivacyReport
from tests import catalog
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
    Trainer, and compare ε and every parameter with an uninterrupted run (bit for bit).

    ``resume_step`` must be the last checkpoint before the crash: resuming from an older one repeats steps
    a saved checkpoint already released, which the privacy journal (rightly) accounts a second time.

    Reproduction mode: ``make_model`` must pass ``noise_seed`` and ``make_dm`` a ``sampling_seed`` —
    the resumed run re-derives both secrets from the user's seeds, never from the checkpoint."""
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
    args = dict(lr=0.1, clip=1.0, smoothing=1e-3, queries=2, privacy=spec)
    args.update(kw)
    return DPZero(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), **args)


def _dm(**kw):
    return PrivatePublicDataModule(blobs(120), batch_size=20, **kw)  # 6 steps per epoch


@pytest.mark.parametrize("crash_at", [12, 9])  # an epoch boundary, and mid-epoch
def test_reproduction_mode_resume_is_bit_identical(tmp_path, crash_at):
    """With both secrets seeded by the user, a resume re-derives them from the seeds: bit-identical."""
    spec = PrivacySpec(epsilon=3.0, accountant="rdp")
    reference = _model(spec, noise_seed=123)
    make_trainer(max_epochs=4).fit(reference, _dm(sampling_seed=7))

    killed = _model(spec, noise_seed=123)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_epochs=4, callbacks=[ckpt, Crash(crash_at + 1)], enable_checkpointing=True).fit(
            killed, _dm(sampling_seed=7)
        )

    resumed = _model(spec, noise_seed=123)
    make_trainer(max_epochs=4).fit(resumed, _dm(sampling_seed=7), ckpt_path=str(tmp_path / f"step={crash_at}.ckpt"))

    assert resumed.private_steps == reference.private_steps == 24
    assert resumed.accountant.history == reference.accountant.history
    assert resumed.epsilon == reference.epsilon
    for a, b in zip(resumed.net.parameters(), reference.net.parameters()):
        assert torch.equal(a, b)
    assert resumed.privacy_report().user_seeded == ("noise", "sampling")


def _zero_gradient_loss(net, batch):
    x, _ = batch
    return (net(x) * 0.0).sum(dim=1)  # every clipped gradient is 0: an update is the DP noise alone


def test_a_resume_draws_fresh_noise_so_a_checkpoint_cannot_replay_or_remove_it(tmp_path):
    """Findings 2 and 3 of the audit, black-box: from one checkpoint, the continuation's noise must be
    unpredictable. Two resumes from the same checkpoint, and the original continuation, must add
    independent noise of the accounted scale (not the same noise, which would let whoever holds the
    checkpoint subtract it, or difference two runs on D and D′ to read one record's contribution)."""
    spec = PrivacySpec(epsilon=50.0, accountant="rdp", noise_multiplier=1.0)

    def model():
        L.seed_everything(0)
        return DPSGD(nn.Linear(100, 100), loss=_zero_gradient_loss, lr=1.0, clip=1.0, privacy=spec)

    def dm():
        inputs = torch.randn(200, 100, generator=torch.Generator().manual_seed(0))
        return PrivatePublicDataModule(TensorDataset(inputs, torch.zeros(200, dtype=torch.long)), batch_size=20)

    original = model()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    make_trainer(max_steps=4, callbacks=[ckpt], enable_checkpointing=True).fit(original, dm())
    start = torch.load(tmp_path / "step=2.ckpt", map_location="cpu", weights_only=False)["state_dict"]["net.weight"]
    updates = [original.net.weight.detach() - start]
    for resume in (1, 2):
        resumed = model()
        make_trainer(max_steps=4).fit(resumed, dm(), ckpt_path=str(tmp_path / "step=2.ckpt"))
        # every continuation released is accounted (the journal): 4 original steps + 2 per resume
        assert resumed.accountant.steps == 4 + 2 * resume and resumed.epsilon > original.epsilon
        updates.append(resumed.net.weight.detach() - start)
    expected_std = math.sqrt(2) * 1.0 * 1.0 * 1.0 / 20  # two steps of lr·σ·C/b per coordinate
    for u in updates:
        assert u.std().item() == pytest.approx(expected_std, rel=0.05)  # the accounted noise, every time
    flat = torch.stack([u.flatten() for u in updates])
    correlation = torch.corrcoef(flat)
    off_diagonal = correlation[~torch.eye(3, dtype=torch.bool)]
    assert off_diagonal.abs().max() < 0.05  # 10,000 coordinates: independent noise has |r| ~ 0.01


def _secret_patterns(model, sampler) -> list[bytes]:
    key, seed = model.noise._key, sampler.seed
    return [key, seed.to_bytes(8, "little"), str(seed).encode(), str(_seed63(key)).encode()]


def test_no_secret_is_written_to_checkpoints_hparams_or_logs(tmp_path):
    """Finding 1 and 2: the sampling seed and the noise key exist in process memory only."""
    from lightning.pytorch.loggers import CSVLogger

    model = _model(PrivacySpec(epsilon=3.0, accountant="rdp"))
    dm = DigitsLikeModule()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    logger = CSVLogger(tmp_path / "logs")
    trainer = make_trainer(max_steps=6, callbacks=[ckpt], enable_checkpointing=True, logger=logger, log_every_n_steps=1)
    trainer.fit(model, dm)
    patterns = _secret_patterns(model, model._sampler)
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert any(f.suffix == ".ckpt" for f in files) and any(f.name == "hparams.yaml" for f in files)
    for f in files:
        content = f.read_bytes()
        for pattern in patterns:
            assert pattern not in content, f"a secret of the run is written to {f.relative_to(tmp_path)}"
    state = torch.load(next(tmp_path.rglob("*.ckpt")), map_location="cpu", weights_only=False)["pl_dp"]
    assert "noise" not in state and "seed" not in state["sampler"]


class DigitsLikeModule(PrivatePublicDataModule):
    """A datamodule that saves its hyperparameters, as the bundled ones do."""

    def __init__(self, batch_size: int = 20, seed: int = 0, sampling_seed: int | None = None) -> None:
        super().__init__(blobs(120), batch_size=batch_size, seed=seed, sampling_seed=sampling_seed)
        self.save_hyperparameters()


def test_two_runs_of_one_config_sample_different_batches():
    """Finding 1: with the same config and global seed, which steps include an example is not fixed."""

    class Record(L.Callback):
        def __init__(self):
            self.batches = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.batches.append(batch[0].sum().item())

    runs = []
    for _ in range(2):
        record = Record()
        make_trainer(max_steps=6, callbacks=[record]).fit(_model(PrivacySpec(3.0, accountant="rdp")), _dm())
        runs.append(record.batches)
    assert runs[0] != runs[1]
    seeded = []
    for _ in range(2):
        record = Record()
        make_trainer(max_steps=6, callbacks=[record]).fit(
            _model(PrivacySpec(3.0, accountant="rdp")), _dm(sampling_seed=3)
        )
        seeded.append(record.batches)
    assert seeded[0] == seeded[1]  # reproduction mode, on request only


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
    with pytest.raises(PrivacyConfigError, match="no pl_dp privacy state"):
        make_trainer(max_steps=4).fit(
            _model(PrivacySpec(epsilon=2.0, accountant="rdp")), _dm(), ckpt_path=str(tmp_path / "stripped.ckpt")
        )


def test_resume_with_another_privacy_spec_is_refused(tmp_path):
    trainer = make_trainer(max_steps=2)
    trainer.fit(_model(PrivacySpec(epsilon=2.0, accountant="rdp")), _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(PrivacyConfigError, match="different privacy spec"):
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
    fresh = create_accountant("rdp").epsilon_after(
        resumed.delta, 12, noise_multiplier=resumed.noise_multiplier, sample_rate=_dm().sample_rate
    )
    assert fresh < resumed.epsilon


def test_a_resume_under_a_new_spec_reports_each_segment_it_ran(tmp_path):
    """The report of a run whose plan changed shows every (σ, q, steps) it ran: read literally, it gives its ε."""
    first = _model(PrivacySpec(epsilon=2.0, accountant="rdp"))
    trainer = make_trainer(max_steps=4)
    trainer.fit(first, _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    resumed = _model(PrivacySpec(epsilon=4.0, accountant="rdp"))
    trainer = make_trainer(max_steps=8, callbacks=[AllowPrivacySpecChange()])
    with pytest.warns(UserWarning, match="epsilon spent so far"):
        trainer.fit(resumed, _dm(), ckpt_path=str(tmp_path / "a.ckpt"))
    trainer.save_checkpoint(tmp_path / "b.ckpt")
    q = _dm().sample_rate
    old, new = first.noise_multiplier, resumed.noise_multiplier
    assert new != old
    for report in (resumed.privacy_report(), PrivacyReport.from_checkpoint(tmp_path / "b.ckpt")):
        assert report.segments == ((old, q, 4), (new, q, 4))
        assert report.to_dict()["segments"] == [
            {"noise_multiplier": old, "sample_rate": q, "steps": 4},
            {"noise_multiplier": new, "sample_rate": q, "steps": 4},
        ]
        text = str(report)
        assert f"4 steps at noise multiplier {old:.4g}, sample rate {q:.4g}" in text
        assert f"4 steps at noise multiplier {new:.4g}, sample rate {q:.4g}" in text
        assert "after 4 private steps a resume changed the privacy spec (epsilon 2 -> 4)" in text
        assert report.spec_changes[0]["from"]["epsilon"] == 2.0
        # the segments, composed by a fresh accountant, give the reported epsilon
        literal = create_accountant("rdp")
        for sigma, rate, steps in report.segments:
            literal.step(noise_multiplier=sigma, sample_rate=rate, num_steps=steps)
        assert literal.get_epsilon(report.delta) == pytest.approx(report.epsilon, rel=1e-12)
    one_plan = str(first.privacy_report())  # a run of one plan keeps its one line
    assert f"noise multiplier {old:.4g}; 4 private steps" in one_plan and "segment" not in one_plan


def test_resuming_a_finished_run_under_another_spec_is_refused_unless_allowed(tmp_path):
    """A checkpoint with no step left to train (max_steps reached) is still checked against the new spec."""
    first = _model(PrivacySpec(epsilon=2.0, accountant="rdp"))
    trainer = make_trainer(max_steps=2)
    trainer.fit(first, _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(PrivacyConfigError, match="different privacy spec"):
        make_trainer(max_steps=2).fit(
            _model(PrivacySpec(epsilon=4.0, accountant="rdp")), _dm(), ckpt_path=str(tmp_path / "a.ckpt")
        )
    resumed = _model(PrivacySpec(epsilon=4.0, accountant="rdp"))
    make_trainer(max_steps=2, callbacks=[AllowPrivacySpecChange()]).fit(
        resumed, _dm(), ckpt_path=str(tmp_path / "a.ckpt")
    )
    report = resumed.privacy_report()
    assert resumed.private_steps == 2 and report.epsilon == pytest.approx(first.epsilon, rel=1e-12)
    assert report.segments == ((first.noise_multiplier, _dm().sample_rate, 2),)  # what ran, and nothing else
    text = str(report)
    assert f"noise multiplier {first.noise_multiplier:.4g}; 2 private steps" in text
    assert "target epsilon 4" in text
    assert "after 2 private steps a resume changed the privacy spec (epsilon 2 -> 4)" in text
    assert "planned for target epsilon 2" in text


def test_a_finished_resume_of_an_earlier_checkpoint_counts_the_whole_lineage_and_keeps_it(tmp_path):
    """Lightning trains nothing when the checkpoint has no step left, so no journal segment opens: ε must still count
    every step the lineage released after that checkpoint, and a checkpoint saved then must keep the lineage (an
    independent review found it reported 5 of 10 steps, and a resume of the re-saved checkpoint 6 of 11)."""
    first = _model(PrivacySpec(epsilon=8.0, accountant="rdp", noise_multiplier=1.0))
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    make_trainer(max_steps=4, callbacks=[ckpt], enable_checkpointing=True, default_root_dir=tmp_path).fit(first, _dm())
    finished = _model(PrivacySpec(epsilon=8.0, accountant="rdp", noise_multiplier=1.0))
    trainer = make_trainer(max_steps=2)
    trainer.fit(finished, _dm(), ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert finished.private_steps == 2 and finished.epsilon == pytest.approx(first.epsilon, rel=1e-12)
    trainer.save_checkpoint(tmp_path / "again.ckpt")
    again = _model(PrivacySpec(epsilon=8.0, accountant="rdp", noise_multiplier=1.0))
    make_trainer(max_steps=3).fit(again, _dm(), ckpt_path=str(tmp_path / "again.ckpt"))
    assert again.accountant.steps == 5  # the lineage's 4, and this resume's one


def test_an_override_cannot_go_below_what_was_already_spent(tmp_path):
    trainer = make_trainer(max_epochs=2)
    first = _model(PrivacySpec(epsilon=2.0, accountant="rdp"))
    trainer.fit(first, _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert first.epsilon > 0.5
    with pytest.raises(PrivacyConfigError, match="already spent"):
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
    with pytest.raises(PrivacyConfigError, match="written by 'DPZero'"):
        make_trainer(max_steps=4).fit(other, _dm(), ckpt_path=str(tmp_path / "a.ckpt"))


def test_a_privacy_state_of_an_unknown_version_is_refused():
    """The version written with every checkpoint is read: a newer pl_dp's state is refused, never guessed at."""
    model = _model(PrivacySpec(epsilon=2.0, accountant="rdp"))
    make_trainer(max_steps=2).fit(model, _dm())
    state = model.privacy_state_dict()
    assert state["version"] == model.PRIVACY_STATE_VERSION
    for version in (model.PRIVACY_STATE_VERSION + 1, 0, "2"):
        with pytest.raises(PrivacyConfigError, match=f"version {version!r}; this pl_dp reads versions 1 to"):
            _model(PrivacySpec(epsilon=2.0, accountant="rdp")).load_privacy_state_dict({**state, "version": version})
    for version in (1, model.PRIVACY_STATE_VERSION):  # older states load (version 1's noise state is ignored)
        resumed = _model(PrivacySpec(epsilon=2.0, accountant="rdp"))
        resumed.load_privacy_state_dict({**state, "version": version})
        assert resumed.private_steps == model.private_steps


def test_resume_with_another_sample_rate_is_refused(tmp_path):
    spec = PrivacySpec(epsilon=2.0, accountant="rdp")
    trainer = make_trainer(max_steps=2)
    trainer.fit(_model(spec), _dm())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    other_rate = PrivatePublicDataModule(blobs(120), batch_size=30)
    with pytest.raises(PrivacyConfigError, match="sample rate"):
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


#: one method per kind of state a resume restores (a kill-and-resume fit each, so not every catalog entry): the
#: public loader's position (PAZO-M), an own update outside the zeroth-order engine (PAZO-S), an optimizer's moments
#: (DP-SGD with Adam) and an adaptive clip threshold (AdaMix); the other methods resume through the same code
FAMILIES = {entry.id: entry for entry in catalog.by_id("pazo-m", "pazo-s", "dpsgd-psac-adam", "coupling-adamix")}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kill_and_resume_is_exact_for_every_method_family(tmp_path, family):
    """Reproduction mode: public-loader position, optimizer moments and the adaptive clip threshold resume,
    and the user-seeded secrets are re-derived from their seeds."""
    entry = FAMILIES[family]

    def make_model():
        L.seed_everything(0)
        return entry.build(privacy=PrivacySpec(epsilon=3.0, accountant="rdp"), noise_seed=5)

    def make_dm():
        return PrivatePublicDataModule(
            blobs(60), public=blobs(30, seed=5), batch_size=10, public_batch_size=5, sampling_seed=2
        )

    assert_resume_is_exact(tmp_path, make_model, make_dm, list, max_steps=10, crash_at=8, resume_step=7)


def test_every_fit_rereads_its_loader_replans_and_composes_epsilon():
    """Finding 5: a second ``fit`` of the same module was accounted at the first fit's sample rate (ε 0.620
    reported, 3.783 true) and accepted a shuffling loader. Each fit must re-read and re-plan; ε composes."""
    spec = PrivacySpec(epsilon=60.0, accountant="rdp", noise_multiplier=1.0)
    L.seed_everything(0)
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=spec)
    make_trainer(max_steps=5).fit(model, PrivatePublicDataModule(blobs(200), batch_size=2))  # q = 0.01
    make_trainer(max_steps=5).fit(model, PrivatePublicDataModule(blobs(200), batch_size=100))  # q = 0.5
    assert model.accountant.history == [(1.0, 0.01, 5), (1.0, 0.5, 5)]
    both = create_accountant("rdp")
    both.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=5)
    both.step(noise_multiplier=1.0, sample_rate=0.5, num_steps=5)
    assert (
        model.epsilon
        == both.get_epsilon(model.delta)
        > create_accountant("rdp").epsilon_after(model.delta, 10, noise_multiplier=1.0, sample_rate=0.01)
    )
    shuffled = DataLoader(blobs(200), batch_size=20, shuffle=True)
    with pytest.raises(PrivacyConfigError, match="Poisson"):
        make_trainer(max_steps=5).fit(model, train_dataloaders=shuffled)
    assert model.accountant.steps == 10


def test_later_fits_are_calibrated_on_what_earlier_fits_spent():
    model = _model(PrivacySpec(epsilon=2.0, accountant="rdp"))
    make_trainer(max_steps=12).fit(model, _dm())
    first, first_sigma = model.epsilon, model.noise_multiplier
    make_trainer(max_steps=12).fit(model, _dm())  # the same target for the total: much noisier
    assert model.private_steps == 24 and first < model.epsilon <= 2.0
    assert model.noise_multiplier > first_sigma
    one_step = create_accountant("rdp").epsilon_after(model.delta, 12, noise_multiplier=1.0, sample_rate=1 / 6)
    target = one_step * 1.2  # a fixed sigma = 1 meets the target for 12 steps, not for 24
    fixed = _model(PrivacySpec(epsilon=target, accountant="rdp", noise_multiplier=1.0))
    make_trainer(max_steps=12).fit(fixed, _dm())
    with pytest.raises(PrivacyConfigError, match="already spent"):
        make_trainer(max_steps=12).fit(fixed, _dm())
    assert fixed.private_steps == 12


def _journal_run(tmp_path, crash_at=None, ckpt_path=None, max_steps=16, spec=None):
    """DPSGD with a checkpoint every 4 steps and every step logged; optionally crashed or resumed."""
    from lightning.pytorch.loggers import CSVLogger

    spec = spec or PrivacySpec(epsilon=50.0, accountant="rdp", noise_multiplier=1.0)
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=spec)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    callbacks = [ckpt] + ([Crash(crash_at)] if crash_at else [])
    trainer = make_trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        enable_checkpointing=True,
        logger=CSVLogger(tmp_path / "logs"),
        log_every_n_steps=1,
    )
    trainer.fit(model, _dm(), ckpt_path=ckpt_path)
    return model


def test_steps_a_crashed_run_logged_after_its_checkpoint_are_accounted_on_resume(tmp_path):
    """The crashed run logged steps 9 and 10 after its step-8 checkpoint; the resume repeats them with fresh
    noise. The adversary holds both, so the resumed run's ε composes 10 + 8 steps, not 16."""
    with pytest.raises(RuntimeError, match="simulated crash"):
        _journal_run(tmp_path, crash_at=10)
    checkpoint = str(tmp_path / "ckpt" / "step=8.ckpt")
    resumed = _journal_run(tmp_path, ckpt_path=checkpoint)
    assert resumed.private_steps == 16 and resumed.accountant.steps == 18
    expected = create_accountant("rdp")
    expected.step(noise_multiplier=1.0, sample_rate=1 / 6, num_steps=18)
    assert resumed.epsilon == pytest.approx(expected.get_epsilon(resumed.delta))

    again = _journal_run(tmp_path, ckpt_path=checkpoint)  # a second continuation of the same checkpoint
    assert again.accountant.steps == 18 + 8
    from pl_dp.privacy import PrivacyReport

    assert PrivacyReport.from_checkpoint(checkpoint).private_steps == 8  # the checkpoint itself is unchanged
    # the report says where the steps beyond this line of training come from (it said "16 private steps" only)
    assert "epsilon composes 26 private steps: the 16 of this line of training and 10 more" in str(
        again.privacy_report()
    )


def test_the_budget_guard_counts_the_journaled_steps(tmp_path):
    spec = PrivacySpec(epsilon=4.0, accountant="rdp")  # sigma calibrated for 16 steps
    with pytest.raises(RuntimeError, match="simulated crash"):
        _journal_run(tmp_path, crash_at=10, spec=spec)
    with pytest.warns(UserWarning, match="would spend epsilon"):
        resumed = _journal_run(tmp_path, ckpt_path=str(tmp_path / "ckpt" / "step=8.ckpt"), spec=spec)
    assert resumed.privacy_exhausted and resumed.epsilon <= 4.0
    assert resumed.accountant.steps == 16 and resumed.private_steps == 14  # 2 steps of the plan went to the crash


def test_a_resume_without_its_journal_says_what_it_cannot_count(tmp_path):
    import shutil

    _journal_run(tmp_path, max_steps=8)
    shutil.rmtree(tmp_path / "ckpt" / "pl_dp_journal")
    with pytest.warns(UserWarning, match="no privacy journal of this run was found"):
        resumed = _journal_run(tmp_path, ckpt_path=str(tmp_path / "ckpt" / "step=8.ckpt"))
    assert resumed.accountant.steps == 16


_LOOSE = PrivacySpec(epsilon=50.0, accountant="rdp", noise_multiplier=1.0)  # no budget stop in the retries


def _flat(path) -> torch.Tensor:
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return torch.cat([state["net.weight"].flatten(), state["net.bias"].flatten()]).double()


@pytest.mark.parametrize("noise", [{}, {"noise": "banded", "bands": 2}], ids=["independent", "banded"])
def test_a_retry_in_the_same_process_from_an_older_checkpoint_draws_fresh_noise(tmp_path, noise):
    """Finding 3 of an independent review: the noise key was drawn once, when the module was built, so fitting the
    same module again from an older checkpoint (a notebook, a retry loop after a crash) drew the same noise for the
    steps the crashed fit had released. Each update here is the noise alone (zero gradients): with the key reused,
    the retry's release of step 3 equalled the crashed fit's, and with banded noise (b = 2) their difference was
    c₁ times step 2's whole noise. Every fit now draws its own key."""
    model = DPSGD(nn.Linear(4, 3), loss=_zero_gradient_loss, lr=1.0, clip=1.0, privacy=_LOOSE, **noise)
    data = PrivatePublicDataModule(blobs(200), batch_size=10)

    def saving(name):
        return ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=1, save_top_k=-1, filename="{step}")

    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_steps=10, callbacks=[saving("crashed"), Crash(5)], enable_checkpointing=True).fit(model, data)
    make_trainer(max_steps=10, callbacks=[saving("retry")], enable_checkpointing=True).fit(
        model, data, ckpt_path=str(tmp_path / "crashed" / "step=2.ckpt")
    )
    crashed = {t: _flat(tmp_path / "crashed" / f"step={t}.ckpt") for t in (1, 2, 3)}
    retried = _flat(tmp_path / "retry" / "step=3.ckpt")
    release, again = crashed[2] - crashed[3], crashed[2] - retried  # step 2's release (SGD, lr 1), twice
    assert release.abs().min() > 0 and again.abs().min() > 0
    assert not torch.allclose(release, again, atol=1e-6)
    if noise:  # the difference is not step 1's noise (c₁ = 1/2): that release keeps it
        assert not torch.allclose((again - release) / 0.5, crashed[1] - crashed[2], atol=1e-5)
    # both fits' releases are accounted: the crashed fit's 4 checkpointed steps (its 5th never left the process)
    assert model.accountant.steps == (4 + 8 if not noise else 2 + 4)


def test_a_loader_reused_by_a_retry_samples_fresh_batches(tmp_path):
    """The same for a private loader the user built and passes to both fits: its sampler lived across them with
    the same seed, so the retry from an older checkpoint sampled again exactly the batches of the steps the crashed
    fit had released. Every fit now draws its own sampling seed (unless the user seeded it)."""
    from pl_dp.privacy import poisson_loader

    class Batches(L.Callback):
        def __init__(self):
            self.seen = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen[pl_module.private_steps] = batch[0].clone()

    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=_LOOSE)
    loader = poisson_loader(blobs(200), sample_rate=0.25, steps_per_epoch=10)
    crashed, retried = Batches(), Batches()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_steps=8, callbacks=[ckpt, crashed, Crash(6)], enable_checkpointing=True).fit(model, loader)
    make_trainer(max_steps=8, callbacks=[retried]).fit(model, loader, ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert sorted(retried.seen) == [2, 3, 4, 5, 6, 7]
    for step in (2, 3, 4, 5):  # released by both fits: never the same sample twice
        a, b = crashed.seen[step], retried.seen[step]
        assert a.shape != b.shape or not torch.equal(a, b), step


def test_a_reused_loader_whose_workers_drew_ahead_is_refused_and_a_first_fit_keeps_its_seed():
    """A loader's workers draw batches before a module hears of the fit: a reused loader's were drawn with the earlier
    fit's seed (the batches it released), so the retry is refused; a loader's first fit keeps its construction seed
    (redrawing it after the workers drew would mix two group assignments of cyclic sampling)."""
    from pl_dp.privacy import poisson_loader

    loader = poisson_loader(blobs(200), sample_rate=0.25, steps_per_epoch=10, num_workers=1)
    seed = loader.batch_sampler.seed
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=_LOOSE)
    make_trainer(max_steps=2).fit(model, loader)
    assert loader.batch_sampler.seed == seed
    with pytest.raises(PrivacyConfigError, match="used by an earlier fit, and its workers already drew"):
        make_trainer(max_steps=4).fit(model, loader)


def test_a_user_seeded_sampler_keeps_its_seed_across_fits():
    """Reproduction mode: a seeded sampler is not redrawn (its batches are the seed's, by the user's choice)."""
    from pl_dp.privacy import poisson_loader

    loader = poisson_loader(blobs(200), sample_rate=0.25, seed=5, steps_per_epoch=10)
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, noise_seed=3, privacy=_LOOSE)
    keys = []
    for _ in range(2):
        make_trainer(max_steps=2).fit(model, loader)
        keys.append((model.noise._key, loader.batch_sampler.seed))
    assert keys[0] == keys[1] == (NoiseSource(3)._key, 5)


def test_a_loader_a_fit_left_mid_epoch_serves_another_modules_fit():
    """A fit that skipped the rest of its epoch left drawn, untaken positions in the loader's sampler; the next fit
    (another module, num_workers=0) starts from its position — those leftovers are forgotten at teardown, not read as
    a worker's draws under an earlier seed."""
    from pl_dp.privacy import poisson_loader

    class SkipRestOfEpoch(DPSGD):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 2 else None

    loader = poisson_loader(blobs(200), sample_rate=0.05, steps_per_epoch=20)
    first = SkipRestOfEpoch(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=_LOOSE)
    make_trainer(max_epochs=1).fit(first, loader)
    assert not loader.batch_sampler.drawing
    second = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=_LOOSE)
    make_trainer(max_steps=2).fit(second, loader)
    assert second.private_steps == 2


def test_an_opacus_loader_reused_gets_a_fresh_generator_and_is_not_called_user_seeded():
    """pl_dp gives an Opacus DPDataLoader without a generator a secret one; a later fit draws another and does not
    mistake pl_dp's for the user's (which would mark the run USER-SEEDED)."""
    from opacus.data_loader import DPDataLoader

    loader = DPDataLoader.from_data_loader(DataLoader(blobs(200), batch_size=10))
    generators, reports = [], []
    for _ in range(2):
        model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=_LOOSE)
        make_trainer(max_steps=2).fit(model, loader)
        generators.append(loader.batch_sampler.generator)
        reports.append(str(model.privacy_report()))
    assert generators[0] is not generators[1]
    assert not any("USER-SEEDED" in report for report in reports)
