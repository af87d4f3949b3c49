"""The user-facing privacy request: target (ε, δ), accountant, optional fixed noise multiplier."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.privacy.accountants import REMOVED_ACCOUNTANTS, accountant_names

#: fewer users than this, and δ's default 1/U is large enough to warn about
SMALL_POPULATION = 100


@dataclass(frozen=True)
class PrivacySpec:
    """What privacy a run must provide.

    Args:
        epsilon: target ε of the whole fit (every private step of every stage).
        delta: target δ; ``None`` means ``1 / n`` for the n units of privacy of the private set (examples, or
            users under user-level privacy), fixed once n is known at fit start.
        accountant: ``None`` (default) means the method's own: ``"prv"`` for the Poisson-sampled
            methods, ``"tree"`` for :class:`~pl_dp.methods.O2NC`. Or name one: ``"prv"`` (Opacus PRV),
            ``"pld"`` (Google's dp-accounting privacy loss distribution, pessimistic: tight and sound),
            ``"rdp"`` (conservative cross-check) or ``"tree"`` (O2NC's tree mechanism over a data
            partition; only for O2NC). Each reports an upper bound on ε; approximations such as
            Gaussian DP (``"gdp"``, removed) are not offered.
        noise_multiplier: σ. ``None`` means calibrated at fit start from (ε, δ, sample rate,
            planned private steps). If given, fit refuses to start when σ cannot meet ε for
            the planned steps.
    """

    epsilon: float
    delta: float | None = None
    accountant: str | None = None
    noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.epsilon, bool)
            or not isinstance(self.epsilon, (int, float))
            or not math.isfinite(self.epsilon)
            or self.epsilon <= 0
        ):
            raise PrivacyConfigError(
                f"PrivacySpec.epsilon must be a finite number > 0, got {self.epsilon!r} "
                "(for a run without privacy pass privacy=None)."
            )
        if self.delta is not None and not (0 < self.delta < 1):
            raise PrivacyConfigError(f"PrivacySpec.delta must lie in (0, 1), got {self.delta!r}.")
        if self.accountant in REMOVED_ACCOUNTANTS:
            raise PrivacyConfigError(f"PrivacySpec.accountant: {REMOVED_ACCOUNTANTS[self.accountant]}.")
        if self.accountant is not None and self.accountant not in accountant_names():
            raise PrivacyConfigError(
                f"PrivacySpec.accountant must be None (the method's own) or one of {tuple(accountant_names())}, "
                f"got {self.accountant!r}."
            )
        if self.noise_multiplier is not None and not self.noise_multiplier > 0:
            raise PrivacyConfigError(f"PrivacySpec.noise_multiplier must be > 0, got {self.noise_multiplier!r}.")

    def resolve_delta(self, n_private: int, unit: str = "example") -> float:
        """δ for a private set of ``n_private`` units of privacy (``unit``: examples, or users under user-level
        privacy): ``1/n`` when unset; warns if δ > 1/n."""
        if n_private < 1:
            raise ConfigError("the private dataset is empty: there is nothing to train on privately.")
        if unit == "user" and n_private < 2:
            raise PrivacyConfigError(
                "the private set holds one user: a guarantee per user at δ = 1/U = 1 protects nothing. Check the user "
                "column (every example named the same user?) or train with example-level privacy."
            )
        if self.delta is None:
            if unit == "user" and n_private < SMALL_POPULATION:
                warnings.warn(
                    f"only {n_private} users: the default delta = 1/U = {1.0 / n_private:.3g} lets the guarantee fail "
                    f"with that probability (at delta = 1/U, publishing one random user outright would satisfy it). "
                    "Set a smaller delta in the privacy spec.",
                    stacklevel=2,
                )
            return 1.0 / n_private
        if self.delta > 1.0 / n_private:
            warnings.warn(
                f"delta={self.delta:g} exceeds 1/n={1.0 / n_private:g} for the n={n_private} {unit}s of the private "
                f"set: a mechanism that publishes one random {unit} outright would satisfy this guarantee.",
                stacklevel=2,
            )
        return self.delta

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
