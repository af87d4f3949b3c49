"""W&B (real client, offline) and CSV logging of a private run."""

import csv
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import wandb
import yaml
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.callbacks import PrivacyBudget, WandbPrivacyLogger
from pl_dp.callbacks.wandb_runs import group_points, read_run
from pl_dp.data import PrivatePublicDataModule
from pl_dp.methods import PAZOM, DPZero
from tests.conftest import blobs, make_trainer


def _settled(read, done, timeout=15.0):
    """``read()`` once ``done`` holds for it, or the last read after ``timeout`` s: the W&B service
    process can still be appending a finished run's records when ``wandb.finish()`` returns under load."""
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.25)
        value = read()
    return value


def _fit(logger, log_private_metrics=False, test=True):
    L.seed_everything(0)
    dm = PrivatePublicDataModule(
        blobs(120),
        public=blobs(24, seed=4),
        val=blobs(40, seed=1),
        test=blobs(40, seed=2),
        batch_size=20,
        public_batch_size=8,
    )
    model = PAZOM(
        nn.Linear(4, 3),
        lr=0.1,
        clip=1.0,
        privacy=PrivacySpec(epsilon=2.0, accountant="rdp"),
        log_private_metrics=log_private_metrics,
    )
    trainer = make_trainer(
        max_epochs=2, logger=logger, log_every_n_steps=1, callbacks=[PrivacyBudget(), WandbPrivacyLogger()]
    )
    trainer.fit(model, dm)
    if test:
        trainer.test(model, dm, verbose=False)
    return model


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    yield tmp_path
    wandb.finish()


@pytest.mark.parametrize("diagnostics", [False, True])
def test_offline_wandb_run_has_config_summary_and_one_epsilon_per_step(offline_wandb, diagnostics):
    logger = WandbLogger(project="pl-dp-tests", save_dir=str(offline_wandb), offline=True)
    model = _fit(logger, log_private_metrics=diagnostics)
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()

    run = _settled(
        lambda: read_run(run_dir), lambda r: "privacy/clip" in r["config"] and "summary/epsilon" in r["summary"]
    )
    config, summary, history = run["config"], run["summary"], run["history"]
    assert "privacy/clip" in config, sorted(config)
    assert config["privacy/clip"] == 1.0
    assert config["privacy/noise_multiplier"] == pytest.approx(model.noise_multiplier)
    assert config["method"] == "PAZOM"
    assert summary["summary/epsilon"] == pytest.approx(model.epsilon)
    assert summary["summary/epsilon"] <= 2.0
    assert "summary/test_acc" in summary and "summary/best_val_acc" in summary
    eps_rows = [r for r in history if "privacy/epsilon" in r]
    assert len(eps_rows) == model.private_steps
    keys = set().union(*history)
    diagnostic_keys = {k for k in keys if k.startswith("diagnostics/")}
    if diagnostics:
        assert "diagnostics/not_private/gamma" in diagnostic_keys
        assert all(
            k.startswith(("diagnostics/not_private/", "diagnostics/cos_zo", "diagnostics/zo_to"))
            for k in diagnostic_keys
        )
    else:
        assert diagnostic_keys == set()


def test_csv_logger_records_the_same_keys(tmp_path):
    model = _fit(CSVLogger(tmp_path, name="csv"))
    metrics = next(Path(tmp_path).rglob("metrics.csv"))
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    header = set(rows[0])
    assert {"privacy/epsilon", "privacy/budget_left", "privacy/private_steps", "summary/epsilon"} <= header
    eps = [float(r["privacy/epsilon"]) for r in rows if r.get("privacy/epsilon")]
    assert len(eps) == model.private_steps and max(eps) <= 2.0
    hparams = yaml.safe_load(next(Path(tmp_path).rglob("hparams.yaml")).read_text())
    assert hparams["privacy/noise_multiplier"] == pytest.approx(model.noise_multiplier)


def test_progress_bar_shows_epsilon_and_budget_left():
    L.seed_everything(0)
    model = _fit(False, test=False)
    trainer_metrics = model.trainer.progress_bar_metrics
    assert "privacy/epsilon" in trainer_metrics and "privacy/budget_left" in trainer_metrics
    assert trainer_metrics["privacy/budget_left"] == pytest.approx(2.0 - trainer_metrics["privacy/epsilon"], abs=1e-5)
    assert torch.isfinite(torch.tensor(trainer_metrics["privacy/epsilon"]))


def test_group_runs_get_a_privacy_utility_chart(offline_wandb):
    for epsilon in (1.0, 4.0):
        logger = WandbLogger(project="pl-dp-tests", save_dir=str(offline_wandb), offline=True, group="sweep")
        L.seed_everything(0)
        dm = PrivatePublicDataModule(
            blobs(120), public=blobs(24, seed=4), test=blobs(40, seed=2), batch_size=20, public_batch_size=8
        )
        model = PAZOM(nn.Linear(4, 3), lr=0.1, privacy=PrivacySpec(epsilon=epsilon, accountant="rdp"))
        trainer = make_trainer(max_epochs=1, logger=logger, callbacks=[WandbPrivacyLogger()])
        trainer.fit(model, dm)
        trainer.test(model, dm, verbose=False)
        run_dir = Path(logger.experiment.dir).parent
        wandb.finish()
    points = _settled(lambda: group_points(run_dir.parent, "sweep"), lambda p: len(p) == 2)
    assert len(points) == 2 and sorted(e for e, _ in points)[1] <= 4.0
    last = read_run(run_dir)
    assert any("privacy_utility_table" in k or "privacy_utility" in k for row in last["history"] for k in row)


class _UserClassifier(L.LightningModule):
    """A user's module that logs its own metric names."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        return self.layer(x)

    def _accuracy(self, batch):
        x, y = batch
        return (self(x).argmax(dim=1) == y).float().mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", self._accuracy(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_acc", self._accuracy(batch))


def test_the_history_reaches_the_last_step_and_the_user_s_metric_names_are_summarized(tmp_path):
    """On main the history of privacy/private_steps stopped at the loggers' last cadence step (60 of 63) and the
    summary knew only pl_dp's own val/acc and test/acc."""
    L.seed_everything(0)
    dm = PrivatePublicDataModule(blobs(120), val=blobs(40, seed=1), test=blobs(40, seed=2), batch_size=20)
    model = DPZero(_UserClassifier(), lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=2.0, accountant="rdp"))
    callback = WandbPrivacyLogger(val_metric="val_acc", test_metric="test_acc")
    trainer = make_trainer(max_epochs=3, logger=CSVLogger(tmp_path), log_every_n_steps=5, callbacks=[callback])
    trainer.fit(model, dm)
    trainer.test(model, dm, verbose=False)
    (path,) = Path(tmp_path).rglob("metrics.csv")
    rows = list(csv.DictReader(path.open()))
    logged_steps = [float(r["privacy/private_steps"]) for r in rows if r.get("privacy/private_steps")]
    assert max(logged_steps) == model.private_steps == 18
    assert any(r.get("summary/best_val_acc") for r in rows) and any(r.get("summary/test_acc") for r in rows)
