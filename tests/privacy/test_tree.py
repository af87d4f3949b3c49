"""Tree mechanism (O2NC Algorithm 5), its accountant, and the data partition."""

import math

import dp_accounting
import dp_accounting.rdp
import pytest
import torch

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.privacy import NoiseSource, calibrate_noise_multiplier, create_accountant
from pl_dp.privacy.sampling import PartitionBatchSampler
from pl_dp.privacy.tree import (
    TreeAccountant,
    TreeAggregatedGaussian,
    TreeLeaf,
    tree_multiplicity,
    tree_nodes,
    tree_rho_squared,
)


def test_node_sets_match_the_paper_and_cover_the_prefix():
    assert tree_nodes(7) == [(1, 4), (5, 6), (7, 7)]
    assert tree_nodes(8) == [(1, 8)]
    assert tree_nodes(13) == [(1, 8), (9, 12), (13, 13)]
    for t in range(1, 300):
        nodes = tree_nodes(t)
        assert len(nodes) == bin(t).count("1")
        covered = [i for a, b in nodes for i in range(a, b + 1)]
        assert covered == list(range(1, t + 1))  # disjoint, in order, exactly [1, t]


@pytest.mark.parametrize("T", [1, 2, 3, 4, 7, 8, 100, 257])
def test_each_leaf_is_in_at_most_floor_log2_T_plus_1_released_nodes(T):
    released = {node for t in range(1, T + 1) for node in tree_nodes(t)}
    worst = max(sum(a <= i <= b for a, b in released) for i in range(1, T + 1))
    assert worst == tree_multiplicity(T) == math.floor(math.log2(T)) + 1


def test_tree_noise_variance_matches_the_node_count():
    tree, noise = TreeAggregatedGaussian(noise_multiplier=2.0, sensitivity=0.5), NoiseSource(seed=0)
    like = [torch.zeros(20000)]
    for t in range(1, 8):
        total = tree.noise(t, like, noise)[0]
        assert total.var().item() == pytest.approx(len(tree_nodes(t)) * 1.0**2, rel=0.05)
    # TREE(7) reuses the node noises of TREE(6) for (1,4) and (5,6): their difference is ξ_7 alone
    tree.noise(1, like, noise)
    six = [tree.noise(t, like, noise)[0].clone() for t in range(2, 7)][-1]
    seven = tree.noise(7, like, noise)[0]
    assert (seven - six).var().item() == pytest.approx(1.0, rel=0.05)


def test_a_node_is_one_draw_over_the_tensors_and_keeps_only_its_own_values():
    """Each node's noise is one draw laid over the tensors end to end; a node kept for later leaves holds its values,
    not the chunk of the draw a small tensor's piece lies in."""
    tree, noise = TreeAggregatedGaussian(noise_multiplier=2.0, sensitivity=0.5), NoiseSource(seed=0)
    like = [torch.zeros(3), torch.zeros(5, 2)]
    noise.start_step(0)
    released = tree.noise(1, like, noise)
    noise.start_step(0)
    draw = noise.normal((13,), tree.noise_std)
    assert torch.equal(torch.cat([t.reshape(-1) for t in released]), draw)
    for xi, x in zip(tree._nodes[0][1], like):
        assert xi.untyped_storage().nbytes() == x.numel() * x.element_size()


def test_a_copy_of_a_tree_holds_no_node_noise_and_cannot_continue_it():
    import copy

    tree, noise, like = TreeAggregatedGaussian(noise_multiplier=2.0, sensitivity=0.5), NoiseSource(), [torch.zeros(8)]
    for t in range(1, 3):
        tree.noise(t, like, noise)
    clone = copy.deepcopy(tree)
    with pytest.raises(RuntimeError, match="node noises are secrets"):
        clone.noise(3, like, noise)  # TREE(3) = ξ(1, 2) + ξ(3): never released without ξ(1, 2)
    assert clone.noise(1, like, noise)[0].shape == (8,)  # a new tree is fine
    tree.noise(3, like, noise)  # the original goes on


def _epsilon_of_nodes(nodes, z, delta):
    """ε of ``nodes`` Gaussian releases with multiplier z, by dp-accounting's RDP accountant (an independent check)."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), nodes))
    return accountant.get_epsilon(delta)


def test_rdp_conversion_and_calibration_match_the_worked_example():
    # Zhang et al. 2024 with eps = 1, delta = 1e-5, T = 1000, s_max = 40: the CKS conversion gives rho = 0.247
    # and sigma = sqrt(c_T) * s_max / rho with c_T = floor(log2 1000) + 1 = 10, i.e. about 512
    accountant = TreeAccountant()
    accountant.plan("p", steps_per_pass=500_000, tree_length=1000, next_position=0)
    z = calibrate_noise_multiplier(1.0, 1e-5, 1.0, 1000, accountant)
    assert z * 40 == pytest.approx(math.sqrt(10) * 40 / 0.247, rel=0.01)
    assert accountant.epsilon_after(1e-5, 1000, noise_multiplier=z, sample_rate=1.0) <= 1.0
    # within a tree, epsilon grows with the node count, not the leaf count
    assert accountant.epsilon_after(1e-5, 7, noise_multiplier=z, sample_rate=1.0) == accountant.epsilon_after(
        1e-5, 4, noise_multiplier=z, sample_rate=1.0
    )
    assert accountant.epsilon_after(1e-5, 4, noise_multiplier=z, sample_rate=1.0) < accountant.epsilon_after(
        1e-5, 8, noise_multiplier=z, sample_rate=1.0
    )
    # a second pass over the data composes: its first leaf adds one node
    history = list(accountant.history)
    accountant._extend(history, 500_001, z)
    assert tree_rho_squared(history) == pytest.approx((10 + 1) / z**2)


def _partition_leaves(sampler, positions, variant="tree"):
    """The leaves released at sampler ``positions`` (O2NC's mapping: tree k of a pass is block k)."""
    leaves = []
    for position in positions:
        passes, block, t = sampler.locate(position)
        if variant == "naive":
            leaves.append(TreeLeaf(sampler.name, passes, block * sampler.block_steps + t, 1, 1))
        else:
            leaves.append(TreeLeaf(sampler.name, passes, block, sampler.block_steps, t + 1))
    return leaves


def _brute_force_worst_count(sampler, fits):
    """The most released nodes any one example is in, from the examples each released leaf used.

    ``fits`` lists the sampler positions released by each fit; a tree is cut where a fit stops or skips.
    """
    count = {}
    for positions in fits:
        trees = {}
        for position in positions:
            passes, block, t = sampler.locate(position)
            trees.setdefault((passes, block), []).append((t + 1, sampler.batch(position)))
        for leaves in trees.values():
            released = len(leaves)
            nodes = [(b - (b & -b) + 1, b) for b in range(1, released + 1)]  # dyadic nodes ending at 1..n
            for leaf, examples in leaves:
                for example in examples:
                    count[example] = count.get(example, 0) + sum(a <= leaf <= b for a, b in nodes)
    return max(count.values())


@pytest.mark.parametrize(
    "fits",
    [
        [range(0, 32)],  # one whole pass: 4 trees of 8 leaves
        [range(0, 19), range(24, 35)],  # a mid-tree resume that spills into the next pass
        [range(0, 11), range(16, 70)],  # a cut tree, then more than two passes
        [range(0, 13), range(0, 13)],  # a second fit that restarts the sampler: the same examples again
    ],
)
def test_ledger_never_counts_fewer_nodes_than_the_worst_example_is_in(fits):
    sampler = PartitionBatchSampler(100, first_batch_size=4, batch_size=2, block_steps=8, seed=5)
    accountant, z = TreeAccountant(), 2.0
    for positions in fits:
        for leaf in _partition_leaves(sampler, positions):
            accountant.record(z, leaf)
    worst = _brute_force_worst_count(sampler, fits)
    ledger = tree_rho_squared(accountant.history) * z**2
    assert ledger >= worst
    if len(fits) == 1:
        assert ledger == worst == 4  # one pass: exact
    assert accountant.get_epsilon(1e-3) >= _epsilon_of_nodes(worst, z, 1e-3)
    assert accountant.steps == sum(len(positions) for positions in fits)


def test_the_audit_case_a_resume_that_spills_into_a_new_pass_counts_its_nodes():
    """Leaves 1..19 (tree 2 cut after 3 leaves), resume at the next tree, 3 leaves into pass 2: 4 + 2 nodes."""
    sampler = PartitionBatchSampler(400, first_batch_size=8, batch_size=2, block_steps=8, seed=0)
    accountant, z = TreeAccountant(), 2.0
    for leaf in _partition_leaves(sampler, range(19)):
        accountant.record(z, leaf)
    resumed = TreeAccountant()
    resumed.load_state_dict(accountant.state_dict())
    resumed.plan(sampler.name, sampler.steps_per_epoch, 8, next_position=24)
    planned = resumed.epsilon_after(1 / 400, 123, noise_multiplier=z, sample_rate=1.0)
    for leaf in _partition_leaves(sampler, range(24, 147)):
        resumed.record(z, leaf)
    assert tree_rho_squared(resumed.history) * z**2 == 6  # not 4: the old step count said one pass
    assert resumed.get_epsilon(1 / 400) == planned  # the plan extended the ledger from position 24, not from 0
    assert planned > _epsilon_of_nodes(4, z, 1 / 400)


@pytest.mark.parametrize("variant", ["tree", "naive"])
def test_plan_from_any_position_agrees_with_the_leaves_then_recorded(variant):
    sampler = PartitionBatchSampler(60, first_batch_size=3, batch_size=3, block_steps=4, seed=1)  # 5 blocks
    length = 1 if variant == "naive" else 4
    accountant, z = TreeAccountant(), 1.5
    for leaf in _partition_leaves(sampler, range(6), variant):  # stop inside tree 1
        accountant.record(z, leaf)
    accountant.plan(sampler.name, sampler.steps_per_epoch, length, next_position=6)
    for more in (1, 2, 3, 14, 15, 37):
        planned = accountant.epsilon_after(1e-3, more, noise_multiplier=z, sample_rate=1.0)
        copy = TreeAccountant()
        copy.load_state_dict(accountant.state_dict())
        for leaf in _partition_leaves(sampler, range(6, 6 + more), variant):
            copy.record(z, leaf)
        assert planned == copy.get_epsilon(1e-3)
    # recording advances the plan: the next query starts after the recorded leaf
    accountant.record(z, _partition_leaves(sampler, [6], variant)[0])
    assert accountant.epsilon_after(1e-3, 36, noise_multiplier=z, sample_rate=1.0) == copy.get_epsilon(1e-3)


def _dp_accounting_tree_epsilon(passes, z, delta):
    """dp-accounting's RDP for tree aggregation: one SingleEpochTreeAggregationDpEvent per pass (each example
    in at most one tree of it), composed over passes. Its relation is REPLACE_SPECIAL; the RDP of a node,
    α/(2z²), is the same under replace-one when z is the noise over the replace-one sensitivity."""
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    events = [dp_accounting.SingleEpochTreeAggregationDpEvent(z, step_counts) for step_counts in passes]
    accountant.compose(dp_accounting.ComposedDpEvent(events))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(
    ("variant", "fits"),
    [
        ("tree", [range(0, 40)]),  # one pass, 5 trees of 8
        ("tree", [range(0, 19), range(24, 100)]),  # a cut tree, then two more passes (the last partial)
        ("naive", [range(0, 95)]),  # per-round trees of one leaf over two and a half passes
    ],
)
def test_tree_accountant_is_at_least_and_close_to_dp_accounting(variant, fits):
    sampler = PartitionBatchSampler(100, first_batch_size=2, batch_size=2, block_steps=8, seed=2)  # 40 per pass
    accountant, z, delta = TreeAccountant(), 3.0, 1e-5
    passes = {}
    for positions in fits:
        for leaf in _partition_leaves(sampler, positions, variant):
            accountant.record(z, leaf)
            trees = passes.setdefault(leaf.pass_index, {})
            trees[leaf.tree] = max(trees.get(leaf.tree, 0), leaf.leaf)
    reference = _dp_accounting_tree_epsilon([list(trees.values()) for trees in passes.values()], z, delta)
    ours = accountant.get_epsilon(delta)
    assert ours >= reference - 1e-12  # equal when the best order is in Opacus' grid; dp-accounting's has more
    assert ours <= reference * 1.01


def test_ledger_refuses_what_it_cannot_interpret():
    accountant = TreeAccountant()
    with pytest.raises(ValueError, match="without leaves 1..2"):
        accountant.record(1.0, TreeLeaf("p", 0, 0, 8, 3))
    accountant.record(1.0, TreeLeaf("p", 0, 0, 8, 1))
    with pytest.raises(ValueError, match="same tree and noise multiplier"):
        accountant.record(2.0, TreeLeaf("p", 0, 0, 8, 2))
    with pytest.raises(ValueError, match="1 <= leaf <= tree_length"):
        TreeLeaf("p", 0, 0, 8, 9)
    with pytest.raises(PrivacyConfigError, match="not Poisson-subsampled"):
        accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    with pytest.raises(PrivacyConfigError, match="not subsampled"):
        accountant.epsilon_after(1e-5, 1, noise_multiplier=1.0, sample_rate=0.5)
    with pytest.raises(ValueError, match="no plan"):
        accountant.epsilon_after(1e-5, 1, noise_multiplier=1.0, sample_rate=1.0)
    old = {"mechanism": "tree", "history": [[2.0, 1.0, 147]], "tree_length": 8, "steps_per_pass": 144}
    with pytest.raises(PrivacyConfigError, match="cannot be resumed soundly"):
        TreeAccountant().load_state_dict(old)
    assert create_accountant("tree").name == "tree"


def test_partition_is_disjoint_covers_blocks_and_repermutes_per_pass():
    sampler = PartitionBatchSampler(100, first_batch_size=9, batch_size=2, block_steps=8, seed=3)
    assert sampler.block_size == 23 and sampler.blocks == 4 and len(sampler) == 32
    batches = list(sampler)
    assert [len(b) for b in batches[:8]] == [9] + [2] * 7
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat)) == 92  # disjoint; the 8 left over are never used
    second = list(sampler)
    assert second != batches  # a new permutation for the second pass
    with pytest.raises(ConfigError, match="too few for one block"):
        PartitionBatchSampler(20, first_batch_size=9, batch_size=2, block_steps=8)
