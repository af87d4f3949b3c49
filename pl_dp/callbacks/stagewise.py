"""StagewiseSchedule: DP-ZOSO's stages (Liu et al., NDSS 2025, §IV-C, Algorithm 1) as a callback.

Stage s (0-based) runs T_s = T_0·g_T^s steps with step size η_s = η_0·d^s, smoothing
β_s = β_0·k^s, and the proximal term (1/λ)(θ − θ^{s−1}) anchored at a real copy of the
parameters taken when the stage starts. η_0 and β_0 are the module's ``lr`` and ``smoothing``.
Stage 0 uses them unchanged (the released code's indexing; Alg. 1 would already halve η in stage 1).

An LR scheduler (``configure_optimizers``, ``--lr_scheduler``) together with this callback is refused
at fit start: both would set η.

Privacy: the schedule is data-independent. σ is calibrated for the module's planned steps, which
Σ_s T_s fills exactly, so every stage is accounted.
"""

from __future__ import annotations

from typing import Any, Protocol

import lightning as L
import torch

from pl_dp.callbacks.protocol import PrivacyCallback, PrivateModuleLike, planned_steps_of
from pl_dp.errors import ConfigError


def stage_lengths(planned_steps: int, stages: int, steps_growth: float, first_stage_steps: int | None) -> list[int]:
    """T_0..T_{S−1}: T_s = T_0·g^s, with T_0 derived so that Σ T_s = ``planned_steps`` when not given."""
    if first_stage_steps is None:
        total = sum(steps_growth**s for s in range(stages))
        lengths = [max(1, int(planned_steps * steps_growth**s / total)) for s in range(stages)]
        lengths[-1] += planned_steps - sum(lengths)  # the last stage absorbs the rounding
        if lengths[-1] < 1:
            raise ConfigError(f"{planned_steps} planned steps are too few for {stages} stages.")
        return lengths
    lengths = [max(1, round(first_stage_steps * steps_growth**s)) for s in range(stages)]
    if sum(lengths) != planned_steps:
        raise ConfigError(
            f"the stages {lengths} add up to {sum(lengths)} steps but the trainer plans {planned_steps}: "
            f"set trainer.max_steps={sum(lengths)} or first_stage_steps=None to fill the plan."
        )
    return lengths


class ProximalAnchor:
    """The proximal term (1/λ)(θ − θ^{s−1}) of one stage: a real copy of θ taken when the stage starts.

    The copy is real (the released DP-ZOPO code aliases it to the live weights, which makes the term
    vanish). The step −η(1/λ)(θ − anchor) reads no data: no clipping, no noise (Liu et al., NDSS 2025,
    §IV-C, Algorithm 2). Zeroth-order methods apply it in the same sweep as the private update, i.e. at
    θ − ηĝ (semi-implicit; it differs from the explicit step by O(η²/λ), and the paper's analysis uses
    the implicit proximal step).
    """

    def __init__(self, coefficient: float, params: list[torch.Tensor]) -> None:
        if not coefficient > 0:
            raise ConfigError(f"the proximal coefficient 1/lambda must be > 0, got {coefficient!r}.")
        self.coefficient = float(coefficient)
        self.anchor = [p.detach().clone() for p in params]

    def terms(self, lr: float, params: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], float]]:
        """−η(1/λ)(θ − anchor) as dense ``(tensors, coefficient)`` terms for a fused parameter sweep."""
        step = lr * self.coefficient
        return [(params, -step), (self.anchor, step)]


class StagedModule(PrivateModuleLike, Protocol):
    """A method with a settable step size (every pl_dp method); ``proximal`` is the anchor slot of the methods that
    apply the term (``applies_proximal_term``: :class:`~pl_dp.methods.own_update.OwnUpdateModule`), set only there."""

    lr: float
    proximal: ProximalAnchor | None

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...


class StagewiseSchedule(PrivacyCallback):
    """DP-ZOSO's stagewise schedule for any pl_dp method with settable ``lr`` (and ``smoothing``).

    Args:
        stages: S, the number of stages.
        first_stage_steps: T_0; ``None`` derives it so that Σ T_s equals the planned steps.
        smoothing_growth: k, β_s = k·β_{s−1} (the paper increases β, Algorithm 1; k is not stated).
        lr_decay: η_s = lr_decay·η_{s−1} (the paper: 1/2).
        steps_growth: T_s = steps_growth·T_{s−1} (the paper: 2).
        proximal: 1/λ, the coefficient of the proximal gradient (1/λ)(θ − θ^{s−1}); the paper's
            "regularization 5e-4" (Tables X–XII; the released code multiplies it by θ − θ^{s−1}, so it
            is 1/λ). ``None`` or 0 disables it.
    """

    requires = ("lr",)
    requires_description = "a pl_dp method with a settable step size"

    def __init__(
        self,
        stages: int = 3,
        first_stage_steps: int | None = None,
        smoothing_growth: float = 2.0,
        lr_decay: float = 0.5,
        steps_growth: float = 2.0,
        proximal: float | None = 5e-4,
    ) -> None:
        if isinstance(stages, bool) or int(stages) != stages or stages < 1:
            raise ConfigError(f"stages must be an integer >= 1, got {stages!r}.")
        for name, value in [
            ("smoothing_growth", smoothing_growth),
            ("lr_decay", lr_decay),
            ("steps_growth", steps_growth),
        ]:
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}.")
        if proximal is not None and proximal < 0:
            raise ConfigError(f"proximal (1/lambda) must be >= 0, got {proximal!r}.")
        self.stages = int(stages)
        self.first_stage_steps = first_stage_steps
        self.smoothing_growth = float(smoothing_growth)
        self.lr_decay = float(lr_decay)
        self.steps_growth = float(steps_growth)
        self.proximal = float(proximal or 0.0)
        self.lengths: list[int] | None = None
        self.stage = -1
        self.base_lr: float | None = None
        self.base_smoothing: float | None = None
        self.anchor: ProximalAnchor | None = None  # the current stage's, held by the module too
        self._saved_anchor: list[Any] | None = None

    def stage_of(self, step: int) -> int:
        """The stage that step ``step`` (0-based) belongs to; steps past the plan stay in the last one."""
        if self.lengths is None:
            raise RuntimeError("StagewiseSchedule has no stages before its fit starts (on_train_start plans them).")
        end = 0
        for s, length in enumerate(self.lengths):
            end += length
            if step < end:
                return s
        return len(self.lengths) - 1

    def values(self, stage: int) -> dict[str, float]:
        """η_s and β_s of ``stage``."""
        if self.base_lr is None:
            raise RuntimeError("StagewiseSchedule reads the base step size at its fit's start (on_train_start).")
        out = {"lr": self.base_lr * self.lr_decay**stage}
        if self.base_smoothing is not None:
            out["smoothing"] = self.base_smoothing * self.smoothing_growth**stage
        return out

    def _enter(self, pl_module: StagedModule, stage: int, anchor: list[Any] | None = None) -> None:
        for name, value in self.values(stage).items():
            setattr(pl_module, name, value)
        # the exact θ: fp32 masters where the method trains half-precision parameters through them
        params = getattr(pl_module, "master_parameters", pl_module.trainable_parameters)
        self.anchor = ProximalAnchor(self.proximal, params()) if self.proximal else None
        if anchor is not None and self.anchor is not None:
            for mine, saved in zip(self.anchor.anchor, anchor):
                mine.copy_(saved)
        if getattr(pl_module, "applies_proximal_term", False):  # the others were refused a term at train start
            pl_module.proximal = self.anchor
        self.stage = stage

    def on_train_start(self, trainer: L.Trainer, pl_module: StagedModule) -> None:
        if self.proximal and not getattr(pl_module, "applies_proximal_term", False):
            raise ConfigError(
                f"StagewiseSchedule(proximal={self.proximal:g}) anchors each stage with a proximal term, which "
                f"{type(pl_module).__name__}'s update does not include: it would be dropped silently. Use "
                "proximal=0 with this method, or a zeroth-order method (DPZero, PAZO-M/P/S), whose update the term "
                "enters (DP-ZOSO, Liu et al. 2025, Alg. 1)."
            )
        if trainer.lr_scheduler_configs:
            raise ConfigError(
                "StagewiseSchedule sets the step size at every stage (eta_s = lr_decay^s * lr); an LR scheduler "
                "would overwrite it between stages and the two schedules would fight. Use one of them: drop "
                "the scheduler, or drop StagewiseSchedule and express the stages as the scheduler."
            )
        planned = planned_steps_of(pl_module)
        self.lengths = stage_lengths(planned, self.stages, self.steps_growth, self.first_stage_steps)
        if self.base_lr is None:  # a fresh run; on resume these come from the checkpoint
            self.base_lr = pl_module.lr
            self.base_smoothing = getattr(pl_module, "smoothing", None)
        if self.stage >= 0:  # resumed mid-stage: the anchor taken when the stage began
            self._enter(pl_module, self.stage, self._saved_anchor)
            self._saved_anchor = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: StagedModule, batch: Any, batch_idx: int) -> None:
        stage = self.stage_of(trainer.global_step)
        if stage != self.stage:
            self._enter(pl_module, stage)
        pl_module.log("train/stage", float(stage), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        anchor = None if self.anchor is None else [a.clone() for a in self.anchor.anchor]
        return {
            "stage": self.stage,
            "base_lr": self.base_lr,
            "base_smoothing": self.base_smoothing,
            "lengths": self.lengths,
            "anchor": anchor,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stage = state_dict["stage"]
        self.base_lr = state_dict["base_lr"]
        self.base_smoothing = state_dict["base_smoothing"]
        self._saved_anchor = state_dict["anchor"]
