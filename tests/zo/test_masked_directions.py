"""Masked directions (DP-ZOPO): the engine moves only kept coordinates; Algorithms 3–4 as specified."""

import pytest
import torch
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.zo.engine import PerturbationEngine
from pl_dp.zo.mask import DirectionMask
from pl_dp.zo.pruning import importance_matrix, path_norm_scores


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _mask(net, fraction=0.2, importance="pruning"):
    scores = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(net.parameters())]
    return importance_matrix(scores, fraction, importance, (1.3, 0.7))


def _changed(before, net):
    return [(a != b.detach()).reshape(-1) for a, b in zip(before, net.parameters())]


def test_masked_sweeps_move_exactly_the_kept_coordinates_in_place():
    net = _net()
    mask = _mask(net)
    engine = PerturbationEngine(net.parameters(), seed=3, mask=mask)
    assert engine.dim == mask.trained == round(0.2 * sum(p.numel() for p in net.parameters()))
    before = [p.detach().clone() for p in net.parameters()]
    grad = [torch.ones_like(p) for p in net.parameters()]
    engine.combine([((0, 0), 0.5), ((0, 1), -0.3)], extra=[(grad, -0.1)])
    kept = [m.reshape(-1) != 0 for m in mask.dense()]
    for changed, keep in zip(_changed(before, net), kept):
        assert torch.equal(changed, keep)  # every kept coordinate moved, no other did
    # the released code's `param[idx] += ...` leaves the parameter unchanged (a copy is updated)
    assert any(c.any() for c in _changed(before, net))


def test_masked_perturb_restore_and_direction_values():
    net = _net()
    mask = _mask(net, 0.5, "rank")
    engine = PerturbationEngine(net.parameters(), seed=1, mask=mask)
    start = [p.detach().clone() for p in net.parameters()]
    engine.perturb((4, 0), 1e-3)
    engine.perturb((4, 0), -1e-3)
    for a, b in zip(start, net.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-7)
    # u = M z: zero off the mask, and z scaled by M_ii on it (same z as an unmasked engine's kept slots)
    u = engine.direction_tensors((7, 2))
    for ui, mi in zip(u, mask.dense([p.shape for p in net.parameters()])):
        assert torch.all(ui[mi == 0] == 0)
    values = torch.cat([v for v in mask.values])
    assert values.max() <= 1.3 + 1e-6 and values.min() >= 0.7 - 1e-6


def test_non_contiguous_parameter_raises_instead_of_updating_a_copy():
    p = nn.Parameter(torch.randn(4, 3).t())  # a transposed (non-contiguous) leaf
    mask = DirectionMask([12], [torch.tensor([0, 5])])
    engine = PerturbationEngine([p], seed=0, mask=mask)
    with pytest.raises(RuntimeError, match="view"):
        engine.perturb((0, 0), 0.1)


def test_importance_matrix_top_k_ties_rank_values_and_incremental():
    scores = [torch.tensor([3.0, 1.0, 2.0, 2.0]), torch.tensor([[5.0, 0.0], [2.0, -1.0]])]
    mask = importance_matrix(scores, 0.5)  # K = 4 of 8: 5, 3, then the three 2.0s tie -> lowest flat index first
    assert [d.tolist() for d in mask.dense()] == [[1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    ranked = importance_matrix(scores, 0.5, "rank", (1.2, 0.8))
    # ranks: 5.0 -> 0, 3.0 -> 1, 2.0 (idx 2) -> 2, 2.0 (idx 3) -> 3; M = 1.2 - 0.4 * rank / 4
    torch.testing.assert_close(ranked.dense()[0], torch.tensor([1.1, 0.0, 1.0, 0.9]))
    torch.testing.assert_close(ranked.dense()[1], torch.tensor([1.2, 0.0, 0.0, 0.0]))
    # incremental: the new scores prefer other coordinates, but the old set stays and grows to K
    flipped = [-s for s in scores]
    grown = importance_matrix(flipped, 0.75, previous=mask)
    old = torch.cat([d for d in mask.dense()]) != 0
    new = torch.cat([d for d in grown.dense()]) != 0
    assert bool(new[old].all()) and int(new.sum()) == 6
    dynamic = importance_matrix(flipped, 0.5)
    assert not bool((torch.cat(dynamic.dense()) != 0)[old].all())  # a dynamic mask may drop them
    with pytest.raises(ConfigError, match="fraction"):
        importance_matrix(scores, 0.0)


def test_full_rate_mask_keeps_whole_tensors_dense():
    net = _net()
    mask = _mask(net, 1.0)
    assert all(idx is None for idx in mask.indices) and mask.fraction == 1.0


def test_path_norm_score_is_synflow_data_free_and_leaves_the_model_alone():
    net = _net()
    before = [p.detach().clone() for p in net.parameters()]
    x = torch.zeros(1, 6)
    exact = path_norm_scores(net, x, estimator="autograd")
    for a, b in zip(before, net.parameters()):
        assert torch.equal(a, b.detach())
    # hand-computed for the first layer's weights: L = 1ᵀ|W2||W1|1 + bias terms; dL/d|W1|_ij = Σ_k |W2|_ki
    w1, w2 = (p.detach().abs().double() for p in (net[0].weight, net[2].weight))
    relu_active = (w1 @ torch.ones(6, dtype=torch.float64) + net[0].bias.detach().abs().double()) > 0
    expected = (w2.sum(0) * relu_active)[:, None] * torch.ones_like(w1) * w1
    torch.testing.assert_close(exact[0], expected)
    assert all(bool((s >= 0).all()) for s in exact)  # SynFlow scores are non-negative
    zo = path_norm_scores(net, x, estimator="zo", queries=2000, smoothing=1e-3, seed=0)
    flat_zo, flat_exact = torch.cat([s.reshape(-1) for s in zo]), torch.cat([s.reshape(-1) for s in exact])
    assert torch.nn.functional.cosine_similarity(flat_zo, flat_exact, dim=0) > 0.7
    assert torch.equal(path_norm_scores(net, x, queries=3, seed=4)[1], path_norm_scores(net, x, queries=3, seed=4)[1])
