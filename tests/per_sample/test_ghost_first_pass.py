"""Ghost clipping's first pass computes the per-example norms only: the same norms and clipped sums as the full
backward it replaced (and as per-example gradients), and no gradient with respect to any parameter."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pl_dp.nets import CausalLM, HFClassifier, TinyTransformerClassifier
from pl_dp.per_sample import GhostClipping, PerSampleGradients
from pl_dp.per_sample.ghost import _random_state
from pl_dp.privacy import ClipFunction
from pl_dp.step.batches import select_examples
from pl_dp.step.losses import causal_lm, cross_entropy
from tests.tiny_hf import tiny_model


class FullFirstPass(GhostClipping):
    """The first pass as it was: a backward of Σ_i ℓ_i with respect to every trainable parameter (then dropped), run
    again as the second pass."""

    def _first_backward(self, losses):
        total = losses.sum()
        grads = torch.autograd.grad(total, self.params, retain_graph=True, allow_unused=True)
        self._again = (total, self.params, _random_state(total.device))
        return [p for p, g in zip(self.params, grads) if g is not None]


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.conv(x))).flatten(1))


class _Bag(nn.Module):
    """Embeddings and LayerNorm, the first layers on integer ids. (No ``padding_idx``: Opacus' norm of an embedding
    counts the padding row, whose gradient autograd drops — an over-estimate, before and after this change.)"""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(20, 6)
        self.extra = nn.Embedding(5, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(self.norm(self.tokens(ids) + self.extra(ids % 5)).mean(1))


class _Recurrent(nn.Module):
    """Opacus' DPLSTM: its cells' layers run once per time step (per-example gradients accumulated by Opacus)."""

    def __init__(self):
        super().__init__()
        from opacus.layers import DPLSTM

        self.embed, self.rnn, self.head = nn.Embedding(20, 4), DPLSTM(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0].mean(1))


class _TwoInputs(nn.Module):
    """Two branches from the data, one a layer applied to a leaf input that needs a gradient. The full first pass
    never reached that layer's full backward hook, which fired below the layer (autograd pruned the branch to the
    leaf, which is no parameter), and refused it; the norm hook on the layer's output is reached by both passes."""

    def __init__(self):
        super().__init__()
        self.left, self.right, self.head = nn.Linear(5, 4), nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.left(x)) * self.right(x.detach().requires_grad_()))


ARCHITECTURES = ["gpt2", "opt", "llama"]
_OPT_FROZEN = ("embed_positions", "fc1", "fc2", "layers.0.final_layer_norm", "layers.1.final_layer_norm")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: tiny_model(tmp_path_factory.mktemp(arch), arch) for arch in ["bert-cls", *ARCHITECTURES]}


def _case(name, models):
    """A net (eval mode: no dropout), a batch and the per-example loss."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (6,), generator=g)
    if name == "mlp":
        net = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
        return net, (torch.randn(6, 5, generator=g), labels), cross_entropy
    if name == "conv":
        return _ConvNet(), (torch.randn(6, 2, 5, 5, generator=g), labels), cross_entropy
    if name == "embeddings":
        return _Bag(), (torch.randint(0, 20, (6, 7), generator=g), labels), cross_entropy
    if name == "lstm":
        return _Recurrent(), (torch.randint(0, 20, (6, 5), generator=g), labels), cross_entropy
    if name == "two-inputs":
        return _TwoInputs(), (torch.randn(6, 5, generator=g), labels), cross_entropy
    if name == "transformer":
        net = TinyTransformerClassifier(vocab_size=50, width=16, depth=2, heads=2, max_length=8, num_classes=3)
        return net.eval(), (torch.randint(1, 50, (6, 8), generator=g), labels), cross_entropy
    if name == "bert":
        net = HFClassifier(models["bert-cls"], trainable="all").eval()
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


def _per_example_norms(net, batch, loss_fn):
    """The reference: one backward per example, the whole gradient materialized."""
    params = [p for p in net.parameters() if p.requires_grad]
    size = len(batch["input_ids"]) if isinstance(batch, dict) else len(batch[0])
    norms = []
    for i in range(size):
        one = select_examples(batch, torch.tensor([i]))
        grads = torch.autograd.grad(loss_fn(net, one).sum(), params, allow_unused=True)
        norms.append(torch.sqrt(sum(g.double().square().sum() for g in grads if g is not None)))
    return torch.stack(norms)


CASES = ["mlp", "conv", "embeddings", "lstm", "two-inputs", "transformer", "bert", *ARCHITECTURES]


@pytest.mark.parametrize("name", CASES)
def test_norms_and_clipped_sums_are_those_of_the_full_first_pass_and_of_per_example_gradients(name, models):
    net, batch, loss_fn = _case(name, models)
    before = FullFirstPass(copy.deepcopy(net), loss_fn)
    after = GhostClipping(copy.deepcopy(net), loss_fn)
    reference = _per_example_norms(copy.deepcopy(net), batch, loss_fn)
    for kind in ("constant", "automatic", "psac"):
        fn = ClipFunction(kind, clip=0.05, r=0.1)  # every example clipped
        sums, norms, nonfinite = after.clipped_sum(batch, fn)
        assert int(nonfinite) == 0
        expected, expected_norms, _ = before.clipped_sum(batch, fn)
        torch.testing.assert_close(norms, expected_norms, rtol=1e-6, atol=1e-9)
        for n, s, e in zip(after.names, sums, expected):
            torch.testing.assert_close(s, e, rtol=1e-6, atol=1e-9, msg=f"{kind}: {n}")
    torch.testing.assert_close(norms.double(), reference, rtol=1e-5, atol=1e-8)
    if name in ("mlp", "conv", "embeddings"):  # torch.func's per-example gradients (vmap)
        functorch_sums, functorch_norms, _ = PerSampleGradients(copy.deepcopy(net), loss_fn, "functorch").clipped_sum(
            batch, fn
        )
        torch.testing.assert_close(norms, functorch_norms, rtol=1e-5, atol=1e-8)
        for n, s, e in zip(after.names, sums, functorch_sums):
            torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-7, msg=n)


def _count_parameter_gradients(params):
    """Hooks on the parameters: each call is a gradient with respect to one of them, computed by autograd (a
    leaf's hook runs whenever autograd evaluates its ``AccumulateGrad`` node, for ``backward`` and for
    ``torch.autograd.grad`` alike)."""
    calls = []
    handles = [p.register_hook(lambda g, i=i: calls.append(i)) for i, p in enumerate(params)]
    return calls, handles


@pytest.mark.parametrize("name", ["mlp", "conv", "embeddings", "bert", "gpt2"])
def test_neither_pass_computes_a_parameter_gradient(name, models):
    net, batch, loss_fn = _case(name, models)
    for engine, passes in ((FullFirstPass(copy.deepcopy(net), loss_fn), 2), (GhostClipping(net, loss_fn), 1)):
        calls, handles = _count_parameter_gradients(engine.params)
        try:
            norms = engine.per_example_norms(batch)
            in_first_pass = len(calls)
            engine.clipped_sum(batch, ClipFunction("constant", 0.1))  # both passes
        finally:
            for handle in handles:
                handle.remove()
        assert bool((norms > 0).all())
        assert all(p.grad is None for p in engine.params)
        # the detector sees the full passes' gradients; the norms-only pass and its second run have none (the sums
        # are contracted from the layers' inputs and output gradients)
        everyone = list(range(len(engine.params)))
        assert in_first_pass == len(everyone) * (passes - 1), type(engine).__name__
        assert sorted(calls[in_first_pass:]) == sorted(everyone * 2 * (passes - 1)), type(engine).__name__


def test_a_parameter_used_outside_its_layer_is_still_refused():
    """The refusal of a parameter the loss uses but whose norm no hook recorded survives: the loss's graph is
    walked for the parameters it reaches instead of computing their gradients (and the walk names the use outside
    the layer first)."""

    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head, self.extra = nn.Linear(5, 4), nn.Linear(4, 3), nn.Linear(5, 3)

        def forward(self, x):  # extra's weight read directly: its layer never runs
            return self.head(torch.tanh(self.inner(x))) + F.linear(x, self.extra.weight)

    torch.manual_seed(0)
    batch = (torch.randn(4, 5), torch.randint(0, 3, (4,)))
    with pytest.raises(RuntimeError, match=r"depends on \['extra\.weight'\].*no per-example norm"):
        FullFirstPass(Reads(), cross_entropy).clipped_sum(batch, ClipFunction("constant", 1.0))
    with pytest.raises(ValueError, match=r"cannot clip \['extra\.weight'\]: .* outside the layer"):
        GhostClipping(Reads(), cross_entropy).clipped_sum(batch, ClipFunction("constant", 1.0))


class _AgainInTheNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) + x[:, :3] @ self.fc.weight[:, :3].T


class _AgainForSomeExamples(_AgainInTheNet):
    """The extra use switched on by the data: no probe example has a first feature above 50."""

    def forward(self, x):
        return self.fc(x) + (x[:, :1] > 50).float() * (x[:, :3] @ self.fc.weight[:, :3].T)


class _HeadTiedByFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.mix = nn.Embedding(7, 4), nn.Linear(4, 4)

    def forward(self, ids):
        return F.linear(torch.tanh(self.mix(self.embedding(ids))), self.embedding.weight)


def _regularized(net, batch):
    x, _ = batch
    return cross_entropy(net, batch) + 0.1 * x.abs().sum(1) * net.fc.weight.square().sum()


@pytest.mark.parametrize(
    "net, loss, batch",
    [
        (_AgainInTheNet, cross_entropy, "dense"),
        (_AgainForSomeExamples, cross_entropy, "dense"),
        (_HeadTiedByFunction, cross_entropy, "ids"),
        (_AgainInTheNet, _regularized, "dense"),
    ],
    ids=["in the net", "for some examples", "a head tied by F.linear", "in the loss"],
)
def test_a_parameter_used_in_its_layer_and_again_outside_it_is_refused(net, loss, batch):
    """Its layer's hooks measure only that layer's part of each example's gradient: the other use would go
    unclipped into the sum (an independent review measured ‖c_i g_i‖ up to 2.0 C, and ratios of measured to true norm
    down to 0.5 on a data-gated use). The graph's structure shows the use, whatever the batch; one process, no
    release: the fit stops at its first private step's pass."""
    torch.manual_seed(0)
    data = (
        (torch.randn(4, 4), torch.randint(0, 3, (4,)))
        if batch == "dense"
        else (torch.randint(0, 7, (4,)), torch.randint(0, 7, (4,)))
    )
    with pytest.raises(ValueError, match=r"cannot clip \['(fc|embedding)\.weight'\]: .* outside the layer"):
        GhostClipping(net(), loss).clipped_sum(data, ClipFunction("constant", 1.0))


def test_a_fit_with_a_parameter_used_outside_its_layer_stops_before_any_release():
    import lightning as L

    from pl_dp import PrivacySpec
    from pl_dp.data import PrivatePublicDataModule
    from pl_dp.methods import DPSGD
    from tests.conftest import blobs, make_trainer

    L.seed_everything(0)
    data = PrivatePublicDataModule(blobs(60), public=blobs(20, seed=3), batch_size=10)
    model = DPSGD(
        _AgainForSomeExamples(),
        lr=0.1,
        clip=1.0,
        per_sample="ghost",
        privacy=PrivacySpec(epsilon=5.0, accountant="rdp"),
    )
    with pytest.raises(ValueError, match="outside the layer"):
        make_trainer(max_steps=2).fit(model, data)
    assert model.private_steps == 0 and model.epsilon == 0.0


def test_a_layer_the_loss_does_not_reach_gets_a_zero_norm_and_a_zero_sum():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(5, 3), nn.Linear(5, 3)

        def forward(self, x):
            self.unused(x)  # run, not used by the loss
            return self.used(x)

    torch.manual_seed(0)
    net, batch = Unused(), (torch.randn(4, 5), torch.randint(0, 3, (4,)))
    fn = ClipFunction("constant", 0.1)
    expected, expected_norms, _ = FullFirstPass(copy.deepcopy(net), cross_entropy).clipped_sum(batch, fn)
    ghost = GhostClipping(net, cross_entropy)
    sums, norms, _ = ghost.clipped_sum(batch, fn)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-6, atol=0)
    for s, e in zip(sums, expected):
        torch.testing.assert_close(s, e, rtol=1e-6, atol=0)
    assert all(float(s.abs().sum()) == 0 for n, s in zip(ghost.names, sums) if "unused" in n)


def test_a_non_finite_example_is_dropped_counted_and_the_passes_rerun_as_before():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    x[2, 1] = float("inf")
    fn = ClipFunction("automatic", 0.5, r=0.1)
    expected, expected_norms, expected_count = FullFirstPass(copy.deepcopy(net), cross_entropy).clipped_sum((x, y), fn)
    sums, norms, count = GhostClipping(net, cross_entropy).clipped_sum((x, y), fn)
    assert int(count) == int(expected_count) == 1
    torch.testing.assert_close(norms, expected_norms, equal_nan=True, rtol=1e-6, atol=0)
    for s, e in zip(sums, expected):
        torch.testing.assert_close(s, e, rtol=1e-6, atol=0)
