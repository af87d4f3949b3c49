"""pl_dp.privacy.seal without Lightning: inside a sealed block nothing is shown, and once-registries stay intact;
a failing example is isolated by bisection and the rest of the batch is computed as if it were not there."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest
import torch

from pl_dp.privacy.seal import isolate_failures, sealed


def _warn(text: str) -> None:
    warnings.warn(text, UserWarning, stacklevel=1)


def test_a_sealed_block_shows_no_warning_log_record_or_output(capsys, caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.DEBUG), sealed():
            _warn("record 17 is odd")
            logging.getLogger("some.library").error("record 17 is odd")
            print("record 17 is odd")
            print("record 17 is odd", file=sys.stderr)
        _warn("after the block")
    assert [str(w.message) for w in caught] == ["after the block"]
    assert not caplog.records
    assert capsys.readouterr() == ("", "")


def test_sealing_keeps_the_once_registry_so_no_other_warning_repeats():
    """``warnings.catch_warnings`` would reset every module's once-registry on exit, so a warning shown once
    outside a step would be shown again after each step; the seal does not touch the filters."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            _warn("outside")  # one location, one message: shown once under "default"
            with sealed():
                _warn("inside")
    assert [str(w.message) for w in caught] == ["outside"]


def test_an_inactive_seal_changes_nothing(capsys):
    with sealed(active=False):
        print("shown")
    assert capsys.readouterr().out == "shown\n"


def test_a_warning_turned_into_an_error_still_raises():
    with warnings.catch_warnings(), pytest.raises(UserWarning):
        warnings.simplefilter("error")
        with sealed():
            _warn("as an error")


def _losses_failing_on(bad: set[int]):
    calls = []

    def compute(batch: torch.Tensor) -> torch.Tensor:
        calls.append(len(batch))
        if any(int(v) in bad for v in batch):
            raise IndexError("out of range")
        return batch.float() * 2

    return compute, calls


def test_without_failure_the_batch_is_computed_once():
    compute, calls = _losses_failing_on(set())
    done, failed = isolate_failures(compute, torch.arange(10))
    assert calls == [10] and not failed
    ((positions, result),) = done
    assert torch.equal(positions, torch.arange(10)) and torch.equal(result, torch.arange(10).float() * 2)


def test_failing_examples_are_isolated_and_the_others_computed():
    batch = torch.arange(100, 116)
    compute, calls = _losses_failing_on({103, 110})
    resets = []
    done, failed = isolate_failures(compute, batch, reset=lambda: resets.append(1))
    assert sorted(p for p, _ in failed) == [3, 10]
    assert all(isinstance(e, IndexError) for _, e in failed)
    covered = torch.cat([positions for positions, _ in done]).sort().values
    assert covered.tolist() == [i for i in range(16) if i not in (3, 10)]
    for positions, result in done:
        assert torch.equal(result, batch[positions].float() * 2)
    assert len(resets) == sum(1 for n in calls if n) - len(done)  # one reset per failed call
    assert sum(calls) < 16 * 5  # bisection: about 2·log2(16) passes over a failing example's halves


def test_interrupts_are_not_caught():
    def interrupted(batch):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        isolate_failures(interrupted, torch.arange(4))
