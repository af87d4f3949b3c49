"""PrivatePublicDataModule: a Poisson-sampled private loader plus an endless public loader."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import collect_init_args
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from pl_dp.data.collate import PaddingCollate
from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.nets.hf import model_positions, padded_positions
from pl_dp.privacy.sampling import CountingBatchSampler, poisson_loader
from pl_dp.privacy.units import PrivacyUnit, UserIndex, UserOf

_SCALARS = (str, Path, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    """Whether ``value`` is a hyperparameter a checkpoint may hold: a scalar, or a flat list or tuple of them."""
    if isinstance(value, (list, tuple)):
        return all(isinstance(item, _SCALARS) for item in value)
    return isinstance(value, _SCALARS)


def pin_memory_for(device: torch.device) -> bool:
    """Whether loaders feeding ``device`` pin their batches: on CUDA only, where a batch in page-locked memory is
    copied while the host goes on (Lightning moves batches with ``non_blocking=True`` there). Elsewhere pinning is a
    wasted copy (and torch warns about it without an accelerator). Pinning changes where a batch is held, never which
    records it holds: no privacy effect."""
    return device.type == "cuda"


class PrivatePublicDataModule(L.LightningDataModule):
    """Datasets in, DP-correct loaders out.

    * ``train_dataloader`` Poisson-samples ``private`` at rate ``batch_size / len(private)``
      (variable, possibly empty batches; one epoch = ``len(private) // batch_size`` steps, at
      least 1) — the only sampling the accountant's numbers hold for — unless the method
      declares its own (``private_loader``; O2NC partitions the data and ignores ``batch_size``).
      A method with banded correlated noise (``bands`` b > 1) gets cyclic Poisson sampling over b groups at rate
      b·``batch_size`` / n within the step's group: the same expected batch size and epoch length.
      Under data parallelism each rank gets its shard of the same global Poisson batch.
      With ``user_of`` it samples users instead (user-level privacy, :mod:`pl_dp.privacy.units`).
    * ``public_batches(k)`` draws k disjoint public batches per call, without end; public
      batches never consume privacy.
    * ``val``/``test``/``predict`` are ordinary loaders; ``predict`` defaults to the test set, and
      examples may be (x, y) or x alone.

    Args:
        private: the private training set.
        public: optional public set (PAZO, Coupling).
        val, test: optional evaluation sets.
        predict: optional set for ``trainer.predict`` (``None``: the test set).
        batch_size: expected private batch size b (sample rate b/n).
        public_batch_size: public batch size b′ (defaults to ``batch_size``).
        seed: seed of the public shuffling. Public: it decides nothing about private data.
        sampling_seed: seed of the private Poisson sampling — a secret of the run. ``None`` (default)
            draws it from OS entropy at every fit and never saves it. Pass one only for tests and
            reproduction: then which steps include each example is known to whoever knows the seed,
            amplification by subsampling no longer protects against them, and the run's privacy
            report says so.
        eval_batch_size: batch size of the evaluation loaders.
        merge_public: treat the public examples as private too (the "FullPriv" and "NonPriv"
            baselines of the Coupling paper): ``private ∪ public`` is Poisson-sampled and there is
            no public set.
        collate_fn: how examples become a batch, for every loader; ``None`` uses
            :class:`~pl_dp.data.collate.PaddingCollate` (``default_collate``, padding variable-length
            1-D tensors such as tokenized text). Empty Poisson batches are handled either way.
        num_workers, pin_memory: as in ``torch.utils.data.DataLoader``, for every loader. Worker
            processes load examples only: the Poisson batches are drawn in the main process. ``pin_memory=None``
            (default) pins exactly when the trainer runs on a CUDA device (:func:`pin_memory_for`): batches then
            sit in page-locked host memory, which Lightning's ``non_blocking`` copy to the device can overlap; on a
            CPU run pinning would only cost a copy.
        fixed_length: pad every private batch to one length, whatever was sampled: ``True`` always, ``False`` never,
            ``None`` (default) when the method asks for it (its ``pads_to_one_length``): a run computing in half
            precision, where the rounding of every example's result depends on the batch's padded length, and every
            private zeroth-order step, which divides that rounding by 2λ. The length is the collate's own
            (``PaddingCollate(length=...)``), else one past the data module's ``max_length`` (the text data modules':
            every row then has padding, so every batch keeps its attention mask, see :meth:`fixed_length_collate`), and
            the collate must be a :class:`~pl_dp.data.collate.PaddingCollate`. Only the private loader pads so; the
            others pad to their longest example.
        user_of: each private example's user, for user-level privacy: a sequence of user ids (one per private
            example, in order; with ``merge_public``, one per example of ``private`` then ``public``) or a callable
            index → user id. The guarantee then protects one user — all of their examples — instead of one example:
            each step Poisson-samples users at rate q = ``batch_size`` / U (``batch_size`` is the expected number of
            users per batch, U the number of users) and takes one example of each sampled user, drawn at random with
            the secret sampling randomness; δ's default becomes 1/U and an epoch is U // ``batch_size`` steps. The
            user ids are private data: they are never saved with the hyperparameters. ``None`` (default):
            example-level privacy. Methods that sample the private set their own way (O2NC's partition) refuse it.

    Use :meth:`from_datamodule` to make an existing LightningDataModule private.
    """

    #: constructor arguments that hold examples (or what reads them): saved as hyperparameters only as a path
    data_arguments: tuple[str, ...] = ("private", "public", "val", "test")
    #: the most positions a sequence of an example can have, when the data module cuts them (the text modules'
    #: ``max_length``): a private batch under ``fixed_length`` is padded to one more
    max_length: int | None = None

    def __init__(
        self,
        private: Dataset,
        *,
        public: Dataset | None = None,
        val: Dataset | None = None,
        test: Dataset | None = None,
        batch_size: int = 64,
        public_batch_size: int | None = None,
        seed: int = 0,
        eval_batch_size: int = 512,
        merge_public: bool = False,
        sampling_seed: int | None = None,
        predict: Dataset | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        fixed_length: bool | None = None,
        user_of: UserOf | None = None,
    ) -> None:
        super().__init__()
        if merge_public and public is not None:
            private, public = ConcatDataset([private, public]), None
        self.private, self.public, self.val, self.test = private, public, val, test
        self.users = UserIndex.of(user_of, len(private)) if user_of is not None and private is not None else None
        self.predict = predict
        self.batch_size = batch_size
        self.public_batch_size = public_batch_size or batch_size
        self.seed = seed
        self.sampling_seed = sampling_seed
        self.eval_batch_size = eval_batch_size
        self.collate_fn = collate_fn if collate_fn is not None else PaddingCollate()
        self.fixed_length = fixed_length
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._public_generator = torch.Generator().manual_seed(seed + 1)
        if private is not None:
            self._validate()
        self._save_plain_hyperparameters()

    def _save_plain_hyperparameters(self) -> None:
        """Save the constructor arguments of this class and its subclasses that are plain values (numbers, strings,
        paths, flat lists of them) as hyperparameters, as given or defaulted. Datasets, texts, tokenizers, prompts
        and callables are left out: checkpoints and loggers save the hyperparameters, and private examples must
        never be among them."""
        frame = inspect.currentframe()
        arguments: dict[str, Any] = {}
        for level in collect_init_args(frame.f_back, []) if frame is not None and frame.f_back else []:
            arguments.update(level)
        # a flat list of strings is plain, but given for a data argument it is the texts themselves
        held = {name for name in self.data_arguments if not isinstance(arguments.get(name), (str, Path, type(None)))}
        held.add("user_of")  # each private example's user: private data in every form (a list of names is "plain")
        left_out = [name for name, value in arguments.items() if name in held or not _plain(value)]
        self.save_hyperparameters(ignore=left_out)

    @classmethod
    def from_datamodule(
        cls,
        datamodule: L.LightningDataModule,
        batch_size: int | None = None,
        public: Dataset | None = None,
        **kwargs: Any,
    ) -> PrivatePublicDataModule:
        """A private version of a user's LightningDataModule: its training set Poisson-sampled.

        Runs the module's ``prepare_data`` and ``setup`` and takes the datasets behind its loaders
        (train → private; val, test, predict when it has them), its training loader's ``collate_fn``,
        ``num_workers`` and ``pin_memory``, and its training batch size as the expected batch size
        (``batch_size`` overrides it). Its own sampling and shuffling are not used: the private set
        is Poisson-sampled.
        """
        datamodule.prepare_data()
        datamodule.setup("fit")
        train = datamodule.train_dataloader()
        found: dict[str, Any] = {}
        for stage in ("val", "test", "predict"):
            if not is_overridden(f"{stage}_dataloader", datamodule):
                continue
            if stage != "val":
                datamodule.setup(stage)
            loader = getattr(datamodule, f"{stage}_dataloader")()
            loader = loader[0] if isinstance(loader, (list, tuple)) and loader else loader
            if isinstance(loader, DataLoader):
                found[stage] = loader.dataset
        options = dict(
            collate_fn=train.collate_fn if train.collate_fn is not default_collate else None,
            num_workers=train.num_workers,
            pin_memory=train.pin_memory,
        )
        return cls(
            train.dataset, public=public, batch_size=batch_size or train.batch_size, **found, **(options | kwargs)
        )

    def _validate(self) -> None:
        n = len(self.private)
        if n < 1:
            raise ConfigError("the private dataset is empty.")
        if isinstance(self.batch_size, bool) or int(self.batch_size) != self.batch_size or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {self.batch_size!r}.")
        unit = self.privacy_unit
        if self.batch_size > unit.population:
            raise ConfigError(
                f"batch_size={self.batch_size} is larger than the private dataset ({unit.population} {unit.plural})"
                + (": under user-level privacy it is the expected number of users per batch." if self.users else ".")
            )
        if self.public is not None and len(self.public) < 1:
            raise ConfigError("the public dataset is empty: pass public=None or give it examples.")
        if self.public is not None and self.public_batch_size > len(self.public):
            raise ConfigError(
                f"public_batch_size={self.public_batch_size} is larger than the public dataset ({len(self.public)})."
            )

    @property
    def loader_kwargs(self) -> dict[str, Any]:
        """``num_workers`` and ``pin_memory`` of every loader, ``pin_memory=None`` resolved for the trainer's device
        (not pinned without a trainer)."""
        pin = self.pin_memory
        if pin is None:
            pin = self.trainer is not None and pin_memory_for(self.trainer.strategy.root_device)
        return {"num_workers": self.num_workers, "pin_memory": pin}

    @property
    def n_private(self) -> int:
        return len(self.private)

    @property
    def privacy_unit(self) -> PrivacyUnit:
        """Whom the private loader's sampling protects: one of the n examples, or with ``user_of`` one of the U
        users."""
        return self.users.unit if self.users is not None else PrivacyUnit("example", self.n_private)

    @property
    def sample_rate(self) -> float:
        """q = b / n (n examples), or b / U under user-level privacy (U users)."""
        return self.batch_size / self.privacy_unit.population

    def train_dataloader(self) -> DataLoader:
        module = self.trainer.lightning_module if self.trainer is not None else None
        loader = self._private_loader(module)
        # a resumed fit's loader starts at the checkpoint's position now: Lightning builds the first epoch's iterator
        # (and a loader's workers draw ahead) before the module restores it
        saved = module.resumed_sampler_state() if hasattr(module, "resumed_sampler_state") else None
        if saved is not None and isinstance(loader.batch_sampler, CountingBatchSampler):
            loader.batch_sampler.load_state_dict(saved)
        return loader

    def _private_loader(self, module: Any) -> DataLoader:
        one_length = bool(getattr(module, "pads_to_one_length", False))
        collate = self.private_collate(one_length, model_positions(getattr(module, "net", None)))
        own = module.private_loader(self.private, self.seed, collate) if hasattr(module, "private_loader") else None
        if own is not None:  # a method whose accounting needs other sampling (O2NC's partition)
            if self.users is not None:
                raise PrivacyConfigError(
                    f"{type(module).__name__} samples the private set its own way (O2NC: a disjoint partition of the "
                    "examples), which bounds no user's contribution: user-level privacy (user_of) needs Poisson "
                    "sampling over users. Use a Poisson-sampled method (DPZero, PAZO, DPSGD, Coupling), or drop "
                    "user_of for example-level privacy."
                )
            return own
        population = self.privacy_unit.population
        steps = max(1, population // self.batch_size)
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        bands = int(getattr(module, "bands", 1))  # banded noise: cyclic groups, batch_size still the expected size
        if bands * self.batch_size > population:
            raise ConfigError(
                f"{bands} cyclic groups of {population} examples hold {population / bands:.4g} each in expectation: "
                f"too few for an expected batch of {self.batch_size} (the rate within a group would be "
                f"{bands * self.batch_size / population:.3g} > 1). Lower batch_size or bands."
            )
        return poisson_loader(
            self.private,
            bands * self.batch_size / population if bands > 1 else self.sample_rate,
            seed=self.sampling_seed,
            steps_per_epoch=steps,
            num_replicas=world,
            rank=rank,
            collate_fn=collate,
            users=self.users,
            bands=bands,
            **self.loader_kwargs,
        )

    def private_collate(self, one_length: bool = False, positions: int | None = None) -> Callable[[list], Any]:
        """The private loader's ``collate_fn``: ``collate_fn``, padding to one length under ``fixed_length`` (or, with
        ``fixed_length=None``, when the method asks for ``one_length``). A collate that pads to one length already is
        used as it is; one that cannot (not a PaddingCollate, or no length known) is refused under
        ``fixed_length=True`` and left to the fit-start checks otherwise, which refuse it where it matters.
        ``positions``: the most positions the method's net reads (:func:`~pl_dp.nets.hf.model_positions`), if known
        (see :meth:`fixed_length_collate`)."""
        collate = self.collate_fn
        wanted = one_length if self.fixed_length is None else self.fixed_length
        if not wanted or (isinstance(collate, PaddingCollate) and collate.length is not None):
            return collate
        if (fixed := self.fixed_length_collate(positions)) is not None:
            return fixed
        if self.fixed_length:
            raise ConfigError(
                f"fixed_length=True needs a PaddingCollate that knows the length: got {type(collate).__name__}, and "
                "this data module cuts its sequences at no max_length. Pass collate_fn=PaddingCollate(length=...)."
            )
        return collate

    def longest_collate(
        self, collate: Callable[[list], Any] | None = None, net: nn.Module | None = None
    ) -> PaddingCollate | None:
        """``collate`` (the private loader's; ``collate_fn`` by default) padding every batch to ``max_length`` — the
        most positions a record may have, or the positions of ``net``'s table of absolute positions if fewer
        (:func:`~pl_dp.nets.hf.padded_positions`: GPT-2 and BERT read no longer batch, and a longer record fails in the
        pre-flight pass; OPT and Llama read longer ones, and are padded to ``max_length``) — when it pads each batch
        to its longest (a :class:`~pl_dp.data.collate.PaddingCollate` without a length) and the length is known, else
        None. The fit-start checks pad a batch with it to see how far a record as long as any may be moves the other
        examples' rounding, and what the net computes in at that length, when the private batches are padded
        dynamically."""
        collate = self.collate_fn if collate is None else collate
        if isinstance(collate, PaddingCollate) and collate.length is None and self.max_length is not None:
            return collate.fixed(min(self.max_length, padded_positions(net) or self.max_length))
        return None

    def fixed_length_collate(self, positions: int | None = None) -> PaddingCollate | None:
        """:meth:`longest_collate` one position longer: ``collate_fn`` padding every private batch of a run that keeps
        one shape to ``max_length`` + 1, or None. A ``max_length`` equal to the net's ``positions`` (if known), which
        the padding position would overflow, raises :class:`~pl_dp.errors.ConfigError` (a ``max_length`` beyond them
        is left alone: a net that places positions by its mask, as OPT, or by rotation, as Llama, reads a longer padded
        batch, and one that does not fails so without the extra position too).

        Privacy: the position past the longest record gives every row padding, so every batch an attention mask.
        Hugging Face drops the mask of a batch none of whose rows is padded, and a GPU then runs another attention
        kernel (FlashAttention takes no mask), which rounds every row's bf16 result otherwise: with texts exactly
        ``max_length`` long, one short record would decide the kernel of its whole micro-batch."""
        longest = self.longest_collate()
        if longest is None or self.max_length is None:
            return None
        if self.max_length == positions:
            raise ConfigError(
                f"max_length={self.max_length} leaves the model ({positions} positions) no position for the padding "
                "a private batch of one length keeps in every row (so that every batch has an attention mask and runs "
                f"one attention kernel): set max_length to {positions - 1} at most."
            )
        return longest.fixed(self.max_length + 1)

    def _loader(self, dataset: Dataset | None) -> DataLoader | list:
        if dataset is None:
            return []
        return DataLoader(dataset, batch_size=self.eval_batch_size, collate_fn=self.collate_fn, **self.loader_kwargs)

    def val_dataloader(self) -> DataLoader | list:
        return self._loader(self.val)

    def test_dataloader(self) -> DataLoader | list:
        return self._loader(self.test)

    def predict_dataloader(self) -> DataLoader | list:
        return self._loader(self.predict if self.predict is not None else self.test)

    def public_batches(self, k: int = 1) -> list[Any]:
        """``k`` disjoint public batches of ``public_batch_size``.

        Disjoint as in Gong & Li 2025's PAZO-S proof (App. B.4); the paper only says "sample k batches".

        Each call draws k·b′ distinct public examples without replacement and splits them; the
        generator's state is part of :meth:`state_dict`, so a resumed run sees the same batches.
        """
        need = self.check_public(k)
        order = torch.randperm(len(self.public), generator=self._public_generator)[:need].tolist()
        chunks = [order[c * self.public_batch_size : (c + 1) * self.public_batch_size] for c in range(k)]
        return [self.collate_fn([self.public[i] for i in chunk]) for chunk in chunks]

    def check_public(self, k: int = 1) -> int:
        """Raise a clear error unless ``k`` disjoint public batches can be drawn; returns k·b′."""
        if self.public is None:
            raise ConfigError("this method needs public data, but the datamodule has public=None.")
        need = k * self.public_batch_size
        if need > len(self.public):
            raise ConfigError(
                f"{k} disjoint public batches of {self.public_batch_size} need {need} public examples; "
                f"the public set has {len(self.public)}. Lower public_batch_size or k."
            )
        return need

    def state_dict(self) -> dict[str, Any]:
        return {"public_generator": self._public_generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "public_generator" in state_dict:
            self._public_generator.set_state(state_dict["public_generator"])


class SplitsDataModule(PrivatePublicDataModule):
    """A :class:`PrivatePublicDataModule` over fixed named splits that a subclass builds from its own arguments
    (the bundled datasets, :class:`~pl_dp.data.TextDataModule`).

    ``splits`` maps ``"private"``, ``"public"`` and optionally ``"val"`` and ``"test"`` to datasets: an empty
    public split means no public data, and b′ (``public_batch_size``) is capped at the public split's size.
    Every other argument is :class:`PrivatePublicDataModule`'s, by keyword.
    """

    def __init__(self, splits: Mapping[str, Dataset], *, public_batch_size: int = 64, **kwargs: Any) -> None:
        public = splits["public"]
        super().__init__(
            splits["private"],
            public=public if len(public) else None,
            val=splits.get("val"),
            test=splits.get("test"),
            public_batch_size=min(public_batch_size, max(len(public), 1)),
            **kwargs,
        )
