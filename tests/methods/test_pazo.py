"""PAZO-M/P/S: each step equals the paper's pseudocode (Gong & Li 2025, Algorithms 1–3) by hand; subspace,
candidates, costs, accounting."""

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError
from pl_dp.methods import PAZOM, PAZOP, PAZOS, DPZero
from pl_dp.privacy import NoiseSource
from pl_dp.zo import Direction, PerturbationEngine, SubspaceEngine, flat_basis, privatize_sum
from tests.conftest import DEVICE, blobs, make_trainer

SPEC = PrivacySpec(epsilon=5.0, accountant="rdp")


def _regression(n, seed, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g) + shift
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y.unsqueeze(1))


def _dm(public_batch_size=4):
    return PrivatePublicDataModule(
        _regression(12, 0),
        public=_regression(16, 1, 0.5),
        batch_size=6,
        public_batch_size=public_batch_size,
        seed=3,
        sampling_seed=3,
    )


def _mse(w, x, y):
    return ((x @ w.T - y) ** 2).squeeze(1)


def _fit_one_step(model):
    torch.manual_seed(0)
    make_trainer(max_steps=1).fit(model, _dm())
    return model


def _setup(cls, **kw):
    L.seed_everything(0)
    net = nn.Linear(3, 1, bias=False)
    theta0 = net.weight.detach().clone().double()
    model = cls(net, loss="mse", privacy=SPEC, noise_seed=11, **kw)
    make_trainer(max_steps=1).fit(model, _dm())
    dm = _dm()
    private_idx = dm.train_dataloader().batch_sampler.batch(0)
    x, y = (t[private_idx].double() for t in dm.private.tensors)
    public = [tuple(t.double() for t in b) for b in dm.public_batches(getattr(model, "k", 1))]
    b = dm.sample_rate * len(dm.private)
    return model, net, theta0, x, y, public, b


def _public_grad(w, batch):
    w = w.clone().requires_grad_(True)
    _mse(w, *batch).mean().backward()
    return w.grad.detach()


def test_pazo_m_step_equals_algorithm_1_by_hand():
    lr, clip, lam, queries, alpha = 0.1, 0.5, 1e-2, 2, 0.3
    model, net, theta0, x, y, public, b = _setup(PAZOM, lr=lr, clip=clip, smoothing=lam, queries=queries, alpha=alpha)
    d = theta0.numel()
    g_pub = _public_grad(theta0, public[0])
    # the directions are drawn on the parameters' device: the probe's parameter is on the device the fit ran on
    probe = PerturbationEngine(
        [nn.Parameter(theta0.float().to(DEVICE))], model.direction_seed, Direction("gaussian", d**0.25)
    )
    noise = NoiseSource(seed=11, secure=True)
    zo = torch.zeros_like(theta0)
    for j in range(queries):
        u = probe.direction_tensors((0, j))[0].cpu().double()
        delta = (_mse(theta0 + lam * u, x, y) - _mse(theta0 - lam * u, x, y)) / (2 * lam)
        z = noise.normal((1,), math.sqrt(queries) * model.noise_multiplier * clip).double()
        zo += (delta.clamp(-clip, clip).sum() + z) / b * u
    expected = theta0 - lr * (alpha * g_pub + (1 - alpha) * zo / queries)
    torch.testing.assert_close(net.weight.detach().double(), expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("orthonormalize", [True, False])
def test_pazo_p_step_equals_algorithm_2_by_hand(orthonormalize):
    lr, clip, lam, queries, k = 0.5, 0.5, 1e-2, 2, 3
    model, net, theta0, x, y, public, b = _setup(
        PAZOP, lr=lr, clip=clip, smoothing=lam, queries=queries, k=k, orthonormalize=orthonormalize
    )
    raw = torch.stack([_public_grad(theta0, batch).flatten() for batch in public], dim=1)  # d × k
    if orthonormalize:  # the documented construction: Q = G V Λ^{-1/2} from the Gram matrix
        evals, evecs = torch.linalg.eigh(raw.T @ raw)
        G = raw @ (evecs / evals.sqrt())
    else:
        G = raw / raw.norm(dim=0)
    probe = SubspaceEngine([nn.Parameter(theta0.float().clone())], model.direction_seed, k)
    probe.rank = k
    noise = NoiseSource(seed=11, secure=True)
    zo = torch.zeros_like(theta0)
    for j in range(queries):
        v = (G @ probe.coefficients((0, j))).reshape(theta0.shape)
        delta = (_mse(theta0 + lam * v, x, y) - _mse(theta0 - lam * v, x, y)) / (2 * lam)
        z = noise.normal((1,), math.sqrt(queries) * model.noise_multiplier * clip).double()
        zo += (delta.clamp(-clip, clip).sum() + z) / b * v
    torch.testing.assert_close(net.weight.detach().double(), theta0 - lr * zo / queries, rtol=0, atol=2e-5)


@pytest.mark.parametrize("perturb_scale", [0.5, 0.0])
def test_pazo_s_step_equals_algorithm_3_by_hand(perturb_scale):
    lr, clip, k = 0.05, 4.0, 3
    model, net, theta0, x, y, public, b = _setup(PAZOS, lr=lr, clip=clip, k=k, perturb_scale=perturb_scale)
    releases = k + (1 if perturb_scale > 0 else 0)
    noise = NoiseSource(seed=11, secure=True)
    std = math.sqrt(releases) * model.noise_multiplier * clip

    def f(w):
        return ((_mse(w, x, y).clamp(-clip, clip).sum() + noise.normal((1,), std).double()) / b).item()

    grads = [_public_grad(theta0, batch) for batch in public]
    assert all(not torch.equal(grads[0], g) for g in grads[1:])  # k distinct candidates (no aliasing)
    values = [f(theta0 - lr * g) for g in grads]
    best = min(range(k), key=lambda j: values[j])
    chosen = theta0 - lr * grads[best]
    if perturb_scale > 0:
        probe = PerturbationEngine(
            [nn.Parameter(theta0.float().clone())],
            model.direction_seed,
            Direction("gaussian", math.sqrt(theta0.numel())),
        )
        z = perturb_scale * probe.direction_tensors((0, k))[0].double()
        if f(theta0 - lr * (grads[best] + z)) < values[best]:
            chosen = theta0 - lr * (grads[best] + z)
    torch.testing.assert_close(net.weight.detach().double(), chosen, rtol=0, atol=2e-5)
    assert model.mechanism(6).releases == releases


def test_pazo_s_noise_std_per_query():
    model = PAZOS(nn.Linear(3, 1), loss="mse", clip=2.0, k=3, privacy=SPEC)
    model.noise_multiplier, model.expected_batch_size, model.sample_rate = 1.3, 8.0, 0.1
    mech = model.mechanism(8)
    noise = NoiseSource(seed=0, secure=True)
    draws = torch.cat([privatize_sum(torch.zeros(8), 2.0, mech, noise)[0] for _ in range(4000)])
    assert draws.std().item() == pytest.approx(math.sqrt(3 + 1) * 1.3 * 2.0 / 8, rel=0.05)


def test_pazo_p_directions_lie_in_the_public_span():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 2))
    engine = SubspaceEngine(net.parameters(), seed=4, k=3)
    raw = []
    for c in range(3):
        cols = [torch.randn_like(p) for p in engine.params]
        raw.append(torch.cat([t.flatten() for t in cols]))
        for slot, t in zip(engine.basis_slot(c), cols):
            slot.copy_(t)
    engine.finalize_basis(orthonormalize=True)
    Q = flat_basis(engine)
    torch.testing.assert_close(Q.T @ Q, torch.eye(3), atol=1e-5, rtol=0)
    G = torch.stack(raw, dim=1)
    for key in [(0, 0), (5, 1)]:
        v = torch.cat([t.flatten() for t in engine.direction_tensors(key)])
        coef = torch.linalg.lstsq(G.double(), v.double().unsqueeze(1)).solution
        residual = (G.double() @ coef).squeeze(1) - v.double()
        assert (residual.norm() / v.norm()).item() <= 1e-6


def test_pazo_p_normalized_columns_have_unit_norm_and_rank_deficiency_is_handled():
    net = nn.Linear(5, 2)
    engine = SubspaceEngine(net.parameters(), seed=0, k=3)
    g = [torch.randn_like(p) for p in engine.params]
    for c, scale in enumerate([1.0, 3.0, 0.0]):  # parallel columns and a zero column
        for slot, t in zip(engine.basis_slot(c), g):
            slot.copy_(scale * t)
    engine.finalize_basis(orthonormalize=False)
    norms = flat_basis(engine).norm(dim=0)
    torch.testing.assert_close(norms[:2], torch.ones(2))
    engine.finalize_basis(orthonormalize=True)
    assert engine.rank == 1
    assert all(torch.isfinite(t).all() for t in engine.direction_tensors((0, 0)))


class _Counter(L.Callback):
    """Counts private forwards (inference), public forwards and public backwards through ``net`` during one training
    step, by default the first of the second epoch: neither the fit-start checks nor the check of a reference example
    at the first step and the loggers' steps (an epoch's last) are a step's own work."""

    def __init__(self, net, step: int = 2):
        self.private = self.public = self.backward = 0
        self.step, self.counting = step, False
        net.register_forward_hook(self._hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counting = trainer.global_step == self.step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counting = False

    def _hook(self, module, inputs, output):
        if not self.counting:
            return
        if output.requires_grad:
            self.public += 1
            output.register_hook(self._backward)
        else:
            self.private += 1

    def _backward(self, grad):
        self.backward += 1


@pytest.mark.parametrize(
    ("cls", "kwargs", "expected"),
    [
        (DPZero, dict(queries=2), (4, 0, 0)),
        (DPZero, dict(queries=3, one_sided=True), (4, 0, 0)),  # q + 1 forwards with a shared f(θ)
        (PAZOM, dict(queries=2, one_sided=True), (3, 1, 1)),
        (PAZOM, dict(queries=2), (4, 1, 1)),
        (PAZOP, dict(queries=2, k=3), (4, 3, 3)),
        (PAZOS, dict(k=3, perturb_scale=1e-3), (4, 3, 3)),
        (PAZOS, dict(k=3, perturb_scale=0.0), (3, 3, 3)),
    ],
)
def test_operation_counts_per_step_match_table_9(cls, kwargs, expected):
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    counter = _Counter(net)
    model = cls(net, loss="mse", privacy=SPEC, **kwargs)
    make_trainer(max_steps=4, callbacks=[counter]).fit(model, _dm())
    assert (counter.private, counter.public, counter.backward) == expected


def test_public_only_steps_never_reach_the_accountant():
    torch.manual_seed(0)
    model = PAZOM(nn.Linear(3, 1), loss="mse", alpha=1.0, privacy=SPEC)
    counter = _Counter(model.net, step=0)
    make_trainer(max_steps=3, callbacks=[counter]).fit(model, _dm())
    assert model.accountant.steps == 0 and model.private_steps == 0 and model.epsilon == 0.0
    assert counter.private == 0  # the private batch was never read
    mixed = PAZOM(nn.Linear(3, 1), loss="mse", alpha=0.5, privacy=SPEC)
    make_trainer(max_steps=3).fit(mixed, _dm())
    assert mixed.accountant.history == [(mixed.noise_multiplier, mixed.sample_rate, 3)]


@pytest.mark.parametrize("cls", [PAZOM, PAZOP, PAZOS])
def test_missing_public_data_fails_at_fit_start(cls):
    dm = PrivatePublicDataModule(_regression(12, 0), batch_size=6)
    model = cls(nn.Linear(3, 1), loss="mse", privacy=SPEC)
    with pytest.raises(ConfigError, match="public"):
        make_trainer(max_steps=1).fit(model, dm)
    assert model.private_steps == 0


def test_too_small_public_set_for_k_batches_is_a_clear_error():
    dm = _dm(public_batch_size=8)  # 3 x 8 > 16 public examples
    with pytest.raises(ConfigError, match="disjoint public batches"):
        make_trainer(max_steps=1).fit(PAZOP(nn.Linear(3, 1), loss="mse", k=3, privacy=SPEC), dm)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (PAZOM, {"alpha": 1.5}, "alpha"),
        (PAZOP, {"k": 0}, "k"),
        (PAZOP, {"direction": "lowrank"}, "direction must be 'gaussian' or 'sphere'"),
        (PAZOS, {"k": 0}, "k"),
        (PAZOS, {"perturb_scale": -1.0}, "perturb_scale"),
        (PAZOS, {"clip": 0.0}, "clip"),
    ],
)
def test_bad_hyperparameters(cls, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cls(nn.Linear(3, 1), privacy=SPEC, **kwargs)


@pytest.mark.parametrize("cls", [PAZOM, PAZOP, PAZOS])
def test_pazo_learns_on_blobs_with_public_data(cls):
    L.seed_everything(0)
    dm = PrivatePublicDataModule(
        blobs(600), public=blobs(60, seed=7), val=blobs(200, seed=1), batch_size=60, public_batch_size=16
    )
    kwargs = {PAZOM: dict(lr=0.2, smoothing=1e-3), PAZOP: dict(lr=0.5), PAZOS: dict(lr=0.2)}[cls]
    model = cls(nn.Linear(4, 3), clip=2.0, privacy=PrivacySpec(epsilon=2.0, accountant="rdp"), **kwargs)
    trainer = make_trainer(max_epochs=10)
    trainer.fit(model, dm)
    assert model.epsilon <= 2.0
    assert trainer.callback_metrics["val/acc"] > 0.9


def test_diagnostics_are_absent_unless_enabled_and_labelled_when_enabled():
    for enabled in (False, True):
        L.seed_everything(0)
        model = PAZOM(nn.Linear(3, 1), loss="mse", privacy=SPEC, log_private_metrics=enabled)
        trainer = make_trainer(max_steps=2)
        trainer.fit(model, _dm())
        keys = [k for k in trainer.callback_metrics if k.startswith("diagnostics/")]
        if not enabled:
            assert keys == []
        else:
            assert "diagnostics/not_private/gamma" in keys
            assert "diagnostics/not_private/cos_public_private" in keys
            assert "diagnostics/cos_zo_public" in keys
            assert all(
                k.startswith(("diagnostics/not_private/", "diagnostics/cos_zo", "diagnostics/zo_to")) for k in keys
            )
