"""Batches reach the device as a GPU wants them ([gpu] issue 40): pl_dp's loaders pin memory exactly when the trainer
runs on CUDA, and every batch a method moves itself goes through Lightning's ``transfer_batch_to_device``, which copies
with ``non_blocking=True`` there. On CPU these tests check the choice; ``make test-gpu`` runs them on CUDA."""

import torch
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.data.datamodule import pin_memory_for
from pl_dp.methods import PAZOM
from tests.conftest import DEVICE, blobs, make_trainer


class Recorded(torch.Tensor):
    """A tensor that records the keyword arguments of every ``.to`` and stays where it is (no CUDA device needed)."""

    moves: list[dict] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            cls.moves.append(dict(kwargs or {}))
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


class RecordingPAZOM(PAZOM):
    """PAZO-M recording the devices its batches are moved to through Lightning's hook."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transfers: list[torch.device] = []

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.transfers.append(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


def _data(**options) -> PrivatePublicDataModule:
    return PrivatePublicDataModule(blobs(), public=blobs(seed=1), val=blobs(seed=2), batch_size=20, **options)


def test_loaders_pin_memory_exactly_when_the_trainer_runs_on_cuda():
    assert pin_memory_for(torch.device("cuda")) and pin_memory_for(torch.device("cuda", 1))
    assert not pin_memory_for(torch.device("cpu")) and not pin_memory_for(torch.device("mps"))
    data = _data()
    assert data.loader_kwargs["pin_memory"] is False  # no trainer yet: nothing to pin for
    model = PAZOM(nn.Linear(4, 3).to(DEVICE), lr=0.05, alpha=0.5, privacy=PrivacySpec(epsilon=8.0))
    trainer = make_trainer(max_steps=2)
    trainer.fit(model, datamodule=data)
    on_cuda = DEVICE.type == "cuda"
    assert trainer.train_dataloader.pin_memory is on_cuda  # the private (Poisson) loader
    assert data.val_dataloader().pin_memory is on_cuda and data.test_dataloader() == []
    assert data.hparams["pin_memory"] is None  # the setting, not its resolution, is the hyperparameter
    assert _data(pin_memory=False).loader_kwargs["pin_memory"] is False  # an explicit choice is kept
    assert _data(pin_memory=True).loader_kwargs["pin_memory"] is True


def test_public_batches_go_through_lightnings_hook_which_copies_to_cuda_non_blocking():
    """pl_dp moves no batch itself: the public batches, like the private ones Lightning moves, take the module's
    ``transfer_batch_to_device``, whose copy to a CUDA device is ``non_blocking`` (the host batch is not read
    after it)."""
    model = RecordingPAZOM(nn.Linear(4, 3).to(DEVICE), lr=0.05, alpha=0.5, privacy=PrivacySpec(epsilon=8.0))
    trainer = make_trainer(max_steps=2)
    trainer.fit(model, datamodule=_data())
    before = len(model.transfers)
    model.public_batches(2)
    assert model.transfers[before:] == [model.device] * 2
    Recorded.moves.clear()
    batch = (torch.zeros(3, 4).as_subclass(Recorded), torch.zeros(3, dtype=torch.long).as_subclass(Recorded))
    model.transfer_batch_to_device(batch, torch.device("cuda"), 0)
    assert Recorded.moves and all(move.get("non_blocking") is True for move in Recorded.moves)
