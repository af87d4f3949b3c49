"""Evaluation and prediction of a private method: loss/accuracy per stage, or the user's own module's steps.

The private method replaces training only. When ``net`` is a LightningModule with its own
``validation_step``/``test_step``/``predict_step`` and epoch hooks, those run as written (its metrics
and ``self.log`` included); otherwise pl_dp logs ``<stage>/loss`` through the training loss and, with the
built-in cross-entropy on classifiers, ``<stage>/acc`` (torchmetrics), and with ``loss="causal_lm"``
``<stage>/perplexity`` (token level, :class:`TokenPerplexity`). Evaluation data (validation, test) is not
private and costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import torch
import torchmetrics

from pl_dp.methods.host import Host
from pl_dp.step.batches import batch_size_of, prediction_inputs
from pl_dp.step.losses import (
    IGNORE_INDEX,
    causal_lm,
    causal_lm_token_losses,
    check_per_sample,
    class_losses,
    cross_entropy,
    forward,
    split_inputs_targets,
)


class TokenPerplexity(torchmetrics.Metric):
    """Token-level perplexity exp(Σ NLL / Σ tokens) over every batch of an epoch (summed across processes), the
    number :func:`pl_dp.nets.perplexity` gives for the same data. Evaluation data is not private: no privacy cost.

    Not ``torchmetrics.text.Perplexity``, which takes the ``[B, T, V]`` logits and recomputes their log-softmax:
    the evaluation already has each sequence's summed NLL and token count from the loss's one forward, and this
    metric only adds them up (two scalars of state, reduced like any torchmetrics state)."""

    full_state_update = False
    higher_is_better = False
    nll: torch.Tensor  # Σ NLL over the tokens seen (fp64)
    tokens: torch.Tensor  # how many tokens

    def __init__(self) -> None:
        super().__init__()
        self.add_state("nll", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, nll: torch.Tensor, tokens: torch.Tensor) -> None:
        """``nll``: each sequence's summed next-token NLL, ``tokens``: how many tokens it sums (``[B]`` each)."""
        # out of place, as torchmetrics' own metrics: a state made under inference mode (trainer.validate) cannot be
        # updated in place outside it (a fit's validation)
        self.nll = self.nll + nll.detach().double().sum()
        self.tokens = self.tokens + tokens.sum()

    def compute(self) -> torch.Tensor:
        return torch.exp(self.nll / self.tokens.clamp_min(1))


class EvaluationMixin(Host):
    """Lightning's evaluation and prediction hooks for a :class:`~pl_dp.methods.base.PrivateModule`.

    Uses the module's ``net``, ``loss_fn``, ``_metrics`` (a ``ModuleDict``) and ``data_parallel``.
    """

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        own = self._user_hook("validation_step")
        return own(batch, batch_idx) if own else self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        own = self._user_hook("test_step")
        return own(batch, batch_idx) if own else self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """``net``'s outputs (logits for classifiers) on the inputs of ``batch``: (x, y), x-only or a dict."""
        own = self._user_hook("predict_step")
        if own:
            return own(batch, batch_idx)
        return forward(self.net, prediction_inputs(batch))

    def on_validation_epoch_start(self) -> None:
        self._run_user_hook("on_validation_epoch_start")

    def on_validation_epoch_end(self) -> None:
        self._run_user_hook("on_validation_epoch_end")

    def on_test_epoch_start(self) -> None:
        self._run_user_hook("on_test_epoch_start")

    def on_test_epoch_end(self) -> None:
        self._run_user_hook("on_test_epoch_end")

    def _user_hook(self, name: str) -> Any:
        """``net``'s own ``name`` hook when ``net`` is a LightningModule that defines it, else None.

        Lightning hands the Trainer to child modules; the hook runs under this module's current hook
        name so that the user's ``self.log`` calls are managed by the Trainer as usual.
        """
        net = self.net
        if not isinstance(net, L.LightningModule) or getattr(type(net), name) is getattr(L.LightningModule, name):
            return None

        def call(*args: Any) -> Any:
            net._current_fx_name = self._current_fx_name
            try:
                return getattr(net, name)(*args)
            finally:
                net._current_fx_name = None

        return call

    def _run_user_hook(self, name: str) -> None:
        own = self._user_hook(name)
        if own:
            own()

    def _update_metric(self, stage: str, key: str, make: Callable[[], torchmetrics.Metric], *values: Any) -> None:
        """Update the epoch metric ``<stage>/<key>`` (made by ``make`` on first use) with ``values`` and log it."""
        name = f"{stage}_{key}".replace("/", "_")
        if name not in self._metrics:
            self._metrics[name] = make().to(self.device)
        metric = self._metrics[name]
        metric(*values)  # forward: the epoch state, and the batch's value for a metric logged per step
        self.log(f"{stage}/{key}", metric, on_epoch=True, prog_bar=stage == "val", metric_attribute=f"_metrics.{name}")

    def _evaluate(self, batch: Any, stage: str) -> None:
        """Log the mean per-example loss of ``batch`` under ``stage``, accuracy for classifiers and perplexity for
        causal language models.

        The loss is the one training uses: the user's callable as it is (pl_dp then never calls the net itself,
        which may have no ``forward``, take the targets too, or need its inputs cast), or a built-in one; with
        ``"cross_entropy"`` the one forward also gives accuracy when the output is ``[B, K]`` logits, with
        ``"causal_lm"`` the token-level perplexity of the epoch (:class:`TokenPerplexity`).
        """
        size = batch_size_of(batch)
        if size == 0:
            return
        logits = targets = None
        if self.loss_fn is cross_entropy:  # one forward gives the loss and the accuracy
            inputs, targets = split_inputs_targets(batch)
            logits = forward(self.net, inputs)
            losses = class_losses(logits.float(), targets)  # an out-of-range label: NaN, as in training
        elif self.loss_fn is causal_lm:  # one forward gives the loss and the perplexity
            nll, tokens = causal_lm_token_losses(self.net, batch)
            losses = nll / tokens.clamp_min(1)  # causal_lm's own per-sequence loss
            self._update_metric(stage, "perplexity", TokenPerplexity, nll, tokens)
        else:
            losses = check_per_sample(self.loss_fn(self.net, batch), size)
        self.log(
            f"{stage}/loss", losses.float().mean(), on_epoch=True, prog_bar=stage == "val", sync_dist=self.data_parallel
        )
        if logits is not None and targets is not None and logits.dim() == 2 and targets.dim() == 1:
            classes = logits.shape[-1]
            accuracy = partial(
                torchmetrics.classification.MulticlassAccuracy,
                num_classes=classes,
                average="micro",
                ignore_index=IGNORE_INDEX,
            )
            scored = (targets >= 0) & (targets < classes)  # an out-of-range label is not scored (no host sync)
            self._update_metric(stage, "acc", accuracy, logits, targets.masked_fill(~scored, IGNORE_INDEX))

    def _log_private_metrics(self, batch: Any) -> None:
        """Training loss/accuracy on the private batch, un-noised: only under ``log_private_metrics``."""
        with torch.no_grad():
            self._evaluate(batch, "diagnostics/not_private/train")
