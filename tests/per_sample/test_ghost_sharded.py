"""Ghost clipping of a net sharded by FSDP2 (2 plain torch processes over gloo): the first pass, whose parameter
gradients are each rank's *unclipped* sums, sends nothing; the second reduce-scatters the clipped sum."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pl_dp.methods.parallel import shard
from pl_dp.per_sample import GhostClipping
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.privacy.losses import resolve_loss
from tests.distributed import on_two_ranks


def _worker(rank: int, mesh, results: dict) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    shard(net, mesh)
    ghost = GhostClipping(net, resolve_loss("cross_entropy"))
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(4, 6, generator=g) * 50, torch.randint(0, 3, (4,), generator=g))
    sent = []
    original = dist.reduce_scatter_single

    def counted(output, input, *args, **kwargs):
        sent.append(input.detach().clone())
        return original(output, input, *args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        norms = ghost.per_example_norms(batch)
        first = len(sent)
        sums, _, _ = ghost.clipped_sum(batch, ClipFunction("constant", 1.0))
    finally:
        dist.reduce_scatter_single = original
    if rank == 0:
        results["first pass"] = first
        results["second pass"] = len(sent) - first
        results["largest norm"] = float(norms.max())
        results["largest sent"] = max(float(t.norm()) for t in sent[first:])


def test_the_first_pass_sends_no_unclipped_gradient():
    results = on_two_ranks(_worker)
    assert results["largest norm"] > 2  # the examples' gradients are above the clip bound C = 1
    assert results["first pass"] == 0
    assert results["second pass"] > 0
    assert results["largest sent"] <= 4 * 1.0 + 1e-5  # a clipped sum of 4 examples, each at most C
