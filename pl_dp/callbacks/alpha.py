"""AlphaSchedule: DPMD's cosine schedule of the public weight α (as run by Liu et al. 2023, Table 2 and §5)."""

from __future__ import annotations

import math
from typing import Any, Protocol

import lightning as L

from pl_dp.callbacks.protocol import PrivacyCallback, PrivateModuleLike, planned_steps_of
from pl_dp.errors import ConfigError


class WeightedModule(PrivateModuleLike, Protocol):
    """A method with a settable public weight α (Coupling, PAZO-M)."""

    alpha: float


class AlphaSchedule(PrivacyCallback):
    """Sets ``pl_module.alpha`` before every step: α_t = 1 − cos(π t / (2K)), clamped to [0, 1].

    This is the linear-combination form of DPMD (Amid et al.) used by the Coupling paper. t is the
    global step (so α₀ = 0: the first step is purely private) and K is ``anneal_steps`` — or, in the
    paper's experiment form α_t = 1 − cos(π t / (T·i)), K = i·T/2 with i = ``anneal_factor`` and T
    the module's planned steps. α rises to 1 − cos(π/i) at the end of the plan.

    Works with any module with a settable ``alpha`` (e.g. :class:`~pl_dp.methods.Coupling`). The
    schedule is data-independent: it costs no privacy, and the plan's σ counts every step as private.
    """

    requires = ("alpha",)
    requires_description = "a method with a settable public weight alpha (Coupling, PAZO-M)"

    def __init__(self, anneal_factor: float = 2.0, anneal_steps: int | None = None) -> None:
        if anneal_steps is not None and not anneal_steps > 0:
            raise ConfigError(f"anneal_steps must be > 0, got {anneal_steps!r}.")
        if not anneal_factor > 0:
            raise ConfigError(f"anneal_factor must be > 0, got {anneal_factor!r}.")
        self.anneal_factor = float(anneal_factor)
        self.anneal_steps = anneal_steps

    def period(self, pl_module: WeightedModule) -> float:
        """K."""
        if self.anneal_steps is not None:
            return float(self.anneal_steps)
        return self.anneal_factor * planned_steps_of(pl_module) / 2.0

    def value(self, step: int, period: float) -> float:
        return min(1.0, max(0.0, 1.0 - math.cos(math.pi * step / (2.0 * period))))

    def first_step_at_alpha_one(self, pl_module: WeightedModule, first: int, last: int) -> int | None:
        """The first step in [``first``, ``last``) at which α_t reaches 1 (``None``: none), for a banded
        :class:`~pl_dp.methods.Coupling`'s fit-start check (:class:`~pl_dp.methods.first_order.AlphaPlan`)."""
        period = self.period(pl_module)
        return next((t for t in range(first, last) if self.value(t, period) >= 1.0), None)

    def on_train_start(self, trainer: L.Trainer, pl_module: WeightedModule) -> None:
        pl_module.setup_privacy()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: WeightedModule, batch: Any, batch_idx: int) -> None:
        pl_module.alpha = self.value(trainer.global_step, self.period(pl_module))
