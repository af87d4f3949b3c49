"""Batching examples whose tensors differ in length (tokenized text) by padding them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

#: pad values of the keys Hugging Face tokenizers and models use; anything else pads with 0
PAD_VALUES: dict[str, int] = {"labels": -100, "attention_mask": 0, "input_ids": 0, "token_type_ids": 0}


class PaddingCollate:
    """``default_collate``, except that 1-D tensors of different lengths are right-padded to the longest, with a mask.

    Dict examples (``{"input_ids": ..., "attention_mask": ..., "labels": ...}``) pad each key with its
    value in ``pad_values`` (``PAD_VALUES`` by default: 0, and −100 for token-level labels); when they carry no
    ``attention_mask``, one is added (1 on each example's own positions of its first ragged key, 0 on padding).
    Tuple examples pad with 0, which the net must read as padding (``TinyTransformerClassifier`` does:
    ``pad_token_id=0``). Examples of equal shapes batch exactly as ``default_collate`` does. Padding is per batch
    (dynamic), so a batch costs what its longest example costs.

    Privacy: padding on the right keeps each example's own values, at its own positions, in its own row, whatever
    else is sampled; only the padded length depends on the batch. A net that masks the padding (attention mask 0
    for keys, weight 0 in pooling; causal attention never reaches later positions) computes each example's loss
    from that example alone. One that does not — mean-pooling over padded positions, attending to them — makes
    every loss depend on the longest example sampled: the fit-start probe (:mod:`pl_dp.privacy.independence`)
    refuses such a net, through this collate, before any step.
    """

    def __init__(self, pad_values: Mapping[str, int] | None = None) -> None:
        self.pad_values = dict(PAD_VALUES if pad_values is None else pad_values)

    def __call__(self, examples: list[Any]) -> Any:
        first = examples[0]
        if isinstance(first, Mapping):
            columns = {key: [e[key] for e in examples] for key in first}
            ragged = [key for key, values in columns.items() if _ragged(values)]
            if ragged:
                batch = {key: _stack(values, self.pad_values.get(key, 0)) for key, values in columns.items()}
                if "attention_mask" not in batch:
                    lengths = torch.tensor([len(v) for v in columns[ragged[0]]])
                    batch["attention_mask"] = (torch.arange(int(lengths.max())) < lengths.unsqueeze(1)).long()
                return batch
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
