"""Sharded private training: the zeroth-order methods, and DP-SGD and Coupling with book-keeping and ghost clipping,
under Lightning's ``ModelParallelStrategy`` (FSDP2, each of 2 CPU processes holding half of every parameter) are the
one logical run that one process is (invariant 11).

The sharded fits run once per session in a subprocess (tests/distributed/worker.py sharded); the single-process
references run here with the same seeds.
"""

import pytest
import torch

from tests import background
from tests.distributed import worker

# two sharded fits of every method in 2 processes (~90 s): `make test-slow` runs them (CI runs both suites)
pytestmark = pytest.mark.slow


SEEDED = [name for name in worker.SHARDED_METHODS if name != "dpzero_rank_seeded"]

#: the sharded fits, started in the background when the session starts (tests/background.py)
SHARDED = background.job(
    "fsdp", lambda out: [worker.launch_command("sharded", out)], needed_by=lambda item: "runs" in item.fixturenames
)


@pytest.fixture(scope="module")
def runs():
    single = {name: worker.run_one(name, 1) for name in SEEDED}
    out, (proc,) = SHARDED.result()
    return worker.launch_results(out, proc), single


def _params(result):
    return torch.tensor(result["parameters"])


@pytest.mark.parametrize("name", SEEDED)
def test_two_sharded_processes_end_where_one_process_ends(runs, name):
    """Within float rounding, not bit for bit: a rank runs the forward on its rows only (a BLAS may choose its
    kernel by the row count, so an example's loss can round differently: 2,955 of 24,800 splits of a batch through
    ``nn.Linear(12, 4)`` on one CPU) and the ranks' partial sums add in another order. DPZero ended bit for bit on
    the machine it was written on, up to 5.2e-7 away on another. Ghost DP-SGD and Coupling: the noise of each shard
    is its slice of the one whole-tensor draw, the clipped sums are FSDP's reduce-scatter of both ranks' (padded
    with empty micro-batches where a rank has fewer)."""
    (rank0, rank1), single = runs
    assert rank0[name]["world_size"] == 2
    assert [rank0[name]["sampler"], rank1[name]["sampler"]] == [
        {"num_replicas": 2, "rank": 0},
        {"num_replicas": 2, "rank": 1},
    ]
    assert rank0[name]["nonfinite_total"] == single[name]["nonfinite_total"]
    torch.testing.assert_close(_params(rank0[name]), _params(single[name]), rtol=0, atol=1e-5)
    assert rank0[name]["epsilon"] == single[name]["epsilon"]  # accounting does not see the layout


@pytest.mark.parametrize("name", list(worker.SHARDED_METHODS))
def test_sharded_steps_send_a_few_scalars_beyond_the_gathers(runs, name):
    """Beyond FSDP's own collectives, a zeroth-order step sends q × (clipped sum, count), the number of forwards,
    and for each of its 2q evaluations how many single-example retries the ranks run (0 unless a loss raised):
    8 + 24·q bytes, whatever the model size. A first-order step: the count, the rounds of passes and, for each
    pass, whether it failed on some rank, whether some rank refused the net after its first pass and whether some
    rank saw a non-finite norm (8 bytes each): a few scalars a pass, whatever the model size (more passes where a
    non-finite norm makes the ranks run a pass again; under 512 bytes a step here, against the 1,104 of the MLP's
    parameters). Like
    FSDP's reduce-scatter of ghost clipping's second backward, book-keeping's sum over the ranks of each parameter's
    clipped sum (:class:`~pl_dp.per_sample.ShardedBookKeeping`) is the model-sized exchange of any sharded step,
    not counted here."""
    (rank0, _), _ = runs
    model = worker.SHARDED_METHODS[name]()
    queries = getattr(model, "queries", None)
    if queries is not None and name != "pazo_p":
        assert rank0[name]["pl_dp_bytes_per_step"] == 8 + 24 * queries
    else:
        assert rank0[name]["pl_dp_bytes_per_step"] <= 512


def test_ranks_with_their_own_seeds_share_rank_0s(runs):
    """Every rank starts from its own global seed: rank 0's direction seed (and, in memory, its noise key and
    sampling seed) must reach the others, or each shard would move along a block of another direction."""
    (rank0, rank1), _ = runs
    name = "dpzero_rank_seeded"
    assert rank0[name]["direction_seed"] == rank1[name]["direction_seed"]
    assert rank0[name]["private_steps"] == rank1[name]["private_steps"] == worker.STEPS


@pytest.mark.parametrize("key", list(worker.RESUMED))
def test_kill_and_resume_from_a_sharded_checkpoint_is_the_same_run(runs, key):
    """Reproduction mode (both secrets seeded): resumed from a distributed checkpoint after 2 of 4 steps, the
    sharded run ends where the uninterrupted one ends, with the same ε (invariant 5 on a sharded layout). bf16
    weights too: their fp32 masters are in the checkpoint, by shard (restarted from the bf16 weights, 263 of the
    MLP's 292 weights ended elsewhere, by up to 0.015)."""
    (rank0, _), _ = runs
    resumed, straight = rank0[key], rank0[worker.RESUMED[key]]
    assert torch.equal(_params(resumed), _params(straight))
    assert resumed["epsilon"] == straight["epsilon"] and resumed["private_steps"] == worker.STEPS


def test_a_non_finite_gradient_on_one_rank_is_dropped_by_all(runs):
    """An example with a finite loss and a NaN gradient, sampled on one rank: every rank runs its micro-batch again
    without its non-finite examples (a pass is a collective), and the run ends where one process ends."""
    (rank0, _), single = runs
    assert single["dpsgd_ghost_nonfinite"]["nonfinite_total"] > 0
    assert single["dpsgd_bk_nonfinite"]["nonfinite_total"] > 0


@pytest.mark.slow
def test_lora_adapters_of_a_hugging_face_model_train_sharded(tmp_path):
    """A peft LoRA model (frozen base, trainable adapters and head copy) under FSDP2: DPZero and ghost DP-SGD end
    where one process ends within float rounding (each rank's rows alone through the net, partial sums added)."""
    rank0, _ = worker.launch("lora", tmp_path)
    for name, tolerance in (("dpzero", 1e-6), ("ghost", 1e-6)):
        single = worker.run_lora(name, 1, tmp_path)
        assert any(".lora_A." in n for n in rank0[name]["trained"])
        torch.testing.assert_close(_params(rank0[name]), _params(single), rtol=0, atol=tolerance)


@pytest.mark.parametrize("name", [name for name in worker.SHARDED_METHODS if "touchy" in name])
def test_a_loss_that_raises_for_one_record_inside_a_step_does_not_end_the_run(runs, name):
    """A loss (or a net's forward, between its two sharded layers: ``_net``) that passes the pre-flight pass and
    raises for a record once training runs: every rank runs the same collectives, the record sits its step out and
    is counted, as on one process — whether the run ends does not depend on whether that record was sampled
    (invariant 10). Before :class:`~pl_dp.step.seal.ForwardsInStep`, the ``_net`` runs aborted on a collective
    mismatch at the first step that sampled the record; with its first version (found by an independent review),
    PAZO-M hung at the public gradient after a step whose last pass failed on one rank only, a layer run twice that
    raised in its first call aborted, and so did a net whose training-mode forward gathers another layer."""
    (rank0, rank1), single = runs
    assert rank0[name]["private_steps"] == rank1[name]["private_steps"] == worker.STEPS
    assert rank0[name]["nonfinite_total"] == single[name]["nonfinite_total"] > 0
