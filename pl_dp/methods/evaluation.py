"""Evaluation and prediction of a private method: loss/accuracy per stage, or the user's own module's steps.

The private method replaces training only. When ``net`` is a LightningModule with its own
``validation_step``/``test_step``/``predict_step`` and epoch hooks, those run as written (its metrics
and ``self.log`` included); otherwise pl_dp logs ``<stage>/loss`` through the training loss and, with the
built-in cross-entropy on classifiers, ``<stage>/acc`` (torchmetrics). Evaluation data (validation, test) is not
private and costs nothing.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics

from pl_dp.methods.host import Host
from pl_dp.step.batches import batch_size_of, prediction_inputs
from pl_dp.step.losses import check_per_sample, cross_entropy, forward, split_inputs_targets


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

    def _metric(self, name: str, num_classes: int) -> torchmetrics.Metric:
        if name not in self._metrics:
            metric = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes, average="micro")
            self._metrics[name] = metric.to(self.device)
        return self._metrics[name]

    def _evaluate(self, batch: Any, stage: str) -> None:
        """Log the mean per-example loss of ``batch`` under ``stage``, and accuracy for classifiers.

        The loss is the one training uses: the user's callable as it is (pl_dp then never calls the net itself,
        which may have no ``forward``, take the targets too, or need its inputs cast), or a built-in one; with
        ``"cross_entropy"`` the one forward also gives accuracy when the output is ``[B, K]`` logits.
        """
        size = batch_size_of(batch)
        if size == 0:
            return
        logits = targets = None
        if self.loss_fn is cross_entropy:  # one forward gives the loss and the accuracy
            inputs, targets = split_inputs_targets(batch)
            logits = forward(self.net, inputs)
            losses = F.cross_entropy(logits.float(), targets, reduction="none")
        else:
            losses = check_per_sample(self.loss_fn(self.net, batch), size)
        self.log(
            f"{stage}/loss", losses.float().mean(), on_epoch=True, prog_bar=stage == "val", sync_dist=self.data_parallel
        )
        if logits is not None and targets is not None and logits.dim() == 2 and targets.dim() == 1:
            name = f"{stage}_acc".replace("/", "_")
            metric = self._metric(name, logits.shape[-1])
            metric(logits, targets)
            self.log(
                f"{stage}/acc", metric, on_epoch=True, prog_bar=stage == "val", metric_attribute=f"_metrics.{name}"
            )

    def _log_private_metrics(self, batch: Any) -> None:
        """Training loss/accuracy on the private batch, un-noised: only under ``log_private_metrics``."""
        with torch.no_grad():
            self._evaluate(batch, "diagnostics/not_private/train")
