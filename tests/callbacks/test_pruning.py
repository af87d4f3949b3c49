"""PruningSchedule (DP-ZOPO): masks per strategy, only masked coordinates train, no private data, exact resume."""

import lightning as L
import pytest
import torch
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.callbacks import PruningSchedule, StagewiseSchedule
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError
from pl_dp.methods import PAZOM, PAZOS, DPZero
from tests.conftest import blobs, make_trainer
from tests.methods.test_checkpoint import assert_resume_is_exact

SPEC = PrivacySpec(epsilon=3.0, accountant="rdp")


def _net():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _model(cls=DPZero, **kw):
    L.seed_everything(0)
    args = dict(lr=0.05, clip=1.0, smoothing=1e-3, privacy=SPEC, noise_seed=5)
    args.update(kw)
    return cls(_net(), **args)


def _dm(seed=0, n=100):
    return PrivatePublicDataModule(blobs(n, seed=seed), val=blobs(30, seed=9), batch_size=10, sampling_seed=1)


class Masks(L.Callback):
    """The mask in force at each step."""

    def __init__(self):
        self.masks = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.masks.append(torch.cat([d.reshape(-1) for d in pl_module.direction_mask.dense()]))


def test_static_pruning_trains_exactly_the_masked_coordinates():
    model = _model()
    start = torch.cat([p.detach().reshape(-1).clone() for p in model.net.parameters()])
    pruning = PruningSchedule(rates=0.1, strategy="static")
    make_trainer(max_steps=20, callbacks=[pruning]).fit(model, _dm())
    kept = torch.cat([d.reshape(-1) for d in pruning.mask.dense()]) != 0
    end = torch.cat([p.detach().reshape(-1) for p in model.net.parameters()])
    assert int(kept.sum()) == round(0.1 * start.numel())
    assert torch.equal(end != start, kept)  # all trained coordinates moved, no frozen one did
    assert model.accountant.steps == 20 and model.epsilon <= 3.0


def test_dynamic_and_incremental_masks_follow_their_definitions():
    runs = {}
    for strategy in ("dynamic", "incremental"):
        model, record = _model(), Masks()
        pruning = PruningSchedule(rates=[0.1, 0.2, 0.4], strategy=strategy, score="autograd")
        make_trainer(max_steps=70, callbacks=[StagewiseSchedule(stages=3, proximal=0.0), pruning, record]).fit(
            model, _dm()
        )
        stage_masks = [record.masks[0] != 0, record.masks[10] != 0, record.masks[30] != 0]
        for t, m in enumerate(record.masks):  # fixed within a stage
            assert torch.equal(m != 0, stage_masks[0 if t < 10 else (1 if t < 30 else 2)])
        d = stage_masks[0].numel()
        assert [int(m.sum()) for m in stage_masks] == [round(0.1 * d), round(0.2 * d), round(0.4 * d)]
        runs[strategy] = stage_masks
    inc = runs["incremental"]
    assert bool(inc[1][inc[0]].all()) and bool(inc[2][inc[1]].all())  # earlier coordinates stay trained
    assert torch.equal(runs["dynamic"][0], inc[0])  # same scores at θ⁰


def test_score_uses_no_private_data():
    masks = []
    for private_seed in (0, 1):
        model, pruning = _model(), PruningSchedule(rates=0.2, score_queries=16)
        make_trainer(max_steps=1, callbacks=[pruning]).fit(model, _dm(seed=private_seed, n=100 + 7 * private_seed))
        masks.append(torch.cat([d.reshape(-1) for d in pruning.mask.dense()]))
    assert torch.equal(masks[0], masks[1])


def test_resume_mid_stage_with_pruning_is_bit_identical(tmp_path):
    def callbacks():
        return [StagewiseSchedule(stages=2, proximal=0.1), PruningSchedule([0.2, 0.4], "incremental", "rank")]

    assert_resume_is_exact(tmp_path, _model, _dm, callbacks, max_steps=30, crash_at=17, resume_step=16)


def test_pazo_m_masks_its_public_step_too():
    L.seed_everything(0)
    dm = PrivatePublicDataModule(blobs(100), public=blobs(30, seed=3), batch_size=10, public_batch_size=8)
    model = PAZOM(_net(), lr=0.05, clip=1.0, alpha=0.5, privacy=SPEC)
    start = torch.cat([p.detach().reshape(-1).clone() for p in model.net.parameters()])
    pruning = PruningSchedule(rates=0.25, score="autograd")
    make_trainer(max_steps=5, callbacks=[pruning]).fit(model, dm)
    kept = torch.cat([d.reshape(-1) for d in pruning.mask.dense()]) != 0
    end = torch.cat([p.detach().reshape(-1) for p in model.net.parameters()])
    assert not bool((end != start)[~kept].any())


def test_clear_errors():
    with pytest.raises(ConfigError, match="single float"):
        PruningSchedule(rates=[0.1, 0.2], strategy="static")
    with pytest.raises(ConfigError, match="must not decrease"):
        PruningSchedule(rates=[0.2, 0.1], strategy="incremental")
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        PruningSchedule(rates=0.0)
    with pytest.warns(UserWarning, match="mostly"):
        PruningSchedule(score_queries=1)
    L.seed_everything(0)
    dm = PrivatePublicDataModule(blobs(100), public=blobs(30, seed=3), batch_size=10, public_batch_size=8)
    with pytest.raises(TypeError, match="set_direction_mask"):
        make_trainer(max_steps=2, callbacks=[PruningSchedule()]).fit(PAZOS(_net(), privacy=SPEC), dm)
    with pytest.raises(ConfigError, match="2 pruning rates for 3 stage"):
        make_trainer(max_steps=9, callbacks=[StagewiseSchedule(3), PruningSchedule([0.1, 0.2], "dynamic")]).fit(
            _model(), _dm()
        )
    with pytest.raises(ConfigError, match="input shape"):
        make_trainer(max_steps=2, callbacks=[PruningSchedule()]).fit(
            _model(), PrivatePublicDataModule(blobs(100), batch_size=10)
        )
