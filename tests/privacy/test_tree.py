"""Tree mechanism (O2NC Algorithm 5), its accountant, and the data partition."""

import math

import pytest
import torch

from pl_dp.privacy import NoiseSource, calibrate_noise_multiplier, create_accountant
from pl_dp.privacy.sampling import PartitionBatchSampler
from pl_dp.privacy.tree import TreeAggregatedGaussian, tree_multiplicity, tree_nodes


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


def test_rdp_conversion_and_calibration_match_the_worked_example():
    # o2nc spec §5.4: eps = 1, delta = 1e-5, T = 1000, s_max = 40: the CKS conversion gives rho = 0.247
    # and sigma = sqrt(c_T) * s_max / rho with c_T = floor(log2 1000) + 1 = 10, i.e. about 512
    accountant = create_accountant("tree")
    accountant.configure(tree_length=1000, steps_per_pass=500_000)
    z = calibrate_noise_multiplier(1.0, 1e-5, 1.0, 1000, accountant)
    assert z * 40 == pytest.approx(math.sqrt(10) * 40 / 0.247, rel=0.01)
    assert accountant.rho(z, 1000) == pytest.approx(0.247, rel=0.01)
    accountant.step(z, 1.0, 1000)
    assert accountant.get_epsilon(1e-5) <= 1.0
    # a second pass over the data composes: rho grows by sqrt(2)
    assert accountant.rho(z, 500_001) == pytest.approx(math.sqrt(2) * accountant.rho(z, 1000))
    # within a tree, epsilon grows with the node count, not the step count
    assert accountant.rho(z, 7) == accountant.rho(z, 4) < accountant.rho(z, 8)


def test_partition_is_disjoint_covers_blocks_and_repermutes_per_pass():
    sampler = PartitionBatchSampler(100, first_batch_size=9, batch_size=2, block_steps=8, seed=3)
    assert sampler.block_size == 23 and sampler.blocks == 4 and len(sampler) == 32
    batches = list(sampler)
    assert [len(b) for b in batches[:8]] == [9] + [2] * 7
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat)) == 92  # disjoint; the 8 left over are never used
    second = list(sampler)
    assert second != batches  # a new permutation for the second pass
    with pytest.raises(ValueError, match="too few for one block"):
        PartitionBatchSampler(20, first_batch_size=9, batch_size=2, block_steps=8)
