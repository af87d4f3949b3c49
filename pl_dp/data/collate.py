"""Batching examples whose tensors differ in length (tokenized text) by padding them: to the longest of the batch, or
to one fixed length."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from pl_dp.errors import ConfigError

#: pad values of the keys Hugging Face tokenizers and models use; anything else pads with 0
PAD_VALUES: dict[str, int] = {"labels": -100, "attention_mask": 0, "input_ids": 0, "token_type_ids": 0}


class PaddingCollate:
    """``default_collate``, except that 1-D tensors of different lengths are right-padded to the longest, with a mask.

    Dict examples (``{"input_ids": ..., "attention_mask": ..., "labels": ...}``) pad each key with its
    value in ``pad_values`` (``PAD_VALUES`` by default: 0, and −100 for token-level labels); when they carry no
    ``attention_mask``, one is added (1 on each example's own positions of its ``input_ids`` if it has them, else
    of its first ragged key; 0 on padding).
    Tuple examples pad with 0, which the net must read as padding (``TinyTransformerClassifier`` does:
    ``pad_token_id=0``). Examples of equal shapes batch exactly as ``default_collate`` does. By default padding is
    per batch (dynamic), so a batch costs what its longest example costs. With ``length``, every sequence field is
    padded to exactly ``length``, so every batch has one shape whatever was sampled: the fields of 1-D tensors of
    different lengths, and those of 1-D integer tensors (token ids, masks, token labels) even when a batch's are
    equally long; 1-D floating-point fields of one length (feature vectors) are left as they are. An example longer
    than ``length`` raises ``ValueError`` (the pre-flight pass names it before training).

    Privacy: padding on the right keeps each example's own values, at its own positions, in its own row, whatever
    else is sampled; only the padded length depends on the batch. A net that masks the padding (attention mask 0
    for keys, weight 0 in pooling; causal attention never reaches later positions) computes each example's loss
    from that example alone. One that does not — mean-pooling over padded positions, attending to them — makes
    every loss depend on the longest example sampled: the fit-start probe (:mod:`pl_dp.step.independence`)
    refuses such a net, through this collate, before any step. In half precision even a masking net is not enough:
    a longer padded length changes the order of the sums over positions (attention, the loss), hence the bf16
    rounding of every example's result; a fixed ``length`` takes that away (the text data modules set it one past
    their ``max_length`` for the private batches of a run that computes in half precision). Choose ``length`` above
    the longest example: a batch none of whose rows is padded loses its attention mask in Hugging Face models, and a
    GPU then runs another attention kernel for it (FlashAttention), which rounds every row otherwise (a run that keeps
    one shape refuses an example that fills ``length``, before any step).
    """

    #: its batch's shapes are a function of its examples' shapes alone (the pre-flight pass relies on it)
    shapes_follow_shapes = True

    @property
    def stacks_equal_rows(self) -> bool:
        """Whether examples of equal shapes batch as ``default_collate`` stacks them: always but with ``length``,
        which pads integer rows (the private loader then reads a ``TensorDataset``'s rows at once; a subclass must
        declare it again, since it may batch otherwise)."""
        return self.length is None

    def __init__(self, pad_values: Mapping[str, int] | None = None, length: int | None = None) -> None:
        self.pad_values = dict(PAD_VALUES if pad_values is None else pad_values)
        if length is not None and (isinstance(length, bool) or int(length) != length or length < 1):
            raise ConfigError(f"length must be an integer >= 1 or None, got {length!r}.")
        self.length = None if length is None else int(length)

    def fixed(self, length: int) -> PaddingCollate:
        """This collate with every batch padded to exactly ``length``: a shallow copy of it, so that a subclass keeps
        what it adds (the private loader of a run that keeps one shape, and the probe, use this copy in its place). A
        subclass holding state of its own per instance (a cache of batches) overrides it."""
        fixed = copy.copy(self)
        fixed.pad_values = dict(self.pad_values)
        fixed.length = PaddingCollate(length=length).length  # checked as the constructor checks it
        return fixed

    def __call__(self, examples: list[Any]) -> Any:
        first = examples[0]
        if isinstance(first, Mapping):
            columns = {key: [e[key] for e in examples] for key in first}
            ragged = [key for key, values in columns.items() if self._ragged(values)]
            if ragged:
                batch = {key: self._stack(values, self.pad_values.get(key, 0)) for key, values in columns.items()}
                if "attention_mask" not in batch:
                    # the token ids' when the examples have them (labels may be longer), whatever else is ragged
                    tokens = "input_ids" if self._sequences(columns.get("input_ids")) else ragged[0]
                    lengths = torch.tensor([len(v) for v in columns[tokens]])
                    width = batch[tokens].shape[-1]
                    batch["attention_mask"] = (torch.arange(width) < lengths.unsqueeze(1)).long()
                return batch
        elif isinstance(first, (tuple, list)):
            columns = list(zip(*examples))
            if any(map(self._ragged, columns)):
                return type(first)(self._stack(list(values), 0) for values in columns)
        return default_collate(examples)

    @staticmethod
    def _sequences(values: Sequence[Any] | None) -> bool:
        """Whether ``values`` are 1-D tensors (of any lengths)."""
        return values is not None and all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in values)

    def _ragged(self, values: Sequence[Any]) -> bool:
        """Whether ``values`` are 1-D tensors to pad: of more than one length, or integer ones with ``length``."""
        if not self._sequences(values):
            return False
        fixed = self.length is not None and not any(v.is_floating_point() or v.is_complex() for v in values)
        return fixed or len({len(v) for v in values}) > 1

    def _stack(self, values: list[Any], pad_value: int) -> Any:
        if not self._ragged(values):
            return default_collate(values)
        longest = max(len(v) for v in values)
        if self.length is not None and longest > self.length:
            raise ValueError(
                f"an example of {longest} positions is longer than the fixed padded length {self.length}: cut it in "
                "the Dataset (the text data modules cut at max_length) or raise the length."
            )
        padded = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=pad_value)
        if self.length is not None and longest < self.length:
            padded = torch.nn.functional.pad(padded, (0, self.length - longest), value=pad_value)
        return padded
