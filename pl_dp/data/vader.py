"""The VADER sentiment lexicon as a binary classification task, tokenized for a local HF model.

Dataset card.
* Source: the lexicon shipped in the ``vaderSentiment`` package (Hutto & Gilbert, ICWSM 2014):
  7,520 English words, slang, emoticons and acronyms, each rated by ten human raters on
  [−4, 4]; the file gives the mean, the standard deviation and the ten ratings.
* Task: label 1 if the mean valence is positive, 0 if negative; near-neutral entries
  (|mean| < 0.5) are dropped. The file lists 14 strings twice (e.g. ``d:`` as −2.9 and 1.2): a
  repeated string keeps the average of its means, and strings rated with both signs are
  dropped, so every text appears once.
* Splits (fixed, independent of the training seed): 15 % test, 10 % validation, the rest the
  training pool; the public split (``public_fraction`` of the pool) is drawn with positives three
  times as likely as negatives — a documented class-imbalance shift (about 70 % positive against
  44 % in the private split), like the shifted public sets of the PAZO experiments; ``public_shift``
  ``"mild"`` makes positives 1.5 times as likely, ``"none"`` draws uniformly (:mod:`pl_dp.data.shift`).
* Inputs: each entry tokenized alone (or in a prompt template), at most ``max_length`` tokens, as
  ``{"input_ids", "attention_mask", "labels"}``; each batch is padded to its longest entry.
* Privacy unit: one lexicon entry (its ten ratings). The lexicon is public, so this is a
  benchmark, not a privacy-sensitive dataset.
* Synthetic authors (``authors=``), for user-level privacy: each private entry is given one of ``authors`` made-up
  authors, author a (1, 2, …) with probability ∝ 1/a (a Zipf law, as real authorship is skewed: with 1,000 authors,
  760 write at least one of the 4,897 private entries, the most prolific 681 and 461 of them one or two), drawn with
  a fixed seed, so the assignment is the same in every run (:func:`synthetic_authors`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from pl_dp.data.datamodule import SplitsDataModule
from pl_dp.data.shift import public_shift_weights
from pl_dp.data.text import TextDataModule
from pl_dp.errors import ConfigError

_SPLIT_SEED = 20140601
NEUTRAL_BAND = 0.5


def vader_lexicon() -> list[tuple[str, float]]:
    """(entry, mean valence) for every row of the packaged lexicon (repeated strings included)."""
    try:
        import vaderSentiment
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("the VADER lexicon needs 'vaderSentiment': pip install 'pl_dp[finetune]'.") from err
    path = Path(vaderSentiment.__file__).parent / "vader_lexicon.txt"
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if len(fields) >= 2:
            rows.append((fields[0], float(fields[1])))
    return rows


def vader_splits(
    public_fraction: float = 0.04, public_shift: str = "strong"
) -> dict[str, tuple[list[str], torch.Tensor]]:
    """Fixed (texts, labels) for ``private``, ``public``, ``val`` and ``test`` (see the module docstring)."""
    if not 0 <= public_fraction < 1:
        raise ConfigError(f"public_fraction must lie in [0, 1), got {public_fraction}.")
    means: dict[str, list[float]] = {}
    for text, mean in vader_lexicon():
        means.setdefault(text, []).append(mean)
    rows = [
        (t, sum(ms) / len(ms))
        for t, ms in means.items()
        if (all(m > 0 for m in ms) or all(m < 0 for m in ms)) and abs(sum(ms) / len(ms)) >= NEUTRAL_BAND
    ]
    texts = [t for t, _ in rows]
    labels = torch.tensor([int(m > 0) for _, m in rows])
    rng = np.random.default_rng(_SPLIT_SEED)
    order = rng.permutation(len(rows))
    n_test, n_val = round(0.15 * len(rows)), round(0.10 * len(rows))
    test, val, pool = order[:n_test], order[n_test : n_test + n_val], order[n_test + n_val :]
    n_public = round(public_fraction * len(pool))
    weights = public_shift_weights(labels[pool].numpy(), 2, public_shift, favoured="last")
    public = rng.choice(pool, size=n_public, replace=False, p=weights / weights.sum()) if n_public else pool[:0]
    private = np.setdiff1d(pool, public)
    return {
        name: ([texts[i] for i in np.sort(idx)], labels[torch.as_tensor(np.sort(idx), dtype=torch.long)])
        for name, idx in [("private", private), ("public", public), ("val", val), ("test", test)]
    }


_AUTHOR_SEED = 20240529


def synthetic_authors(count: int, authors: int, exponent: float = 1.0) -> list[int]:
    """An author (1…``authors``) for each of ``count`` texts: author a with probability ∝ a^−``exponent`` (Zipf),
    drawn independently per text from a fixed seed (the same assignment in every run). Authors drawn for no text do
    not appear, so the data holds at most ``authors`` users."""
    if isinstance(authors, bool) or int(authors) != authors or authors < 1:
        raise ConfigError(f"authors must be an integer >= 1, got {authors!r}.")
    weights = np.arange(1, authors + 1, dtype=np.float64) ** -exponent
    drawn = np.random.default_rng(_AUTHOR_SEED).choice(authors, size=count, p=weights / weights.sum())
    return (drawn + 1).tolist()


class VaderSentimentDataModule(TextDataModule):
    """VADER lexicon sentiment (see the module docstring) as a :class:`~pl_dp.data.TextDataModule`.

    With the defaults: 4,897 private, 204 public, 680 validation and 1,020 test entries (6,801 in all).

    Args:
        batch_size: expected private batch size (Poisson sampling).
        public_fraction: share of the training pool that is public (shifted towards positives).
        public_shift: the public split's class imbalance, ``"none"``, ``"mild"`` or ``"strong"`` (3:1).
        public_batch_size: public batch size (at most the public split's size).
        seed: seed of the public shuffling (the splits are fixed).
        sampling_seed: secret seed of the private Poisson sampling; ``None`` (default): OS entropy
            (see :class:`~pl_dp.data.PrivatePublicDataModule`).
        max_length: tokens per entry, special tokens (and template) included.
        tokenizer_path: a local tokenizer directory; ``None`` uses the packaged MiniLM's.
        template: a prompt template (``"{text}"``: the entry alone; e.g. ``"{text} It was {mask}."`` for a
            masked LM), see :class:`~pl_dp.nets.PromptClassifier`.
        prompt: a :class:`~pl_dp.nets.PromptClassifier` whose tokenizer and template to use instead.
        authors: for user-level privacy, give the private entries this many synthetic authors with a Zipf-skewed
            number of entries each (:func:`synthetic_authors`): the guarantee then protects one author, each step
            samples authors (``batch_size`` is the expected number of authors per batch) and one entry of each.
            ``None`` (default): example-level privacy, one entry.
    """

    def __init__(
        self,
        *,
        public_fraction: float = 0.04,
        public_shift: str = "strong",
        tokenizer_path: str | None = None,
        prompt: Any | None = None,
        max_length: int = 8,
        authors: int | None = None,
        **kwargs: Any,
    ) -> None:
        from pl_dp.nets.hf import minilm_path

        splits = vader_splits(public_fraction, public_shift)
        if authors is not None:
            kwargs["user_of"] = synthetic_authors(len(splits["private"][0]), authors)
        super().__init__(
            splits["private"],
            public=splits["public"],
            val=splits["val"],
            test=splits["test"],
            tokenizer=None if prompt is not None else tokenizer_path or minilm_path(),
            prompt=prompt,
            max_length=max_length,
            **kwargs,
        )


def minilm_embeddings(texts: list[str], model_path: str | None = None, max_length: int = 8) -> torch.Tensor:
    """Sentence embeddings ``[len(texts), hidden]`` from a local encoder (default: the packaged MiniLM).

    The all-MiniLM-L6-v2 recipe: the mean of the last hidden states over each text's tokens, then
    L2 normalization. Runs on the CPU in inference mode; nothing is downloaded.
    """
    from transformers import AutoModel, AutoTokenizer

    from pl_dp.nets.hf import mean_pool, minilm_path, quiet_transformers

    path = str(model_path or minilm_path())
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        encoder = AutoModel.from_pretrained(path, local_files_only=True).eval()
    chunks = [torch.empty(0, encoder.config.hidden_size)]
    for start in range(0, len(texts), 512):
        enc = tokenizer(
            texts[start : start + 512], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        with torch.inference_mode():
            chunks.append(mean_pool(encoder(**enc).last_hidden_state, enc["attention_mask"]))
    return torch.cat(chunks)


@functools.lru_cache(maxsize=4)
def _embedded_splits(
    public_fraction: float, max_length: int, model_path: str | None, public_shift: str
) -> dict[str, TensorDataset]:
    splits = vader_splits(public_fraction, public_shift)
    names = list(splits)
    texts = [t for name in names for t in splits[name][0]]
    vectors = minilm_embeddings(texts, model_path, max_length).split([len(splits[n][0]) for n in names])
    return {name: TensorDataset(v.clone(), splits[name][1]) for name, v in zip(names, vectors)}


class VaderEmbeddingDataModule(SplitsDataModule):
    """VADER sentiment (same fixed splits as :class:`VaderSentimentDataModule`) as frozen sentence embeddings.

    Each entry is encoded once by the pretrained MiniLM — mean of the last hidden states over its
    tokens, L2-normalized, exactly the all-MiniLM-L6-v2 sentence-embedding recipe — and the
    private methods train a small head (e.g. ``MLP(384, [64], 2)``) on the 384-dimensional
    vectors: DP "linear probing" on pretrained features, orders of magnitude cheaper than
    fine-tuning the encoder. The encoder is public and fixed (it never sees a gradient), so
    the privacy guarantee is the head's, per lexicon entry. Embeddings are computed on the
    CPU when the module is built (a few seconds) and cached per process.

    Args: as :class:`VaderSentimentDataModule` (``authors`` included: the same synthetic authors of the same
    entries); ``model_path`` is a local encoder directory (``None``: the packaged MiniLM).
    """

    def __init__(
        self,
        *,
        public_fraction: float = 0.04,
        public_shift: str = "strong",
        max_length: int = 8,
        model_path: str | None = None,
        public_batch_size: int = 32,
        eval_batch_size: int = 1024,
        authors: int | None = None,
        **kwargs: Any,
    ) -> None:
        splits = _embedded_splits(public_fraction, max_length, model_path, public_shift)
        if authors is not None:
            kwargs["user_of"] = synthetic_authors(len(splits["private"]), authors)
        super().__init__(splits, public_batch_size=public_batch_size, eval_batch_size=eval_batch_size, **kwargs)
