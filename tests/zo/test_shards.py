"""Sharded perturbation (pl_dp.step.shards): on 2 ranks holding FSDP-style Shard(0) blocks of each parameter, the
engine writes exactly the slice of the direction one process writes — bit for bit — for every direction kind, under
a mask, with importance values and with fp32 masters, including chunks that straddle the edge of a block.

The 2 ranks are plain torch processes over gloo (``torch.distributed.tensor.distribute_tensor``), no Lightning.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_dp.step.shards import layout_of
from pl_dp.zo.engine import CPU_CHUNK, Direction, PerturbationEngine
from pl_dp.zo.mask import DirectionMask
from pl_dp.zo.master import MasterWeights
from tests.distributed import two_ranks

# rows chosen so that chunks of CPU_CHUNK coordinates straddle the edge between the two ranks' blocks
SHAPES = [(7, CPU_CHUNK // 3 + 5), (CPU_CHUNK + 11,), (5, 3)]
CASES = [
    ("gaussian", False, torch.float32),
    ("sphere", False, torch.float32),
    ("rademacher", False, torch.float32),
    ("lowrank", False, torch.float32),
    ("gaussian", True, torch.float32),
    ("sphere", True, torch.float32),
    ("lowrank", True, torch.float32),
    ("gaussian", False, torch.bfloat16),
]


def _parameters(dtype: torch.dtype) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in SHAPES]


def _mask() -> DirectionMask:
    g = torch.Generator().manual_seed(1)
    numels = [torch.Size(s).numel() for s in SHAPES]
    indices = [torch.randperm(n, generator=g)[: n // 2].sort().values for n in numels[:2]] + [None]
    values = [torch.rand(len(i), generator=g) + 0.5 for i in indices[:2]] + [None]
    return DirectionMask(numels, indices, values)


def _run(engine: PerturbationEngine) -> None:
    """Two queries of a step as the estimator runs them, then the fused restore and update."""
    engine.perturb((3, 0), 1e-2)
    engine.perturb((3, 0), -1e-2, times=2)
    engine.perturb((3, 0), 1e-2)
    engine.perturb((3, 1), 1e-2)
    engine.perturb((3, 1), -1e-2, times=2)
    engine.combine([((3, 0), -0.3), ((3, 1), 1e-2 + 0.2)])


def _single(kind: str, masked: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    params = _parameters(dtype)
    mask = _mask() if masked else None
    _run(PerturbationEngine(params, 42, Direction(kind), mask=mask, masters=MasterWeights()))
    return [p.detach().clone() for p in params]


def _worker(rank: int, mesh, results: dict) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    for case in CASES:
        kind, masked, dtype = case
        params = [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in _parameters(dtype)]
        engine = PerturbationEngine(params, 42, Direction(kind), mask=_mask() if masked else None)
        _run(engine)
        full = [p.detach().full_tensor() for p in params]
        if rank == 0:
            results[case] = (full, [layout_of("p", p).offset for p in params])


#: ``on_two_ranks(_worker)``, started in the background when the session starts (tests/background.py)
RANKS = two_ranks.job("shards", _worker, needed_by=lambda item: "sharded" in item.fixturenames)


@pytest.fixture(scope="module")
def sharded():
    return two_ranks.results(RANKS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'masked' if c[1] else 'dense'}-{c[2]}")
def test_two_ranks_write_what_one_process_writes(sharded, case):
    full, offsets = sharded[case]
    assert offsets[0] == 0
    for got, want in zip(full, _single(*case)):
        assert torch.equal(got, want)


def test_blocks_straddle_chunks(sharded):
    """The case the test is for: rank 1's block of the first two parameters starts inside a chunk."""
    rows = [-(-s[0] // 2) for s in SHAPES]
    starts = [r * torch.Size(s[1:]).numel() for r, s in zip(rows, SHAPES)]
    assert all(start % CPU_CHUNK for start in starts[:2])


class _Counting(nn.Linear):
    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


@pytest.mark.parametrize("size, physical, forwards", [(0, None, 2), (5, 2, 4), (5, None, 3)])
def test_a_sharded_evaluation_runs_as_many_forwards_as_every_rank(size, physical, forwards):
    """A sharded forward is a collective: a rank with fewer (or no) examples pads with forwards on a fixed padding
    example (a net may not run an empty batch), and the losses are those of its examples."""
    from pl_dp.step.losses import resolve_loss
    from pl_dp.step.passes import ShardedPasses
    from pl_dp.zo.estimator import per_sample_evaluator

    net, loss = _Counting(3, 2), resolve_loss("cross_entropy")
    batch = (torch.randn(size, 3), torch.randint(0, 2, (size,)))
    _Counting.calls = 0
    padding = (torch.randn(1, 3), torch.zeros(1, dtype=torch.long))
    answers = iter([forwards])  # the most passes any rank needs, then (no example raised) the retries' agreement
    passes = ShardedPasses(lambda count: next(answers, count), padding=padding)
    padded = per_sample_evaluator(net, loss, batch, size, physical, sharded=passes)()
    assert _Counting.calls == forwards
    assert torch.equal(padded, per_sample_evaluator(net, loss, batch, size, physical)())
