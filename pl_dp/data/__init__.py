"""Data modules: Poisson-sampled private data, public data, bundled real datasets."""

from pl_dp.data.datamodule import PrivatePublicDataModule, SplitsDataModule
from pl_dp.data.digits import DigitsDataModule, digits_splits
from pl_dp.data.generation import TextGenerationDataModule, TokenSequences
from pl_dp.data.synthetic import SyntheticClassificationDataModule, synthetic_splits
from pl_dp.data.text import TextDataModule, TokenizedTexts, read_texts, tokenize_prompts
from pl_dp.data.vader import (
    VaderEmbeddingDataModule,
    VaderSentimentDataModule,
    minilm_embeddings,
    vader_lexicon,
    vader_splits,
)

__all__ = [
    "DigitsDataModule",
    "PrivatePublicDataModule",
    "SplitsDataModule",
    "SyntheticClassificationDataModule",
    "TextDataModule",
    "TextGenerationDataModule",
    "TokenSequences",
    "TokenizedTexts",
    "VaderEmbeddingDataModule",
    "VaderSentimentDataModule",
    "digits_splits",
    "minilm_embeddings",
    "read_texts",
    "synthetic_splits",
    "tokenize_prompts",
    "vader_lexicon",
    "vader_splits",
]
