"""Argument checks shared by the methods and the audit: one wording for the same mistake everywhere."""

from __future__ import annotations

from typing import Any

from pl_dp.errors import ConfigError


def check_positive(name: str, value: float | None, allow_none: bool = False) -> None:
    """Raise unless ``value`` is a number > 0 (or None, with ``allow_none``); booleans are not numbers here."""
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a number > 0, got {value!r}.")


def positive_integer(name: str, value: Any) -> int:
    """``value`` as an ``int`` when it is a whole number >= 1 (``2.0`` passes; ``True`` and ``2.5`` raise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}.")
    return int(value)
