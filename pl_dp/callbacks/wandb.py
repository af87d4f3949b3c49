"""WandbPrivacyLogger: what a private run needs in Weights & Biases, at a glance.

* once, at fit start: the run config — method, the privacy spec, the calibrated noise
  multiplier, sample rate, δ, planned private steps, accountant and clip bound (every
  hyperparameter is logged by Lightning itself from the module's ``hparams``);
* every step, through the module's own ``self.log`` (so CSV and TensorBoard get the same keys):
  ``privacy/epsilon``, ``privacy/budget_left``, ``privacy/private_steps`` and the method's
  privatized statistics (α, chosen candidate, …); non-private diagnostics only when the module's
  ``log_private_metrics`` is on, under ``diagnostics/not_private/``;
* at the end: a summary with the exact final ε, δ, private steps, best validation and test
  accuracy.

With a :class:`~lightning.pytorch.loggers.WandbLogger` the config goes to ``run.config`` and the
summary to ``run.summary``; with any other logger both go through ``log_hyperparams`` /
``log_metrics``, so the callback is harmless there. Runs that share a W&B ``group`` give the
privacy–utility curve directly in the workspace: plot ``summary/test_acc`` against
``summary/epsilon`` over the group.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger


def privacy_config(pl_module: Any) -> dict[str, Any]:
    """The resolved privacy plan (Lightning itself logs the module's hyperparameters)."""
    config: dict[str, Any] = {"method": type(pl_module).__name__}
    spec = getattr(pl_module, "privacy", None)
    config["privacy/private"] = spec is not None
    if spec is not None:
        config.update({f"privacy/spec/{k}": v for k, v in spec.to_dict().items()})
        config.update(
            {
                "privacy/noise_multiplier": pl_module.noise_multiplier,
                "privacy/sample_rate": pl_module.sample_rate,
                "privacy/delta": pl_module.delta,
                "privacy/planned_steps": pl_module.planned_steps,
                "privacy/accountant": spec.accountant,
                "privacy/expected_batch_size": pl_module.expected_batch_size,
            }
        )
    clip = getattr(pl_module, "clip", None)
    clip_function = getattr(pl_module, "clip_function", None)
    if clip_function is not None:
        clip = clip_function.clip
        config["privacy/clip_fn"] = clip_function.kind
    config["privacy/clip"] = clip
    return config


class WandbPrivacyLogger(L.Callback):
    """Logs the privacy configuration once and a privacy/utility summary at the end (see module doc)."""

    def __init__(self) -> None:
        self.best_val_acc: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        pl_module.setup_privacy()
        config = privacy_config(pl_module)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.config.update(config, allow_val_change=True)
            else:
                logger.log_hyperparams(config)

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        acc = trainer.callback_metrics.get("val/acc")
        if acc is not None and not trainer.sanity_checking:
            self.best_val_acc = max(float(acc), self.best_val_acc or 0.0)

    def _summary(self, trainer: L.Trainer, pl_module: Any) -> dict[str, float]:
        summary = {"summary/epsilon": float(pl_module.epsilon), "summary/private_steps": float(pl_module.private_steps)}
        if pl_module.delta is not None:
            summary["summary/delta"] = float(pl_module.delta)
        if self.best_val_acc is not None:
            summary["summary/best_val_acc"] = self.best_val_acc
        test_acc = trainer.callback_metrics.get("test/acc")
        if test_acc is not None:
            summary["summary/test_acc"] = float(test_acc)
        return summary

    def _publish(self, trainer: L.Trainer, pl_module: Any) -> None:
        summary = self._summary(trainer, pl_module)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.summary.update(summary)
            else:
                logger.log_metrics(summary, step=trainer.global_step)
                logger.save()

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._publish(trainer, pl_module)

    def on_test_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._publish(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"best_val_acc": self.best_val_acc}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_val_acc = state_dict.get("best_val_acc")
