"""Scikit-learn's bundled handwritten digits (8×8 images, 10 classes, 1,797 examples)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

from pl_dp.data.datamodule import SplitsDataModule
from pl_dp.data.shift import public_shift_weights
from pl_dp.errors import ConfigError

_SPLIT_SEED = 20240229  # fixed: the splits never move with the training seed


def digits_splits(
    public_fraction: float = 0.04,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    public_shift: str = "strong",
) -> tuple[TensorDataset, TensorDataset, TensorDataset, TensorDataset]:
    """Fixed (private, public, val, test) TensorDatasets of the UCI digits.

    Features are pixel intensities scaled to [0, 1]. The public split is drawn from the
    training pool with class imbalance (``public_shift``, :mod:`pl_dp.data.shift`): by default
    class c is picked with weight 1.5 − c/9, so class 0 is three times as likely as class 9 —
    mimicking the shifted public sets of PAZO's CIFAR-10 setup (Gong & Li 2025, §5.1);
    ``"mild"`` makes it 1.5 times, ``"none"`` draws uniformly.
    """
    if not 0 <= public_fraction < 1:
        raise ConfigError(f"public_fraction must lie in [0, 1), got {public_fraction}.")
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    rng = np.random.default_rng(_SPLIT_SEED)
    order = rng.permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    n_val = int(round(val_fraction * len(y)))
    test_idx, val_idx, pool = order[:n_test], order[n_test : n_test + n_val], order[n_test + n_val :]
    n_public = int(round(public_fraction * len(pool)))
    weights = public_shift_weights(y[pool].numpy(), 10, public_shift)
    public_idx = rng.choice(pool, size=n_public, replace=False, p=weights / weights.sum()) if n_public else pool[:0]
    private_idx = np.setdiff1d(pool, public_idx)

    def subset(idx: np.ndarray) -> TensorDataset:
        t = torch.as_tensor(np.sort(idx))
        return TensorDataset(x[t], y[t])

    return subset(private_idx), subset(public_idx), subset(val_idx), subset(test_idx)


class DigitsDataModule(SplitsDataModule):
    """Digits as private/public/val/test splits (see :func:`digits_splits`).

    With the defaults: 1,208 private, 50 public, 180 validation and 359 test examples; public batches
    of 16, so that PAZO-P's default k = 3 disjoint public batches fit the 50 public examples. ``public_shift``
    (``"none"``, ``"mild"``, ``"strong"``) sets the public split's class imbalance. Arguments as
    :class:`~pl_dp.data.PrivatePublicDataModule`; ``sampling_seed`` (secret Poisson sampling) stays
    ``None`` unless reproducing a run.
    """

    def __init__(
        self, *, public_fraction: float = 0.04, public_shift: str = "strong", public_batch_size: int = 16, **kwargs: Any
    ) -> None:
        datasets = digits_splits(public_fraction, public_shift=public_shift)
        splits = dict(zip(("private", "public", "val", "test"), datasets))
        super().__init__(splits, public_batch_size=public_batch_size, **kwargs)
