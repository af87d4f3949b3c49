"""DPZero end to end: the step formula by hand, empty batches, bad inputs, logging."""

import csv
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods import DPZero
from pl_dp.privacy import PRV, NoiseSource, create_accountant, poisson_loader
from pl_dp.zo import PerturbationEngine
from tests.conftest import DEVICE, blobs, make_trainer


def _linear_data(n=12):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y.unsqueeze(1))


def _one_step(lr, clip, lam, queries, **kwargs):
    """One DPZero step on a tiny linear regression; returns what the by-hand checks need."""
    data = _linear_data()
    dm = PrivatePublicDataModule(data, batch_size=6, sampling_seed=0)  # both secrets seeded: reproduction mode
    torch.manual_seed(0)
    net = nn.Linear(3, 1, bias=False)
    theta0 = net.weight.detach().clone().double()
    spec = PrivacySpec(epsilon=5.0, accountant="rdp")
    model = DPZero(
        net, loss="mse", lr=lr, clip=clip, smoothing=lam, queries=queries, privacy=spec, noise_seed=11, **kwargs
    )
    make_trainer(max_steps=1).fit(model, dm)
    return data, dm, net, theta0, model


def test_one_step_equals_the_spec_formula_by_hand():
    lr, clip, lam, queries = 0.1, 0.5, 1e-2, 3
    data, dm, net, theta0, model = _one_step(lr, clip, lam, queries)

    # --- DPZero with q queries (Gong & Li 2025, Eq. 2 and §3.1), by hand, in float64 ---
    sigma = model.noise_multiplier
    b = dm.sample_rate * len(data)
    batch = dm.train_dataloader().batch_sampler.batch(0)
    x = data.tensors[0][batch].double()
    y = data.tensors[1][batch].double()
    # the directions are drawn on the parameters' device: the probe's parameter is on the device the fit ran on
    probe = PerturbationEngine([nn.Parameter(theta0.float().to(DEVICE))], seed=model.direction_seed)
    noise = NoiseSource(seed=11, secure=True)  # zeroth-order noise: the cryptographic generator, on any device
    update = torch.zeros_like(theta0)
    for j in range(queries):
        u = probe.direction_tensors((0, j))[0].cpu().double()
        f = lambda w: ((x @ w.T - y) ** 2).squeeze(1)  # noqa: E731
        delta = (f(theta0 + lam * u) - f(theta0 - lam * u)) / (2 * lam)
        z = noise.normal((1,), math.sqrt(queries) * sigma * clip).double()
        s = (delta.clamp(-clip, clip).sum() + z) / b
        update += s * u
    expected = theta0 - lr / queries * update
    torch.testing.assert_close(net.weight.detach().double(), expected, rtol=0, atol=2e-5)
    assert model.accountant.history == [(sigma, dm.sample_rate, 1)]


@pytest.mark.parametrize("direction", ["gaussian", "rademacher"])
def test_one_sided_step_equals_the_formula_by_hand(direction):
    lr, clip, lam, queries = 0.1, 0.5, 1e-2, 3
    data, dm, net, theta0, model = _one_step(lr, clip, lam, queries, one_sided=True, direction=direction)
    b = dm.sample_rate * len(data)
    batch = dm.train_dataloader().batch_sampler.batch(0)
    x, y = data.tensors[0][batch].double(), data.tensors[1][batch].double()
    probe = PerturbationEngine(
        [nn.Parameter(theta0.float().to(DEVICE))], seed=model.direction_seed, direction=direction
    )
    noise = NoiseSource(seed=11, secure=True)
    f = lambda w: ((x @ w.T - y) ** 2).squeeze(1)  # noqa: E731
    update = torch.zeros_like(theta0)
    for j in range(queries):  # Δ_i = [f(θ + λu_j) − f(θ)] / λ against the one shared f(θ)
        u = probe.direction_tensors((0, j))[0].cpu().double()
        delta = (f(theta0 + lam * u) - f(theta0)) / lam
        z = noise.normal((1,), math.sqrt(queries) * model.noise_multiplier * clip).double()
        update += (delta.clamp(-clip, clip).sum() + z) / b * u
    torch.testing.assert_close(net.weight.detach().double(), theta0 - lr / queries * update, rtol=0, atol=2e-5)
    assert model.accountant.history == [(model.noise_multiplier, dm.sample_rate, 1)]  # same mechanism


def test_empty_batch_gives_a_noise_only_update_and_one_accountant_step():
    data = blobs(50)
    train = poisson_loader(data, sample_rate=1e-9, steps_per_epoch=1)  # always empty
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    before = [p.detach().clone() for p in net.parameters()]
    model = DPZero(net, lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=50.0, delta=1e-5, accountant="rdp"), noise_seed=0)
    make_trainer(max_steps=1).fit(model, train_dataloaders=train)
    assert model.accountant.steps == 1
    assert any(not torch.equal(p, b) for p, b in zip(net.parameters(), before))  # noise moved θ


def test_non_private_run_spends_nothing_and_learns():
    dm = PrivatePublicDataModule(blobs(600), val=blobs(200, seed=1), batch_size=60)
    torch.manual_seed(0)
    model = DPZero(nn.Linear(4, 3), lr=0.1, clip=None, smoothing=1e-3, queries=2)
    trainer = make_trainer(max_epochs=20)
    trainer.fit(model, dm)
    assert model.accountant is None and model.epsilon == 0.0
    assert trainer.callback_metrics["val/acc"] > 0.9


def test_private_run_learns_and_stays_within_epsilon():
    dm = PrivatePublicDataModule(blobs(600), val=blobs(200, seed=1), batch_size=60)
    torch.manual_seed(0)
    spec = PrivacySpec(epsilon=4.0, accountant="rdp")
    model = DPZero(nn.Linear(4, 3), lr=0.1, clip=1.0, smoothing=1e-3, queries=2, privacy=spec)
    trainer = make_trainer(max_epochs=20)
    trainer.fit(model, dm)
    assert model.private_steps == 200
    assert model.epsilon <= 4.0
    assert model.epsilon == pytest.approx(4.0, rel=0.02)  # calibrated for exactly the planned steps
    assert trainer.callback_metrics["val/acc"] > 0.9


class _ScalarLoss:
    def __call__(self, net, batch):
        x, y = batch
        return F.cross_entropy(net(x), y)  # batch mean: forbidden


class _ShortLoss:
    def __call__(self, net, batch):
        x, y = batch
        return F.cross_entropy(net(x), y, reduction="none")[:-1]


@pytest.mark.parametrize(("loss", "match"), [(_ScalarLoss(), "one value per example"), (_ShortLoss(), "shape")])
def test_bad_losses_raise_naming_the_contract(loss, match):
    dm = PrivatePublicDataModule(blobs(100), batch_size=20)
    model = DPZero(nn.Linear(4, 3), loss=loss, lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=1.0, accountant="rdp"))
    with pytest.raises(ValueError, match=match):
        make_trainer(max_steps=1).fit(model, dm)


class _NaNForClassZero:
    """NaN for every example of class 0 (by its own content: a loss that is NaN for the first row of each batch
    depends on the example's row, which the probe refuses)."""

    def __call__(self, net, batch):
        x, y = batch
        losses = F.cross_entropy(net(x), y, reduction="none")
        return torch.where(y == 0, torch.full_like(losses, float("nan")), losses)


def _logged_columns(log_dir) -> set[str]:
    import csv

    (path,) = log_dir.rglob("metrics.csv")
    with open(path) as f:
        return set(next(csv.reader(f)))


def test_nonfinite_differences_contribute_zero_silently(tmp_path, recwarn):
    dm = PrivatePublicDataModule(blobs(100), batch_size=20)
    spec = PrivacySpec(epsilon=5.0, accountant="rdp")
    # preflight=False: the pre-flight pass would refuse the examples of class 0
    model = DPZero(nn.Linear(4, 3), loss=_NaNForClassZero(), lr=0.1, clip=1.0, privacy=spec, preflight=False)
    make_trainer(max_steps=3).fit(model, dm)
    assert not [w for w in recwarn if "finite" in str(w.message)]  # whether it happened is private
    assert all(torch.isfinite(p).all() for p in model.net.parameters())
    assert model.nonfinite_total >= 2  # the NaN examples of each batch, counted in process memory


def test_the_nonfinite_count_is_not_released_unless_private_metrics_are_asked_for(tmp_path):
    """A record with an infinite loss: the number of steps that sampled it is private, un-noised information.
    The logs of a run on D and on D′ (with that record) must not differ in what they report."""
    data = blobs(100)
    poisoned = TensorDataset(data.tensors[0].clone(), data.tensors[1])
    poisoned.tensors[0][0] = float("inf")  # this record's loss is not finite whenever it is sampled
    columns = {}
    for name, dataset, diagnostics in (("d", data, False), ("d_prime", poisoned, False), ("diag", poisoned, True)):
        model = DPZero(
            nn.Linear(4, 3),
            lr=0.1,
            clip=1.0,
            privacy=PrivacySpec(epsilon=5.0, accountant="rdp"),
            log_private_metrics=diagnostics,
            preflight=False,  # the pre-flight pass would refuse the record before training
        )
        # rate 0.5, seeded: the record is sampled (from OS entropy it missed all 6 steps once in 64 runs)
        dm = PrivatePublicDataModule(dataset, batch_size=50, sampling_seed=3)
        make_trainer(max_steps=6, logger=CSVLogger(tmp_path / name), log_every_n_steps=1).fit(model, dm)
        columns[name] = _logged_columns(tmp_path / name)
        assert model.nonfinite_total > 0 or dataset is data
    assert columns["d"] == columns["d_prime"]
    assert not any("nonfinite" in c for c in columns["d_prime"])
    assert "diagnostics/not_private/nonfinite_total" in columns["diag"]  # only when asked for, and labelled


def test_step_metrics_are_logged_on_the_loggers_cadence_with_current_values(tmp_path):
    """Per-step statistics are logged only on the steps the loggers write (each ``self.log`` costs
    more than a small model's step); every written value must be that step's own, not a stale one."""
    import csv

    dm = PrivatePublicDataModule(blobs(100), batch_size=10)
    model = DPZero(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=5.0, accountant="rdp"))
    logger = CSVLogger(tmp_path)
    trainer = make_trainer(max_steps=23, logger=logger, log_every_n_steps=5)
    trainer.fit(model, dm)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("privacy/private_steps")]
    assert [int(float(r["privacy/private_steps"])) for r in rows] == [5, 10, 15, 20]
    assert [int(r["step"]) for r in rows] == [4, 9, 14, 19]  # Lightning's step index of the same batches
    # epoch ends and the final step are logged too (not written by the loggers), so the values
    # callbacks and users read after fit are current
    assert trainer.callback_metrics["privacy/private_steps"] == 23
    assert trainer.callback_metrics["privacy/epsilon"] == pytest.approx(model.epsilon)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip": 0.0}, "clip"),
        ({"clip": -1.0}, "clip"),
        ({"clip": None}, "clip"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"queries": 0}, "queries"),
        ({"queries": 1.5}, "queries"),
        ({"lr": 0.0}, "lr"),
        ({"direction": "uniform"}, "rademacher"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    args = dict(lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=1.0))
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        DPZero(nn.Linear(2, 2), **args)


def test_batch_size_larger_than_dataset_raises():
    with pytest.raises(ConfigError, match="batch_size"):
        PrivatePublicDataModule(blobs(10), batch_size=11)


def test_shuffling_private_loader_is_refused():
    loader = DataLoader(blobs(40), batch_size=8, shuffle=True)
    model = DPZero(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=1.0, accountant="rdp"))
    with pytest.raises(PrivacyConfigError, match="Poisson"):
        make_trainer(max_steps=1).fit(model, train_dataloaders=loader)


def test_model_without_trainable_parameters_raises():
    dm = PrivatePublicDataModule(blobs(40), batch_size=8)
    model = DPZero(nn.Linear(4, 3).requires_grad_(False), lr=0.1, clip=1.0)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        make_trainer(max_steps=1).fit(model, dm)


def test_existing_lightning_module_as_net():
    class UserModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 3)

        def forward(self, x):
            return self.layer(x)

    dm = PrivatePublicDataModule(blobs(100), batch_size=20)
    user = UserModule()
    before = user.layer.weight.detach().clone()
    model = DPZero(user, lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=2.0, accountant="rdp"))
    make_trainer(max_steps=2).fit(model, dm)
    assert not torch.equal(user.layer.weight, before)


def test_logged_epsilon_is_the_exact_epsilon_and_the_rdp_bound_has_its_own_name(tmp_path):
    """PRV: ``privacy/epsilon`` is the accountant's exact ε wherever it is logged (on a grid of the plan and at the
    last step), never a bound above it nor a value of an earlier step; ``privacy/epsilon_rdp``, the Rényi-DP bound,
    is logged at every step."""
    dm = PrivatePublicDataModule(blobs(100), batch_size=20)
    model = DPZero(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=2.0))  # PRV: tracker path
    logger = CSVLogger(tmp_path)
    trainer = make_trainer(max_steps=16, logger=logger, log_every_n_steps=1)
    trainer.fit(model, dm)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steps_at = {r["step"]: int(float(r["privacy/private_steps"])) for r in rows if r["privacy/private_steps"]}
    assert sorted(steps_at.values()) == list(range(1, 17))
    exact = create_accountant("prv")

    def truth(steps):
        exact.history = [(model.noise_multiplier, dm.sample_rate, steps)]
        return exact.get_epsilon(model.delta)

    for r in rows:
        if r["privacy/private_steps"]:
            assert float(r["privacy/epsilon_rdp"]) >= truth(steps_at[r["step"]])
    logged = {steps_at[r["step"]]: float(r["privacy/epsilon"]) for r in rows if r["privacy/epsilon"]}
    assert sorted(logged) == [2, 4, 6, 8, 10, 12, 14, 16]  # every 1/8 of the plan, the last step included
    for steps, epsilon in logged.items():
        assert epsilon == pytest.approx(truth(steps), rel=0.01)
    left = [float(r["privacy/budget_left"]) for r in rows if r["privacy/budget_left"]]
    assert left == pytest.approx([2.0 - logged[steps] for steps in sorted(logged)])
    assert float(trainer.callback_metrics["privacy/epsilon"]) == pytest.approx(model.epsilon, rel=1e-6)


def test_a_fit_that_nothing_logs_evaluates_the_prv_epsilon_once(monkeypatch):
    """With σ given, neither a logger nor a progress bar, and a run that goes to plan: the plan's check, the budget
    guard and the final ε are one PRV evaluation — Opacus' one ``get_epsilon`` at the end — and the ε kept is the
    exact one of the history."""
    calls = []
    evaluate = PRV._epsilon
    monkeypatch.setattr(PRV, "_epsilon", lambda self, h, d: calls.append(list(h)) or evaluate(self, h, d))
    dm = PrivatePublicDataModule(blobs(100), batch_size=20)
    spec = PrivacySpec(epsilon=10.0, noise_multiplier=1.0)
    model = DPZero(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=spec)
    trainer = make_trainer(max_steps=16, log_every_n_steps=1)
    trainer.fit(model, dm)
    assert calls == [[(1.0, dm.sample_rate, 16)]]
    assert model.epsilon == evaluate(PRV(), calls[0], model.delta)
    assert float(trainer.callback_metrics["privacy/epsilon"]) == pytest.approx(model.epsilon, rel=1e-6)  # float32


def test_joint_clip_step_equals_the_vector_mechanism_by_hand():
    lr, clip, lam, queries = 0.1, 0.5, 1e-2, 3
    data, dm, net, theta0, model = _one_step(lr, clip, lam, queries, joint_clip=True)
    assert model.mechanism(6).releases == 1  # one q-dimensional Gaussian, std sigma*C per coordinate

    b = dm.sample_rate * len(data)
    batch = dm.train_dataloader().batch_sampler.batch(0)
    x, y = data.tensors[0][batch].double(), data.tensors[1][batch].double()
    probe = PerturbationEngine([nn.Parameter(theta0.float().to(DEVICE))], seed=model.direction_seed)
    us = [probe.direction_tensors((0, j))[0].cpu().double() for j in range(queries)]
    f = lambda w: ((x @ w.T - y) ** 2).squeeze(1)  # noqa: E731
    deltas = torch.stack([(f(theta0 + lam * u) - f(theta0 - lam * u)) / (2 * lam) for u in us], dim=1)
    norms = deltas.norm(dim=1, keepdim=True)
    clipped = deltas * torch.clamp(clip / norms, max=1.0)
    noise = NoiseSource(seed=11, secure=True).normal((queries,), model.noise_multiplier * clip).double()
    s = (clipped.sum(0) + noise) / b
    expected = theta0 - lr / queries * sum(sj * u for sj, u in zip(s, us))
    torch.testing.assert_close(net.weight.detach().double(), expected, rtol=0, atol=2e-5)


def test_the_clamp_and_the_noise_follow_one_clip_bound():
    """The clip bound had two holders: the module's (the noise) and a copy in the estimator (the clamp), which a
    change of model.clip after the first step left behind — each example then moved the release by up to the old
    bound under noise scaled to the new one. The audit's canary measures what one example moves the release by."""
    from pl_dp.audit import _StepTrials

    spec = PrivacySpec(epsilon=100.0, accountant="rdp", noise_multiplier=1.0)
    model = DPZero(nn.Linear(4, 3), clip=1.0, privacy=spec)
    data = PrivatePublicDataModule(blobs(40), batch_size=8)
    make_trainer(max_steps=1).fit(model, data)  # the estimator is built with clip 1
    model.clip = 0.25  # between steps, as a schedule would
    result = _StepTrials(trials=20, reference_size=8, canary=None, input_scale=100.0, confidence=0.95).run(model, data)
    assert result.canary_influence == pytest.approx(1.0, abs=0.02), result  # 4.0 with the stale clamp
