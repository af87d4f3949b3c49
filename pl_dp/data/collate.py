"""Batching examples whose tensors differ in length (tokenized text) by padding them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

#: pad values of the keys Hugging Face tokenizers and models use; anything else pads with 0
PAD_VALUES: dict[str, int] = {"labels": -100, "attention_mask": 0, "input_ids": 0, "token_type_ids": 0}


class PaddingCollate:
    """``default_collate``, except that 1-D tensors of different lengths are right-padded to the longest.

    Dict examples (``{"input_ids": ..., "attention_mask": ..., "labels": ...}``) pad each key with its
    value in ``pad_values`` (``PAD_VALUES`` by default: 0, and −100 for token-level labels); tuple
    examples pad with 0. Examples of equal shapes batch exactly as ``default_collate`` does. Padding is
    per batch (dynamic), so a batch costs what its longest example costs. A padded position changes no
    per-example value when the model masks it (attention mask 0): each example's loss still depends
    on that example only.
    """

    def __init__(self, pad_values: Mapping[str, int] | None = None) -> None:
        self.pad_values = dict(PAD_VALUES if pad_values is None else pad_values)

    def __call__(self, examples: list[Any]) -> Any:
        first = examples[0]
        if isinstance(first, Mapping):
            columns = {key: [e[key] for e in examples] for key in first}
            if any(map(_ragged, columns.values())):
                return {key: _stack(values, self.pad_values.get(key, 0)) for key, values in columns.items()}
        elif isinstance(first, (tuple, list)):
            columns = list(zip(*examples))
            if any(map(_ragged, columns)):
                return type(first)(_stack(list(values), 0) for values in columns)
        return default_collate(examples)


def _ragged(values: Sequence[Any]) -> bool:
    """Whether ``values`` are 1-D tensors of more than one length."""
    return all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in values) and len({len(v) for v in values}) > 1


def _stack(values: list[Any], pad_value: int) -> Any:
    if _ragged(values):
        return torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=pad_value)
    return default_collate(values)
