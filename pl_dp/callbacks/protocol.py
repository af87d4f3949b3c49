"""The privacy protocol the callbacks talk to, and the clear error a module without it gets."""

from __future__ import annotations

from typing import Any, Protocol

import lightning as L
import torch

from pl_dp.privacy.accountants import Accountant
from pl_dp.privacy.spec import PrivacySpec

#: what every pl_dp method exposes to callbacks (public names: keep them stable)
PRIVACY_PROTOCOL = (
    "privacy",
    "setup_privacy",
    "accountant",
    "noise_multiplier",
    "sample_rate",
    "delta",
    "private_steps",
    "planned_steps",
    "epsilon",
)


class PrivateModuleLike(Protocol):
    """What a callback may use of a pl_dp method: the privacy protocol (:data:`PRIVACY_PROTOCOL`) and the
    LightningModule members callbacks touch. A callback that needs more names it in ``requires`` and types its
    module with a protocol that extends this one."""

    privacy: PrivacySpec | None
    noise_multiplier: float
    sample_rate: float | None
    delta: float | None
    private_steps: int
    planned_steps: int | None  # set by setup_privacy

    @property
    def accountant(self) -> Accountant | None: ...

    @property
    def epsilon(self) -> float: ...

    @property
    def device(self) -> torch.device: ...

    def setup_privacy(self) -> None: ...

    def add_privacy_target(self, epsilon: float, delta: float | None = None) -> float: ...

    def log(self, name: str, value: Any, **kwargs: Any) -> None: ...


def planned_steps_of(pl_module: PrivateModuleLike) -> int:
    """The private steps the current fit plans, once ``setup_privacy`` has made the plan."""
    pl_module.setup_privacy()
    if pl_module.planned_steps is None:
        raise RuntimeError(f"{type(pl_module).__name__}.setup_privacy() made no plan: planned_steps is None.")
    return pl_module.planned_steps


class PrivacyCallback(L.Callback):
    """A callback that needs pl_dp's privacy protocol; checks for it at fit start.

    Subclasses name what they use beyond the protocol in ``requires`` and say which methods have it
    in ``requires_description``.
    """

    requires: tuple[str, ...] = ()
    requires_description: str = ""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        name, module = type(self).__name__, type(pl_module).__name__
        missing = [attr for attr in PRIVACY_PROTOCOL if not hasattr(pl_module, attr)]
        if missing:
            raise TypeError(
                f"{name} needs a pl_dp method: a module with the privacy protocol ({', '.join(PRIVACY_PROTOCOL)}); "
                f"{module} has no {', '.join(missing)}. Wrap your model in a pl_dp method — e.g. "
                "pl_dp.methods.DPSGD(net=YourModule(), privacy=PrivacySpec(epsilon=...)) — which trains it "
                "privately while your module's validation, test and predict steps run as written."
            )
        missing = [attr for attr in self.requires if not hasattr(pl_module, attr)]
        if missing:
            raise TypeError(
                f"{name} needs {self.requires_description or 'a method with ' + ', '.join(self.requires)}; "
                f"{module} has no {', '.join(missing)}."
            )
