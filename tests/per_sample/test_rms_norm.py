"""Hugging Face's RMSNorm layers get their per-example gradients in closed form (pl_dp.per_sample.rms_norm)."""

import pytest
import torch
from opacus.grad_sample import GradSampleModule
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pl_dp.per_sample import BookKeeping, GhostClipping, PerSampleGradients
from pl_dp.per_sample.rms_norm import computes_rms_norm, rms_norm_grad_sample, rms_norm_samplers
from pl_dp.privacy import ClipFunction
from pl_dp.step.losses import cross_entropy


class _Normed(nn.Module):
    """A linear layer, a Llama RMSNorm on a sequence, mean-pooled logits."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = norm
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.inp(x))).mean(1)


class LookalikeRMSNorm(nn.Module):
    """Named and built like Hugging Face's RMSNorm, but scales by (1 + weight) (Gemma's form): not registered."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class ShortRMSNorm(LlamaRMSNorm):
    """Hugging Face's formula on sequences of up to 3 positions, three times it beyond: not registered."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden_states)
        return out if hidden_states.dim() < 3 or hidden_states.shape[1] <= 3 else 3 * out


def _batch(size: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(size, 4, 6, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def _each_examples_gradient(net: nn.Module, batch) -> list[list[torch.Tensor]]:
    params = [p for p in net.parameters() if p.requires_grad]
    x, y = batch
    return [torch.autograd.grad(cross_entropy(net, (x[i : i + 1], y[i : i + 1])).sum(), params) for i in range(len(y))]


def test_a_llama_rms_norm_gets_the_closed_form_on_its_engine_only_and_a_lookalike_does_not():
    torch.manual_seed(0)
    llama = LlamaRMSNorm(8)
    llama.weight.data.uniform_(0.5, 1.5)
    assert computes_rms_norm(llama) and not computes_rms_norm(LookalikeRMSNorm(8))
    assert not computes_rms_norm(ShortRMSNorm(8))  # checked on more than one shape (found by review)
    assert rms_norm_samplers(_Normed(llama)) == {LlamaRMSNorm: rms_norm_grad_sample}
    assert rms_norm_samplers(_Normed(LookalikeRMSNorm(8))) == {}
    engine = BookKeeping(_Normed(llama), cross_entropy)
    assert engine._gsm.GRAD_SAMPLERS[LlamaRMSNorm] is rms_norm_grad_sample
    assert LlamaRMSNorm not in GradSampleModule.GRAD_SAMPLERS  # Opacus' registry is left alone


@pytest.mark.parametrize("engine", [PerSampleGradients, GhostClipping, BookKeeping])
def test_every_engine_clips_a_llama_rms_norm_by_each_examples_own_gradient(engine):
    """Norms and clipped sums equal those of each example's gradient computed alone (float rounding): through the
    closed form where the sum is made of the per-example gradients whose norms set the weights (hooks, book-keeping;
    Opacus' torch.func copy of the layer is not prepared), through Opacus' own path under ghost clipping, whose sum
    comes from autograd."""
    torch.manual_seed(0)
    net = _Normed(LlamaRMSNorm(8))
    net.norm.weight.data.uniform_(0.5, 1.5)
    batch = _batch()
    rows = _each_examples_gradient(net, batch)
    clip = ClipFunction("constant", clip=0.05)
    sums, norms, _ = engine(net, cross_entropy).clipped_sum(batch, clip)
    assert hasattr(net.norm, "ft_compute_sample_grad") == (engine is GhostClipping)  # Opacus' torch.func path
    expected_norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in row)) for row in rows])
    torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-7)
    weights = clip.weights(expected_norms)
    for k, total in enumerate(sums):
        torch.testing.assert_close(total, sum(w * row[k] for w, row in zip(weights, rows)), rtol=1e-4, atol=1e-7)
