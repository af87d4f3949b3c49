"""The participation schema banded noise is accounted for, measured on the batches a fit actually trains: step t of a
fit trains a batch of cyclic group t mod b, so an example's participations are at least b steps apart and number at
most the ⌈T/b⌉ compositions the ledger counts — also when batches are drawn and never trained (a loader's workers
drawing ahead of an epoch cut short by ``limit_train_batches``, a module skipping the rest of an epoch) and across a
resume with workers. And the mechanism (σ, clip, q) is fixed for a whole banded fit, and Coupling's α = 1 is refused
at fit start. Found by an independent privacy review (F1, F4, I1)."""

import math
from collections import defaultdict

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.callbacks import AlphaSchedule
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import PrivacyConfigError
from pl_dp.methods import DPSGD, Coupling
from pl_dp.privacy import CyclicPoissonBatchSampler, poisson_loader
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.privacy.sampling import CountingBatchSampler
from tests.conftest import make_trainer
from tests.methods.test_checkpoint import Crash

BANDS, N, BATCH = 4, 400, 10


def indexed(n: int = N) -> TensorDataset:
    """Examples whose first feature is their index: the trained batches say which examples took part."""
    x = torch.randn(n, 5, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.arange(n).float()
    return TensorDataset(x, torch.zeros(n, dtype=torch.long))


class Trained(L.Callback):
    """The examples of every batch a private step trained, with the step's index in its fit."""

    def __init__(self):
        self.steps: list[tuple[int, list[int]]] = []
        self._first = None

    def on_train_start(self, trainer, pl_module):
        self._first = pl_module.private_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((pl_module.private_steps - 1 - self._first, batch[0][:, 0].long().tolist()))

    def participations(self) -> dict[int, list[int]]:
        seen = defaultdict(list)
        for step, examples in self.steps:
            for example in examples:
                seen[example].append(step)
        return seen


def banded(cls: type[DPSGD] = DPSGD, **kwargs) -> DPSGD:
    return cls(
        nn.Linear(5, 3),
        lr=0.1,
        clip=1.0,
        privacy=PrivacySpec(epsilon=8.0, accountant="rdp", noise_multiplier=2.0),
        noise="banded",
        bands=BANDS,
        **kwargs,
    )


def assert_schema(model: DPSGD, trained: Trained, start: int = 0, earlier: int = 0) -> None:
    """Each trained step sampled group (start + t) mod b only; participations ≥ b apart and no more than the
    compositions this fit added to the ``earlier`` ones."""
    sampler = model._sampler
    for step, examples in trained.steps:
        groups = set(sampler.group_of(examples).tolist()) if examples else set()
        assert groups <= {(start + step) % BANDS}, (step, groups)
    participations = trained.participations()
    assert participations, "no example was trained"
    gaps = [b - a for steps in participations.values() for a, b in zip(steps, steps[1:])]
    assert min(gaps, default=BANDS) >= BANDS
    most = max(len(steps) for steps in participations.values())
    compositions = model.accountant.steps - earlier
    assert compositions >= most  # ε is reported for at least as many compositions as participations
    assert compositions == math.ceil(len(trained.steps) / BANDS)


def test_limit_train_batches_with_workers_keeps_the_cyclic_schedule():
    """The loader's worker draws prefetch_factor·num_workers batches ahead; each epoch cut at 2 batches drops the rest.
    Before the fix the next epoch began after the dropped ones: groups 0,1,0,1,… (separation 2), 8 participations for
    4 compositions — ε reported 7.98 for a run whose participations are worth ≥ 10.5."""
    model, trained = banded(), Trained()
    make_trainer(max_epochs=8, limit_train_batches=2, callbacks=[trained]).fit(
        model, PrivatePublicDataModule(indexed(), batch_size=BATCH, num_workers=1)
    )
    assert model.private_steps == 16
    assert_schema(model, trained)


class SkipsTheRestOfEachEpoch(DPSGD):
    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx >= 3:  # e.g. a wall-clock budget per epoch: the batch handed over is drawn, never trained
            return -1
        return None


def test_skipping_the_rest_of_an_epoch_keeps_the_cyclic_schedule():
    model, trained = banded(SkipsTheRestOfEachEpoch), Trained()
    make_trainer(max_epochs=6, callbacks=[trained]).fit(model, PrivatePublicDataModule(indexed(), batch_size=BATCH))
    assert model.private_steps == 18
    assert_schema(model, trained)


def test_a_resume_with_workers_continues_at_the_checkpoints_position(tmp_path):
    """Lightning builds the first epoch's iterator — and the workers draw ahead — before the module restores the
    sampler's position: the data module places its loader there first, so the resumed fit trains P, P + 1, …"""
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_steps=12, callbacks=[ckpt, Crash(7)], enable_checkpointing=True).fit(
            banded(), PrivatePublicDataModule(indexed(), batch_size=BATCH, num_workers=1)
        )
    saved = torch.load(tmp_path / "step=6.ckpt", weights_only=False)["pl_dp"]["sampler"]["position"]
    assert saved == 6
    resumed, trained = banded(), Trained()
    make_trainer(max_steps=12, callbacks=[trained]).fit(
        resumed,
        PrivatePublicDataModule(indexed(), batch_size=BATCH, num_workers=1),
        ckpt_path=str(tmp_path / "step=6.ckpt"),
    )
    assert resumed.private_steps == 12 and resumed._sampler_start == saved
    assert_schema(resumed, trained, start=saved, earlier=math.ceil(saved / BANDS))


class OwnLoader(L.LightningDataModule):
    """A data module of one's own over pl_dp's cyclic loader, with a worker: it cannot be placed at a checkpoint's
    position before Lightning iterates it."""

    def train_dataloader(self):
        return poisson_loader(indexed(), BANDS * BATCH / N, bands=BANDS, steps_per_epoch=N // BATCH, num_workers=1)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(indexed(20), batch_size=10)


def test_a_resume_whose_workers_drew_first_continues_where_they_began(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_steps=12, callbacks=[ckpt, Crash(7)], enable_checkpointing=True).fit(banded(), OwnLoader())
    resumed, trained = banded(), Trained()
    with pytest.warns(UserWarning, match="drew batches from sampler position 0 before the checkpoint's position 6"):
        make_trainer(max_steps=12, callbacks=[trained]).fit(
            resumed, OwnLoader(), ckpt_path=str(tmp_path / "step=6.ckpt")
        )
    assert resumed.private_steps == 12 and resumed._sampler_start == 0
    assert_schema(resumed, trained, start=0, earlier=2)


def test_a_batch_off_the_schedule_is_refused_before_its_release(monkeypatch):
    """The guard behind the realignment: were an epoch to begin elsewhere than at the first untrained position, the
    step is refused before anything is released or recorded."""
    monkeypatch.setattr(CountingBatchSampler, "restart_at", lambda self, position: None)  # the old behaviour
    model = banded()
    with pytest.raises(PrivacyConfigError, match="needs position 2"):
        make_trainer(max_epochs=4, limit_train_batches=2).fit(
            model, PrivatePublicDataModule(indexed(), batch_size=BATCH, num_workers=1)
        )
    assert model.private_steps == 2 and model.accountant.steps == 1  # the refused step released nothing


def test_a_loader_that_reorders_batches_is_refused():
    model = banded()
    loader = poisson_loader(indexed(), BANDS * BATCH / N, bands=BANDS, num_workers=2, in_order=False)
    with pytest.raises(PrivacyConfigError, match="in_order"):
        make_trainer(max_steps=4).fit(model, loader)
    assert model.private_steps == 0


class ChangesTheMechanism(L.Callback):
    def __init__(self, change):
        self.change = change

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.private_steps == 1:
            self.change(pl_module)


def lower_sigma(module):
    module.noise_multiplier = module.noise_multiplier / 4


def raise_the_clip(module):
    module.clip_function = ClipFunction("constant", 4.0, 0.1)


@pytest.mark.parametrize("change", [lower_sigma, raise_the_clip])
def test_the_mechanism_of_a_banded_fit_cannot_change_within_it(change):
    """The ledger records a band at its first step: a σ lowered (a clip raised) inside it was never accounted; and
    even at a band's start one participation's noise spans b rows. Before the fix the history stayed [(2.0, q, 1)]
    while noise at σ/4 was added."""
    model = banded()
    with pytest.raises(PrivacyConfigError, match="within one"):
        make_trainer(max_steps=4, callbacks=[ChangesTheMechanism(change)]).fit(
            model, PrivatePublicDataModule(indexed(), batch_size=BATCH)
        )
    assert model.private_steps == 1  # refused before the second step's release


def test_one_band_still_accounts_a_sigma_change_step_by_step():
    model = DPSGD(
        nn.Linear(5, 3), lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=50.0, accountant="rdp", noise_multiplier=2.0)
    )
    make_trainer(max_steps=4, callbacks=[ChangesTheMechanism(lower_sigma)]).fit(
        model, PrivatePublicDataModule(indexed(), batch_size=BATCH)
    )
    assert [entry[0] for entry in model.accountant.history] == [2.0, 0.5]


@pytest.mark.parametrize("anneal_steps, refused", [(3, True), (100, False)])
def test_an_alpha_schedule_reaching_one_is_refused_at_fit_start(anneal_steps, refused):
    """Coupling with banded noise cannot skip the private batch (α = 1) within a fit; a schedule that would get there
    within the plan is refused before the first step, not at that step after ε was spent."""
    model = Coupling(
        nn.Linear(5, 3),
        clip=1.0,
        noise="banded",
        bands=2,
        privacy=PrivacySpec(epsilon=8.0, accountant="rdp", noise_multiplier=2.0),
    )
    trainer = make_trainer(max_steps=8, callbacks=[AlphaSchedule(anneal_steps=anneal_steps)])
    data = PrivatePublicDataModule(indexed(), public=indexed(50), batch_size=BATCH)
    if refused:
        with pytest.raises(PrivacyConfigError, match="reaches alpha=1 at step 4"):
            trainer.fit(model, data)
        assert model.private_steps == 0 and model.epsilon == 0.0
    else:
        trainer.fit(model, data)
        assert model.private_steps == 8


def test_the_sampler_draws_again_from_the_first_position_no_step_took():
    """The sampler alone: an iteration abandoned after drawing ahead, restarted at the first untaken position, yields
    that position's batch again (the same batch: batch i is a function of (seed, i)) and then the next ones."""
    sampler = CyclicPoissonBatchSampler(N, 0.4, bands=BANDS, steps_per_epoch=10, seed=1)
    first = iter(sampler)
    drawn = [next(first) for _ in range(3)]  # a loader's workers drawing ahead
    assert sampler.take() == 0 and sampler.first_untaken() == 1 and sampler.position == 3
    sampler.restart_at(1)
    again = list(sampler)  # the next epoch's iteration
    assert again[0] == drawn[1] and len(again) == 9 and sampler.take() == 1
    assert sampler.first_untaken() == 2
