"""A fixed synthetic binary classification problem: many rows, few features (O2NC's regime).

**Dataset card.**

* *What.* ``sklearn.datasets.make_classification`` with a fixed generator seed: ``n_samples`` rows (default
  500,000) of ``n_features`` real features (default 10), of which ``n_informative`` (default 5) carry the label
  and the rest are pure noise (no redundant or repeated features); two classes, each a mixture of two Gaussian
  clusters on the vertices of a hypercube of side ``2·class_sep`` (default 1.0), and a fraction ``flip_y``
  (default 0.03) of the labels assigned at random. Balanced classes. With the defaults, logistic regression
  reaches about 89.5 % test accuracy (scikit-learn's ``LogisticRegression`` on the private split); the
  clusters make the Bayes-optimal boundary non-linear, so a small MLP can do slightly better.
* *Splits.* A permutation with a fixed split seed (independent of the training ``seed`` and of the sampling
  seed): ``test_fraction`` (default 10 %) test, ``val_fraction`` (default 10 %) validation, then a
  ``public_fraction`` (default 0: no public split) of the rest as public data, drawn uniformly; the remainder
  is private (400,000 rows with the defaults).
* *Features.* float32, standardized with the mean and standard deviation of the **validation** split, so that
  no statistic of the private rows enters the preprocessing (the standardization costs no privacy budget).
  Labels are int64 in {0, 1}.
* *Privacy unit.* One row (one (x, y) pair) is one individual.
* *Why.* Zeroth-order private methods pay a noise that grows with the number d of trained parameters;
  Zhang, Tran & Cutkosky's private online-to-nonconvex conversion (O2NC, ICLR 2024) needs n ≳ d^{3/2}/(ρδε²)
  examples, so it is only useful for large n and small d. This problem is that regime — n in the hundreds of
  thousands, a linear model (d = 22) — where the UCI digits (1.2k rows, d = 650) are not; it also gives a
  cheap, exactly reproducible benchmark with a known non-private ceiling.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sklearn.datasets import make_classification
from torch.utils.data import TensorDataset

from pl_dp.data.datamodule import SplitsDataModule
from pl_dp.errors import ConfigError

_DATA_SEED = 0  # fixed: the problem itself (clusters, rows, label noise)
_SPLIT_SEED = 20240229  # fixed: the splits never move with the training seed


def synthetic_splits(
    n_samples: int = 500_000,
    n_features: int = 10,
    n_informative: int = 5,
    class_sep: float = 1.0,
    flip_y: float = 0.03,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    public_fraction: float = 0.0,
) -> tuple[TensorDataset, TensorDataset, TensorDataset, TensorDataset]:
    """Fixed (private, public, val, test) TensorDatasets of the synthetic problem (see the module's card).

    Test and validation are taken first (``test_fraction``, ``val_fraction`` of ``n_samples``), then
    ``public_fraction`` of the remaining pool; the rest is private. Features are standardized with the
    validation split's statistics.
    """
    if not 0 <= public_fraction < 1:
        raise ConfigError(f"public_fraction must lie in [0, 1), got {public_fraction}.")
    if not (val_fraction > 0 and test_fraction > 0 and val_fraction + test_fraction < 1):
        raise ConfigError(
            f"val_fraction and test_fraction must be positive with a sum below 1, got {val_fraction}, {test_fraction}."
        )
    if not 0 < n_informative <= n_features:
        raise ConfigError(f"n_informative must lie in [1, n_features={n_features}], got {n_informative}.")
    x, y = make_classification(
        n_samples=n_samples,
        n_features=n_features,
        n_informative=n_informative,
        n_redundant=0,
        n_repeated=0,
        n_classes=2,
        class_sep=class_sep,
        flip_y=flip_y,
        random_state=_DATA_SEED,
    )
    order = np.random.default_rng(_SPLIT_SEED).permutation(n_samples)
    n_test = int(round(test_fraction * n_samples))
    n_val = int(round(val_fraction * n_samples))
    test_idx, val_idx, pool = order[:n_test], order[n_test : n_test + n_val], order[n_test + n_val :]
    n_public = int(round(public_fraction * len(pool)))
    public_idx, private_idx = pool[:n_public], pool[n_public:]
    if len(private_idx) == 0 or n_val == 0 or n_test == 0:
        raise ConfigError(f"n_samples={n_samples} is too small for these fractions: a split would be empty.")
    mean, std = x[val_idx].mean(axis=0), x[val_idx].std(axis=0)
    features = torch.tensor((x - mean) / np.where(std > 0, std, 1.0), dtype=torch.float32)
    labels = torch.tensor(y, dtype=torch.long)

    def subset(idx: np.ndarray) -> TensorDataset:
        t = torch.as_tensor(np.sort(idx))
        return TensorDataset(features[t], labels[t])

    return subset(private_idx), subset(public_idx), subset(val_idx), subset(test_idx)


class SyntheticClassificationDataModule(SplitsDataModule):
    """The synthetic problem as private/val/test splits (see :func:`synthetic_splits` and the module's card).

    With the defaults: 400,000 private, 50,000 validation and 50,000 test rows of 10 float32 features,
    no public split (``public_fraction > 0`` carves one from the training pool, with public batches of
    ``public_batch_size``). Arguments as :class:`~pl_dp.data.PrivatePublicDataModule`; ``sampling_seed``
    (secret Poisson sampling) stays ``None`` unless reproducing a run. O2NC ignores ``batch_size`` (it
    partitions the private set itself).
    """

    def __init__(
        self,
        *,
        n_samples: int = 500_000,
        n_features: int = 10,
        n_informative: int = 5,
        class_sep: float = 1.0,
        flip_y: float = 0.03,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        public_fraction: float = 0.0,
        batch_size: int = 256,
        eval_batch_size: int = 4096,
        **kwargs: Any,
    ) -> None:
        splits = synthetic_splits(
            n_samples, n_features, n_informative, class_sep, flip_y, val_fraction, test_fraction, public_fraction
        )
        super().__init__(
            dict(zip(("private", "public", "val", "test"), splits)),
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            **kwargs,
        )
