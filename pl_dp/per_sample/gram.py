"""Per-example norms of sums of outer products, G = Σ_t u_t v_tᵀ, from T×T Gram matrices, raised by their rounding.

Ghost clipping measures an example's gradient of a linear layer (inputs a_t, output gradients b_t at its T
positions) without forming it (Li, Tramèr, Liang & Hashimoto, 2022, "Large Language Models Can Be Strong
Differentially Private Learners", §4):

    ‖Σ_t b_t a_tᵀ‖² = Σ_{t,s} (b_t·b_s)(a_t·a_s),

and a weight tied across an embedding and a linear head by the same products of its uses' factors
(:mod:`pl_dp.per_sample.tied`). The terms are of size up to |b_t||b_s||a_t||a_s| while their sum is ‖G‖²: where an
example's positions nearly cancel, the fp32 rounding of the terms (relative 2⁻²⁴) swamps the sum, which can come
out as 0, while the released sum (a contraction of the same factors, rounding relative to the factors, not to their
squares) keeps the gradient. An independent review planted two positions' output gradients s·e₀ and −s(1 + 2⁻¹²)·e₀
at equal inputs (s = 2¹⁶): true norm 16, Gram norm 0, and 16·C released, under ``"ghost"`` and ``"bk"`` alike
(Opacus' ghost clipping, whose linear norm :func:`linear_norms` replaces, computes the same formula, its bias's norm
from the same Gram matrix).

So the Gram matrices and their products are computed in float64, where the product of two fp32 numbers is exact,
and each estimate Ŝ comes with a bound E on its rounding error (:func:`gram_products`): a sum of n floating-point
products errs by at most γ_n = n·u/(1 − n·u) times the sum of their magnitudes, whatever the order of summation
(Higham, 2002, "Accuracy and Stability of Numerical Algorithms", §3.1; u = 2⁻⁵³), here at most γ·M·M' with
M = Σ_t |u_t||v_t|. The norm clipped by is √(Ŝ + E) rounded up to fp32: at least the exact norm of G over the fp32
factors, whatever they are. Where nothing cancels E is far below fp32 resolution and the norm is the one fp32
arithmetic would give, to its rounding; where an example does cancel, it is clipped by its true norm or harder,
never less. The norm of an *instantiated* per-example gradient (where 2T² > p·d) and of a bias's summed output
gradients ‖Σ_t b_t‖ have no squared terms to cancel and round at the level of the release itself.

Cost: float64 copies of one layer's inputs and output gradients and their Gram matrices: on a CPU a few times the
fp32 Gram matrices (``benchmarks/gram_bound.py``), on data-centre GPUs (fp64 at the fp32 rate) about the same,
on GPUs with slow fp64 much more. (A bound on the fp32 rounding instead costs no copy, but it grows with the
factors' widths and positions: a language model's head, 50k wide over 1,024 positions, would be clipped by up to
twice its norm.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from opacus.grad_sample.linear import compute_linear_norm_sample
from torch import nn

#: the unit roundoff of float64
_UNIT = 2.0**-53


#: float64 values a Gram computation copies at a time, by device type: examples are taken in chunks of about this
#: size, which bounds the copies' memory (a language model's head: batch × tokens × vocabulary) and, on a CPU, lets
#: the allocator reuse them (copying a whole batch at once cost about twice as much there, in page faults)
_CHUNK = {"cpu": 2**20}
_CHUNK_ELSEWHERE = 2**26


def in_chunks(
    compute: Callable[..., tuple[torch.Tensor, torch.Tensor]], *factors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute(*factors)`` — a (Ŝ, E) pair per example (:func:`gram_products`) — over chunks of examples (the
    factors' first dimension), each chunk's float64 copies within the device's budget, put back together."""
    per_example = sum(f[0].numel() for f in factors)
    budget = _CHUNK.get(factors[0].device.type, _CHUNK_ELSEWHERE)
    rows = max(1, budget // max(per_example, 1))
    parts = [compute(*(f[start : start + rows] for f in factors)) for start in range(0, factors[0].shape[0], rows)]
    squares, bounds = zip(*parts)
    return torch.cat(squares), torch.cat(bounds)


def mass(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """M = Σ_t |u_t|·|v_t| per example (float64) of fp32 factors ``[B, T, ·]``: ‖Σ_t u_t v_tᵀ‖ ≤ M. The lengths are
    taken in fp32 (relative error about width·2⁻²⁴, within the factor 2 of :func:`gram_products`' bound)."""
    return (u.norm(dim=2) * v.norm(dim=2)).sum(dim=1).double()


def gram_products(
    outer_u: torch.Tensor, outer_v: torch.Tensor, masses: torch.Tensor, *, widths: int, terms: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ŝ = Σ_{t,s} U_ts·V_ts per example (``[B]``, float64) of two float64 Gram matrices ``[B, T, T']`` of fp32
    factors (U_ts = u_t·u'_s, V_ts = v_t·v'_s), and a bound E ≥ |Ŝ − S| on its rounding error against the exact S.

    ``masses``: M·M' (:func:`mass` of both sides); ``widths``: the two products' inner lengths added (0 for a side
    that is exact: one-hot factors); ``terms``: the additions each product U_ts·V_ts goes through (T·T', plus any sum
    Ŝ is added into). Each Gram entry errs by at most γ_width·|u_t||u'_s| (its products are exact), each product and
    the sum by γ_terms of their magnitudes, all within Σ_ts |u_t||u'_s||v_t||v'_s| = M·M':
    E = 2(widths + terms + 4)·u·M·M' + 4u·|Ŝ|, doubled for the γ_n denominators and the rounding of M·M' and of E
    (valid while (widths + terms)·u ≪ 1), and the rounding of √(Ŝ + E)."""
    squares = (outer_u * outer_v).sum(dim=(1, 2))
    return squares, 2 * (widths + terms + 4) * _UNIT * masses + 4 * _UNIT * squares.abs()


def raised_norm(squares: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """√(Ŝ + E) rounded up to fp32: at least the exact norm whose square Ŝ estimates with error at most E
    (:func:`gram_products`)."""
    norms = (squares + bound).clamp_min(0).sqrt()
    rounded = norms.float()
    return torch.where(rounded.double() < norms, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded)


def linear_norms(
    layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example gradient norms (fp32) of an ``nn.Linear``, by the cheaper of ghost norm and instantiated gradient.

    On ``[B, T, ·]`` inputs a weight's ghost norm needs two T×T Gram matrices per example, the instantiated gradient
    one p×d matrix (Bu, Wang, Zha & Karypis, 2023, §3.2): for 2T² > p·d the gradient is formed and its norm taken,
    otherwise ‖Σ_t b_t a_tᵀ‖ from float64 Gram matrices, raised by their rounding error (see the module docstring). The
    bias's norm is ‖Σ_t b_t‖. Inputs of more dimensions (``[B, H, W, ·]``: a channels-last pointwise layer) are
    measured as ``[B, T, ·]`` with T their positions, which Opacus' ghost norm returns nothing for; ``[B, ·]`` inputs
    by Opacus' (|b|·|a|, no sum to cancel). For Hugging Face's ``Conv1D`` too (GPT-2's projections: a linear layer
    whose weight is stored transposed)."""
    if backprops.dim() <= 2:
        return compute_linear_norm_sample(layer, activations, backprops)
    backprops = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1])
    inputs = activations[0].to(backprops.dtype).reshape(backprops.shape[0], backprops.shape[1], -1)
    norms = {}
    if layer.weight.requires_grad:
        positions = backprops.shape[1]
        if 2 * positions**2 > layer.weight.numel():
            squares = torch.einsum("btp,btd->bpd", backprops, inputs).square().sum(dim=(1, 2))
            norms[layer.weight] = squares.clamp_min(0).sqrt()
        else:
            squares, bound = in_chunks(_gram_norms, backprops, inputs)
            norms[layer.weight] = raised_norm(squares, bound)
    if layer.bias is not None and layer.bias.requires_grad:
        norms[layer.bias] = backprops.sum(dim=1).norm(dim=1)
    return norms


def _gram_norms(backprops: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ŝ and E (:func:`gram_products`) of ‖Σ_t b_t a_tᵀ‖² per example, from float64 Gram matrices."""
    masses = mass(backprops, inputs).square()
    wide, narrow = backprops.double(), inputs.double()
    return gram_products(
        torch.bmm(wide, wide.transpose(1, 2)),
        torch.bmm(narrow, narrow.transpose(1, 2)),
        masses,
        widths=wide.shape[2] + narrow.shape[2],
        terms=wide.shape[1] ** 2,
    )
