"""One noise draw per logical step under real data parallelism: 2 CPU processes (Lightning DDP, gloo) = one
logical run.

The 2-process fits run once per session in a subprocess (tests/distributed/worker.py; Lightning's
launcher starts rank 1); the single-process references run in this process with the same seeds.
"""

import pytest
import torch

from pl_dp.privacy.sampling import PoissonBatchSampler
from tests import background
from tests.distributed import worker

#: the 2-process fits, started in the background when the session starts (tests/background.py)
TWO_PROCESSES = background.job(
    "ddp", lambda out: [worker.launch_command("2", out)], needed_by=lambda item: "runs" in item.fixturenames
)


@pytest.fixture(scope="module")
def runs():
    single = worker.run_all(1)
    out, (proc,) = TWO_PROCESSES.result()
    return worker.launch_results(out, proc), single


def _params(result):
    return torch.tensor(result["parameters"])


@pytest.mark.parametrize("name", list(worker.METHODS))
def test_replicas_are_bit_identical_and_shard_one_poisson_batch(runs, name):
    (rank0, rank1), _ = runs
    assert rank0[name]["world_size"] == rank1[name]["world_size"] == 2
    assert torch.equal(_params(rank0[name]), _params(rank1[name]))
    assert [rank0[name]["sampler"], rank1[name]["sampler"]] == [
        {"num_replicas": 2, "rank": 0},
        {"num_replicas": 2, "rank": 1},
    ]  # Lightning did not replace the sharded Poisson sampler


@pytest.mark.parametrize("name", [m for m in worker.METHODS if m != "dpzero_rank_seeded"])
def test_two_processes_equal_one_process_with_the_same_seeds(runs, name):
    """Equal up to float summation order: the clipped sums are added shard by shard across ranks."""
    (rank0, _), single = runs
    torch.testing.assert_close(_params(rank0[name]), _params(single[name]), rtol=0, atol=1e-6)
    assert rank0[name]["epsilon"] == single[name]["epsilon"]  # accounting does not see the world size
    assert rank0[name]["expected_batch_size"] == single[name]["expected_batch_size"] == worker.BATCH


@pytest.mark.parametrize("name, queries", [("dpzero", 3), ("pazo_m", 2)])
def test_zeroth_order_steps_send_a_few_scalars(runs, name, queries):
    (rank0, _), _ = runs
    result = rank0[name]
    assert result["pl_dp_bytes_per_step"] == 8 * queries  # q × (clipped sum, non-finite count), float32
    assert result["dist_bytes_per_step"] <= 8 * (queries + 2) + 16  # everything through torch.distributed
    first_order = rank0["dpsgd"]
    assert first_order["dist_bytes_per_step"] >= 4 * first_order["dimension"]


def test_first_order_noise_is_drawn_once_per_logical_step(runs):
    """Zero gradients: the update is −lr·noise/b. One σC draw per step gives std σC/b per coordinate; a
    draw per rank summed across 2 ranks would give √2 times that."""
    (rank0, _), single = runs
    expected = worker.SIGMA * worker.CLIP / worker.BATCH
    for result in (rank0["dpsgd_zero_grad"], single["dpsgd_zero_grad"]):
        per_step = torch.tensor(result["update"]).std().item() / worker.STEPS**0.5
        assert per_step == pytest.approx(expected, rel=0.08)
    assert torch.equal(
        torch.tensor(rank0["dpsgd_zero_grad"]["update"]), torch.tensor(single["dpsgd_zero_grad"]["update"])
    )


def test_sharded_poisson_sampling_is_poisson_sampling_of_the_whole_set():
    n, q, world, steps = 2000, 0.05, 3, 400
    single = PoissonBatchSampler(n, q, steps, seed=4)
    shards = [PoissonBatchSampler(n, q, steps, seed=4, num_replicas=world, rank=r) for r in range(world)]
    counts = torch.zeros(n)
    per_rank = torch.zeros(world)
    for i in range(steps):
        parts = [s.batch(i) for s in shards]
        assert sorted(sum(parts, [])) == single.batch(i)  # the union is the single-process batch
        assert all(set(a).isdisjoint(b) for j, a in enumerate(parts) for b in parts[j + 1 :])
        for r, part in enumerate(parts):
            per_rank[r] += len(part)
            counts[part] += 1
    assert counts.mean().item() / steps == pytest.approx(q, rel=0.03)  # inclusion rate of every example ≈ q
    assert (per_rank / steps).tolist() == pytest.approx([q * n / world] * world, rel=0.05)
    assert all(s.expected_batch_size == q * n for s in shards)  # every rank normalizes by the global q·n


def test_banded_noise_whose_workers_drew_with_each_ranks_own_seed_is_refused_on_every_rank(runs):
    """The workers of each rank draw batches (with the rank's own unseeded sampling seed: its own cyclic groups)
    before the ranks share rank 0's seed; the steps would mix two group assignments. Every rank refuses at fit start
    (none waits at a broadcast the other never reaches); one process has no seed to share and runs."""
    (rank0, rank1), single = runs
    for rank in (rank0, rank1):
        assert "banded noise on 2 processes needs num_workers=0" in rank["dpsgd_banded_workers"]
    assert single["dpsgd_banded_workers"] is None
