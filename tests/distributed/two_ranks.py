"""A test's :func:`~tests.distributed.on_two_ranks` run in a fresh interpreter, started in the background when the
session starts (tests/background.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests import background


def job(name: str, work: Callable[[int, Any, dict], None], needed_by: Callable | None = None) -> background.Job:
    """Declare, in the test module that defines ``work`` (a module-level function), a run of
    ``on_two_ranks(work)``."""
    return background.call(name, work, needed_by, through="tests.distributed:on_two_ranks")


def results(declared: background.Job) -> dict:
    """What the ranks of ``declared``'s run put in their results; its error if the run failed."""
    return background.returned(declared)
