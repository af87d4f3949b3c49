"""Half-precision (bf16/fp16) parameters: the engine trains fp32 master weights and writes their rounding.

Perturbing and restoring bf16 weights in place drifts (each ±λu is rounded to 8 bits of mantissa) and an
update below half a bf16 ulp is lost — the fp16 collapses reported for MeZO (Malladi et al. 2023). These
tests pin the fixed behaviour from the outside: restores are exact, small updates accumulate, and the
module's weights are always the rounding of the fp32 value they stand for.
"""

import math

import pytest
import torch
from torch import nn

from pl_dp.zo import DirectionMask, MasterWeights, PerturbationEngine, SubspaceEngine


def _net(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def _snapshot(net):
    return [p.detach().clone() for p in net.parameters()]


def _half_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype`` around each (fp32) value: the most a correct rounding may move it."""
    mantissa = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    tiny = torch.finfo(dtype).tiny
    exponent = torch.floor(torch.log2(values.abs().clamp_min(tiny)))
    return torch.exp2(exponent - mantissa)


#: relative error of 1,000 fp32 additions (each rounds by at most 2^-24 of the value)
ACCUMULATED = 1000 * 2.0**-24


def _assert_rounding_of(params, reference, dtype, relative=0.0):
    """Each half-precision parameter is within half an ulp (plus ``relative`` fp32 slack) of the fp32 ``reference``."""
    for p, r in zip(params, reference):
        error = (p.float() - r).abs()
        bound = _half_ulp(r, dtype) * (1 + 2**-7) + relative * r.abs() + 1e-9
        assert torch.all(error <= bound), f"off by {float((error - bound).max()):.3g} beyond the rounding"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["gaussian", "sphere", "rademacher", "lowrank"])
@pytest.mark.parametrize("cache", [False, True])
def test_1000_perturb_restore_cycles_leave_half_precision_weights_bit_identical(dtype, kind, cache):
    net = _net(dtype)
    before = _snapshot(net)
    engine = PerturbationEngine(net.parameters(), seed=1, direction=kind, cache_directions=cache)
    for step in range(1000):
        key = (step, 0)
        engine.perturb(key, 1e-3)
        engine.perturb(key, -1e-3, times=2)
        engine.perturb(key, 1e-3)
    for p, b in zip(net.parameters(), before):
        assert p.dtype == dtype and torch.equal(p, b)


def test_a_restore_fused_with_a_zero_update_is_exact_in_bf16():
    """The estimator's restore: two_point leaves θ − λu, combine adds +λ (here with no update)."""
    net = _net()
    before = _snapshot(net)
    engine = PerturbationEngine(net.parameters(), seed=3)
    for step in range(1000):
        engine.two_point((step, 0), 1e-2, lambda: torch.zeros(1))
        engine.combine([((step, 0), 1e-2)])
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b)


def test_1000_small_updates_accumulate_and_the_bf16_weights_follow():
    """1,000 updates of 1e-6 move each weight by 1e-3 (bf16 alone keeps almost none of a 1e-6 step)."""
    net = _net()
    start = [p.detach().float() for p in net.parameters()]
    engine = PerturbationEngine(net.parameters(), seed=0)
    ones = [torch.ones_like(p) for p in net.parameters()]
    for _ in range(1000):
        engine.combine([], extra=[(ones, 1e-6)])
    _assert_rounding_of(net.parameters(), [s + 1e-3 for s in start], torch.bfloat16, ACCUMULATED)
    for w, s in zip(engine.weights, start):  # the fp32 masters hold the sum
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, s + 1e-3, rtol=ACCUMULATED, atol=1e-9)


@pytest.mark.parametrize("kind", ["gaussian", "lowrank"])
def test_updates_along_directions_follow_the_fp32_run_to_within_bf16_rounding(kind):
    """A bf16 module trained by combine() is the bf16 rounding of the same run on an fp32 copy."""
    half = _net()
    full = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    engines = [PerturbationEngine(net.parameters(), seed=5, direction=kind) for net in (half, full)]
    for step in range(300):
        for engine in engines:
            engine.combine([((step, 0), 2e-5), ((step, 1), -1e-5)])
    for h, f in zip(half.parameters(), full.parameters()):
        assert torch.equal(h, f.detach().to(torch.bfloat16))


def test_perturbed_bf16_weights_are_the_rounding_of_master_plus_lambda_u():
    net = _net()
    reference = PerturbationEngine(_net(torch.float32).parameters(), seed=2)  # fp32 directions, same seed
    start = [p.detach().float() for p in net.parameters()]
    engine = PerturbationEngine(net.parameters(), seed=2)
    lam, key = 1e-2, (0, 0)
    u = reference.direction_tensors(key)
    seen = []

    def evaluate():
        seen.append([p.detach().clone() for p in net.parameters()])
        return torch.zeros(1)

    engine.two_point(key, lam, evaluate)
    _assert_rounding_of(seen[0], [s + lam * ui for s, ui in zip(start, u)], torch.bfloat16)
    _assert_rounding_of(seen[1], [s - lam * ui for s, ui in zip(start, u)], torch.bfloat16)
    _assert_rounding_of(net.parameters(), [s - lam * ui for s, ui in zip(start, u)], torch.bfloat16)
    engine.combine([(key, lam - 0.5)])  # restore fused with an update of −0.5·u
    for p, w in zip(net.parameters(), engine.weights):
        assert torch.equal(p, w.to(torch.bfloat16))  # at rest: exactly the rounding of the master
    _assert_rounding_of(net.parameters(), [s - 0.5 * ui for s, ui in zip(start, u)], torch.bfloat16)


@pytest.mark.parametrize("kind", ["gaussian", "lowrank"])
def test_masked_bf16_directions_restore_exactly_and_accumulate_on_the_mask_only(kind):
    net = _net()
    before = _snapshot(net)
    start = [p.detach().float() for p in net.parameters()]
    generator = torch.Generator().manual_seed(0)
    indices = [torch.randperm(p.numel(), generator=generator)[: p.numel() // 3].sort().values for p in before]
    values = [torch.rand(i.numel(), generator=generator) + 0.5 for i in indices]
    mask = DirectionMask([p.numel() for p in before], indices, values)
    engine = PerturbationEngine(net.parameters(), seed=4, mask=mask, direction=kind)
    for step in range(200):
        engine.two_point((step, 0), 1e-3, lambda: torch.zeros(1))
        engine.perturb((step, 0), 1e-3)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    ones = [torch.ones_like(p) for p in net.parameters()]
    for _ in range(1000):
        engine.combine([], extra=[(ones, 1e-6)])
    for p, w, s, b, idx in zip(net.parameters(), engine.weights, start, before, indices):
        kept = torch.zeros(p.numel(), dtype=torch.bool)
        kept[idx] = True
        assert torch.equal(p.view(-1)[~kept], b.view(-1)[~kept])  # off the mask: never written
        torch.testing.assert_close(w.view(-1)[kept], s.view(-1)[kept] + 1e-3, rtol=ACCUMULATED, atol=1e-9)
        assert torch.equal(p, w.to(torch.bfloat16))


def test_a_non_contiguous_bf16_parameter_restores_exactly_and_accumulates():
    p = nn.Parameter(torch.randn(60, 50).t().bfloat16())  # a transposed leaf, swept whole
    assert not p.is_contiguous()
    before = p.detach().clone()
    engine = PerturbationEngine([p], seed=0)
    assert not engine.weights[0].is_contiguous()  # the master keeps the parameter's layout
    for step in range(100):
        engine.two_point((step, 0), 1e-3, lambda: torch.zeros(1))
        engine.perturb((step, 0), 1e-3)
    assert torch.equal(p, before)
    ones = [torch.ones_like(p)]
    for _ in range(200):
        engine.combine([], extra=[(ones, 5e-6)])
    _assert_rounding_of([p], [before.float() + 1e-3], torch.bfloat16, ACCUMULATED)


def test_unrestored_perturbations_are_folded_into_the_masters_and_the_weights_stay_their_rounding():
    """A caller that keeps perturbing along new directions: at most MAX_PENDING stay pending."""
    from pl_dp.zo.engine import MAX_PENDING

    net = _net()
    reference = PerturbationEngine(_net(torch.float32).parameters(), seed=6)
    start = [p.detach().float() for p in net.parameters()]
    engine = PerturbationEngine(net.parameters(), seed=6)
    total = [s.clone() for s in start]
    for step in range(3 * MAX_PENDING):
        engine.perturb((step, 0), 1e-3)
        for t, u in zip(total, reference.direction_tensors((step, 0))):
            t.add_(u, alpha=1e-3)
        assert len(engine._pending) <= MAX_PENDING
    _assert_rounding_of(net.parameters(), total, torch.bfloat16, 1e-5)
    engine.combine([])  # everything pending goes into the masters
    assert not engine._pending
    for p, w, t in zip(net.parameters(), engine.weights, total):
        assert torch.equal(p, w.to(torch.bfloat16))
        torch.testing.assert_close(w, t, rtol=1e-5, atol=1e-7)


def test_subspace_engine_restores_bf16_exactly_and_keeps_an_fp32_basis():
    net = _net()
    before = _snapshot(net)
    engine = SubspaceEngine(net.parameters(), seed=0, k=2)
    for c in range(2):
        for slot in engine.basis_slot(c):
            slot.copy_(torch.randn(slot.shape))
    engine.finalize_basis()
    assert all(b.dtype == torch.float32 for b in engine.basis)
    for step in range(200):
        engine.two_point((step, 0), 1e-3, lambda: torch.zeros(1))
        engine.combine([((step, 0), 1e-3)])
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_fp32_and_fp64_parameters_are_written_in_place_without_a_copy():
    for dtype in (torch.float32, torch.float64):
        net = _net(dtype)
        engine = PerturbationEngine(net.parameters(), seed=0)
        assert all(w is p for w, p in zip(engine.weights, engine.params))
        assert engine.masters.nbytes == 0


def test_masters_can_be_turned_off_to_write_bf16_in_place():
    net = _net()
    engine = PerturbationEngine(net.parameters(), seed=0, masters=MasterWeights(enabled=False))
    assert all(w is p for w, p in zip(engine.weights, engine.params))
    assert engine.masters.nbytes == 0


def test_masters_outlive_an_engine_rebuild_and_yield_to_outside_writes():
    net = _net()
    start = [p.detach().float() for p in net.parameters()]
    store = MasterWeights()
    ones = [torch.ones_like(p) for p in net.parameters()]
    for _ in range(2):  # e.g. on_train_start, a new pruning mask: the engine is rebuilt, the masters stay
        engine = PerturbationEngine(net.parameters(), seed=0, masters=store)
        for _ in range(500):
            engine.combine([], extra=[(ones, 1e-6)])
    assert store.nbytes == 4 * sum(p.numel() for p in net.parameters())
    for w, s in zip(engine.weights, start):
        torch.testing.assert_close(w, s + 1e-3, rtol=ACCUMULATED, atol=1e-9)
    with torch.no_grad():
        net[0].weight.fill_(0.5)  # written from outside (e.g. load_state_dict): its master is taken afresh
    engine = PerturbationEngine(net.parameters(), seed=0, masters=store)
    assert torch.equal(engine.weights[0], torch.full_like(engine.weights[0], 0.5))
    torch.testing.assert_close(engine.weights[1], start[1] + 1e-3, rtol=ACCUMULATED, atol=1e-9)


def test_master_state_dict_round_trip_by_parameter_name():
    net = _net()
    store = MasterWeights()
    engine = PerturbationEngine(net.parameters(), seed=0, masters=store)
    engine.combine([((0, 0), 1e-4)])
    state = store.state_dict(net.named_parameters())
    assert sorted(state) == sorted(name for name, _ in net.named_parameters())
    assert all(t.dtype == torch.float32 for t in state.values())
    fresh = MasterWeights()
    fresh.load_state_dict(state, net.named_parameters())
    rebuilt = PerturbationEngine(net.parameters(), seed=0, masters=fresh)
    for a, b in zip(rebuilt.weights, engine.weights):
        assert torch.equal(a, b) and a is not b
    stale = {name: t + 1.0 for name, t in state.items()}  # masters that do not round to the weights: refused
    fresh = MasterWeights()
    fresh.load_state_dict(stale, net.named_parameters())
    rebuilt = PerturbationEngine(net.parameters(), seed=0, masters=fresh)
    for w, p in zip(rebuilt.weights, net.parameters()):
        assert torch.equal(w, p.detach().float())


def test_mixed_precision_model_keeps_fp32_parameters_in_place_and_masters_for_bf16_ones():
    net = _net(torch.float32)
    net[0].to(torch.bfloat16)
    net[2].weight.data = net[2].weight.data.bfloat16()
    engine = PerturbationEngine(net.parameters(), seed=0)
    mastered = [w is not p for w, p in zip(engine.weights, engine.params)]
    assert mastered == [True, True, True, False]
    before = _snapshot(net)
    for step in range(100):
        engine.two_point((step, 0), 1e-3, lambda: torch.zeros(1))
        engine.combine([((step, 0), 1e-3)])
    for p, b, m in zip(net.parameters(), before, mastered):
        if m:
            assert torch.equal(p, b)
        else:
            torch.testing.assert_close(p, b, rtol=0, atol=1e-6)


def test_bf16_drift_before_and_after_is_measured():
    """The numbers quoted in the docs: rms drift of bf16 weights after 1,000 cycles, in place vs masters."""
    drifts = {}
    for enabled in (False, True):
        net = _net()
        before = [p.detach().float() for p in net.parameters()]
        engine = PerturbationEngine(net.parameters(), seed=1, masters=MasterWeights(enabled=enabled))
        for step in range(1000):
            engine.two_point((step, 0), 1e-3, lambda: torch.zeros(1))
            engine.perturb((step, 0), 1e-3)
        diff = torch.cat([(p.detach().float() - b).flatten() for p, b in zip(net.parameters(), before)])
        drifts[enabled] = math.sqrt(float(diff.square().mean()))
    assert drifts[True] == 0.0 and drifts[False] > 1e-5
