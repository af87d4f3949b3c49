"""The per-sample loss contract: one loss value per example, checked on every call.

A private method needs one loss value per example. ``loss`` is either a name
(``"cross_entropy"``, ``"mse"``, ``"causal_lm"``) or a callable ``(net, batch) -> Tensor[B]``; :func:`check_per_sample`
enforces the contract on every call: a scalar (batch mean), a wrong length or an integer
dtype raises, because clipping a batch mean silently breaks the sensitivity bound.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import nn

from pl_dp.errors import ConfigError
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


def forward(net: nn.Module, inputs: Any) -> torch.Tensor:
    """Call ``net`` on inputs (a tensor or keyword mapping); unwrap Hugging Face outputs to logits."""
    out = net(**inputs) if isinstance(inputs, Mapping) else net(inputs)
    return getattr(out, "logits", out)


def cross_entropy(net: nn.Module, batch: Any) -> torch.Tensor:
    """Per-example cross-entropy, computed in fp32 whatever the model's dtype."""
    inputs, targets = split_inputs_targets(batch)
    return F.cross_entropy(forward(net, inputs).float(), targets, reduction="none")


def mse(net: nn.Module, batch: Any) -> torch.Tensor:
    """Per-example mean squared error (mean over all but the batch dimension), in fp32."""
    inputs, targets = split_inputs_targets(batch)
    err = (forward(net, inputs).float() - targets.float()) ** 2
    return err.reshape(err.shape[0], -1).mean(dim=1)


#: the target value Hugging Face ignores in token-level labels (and :class:`~pl_dp.data.collate.PaddingCollate` pads
#: labels with)
IGNORE_INDEX = -100


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
    nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
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
