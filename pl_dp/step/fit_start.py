"""The checks a private fit runs once, before its first step: one ordered list, which a method extends.

Everything a private run checks about its data, net and loss happens before the first step, on data whose use does not
depend on what the sampler draws: a check that failed at the step that sampled the record it fails on would disclose
that record's membership by *when* the run stopped. :class:`FitStartChecks` is that list, in the order the checks run —
the pre-flight pass over the private set (:mod:`pl_dp.step.preflight`), the per-example independence probe
(:mod:`pl_dp.step.independence`), the check that the passes compute in the precision the run declares, then what a
method adds (DP-SGD: that each clipped row is one example's whole gradient). A method states its checks in one place,
``fit_start_checks()``, and extends its base's list:

    def fit_start_checks(self) -> FitStartChecks:
        return super().fit_start_checks().then("per-example gradients", self.verify_gradients)

Each check raises to refuse the run (before anything is trained or accounted) and may return what a later stage
uses (the pre-flight report seals the loader's batching). A refusal carries a note naming the check that raised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FitStartCheck:
    """One check: its ``name`` and the callable that runs it (raises to refuse; may return a result)."""

    name: str
    run: Callable[[], Any]


class FitStartChecks:
    """The checks of a private fit, in the order they run (see the module's docstring). Immutable: :meth:`then`
    returns a longer list."""

    def __init__(self, checks: tuple[FitStartCheck, ...] = ()) -> None:
        names = [check.name for check in checks]
        if len(set(names)) != len(names):
            raise ValueError(f"fit-start checks are named once each, got {names}")
        self._checks = checks

    def then(self, name: str, run: Callable[[], Any]) -> FitStartChecks:
        """This list followed by the check ``name``."""
        return FitStartChecks((*self._checks, FitStartCheck(name, run)))

    @property
    def names(self) -> list[str]:
        """The checks' names, in the order they run."""
        return [check.name for check in self._checks]

    def __iter__(self) -> Iterator[FitStartCheck]:
        return iter(self._checks)

    def run(self) -> dict[str, Any]:
        """Run every check in order (the first that raises ends the fit, noting its name); what each returned, by
        name."""
        results: dict[str, Any] = {}
        for check in self._checks:
            try:
                results[check.name] = check.run()
            except Exception as refused:
                refused.add_note(f"(refused by pl_dp's fit-start check {check.name!r})")
                raise
        return results
