"""The tree mechanism for private running sums and its accountant (O2NC, o2nc spec §3, §5).

* :func:`tree_nodes` — NODE(t) of Algorithm 5: the dyadic intervals whose noises make up TREE(t).
* :class:`TreeAggregatedGaussian` — the per-step mechanism of a tree-aggregated release: it adds
  TREE(t) = Σ_{(a,b) ∈ NODE(t)} ξ_b, ξ_b ~ N(0, (z·s)² I), to the running sum and steps the
  accountant (invariant 7). Only the ξ of the current prefix nodes are held (≤ ⌊log₂T⌋+1 vectors:
  a node of a later t' that is ≤ t is always a node of t too); they are never checkpointed.
* :class:`~pl_dp.privacy.accountants.TreeAccountant` — RDP of the whole run, (α, αρ²/2) for every α
  with ρ² = c/z², c the number of released nodes that contain one example, converted to (ε, δ)
  with Opacus' RDP conversion. Assumes **replace-one** adjacency and sensitivity s per leaf (the caller's
  ``sensitivity``, a bound enforced by clipping), and data that is partitioned, not sampled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pl_dp.privacy.accountants import Accountant, TreeAccountant, tree_multiplicity
from pl_dp.privacy.noise import NoiseSource


def tree_nodes(t: int) -> list[tuple[int, int]]:
    """NODE(t): the intervals (a, b) covering [1, t], largest first (o2nc spec Algorithm 5).

    NODE(7) = [(1, 4), (5, 6), (7, 7)]; NODE(8) = [(1, 8)]; |NODE(t)| = popcount(t).
    """
    if t < 1:
        raise ValueError(f"tree index t must be >= 1, got {t}.")
    nodes, start = [], 0
    for bit in reversed(range(t.bit_length())):
        if t >> bit & 1:
            nodes.append((start + 1, start + (1 << bit)))
            start += 1 << bit
    return nodes


class TreeAggregatedGaussian:
    """Releases g_t + TREE(t) for t = 1..T of one tree (restart with ``t = 1``).

    Args:
        noise_multiplier: z; every node's noise has std z·``sensitivity`` per coordinate.
        sensitivity: s, the L2 sensitivity of every leaf (increment) of the running sum.
    """

    def __init__(self, noise_multiplier: float, sensitivity: float) -> None:
        if noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
        if noise_multiplier > 0 and not (sensitivity > 0 and math.isfinite(sensitivity)):
            raise ValueError(f"a private tree needs a finite sensitivity > 0, got {sensitivity}.")
        self.noise_multiplier = float(noise_multiplier)
        self.sensitivity = float(sensitivity)
        self._nodes: list[tuple[int, list[torch.Tensor]]] = []  # (right endpoint b, ξ_b) of the current prefix

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.sensitivity

    def noise(self, t: int, like: Sequence[torch.Tensor], noise: NoiseSource) -> list[torch.Tensor]:
        """TREE(t): draws ξ_t, keeps the ξ_b of NODE(t), returns their sum (shaped like ``like``)."""
        if t == 1:
            self._nodes = []
        ends = {b for _, b in tree_nodes(t)}
        self._nodes = [(b, xi) for b, xi in self._nodes if b in ends]
        fresh = [noise.normal(x.shape, self.noise_std, x.device, x.dtype) for x in like]
        self._nodes.append((t, fresh))
        total = [torch.zeros_like(x) for x in like]
        for _, xi in self._nodes:
            for acc, part in zip(total, xi):
                acc.add_(part)
        return total

    def release(self, t: int, running_sum: Sequence[torch.Tensor], noise: NoiseSource) -> list[torch.Tensor]:
        """g̃_t = g_t + TREE(t); ``running_sum`` (private) is not modified."""
        return [g + xi for g, xi in zip(running_sum, self.noise(t, running_sum, noise))]

    def account(self, accountant: Accountant | None) -> None:
        """Record one leaf (a tree accountant counts nodes per example itself)."""
        if self.noise_multiplier > 0 and accountant is not None:
            accountant.step(self.noise_multiplier, 1.0)


__all__ = ["TreeAccountant", "TreeAggregatedGaussian", "tree_multiplicity", "tree_nodes"]
