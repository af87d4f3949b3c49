"""``pl-dp tune``: a hyperparameter search on private data whose release is accounted (Papernot & Steinke 2022).

A search runs a random number K of private trials of one config — each with hyperparameters drawn uniformly at
random from a search space (``--tune.space "model.init_args.lr=[0.01,0.1,1.0]"``, several keys make a grid) —
scores each on the data module's validation split, and releases only the best trial's model and score, with a
privacy report whose (ε, δ) is Papernot & Steinke's bound for the whole search (ICLR 2022, Theorems 2 and 6;
:mod:`pl_dp.privacy.selection`): dp-accounting's ``RepeatAndSelectDpEvent(trial event, mean, shape)``.

What the bound needs, and how the search keeps it:

* **One mechanism, repeated.** Every trial must plan the same privacy event (σ, q and planned steps). The space may
  vary only the method's hyperparameters (``model.init_args.*`` but its ``privacy`` and the secrets' seeds),
  ``optimizer.*`` and ``lr_scheduler.*``; data, trainer and privacy keys are refused (:func:`check_space`). Each
  trial is accounted by its *plan*, fixed at fit start before any step (:func:`planned_event`): a trial that stops
  early (EarlyStopping, ``max_time``) released a prefix of its plan, which the plan's event bounds, and its actual
  step count — which may depend on the data — is never compared, printed or stored. The first trial's plan declares
  the event; a later trial that planned another stops the search, which then releases nothing.
* **Random hyperparameters.** Each trial draws its candidate uniformly from the grid (the theorem's i.i.d. runs);
  the grid is not enumerated in order, which would make the trials different mechanisms.
* **K random and hidden.** After each trial the search draws, from the OS's CSPRNG, whether to run one more, with
  the conditional probability of the distribution (:meth:`TrialCount.more_probability`): K is never drawn whole
  and never written. The search directory and the progress lines while it runs are its *working state*: they show
  how many trials ran, which the bound keeps hidden, so they must be kept like the private data. When the search
  ends it deletes the whole ``trials/`` folder (the best trial's model is in ``best.ckpt``) and keeps only the
  released result in its state file; release ``best.ckpt`` alone and keep the directory private.
* **The score costs nothing.** It is computed on the validation split, which pl_dp's privacy model leaves outside
  the protected set (docs/privacy-model.md): a split holding records whose privacy counts must not be used.

Resumable: the state file (``DIRECTORY/search.json``) records each finished trial (its candidate, score,
checkpoint, event) and each decision to go on. A search killed inside a trial counts that trial as one of the K,
finished with the worst score and no model (it is never re-run: re-running would let a user who watched its progress
re-roll its noise), and never re-spends or re-draws what it had decided.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.privacy.accountants import accountant_class
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.selection import SecretCoin, TrialCount

#: the state file of a search, in its directory
STATE_FILE = "search.json"
#: the released model of a finished search, in its directory
RELEASED_FILE = "best.ckpt"
#: prefixes of the keys a search space may vary, and the keys under them it may not
SEARCHABLE = ("model.init_args.", "optimizer.", "lr_scheduler.")
NOT_SEARCHABLE = ("model.init_args.privacy", "model.init_args.noise_seed", "model.init_args.sampling_seed")
#: what the trials' Trainer is given over the config: no logger (a trial's logs would be releases the bound does
#: not cover) and no Lightning checkpoints (the search saves the one it needs)
TRIAL_TRAINER = ("--trainer.logger=false", "--trainer.enable_checkpointing=false")


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Keys of a config and the values a trial may give each; a candidate is one value per key (the grid)."""

    values: Mapping[str, tuple[Any, ...]]

    @classmethod
    def parse(cls, entries: Sequence[str]) -> SearchSpace:
        """``["model.init_args.lr=[0.01,0.1]", ...]`` (YAML lists) as a space, checked by :func:`check_space`."""
        values: dict[str, tuple[Any, ...]] = {}
        for entry in entries:
            key, equals, listed = entry.partition("=")
            parsed = yaml.safe_load(listed) if equals else None
            if not key.strip() or not isinstance(parsed, list) or not parsed:
                raise ConfigError(
                    f"--tune.space {entry!r} is not KEY=[VALUE, ...]: write e.g. "
                    "--tune.space 'model.init_args.lr=[0.01,0.1,1.0]' (one option per key)."
                )
            if key.strip() in values:
                raise ConfigError(f"--tune.space names {key.strip()} twice: give its values in one list.")
            values[key.strip()] = tuple(parsed)
        if not values:
            raise ConfigError("pl-dp tune needs a search space: --tune.space 'model.init_args.lr=[0.01,0.1,1.0]'.")
        check_space(values)
        return cls(values=values)

    def candidates(self) -> list[dict[str, Any]]:
        """Every combination of values, in a fixed order."""
        keys = list(self.values)
        return [dict(zip(keys, combination)) for combination in itertools.product(*self.values.values())]


def check_space(values: Mapping[str, Any]) -> None:
    """Refuse keys that may change a trial's privacy event (σ, q, steps) or its secrets: Papernot & Steinke's bound
    holds for one mechanism repeated, so every trial must release the same event."""
    refused = [
        key
        for key in values
        if not key.startswith(SEARCHABLE) or any(key == bad or key.startswith(bad + ".") for bad in NOT_SEARCHABLE)
    ]
    if refused:
        raise PrivacyConfigError(
            f"the search space may not vary {', '.join(refused)}: every trial of a search must release the same "
            "privacy event (noise multiplier, sample rate and steps), which the data, the trainer and the privacy "
            "spec set, and the secrets' seeds are no hyperparameters. Vary the method's hyperparameters "
            f"(model.init_args.* but privacy and the seeds: lr, clip, ...), optimizer.* or lr_scheduler.*."
        )


def candidate_arguments(candidate: Mapping[str, Any]) -> list[str]:
    """A candidate as command-line options over the config."""
    return [f"--{key}={json.dumps(value)}" for key, value in candidate.items()]


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """What one finished trial left: its score, its *planned* privacy event, δ and its checkpoint.

    ``history`` is the accountant history the trial's plan — σ, q and the planned steps, fixed at fit start before
    any step — releases, never the steps the trial actually took: a trial may stop early on its model's results
    (EarlyStopping, ``max_time``), and a step count that depends on the data may be neither compared, printed nor
    stored (found by review). A trial that stops early releases a prefix of its plan's iterates, so the plan's event
    bounds it; a trial whose steps exceed the plan is refused (:func:`planned_event`)."""

    score: float
    history: list[list[float]]
    accountant: str
    delta: float
    checkpoint: str


#: runs one trial: (candidate, its directory) -> its result
TrialRunner = Callable[[Mapping[str, Any], Path], TrialResult]


@dataclass(frozen=True, kw_only=True)
class Released:
    """The output of a finished search: the best model's checkpoint and score, or nothing (K = 0 under Poisson)."""

    checkpoint: Path | None
    score: float | None
    candidate: dict[str, Any] | None
    #: every trial drawn was interrupted (killed), so no model was finished to release
    interrupted: bool = False

    @property
    def report(self) -> PrivacyReport | None:
        """The released model's privacy report: ε of the whole search, recomputed from the checkpoint."""
        return None if self.checkpoint is None else PrivacyReport.from_checkpoint(self.checkpoint)

    def __str__(self) -> str:
        if self.checkpoint is None and self.interrupted:
            return "pl-dp tune: every trial drawn was interrupted (each counts as lost): nothing is released."
        if self.checkpoint is None:
            return "pl-dp tune: the number of trials drawn was 0 (Poisson): nothing was run and nothing is released."
        values = ", ".join(f"{key}={value}" for key, value in (self.candidate or {}).items())
        return f"pl-dp tune: released {self.checkpoint} (score {self.score:.4f}; {values})\n{self.report}"


@dataclass(kw_only=True)
class Search:
    """One search: what it is (``identity``, checked on every resume) and its state file in ``directory``.

    Args:
        directory: where the search keeps its working state and writes the released model.
        space: the hyperparameters the trials draw from.
        count: the distribution of the number of trials.
        metric: the validation metric a trial is scored by, and ``mode`` whether larger (``"max"``) is better.
        identity: what else defines the search (the config and options): a resume must match it.
        coin: the secret draws (number of trials, candidates); from OS entropy unless seeded for a test.
        progress: print a line as each trial starts (working state: it shows how many trials ran).
    """

    directory: Path
    space: SearchSpace
    count: TrialCount
    metric: str = "val/acc"
    mode: str = "max"
    identity: Mapping[str, Any] = field(default_factory=dict)
    coin: SecretCoin = field(default_factory=SecretCoin)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise ConfigError(f"--tune.mode must be 'max' or 'min', got {self.mode!r}.")
        self.directory = Path(self.directory)

    @property
    def _state_path(self) -> Path:
        return self.directory / STATE_FILE

    def _description(self) -> dict[str, Any]:
        return {
            "space": {key: list(values) for key, values in self.space.values.items()},
            "mean": self.count.mean,
            "shape": "inf" if self.count.is_poisson else self.count.shape,
            "metric": self.metric,
            "mode": self.mode,
            **self.identity,
        }

    def _load(self) -> dict[str, Any]:
        if not self._state_path.exists():
            return {"search": self._description(), "trials": [], "more": None, "event": None, "released": None}
        state = json.loads(self._state_path.read_text())
        if state["search"] != json.loads(json.dumps(self._description())):
            raise ConfigError(
                f"{self.directory} holds a different search (its config, space or trial distribution differ): "
                "resume it with the same command line, or start this one in a new --tune.directory."
            )
        return state

    def _save(self, state: dict[str, Any]) -> None:
        """Write the state atomically: a kill leaves the old file or the new one, never half of one."""
        self.directory.mkdir(parents=True, exist_ok=True)
        temporary = self._state_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(state, indent=1))
        os.replace(temporary, self._state_path)

    def run(self, run_trial: TrialRunner, max_trials: int | None = None) -> Released | None:
        """Run (or resume) the search; ``max_trials`` caps the trials this call starts (``None``: no cap), and a
        capped call returns ``None`` with the search resumable. A finished search returns its release again."""
        state = self._load()
        started = 0
        while state["released"] is None:
            trials = state["trials"]
            if trials and trials[-1]["score"] is None:  # killed inside this trial: it counts, and lost
                self._count_interrupted(state, trials[-1])
            else:
                if state["more"] is None:  # one decision per finished trial, kept once drawn
                    state["more"] = self.coin.one_more(self.count, len(trials))
                    self._save(state)
                if not state["more"]:
                    self._release(state)
                    break
                if max_trials is not None and started >= max_trials:
                    return None
                candidates = self.space.candidates()
                trial: dict[str, Any] = {
                    "id": uuid.uuid4().hex,
                    "candidate": candidates[self.coin.choice(len(candidates))],
                }
                trial["score"] = None
                trials.append(trial)
                state["more"] = None
                self._save(state)
                started += 1
                self._run_trial(state, trial, run_trial)
        return self._released(state)

    def _count_interrupted(self, state: dict[str, Any], trial: dict[str, Any]) -> None:
        """A trial killed before it finished is one of the K trials, finished with the worst score and no model.

        Re-running it would draw fresh noise for a trial whose progress the user may have watched: a user who kills
        every bad-looking trial would release the best of many runs while the report states the bound for K (found
        by review). Counted as lost, a kill can only lose a trial, never re-roll it; the decision to go on after it is
        drawn as after any trial."""
        trial.update(score=-math.inf if self.mode == "max" else math.inf, checkpoint=None, interrupted=True)
        shutil.rmtree(self.directory / "trials" / trial["id"], ignore_errors=True)
        state["more"] = None
        self._save(state)

    def _run_trial(self, state: dict[str, Any], trial: dict[str, Any], run_trial: TrialRunner) -> None:
        directory = self.directory / "trials" / trial["id"]
        shutil.rmtree(directory, ignore_errors=True)
        if self.progress:
            values = ", ".join(f"{key}={value}" for key, value in trial["candidate"].items())
            print(f"pl-dp tune: a trial starts ({values}) [working state: keep private]", file=sys.stderr)
        result = run_trial(trial["candidate"], directory)
        event = {"accountant": result.accountant, "history": result.history, "delta": result.delta}
        if state["event"] is None:
            state["event"] = event
        elif event != state["event"]:  # planned events come from the config: the later one is not printed anyway
            raise PrivacyConfigError(
                f"a trial planned another privacy event than the first trial's {state['event']}: the trials are not "
                "one mechanism repeated, so Papernot & Steinke's bound does not hold, and the search stops without "
                f"releasing anything (keep {self.directory} private). Vary only hyperparameters that leave the "
                "noise multiplier, the sample rate and the planned steps unchanged, in a new --tune.directory."
            )
        trial["checkpoint"] = result.checkpoint
        trial["score"] = self._comparable(result.score)
        self._save(state)

    def _comparable(self, score: float) -> float:
        """A non-finite score ranks last (a diverged trial is a valid, bad outcome)."""
        if math.isfinite(score):
            return float(score)
        return -math.inf if self.mode == "max" else math.inf

    def _release(self, state: dict[str, Any]) -> None:
        """Write the best trial's model with the search's record, delete the other trials and every trace of how
        many ran, and mark the search released."""
        trials = state["trials"]
        if not trials:  # Poisson: K = 0
            state.update(released={"checkpoint": None, "trial": None})
            self._save(state)
            return
        sign = 1.0 if self.mode == "max" else -1.0
        best = max(trials, key=lambda trial: (sign * trial["score"], trial["checkpoint"] is not None))
        if best["checkpoint"] is None:  # every trial was interrupted: there is no model to release
            state.update(trials=[], more=None, released={"checkpoint": None, "trial": None, "interrupted": True})
            self._save(state)
            return
        checkpoint = torch.load(best["checkpoint"], map_location="cpu", weights_only=False)
        checkpoint["pl_dp"]["search"] = {
            "mean": self.count.mean,
            "shape": self.count.shape,
            "metric": self.metric,
            "score": best["score"],
            "candidate": best["candidate"],
            "seeded": self.coin.seeded,
            "history": state["event"]["history"],  # the planned event, the same for every trial
            "released_steps": checkpoint["pl_dp"].get("private_steps"),  # the released trial's own (its output)
        }
        # the trial's privacy journal stays behind in trials/, which is deleted: the release is not trained further
        # (the ledger refuses it), so its checkpoint's history is all there is to count
        checkpoint["pl_dp"]["journal"] = None
        released = self.directory / RELEASED_FILE
        torch.save(checkpoint, released)
        state.update(
            trials=[],
            more=None,
            released={
                "checkpoint": str(released),
                "score": best["score"],
                "candidate": best["candidate"],
                "trial": best["id"],
            },
        )
        self._save(state)

    def _released(self, state: dict[str, Any]) -> Released:
        """The release of a finished search, after deleting the whole ``trials/`` folder — also what a search killed
        while it deleted it left. Nothing of a trial stays: a kept trial directory's modification time would show
        that other trials ran, and its ``trial.ckpt`` would report one trial's ε for the released model (found by
        review)."""
        released = state["released"]
        shutil.rmtree(self.directory / "trials", ignore_errors=True)
        if released["checkpoint"] is None:
            return Released(checkpoint=None, score=None, candidate=None, interrupted=released.get("interrupted", False))
        return Released(
            checkpoint=Path(released["checkpoint"]), score=released["score"], candidate=released["candidate"]
        )


def lightning_trial(config: Path, overrides: Sequence[str], metric: str, progress: bool) -> TrialRunner:
    """A trial as ``pl-dp fit`` runs it: the config with ``overrides`` and the candidate's values, fitted, scored by
    ``metric`` on the validation split, saved; no logger and no Lightning checkpoints (:data:`TRIAL_TRAINER`)."""
    from pl_dp.cli import PlDpCLI

    def run(candidate: Mapping[str, Any], directory: Path) -> TrialResult:
        command_line, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI reads sys.argv when given no args, and warns
        try:  # when given both: the trial's command line is ``args`` alone
            cli = PlDpCLI(
                model_class=None,
                datamodule_class=None,
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=[
                    "--config",
                    str(config),
                    *overrides,
                    *candidate_arguments(candidate),
                    *TRIAL_TRAINER,
                    f"--trainer.default_root_dir={directory}",
                    *([] if progress else ["--trainer.enable_progress_bar=false"]),
                ],
                run=False,
                save_config_callback=None,
            )
        finally:
            sys.argv = command_line
        model = cli.model
        accountant = getattr(model, "accountant_name", None)
        if accountant is None:
            raise PrivacyConfigError(
                "pl-dp tune runs private trials: the config's model has no privacy spec (model.init_args.privacy)."
            )
        if not accountant_class(accountant).supports(SubsampledGaussian):
            raise PrivacyConfigError(
                f"pl-dp tune accounts trials of Poisson-subsampled Gaussian steps; the {accountant!r} accountant's "
                "releases (a tree mechanism) have no repeat-and-select bound here: tune a Poisson-sampled method."
            )
        cli.trainer.fit(model, datamodule=cli.datamodule)
        if cli.trainer.interrupted:
            raise KeyboardInterrupt("the trial was interrupted: resume the search with the same command line.")
        scores = cli.trainer.validate(model, datamodule=cli.datamodule, verbose=False)
        scored = scores[0] if scores else {}
        if metric not in scored:
            raise ConfigError(
                f"the trials are scored by --tune.metric {metric!r}, which validation did not log; it logged "
                f"{sorted(scored) or 'nothing (does the data module have a validation split?)'}."
            )
        path = directory / "trial.ckpt"
        cli.trainer.save_checkpoint(path)
        state = model.privacy_state_dict()
        return TrialResult(
            score=float(scored[metric]),
            history=planned_event(state),
            accountant=accountant,
            delta=float(state["delta"]),
            checkpoint=str(path),
        )

    return run


def planned_event(state: Mapping[str, Any]) -> list[list[float]]:
    """The privacy event a fresh trial planned at fit start, before any step: ``[[σ, q, planned steps]]`` from its
    privacy state (:meth:`~pl_dp.privacy.ledger.PrivacyLedger.state_dict`), a function of the config and the data's
    size only. Under banded correlated noise over b cyclic groups a fit's T planned steps are ⌈T/b⌉ compositions
    (:meth:`~pl_dp.privacy.ledger.PrivacyLedger.compositions`), the rows its history holds.

    The trial's actual accountant history must fit in it — every row at the plan's σ and q, no more steps in all
    than planned — which holds whenever the trial stopped early (a prefix of the plan's releases: post-processing).
    Anything else is refused with a message that does not state the actual history, whose length may depend on the
    data."""
    sigma, rate, steps = state["noise_multiplier"], state["sample_rate"], state["planned_steps"]
    if steps is not None:
        steps = -(-int(steps) // int(state.get("bands", 1)))
    history = state["accountant"]["history"]
    fits = (
        rate is not None
        and steps is not None
        and all(
            math.isclose(row[0], sigma, rel_tol=1e-12) and math.isclose(row[1], rate, rel_tol=1e-12) for row in history
        )
        and sum(int(row[2]) for row in history) <= int(steps)
    )
    if not fits or not steps:
        raise PrivacyConfigError(
            "a trial's private steps do not fit the plan it made at fit start (noise multiplier, sample rate and "
            "planned steps), or it planned none: the search accounts each trial by its plan and cannot account this "
            "one, so it stops without releasing anything. Trials must be fresh fits of one plan: no ckpt_path, and no "
            "callback that changes the noise multiplier, the sample rate or the steps."
        )
    return [[float(sigma), float(rate), int(steps)]]


def split_arguments(argv: Sequence[str]) -> tuple[dict[str, list[str]], list[str]]:
    """``--tune.NAME VALUE`` (or ``=VALUE``) options by name, and the rest (the trials' command line)."""
    options: dict[str, list[str]] = {}
    rest: list[str] = []
    arguments: Iterator[str] = iter(argv)
    for argument in arguments:
        if not argument.startswith("--tune."):
            rest.append(argument)
            continue
        name, equals, value = argument[len("--tune.") :].partition("=")
        if not equals:
            value = next(arguments, "")
        options.setdefault(name, []).append(value)
    return options, rest


#: ``pl-dp tune``'s options (``--tune.NAME``), their defaults (``None``: required) and what they are
OPTIONS: dict[str, tuple[str | None, str]] = {
    "space": (None, "KEY=[VALUE, ...], repeated for each key (the grid each trial draws a candidate from)"),
    "mean": (None, "the mean number of trials, > 1"),
    "shape": ("1", "0 logarithmic, 1 geometric, another value > 0 truncated negative binomial, inf Poisson"),
    "directory": (None, "the search's working state and, once it ends, its released model (best.ckpt)"),
    "metric": ("val/acc", "the validation metric each trial is scored by"),
    "mode": ("max", "max or min: which score is best"),
    "progress": ("true", "show each trial's progress (working state: it shows how many trials ran)"),
    "max_trials": ("none", "start at most this many trials in this run, then stop (resume with the same command)"),
}
#: what ``pl-dp tune`` prints when --tune.max_trials stopped it before the search ended: working state, like the
#: progress lines (that the search goes on after N trials shows K > N)
PAUSED = "pl-dp tune: stopped before the search ended (--tune.max_trials); run the same command to resume it."
TUNE_USAGE = (
    "usage: pl-dp tune --config C.yaml --tune.space 'model.init_args.lr=[0.01,0.1,1.0]' --tune.mean 4 "
    "[--tune.shape 1] --tune.directory DIR [options over the config]\n\nA private hyperparameter search: a random "
    "number of trials (Papernot & Steinke 2022), only the best released, its epsilon that of the whole search.\n"
    + "\n".join(f"  --tune.{name:<11} {text}" + (f" (default {d})" if d else "") for name, (d, text) in OPTIONS.items())
)


def tune_command(argv: Sequence[str]) -> Released | None:
    """``pl-dp tune ...`` (without ``tune``): the search of the command line, run or resumed; what it released."""
    options, rest = split_arguments(argv)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown option(s) --tune.{', --tune.'.join(unknown)}; pl-dp tune takes --tune.{{{','.join(OPTIONS)}}}."
        )
    for name, (default, _) in OPTIONS.items():
        if name not in options:
            if default is None:
                raise ConfigError(f"pl-dp tune needs --tune.{name} ({OPTIONS[name][1]}).\n{TUNE_USAGE}")
            options[name] = [default]
        elif name != "space" and len(options[name]) > 1:
            raise ConfigError(f"--tune.{name} is given {len(options[name])} times: give it once.")
    configs = [i for i, argument in enumerate(rest) if argument == "--config" or argument.startswith("--config=")]
    if len(configs) != 1:
        raise ConfigError(f"pl-dp tune takes one --config (the trials' config), got {len(configs)}.\n{TUNE_USAGE}")
    index = configs[0]
    config = rest[index].partition("=")[2] if "=" in rest[index] else (rest[index + 1] if index + 1 < len(rest) else "")
    overrides = rest[:index] + rest[index + (1 if "=" in rest[index] else 2) :]
    if not Path(config).is_file():
        raise ConfigError(f"--config {config!r} is not a file.")

    def value(name: str) -> str:
        return options[name][0]

    try:
        mean, shape = float(value("mean")), float(value("shape"))
        max_trials = None if value("max_trials").lower() == "none" else int(value("max_trials"))
    except ValueError as error:
        raise ConfigError(
            f"pl-dp tune: {error} (--tune.mean and --tune.shape are numbers, --tune.max_trials an integer)."
        ) from None
    progress = yaml.safe_load(value("progress"))
    if not isinstance(progress, bool):
        raise ConfigError(f"--tune.progress is true or false, got {value('progress')!r}.")
    search = Search(
        directory=Path(value("directory")),
        space=SearchSpace.parse(options["space"]),
        count=TrialCount(mean=mean, shape=shape),
        metric=value("metric"),
        mode=value("mode"),
        identity={"config": Path(config).read_text(), "overrides": list(overrides)},
        progress=progress,
    )
    return search.run(lightning_trial(Path(config), overrides, search.metric, progress), max_trials=max_trials)
