"""The passes of a private step on a net sharded by FSDP2: every rank runs each of them.

A sharded forward is a sequence of collectives (FSDP2 all-gathers each layer's parameters; a backward
reduce-scatters its gradients), so every rank must run as many passes as the others, whatever its share of the
Poisson batch, and a pass that cannot go on for one rank must stop for all. :class:`ShardedPasses` is what the
passes of a sharded step share: how the ranks agree on a number of passes (the most any rank needs), the fixed
non-private example a rank with fewer examples runs at weight 0 (a net may not run an empty batch), the guard that
keeps the ranks' forwards in step when one raises on one rank (:class:`~pl_dp.step.seal.ForwardsInStep`), and the
rounds in which the examples of an abandoned pass run again. A method holds one only while its net is sharded: one
process, and DDP replicas whose passes are their own, need none of it.

Whether the padding example failed — a net or loss broken for a fixed example that is not private, whatever was
sampled — travels in the same agreements, as a count no rank can need (:data:`PADDING_FAILS`), and ends the step on
every rank at once (:func:`agreed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pl_dp.step.batches import batch_size_of, select_examples
from pl_dp.step.seal import PADDING_FAILED, ForwardsInStep, PassFailed

T = TypeVar("T")

#: what a rank sends in an agreement when the padding example failed there: more passes than any rank can need
PADDING_FAILS = 1 << 30


def agreed(value: float) -> int:
    """A count the ranks agreed on (their maximum), or the ``RuntimeError`` of a failed padding example (raised on
    every rank: each received :data:`PADDING_FAILS`)."""
    if value >= PADDING_FAILS:
        raise RuntimeError(PADDING_FAILED)
    return int(value)


@dataclass(eq=False)
class ShardedPasses:
    """What the passes of one sharded step share (see the module's docstring).

    ``agree(count)`` returns the most any rank sends (a collective every rank calls); ``in_step`` guards each pass;
    ``padding`` is the fixed non-private example, set by the module at fit start.
    """

    agree: Callable[[int], int]
    in_step: ForwardsInStep | None = None
    padding: Any = None

    def passes(self, count: int, padding_failed: bool = False) -> int:
        """The number of passes every rank runs when this one needs ``count`` (see :func:`agreed`)."""
        return agreed(self.agree(PADDING_FAILS if padding_failed else count))

    def check(self, error: Exception | None, *, padding: bool = False) -> None:
        """After a pass's forward, on every rank (an agreement): nothing if it ran on every rank; if it raised on some
        rank, every rank leaves it (:meth:`abandon`) and raises :class:`~pl_dp.step.seal.PassFailed` (``here``:
        whether ``error`` was raised on this one), before any backward; raised by the ``padding`` example, the
        ``RuntimeError`` of :func:`agreed` on every rank."""
        try:
            failed = self.passes(int(error is not None), padding_failed=padding and error is not None)
        except RuntimeError as padding_failed:
            raise padding_failed from error
        if failed:
            self.abandon()
            raise PassFailed(here=error is not None) from error

    @contextlib.contextmanager
    def guard(self, backward_follows: bool = False) -> Iterator[None]:
        """One pass, kept in step with the other ranks' if it raises here (:meth:`ForwardsInStep.guard`)."""
        with self.in_step.guard(backward_follows=backward_follows) if self.in_step else contextlib.nullcontext():
            yield

    def abandon(self) -> None:
        """Every rank leaves the pass that failed on one of them, with the same FSDP state."""
        if self.in_step is not None:
            self.in_step.abandon()

    def run(self, parts: list[Any], compute: Callable[[Any], T], pad: Callable[[Any], T]) -> tuple[list[T], int]:
        """``compute(part)`` of each of this rank's ``parts`` — a pass, forward and backward, that every rank runs —
        in rounds whose length the ranks agree on; a rank with fewer runs ``pad(padding)``, the pass of the padding
        example at weight 0, whose result holds its shard of the other ranks' sums and nothing of its own.

        A pass whose loss raises on some rank is abandoned by all (:class:`~pl_dp.step.seal.PassFailed`, raised on
        every rank before the pass's backward); the rank where it raised runs that part's examples one by one in a
        later round, and an example that raises alone is left out and counted; the others run their abandoned part
        again. Returns the results (padding passes included) and the number of examples left out.
        """
        results, failed, queue = [], 0, list(parts)
        rounds = self.passes(len(queue))
        while rounds:
            retry = []
            for r in range(rounds):
                part = queue[r] if r < len(queue) else None
                try:
                    result = pad(self.padding) if part is None else compute(part)
                except PassFailed as failure:
                    if part is None:
                        continue
                    size = batch_size_of(part)
                    if not failure.here:
                        retry.append(part)
                    elif size > 1:
                        retry += [select_examples(part, torch.tensor([i])) for i in range(size)]
                    else:
                        failed += 1
                    continue
                results.append(result)
            queue = retry
            rounds = self.passes(len(queue))
        return results, failed
