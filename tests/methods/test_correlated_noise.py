"""Banded correlated noise through real fits (``DPSGD``/``Coupling`` with ``noise="banded", bands=b``): b = 1 is
DP-SGD bit for bit, the added noise has the strategy's covariance, one example moves the release by at most ζ·C per
participation (black box), the participation schema is enforced, and a kill-and-resume restarts the recursion and
composes the segments."""

import copy
import math
import pickle

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.audit import audit
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods import DPSGD, Coupling
from pl_dp.privacy import BandedSquareRoot, CyclicPoissonBatchSampler, create_accountant, poisson_loader
from tests.conftest import blobs, make_trainer
from tests.methods.test_checkpoint import Crash

SPEC = PrivacySpec(epsilon=50.0, accountant="rdp", noise_multiplier=1.0)


class Trajectory(L.Callback):
    """The trainable parameters, flat, before the first step and after every step."""

    def __init__(self):
        self.points = []

    def on_train_start(self, trainer, pl_module):
        self.points.append(self._flat(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.points.append(self._flat(pl_module))

    @staticmethod
    def _flat(module):
        return torch.cat([p.detach().flatten().double() for p in module.trainable_parameters()])

    def updates(self):
        """θ_{t} − θ_{t+1} per step, [steps, d]: with plain SGD at lr = 1, the privatized gradient of each step. On the
        CPU, where the tests' references are: the points were recorded on the device the fit ran on."""
        points = torch.stack(self.points).cpu()
        return points[:-1] - points[1:]


@pytest.mark.parametrize("cls", [DPSGD, Coupling])
def test_one_band_is_dp_sgd_bit_for_bit(cls):
    def run(**noise):
        L.seed_everything(0)
        model = cls(
            nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=PrivacySpec(3.0, accountant="rdp"), noise_seed=1, **noise
        )
        public = blobs(40, seed=5) if cls is Coupling else None
        make_trainer(max_steps=8).fit(
            model, PrivatePublicDataModule(blobs(100), public=public, batch_size=10, sampling_seed=2)
        )
        return model

    independent, banded = run(), run(noise="banded", bands=1)
    assert all(torch.equal(a, b) for a, b in zip(independent.parameters(), banded.parameters()))
    assert banded.accountant.history == independent.accountant.history and banded.epsilon == independent.epsilon


def _zero_gradient_loss(net, batch):
    x, _ = batch
    return (net(x) * 0.0).sum(dim=1)  # every clipped gradient is 0: an update is the DP noise alone


def test_the_noise_a_fit_adds_has_the_strategys_covariance():
    """Zero gradients, plain SGD at lr = 1: the update of step t is σζC·w_t / E[b], and over 10 100 coordinates its
    empirical covariance across steps is σ²ζ²C²·C⁻¹C⁻ᵀ / E[b]² (the strategy's), within sampling error."""
    bands, steps, clip = 3, 6, 0.5
    model = DPSGD(
        nn.Linear(100, 100), loss=_zero_gradient_loss, lr=1.0, clip=clip, privacy=SPEC, noise="banded", bands=bands
    )
    data = TensorDataset(torch.randn(300, 100), torch.zeros(300, dtype=torch.long))
    trajectory = Trajectory()
    make_trainer(max_steps=steps, callbacks=[trajectory]).fit(model, PrivatePublicDataModule(data, batch_size=20))
    updates = trajectory.updates() * model.expected_batch_size
    empirical = updates @ updates.T / updates.shape[1]
    strategy = BandedSquareRoot(bands)
    inverse = torch.linalg.inv(strategy.matrix(steps))
    expected = (1.0 * strategy.sensitivity * clip) ** 2 * inverse @ inverse.T
    assert (empirical - expected).abs().max().item() < 0.05 * expected.diagonal().max().item()
    assert model.private_steps == steps and model.accountant.steps == 2  # ⌈6/3⌉ compositions
    assert model.noise_correlation._past  # the secret past outputs, in this process's memory only: copies lack them
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.noise_correlation._past == {} and clone.noise_correlation.strategy == strategy


def _linear_loss(net, batch):
    x, _ = batch
    return net(x).sum(dim=1)  # a gradient that does not depend on θ: each example's part of a release is fixed


def test_one_example_moves_the_release_by_at_most_zeta_c_per_participation():
    """Black box: D and D ∪ {x}, every member of the step's group sampled (q = 1), the same seeds. The releases of
    the two runs, mapped back to the strategy's domain (C·(release·E[b])), differ by x's clipped gradient times C's
    column: on each participation's block of b steps, by at most ζ·C — the sensitivity the noise σζC is set for —
    and by nothing elsewhere."""
    bands, steps, clip, n = 3, 9, 0.5, 30
    inputs = 100.0 * torch.randn(n + 1, 4, generator=torch.Generator().manual_seed(0))  # every gradient clipped

    def released(size):
        L.seed_everything(0)
        model = DPSGD(
            nn.Linear(4, 3),
            loss=_linear_loss,
            lr=1.0,
            clip=clip,
            privacy=SPEC,
            noise_seed=3,
            noise="banded",
            bands=bands,
        )
        data = TensorDataset(inputs[:size], torch.zeros(size, dtype=torch.long))
        trajectory = Trajectory()
        loader = poisson_loader(data, 1.0, seed=4, steps_per_epoch=steps, bands=bands)
        make_trainer(max_steps=steps, callbacks=[trajectory]).fit(model, train_dataloaders=loader)
        return trajectory.updates() * model.expected_batch_size, loader.batch_sampler

    without, _ = released(n)
    with_x, larger = released(n + 1)
    group = int(larger.group_of([n])[0])
    strategy = BandedSquareRoot(bands)
    shift = strategy.matrix(steps) @ (with_x - without)  # C·Δ: the two releases' difference, noise cancelled
    participations = [t for t in range(steps) if t % bands == group]
    touched = torch.zeros(steps, dtype=torch.bool)
    for t in participations:
        block = shift[t : t + bands].norm().item()
        assert block <= strategy.sensitivity * clip * (1 + 1e-4)
        if t + bands <= steps:  # a whole column of C: exactly ζ·C
            assert block == pytest.approx(strategy.sensitivity * clip, rel=1e-3)
        touched[t : t + bands] = True
    assert shift[~touched].abs().max().item() < 1e-4 * clip


def test_the_data_module_builds_the_cyclic_loader_and_a_banded_run_trains():
    model = DPSGD(
        nn.Linear(4, 3), lr=0.5, clip=1.0, privacy=PrivacySpec(4.0, accountant="rdp"), noise="banded", bands=4
    )
    dm = PrivatePublicDataModule(blobs(400), batch_size=20, val=blobs(100, seed=1))
    make_trainer(max_epochs=3).fit(model, dm)
    sampler = model._sampler
    assert isinstance(sampler, CyclicPoissonBatchSampler) and sampler.bands == 4
    assert sampler.sample_rate == pytest.approx(4 * 20 / 400) and model.expected_batch_size == pytest.approx(20.0)
    assert model.private_steps == 60 and model.accountant.steps == 15 and model.epsilon <= 4.0
    x, y = blobs(100, seed=1).tensors
    assert (model.net(x).argmax(1) == y).float().mean() > 0.8
    report = str(model.privacy_report())
    assert "cyclic over 4 groups" in report and "one subsampled Gaussian per band of 4 steps" in report


def test_a_loader_of_another_participation_schema_is_refused():
    """The accountant must match the sampler: banded noise with b > 1 needs cyclic Poisson sampling over b groups, and
    independent noise refuses a cyclic loader."""
    data = blobs(120)

    def fit(model, loader):
        make_trainer(max_steps=2).fit(model, train_dataloaders=loader)

    banded = DPSGD(nn.Linear(4, 3), clip=1.0, privacy=SPEC, noise="banded", bands=4)
    with pytest.raises(PrivacyConfigError, match="cyclic Poisson sampling over 4 groups.*plain Poisson"):
        fit(banded, poisson_loader(data, 0.1))
    with pytest.raises(PrivacyConfigError, match="over 4 groups.*3 cyclic groups"):
        fit(banded, poisson_loader(data, 0.3, bands=3))
    with pytest.raises(PrivacyConfigError, match="plain Poisson sampling.*4 cyclic groups"):
        fit(DPSGD(nn.Linear(4, 3), clip=1.0, privacy=SPEC), poisson_loader(data, 0.4, bands=4))
    assert banded.private_steps == 0  # refused before any step


def test_configurations_the_banded_analysis_does_not_cover_are_refused():
    with pytest.raises(ConfigError, match="needs noise='banded'"):
        DPSGD(nn.Linear(4, 3), bands=2)
    with pytest.raises(ConfigError, match="noise must be one of"):
        DPSGD(nn.Linear(4, 3), noise="toeplitz")
    with pytest.raises(ConfigError, match="bands must be an integer"):
        DPSGD(nn.Linear(4, 3), noise="banded", bands=0)
    with pytest.raises(ConfigError, match="adaptive clipping"):
        Coupling(nn.Linear(4, 3), clip_fn="constant", clip_quantile=0.5, noise="banded", bands=2)
    with pytest.raises(ConfigError, match="too few for an expected batch"):
        dm = PrivatePublicDataModule(blobs(40), batch_size=15)
        make_trainer(max_steps=1).fit(DPSGD(nn.Linear(4, 3), privacy=SPEC, noise="banded", bands=3), dm)
    with pytest.raises(PrivacyConfigError, match="reload_dataloaders_every_n_epochs"):
        dm = PrivatePublicDataModule(blobs(40), batch_size=5)
        banded = DPSGD(nn.Linear(4, 3), privacy=SPEC, noise="banded", bands=2)
        make_trainer(max_steps=1, reload_dataloaders_every_n_epochs=1).fit(banded, dm)
    coupling = Coupling(nn.Linear(4, 3), alpha=1.0, clip=1.0, privacy=SPEC, noise="banded", bands=2)
    dm = PrivatePublicDataModule(blobs(40), public=blobs(20, seed=3), batch_size=5)
    with pytest.raises(PrivacyConfigError, match="alpha=1 skips the private batch"):
        make_trainer(max_steps=1).fit(coupling, dm)


def test_kill_and_resume_restarts_the_recursion_and_composes_the_segments(tmp_path):
    """A resume draws a fresh noise key, so the past outputs cannot be re-derived — and they are never checkpointed.
    The resumed fit starts a new banded mechanism: its first update is the bare draw z (variance σ²ζ²C², not the
    1.15²·σ²ζ²C² step 6 of the uninterrupted recursion has), and the accountant composes both segments:
    ⌈5/4⌉ + ⌈3/4⌉ = 3 compositions where the uninterrupted run has ⌈8/4⌉ = 2."""
    bands, clip = 4, 1.0

    def model():
        L.seed_everything(0)
        return DPSGD(
            nn.Linear(100, 100), loss=_zero_gradient_loss, lr=1.0, clip=clip, privacy=SPEC, noise="banded", bands=bands
        )

    def dm():
        data = TensorDataset(
            torch.randn(400, 100, generator=torch.Generator().manual_seed(0)), torch.zeros(400, dtype=torch.long)
        )
        return PrivatePublicDataModule(data, batch_size=20)

    uninterrupted, whole = model(), Trajectory()
    make_trainer(max_steps=8, callbacks=[whole]).fit(uninterrupted, dm())
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_steps=8, callbacks=[ckpt, Crash(6)], enable_checkpointing=True).fit(model(), dm())
    checkpoint = torch.load(tmp_path / "step=5.ckpt", map_location="cpu", weights_only=False)
    assert set(checkpoint["state_dict"]) == {"net.weight", "net.bias"}  # no noise output among the tensors saved
    assert "noise_correlation" not in str(checkpoint.get("hyper_parameters")) and "correlation" not in str(
        checkpoint["pl_dp"]
    )

    resumed, tail = model(), Trajectory()
    make_trainer(max_steps=8, callbacks=[tail]).fit(resumed, dm(), ckpt_path=str(tmp_path / "step=5.ckpt"))
    assert resumed.private_steps == 8
    assert uninterrupted.accountant.steps == 2 and resumed.accountant.steps == 3
    reference = create_accountant("rdp")
    reference.step(noise_multiplier=1.0, sample_rate=resumed.sample_rate, num_steps=3)
    assert resumed.epsilon == pytest.approx(reference.get_epsilon(resumed.delta), rel=1e-12)

    strategy = BandedSquareRoot(bands)
    scale = 1.0 * strategy.sensitivity * clip / resumed.expected_batch_size
    inverse = torch.linalg.inv(strategy.matrix(8))
    sixth = math.sqrt((inverse @ inverse.T)[5, 5].item())  # step 6 of one recursion over 8 steps: 1.15
    assert tail.updates()[0].std().item() == pytest.approx(scale, rel=0.03)  # the resumed segment's first step
    assert whole.updates()[5].std().item() == pytest.approx(scale * sixth, rel=0.03)


def test_a_seeded_banded_run_refuses_to_resume_and_an_entropy_key_resumes_it(tmp_path):
    """Finding 2 of an independent review: with noise_seed set, a resume drew the same z_t for step t as the run that
    wrote the checkpoint, but restarted the recursion. The interrupted run's release of step 5 carried z₅ − c₁·w₄, the
    resume's z₅: from the two runs' checkpoints alone (no seed), r₄ − (r₅′ − r₅)/c₁ is step 4's clipped mean gradient
    without noise. Which steps the interrupted run released past the checkpoint cannot be told (steps inside a band
    add nothing to the journal), so such a resume is refused; without the noise seed it resumes with a fresh key."""

    def model(seed):
        L.seed_everything(0)
        return DPSGD(nn.Linear(4, 3), lr=1.0, clip=0.5, privacy=SPEC, noise_seed=seed, noise="banded", bands=2)

    def dm():
        return PrivatePublicDataModule(blobs(200), batch_size=10, sampling_seed=12)

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_steps=10, callbacks=[ckpt, Crash(7)], enable_checkpointing=True).fit(model(11), dm())
    path = str(tmp_path / "step=5.ckpt")
    with pytest.raises(PrivacyConfigError, match="banded noise .* noise_seed cannot resume"):
        make_trainer(max_steps=10).fit(model(11), dm(), ckpt_path=path)
    resumed = model(None)
    make_trainer(max_steps=10).fit(resumed, dm(), ckpt_path=path)
    assert resumed.private_steps == 10


def test_the_one_step_audit_sees_a_bands_first_step():
    """``pl_dp.audit`` runs the method's own step many times: with banded noise each trial is a band's first step
    (the recursion restarts), a Gaussian of std σζC for a sensitivity of C — within the claim, and the canary moves
    the statistic by 1/(σζ) noise stds."""
    sigma, bands = 2.0, 3
    torch.manual_seed(0)
    model = DPSGD(
        nn.Linear(4, 3),
        clip=1.0,
        privacy=PrivacySpec(epsilon=100.0, accountant="rdp", noise_multiplier=sigma),
        noise_seed=0,
        noise="banded",
        bands=bands,
    )
    result = audit(model, PrivatePublicDataModule(blobs(40), batch_size=8), trials=300)
    assert not result.violated and result.epsilon_lower_bound <= result.claimed_epsilon
    # the claim is the trial's own Gaussian, σζ: a build that forgot ζ adds less noise than it claims
    zeta = BandedSquareRoot(bands).sensitivity
    claimed = create_accountant("rdp").epsilon_after(result.delta, 1, noise_multiplier=sigma * zeta, sample_rate=1.0)
    assert result.claimed_epsilon == pytest.approx(claimed, rel=1e-12)
    assert result.separation * sigma * BandedSquareRoot(bands).sensitivity == pytest.approx(1.0, abs=0.45), result
