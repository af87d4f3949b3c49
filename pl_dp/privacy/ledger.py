"""The privacy ledger of a run: what was released, the plan it was released under, and the budget guard.

:class:`PrivacyLedger` is the one object the guarantee depends on, kept apart from the training loop
the way Opacus keeps its accountants apart from its engine (Lightning-free, testable alone):

* the **plan** — the unit of privacy (example or user, :mod:`pl_dp.privacy.units`), δ, the sample rate q and
  expected batch size read from the sampler actually used (so the accountant matches the sampler), σ calibrated
  for every planned step on top of the history already spent, or the checkpoint's σ on a resume, checked against
  the spec (a change is refused unless allowed);
* the **record** — the accountant history (what was released), the private-step count, which secrets
  were ever user-seeded, and the lineage's write-ahead journal (:mod:`pl_dp.privacy.journal`), so that
  ε is a function of this object alone and a resume composes everything the run ever released;
* the **guard** — the budget targets (the spec's, and tighter ones registered by callbacks); one
  place answers "may the next step run?", so the budget is never exceeded.

Under cyclic Poisson sampling over b groups (banded correlated noise, :mod:`pl_dp.privacy.correlated`) the
accountant composes one subsampled Gaussian per band of b private steps of a fit — at the band's first step — not one
per step (Choquette-Choo et al. 2023); :meth:`PrivacyLedger.compositions` is the one place that counts them, for the
record, the plan, the calibration and the guard alike. With b = 1 (every other sampler) a composition is a step.

Its ``state_dict`` is what a checkpoint holds for privacy; it never holds a secret (the DP noise key or the
sampling seed).
"""

from __future__ import annotations

import math
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pl_dp.errors import PrivacyConfigError
from pl_dp.privacy.accountants import Accountant, create_accountant
from pl_dp.privacy.calibration import EpsilonTracker, StepBudget, calibrate_noise_multiplier
from pl_dp.privacy.journal import PrivacyJournal
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.selection import release_epsilon
from pl_dp.privacy.spec import PrivacySpec
from pl_dp.privacy.units import PrivacyUnit

Broadcast = Callable[[Any], Any]


class PrivacyLedger:
    """The plan, the record and the budget guard of one module's private training (see the module doc).

    Args:
        spec: the privacy request; ``None`` for a non-private run (nothing is planned or accounted).
        accountant: the accountant's name (the spec's, or the method's own).
    """

    def __init__(self, spec: PrivacySpec | None, accountant: str | None) -> None:
        if spec is not None and accountant is None:
            raise ValueError("a private run's ledger needs the name of its accountant.")
        self.spec = spec
        self.accountant_name = accountant if spec is not None else None
        self.accountant: Accountant | None = None
        if self.accountant_name is not None:
            self.accountant = create_accountant(self.accountant_name)
        # the plan (set by plan(), restored from checkpoints)
        self.unit: PrivacyUnit | None = None  # whom the guarantee protects, as the private sampler states it
        self.noise_multiplier = 0.0
        self.sample_rate: float | None = None
        self.expected_batch_size: float | None = None
        #: the participation schema: b cyclic groups, one composition per b steps of a fit (1: every step)
        self.bands = 1
        self.delta: float | None = None
        self.planned_steps: int | None = None
        # the record
        self.private_steps = 0
        self._fit_start = 0  # private_steps when this fit's plan began: its bands count from there
        self.user_seeded = {"noise": False, "sampling": False}  # sticky across fits and resumes
        #: the specs allowed resumes replaced: {"private_steps": steps before the change, "from": spec, "to": spec}
        self.spec_changes: list[dict[str, Any]] = []
        self.lineage: str | None = None
        self.journal: PrivacyJournal | None = None
        #: the hyperparameter search that released this model (``pl-dp tune``), kept so its ε stays in the report
        self.search: dict[str, Any] | None = None
        self._segment: Accountant | None = None  # this fit's own steps, for the journal
        self._segment_id = ""
        # the guard
        self.exhausted = False
        self._budgets: list[StepBudget] = []
        self._tracker: EpsilonTracker | None = None

    @property
    def private(self) -> bool:
        return self.spec is not None

    # ---- a private run's plan, narrowed (a non-private run plans nothing and never reads these) ----------------
    @property
    def _spec(self) -> PrivacySpec:
        if self.spec is None:
            raise RuntimeError("a non-private run has no privacy spec to plan with.")
        return self.spec

    @property
    def _accountant(self) -> Accountant:
        if self.accountant is None:
            raise RuntimeError("a non-private run has no accountant.")
        return self.accountant

    @property
    def _accountant_name(self) -> str:
        if self.accountant_name is None:
            raise RuntimeError("a non-private run has no accountant.")
        return self.accountant_name

    @property
    def _delta(self) -> float:
        if self.delta is None:
            raise RuntimeError("delta is fixed before the first plan (fix_delta), and was not.")
        return self.delta

    @property
    def _sample_rate(self) -> float:
        if self.sample_rate is None:
            raise RuntimeError("the private sampler states no sample rate: it cannot be accounted.")
        return self.sample_rate

    # ---- the plan ----------------------------------------------------------------------------
    def observe_sampler(self, sampler: Any, noise_seeded: bool) -> None:
        """Read the unit of privacy, q and the expected batch size off the private sampler, and whether any secret
        is user-seeded. A private run whose record holds steps of one unit refuses a sampler of another: the
        composed ε would be claimed for a unit the earlier steps did not protect."""
        unit = getattr(sampler, "unit", None)  # pl_dp's samplers, Opacus' Poisson sampler
        earlier = self.unit.kind if self.unit is not None else None
        now = unit.kind if unit is not None else None
        if self.private and self.private_steps and None not in (earlier, now) and now != earlier:
            raise PrivacyConfigError(
                f"this run released {self.private_steps} private steps at {earlier}-level privacy and its loader now "
                f"samples at {now}-level: epsilon composes every step, and the earlier ones do not protect a {now}. "
                f"Train a fresh module (or start a new run) for {now}-level privacy, or keep the earlier data "
                "module's unit."
            )
        self.user_seeded["noise"] |= noise_seeded
        self.user_seeded["sampling"] |= bool(getattr(sampler, "seeded", False))
        if unit is not None:
            self.unit = unit
        if hasattr(sampler, "sample_rate"):  # pl_dp's samplers, Opacus' Poisson sampler
            self.sample_rate = sampler.sample_rate
            self.expected_batch_size = sampler.expected_batch_size
        self.bands = int(getattr(sampler, "bands", 1))

    def compositions(self, steps: int) -> int:
        """How many subsampled-Gaussian compositions the next ``steps`` private steps of this fit add: one per band of
        :attr:`bands` steps, counted from the fit's first step, ⌈(s + k)/b⌉ − ⌈s/b⌉ after s steps (k for b = 1)."""
        done, bands = self.private_steps - self._fit_start, self.bands
        return -(-(done + steps) // bands) + (-done // bands)

    @property
    def _unit(self) -> PrivacyUnit:
        if self.unit is None:
            raise RuntimeError("the private sampler states no unit of privacy: observe_sampler reads it first.")
        return self.unit

    def fix_delta(self) -> None:
        """δ, fixed by the first plan (or the checkpoint): the ε of every fit is at one δ; by default 1/n for the n
        units of privacy (examples or users) of the private set."""
        if self.delta is None:
            self.delta = self._spec.resolve_delta(self._unit.population, self._unit.kind)

    def open_journal(self, restored: dict[str, Any] | None, directory: Path | None, broadcast: Broadcast) -> None:
        """Start this fit's journal segment; on a resume, account every step the lineage ever released.

        A resumed accountant is the composition of every segment in the journal — which holds all the
        checkpoint holds, plus what a crashed run logged after it and what other resumes of the same
        checkpoint released. Without the journal (moved or deleted) the checkpoint's history is kept
        and a warning says what cannot be counted. ``directory`` is where a new lineage's journal goes
        (next to the checkpoints); ``None`` defers it to the first checkpoint (:meth:`write_journal`).
        ``broadcast`` gives every data-parallel rank rank 0's reading of the journal.
        """
        self._segment_id = uuid.uuid4().hex
        self._segment = create_accountant(self._accountant_name)
        if restored is not None:
            self.lineage = restored.get("lineage") or self.lineage
            path = restored.get("journal")
            journal = PrivacyJournal(path) if path else None
            composed = broadcast(journal.composed(self._accountant.name).state_dict() if journal else None)
            released = create_accountant(self._accountant_name)
            if composed is not None:
                released.load_state_dict(composed)
            if released.history and released.steps >= self._accountant.steps:
                self._accountant.load_state_dict(composed)
            else:
                warnings.warn(
                    f"no privacy journal of this run was found{f' at {path}' if path else ''}: epsilon counts "
                    "the steps the checkpoint holds. Steps that an earlier run released after this checkpoint "
                    "(logged metrics before a crash, another resume of the same checkpoint) cannot be counted; "
                    "if there were any, epsilon is under-reported.",
                    stacklevel=3,
                )
            self.journal = journal
        if self.lineage is None:
            self.lineage = uuid.uuid4().hex
        if self.journal is None and directory is not None:
            self.journal = PrivacyJournal.of(directory, self.lineage)

    def plan(self, steps_left: int, restored: dict[str, Any] | None, allow_change: bool, planned_steps: int) -> None:
        """σ for the ``steps_left`` steps of this fit, and the budget guard (after :meth:`open_journal`).

        A new plan calibrates σ on top of the history already spent (or checks the spec's fixed σ)
        and refuses to start when nothing is left; a resume takes the checkpoint's σ after checking
        that the spec and q did not change (a change is refused unless ``allow_change``, and then σ
        is re-planned for the rest on top of the kept history). A resumed plan that would exceed the
        target warns: the guard will stop early.
        """
        spec = self._spec
        if self.search is not None:
            raise PrivacyConfigError(
                "this model is the release of a hyperparameter search (pl-dp tune): its epsilon "
                f"{self.epsilon:.3f} (delta={self._delta:.3g}) is the whole search's, which the plan, the budget guard "
                "and the logged privacy/epsilon of a further fit do not compose, so training it further is refused. "
                "Test, validate or report it as it is (pl-dp test/validate/report), or train the chosen "
                "hyperparameters in a fresh run (pl-dp fit without --ckpt_path), whose epsilon then adds to the "
                "search's."
            )
        self.planned_steps = planned_steps
        self._fit_start = self.private_steps  # a fit is a banded mechanism of its own (its noise recursion restarts)
        releases = self.compositions(steps_left)
        spent = self._accountant.get_epsilon(self._delta)
        if restored is not None:
            self._resume_plan(restored, releases, allow_change)
        elif spent >= spec.epsilon:
            raise PrivacyConfigError(
                f"this module has already spent epsilon={spent:.3f} (delta={self._delta:.3g}) of its target "
                f"epsilon={spec.epsilon:g} in earlier fits: there is no budget left for the {steps_left} steps "
                "this fit plans. Epsilon composes across fits; train a fresh module, or raise the target on "
                "purpose with pl_dp.callbacks.AllowPrivacySpecChange from a checkpoint."
            )
        elif spec.noise_multiplier is not None:
            self.noise_multiplier = spec.noise_multiplier
            eps = self._epsilon_after(self._delta, releases)
            if eps > spec.epsilon:
                raise PrivacyConfigError(
                    f"noise_multiplier={self.noise_multiplier:g} cannot meet epsilon={spec.epsilon:g} "
                    f"(delta={self._delta:.3g}) for the {steps_left} planned private steps at sample "
                    f"rate {self._sample_rate:.4g}"
                    + (f" on top of the {spent:.3f} already spent" if spent else "")
                    + f": it would spend epsilon={eps:.3f}. Raise the noise multiplier, plan fewer steps, or "
                    "leave noise_multiplier=None to calibrate."
                )
        else:
            self.noise_multiplier = calibrate_noise_multiplier(
                spec.epsilon, self._delta, self._sample_rate, max(releases, 1), self._accountant
            )
        horizon = self._accountant.steps + releases
        self.exhausted = False
        self._budgets = [StepBudget(self._accountant, spec.epsilon, self._delta, horizon=horizon)]
        self._tracker = EpsilonTracker(self._accountant, self._delta, horizon)
        if restored is None:  # a new plan meets the target by construction (calibrated, or checked above)
            return
        planned_epsilon = self._epsilon_after(self._delta, releases)
        if planned_epsilon > spec.epsilon:
            warnings.warn(
                f"this fit plans {steps_left} more private steps, which at the checkpoint's noise multiplier "
                f"{self.noise_multiplier:.4g} would spend epsilon={planned_epsilon:.3f} > the target "
                f"{spec.epsilon:g}: training will stop before the step that would exceed it (privacy_exhausted). "
                "To train longer, resume with a larger epsilon on purpose (pl_dp.callbacks.AllowPrivacySpecChange "
                "re-plans sigma for the steps left).",
                stacklevel=3,
            )

    def _epsilon_after(self, delta: float, releases: int) -> float:
        """ε after ``releases`` more compositions (:meth:`compositions`) of the current plan (σ, q) at ``delta``."""
        return self._accountant.epsilon_after(
            delta, releases, noise_multiplier=self.noise_multiplier, sample_rate=self._sample_rate
        )

    def check_resume(self, saved: dict[str, Any], allow_change: bool, sample_rate: float | None = None) -> list[str]:
        """What a resume of the checkpoint state ``saved`` changes: its privacy spec, and its sample rate when
        ``sample_rate`` (the loader's) is given. A change is refused unless ``allow_change``; an allowed change of
        the spec is recorded (:attr:`spec_changes`, once per resume), so the report says what the earlier steps
        were planned for. Runs when a fit resumes a checkpoint — before its loader is read, so also when the
        checkpoint has no step left to train — and again in the plan, with the loader's sample rate.
        """
        changes = []
        spec = self._spec.to_dict()
        if saved["privacy"] != spec:
            changes.append(f"the checkpoint was trained with privacy={saved['privacy']} but this run asks for {spec}")
        if sample_rate is not None and not math.isclose(saved["sample_rate"], sample_rate, rel_tol=1e-12):
            changes.append(
                f"the checkpoint's sample rate {saved['sample_rate']:g} differs from the loader's {sample_rate:g}"
            )
        if sample_rate is not None and saved.get("bands", 1) != self.bands:
            changes.append(
                f"the checkpoint's {saved.get('bands', 1)} cyclic groups differ from the loader's {self.bands}"
            )
        if changes and not allow_change:
            raise PrivacyConfigError(
                "; ".join(changes) + ": resuming under a different privacy spec or sample rate is refused (the "
                "accountant would no longer describe the run). To continue on purpose, with the saved history "
                "kept and sigma re-planned for the rest, add the callback pl_dp.callbacks.AllowPrivacySpecChange."
            )
        if saved["privacy"] != spec:
            change = {"private_steps": int(saved["private_steps"]), "from": saved["privacy"], "to": spec}
            if not self.spec_changes or self.spec_changes[-1] != change:
                self.spec_changes.append(change)
        return changes

    def _resume_plan(self, saved: dict[str, Any], releases: int, allow_change: bool) -> None:
        changes = self.check_resume(saved, allow_change, self._sample_rate)
        if not changes:
            self.noise_multiplier = saved["noise_multiplier"]
            return
        self._replan_after_change(changes, releases)

    def _replan_after_change(self, changes: list[str], releases: int) -> None:
        """σ for the compositions left, on top of the restored accountant history (never from zero)."""
        spec = self._spec
        remaining = max(1, releases)
        spent = self._accountant.get_epsilon(self._delta) if self._accountant.history else 0.0
        if spent >= spec.epsilon:
            raise PrivacyConfigError(
                f"the checkpoint has already spent epsilon={spent:.3f} (delta={self._delta:.3g}); the new target "
                f"epsilon={spec.epsilon:g} leaves nothing for the {remaining} steps left."
            )
        if spec.noise_multiplier is not None:
            self.noise_multiplier = spec.noise_multiplier
            total = self._epsilon_after(self._delta, remaining)
            if total > spec.epsilon:
                raise PrivacyConfigError(
                    f"noise_multiplier={self.noise_multiplier:g} cannot meet epsilon={spec.epsilon:g} for the "
                    f"{remaining} steps left on top of the checkpoint's spent epsilon={spent:.3f}: it would "
                    f"reach {total:.3f}."
                )
        else:
            self.noise_multiplier = calibrate_noise_multiplier(
                spec.epsilon, self._delta, self._sample_rate, remaining, self._accountant
            )
        warnings.warn(
            "; ".join(changes) + f". Continuing as allowed: epsilon spent so far {spent:.3f} is kept, and the "
            f"{remaining} steps left use noise multiplier {self.noise_multiplier:.4g}.",
            stacklevel=4,
        )

    # ---- the guard ---------------------------------------------------------------------------
    def add_target(self, epsilon: float, delta: float | None = None) -> float:
        """Register a budget tighter than (or equal to) the spec's; returns the ε this fit's plan would spend.

        The guard then refuses the step that would take ε past ``epsilon`` at ``delta`` (default: the
        run's δ). A fixed σ whose plan cannot meet the target is refused now; a calibrated plan that
        exceeds it runs until the guard stops it.
        """
        delta = self._delta if delta is None else delta
        releases = max(self._budgets[0].horizon - self._accountant.steps, 0) if self._budgets else 0
        self._budgets.append(StepBudget(self._accountant, epsilon, delta, horizon=self._accountant.steps + releases))
        planned = self._epsilon_after(delta, releases)
        if planned > epsilon and self._spec.noise_multiplier is not None:
            raise PrivacyConfigError(
                f"the {releases} planned private releases with noise_multiplier={self.noise_multiplier:g} would "
                f"spend epsilon={planned:.3f} > target {epsilon:g}: refusing to start. Raise the noise multiplier "
                "or plan fewer steps."
            )
        return planned

    def allows_next_step(self) -> bool:
        """Whether the next private step keeps ε within every target; once refused, stays refused this fit. A step
        inside a band (no composition of its own: :meth:`compositions`) was paid for at the band's first step."""
        if not self.exhausted and self.compositions(1):
            self.exhausted = not all(b.allows(self.noise_multiplier, self._sample_rate) for b in self._budgets)
        return not self.exhausted

    # ---- the record --------------------------------------------------------------------------
    def record(self, mechanism: Any) -> None:
        """Record one private step of ``mechanism`` (a :class:`SubsampledGaussian` or tree release): with the
        accountants when it opens a composition (:meth:`compositions`: every step but those inside a band)."""
        if self.compositions(1):
            mechanism.account(self.accountant, self._segment)
        self.private_steps += 1

    def write_journal(self, directory: Path, writer: bool) -> None:
        """Record this fit's released steps, before something leaves the process (only the ``writer`` rank).

        ``directory`` is used when the lineage has no journal yet (a checkpoint saved without a
        checkpoint callback).
        """
        if self._segment is None or not self._segment.history:
            return
        if self.journal is None:
            if self.lineage is None:
                raise RuntimeError("the journal is written after open_journal, which names the lineage.")
            self.journal = PrivacyJournal.of(directory, self.lineage)
        if writer:
            self.journal.record(self._segment_id, self._segment)

    @property
    def epsilon(self) -> float:
        """Exact ε spent so far (0 for a non-private run); for a search's release (:attr:`search`) the whole
        search's ε (:func:`~pl_dp.privacy.selection.release_epsilon`), the report's, never the one trial's."""
        if self.accountant is None or self.delta is None:
            return 0.0
        if self.search is not None and self.accountant.history:
            return release_epsilon(self.search, self.accountant.history, self.private_steps, self.delta)
        return self.accountant.get_epsilon(self.delta)

    def logged_epsilon(self, final: bool = False, written: bool = True) -> dict[str, float]:
        """The ε values a logged step logs (:meth:`EpsilonTracker.metrics`; none before a plan): ``"epsilon"``,
        the accountant's exact ε, where it is evaluated (always at the fit's ``final`` step), and for PRV and
        PLD ``"epsilon_rdp"``, the Rényi-DP upper bound of the same history."""
        return {} if self._tracker is None else self._tracker.metrics(final, written)

    # ---- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds for ε to stay right — and nothing secret."""
        return {
            "privacy": self.spec.to_dict() if self.spec else None,
            "unit": self.unit.to_dict() if self.unit is not None else None,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
            "bands": self.bands,
            "delta": self.delta,
            "planned_steps": self.planned_steps,
            "private_steps": self.private_steps,
            "accountant": self.accountant.state_dict() if self.accountant else None,
            "user_seeded": dict(self.user_seeded),
            "spec_changes": [dict(change) for change in self.spec_changes],
            "lineage": self.lineage,
            "journal": str(self.journal.path) if self.journal is not None else None,
            **({"search": dict(self.search)} if self.search is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["privacy"] is None) != (self.spec is None):
            raise PrivacyConfigError("cannot resume a private run as a non-private one or the reverse.")
        self.private_steps = int(state["private_steps"])
        unit = state.get("unit")  # checkpoints before user-level privacy: example-level
        self.unit = PrivacyUnit.from_dict(unit) if unit is not None else None
        self.noise_multiplier = float(state["noise_multiplier"])
        self.sample_rate = state["sample_rate"]
        self.expected_batch_size = state.get("expected_batch_size")
        self.bands = int(state.get("bands", 1))
        self.delta = state["delta"]
        self.planned_steps = state["planned_steps"]
        for secret, seeded in state.get("user_seeded", {}).items():
            self.user_seeded[secret] |= bool(seeded)
        self.spec_changes = [dict(change) for change in state.get("spec_changes") or ()]
        self.search = dict(state["search"]) if state.get("search") else None
        if self.accountant is not None:
            self.accountant.load_state_dict(state["accountant"])
        # the lineage and its journal, so that ε counts every step the lineage released even when no fit follows (a
        # finished run resumed: Lightning skips training, and open_journal never runs) and a checkpoint saved then
        # keeps them (found by an independent review: it dropped both, and a later resume under-counted)
        self.lineage = state.get("lineage") or self.lineage
        path = state.get("journal")
        if path:
            self.journal = PrivacyJournal(path)
            accountant = self.accountant
            if accountant is not None:
                released = self.journal.composed(accountant.name)
                if released.history and released.steps >= accountant.steps:
                    accountant.load_state_dict(released.state_dict())

    def report(self, method: str, secure_rng: bool, noise_seeded: bool) -> PrivacyReport:
        """The privacy report of this record (the same one a checkpoint of it gives)."""
        state = self.state_dict() | {"method": method, "secure_rng": secure_rng}
        state["user_seeded"] = {**self.user_seeded, "noise": self.user_seeded["noise"] or noise_seeded}
        return PrivacyReport.from_state(state)
