"""The ZO engine: exact restore, seeded replay, direction distributions, fused sweeps."""

import math

import pytest
import torch
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.zo import Direction, PerturbationEngine


def _net(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)


def test_perturb_restore_drift_fp32_after_1000_cycles(device):
    net = _net(device=device)
    before = [p.detach().clone() for p in net.parameters()]
    engine = PerturbationEngine(net.parameters(), seed=1)
    for step in range(1000):
        key = (step, 0)
        engine.perturb(key, 1e-3)
        engine.perturb(key, -1e-3, times=2)
        engine.perturb(key, 1e-3)
    drift = torch.cat([(p - b).flatten() for p, b in zip(net.parameters(), before)]).norm()
    scale = torch.cat([b.flatten() for b in before]).norm()
    assert (drift / scale).item() <= 1e-6  # a single -2λ move instead of two -λ moves gives ~2e-6


def test_same_seed_replays_the_same_update_bit_for_bit(device):
    nets = [_net(device=device), _net(device=device)]
    for net in nets:
        engine = PerturbationEngine(net.parameters(), seed=42)
        for step in range(5):
            engine.combine([((step, 0), -0.01), ((step, 1), 0.02)])
    for a, b in zip(*[n.parameters() for n in nets]):
        assert torch.equal(a, b)


def test_direction_is_independent_of_generation_order_and_global_rng():
    engine = PerturbationEngine(_net().parameters(), seed=9)
    forward = [t.clone() for t in engine.direction_tensors((3, 1))]
    torch.manual_seed(0)
    torch.randn(100)
    reverse = [engine.raw((3, 1), i).clone() for i in reversed(range(len(engine.params)))][::-1]
    for a, b in zip(forward, reverse):
        assert torch.equal(a, b)


def test_gaussian_and_sphere_second_moments():
    net = nn.Linear(1000, 10)
    d = sum(p.numel() for p in net.parameters())
    gauss = PerturbationEngine(net.parameters(), seed=0)
    u = torch.cat([t.flatten() for t in gauss.direction_tensors((0, 0))])
    assert u.var().item() == pytest.approx(1.0, rel=0.05)  # E[uu^T] = I
    sphere = PerturbationEngine(net.parameters(), seed=0, direction=Direction("sphere"))
    v = torch.cat([t.flatten() for t in sphere.direction_tensors((0, 0))])
    assert v.norm().item() == pytest.approx(math.sqrt(d), rel=1e-5)
    small = PerturbationEngine(net.parameters(), seed=0, direction=Direction("sphere", radius=d**0.25))
    w = torch.cat([t.flatten() for t in small.direction_tensors((0, 0))])
    assert w.norm().item() == pytest.approx(d**0.25, rel=1e-5)


def test_only_trainable_parameters_are_perturbed():
    net = _net()
    net[0].weight.requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    engine = PerturbationEngine(net.parameters(), seed=0)
    engine.perturb((0, 0), 1.0)
    assert torch.equal(net[0].weight, frozen)
    assert engine.dim == sum(p.numel() for p in net.parameters() if p.requires_grad)


def test_no_trainable_parameters_is_a_clear_error():
    net = _net().requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        PerturbationEngine(net.parameters(), seed=0)


def test_combine_equals_sequential_perturbs_and_extra_terms():
    a, b = _net(), _net()
    ea, eb = PerturbationEngine(a.parameters(), 5), PerturbationEngine(b.parameters(), 5)
    grads = [torch.ones_like(p) for p in b.parameters()]
    ea.perturb((0, 0), 0.3)
    ea.perturb((0, 1), -0.2)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(1.0, alpha=-0.5)
    eb.combine([((0, 0), 0.3), ((0, 1), -0.2)], extra=[(grads, -0.5)])
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_two_point_leaves_parameters_at_minus_lambda():
    net = _net()
    before = [p.detach().clone() for p in net.parameters()]
    engine = PerturbationEngine(net.parameters(), seed=0)
    x = torch.randn(8, 16)
    diff = engine.two_point((0, 0), 1e-2, lambda: net(x).sum(dim=1).detach())
    assert diff.shape == (8,)
    u = engine.direction_tensors((0, 0))
    for p, b, ui in zip(net.parameters(), before, u):
        torch.testing.assert_close(p, b - 1e-2 * ui, rtol=0, atol=1e-6)


def _wide(seed=0):
    """Enough coordinates (≈ 0.4M) for the sweeps to run on several threads, in many chunks."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(300, 1000), nn.Tanh(), nn.Linear(1000, 100), nn.LayerNorm(100))


@pytest.mark.parametrize("kind", ["gaussian", "sphere", "rademacher", "lowrank"])
@pytest.mark.parametrize("cache", [False, True])
def test_directions_and_sweeps_are_bit_identical_on_1_2_and_4_threads(kind, cache):
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            net = _wide()
            engine = PerturbationEngine(net.parameters(), seed=7, direction=kind, cache_directions=cache, cache_size=2)
            assert (kind == "lowrank" or len(engine.chunks) > 4) and engine.cache_directions == cache
            engine.two_point((3, 0), 1e-3, lambda: torch.zeros(2))
            engine.perturb((3, 0), 1e-3)
            engine.two_point((3, 1), 1e-3, lambda: torch.zeros(2))
            engine.combine([((3, 0), -0.5), ((3, 1), 1e-3 + 0.25)])
            results.append(([p.detach().clone() for p in net.parameters()], engine.direction_tensors((3, 1))))
    finally:
        torch.set_num_threads(threads)
    for params, directions in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))
        assert all(torch.equal(a, b) for a, b in zip(directions, results[0][1]))


@pytest.mark.parametrize("kind", ["gaussian", "rademacher", "lowrank"])
def test_kept_directions_sweep_exactly_like_redrawn_ones(kind):
    nets = [_wide(), _wide()]
    engines = [
        PerturbationEngine(net.parameters(), seed=3, direction=kind, cache_directions=cache)
        for net, cache in zip(nets, (False, True))
    ]
    for engine in engines:
        diff = engine.two_point((0, 0), 1e-3, lambda: torch.ones(1))
        engine.combine([((0, 0), 1e-3 - 0.1 * float(diff))])
    for a, b in zip(*[net.parameters() for net in nets]):
        assert torch.equal(a, b)
    for a, b in zip(engines[0].direction_tensors((0, 0)), engines[1].direction_tensors((0, 0))):
        assert torch.equal(a, b)


def test_a_query_draws_once_with_kept_directions_and_three_times_without(monkeypatch):
    draws = []
    fill = PerturbationEngine._fill
    monkeypatch.setattr(
        PerturbationEngine, "_fill", lambda self, key, chunk, out: draws.append(key) or fill(self, key, chunk, out)
    )
    for cache, sweeps in ((True, 1), (False, 3)):
        net = _wide()
        engine = PerturbationEngine(net.parameters(), seed=0, cache_directions=cache)
        draws.clear()
        engine.two_point((0, 0), 1e-3, lambda: torch.zeros(1))
        engine.combine([((0, 0), 1e-3 - 0.01)])  # restore fused with the update
        assert len(draws) == sweeps * len(engine.chunks)


def test_cache_directions_default_keeps_what_fits_in_the_budget(monkeypatch):
    from pl_dp.zo import engine as engine_module

    params = list(_wide().parameters())
    copy = sum(p.numel() * p.element_size() for p in params)
    assert PerturbationEngine(params, 0, cache_size=4).cache_size == 4
    assert PerturbationEngine(params, 0, cache_directions=False, cache_size=4).cache_size == 0
    monkeypatch.setattr(engine_module, "CACHE_BUDGET_BYTES", 2 * copy)
    assert PerturbationEngine(params, 0, cache_size=4).cache_size == 2
    monkeypatch.setattr(engine_module, "CACHE_BUDGET_BYTES", copy - 1)
    assert not PerturbationEngine(params, 0).cache_directions
    assert PerturbationEngine(params, 0, cache_directions=True, cache_size=3).cache_size == 3  # asked for: kept
    engine = PerturbationEngine(params, 0, cache_directions=True, cache_size=2)
    for step in range(3):
        engine.perturb((step, 0), 1e-3)
    assert list(engine._cache) == [(1, 0), (2, 0)]  # the least recently used direction is evicted
    with pytest.raises(ConfigError, match="cache_size"):
        PerturbationEngine(params, 0, cache_size=0)


def test_rademacher_directions_are_signs_of_norm_r():
    net = _wide()
    d = sum(p.numel() for p in net.parameters())
    engine = PerturbationEngine(net.parameters(), seed=1, direction="rademacher")
    u = torch.cat([t.flatten() for t in engine.direction_tensors((0, 0))])
    assert set(u.unique().tolist()) == {-1.0, 1.0}
    assert abs(u.mean().item()) < 5 / math.sqrt(d)  # balanced signs
    assert u.norm().item() == pytest.approx(math.sqrt(d), rel=1e-6)
    v = torch.cat([t.flatten() for t in engine.direction_tensors((0, 1))])
    assert abs(torch.dot(u, v).item()) < 5 * math.sqrt(d)  # another key, independent signs
    odd = nn.Parameter(torch.zeros(37, dtype=torch.float64))  # not a multiple of 32, not float32
    w = PerturbationEngine([odd], seed=2, direction="rademacher").direction_tensors((0, 0))[0]
    assert w.dtype == torch.float64 and set(w.abs().unique().tolist()) == {1.0}


def test_lowrank_directions_are_rank_one_per_matrix_with_identity_second_moment():
    net = _wide()
    engine = PerturbationEngine(net.parameters(), seed=5, direction="lowrank")
    draws = [engine.direction_tensors((k, 0)) for k in range(40)]
    first = draws[0][0]
    assert torch.linalg.matrix_rank(first).item() == 1  # the 1000 × 300 weight is a·bᵀ
    assert first.shape == (1000, 300) and draws[0][1].dim() == 1
    for i in range(len(engine.params)):
        stacked = torch.stack([d[i].flatten() for d in draws])  # E[u_k²] = 1 for every coordinate
        assert stacked.square().mean().item() == pytest.approx(1.0, rel=0.15)
    # under a mask, a matrix gets the kept entries of the same a·bᵀ (scaled by M); nothing off the mask moves
    from pl_dp.zo.pruning import importance_matrix

    scores = [torch.rand(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(net.parameters())]
    mask = importance_matrix(scores, 0.1, "rank", (1.5, 0.5))
    masked = PerturbationEngine(net.parameters(), seed=5, direction="lowrank", mask=mask)
    full = PerturbationEngine(net.parameters(), seed=5, direction="lowrank")
    for i, m in enumerate(mask.dense([p.shape for p in net.parameters()])):
        got = torch.zeros_like(m)
        masked.accumulate(got, (0, 0), i, 1.0)
        assert torch.all(got[m == 0] == 0) and torch.all(got[m != 0] != 0)
        if m.dim() == 2:
            torch.testing.assert_close(got, full.raw((0, 0), i) * m, rtol=1e-6, atol=0)


def test_non_contiguous_parameter_is_swept_in_place():
    p = nn.Parameter(torch.randn(300, 500).t())  # a transposed leaf, swept whole
    q = nn.Parameter(p.detach().contiguous().clone())
    before = p.detach().clone()
    engine = PerturbationEngine([p], seed=0)
    engine.perturb((0, 0), 0.5)
    u = engine.direction_tensors((0, 0))[0]
    torch.testing.assert_close(p.detach(), before + 0.5 * u, rtol=0, atol=1e-6)
    assert not torch.equal(p.detach(), before) and q.is_contiguous()
