"""Book-keeping clipping: ghost clipping's norms and clipped sums from one backward pass, per layer type and on
tiny BERT, GPT-2, OPT and Llama-style models; no parameter gradient from autograd; sensitivity ≤ C, black box."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.nets import CausalLM, HFClassifier, TinyTransformerClassifier
from pl_dp.per_sample import BookKeeping, GhostClipping, get_per_sample_mode, verify_per_example_gradients
from pl_dp.per_sample.gram import linear_norms
from pl_dp.privacy import ClipFunction
from pl_dp.step.batches import select_examples
from pl_dp.step.losses import causal_lm, cross_entropy
from tests.per_sample.test_ghost_first_pass import _OPT_FROZEN, _Bag, _ConvNet, _Recurrent, _TwoInputs
from tests.tiny_hf import tiny_model

KINDS = ("constant", "automatic", "psac")


class _Sequence(nn.Module):
    """Linear layers on ``[B, T, d]``: a wide one measured by its ghost norm (2T² ≤ p·d), a narrow one by its
    instantiated per-example gradient (2T² > p·d), and a LayerNorm between them."""

    def __init__(self):
        super().__init__()
        self.wide, self.norm, self.narrow = nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 2)
        self.head = nn.Linear(2, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.narrow(self.norm(self.wide(x)))).mean(1))


class _Padded(nn.Module):
    """An embedding with ``padding_idx`` (its row gets no gradient) feeding a sequence of linear layers."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj, self.head = nn.Embedding(20, 6, padding_idx=0), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.embed(ids))).mean(1))


class _Norms(nn.Module):
    """RMSNorm, a Conv1d and a leaf module of raw parameters (Opacus measures it by torch.func)."""

    def __init__(self):
        super().__init__()
        self.conv, self.rms, self.scale = nn.Conv1d(3, 4, 3, padding=1), nn.RMSNorm(4), _Scale(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.rms(torch.tanh(self.conv(x)).transpose(1, 2))
        return self.head(self.scale(h).mean(1))


class _Scale(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * self.gain


class _Tied(nn.Module):
    """A language-model-like head sharing the input embeddings' weight."""

    def __init__(self):
        super().__init__()
        self.embed, self.mix, self.out = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.embed(ids))).mean(1))


ARCHITECTURES = ("gpt2", "opt", "llama")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: tiny_model(tmp_path_factory.mktemp(arch), arch) for arch in ("bert-cls", *ARCHITECTURES)}


def _case(name, models=None):
    """A net (eval mode: no dropout), a batch and the per-example loss."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (6,), generator=g)
    dense = {
        "mlp": (lambda: nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)), (6, 5)),
        "sequence": (_Sequence, (6, 7, 6)),
        "conv": (_ConvNet, (6, 2, 5, 5)),
        "norms": (_Norms, (6, 3, 5)),
        "two-inputs": (_TwoInputs, (6, 5)),
    }
    if name in dense:
        make, shape = dense[name]
        return make(), (torch.randn(*shape, generator=g), labels), cross_entropy
    ids = torch.randint(0, 20, (6, 7), generator=g)
    if name in ("embeddings", "padded", "lstm", "tied"):
        ids[0, 4:] = 0  # the padding index of "padded"
        net = {"embeddings": _Bag, "padded": _Padded, "lstm": _Recurrent, "tied": _Tied}[name]()
        return net, (ids % 10 if name == "tied" else ids, labels), cross_entropy
    if name == "transformer":
        net = TinyTransformerClassifier(vocab_size=50, width=16, depth=2, heads=2, max_length=8, num_classes=3)
        return net.eval(), (torch.randint(1, 50, (6, 8), generator=g), labels), cross_entropy
    if name in ("bert", "bert-lora"):
        net = HFClassifier(models["bert-cls"], trainable="all" if name == "bert" else "lora").eval()
        ids = torch.randint(1000, 3000, (5, 7), generator=g)
        mask = torch.ones_like(ids)
        mask[0, 5:] = 0
        return net, {"input_ids": ids, "attention_mask": mask, "labels": labels[:5] % 2}, cross_entropy
    net = CausalLM(model_path=models[name]).eval()
    for pname, p in net.named_parameters():
        if name == "opt" and any(part in pname for part in _OPT_FROZEN):
            p.requires_grad_(False)  # [batch x tokens, width] layers: refused under per-example norms
    ids = torch.randint(2, 300, (5, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    return net, {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}, causal_lm


LAYERS = ["mlp", "sequence", "padded", "embeddings", "conv", "norms", "lstm", "two-inputs", "tied", "transformer"]
MODELS = ["bert", "bert-lora", *ARCHITECTURES]


def _own_gradients(net, batch, loss_fn):
    """The reference: one backward per example, the whole gradient materialized (fp64 rows)."""
    params = [p for p in net.parameters() if p.requires_grad]
    size = len(batch["input_ids"]) if isinstance(batch, dict) else len(batch[0])
    rows = []
    for i in range(size):
        grads = torch.autograd.grad(loss_fn(net, select_examples(batch, torch.tensor([i]))).sum(), params)
        rows.append([g.double() for g in grads])
    return rows


@pytest.mark.parametrize("name", LAYERS + MODELS)
def test_norms_and_clipped_sums_are_those_of_ghost_clipping(name, models):
    """Every layer type ghost clipping supports, and the tiny transformers: the same norms and the same clipped sum,
    to float rounding, for every clip function (every example clipped)."""
    net, batch, loss_fn = _case(name, models if name in MODELS else None)
    ghost = GhostClipping(copy.deepcopy(net), loss_fn)
    bk = BookKeeping(copy.deepcopy(net), loss_fn)
    assert bk.names == ghost.names
    for kind in KINDS:
        fn = ClipFunction(kind, clip=0.05, r=0.1)
        expected, expected_norms, _ = ghost.clipped_sum(batch, fn)
        sums, norms, nonfinite = bk.clipped_sum(batch, fn)
        assert int(nonfinite) == 0 and all(s.dtype == torch.float32 for s in sums)
        torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-7)
        for n, s, e in zip(bk.names, sums, expected):
            torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-7, msg=f"{kind}: {n}")


@pytest.mark.parametrize("name", ["sequence", "padded", "norms", "tied", "lstm", "gpt2"])
def test_the_rows_it_sums_are_each_examples_own_gradient(name, models):
    """What the clipped sum is made of (and what the fit-start check compares): per-example gradients equal to the
    gradient of each example's loss alone (the padding row of an embedding at zero, a tied weight's two uses summed)."""
    net, batch, loss_fn = _case(name, models)
    rows, _ = BookKeeping(copy.deepcopy(net), loss_fn)(batch)
    for i, own in enumerate(_own_gradients(copy.deepcopy(net), batch, loss_fn)):
        for row, g in zip(rows, own):
            torch.testing.assert_close(row[i].double(), g, rtol=1e-5, atol=1e-7)


class _ChangesOutputInPlace(nn.Module):
    """A linear layer's output read, then changed in place (a residual read before an in-place dropout). On ``[B, T,
    d]`` inputs that are contiguous, ``nn.Linear`` returns an autograd view, and a change in place of a view takes
    part of its gradient past a hook on the view's own node: 0.64–0.80 of the true norm for single-example batches of
    a transposed input (contiguous only when B = 1), found by review. ``layout``: "flat" (``[B, d]``), "tokens"
    (``[B, T, d]``), "transposed" (``[B, T, d]`` made non-contiguous unless B = 1)."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout, self.fc, self.head = layout, nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        if self.layout == "transposed":
            x = x.transpose(0, 1).contiguous().transpose(0, 1)
        out = self.fc(x)
        skip = out * 1.0
        out.mul_(4.0)
        h = self.head(torch.tanh(out + skip))
        return h if self.layout == "flat" else h.mean(1)


class _InPlaceScale(nn.Module):
    """A LayerScale that multiplies its input in place (timm's ``inplace=True``): the input a hook records afterwards is
    γ·x, not x."""

    def __init__(self, width: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((width,), 1.5))

    def forward(self, x):
        return x.mul_(self.gamma)


class _ScalesItsInputInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.scale, self.head = nn.Linear(4, 8), _InPlaceScale(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.scale(self.fc(x) * 1.0)))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
def test_a_hooked_output_or_input_changed_in_place_is_refused_whatever_the_batch(mode):
    """A layer's output changed in place after the call, and a module changing its input in place in its forward, are
    refused at the forward, in every layout and for every batch size: each layer's output gradient comes through an
    identity node that autograd forbids changing in place, as Opacus' full backward hooks did."""
    torch.manual_seed(0)
    for layout in ("flat", "tokens", "transposed"):
        engine = get_per_sample_mode(mode).build(_ChangesOutputInPlace(layout), cross_entropy, None)
        for size in (1, 3):
            x = torch.randn(size, 4) if layout == "flat" else torch.randn(size, 5, 4)
            with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
                engine.clipped_sum((x, torch.randint(0, 3, (size,))), ClipFunction("constant", 1.0))
            engine.reset()
    engine = get_per_sample_mode(mode).build(_ScalesItsInputInPlace(), cross_entropy, None)
    with pytest.raises(RuntimeError, match="its forward changed its input in place"):
        engine.clipped_sum((torch.randn(3, 4), torch.randint(0, 3, (3,))), ClipFunction("constant", 1.0))


class _BoostsItsGradientInPlace(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient it is given in place: by 4 on rows flagged by a feature."""

    @staticmethod
    def forward(ctx, values, x):
        ctx.boost = torch.where(x[:, :1] > 5, 4.0, 1.0)
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.mul_(ctx.boost), None


class _SharesAGradient(nn.Module):
    """A sum whose two branches autograd hands one gradient tensor: a linear layer's output, and a branch whose custom
    backward changes that tensor in place after the layer's norm was taken."""

    def __init__(self):
        super().__init__()
        self.fc, self.side, self.head = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        boosted = _BoostsItsGradientInPlace.apply(torch.tanh(self.side(x * 0.01)), x)
        return self.head(torch.tanh(self.fc(x * 0.01) + boosted))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
def test_a_kept_output_gradient_changed_in_place_by_a_later_backward_is_refused_or_clipped(mode):
    """Independent review: book-keeping took a layer's norm from its output gradient in the hook, and its sum from the
    same tensor after a custom backward on a sibling branch had multiplied it in place — one record moved the release
    by 1.36·C. It is refused now; ghost clipping (whose second backward is checked against the first) and per-example
    gradients (which sum the rows they measure) clip it at C."""
    torch.manual_seed(0)
    engine = get_per_sample_mode(mode).build(_SharesAGradient(), cross_entropy, None)
    x, y, clip = torch.randn(6, 4) * 0.01, torch.randint(0, 3, (6,)), ClipFunction("constant", 1e-3)
    x[0, 0] = 10.0
    if mode == "bk":
        with pytest.raises(RuntimeError, match="output gradient was changed in place after its norm was taken"):
            engine.clipped_sum((x, y), clip)
        return
    with_it, without = engine.clipped_sum((x, y), clip)[0], engine.clipped_sum((x[1:], y[1:]), clip)[0]
    moved = torch.sqrt(sum((a - b).double().square().sum() for a, b in zip(with_it, without)))
    assert moved <= 1e-3 * (1 + 1e-5), float(moved / 1e-3)


def test_a_narrow_linear_layer_is_measured_by_its_instantiated_gradient():
    """2T² > p·d: the per-example gradient is formed (p·d per example, not T² per example) — same norm."""
    layer = nn.Linear(3, 2)
    a, b = torch.randn(4, 9, 3), torch.randn(4, 9, 2)
    norms = linear_norms(layer, [a], b)
    expected = torch.einsum("btp,btd->bpd", b, a).flatten(1).norm(dim=1)
    torch.testing.assert_close(norms[layer.weight], expected)
    torch.testing.assert_close(norms[layer.bias], b.sum(1).norm(dim=1))


class _Pointwise(nn.Module):
    """A channels-last pointwise layer (ConvNeXt's): ``nn.Linear`` on ``[B, H, W, C]``, pooled, then a head."""

    def __init__(self):
        super().__init__()
        self.pointwise, self.head = nn.Linear(4, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.pointwise(x).mean((1, 2)))


@pytest.mark.parametrize("engine", [GhostClipping, BookKeeping])
def test_a_linear_layer_on_inputs_of_any_rank_is_measured_and_summed_exactly(engine):
    """``[B, H, W, C]`` inputs, which Opacus' ghost norm returns nothing for (sharded, its hooks then left the layer at
    norm 0 — every example unclipped, found by an independent review; ghost clipping refused it): each example's
    norm and the clipped sum are those of its own gradient, and the fit-start check passes."""
    torch.manual_seed(0)
    net, g = _Pointwise(), torch.Generator().manual_seed(1)
    batch = (torch.randn(6, 2, 3, 4, generator=g) * 30, torch.randint(0, 3, (6,), generator=g))
    own = _own_gradients(copy.deepcopy(net), batch, cross_entropy)
    true_norms = torch.stack([torch.cat([r.reshape(-1) for r in row]).norm() for row in own])
    bk = engine(net, cross_entropy)
    sums, norms, _ = bk.clipped_sum(batch, ClipFunction("constant", 1.0))
    assert float(true_norms.max()) > 1  # the clip bound is reached
    torch.testing.assert_close(norms.double(), true_norms, rtol=1e-5, atol=1e-7)
    for s, rows in zip(sums, zip(*own)):
        expected = sum(r / max(float(n), 1.0) for r, n in zip(rows, true_norms))
        torch.testing.assert_close(s.double(), expected, rtol=1e-5, atol=1e-6)
    verify_per_example_gradients(bk, batch)


def test_norms_that_fall_short_of_the_rows_it_sums_are_refused_at_fit_start(monkeypatch):
    """Book-keeping clips by its norm samplers' norms and sums its rows apart: the fit-start check compares both with
    each example's own gradient, so a norm sampler that measures less than the rows (here: halved) is refused."""

    def halved(layer, activations, backprops):
        return {p: n / 2 for p, n in linear_norms(layer, activations, backprops).items()}

    monkeypatch.setattr("pl_dp.per_sample.ghost.linear_norms", halved)
    torch.manual_seed(0)
    bk = BookKeeping(_Pointwise(), cross_entropy)
    with pytest.raises(RuntimeError, match="ghost norms"):
        verify_per_example_gradients(bk, (torch.randn(3, 2, 3, 4), torch.tensor([0, 1, 2])))


def test_an_embedding_whose_positions_nearly_cancel_is_measured_as_the_sum_adds_them():
    """One example whose two positions look up the same token with output gradients s·e₀ and −s(1 + 2⁻¹²)·e₀
    (s = 2¹⁶): its gradient's norm is 16, which a Gram matrix of the output gradients rounds to 0 in fp32 (then
    released unclipped: 16·C, found by an independent review); the norm clipped by is at least the true one, and the
    release stays at C."""
    scale = 2.0**16
    planted = torch.zeros(1, 2, 4)
    planted[0, 0, 0], planted[0, 1, 0] = scale, -scale * (1 + 2**-12)

    def loss(net, batch):
        return (net(batch[0]) * batch[1]).sum((1, 2))

    torch.manual_seed(0)
    bk = BookKeeping(nn.Embedding(7, 4), loss)
    sums, norms, _ = bk.clipped_sum((torch.tensor([[3, 3]]), planted), ClipFunction("constant", 1.0))
    assert float(norms[0]) >= 16.0 * (1 - 1e-6)  # at least the true norm (here the floor, 2⁻¹⁰ of its mass 2¹⁷)
    assert float(sums[0].norm()) <= 1.0 + 1e-6


def _count_parameter_gradients(params):
    """Each call: autograd evaluated the ``AccumulateGrad`` node of one parameter (a gradient with respect to it)."""
    calls = []
    handles = [p.register_hook(lambda g, i=i: calls.append(i)) for i, p in enumerate(params)]
    return calls, handles


@pytest.mark.parametrize("name", ["mlp", "padded", "conv", "tied", "gpt2"])
def test_one_backward_and_no_parameter_gradient_from_autograd(name, models):
    """The gradient with respect to the net's last layer's output is computed once per clipped sum (ghost clipping:
    twice), and autograd computes no gradient with respect to any parameter (no ``AccumulateGrad`` node runs)."""
    net, batch, loss_fn = _case(name, models)
    for engine, backwards in ((GhostClipping(copy.deepcopy(net), loss_fn), 2), (BookKeeping(net, loss_fn), 1)):
        last = [m for m in engine.net.modules() if isinstance(m, nn.Linear)][-1]
        outputs: list[int] = []

        def count_backwards(module, args, out, outputs=outputs):
            if out.requires_grad:  # not in the no-grad forward that checks broadcast lookups
                out.register_hook(lambda grad: outputs.append(1))

        calls, handles = _count_parameter_gradients(engine.params)
        handles.append(last.register_forward_hook(count_backwards))
        try:
            sums, _, _ = engine.clipped_sum(batch, ClipFunction("constant", 0.1))
        finally:
            for handle in handles:
                handle.remove()
        assert len(outputs) == backwards, type(engine).__name__
        assert all(bool(s.abs().sum() > 0) for s in sums)
    assert calls == [] and all(p.grad is None for p in engine.params)


def _scaled_loss(net, batch):
    x, y, scale = batch
    return F.cross_entropy(net(x), y, reduction="none") * scale


@pytest.mark.parametrize("kind", KINDS)
def test_an_example_with_a_huge_loss_moves_the_sum_by_at_most_the_clip(kind):
    """Black box: D and D′ = D without one example; the clipped sums differ by at most C."""
    torch.manual_seed(0)
    net = _Sequence()
    x, y = torch.randn(6, 7, 6), torch.randint(0, 3, (6,))
    scale = torch.ones(6)
    scale[0] = 1e6
    clip = 0.5
    bk = BookKeeping(net, _scaled_loss)
    with_it, norms, _ = bk.clipped_sum((x, y, scale), ClipFunction(kind, clip))
    without, _, _ = bk.clipped_sum((x[1:], y[1:], scale[1:]), ClipFunction(kind, clip))
    moved = torch.sqrt(sum((a - b).double().square().sum() for a, b in zip(with_it, without)))
    assert norms[0] > 1e4 * clip  # unweighted, this example alone would move the sum by ‖g_0‖
    assert moved <= clip * (1 + 1e-5)


class _ScaledLinear(nn.Linear):
    """A read-out that scales its output after the layer's own forward (muP's read-out, an equalized learning rate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.01


class _ScaledEmbedding(nn.Embedding):
    """As Hugging Face's BartScaledWordEmbedding: the lookup times a constant."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 0.01


class _ScaledTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.head = _ScaledEmbedding(20, 8), nn.Linear(8, 3)
        self.head.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(ids).mean(1))


@pytest.mark.parametrize("case", ["linear", "embedding"])
def test_a_layer_subclass_that_rescales_its_output_is_clipped_by_its_own_gradient(case):
    """Found by review: the sum's shortcut for nn.Linear and nn.Embedding took their subclasses too, while their
    norms came from their true per-example gradients — a subclass scaling its output by s moved the release by C/s
    (100·C here), and the fit-start check, which reads the rows, passed. Black box, against ghost clipping."""
    torch.manual_seed(0)
    if case == "linear":
        net: nn.Module = nn.Sequential(nn.Linear(4, 8), _ScaledLinear(8, 3))
        x = torch.randn(6, 4)
        x[0] *= 1e4
    else:
        net = _ScaledTokens()
        x = torch.randint(0, 20, (6, 5))
    y = torch.randint(0, 3, (6,))
    scale = torch.ones(6)
    scale[0] = 1e6
    clip = ClipFunction("constant", 1.0)
    for engine in (BookKeeping, GhostClipping):
        summed = engine(copy.deepcopy(net), _scaled_loss)
        with_it = summed.clipped_sum((x, y, scale), clip)[0]
        without = summed.clipped_sum((x[1:], y[1:], scale[1:]), clip)[0]
        moved = torch.sqrt(sum((a - b).double().square().sum() for a, b in zip(with_it, without)))
        assert moved <= 1.0 + 1e-5, (engine.__name__, float(moved))
    bk, ghost = BookKeeping(copy.deepcopy(net), _scaled_loss), GhostClipping(copy.deepcopy(net), _scaled_loss)
    for a, b in zip(bk.clipped_sum((x, y, scale), clip)[0], ghost.clipped_sum((x, y, scale), clip)[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_fit_start_check_reads_the_sum_it_releases_not_only_its_rows(monkeypatch):
    """The rows book-keeping returns for the check and the per-layer contractions it sums are two computations: a
    sum that drifts from the rows (the subclass bug above) is refused, not only rows that drift from the truth."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    batch = (torch.randn(6, 4), torch.randint(0, 3, (6,)))
    verify_per_example_gradients(BookKeeping(copy.deepcopy(net), cross_entropy), batch)  # the true sum passes
    halved = BookKeeping._weighted_sum
    monkeypatch.setattr(BookKeeping, "_weighted_sum", lambda self, *a: [s / 2 for s in halved(self, *a)])
    with pytest.raises(RuntimeError, match=r"\(summed\)"):
        verify_per_example_gradients(BookKeeping(copy.deepcopy(net), cross_entropy), batch)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_one_sequence_of_a_tied_embedding_model_moves_the_sum_by_at_most_the_clip(arch, models):
    """Black box on GPT-2, OPT and Llama-style models (tied input and output embeddings)."""
    net, _, _ = _case(arch, models)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (6, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[3, :4] = -100  # a prompt: no loss on its first tokens
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    bk, clip = BookKeeping(net, causal_lm), 0.05
    for kind in KINDS:
        fn = ClipFunction(kind, clip=clip, r=0.01)
        with_it, norms, _ = bk.clipped_sum(batch, fn)
        for removed in (0, 3):
            without, _, _ = bk.clipped_sum(
                select_examples(batch, torch.tensor([i for i in range(6) if i != removed])), fn
            )
            moved = torch.sqrt(sum((a - b).double().square().sum() for a, b in zip(with_it, without)))
            assert norms[removed] > 10 * clip
            assert moved <= clip * (1 + 1e-5), f"{kind}, without {removed}: moved {moved}"


def test_a_non_finite_example_is_dropped_and_counted_as_in_ghost_clipping():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    x[2, 1] = float("nan")
    fn = ClipFunction("automatic", 0.5, r=0.1)
    expected, expected_norms, expected_count = GhostClipping(copy.deepcopy(net), cross_entropy).clipped_sum((x, y), fn)
    sums, norms, count = BookKeeping(net, cross_entropy).clipped_sum((x, y), fn)
    assert int(count) == int(expected_count) == 1
    torch.testing.assert_close(norms, expected_norms, equal_nan=True)
    for s, e in zip(sums, expected):
        assert torch.isfinite(s).all()
        torch.testing.assert_close(s, e)


def test_the_sums_are_fp32_and_computed_without_autocast():
    net, batch, _ = _case("sequence")
    fn = ClipFunction("constant", 0.3)
    expected, expected_norms, _ = BookKeeping(copy.deepcopy(net), cross_entropy).clipped_sum(batch, fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sums, norms, _ = BookKeeping(copy.deepcopy(net), cross_entropy).clipped_sum(batch, fn)
    torch.testing.assert_close(norms, expected_norms)
    for s, e in zip(sums, expected):
        assert s.dtype == torch.float32
        torch.testing.assert_close(s, e)


class _TimeMajor(nn.Module):
    """A layer that sees the batch in the second dimension: its rows are positions, not examples."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):  # x: [B, T, 4] with T = B
        return self.head(torch.tanh(self.fc(x.transpose(0, 1))).transpose(0, 1).mean(1))


def test_rows_that_are_not_examples_are_refused_by_the_fit_start_check():
    """The check compares the rows this engine sums with each example's own gradient, parameter by parameter (not
    only the norms, as for ghost clipping: a row that is not an example moves the sum whatever its norm)."""
    torch.manual_seed(0)
    examples = (torch.randn(3, 3, 4), torch.randint(0, 3, (3,)))
    with pytest.raises(RuntimeError, match=r"gradients of \[.*'fc\.weight'.*not each example's own gradient"):
        verify_per_example_gradients(BookKeeping(_TimeMajor(), cross_entropy), examples, sizes=(3,))
    net, batch, _ = _case("padded")
    verify_per_example_gradients(BookKeeping(net, cross_entropy), batch)  # a net it handles passes


def test_what_it_cannot_sum_is_refused_when_the_engine_is_built():
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.head = nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Linear(4, 3)

        def forward(self, ids):
            return self.head(self.tokens(ids).mean(1))

    for engine in (GhostClipping, BookKeeping):  # the batch's token counts would mix the examples' contributions
        with pytest.raises(ConfigError, match=r"'tokens' \(Embedding with scale_grad_by_freq\).*'functorch'"):
            engine(Counts(), cross_entropy)
    with pytest.raises(ConfigError, match=r"per_sample='bk' needs fp32 trainable parameters"):
        BookKeeping(nn.Linear(4, 3).to(torch.bfloat16), cross_entropy)
