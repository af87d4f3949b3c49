"""PrivatePublicDataModule: a Poisson-sampled private loader plus an endless public loader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from pl_dp.privacy.sampling import poisson_loader


class PrivatePublicDataModule(L.LightningDataModule):
    """Datasets in, DP-correct loaders out.

    * ``train_dataloader`` Poisson-samples ``private`` at rate ``batch_size / len(private)``
      (variable, possibly empty batches; one epoch = ``len(private) // batch_size`` steps, at
      least 1) — the only sampling the accountant's numbers hold for.
    * ``public_iterator()`` cycles ``public`` forever, reshuffled each pass; public batches
      never consume privacy.
    * ``val``/``test`` are ordinary loaders.

    Args:
        private: the private training set.
        public: optional public set (PAZO, Coupling).
        val, test: optional evaluation sets.
        batch_size: expected private batch size b (sample rate b/n).
        public_batch_size: public batch size b′ (defaults to ``batch_size``).
        seed: seed of the Poisson sampler and the public shuffling (not of the DP noise).
        eval_batch_size: batch size of the evaluation loaders.
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
    ) -> None:
        super().__init__()
        self.private, self.public, self.val, self.test = private, public, val, test
        self.batch_size = batch_size
        self.public_batch_size = public_batch_size or batch_size
        self.seed = seed
        self.eval_batch_size = eval_batch_size
        if private is not None:
            self._validate()

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
        steps = max(1, self.n_private // self.batch_size)
        return poisson_loader(self.private, self.sample_rate, seed=self.seed, steps_per_epoch=steps)

    def val_dataloader(self) -> DataLoader | list:
        return DataLoader(self.val, batch_size=self.eval_batch_size) if self.val is not None else []

    def test_dataloader(self) -> DataLoader | list:
        return DataLoader(self.test, batch_size=self.eval_batch_size) if self.test is not None else []

    def public_iterator(self) -> Iterator[Any]:
        """Public batches of size ``public_batch_size``, forever, reshuffled each pass (seeded)."""
        if self.public is None:
            raise ValueError("this method needs public data, but the datamodule has public=None.")
        return self._cycle_public()

    def _cycle_public(self) -> Iterator[Any]:
        g = torch.Generator().manual_seed(self.seed + 1)
        while True:
            loader = DataLoader(
                self.public, batch_size=self.public_batch_size, shuffle=True, generator=g, drop_last=True
            )
            yield from loader
