"""The layouts of a step over processes (:mod:`pl_dp.step.distribution`); the two-process runs in
tests/distributed/ check them end to end (DDP and FSDP2 fits that end where one process ends)."""

from __future__ import annotations

import pytest
import torch

from pl_dp.step.distribution import Distribution, Replicated


def _fails_on_negative(part: torch.Tensor) -> torch.Tensor:
    if bool((part < 0).any()):
        raise RuntimeError("a record the net cannot run")
    return part.sum()


def test_one_process_leaves_a_failing_example_out_of_a_private_run_and_counts_it():
    parts = [torch.tensor([1.0, -1.0, 2.0]), torch.tensor([3.0])]
    done, failed = Distribution().run(parts, _fails_on_negative, isolate=True)
    assert failed == 1
    assert float(sum(done)) == 6.0


def test_one_process_without_privacy_raises_what_the_pass_raises():
    with pytest.raises(RuntimeError, match="a record the net cannot run"):
        Distribution().run([torch.tensor([-1.0])], _fails_on_negative, isolate=False)


def test_replicas_sum_the_sums_and_the_count_in_one_collective():
    calls: list[torch.Tensor] = []

    def two_equal_ranks(tensor: torch.Tensor) -> torch.Tensor:  # what a sum over two ranks holding the same gives
        calls.append(tensor)
        return 2 * tensor

    sums = [torch.arange(6.0).reshape(2, 3), torch.tensor([7.0])]
    summed, count = Replicated(two_equal_ranks).sum_with_count(sums, torch.tensor(3))
    assert len(calls) == 1
    assert [s.tolist() for s in summed] == [(2 * sums[0]).tolist(), [14.0]]
    assert float(count) == 6.0
