"""WandbPrivacyLogger: what a private run needs in Weights & Biases, at a glance.

* once, at fit start: the run config — method, the privacy spec, the calibrated noise
  multiplier, sample rate, δ, planned private steps, accountant, clip bound, and the unit of privacy
  (``privacy/unit``: ``"example"`` or ``"user"``; ``privacy/population``: how many the private set holds; every
  hyperparameter is logged by Lightning itself from the module's ``hparams``);
* every step, through the module's own ``self.log`` (so CSV and TensorBoard get the same keys):
  ``privacy/epsilon`` (the exact ε; PRV and PLD: at points of the plan, with their Rényi-DP bound
  ``privacy/epsilon_rdp`` at every logged step), ``privacy/budget_left``, ``privacy/private_steps`` and the method's
  privatized statistics (α, chosen candidate, …); non-private diagnostics only when the module's
  ``log_private_metrics`` is on, under ``diagnostics/not_private/``;
* at the end: the last step's ``privacy/*`` values (whatever the loggers' cadence) and a summary with the exact
  final ε, δ, private steps, the best validation metric and the test metric (accuracy unless you name your own).

With a :class:`~lightning.pytorch.loggers.WandbLogger` the config goes to ``run.config`` and the
summary to ``run.summary``; with any other logger both go through ``log_hyperparams`` /
``log_metrics``, so the callback is harmless there. When the run belongs to a W&B ``group``, the
test end also logs ``privacy_utility``: a line chart of test accuracy against ε over the group's
runs found in the local W&B directory (every run, online or offline, keeps its ``.wandb`` log
there, read back by :mod:`pl_dp.callbacks.wandb_runs`) plus this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import lightning as L
from lightning.pytorch.loggers import WandbLogger

from pl_dp.callbacks.protocol import PrivacyCallback, PrivateModuleLike
from pl_dp.callbacks.wandb_runs import group_points
from pl_dp.errors import ConfigError
from pl_dp.privacy.units import PrivacyUnit


def _summary_key(metric: str) -> str:
    return metric.replace("/", "_")


class LoggedModule(PrivateModuleLike, Protocol):
    """What the W&B summary reads beyond the privacy protocol (every pl_dp method has it)."""

    accountant_name: str | None
    expected_batch_size: float | None
    privacy_unit: PrivacyUnit | None


def privacy_config(pl_module: LoggedModule) -> dict[str, Any]:
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
                "privacy/accountant": pl_module.accountant_name,
                "privacy/expected_batch_size": pl_module.expected_batch_size,
            }
        )
        unit = pl_module.privacy_unit  # "example" or "user", and how many the private set holds (the n of q and δ)
        if unit is not None:
            config.update({"privacy/unit": unit.kind, "privacy/population": unit.population})
    clip = getattr(pl_module, "clip", None)
    clip_function = getattr(pl_module, "clip_function", None)
    if clip_function is not None:
        clip = clip_function.clip
        config["privacy/clip_fn"] = clip_function.kind
    config["privacy/clip"] = clip
    return config


class WandbPrivacyLogger(PrivacyCallback):
    """Logs the privacy configuration once and a privacy/utility summary at the end (see module doc).

    Args:
        val_metric: the validation metric whose best value the summary keeps (``summary/best_<val_metric>``, ``/``
            written ``_``): pl_dp's own ``val/acc`` by default, or what your module logs (``val_acc``, ``val/loss``).
        test_metric: the test metric of the summary and of the group's privacy–utility chart.
        mode: ``"max"`` or ``"min"``: whether a larger or a smaller ``val_metric`` is better.
    """

    def __init__(self, val_metric: str = "val/acc", test_metric: str = "test/acc", mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ConfigError(f"mode must be 'max' or 'min', got {mode!r}.")
        self.val_metric, self.test_metric, self.mode = val_metric, test_metric, mode
        self.best_val: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: LoggedModule) -> None:
        pl_module.setup_privacy()
        config = privacy_config(pl_module)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.config.update(config, allow_val_change=True)
            else:
                logger.log_hyperparams(config)

    def on_validation_end(self, trainer: L.Trainer, pl_module: LoggedModule) -> None:
        value = trainer.callback_metrics.get(self.val_metric)
        if value is None or trainer.sanity_checking:
            return
        better = max if self.mode == "max" else min
        self.best_val = float(value) if self.best_val is None else better(float(value), self.best_val)

    @property
    def test_key(self) -> str:
        return f"summary/{_summary_key(self.test_metric)}"

    def _summary(self, trainer: L.Trainer, pl_module: LoggedModule) -> dict[str, float]:
        summary = {"summary/epsilon": float(pl_module.epsilon), "summary/private_steps": float(pl_module.private_steps)}
        if pl_module.delta is not None:
            summary["summary/delta"] = float(pl_module.delta)
        if self.best_val is not None:
            summary[f"summary/best_{_summary_key(self.val_metric)}"] = self.best_val
        test = trainer.callback_metrics.get(self.test_metric)
        if test is not None:
            summary[self.test_key] = float(test)
        return summary

    def _publish(self, trainer: L.Trainer, pl_module: LoggedModule) -> None:
        summary = self._summary(trainer, pl_module)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.summary.update(summary)
            else:
                logger.log_metrics(summary, step=trainer.global_step)
                logger.save()

    def on_train_end(self, trainer: L.Trainer, pl_module: LoggedModule) -> None:
        # the last steps' privacy/* values: Lightning writes to its loggers on their cadence, which the end of a fit
        # need not fall on, so the history would stop short of the summary
        final = {key: float(value) for key, value in trainer.callback_metrics.items() if key.startswith("privacy/")}
        written = trainer.should_stop or trainer.global_step % max(trainer.log_every_n_steps, 1) == 0
        if final and not written:
            for logger in trainer.loggers:
                logger.log_metrics(final, step=trainer.global_step)
        self._publish(trainer, pl_module)

    def on_test_end(self, trainer: L.Trainer, pl_module: LoggedModule) -> None:
        self._publish(trainer, pl_module)
        summary = self._summary(trainer, pl_module)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and logger.experiment.group and self.test_key in summary:
                self._log_group_chart(logger.experiment, summary)

    def _log_group_chart(self, run: Any, summary: dict[str, float]) -> None:
        import wandb

        wandb_dir = Path(run.dir).parent.parent  # <wandb dir>/<run dir>/files
        points = group_points(wandb_dir, run.group, self.test_key)
        points.append((summary["summary/epsilon"], summary[self.test_key]))
        name = _summary_key(self.test_metric)
        table = wandb.Table(data=sorted(set(points)), columns=["epsilon", name])
        run.log({"privacy_utility": wandb.plot.line(table, "epsilon", name, title=f"privacy–utility: {run.group}")})

    def state_dict(self) -> dict[str, Any]:
        return {"best_val": self.best_val}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_val = state_dict.get("best_val", state_dict.get("best_val_acc"))
