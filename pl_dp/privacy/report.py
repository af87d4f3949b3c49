"""The privacy report of a run: what was spent, under which assumptions, and what is and is not protected.

Built from the same privacy state a checkpoint holds (``PrivateModule.privacy_state_dict()``), so a
live module and a checkpoint on disk give the same report: ε is recomputed from the recorded
accountant history, never taken from a stored number.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from dp_accounting import NeighboringRelation

from pl_dp.errors import ConfigError
from pl_dp.privacy.accountants import STATE_NAME_KEY, accountant_class, load_accountant
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.privacy.selection import TrialCount, release_epsilon
from pl_dp.privacy.units import PrivacyUnit
from pl_dp.step.independence import RELEASE_TOLERANCE

#: how the report words each neighbouring relation an accountant declares (``Accountant.adjacency``)
ADJACENCY = {NeighboringRelation.ADD_OR_REMOVE_ONE: "add/remove-one", NeighboringRelation.REPLACE_ONE: "replace-one"}
DEFAULT_ADJACENCY = ADJACENCY[NeighboringRelation.ADD_OR_REMOVE_ONE]

#: whom the guarantee protects, by unit of privacy (:mod:`pl_dp.privacy.units`)
PROTECTED_UNIT = {"example": "one example", "user": "one user (all of their examples)"}
PROTECTED = (
    "every model and checkpoint released during training and at its end, and the logged privacy/* "
    "metrics and statistics of noisy releases, against an adversary who knows the code, the config, "
    "every checkpoint and log, and all the data except whether {unit} is in it"
)
NOT_PROTECTED = (
    "validation, test and public data and anything computed from them",
    "metrics under diagnostics/not_private/ (logged only with log_private_metrics=True)",
    "choices made by looking at private results (hyperparameter tuning on private data), but a search by pl-dp tune, "
    "whose released model's report accounts it",
    "timing side channels",
)
#: what is treated as public about the private set's size, by unit of privacy
SIZE_SHOWN = {
    "example": "the size of the private set: q = batch_size / n, δ's default 1/n and the steps per epoch are computed "
    "from n and shown, as in Opacus (n is treated as public)",
    "user": "the number of users U and of examples: q = users per batch / U, δ's default 1/U and the steps per epoch "
    "are computed from U and shown (U and the number of examples are treated as public)",
}


def _plain(value: Any) -> str:
    """A spec's value as the report writes it (2.0 as 2, None as "none")."""
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


@dataclass(frozen=True)
class PrivacyReport:
    """What one run spent and what the number means. ``str(report)`` is a readable block."""

    method: str
    private: bool
    epsilon: float
    target_epsilon: float | None
    delta: float | None
    accountant: str | None
    adjacency: str
    noise_multiplier: float
    sample_rate: float | None
    expected_batch_size: float | None
    private_steps: int
    planned_steps: int | None
    user_seeded: tuple[str, ...]
    secure_rng: bool
    charged_steps: int = 0  # the steps the accountant composes: these and what the lineage's journal adds
    #: the composed history as runs of one plan: (noise multiplier, sample rate — None for a partition —, steps)
    segments: tuple[tuple[float, float | None, int], ...] = ()
    #: the privacy specs a resume replaced (``AllowPrivacySpecChange``): after how many private steps, from, to
    spec_changes: tuple[dict[str, Any], ...] = ()
    #: how far one record may move the other examples' part of a release, in units of C (checked at fit start)
    release_tolerance: float = RELEASE_TOLERANCE
    #: ε had one record moved every release by the whole tolerance, (1 + ``release_tolerance``)·C: each noise multiplier
    #: over 1 + the tolerance (example-level runs outside a search, ε finite; None otherwise). The tolerance is the
    #: probe's, of the clipped sums and differences a step releases; an auxiliary release (adaptive clipping's count
    #: of norms below the bound) is outside it. One more evaluation of the accountant when the report is made
    epsilon_at_tolerance: float | None = None
    #: the hyperparameter search (``pl-dp tune``) that released this model, or None: the distribution of the number
    #: of trials (mean, shape), the score (metric, value), the candidate and whether its draws were seeded
    search: dict[str, Any] | None = None
    #: the ε of the one trial that trained this model (``epsilon`` is then the whole search's)
    trial_epsilon: float | None = None
    #: the unit of privacy, ``"example"`` or ``"user"`` (:class:`~pl_dp.privacy.units.PrivacyUnit`)
    unit: str = "example"
    #: how many units the private set holds (examples, or users): the n of q and of δ's default; None before a plan
    population: int | None = None
    #: cyclic groups of the sampling, with banded correlated noise (1: plain Poisson sampling, independent noise)
    bands: int = 1

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PrivacyReport:
        """The report of a privacy state (a module's ``privacy_state_dict()`` or a checkpoint's ``"pl_dp"``)."""
        spec = state.get("privacy")
        accountant_state = state.get("accountant")
        unit = PrivacyUnit.from_dict(state["unit"]) if state.get("unit") else None
        epsilon, charged, segments, at_tolerance = 0.0, 0, [], None
        if spec is not None and accountant_state is not None:
            accountant = load_accountant(accountant_state)
            segments = accountant.segments()
            if state.get("delta") is not None:
                epsilon, charged = accountant.get_epsilon(state["delta"]), accountant.steps
                finite = 0 < epsilon < math.inf  # an infinite ε is infinite at the tolerance too: not evaluated again
                if finite and state.get("search") is None and (unit is None or unit.kind == "example"):
                    at_tolerance = accountant.epsilon_at_sensitivity(1 + RELEASE_TOLERANCE, state["delta"])
        name = accountant_state[STATE_NAME_KEY] if accountant_state else None
        search, trial_epsilon = state.get("search"), None
        if (
            search is not None and accountant_state is not None and epsilon
        ):  # a search's release: Papernot & Steinke's bound over its random trials
            history = accountant_state["history"]
            trial = search.get("history", history)
            trial_epsilon = load_accountant({**accountant_state, "history": trial}).get_epsilon(state["delta"])
            epsilon = release_epsilon(search, history, state.get("private_steps"), state["delta"])
        seeded = tuple(k for k, v in state.get("user_seeded", {}).items() if v)
        return cls(
            method=state["method"],
            private=spec is not None,
            epsilon=epsilon,
            target_epsilon=spec["epsilon"] if spec else None,
            delta=state.get("delta"),
            accountant=name,
            adjacency=ADJACENCY[accountant_class(name).adjacency] if name else DEFAULT_ADJACENCY,
            noise_multiplier=float(state.get("noise_multiplier") or 0.0),
            sample_rate=state.get("sample_rate"),
            expected_batch_size=state.get("expected_batch_size"),
            private_steps=int(state.get("private_steps", 0)),
            planned_steps=state.get("planned_steps"),
            user_seeded=seeded + (("number of trials",) if search and search.get("seeded") else ()),
            secure_rng=bool(state.get("secure_rng", False)),
            charged_steps=int(charged),
            segments=tuple(segments),
            spec_changes=tuple(dict(change) for change in state.get("spec_changes") or ()),
            search=dict(search) if search is not None else None,
            trial_epsilon=trial_epsilon,
            epsilon_at_tolerance=at_tolerance,
            unit=unit.kind if unit is not None else "example",
            population=unit.population if unit is not None else None,
            bands=int(state.get("bands", 1)),
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> PrivacyReport:
        """The report of a Lightning checkpoint written by a pl_dp method."""
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        if "pl_dp" not in checkpoint:
            raise ConfigError(f"{path} holds no pl_dp privacy state: it was not written by a pl_dp method.")
        return cls.from_state(checkpoint["pl_dp"])

    @property
    def is_guarantee(self) -> bool:
        """Whether ε holds against everyone: a private run whose secrets were never user-seeded."""
        return self.private and not self.user_seeded

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for loggers' hyperparameters, YAML, JSON)."""
        segments = [{"noise_multiplier": s, "sample_rate": q, "steps": n} for s, q, n in self.segments]
        return asdict(self) | {
            "user_seeded": list(self.user_seeded),
            "is_guarantee": self.is_guarantee,
            "segments": segments,
            "spec_changes": [dict(change) for change in self.spec_changes],
        }

    def _plan_lines(self) -> list[str]:
        """σ, q and steps as they ran: one line for one plan, a line per segment when the plan changed."""
        planned = f" (planned {self.planned_steps})" if self.planned_steps else ""
        if len(self.segments) <= 1:
            sigma = self.segments[0][0] if self.segments else self.noise_multiplier
            return [
                f"  accountant    {self.accountant}; noise multiplier {sigma:.4g}; "
                f"{self.private_steps} private steps{planned}"
            ]
        lines = [
            f"  accountant    {self.accountant}; {self.private_steps} private steps{planned}, in "
            f"{len(self.segments)} segments of one noise multiplier and sample rate (the plan changed: epsilon "
            "composes them all)"
        ]
        unit = "steps" if self.bands == 1 else f"compositions (one per band of {self.bands} steps)"
        for index, (sigma, rate, steps) in enumerate(self.segments, 1):
            sampled = "" if rate is None else f", sample rate {rate:.4g}"
            lines.append(f"  segment {index:<5} {steps} {unit} at noise multiplier {sigma:.4g}{sampled}")
        return lines

    def _search_lines(self) -> list[str]:
        """What a search's release adds: how the trials were counted and the best chosen."""
        if self.search is None:
            return []
        count = TrialCount(mean=self.search["mean"], shape=self.search["shape"])
        values = ", ".join(f"{key}={value}" for key, value in self.search["candidate"].items())
        trial_steps = self.search.get("released_steps")
        if trial_steps is None:
            trial_steps = sum(int(row[2]) for row in self.search.get("history", ()))
        later = (
            [
                f"  trained on    {self.private_steps - trial_steps} private steps after the search: epsilon composes "
                "the search with this model's whole history again (an upper bound)"
            ]
            if trial_steps and self.private_steps > trial_steps
            else []
        )
        return [
            f"  search        the best of a random number of trials (pl-dp tune), number of trials {count.describe()}: "
            "epsilon is Papernot & Steinke's (2022) Renyi-DP bound for the whole search (dp-accounting's "
            f"RepeatAndSelectDpEvent); each trial alone spent epsilon {self.trial_epsilon:.4g}, the event below",
            f"  selection     {self.search['metric']} {self.search['score']:.4g} on the validation split (outside the "
            f"protected set: no privacy cost), with {values}; the number of trials and the other trials stay hidden",
            *later,
        ]

    def _unit_sampling(self) -> str:
        """What the sampling line adds under user-level privacy: whom q samples, and how many rows a user is."""
        if self.unit != "user":
            return ""
        users = "users" if self.population is None else f"{self.population} users"
        return (
            f", over {users}: each user joins a batch with probability q and gives one of their examples, "
            "drawn at random, so one user is at most one row of any batch"
        )

    def _band_sampling(self) -> str:
        """What the sampling line adds under banded correlated noise: the cyclic groups and what one composition is."""
        if self.bands == 1:
            return ""
        return (
            f", cyclic over {self.bands} groups (each example in one, drawn at random; step t samples group t mod "
            f"{self.bands} at that rate); banded correlated noise (matrix factorization): the accountant composes one "
            f"subsampled Gaussian per band of {self.bands} steps of each fit, Choquette-Choo et al. 2023"
        )

    def _change_lines(self) -> list[str]:
        lines = []
        for change in self.spec_changes:
            before, after = change.get("from") or {}, change.get("to") or {}
            moved = [
                f"{k} {_plain(before.get(k))} -> {_plain(after.get(k))}" for k in after if before.get(k) != after.get(k)
            ]
            lines.append(
                f"  spec changed  after {change.get('private_steps')} private steps a resume changed the privacy "
                f"spec ({', '.join(moved)}), as AllowPrivacySpecChange allowed; the steps before it were planned "
                f"for target epsilon {_plain(before.get('epsilon'))}"
            )
        return lines

    def __str__(self) -> str:
        if not self.private:
            return f"pl_dp privacy report — {self.method}: non-private run (no privacy guarantee)."
        noise = "SHAKE-256 cryptographic generator" if self.secure_rng else "torch generator"
        lines = [
            f"pl_dp privacy report — {self.method}",
            (
                f"  guarantee     ({self.epsilon:.4g}, {self.delta:.3g})-DP per {self.unit}, {self.adjacency} adjacency"
                + (" of users (one user with all of their examples)" if self.unit == "user" else "")
                if self.delta is not None  # None until the first fit plans (e.g. `pl-dp test` of an untrained model)
                else "  guarantee     nothing spent: no private fit yet"
            )
            + (f"; target epsilon {self.target_epsilon:g}" if self.target_epsilon is not None else "")
            + (" per trial" if self.search is not None and self.target_epsilon is not None else ""),
            *self._search_lines(),
            *self._plan_lines(),
            *self._change_lines(),
        ]
        if self.charged_steps > self.private_steps:
            lines.append(
                f"  journal       epsilon composes {self.charged_steps} private steps: the {self.private_steps} of "
                f"this line of training and {self.charged_steps - self.private_steps} more that its lineage released "
                "elsewhere — after the checkpoint it resumed from, or in other resumes of one — as the privacy "
                "journal records: every released step counts, also the ones a resume discards"
            )
        if self.accountant is not None and not accountant_class(self.accountant).supports(SubsampledGaussian):
            lines.append("  sampling      a fixed partition of the private set (each example in one round per pass)")
        elif self.sample_rate is not None:
            expected = "" if self.expected_batch_size is None else f" (expected batch {self.expected_batch_size:.4g})"
            rates = {rate for _, rate, _ in self.segments}
            rate = (
                f"rate {self.sample_rate:.4g}" if len(rates) <= 1 else f"rate per segment; now {self.sample_rate:.4g}"
            )
            lines.append(f"  sampling      Poisson, {rate}{expected}" + self._unit_sampling() + self._band_sampling())
        if self.user_seeded:
            lines.append(
                f"  secrets       USER-SEEDED ({', '.join(self.user_seeded)}): epsilon is NO guarantee against "
                "anyone who knows those seeds (config, hparams)"
            )
        else:
            lines.append(
                "  secrets       noise and sampling drawn from OS entropy, held in memory only, fresh at every resume"
            )
        lines.append(f"  noise         {noise}" + ("" if self.secure_rng else " (not cryptographic)"))
        lines.append(
            "  independence  each example's part of a release depends on that example alone, checked at every private "
            "fit's start through the private loader, in the run's precision: one example replaced, added or inserted "
            f"moves the others' part of a release by at most {self.release_tolerance:.0%} of C on the probe batch, so "
            f"one record moves a release by at most {1 + self.release_tolerance:g}·C (half-precision runs pad their "
            "private batches to one shape)"
            + (
                ""
                if self.epsilon_at_tolerance is None
                else f"; epsilon {self.epsilon_at_tolerance:.4g} if it moved every release by that much"
            )
        )
        lines.append(f"  protects      {PROTECTED.format(unit=PROTECTED_UNIT[self.unit])}")
        not_protected = [*NOT_PROTECTED, SIZE_SHOWN[self.unit]]
        if self.search is not None:
            not_protected.append(
                "the search's working state while it ran (its directory, its progress lines): they show how many "
                "trials ran"
            )
        if not self.secure_rng:
            not_protected.append("floating-point attacks on the noise generator (secure_rng=False)")
        lines.append("  not protected " + "; ".join(not_protected))
        return "\n".join(lines)
