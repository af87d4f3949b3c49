"""Ghost norms that cannot round low: an example whose positions nearly cancel is clipped by at least its true norm
under ``"ghost"`` and ``"bk"`` (linear weight and bias, a tied weight's cross terms), black box on the release, and
an example that does not cancel is measured as before, to float rounding."""

from __future__ import annotations

import pytest
import torch
from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample
from opacus.grad_sample.linear import compute_linear_norm_sample
from torch import nn

from pl_dp.per_sample import BookKeeping, GhostClipping
from pl_dp.per_sample.gram import embedding_norms, linear_norms
from pl_dp.per_sample.tied import tied_norm
from pl_dp.privacy import ClipFunction

ENGINES = {"ghost": GhostClipping, "bk": BookKeeping}
SCALE = 2.0**16  # the planted output gradients' size: in fp32 their Gram terms are 2³² and round at 2⁸
CANCEL = 2.0**-12  # how nearly the two positions cancel: the true norm is SCALE·CANCEL = 16


class _Planted(nn.Module):
    """A linear layer (weight and bias) whose output is returned as is: the loss below plants its output
    gradients."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return self.layer(x)


def _planted_loss(net, batch):
    inputs, planted = batch[0], batch[1]
    out = net(inputs)
    return (out * planted).sum(tuple(range(1, out.dim())))


def _release(engine, batch):
    """The clipped sum at C = 1 of a batch of one example, as one flat vector, and the norm clipped by."""
    sums, norms, _ = engine.clipped_sum(batch, ClipFunction("constant", 1.0))
    return torch.cat([s.reshape(-1) for s in sums]), norms


@pytest.mark.parametrize("mode", ENGINES)
def test_a_linear_layer_whose_positions_nearly_cancel_releases_at_most_the_clip(mode):
    """Two positions with equal inputs e₀ and output gradients s·e₀ and −s(1 + 2⁻¹²)·e₀ (s = 2¹⁶): the weight's and
    the bias's gradients have norm 16 each, which the fp32 Gram matrices round to 0 (an independent review released
    16·C that way, under both modes and in Opacus' ghost clipping)."""
    torch.manual_seed(0)
    inputs = torch.zeros(1, 2, 4)
    inputs[0, :, 0] = 1.0
    planted = torch.zeros(1, 2, 4)
    planted[0, 0, 0], planted[0, 1, 0] = SCALE, -SCALE * (1 + CANCEL)
    release, norms = _release(ENGINES[mode](_Planted(), _planted_loss), (inputs, planted))
    true_norm = SCALE * CANCEL * 2**0.5  # weight and bias
    assert float(norms[0]) >= true_norm * (1 - 1e-6)
    assert float(release.norm()) <= 1.0 + 1e-6


class _TiedPlanted(nn.Module):
    """An embedding and a linear head sharing one weight; the loss plants both uses' output gradients."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, x):
        return self.embed(ids), self.head(x)


def _tied_loss(net, batch):
    ids, x, embed_grad, head_grad = batch
    looked_up, logits = net(ids, x)
    return (looked_up * embed_grad).sum((1, 2)) + (logits * head_grad).sum((1, 2))


@pytest.mark.parametrize("mode", ENGINES)
def test_a_tied_weight_whose_uses_nearly_cancel_releases_at_most_the_clip(mode):
    """Token 3 looked up with output gradient s·e₀, and the head's input e₀ with output gradient −s(1 + 2⁻¹²)·e₃:
    the two uses' gradients nearly cancel in W[3, 0] (norm 16), which the fp32 cross term rounds to 0."""
    torch.manual_seed(0)
    ids = torch.tensor([[3]])
    x = torch.zeros(1, 1, 4)
    x[0, 0, 0] = 1.0
    embed_grad, head_grad = torch.zeros(1, 1, 4), torch.zeros(1, 1, 7)
    embed_grad[0, 0, 0], head_grad[0, 0, 3] = SCALE, -SCALE * (1 + CANCEL)
    release, norms = _release(ENGINES[mode](_TiedPlanted(), _tied_loss), (ids, x, embed_grad, head_grad))
    assert float(norms[0]) >= SCALE * CANCEL * (1 - 1e-6)
    assert float(release.norm()) <= 1.0 + 1e-6


def _exact_norms(a, b):
    """‖Σ_t b_t a_tᵀ‖ per example from the instantiated gradient in fp64, where each product of two fp32 numbers is
    exact."""
    return torch.einsum("btp,btd->bpd", b.double(), a.double()).flatten(1).norm(dim=1)


def test_a_gram_norm_is_never_below_the_exact_norm_and_is_the_fp32_norm_where_nothing_cancels():
    """Random examples, the first 20 with two positions cancelling to one part in 2¹⁰ to 2²⁰, wide enough for the
    Gram path (2T² ≤ p·d): every norm is at least the exact one, and the cancelling ones are not raised by more than
    the float64 rounding bound (10⁻⁶ of the terms' size) or to the floor of 2⁻¹⁰ of them; the others are the exact
    norm to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(32, 24)
    a = torch.randn(40, 3, 32, generator=g)
    b = torch.randn(40, 3, 24, generator=g) * 100
    for i in range(20):
        a[i, 1] = a[i, 0]
        b[i, 1] = -b[i, 0] * (1 + 2.0 ** -(10 + i // 2))
        b[i, 2] = 0
    norms = linear_norms(layer, [a], b)[layer.weight].double()
    exact = _exact_norms(a, b)
    terms = (b.double().norm(dim=2) * a.double().norm(dim=2)).sum(dim=1)  # Σ_t |b_t||a_t|
    assert bool((norms >= exact).all())
    # the cancelling ones: raised by the float64 bound (10⁻⁶ of the terms), or up to the floor (2⁻¹⁰ of them)
    assert bool((norms[:20] <= torch.maximum(exact[:20] + 1e-6 * terms[:20], terms[:20] * 2.0**-10 * 1.001)).all())
    torch.testing.assert_close(norms[20:], exact[20:], rtol=2.5e-7, atol=0)


@pytest.mark.parametrize("kind", ["weight", "bias", "embedding"])
def test_a_sum_over_positions_that_loses_bits_in_fp32_is_never_measured_below_the_exact_norm(kind):
    """One example of 2¹⁷ positions: +X, then 2¹⁷ − 2 of X·2⁻²⁵ (below half an ulp of X), then −X. Added one after
    another in fp32 the small ones vanish into X and the sum is 0; exactly it is about X·2⁻⁸, above the mass floor
    (X·2⁻⁹). Opacus' embedding norm summed them so (norm 0: clipped by the floor, half the true norm), and a bias's
    fp32 sum lost 1e-4 of them. A linear weight measured by its instantiated gradient (2T² > p·d), a bias and an
    embedding now sum positions in float64: at least the exact norm."""
    positions, big = 2**17, 2.0**20
    b = torch.full((1, positions, 1), big * 2.0**-25)
    b[0, 0, 0], b[0, -1, 0] = big, -big
    exact = float(b.double().sum())
    if kind == "embedding":
        layer = nn.Embedding(3, 1)
        norm = embedding_norms(layer, [torch.zeros(1, positions, dtype=torch.long)], b)[layer.weight]
    else:
        layer = nn.Linear(1, 1)
        norm = linear_norms(layer, [torch.ones(1, positions, 1)], b)[getattr(layer, kind)]
    assert exact > float(b.double().abs().sum()) * 2.0**-10  # the floor alone would not cover it
    assert exact <= float(norm) <= exact * (1 + 1e-6)


def test_a_linear_norm_on_one_position_per_example_does_not_underflow():
    """On ``[B, d]`` inputs the norm is |b|·|a|: Opacus' takes the squares in fp32, which underflow to 0 for entries
    below 2⁻⁷⁵ (an independent review released 3.9·C at C = 10⁻³); float64 lengths give the exact norm."""
    layer = nn.Linear(64, 16)
    b, a = torch.full((2, 16), 2.0**-75), torch.full((2, 64), 2.0**60)
    exact = b.double().norm(dim=1) * a.double().norm(dim=1)
    assert float(compute_linear_norm_sample(layer, [a], b)[layer.weight].max()) == 0.0
    norms = linear_norms(layer, [a], b)[layer.weight].double()
    assert bool((norms >= exact).all()) and bool((norms <= exact * (1 + 1e-6)).all())


def test_an_embeddings_norm_leaves_out_its_padding_positions():
    """The padding row gets no gradient, so an example's embedding gradient norm leaves its padding positions out:
    the norms are the exact ones (Opacus' counts the padding positions: a norm above the gradient's, which clips
    harder than needed)."""
    g = torch.Generator().manual_seed(0)
    layer = nn.Embedding(6, 4, padding_idx=0)
    ids = torch.randint(1, 6, (5, 7), generator=g)
    ids[:, -3:] = 0
    b = torch.randn(5, 7, 4, generator=g)
    exact = torch.stack(
        [torch.zeros(6, 4, dtype=torch.float64).index_add_(0, ids[i], b[i].double())[1:].norm() for i in range(5)]
    )
    torch.testing.assert_close(embedding_norms(layer, [ids], b)[layer.weight].double(), exact, rtol=1e-6, atol=0)
    assert bool((compute_embedding_norm_sample(layer, [ids], b)[layer.weight] > exact * 1.01).all())


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_one_examples_many_positions_are_added_without_rounding_past_the_clip(kind, mode):
    """One example of 2¹⁷ positions: +1, pairs (+2⁻²⁴(1 + 2⁻⁸), −2⁻²⁴(1 − 2⁻⁸)), −1; added in fp32 one after another,
    every + rounds up to an ulp and every − vanishes, so an fp32 contraction of its clipped positions released 2·C
    (linear) and 3.98·C (embedding) at clip weight ½ (an independent review). Book-keeping's contractions add in
    float64: the release is the example's clipped gradient, within C."""
    positions, unit = 2**17, 2.0**-23
    planted = torch.empty(positions, dtype=torch.float64)
    planted[1:-1:2], planted[2:-1:2] = unit / 2 * (1 + 2.0**-8), -unit / 2 * (1 - 2.0**-8)
    planted[0], planted[-1] = 1.0, -1.0
    planted = planted.float().reshape(1, positions, 1)
    if kind == "embedding":
        net, inputs = _Layer(nn.Embedding(3, 1)), torch.ones(1, positions, dtype=torch.long)
    else:
        net, inputs = _Layer(nn.Linear(1, 1, bias=False)), torch.ones(1, positions, 1)
    engine = ENGINES[mode](net, _planted_loss)
    clip = float(engine.per_example_norms((inputs, planted))[0]) / 2  # clip weight ½: the example can scale itself
    sums, _, _ = engine.clipped_sum((inputs, planted), ClipFunction("constant", clip))
    assert float(torch.cat([s.reshape(-1) for s in sums]).norm()) <= clip * (1 + 1e-6)


def test_examples_taken_in_chunks_are_measured_as_in_one(monkeypatch):
    """The float64 copies are bounded by taking examples in chunks: with chunks of one to three examples, a linear
    layer's norms and a tied weight's (an embedding with a padding row and a linear head) are those of one chunk."""
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(8, 6)
    a, b = torch.randn(7, 3, 8, generator=g), torch.randn(7, 3, 6, generator=g)
    ids = torch.randint(0, 5, (7, 3), generator=g)
    looked_up = torch.randn(7, 3, 8, generator=g).masked_fill((ids == 0).unsqueeze(-1), 0.0)
    uses = [(ids, looked_up, True), (b, a, False)]
    whole = linear_norms(layer, [a], b)[layer.weight], tied_norm(uses)
    # values per example: 42 for the linear layer (3 positions × (6 + 8)), 69 for the tied weight's two uses: chunks
    # of 1, 2 and 3 examples (linear) and 1, 1 and 2 (tied)
    for budget in (42, 84, 138):
        monkeypatch.setattr("pl_dp.per_sample.gram._CHUNK", {"cpu": budget})
        torch.testing.assert_close(linear_norms(layer, [a], b)[layer.weight], whole[0], rtol=0, atol=0)
        torch.testing.assert_close(tied_norm(uses), whole[1], rtol=0, atol=0)


class _Layer(nn.Module):
    """One layer whose output the loss plants gradients on."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


def _absorbing_batch(kind: str, size: int, last: bool):
    """``size`` examples that each add C·e₀e₀ᵀ (and C·e₀ to a bias) at one position, and one — first or last —
    whose two positions' output gradients ±2⁴⁰·e₀ cancel exactly: its gradient is 0."""
    scale, where = 2.0**40, size - 1 if last else 0
    positions, width = (2 if kind == "embedding" else 3), (8 if kind == "gram" else 4)
    if kind == "embedding":
        inputs = torch.zeros(size, positions, dtype=torch.long)
    else:
        inputs = torch.zeros(size, positions, width)
        inputs[:, :, 0] = 1.0
    planted = torch.zeros(size, positions, width)
    planted[:, 0, 0] = 1.0
    planted[where, 0, 0], planted[where, 1, 0] = scale, -scale
    return (inputs, planted), where


def _net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "embedding":
        return _Layer(nn.Embedding(5, 4))
    net = _Layer(nn.Linear(8, 8) if kind == "gram" else nn.Linear(4, 4))  # 2T² = 18: ≤ 64, > 16
    if kind == "bias":  # BitFit: the bias alone is trained
        net.layer.weight.requires_grad_(False)
    return net


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize("kind", ["instantiated", "gram", "bias", "embedding"])
def test_an_example_whose_positions_cancel_cannot_absorb_the_others_in_the_release(mode, kind):
    """The release adds every example's positions in one fp32 contraction: an example whose positions are huge and
    cancel (gradient 0, norm 0) swallowed the other examples' contributions added before it — 15·C for 16 examples
    (63·C for 64, found by an independent review; under ``"hooks"`` 0). Its norm is now at least 2⁻¹⁰ of its
    positions' mass, so its scaled positions stay within 2¹⁰·C: adding or removing it moves the release by at most
    C (here by about 0), wherever it is in the batch. ``kind``: a linear layer measured by its instantiated gradient
    (2T² > p·d) or by Gram matrices, a bias alone, an embedding."""
    clip = ClipFunction("constant", 1.0)
    for last in (False, True):
        batch, where = _absorbing_batch(kind, 16, last)
        keep = torch.tensor([i for i in range(16) if i != where])
        with_it, _, _ = ENGINES[mode](_net(kind), _planted_loss).clipped_sum(batch, clip)
        without, _, _ = ENGINES[mode](_net(kind), _planted_loss).clipped_sum(tuple(t[keep] for t in batch), clip)
        moved = torch.cat([(a - b).reshape(-1) for a, b in zip(with_it, without)]).norm()
        assert float(moved) <= 1.0 + 1e-3, (last, float(moved))


class _PositionWise(nn.Module):
    """A layer measured by per-example gradients (Opacus' samplers), not by a floored norm, on ``[B, T, 4]``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "layer_scale":  # a raw parameter beside a (frozen) layer: its gradient comes from the graph
            self.layer, self.gamma = nn.Linear(4, 4).requires_grad_(False), nn.Parameter(torch.ones(4))
        else:
            self.layer = {"layer_norm": nn.LayerNorm(4), "rms_norm": nn.RMSNorm(4), "conv": nn.Conv1d(4, 4, 1)}[kind]

    def forward(self, x):
        if self.kind == "layer_scale":
            return self.gamma * self.layer(x)
        return self.layer(x.transpose(1, 2)).transpose(1, 2) if self.kind == "conv" else self.layer(x)


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "conv", "layer_scale"])
def test_layers_measured_by_per_example_gradients_are_summed_per_example(mode, kind):
    """A LayerNorm's, an RMSNorm's, a convolution's or a LayerScale's sum is made of its clipped per-example
    gradients, not of its positions added across examples: an example whose positions ±2⁴⁰·e₀ cancel moves the
    release of 16 examples by at most C. Ghost clipping took these sums from its second backward: 15, 7, 8.7 and
    7·C (an independent review)."""
    clip, scale, size = ClipFunction("constant", 1.0), 2.0**40, 16
    inputs = torch.zeros(size, 2, 4)
    inputs[:, :, 0], inputs[:, :, 1] = 1.0, -1.0
    planted = torch.zeros(size, 2, 4)
    planted[:, 0, 0] = 1.0
    planted[-1, 0, 0], planted[-1, 1, 0] = scale, -scale
    releases = []
    for rows in (slice(None), slice(0, size - 1)):
        torch.manual_seed(0)
        sums, _, _ = ENGINES[mode](_PositionWise(kind), _planted_loss).clipped_sum((inputs[rows], planted[rows]), clip)
        releases.append(torch.cat([s.reshape(-1) for s in sums]))
    assert float((releases[0] - releases[1]).norm()) <= 1.0 + 1e-3


class _SharedWithAToken(nn.Module):
    """One LayerNorm applied to a learned token (``[1, 1, d]``, then broadcast over the batch) and to the batch."""

    def __init__(self):
        super().__init__()
        self.token, self.norm, self.head = nn.Parameter(torch.randn(1, 1, 4)), nn.LayerNorm(4), nn.Linear(4, 3)

    def forward(self, x):
        token = self.norm(self.token).expand(x.shape[0], 1, 4)
        return self.head(torch.cat([token, self.norm(x)], 1).mean(1))


@pytest.mark.parametrize("mode", ENGINES)
def test_a_layer_called_on_a_tensor_shared_by_the_batch_is_refused(mode):
    """Opacus adds the gradient of a call on a ``[1, …]`` tensor into the first example's row, so the layer's norms
    and rows are not per example (and a weighted sum of rows broadcast that one row over the batch: 18,378·C moved
    by one example, found by an independent review): refused at the first batch, the layer named."""
    torch.manual_seed(0)
    engine = ENGINES[mode](
        _SharedWithAToken(), lambda net, batch: nn.functional.cross_entropy(net(batch[0]), batch[1], reduction="none")
    )
    with pytest.raises(RuntimeError, match=r"cannot clip \['norm'\]: called in one forward.*'functorch'"):
        engine.clipped_sum((torch.randn(5, 3, 4), torch.randint(0, 3, (5,))), ClipFunction("constant", 1.0))
