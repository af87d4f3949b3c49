"""Free text for private fine-tuning of a causal language model: texts in, DP-correct loaders of token ids out.

:class:`TextGenerationDataModule` reads texts (a list, a CSV/TSV or JSON Lines file, a mapping of columns or a
Hugging Face ``datasets.Dataset``), optionally as prompt/completion pairs, tokenizes them with a local tokenizer and
serves a Poisson-sampled private loader of right-padded batches with attention masks, for ``loss="causal_lm"``
(:func:`pl_dp.step.losses.causal_lm`). One example is one sequence: ε protects each text (each pair) as a whole.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from pl_dp.data.datamodule import SplitsDataModule
from pl_dp.data.text import carve_splits, read_columns, token_padding
from pl_dp.errors import ConfigError
from pl_dp.step.losses import IGNORE_INDEX
from pl_dp.step.seal import sealed

#: texts: a list of strings, a CSV/TSV/JSONL path, a mapping of columns or a ``datasets.Dataset``
GenerationSource = Any


class TokenSequences(Dataset):
    """Tokenized sequences; items are ``{"input_ids", "attention_mask", "labels"}`` of one sequence, unpadded
    (:class:`~pl_dp.data.collate.PaddingCollate` right-pads each batch to its longest sequence, labels with −100).
    ``labels`` are the input ids, −100 on the tokens that are not to be predicted (a prompt's)."""

    def __init__(self, input_ids: list[torch.Tensor], labels: list[torch.Tensor]) -> None:
        if len(input_ids) != len(labels):
            raise ValueError("token ids and labels differ in length.")
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[i]}


def read_generation_texts(
    source: GenerationSource, text_column: str, prompt_column: str | None, completion_column: str | None
) -> tuple[list[str], list[str]]:
    """``(prompts, completions)`` of a source: a list of texts (prompts empty), or the columns of a file, a mapping
    or a dataset — ``text_column``, or ``prompt_column`` and ``completion_column`` when both are given."""
    if isinstance(source, (list, tuple)) and all(isinstance(text, str) for text in source):
        return [""] * len(source), list(source)
    if (prompt_column is None) != (completion_column is None):
        raise ConfigError("give both prompt_column and completion_column (the loss is on the completion), or neither.")
    if prompt_column is None or completion_column is None:
        (texts,) = read_columns(source, [text_column])
        return [""] * len(texts), [str(text) for text in texts]
    prompts, completions = read_columns(source, [prompt_column, completion_column])
    return [str(p) for p in prompts], [str(c) for c in completions]


def tokenize_sequences(
    prompts: Sequence[str], completions: Sequence[str], tokenizer: Any, max_length: int, add_eos: bool
) -> TokenSequences:
    """Token ids of prompt + completion (the tokenizer's special tokens, e.g. a beginning-of-sequence token, before
    the prompt; its end-of-sequence token after the completion with ``add_eos``), cut to ``max_length`` tokens from
    the end; labels are −100 on the prompt's tokens, so the loss is on the completion (and its end) only.

    Quiet: the tokenizer runs with ``verbose=False`` inside :func:`~pl_dp.step.seal.sealed` (a text longer than
    the model's maximum neither prints transformers' notice nor sets its flag in ``tokenizer.deprecation_warnings``),
    and a tokenizer that is not a fast (Rust) one is copied first: Python tokenizers may cache the words they read
    (the BPE word cache of CTRL's, XLM's, BioGPT's). The tokenizer given — which a net may hold, and a pickle of it
    carry — keeps no trace of the texts.
    """
    if max_length < 2:
        raise ConfigError(f"max_length must be at least 2 (a token and its successor), got {max_length}.")
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []
    if not getattr(tokenizer, "is_fast", False):
        tokenizer = copy.deepcopy(tokenizer)
    ids, labels = [], []
    with sealed():
        for prompt, completion in zip(prompts, completions):
            head = tokenizer(prompt, verbose=False)["input_ids"]  # an empty prompt: the special tokens alone (BOS)
            tail = tokenizer(completion, add_special_tokens=False, verbose=False)["input_ids"] + eos
            sequence = torch.tensor(head + tail, dtype=torch.long)[:max_length]
            target = sequence.clone()
            target[: len(head)] = IGNORE_INDEX
            ids.append(sequence)
            labels.append(target)
    return TokenSequences(ids, labels)


class TextGenerationDataModule(SplitsDataModule):
    """Texts → token sequences → a Poisson-sampled private loader of right-padded batches, and evaluation loaders.

    Every item is one sequence ``{"input_ids", "attention_mask", "labels"}``; batches are right-padded to their
    longest sequence with attention mask 0 and label −100 on the padding (:class:`~pl_dp.data.collate.
    PaddingCollate`), so each sequence keeps its own positions whatever else is sampled, and a causal model reads
    none of the padding: per-example independence holds through this loader (the fit-start probe checks it with
    the net and loss of the run). Train with ``loss="causal_lm"``.

    Splits. ``data`` is the pool: each text (each prompt/completion pair) goes to test, val or public with
    probability ``test_fraction``, ``val_fraction``, ``public_fraction``, decided by a keyed hash of the record
    itself and ``split_seed`` (public), and otherwise to the private training set
    (:func:`~pl_dp.data.text.carve_splits`): split sizes vary binomially around the fractions, equal records share
    a split, and adding or removing one record moves no other. ``val``, ``test`` and ``public`` give a split
    explicitly instead. ε protects each private sequence; a record that lands in val, test or public is used
    without privacy: validation and test losses are logged without noise, and public sequences are used as they are.

    Args:
        data: the texts: a list of strings, a ``.csv``/``.tsv``/``.jsonl`` path, a mapping of columns or a
            ``datasets.Dataset``.
        val, test, public: explicit splits, in the same forms.
        tokenizer: a local tokenizer (or model) directory, or a loaded tokenizer.
        text_column: the column of the texts (files, mappings, datasets).
        prompt_column, completion_column: columns of prompt/completion pairs instead: the sequence is the prompt
            followed by the completion, and the loss is on the completion only.
        max_length: tokens per sequence at most (longer ones lose tokens from their end).
        add_eos: end each sequence with the tokenizer's end-of-sequence token (predicted too: the model learns to
            stop).
        val_fraction, test_fraction: expected shares of the pool (``None``: 0.1, or 0 when the split is given).
        public_fraction: expected share of the pool that is public data.
        split_seed: key of the hash that splits the pool.
        batch_size, public_batch_size, eval_batch_size: as in :class:`~pl_dp.data.PrivatePublicDataModule`, with
            defaults for text; its other arguments (``seed``, ``sampling_seed``, ``num_workers``, …) are taken by
            keyword (``sampling_seed=None``: the Poisson sampling is a secret from OS entropy).

    Texts given in memory are never written to the hyperparameters (which checkpoints and loggers save): only paths
    are.
    """

    data_arguments = ("data", "public", "val", "test", "tokenizer")
    max_length: int  # every sequence is cut to it: the padded length of a private batch under fixed_length

    def __init__(
        self,
        *,
        data: GenerationSource,
        tokenizer: str | Path | Any,
        val: GenerationSource | None = None,
        test: GenerationSource | None = None,
        public: GenerationSource | None = None,
        text_column: str = "text",
        prompt_column: str | None = None,
        completion_column: str | None = None,
        max_length: int = 128,
        add_eos: bool = True,
        val_fraction: float | None = None,
        test_fraction: float | None = None,
        public_fraction: float = 0.0,
        split_seed: int = 0,
        batch_size: int = 32,
        public_batch_size: int = 32,
        eval_batch_size: int = 64,
        **kwargs: Any,
    ) -> None:
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        else:
            self.tokenizer = tokenizer
        self.max_length = max_length

        def read(source: GenerationSource) -> tuple[list[str], list[str]]:
            return read_generation_texts(source, text_column, prompt_column, completion_column)

        prompts, completions = read(data)
        given = {
            name: None if source is None else read(source)
            for name, source in {"public": public, "val": val, "test": test}.items()
        }
        raw = carve_splits((prompts, completions), given, test_fraction, val_fraction, public_fraction, split_seed)
        splits = {
            name: tokenize_sequences(prompts, completions, self.tokenizer, max_length, add_eos)
            for name, (prompts, completions) in raw.items()
        }
        kwargs.setdefault("collate_fn", token_padding(self.tokenizer))
        super().__init__(
            splits,
            batch_size=batch_size,
            public_batch_size=public_batch_size,
            eval_batch_size=eval_batch_size,
            **kwargs,
        )
