"""pl_dp.step.seal without Lightning: inside a sealed block nothing is shown, and once-registries stay intact;
a failing example is isolated by bisection and the rest of the batch is computed as if it were not there."""

from __future__ import annotations

import collections
import copy
import logging
import sys
import warnings

import numpy as np
import pytest
import torch

from pl_dp.step.seal import PlainAttributes, isolate_failures, sealed
from tests import background
from tests.distributed import two_ranks


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


def _divide_by_zero() -> None:
    np.divide(np.zeros(1), np.zeros(1))  # numpy warns from C: "invalid value encountered in divide"


def test_a_warning_first_raised_inside_a_seal_is_still_shown_after_it():
    """Whether a warning is shown after the seal must not depend on what was raised inside it: a private record that
    first raised it would otherwise hide the same warning raised later by public data (an ignored warning is written
    to no once-registry). Python-level and C-level (numpy) warnings alike."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            with sealed():
                _warn("the same")
                _divide_by_zero()
        _warn("the same")
        _divide_by_zero()
        _warn("the same")  # and once only, after that
    assert [str(w.message) for w in caught] == ["the same", "invalid value encountered in divide"]


def test_a_once_only_log_helper_remembers_nothing_from_inside_a_seal(caplog):
    """Hugging Face's ``logger.warning_once`` caches the messages it logged: called inside the seal, the cache
    would hide the same message logged later from public data."""
    import transformers.utils.logging  # noqa: F401 - adds warning_once to logging.Logger

    logger = logging.getLogger("pl_dp.tests.once")
    with sealed():
        logger.warning_once("a record is odd")
    with caplog.at_level(logging.WARNING, logger="pl_dp.tests.once"):
        logger.warning_once("a record is odd")
    assert [r.getMessage() for r in caplog.records] == ["a record is odd"]


def test_the_warning_filters_are_put_back_even_when_the_block_raises():
    kept = warnings.filters[:]
    with pytest.raises(KeyError), sealed():
        raise KeyError("a record")
    assert warnings.filters == kept


def test_an_inactive_seal_changes_nothing(capsys):
    with sealed(active=False):
        print("shown")
    assert capsys.readouterr().out == "shown\n"


def test_a_warning_turned_into_an_error_still_raises():
    with warnings.catch_warnings(), pytest.raises(UserWarning):
        warnings.simplefilter("error")
        with sealed():
            _warn("as an error")


class _Unrefillable(dict):
    """A dict that refuses ``update``, as Hugging Face's ``ModelOutput`` does."""

    def update(self, *args, **kwargs) -> None:
        raise RuntimeError("you cannot use update on this instance")


class _Cached(torch.nn.Module):
    """A module with plain attributes of every kind a forward may grow or change."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)
        self.inner.seen = [1, 2]  # in a submodule
        self.table, self.first, self.second = torch.zeros(1), "a", "b"
        self.cache, self.lengths, self.tags = {"k": 1}, [3], {"x"}
        self.ordered, self.counts = collections.OrderedDict(k=1), collections.Counter("ab")
        self.frozen = _Unrefillable(k=1)
        self.register_buffer("rotary", torch.zeros(2), persistent=True)


def test_plain_attributes_are_put_back_as_they_were_and_registries_left_alone():
    """What a forward stores on the net from a private batch is undone after the step (a pickle of the net would
    carry it): added attributes removed, reassigned or deleted ones put back (the same objects, by key: two values
    swapped between keys too), lists, dicts and sets refilled in place (an OrderedDict or a Counter too: reviews),
    buffers registered or bound anew put back with their persistence (a rotary table grown to the longest input);
    parameters, submodules and the training flag are not touched."""
    net = _Cached()
    before = {key: value for key, value in net.__dict__.items()}
    rotary = net.rotary
    lists = (net.cache, net.lengths, net.tags, net.inner.seen, net.ordered, net.counts)
    contents = [copy.copy(value) for value in lists]
    attributes = PlainAttributes(net)
    net.table = torch.zeros(37)  # grown to the longest record
    net.added = "from the batch"
    del net.__dict__["first"]
    net.__dict__["first"], net.__dict__["second"] = "b", "a"  # swapped, keys re-inserted in another order
    net.cache["long"] = 37
    net.lengths.append(37)
    net.tags.add("y")
    net.inner.seen[0] = 99
    net.ordered["long"], net.counts["c"], net.frozen["long"] = 37, 37, 37
    net.register_buffer("state", torch.ones(1))
    net.register_buffer("rotary", torch.zeros(37), persistent=False)  # grown, and left out of the state dict
    net.inner.weight.requires_grad_(False)
    net.eval()
    attributes.restore()
    assert "added" not in net.__dict__ and net.table is before["table"]
    assert (net.first, net.second) == ("a", "b")
    for value, saved in zip(lists, contents):
        assert value == saved
    objects = (net.cache, net.lengths, net.tags, net.inner.seen, net.ordered, net.counts)
    assert all(a is b for a, b in zip(objects, lists))  # the same objects, refilled
    assert not hasattr(net, "state") and net.rotary is rotary and "rotary" in net.state_dict()
    assert net.frozen == {"k": 1}  # refilling it raised: a copy of it in its place
    assert not net.training and not net.inner.weight.requires_grad  # the mode and the parameters: not the restore's
    net.train()
    attributes = PlainAttributes(net)
    last = list(net.__dict__)[-1]
    value = net.__dict__[last]
    net.__dict__["renamed"] = net.__dict__.pop(last)  # the same values in the same order, one under another key
    attributes.restore()
    assert net.__dict__[last] is value and "renamed" not in net.__dict__


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


class _Touchy(torch.nn.Module):
    """Three sharded layers; the forward raises between the first two, on a batch whose first feature is 99."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)
        if bool((x[:, 0] == 99.0).any()):
            raise ValueError("a touchy record")
        return self.c(torch.tanh(self.b(hidden)))


def _forwards_in_step(rank: int, mesh, results: dict) -> None:
    """Rank 0's forward raises between two layers (or, once, in the loss before the forward) while rank 1's runs;
    then both take a gradient through the sharded net."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pl_dp.step.seal import ForwardsInStep

    torch.manual_seed(0)
    net = _Touchy()
    reference = [p.detach().clone() for p in net.parameters()]
    for layer in (net.a, net.b, net.c):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    with torch.no_grad():  # FSDP2 allocates the gathered memory at the first all-gather: not in inference mode
        for layer in (net.a, net.b, net.c):
            layer.unshard()
            layer.reshard()
    in_step = ForwardsInStep(net)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    bad = x.clone()
    bad[0, 0] = 99.0
    with torch.inference_mode():
        net(x)  # a forward that completes: the order of the gathers
    failed = []

    def loss(batch: torch.Tensor, before: bool) -> torch.Tensor:
        if before:
            raise ValueError("raised before the net ran")
        return net(batch).sum(dim=1)

    for before in (False, True, False, False):
        try:
            with torch.inference_mode(), in_step.guard():
                loss(bad if rank == 0 else x, before and rank == 0)
            raised = 0.0
        except ValueError:
            raised = 1.0
        flag = torch.tensor([raised])
        dist.all_reduce(flag)  # the ranks meet at their next collective
        failed.append(float(flag))
    history = len(net._get_fsdp_state()._comm_ctx.post_forward_order)
    net(x).square().sum().backward()  # outside any guard, as a public gradient is taken
    whole = [p.grad.full_tensor() for p in net.parameters()]
    plain = _Touchy()
    with torch.no_grad():
        for p, value in zip(plain.parameters(), reference):
            p.copy_(value)
    plain(x).square().sum().backward()
    results[rank] = {
        "failed": failed,
        "history": history,
        "gradient_error": max(float((g - p.grad).abs().max()) for g, p in zip(whole, plain.parameters())),
    }


#: ``on_two_ranks(_forwards_in_step)``, started in the background when the session starts (tests/background.py)
FORWARDS_IN_STEP = two_ranks.job(
    "seal",
    _forwards_in_step,
    background.for_test("test_a_sharded_forward_that_raises_between_layers_on_one_rank_keeps_the_ranks_in_step"),
)


def test_a_sharded_forward_that_raises_between_layers_on_one_rank_keeps_the_ranks_in_step():
    """Without :class:`ForwardsInStep` rank 0 leaves its forward after the first layer's all-gather while rank 1
    goes on to gather the second: a collective mismatch (gloo aborts) at the pass whose batch held the record.
    Guarded, rank 0 issues the rest of the gathers; both meet at the next collective, four times, and a backward
    afterwards, outside any guard — whose all-gathers FSDP prefetches from its post-forward history, reset on every
    rank at the end of every forward-only pass (rank 1's would hold one forward more: a hang) — gives the gradient of
    one process."""
    results = two_ranks.results(FORWARDS_IN_STEP)
    for rank in (0, 1):
        assert results[rank]["failed"] == [1.0, 1.0, 1.0, 1.0]
        assert results[rank]["gradient_error"] < 1e-6
    assert results[0]["history"] == results[1]["history"] == 0  # rank 1 held a forward more, or all since the start


def test_a_net_sharded_only_in_its_layers_is_refused():
    """Whether a forward completed is read off the FSDP2 root's hooks: a net whose layers are sharded but not the net
    itself has no single root, and is refused with what to do."""
    from pl_dp.step.seal import ForwardsInStep

    with pytest.raises(ValueError, match="apply fully_shard to the net itself"):
        ForwardsInStep(torch.nn.Sequential(torch.nn.Linear(2, 2)))
