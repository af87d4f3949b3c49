"""User-level privacy in the privacy layer: the user index, Poisson sampling over users with one example each, the
unit the ledger records, δ's default and the report's words."""

import collections
import decimal

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from torch.utils.data import TensorDataset

from pl_dp.errors import ConfigError, DataError, PrivacyConfigError
from pl_dp.privacy import PrivacyReport, PrivacySpec, SubsampledGaussian, poisson_loader, poisson_sampler_of
from pl_dp.privacy.ledger import PrivacyLedger
from pl_dp.privacy.sampling import PoissonBatchSampler, UserPoissonBatchSampler
from pl_dp.privacy.units import PrivacyUnit, UserIndex


def _skewed_users(num_users: int = 40, seed: int = 0) -> list[str]:
    """One user id per example: user u has 1 + ⌊60/(u+1)⌋ examples (Zipf-like; user 0 has 61), shuffled."""
    ids = [f"user{u}" for u in range(num_users) for _ in range(1 + 60 // (u + 1))]
    order = np.random.default_rng(seed).permutation(len(ids))
    return [ids[i] for i in order]


def test_the_user_index_numbers_users_and_lists_their_examples():
    ids = ["b", "a", "b", "c", "a", "b"]
    index = UserIndex(ids)
    assert (index.num_examples, index.num_users) == (6, 3)
    assert index.counts.tolist() == [3, 2, 1]  # numbered in order of first example: b, a, c
    examples = [sorted(index.order[index.offsets[u] : index.offsets[u + 1]].tolist()) for u in range(3)]
    assert examples == [[0, 2, 5], [1, 4], [3]]
    assert UserIndex.of(lambda i: ids[i], 6).counts.tolist() == [3, 2, 1]  # a callable index -> user id
    with pytest.raises(ConfigError, match="user of each of the 5 private examples"):
        UserIndex.of(ids, 5)
    with pytest.raises(ConfigError, match="hashable"):
        UserIndex([["a"], ["b"]])


def test_one_example_per_sampled_user_and_users_sampled_at_rate_q_whatever_their_size():
    """Over many batches through the real loader: no batch holds two examples of one user; every user joins a batch
    with probability q, independently of how many examples they have; within a user, each example is equally
    likely."""
    ids = _skewed_users()
    index = UserIndex(ids)
    q, steps = 0.2, 3000
    dataset = TensorDataset(torch.arange(len(ids)))
    loader = poisson_loader(dataset, q, seed=5, steps_per_epoch=steps, users=index)
    sampler = poisson_sampler_of(loader)
    assert isinstance(sampler, UserPoissonBatchSampler) and sampler.unit == PrivacyUnit("user", 40)
    assert sampler.expected_batch_size == pytest.approx(q * 40)
    joined = collections.Counter()
    picked = collections.Counter()
    sizes = []
    for (rows,) in loader:
        users = [ids[i] for i in rows.tolist()]
        assert len(users) == len(set(users))  # one example per sampled user
        joined.update(users)
        picked.update(rows.tolist())
        sizes.append(len(rows))
    rates = np.array([joined[f"user{u}"] / steps for u in range(40)])
    assert np.abs(rates - q).max() < 4.5 * (q * (1 - q) / steps) ** 0.5  # each user at rate q, the 61-example one too
    assert np.mean(sizes) == pytest.approx(q * 40, rel=0.02) and len(set(sizes)) > 5  # Poisson over users
    heavy = [i for i, user in enumerate(ids) if user == "user0"]
    counts = np.array([picked[i] for i in heavy])
    expected = counts.sum() / len(heavy)
    assert ((counts - expected) ** 2 / expected).sum() < 100.0  # χ²(60) at 0.001: uniform within the user


def test_user_sampling_is_counter_based_secret_and_shards_one_global_batch():
    index = UserIndex(_skewed_users())
    full = UserPoissonBatchSampler(index, 0.3, seed=7).batch(4)
    assert full == UserPoissonBatchSampler(index, 0.3, seed=7).batch(4)  # a pure function of (seed, step)
    assert UserPoissonBatchSampler(index, 0.3).batch(4) != UserPoissonBatchSampler(index, 0.3).batch(4)
    assert not UserPoissonBatchSampler(index, 0.3).seeded and UserPoissonBatchSampler(index, 0.3).state_dict() == {
        "position": 0
    }
    shards = [UserPoissonBatchSampler(index, 0.3, seed=7, num_replicas=3, rank=r).batch(4) for r in range(3)]
    assert sorted(sum(shards, [])) == full  # the union over ranks is the global batch: each user once
    state = torch.get_rng_state()
    UserPoissonBatchSampler(index, 0.3, seed=7).batch(5)
    assert torch.equal(state, torch.get_rng_state())  # never the global RNG


def _ledger(sampler, delta=None):
    spec = PrivacySpec(2.0, delta=delta, accountant="pld")
    ledger = PrivacyLedger(spec, "pld")
    ledger.observe_sampler(sampler, noise_seeded=False)
    ledger.fix_delta()
    return ledger


def test_delta_defaults_to_one_over_the_users_and_the_report_speaks_of_users():
    index = UserIndex(_skewed_users())
    assert index.num_examples == 281 and index.num_users == 40
    ledger = _ledger(UserPoissonBatchSampler(index, 0.25, seed=1))
    assert ledger.delta == 1 / 40 and ledger.unit == PrivacyUnit("user", 40)
    ledger.open_journal(None, None, lambda obj: obj)
    ledger.plan(10, None, False, 10)
    ledger.record(SubsampledGaussian(ledger.noise_multiplier, ledger.sample_rate, 1.0, ledger.expected_batch_size))
    report = ledger.report("DPSGD", secure_rng=False, noise_seeded=False)
    text = str(report)
    assert "-DP per user, add/remove-one adjacency of users (one user with all of their examples)" in text
    assert "over 40 users: each user joins a batch with probability q and gives one of their examples" in text
    assert "all the data except whether one user (all of their examples) is in it" in text
    assert "δ's default 1/U" in text
    assert report.to_dict()["unit"] == "user" and report.to_dict()["population"] == 40
    assert PrivacyReport.from_state(ledger.state_dict() | {"method": "DPSGD"}).unit == "user"  # as a checkpoint says
    example = _ledger(PoissonBatchSampler(281, 0.25, seed=1))
    assert example.delta == 1 / 281 and "-DP per example, add/remove-one adjacency;" in str(
        example.report("DPSGD", secure_rng=False, noise_seeded=False)
    )
    with pytest.warns(UserWarning, match="for the n=40 users of the private set: a mechanism that publishes one"):
        _ledger(UserPoissonBatchSampler(index, 0.25, seed=1), delta=0.1)


def test_a_run_that_released_example_level_steps_refuses_a_user_level_sampler():
    index = UserIndex(_skewed_users())
    ledger = _ledger(PoissonBatchSampler(281, 0.25, seed=1))
    ledger.open_journal(None, None, lambda obj: obj)
    ledger.plan(10, None, False, 10)
    ledger.record(SubsampledGaussian(ledger.noise_multiplier, ledger.sample_rate, 1.0, ledger.expected_batch_size))
    restored = PrivacyLedger(ledger.spec, "pld")
    restored.load_state_dict(ledger.state_dict())  # a resume, or another fit of the same module
    with pytest.raises(PrivacyConfigError, match="released 1 private steps at example-level privacy"):
        restored.observe_sampler(UserPoissonBatchSampler(index, 0.25, seed=1), noise_seeded=False)


@pytest.mark.parametrize(
    "missing",
    [None, float("nan"), np.float32("nan"), "", "  ", pd.NA, pd.NaT, np.datetime64("NaT"), "nan", "None", "<NA>"]
    + [b"", b"None", decimal.Decimal("NaN"), complex("nan"), pa.array([None], pa.int64())[0], ("org", None)],
    ids=repr,
)
def test_an_example_that_names_no_user_is_refused(missing):
    """Found by reviews: None, "" and NaN pooled into one user (NaN objects, unequal to themselves, into one user
    each) — a person among them was protected as neither; so did pandas' NA and NaT (a nullable column's empty cell:
    2·C moved) and a missing id written out as text ("nan", "None", "<NA>"). Refused, with a count and no id."""
    with pytest.raises(DataError, match=r"1 private example\(s\) name no user"):
        UserIndex([missing] if not isinstance(missing, str) else ["ann", missing, "bob"])


def test_user_ids_are_compared_by_value():
    """A column of ids read as tensors (a datasets.Dataset in torch format) holds 0-d tensors, which hash by identity:
    each example was a user of its own (a user of 20 examples moved the release by 20·C; review). Tensors and NumPy
    values are compared by their value; ids compared by identity, ids of two types ('7' and 7) and a mapping are
    refused."""
    expected = [3, 2, 1]
    ids = [5, 4, 5, 9, 4, 5]
    for given in (torch.tensor(ids), list(torch.tensor(ids)), np.array(ids), [np.int64(i) for i in ids]):
        assert UserIndex.of(given, 6).counts.tolist() == expected
    assert UserIndex.of(lambda i: torch.tensor(ids[i]), 6).counts.tolist() == expected
    Author = collections.namedtuple("Author", "org uid")
    composite = [  # (organisation, user) ids, as tuples, namedtuples, frozensets and Arrow scalars
        [(torch.tensor(1), torch.tensor(i)) for i in ids],
        [Author("org", torch.tensor(i)) for i in ids],
        [frozenset({torch.tensor(i)}) for i in ids],
        list(pa.array(ids)),
    ]
    for given in composite:
        assert UserIndex(given).counts.tolist() == expected
    with pytest.raises(ConfigError, match="one value, got a Tensor of shape"):
        UserIndex([torch.tensor([1, 2]), torch.tensor([3, 4])])
    with pytest.raises(ConfigError, match="not a mapping"):
        UserIndex.of(dict(enumerate(ids)), 6)

    class Person:
        pass

    with pytest.raises(ConfigError, match=r"of type \['Person'\] are told apart by object identity"):
        UserIndex([Person() for _ in ids])
    with pytest.raises(ConfigError, match=r"of type \['Person'\] are told apart by object identity"):
        UserIndex([("org", Person()) for _ in ids])
    with pytest.raises(ConfigError, match="mix strings and numbers"):
        UserIndex(["7", 7, "8"])


def test_one_user_is_refused_and_few_users_warn_about_the_default_delta():
    with pytest.raises(PrivacyConfigError, match="holds one user"):
        PrivacySpec(epsilon=2.0).resolve_delta(1, "user")
    with pytest.warns(UserWarning, match=r"only 20 users: the default delta = 1/U = 0.05"):
        assert PrivacySpec(epsilon=2.0).resolve_delta(20, "user") == 0.05
    assert PrivacySpec(epsilon=2.0, delta=1e-6).resolve_delta(20, "user") == 1e-6  # a delta given: no warning
