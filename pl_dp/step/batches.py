"""The structure of a batch: its size, its device, micro-batches and chosen examples of it, its inputs.

A batch is a tensor, or a mapping or sequence of them (nested at any depth), whose tensors hold one row per
example along their first dimension; a per-example list (texts) counts as a column too. These helpers cut and
read a batch without knowing its fields, which is what lets a method, the pre-flight pass and the seal handle
whatever a loader yields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate


def batch_size_of(batch: Any) -> int:
    """Number of examples in ``batch``: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                return batch_size_of(value)
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        for value in batch:
            if isinstance(value, (torch.Tensor, Mapping, Sequence)):
                try:
                    return batch_size_of(value)
                except TypeError:
                    continue
    raise TypeError(f"cannot find a tensor in the batch to size it (got {type(batch).__name__}).")


def device_of(batch: Any) -> torch.device:
    """The device of the first tensor in ``batch`` (the CPU when it holds none)."""
    found = _first_device(batch)
    return torch.device("cpu") if found is None else found


def _first_device(batch: Any) -> torch.device | None:
    if isinstance(batch, torch.Tensor):
        return batch.device
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((d for d in map(_first_device, values) if d is not None), None)


def split_batch(batch: Any, size: int | None) -> list[Any]:
    """``batch`` cut into consecutive micro-batches of at most ``size`` examples (all of it when ``size`` is None).

    Every tensor is sliced along its first (example) dimension; mappings and sequences keep their
    structure. Per-example quantities computed micro-batch by micro-batch are those of the whole
    batch, because each example's loss depends on that example alone (per-example independence, checked at
    fit start by :mod:`pl_dp.step.independence`).
    """
    total = batch_size_of(batch)
    if size is None or total <= size:
        return [batch]
    return [_take(batch, slice(start, min(start + size, total)), total) for start in range(0, total, size)]


def fill_rows(batch: Any, rows: int) -> Any:
    """``batch`` with its first example repeated until it has ``rows`` examples (the batch as it is when it has
    that many or more, or none).

    A run that must keep one batch shape (half precision: the rounding of every example's result depends on the
    shape of the batch it is computed in) runs every micro-batch filled to the same number of rows and drops the
    results of the filling rows; per-example independence makes what they hold irrelevant to the others.
    """
    size = batch_size_of(batch)
    if size == 0 or size >= rows:
        return batch
    return select_examples(batch, torch.cat([torch.arange(size), torch.zeros(rows - size, dtype=torch.long)]))


def select_examples(batch: Any, index: torch.Tensor) -> Any:
    """The examples of ``batch`` at positions ``index`` (a 1-d integer tensor), in that order, same structure."""
    return _take(batch, index, batch_size_of(batch))


def _take(batch: Any, index: slice | torch.Tensor, size: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[index if isinstance(index, slice) else index.to(batch.device)]
    if isinstance(batch, Mapping):
        return {k: _take(v, index, size) for k, v in batch.items()}
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        rebuild: Any = type(batch)  # a list, a tuple, …: the concrete type of the batch
        if len(batch) == size and all(isinstance(v, (str, bytes, int, float)) for v in batch):
            rows = range(size)[index] if isinstance(index, slice) else index.tolist()
            return rebuild(batch[i] for i in rows)  # a per-example list, e.g. texts
        return rebuild(_take(v, index, size) for v in batch)
    return batch


def prediction_inputs(batch: Any) -> Any:
    """The inputs of a batch for prediction: ``x`` of (x, y) or of an x-only [x], a dict without ``labels``."""
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if k != "labels"}
    if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) in (1, 2):
        return batch[0]
    return batch


def example_structure(example: Any) -> Any:
    """What a collate reads to decide how to batch an example, without its values: the types, the keys of
    mappings, the lengths of sequences, and the dtype and number of dimensions of arrays (not their sizes, which
    padding may equalize). ``default_collate`` and :class:`~pl_dp.data.collate.PaddingCollate` take the batch's
    keys and dtypes from its *first* example, so examples of another structure batch differently — or not at all —
    depending on which example comes first."""
    if isinstance(example, torch.Tensor):
        return ("tensor", str(example.dtype), example.dim())
    if isinstance(example, np.ndarray):
        return ("ndarray", example.dtype.str, example.ndim)
    if isinstance(example, Mapping):
        return ("mapping", tuple(sorted((str(k), example_structure(v)) for k, v in example.items())))
    if isinstance(example, (list, tuple)):
        return (type(example).__name__, tuple(example_structure(v) for v in example))
    return (type(example).__name__,)


def stacks_tensor_rows(dataset: Dataset, collate_fn: Callable[[list], Any]) -> bool:
    """Whether ``collate_fn``'s batch of examples of ``dataset`` is the list of its tensors' rows stacked, so that the
    rows may be read at once (one indexing per tensor) in place of collating examples read one by one: a plain
    ``TensorDataset`` (rows of the same tensors: one structure, rows that cannot fail to read) of dense tensors of
    its length (a nested tensor cannot be indexed by rows; a shorter tensor has rows that fail to read), and
    ``default_collate`` or a collate whose own class (not a parent's: a subclass may batch otherwise) has
    ``stacks_equal_rows`` and says so (:class:`~pl_dp.data.collate.PaddingCollate` without a fixed length)."""
    if type(dataset) is not TensorDataset:
        return False
    declared = "stacks_equal_rows" in type(collate_fn).__dict__
    stacks = collate_fn is default_collate or (declared and bool(getattr(collate_fn, "stacks_equal_rows", False)))
    tensors = dataset.tensors
    return stacks and all(t.layout == torch.strided and not t.is_nested and len(t) == len(dataset) for t in tensors)
