"""Per-example gradients equal a microbatch loop, for hooks (Opacus) and torch.func."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pl_dp.nets.transformer import _Block
from pl_dp.per_sample import PerSampleGradients, clipped_sum
from pl_dp.privacy import ClipFunction
from pl_dp.step.losses import cross_entropy


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.block = _Block(8, 2)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)).mean(1))


def _case(name):
    torch.manual_seed(0)
    if name == "linear":
        return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), torch.randn(6, 5)
    if name == "conv":
        return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)), torch.randn(
            6, 1, 6, 6
        )
    if name == "embedding":
        return nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 3)), torch.randint(0, 10, (6, 3))
    if name == "layernorm":
        return nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3)), torch.randn(6, 5)
    if name == "attention":
        return _Attention(), torch.randint(0, 20, (6, 5))
    raise ValueError(name)


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("name", ["linear", "conv", "embedding", "layernorm", "attention"])
def test_per_sample_gradients_equal_a_microbatch_loop(name, mode):
    net, x = _case(name)
    y = torch.randint(0, 3, (x.shape[0],))
    grads, losses = PerSampleGradients(net, cross_entropy, mode)((x, y))
    params = [p for p in net.parameters() if p.requires_grad]
    for i in range(x.shape[0]):
        loss = F.cross_entropy(net(x[i : i + 1]), y[i : i + 1])
        expected = torch.autograd.grad(loss, params)
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g[i], e, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(losses[i], loss.detach(), atol=1e-5, rtol=1e-4)


def test_frozen_parameters_get_no_per_sample_gradient():
    net, x = _case("linear")
    net[0].requires_grad_(False)
    grads, _ = PerSampleGradients(net, cross_entropy, "functorch")((x, torch.zeros(6, dtype=torch.long)))
    assert [g.shape[1:] for g in grads] == [p.shape for p in net.parameters() if p.requires_grad]


def test_clipped_sum_weights_and_nonfinite_examples():
    g = [torch.tensor([[3.0, 4.0], [0.3, 0.4], [float("nan"), 0.0]])]
    sums, norms, bad = clipped_sum(g, ClipFunction("constant", clip=1.0))
    torch.testing.assert_close(sums[0], torch.tensor([0.6 + 0.3, 0.8 + 0.4]))
    assert int(bad) == 1 and norms[0].item() == pytest.approx(5.0)


def test_hooks_give_per_example_gradients_in_eval_mode():
    """A pretrained model is in eval mode (from_pretrained, peft): Opacus' hooks used to raise 'No activations'."""
    net, x = _case("layernorm")
    net.eval()
    y = torch.randint(0, 3, (x.shape[0],))
    grads, _ = PerSampleGradients(net, cross_entropy, "hooks")((x, y))
    for i in range(x.shape[0]):
        expected = torch.autograd.grad(F.cross_entropy(net(x[i : i + 1]), y[i : i + 1]), list(net.parameters()))
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g[i], e, atol=1e-5, rtol=1e-4)
    assert not any(m.training for m in net.modules())  # modes left as they were


class _WeightUsedElsewhere(nn.Module):
    """``inner``'s weight is read by the parent's forward: ``inner``'s hooks never fire."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 3)

    def forward(self, x):
        return F.linear(x, self.inner.weight)


def test_a_parameter_the_hooks_cannot_see_is_refused_not_zeroed():
    x, y = torch.randn(4, 5), torch.zeros(4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"inner\.weight.*no per-example gradient"):
        PerSampleGradients(_WeightUsedElsewhere(), cross_entropy, "hooks")((x, y))


class _FlattensTheBatch(nn.Module):
    """Like OPT's feed-forward block: the Linear sees [batch x tokens, width], so its 'per-sample' rows are tokens."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x.reshape(-1, 5)).view(x.shape[0], -1, 3).mean(1)


def test_per_row_gradients_of_a_layer_that_flattens_the_batch_are_refused():
    x, y = torch.randn(4, 7, 5), torch.zeros(4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"per input row, not per example, for \['fc\.weight', 'fc\.bias'\]"):
        PerSampleGradients(_FlattensTheBatch(), cross_entropy, "hooks")((x, y))


def test_the_clipped_sum_is_accumulated_in_fp32_under_autocast():
    """Autocast runs einsum in bf16: the weighted sum of the clipped gradients was rounded to 8 bits, so that every
    example in it moved the release (0.35·C over 130 examples under ``bf16-mixed``, found by the fit-start probe)."""
    generator = torch.Generator().manual_seed(0)
    per_example = [torch.randn(130, 64, 32, generator=generator), torch.randn(130, 32, generator=generator)]
    clip = ClipFunction("constant", 1.0)
    exact = clipped_sum(per_example, clip)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = clipped_sum(per_example, clip)[0]
    for a, b in zip(under_autocast, exact):
        assert a.dtype == torch.float32 and torch.equal(a, b)
