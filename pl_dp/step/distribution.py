"""How the work of one private step is spread over processes: one object, chosen when the fit sets up.

A data-parallel private run is one logical run: every rank computes the clipped contributions of its share of one
global Poisson batch, the ranks' sums are added *before* the noise, and every rank then adds the same noise draw.
What differs between the three layouts is where the sums live and how the passes run:

- one process (:class:`Distribution` itself): the sums are this process's; a pass that raises for one example
  leaves that example out.
- :class:`Replicated` (DDP): each rank holds the whole net; the ranks' sums and counts are added in one all-reduce.
- :class:`Sharded` (FSDP2): each rank holds a block of every parameter; a backward's reduce-scatter leaves each rank
  its block of the sum over all ranks, so only counts cross the network; the passes are collectives that every rank
  runs, in the numbers and rounds :class:`~pl_dp.step.passes.ShardedPasses` agrees on, and each rank draws the noise
  of its own blocks (:func:`~pl_dp.step.shards.block`).

A method asks its distribution rather than branching on the strategy: :meth:`Distribution.run` runs the passes,
:meth:`Distribution.sum_with_count` adds the sums across ranks, :meth:`Distribution.gradient_of_sum` differentiates a
summed loss, :meth:`Distribution.noise_blocks` says which blocks of the noise this rank draws.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pl_dp.step.passes import ShardedPasses
from pl_dp.step.seal import isolate_failures
from pl_dp.step.shards import block, local

T = TypeVar("T")

#: sums a tensor over the data-parallel ranks (a collective every rank calls)
AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


class Distribution:
    """One process: nothing crosses a network. The base of the data-parallel layouts."""

    #: the sharded step's passes (agreement, guard, padding example); None unless the net is sharded
    passes: ShardedPasses | None = None

    #: whether each rank holds only a block of each sum (FSDP2)
    sharded: bool = False

    @property
    def sum_reducer(self) -> AllReduceSum | None:
        """The sum over ranks, for an estimator's ``reduce`` hook; None on one process."""
        return None

    def run(
        self,
        parts: list[Any],
        compute: Callable[[Any], T],
        *,
        pad: Callable[[Any], T] | None = None,
        isolate: bool,
        reset: Callable[[], None] | None = None,
    ) -> tuple[list[T], int]:
        """``compute(part)`` of each micro-batch, and how many examples were left out. With ``isolate`` (a private
        run), an example whose pass raises is left out and counted rather than ending the run at the step that
        sampled it (:func:`~pl_dp.step.seal.isolate_failures`, with ``reset`` after each failure). ``pad(example)``
        is the pass, at weight 0, of the padding example that a rank runs when it has fewer micro-batches than
        another (sharded only: one process never pads)."""
        if not isolate:
            return [compute(part) for part in parts], 0
        done: list[T] = []
        failed = 0
        for part in parts:
            isolated, raised = isolate_failures(compute, part, reset=reset)
            done += [result for _, result in isolated]
            failed += len(raised)
        return done, failed

    def sum_with_count(self, sums: list[torch.Tensor], count: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The sums and a count over every rank (before the noise, which every rank then adds identically)."""
        return sums, count

    def gradient_of_sum(self, loss: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
        """∂loss/∂params, as this rank holds them."""
        return list(torch.autograd.grad(loss, params, allow_unused=True))

    def noise_blocks(self, params: list[torch.nn.Parameter]) -> list[tuple[torch.Size, int]] | None:
        """Which block of each parameter's noise this rank draws; None: the whole of each."""
        return None

    def squared_norm(self, squares: torch.Tensor) -> float:
        """‖sum‖² from this rank's squared norms of what it holds of the sums (added across ranks when sharded)."""
        return float(squares)


class Replicated(Distribution):
    """DDP: every rank holds the whole net and sums its share of the batch; ``all_reduce_sum`` adds them."""

    def __init__(self, all_reduce_sum: AllReduceSum) -> None:
        self.all_reduce_sum = all_reduce_sum

    @property
    def sum_reducer(self) -> AllReduceSum:
        return self.all_reduce_sum

    def sum_with_count(self, sums: list[torch.Tensor], count: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Sums and count in one all-reduce of their concatenation."""
        flat = self.all_reduce_sum(torch.cat([s.reshape(-1) for s in sums] + [count.to(sums[0]).reshape(1)]))
        out, offset = [], 0
        for s in sums:
            out.append(flat[offset : offset + s.numel()].view_as(s))
            offset += s.numel()
        return out, flat[-1]


class Sharded(Replicated):
    """FSDP2: each rank holds a block of every parameter, and of every sum (see the module's docstring)."""

    sharded = True
    passes: ShardedPasses

    def __init__(self, all_reduce_sum: AllReduceSum, passes: ShardedPasses) -> None:
        super().__init__(all_reduce_sum)
        self.passes = passes

    def run(
        self,
        parts: list[Any],
        compute: Callable[[Any], T],
        *,
        pad: Callable[[Any], T] | None = None,
        isolate: bool,
        reset: Callable[[], None] | None = None,
    ) -> tuple[list[T], int]:
        """Passes every rank runs (:meth:`~pl_dp.step.passes.ShardedPasses.run`: ``pad(padding example)`` on a rank
        with fewer parts; a failing example is left out and counted whether or not the run is private)."""
        if pad is None:
            raise TypeError("a sharded step's passes need the padding pass (pad) of a rank with fewer micro-batches")
        return self.passes.run(parts, compute, pad)

    def sum_with_count(self, sums: list[torch.Tensor], count: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The sums are this rank's blocks of sums over all ranks already (FSDP's reduce-scatter): only the count
        is added."""
        return sums, self.all_reduce_sum(count.float().reshape(1))[0]

    def gradient_of_sum(self, loss: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
        """This rank's block of the gradient summed over ranks (FSDP's reduce-scatter), ``.grad`` left empty."""
        loss.backward()
        grads = [None if p.grad is None else local(p.grad) for p in params]
        for p in params:
            p.grad = None
        return grads

    def noise_blocks(self, params: list[torch.nn.Parameter]) -> list[tuple[torch.Size, int]]:
        return [block(p) for p in params]

    def squared_norm(self, squares: torch.Tensor) -> float:
        return float(self.all_reduce_sum(squares.reshape(1)))
