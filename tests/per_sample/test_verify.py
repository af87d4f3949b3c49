"""Clipping bounds an example's contribution only if the clipped rows are each example's whole gradient.

Two nets whose Opacus rows are not: a bias also used outside its layer (its row misses that use) and a
time-major layer (its rows are positions, and pass a shape check when T equals the batch size). Both are
refused at fit start, before any step; an ordinary net trains, and a second fit on another trainable set
gets per-example gradients of that set.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import blobs, make_trainer
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.methods import DPSGD
from pl_dp.per_sample import PerSampleGradients, verify_per_example_gradients
from pl_dp.step.losses import cross_entropy


class BiasUsedTwice(nn.Module):
    """``fc.bias`` is added once by ``fc`` and once more by hand: Opacus' row for it misses the second use."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + 5.0 * self.fc.bias


class TimeMajor(nn.Module):
    """Repeats each example over ``steps`` positions and runs a Linear on the time-major ``[T, B, d]`` tensor."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(1, self.steps + 1, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        sequence = x.unsqueeze(0) * positions  # [T, B, 4]
        return self.fc(sequence).mean(0)  # per-example logits [B, 3]: each example's loss is its own


def _fit(net: nn.Module, epochs: int = 1) -> DPSGD:
    """A DP-SGD fit whose clipped rows are Opacus' per-example gradients (``per_sample="hooks"``), which the fit-start
    check compares with each example's own (ghost clipping and book-keeping refuse these nets when they are built)."""
    data = PrivatePublicDataModule(blobs(120), val=blobs(20, seed=1), batch_size=16)
    model = DPSGD(net, lr=0.1, clip=1.0, per_sample="hooks", privacy=PrivacySpec(epsilon=2.0))
    make_trainer(max_epochs=epochs).fit(model, data)
    return model


@pytest.mark.parametrize("net", [BiasUsedTwice(), TimeMajor(steps=3), TimeMajor(steps=2)], ids=str)
def test_rows_that_are_not_each_examples_gradient_are_refused_before_any_step(net):
    with pytest.raises(RuntimeError, match="not each example's own gradient|per input row, not per example"):
        _fit(net)


def test_time_major_rows_pass_a_shape_check_when_the_batch_equals_the_sequence_length():
    """Why a shape check is not enough: at B = T, Opacus returns [B, ...] rows that mix the examples."""
    torch.manual_seed(0)
    net, x = TimeMajor(steps=3), torch.randn(3, 4)
    per_sample = PerSampleGradients(net, cross_entropy)
    rows, _ = per_sample((x, torch.tensor([0, 1, 2])))
    assert rows[0].shape == (3, 3, 4)  # looks per-example
    with pytest.raises(RuntimeError, match="not each example's own gradient"):
        verify_per_example_gradients(per_sample, (x, torch.tensor([0, 1, 2])), sizes=(3,))


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_an_ordinary_net_passes_and_keeps_its_module_modes(mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3)).train()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    verify_per_example_gradients(PerSampleGradients(net, cross_entropy, mode), (x, y))
    assert all(module.training for module in net.modules())


def test_a_second_fit_clips_the_parameters_trainable_then():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model = _fit(net)
    net[0].requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    trainer = make_trainer(max_epochs=2)
    trainer.fit(model, PrivatePublicDataModule(blobs(120), val=blobs(20, seed=1), batch_size=16))
    assert model._per_sample.names == ["2.weight", "2.bias"]
    assert torch.equal(net[0].weight, frozen)


def test_functional_use_of_a_weight_is_caught_under_hooks_too():
    """A weight used by its module and again through F.linear (a tied output layer written functionally)."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4, bias=False)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(F.linear(self.proj(x), self.proj.weight))

    with pytest.raises(RuntimeError, match="not each example's own gradient"):
        _fit(Tied())
