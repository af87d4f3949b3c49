"""Lightning conventions users rely on: predict, schedulers, optimizers, their own module, callbacks,
checkpoints, precision, loaders, strategies, and defaults that compose (issue [lightning])."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pl_dp import PrivacySpec
from pl_dp.callbacks import PrivacyBudget, StagewiseSchedule, WandbPrivacyLogger
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods import DPSGD, O2NC, PAZOM, PAZOP, PAZOS, Coupling, DPZero
from pl_dp.methods.parallel import check_strategy
from pl_dp.per_sample import clipped_sum
from pl_dp.privacy import ClipFunction
from tests import catalog
from tests.conftest import blobs, make_trainer

SPEC = PrivacySpec(epsilon=5.0, accountant="rdp")


def _dm(**kw) -> PrivatePublicDataModule:
    return PrivatePublicDataModule(blobs(100), val=blobs(30, seed=1), test=blobs(20, seed=2), batch_size=10, **kw)


# ---- 1. predict ---------------------------------------------------------------------------------
def test_predict_from_python_on_xy_x_only_and_the_datamodule_split():
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    trainer = make_trainer(max_steps=2)
    trainer.fit(model, _dm())
    data = blobs(12, seed=3)
    with_labels = torch.cat(trainer.predict(model, DataLoader(data, batch_size=5)))
    x_only = torch.cat(trainer.predict(model, DataLoader(TensorDataset(data.tensors[0]), batch_size=5)))
    assert with_labels.shape == (12, 3) and torch.equal(with_labels, x_only)
    torch.testing.assert_close(with_labels, model.net(data.tensors[0]))
    assert torch.cat(trainer.predict(model, datamodule=_dm())).shape == (20, 3)  # no predict split: the test set
    own = PrivatePublicDataModule(blobs(100), batch_size=10, predict=TensorDataset(data.tensors[0]))
    assert torch.cat(trainer.predict(model, datamodule=own)).shape == (12, 3)


# ---- 2. LR schedulers -----------------------------------------------------------------------------
class _ScheduledDPZero(DPZero):
    def __init__(self, interval: str, frequency: int, **kw) -> None:
        super().__init__(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC, **kw)
        self.interval, self.frequency = interval, frequency

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.interval, "frequency": self.frequency},
        }


@pytest.mark.parametrize(("interval", "frequency", "steps", "halvings"), [("step", 2, 6, 3), ("epoch", 1, 30, 3)])
def test_lr_schedulers_step_under_manual_optimization(interval, frequency, steps, halvings):
    model = _ScheduledDPZero(interval, frequency)
    make_trainer(max_steps=steps).fit(model, _dm())  # 10 steps per epoch
    assert model.lr == pytest.approx(0.1 * 0.5**halvings)


def test_a_stagewise_schedule_and_an_lr_scheduler_are_refused_together():
    with pytest.raises(ConfigError, match="StagewiseSchedule sets the step size"):
        make_trainer(max_steps=4, callbacks=[StagewiseSchedule(stages=2)]).fit(_ScheduledDPZero("step", 1), _dm())


# ---- 3. optimizers --------------------------------------------------------------------------------
class _AdamWDPSGD(DPSGD):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.trainable_parameters(), lr=0.01)


class _AdamDPZero(DPZero):
    def configure_optimizers(self):
        return torch.optim.Adam(self.trainable_parameters(), lr=0.01)


def test_first_order_methods_apply_the_configured_optimizer_to_the_privatized_gradient():
    model = _AdamWDPSGD(nn.Linear(4, 3), clip=1.0, privacy=SPEC)
    trainer = make_trainer(max_steps=3)
    trainer.fit(model, _dm())
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert all(optimizer.state[p]["step"] == 3 for p in model.net.parameters())  # DP-AdamW: moments of ĝ


def test_methods_that_write_their_own_update_refuse_other_optimizers():
    with pytest.raises(ConfigError, match="accepts only torch.optim.SGD"):
        make_trainer(max_steps=2).fit(_AdamDPZero(nn.Linear(4, 3), clip=1.0, privacy=SPEC), _dm())


# ---- 4. the user's own LightningModule keeps its evaluation ------------------------------------------
class _UserClassifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.epochs_ended = 0

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):  # the user's own (non-private) training: replaced by pl_dp
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_accuracy(self(x), y)
        self.log("user_val_acc", self.val_accuracy)

    def on_validation_epoch_end(self):
        self.epochs_ended += 1

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("user_test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(dim=1)


def test_a_users_lightning_module_keeps_its_validation_test_predict_and_metrics():
    user = _UserClassifier()
    model = DPSGD(user, lr=0.5, clip=1.0, privacy=SPEC)
    trainer = make_trainer(max_epochs=2)
    trainer.fit(model, _dm())
    assert 0.0 <= float(trainer.callback_metrics["user_val_acc"]) <= 1.0
    assert "val/acc" not in trainer.callback_metrics  # the user's evaluation replaces pl_dp's
    assert user.epochs_ended == 2
    assert "user_test_loss" in trainer.test(model, _dm(), verbose=False)[0]
    labels = torch.cat(trainer.predict(model, datamodule=_dm()))
    assert labels.dtype == torch.long and labels.shape == (20,)


# ---- 5. callbacks on modules without the privacy protocol ----------------------------------------------
@pytest.mark.parametrize("callback", [PrivacyBudget(), WandbPrivacyLogger()])
def test_privacy_callbacks_on_a_plain_module_say_what_they_need(callback):
    with pytest.raises(TypeError, match="Wrap your model in a pl_dp method"):
        make_trainer(max_steps=1, callbacks=[callback]).fit(_UserClassifier(), DataLoader(blobs(20), batch_size=5))


# ---- 6. checkpoints as users load them --------------------------------------------------------------
def test_load_from_checkpoint_reports_the_epsilon_spent(tmp_path):
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    trainer = make_trainer(max_steps=20)
    trainer.fit(model, _dm())
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    loaded = DPSGD.load_from_checkpoint(tmp_path / "run.ckpt", net=nn.Linear(4, 3))
    assert loaded.private_steps == 20
    assert loaded.epsilon == model.epsilon > 0
    assert loaded.privacy_report().epsilon == model.epsilon


def test_resuming_past_the_spent_plan_says_so_at_fit_start(tmp_path):
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    trainer = make_trainer(max_epochs=2)
    trainer.fit(model, _dm())
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    resumed = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    with pytest.warns(UserWarning, match="AllowPrivacySpecChange"):
        make_trainer(max_epochs=4).fit(resumed, _dm(), ckpt_path=str(tmp_path / "end.ckpt"))
    assert resumed.privacy_exhausted and resumed.epsilon <= SPEC.epsilon


# ---- 7. precision -------------------------------------------------------------------------------------
#: every method, and DP-SGD in every per-sample mode (hooks and functorch run under autocast, ghost in fp32)
METHODS = {entry.id: entry for entry in [*catalog.METHODS, *catalog.select(catalog.VARIANTS, aspects=("per_sample",))]}


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_trains_under_bf16_mixed_precision(name):
    model = METHODS[name].build(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), privacy=PrivacySpec(5.0))
    dm = PrivatePublicDataModule(blobs(100), public=blobs(40, seed=3), batch_size=10, public_batch_size=8)
    make_trainer(max_steps=3, precision="bf16-mixed").fit(model, dm)
    assert model.private_steps == 3 and 0 < model.epsilon <= 5.0
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.net.parameters())


def test_half_precision_per_example_gradients_are_clipped_with_fp32_norms():
    """Under autocast the per-example gradients are bf16; a norm rounded down in bf16 would let a clipped
    contribution exceed C. Every single-example contribution must stay within C."""
    generator = torch.Generator().manual_seed(0)
    clip = ClipFunction("constant", 1.0)
    worst = 0.0
    for _ in range(20):
        per_example = [(torch.randn(64, 2000, generator=generator) * 3).bfloat16()]
        for i in range(64):
            sums, _, _ = clipped_sum([g[i : i + 1] for g in per_example], clip)
            worst = max(worst, float(torch.linalg.vector_norm(sums[0].double())))
    assert worst <= 1.0 + 1e-6


# ---- 8. loaders ---------------------------------------------------------------------------------------
def test_opacus_poisson_loader_is_accepted_with_its_sample_rate_and_a_secret_generator():
    from opacus.data_loader import DPDataLoader

    loader = DPDataLoader(blobs(100), sample_rate=0.1)
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    make_trainer(max_steps=4).fit(model, train_dataloaders=loader)
    assert model.sample_rate == 0.1 and model.expected_batch_size == pytest.approx(10.0)
    assert model.accountant.history == [(model.noise_multiplier, 0.1, 4)]
    assert loader.batch_sampler.generator is not None  # not torch's global RNG, which seed_everything makes public
    assert not model.privacy_report().user_seeded


def test_fixed_size_batches_are_refused_with_a_message_that_names_them():
    with pytest.raises(PrivacyConfigError, match="fixed-size batches"):
        make_trainer(max_steps=1).fit(
            DPSGD(nn.Linear(4, 3), clip=1.0, privacy=SPEC), train_dataloaders=DataLoader(blobs(40), batch_size=8)
        )


class _Tokenized(Dataset):
    """Variable-length token sequences, as a tokenizer without padding returns them."""

    def __init__(self, n: int = 60) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(n):
            length = int(torch.randint(2, 9, (), generator=generator))
            ids = torch.randint(1, 50, (length,), generator=generator)
            mask = torch.ones(length, dtype=torch.long)
            self.items.append({"input_ids": ids, "attention_mask": mask, "labels": i % 2})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


class _BagOfTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((self.embedding(input_ids) * mask).sum(1) / mask.sum(1).clamp_min(1))


def test_variable_length_dict_examples_batch_with_padding_and_the_loader_options_reach_every_loader():
    dm = PrivatePublicDataModule(_Tokenized(), val=_Tokenized(20), batch_size=10, num_workers=1, fixed_length=False)
    model = DPZero(_BagOfTokens(), lr=0.1, clip=1.0, privacy=SPEC)
    trainer = make_trainer(max_steps=3, limit_val_batches=1)
    trainer.fit(model, dm)
    assert model.private_steps == 3
    assert dm.val_dataloader().num_workers == 1 and dm.train_dataloader().num_workers == 1


class _UserDataModule(L.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.train, self.valid = blobs(80), blobs(20, seed=1)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=16, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.valid, batch_size=10)


def test_an_existing_datamodule_is_made_private():
    dm = PrivatePublicDataModule.from_datamodule(_UserDataModule())
    assert dm.batch_size == 16 and len(dm.private) == 80 and len(dm.val) == 20 and dm.test is None
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    make_trainer(max_steps=2).fit(model, dm)
    assert model.sample_rate == pytest.approx(16 / 80)


# ---- 9. ε where users look ------------------------------------------------------------------------------
def test_the_privacy_report_is_logged_to_every_logger(tmp_path):
    import yaml

    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    make_trainer(max_steps=3, logger=CSVLogger(tmp_path)).fit(model, _dm())
    (hparams,) = tmp_path.rglob("hparams.yaml")
    logged = yaml.safe_load(hparams.read_text())["privacy_report"]
    assert logged["epsilon"] == pytest.approx(model.epsilon) and logged["is_guarantee"] is True


def test_an_untrained_private_model_can_be_tested_and_reports_nothing_spent():
    """`pl-dp test --config` without a checkpoint evaluates the initial model (e.g. a zero-shot prompt)."""
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    assert "test/acc" in make_trainer().test(model, _dm(), verbose=False)[0]
    assert "nothing spent: no private fit yet" in str(model.privacy_report())


# ---- 10. strategies ---------------------------------------------------------------------------------------
def test_unsupported_strategies_are_refused_with_what_to_use():
    check_strategy(SingleDeviceStrategy(torch.device("cpu")), "DPSGD", shardable=False)
    check_strategy(DDPStrategy(), "DPSGD", shardable=False)
    for strategy in (FSDPStrategy(), DeepSpeedStrategy.__new__(DeepSpeedStrategy)):
        with pytest.raises(NotImplementedError, match="strategy='ddp'"):
            check_strategy(strategy, "DPZero", shardable=True)
    for method in ("DPSGD", "Coupling", "O2NC"):  # sharding is refused by name where not implemented
        with pytest.raises(NotImplementedError, match=f"{method} cannot be sharded yet"):
            check_strategy(ModelParallelStrategy(), method, shardable=False)


def test_which_methods_shard_is_declared_by_the_method():
    net = nn.Linear(4, 3)
    assert all(cls(net).supports_sharding for cls in (DPZero, PAZOM, PAZOP, PAZOS))
    assert not O2NC(net).supports_sharding
    assert DPSGD(net, per_sample="ghost").supports_sharding and Coupling(net, per_sample="ghost").supports_sharding
    assert DPSGD(net).supports_sharding and Coupling(net).supports_sharding  # book-keeping, the default
    assert not DPSGD(net, per_sample="hooks").supports_sharding  # per-example gradients of gathered layers


def test_sharding_is_declared_by_each_class_never_inherited():
    """A subclass may change what a step computes: it runs sharded only once its own class says so."""
    net = nn.Linear(4, 3)
    assert not type("MyDPZero", (DPZero,), {})(net).supports_sharding
    assert type("MyDPZero", (DPZero,), {}, shardable=True)(net).supports_sharding


def test_every_method_that_declares_sharding_has_sharded_fits_in_the_fsdp_tests():
    """The classes the FSDP2 test runs (tests/distributed/worker.py's SHARDED_METHODS) cover every exported method
    that declares ``shardable``."""
    from tests.distributed import worker

    declared = {entry.name for entry in catalog.METHODS if entry.cls.shardable}
    tested = {type(build()).__name__ for build in worker.SHARDED_METHODS.values()}
    assert declared == {"DPZero", "PAZOM", "PAZOP", "PAZOS", "DPSGD", "Coupling"}
    assert declared <= tested, sorted(declared - tested)


# ---- 11. defaults compose ------------------------------------------------------------------------------
def _digits_net() -> nn.Module:
    from pl_dp.nets import MLP

    return MLP(64, [32], 10)


@pytest.mark.parametrize("method", catalog.classes(), ids=lambda cls: cls.__name__)
def test_every_method_runs_with_the_bundled_digits_defaults(method):
    from pl_dp.data import DigitsDataModule

    model = method(_digits_net(), privacy=PrivacySpec(epsilon=4.0))  # the method's own accountant
    make_trainer(max_steps=3, limit_val_batches=1).fit(model, DigitsDataModule())
    assert model.private_steps == 3 and 0 < model.epsilon <= 4.0
    assert model.accountant_name == method.default_accountant == ("tree" if method is O2NC else "prv")


def test_every_shipped_config_shows_the_progress_bar():
    from pathlib import Path

    import yaml

    for path in sorted((Path(__file__).resolve().parents[2] / "configs").rglob("*.yaml")):
        trainer = yaml.safe_load(path.read_text()).get("trainer", {})
        assert trainer.get("enable_progress_bar", True), f"{path.name}: epsilon shows in the progress bar"


def test_model_checkpoint_works_with_private_runs(tmp_path):
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/acc", mode="max")
    make_trainer(max_epochs=2, callbacks=[checkpoint], enable_checkpointing=True).fit(model, _dm())
    assert checkpoint.best_model_path
