"""Per-example independence without Lightning: batch-mixing modules are refused by type, and the probe catches
mixing, backward mixing and buffer writes by behaviour while leaving the net and the random stream as it found
them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import IndependenceError
from pl_dp.nets import MLP
from pl_dp.nets.transformer import TinyTransformerClassifier
from pl_dp.privacy import poisson_loader
from pl_dp.step.independence import (
    RELEASE_TOLERANCE,
    Release,
    batch_mixing_modules,
    half_precision_operators,
    probe_examples,
    probe_independence,
    refuse_batch_mixing_modules,
)
from pl_dp.step.losses import cross_entropy
from tests.conftest import RunningInputMean, SubtractBatchMean, blobs


class BackwardOnlyMixing(nn.Module):
    """Per-example values, but the gradient flows through the batch mean: x + (m − m.detach()) = x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=0, keepdim=True)
        return x + (mean - mean.detach())


def _net(middle: nn.Module, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), middle, nn.ReLU(), nn.Linear(width, 3))


def _examples(n: int = 9) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(blobs(n))


def _squared_error(net: nn.Module, batch) -> torch.Tensor:
    """A callable per-example loss (not a built-in name)."""
    x, y = batch
    return (net(x) - F.one_hot(y, 3).float()).square().sum(dim=1)


# ---- known modules, by type ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("track_running_stats", [False, True])
def test_batchnorm_is_refused_whatever_its_options(affine, track_running_stats):
    net = _net(nn.BatchNorm1d(16, affine=affine, track_running_stats=track_running_stats))
    with pytest.raises(IndependenceError, match=r"'1' \(BatchNorm1d\).*GroupNorm.*ModuleValidator\.fix"):
        refuse_batch_mixing_modules(net)


def test_every_known_mixing_module_is_named_in_one_error():
    net = nn.ModuleDict(
        {
            "features": nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)),
            "lazy": nn.LazyBatchNorm1d(),
            "sync": nn.SyncBatchNorm(4, affine=False),
            "instance_tracked": nn.InstanceNorm1d(4, track_running_stats=True),
            "instance": nn.InstanceNorm1d(4),
            "group": nn.GroupNorm(2, 4),
            "layer": nn.LayerNorm(4),
        }
    )
    found = batch_mixing_modules(net)
    assert [line.split(":")[0] for line in found] == [
        "'features.1' (BatchNorm2d)",
        "'lazy' (LazyBatchNorm1d)",
        "'sync' (SyncBatchNorm)",
        "'instance_tracked' (InstanceNorm1d)",
    ]
    assert "track_running_stats=False" in found[-1]
    with pytest.raises(IndependenceError) as error:
        refuse_batch_mixing_modules(net)
    assert all(line in str(error.value) for line in found)


# ---- the probe, by behaviour --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("strength", [1.0, 0.01])
def test_probe_catches_an_unknown_parameter_free_mixing_module(mode, strength):
    # here a 1 % batch-mean subtraction moves the other losses by ~5e-4 of the largest (a parameter-free
    # BatchNorm over 8 examples: ~4e-2), well above the 1e-5 tolerance; a per-example net moves them by exactly 0
    net = _net(SubtractBatchMean(strength))
    with pytest.raises(
        IndependenceError, match=r"position 4 by .* changed the losses of the examples at positions \[0, 1"
    ):
        probe_independence(net, _squared_error, _examples(), (mode,), "public")


class _HalfPrecisionBody(nn.Module):
    """A net trained in bf16 (its inputs cast to bf16) whose fp32 head adds ``mixing`` times the batch's sum."""

    def __init__(self, mixing: float = 0.0) -> None:
        super().__init__()
        self.body = _net(nn.Identity()).to(torch.bfloat16)
        self.mixing = mixing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x.to(torch.bfloat16)).float()
        return hidden + self.mixing * hidden.sum(dim=0, keepdim=True)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_half_precision_loosens_the_probe_only_for_a_repadded_batch_of_a_net_trained_in_it(mode):
    """The bf16 tolerance (1/8 of bf16's epsilon) is for a batch padded to another length (its rounding changes):
    a batch of the reference's shapes keeps 1e-5, so a 1e-4 mixing behind a bf16 body is caught, and an fp32 net
    holding a bf16 buffer is not "trained in bf16" (an independent reviewer's two ways through a looser rule)."""
    probe_independence(_HalfPrecisionBody(), _squared_error, _examples(), (mode,), "public")
    with pytest.raises(IndependenceError, match="changed the losses"):
        probe_independence(_HalfPrecisionBody(1e-4), _squared_error, _examples(), (mode,), "public")
    holder = _net(nn.Identity())
    holder.register_buffer("unused", torch.zeros(1, dtype=torch.bfloat16))

    def summed(net: nn.Module, batch) -> torch.Tensor:
        losses = _squared_error(net, batch)
        return losses + 1e-4 * losses.sum()

    with pytest.raises(IndependenceError, match="changed the losses"):
        probe_independence(holder, summed, _examples(), (mode,), "public")


def test_probe_catches_mixing_in_the_loss_itself():
    def relative_loss(net: nn.Module, batch) -> torch.Tensor:
        losses = cross_entropy(net, batch)
        return losses / losses.mean()

    with pytest.raises(IndependenceError, match="changed the losses"):
        probe_independence(_net(nn.Identity()), relative_loss, _examples(), ("eval",), "public")


def test_backward_only_mixing_is_caught_where_gradients_are_taken():
    net = _net(BackwardOnlyMixing())
    probe_independence(net, cross_entropy, _examples(), ("eval",), "public")  # losses are per example
    with pytest.raises(IndependenceError, match="summed gradient of the other examples.*backward pass mixes"):
        probe_independence(net, cross_entropy, _examples(), ("train",), "public")


@pytest.mark.parametrize("how", ["in place", "reassign", "frozen parameter"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_forward_that_writes_state_is_refused_and_undone(how, mode):
    net = _net(RunningInputMean(16, how))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    seen = net[1].seen
    with pytest.raises(IndependenceError, match=r"the forward pass wrote \['1\.seen'\].*un-noised"):
        probe_independence(net, cross_entropy, _examples(), (mode,), "private")
    if how != "frozen parameter":  # buffers come back (object and values); parameters are never restored
        assert net[1].seen is seen
        assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_dropout_in_train_mode_passes_and_the_probe_leaves_net_and_random_stream_as_found():
    net = nn.Sequential(nn.Linear(4, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 3))
    net[3].eval()  # a mixed-mode net: modes are restored module by module
    modes = [m.training for m in net.modules()]
    weights = [p.detach().clone() for p in net.parameters()]
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    probe_independence(net, cross_entropy, _examples(), ("eval", "train"), "public")  # train's dropout draws last
    assert torch.equal(torch.rand(5), expected)
    assert [m.training for m in net.modules()] == modes
    assert all(torch.equal(p, w) for p, w in zip(net.parameters(), weights))
    assert all(p.grad is None for p in net.parameters())


def test_mixing_behind_dropout_is_still_caught_in_train_mode():
    # every pass starts from the same random state, so dropout masks match and do not hide the mixing as noise
    net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), SubtractBatchMean(), nn.ReLU(), nn.Linear(16, 3))
    with pytest.raises(IndependenceError, match="training mode with autograd.*changed the losses"):
        probe_independence(net, cross_entropy, _examples(), ("train",), "public")


def test_shipped_nets_pass_in_both_modes():
    probe_independence(MLP(4, (8,), 3), cross_entropy, _examples(), ("train", "eval"), "public")
    tokens = torch.randint(1, 50, (9, 6), generator=torch.Generator().manual_seed(0))
    transformer = TinyTransformerClassifier(vocab_size=50, width=16, depth=1, heads=2, max_length=6, dropout=0.1)
    examples = list(zip(tokens, torch.arange(9) % 2))
    probe_independence(transformer, cross_entropy, examples, ("train", "eval"), "public")


# ---- which examples ---------------------------------------------------------------------------------------------
def test_probe_examples_prefer_public_then_validation_then_private_by_index():
    private, public, val = blobs(40, seed=1), blobs(20, seed=2), blobs(20, seed=3)
    loader = poisson_loader(private, 0.25, seed=0)
    for kwargs, use_public, source, dataset in [
        ({"public": public, "val": val}, True, "public", public),
        ({"public": public, "val": val}, False, "validation", val),  # a method that does not use public data
        ({"val": val}, True, "validation", val),
        ({}, True, "private", private),
        ({"public": blobs(2), "public_batch_size": 2}, True, "private", private),  # too few public examples
    ]:
        datamodule = PrivatePublicDataModule(private, batch_size=10, **kwargs)
        examples, found = probe_examples(datamodule, loader, public=use_public)
        assert found == source
        x = dataset.tensors[0]
        outlier = int(x.square().sum(dim=1).argmax())  # same length: the largest norm is the outlier, last
        expected = [i for i in range(len(dataset)) if i != outlier][:8] + [outlier]
        assert all(torch.equal(e[0], x[i]) for e, i in zip(examples, expected)) and len(examples) == 9
    assert loader.batch_sampler.position == 0  # the Poisson sampler (a secret) was not consulted
    with pytest.raises(IndependenceError, match="at least 3 examples"):
        probe_examples(None, poisson_loader(blobs(2), 0.5))


class TrainOnlyBatchMax(nn.Module):
    """Mixes only in training mode, through an order statistic: x scaled by the batch's largest |x|."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.detach().abs().max().clamp_min(1.0) * 5.0 if self.training else x


def test_mixing_through_a_batch_maximum_in_training_mode_is_caught():
    """Replacing by a copy of example 0 rarely moves a maximum; the outlier (same shape here) does."""
    net = _net(TrainOnlyBatchMax())
    examples = _examples(8) + [(torch.full((4,), 40.0), torch.tensor(0))]  # the outlier last, as probe_examples puts it
    probe_independence(net, cross_entropy, examples, ("eval",), "public")  # eval mode does not mix
    with pytest.raises(IndependenceError, match="training mode.*by a long or outlying example, changed the losses"):
        probe_independence(net, cross_entropy, examples, ("train",), "public")


class GrowingCache(nn.Module):
    """Keeps, across forwards, a table as long as the longest input it saw (a lazily grown positional table)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.zeros(1)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > len(self.table):
            self.table = torch.zeros(int(x.abs().max()) + 1)
        self.seen.append(len(x))
        return x


def test_the_probe_leaves_no_plain_attribute_it_grew():
    """A pickle of the module would carry them: the longest probe example's size, how many passes ran."""
    net = _net(GrowingCache())
    table = net[1].table
    probe_independence(net, cross_entropy, _examples(), ("train", "eval"), "public")
    assert net[1].table is table and net[1].seen == []


def test_training_mode_keeps_the_batch_shape_when_the_middle_example_is_the_only_longest():
    """In training mode the replaced batch must keep the reference's padded shape (another shape draws other dropout
    masks). When the middle example is the only one as long as the batch, neither the outlier nor a copy of another
    example can take its place without shortening the padding: another position is replaced. Before, a copy of the
    first example took the middle's place and the dropout masks moved every loss: a per-example transformer with
    dropout was refused (found on a LoRA BERT trained with no validation data, whose probe read private examples)."""
    from pl_dp.data.collate import PaddingCollate

    lengths = [3, 4, 3, 4, 8, 4, 3, 4, 10]  # position 4 (the middle of 8) is the only longest; the outlier is last
    g = torch.Generator().manual_seed(0)
    examples = [(torch.randint(1, 50, (n,), generator=g), torch.tensor(i % 2)) for i, n in enumerate(lengths)]
    torch.manual_seed(0)
    transformer = TinyTransformerClassifier(vocab_size=50, width=16, depth=1, heads=2, max_length=10, dropout=0.1)
    probe_independence(transformer, cross_entropy, examples, ("train", "eval"), "private", collate=PaddingCollate())


# ---- what a step releases, in its precision and shape -------------------------------------------------------------
class GatedBatchMean(nn.Module):
    """``h + g·mean_batch(h)`` with a learnable gate initialised at 1e-9 (ReZero/LayerScale-style): no loss moves, but
    a direction that moves ``g`` makes every example's two-point difference depend on the batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.tensor(1e-9))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gate * h.mean(dim=0, keepdim=True)


def _two_point_release(net: nn.Module, loss_fn, smoothing: float = 1e-3, clip: float = 1.0) -> Release:
    """Each kept example's clipped two-point difference along one fixed Gaussian direction, θ restored from a copy."""
    params = [p for p in net.parameters() if p.requires_grad]
    direction = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]

    def compute(batch, keep: torch.Tensor) -> list[torch.Tensor]:
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            losses = []
            for sign in (1.0, -1.0):
                for p, s, u in zip(params, saved, direction):
                    p.copy_(s + sign * smoothing * u)
                losses.append(loss_fn(net, batch))
            for p, s in zip(params, saved):
                p.copy_(s)
        differences = ((losses[0] - losses[1]) / (2 * smoothing)).clamp(-clip, clip)
        return differences[keep].reshape(-1, 1) / clip

    return Release(compute, "the clipped two-point differences", per_example=True)


def test_a_gated_batch_statistic_moves_no_loss_but_the_release_and_is_refused():
    net = _net(GatedBatchMean())
    examples = _examples()
    examples[-1] = (examples[-1][0] * 50, examples[-1][1])  # a large, finite outlier
    probe_independence(net, _squared_error, examples, ("eval",), "public")  # loss values: nothing moves
    with pytest.raises(IndependenceError, match=r"moved the clipped two-point differences.*same shapes.*h \+ g·mean"):
        probe_independence(
            net, _squared_error, examples, ("eval",), "public", release=_two_point_release(net, _squared_error)
        )
    probe_independence(  # without the gate: a per-example net's release does not move
        _net(nn.Identity()),
        _squared_error,
        examples,
        ("eval",),
        "public",
        release=_two_point_release(_net(nn.Identity()), _squared_error),
    )


def test_every_pass_runs_in_the_given_context_and_in_micro_batches_of_the_given_rows():
    seen: list[tuple[bool, int]] = []
    net = _net(nn.Identity())
    net.register_forward_pre_hook(lambda module, args: seen.append((torch.is_autocast_enabled("cpu"), len(args[0]))))

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    release = _two_point_release(net, _squared_error)
    probe_independence(net, _squared_error, _examples(), ("train", "eval"), "public", context=autocast, rows=4)
    assert seen and all(autocast_on for autocast_on, _ in seen) and {rows for _, rows in seen} == {4}
    seen.clear()
    probe_independence(net, _squared_error, _examples(), ("eval",), "public", context=autocast, release=release)
    assert seen and all(autocast_on for autocast_on, _ in seen)


def test_the_privacy_report_states_the_release_tolerance():
    from pl_dp.privacy.report import PrivacyReport

    model_state = {"method": "DPZero", "privacy": {"epsilon": 1.0}, "delta": 1e-5}
    report = PrivacyReport.from_state(model_state)
    assert report.to_dict()["release_tolerance"] == RELEASE_TOLERANCE == 0.01
    assert "at most 1.01·C" in str(report)


class _RoundsInBackward(torch.autograd.Function):
    """The identity, whose backward rounds the gradient to bf16."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.bfloat16().float()


class _HalfBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(2, [8], 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, activation, last = self.mlp
        return last(_RoundsInBackward.apply(activation(first(x))))


class _AutocastsWhenTraining(nn.Module):
    """An MLP whose forward autocasts to bf16 in training mode only."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(2, [8], 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.training):
            return self.mlp(x)


def test_half_precision_operators_are_found_in_the_modes_asked_and_the_net_is_left_as_it_was():
    net = _AutocastsWhenTraining().eval()
    batch = (torch.randn(4, 2), torch.tensor([0, 1, 2, 0]))
    assert half_precision_operators(net, cross_entropy, [batch], ("eval",)) == {}
    found = half_precision_operators(net, cross_entropy, [batch], ("train", "eval"))
    assert found and set(found.values()) == {torch.bfloat16}
    assert not net.training  # its mode put back
    assert half_precision_operators(MLP(2, [8], 3), cross_entropy, [batch]) == {}
    # a backward that rounds is seen in training mode, which takes the gradient
    assert half_precision_operators(_HalfBackward(), cross_entropy, [batch], ("eval",)) == {}
    assert half_precision_operators(_HalfBackward(), cross_entropy, [batch], ("train",))
