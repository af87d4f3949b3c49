"""Poisson sampling of the private set: the sampling the accountants assume.

Each step includes every example independently with probability q = batch_size / n, so batches
have variable size and may be empty; sums are normalized by the expected size q·n. Batch i is a
pure function of (seed, i) — counter-based like the direction engine — so the sampler's whole
state is its position, which the method saves and restores with its checkpoint. A batch costs time
and memory in proportion to its expected size, not to n (``benchmarks/sampler.py``).

The sampling seed is a secret of the run (docs/privacy-model.md): amplification by subsampling holds only
against an adversary who does not know which steps included an example. It is drawn from OS
entropy unless the user passes one (for tests and reproduction: such a run's ε is no guarantee
against whoever knows the seed), and it is never saved: a resumed run draws a fresh one, which
leaves the distribution of the remaining batches unchanged because Poisson batches are independent.
Pickles and deep copies of a sampler leave the seed out too; the copy draws its own.

Under data parallelism every rank draws the same global Bernoulli mask and keeps the indices
of its own shard (``index % num_replicas == rank``), so the union over ranks is exactly Poisson
sampling of the whole private set at rate q.

User-level privacy (:mod:`pl_dp.privacy.units`) samples users instead: :class:`UserPoissonBatchSampler` includes each
user independently at rate q and takes one example of each sampled user, so one user is at most one row of a batch.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset
from torch.utils.data._utils.collate import default_collate

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.privacy.seeding import CopiesDrawTheirOwnSecret, derive_seed, entropy_seed, secret_cpu_generator
from pl_dp.privacy.units import PrivacyUnit, UserIndex
from pl_dp.step.batches import example_structure, stacks_tensor_rows
from pl_dp.step.seal import sealed


class CountingBatchSampler(Sampler[list[int]]):
    """A batch sampler whose batch i is a pure function of (seed, i): its saved state is its position.

    Subclasses define :meth:`batch` and ``steps_per_epoch``. Iteration yields the batches up to the
    end of the current epoch, so a resumed run continues mid-epoch where it stopped.
    """

    num_samples: int
    steps_per_epoch: int
    seed: int
    position: int

    def batch(self, index: int) -> list[int]:
        raise NotImplementedError

    @property
    def unit(self) -> PrivacyUnit:
        """Whom the guarantee protects and how many there are: one example of ``num_samples``."""
        return PrivacyUnit("example", self.num_samples)

    #: where the next iteration begins, when a module trains this sampler's batches (:meth:`restart_at`): the first
    #: position no step trained; None: where the last iteration stopped drawing
    _restart: int | None = None
    #: the positions the current iteration drew that no step took yet (:meth:`take`), oldest first
    _drawn: deque[int] | None = None

    def __iter__(self) -> Iterator[list[int]]:
        if self._restart is not None:
            # batches drawn but never trained (a loader's prefetch cut off at an epoch's end, a skipped rest of epoch)
            # are drawn again: batch i is a function of (seed, i), so it is the same batch, never trained twice
            self.position = self._restart
        end = (self.position // self.steps_per_epoch + 1) * self.steps_per_epoch
        drawn = self._drawn = deque()  # this iteration's own: an abandoned one's draws are not taken
        while self.position < end:
            index = self.position
            self.position += 1
            drawn.append(index)
            yield self.batch(index)

    def restart_at(self, position: int) -> None:
        """Begin every later iteration at ``position`` (the first one no step trained), not where the last stopped
        drawing: a DataLoader draws ahead of training (its workers' prefetch) and drops what an epoch cut short did
        not train, and the positions a fit trains must follow each other (cyclic sampling's group of step t is
        t mod b; a partition's blocks)."""
        self._restart = int(position)

    def take(self) -> int | None:
        """The position of the oldest batch the current iteration drew that no step took yet (None: none): a
        DataLoader hands batches on in the order its batch sampler yields them."""
        drawn = self._drawn
        return drawn.popleft() if drawn else None

    def first_untaken(self) -> int:
        """Where training continues: the oldest position drawn and not taken, else where the next iteration begins."""
        drawn = self._drawn
        if drawn:
            return drawn[0]
        return self._restart if self._restart is not None else self.position

    def forget_draws(self) -> None:
        """Drop what the current iteration drew and no step took (a fit ends; the next one draws anew)."""
        self._drawn = None

    @property
    def drawing(self) -> bool:
        """Whether the current iteration drew batches no step took yet (a loader's workers draw ahead)."""
        return bool(self._drawn)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self._restart, self._drawn = None, None


class PoissonBatchSampler(CopiesDrawTheirOwnSecret, CountingBatchSampler):
    """Yields Poisson-sampled index lists: each example independently with probability ``sample_rate``.

    ``seed=None`` (default) draws the sampling seed from OS entropy; an integer makes the batches
    reproducible and known to whoever knows it (``seeded`` is then True).
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if num_samples < 1:
            raise ConfigError("the private dataset is empty: Poisson sampling needs at least one example.")
        if not 0 < sample_rate <= 1:
            raise PrivacyConfigError(f"sample_rate must lie in (0, 1], got {sample_rate}.")
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"rank {rank} is outside [0, {num_replicas}).")
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = int(steps_per_epoch) if steps_per_epoch else max(1, round(1.0 / sample_rate))
        self.seeded = seed is not None
        self.seed = int(seed) if seed is not None else entropy_seed()
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.position = 0  # index of the next batch to draw
        self._fits = 0  # fits that sampled from it (begin_fit)

    secret = "seed"  # left out of pickles and deep copies, which draw their own (CopiesDrawTheirOwnSecret)
    #: the participation schema: 1, every example may join every step (:class:`CyclicPoissonBatchSampler`: b groups)
    bands = 1

    def _draw_secret(self) -> int:
        return entropy_seed()

    def begin_fit(self) -> None:
        """A fit starts sampling from this sampler. The first fit keeps the seed drawn at construction; a later one (a
        loader the user built and passes to several fits: a retry from an older checkpoint) draws a fresh seed
        (:meth:`~pl_dp.privacy.seeding.CopiesDrawTheirOwnSecret.redraw_secret`), so it never samples again the batches
        an earlier fit released — unless the loader's workers already drew batches under the old seed (they draw
        ahead before a module hears of the fit): a seed changed then would mix two group assignments of cyclic
        sampling, and the batches drawn are an earlier fit's, so that is refused."""
        if self._fits and not self.seeded:
            if self.drawing:
                raise PrivacyConfigError(
                    "this private loader was used by an earlier fit, and its workers already drew batches for this "
                    "one with that fit's secret sampling seed (a retry would sample the batches it released again): "
                    "build a new loader for each fit (pl_dp.data.PrivatePublicDataModule does), or use num_workers=0."
                )
            self.redraw_secret()
        self._fits += 1

    @property
    def expected_batch_size(self) -> float:
        """q·n: the global expected batch size every rank normalizes by."""
        return self.sample_rate * self.num_samples

    def batch(self, index: int) -> list[int]:
        """The indices of batch ``index`` (this rank's share), in increasing order.

        Drawn in O(expected batch size), not O(n): the batch's size K ~ Binomial(n, q), then K distinct indices
        uniformly at random (NumPy's ``Generator.binomial`` and ``Generator.choice(replace=False)``, which draws
        a small sample from a large population by Floyd's algorithm). That is exactly the law of including each
        example independently with probability q: given its size, a Poisson sample is a uniform subset. The
        arithmetic is float64 (a float32 uniform compared with q would include each example with probability
        ⌈q·2²⁴⌉/2²⁴: +19 % at q = 1e-7). Every rank draws the same global batch and keeps its shard.
        """
        rng = np.random.Generator(np.random.PCG64(derive_seed(self.seed, index)))
        size = rng.binomial(self.num_samples, self.sample_rate)
        sampled = self.eligible(rng.choice(self.num_samples, size=size, replace=False), index)
        idx = np.sort(self.examples_of(sampled, rng))
        if self.num_replicas > 1:
            idx = idx[idx % self.num_replicas == self.rank]
        return idx.tolist()

    def eligible(self, sampled: np.ndarray, index: int) -> np.ndarray:
        """The ``sampled`` units that may join batch ``index``: all of them (every unit, every step)."""
        return sampled

    def examples_of(self, sampled: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The examples the ``sampled`` units put in the batch: themselves (the unit is the example)."""
        return sampled


_GROUP_DOMAIN = 0x67726F757073  # "groups": the counter of the group assignment in the sampling seed's chain
_SPLITMIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


class CyclicPoissonBatchSampler(PoissonBatchSampler):
    """Cyclic Poisson sampling: the participation schema of banded matrix factorization with amplification.

    Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu (NeurIPS 2023, "Amplified banded matrix
    factorization", arXiv 2306.08153, Theorem 5): each example belongs to one of ``bands`` groups, and batch t
    includes each member of group t mod b independently with probability ``sample_rate`` (q) — so any two
    participations of one example are at least b steps apart (b-min-separation), which is what lets a b-banded
    strategy's release be accounted as ⌈T/b⌉ subsampled Gaussian steps at rate q
    (:mod:`pl_dp.privacy.correlated`).

    **Groups.** Each example's group is drawn independently and uniformly, as a function of (sampling seed, index)
    alone (SplitMix64 of the seed's group key and the index, mod b) — jax_privacy's ``INDEPENDENT`` partition, the one
    that holds under add/remove adjacency: the other examples' groups are i.i.d. uniform whether or not one example
    is added, so the two data sets stay neighbours group by group (an equal split, or i mod b, would change the groups'
    sizes or shift the later examples' groups). That rests on the seed being secret, as the Poisson sample does. The
    groups are never stored and change with the seed (a resumed run, a copy, every fit draw new ones; the ledger
    accounts each fit as a banded mechanism of its own, so no participation schedule crosses a fit).

    **Cost.** Batch t is drawn as a Poisson sample of all n examples at rate q (``Generator.binomial`` and
    ``choice(replace=False)``, as :class:`PoissonBatchSampler`), of which the members of group t mod b are kept: each
    member joins with probability q, independently — exactly the schema — and a step costs O(q·n) = O(b · expected
    batch size), not O(n). The expected batch size is q·n/b: for the expected batch size b′ of a DP-SGD run, take
    q = b·b′/n (what :class:`~pl_dp.data.PrivatePublicDataModule` does for ``batch_size=b′``); an epoch is still
    n/b′ steps.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        bands: int,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(num_samples, sample_rate, steps_per_epoch, seed, num_replicas, rank)
        if isinstance(bands, bool) or int(bands) != bands or bands < 1:
            raise ConfigError(f"bands must be an integer >= 1, got {bands!r}.")
        self.bands = int(bands)

    @property
    def expected_batch_size(self) -> float:
        """q·n/b: one group of n/b examples in expectation, sampled at rate q."""
        return self.sample_rate * self.num_samples / self.bands

    def group_of(self, indices: np.ndarray) -> np.ndarray:
        """The group (in [0, b)) of each example in ``indices``: a function of (sampling seed, index) alone."""
        x = np.asarray(indices, dtype=np.uint64) ^ np.uint64(derive_seed(self.seed, _GROUP_DOMAIN))
        x = x + _SPLITMIX[0]
        x = (x ^ (x >> np.uint64(30))) * _SPLITMIX[1]
        x = (x ^ (x >> np.uint64(27))) * _SPLITMIX[2]
        return ((x ^ (x >> np.uint64(31))) % np.uint64(self.bands)).astype(np.int64)

    def eligible(self, sampled: np.ndarray, index: int) -> np.ndarray:
        """The ``sampled`` examples of group ``index`` mod b."""
        return sampled[self.group_of(sampled) == index % self.bands]


class UserPoissonBatchSampler(PoissonBatchSampler):
    """Poisson sampling over users, one example per sampled user: the sampling of user-level privacy.

    Each of the U users joins a batch independently with probability ``sample_rate`` (q = users per batch / U), and
    each sampled user contributes one of their examples, uniform among them and drawn from the same secret
    randomness as the users (batch i stays a pure function of (seed, i); never torch's global RNG). This is
    dp-transformers' ``AuthorIndexedDataset`` under Poisson sampling, and Charles et al. (2024)'s user-level
    sampling with one example per user: two private sets that differ in all of one user's examples give batches that
    differ in at most one row, so a method's per-row bound C and the subsampled-Gaussian accountant at rate q hold
    for the user (:mod:`pl_dp.privacy.units`). ``num_samples`` is U (the population sampled); the expected batch is
    q·U rows. Under data parallelism each rank keeps the chosen examples of its shard, so a user sampled once
    globally is in one rank's share.
    """

    def __init__(
        self,
        users: UserIndex,
        sample_rate: float,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(users.num_users, sample_rate, steps_per_epoch, seed, num_replicas, rank)
        self.users = users

    @property
    def unit(self) -> PrivacyUnit:
        """One user (all of their examples) of ``num_samples`` users."""
        return self.users.unit

    def examples_of(self, sampled: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One example of each sampled user (:meth:`~pl_dp.privacy.units.UserIndex.one_example_each`)."""
        return self.users.one_example_each(sampled, rng)


class PartitionBatchSampler(CountingBatchSampler):
    """Disjoint fixed-size batches: each example is used in exactly one step per pass (O2NC).

    Zhang, Tran & Cutkosky (2024), Algorithm 4: a seeded, data-independent permutation of the private
    set is cut into K blocks of ``first_batch_size + batch_size·(block_steps − 1)`` examples
    (B₁ + B₂(T − 1)); block k yields one batch of B₁ then T − 1 batches of B₂. The remainder (fewer
    than one block) is never used. A new pass re-permutes with a new seed. There is no sampling
    amplification (``sample_rate`` is 1): the accountant for this sampler is
    :class:`~pl_dp.privacy.tree.TreeAccountant`. Because the analysis never relies on the
    permutation being hidden, the ``seed`` is not a secret: it may be saved with a checkpoint, and
    :attr:`layout` (with the seed) is what a resume must find unchanged.
    """

    sample_rate = 1.0

    def __init__(self, num_samples: int, first_batch_size: int, batch_size: int, block_steps: int, seed: int = 0):
        for name, value in [
            ("first_batch_size", first_batch_size),
            ("batch_size", batch_size),
            ("block_steps", block_steps),
        ]:
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}.")
        self.num_samples = int(num_samples)
        self.first_batch_size, self.batch_size, self.block_steps = (
            int(first_batch_size),
            int(batch_size),
            int(block_steps),
        )
        self.block_size = self.first_batch_size + self.batch_size * (self.block_steps - 1)
        self.blocks = self.num_samples // self.block_size
        if self.blocks < 1:
            raise ConfigError(
                f"{self.num_samples} private examples are too few for one block of B1 + B2*(T-1) = "
                f"{self.first_batch_size} + {self.batch_size}*({self.block_steps}-1) = {self.block_size}: "
                "lower the batch sizes or the inner steps T."
            )
        self.steps_per_epoch = self.blocks * self.block_steps
        self.seed = int(seed)
        self.position = 0

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    @property
    def layout(self) -> dict[str, int]:
        """What fixes the blocks of every pass: n, B₁, B₂, T and the seed."""
        return {
            "num_samples": self.num_samples,
            "first_batch_size": self.first_batch_size,
            "batch_size": self.batch_size,
            "block_steps": self.block_steps,
            "seed": self.seed,
        }

    @property
    def name(self) -> str:
        """The partition's name for the tree accountant's ledger: equal names mean equal blocks in every pass."""
        return " ".join(f"{key}={value}" for key, value in self.layout.items())

    def locate(self, index: int) -> tuple[int, int, int]:
        """(pass, block k, step t in the block, 0-based) of batch ``index``."""
        passes, within = divmod(index, self.steps_per_epoch)
        block, step = divmod(within, self.block_steps)
        return passes, block, step

    def batch(self, index: int) -> list[int]:
        passes, block, step = self.locate(index)
        order = torch.randperm(
            self.num_samples, generator=torch.Generator().manual_seed(derive_seed(self.seed, passes))
        )
        start = block * self.block_size + (0 if step == 0 else self.first_batch_size + (step - 1) * self.batch_size)
        size = self.first_batch_size if step == 0 else self.batch_size
        return order[start : start + size].tolist()


class _Unreadable:
    """Marks a sampled example whose reading raised (:class:`SealedReads`); the collate leaves it out."""

    def __repr__(self) -> str:
        return "UNREADABLE"


UNREADABLE = _Unreadable()


class Rows:
    """The sampled rows of a plain ``TensorDataset``'s tensors, read at once (:class:`SealedReads` with
    ``columns``): what stacking the examples one by one gives, in one indexing per tensor."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors


class SealedReads(Dataset):
    """The private dataset as pl_dp's private loaders read it: sampled examples are read inside
    :func:`~pl_dp.step.seal.sealed` (a warning a record's reading raises is not shown), and one whose reading
    raises is replaced by :data:`UNREADABLE`, which :class:`EmptySafeCollate` leaves out of its batch — a record
    that fails to load (a truncated file, a random crop that does not fit) contributes nothing to that step
    instead of ending the run at the step that sampled it. ``dataset[i]`` reads directly (it raises). A dataset
    whose ``__getitems__`` returns something other than a list of examples (a dict of columns) is passed through
    as it returns it. With ``columns`` (a plain ``TensorDataset`` whose collate stacks its rows:
    :attr:`EmptySafeCollate.stacks_rows`) the sampled rows of each tensor are read at once (:class:`Rows`): a
    ``TensorDataset``'s rows cannot fail to read."""

    def __init__(self, dataset: Dataset, *, columns: bool = False) -> None:
        self.dataset = dataset
        self.columns = columns

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Any:
        if self.columns:
            rows = torch.as_tensor(indices, dtype=torch.long)
            # contiguous, as torch.stack makes them (a channels-last tensor's rows keep its strides)
            return Rows(tuple(tensor[rows].contiguous() for tensor in self.dataset.tensors))  # type: ignore[attr-defined]
        with sealed():
            getitems = getattr(self.dataset, "__getitems__", None)
            if getitems is not None:
                try:
                    return getitems(indices)
                except Exception:  # noqa: BLE001 - read one by one below
                    pass
            return [self._read(index) for index in indices]

    def _read(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception:  # noqa: BLE001 - this example sits the step out
            return UNREADABLE


class EmptySafeCollate:
    """The collate of pl_dp's private loaders: an empty Poisson batch becomes zero-length tensors of the right
    shapes, and what a record does to its batch depends on that record alone.

    Examples that could not be read (:class:`SealedReads`) are left out, and — once the private set's structure is
    known (:meth:`expect`, at fit start: the structure the pre-flight pass found in every example) — so is every
    example of another :func:`~pl_dp.step.batches.example_structure` (an extra key, an int64 array among float32
    ones), always, whatever else was sampled: both are rules about each example alone, so leaving it out changes
    no other example's part, and it contributes 0 (the bound holds). The user's ``collate_fn`` then runs inside
    :func:`~pl_dp.step.seal.sealed`; a failure left after that (a collate that fails on the values of examples
    of one structure) still raises. ``dropped`` counts the examples left out in this process: un-noised private
    information, kept in memory only. The pre-flight pass reports such examples before training.
    """

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list], Any] = default_collate) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.dropped = 0
        self.structure: Any = None
        self._empty: Any = None
        # a plain TensorDataset's examples are rows of the same tensors: one structure by construction
        self._one_structure = type(dataset) is TensorDataset
        #: whether the batch of a plain TensorDataset's examples is its tensors' rows stacked, so that
        #: :class:`SealedReads` may read them at once (:func:`~pl_dp.step.batches.stacks_tensor_rows`)
        self.stacks_rows = stacks_tensor_rows(dataset, collate_fn)

    def expect(self, example: Any) -> None:
        """From now on only examples of ``example``'s structure are batched, and an empty batch is ``example``'s
        batch sliced to 0 (built now, not at the step that samples nothing). A plain ``TensorDataset``'s examples
        all have one structure (rows of the same tensors), so the per-example comparison is skipped there: it could
        leave nothing out."""
        self.structure = example_structure(example)
        self._empty = _slice_empty(self.collate_fn([example]))

    def __call__(self, items: Any) -> Any:
        if isinstance(items, Rows):  # default_collate's batch of tuple examples: a list
            return list(items.tensors)
        if not isinstance(items, list):  # a dataset's own batch (its __getitems__ returned columns)
            with sealed():
                return self.collate_fn(items)
        kept = [item for item in items if item is not UNREADABLE]
        if self.structure is not None and not self._one_structure:
            kept = [item for item in kept if example_structure(item) == self.structure]
        self.dropped += len(items) - len(kept)
        with sealed():
            if kept:
                return self.collate_fn(kept)
            if self._empty is None:
                self._empty = _slice_empty(self.collate_fn([self.dataset[0]]))
            return self._empty


def private_data_of(loader: Any) -> tuple[Any, Callable[[list], Any]]:
    """The dataset and the user's ``collate_fn`` behind a private loader, without pl_dp's sealing wrappers (the
    fit-start checks read examples directly and want their errors)."""
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None) or default_collate
    if isinstance(dataset, SealedReads):
        dataset = dataset.dataset
    if isinstance(collate, EmptySafeCollate):
        collate = collate.collate_fn
    return dataset, collate


def _slice_empty(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[:0]
    if isinstance(obj, dict):
        return {k: _slice_empty(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_slice_empty(v) for v in obj)
    return obj


def poisson_loader(
    dataset: Dataset,
    sample_rate: float,
    seed: int | None = None,
    steps_per_epoch: int | None = None,
    num_replicas: int = 1,
    rank: int = 0,
    collate_fn: Callable[[list], Any] = default_collate,
    users: UserIndex | None = None,
    bands: int = 1,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader over ``dataset`` with Poisson sampling at ``sample_rate`` (empty batches allowed).

    With ``users`` (each example's user, :class:`~pl_dp.privacy.units.UserIndex`) it samples users at
    ``sample_rate`` and one example of each sampled user (:class:`UserPoissonBatchSampler`): user-level privacy.
    With ``bands`` > 1 it samples cyclically (:class:`CyclicPoissonBatchSampler`: batch t samples group t mod b at
    ``sample_rate``), the schema of banded matrix factorization (``DPSGD(noise="banded", bands=b)``).

    ``seed`` is the secret sampling seed: leave it ``None`` (OS entropy) unless reproducing a run. Examples are
    read and batched sealed (:class:`SealedReads`, :class:`EmptySafeCollate`): an example that fails to load or to
    batch sits its step out instead of ending the run, and nothing the reading or the collate says is shown.

    With ``num_replicas > 1`` each rank gets its shard of the global Poisson batch. The loader's ``sampler`` is a
    :class:`ShardMarker`: frameworks that inject a ``DistributedSampler`` (Lightning's ``use_distributed_sampler``,
    under any distributed strategy, one process included) see the loader as already distributed and leave it
    alone instead of failing on, or replacing, the Poisson batch sampler.
    """
    if users is not None and users.num_examples != len(dataset):
        raise ConfigError(
            f"the user index names the users of {users.num_examples} examples, but the dataset has {len(dataset)}."
        )
    sampler: PoissonBatchSampler
    if users is not None:
        if bands != 1:
            raise ConfigError(
                "cyclic Poisson sampling (bands > 1, for banded correlated noise) samples examples: user-level "
                "privacy (user_of) is not supported with it. Use noise='independent', or drop user_of."
            )
        sampler = UserPoissonBatchSampler(users, sample_rate, steps_per_epoch, seed, num_replicas, rank)
    elif bands != 1:
        sampler = CyclicPoissonBatchSampler(len(dataset), sample_rate, bands, steps_per_epoch, seed, num_replicas, rank)
    else:
        sampler = PoissonBatchSampler(len(dataset), sample_rate, steps_per_epoch, seed, num_replicas, rank)
    collate = EmptySafeCollate(dataset, collate_fn)
    reads = SealedReads(dataset, columns=collate.stacks_rows)
    loader = DataLoader(reads, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)
    # DataLoader forbids setting ``sampler`` next to ``batch_sampler``; it never iterates it
    object.__setattr__(loader, "sampler", ShardMarker(dataset, num_replicas, rank))
    return loader


class ShardMarker(DistributedSampler):
    """The ``sampler`` of a sharded Poisson loader: marks it as distributed; iteration uses the batch sampler."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)


def partition_loader(
    dataset: Dataset,
    first_batch_size: int,
    batch_size: int,
    block_steps: int,
    seed: int = 0,
    collate_fn: Callable[[list], Any] = default_collate,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader over a :class:`PartitionBatchSampler` (each example in one step per pass)."""
    sampler = PartitionBatchSampler(len(dataset), first_batch_size, batch_size, block_steps, seed)
    collate = EmptySafeCollate(dataset, collate_fn)
    return DataLoader(SealedReads(dataset), batch_sampler=sampler, collate_fn=collate, **loader_kwargs)


#: the attribute that marks an Opacus sampler's generator as pl_dp's own (drawn from OS entropy, redrawn every fit)
_INSTALLED = "_pl_dp_secret_generator"


class OpacusPoissonSampling:
    """Opacus' ``UniformWithReplacementSampler`` (behind its ``DPDataLoader``) read as Poisson sampling.

    It includes each example independently with probability ``sample_rate``, as the accountants
    assume. Its randomness must be secret too: a sampler without a generator draws from torch's
    global RNG, which ``seed_everything`` makes public, so it gets a generator seeded from OS
    entropy here, drawn again at every fit. A user-supplied generator is kept and counted as user-seeded (secret only
    if its seed is). It has no position to checkpoint: Poisson batches are independent, so a resumed epoch
    that draws new ones leaves the distribution unchanged.
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.sample_rate = float(sampler.sample_rate)
        self.num_samples = int(sampler.num_samples)
        # a generator pl_dp installed (an earlier fit's) is not the user's: it is replaced, and the run is not seeded
        installed = getattr(sampler, _INSTALLED, False)
        self.seeded = sampler.generator is not None and not installed
        if not self.seeded:
            sampler.generator = secret_cpu_generator(secrets.token_bytes(32))  # a CPU seed keeps 32 bits only
            setattr(sampler, _INSTALLED, True)

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.num_samples

    @property
    def unit(self) -> PrivacyUnit:
        """One example of ``num_samples``: Opacus' sampler samples examples."""
        return PrivacyUnit("example", self.num_samples)


def poisson_sampler_of(loader: Any) -> PoissonBatchSampler | OpacusPoissonSampling:
    """The Poisson sampler behind a private loader, or a clear error: the accountant must match the sampler.

    Accepts pl_dp's :class:`PoissonBatchSampler` and Opacus' ``UniformWithReplacementSampler``
    (``opacus.data_loader.DPDataLoader``), which it wraps in :class:`OpacusPoissonSampling`.
    """
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, PoissonBatchSampler):
        return sampler
    if type(sampler) is UniformWithReplacementSampler:  # not the distributed variant: it shuffles and shards
        return OpacusPoissonSampling(sampler)
    found = type(sampler).__name__ if sampler is not None else type(loader).__name__
    if found == "BatchSampler":
        inner = getattr(sampler, "sampler", None)
        found = f"BatchSampler over {type(inner).__name__} (fixed-size batches, shuffled or in order)"
    raise PrivacyConfigError(
        "the private training loader must Poisson-sample: the accountant assumes each example joins each "
        "batch independently with probability b/n. Use pl_dp.data.PrivatePublicDataModule, "
        "pl_dp.privacy.poisson_loader, or Opacus' DPDataLoader. Got a loader with " + found + ": fixed-size "
        "batches would make the reported epsilon wrong."
    )
