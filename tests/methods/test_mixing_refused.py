"""Per-example independence at fit start: nets and losses that mix examples, or write state from the batch,
are refused before any private step, for zeroth-order and first-order methods alike."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import IndependenceError
from pl_dp.methods import DPSGD
from tests import catalog
from tests.conftest import RunningInputMean, SubtractBatchMean, blobs, make_trainer

SPEC = PrivacySpec(epsilon=2.0, accountant="rdp")


def _net(middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(hidden=nn.Linear(4, 16), norm=middle, act=nn.ReLU(), head=nn.Linear(16, 3)))


def _fit(model, **data) -> None:
    make_trainer(max_steps=2).fit(model, PrivatePublicDataModule(blobs(60), batch_size=10, **data))


def _untouched(model) -> bool:
    return model.private_steps == 0 and not model.accountant.history


@pytest.mark.parametrize("cls", catalog.classes(catalog.REPRESENTATIVES))
def test_audit_batchnorm_without_parameters_is_refused_at_fit_start(cls):
    # the audit's black-box case: nothing trainable, so neither Opacus nor the ZO path saw it; at batch 200 it
    # measured a per-example sensitivity of 17.6 C (DP-SGD) and 7.8 C (DPZero)
    model = cls(_net(nn.BatchNorm1d(16, affine=False, track_running_stats=False)), clip=1.0, privacy=SPEC)
    with pytest.raises(IndependenceError, match=r"'norm' \(BatchNorm1d\): BatchNorm normalizes each example"):
        _fit(model)
    assert _untouched(model)


class _Tokens(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.tokens, self.head = embedding, nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(ids).mean(1))


def test_an_embedding_with_max_norm_writes_the_batch_into_its_weight():
    """Why it is refused: torch renormalizes, in place, the rows a forward looks up — the rows of the tokens the
    batch holds, frozen or not, outside any noise."""
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, max_norm=0.5)
    with torch.no_grad():
        embedding.weight.mul_(10)
    before = embedding.weight.detach().clone()
    with torch.no_grad():
        embedding(torch.tensor([[3, 7]]))
    changed = (embedding.weight != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 7]


@pytest.mark.parametrize("cls", catalog.classes(catalog.REPRESENTATIVES))
def test_an_embedding_with_max_norm_is_refused_at_fit_start(cls):
    torch.manual_seed(0)
    model = cls(_Tokens(nn.Embedding(10, 4, max_norm=1.0)), clip=1.0, privacy=SPEC)
    ids = torch.randint(0, 10, (60, 5), generator=torch.Generator().manual_seed(0))
    data = PrivatePublicDataModule(torch.utils.data.TensorDataset(ids, torch.randint(0, 3, (60,))), batch_size=10)
    with pytest.raises(IndependenceError, match=r"'tokens' \(Embedding\): max_norm=1 renormalizes, in place"):
        make_trainer(max_steps=2).fit(model, data)
    assert _untouched(model)


def _squared_error(net: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return (net(x) - F.one_hot(y, 3).float()).square().sum(dim=1)


def _loss_relative_to_the_batch(net: nn.Module, batch) -> torch.Tensor:
    losses = F.cross_entropy(net(batch[0]), batch[1], reduction="none")
    return losses / losses.mean()


@pytest.mark.parametrize("cls", catalog.classes(catalog.REPRESENTATIVES))
@pytest.mark.parametrize(
    ("middle", "loss"),
    [(SubtractBatchMean(), _squared_error), (nn.Identity(), _loss_relative_to_the_batch)],
    ids=["in-the-net", "in-the-loss"],
)
def test_unknown_parameter_free_mixing_is_caught_by_the_probe_at_fit_start(cls, middle, loss):
    model = cls(_net(middle), loss=loss, clip=1.0, privacy=SPEC)
    mode = "training mode with autograd" if cls is DPSGD else "eval mode under torch.inference_mode"
    with pytest.raises(IndependenceError, match=rf"{mode}.*10 private examples.*changed the losses"):
        _fit(model)
    assert _untouched(model)


@pytest.mark.parametrize("cls", catalog.classes(catalog.REPRESENTATIVES))
def test_a_forward_that_writes_a_buffer_is_refused_at_fit_start(cls):
    model = cls(_net(RunningInputMean(16, "in place")), clip=1.0, privacy=SPEC)
    with pytest.raises(IndependenceError, match=r"10 validation examples, the forward pass wrote \['norm\.seen'\]"):
        _fit(model, val=blobs(20, seed=3))
    assert _untouched(model)
    assert torch.equal(model.net.norm.seen, torch.zeros(16))  # the probe undid its own write


def test_dropout_in_train_mode_passes_the_probe_and_trains():
    model = DPSGD(_net(nn.Dropout(0.3)), clip=1.0, privacy=SPEC, noise_seed=0)
    _fit(model)
    assert model.private_steps == 2
    assert model.net.training and model.net.norm.training  # modes as Lightning left them
