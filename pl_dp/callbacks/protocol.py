"""The privacy protocol the callbacks talk to, and the clear error a module without it gets."""

from __future__ import annotations

from typing import Any

import lightning as L

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


class PrivacyCallback(L.Callback):
    """A callback that needs pl_dp's privacy protocol; checks for it at fit start.

    Subclasses name what they use beyond the protocol in ``requires`` and say which methods have it
    in ``requires_description``.
    """

    requires: tuple[str, ...] = ()
    requires_description: str = ""

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
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
