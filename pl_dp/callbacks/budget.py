"""PrivacyBudget: stop before the step that would take ε past the target (invariant 4)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from pl_dp.callbacks.protocol import PrivacyCallback
from pl_dp.privacy.budget import StepBudget


class PrivacyBudget(PrivacyCallback):
    """Stops training *before* the private step that would push ε past ``epsilon``.

    Works with any module implementing the privacy protocol (``setup_privacy()``,
    ``accountant``, ``noise_multiplier``, ``sample_rate``, ``delta``, ``private_steps``,
    ``planned_steps``, ``privacy``, ``privacy_exhausted``). Each check is a prospective ε
    on a copy of the accountant's history; whole ranges of steps are verified at once, so a run
    on plan costs one accountant evaluation.

    Args:
        epsilon: the target; ``None`` uses the module's ``PrivacySpec.epsilon``. A target below
            the spec's makes training stop early.
        delta: the δ of the target; ``None`` uses the module's δ.

    Raises at fit start when the module's noise multiplier was set explicitly and cannot meet the
    target over the planned steps (a calibrated σ always meets the spec's own ε).
    """

    def __init__(self, epsilon: float | None = None, delta: float | None = None) -> None:
        if epsilon is not None and not epsilon > 0:
            raise ValueError(f"PrivacyBudget epsilon must be > 0, got {epsilon!r}.")
        if delta is not None and not 0 < delta < 1:
            raise ValueError(f"PrivacyBudget delta must lie in (0, 1), got {delta!r}.")
        self.epsilon = epsilon
        self.delta = delta
        self.stopped_at: int | None = None
        self._budget: StepBudget | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        pl_module.setup_privacy()
        if pl_module.privacy is None:
            rank_zero_warn("PrivacyBudget is attached to a non-private run: there is no budget to guard.")
            return
        target = self.epsilon if self.epsilon is not None else pl_module.privacy.epsilon
        delta = self.delta if self.delta is not None else pl_module.delta
        self._budget = StepBudget(pl_module.accountant, target, delta, horizon=pl_module.planned_steps)
        remaining = max(pl_module.planned_steps - pl_module.private_steps, 0)
        planned_eps = pl_module.accountant.epsilon_after(
            delta, remaining, pl_module.noise_multiplier, pl_module.sample_rate
        )
        if planned_eps > target:
            if pl_module.privacy.noise_multiplier is not None:
                raise ValueError(
                    f"the planned {pl_module.planned_steps} private steps with noise_multiplier="
                    f"{pl_module.noise_multiplier:g} would spend epsilon={planned_eps:.3f} > target {target:g}: "
                    "refusing to start. Raise the noise multiplier or plan fewer steps."
                )
            rank_zero_warn(
                f"the plan would spend epsilon={planned_eps:.3f} > PrivacyBudget target {target:g}: "
                "training will stop early, before the step that would exceed it."
            )

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._budget is None:
            return
        if pl_module.privacy_exhausted or not self._budget.allows(pl_module.noise_multiplier, pl_module.sample_rate):
            pl_module.privacy_exhausted = True
            trainer.should_stop = True
            if self.stopped_at is None:
                self.stopped_at = pl_module.private_steps

    def state_dict(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "delta": self.delta, "stopped_at": self.stopped_at}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stopped_at = state_dict.get("stopped_at")
