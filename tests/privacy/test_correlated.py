"""Banded matrix factorization without Lightning: the strategy, the noise recursion and its covariance, the cyclic
Poisson sampler (the participation schema) and the amplified accounting, cross-checked against dp-accounting."""

import copy
import math
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dp_accounting import NeighboringRelation
from dp_accounting.dp_event import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from dp_accounting.pld import PLDAccountant

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.privacy import (
    BandedMatrixFactorization,
    BandedNoise,
    BandedSquareRoot,
    CyclicPoissonBatchSampler,
    NoiseSource,
    PrivacySpec,
    SubsampledGaussian,
)
from pl_dp.privacy.ledger import PrivacyLedger
from pl_dp.privacy.units import PrivacyUnit


def test_the_banded_square_root_squares_to_the_prefix_sums_within_its_band():
    """c_j are the coefficients of (1 − x)^(−1/2): the full square root S of the prefix-sum matrix A (S·S = A), of
    which the b-banded strategy keeps b diagonals; ζ is its largest column norm."""
    steps = 8
    full = BandedSquareRoot(steps).matrix(steps)
    prefix = torch.tril(torch.ones(steps, steps, dtype=torch.float64))
    assert torch.allclose(full @ full, prefix, atol=1e-12)
    strategy = BandedSquareRoot(3)
    assert strategy.coefficients == (1.0, 0.5, 0.375)
    assert strategy.sensitivity == pytest.approx(math.sqrt(1 + 0.25 + 0.140625))
    banded = strategy.matrix(steps)
    assert torch.equal(banded, torch.tril(full) - torch.tril(full, -3))
    assert banded.norm(dim=0).max().item() == pytest.approx(strategy.sensitivity)
    assert BandedSquareRoot(1).sensitivity == 1.0 and BandedSquareRoot(1).coefficients == (1.0,)
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="bands"):
            BandedSquareRoot(bad)


def _mechanism(bands, sigma=1.3, clip=0.7):
    gaussian = SubsampledGaussian(noise_multiplier=sigma, sample_rate=0.1, sensitivity=clip, expected_batch_size=1.0)
    return BandedMatrixFactorization.of(gaussian, BandedNoise(BandedSquareRoot(bands)))


def _noise_over_steps(mechanism, steps, dim, seed=0):
    """The noise the mechanism adds to zero sums of ``dim`` coordinates at each of ``steps`` steps: [steps, dim]."""
    source, rows = NoiseSource(seed), []
    for t in range(steps):
        source.start_step(t)
        sums = [torch.zeros(dim)]
        mechanism.privatize_(sums, source)
        rows.append(sums[0])
    return torch.stack(rows).double()


def test_the_added_noise_has_the_strategys_covariance():
    """Empirical covariance over steps of the added noise (coordinates are i.i.d. samples) = σ²ζ²κ²·C⁻¹C⁻ᵀ, within
    sampling error: 40 000 coordinates, relative std of an entry ≈ 1/√20 000."""
    bands, steps, sigma, clip = 4, 7, 1.3, 0.7
    mechanism = _mechanism(bands, sigma, clip)
    noise = _noise_over_steps(mechanism, steps, 40_000)
    empirical = noise @ noise.T / noise.shape[1]
    inverse = torch.linalg.inv(BandedSquareRoot(bands).matrix(steps))
    expected = (sigma * clip * mechanism.correlation.strategy.sensitivity) ** 2 * inverse @ inverse.T
    scale = expected.diagonal().max().item()
    assert (empirical - expected).abs().max().item() < 0.03 * scale
    assert mechanism.noise_std == pytest.approx(sigma * clip * math.sqrt(1 + 0.25 + 0.375**2 + 0.3125**2))


def test_with_one_band_the_noise_is_dp_sgds_bit_for_bit():
    plain = SubsampledGaussian(noise_multiplier=1.3, sample_rate=0.1, sensitivity=0.7, expected_batch_size=1.0)
    assert torch.equal(_noise_over_steps(_mechanism(1), 5, 1000), _noise_over_steps(plain, 5, 1000))


def test_copies_and_restarts_never_carry_the_past_noise():
    """The past outputs are the recursion's secret: pickles and deep copies leave them out, a restart forgets them
    (the first output after it is the draw itself)."""
    correlation = BandedNoise(BandedSquareRoot(3))
    for _ in range(2):
        correlation.correlate_(0, torch.randn(10))
    for clone in (copy.deepcopy(correlation), pickle.loads(pickle.dumps(correlation))):
        assert clone.strategy == correlation.strategy and clone._past == {}
    assert len(correlation._past[0]) == 2  # b − 1 outputs kept, no more
    correlation.restart()
    draw = torch.randn(10)
    assert torch.equal(correlation.correlate_(0, draw.clone()), draw)


def test_sharded_blocks_correlate_as_the_whole_tensor():
    """A rank that holds a block of a tensor runs the recursion on its block: the same values as the whole draw's
    (FSDP2 shards; the noise source draws blocks independently of the layout)."""
    mechanism, source = _mechanism(3), NoiseSource(5)
    shards = [_mechanism(3), _mechanism(3)]
    for t in range(4):
        source.start_step(t)
        whole = [torch.zeros(6, 5)]
        mechanism.privatize_(whole, source)
        for rank, shard in enumerate(shards):
            source.start_step(t)
            block = [torch.zeros(3, 5)]
            shard.privatize_(block, source, blocks=[(torch.Size((6, 5)), 15 * rank)])
            assert torch.equal(block[0], whole[0][3 * rank : 3 * rank + 3])


def test_cyclic_batches_lie_in_their_group_at_the_group_rate():
    """Batch t holds members of group t mod b only — so two participations of an example are ≥ b steps apart — each
    at rate q; groups are near-equal, independent of n (adding an example moves no other's group), and the expected
    batch is q·n/b."""
    n, q, bands, batches = 3000, 0.2, 3, 300
    sampler = CyclicPoissonBatchSampler(n, q, bands, steps_per_epoch=batches, seed=11)
    groups = sampler.group_of(np.arange(n))
    counts, last = np.zeros(n), np.full(n, -(10**9))
    for t, batch in enumerate(sampler):
        assert np.all(groups[batch] == t % bands)
        assert np.all(t - last[batch] >= bands)  # b-min-separation
        last[batch] = t
        counts[batch] += 1
    assert counts.sum() / (n * batches / bands) == pytest.approx(q, rel=0.03)
    assert np.bincount(groups, minlength=bands) / n == pytest.approx(np.full(bands, 1 / bands), abs=0.03)
    larger = CyclicPoissonBatchSampler(n + 1, q, bands, seed=11)
    assert np.array_equal(larger.group_of(np.arange(n)), groups)
    assert sampler.expected_batch_size == pytest.approx(q * n / bands)
    other = CyclicPoissonBatchSampler(n, q, bands, seed=12)  # another seed, another assignment
    assert not np.array_equal(other.group_of(np.arange(n)), groups)


def test_the_cyclic_sampler_resumes_at_its_position_and_copies_draw_their_own_groups():
    a = CyclicPoissonBatchSampler(500, 0.3, 4, steps_per_epoch=10, seed=3)
    first = [a.batch(i) for i in range(6)]
    b = CyclicPoissonBatchSampler(500, 0.3, 4, steps_per_epoch=10, seed=3)
    b.load_state_dict({"position": 3})
    assert next(iter(b)) == first[3]
    secret = CyclicPoissonBatchSampler(500, 0.3, 4, steps_per_epoch=10)
    assert set(secret.state_dict()) == {"position"}
    clone = pickle.loads(pickle.dumps(secret))
    assert clone.seed != secret.seed and clone.bands == 4  # its own groups and batches, the same schema


def _ledger(spec, bands, rate, steps):
    ledger = PrivacyLedger(spec, spec.accountant)
    n = 1000
    sampler = SimpleNamespace(
        sample_rate=rate,
        expected_batch_size=rate * n / bands,
        bands=bands,
        seeded=False,
        unit=PrivacyUnit("example", n),
    )
    ledger.observe_sampler(sampler, noise_seeded=False)
    ledger.fix_delta()
    ledger.open_journal(None, None, lambda obj: obj)
    ledger.plan(steps, None, False, steps)
    return ledger


def _run(ledger, steps, bands):
    gaussian = SubsampledGaussian(ledger.noise_multiplier, ledger.sample_rate, 1.0, ledger.expected_batch_size)
    mechanism = BandedMatrixFactorization.of(gaussian, BandedNoise(BandedSquareRoot(bands)))
    for _ in range(steps):
        assert ledger.allows_next_step()
        ledger.record(mechanism)


@pytest.mark.parametrize(
    ("sigma", "rate", "steps", "bands"),
    [(1.0, 0.2, 100, 2), (0.8, 0.2, 50, 4), (1.0, 0.5, 37, 5), (1.2, 0.05, 600, 8), (0.6, 0.02, 2000, 16)],
)
@pytest.mark.parametrize("accountant", ["pld", "prv"])
def test_the_amplified_event_matches_an_independent_pld_on_a_grid(sigma, rate, steps, bands, accountant):
    """ε of T steps of the banded mechanism, as the ledger records them (one composition per band of b steps), against
    dp-accounting's PLD of the event built here from the theorem: ⌈T/b⌉ Poisson-subsampled Gaussian steps at rate q
    and multiplier σ (Choquette-Choo et al. 2023, Theorem 5; jax_privacy's BandMF event) — within 1 % (ε from 2.2 to
    10.1 on this grid: PRV's error bound is absolute, 0.01, which is over 1 % below ε ≈ 1)."""
    spec = PrivacySpec(epsilon=1e3, delta=1e-5, noise_multiplier=sigma, accountant=accountant)
    ledger = _ledger(spec, bands, rate, steps)
    _run(ledger, steps, bands)
    reference = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    reference.compose(
        SelfComposedDpEvent(PoissonSampledDpEvent(rate, GaussianDpEvent(sigma)), math.ceil(steps / bands))
    )
    assert ledger.private_steps == steps and ledger.accountant.steps == math.ceil(steps / bands)
    assert ledger.epsilon == pytest.approx(reference.get_epsilon(1e-5), rel=0.01)


def test_calibration_and_the_guard_use_the_amplified_event():
    """σ is calibrated for ⌈T/b⌉ compositions, so a run of T steps ends at the target; the guard lets the band's
    later steps run (paid at its first) and stops the step that would open one composition too many."""
    bands, steps = 4, 42
    ledger = _ledger(PrivacySpec(epsilon=2.0, delta=1e-5, accountant="rdp"), bands, 0.2, steps)
    plain = _ledger(PrivacySpec(epsilon=2.0, delta=1e-5, accountant="rdp"), 1, 0.2, math.ceil(steps / bands))
    assert ledger.noise_multiplier == plain.noise_multiplier  # the same event, the same σ
    _run(ledger, steps, bands)
    assert ledger.epsilon <= 2.0 and ledger.accountant.steps == 11
    for _ in range(2):  # steps 43 and 44 finish the band step 41 opened: already paid
        assert ledger.allows_next_step()
        ledger.record(SubsampledGaussian(ledger.noise_multiplier, 0.2, 1.0, 50.0))
    ledger.add_target(ledger.epsilon)  # nothing left for a new composition
    assert not ledger.allows_next_step() and ledger.accountant.steps == 11


def test_a_new_fit_starts_new_bands():
    """Each fit is a banded mechanism of its own (its recursion restarts): its bands count from its first step, so a
    fit that starts mid-band pays for a composition at once."""
    ledger = _ledger(PrivacySpec(epsilon=50.0, delta=1e-5, noise_multiplier=1.0, accountant="rdp"), 4, 0.2, 6)
    _run(ledger, 6, 4)
    assert ledger.accountant.steps == 2
    ledger.plan(6, None, False, 6)
    _run(ledger, 6, 4)
    assert ledger.private_steps == 12 and ledger.accountant.steps == 4  # ⌈6/4⌉ + ⌈6/4⌉, not ⌈12/4⌉


def test_a_resume_under_another_number_of_groups_is_refused_unless_allowed():
    """A checkpoint's history was released under its cyclic groups; a loader of another b changes the event."""
    spec = PrivacySpec(epsilon=50.0, delta=1e-5, noise_multiplier=1.0, accountant="rdp")
    ledger = _ledger(spec, 4, 0.2, 8)
    _run(ledger, 8, 4)
    state = ledger.state_dict()
    assert state["bands"] == 4
    resumed = PrivacyLedger(spec, "rdp")
    n = 1000
    sampler = SimpleNamespace(
        sample_rate=0.2, expected_batch_size=0.2 * n / 2, bands=2, seeded=False, unit=PrivacyUnit("example", n)
    )
    resumed.load_state_dict(state)  # the checkpoint (on_load_checkpoint), then the loader (the fit's start)
    resumed.observe_sampler(sampler, noise_seeded=False)
    with pytest.raises(PrivacyConfigError, match="4 cyclic groups differ from the loader's 2"):
        resumed.plan(8, state, False, 16)
