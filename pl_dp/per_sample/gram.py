"""Per-example norms of sums of outer products, G = Σ_t u_t v_tᵀ, that the rounding of fp32 cannot bring below C.

Ghost clipping and book-keeping clip each example by a norm computed apart from the sum they release, and that sum
adds every example's *positions* in one fp32 contraction. Two things follow where an example's positions are large
and cancel (its gradient small next to its positions' mass M = Σ_t |u_t||v_t|); an independent review showed both,
under ``"ghost"`` and ``"bk"`` alike, and Opacus' ghost clipping has both.

**The Gram norm rounds to 0.** A linear layer's norm (inputs a_t, output gradients b_t; Li, Tramèr, Liang &
Hashimoto, 2022, "Large Language Models Can Be Strong Differentially Private Learners", §4), and a weight tied
across an embedding and a linear head by the same products of its uses' factors (:mod:`pl_dp.per_sample.tied`), is

    ‖Σ_t b_t a_tᵀ‖² = Σ_{t,s} (b_t·b_s)(a_t·a_s),

whose terms are of size up to M² while their sum is ‖G‖²: in fp32 the rounding of the terms (2⁻²⁴ of them) swamps a
sum below 2⁻¹²·M. Planted output gradients s·e₀ and −s(1 + 2⁻¹²)·e₀ at equal inputs (s = 2¹⁶): true norm 16, fp32
Gram norm 0, 16·C released. So the Gram matrices and their products are computed in float64, where the product of
two fp32 numbers is exact, and each estimate Ŝ comes with a bound E on its rounding error (:func:`gram_products`): a
sum of n floating-point products errs by at most γ_n = n·u/(1 − n·u) times the sum of their magnitudes, whatever
the order of summation (Higham, 2002, "Accuracy and Stability of Numerical Algorithms", §3.1; u = 2⁻⁵³), here at
most γ·M·M'. The Gram norm is √(Ŝ + E) rounded up to fp32: at least the exact norm of G over the fp32 factors. Where
nothing cancels E is far below fp32 resolution, and the norm is the one fp32 arithmetic would give, to its
rounding.

**A sum over positions loses bits.** The other norms measured on sequences add an example's positions before taking
a norm: a bias's ‖Σ_t b_t‖, an embedding row's summed output gradients (Opacus' norm), a linear weight's
instantiated gradient Σ_t b_t a_tᵀ (2T² > p·d). In fp32 such a sum errs by up to T·2⁻²⁴ of its positions' mass: an
example of 2¹⁷ positions +X, X·2⁻²⁵ …, −X sums to 0 one position after another (Opacus' embedding norm), and its true
norm, X·2⁻⁸, is twice the floor below. These sums are taken in float64 (:func:`summed_norms`: each product exact,
the bound 2T·2⁻⁵³ of the mass), then rounded up to fp32.

**One example's positions absorb the others'.** An example whose positions ±2⁴⁰·e₀ cancel exactly has gradient 0,
norm 0, clip weight 1; in the release's fp32 accumulator its first position swallows every other example's
contribution added before it, and its second takes them away: 63·C moved for 64 examples (the instantiated norm,
2T² > p·d, a bias's ‖Σ_t b_t‖ and an embedding's norm alike; under ``"hooks"``, which sums examples' own
gradients, 0). No exact norm prevents this: the release's rounding scales with the scaled positions c_i·|u_t||v_t|,
which clipping bounds only in their sum. So every norm measured on sequences here is floored at a share of its
positions' mass, ‖g_i‖ ≥ M_i·2⁻¹⁰ (:func:`floored`, :data:`MASS_FLOOR`): an example's scaled positions then add up to
at most 2¹⁰·C, and what their rounding can absorb is of the order of 2¹⁰·2⁻²⁴·C per addition, as in a sum of
terms of at most 2¹⁰·C (``"hooks"`` adds terms of at most C). The floor is conservative (a norm above the true one
clips harder, never less) and binds only where an example's gradient is below 2⁻¹⁰ of its positions' mass: on
random directions the ratio is about √T, and on the nets of ``benchmarks/gram_bound.py`` it bound only for
parameters whose gradient is 0 in exact arithmetic (an attention layer's key bias), moving no whole-gradient norm
by more than fp32 rounding.

Cost: float64 copies of one layer's inputs and output gradients and their Gram matrices, a chunk of examples at a
time: on a CPU a few times the fp32 Gram matrices (``benchmarks/gram_bound.py``), on data-centre GPUs (fp64 at the
fp32 rate) about the same, on GPUs with slow fp64 much more. (A bound on the fp32 rounding instead costs no copy,
but it grows with the factors' widths and positions: a language model's head, 50k wide over 1,024 positions, would
be clipped by up to twice its norm.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample
from torch import nn

#: the unit roundoff of float64
_UNIT = 2.0**-53


#: float64 values a Gram computation copies at a time, by device type: examples are taken in chunks of about this
#: size, which bounds the copies' memory (a language model's head: batch × tokens × vocabulary) and, on a CPU, lets
#: the allocator reuse them (copying a whole batch at once cost about twice as much there, in page faults)
_CHUNK = {"cpu": 2**20}
_CHUNK_ELSEWHERE = 2**26


def rows_per_chunk(per_row: int, device: torch.device) -> int:
    """How many rows of ``per_row`` values each a float64 copy takes at a time on ``device`` (:data:`_CHUNK`)."""
    return max(1, _CHUNK.get(device.type, _CHUNK_ELSEWHERE) // max(per_row, 1))


def in_chunks(compute: Callable[..., tuple[torch.Tensor, ...]], *factors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``compute(*factors)`` — a tuple of per-example values, such as (Ŝ, E) (:func:`gram_products`) — over chunks of
    examples (the factors' first dimension), each chunk's float64 copies within the device's budget, put back
    together."""
    rows = rows_per_chunk(sum(f[0].numel() for f in factors), factors[0].device)
    parts = [compute(*(f[start : start + rows] for f in factors)) for start in range(0, factors[0].shape[0], rows)]
    return tuple(torch.cat(values) for values in zip(*parts))


#: the least share of its positions' mass M an example's norm is taken to be (see the module docstring)
MASS_FLOOR = 2.0**-10


def mass(u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
    """M = Σ_t |u_t|·|v_t| per example (float64) of factors ``[B, T, ·]`` (Σ_t |u_t| without ``v``), from float64
    lengths (an fp32 one underflows to 0 below 2⁻⁷⁵ per entry). ‖Σ_t u_t v_tᵀ‖ ≤ M."""
    lengths = torch.linalg.vector_norm(u, dim=2, dtype=torch.float64)
    return (lengths if v is None else lengths * torch.linalg.vector_norm(v, dim=2, dtype=torch.float64)).sum(dim=1)


def floored(norms: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """max(‖g_i‖, M_i·:data:`MASS_FLOOR`) in the norms' dtype: an example clipped by at least a share of its
    positions' mass, so that its scaled positions stay within 1/:data:`MASS_FLOOR` of the clip bound."""
    return torch.maximum(norms, (masses * MASS_FLOOR).to(norms.dtype))


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
    return rounded_up((squares + bound).clamp_min(0).sqrt())


def rounded_up(norms: torch.Tensor) -> torch.Tensor:
    """float64 ``norms`` rounded up to fp32."""
    rounded = norms.float()
    return torch.where(rounded.double() < norms, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded)


def summed_norms(values: torch.Tensor, *, terms: int, masses: torch.Tensor) -> torch.Tensor:
    """An upper bound (float64) on the exact norm of each example's sum that ``values`` holds (``[B, ·]``, float64,
    each entry a sum of ``terms`` exact products of fp32 numbers), ``masses`` the sums of those products' magnitudes
    per example (M): each entry errs by at most γ_terms = terms·u/(1 − terms·u) ≤ 2·terms·u of its products'
    magnitudes (Higham, §3.1; u = 2⁻⁵³), so the example's sum by at most 2·terms·u·M in norm; the norm is raised by
    its own rounding (γ of its entries + 4)."""
    values = values.reshape(values.shape[0], -1)
    norms = torch.linalg.vector_norm(values, dim=1)
    return norms * (1 + 2 * (values.shape[1] + 4) * _UNIT) + 2 * terms * _UNIT * masses


def linear_norms(
    layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example gradient norms (fp32) of an ``nn.Linear``, by the cheaper of ghost norm and instantiated gradient.

    On ``[B, T, ·]`` inputs a weight's ghost norm needs two T×T Gram matrices per example, the instantiated gradient
    one p×d matrix (Bu, Wang, Zha & Karypis, 2023, §3.2): for 2T² > p·d the gradient is formed (in float64) and its
    norm taken, otherwise ‖Σ_t b_t a_tᵀ‖ from float64 Gram matrices; either raised by its rounding bound (see the
    module docstring). The bias's norm is ‖Σ_t b_t‖ (:func:`bias_norms`). Inputs of more dimensions (``[B, H, W, ·]``:
    a channels-last pointwise layer) are measured as ``[B, T, ·]`` with T their positions, which Opacus' ghost norm
    returns nothing for; ``[B, ·]`` inputs by |b|·|a| (no sum to cancel) from float64 lengths (Opacus' fp32 squares
    underflow to a norm of 0 below 2⁻⁷⁵ an entry). For Hugging Face's ``Conv1D`` too (GPT-2's projections: a linear
    layer whose weight is stored transposed)."""
    if backprops.dim() <= 2:  # ‖b aᵀ‖ = |b||a|
        lengths = torch.linalg.vector_norm(backprops, dim=1, dtype=torch.float64)
        raised = 1 + 2 * (backprops.shape[1] + activations[0].shape[1] + 4) * _UNIT
        flat: dict[nn.Parameter, torch.Tensor] = {}
        if layer.weight.requires_grad:
            inputs = torch.linalg.vector_norm(activations[0], dim=1, dtype=torch.float64)
            flat[layer.weight] = rounded_up(lengths * inputs * raised)
        if layer.bias is not None and layer.bias.requires_grad:
            flat[layer.bias] = rounded_up(lengths * raised)
        return flat
    backprops = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1])
    inputs = activations[0].to(backprops.dtype).reshape(backprops.shape[0], backprops.shape[1], -1)
    norms = {}
    if layer.weight.requires_grad and 2 * backprops.shape[1] ** 2 <= layer.weight.numel():
        squares, bound, masses, bias_masses = in_chunks(_gram_norms, backprops, inputs)
        norms[layer.weight] = floored(raised_norm(squares, bound), masses)
    elif layer.weight.requires_grad:
        weight_norms, masses, bias_masses = in_chunks(_instantiated_norms, backprops, inputs)
        norms[layer.weight] = floored(rounded_up(weight_norms), masses)
    else:
        bias_masses = mass(backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        norms[layer.bias] = bias_norms(backprops, bias_masses)
    return norms


def bias_norms(backprops: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """‖Σ_t b_t‖ per example (fp32) of output gradients ``[B, T, p]``: the sum over positions in float64, raised by
    its rounding bound (:func:`summed_norms`) and rounded up, floored at a share of the mass Σ_t |b_t| (``masses``)."""
    sums = backprops.sum(dim=1, dtype=torch.float64)
    return floored(rounded_up(summed_norms(sums, terms=backprops.shape[1], masses=masses)), masses)


def embedding_norms(
    layer: nn.Embedding, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Opacus' per-example gradient norms of an ``nn.Embedding`` (each distinct token's summed output gradients), the
    sums in float64 and raised by their rounding bound, floored at a share of the looked-up positions' mass Σ_t |b_t|
    (:func:`floored`). Positions at ``padding_idx``, whose row gets no gradient, are left out of both (Opacus counts
    them: a norm above the gradient's, 1–4 % on padded text)."""
    if backprops.dim() <= 2:
        return compute_embedding_norm_sample(layer, activations, backprops)
    ids = activations[0].reshape(backprops.shape[0], -1)
    rows = backprops.reshape(ids.shape[0], ids.shape[1], -1)
    if layer.padding_idx is not None:
        rows = rows.masked_fill((ids == layer.padding_idx).unsqueeze(-1), 0.0)
    # each token's output gradients summed in float64: its rounding (float64's, bounded by the positions' mass) is all
    # that separates the norm from the exact one
    norms = compute_embedding_norm_sample(layer, activations, rows.double())
    if layer.weight not in norms:
        return norms
    masses = mass(rows)
    bound = 2 * (ids.shape[1] + rows.shape[2] + 4) * _UNIT * masses
    norms[layer.weight] = floored(rounded_up(norms[layer.weight] + bound), masses)
    return norms


def _instantiated_norms(backprops: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An upper bound (float64, :func:`summed_norms`) on ‖Σ_t b_t a_tᵀ‖ per example from the gradient itself, formed
    in float64 (its products exact, each entry a sum of T of them: in fp32 the bound would be 2T·2⁻²⁴ of the
    positions' mass, a few percent of the norm over thousands of positions), and the masses Σ_t |b_t||a_t| and
    Σ_t |b_t|."""
    wide, narrow = backprops.double(), inputs.double()
    lengths = wide.norm(dim=2)
    masses = (lengths * narrow.norm(dim=2)).sum(dim=1)
    grads = torch.einsum("btp,btd->bpd", wide, narrow)
    norms = summed_norms(grads, terms=backprops.shape[1], masses=masses)
    return norms, masses, lengths.sum(dim=1)


def _gram_norms(backprops: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Ŝ and E (:func:`gram_products`) of ‖Σ_t b_t a_tᵀ‖² per example from float64 Gram matrices, and the masses
    Σ_t |b_t||a_t| and Σ_t |b_t| (float64 lengths: an fp32 one underflows to 0 below 2⁻⁷⁵ per entry)."""
    wide, narrow = backprops.double(), inputs.double()
    lengths = wide.norm(dim=2)
    masses = (lengths * narrow.norm(dim=2)).sum(dim=1)
    squares, bound = gram_products(
        torch.bmm(wide, wide.transpose(1, 2)),
        torch.bmm(narrow, narrow.transpose(1, 2)),
        masses.square(),
        widths=wide.shape[2] + narrow.shape[2],
        terms=wide.shape[1] ** 2,
    )
    return squares, bound, masses, lengths.sum(dim=1)
