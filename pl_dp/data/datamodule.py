"""PrivatePublicDataModule: a Poisson-sampled private loader plus an endless public loader."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from pl_dp.privacy.sampling import poisson_loader


class PrivatePublicDataModule(L.LightningDataModule):
    """Datasets in, DP-correct loaders out.

    * ``train_dataloader`` Poisson-samples ``private`` at rate ``batch_size / len(private)``
      (variable, possibly empty batches; one epoch = ``len(private) // batch_size`` steps, at
      least 1) — the only sampling the accountant's numbers hold for — unless the method
      declares its own (``private_loader``; O2NC partitions the data and ignores ``batch_size``).
      Under data parallelism each rank gets its shard of the same global Poisson batch.
    * ``public_batches(k)`` draws k disjoint public batches per call, without end; public
      batches never consume privacy.
    * ``val``/``test`` are ordinary loaders.

    Args:
        private: the private training set.
        public: optional public set (PAZO, Coupling).
        val, test: optional evaluation sets.
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
    """

    def __init__(
        self,
        private: Dataset,
        public: Dataset | None = None,
        val: Dataset | None = None,
        test: Dataset | None = None,
        batch_size: int = 64,
        public_batch_size: int | None = None,
        seed: int = 0,
        eval_batch_size: int = 512,
        merge_public: bool = False,
        sampling_seed: int | None = None,
    ) -> None:
        super().__init__()
        if merge_public and public is not None:
            private, public = ConcatDataset([private, public]), None
        self.private, self.public, self.val, self.test = private, public, val, test
        self.batch_size = batch_size
        self.public_batch_size = public_batch_size or batch_size
        self.seed = seed
        self.sampling_seed = sampling_seed
        self.eval_batch_size = eval_batch_size
        self._public_generator = torch.Generator().manual_seed(seed + 1)
        if private is not None:
            self._validate()

    @classmethod
    def from_splits(cls, splits: dict[str, Dataset], public_batch_size: int, **kwargs: Any) -> dict[str, Any]:
        """Constructor arguments for fixed named splits (``private``, ``public``, ``val``, ``test``).

        A bundled dataset's subclass passes them on to ``__init__``: an empty public split means no
        public data, and b′ is capped at the public split's size.
        """
        public = splits["public"]
        return dict(
            private=splits["private"],
            public=public if len(public) else None,
            val=splits.get("val"),
            test=splits.get("test"),
            public_batch_size=min(public_batch_size, max(len(public), 1)),
            **kwargs,
        )

    def _validate(self) -> None:
        n = len(self.private)
        if n < 1:
            raise ValueError("the private dataset is empty.")
        if isinstance(self.batch_size, bool) or int(self.batch_size) != self.batch_size or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}.")
        if self.batch_size > n:
            raise ValueError(f"batch_size={self.batch_size} is larger than the private dataset ({n} examples).")
        if self.public is not None and len(self.public) < 1:
            raise ValueError("the public dataset is empty: pass public=None or give it examples.")
        if self.public is not None and self.public_batch_size > len(self.public):
            raise ValueError(
                f"public_batch_size={self.public_batch_size} is larger than the public dataset ({len(self.public)})."
            )

    @property
    def n_private(self) -> int:
        return len(self.private)

    @property
    def sample_rate(self) -> float:
        """q = b / n."""
        return self.batch_size / self.n_private

    def train_dataloader(self) -> DataLoader:
        module = self.trainer.lightning_module if self.trainer is not None else None
        own = module.private_loader(self.private, self.seed) if hasattr(module, "private_loader") else None
        if own is not None:  # a method whose accounting needs other sampling (O2NC's partition)
            return own
        steps = max(1, self.n_private // self.batch_size)
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        return poisson_loader(
            self.private,
            self.sample_rate,
            seed=self.sampling_seed,
            steps_per_epoch=steps,
            num_replicas=world,
            rank=rank,
        )

    def val_dataloader(self) -> DataLoader | list:
        return DataLoader(self.val, batch_size=self.eval_batch_size) if self.val is not None else []

    def test_dataloader(self) -> DataLoader | list:
        return DataLoader(self.test, batch_size=self.eval_batch_size) if self.test is not None else []

    def public_batches(self, k: int = 1) -> list[Any]:
        """``k`` disjoint public batches of ``public_batch_size`` (PAZO spec A7).

        Each call draws k·b′ distinct public examples without replacement and splits them; the
        generator's state is part of :meth:`state_dict`, so a resumed run sees the same batches.
        """
        need = self.check_public(k)
        order = torch.randperm(len(self.public), generator=self._public_generator)[:need].tolist()
        chunks = [order[c * self.public_batch_size : (c + 1) * self.public_batch_size] for c in range(k)]
        return [default_collate([self.public[i] for i in chunk]) for chunk in chunks]

    def check_public(self, k: int = 1) -> int:
        """Raise a clear error unless ``k`` disjoint public batches can be drawn; returns k·b′."""
        if self.public is None:
            raise ValueError("this method needs public data, but the datamodule has public=None.")
        need = k * self.public_batch_size
        if need > len(self.public):
            raise ValueError(
                f"{k} disjoint public batches of {self.public_batch_size} need {need} public examples; "
                f"the public set has {len(self.public)}. Lower public_batch_size or k."
            )
        return need

    def state_dict(self) -> dict[str, Any]:
        return {"public_generator": self._public_generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "public_generator" in state_dict:
            self._public_generator.set_state(state_dict["public_generator"])
