"""Data modules: Poisson-sampled private data, public data, bundled real datasets."""

from pl_dp.data.datamodule import PrivatePublicDataModule
from pl_dp.data.digits import DigitsDataModule, digits_splits

__all__ = ["DigitsDataModule", "PrivatePublicDataModule", "digits_splits"]
