"""The per-sample loss contract: one loss value per example, checked on every call.

A private method needs one loss value per example. ``loss`` is either a name
(``"cross_entropy"``, ``"mse"``, ``"causal_lm"``) or a callable ``(net, batch) -> Tensor[B]``; :func:`check_per_sample`
enforces the contract on every call: a scalar (batch mean), a wrong length or an integer
dtype raises, because clipping a batch mean silently breaks the sensitivity bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import nn

from pl_dp.errors import ConfigError, DataError
from pl_dp.step.batches import prediction_inputs

PerSampleLoss = Callable[[nn.Module, Any], torch.Tensor]
LossSpec = Union[str, PerSampleLoss]


def split_inputs_targets(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(x, y)`` from a tuple/list batch or a mapping with a ``labels`` key."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise KeyError(f"a dict batch needs a 'labels' entry for the built-in losses. {_OWN_LOSS}")
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return inputs, batch["labels"]
    if isinstance(batch, Sequence) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"the built-in losses need a batch (inputs, targets) or a dict with 'labels'. {_OWN_LOSS}")


_OWN_LOSS = (
    "For batches of another shape (no targets, more fields, a net that takes several inputs), pass loss= a callable "
    "(net, batch) -> Tensor[B] that returns one loss per example."
)


def kind_of(value: Any) -> str:
    """What ``value`` is, by type only (never its contents, which may come from private examples): ``"a Tensor"``,
    ``"a tuple of 2 (Tensor, Tensor)"``, ``"a tuple of str"`` (a collated batch of strings), ``"a dict with keys
    ['hidden', 'out']"`` (keys are the code's), ``"None"``."""
    if value is None:
        return "None"
    name = type(value).__name__
    if isinstance(value, Mapping):
        return f"a {name} with keys {sorted(str(key) for key in value)[:8]}"
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(item).__name__ for item in value})
        if len(kinds) == 1 and not isinstance(value[0], (torch.Tensor, list, tuple, Mapping)):
            return f"a {name} of {kinds[0]}"  # a batch of scalars: how many is the batch size, left out
        items = ", ".join(type(item).__name__ for item in value[:4]) + (", …" if len(value) > 4 else "")
        return f"a {name} of {len(value)} ({items})"
    return f"a {name}"


def forward(net: nn.Module, inputs: Any) -> torch.Tensor:
    """Call ``net`` on inputs (a tensor or keyword mapping); unwrap Hugging Face outputs to logits.

    Raises :class:`~pl_dp.errors.ConfigError` when the net returns something other than a tensor (or an output with
    a tensor ``logits``), e.g. ``return logits, hidden``: the built-in losses need the logits alone."""
    out = net(**inputs) if isinstance(inputs, Mapping) else net(inputs)
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(
            f"the net returned {kind_of(out)}, not a tensor of logits: the built-in losses (loss='cross_entropy', "
            "'mse', 'causal_lm') need the net to return one tensor, the logits, of shape (batch, classes) (or "
            "(batch, tokens, vocabulary) for 'causal_lm'; a Hugging Face output with .logits is fine). Make the "
            "net's forward return the logits alone (`return logits`, not `return logits, hidden`), or pass loss= "
            "a callable (net, batch) -> Tensor[B] of your own that takes them from what the net returns."
        )
    return logits


def _target_tensor(targets: Any, loss: str, needed: str, example: str) -> torch.Tensor:
    """``targets`` if it is a tensor; else a :class:`~pl_dp.errors.DataError` naming its type (not its values)."""
    if isinstance(targets, torch.Tensor):
        return targets
    raise DataError(
        f"the labels of the batch are {kind_of(targets)}, not a tensor: loss={loss!r} needs {needed}. {example}"
    )


_CLASS_INDICES = (
    "Map each label to its integer class index in your Dataset, e.g. index = {name: i for i, name in "
    "enumerate(sorted(class_names))} once, then `return x, index[label]` in __getitem__ (the label a Python int or a "
    "0-d torch.long tensor)."
)


#: the target value Hugging Face ignores in token-level labels (and :class:`~pl_dp.data.collate.PaddingCollate` pads
#: labels with)
IGNORE_INDEX = -100


def cross_entropy(net: nn.Module, batch: Any) -> torch.Tensor:
    """Per-example cross-entropy, computed in fp32 whatever the model's dtype."""
    inputs, targets = split_inputs_targets(batch)
    logits = forward(net, inputs).float()
    needed = "integer class indices (a torch.long tensor of shape (batch,))"
    return class_losses(logits, _target_tensor(targets, "cross_entropy", needed, _CLASS_INDICES))


def class_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits, targets, reduction="none")`` (classes along dimension 1, :data:`IGNORE_INDEX`
    ignored), except that a class index outside ``[0, K)`` gives a NaN loss instead of an error.

    Privacy: an out-of-range label raises an IndexError on a CPU and, on CUDA, trips a device-side assert that ends
    the process (it cannot be caught) — either says whether the record was sampled. A NaN loss is what a private
    step already handles without a word, and the pre-flight pass names it before training. What the row then
    contributes, always within the clip bound: nothing to a zeroth-order step (a non-finite loss, counted privately
    with the others); no gradient to a first-order one (the filled row's gradient is 0: not counted as non-finite);
    for ``causal_lm``, where one token's label is out of range, the sequence's loss is NaN — a zeroth-order step
    drops the sequence, a first-order one takes the clipped gradient of its other tokens. The check runs on the
    device: no host synchronization."""
    if targets.is_floating_point():  # class probabilities: nothing to index
        return F.cross_entropy(logits, targets, reduction="none")
    valid = ((targets >= 0) & (targets < logits.shape[1])) | (targets == IGNORE_INDEX)
    losses = F.cross_entropy(logits, targets.masked_fill(~valid, 0), ignore_index=IGNORE_INDEX, reduction="none")
    return losses.masked_fill(~valid, math.nan)


def mse(net: nn.Module, batch: Any) -> torch.Tensor:
    """Per-example mean squared error (mean over all but the batch dimension), in fp32."""
    inputs, targets = split_inputs_targets(batch)
    needed = "numeric targets (a float tensor of the net's output shape)"
    example = "Return each target as a number or a float tensor from your Dataset."
    err = (forward(net, inputs).float() - _target_tensor(targets, "mse", needed, example).float()) ** 2
    return err.reshape(err.shape[0], -1).mean(dim=1)


def next_token_targets(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The target of each position's next-token prediction, ``[B, T-1]``: ``labels`` (or ``input_ids`` where no
    labels are given) shifted left by one, with :data:`IGNORE_INDEX` wherever the target is not to be predicted —
    a −100 label, or a padded position (``attention_mask`` 0) when the labels are the input ids."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(f"loss='causal_lm' needs dict batches with 'input_ids' (and 'attention_mask'). {_OWN_LOSS}")
    ids = batch["input_ids"]
    if "labels" in batch:
        labels = batch["labels"]
        if labels.shape != ids.shape:
            raise ValueError(
                f"loss='causal_lm' needs token-level labels of the input ids' shape {tuple(ids.shape)}, got "
                f"{tuple(labels.shape)} (class labels belong to loss='cross_entropy')."
            )
    else:
        labels = ids
        if "attention_mask" in batch:
            labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    return labels[:, 1:]


def causal_lm_token_losses(net: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example: the summed next-token negative log-likelihood (fp32) and the number of tokens it sums, ``[B]``
    each. The net sees every key of the batch but ``labels`` (Hugging Face models would reduce them to a batch
    mean); position t predicts the target at t + 1 (:func:`next_token_targets`)."""
    targets = next_token_targets(batch)
    logits = forward(net, prediction_inputs(batch))[:, :-1].float()
    if logits.shape[:2] != targets.shape:
        shape = tuple(batch["input_ids"].shape)
        raise ValueError(f"the net returned logits of shape {tuple(logits.shape)} for input ids of shape {shape}.")
    nll = class_losses(logits.transpose(1, 2), targets)
    return nll.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)


def causal_lm(net: nn.Module, batch: Any) -> torch.Tensor:
    """Per-sequence causal language-modelling loss: the mean next-token cross-entropy over the sequence's targets.

    For dict batches ``{"input_ids", "attention_mask"[, "labels"]}`` of right-padded sequences and a net returning
    ``[B, T, V]`` logits (a Hugging Face causal LM, e.g. :class:`~pl_dp.nets.CausalLM`). The targets are the input
    ids shifted by one, padding ignored; token-level ``labels`` (−100 ignored, as in Hugging Face) choose them
    instead — e.g. the completion only, after a prompt. One example is one sequence: DP protects a sequence, not a
    token, and the mean over its own tokens keeps every sequence's weight in the batch sum the same (its gradient is
    clipped as one). A sequence without targets has loss 0 (and gradient 0). Computed in fp32 from the logits.
    """
    total, count = causal_lm_token_losses(net, batch)
    return total / count.clamp_min(1)


_LOSSES: dict[str, PerSampleLoss] = {"cross_entropy": cross_entropy, "mse": mse, "causal_lm": causal_lm}


def resolve_loss(loss: LossSpec) -> PerSampleLoss:
    if callable(loss):
        return loss
    try:
        return _LOSSES[loss]
    except KeyError:
        raise ConfigError(
            f"unknown loss {loss!r}: use one of {sorted(_LOSSES)} or a callable (net, batch) -> Tensor[B]."
        ) from None


def check_per_sample(losses: Any, batch_size: int) -> torch.Tensor:
    """Enforce the per-sample contract and return the losses as an fp32 vector of length B."""
    if not isinstance(losses, torch.Tensor):
        raise TypeError(f"the per-sample loss must return a Tensor[B], got {type(losses).__name__}.")
    if losses.dim() != 1 or losses.shape[0] != batch_size:
        raise ValueError(
            f"the per-sample loss must return one value per example, a Tensor of shape [{batch_size}]; "
            f"got shape {tuple(losses.shape)}. A batch mean (reduction='mean') cannot be clipped per "
            "example: use reduction='none'."
        )
    if not torch.is_floating_point(losses):
        raise TypeError(f"the per-sample loss must be floating point, got dtype {losses.dtype}.")
    return losses.float()
