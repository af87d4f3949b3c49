"""The base of every pl_dp method: privacy plan, accounting, logging and checkpointed state.

A method subclasses :class:`PrivateModule` and implements two things:

* :meth:`PrivateModule.mechanism` — its per-step release (sensitivity, number of sums); the
  base adds σ, the sample rate and the expected batch size (invariant 7);
* :meth:`PrivateModule.private_step` — its math for one step, which must add noise through
  that mechanism and nothing else.

The base owns everything the guarantee depends on: at every fit it reads n and q from the
Poisson sampler actually used (invariant 1) and calibrates σ for every planned step on top of the
history already spent; it steps the accountant exactly once per private step, refuses a step
that would exceed ε (invariant 4), and saves/restores the accountant history, counters and
sampler position — never the secrets (the noise key and the sampling seed), which a resumed run
draws afresh (invariants 2 and 5).
"""

from __future__ import annotations

import math
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pl_dp.privacy.accountants import Accountant, create_accountant
from pl_dp.privacy.budget import EpsilonTracker, StepBudget, calibrate_noise_multiplier
from pl_dp.privacy.independence import probe_examples, probe_independence, refuse_batch_mixing_modules
from pl_dp.privacy.journal import PrivacyJournal
from pl_dp.privacy.losses import (
    LossSpec,
    batch_size_of,
    check_per_sample,
    cross_entropy,
    forward,
    prediction_inputs,
    resolve_loss,
    split_inputs_targets,
)
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.privacy.noise import NoiseSource
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.sampling import CountingBatchSampler, PoissonBatchSampler, poisson_sampler_of
from pl_dp.privacy.seeding import derive_seed
from pl_dp.privacy.spec import PrivacySpec

_DIRECTION_TAG = 0xD1EC


def _positive(name: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}.")


def _positive_integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return int(value)


def check_strategy(strategy: Strategy) -> None:
    """Refuse, at fit start, a Lightning strategy pl_dp does not support yet (single device and DDP are).

    FSDP and DeepSpeed shard parameters, gradients and optimizer state across ranks: the per-step
    clipped sum, the one noise draw per logical step shared by every replica (invariant 3) and the
    zeroth-order sweeps are implemented for whole replicas only. Refusing is better than a run whose
    noise or sensitivity silently differs from what is accounted.
    """
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise NotImplementedError(
            f"pl_dp supports the single-device and DDP strategies; got {type(strategy).__name__}. FSDP and "
            "DeepSpeed shard parameters and gradients, for which one noise draw per logical step and the "
            "per-example clipped sums are not implemented yet: use strategy='ddp' (or one device)."
        )


def refuse_unless_plain_sgd(module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` is ``torch.optim.SGD`` without momentum, weight decay or Nesterov.

    For methods that write their update themselves (zeroth-order, O2NC): the optimizer holds η only.
    """
    plain = isinstance(optimizer, torch.optim.SGD) and all(
        not group.get("momentum") and not group.get("weight_decay") and not group.get("nesterov")
        for group in optimizer.param_groups
    )
    if not plain:
        raise ValueError(
            f"{type(module).__name__} applies its own update (it writes no gradient for an optimizer), so it "
            "accepts only torch.optim.SGD without momentum, weight decay or Nesterov, which holds the step size "
            f"for LR schedulers; got {type(optimizer).__name__} with {optimizer.defaults}. Remove --optimizer "
            "(or configure_optimizers' override), or use a first-order method (DPSGD, Coupling) for Adam-style "
            "updates on the privatized gradient."
        )


class PrivateModule(L.LightningModule):
    """Privacy protocol shared by all methods (see ARCHITECTURE.md "Public names").

    Args:
        net: the model (any ``nn.Module``, including a LightningModule).
        loss: ``"cross_entropy"``, ``"mse"`` or a callable ``(net, batch) -> Tensor[B]`` giving one
            loss per example.
        lr: step size η.
        privacy: the privacy request; ``None`` runs the same method without noise or accounting.
        noise_seed: seed of the DP noise. Default ``None`` draws a secret key from OS entropy at
            construction, held in memory only (never checkpointed: a resumed run draws a new one).
            Set it only for tests and reproduction: whoever knows it can remove the noise, and the
            privacy report says the run's ε is no guarantee against them.
        log_private_metrics: also log statistics computed on the *private* batch without noise —
            train loss/accuracy, the count of non-finite per-example values and, for public-data
            methods, γ-similarity to the public gradient — under ``diagnostics/not_private/``. Not
            differentially private; off by default.
        secure_rng: draw the DP noise from a cryptographic generator (SHAKE-256, with the
            floating-point hardening of Holohan & Braghin 2021) instead of torch's generator.
            ``None`` means the method's default (``secure_rng_default``): on for methods that
            release a few noisy scalars or small vectors a step (zeroth-order, O2NC), where it
            costs microseconds; off for full gradients (first-order), where it costs seconds per
            step on a CPU for a 22.7M-parameter model (``benchmarks/secure_noise.py``).
    """

    #: whether the method needs a public loader (PAZO, Coupling)
    requires_public_data: bool = False
    #: whether the method runs under data parallelism (sum-then-noise collectives; O2NC does not yet)
    supports_data_parallel: bool = True
    #: accept a checkpoint trained under another privacy spec or sample rate (set by
    #: :class:`~pl_dp.callbacks.AllowPrivacySpecChange`): the saved history is kept and σ re-planned
    allow_privacy_change: bool = False
    #: whether DP noise comes from the cryptographic generator unless ``secure_rng`` says otherwise
    secure_rng_default: bool = False
    #: whether the method writes its update itself (zeroth-order, O2NC): its optimizer holds η only, so
    #: only plain SGD is accepted; first-order methods hand the privatized gradient to any optimizer
    applies_own_update: bool = False

    #: the accountant of ``PrivacySpec(accountant=None)``: the one this method's sampling calls for
    default_accountant: str = "prv"

    @property
    def accountant_name(self) -> str | None:
        """The accountant in use: the spec's, or the method's own when the spec names none."""
        if self.privacy is None:
            return None
        return self.privacy.accountant or self.default_accountant

    #: the modes in which the method evaluates private losses, probed at fit start (invariant 8): "train"
    #: (training mode, autograd: first-order) and/or "eval" (eval mode, inference mode: zeroth-order)
    private_loss_modes: tuple[str, ...] = ("train", "eval")

    @property
    def touches_private_data(self) -> bool:
        """Whether a step reads the private batch (False e.g. for a public-only mixing weight).

        Steps that do not are neither budget-checked nor accounted nor counted in ``private_steps``.
        """
        return True

    def __init__(
        self,
        net: nn.Module,
        loss: LossSpec = "cross_entropy",
        lr: float = 1e-3,
        privacy: PrivacySpec | None = None,
        noise_seed: int | None = None,
        log_private_metrics: bool = False,
        secure_rng: bool | None = None,
    ) -> None:
        super().__init__()
        _positive("lr", lr)
        if isinstance(privacy, Mapping):  # as stored in hparams and checkpoints
            privacy = PrivacySpec(**privacy)
        if privacy is not None and not isinstance(privacy, PrivacySpec):
            raise TypeError(f"privacy must be a PrivacySpec or None, got {type(privacy).__name__}.")
        self.save_hyperparameters(ignore=["net"] + ([] if isinstance(loss, str) else ["loss"]))
        if privacy is not None:  # plain data for YAML, loggers and checkpoints (Lightning logs the initial copy)
            self.hparams["privacy"] = self._hparams_initial["privacy"] = privacy.to_dict()
        self.automatic_optimization = False
        self.net = net
        self.loss_fn = resolve_loss(loss)
        self._lr = float(lr)
        self.privacy = privacy
        self.noise = NoiseSource(noise_seed, secure=self.secure_rng_default if secure_rng is None else secure_rng)
        # data-independent randomness (ZO directions, exploration noise): reproducible under
        # seed_everything, never shared with the DP noise
        self.direction_seed = derive_seed(torch.initial_seed(), _DIRECTION_TAG)
        if self.accountant_name == "tree" and self.default_accountant != "tree":
            raise ValueError(
                f"the tree accountant analyses O2NC's tree-aggregated releases over a data partition; "
                f"{type(self).__name__} Poisson-samples: leave PrivacySpec(accountant=None) for its own ('prv')."
            )
        self.accountant: Accountant | None = create_accountant(self.accountant_name) if privacy else None
        self.log_private_metrics = log_private_metrics
        # privacy plan (set in setup_privacy, restored from checkpoints)
        self.noise_multiplier: float = 0.0
        self.sample_rate: float | None = None
        self.delta: float | None = None
        self.expected_batch_size: float | None = None
        self.planned_steps: int | None = None
        # counters (nonfinite_total is un-noised private information: process memory only)
        self.private_steps = 0
        self.nonfinite_total = 0
        self._nonfinite_warned = False
        # which secrets were ever user-seeded in this run (sticky across fits and resumes)
        self.user_seeded = {"noise": False, "sampling": False}
        # the write-ahead journal of released steps (a lineage is a run and all its resumes; each fit of a
        # process is one segment with an accountant of its own steps): see pl_dp.privacy.journal
        self.lineage: str | None = None
        self._segment_id = ""
        self._segment: Accountant | None = None
        self._journal: PrivacyJournal | None = None
        self.privacy_exhausted = False
        self.collective_bytes = 0
        self._sampler: CountingBatchSampler | None = None
        self._sampler_start = 0
        self._batches_consumed = 0
        self._restored: dict[str, Any] | None = None
        self._plan_ready = False
        self._budget: StepBudget | None = None
        self._tracker: EpsilonTracker | None = None
        self._metrics: nn.ModuleDict = nn.ModuleDict()
        self.proximal_anchor: list[torch.Tensor] | None = None
        self.proximal_coefficient = 0.0

    # ---- the method's part -----------------------------------------------------------------
    def mechanism(self, batch_size: int) -> SubsampledGaussian:
        """This method's per-step mechanism (override via :meth:`_gaussian`)."""
        raise NotImplementedError

    def private_step(self, batch: Any, batch_size: int, mechanism: SubsampledGaussian) -> dict[str, torch.Tensor]:
        """One step of the method's math; returns privatized (safe to log) statistics."""
        raise NotImplementedError

    def _gaussian(
        self,
        batch_size: int,
        sensitivity: float | None,
        releases: int = 1,
        auxiliary_noise_multiplier: float | None = None,
    ) -> SubsampledGaussian:
        expected = self.expected_batch_size if self.expected_batch_size is not None else max(batch_size, 1)
        return SubsampledGaussian(
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate or 1.0,
            sensitivity=sensitivity if sensitivity is not None else math.inf,
            expected_batch_size=expected,
            releases=releases,
            auxiliary_noise_multiplier=auxiliary_noise_multiplier,
        )

    # ---- parameters and step size -----------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        params = [p for p in self.net.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to optimize.")
        return params

    @property
    def lr(self) -> float:
        """Current step size; reads the optimizer's so LR schedulers and schedule callbacks agree."""
        opt = self._optimizer_or_none()
        return float(opt.param_groups[0]["lr"]) if opt is not None else self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        _positive("lr", value)
        self._lr = float(value)
        opt = self._optimizer_or_none()
        if opt is not None:
            for group in opt.param_groups:
                group["lr"] = float(value)

    def _optimizer_or_none(self) -> torch.optim.Optimizer | None:
        trainer = self._trainer
        if trainer is None or not trainer.optimizers:
            return None
        return trainer.optimizers[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD at ``lr``. It holds the step size (read by ``lr``, changed by LR schedulers and schedule
        callbacks) and advances ``global_step``. Methods that write their update themselves leave .grad
        empty; first-order methods put the privatized gradient in .grad for whatever optimizer is
        configured (their ``optimizer=`` argument, an override, or the CLI's ``--optimizer``)."""
        return torch.optim.SGD(self.trainable_parameters(), lr=self._lr)

    def _step_lr_schedulers(self, interval: str) -> None:
        """Step the LR schedulers of ``configure_optimizers`` (or the CLI's ``--lr_scheduler``).

        Lightning steps schedulers itself only under automatic optimization; under manual
        optimization the module must (Lightning docs, "Manual Optimization: Learning Rate
        Scheduling"). Each scheduler steps on its ``interval`` ("step": after every optimizer step;
        "epoch": at the end of every training epoch, after validation) every ``frequency`` of them;
        ``ReduceLROnPlateau`` steps with its ``monitor`` metric. Schedules change η only: the noise
        and the accounting do not depend on it.
        """
        trainer = self.trainer
        for config in trainer.lr_scheduler_configs:
            if config.interval != interval:
                continue
            count = trainer.global_step if interval == "step" else trainer.current_epoch + 1
            if count % config.frequency:
                continue
            if not config.reduce_on_plateau:
                config.scheduler.step()
                continue
            value = trainer.callback_metrics.get(config.monitor)
            if value is not None:
                config.scheduler.step(value)
            elif config.strict:
                available = ", ".join(sorted(trainer.callback_metrics)) or "none"
                raise ValueError(
                    f"ReduceLROnPlateau monitors {config.monitor!r}, which was not logged; available: {available}."
                )

    def on_train_epoch_end(self) -> None:
        self._step_lr_schedulers("epoch")

    # ---- privacy plan ------------------------------------------------------------------------
    def private_loader(self, dataset: Any, seed: int) -> Any:
        """The private training loader this method's accounting assumes, or None for Poisson sampling.

        :class:`~pl_dp.data.PrivatePublicDataModule` asks the module first; methods whose guarantee
        rests on other sampling (O2NC: a disjoint partition) return their own loader here.
        """
        return None

    def private_sampler_of(self, loader: Any) -> CountingBatchSampler | None:
        """The sampler behind the private loader, checked against this method's accounting (invariant 1)."""
        if self.privacy is None:
            return getattr(loader, "batch_sampler", None)
        return poisson_sampler_of(loader)

    def setup_privacy(self) -> None:
        """Read the sampler, calibrate σ for the steps this fit plans, prepare the budget guard.

        Runs once per fit (idempotent within it; :meth:`on_fit_start` re-arms it): every fit re-reads
        its loader, re-checks that it Poisson-samples, and plans on top of the accountant history
        already spent, so ε composes across fits and resumes and ``epsilon`` is the total.
        """
        if self._plan_ready:
            return
        trainer = self.trainer
        loader = trainer.train_dataloader
        sampler = self.private_sampler_of(loader)
        if trainer.world_size > 1:
            self._setup_data_parallel(sampler)
        planned = trainer.estimated_stepping_batches
        if not math.isfinite(planned):
            raise ValueError("private training needs a finite plan: set trainer max_steps or max_epochs.")
        if self.privacy is not None and trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "accumulate_grad_batches must be 1: each Poisson batch is one private step "
                "(use a larger batch_size for a larger expected batch)."
            )
        self.planned_steps = int(planned)
        steps_left = max(self.planned_steps - trainer.global_step, 0)
        restored, self._restored = self._restored, None  # a checkpoint is checked once, by the fit it resumes
        self._plan_ready = True
        self.user_seeded["noise"] |= self.noise.seeded
        self.user_seeded["sampling"] |= bool(getattr(sampler, "seeded", False))
        if hasattr(sampler, "sample_rate"):  # pl_dp's samplers, Opacus' Poisson sampler
            self.sample_rate = sampler.sample_rate
            self.expected_batch_size = sampler.expected_batch_size
        self._sampler = sampler if isinstance(sampler, CountingBatchSampler) else None
        if self._sampler is not None:  # its position is checkpointed, so a resume continues the epoch
            if restored is not None and "sampler" in restored:
                sampler.load_state_dict(restored["sampler"])
            self._sampler_start = sampler.position
            self._batches_consumed = 0
        if self.privacy is None:
            return
        self.check_independence()
        spec = self.privacy
        if self.delta is None:  # fixed by the first plan (or the checkpoint): ε of every fit is at one δ
            self.delta = spec.resolve_delta(sampler.num_samples)
        self._open_journal(restored)
        self.prepare_accounting(sampler, restored)
        spent = self.accountant.get_epsilon(self.delta)
        if restored is not None:
            self._check_restored_plan(restored, steps_left)
        elif spent >= spec.epsilon:
            raise ValueError(
                f"this module has already spent epsilon={spent:.3f} (delta={self.delta:.3g}) of its target "
                f"epsilon={spec.epsilon:g} in earlier fits: there is no budget left for the {steps_left} steps "
                "this fit plans. Epsilon composes across fits; train a fresh module, or raise the target on "
                "purpose with pl_dp.callbacks.AllowPrivacySpecChange from a checkpoint."
            )
        elif spec.noise_multiplier is not None:
            self.noise_multiplier = spec.noise_multiplier
            eps = self.accountant.epsilon_after(self.delta, steps_left, self.noise_multiplier, self.sample_rate)
            if eps > spec.epsilon:
                raise ValueError(
                    f"noise_multiplier={self.noise_multiplier:g} cannot meet epsilon={spec.epsilon:g} "
                    f"(delta={self.delta:.3g}) for the {steps_left} planned private steps at sample "
                    f"rate {self.sample_rate:.4g}" + (f" on top of the {spent:.3f} already spent" if spent else "")
                    + f": it would spend epsilon={eps:.3f}. Raise the noise multiplier, plan fewer steps, or "
                    "leave noise_multiplier=None to calibrate."
                )
        else:
            self.noise_multiplier = calibrate_noise_multiplier(
                spec.epsilon, self.delta, self.sample_rate, max(steps_left, 1), self.accountant
            )
        horizon = self.accountant.steps + steps_left
        self._budget = StepBudget(self.accountant, spec.epsilon, self.delta, horizon=horizon)
        self._tracker = EpsilonTracker(self.accountant, self.delta, horizon)
        if restored is None:  # a new plan meets the target by construction (calibrated, or checked above)
            return
        planned_epsilon = self.accountant.epsilon_after(self.delta, steps_left, self.noise_multiplier, self.sample_rate)
        if planned_epsilon > spec.epsilon:
            warnings.warn(
                f"this fit plans {steps_left} more private steps, which at the checkpoint's noise multiplier "
                f"{self.noise_multiplier:.4g} would spend epsilon={planned_epsilon:.3f} > the target "
                f"{spec.epsilon:g}: training will stop before the step that would exceed it (privacy_exhausted). "
                "To train longer, resume with a larger epsilon on purpose (pl_dp.callbacks.AllowPrivacySpecChange "
                "re-plans sigma for the steps left).",
                stacklevel=2,
            )

    def on_fit_start(self) -> None:
        check_strategy(self.trainer.strategy)
        self._plan_ready = False  # every fit re-reads its loader and re-plans (ε composes across fits)
        self.privacy_exhausted = False  # the budget guard decides again for this fit's plan
        self._nonfinite_warned = False

    def _open_journal(self, restored: dict[str, Any] | None) -> None:
        """Start this fit's journal segment; on a resume, account every step the lineage ever released.

        A resumed accountant is the composition of every segment in the journal — which holds all the
        checkpoint holds, plus what a crashed run logged after it and what other resumes of the same
        checkpoint released. Without the journal (moved or deleted) the checkpoint's history is used
        and a warning says what cannot be counted. The journal is written only for runs that can be
        resumed (a checkpoint callback, a saved checkpoint, or a resume), next to their checkpoints.
        """
        self._segment_id = uuid.uuid4().hex
        self._segment = create_accountant(self.accountant_name)
        if restored is not None:
            self.lineage = restored.get("lineage") or self.lineage
            path = restored.get("journal")
            journal = PrivacyJournal(path) if path else None
            composed = self._broadcast(journal.composed(self.accountant.mechanism).state_dict() if journal else None)
            released = create_accountant(self.accountant_name)
            if composed is not None:
                released.load_state_dict(composed)
            if released.steps >= self.accountant.steps and released.history:
                self.accountant.load_state_dict(composed)
            else:
                warnings.warn(
                    f"no privacy journal of this run was found{f' at {path}' if path else ''}: epsilon counts "
                    "the steps the checkpoint holds. Steps that an earlier run released after this checkpoint "
                    "(logged metrics before a crash, another resume of the same checkpoint) cannot be counted; "
                    "if there were any, epsilon is under-reported.",
                    stacklevel=2,
                )
            self._journal = journal
        if self.lineage is None:
            self.lineage = uuid.uuid4().hex
        if self._journal is None and self.trainer.checkpoint_callbacks:
            directory = getattr(self.trainer.checkpoint_callback, "dirpath", None) or self.trainer.default_root_dir
            self._journal = PrivacyJournal.of(Path(directory) / "pl_dp_journal", self.lineage)

    def _write_journal(self) -> None:
        """Record this segment's released steps, before something leaves the process (rank 0 writes)."""
        if self._segment is None or not self._segment.history:
            return
        if self._journal is None:  # a checkpoint saved without a checkpoint callback: journal beside the root dir
            self._journal = PrivacyJournal.of(Path(self.trainer.default_root_dir) / "pl_dp_journal", self.lineage)
        if self.trainer.is_global_zero:
            self._journal.record(self._segment_id, self._segment)

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (identity on one process)."""
        return self.trainer.strategy.broadcast(obj, src=0) if self.data_parallel else obj

    def prepare_accounting(self, sampler: Any, restored: dict[str, Any] | None) -> None:
        """Wire the accountant to this fit's private sampler, before σ is planned (explicit, once per plan).

        Called after the sampler's position is restored, with the checkpoint's privacy state when the fit
        resumes one. Poisson accountants need nothing; O2NC checks its partition against the checkpoint
        and tells the tree accountant where the next leaf comes from.
        """

    def check_independence(self) -> None:
        """Invariant 8, once per private fit before any step: refuse batch-mixing layers, then probe the net and loss
        on a few examples (public if the method uses it, else validation, else private by index) in each of the
        method's ``private_loss_modes``."""
        refuse_batch_mixing_modules(self.net)
        datamodule, loader = getattr(self.trainer, "datamodule", None), self.trainer.train_dataloader
        examples, source = probe_examples(datamodule, loader, public=self.requires_public_data)
        examples = self.transfer_batch_to_device(examples, self.device, 0)
        probe_independence(self.net, self.loss_fn, examples, self.private_loss_modes, source)

    def _check_restored_plan(self, saved: dict[str, Any], steps_left: int) -> None:
        changes = []
        if saved["privacy"] != self.privacy.to_dict():
            changes.append(
                f"the checkpoint was trained with privacy={saved['privacy']} but this run asks for "
                f"{self.privacy.to_dict()}"
            )
        if not math.isclose(saved["sample_rate"], self.sample_rate, rel_tol=1e-12):
            changes.append(
                f"the checkpoint's sample rate {saved['sample_rate']:g} differs from the loader's {self.sample_rate:g}"
            )
        if not changes:
            self.noise_multiplier = saved["noise_multiplier"]
            return
        if not self.allow_privacy_change:
            raise ValueError(
                "; ".join(changes) + ": resuming under a different privacy spec or sample rate is refused (the "
                "accountant would no longer describe the run). To continue on purpose, with the saved history "
                "kept and sigma re-planned for the rest, add the callback pl_dp.callbacks.AllowPrivacySpecChange."
            )
        self._replan_after_change(changes, steps_left)

    def _replan_after_change(self, changes: list[str], steps_left: int) -> None:
        """σ for the steps left, on top of the restored accountant history (never from zero)."""
        spec = self.privacy
        remaining = max(1, steps_left)
        spent = self.accountant.get_epsilon(self.delta) if self.accountant.history else 0.0
        if spent >= spec.epsilon:
            raise ValueError(
                f"the checkpoint has already spent epsilon={spent:.3f} (delta={self.delta:.3g}); the new target "
                f"epsilon={spec.epsilon:g} leaves nothing for the {remaining} steps left."
            )
        if spec.noise_multiplier is not None:
            self.noise_multiplier = spec.noise_multiplier
            total = self.accountant.epsilon_after(self.delta, remaining, self.noise_multiplier, self.sample_rate)
            if total > spec.epsilon:
                raise ValueError(
                    f"noise_multiplier={self.noise_multiplier:g} cannot meet epsilon={spec.epsilon:g} for the "
                    f"{remaining} steps left on top of the checkpoint's spent epsilon={spent:.3f}: it would "
                    f"reach {total:.3f}."
                )
        else:
            self.noise_multiplier = calibrate_noise_multiplier(
                spec.epsilon, self.delta, self.sample_rate, remaining, self.accountant
            )
        warnings.warn(
            "; ".join(changes) + f". Continuing as allowed: epsilon spent so far {spent:.3f} is kept, and the "
            f"{remaining} steps left use noise multiplier {self.noise_multiplier:.4g}.",
            stacklevel=2,
        )

    # ---- data parallelism --------------------------------------------------------------------
    def _setup_data_parallel(self, sampler: CountingBatchSampler | None) -> None:
        """Make N processes one logical private run (ARCHITECTURE invariant 3).

        Every rank gets rank 0's secrets — the noise key and the sampling seed, in process memory over
        the process group, never through storage — and its direction seed, so that after the clipped
        sums are summed across ranks (:meth:`all_reduce_sum`) each rank adds the *same* noise draw —
        one draw per logical step — and applies the same update. The private sampler must shard one
        global Poisson batch (each rank would otherwise sample the whole set and an example could
        appear world-size times per step). DDP's gradient all-reduce is switched off: pl_dp sums
        what it needs itself, and .grad is only ever the already-shared privatized gradient.
        """
        trainer = self.trainer
        world, rank = trainer.world_size, trainer.global_rank
        if not self.supports_data_parallel:
            raise NotImplementedError(
                f"{type(self).__name__} runs on one process for now (got world size {world}): "
                "use devices=1, num_nodes=1."
            )
        if self.privacy is not None and (
            getattr(sampler, "num_replicas", 1) != world or getattr(sampler, "rank", 0) != rank
        ):
            raise ValueError(
                f"with {world} processes the private loader must shard one global Poisson batch "
                f"(PoissonBatchSampler(num_replicas={world}, rank={rank}), as PrivatePublicDataModule builds it); "
                f"got {type(sampler).__name__} with num_replicas={getattr(sampler, 'num_replicas', 1)}."
            )
        def broadcast(obj: Any) -> Any:
            return trainer.strategy.broadcast(obj, src=0)

        self.noise.share(broadcast)
        self.direction_seed = int(broadcast(self.direction_seed))
        if isinstance(sampler, PoissonBatchSampler):  # one global Poisson batch: the same secret mask on every rank
            sampler.seed, sampler.seeded = broadcast((sampler.seed, sampler.seeded))
        wrapped = trainer.strategy.model
        if isinstance(wrapped, DistributedDataParallel):
            wrapped.require_backward_grad_sync = False

    @property
    def data_parallel(self) -> bool:
        return self._trainer is not None and self._trainer.world_size > 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over data-parallel ranks through the Lightning strategy (identity on one
        process). Only clipped sums and counts are passed here, never per-example values; the bytes
        sent are counted in ``collective_bytes``."""
        if not self.data_parallel:
            return tensor
        self.collective_bytes += tensor.numel() * tensor.element_size()
        summed = self.trainer.strategy.reduce(tensor.to(self.device).contiguous(), reduce_op="sum")  # NCCL: on GPU
        return summed.to(tensor.device)

    @property
    def sum_reducer(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """:meth:`all_reduce_sum` under data parallelism, else None (for the ``reduce`` hooks below)."""
        return self.all_reduce_sum if self.data_parallel else None

    @property
    def epsilon(self) -> float:
        """Exact ε spent so far (0 for a non-private run)."""
        if self.accountant is None or self.delta is None:
            return 0.0
        return self.accountant.get_epsilon(self.delta)

    def privacy_report(self) -> PrivacyReport:
        """ε, δ, σ, q, steps, accountant, adjacency, secrets, and what is and is not protected.

        The same report :meth:`PrivacyReport.from_checkpoint` gives for a checkpoint of this run.
        """
        state = self.privacy_state_dict()
        state["user_seeded"] = {**self.user_seeded, "noise": self.user_seeded["noise"] or self.noise.seeded}
        return PrivacyReport.from_state(state)

    def on_fit_end(self) -> None:
        """Record the fit's releases in the journal; log the privacy report to every logger."""
        if self._journal is not None:
            self._write_journal()
        if self.trainer.loggers and self.privacy is not None:
            report = self.privacy_report().to_dict()
            for logger in self.trainer.loggers:
                logger.log_hyperparams({"privacy_report": report})
                logger.save()

    def on_train_start(self) -> None:
        if self.applies_own_update:
            refuse_unless_plain_sgd(self, self.optimizers(use_pl_optimizer=False))
        self.setup_privacy()
        if self.requires_public_data:
            self._public_source().check_public(self.public_batches_per_step)  # fail now, not at step 1

    # ---- the step ----------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> None:
        guarded = self.privacy is not None and self.touches_private_data
        if guarded and (self.privacy_exhausted or not self._budget.allows(self.noise_multiplier, self.sample_rate)):
            self.privacy_exhausted = True
            self.trainer.should_stop = True
            return None
        batch_size = batch_size_of(batch)
        mechanism = self.mechanism(batch_size)
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        self.noise.start_step(self.private_steps)
        stats = self.private_step(batch, batch_size, mechanism)
        if self.touches_private_data:
            mechanism.account(self.accountant, self._segment)
            self.private_steps += 1
        self._batches_consumed += 1
        opt.step()  # applies .grad where a first-order method set it; otherwise only advances global_step
        opt.zero_grad(set_to_none=True)
        self._step_lr_schedulers("step")
        self._log_step(stats, batch_size)
        if self.log_private_metrics:
            self._log_private_metrics(batch)

    def _log_step(self, stats: dict[str, torch.Tensor], batch_size: int) -> None:
        nonfinite = stats.pop("nonfinite", None)
        if nonfinite is not None:
            self._count_nonfinite(int(nonfinite))
        if not self._logging_step():
            return
        if self.trainer.loggers and self._journal is not None:
            self._write_journal()  # this step's outputs are about to be logged
        for name, value in stats.items():
            self.log(name, value, on_step=True, on_epoch=False)
        if self.log_private_metrics:
            self.log(
                "diagnostics/not_private/nonfinite_total", float(self.nonfinite_total), on_step=True, on_epoch=False
            )
        self.log("privacy/private_steps", float(self.private_steps), on_step=True, on_epoch=False)
        if self._tracker is not None:
            eps = self._tracker.epsilon()
            self.log("privacy/epsilon", eps, on_step=True, on_epoch=False, prog_bar=True)
            self.log("privacy/budget_left", self.privacy.epsilon - eps, on_step=True, on_epoch=False, prog_bar=True)

    def _count_nonfinite(self, count: int) -> None:
        """Count examples whose per-example value was non-finite (they contributed 0: invariant 6).

        The count is a function of the private data with no noise — logging it would tell an adversary
        how often a record with an infinite loss was sampled — so it stays in process memory
        (``nonfinite_total``) and is logged only under ``log_private_metrics``. Otherwise the user
        gets one warning per fit that such values occurred, without the count.
        """
        self.nonfinite_total += count
        if count and not self.log_private_metrics and not self._nonfinite_warned:
            self._nonfinite_warned = True
            rank_zero_warn(
                "non-finite per-example losses or gradients occurred; those examples contributed 0 to their "
                "step (the sensitivity bound holds). The count is un-noised private information, so it is not "
                "logged: read model.nonfinite_total in this process, or set log_private_metrics=True to log it "
                "under diagnostics/not_private/ (not differentially private)."
            )

    def _logging_step(self) -> bool:
        """Whether to log this step's on-step metrics: on the loggers' cadence and at the end.

        Metrics logged on other steps are dropped by the loggers anyway, and each ``self.log`` call
        costs about a millisecond on a CPU — several times the whole step of a small model — so the
        per-step statistics are logged every ``log_every_n_steps`` only. ``global_step`` counts this
        step already (the optimizer has stepped), which matches Lightning's ``+ 1`` convention. The
        last batch of each epoch and the final step are logged too, so that ``callback_metrics``
        (read by ``ModelCheckpoint``/``EarlyStopping`` and after ``fit``) hold current values.
        """
        trainer = self.trainer
        every = trainer.log_every_n_steps
        final = trainer.should_stop or trainer.is_last_batch or 0 < trainer.max_steps <= trainer.global_step
        return final or (every > 0 and trainer.global_step % every == 0)

    # ---- evaluation ----------------------------------------------------------------------------
    def _metric(self, name: str, num_classes: int) -> torchmetrics.Metric:
        if name not in self._metrics:
            metric = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes, average="micro")
            self._metrics[name] = metric.to(self.device)
        return self._metrics[name]

    def _evaluate(self, batch: Any, stage: str) -> None:
        if batch_size_of(batch) == 0:
            return
        logits = targets = None
        try:
            inputs, targets = split_inputs_targets(batch)
        except (KeyError, TypeError):  # a batch the built-in losses do not know: the user's loss decides
            inputs = None
        if inputs is not None:
            logits = forward(self.net, inputs)
        if self.loss_fn is cross_entropy and logits is not None:
            losses = F.cross_entropy(logits.float(), targets, reduction="none")
        else:
            losses = self.loss_fn(self.net, batch)
        self.log(
            f"{stage}/loss", losses.float().mean(), on_epoch=True, prog_bar=stage == "val", sync_dist=self.data_parallel
        )
        if logits is not None and logits.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point():
            name = f"{stage}_acc".replace("/", "_")
            metric = self._metric(name, logits.shape[-1])
            metric(logits, targets)
            self.log(
                f"{stage}/acc", metric, on_epoch=True, prog_bar=stage == "val", metric_attribute=f"_metrics.{name}"
            )

    def _log_private_metrics(self, batch: Any) -> None:
        with torch.no_grad():
            self._evaluate(batch, "diagnostics/not_private/train")

    def log_gradient_similarity(self, batch: Any, public_grad: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Log γ = ‖g_pub − ∇f(θ; B_private)‖ and their cosine (PAZO spec §7.1, mini-batch version).

        Only with ``log_private_metrics``: this backpropagates through the private batch without
        clipping or noise. Returns the private batch gradient (or None when disabled or empty).
        """
        if not self.log_private_metrics or batch_size_of(batch) == 0:
            return None
        private_grad = self.public_gradient(batch)  # same computation; the data is private here
        diff = sum(float((a - b).square().sum()) for a, b in zip(public_grad, private_grad))
        dot = sum(float((a * b).sum()) for a, b in zip(public_grad, private_grad))
        norms = [math.sqrt(sum(float(t.square().sum()) for t in g)) for g in (public_grad, private_grad)]
        self.log("diagnostics/not_private/gamma", math.sqrt(diff), on_step=True, on_epoch=False)
        self.log(
            "diagnostics/not_private/cos_public_private",
            dot / max(norms[0] * norms[1], 1e-30),
            on_step=True,
            on_epoch=False,
        )
        return private_grad

    def _user_hook(self, name: str) -> Any:
        """``net``'s own ``name`` hook when ``net`` is a LightningModule that defines it, else None.

        The private method replaces training only: a user's module keeps its evaluation and
        prediction, its metrics and its logging, run as written (Lightning hands the Trainer to
        child modules; the hook runs under this module's current hook name so ``self.log`` works).
        """
        net = self.net
        if not isinstance(net, L.LightningModule) or getattr(type(net), name) is getattr(L.LightningModule, name):
            return None

        def call(*args: Any) -> Any:
            net._current_fx_name = self._current_fx_name
            try:
                return getattr(net, name)(*args)
            finally:
                net._current_fx_name = None

        return call

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        own = self._user_hook("validation_step")
        return own(batch, batch_idx) if own else self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        own = self._user_hook("test_step")
        return own(batch, batch_idx) if own else self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """``net``'s outputs (logits for classifiers) on the inputs of ``batch``: (x, y), x-only or a dict."""
        own = self._user_hook("predict_step")
        if own:
            return own(batch, batch_idx)
        return forward(self.net, prediction_inputs(batch))

    def on_validation_epoch_start(self) -> None:
        self._run_user_hook("on_validation_epoch_start")

    def on_validation_epoch_end(self) -> None:
        self._run_user_hook("on_validation_epoch_end")

    def on_test_epoch_start(self) -> None:
        self._run_user_hook("on_test_epoch_start")

    def on_test_epoch_end(self) -> None:
        self._run_user_hook("on_test_epoch_end")

    def _run_user_hook(self, name: str) -> None:
        own = self._user_hook(name)
        if own:
            own()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.net(*args, **kwargs)

    # ---- proximal anchor (set by StagewiseSchedule) ---------------------------------------------
    def set_proximal_anchor(self, coefficient: float) -> None:
        """Snapshot θ as the anchor of the proximal term (1/λ)(θ − anchor), λ = 1/``coefficient``.

        The anchor is a real copy (DPZOPO's released code aliases it to the live weights, which makes
        the term vanish; dpzopo spec §8). ``coefficient=0`` removes it.
        """
        if coefficient < 0:
            raise ValueError(f"the proximal coefficient 1/lambda must be >= 0, got {coefficient!r}.")
        self.proximal_coefficient = float(coefficient)
        params = self.trainable_parameters()
        self.proximal_anchor = [p.detach().clone() for p in params] if coefficient > 0 else None

    def proximal_terms(self) -> list[tuple[list[torch.Tensor], float]]:
        """The proximal gradient step −η(1/λ)(θ − anchor) as dense ``extra`` terms for a fused sweep.

        Data-independent: no clipping, no noise (dpzopo spec §1, line 11). It is applied in the same
        sweep after the private update, i.e. evaluated at θ − ηĝ (semi-implicit; differs from the
        explicit step of Alg. 2 by O(η²/λ), and the paper's proof uses the implicit prox).
        """
        anchor = self.proximal_anchor
        if anchor is None:
            return []
        step = self.lr * self.proximal_coefficient
        return [(self.trainable_parameters(), -step), (anchor, step)]

    @torch.no_grad()
    def apply_proximal_(self) -> None:
        """The proximal step as its own sweep, for methods whose update is not a fused ZO sweep."""
        for tensors, alpha in self.proximal_terms():
            for p, t in zip(self.trainable_parameters(), tensors):
                p.add_(t, alpha=alpha)

    # ---- public data -------------------------------------------------------------------------
    #: how many disjoint public batches one step draws (methods that need public data)
    public_batches_per_step: int = 1

    def _public_source(self):
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "public_batches"):
            raise ValueError(
                f"{type(self).__name__} needs public data: train with a PrivatePublicDataModule "
                "(or a subclass) that has a public dataset."
            )
        return dm

    def public_batches(self, k: int = 1) -> list[Any]:
        """``k`` disjoint public batches on this module's device. Public data costs no privacy."""
        return [self.transfer_batch_to_device(b, self.device, 0) for b in self._public_source().public_batches(k)]

    def public_gradient(self, batch: Any) -> list[torch.Tensor]:
        """∇ of the mean loss over a public batch at the current parameters: no clipping, no noise."""
        params = self.trainable_parameters()
        with torch.enable_grad():
            losses = check_per_sample(self.loss_fn(self.net, batch), batch_size_of(batch))
            grads = torch.autograd.grad(losses.mean(), params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    # ---- checkpointing -------------------------------------------------------------------------
    #: version of the checkpointed privacy state (2: no secrets — noise key and sampling seed — saved)
    PRIVACY_STATE_VERSION = 2

    def privacy_state_dict(self) -> dict[str, Any]:
        """What must survive a checkpoint for ε to stay right — and nothing secret (invariants 2 and 5).

        The accountant history (what was released), the plan it was released under, step counters,
        the sampler's position and which secrets were ever user-seeded. Never the noise key, the
        sampling seed or a count computed from private data without noise.
        """
        state: dict[str, Any] = {
            "version": self.PRIVACY_STATE_VERSION,
            "method": type(self).__name__,
            "privacy": self.privacy.to_dict() if self.privacy else None,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
            "delta": self.delta,
            "planned_steps": self.planned_steps,
            "private_steps": self.private_steps,
            "accountant": self.accountant.state_dict() if self.accountant else None,
            "direction_seed": self.direction_seed,
            "user_seeded": dict(self.user_seeded),
            "secure_rng": self.noise.secure,
            "lineage": self.lineage,
            "journal": str(self._journal.path) if self._journal is not None else None,
        }
        if self._sampler is not None:
            state["sampler"] = {"position": self._sampler_start + self._batches_consumed}
        return state

    def load_privacy_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the privacy state of a checkpoint; the secrets stay this process's own (fresh).

        A checkpoint written before version 2 also holds the noise generator's state: it is ignored,
        so a resume never replays the noise of the original continuation.
        """
        if state.get("method") != type(self).__name__:
            raise ValueError(
                f"this checkpoint was written by {state.get('method')!r}, not {type(self).__name__!r}: "
                "its privacy state cannot be resumed by another method."
            )
        if (state["privacy"] is None) != (self.privacy is None):
            raise ValueError("cannot resume a private run as a non-private one or the reverse.")
        self.private_steps = int(state["private_steps"])
        self.direction_seed = int(state["direction_seed"])
        self.noise_multiplier = float(state["noise_multiplier"])
        self.sample_rate = state["sample_rate"]
        self.expected_batch_size = state.get("expected_batch_size")
        self.delta = state["delta"]
        self.planned_steps = state["planned_steps"]
        for secret, seeded in state.get("user_seeded", {}).items():
            self.user_seeded[secret] |= bool(seeded)
        if self.accountant is not None:
            self.accountant.load_state_dict(state["accountant"])
        self._restored = state
        self._plan_ready = False  # setup_privacy re-reads the loader and checks it against the checkpoint

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.privacy is not None and self.lineage is not None:
            self._write_journal()  # before the checkpoint exists: a resume from it finds every step released
        checkpoint["pl_dp"] = self.privacy_state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "pl_dp" not in checkpoint:
            raise ValueError(
                "this checkpoint has no pl_dp privacy state (accountant history, plan, counters): resuming "
                "would restart the accountant from zero and under-report epsilon."
            )
        self.load_privacy_state_dict(checkpoint["pl_dp"])
