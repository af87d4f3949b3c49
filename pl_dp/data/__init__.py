"""Data modules: Poisson-sampled private data, public data, bundled real datasets."""

from pl_dp.data.datamodule import PrivatePublicDataModule
from pl_dp.data.digits import DigitsDataModule, digits_splits
from pl_dp.data.vader import VaderSentimentDataModule, vader_lexicon, vader_splits

__all__ = [
    "DigitsDataModule",
    "PrivatePublicDataModule",
    "VaderSentimentDataModule",
    "digits_splits",
    "vader_lexicon",
    "vader_splits",
]
