"""DPSGD (constant / automatic / PSAC) and Coupling: formulas by hand, noise scale, baselines."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.callbacks import AlphaSchedule
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods import DPSGD, Coupling
from pl_dp.per_sample import per_sample_mode_names
from pl_dp.privacy import ClipFunction, NoiseSource
from tests.conftest import DEVICE, blobs, make_trainer

SPEC = PrivacySpec(epsilon=5.0, accountant="rdp")


def _dm(n=40, batch_size=10, public=True):
    return PrivatePublicDataModule(
        blobs(n),
        public=blobs(24, seed=5) if public else None,
        batch_size=batch_size,
        public_batch_size=8,
        seed=2,
        sampling_seed=2,  # reproduction mode: the by-hand checks replay the batches
    )


@pytest.mark.parametrize("clip_fn", ["constant", "automatic", "psac"])
@pytest.mark.parametrize("per_sample", per_sample_mode_names())
def test_dpsgd_step_equals_the_formula_by_hand(clip_fn, per_sample):
    L.seed_everything(0)
    net = nn.Linear(4, 3)
    theta0 = [p.detach().clone() for p in net.parameters()]
    lr, clip = 0.5, 0.7
    model = DPSGD(net, lr=lr, clip=clip, clip_fn=clip_fn, per_sample=per_sample, privacy=SPEC, noise_seed=9)
    dm = _dm()
    make_trainer(max_steps=1).fit(model, dm)

    idx = dm.train_dataloader().batch_sampler.batch(0)
    x, y = (t[idx] for t in dm.private.tensors)
    reference = nn.Linear(4, 3)
    with torch.no_grad():
        for p, t in zip(reference.parameters(), theta0):
            p.copy_(t)
    fn = ClipFunction(clip_fn, clip, 0.1)
    total = [torch.zeros_like(t) for t in theta0]
    for i in range(len(idx)):
        g = torch.autograd.grad(F.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]), list(reference.parameters()))
        norm = torch.sqrt(sum(t.square().sum() for t in g))
        w = fn.weights(norm.reshape(1))[0]
        total = [a + w * t for a, t in zip(total, g)]
    # first-order noise: torch's generator by default, one draw over the parameters in order, on the fit's device
    numel = sum(t.numel() for t in total)
    draw = NoiseSource(seed=9).normal((numel,), model.noise_multiplier * clip, device=DEVICE).cpu()
    b = dm.sample_rate * len(dm.private)
    for p, t0, s, z in zip(net.parameters(), theta0, total, draw.split([t.numel() for t in total])):
        expected = t0 - lr * (s + z.view_as(s)) / b
        torch.testing.assert_close(p.detach(), expected, atol=1e-5, rtol=1e-5)


class _ZeroGradientLoss:
    def __call__(self, net, batch):
        x, _ = batch
        return 0.0 * net(x).sum(dim=1)


def test_noise_std_of_the_update_with_zero_gradients():
    L.seed_everything(0)
    net = nn.Linear(100, 50)
    before = [p.detach().clone() for p in net.parameters()]
    spec = PrivacySpec(epsilon=50.0, accountant="rdp", noise_multiplier=1.3)
    lr, clip = 0.1, 2.0
    model = DPSGD(net, loss=_ZeroGradientLoss(), lr=lr, clip=clip, privacy=spec)
    data = TensorDataset(torch.randn(200, 100), torch.zeros(200, dtype=torch.long))
    dm = PrivatePublicDataModule(data, batch_size=20)
    make_trainer(max_steps=1).fit(model, dm)
    update = torch.cat([(p - b).flatten() for p, b in zip(net.parameters(), before)])
    assert update.std().item() == pytest.approx(1.3 * clip * lr / 20, rel=0.15)
    assert model.accountant.history == [(1.3, 0.1, 1)]  # exactly one sigma*C draw, one accounted step


def test_coupling_with_alpha_zero_equals_dpsgd():
    results = []
    for cls, kwargs in [(DPSGD, {}), (Coupling, {"alpha": 0.0})]:
        L.seed_everything(0)
        model = cls(nn.Linear(4, 3), lr=0.3, clip=1.0, clip_fn="constant", privacy=SPEC, noise_seed=4, **kwargs)
        make_trainer(max_steps=5).fit(model, _dm())
        results.append(model)
    for a, b in zip(results[0].net.parameters(), results[1].net.parameters()):
        assert torch.equal(a, b)
    assert results[0].epsilon == results[1].epsilon > 0


def test_coupling_with_alpha_one_is_sgd_on_public_data_and_spends_nothing():
    L.seed_everything(0)
    net = nn.Linear(4, 3)
    theta = [p.detach().clone() for p in net.parameters()]
    model = Coupling(net, lr=0.3, alpha=1.0, privacy=SPEC)
    make_trainer(max_steps=3).fit(model, _dm())
    reference = nn.Linear(4, 3)
    with torch.no_grad():
        for p, t in zip(reference.parameters(), theta):
            p.copy_(t)
    dm = _dm()
    for _ in range(3):
        x, y = dm.public_batches(1)[0]
        grads = torch.autograd.grad(F.cross_entropy(reference(x), y), list(reference.parameters()))
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads):
                p.sub_(0.3 * g)
    for a, b in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert model.epsilon == 0.0 and model.accountant.steps == 0 and model.private_steps == 0


def test_coupling_auto_alpha_follows_eq5_and_inverts():
    alpha = Coupling.alpha_from_kappa(kappa=2.0, batch_size=64, noise_multiplier=1.5, dim=1000)
    assert alpha == pytest.approx(1 / (1 + 64 * math.sqrt(4.0 / (64**2 + 1.5**2 * 1000))))
    assert Coupling.kappa_from_alpha(alpha, 64, 1.5, 1000) == pytest.approx(2.0)
    L.seed_everything(0)
    model = Coupling(nn.Linear(4, 3), alpha="auto", kappa=2.0, privacy=SPEC)
    make_trainer(max_steps=1).fit(model, _dm())
    assert model.alpha == pytest.approx(Coupling.alpha_from_kappa(2.0, 10, model.noise_multiplier, 15))
    with pytest.raises(ConfigError, match="kappa"):
        Coupling(nn.Linear(4, 3), alpha="auto")


def test_alpha_schedule_is_dpmd_cosine():
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(pl_module.alpha)

    L.seed_everything(0)
    model = Coupling(nn.Linear(4, 3), lr=0.1, alpha=0.5, privacy=SPEC)
    make_trainer(max_steps=8, callbacks=[AlphaSchedule(anneal_factor=2.0), Record()]).fit(model, _dm())
    expected = [1 - math.cos(math.pi * t / (8 * 2.0)) for t in range(8)]
    assert seen == pytest.approx(expected)
    assert seen[0] == 0.0
    assert model.private_steps == 8  # alpha < 1 throughout: every step is private


@pytest.mark.parametrize("clip_fn", ["constant", "automatic", "psac"])
def test_dpsgd_learns_privately(clip_fn):
    L.seed_everything(0)
    dm = PrivatePublicDataModule(blobs(600), val=blobs(200, seed=1), batch_size=60)
    lr = {"constant": 0.5, "automatic": 0.5, "psac": 0.5}[clip_fn]
    model = DPSGD(nn.Linear(4, 3), lr=lr, clip=1.0, clip_fn=clip_fn, privacy=PrivacySpec(1.0, accountant="rdp"))
    trainer = make_trainer(max_epochs=5)
    trainer.fit(model, dm)
    assert model.epsilon <= 1.0
    assert trainer.callback_metrics["val/acc"] > 0.9


def _digits_fit(per_sample, clip_fn, steps=4):
    from pl_dp.data import DigitsDataModule
    from pl_dp.nets import MLP

    L.seed_everything(0)
    model = DPSGD(
        MLP(64, [32], 10),
        lr=0.5,
        clip=0.5,
        clip_fn=clip_fn,
        per_sample=per_sample,
        privacy=PrivacySpec(epsilon=4.0, accountant="rdp"),
        noise_seed=3,
    )
    trainer = make_trainer(max_steps=steps, val_check_interval=steps, limit_val_batches=2)
    trainer.fit(model, DigitsDataModule(batch_size=64, sampling_seed=5))
    return model, trainer


@pytest.mark.parametrize("clip_fn", ["constant", "automatic", "psac"])
@pytest.mark.parametrize("mode, engine", [("ghost", "GhostClipping"), ("bk", "BookKeeping")])
def test_ghost_clipping_fits_digits_and_releases_what_hooks_release(clip_fn, mode, engine):
    """Same batches and noise: the same mechanism, the same ε, and the same parameters up to rounding (ghost
    clipping, and book-keeping: its norms and clipped sums from one backward pass)."""
    (ghost, trainer), (hooks, _) = _digits_fit(mode, clip_fn), _digits_fit("hooks", clip_fn)
    assert ghost.private_steps == hooks.private_steps == 4
    assert ghost.accountant.history == hooks.accountant.history
    assert ghost.noise_multiplier == hooks.noise_multiplier and ghost.epsilon == hooks.epsilon
    assert 0 < ghost.epsilon <= 4.0 and torch.isfinite(trainer.callback_metrics["val/loss"])
    for a, b in zip(ghost.net.parameters(), hooks.net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert ghost._per_sample.__class__.__name__ == engine


def test_ghost_clipping_refuses_an_unsupported_net_at_fit_start():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 4)
            self.outer.bias = self.inner.bias  # tied weights are clipped exactly; tied biases are not covered
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.outer(self.inner(x)))

    model = DPSGD(Tied(), clip=1.0, per_sample="ghost", privacy=SPEC)
    with pytest.raises(ConfigError, match=r"tied across modules: inner\.bias = outer\.bias \(in Linear\)"):
        make_trainer(max_steps=1).fit(model, _dm())
    assert model.private_steps == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip": None}, "clip"),
        ({"optimizer": "lbfgs"}, "optimizer"),
        ({"per_sample": "vmap"}, "per_sample"),
        ({"clip_fn": "median"}, "clip_fn"),
    ],
)
def test_bad_first_order_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DPSGD(nn.Linear(2, 2), privacy=SPEC, **kwargs)


def test_non_private_baseline_needs_no_per_sample_work():
    L.seed_everything(0)
    dm = PrivatePublicDataModule(blobs(600), val=blobs(200, seed=1), batch_size=60)
    model = DPSGD(nn.Linear(4, 3), lr=0.5, clip=None)
    trainer = make_trainer(max_epochs=3)
    trainer.fit(model, dm)
    assert model._per_sample is None and model.epsilon == 0.0
    assert trainer.callback_metrics["val/acc"] > 0.9


def test_full_priv_merges_public_into_private():
    dm = PrivatePublicDataModule(blobs(40), public=blobs(10, seed=3), batch_size=10, merge_public=True)
    assert dm.n_private == 50 and dm.public is None


def test_adamix_quantile_release_is_paid_for_and_visible_in_the_accountant():
    L.seed_everything(0)
    spec = PrivacySpec(epsilon=3.0, accountant="rdp")
    model = Coupling(
        nn.Linear(4, 3),
        lr=0.1,
        clip=1.0,
        alpha=0.5,
        clip_fn="constant",
        clip_quantile=0.9,
        quantile_noise=4.0,
        privacy=spec,
    )
    make_trainer(max_steps=6).fit(model, _dm())
    sigma = model.noise_multiplier
    mech = model.mechanism(10)
    # the accountant records the composite sigma of (gradient, count) ...
    assert model.accountant.history == [(sigma, model.sample_rate, 6)]
    # ... and the gradient noise is raised so that the pair spends exactly that
    main = mech.main_noise_multiplier
    assert main > sigma
    assert 1 / main**2 + 1 / 4.0**2 == pytest.approx(1 / sigma**2)
    assert mech.noise_std == pytest.approx(main * model.clip_function.clip)
    assert model.clip_function.clip != 1.0  # the threshold moved with the privatized count
    assert model.epsilon <= 3.0


def test_adamix_count_noise_must_exceed_sigma():
    L.seed_everything(0)
    model = Coupling(
        nn.Linear(4, 3),
        alpha=0.5,
        clip_fn="constant",
        clip_quantile=0.9,
        quantile_noise=0.5,
        privacy=PrivacySpec(epsilon=1.0, accountant="rdp"),
    )
    with pytest.raises(PrivacyConfigError, match="auxiliary release"):
        make_trainer(max_steps=1).fit(model, _dm())


def test_adaptive_clip_tracks_the_target_quantile_of_per_example_norms():
    L.seed_everything(0)
    net = nn.Linear(4, 3)
    model = DPSGD(net, lr=1e-9, clip=5.0, clip_fn="constant", clip_quantile=0.9, quantile_lr=0.2)  # non-private
    data = blobs(400)
    make_trainer(max_steps=300).fit(model, PrivatePublicDataModule(data, batch_size=40, sampling_seed=0))
    x, y = data.tensors
    norms = []
    for i in range(len(y)):
        g = torch.autograd.grad(F.cross_entropy(net(x[i : i + 1]), y[i : i + 1]), list(net.parameters()))
        norms.append(torch.sqrt(sum(t.square().sum() for t in g)))
    fraction_below = (torch.stack(norms) <= model.clip_function.clip).float().mean().item()
    assert fraction_below == pytest.approx(0.9, abs=0.06)


def test_adaptive_clip_needs_constant_clipping():
    with pytest.raises(ConfigError, match="constant"):
        DPSGD(nn.Linear(2, 2), clip_fn="automatic", clip_quantile=0.9, privacy=SPEC)
