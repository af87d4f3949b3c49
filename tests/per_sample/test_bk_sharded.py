"""Book-keeping on a net sharded by FSDP2 (2 plain torch processes over gloo): the first pass reduces no gradient,
each rank keeps its block of the clipped sum over both ranks' examples — the one-process sum of all of them — and
the fit-start check of the rows it sums refuses a broken net on every rank alike. A rank's padding pass:
tests/per_sample/test_ghost_sharded.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from opacus.grad_sample.linear import compute_linear_norm_sample
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

import pl_dp.per_sample.ghost as ghost_module
from pl_dp.methods.parallel import shard, sum_gradients
from pl_dp.per_sample import BookKeeping, ShardedBookKeeping, get_per_sample_mode, verify_per_example_gradients
from pl_dp.per_sample.gradients import _on_any_rank
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.step.passes import ShardedPasses
from tests.distributed import two_ranks

# 2 plain torch processes over gloo (~20 s): `make test-slow` runs them (CI runs both suites)
pytestmark = pytest.mark.slow

CLIP = ClipFunction("constant", 1.0)
NETS = ("mlp", "tokens", "pointwise")


class _Tokens(nn.Module):
    """An embedding with a padding row, a LayerNorm and a linear head over the mean of the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)).mean(dim=1))


class _TimeMajor(nn.Module):
    """A layer that sees the batch in its second dimension (``[T, B, d]``): its rows are positions, not examples."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(x.transpose(0, 1)).transpose(0, 1).mean(dim=1))


class _ConstantRows(nn.Module):
    """A LayerNorm called on 4 constant rows (not the batch), which every example reads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.tensor([[1.0, -1.0, 0.1 * j, 0.0] for j in range(4)])
        return self.head(x) + self.norm(rows).sum(0)


def _planted_loss(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, planted = batch
    return (net(inputs) * planted).sum(1)


def _loss(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(net(inputs), labels, reduction="none")


def _most_over_ranks(count: int) -> int:
    most = torch.tensor([count])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def _whole(blocks: list[torch.Tensor]) -> list[float]:
    """Every rank's blocks of every parameter's sum, put back together (a collective)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, blocks)
    return torch.cat([torch.cat(parts).reshape(-1) for parts in zip(*gathered)]).tolist()


class _Pointwise(nn.Module):
    """A channels-last pointwise layer (ConvNeXt's): ``nn.Linear`` on ``[B, H, W, C]``, pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.pointwise = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(x).mean((1, 2))


def _batches(name: str, rank: int) -> tuple[tuple, tuple]:
    """(this rank's batch of 4 examples, both ranks' 8), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        both = (torch.randn(8, 6, generator=g) * 50, torch.randint(0, 3, (8,), generator=g))
    elif name == "pointwise":
        both = (torch.randn(8, 2, 3, 4, generator=g) * 30, torch.randint(0, 3, (8,), generator=g))
    else:
        tokens = torch.randint(0, 11, (8, 5), generator=g)
        tokens[:, -2:] = 0  # padding positions: the padding row gets no gradient
        both = (tokens, torch.randint(0, 3, (8,), generator=g))
    return tuple(t[4 * rank : 4 * rank + 4] for t in both), both


def _nets(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
    return _Pointwise() if name == "pointwise" else _Tokens()


def _worker(rank: int, mesh, results: dict) -> None:
    reductions, original = [], _fsdp_param_group.foreach_reduce

    def reduce(fsdp_params, *args, **kwargs):  # FSDP2's gradient reduction (whatever collective it then uses)
        reductions.append(len(fsdp_params))
        return original(fsdp_params, *args, **kwargs)

    _fsdp_param_group.foreach_reduce = reduce
    for name in NETS:
        net = _nets(name)
        alone = BookKeeping(copy.deepcopy(net), _loss)
        shard(net, mesh)
        passes = ShardedPasses(_most_over_ranks)
        bk = get_per_sample_mode("bk").build(net, _loss, passes)
        mine, both = _batches(name, rank)
        before = len(reductions)
        sums, norms, _ = bk.clipped_sum(mine, CLIP)
        results[f"{name}: FSDP reductions"] = len(reductions) - before
        results[f"{name}: engine"] = type(bk).__name__
        results[f"{name}: norms on rank {rank}"] = norms.tolist()
        results[f"{name}: one process norms"] = alone.per_example_norms(both).tolist()
        results[f"{name}: released on rank {rank}"] = _whole(sums)
        results[f"{name}: one process"] = torch.cat([s.reshape(-1) for s in alone.clipped_sum(both, CLIP)[0]]).tolist()
        verify_per_example_gradients(bk, both)  # raises on a wrong row
        results[f"{name}: verified on rank {rank}"] = True
    net = _nets("pointwise")
    shard(net, mesh)
    ghost = get_per_sample_mode("ghost").build(net, _loss, ShardedPasses(_most_over_ranks))
    sums, _, _ = ghost.clipped_sum(_batches("pointwise", rank)[0], CLIP)
    results[f"pointwise: released under ghost on rank {rank}"] = _whole(sums)
    net = _nets("pointwise")
    shard(net, mesh)
    ghost_module.linear_norms, measured_by = compute_linear_norm_sample, ghost_module.linear_norms
    try:  # Opacus' own linear norm returns nothing for 4-D inputs: its hooks leave the layer at norm 0
        ghost = get_per_sample_mode("ghost").build(net, _loss, ShardedPasses(_most_over_ranks))
        ghost.clipped_sum(_batches("pointwise", rank)[0], CLIP)
    except RuntimeError as refused:
        results[f"pointwise under Opacus' norm on rank {rank}"] = str(refused)
    finally:
        ghost_module.linear_norms = measured_by
    names, params = zip(*net.named_parameters())
    results[f"rank 1's refusal seen on rank {rank}"] = _on_any_rank(names, params, rank == 1)
    for mode in ("ghost", "bk"):  # a net sharded by the user's code, FSDP2 keeping gathered copies after backward
        net = _nets("mlp")
        for layer in (net[0], net[1], net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        sum_gradients(net)
        net.set_reshard_after_backward(False)
        engine = get_per_sample_mode(mode).build(net, _loss, ShardedPasses(_most_over_ranks))
        for _ in range(2):
            sums, _, _ = engine.clipped_sum(_batches("mlp", rank)[0], CLIP)
        results[f"{mode}: released without resharding on rank {rank}"] = _whole(sums)
        torch.manual_seed(0)
        net = _ConstantRows()
        shard(net, mesh)
        engine = get_per_sample_mode(mode).build(net, _planted_loss, ShardedPasses(_most_over_ranks))
        size = 4 if rank == 0 else 3  # rank 0's call on the 4 constant rows passes as a call on its batch
        try:
            engine.clipped_sum((torch.zeros(size, 4), torch.ones(size, 4)), CLIP)
        except RuntimeError as refused:
            results[f"{mode}: constant rows refused on rank {rank}"] = str(refused)
    torch.manual_seed(0)
    net = _TimeMajor()
    shard(net, mesh)
    # 2 examples of 2 positions: the rows have the batch's shape, so only their values can tell
    probe = (torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1]))
    try:
        verify_per_example_gradients(ShardedBookKeeping(net, _loss, passes=ShardedPasses(_most_over_ranks)), probe)
    except RuntimeError as refused:
        results[f"time-major refused on rank {rank}"] = str(refused)


#: ``on_two_ranks(_worker)``, started in the background when the session starts (tests/background.py)
RANKS = two_ranks.job("bk_sharded", _worker)


@pytest.mark.parametrize("name", NETS)
def test_each_rank_keeps_its_block_of_the_one_process_clipped_sum_and_no_gradient_is_reduced(name):
    """Linear (on 2-D and channels-last 4-D inputs), LayerNorm and an embedding with a padding row, examples far
    above the clip bound: both ranks' blocks put together are one process's clipped sum of both ranks' examples;
    FSDP2 reduces nothing (no parameter gradient is ever computed, unclipped or clipped); the fit-start check passes
    on every rank."""
    results = two_ranks.results(RANKS)
    assert results[f"{name}: engine"] == "ShardedBookKeeping"
    alone = torch.tensor(results[f"{name}: one process norms"])
    assert float(alone.max()) > 1.2  # the clip bound C = 1 is reached
    for rank in (0, 1):
        torch.testing.assert_close(
            torch.tensor(results[f"{name}: norms on rank {rank}"]), alone[4 * rank : 4 * rank + 4]
        )
        torch.testing.assert_close(
            torch.tensor(results[f"{name}: released on rank {rank}"]),
            torch.tensor(results[f"{name}: one process"]),
            rtol=1e-5,
            atol=1e-6,
        )
        assert results[f"{name}: verified on rank {rank}"]
    assert results[f"{name}: FSDP reductions"] == 0


def _released_as_one_process(released: str, one_process: str) -> None:
    """Each rank's record ``released`` (a key with ``{rank}``: both ranks' blocks put together) is one process's
    release ``one_process``."""
    results = two_ranks.results(RANKS)
    for rank in (0, 1):
        torch.testing.assert_close(
            torch.tensor(results[released.format(rank=rank)]),
            torch.tensor(results[one_process]),
            rtol=1e-5,
            atol=1e-6,
        )


def test_a_layer_that_sees_the_batch_in_another_dimension_is_refused_on_every_rank():
    """The rows a sharded book-keeping sums are checked against each example's own gradient at fit start; a
    time-major layer's rows are positions: refused on both ranks (neither waits at a collective the other left),
    and a refusal found on one rank only is every rank's."""
    results = two_ranks.results(RANKS)
    for rank in (0, 1):
        assert "not each example's own gradient" in results[f"time-major refused on rank {rank}"]
        assert results[f"rank 1's refusal seen on rank {rank}"]


def test_sharded_ghost_clipping_measures_a_linear_layer_on_inputs_of_any_rank():
    """A channels-last pointwise layer (``nn.Linear`` on ``[B, H, W, C]``) under sharded ghost clipping: both ranks'
    blocks put together are one process's clipped sum of both ranks' examples."""
    _released_as_one_process("pointwise: released under ghost on rank {rank}", "pointwise: one process")


def test_a_layer_whose_norm_sampler_returns_nothing_is_refused_under_sharded_ghost_clipping():
    """Opacus' FSDP hooks start each layer's norm at zeros and leave it there when its norm sampler returns nothing
    (Opacus' own linear norm on 4-D inputs, which pl_dp used until it measured them): sharded ghost clipping refuses
    the layer by name on both ranks instead of clipping it at norm 0 (its fit-start check refused it later; an
    independent review found sharded book-keeping released such a net unclipped)."""
    results = two_ranks.results(RANKS)
    for rank in (0, 1):
        assert (
            "recorded no per-example norm for ['pointwise.bias', 'pointwise.weight']"
            in results[f"pointwise under Opacus' norm on rank {rank}"]
        )


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_a_net_that_keeps_gathered_parameters_after_backward_is_summed_whole(mode):
    """A net sharded by the user's code with ``set_reshard_after_backward(False)``: after the backward its layers hold
    FSDP2's gathered copies, not the trained shards; the sums made of what the layers kept are matched to the trained
    parameters by name, so the release is one process's clipped sum (it was 0 for those layers, silently)."""
    _released_as_one_process(f"{mode}: released without resharding on rank {{rank}}", "mlp: one process")


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_a_net_refused_on_one_rank_after_its_first_pass_is_refused_on_every_rank(mode):
    """A LayerNorm called on 4 constant rows passes the row count check on the rank that sampled 4 examples and fails
    it on the rank that sampled 3: every rank raises (one all-reduce), where the rank that passed went on to its next
    collective and waited there."""
    results = two_ranks.results(RANKS)
    assert "cannot clip" in results[f"{mode}: constant rows refused on rank 1"]
    assert "another rank refused it" in results[f"{mode}: constant rows refused on rank 0"]
