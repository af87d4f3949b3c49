"""Empirical privacy audit of one private step (Jagielski et al. 2020; Nasr et al. 2021).

The audit runs a method's own ``private_step`` many times from the same parameters on two
neighbouring batches, D (``reference_size`` private examples) and D′ = D ∪ {canary}, with fresh DP
noise each time, and watches what the step *releases* (every tensor that passes through its
mechanism: q noisy scalars for the zeroth-order methods, k(+1) noisy losses for PAZO-S, the noisy
gradient sum for DP-SGD/Coupling). The canary is chosen to hit the clip bound: a private example
with its input scaled up and its label set to the class the model finds least likely, so its
per-example quantity saturates C in every release.

Everything else about the step is held fixed across trials (parameters, direction seed, public
batches), so the releases on D and D′ differ only by the canary's clipped contribution v. The test
statistic is the projection ⟨release − release₀(D), v⟩/‖v‖ (release₀: the noise-free step), the
most powerful test against a Gaussian mechanism. A threshold is chosen on half the trials and the
other half gives Clopper–Pearson bounds on its false-positive and false-negative rates, hence a
lower bound on ε that holds with the stated confidence:

    ε_lb = max( ln((1 − δ − FNR⁺)/FPR⁺),  ln((1 − δ − FPR⁺)/FNR⁺) )

The claimed ε is the accountant's ε for the same experiment: one step of the method's Gaussian
mechanism with multiplier σ (σ·ζ for banded noise, whose trial is a band's first step with noise σ·ζ·C), the canary
present with certainty (sample rate 1). A lower bound
above the claim means the implementation adds less noise than it accounts for.

Audit on small models: the canary construction scales float inputs, and each trial is one step. Both
neighbouring batches are built by the run's own private loader's ``collate_fn``, so what batching does (padding
to the longest example, a user's per-batch transform) is part of what is audited, and every trial runs inside the
trainer's precision context (autocast for ``bf16-mixed``/``16-mixed``, the half default dtype for ``bf16-true``), as
Lightning runs a training step: a half-precision run is audited in the precision it trains in.

:func:`release_shift` measures the noise-free part alone: how far one record moves the release (‖v‖ in units of
the clip bound, which may be exactly 0), e.g. for a canary whose own contribution is 0, where anything that moves
is the other examples' contributions.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from scipy.stats import beta
from torch.utils.data import default_collate

from pl_dp.errors import ConfigError
from pl_dp.methods.base import PrivateModule
from pl_dp.privacy.accountants import create_accountant
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.step.batches import batch_size_of
from pl_dp.step.losses import forward, split_inputs_targets
from pl_dp.step.validation import positive_integer


@dataclass(frozen=True)
class AuditResult:
    """What an audit measured, next to what the accountant claims for the same experiment."""

    method: str
    trials: int  # per hypothesis (D and D′)
    noise_multiplier: float
    delta: float
    claimed_epsilon: float
    epsilon_lower_bound: float
    confidence: float
    false_positive_rate: float  # on the held-out half, at the chosen threshold
    false_negative_rate: float
    canary_influence: float  # ‖v‖ relative to the clip bound: 1 = the canary saturates C in every release
    separation: float  # mean statistic gap in noise standard deviations (≈ 1/σ for a correct mechanism)

    @property
    def violated(self) -> bool:
        """True when the measured lower bound exceeds the claimed ε (an implementation bug)."""
        return self.epsilon_lower_bound > self.claimed_epsilon

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"violated": self.violated}

    def __str__(self) -> str:
        verdict = "VIOLATION: the mechanism leaks more than it accounts for" if self.violated else "consistent"
        return (
            f"pl-dp audit: {self.method}, {self.trials} trials per world, sigma {self.noise_multiplier:.4g}, "
            f"delta {self.delta:.2e} | claimed epsilon {self.claimed_epsilon:.3f} | empirical lower bound "
            f"{self.epsilon_lower_bound:.3f} ({self.confidence:.0%} confidence; FPR {self.false_positive_rate:.3f}, "
            f"FNR {self.false_negative_rate:.3f}) | canary influence {self.canary_influence:.2f}, "
            f"separation {self.separation:.2f} noise std | {verdict}"
        )


class _RecordingMechanism:
    """Delegates to the method's mechanism and keeps a copy of every tensor it releases."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.released: list[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def privatize(self, sums: torch.Tensor, noise: Any) -> torch.Tensor:
        out = self._inner.privatize(sums, noise)
        self.released.append(out.detach().flatten().double().cpu())
        return out

    def privatize_(self, sums: Sequence[torch.Tensor], noise: Any, blocks: Any = None) -> None:
        self._inner.privatize_(sums, noise, blocks=blocks)
        self.released.extend(t.detach().flatten().double().cpu() for t in sums)

    def privatize_auxiliary(self, count: torch.Tensor, noise: Any) -> torch.Tensor:
        out = self._inner.privatize_auxiliary(count, noise)
        self.released.append(out.detach().flatten().double().cpu())
        return out

    def account(self, *accountants: Any) -> None:  # trials are not training steps
        return None

    def vector(self) -> torch.Tensor:
        return torch.cat(self.released) if self.released else torch.zeros(0, dtype=torch.float64)


def make_canary(
    net: torch.nn.Module, example: Any, input_scale: float, collate: Callable[[list], Any] = default_collate
) -> Any:
    """A worst-case version of ``example``: float inputs × ``input_scale``, label = least likely class."""
    inputs, _ = split_inputs_targets(collate([example]))
    if torch.is_tensor(inputs) and inputs.is_floating_point():
        inputs = inputs * input_scale
    with torch.no_grad():
        logits = forward(net, inputs)
    label = logits.float().argmin(dim=-1)[0]
    if isinstance(example, dict):
        scaled = {k: v[0] for k, v in inputs.items()} if isinstance(inputs, dict) else {}
        return {**example, **scaled, "labels": label.to(torch.as_tensor(example["labels"]).dtype)}
    target = torch.as_tensor(example[1])
    return (inputs[0], label.to(target.dtype).reshape(target.shape))


def clopper_pearson_upper(failures: int, trials: int, alpha: float) -> float:
    """One-sided (1 − alpha) upper confidence bound on a binomial rate."""
    return 1.0 if failures >= trials else float(beta.ppf(1 - alpha, failures + 1, trials - failures))


def epsilon_lower_bound(
    null: torch.Tensor, alternative: torch.Tensor, threshold: float, delta: float, alpha: float
) -> tuple[float, float, float]:
    """(ε lower bound, FPR, FNR) of the test "alternative if statistic > threshold" on held-out trials."""
    false_pos = int((null > threshold).sum())
    false_neg = int((alternative <= threshold).sum())
    fpr_hi = clopper_pearson_upper(false_pos, len(null), alpha / 2)
    fnr_hi = clopper_pearson_upper(false_neg, len(alternative), alpha / 2)
    bounds = [0.0]
    for a, b in ((fnr_hi, fpr_hi), (fpr_hi, fnr_hi)):
        if 1 - delta - a > 0 and b > 0:
            bounds.append(math.log((1 - delta - a) / b))
    return max(bounds), false_pos / len(null), false_neg / len(alternative)


def _choose_threshold(null: torch.Tensor, alternative: torch.Tensor, delta: float) -> float:
    """The threshold with the best point estimate of the ε bound (rates without confidence)."""
    candidates = torch.cat([null, alternative]).unique()
    best, best_threshold = -math.inf, float(candidates[0])
    n, m = len(null), len(alternative)
    for t in candidates.tolist():
        fpr = max(int((null > t).sum()), 1) / n
        fnr = max(int((alternative <= t).sum()), 1) / m
        value = max(math.log(max(1 - delta - fnr, 1e-300) / fpr), math.log(max(1 - delta - fpr, 1e-300) / fnr))
        if value > best:
            best, best_threshold = value, t
    return best_threshold


class _NeighbouringReleases:
    """A method's release on D and on D′ = D ∪ {canary}, each from the same state, as a training step computes it.

    Built inside a fit, once the method is set up exactly as for training. D is the datamodule's first
    ``reference_size`` private examples, and the canary is row ``canary_row`` of D′'s batch (None: the last); both
    batches are built by the run's own private loader's ``collate_fn``
    (padding, masks and all) and converted and moved as Lightning moves a training batch. Every release runs inside
    the method's precision context (:meth:`~pl_dp.methods.precision.PrecisionMixin.precision_context`: the trainer's
    — autocast for ``bf16-mixed`` and ``16-mixed``, the half default dtype for ``bf16-true`` —, where Lightning runs
    ``training_step``, and the run's one attention kernel), as the canary is made; afterwards the
    parameters (and fp32 masters), the public data's position and an adaptive clip threshold are restored, so that
    releases differ only by their batch and their noise.
    """

    def __init__(
        self,
        module: PrivateModule,
        datamodule: Any,
        reference_size: int,
        canary: Any,
        input_scale: float,
        canary_row: int | None = None,
    ) -> None:
        self.module = module
        self.datamodule = datamodule
        private = getattr(datamodule, "private", None)
        needed = reference_size + (canary is None)  # the default canary is made of private example reference_size
        if private is None or len(private) < needed:
            raise ConfigError(
                f"the audit needs a datamodule with a private dataset of at least {needed} examples "
                f"(reference_size{' + 1' if canary is None else ''})."
            )
        examples = [private[i] for i in range(reference_size)]
        trainer = module.trainer
        collate = trainer.train_dataloader.collate_fn  # the run's own batching: padding, masks and all
        if canary is None:
            with module.precision_context():
                canary = make_canary(module.net, private[reference_size], input_scale, collate)

        def prepare(batch: list[Any]) -> Any:  # as Lightning prepares a training batch
            converted = trainer.precision_plugin.convert_input(collate(batch))
            return module.transfer_batch_to_device(converted, module.device, 0)

        row = reference_size if canary_row is None else canary_row
        self.without, self.with_canary = prepare(examples), prepare(examples[:row] + [canary] + examples[row:])
        # the parameters and, where the method trains half-precision ones through fp32 masters, the masters
        params = module.trainable_parameters()
        self.params = params + [m for m in module.master_parameters() if all(m is not p for p in params)]
        self.start = [p.detach().clone() for p in self.params]
        self.public_state = copy.deepcopy(datamodule.state_dict()) if hasattr(datamodule, "state_dict") else None
        # adaptive clipping moves the threshold after each step (a function of the released count)
        self.clip_function = getattr(module, "clip_function", None)
        self.noise_multiplier = module.noise_multiplier
        self._counters = itertools.count(-1, -1)  # noise counters no training step uses

    def release(self, batch: Any, noise_multiplier: float) -> tuple[torch.Tensor, _RecordingMechanism]:
        """What one private step on ``batch`` releases with multiplier ``noise_multiplier`` (fresh noise each call)."""
        module = self.module
        module.noise_multiplier = noise_multiplier
        try:
            with module.precision_context():  # the precision (and attention kernel) the run trains in
                mechanism = _RecordingMechanism(module.mechanism(batch_size_of(batch)))
                module.noise.start_step(next(self._counters))
                module.private_step(batch, batch_size_of(batch), mechanism)
        finally:  # every release starts from the same state; only the batch and the noise differ
            with torch.no_grad():
                for p, s in zip(self.params, self.start):
                    p.copy_(s)
                    p.grad = None
            if self.public_state is not None:
                self.datamodule.load_state_dict(copy.deepcopy(self.public_state))
            if self.clip_function is not None:
                module.clip_function = self.clip_function
            if getattr(module, "noise_correlation", None) is not None:  # banded noise: each trial a band's first step
                module.noise_correlation.restart()
            module.noise_multiplier = self.noise_multiplier
        return mechanism.vector(), mechanism

    def shift(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(base, v, shift)``: the noise-free release on D, its change v on D′, and ‖v‖ in units of the clip bound
        (‖v‖·b/(C·√releases), b the expected batch size: 1 when the canary alone saturates C in every release)."""
        base, mechanism = self.release(self.without, 0.0)
        v = self.release(self.with_canary, 0.0)[0] - base
        bound = mechanism.sensitivity * math.sqrt(mechanism.releases)
        return base, v, float(v.norm()) * mechanism.expected_batch_size / bound


class _StepTrials:
    """Runs the trials inside a fit, once the method is set up exactly as for training."""

    def __init__(self, trials: int, reference_size: int, canary: Any, input_scale: float, confidence: float) -> None:
        self.trials = trials
        self.reference_size = reference_size
        self.canary = canary
        self.input_scale = input_scale
        self.confidence = confidence

    def run(self, module: PrivateModule, datamodule: Any) -> AuditResult:
        releases = _NeighbouringReleases(module, datamodule, self.reference_size, self.canary, self.input_scale)
        base, v, influence = releases.shift()
        norm = float(v.norm())
        if norm == 0.0:
            raise ValueError("the canary does not change the step's release: nothing to audit (check the loss/clip).")
        direction = v / norm
        sigma = releases.noise_multiplier
        stats: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(self.trials):
            for world, batch in ((0, releases.without), (1, releases.with_canary)):
                stats[world].append(float((releases.release(batch, sigma)[0] - base) @ direction))
        null, alternative = torch.tensor(stats[0]), torch.tensor(stats[1])
        half = self.trials // 2
        delta = module.delta
        threshold = _choose_threshold(null[:half], alternative[:half], delta)
        alpha = 1 - self.confidence
        lower, fpr, fnr = epsilon_lower_bound(null[half:], alternative[half:], threshold, delta, alpha)
        # a trial of banded noise is a band's first step, whose noise is σ·ζ·C·z (ζ the strategy's sensitivity): the
        # claim is that Gaussian's ε, so that a build which forgot ζ (noise σ·C) is measured against what it claims
        correlation = getattr(module, "noise_correlation", None)
        zeta = 1.0 if correlation is None else float(correlation.strategy.sensitivity)
        with np.errstate(divide="ignore"):  # Opacus' PRV takes log(1 − q) = −inf at q = 1 harmlessly
            accountant = create_accountant(module.accountant_name)
            claimed = accountant.epsilon_after(delta, 1, noise_multiplier=sigma * zeta, sample_rate=1.0)
        spread = float(torch.cat([null, alternative - alternative.mean() + null.mean()]).std())
        return AuditResult(
            method=type(module).__name__,
            trials=self.trials,
            noise_multiplier=sigma,
            delta=delta,
            claimed_epsilon=claimed,
            epsilon_lower_bound=lower,
            confidence=self.confidence,
            false_positive_rate=fpr,
            false_negative_rate=fnr,
            canary_influence=influence,
            separation=float(alternative.mean() - null.mean()) / spread if spread > 0 else math.inf,
        )


class _AtFirstBatch(Callback):
    """Measures ``measure(module, datamodule)`` at the fit's first training batch, before its step, then stops."""

    def __init__(self, measure: Callable[[Any, Any], Any]) -> None:
        self.measure = measure
        self.result: Any = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.result is None:
            self.result = self.measure(pl_module, trainer.datamodule)
            trainer.should_stop = True


def quiet_trainer(**overrides: Any) -> L.Trainer:
    """A one-process CPU ``Trainer`` that only trains: no logger, checkpoints, progress bar, model summary or sanity
    check — what the audits (this one and :mod:`pl_dp.audit_run`) run on. ``overrides`` add to or replace these."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    settings.update(overrides)
    return L.Trainer(**settings)


def audit(
    model: PrivateModule,
    datamodule: L.LightningDataModule,
    trainer: L.Trainer | None = None,
    trials: int = 1000,
    reference_size: int = 8,
    canary: Any = None,
    input_scale: float = 100.0,
    confidence: float = 0.95,
) -> AuditResult:
    """Audit ``model``'s private step empirically (see the module docstring).

    Args:
        model: a private pl_dp method (``privacy`` set; the σ audited is the one its plan
            calibrates, or the spec's ``noise_multiplier``). O2NC (tree accountant) is not supported.
        datamodule: a :class:`~pl_dp.data.PrivatePublicDataModule`; D is its first
            ``reference_size`` private examples, and public batches come from it as in training.
        trainer: the Trainer whose plan sets σ (e.g. the one a config builds); by default a quiet
            one-step CPU Trainer. One real training step runs after the trials; the model is not
            meant to be trained further.
        trials: steps per neighbouring dataset (half choose the threshold, half bound the rates).
        reference_size: |D|, the private examples present in both worlds.
        canary: an example in the dataset's format; by default :func:`make_canary` of private
            example ``reference_size``.
        input_scale: how much the default canary's float inputs are scaled up to saturate C.
        confidence: the Clopper–Pearson confidence of the lower bound.
    """
    _check_auditable(model)
    trials = positive_integer("trials", trials)
    if trials < 20:
        raise ConfigError(f"trials must be >= 20 for a meaningful bound, got {trials}.")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must lie in (0, 1), got {confidence!r}.")
    reference_size = positive_integer("reference_size", reference_size)
    step_trials = _StepTrials(trials, reference_size, canary, float(input_scale), confidence)
    return _measure_in_fit(model, datamodule, trainer, step_trials.run)


def release_shift(
    model: PrivateModule,
    datamodule: L.LightningDataModule,
    canary: Any = None,
    *,
    reference_size: int = 8,
    trainer: L.Trainer | None = None,
    input_scale: float = 100.0,
    canary_row: int | None = None,
) -> float:
    """How far one record moves what ``model``'s private step releases, without noise, in units of the clip bound.

    Runs the method's own ``private_step`` twice from the same state, σ set to 0: on D, the datamodule's first
    ``reference_size`` private examples, and on D′ = D ∪ {``canary``}, both batches built by the run's own private
    loader's ``collate_fn`` and computed inside the trainer's precision context, as a training step is. Returns
    ‖v‖·b/(C·√releases), v the change of the released vector (the q noisy scalars of a zeroth-order step, the
    noisy gradient sum of a first-order one, …), b the expected batch size, C the clip bound — the quantity
    :attr:`AuditResult.canary_influence` reports, here allowed to be exactly 0 (the audit refuses a canary that
    moves nothing).

    Privacy meaning: under add/remove-one adjacency, a record's presence may move the release by at most its own
    clipped contribution, C in these units; the accountant's ε rests on that bound. A record whose own contribution
    is 0 (e.g. a sequence whose labels are all −100) should move it by 0: anything it moves is the *other* examples'
    contributions changing with the batch (mixing through a layer, or rounding that depends on the batch's padded
    length in half precision), which no noise was calibrated for.

    Args:
        model: a private pl_dp method (``privacy`` set); O2NC (tree accountant) is not supported.
        datamodule: a :class:`~pl_dp.data.PrivatePublicDataModule` with at least ``reference_size`` private
            examples (one more without a ``canary``); public batches come from it as in training.
        canary: one example in the private dataset's format; by default :func:`make_canary` of private example
            ``reference_size`` (float inputs × ``input_scale``, the least likely label), which saturates C.
        reference_size: |D|. With a sample rate of 1 (``batch_size`` ≥ the private set's size) b = |D| is the
            batch a step would see.
        trainer: the Trainer of the run (its precision, its plan); by default a quiet one-step CPU Trainer. The
            fit refuses to start as training would (e.g. :class:`~pl_dp.step.independence.IndependenceError`
            from the fit-start probe); otherwise one real training step runs after the measurement.
        input_scale: how much the default canary's float inputs are scaled up.
        canary_row: the canary's row in D′'s batch, 0 to ``reference_size``; ``None`` appends it (as
            :func:`audit` does). 0 moves every other example one row down, as Poisson sampling does when a record of
            a low index joins the batch (a private loader keeps the dataset's order): rounding or micro-batch
            boundaries that depend on an example's row then count too.
    """
    _check_auditable(model)
    size = positive_integer("reference_size", reference_size)
    if canary_row is not None and not 0 <= canary_row <= size:
        raise ConfigError(f"canary_row must lie in [0, reference_size = {size}] or be None, got {canary_row!r}.")

    def measure(module: PrivateModule, data: Any) -> float:
        return _NeighbouringReleases(module, data, size, canary, float(input_scale), canary_row).shift()[2]

    return _measure_in_fit(model, datamodule, trainer, measure)


def _check_auditable(model: PrivateModule) -> None:
    if getattr(model, "privacy", None) is None:
        raise ConfigError("the audit needs a private model (privacy=PrivacySpec(...)).")
    if not issubclass(model.release, SubsampledGaussian):
        raise ConfigError("the audit covers Poisson-sampled Gaussian steps; O2NC's tree mechanism is not supported.")


def _measure_in_fit(
    model: PrivateModule,
    datamodule: L.LightningDataModule,
    trainer: L.Trainer | None,
    measure: Callable[[PrivateModule, Any], Any],
) -> Any:
    """``measure(module, datamodule)`` at the first training batch of a fit of ``model`` (set up as for training)."""
    callback = _AtFirstBatch(measure)
    if trainer is None:
        trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.callbacks.append(callback)
    try:
        trainer.fit(model, datamodule)
    finally:  # a Trainer used again fits without it
        if callback in trainer.callbacks:
            trainer.callbacks.remove(callback)
    if callback.result is None:
        raise RuntimeError("the fit ended before its first private step: nothing was audited.")
    return callback.result
