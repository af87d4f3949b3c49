"""The ZO engine: exact restore, seeded replay, direction distributions, fused sweeps."""

import math

import pytest
import torch
from torch import nn

from pl_dp.zo import Direction, PerturbationEngine


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def test_perturb_restore_drift_fp32_after_1000_cycles():
    net = _net()
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


def test_same_seed_replays_the_same_update_bit_for_bit():
    nets = [_net(), _net()]
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
    with pytest.raises(ValueError, match="no trainable parameters"):
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
