"""Raw parameters beside layers (a LayerScale ``gamma``, a scale or bias on the net) under ghost and BK clipping:
per-example gradients from the live graph equal torch.func's, the released sum moves by at most C (black box), and
a weight used outside its layer, or a raw parameter outside its module's call, is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pl_dp.per_sample import BookKeeping, GhostClipping, PerSampleGradients, verify_per_example_gradients
from pl_dp.privacy import ClipFunction
from pl_dp.step.losses import cross_entropy
from pl_dp.step.seal import isolate_failures

ENGINES = [GhostClipping, BookKeeping]
KINDS = ("constant", "automatic", "psac")


class _LayerScaleBlock(nn.Module):
    """A residual block with a raw LayerScale parameter beside its layer (Touvron et al. 2021, CaiT; ViT, ConvNeXt)."""

    def __init__(self, width: int = 5):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gamma = nn.Parameter(torch.linspace(0.2, 1.0, width))

    def forward(self, x, gate=None):
        return x + self.gamma * torch.tanh(self.fc(x)) * (1.0 if gate is None else gate)


class _LayerScaleNet(nn.Module):
    """Two LayerScale blocks, a head, and optionally a raw output scale on the root itself."""

    def __init__(self, root_scale: bool = False, width: int = 5):
        super().__init__()
        self.blocks = nn.Sequential(_LayerScaleBlock(width), _LayerScaleBlock(width))
        self.head = nn.Linear(width, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 3)) if root_scale else None

    def forward(self, x):
        out = self.head(self.blocks(x))
        return out if self.scale is None else out * self.scale


class _AlsoAlone(_LayerScaleBlock):
    """``gamma`` also used outside a product with the batch: its per-example gradients from the block's output."""

    def forward(self, x, gate=None):
        return super().forward(x) + 0.1 * self.gamma


class _TwoProducts(_LayerScaleBlock):
    """``gamma`` in two products with the batch (a branch each): its gradient is the sum of both."""

    def forward(self, x, gate=None):
        return x + self.gamma * torch.tanh(self.fc(x)) + (x * self.gamma[None, :]).square()


class _WithBuffer(_LayerScaleBlock):
    """A block with a buffer (a fixed offset): Opacus' refusal of a module it would copy does not apply here."""

    def __init__(self):
        super().__init__()
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 5))

    def forward(self, x, gate=None):
        return super().forward(x + self.offset)


class _RootBias(nn.Module):
    """A raw bias on the net, added to the output, and a raw scale of the input that reaches it through the layers."""

    def __init__(self):
        super().__init__()
        self.first, self.head = nn.Linear(5, 8), nn.Linear(8, 3)
        self.bias, self.input_scale = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.ones(5))

    def forward(self, x):
        return self.head(torch.tanh(self.first(x * self.input_scale))) + self.bias


class _ConvLayerScale(nn.Module):
    """ConvNeXt's form: ``x + gamma[:, None, None] * conv(x)`` on channels."""

    def __init__(self):
        super().__init__()
        self.conv, self.gamma, self.head = nn.Conv2d(3, 3, 3, padding=1), nn.Parameter(torch.ones(3)), nn.Linear(48, 3)

    def forward(self, x):
        return self.head((x + self.gamma[:, None, None] * self.conv(x)).flatten(1))


class _Sequence(nn.Module):
    """A LayerScale block on ``[B, T, d]`` tokens."""

    def __init__(self):
        super().__init__()
        self.block, self.head = _LayerScaleBlock(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.block(x).mean(1))


class _Gated(nn.Module):
    """The block takes a gate switched on by the data, and its forward reads state a caller sets after the engine is
    built: Opacus' copy of the module from build time saw neither (3.4·C under-clipped, found by review)."""

    def __init__(self, keyword: bool = True):
        super().__init__()
        self.block, self.head, self.keyword, self.boost = _LayerScaleBlock(), nn.Linear(5, 3), keyword, 1.0

    def forward(self, x):
        gate = self.boost * (1.0 + 9.0 * (x[:, :1] > 1.0).float())
        return self.head(self.block(x, gate=gate) if self.keyword else self.block(x, gate))


class _SharedNorm(nn.Module):
    """A LayerNorm under a LayerScale block, registered again on the net: hooked once, measured once."""

    def __init__(self):
        super().__init__()
        self.block = _LayerScaleBlock()
        self.block.norm = nn.LayerNorm(5)
        self.norm, self.head = self.block.norm, nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.norm(self.block(x)))


def _case(name):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (6,), generator=g)
    nets = {
        "layer-scale": lambda: _LayerScaleNet(),
        "root-scale": lambda: _LayerScaleNet(root_scale=True),
        "root-bias": _RootBias,
        "conv": _ConvLayerScale,
        "gated": _Gated,
        "gated-positional": lambda: _Gated(keyword=False),
        "shared-norm": _SharedNorm,
        "also-alone": lambda: nn.Sequential(_AlsoAlone(), nn.Linear(5, 3)),
        "buffer": lambda: nn.Sequential(_WithBuffer(), nn.Linear(5, 3)),
        "two-products": lambda: nn.Sequential(nn.Linear(5, 5), _TwoProducts(), nn.Linear(5, 3)),
    }
    if name == "sequence":
        return _Sequence(), (torch.randn(6, 4, 6, generator=g), labels)
    shape = (6, 3, 4, 4) if name == "conv" else (6, 5)
    return nets[name](), (torch.randn(shape, generator=g), labels)


CASES = ["layer-scale", "root-scale", "root-bias", "conv", "sequence", "gated", "gated-positional", "shared-norm"]
CASES += ["buffer", "two-products"]
CASES += ["also-alone"]  # with root-bias: per-example gradients from the module's outputs, not through products


@pytest.mark.parametrize("engine", ENGINES, ids=["ghost", "bk"])
@pytest.mark.parametrize("name", CASES)
def test_norms_and_clipped_sums_equal_those_of_torch_func(name, engine):
    net, batch = _case(name)
    if name.startswith("gated"):
        net.boost = 3.0  # set after the engines below are built: their norms must see it
    reference = PerSampleGradients(copy.deepcopy(net), cross_entropy, "functorch")
    clipping = engine(net, cross_entropy)
    if name.startswith("gated"):
        net.boost = reference.net.boost = 3.0
    assert clipping.names == reference.names
    one = tuple(t[:1] for t in batch)  # a batch of one: every factor has a batch dimension of 1
    for kind, examples in [(kind, batch) for kind in KINDS] + [("constant", one)]:
        fn = ClipFunction(kind, clip=0.05, r=0.1)  # every example clipped
        expected, expected_norms, _ = reference.clipped_sum(examples, fn)
        sums, norms, nonfinite = clipping.clipped_sum(examples, fn)
        assert int(nonfinite) == 0
        torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-7)
        for n, s, e in zip(clipping.names, sums, expected):
            torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-8, msg=f"{kind}: {n}")


def _scaled_loss(net, batch):
    x, y, scale = batch
    return F.cross_entropy(net(x), y, reduction="none") * scale


class _DroppedBlock(_LayerScaleBlock):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x, gate=None):
        return x + self.drop(self.gamma * torch.tanh(self.fc(x)))


@pytest.mark.parametrize("engine", ENGINES, ids=["ghost", "bk"])
def test_in_training_mode_the_norms_are_those_of_the_gradients_of_the_pass_itself(engine):
    """Dropout on: the norms are those of the very graph the release sums (its masks), each example's gradient taken
    from the same forward — what a copy of the module, run again, could not give."""
    net = nn.Sequential(_DroppedBlock(), nn.Linear(5, 3)).train()
    _, batch = _case("layer-scale")
    params = list(net.parameters())
    torch.manual_seed(7)
    losses = cross_entropy(net, batch)
    own = [torch.autograd.grad(losses[i], params, retain_graph=True) for i in range(len(losses))]
    expected = torch.stack([torch.sqrt(sum(g.square().sum() for g in grads)) for grads in own])
    torch.manual_seed(7)  # the same dropout masks
    norms = engine(copy.deepcopy(net), cross_entropy).per_example_norms(batch)
    torch.testing.assert_close(norms, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("engine", ENGINES, ids=["ghost", "bk"])
@pytest.mark.parametrize("name", ["root-scale", "root-bias", "gated"])
def test_an_example_with_a_huge_gradient_moves_the_sum_by_at_most_the_clip(name, engine):
    """Black box: D and D′ = D without one example whose gradient is huge (its raw parameters' part included); the
    un-noised clipped sums differ by at most C."""
    net, (x, y) = _case(name)
    scale = torch.ones(len(y))
    scale[0] = 1e6
    clip = 0.5
    clipping = engine(net, _scaled_loss)
    for kind in KINDS:
        with_it, norms, _ = clipping.clipped_sum((x, y, scale), ClipFunction(kind, clip))
        without, _, _ = clipping.clipped_sum((x[1:], y[1:], scale[1:]), ClipFunction(kind, clip))
        moved = torch.sqrt(sum((a - b).double().square().sum() for a, b in zip(with_it, without)))
        assert norms[0] > 1e4 * clip  # unweighted, this example alone would move the sum by ‖g_0‖
        assert moved <= clip * (1 + 1e-5), kind


@pytest.mark.parametrize("engine", ENGINES, ids=["ghost", "bk"])
def test_the_fit_start_check_passes_and_a_fit_trains_the_raw_parameters(engine):
    import lightning as L

    from pl_dp import PrivacySpec
    from pl_dp.data import PrivatePublicDataModule
    from pl_dp.methods import DPSGD
    from tests.conftest import blobs, make_trainer

    net, batch = _case("root-scale")
    verify_per_example_gradients(engine(copy.deepcopy(net), cross_entropy), batch)
    L.seed_everything(0)
    data = PrivatePublicDataModule(blobs(60, dim=5), public=blobs(20, dim=5, seed=3), batch_size=10)
    mode = {GhostClipping: "ghost", BookKeeping: "bk"}[engine]
    model = DPSGD(net, lr=0.1, clip=1.0, per_sample=mode, privacy=PrivacySpec(epsilon=5.0, accountant="rdp"))
    before = [p.detach().clone() for p in (net.blocks[0].gamma, net.scale)]
    make_trainer(max_steps=2).fit(model, data)
    assert model.private_steps == 2
    assert all(not torch.equal(b, p) for b, p in zip(before, (net.blocks[0].gamma, net.scale)))


class _WeightAgainInTheBlock(_LayerScaleBlock):
    def forward(self, x, gate=None):
        return super().forward(x) + F.linear(x, self.fc.weight)


class _GammaReadElsewhere(_LayerScaleNet):
    def forward(self, x):
        return super().forward(x) + self.blocks[0].gamma[:3]


class _NormScaleBlock(nn.Module):
    """A LayerScale block around a LayerNorm (no ghost-norm layer, whose own refusal of a second call comes first)."""

    def __init__(self):
        super().__init__()
        self.norm, self.gamma = nn.LayerNorm(5), nn.Parameter(torch.ones(5))

    def forward(self, x):
        return x + self.gamma * self.norm(x)


class _BlockTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = _NormScaleBlock(), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.block(self.block(x)))


def _reads_the_scale(net, batch):
    x, _ = batch
    return cross_entropy(net, batch) + x.abs().sum(1) * net._module.scale.square().sum()


@pytest.mark.parametrize("engine", ENGINES, ids=["ghost", "bk"])
@pytest.mark.parametrize(
    "net, loss, error, match",
    [
        (
            lambda: nn.Sequential(_WeightAgainInTheBlock(), nn.Linear(5, 3)),
            cross_entropy,
            ValueError,
            r"\['0\.fc\.weight'\]: .* outside the layer",
        ),
        (_GammaReadElsewhere, cross_entropy, ValueError, r"\['blocks\.0\.gamma'\]: .* outside the call of the module"),
        (lambda: _LayerScaleNet(root_scale=True), _reads_the_scale, ValueError, r"\['scale'\]: .* outside the call"),
        (_BlockTwice, cross_entropy, NotImplementedError, r"'block' .* called more than once"),
    ],
    ids=["a block's weight outside its layer", "gamma read elsewhere", "a root scale read in the loss", "block twice"],
)
def test_a_use_outside_its_layer_or_module_is_refused(net, loss, error, match, engine):
    """A use the measured gradient does not cover would go unclipped into the sum: refused from the graph's
    structure at the first pass, before any release."""
    _, batch = _case("layer-scale")
    with pytest.raises(error, match=match):
        engine(net(), loss).clipped_sum(batch, ClipFunction("constant", 1.0))


@pytest.mark.parametrize("engine", ENGINES, ids=["ghost", "bk"])
@pytest.mark.parametrize("name", ["gated", "also-alone"])
def test_a_non_finite_example_is_dropped_and_counted(name, engine):
    """Through a product (LayerScale) each row's gradient is its own: dropped and counted as any non-finite example.
    From a module's outputs, a batched backward spreads one row's non-finite values to every row: the pass raises,
    and the seal's halving leaves the others' sum exactly that of the batch without the example."""
    net, (x, y) = _case(name)
    x = x.clone()
    x[2, 1] = float("inf")
    fn = ClipFunction("constant", 0.05)
    clipping = engine(copy.deepcopy(net), cross_entropy)
    if name == "also-alone":
        with pytest.raises(FloatingPointError, match="non-finite per-example gradient of the raw parameters"):
            clipping.clipped_sum((x, y), fn)
        clipping.reset()
    done, failed = isolate_failures(lambda part: clipping.clipped_sum(part, fn), (x, y), reset=clipping.reset)
    assert not failed and sum(int(result[2]) for _, result in done) == 1
    assert len(done) == (1 if name == "gated" else 4)
    keep = torch.tensor([0, 1, 3, 4, 5])
    expected, _, _ = engine(copy.deepcopy(net), cross_entropy).clipped_sum((x[keep], y[keep]), fn)
    for k, e in enumerate(expected):
        torch.testing.assert_close(sum(result[0][k] for _, result in done), e, rtol=1e-5, atol=1e-8)
