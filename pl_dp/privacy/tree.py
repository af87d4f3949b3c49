"""The tree mechanism for private running sums and its accountant (O2NC).

Zhang, Tran & Cutkosky (ICLR 2024), Algorithm 5 and Theorem 4.3, after Dwork et al. (2010) and
Chan, Shi & Song (2011):

* :func:`tree_nodes` — NODE(t) of Algorithm 5: the dyadic intervals whose noises make up TREE(t).
* :class:`TreeAggregatedGaussian` — the per-step mechanism of a tree-aggregated release: it adds
  TREE(t) = Σ_{(a,b) ∈ NODE(t)} ξ_b, ξ_b ~ N(0, (z·s)² I), to the running sum and records the
  released leaf with the accountant (one object adds the noise and feeds the accountant, so the two
  cannot drift). Only the ξ of the current prefix nodes are held (≤ ⌊log₂T⌋+1 vectors: a node of a
  later t' that is ≤ t is always a node of t too); they are never checkpointed.
* :class:`TreeAccountant` — a ledger of the released leaves (:class:`TreeRun`) and the RDP of the
  whole run, (α, αρ²/2) for every α, with ρ² the worst example's count of released nodes over z²,
  converted to (ε, δ) with Opacus' RDP conversion. Assumes **replace-one** adjacency, sensitivity
  s per leaf (the caller's ``sensitivity``, a bound enforced by clipping) and data that is
  partitioned, not sampled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from dp_accounting import NeighboringRelation
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis

from pl_dp.errors import PrivacyConfigError
from pl_dp.privacy.accountants import Accountant, opacus_rdp_conversion, register_accountant
from pl_dp.privacy.noise import NoiseSource


def tree_nodes(t: int) -> list[tuple[int, int]]:
    """NODE(t): the intervals (a, b) covering [1, t], largest first (Zhang et al. 2024, Alg. 5).

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


def tree_multiplicity(leaves: int) -> int:
    """⌊log₂ n⌋ + 1: the most released nodes that contain one leaf once n leaves of a tree are released.

    Zhang et al. (2024) bound it by 2 ln T (Thm. 4.3), which is smaller for T ∈ {1, 2, 4} (no noise at
    T = 1), so that bound is not used. Proof of this one: see :class:`TreeAccountant`.
    """
    if leaves < 1:
        raise ValueError(f"the tree needs at least one leaf, got {leaves}.")
    return leaves.bit_length()


@dataclass(frozen=True)
class TreeLeaf:
    """Where a released leaf sits: leaf ``leaf`` (1-based) of tree ``tree``, in pass ``pass_index``.

    Args:
        partition: names the partition of the data into blocks; equal names mean the same blocks
            in every pass (e.g. :attr:`~pl_dp.privacy.sampling.PartitionBatchSampler.name`).
        pass_index: the pass over the partition (each example is in one block per pass).
        tree: the tree's index in the pass; trees of one pass hold disjoint examples.
        tree_length: T, the leaves the tree has room for.
        leaf: t, this leaf's index in its tree; the release is g_t + TREE(t).
    """

    partition: str
    pass_index: int
    tree: int
    tree_length: int
    leaf: int

    def __post_init__(self) -> None:
        if self.pass_index < 0 or self.tree < 0 or not 1 <= self.leaf <= self.tree_length:
            raise ValueError(f"a leaf needs pass_index >= 0, tree >= 0 and 1 <= leaf <= tree_length, got {self}.")


class TreeRun(NamedTuple):
    """One ledger entry: ``trees`` consecutive trees of a pass, each with leaves 1..``leaves`` released.

    Only complete trees (``leaves == tree_length``) are merged into one run; a partial tree (cut short
    by a stop or a mid-tree resume) is a run of its own.
    """

    noise_multiplier: float
    partition: str
    pass_index: int
    first_tree: int
    trees: int
    tree_length: int
    leaves: int

    @property
    def end(self) -> int:
        """One past the run's last tree."""
        return self.first_tree + self.trees

    @property
    def complete(self) -> bool:
        return self.leaves == self.tree_length


def _add_leaves(history: list[TreeRun], noise_multiplier: float, leaf: TreeLeaf, last: int) -> None:
    """Record leaves ``leaf.leaf``..``last`` of one tree: a new tree from leaf 1, or its continuation."""
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0 for an accounted leaf, got {noise_multiplier}.")
    if not leaf.leaf <= last <= leaf.tree_length:
        raise ValueError(f"cannot record leaves {leaf.leaf}..{last} of a tree of {leaf.tree_length}.")
    shape = (noise_multiplier, leaf.partition, leaf.pass_index)
    if leaf.leaf == 1:
        history.append(TreeRun(*shape, leaf.tree, 1, leaf.tree_length, last))
    else:
        previous = history[-1] if history else None
        if (
            previous is None
            or tuple(previous[:3]) != shape
            or (previous.end - 1, previous.tree_length, previous.leaves) != (leaf.tree, leaf.tree_length, leaf.leaf - 1)
        ):
            raise ValueError(
                f"leaf {leaf.leaf} of tree {leaf.tree} (pass {leaf.pass_index}) would be released without "
                f"leaves 1..{leaf.leaf - 1} of the same tree and noise multiplier before it; the ledger ends "
                f"with {previous}."
            )
        history[-1] = previous._replace(leaves=last)
    _merge_last(history)


def _add_trees(
    history: list[TreeRun],
    noise_multiplier: float,
    partition: str,
    pass_index: int,
    first: int,
    trees: int,
    length: int,
) -> None:
    """Record ``trees`` complete trees of ``length`` leaves, from tree ``first`` of a pass."""
    _add_leaves(history, noise_multiplier, TreeLeaf(partition, pass_index, first, length, 1), length)
    if trees > 1:
        history[-1] = history[-1]._replace(trees=history[-1].trees + trees - 1)


def _merge_last(history: list[TreeRun]) -> None:
    if len(history) < 2:
        return
    a, b = history[-2], history[-1]
    if a.complete and b.complete and a[:3] == b[:3] and a.tree_length == b.tree_length and b.first_tree == a.end:
        history[-2:] = [a._replace(trees=a.trees + b.trees)]


def tree_rho_squared(history: Sequence[TreeRun]) -> float:
    """ρ² = Σ over passes of max over the pass's trees of (⌊log₂ leaves⌋ + 1)/z² (see :class:`TreeAccountant`).

    Consecutive runs form one pass while they name the same partition and pass and their tree
    indices increase; anything else (another partition, another pass, a tree index that does not
    move forward, e.g. a new fit that restarts the sampler) starts a new pass, which composes.
    """
    total, worst, previous = 0.0, 0.0, None
    for run in history:
        if previous is None or run[1:3] != previous[1:3] or run.first_tree < previous.end:
            total, worst = total + worst, 0.0
        worst = max(worst, tree_multiplicity(run.leaves) / run.noise_multiplier**2)
        previous = run
    return total + worst


class TreeAggregatedGaussian:
    """Releases g_t + TREE(t) for the leaves t = 1..T of one tree after another; records each leaf.

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
        self._nodes: list[tuple[int, list[torch.Tensor]]] | None = []  # (right endpoint b, ξ_b) of the prefix
        self._released: TreeLeaf | None = None  # the leaf released and not yet accounted

    def __getstate__(self) -> dict[str, Any]:
        """A pickle or deep copy holds no node noise (a secret: it would remove the noise of every release)."""
        return dict(self.__dict__, _nodes=None)

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.sensitivity

    def noise(self, t: int, like: Sequence[torch.Tensor], noise: NoiseSource) -> list[torch.Tensor]:
        """TREE(t): draws ξ_t, keeps the ξ_b of NODE(t), returns their sum (shaped like ``like``)."""
        if t == 1:
            self._nodes = []
        if self._nodes is None:
            raise RuntimeError(
                "this tree's node noises are secrets that a pickle or a deep copy does not carry: a copy can start "
                "a new tree (t = 1), not continue one mid-way (its release would lack the earlier nodes' noise)."
            )
        ends = {b for _, b in tree_nodes(t)}
        self._nodes = [(b, xi) for b, xi in self._nodes if b in ends]
        # copies: a piece may be a view of a whole chunk of the draw, which a node kept for later leaves would hold
        fresh = [part.to(x.dtype, copy=True) for part, x in zip(noise.normal_like(like, self.noise_std), like)]
        self._nodes.append((t, fresh))
        total = [torch.zeros_like(x) for x in like]
        for _, xi in self._nodes:
            for acc, part in zip(total, xi):
                acc.add_(part)
        return total

    def release(self, leaf: TreeLeaf, running_sum: Sequence[torch.Tensor], noise: NoiseSource) -> list[torch.Tensor]:
        """g̃_t = g_t + TREE(t) at ``leaf`` (t = ``leaf.leaf``; t = 1 starts a tree); ``running_sum`` (private)
        is not modified. The leaf is what :meth:`account` records."""
        self._released = leaf
        return [g + xi for g, xi in zip(running_sum, self.noise(leaf.leaf, running_sum, noise))]

    def account(self, *accountants: Accountant | None) -> None:
        """Record the leaf just released with each tree accountant given (nothing for a non-private run)."""
        leaf, self._released = self._released, None
        for accountant in accountants:
            if self.noise_multiplier > 0 and accountant is not None:
                if leaf is None:
                    raise RuntimeError("TreeAggregatedGaussian.account() without a release: nothing to record.")
                if not isinstance(accountant, TreeAccountant):
                    raise PrivacyConfigError(
                        f"tree-aggregated releases need the tree accountant, got {type(accountant).__name__}."
                    )
                accountant.record(self.noise_multiplier, leaf)


@register_accountant
class TreeAccountant(Accountant):
    """(ε, δ) of tree-aggregated releases over a partition of the data, from a ledger of what was released.

    The history is a ledger of :class:`TreeRun`: for each pass over the partition and each tree in
    it, the tree length and the number of leaves released (the shape of dp-accounting's
    ``SingleEpochTreeAggregationDpEvent``, one per pass). ε is a function of the ledger alone:

    **Claim.** After the recorded releases, every example lies in at most
    N = Σ_passes max_{trees of the pass} (⌊log₂ n_tree⌋ + 1) released nodes, n_tree being the
    leaves released in that tree; with noise multiplier z the run is (α, αN/(2z²))-RDP for every
    α > 1 (ρ² = N/z²) under replace-one adjacency.

    **Proof.** (1) In one tree, TREE(t) sums the nodes of NODE(t), each of the form (b − lowbit(b) + 1, b)
    with b ≤ t, and NODE(b) ends with the node whose right end is b; so after leaves 1..n the
    released nodes are exactly {(b − lowbit(b) + 1, b) : 1 ≤ b ≤ n}. Leaf i lies in the node ending
    at b iff b is on the chain b₀ = i, b_{j+1} = b_j + lowbit(b_j); lowbit at least doubles along
    the chain, so b_j ≥ 2^j and at most ⌊log₂ n⌋ + 1 of them are ≤ n (all of them for i = 1).
    (2) The partition puts each example in exactly one block per pass and a block's rounds use
    disjoint examples, so an example enters one leaf of one tree per pass (in O2NC's naive variant
    each round is its own tree of length 1). A leaf whose rounds were never run — O2NC resumes a
    mid-tree checkpoint at the next tree of the same pass, because the noise-free running sum is
    not saved — adds nothing, and the cut tree stays in the ledger with the leaves it released,
    so its pass's maximum still counts it. Runs are grouped into one pass only while they name the
    same partition and pass and move forward in tree index; splitting a pass in two can only add
    terms, so the grouping never under-counts. (3) Each node adds N(0, (z·s)²I) to a sum in which
    one example changes only its own leaf, by at most s (Zhang et al. 2024, Lemmas 3.1–3.2 with
    clipping), whatever the earlier releases were: a Gaussian mechanism with RDP α/(2z²) (Mironov
    2017); adaptive composition (Mironov 2017, Prop. 1; Zhang et al. 2024, Thm. 4.3) over
    the at most N nodes that contain the example gives αN/(2z²); nodes with different z add
    1/z² each, which the per-run z keeps. The released sums are post-processing of the nodes. ∎

    The (ε, δ) conversion is Opacus' (Balle et al. 2020), as for the RDP accountant.

    Prospective queries (:meth:`epsilon_after`, for calibration and the budget guard) extend a copy
    of the ledger with the leaves planned from where the next one comes from, set once per fit
    with :meth:`plan` and advanced by every recorded leaf.
    """

    name = "tree"
    adjacency = NeighboringRelation.REPLACE_ONE
    accepts = (TreeAggregatedGaussian,)
    is_cheap = True

    def __init__(self) -> None:
        super().__init__()
        self._plan: tuple[str, int, int] | None = None  # (partition, steps per pass, tree length)
        self._next_position = 0

    # ---- recording -------------------------------------------------------------------------
    def record(self, noise_multiplier: float, leaf: TreeLeaf) -> None:
        """Record one released leaf (:meth:`TreeAggregatedGaussian.account`)."""
        _add_leaves(self.history, float(noise_multiplier), leaf, leaf.leaf)
        if self._plan is not None and (leaf.partition, leaf.tree_length) == (self._plan[0], self._plan[2]):
            steps_per_pass, length = self._plan[1], self._plan[2]
            self._next_position = leaf.pass_index * steps_per_pass + leaf.tree * length + leaf.leaf

    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        raise PrivacyConfigError(
            "the tree accountant records released tree leaves (TreeAccountant.record), not Poisson-subsampled "
            "steps: use it only with O2NC."
        )

    def plan(self, partition: str, steps_per_pass: int, tree_length: int, next_position: int) -> None:
        """Where future leaves come from: position ``next_position`` of a partition sampler whose position
        x is leaf x mod T + 1 of tree ⌊(x mod S)/T⌋ in pass ⌊x/S⌋ (S = ``steps_per_pass``, T = ``tree_length``)."""
        if tree_length < 1 or steps_per_pass < tree_length or steps_per_pass % tree_length or next_position < 0:
            raise ValueError(
                "need 1 <= tree_length <= steps_per_pass, steps_per_pass a multiple of tree_length and "
                f"next_position >= 0; got {tree_length}, {steps_per_pass}, {next_position}."
            )
        self._plan = (str(partition), int(steps_per_pass), int(tree_length))
        self._next_position = int(next_position)

    @property
    def steps(self) -> int:
        """Total number of released leaves."""
        return sum(run.trees * run.leaves for run in self.history)

    def segments(self) -> list[tuple[float, float | None, int]]:
        """Runs of consecutive released leaves with one noise multiplier: ``(z, None, leaves)`` (not subsampled)."""
        runs: list[tuple[float, float | None, int]] = []
        for run in self.history:
            if runs and runs[-1][0] == run.noise_multiplier:
                runs[-1] = (run.noise_multiplier, None, runs[-1][2] + run.trees * run.leaves)
            else:
                runs.append((run.noise_multiplier, None, run.trees * run.leaves))
        return runs

    # ---- queries ---------------------------------------------------------------------------
    def epsilon_after(self, delta: float, num_steps: int, *, noise_multiplier: float, sample_rate: float) -> float:
        """ε after the next ``num_steps`` leaves of the plan, released with multiplier z; the ledger is unchanged."""
        if sample_rate != 1.0:
            raise PrivacyConfigError(
                f"tree-aggregated releases are not subsampled (sample rate 1), got sample rate {sample_rate}: "
                "the tree accountant is for O2NC."
            )
        history = list(self.history)
        if num_steps > 0:
            if self._plan is None:
                raise ValueError("the tree accountant has no plan for future leaves: call plan(...) first.")
            self._extend(history, num_steps, float(noise_multiplier))
        return self._epsilon(history, delta) if history else 0.0

    def _extend(self, history: list[TreeRun], num_steps: int, noise_multiplier: float) -> None:
        partition, steps_per_pass, length = self._plan
        position, left = self._next_position, num_steps
        while left > 0:
            pass_index, within = divmod(position, steps_per_pass)
            tree, done = divmod(within, length)
            if done or left < length:  # the rest of a started tree, or a last partial one
                last = min(length, done + left)
                _add_leaves(history, noise_multiplier, TreeLeaf(partition, pass_index, tree, length, done + 1), last)
                taken = last - done
            else:
                trees = min(left, steps_per_pass - within) // length
                _add_trees(history, noise_multiplier, partition, pass_index, tree, trees, length)
                taken = trees * length
            position, left = position + taken, left - taken

    def _scaled_history(self, scale: float) -> list[TreeRun]:
        return [run._replace(noise_multiplier=run.noise_multiplier * scale) for run in self.history]

    def _epsilon(self, history: list[TreeRun], delta: float) -> float:
        orders = np.asarray(RDPAccountant.DEFAULT_ALPHAS, dtype=float)
        with opacus_rdp_conversion():
            eps, _ = rdp_analysis.get_privacy_spent(
                orders=orders, rdp=orders * tree_rho_squared(history) / 2, delta=delta
            )
        return float(eps)

    # ---- checkpointing ---------------------------------------------------------------------
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._plan, self._next_position = None, 0

    def _entry(self, row: Sequence[Any]) -> TreeRun:
        if len(row) != len(TreeRun._fields):
            raise PrivacyConfigError(
                f"this tree-accountant state holds {list(row)!r}, not a release ledger {TreeRun._fields}: it was "
                "written before pl_dp recorded each tree, and the released trees cannot be recovered from a step "
                "count, so it cannot be resumed soundly."
            )
        z, partition, pass_index, first_tree, trees, length, leaves = row
        return TreeRun(float(z), str(partition), int(pass_index), int(first_tree), int(trees), int(length), int(leaves))


__all__ = [
    "TreeAccountant",
    "TreeAggregatedGaussian",
    "TreeLeaf",
    "TreeRun",
    "tree_multiplicity",
    "tree_nodes",
    "tree_rho_squared",
]
