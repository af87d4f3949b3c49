"""pl_dp's errors: one small family, so that a caller — or a test — tells a refusal's kind by its type.

Each is a ``ValueError`` (what a bad argument or input raises in Python), so ``except ValueError`` keeps working, and
each says in its message what to change. Whether one is raised never depends on which records a step sampled: they
are raised at construction, at fit start, or by the pre-flight pass and the probe, before the first release.

Every pl_dp layer may import this module; it imports none.
"""

from __future__ import annotations


class PlDpError(ValueError):
    """The base of pl_dp's refusals."""


class ConfigError(PlDpError):
    """An argument, or a combination of the module, trainer, strategy and data module, that pl_dp cannot run."""


class PrivacyConfigError(ConfigError):
    """A privacy request that cannot be met or accounted soundly: the spec (ε, δ, σ, the accountant), a plan whose
    steps would exceed the budget, a loader whose sampling the accountant does not assume, or a resumed history the
    request contradicts."""


class DataError(PlDpError):
    """Private examples that a private step cannot use (unreadable, of another structure, non-finite, failing the
    loss), found by the pre-flight pass before any release and named by index."""


class IndependenceError(PlDpError):
    """A net or loss in which one example's loss, gradient or release depends on other examples (or which writes a
    statistic of its input into a buffer): it breaks every per-example sensitivity bound."""


__all__ = ["ConfigError", "DataError", "IndependenceError", "PlDpError", "PrivacyConfigError"]
