"""Poisson sampling, the noise source, the mechanism declaration, clipping and the loss contract."""

import math
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from pl_dp.data.collate import PaddingCollate
from pl_dp.errors import PrivacyConfigError
from pl_dp.privacy import (
    RDP,
    NoiseSource,
    PoissonBatchSampler,
    PrivacySpec,
    SubsampledGaussian,
    clip_per_example,
    poisson_loader,
    poisson_sampler_of,
)
from pl_dp.privacy.noise import _generator
from pl_dp.privacy.seeding import derive_seed
from pl_dp.step import check_per_sample
from pl_dp.zo import privatize_sum, privatize_sums


def test_poisson_inclusion_rate_and_variable_sizes():
    n, q, batches = 1000, 0.05, 400
    sampler = PoissonBatchSampler(n, q, steps_per_epoch=batches, seed=3)
    counts = torch.zeros(n)
    sizes = []
    for idx in sampler:
        counts[idx] += 1
        sizes.append(len(idx))
    rate = counts.sum() / (n * batches)
    assert rate == pytest.approx(q, rel=0.02)  # 20k Bernoulli(0.05) draws: std of rate ≈ 0.7 %
    assert len(set(sizes)) > 5  # variable batch sizes, not fixed
    # each example's inclusion is independent of the others: per-example rates spread binomially
    assert counts.std() == pytest.approx(math.sqrt(batches * q * (1 - q)), rel=0.15)


def test_poisson_inclusion_holds_its_rate_below_float32_resolution():
    """Inclusion compared a float32 uniform with q: the true rate was ⌈q·2²⁴⌉/2²⁴, 2⁻²⁴ ≈ 6e-8 for any smaller q.
    At q = 1e-12 over 200 batches of n = 10⁶ that is about 12 inclusions; the true law expects 2e-4."""
    sampler = PoissonBatchSampler(1_000_000, 1e-12, steps_per_epoch=200, seed=0)
    assert sum(len(sampler.batch(i)) for i in range(200)) == 0


def test_poisson_law_at_large_n_and_small_q():
    """n = 10⁸, q = 10⁻⁶ (b = 100): batch sizes Binomial(n, q), indices distinct, sorted and uniform over [0, n)."""
    n, q, steps = 10**8, 1e-6, 2000
    sampler = PoissonBatchSampler(n, q, steps_per_epoch=steps, seed=0)
    sizes, deciles = [], torch.zeros(10)
    for i in range(steps):
        batch = sampler.batch(i)
        assert batch == sorted(set(batch)) and all(0 <= j < n for j in batch)
        sizes.append(len(batch))
        deciles += torch.bincount(torch.tensor(batch, dtype=torch.long) * 10 // n, minlength=10)
    sizes = torch.tensor(sizes, dtype=torch.float64)
    assert sizes.mean().item() == pytest.approx(n * q, abs=1.0)  # standard error 0.22
    assert sizes.var().item() == pytest.approx(n * q * (1 - q), rel=0.15)  # standard error ≈ 3 %
    expected = sizes.sum() / 10
    assert (((deciles - expected) ** 2) / expected).sum().item() < 27.9  # χ²(9) at 0.001


def test_poisson_inclusions_of_different_examples_are_independent():
    """Pairwise: the correlation of two examples' inclusion indicators is 0 (a fixed-size sampler's is −1/(n−1),
    and its batch-size variance 0)."""
    n, q, steps = 200, 0.3, 3000
    sampler = PoissonBatchSampler(n, q, steps_per_epoch=steps, seed=1)
    included = torch.zeros(steps, n)
    for i in range(steps):
        included[i, sampler.batch(i)] = 1.0
    assert included.mean().item() == pytest.approx(q, rel=0.01)
    correlation = torch.corrcoef(included.T)
    off = correlation[~torch.eye(n, dtype=torch.bool)]
    assert off.mean().abs().item() < 0.002 and off.abs().max().item() < 0.1  # each ≈ N(0, 1/√3000 = 0.018)


def test_a_batch_costs_its_size_not_the_population():
    """At n = 10¹⁰ a step allocates a few kB (a mask over n, as Opacus' sampler and pl_dp's before draw, is 40 GB)."""
    import tracemalloc

    sampler = PoissonBatchSampler(10**10, 1e-8, steps_per_epoch=10, seed=2)
    tracemalloc.start()
    sizes = [len(sampler.batch(i)) for i in range(10)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert 0 < sum(sizes) < 2000 and peak < 1_000_000  # NumPy reports its allocations to tracemalloc


def test_a_copy_of_a_sampler_draws_other_batches_unless_seeded():
    import copy
    import pickle

    secret, seeded = PoissonBatchSampler(1000, 0.1), PoissonBatchSampler(1000, 0.1, seed=4)
    for clone in (copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))):
        assert clone(secret).batch(2) != secret.batch(2) and "seed" not in secret.__getstate__()
        assert clone(seeded).batch(2) == seeded.batch(2)  # a user seed is public: reproduction mode


def _seeded_by_32_bits(state: torch.Tensor) -> bool:
    """Whether a CPU generator state is the Mersenne Twister's seeding of its first word (what manual_seed makes)."""
    import struct

    words = struct.unpack_from("<624Q", bytes(state.tolist()), 24)
    return words[1] == (1812433253 * (words[0] ^ (words[0] >> 30)) + 1) & 0xFFFFFFFF


def test_secret_cpu_generators_have_a_full_state_not_a_32__bit_seed():
    """torch's CPU generator keeps the low 32 bits of a seed: trying 2³² seeds against a release recovers the noise
    (the second review: hours on one core). The noise of a step, the step's own randomness (dropout) and the Poisson
    sampling of Opacus' loader all run from a state filled from the secret instead."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    from pl_dp.privacy.sampling import OpacusPoissonSampling

    assert _seeded_by_32_bits(torch.Generator().manual_seed(2**40 + 5).get_state())  # what the check detects
    source = NoiseSource(seed=3)
    assert not _seeded_by_32_bits(_generator(source._key, torch.device("cpu"), b"noise", 0, 0).get_state())
    with torch.random.fork_rng():
        source.seed_randomness(0, 0, torch.device("cpu"))
        assert not _seeded_by_32_bits(torch.get_rng_state())
        assert torch.initial_seed() == 0  # never the secret
    opacus = OpacusPoissonSampling(UniformWithReplacementSampler(num_samples=100, sample_rate=0.1))
    assert not _seeded_by_32_bits(opacus.sampler.generator.get_state())


def test_a_secret_cpu_state_holds_every_word_of_its_hash_and_twists_them_first():
    """The Mersenne Twister's 624 words are SHAKE-256(material)'s 32-bit little-endian words, one per 8-byte slot (a
    word written into the wrong half of its slot, or a 64-bit read of the hash, would keep less entropy than the
    hash gives); the initial seed reads 0, and the next draw twists these words first (left = 1)."""
    import hashlib
    import struct

    from pl_dp.privacy.seeding import secret_cpu_state

    material = b"a step's material"
    state = bytes(secret_cpu_state(material).tolist())
    words = struct.unpack("<624I", hashlib.shake_256(material).digest(4 * 624))
    assert struct.unpack_from("<624Q", state, 24) == words
    assert struct.unpack_from("<Qii", state, 0) == (0, 1, 1)
    assert state[24 + 8 * 624 :] == bytes(torch.Generator().manual_seed(5489).get_state().tolist())[24 + 8 * 624 :]


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draw_of_one_chunk_is_the_block_of_the_whole_draw(secure, dtype):
    """A draw of at most one chunk is returned as drawn (no copy, unless the generator's dtype is another: the secure
    one draws float64): in the dtype asked for, the same values a rank reading it as one block of a sharded tensor
    gets, and a block of it is its slice."""
    whole, sliced, block = (NoiseSource(seed=4, secure=secure) for _ in range(3))
    for source in (whole, sliced, block):
        source.start_step(2)
    drawn = whole.normal((64, 33), 1.5, dtype=dtype)
    assert drawn.shape == (64, 33) and drawn.dtype == dtype
    assert torch.equal(sliced.normal((64, 33), 1.5, dtype=dtype, block=(0, 64 * 33)), drawn.reshape(-1))
    assert torch.equal(block.normal((64, 33), 1.5, dtype=dtype, block=(100, 50)), drawn.reshape(-1)[100:150])


def test_poisson_batches_are_counter_based_and_resumable():
    a = PoissonBatchSampler(100, 0.1, steps_per_epoch=5, seed=1)
    first = list(a)
    assert len(first) == 5 and a.position == 5
    b = PoissonBatchSampler(100, 0.1, steps_per_epoch=5, seed=1)
    b.load_state_dict({"position": 3})
    assert next(iter(b)) == first[3]
    assert first[0] != list(a)[0]  # the next epoch draws fresh batches


def test_the_sampling_seed_is_a_secret_from_os_entropy_and_never_in_the_state():
    a, b = PoissonBatchSampler(1000, 0.1), PoissonBatchSampler(1000, 0.1)
    assert not a.seeded and a.batch(0) != b.batch(0)  # two runs of one config sample differently
    assert a.state_dict() == {"position": 0}  # the position only: the seed never reaches a checkpoint
    assert PoissonBatchSampler(1000, 0.1, seed=4).seeded


def test_distributed_shards_union_is_the_global_poisson_batch():
    full = PoissonBatchSampler(500, 0.1, seed=7).batch(4)
    shards = [PoissonBatchSampler(500, 0.1, seed=7, num_replicas=3, rank=r).batch(4) for r in range(3)]
    assert sorted(sum(shards, [])) == full
    assert all(i % 3 == r for r, s in enumerate(shards) for i in s)


def test_empty_poisson_batch_collates_to_zero_length_tensors():
    ds = TensorDataset(torch.randn(5, 3), torch.arange(5))
    loader = poisson_loader(ds, 1e-9, steps_per_epoch=2)
    x, y = next(iter(loader))
    assert x.shape == (0, 3) and y.shape == (0,) and y.dtype == torch.long


class _TwiceCollate(PaddingCollate):
    """A collate that batches otherwise than it parent: it doubles the features."""

    def __call__(self, examples):
        x, *rest = super().__call__(examples)
        return [2 * x, *rest]


@pytest.mark.parametrize("collate", [default_collate, PaddingCollate(), PaddingCollate(length=4), _TwiceCollate()])
def test_a_tensor_datasets_rows_read_at_once_batch_as_its_examples_read_one_by_one(collate):
    """The private loader reads a plain TensorDataset's sampled rows with one indexing per tensor where its collate
    stacks equal rows (``default_collate``, a ``PaddingCollate`` without a fixed length): the batches are those of the
    examples read and collated one by one, bit for bit, empty ones included. A collate that pads integer rows to a
    length, or a subclass that batches otherwise, gets the examples one by one."""
    images = torch.randn(40, 3, 2, 2).to(memory_format=torch.channels_last)  # rows stacked are contiguous
    ds = TensorDataset(torch.randn(40, 3), torch.randint(0, 9, (40, 3)), torch.arange(40), images)
    at_once, one_by_one = (poisson_loader(ds, 0.05, seed=3, steps_per_epoch=30, collate_fn=collate) for _ in "ab")
    stacks = collate is default_collate or (type(collate) is PaddingCollate and collate.length is None)
    assert at_once.dataset.columns == stacks
    one_by_one.dataset.columns = False
    at_once, one_by_one = list(at_once), list(one_by_one)
    assert any(len(batch[0]) == 0 for batch in one_by_one)  # an empty batch among them
    assert len(at_once) == len(one_by_one) == 30
    for mine, theirs in zip(at_once, one_by_one):
        assert type(mine) is type(theirs)
        for a, b in zip(mine, theirs):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            assert a.stride() == b.stride() or a.numel() == 0  # an empty tensor's strides describe no memory


def test_rows_are_read_one_by_one_where_a_tensor_cannot_be_indexed_by_them():
    """A nested tensor (no row indexing) or a tensor shorter than the dataset (its missing rows fail to read, and
    such an example sits its step out) keeps the one-by-one reads."""
    nested = torch.nested.nested_tensor([torch.randn(k) for k in (2, 3, 2, 4)])
    short = TensorDataset(torch.randn(4, 2), torch.arange(4))
    short.tensors = (short.tensors[0], short.tensors[1][:2])
    for ds in (TensorDataset(nested, torch.arange(4)), short):
        assert not poisson_loader(ds, 0.5, steps_per_epoch=2).dataset.columns


def test_shuffling_loader_is_refused():
    ds = TensorDataset(torch.randn(10, 2), torch.zeros(10, dtype=torch.long))
    with pytest.raises(PrivacyConfigError, match="Poisson"):
        poisson_sampler_of(torch.utils.data.DataLoader(ds, batch_size=2, shuffle=True))


def test_noise_is_independent_of_direction_and_global_seeds():
    # T11: re-seeding every other generator with the same value does not reproduce the noise
    seed = 1234
    torch.manual_seed(seed)
    global_draw = torch.randn(1000)
    g = torch.Generator().manual_seed(seed)
    direction_draw = torch.randn(1000, generator=g)
    g.manual_seed(derive_seed(seed, 0, 0, 0))
    subseed_draw = torch.randn(1000, generator=g)
    a = NoiseSource().normal((1000,), 1.0)
    b = NoiseSource().normal((1000,), 1.0)
    for other in (global_draw, direction_draw, subseed_draw, b):
        assert not torch.allclose(a, other)
        assert abs(torch.corrcoef(torch.stack([a, other]))[0, 1]) < 0.15


@pytest.mark.parametrize("secure", [False, True])
def test_seeded_noise_is_a_pure_function_of_seed_step_and_draw(secure):
    a, b = NoiseSource(seed=5, secure=secure), NoiseSource(seed=5, secure=secure)
    a.start_step(7)
    first, second = a.normal((4,), 2.0), a.normal((4,), 2.0)
    b.start_step(7)
    assert torch.equal(b.normal((4,), 2.0), first) and torch.equal(b.normal((4,), 2.0), second)
    assert not torch.equal(first, second)
    b.start_step(8)
    assert not torch.equal(b.normal((4,), 2.0), first)  # another step, other noise
    assert not torch.equal(NoiseSource(seed=6, secure=secure).normal((4,), 2.0), NoiseSource(seed=5).normal((4,), 2.0))


@pytest.mark.parametrize("secure", [False, True])
def test_a_block_of_a_draw_is_its_slice_drawn_from_the_chunks_that_meet_it(secure):
    """A rank's block of a sharded tensor gets exactly its slice of the draw one process makes — across chunk edges
    (2²⁰ values), at either end, empty — and drawing it costs the block: here a block of a draw of 2³⁴ values (64 GiB
    whole in fp32), which would not fit in memory if the whole draw were made."""
    source, shape = NoiseSource(seed=3, secure=secure), (1500, 1500)  # 2.1 chunks
    source.start_step(5)
    whole = source.normal(shape, 2.0).view(-1)
    numel = whole.numel()
    for offset, count in [(0, numel), (0, 1 << 20), (1000, 1 << 20), (numel // 2, numel - numel // 2), (numel - 5, 5)]:
        source.start_step(5)
        assert torch.equal(source.normal(shape, 2.0, block=(offset, count)), whole[offset : offset + count])
    source.start_step(5)
    assert source.normal(shape, 2.0, block=(numel, 0)).shape == (0,)
    huge = source.normal((1 << 34,), 2.0, block=((1 << 33) + 17, 10))
    assert huge.shape == (10,) and huge.std() > 0
    with pytest.raises(ValueError, match="does not lie"):
        source.normal(shape, 2.0, block=(numel - 2, 5))


@pytest.mark.parametrize("secure", [False, True])
def test_a_release_of_many_tensors_is_one_draw_and_each_rank_adds_its_blocks_of_it(secure):
    """``privatize_`` adds to a list of tensors the consecutive pieces of one draw of their total size (one generator
    state, not one per tensor), and ranks holding blocks of the whole tensors add exactly their slices of what one
    process adds — a block across a chunk edge, tensors sharing a chunk, a rank with an empty block included."""
    mechanism = SubsampledGaussian(noise_multiplier=1.3, sample_rate=0.1, sensitivity=0.7, expected_batch_size=2.0)
    shapes = [(3, 5), (1 << 20,), (2,), (2, 600_000)]  # 2.2 chunks of 2²⁰ values; a third rank holds none of (2,)
    source = NoiseSource(seed=4, secure=secure)
    source.start_step(2)
    whole = [torch.zeros(shape) for shape in shapes]
    mechanism.privatize_(whole, source)
    flat = torch.cat([t.reshape(-1) for t in whole]) * mechanism.expected_batch_size
    source.start_step(2)
    assert torch.equal(flat, source.normal((flat.numel(),), mechanism.noise_std))  # the pieces of one draw, in order
    for ranks in (2, 3):
        for rank in range(ranks):
            blocks, held = [], []
            for shape in shapes:
                numel = math.prod(shape)
                size = -(-numel // ranks)
                offset = min(rank * size, numel)
                blocks.append((torch.Size(shape), offset))
                held.append(torch.zeros(min(size, numel - offset)))
            source.start_step(2)
            mechanism.privatize_(held, source, blocks=blocks)
            for (_, offset), block, expected in zip(blocks, held, whole):
                assert torch.equal(block, expected.reshape(-1)[offset : offset + block.numel()])
    two = [torch.zeros(4), torch.zeros(4)]
    with pytest.raises(ValueError, match="does not lie"):  # it would take the next tensor's noise
        mechanism.privatize_(two, source, blocks=[(torch.Size((4,)), 2), (torch.Size((4,)), 0)])
    with pytest.raises(ValueError, match="shorter"):  # a tensor without a block would get no noise
        mechanism.privatize_(two, source, blocks=[(torch.Size((4,)), 0)])
    with pytest.raises(ValueError, match="one device"):
        source.normal_like([torch.zeros(2), torch.zeros(2, device="meta")], 1.0)
    source.start_step(3)
    assert list(source.normal_like([], 1.0)) == []  # no tensors, no draw: the step's first draw is still draw 0
    fresh = NoiseSource(seed=4, secure=secure)
    fresh.start_step(3)
    assert torch.equal(source.normal((4,), 1.0), fresh.normal((4,), 1.0))


@pytest.mark.parametrize("secure", [False, True])
def test_the_blocks_of_a_draw_are_of_the_step_and_key_it_was_taken_under(secure):
    """A draw's blocks are made as they are read; they are still that draw's after the source moved on to another
    step or took another key — never a (step, draw) the replay guard did not see."""
    source = NoiseSource(seed=8, secure=secure)
    source.start_step(3)
    expected = source.normal((10,), 1.0)
    source.start_step(3)
    blocks = source.normal_blocks(10, 1.0, [(0, 4), (4, 6)])
    source.start_step(4)
    source.share(lambda _: (bytes(32), True))  # another key
    assert torch.equal(torch.cat(list(blocks)), expected)


@pytest.mark.parametrize("secure", [False, True])
def test_entropy_noise_differs_between_sources_and_has_no_state_to_save(secure):
    a, b = NoiseSource(secure=secure), NoiseSource(secure=secure)
    assert not a.seeded and not torch.equal(a.normal((8,), 1.0), b.normal((8,), 1.0))
    assert not hasattr(a, "state_dict")  # nothing a checkpoint could hold


def test_secure_noise_is_standard_normal_at_the_requested_scale():
    from scipy import stats

    draws = NoiseSource(secure=True).normal((200_000,), 3.0, dtype=torch.float64)
    assert draws.std().item() == pytest.approx(3.0, rel=0.01)
    assert stats.kstest(draws.numpy() / 3.0, "norm").pvalue > 1e-3


def test_mechanism_noise_std_and_accounting_come_from_one_declaration():
    mech = SubsampledGaussian(
        noise_multiplier=1.5, sample_rate=0.1, sensitivity=2.0, expected_batch_size=10, releases=4
    )
    assert mech.noise_std == pytest.approx(math.sqrt(4) * 1.5 * 2.0)
    out = mech.privatize(torch.zeros(20000), NoiseSource(seed=0))
    assert out.std().item() == pytest.approx(mech.noise_std / 10, rel=0.03)
    acc = RDP()
    mech.account(acc)
    assert acc.history == [(1.5, 0.1, 1)]  # sigma, never sqrt(q)*sigma
    nonprivate = SubsampledGaussian(0.0, 0.1, math.inf, 10)
    nonprivate.account(acc)
    assert acc.steps == 1


def test_clip_per_example_bounds_and_counts_nonfinite():
    vals = torch.tensor([0.5, -3.0, 7.0, float("nan"), float("inf"), -float("inf")])
    clipped, bad = clip_per_example(vals, 1.0)
    assert torch.equal(clipped, torch.tensor([0.5, -1.0, 1.0, 0.0, 0.0, 0.0]))  # scalars: the clamp
    assert int(bad) == 3
    rows, bad = clip_per_example(torch.tensor([[3.0, 4.0], [0.3, 0.4], [float("nan"), 1.0]]), 1.0)
    torch.testing.assert_close(rows, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))  # rows: joint L2
    assert int(bad) == 1


def test_per_sample_contract():
    assert check_per_sample(torch.ones(3, dtype=torch.float64), 3).dtype == torch.float32
    with pytest.raises(ValueError, match="one value per example"):
        check_per_sample(torch.tensor(1.0), 3)
    with pytest.raises(ValueError, match="one value per example"):
        check_per_sample(torch.ones(4), 3)
    with pytest.raises(TypeError, match="floating point"):
        check_per_sample(torch.ones(3, dtype=torch.long), 3)
    with pytest.raises(TypeError):
        check_per_sample(nn.Linear(1, 1), 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": 0}, "epsilon"),
        ({"epsilon": -1}, "epsilon"),
        ({"epsilon": float("nan")}, "epsilon"),
        ({"epsilon": 1, "delta": 1.5}, "delta"),
        ({"epsilon": 1, "accountant": "moments"}, "accountant"),
        ({"epsilon": 1, "noise_multiplier": 0}, "noise_multiplier"),
    ],
)
def test_privacy_spec_validation(kwargs, match):
    with pytest.raises(PrivacyConfigError, match=match):
        PrivacySpec(**kwargs)


def test_delta_defaults_to_one_over_n_and_warns_when_large():
    assert PrivacySpec(1.0).resolve_delta(200) == 1 / 200
    with pytest.warns(UserWarning, match="exceeds 1/n=0.005 for the n=200 examples"):
        PrivacySpec(1.0, delta=0.1).resolve_delta(200)


def test_releases_privatized_together_are_those_privatized_one_by_one():
    """``privatize_sums`` (one host copy and one reduce for a zeroth-order step's q releases) draws the same noise,
    in the same order, as q calls of ``privatize_sum``; a non-finite value contributes 0 and is counted either way."""
    mech = SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.1, sensitivity=1.0, expected_batch_size=10)
    values = [torch.tensor([0.3, -2.0, 0.5]), torch.tensor([float("nan"), 0.1, 4.0]), torch.randn(3, 2)]
    source = NoiseSource(seed=7)
    one_by_one = [privatize_sum(v, 1.0, mech, source) for v in values]
    together = privatize_sums(values, 1.0, mech, NoiseSource(seed=7))
    for (release, count), (expected, expected_count) in zip(together, one_by_one):
        assert torch.equal(release, expected) and float(count) == float(expected_count)
    assert [float(count) for _, count in together] == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("secure", [False, True])
def test_an_entropy_key_never_draws_a_training_steps_noise_twice(secure):
    """A guard behind the fresh key of every fit: an unseeded source refuses a (step, draw) at or before the latest
    one it drew under its key — the same noise in two releases cancels in their difference."""
    source = NoiseSource(secure=secure)
    source.start_step(3)
    first = source.normal((4,), 1.0)
    source.normal((4,), 1.0)  # the step's next draw
    for step in (3, 2):
        source.start_step(step)
        with pytest.raises(RuntimeError, match="same secret key"):
            source.normal((4,), 1.0)
    source.start_step(4)
    source.normal((4,), 1.0)
    source.start_step(-1)  # the one-step audit's trials (negative counters) release nothing: not guarded
    source.normal((4,), 1.0)
    source.redraw_secret()  # a new fit's key: its steps are drawn afresh
    source.start_step(3)
    assert not torch.equal(source.normal((4,), 1.0), first)
    copy = pickle.loads(pickle.dumps(source))  # a copy draws its own key, none of whose draws is made
    copy.start_step(3)
    copy.normal((4,), 1.0)


def test_a_seeded_key_replays_its_draws_and_keeps_its_key():
    """Reproduction mode: a user's seed redraws the same noise (a bit-identical resume) and is never redrawn."""
    source = NoiseSource(seed=5)
    key = source._key
    source.redraw_secret()
    assert source._key == key
    draws = []
    for _ in range(2):
        source.start_step(3)
        draws.append(source.normal((4,), 1.0))
    assert torch.equal(*draws)
