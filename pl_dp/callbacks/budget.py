"""PrivacyBudget: stop before the step that would take ε past a target."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from pl_dp.callbacks.protocol import PrivacyCallback, PrivateModuleLike
from pl_dp.errors import PrivacyConfigError


class PrivacyBudget(PrivacyCallback):
    """Stops training *before* the private step that would push ε past ``epsilon``.

    The module's own guard already stops at its ``PrivacySpec.epsilon``; this callback registers a
    target with it (``add_privacy_target``), so that one place — the module's privacy ledger —
    decides every stop. Each check is a prospective ε on a copy of the accountant's history; whole
    ranges of steps are verified at once, so a run on plan costs one accountant evaluation.

    Args:
        epsilon: the target; ``None`` uses the module's ``PrivacySpec.epsilon``. A target below
            the spec's makes training stop early.
        delta: the δ of the target; ``None`` uses the module's δ.

    Raises at fit start when the module's noise multiplier was set explicitly and cannot meet the
    target over the planned steps (a calibrated σ always meets the spec's own ε); warns when a
    calibrated plan would exceed a tighter target. ``stopped_at`` is the private step count at
    which the guard stopped the run (None if it ran its plan).
    """

    requires = ("add_privacy_target", "privacy_exhausted")
    requires_description = "a pl_dp method (its privacy ledger holds the targets)"

    def __init__(self, epsilon: float | None = None, delta: float | None = None) -> None:
        if epsilon is not None and not epsilon > 0:
            raise PrivacyConfigError(f"PrivacyBudget epsilon must be > 0, got {epsilon!r}.")
        if delta is not None and not 0 < delta < 1:
            raise PrivacyConfigError(f"PrivacyBudget delta must lie in (0, 1), got {delta!r}.")
        self.epsilon = epsilon
        self.delta = delta
        self.stopped_at: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: PrivateModuleLike) -> None:
        pl_module.setup_privacy()
        if pl_module.privacy is None:
            rank_zero_warn("PrivacyBudget is attached to a non-private run: there is no budget to guard.")
            return
        target = self.epsilon if self.epsilon is not None else pl_module.privacy.epsilon
        planned = pl_module.add_privacy_target(target, self.delta)
        if planned > target:
            rank_zero_warn(
                f"the plan would spend epsilon={planned:.3f} > PrivacyBudget target {target:g}: "
                "training will stop early, before the step that would exceed it."
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: PrivateModuleLike) -> None:
        if getattr(pl_module, "privacy_exhausted", False) and self.stopped_at is None:
            self.stopped_at = pl_module.private_steps

    def state_dict(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "delta": self.delta, "stopped_at": self.stopped_at}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stopped_at = state_dict.get("stopped_at")
