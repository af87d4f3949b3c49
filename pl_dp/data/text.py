"""Text classification data for fine-tuning a language model privately: texts and labels in, DP-correct loaders out.

:class:`TextDataModule` reads texts and labels from Python lists, a CSV/TSV or JSON Lines file, or a Hugging Face
``datasets.Dataset``; splits them (explicitly, or each record by a keyed hash of itself and a fixed split seed);
fills a prompt template and tokenizes with a local tokenizer; and serves a Poisson-sampled private loader (it is a
:class:`~pl_dp.data.PrivatePublicDataModule`) whose batches are padded per batch (dynamic padding).

A template that does not fit ``max_length`` is never cut: the text is, from its end, as LM-BFF does (Gao, Fisch
& Chen, 2021), so a masked LM's ``{mask}`` and a causal LM's closing words survive truncation.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import torch
from torch.utils.data import Dataset

from pl_dp.data.collate import PAD_VALUES, PaddingCollate
from pl_dp.data.datamodule import SplitsDataModule
from pl_dp.errors import ConfigError
from pl_dp.nets.prompt import MASK, TEXT, split_template
from pl_dp.step.seal import sealed

#: texts and labels: a CSV/TSV/JSONL path, a mapping of columns, a pair (texts, labels), or a ``datasets.Dataset``
TextSource = Union[str, Path, Mapping[str, Sequence[Any]], tuple[Sequence[str], Sequence[Any]], Any]


def read_texts(source: TextSource, text_column: str = "text", label_column: str = "label") -> tuple[list[str], list]:
    """``(texts, labels)`` from a path (``.csv``, ``.tsv``, ``.jsonl``: one JSON object per line), a mapping of
    columns, a pair ``(texts, labels)`` or a Hugging Face ``datasets.Dataset`` (any object with ``column_names``)."""
    if isinstance(source, (tuple, list)) and len(source) == 2:
        texts, labels = source
        return list(texts), list(labels)
    texts, labels = read_columns(source, [text_column, label_column])
    return texts, labels


def read_columns(source: Any, columns: Sequence[str]) -> list[list]:
    """The named ``columns`` (one list each, in order) of a path (``.csv``, ``.tsv``, ``.jsonl``: one JSON object per
    line), a mapping of columns or a Hugging Face ``datasets.Dataset`` (any object with ``column_names``)."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.suffix in (".csv", ".tsv"):
            with path.open(newline="", encoding="utf-8-sig") as file:  # a BOM (spreadsheet exports) is dropped
                rows = list(csv.DictReader(file, delimiter="\t" if path.suffix == ".tsv" else ","))
        elif path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as file:
                rows = [json.loads(line) for line in file if line.strip()]
        else:
            raise ConfigError(f"cannot read {path}: use a .csv, .tsv or .jsonl file.")
        missing = set(columns) - set(rows[0] if rows else ())
        if rows and missing:
            raise KeyError(f"{path} has no column {sorted(missing)}; its columns are {sorted(rows[0])}.")
        return [[row[column] for row in rows] for column in columns]
    if isinstance(source, Mapping) or hasattr(source, "column_names"):
        names = source.keys() if isinstance(source, Mapping) else source.column_names
        missing = set(columns) - set(names)
        if missing:
            raise KeyError(f"the data has no column {sorted(missing)}; its columns are {sorted(names)}.")
        return [list(source[column]) for column in columns]
    raise TypeError(
        f"cannot read texts from a {type(source).__name__}: give a .csv/.tsv/.jsonl path, a mapping of columns, "
        "a pair (texts, labels) or a datasets.Dataset."
    )


def encode_labels(labels: Sequence[Any], label_names: Sequence[str] | None = None) -> torch.Tensor:
    """Class indices ``[n]`` (int64): names are looked up in ``label_names``, integers (also as text) kept."""
    index = {name: i for i, name in enumerate(label_names or ())}
    out = []
    for label in labels:
        if isinstance(label, str) and label in index:
            out.append(index[label])
            continue
        try:
            value = float(label)
        except (TypeError, ValueError):
            value = None
        if value is None or isinstance(label, bool) or not value.is_integer() or value < 0:
            known = f" (label_names: {list(index)})" if index else "; give label_names for labels that are names"
            raise ConfigError(f"a label is neither a class index nor a known name{known}.")
        out.append(int(value))
    encoded = torch.tensor(out, dtype=torch.long)
    if index and len(encoded) and int(encoded.max()) >= len(index):
        raise ConfigError(f"a class index is >= the number of label_names ({len(index)}).")
    return encoded


def tokenize_prompts(
    texts: Sequence[str], tokenizer: Any, template: str = TEXT, max_length: int = 128
) -> list[torch.Tensor]:
    """Token ids (a 1-D int64 tensor per text, unpadded) of ``template`` filled with each text.

    ``{mask}`` becomes the tokenizer's mask token. A prompt longer than ``max_length`` tokens loses tokens from
    the end of its text only — never from the template or the special tokens (so with the template ``"{text}"``
    this is the tokenizer's own truncation). Needs a fast tokenizer (character offsets).

    Quiet: the tokenizer runs with ``verbose=False`` inside :func:`~pl_dp.step.seal.sealed`, so a text longer
    than the model's maximum neither prints transformers' "Token indices sequence length is longer…" notice nor
    sets that notice's flag in ``tokenizer.deprecation_warnings`` — the tokenizer (which a net may hold, and a
    pickle of it carry) keeps no trace of the texts it read.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError("tokenizing prompts needs a fast (Rust) tokenizer: load it with AutoTokenizer.")
    prefix, suffix = split_template(template, tokenizer.mask_token)
    if not texts:
        return []
    with sealed():
        encoded = tokenizer(
            [prefix + text + suffix for text in texts],
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
            return_attention_mask=False,
            verbose=False,
        )
    out = []
    for ids, offsets, special, text in zip(
        encoded["input_ids"], encoded["offset_mapping"], encoded["special_tokens_mask"], texts
    ):
        overflow = len(ids) - max_length
        if overflow > 0:
            start, end = len(prefix), len(prefix) + len(text)
            in_text = [j for j, ((a, _), s) in enumerate(zip(offsets, special)) if not s and start <= a < end]
            if overflow > len(in_text):
                raise ConfigError(
                    f"the template {template!r} with its special tokens is longer than max_length={max_length}."
                )
            cut = set(in_text[len(in_text) - overflow :])
            ids = [token for j, token in enumerate(ids) if j not in cut]
        out.append(torch.tensor(ids, dtype=torch.long))
    if MASK in template:
        counts = [int((ids == tokenizer.mask_token_id).sum()) for ids in out]
        if any(count != 1 for count in counts):
            raise ValueError(
                f"{sum(count != 1 for count in counts)} texts contain the mask token {tokenizer.mask_token!r} "
                "themselves: a masked-LM prompt needs exactly one, the template's."
            )
    return out


def token_padding(tokenizer: Any) -> PaddingCollate:
    """The padding collate of ``tokenizer``'s token ids: ``input_ids`` padded with its ``pad_token_id`` (0 when it has
    none). A decoder's sequence classifier takes its logits at the last token that is not the pad token: padded with
    another id, every padded row would be classified from a padding position."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return PaddingCollate({**PAD_VALUES, "input_ids": pad if isinstance(pad, int) else 0})


class TokenizedTexts(Dataset):
    """Tokenized texts with labels; items are ``{"input_ids", "attention_mask", "labels"}`` of one example,
    unpadded (:class:`~pl_dp.data.collate.PaddingCollate` pads each batch to its longest example)."""

    def __init__(self, texts: list[str], input_ids: list[torch.Tensor], labels: torch.Tensor) -> None:
        if not len(texts) == len(input_ids) == len(labels):
            raise ValueError("texts, token ids and labels differ in length.")
        self.texts, self.input_ids, self.labels = texts, input_ids, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[i]}


def split_position(record: Sequence[Any], key: bytes) -> float:
    """A number in [0, 1) that is a function of ``record`` (its columns, as text) and ``key`` alone: the keyed
    BLAKE2b hash of the columns, each written as UTF-8 after its length (an unambiguous encoding of the record),
    its first 53 bits read as a binary fraction (uniform on [0, 1) for all practical purposes)."""
    digest = hashlib.blake2b(key=key, digest_size=8)
    for value in record:
        text = str(value).encode("utf-8")
        digest.update(len(text).to_bytes(8, "big") + text)
    return (int.from_bytes(digest.digest(), "big") >> 11) / 2**53


def carve_splits(
    columns: tuple[list, ...],
    given: Mapping[str, tuple[list, ...] | None],
    test_fraction: float | None,
    val_fraction: float | None,
    public_fraction: float,
    split_seed: int,
    split_by: int | None = None,
) -> dict[str, tuple[list, ...]]:
    """The ``"private"``, ``"public"``, ``"val"`` and ``"test"`` splits of a pool of parallel ``columns`` (texts and
    labels, prompts and completions, and a user column), in pool order; a split's ``given`` columns (as many) are
    appended to it.

    Each record goes where its own :func:`split_position` ``u`` (keyed by ``split_seed``) falls — of the whole
    record, or with ``split_by`` of its value in that column alone (a user column: all of one user's records land in
    one split, so no user is partly private and partly evaluated or public) — test if ``u <
    test_fraction``, else val if ``u < test_fraction + val_fraction``, else public if below that ``+
    public_fraction``, else private (a fraction ``None`` is 0.1, or 0 when that split is ``given``). The fractions
    are therefore expected shares: a split's size is Binomial(n, fraction), not a fixed count. Records equal in both
    columns land in the same split, so no duplicate straddles the private set and an evaluation or public split.

    Privacy: a record's split depends on that record and the (public) seed only, never on the rest of the pool, so
    adding or removing one record moves no other record between splits, and which records are evaluated or used as
    public data says nothing about the others. A record that lands in val, test or public is used without privacy
    (evaluation metrics are logged without noise, public data is read as it is); ε protects the private split.
    """
    fractions = {
        "test": (0.0 if given.get("test") is not None else 0.1) if test_fraction is None else test_fraction,
        "val": (0.0 if given.get("val") is not None else 0.1) if val_fraction is None else val_fraction,
        "public": public_fraction,
    }
    bounds, total = [], 0.0
    for name, fraction in fractions.items():
        if not 0 <= fraction < 1:
            raise ConfigError(f"{name}_fraction must lie in [0, 1), got {fraction}.")
        total += fraction
        bounds.append((total, name))
    if total >= 1:
        raise ConfigError(f"test, val and public fractions add up to {total:g}: nothing would be left private.")
    key = hashlib.sha256(str(split_seed).encode()).digest()  # any integer seed, as a key of BLAKE2b's size
    out: dict[str, tuple[list, ...]] = {
        name: tuple([] for _ in columns) for name in ("private", "public", "val", "test")
    }
    for record in zip(*columns, strict=True):
        position = split_position(record if split_by is None else (record[split_by],), key)
        name = next((name for bound, name in bounds if position < bound), "private")
        for column, value in zip(out[name], record):
            column.append(value)
    for name in ("public", "val", "test"):
        for column, extra in zip(out[name], given.get(name) or tuple([] for _ in columns), strict=True):
            column.extend(extra)
    return out


def _with_users(columns: tuple[list, list], user_column: str | None) -> tuple[list, ...]:
    """Texts and labels of an explicit split, with no user (``None``) each when the pool has a user column."""
    return columns if user_column is None else (*columns, [None] * len(columns[0]))


class TextDataModule(SplitsDataModule):
    """Texts and labels → tokenized prompts → a Poisson-sampled private loader, public and evaluation loaders.

    Splits. ``data`` is the pool: each record goes to test, val or public with probability ``test_fraction``,
    ``val_fraction``, ``public_fraction``, decided by a keyed hash of the record itself (text and label) and
    ``split_seed`` (public, so the split is the same in every run), and otherwise to the private training set
    (:func:`carve_splits`). The fractions are expected shares: split sizes vary binomially around them, and equal
    records share a split. ``public``, ``val`` and ``test`` give a split explicitly instead (its fraction of the
    pool is then 0 unless given). Adding or removing one record moves no other record between splits. ε protects
    the private set; a record that lands in val, test or public is used without privacy: validation and test
    metrics are logged without noise, and public examples are used as they are.

    Args:
        data: the pool of labelled texts: a ``.csv``/``.tsv``/``.jsonl`` path, a mapping of columns, a pair
            ``(texts, labels)``, or a ``datasets.Dataset``.
        public, val, test: explicit splits, in the same forms.
        tokenizer: a local tokenizer directory or a loaded (fast) tokenizer.
        template: the prompt, ``"{text}"`` by default; ``{mask}`` becomes the tokenizer's mask token.
        prompt: a :class:`~pl_dp.nets.PromptClassifier` whose tokenizer and template to use instead.
        text_column, label_column: the columns of files, mappings and datasets.
        user_column: the column naming each record's user (author), for user-level privacy: the guarantee then
            protects one user with all of their records, each step samples users and one record of each
            (``user_of`` of :class:`~pl_dp.data.PrivatePublicDataModule`: ``batch_size`` is the expected number of
            users per batch, δ's default 1/U), and the pool is split by user — all of a user's records land in one
            split, decided by the user id alone. Records of ``public``, ``val`` and ``test`` given explicitly need
            no user. ``None`` (default): example-level privacy.
        label_names: class names in class order, for labels given as names (``["negative", "positive"]``).
        max_length: tokens per example at most (special tokens and template included; the text is cut).
        val_fraction, test_fraction: expected shares of the pool (``None``: 0.1, or 0 when the split is given).
        public_fraction: expected share of the pool that is public data (for PAZO, Coupling).
        split_seed: key of the hash that splits the pool.
        batch_size, public_batch_size, eval_batch_size: as in :class:`~pl_dp.data.PrivatePublicDataModule`, with
            defaults for text; its other arguments (``seed``, ``sampling_seed``, ``num_workers``, …) are taken by
            keyword (``sampling_seed=None``: the Poisson sampling is a secret from OS entropy).

    Texts given as lists or datasets are never written to the hyperparameters (which checkpoints and loggers
    save): only paths are.
    """

    data_arguments = ("data", "public", "val", "test", "tokenizer")
    max_length: int  # every sequence is cut to it: the padded length of a private batch under fixed_length

    def __init__(
        self,
        data: TextSource,
        *,
        public: TextSource | None = None,
        val: TextSource | None = None,
        test: TextSource | None = None,
        tokenizer: str | Path | Any | None = None,
        template: str | None = None,
        prompt: Any | None = None,
        text_column: str = "text",
        label_column: str = "label",
        user_column: str | None = None,
        label_names: list[str] | None = None,
        max_length: int = 128,
        val_fraction: float | None = None,
        test_fraction: float | None = None,
        public_fraction: float = 0.0,
        split_seed: int = 0,
        batch_size: int = 32,
        public_batch_size: int = 32,
        eval_batch_size: int = 256,
        **kwargs: Any,
    ) -> None:
        if prompt is not None and (tokenizer is not None or template is not None):
            raise ConfigError("give either prompt (its tokenizer and template are used) or tokenizer and template.")
        if prompt is None and tokenizer is None:
            raise ConfigError("TextDataModule needs a tokenizer (a local directory or a loaded tokenizer) or a prompt.")
        self.tokenizer = prompt.tokenizer if prompt is not None else tokenizer
        if isinstance(self.tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer), local_files_only=True)
        self.template = prompt.template if prompt is not None else template or TEXT
        self.max_length = max_length
        columns = dict(text_column=text_column, label_column=label_column)
        pool = (*read_texts(data, **columns), *([] if user_column is None else read_columns(data, [user_column])))
        given = {
            name: None if source is None else _with_users(read_texts(source, **columns), user_column)
            for name, source in {"public": public, "val": val, "test": test}.items()
        }
        split_by = None if user_column is None else 2  # a user's records land in one split
        raw = carve_splits(pool, given, test_fraction, val_fraction, public_fraction, split_seed, split_by)
        num_labels = len(label_names) if label_names else getattr(prompt, "num_labels", None)
        splits = {name: self._tokenized(split[0], split[1], label_names, num_labels) for name, split in raw.items()}
        kwargs.setdefault("collate_fn", token_padding(self.tokenizer))
        if user_column is not None:
            if kwargs.get("user_of") is not None:
                raise ConfigError("give either user_column (the users are read from the data) or user_of, not both.")
            kwargs["user_of"] = raw["private"][2]
        super().__init__(
            splits,
            batch_size=batch_size,
            public_batch_size=public_batch_size,
            eval_batch_size=eval_batch_size,
            **kwargs,
        )

    def _tokenized(
        self, texts: list[str], labels: list, label_names: list[str] | None, num_labels: int | None
    ) -> TokenizedTexts:
        encoded = encode_labels(labels, label_names)
        if num_labels is not None and len(encoded) and int(encoded.max()) >= num_labels:
            raise ConfigError(f"a label is >= the number of classes ({num_labels}).")
        ids = tokenize_prompts(texts, self.tokenizer, self.template, self.max_length)
        return TokenizedTexts(list(texts), ids, encoded)
