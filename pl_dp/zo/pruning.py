"""Data-free pruning for DP-ZOPO (Liu et al., NDSS 2025, §IV-D, Algorithms 3–4).

* :func:`path_norm_scores` — the synaptic-saliency score ∇ℒ(|θ|) ⊙ |θ| of the path-norm loss
  ℒ = 𝟙ᵀ(∏_l |θ^{[l]}|)𝟙 (Algorithm 3, line 1), generalized to any architecture as in the released
  code and SynFlow (the paper defines ℒ for a product of layer matrices only): every parameter
  replaced by its absolute value, a constant all-ones input, ℒ the sum of the outputs, computed in
  float64 through ``torch.func.functional_call`` so the model's own parameters are never touched
  (no sign to restore). ∇ℒ is the paper's zeroth-order estimate (``estimator="zo"``) or the exact
  gradient (``"autograd"``, a pl_dp deviation: ℒ reads no data, so an exact backward pass costs no
  privacy either).
  **No data is read**: the score costs no privacy (Theorem 3).
* :func:`importance_matrix` — the diagonal M as a :class:`DirectionMask`: the top K = round(r·d)
  coordinates by score (descending, ties broken by flat index: a pl_dp reading of Algorithm 4, whose
  printed sort-and-slice would keep a 1 − r fraction), M_ii = 1 (``"pruning"``) or
  A − (A − B)·rank/K (``"rank"``, with K as the denominator, as in the released code); ``previous``
  keeps an earlier trained set and adds the best new coordinates (the incremental strategy of
  §IV-D2; Algorithm 4 as printed never copies the previous mask, the text implies the union).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from pl_dp.errors import ConfigError
from pl_dp.privacy.seeding import SeedDomain, derive_seed
from pl_dp.zo.estimator import eval_mode
from pl_dp.zo.mask import DirectionMask


def _path_norm(
    net: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], inputs: Any
) -> torch.Tensor:
    state = {**buffers, **params}
    if isinstance(inputs, Mapping):
        out = functional_call(net, state, (), inputs)
    else:
        out = functional_call(net, state, (inputs,))
    logits = getattr(out, "logits", out)
    return logits.double().sum()


def _ones(example: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(example, dtype=torch.float64 if example.is_floating_point() else None)


def path_norm_scores(
    net: nn.Module,
    example_input: torch.Tensor | Mapping[str, torch.Tensor],
    estimator: str = "zo",
    queries: int = 8,
    smoothing: float = 1e-3,
    seed: int = 0,
    state: Mapping[str, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """∇ℒ(|θ|) ⊙ |θ| for each trainable parameter of ``net`` (float64, shaped like the parameter).

    Args:
        net: the model; its parameters are read, never modified.
        example_input: a tensor, or a keyword mapping (Hugging Face models); only shapes and
            dtypes are used: the input is all ones (token id 1 for integer inputs, the released
            code's choice).
        estimator: ``"zo"`` (Algorithm 3: (1/P)Σ_p [ℒ(|θ|+βv_p) − ℒ(|θ|−βv_p)]/(2β)·v_p,
            v_p ~ N(0, I_d)) or ``"autograd"`` (one exact backward pass).
        queries: P for the ZO estimate. With P = 1 (the released code) the score is |θ| times a
            one-dimensional Gaussian projection — nearly random (the paper does not state P); more
            queries cost 2 float64 forwards each.
        smoothing: β for the ZO estimate (the released code's 1e-3).
        seed: seed of the ZO directions (data-independent).
        state: the values of ``net``'s parameters and buffers by name, whole, where ``net`` holds only its
            structure (a net sharded by FSDP2: :func:`~pl_dp.step.shards.meta_copy`); ``None``: its own.

    Memory: three float64 copies of the trainable parameters (|θ|, the direction, the score).
    """
    if estimator not in ("zo", "autograd"):
        raise ConfigError(f"estimator must be 'zo' or 'autograd', got {estimator!r}.")
    if int(queries) != queries or queries < 1:
        raise ConfigError(f"queries must be an integer >= 1, got {queries!r}.")
    if not smoothing > 0:
        raise ConfigError(f"smoothing must be > 0, got {smoothing!r}.")
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    if not names:
        raise ConfigError("the model has no trainable parameters to score.")
    values = {**dict(net.named_parameters()), **dict(net.named_buffers())} if state is None else state
    params = {n: values[n].detach().abs().double() for n, _ in net.named_parameters()}
    buffers = {n: (values[n].double() if values[n].is_floating_point() else values[n]) for n, _ in net.named_buffers()}
    if isinstance(example_input, Mapping):
        inputs = {k: _ones(v) for k, v in example_input.items()}
    else:
        inputs = _ones(example_input)
    with eval_mode(net):
        if estimator == "autograd":
            for n in names:
                params[n].requires_grad_(True)
            with torch.enable_grad():
                grads = torch.autograd.grad(_path_norm(net, params, buffers, inputs), [params[n] for n in names])
            return [g * params[n].detach() for g, n in zip(grads, names)]
        grad = {n: torch.zeros_like(params[n]) for n in names}
        with torch.no_grad():
            for j in range(int(queries)):
                gen = torch.Generator().manual_seed(derive_seed(seed, SeedDomain.PRUNING_SCORES, j))
                v = {
                    n: torch.randn(params[n].shape, generator=gen, dtype=torch.float64).to(params[n].device)
                    for n in names
                }
                plus = _path_norm(net, {**params, **{n: params[n] + smoothing * v[n] for n in names}}, buffers, inputs)
                minus = _path_norm(net, {**params, **{n: params[n] - smoothing * v[n] for n in names}}, buffers, inputs)
                coeff = float(plus - minus) / (2.0 * smoothing * queries)
                for n in names:
                    grad[n].add_(v[n], alpha=coeff)
        return [grad[n].mul_(params[n]) for n in names]


def importance_matrix(
    scores: Sequence[torch.Tensor],
    fraction: float,
    importance: str = "pruning",
    bounds: tuple[float, float] = (1.2, 0.8),
    previous: DirectionMask | None = None,
) -> DirectionMask:
    """Algorithm 4: the mask that trains K = round(``fraction``·d) coordinates.

    Args:
        scores: one score tensor per trainable parameter (higher = more important).
        fraction: r ∈ (0, 1], the fraction of coordinates trained (1.0 is DP-ZOSO).
        importance: ``"pruning"`` (M_ii = 1 on the kept set) or ``"rank"`` (M_ii = A − (A−B)·rank/K,
            rank 0 = highest score, a std multiplier of the direction, as in the
            released code; the paper's "N(0, 1.2)" could read as a variance).
        bounds: (A, B), upper and lower bound of the rank-based values (the code's 1.2 / 0.8).
        previous: an earlier mask whose trained set is kept (incremental strategy): the new set is
            previous ∪ the best K − |previous| other coordinates; rank-based values re-rank the
            union by the current scores. K ≤ |previous| keeps ``previous``'s set.
    """
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"the trained fraction (pruning rate) must lie in (0, 1], got {fraction!r}.")
    if importance not in ("pruning", "rank"):
        raise ConfigError(f"importance must be 'pruning' or 'rank', got {importance!r}.")
    upper, lower = (float(b) for b in bounds)
    if importance == "rank" and not upper >= lower > 0:
        raise ConfigError(f"bounds must be (A, B) with A >= B > 0, got {bounds!r}.")
    numels = [s.numel() for s in scores]
    flat = torch.cat([s.detach().reshape(-1).double().cpu() for s in scores])
    flat = torch.where(torch.isfinite(flat), flat, torch.full_like(flat, -math.inf))
    total = flat.numel()
    keep = max(1, min(total, round(fraction * total)))
    order = torch.sort(flat, descending=True, stable=True).indices  # ties: lower flat index first
    if previous is None:
        chosen = order[:keep]
    else:
        if list(previous.numels) != numels:
            raise ValueError("the previous mask was built for other parameter shapes.")
        old = torch.cat([d.reshape(-1) for d in previous.dense()]) != 0
        new = order[~old[order]][: max(0, keep - int(old.sum()))]
        chosen = torch.cat([old.nonzero().squeeze(1), new])
        keep = chosen.numel()
        chosen = chosen[torch.sort(flat[chosen], descending=True, stable=True).indices]
    values = None
    if importance == "rank":
        rank = torch.empty(total, dtype=torch.float64)
        rank[chosen] = torch.arange(keep, dtype=torch.float64)
        values_flat = upper - (upper - lower) * rank / keep
    selected = torch.zeros(total, dtype=torch.bool)
    selected[chosen] = True
    indices: list[torch.Tensor | None] = []
    value_list: list[torch.Tensor | None] = []
    start = 0
    for numel in numels:
        part = selected[start : start + numel]
        local = part.nonzero().squeeze(1)
        full = local.numel() == numel
        indices.append(None if full else local)
        if importance == "rank":
            value_list.append(values_flat[start : start + numel][part].float())
        start += numel
    if importance == "rank":
        values = value_list
    return DirectionMask(numels, indices, values)
