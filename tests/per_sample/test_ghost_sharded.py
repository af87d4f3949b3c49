"""Ghost clipping of a net sharded by FSDP2 (2 plain torch processes over gloo): the first pass computes no parameter
gradient (each rank's *unclipped* sum) and reduce-scatters nothing; the second reduce-scatters the clipped sum."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from pl_dp.errors import ConfigError
from pl_dp.methods.parallel import shard
from pl_dp.per_sample import GhostClipping, ShardedGhostClipping, get_per_sample_mode
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.step.independence import has_half_precision_parameters
from pl_dp.step.losses import resolve_loss
from pl_dp.step.passes import ShardedPasses
from tests.distributed import two_ranks

# 2 plain torch processes over gloo per test (~15–30 s each): `make test-slow` runs them (CI runs both suites)
pytestmark = pytest.mark.slow

#: the sharded per-sample modes
MODES = ("ghost", "bk")


def _most_over_ranks(count: int) -> int:
    most = torch.tensor([count])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def _worker(rank: int, mesh, results: dict) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
    alone = GhostClipping(copy.deepcopy(net), resolve_loss("cross_entropy"))  # the same net in one process
    shard(net, mesh)
    ghost = ShardedGhostClipping(net, resolve_loss("cross_entropy"), passes=ShardedPasses(_most_over_ranks))
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(4, 6, generator=g) * 50, torch.randint(0, 3, (4,), generator=g))
    sent, reduced = [], []
    original, foreach_reduce = dist.reduce_scatter_single, _fsdp_param_group.foreach_reduce

    def reduce(fsdp_params, *args, **kwargs):  # FSDP2's gradient reduction (whatever reduce-scatter it then uses)
        reduced.append(len(fsdp_params))
        return foreach_reduce(fsdp_params, *args, **kwargs)

    def counted(output, input, *args, **kwargs):
        sent.append(input.detach().clone())
        return original(output, input, *args, **kwargs)

    dist.reduce_scatter_single = counted
    _fsdp_param_group.foreach_reduce = reduce
    try:
        norms = ghost.per_example_norms(batch)
        first, first_reduced = len(sent), len(reduced)
        sums, _, _ = ghost.clipped_sum(batch, ClipFunction("constant", 1.0))
    finally:
        dist.reduce_scatter_single, _fsdp_param_group.foreach_reduce = original, foreach_reduce
    results[f"norms match on rank {rank}"] = torch.allclose(norms, alone.per_example_norms(batch), rtol=1e-6)
    for mode in MODES:
        results[f"{mode}: moved by one example on rank {rank}"] = _moved_by_an_absorbing_example(mode, rank, mesh)
    if rank == 0:
        results["first pass"] = first
        results["first pass, FSDP reductions"] = first_reduced
        results["both passes, FSDP reductions"] = len(reduced) - first_reduced
        results["second pass"] = len(sent) - first
        results["largest norm"] = float(norms.max())
        results["largest sent"] = max(float(t.norm()) for t in sent[first:])


def _planted_loss(net, batch):
    inputs, planted = batch
    return (net(inputs) * planted).sum((1, 2))


def _moved_by_an_absorbing_example(mode: str, rank: int, mesh) -> float:
    """How far one example moves the release of a LayerNorm over 16 examples, 8 per rank: each adds about C·e₀ to
    the weight at one position, but rank 0's last one has positions whose output gradients ±2⁴⁰·e₀ cancel (its
    gradient is 0, its norm 0, its clip weight 1) — against the same batch with that example's output gradients 0."""
    inputs = torch.zeros(8, 2, 4)
    inputs[:, :, 0], inputs[:, :, 1] = 1.0, -1.0
    planted = torch.zeros(8, 2, 4)
    planted[:, 0, 0] = 1.0
    releases = []
    for absorbing in (2.0**40, 0.0):
        if rank == 0:
            planted[-1, 0, 0], planted[-1, 1, 0] = absorbing, -absorbing
        torch.manual_seed(0)
        net = nn.Sequential(nn.LayerNorm(4))
        shard(net, mesh)
        engine = get_per_sample_mode(mode).build(net, _planted_loss, ShardedPasses(_most_over_ranks))
        sums, _, _ = engine.clipped_sum((inputs, planted), ClipFunction("constant", 1.0))
        releases.append(torch.cat([s.reshape(-1) for s in sums]))
    squared = (releases[0] - releases[1]).square().sum()
    dist.all_reduce(squared)  # each rank holds its block of each parameter's sum
    return float(squared.sqrt())


#: ``on_two_ranks(_worker)``, started in the background when the session starts (tests/background.py)
RANKS = two_ranks.job("ghost_sharded", _worker)


def test_the_first_pass_sends_no_unclipped_gradient():
    results = two_ranks.results(RANKS)
    assert results["norms match on rank 0"] and results["norms match on rank 1"]
    assert results["largest norm"] > 2  # the examples' gradients are above the clip bound C = 1
    assert results["first pass"] == 0
    # FSDP2 reduces the gradients a backward left on the gathered parameters: none are computed, none reduced
    assert results["first pass, FSDP reductions"] == 0
    assert results["both passes, FSDP reductions"] > 0  # the second pass's
    assert results["second pass"] > 0
    assert results["largest sent"] <= 4 * 1.0 + 1e-5  # a clipped sum of 4 examples, each at most C


@pytest.mark.parametrize("mode", MODES)
def test_an_example_whose_positions_cancel_cannot_absorb_the_others_in_a_sharded_release(mode):
    """A LayerNorm's sum is made of its clipped per-example gradients on a sharded net too, summed over the ranks:
    an example whose positions ±2⁴⁰·e₀ cancel (norm 0) moves the release of 16 examples by at most C. Sharded ghost
    clipping took this sum from its second backward, whose fp32 reduction over the rank's positions the example's
    first position swallowed its rank's other 7 examples' contributions in (7·C moved)."""
    results = two_ranks.results(RANKS)
    for rank in (0, 1):
        assert results[f"{mode}: moved by one example on rank {rank}"] <= 1.0 + 1e-3


def _root_of_first_logit(net, batch):
    """Cross-entropy plus √|first logit|: finite at every input, its gradient infinite where that logit is 0."""
    inputs, labels = batch
    out = net(inputs)
    return nn.functional.cross_entropy(out, labels, reduction="none") + out[:, 0].abs().sqrt()


def _padding_worker(rank: int, mesh, results: dict) -> None:
    clip = ClipFunction("constant", 1.0)
    padding = (torch.zeros(1, 4), torch.tensor([0]))  # its first logit is 0: a non-finite gradient
    passes = ShardedPasses(_most_over_ranks, padding=padding)
    example = (torch.randn(1, 4, generator=torch.Generator().manual_seed(5)), torch.tensor([1]))
    parts = [] if rank == 0 else [example]  # rank 0 sampled nothing: it runs the padding example at weight 0
    for mode in MODES:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4), nn.Linear(4, 2, bias=False))
        alone = get_per_sample_mode(mode).build(copy.deepcopy(net), _root_of_first_logit, None)
        shard(net, mesh)
        engine = get_per_sample_mode(mode).build(net, _root_of_first_logit, passes)
        done, _ = passes.run(
            parts, partial(engine.clipped_sum, clip_fn=clip), partial(engine.padding_sum, clip_fn=clip)
        )
        blocks: list = [None, None]
        dist.all_gather_object(blocks, done[0][0])  # each rank's rows of each parameter's sum
        whole = [torch.cat([mine, theirs]) for mine, theirs in zip(*blocks)]
        results[f"{mode}: padding norm on rank {rank}"] = float(engine.per_example_norms(padding)[0])
        results[f"{mode}: released on rank {rank}"] = torch.cat([w.reshape(-1) for w in whole]).tolist()
        expected = alone.clipped_sum(example, clip)[0]
        results[f"{mode}: one process"] = torch.cat([e.reshape(-1) for e in expected]).tolist()
    scaled = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    scaled.register_parameter("gamma", nn.Parameter(torch.ones(2)))  # a raw parameter: the net measured whole
    shard(scaled, mesh)
    try:
        ShardedGhostClipping(scaled, _root_of_first_logit, passes=passes)
    except ConfigError as refused:
        results[f"raw parameter on rank {rank}"] = str(refused)
    for field in ("param_dtype", "output_dtype"):
        half = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
        for layer in half:
            fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**{field: torch.bfloat16}))
        fully_shard(half, mesh=mesh)
        results[f"{field}: counted as half precision on rank {rank}"] = has_half_precision_parameters(half)
        for mode in MODES:
            try:
                get_per_sample_mode(mode).build(half, _root_of_first_logit, passes)
            except ConfigError as refused:
                results[f"{mode}, {field}: half-precision policy on rank {rank}"] = str(refused)


PADDING = two_ranks.job("ghost_sharded_padding", _padding_worker)


@pytest.mark.parametrize("mode", MODES)
def test_a_padding_example_with_a_non_finite_gradient_adds_nothing_to_the_release(mode):
    """A rank with no examples runs the padding example at weight 0; its gradient is non-finite (0·∞ would be NaN):
    the release is the other rank's example's clipped gradient alone, finite — ghost clipping's second backward,
    the LayerNorm's sum over the ranks of its per-example gradients and book-keeping's alike."""
    results = two_ranks.results(PADDING)
    padding_norm = results[f"{mode}: padding norm on rank 0"]
    assert padding_norm != padding_norm  # NaN: what a padding pass meets
    assert "FSDP2 does not allow" in results["raw parameter on rank 0"]  # not Opacus' failed deepcopy
    released = torch.tensor(results[f"{mode}: released on rank 0"])
    assert torch.isfinite(released).all()
    assert torch.allclose(released, torch.tensor(results[f"{mode}: one process"]), atol=1e-6)


@pytest.mark.parametrize("field", ["param_dtype", "output_dtype"])
@pytest.mark.parametrize("mode", MODES)
def test_a_net_sharded_with_a_half_precision_policy_is_refused(mode, field):
    """A net its own code sharded with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` stores fp32 shards but
    computes in bf16 (16·C released under ghost clipping, an independent review), and one with
    ``output_dtype=torch.bfloat16`` rounds the gradient that comes back through each layer's output (1.004·C): ghost
    clipping and book-keeping refuse both on every rank, naming the layers and the dtype, and a zeroth-order run counts
    them as half precision (one batch shape)."""
    results = two_ranks.results(PADDING)
    for rank in (0, 1):
        refused = results[f"{mode}, {field}: half-precision policy on rank {rank}"]
        assert "MixedPrecisionPolicy" in refused and f"0 ({field}=torch.bfloat16)" in refused
        assert results[f"{field}: counted as half precision on rank {rank}"]
