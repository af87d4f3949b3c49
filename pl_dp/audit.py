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
mechanism with multiplier σ, the canary present with certainty (sample rate 1). A lower bound
above the claim means the implementation adds less noise than it accounts for.

Audit on small models: the canary construction scales float inputs, and each trial is one step. Both
neighbouring batches are built by the run's own private loader's ``collate_fn``, so what batching does (padding
to the longest example, a user's per-batch transform) is part of what is audited.
"""

from __future__ import annotations

import copy
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

from pl_dp.methods.base import PrivateModule
from pl_dp.privacy.accountants import create_accountant
from pl_dp.privacy.batches import batch_size_of
from pl_dp.privacy.losses import forward, split_inputs_targets
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.privacy.validation import positive_integer


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


class _StepTrials:
    """Runs the trials inside a fit, once the method is set up exactly as for training."""

    def __init__(self, trials: int, reference_size: int, canary: Any, input_scale: float, confidence: float) -> None:
        self.trials = trials
        self.reference_size = reference_size
        self.canary = canary
        self.input_scale = input_scale
        self.confidence = confidence

    def _batches(self, module: PrivateModule, datamodule: Any) -> tuple[Any, Any]:
        private = getattr(datamodule, "private", None)
        if private is None or len(private) < self.reference_size + 1:
            raise ValueError(
                f"the audit needs a datamodule with a private dataset of at least reference_size + 1 = "
                f"{self.reference_size + 1} examples."
            )
        examples = [private[i] for i in range(self.reference_size)]
        collate = module.trainer.train_dataloader.collate_fn  # the run's own batching: padding, masks and all
        canary = self.canary
        if canary is None:
            canary = make_canary(module.net, private[self.reference_size], self.input_scale, collate)
        batches = (examples, examples + [canary])
        return tuple(module.transfer_batch_to_device(collate(batch), module.device, 0) for batch in batches)

    def run(self, module: PrivateModule, datamodule: Any) -> AuditResult:
        without, with_canary = self._batches(module, datamodule)
        # the parameters and, where the method trains half-precision ones through fp32 masters, the masters
        params = module.trainable_parameters()
        params += [m for m in module.master_parameters() if all(m is not p for p in params)]
        start = [p.detach().clone() for p in params]
        public_state = copy.deepcopy(datamodule.state_dict()) if hasattr(datamodule, "state_dict") else None
        # adaptive clipping moves the threshold after each step (a function of the released count)
        clip_function = getattr(module, "clip_function", None)
        sigma = module.noise_multiplier

        trial_counter = iter(range(-1, -(4 * self.trials + 16), -1))  # noise counters no training step uses

        def release(batch: Any, noise_multiplier: float) -> tuple[torch.Tensor, Any]:
            module.noise_multiplier = noise_multiplier
            mechanism = _RecordingMechanism(module.mechanism(batch_size_of(batch)))
            module.noise.start_step(next(trial_counter))  # fresh noise for every trial
            try:
                module.private_step(batch, batch_size_of(batch), mechanism)
            finally:  # every trial starts from the same state; only the noise differs
                with torch.no_grad():
                    for p, s in zip(params, start):
                        p.copy_(s)
                        p.grad = None
                if public_state is not None:
                    datamodule.load_state_dict(copy.deepcopy(public_state))
                if clip_function is not None:
                    module.clip_function = clip_function
                module.noise_multiplier = sigma
            return mechanism.vector(), mechanism

        base, reference_mechanism = release(without, 0.0)
        shifted, _ = release(with_canary, 0.0)
        v = shifted - base
        norm = float(v.norm())
        if norm == 0.0:
            raise ValueError("the canary does not change the step's release: nothing to audit (check the loss/clip).")
        direction = v / norm
        bound = reference_mechanism.sensitivity * math.sqrt(reference_mechanism.releases)
        influence = norm * reference_mechanism.expected_batch_size / bound
        stats = {0: [], 1: []}
        for _ in range(self.trials):
            for world, batch in ((0, without), (1, with_canary)):
                stats[world].append(float((release(batch, sigma)[0] - base) @ direction))
        null, alternative = torch.tensor(stats[0]), torch.tensor(stats[1])
        half = self.trials // 2
        delta = module.delta
        threshold = _choose_threshold(null[:half], alternative[:half], delta)
        alpha = 1 - self.confidence
        lower, fpr, fnr = epsilon_lower_bound(null[half:], alternative[half:], threshold, delta, alpha)
        with np.errstate(divide="ignore"):  # Opacus' PRV takes log(1 − q) = −inf at q = 1 harmlessly
            accountant = create_accountant(module.accountant_name)
            claimed = accountant.epsilon_after(delta, 1, noise_multiplier=sigma, sample_rate=1.0)
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


class _AuditCallback(Callback):
    def __init__(self, trials: _StepTrials) -> None:
        self.trials = trials
        self.result: AuditResult | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.result is None:
            self.result = self.trials.run(pl_module, trainer.datamodule)
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
    if getattr(model, "privacy", None) is None:
        raise ValueError("the audit needs a private model (privacy=PrivacySpec(...)).")
    if not issubclass(model.release, SubsampledGaussian):
        raise ValueError("the audit covers Poisson-sampled Gaussian steps; O2NC's tree mechanism is not supported.")
    trials = positive_integer("trials", trials)
    if trials < 20:
        raise ValueError(f"trials must be >= 20 for a meaningful bound, got {trials}.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}.")
    reference_size = positive_integer("reference_size", reference_size)
    callback = _AuditCallback(_StepTrials(trials, reference_size, canary, float(input_scale), confidence))
    if trainer is None:
        trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.callbacks.append(callback)
    trainer.fit(model, datamodule)
    if callback.result is None:
        raise RuntimeError("the fit ended before its first private step: nothing was audited.")
    return callback.result
