"""The base of every pl_dp method: the story of one private step, in Lightning's hooks.

A method subclasses :class:`PrivateModule` — through its family's base:
:class:`~pl_dp.methods.own_update.OwnUpdateModule` for methods that write their update themselves (fp32 masters,
plain SGD, the proximal term), :class:`~pl_dp.methods.first_order.FirstOrderModule` for per-example gradients — and
implements two things:

* :meth:`PrivateModule.mechanism` — its per-step release (sensitivity, number of sums); the
  base adds σ, the sample rate and the expected batch size, so the mechanism is declared in one
  place and accounting cannot drift from the code that adds noise;
* :meth:`PrivateModule.private_step` — its math for one step, which must add noise through
  that mechanism and nothing else.

Everything the guarantee depends on lives in the module's :class:`~pl_dp.privacy.ledger.PrivacyLedger`
(Lightning-free): at every fit the base reads n and q from the sampler actually used (so the accountant
matches the sampler) and lets the ledger plan σ on top of the history already spent; every private step
asks the ledger first (the budget is never exceeded) and is recorded in it exactly once; checkpoints hold
the ledger's state and the sampler position — never the secrets (the noise key and the sampling seed), which
a resumed run draws afresh (threat model: docs/privacy-model.md). Evaluation (:mod:`pl_dp.methods.evaluation`),
data parallelism (:mod:`pl_dp.methods.parallel`) and the precision a step computes in, with the batch shape it keeps
(:mod:`pl_dp.methods.precision`), are mixed in from their own modules.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.data import default_collate

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods.evaluation import EvaluationMixin
from pl_dp.methods.parallel import DataParallelMixin
from pl_dp.methods.precision import PrecisionMixin
from pl_dp.privacy.accountants import Accountant, accountant_class, accountant_names
from pl_dp.privacy.ledger import PrivacyLedger
from pl_dp.privacy.mechanisms import Mechanism, SubsampledGaussian
from pl_dp.privacy.noise import NoiseSource
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.sampling import (
    CountingBatchSampler,
    EmptySafeCollate,
    PoissonBatchSampler,
    poisson_sampler_of,
    private_data_of,
)
from pl_dp.privacy.seeding import SeedDomain, derive_seed
from pl_dp.privacy.spec import PrivacySpec
from pl_dp.privacy.units import PrivacyUnit
from pl_dp.step.batches import batch_size_of, fill_rows
from pl_dp.step.distribution import Distribution
from pl_dp.step.fit_start import FitStartChecks
from pl_dp.step.independence import (
    PROBE_MAX,
    PROBE_SIZE,
    Release,
    half_precision_operators,
    probe_examples,
    probe_independence,
    refuse_batch_mixing_modules,
    refuse_varying_batch_shapes,
)
from pl_dp.step.losses import LossSpec, resolve_loss
from pl_dp.step.preflight import PreflightReport, check_private_set
from pl_dp.step.seal import PlainAttributes, sealed
from pl_dp.step.validation import check_positive, positive_integer
from pl_dp.zo.estimator import per_sample_evaluator

#: the fit-start check that reads every private example once (its report seals the private loader's batching)
PRIVATE_DATA_CHECK = "private data"

#: where a lineage's privacy journal goes, inside the checkpoint directory (or the Trainer's root)
JOURNAL_DIRECTORY = "pl_dp_journal"


class _FromLedger:
    """A module attribute that is its ledger's (the privacy protocol callbacks read, and tests set)."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, module: Any, owner: type | None = None) -> Any:
        return self if module is None else getattr(module.ledger, self.name)

    def __set__(self, module: Any, value: Any) -> None:
        setattr(module.ledger, self.name, value)


@dataclass
class StepResult:
    """What a method's :meth:`PrivateModule.private_step` hands back to the base.

    ``metrics``: statistics computed from the noised release or from public data only — safe to log; the base logs
    them on the loggers' cadence. ``nonfinite``: how many sampled examples contributed 0 (a non-finite value, or a
    pass that raised). It is a function of the private data without noise: the base adds it to the in-memory
    ``nonfinite_total`` and logs it only under ``log_private_metrics`` (:meth:`PrivateModule._count_nonfinite`).
    """

    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    nonfinite: int | torch.Tensor = 0


MechanismT = TypeVar("MechanismT", bound=Mechanism)


class PrivateModule(EvaluationMixin, DataParallelMixin, PrecisionMixin, L.LightningModule, Generic[MechanismT]):
    """The privacy protocol shared by all methods: ``epsilon``, ``privacy_report()``, ``accountant``,
    ``noise_multiplier``, ``sample_rate``, ``delta``, ``private_steps``, ``planned_steps`` (what the
    callbacks read), around one private step.

    Args:
        net: the model (any ``nn.Module``, including a LightningModule).
        loss: ``"cross_entropy"``, ``"mse"``, ``"causal_lm"`` or a callable ``(net, batch) -> Tensor[B]`` giving one
            loss per example.
        lr: step size η.
        privacy: the privacy request; ``None`` runs the same method without noise or accounting.
        noise_seed: seed of the DP noise. Default ``None`` draws a secret key from OS entropy at
            construction and again at the start of every fit, held in memory only (never checkpointed: a resumed
            run, or a retry of this module in the same process, draws a new one).
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
        max_physical_batch_size: split each logical Poisson batch into micro-batches of at most this
            many examples for the forward/backward passes (as Opacus' ``BatchMemoryManager``):
            per-example losses and clipped sums are accumulated across micro-batches and one noise
            draw is added per logical step, so memory is bounded by the physical batch while the
            release and its accounting are those of the logical batch. ``None``: one pass.
        preflight: at every private fit, before the first step, check every private example once — it loads,
            has the others' structure, batches with them through the loader's ``collate_fn``, its floating-point
            values are finite and its loss is finite (:mod:`pl_dp.step.preflight`) — and refuse to train with an
            error naming the bad ones by index. Costs one inference pass over the private set. ``False`` skips the
            values and the loss (the forward passes): examples are still read, their structure and batching checked
            (the private loader's batching rule rests on it), and one whose values or loss are bad then contributes
            0 to each step that samples it, counted only in ``nonfinite_total``.
    """

    #: whether the method needs a public loader (PAZO, Coupling: :class:`~pl_dp.methods.public.PublicDataMixin`)
    requires_public_data: bool = False
    #: accept a checkpoint trained under another privacy spec or sample rate (set by
    #: :class:`~pl_dp.callbacks.AllowPrivacySpecChange`): the saved history is kept and σ re-planned
    allow_privacy_change: bool = False
    #: whether DP noise comes from the cryptographic generator unless ``secure_rng`` says otherwise
    secure_rng_default: bool = False
    #: the accountant of ``PrivacySpec(accountant=None)``: the one this method's sampling calls for
    default_accountant: str = "prv"
    #: the mechanism of each private step (:meth:`mechanism`); a spec's accountant must support it
    #: (:meth:`~pl_dp.privacy.accountants.Accountant.supports`)
    release: type[Mechanism] = SubsampledGaussian
    #: the participation schema its noise is accounted for: 1, Poisson sampling of every example at every step; b > 1,
    #: cyclic Poisson sampling over b groups (banded correlated noise, :mod:`pl_dp.privacy.correlated`). The data
    #: module builds the matching loader, and a private fit refuses a loader of another schema
    bands: int = 1
    #: the modes in which the method evaluates private losses, probed at fit start for per-example independence: "train"
    #: (training mode, autograd: first-order) and/or "eval" (eval mode, inference mode: zeroth-order)
    private_loss_modes: tuple[str, ...] = ("train", "eval")
    #: version of the checkpointed privacy state (2: no secrets — noise key and sampling seed — saved)
    PRIVACY_STATE_VERSION = 2

    # this process's own (declared in __init__ by add_process_state): the non-finite count, the bytes sent, the
    # fit's reference example
    _nonfinite: int | torch.Tensor
    collective_bytes: int
    _reference: Any

    def __init__(
        self,
        net: nn.Module,
        *,
        loss: LossSpec = "cross_entropy",
        lr: float = 1e-3,
        privacy: PrivacySpec | None = None,
        noise_seed: int | None = None,
        log_private_metrics: bool = False,
        secure_rng: bool | None = None,
        max_physical_batch_size: int | None = None,
        preflight: bool = True,
    ) -> None:
        super().__init__()
        check_positive("lr", lr)
        if max_physical_batch_size is not None:
            max_physical_batch_size = positive_integer("max_physical_batch_size", max_physical_batch_size)
        self.max_physical_batch_size = max_physical_batch_size
        self.preflight = bool(preflight)
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
        self.direction_seed = derive_seed(torch.initial_seed(), SeedDomain.DIRECTIONS)
        if privacy is not None and not accountant_class(self.accountant_name).supports(self.release):
            fitting = [name for name in accountant_names() if accountant_class(name).supports(self.release)]
            raise PrivacyConfigError(
                f"the {self.accountant_name!r} accountant does not account {type(self).__name__}'s releases "
                f"({self.release.__name__}): use PrivacySpec(accountant=None) (its own, {self.default_accountant!r}) "
                f"or one of {fitting}."
            )
        self.ledger = PrivacyLedger(privacy, self.accountant_name)
        self.log_private_metrics = log_private_metrics
        self._process_state: dict[str, Any] = {}
        self.add_process_state("_nonfinite", 0)  # un-noised private information, added up where it was computed
        self.add_process_state("collective_bytes", 0)  # retries make it depend on which records were sampled
        # a public or validation example, set at fit start (see check_independence); how this fit's step is spread
        # over processes (set up by configure_model): the next fit's own
        self.add_process_state("_reference", None)
        self.add_process_state("distribution", Distribution())
        self._sampler: CountingBatchSampler | None = None
        self._sampler_start = 0
        self._batches_consumed = 0
        self._fit_release: dict[str, Any] | None = None
        self._restored: dict[str, Any] | None = None
        self._plan_ready = False
        self._metrics: nn.ModuleDict = nn.ModuleDict()

    def add_process_state(self, name: str, default: Any) -> None:
        """Declare the attribute ``name`` as this process's own, and set it to ``default``.

        A copy of the module (a pickle, a deep copy, a spawned process: :meth:`__getstate__`) holds ``default``
        instead, and no checkpoint holds it (:meth:`privacy_state_dict` names what one does). For what is computed
        from private data without noise, or depends on which records were sampled, and for what one fit sets up.
        """
        self._process_state[name] = default
        setattr(self, name, copy.copy(default))

    # ---- the method's part -----------------------------------------------------------------
    def mechanism(self, batch_size: int) -> MechanismT:
        """This method's per-step mechanism (:class:`~pl_dp.privacy.mechanisms.Mechanism`; a subsampled Gaussian is
        built by :meth:`_gaussian`)."""
        raise NotImplementedError

    def private_step(self, batch: Any, batch_size: int, mechanism: MechanismT) -> StepResult:
        """One step of the method's math, its noise added through ``mechanism`` only: what it hands back
        (:class:`StepResult`) is its statistics safe to log and its count of examples that contributed 0."""
        raise NotImplementedError

    def reference_pass(self, batch: Any) -> None:
        """The method's per-example computation on ``batch``, results discarded, exceptions raised (by default the
        per-example losses, as :meth:`~pl_dp.methods.own_update.OwnUpdateModule.private_losses` evaluates them;
        first-order methods: the clipped sum)."""
        per_sample_evaluator(self.net, self.loss_fn, batch, batch_size_of(batch), self.max_physical_batch_size)()

    def probe_release(self) -> Release | None:
        """What a private step releases, as the fit-start probe compares it between neighbouring batches
        (:class:`~pl_dp.step.independence.Release`); None: the probe compares losses (and gradients) only."""
        return None

    def check_reference(self) -> None:
        """Raise when the per-example computation fails for a fixed validation (or public) example.

        Inside a private step a failing example only sits out, so a net or loss that fails for *every* example
        would train on noise alone, silently. This check runs at the first step of each fit and on the loggers'
        cadence — a schedule that does not depend on what was sampled — on an example that is not private, so
        that whether and when it raises says nothing about the private records. Without validation or public data
        there is nothing to check it on. Its outcome is whether it raises; what the pass itself would print (e.g.
        torch's notice that a full backward hook fires on a layer whose input needs no gradient) is sealed away.
        """
        if self._reference is None:
            return
        try:
            with torch.random.fork_rng(devices=[self.device.index] if self.device.type == "cuda" else []), sealed():
                self.reference_pass(self._reference)
        except Exception as error:
            error.add_note("(raised for a fixed validation or public example: the net or the loss fails, not a record)")
            raise

    @property
    def touches_private_data(self) -> bool:
        """Whether a step reads the private batch (False e.g. for a public-only mixing weight).

        Steps that do not are neither budget-checked nor accounted nor counted in ``private_steps``.
        """
        return True

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

    # ---- the privacy protocol (the ledger's, for callbacks and users) --------------------------
    @property
    def accountant_name(self) -> str | None:
        """The accountant in use: the spec's, or the method's own when the spec names none."""
        if self.privacy is None:
            return None
        return self.privacy.accountant or self.default_accountant

    @property
    def accountant(self) -> Accountant | None:
        return self.ledger.accountant

    @property
    def epsilon(self) -> float:
        """Exact ε spent so far, across fits and resumes (0 for a non-private run)."""
        return self.ledger.epsilon

    def privacy_report(self) -> PrivacyReport:
        """ε, δ, σ, q, steps, accountant, adjacency, secrets, and what is and is not protected.

        The same report :meth:`PrivacyReport.from_checkpoint` gives for a checkpoint of this run.
        """
        return self.ledger.report(type(self).__name__, self.noise.secure, self.noise.seeded)

    def add_privacy_target(self, epsilon: float, delta: float | None = None) -> float:
        """Stop before the step that would take ε past ``epsilon`` too (see :meth:`PrivacyLedger.add_target`)."""
        return self.ledger.add_target(epsilon, delta)

    noise_multiplier = _FromLedger("σ of the current plan")
    sample_rate = _FromLedger("q, read from the private sampler")
    expected_batch_size = _FromLedger("q·n, the normalization of every released sum")
    delta = _FromLedger("δ of the guarantee (fixed by the first plan)")
    planned_steps = _FromLedger("the steps the current fit plans (Lightning's estimate)")
    private_steps = _FromLedger("private steps run, across fits and resumes")
    user_seeded = _FromLedger("which secrets were ever user-seeded")

    @property
    def privacy_unit(self) -> PrivacyUnit | None:
        """Whom the guarantee protects — one example, or one user with all of their examples — and how many the
        private set holds, as the private sampler states it (read at fit start; None before)."""
        return self.ledger.unit

    @property
    def privacy_exhausted(self) -> bool:
        """Whether the budget guard refused a step in this fit (training stopped there)."""
        return self.ledger.exhausted

    @privacy_exhausted.setter
    def privacy_exhausted(self, value: bool) -> None:
        self.ledger.exhausted = bool(value)

    @property
    def lineage(self) -> str | None:
        """The id of this run and all its resumes (names its privacy journal)."""
        return self.ledger.lineage

    # ---- parameters and step size -----------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        params = [p for p in self.net.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the model has no trainable parameters (requires_grad=True): nothing to optimize.")
        return params

    def master_parameters(self) -> list[torch.Tensor]:
        """The tensors holding the trained values, one per trainable parameter: the parameter itself, or, for
        methods that train half-precision parameters through fp32 masters (:mod:`pl_dp.zo.master`), its master.

        Whatever reads θ exactly (a proximal anchor, an audit's snapshot) reads these; whatever writes them
        goes through the method's engine, which rewrites the parameters as their rounding.
        """
        return self.trainable_parameters()

    @property
    def lr(self) -> float:
        """Current step size; reads the optimizer's so LR schedulers and schedule callbacks agree."""
        opt = self._optimizer_or_none()
        return float(opt.param_groups[0]["lr"]) if opt is not None else self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        check_positive("lr", value)
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
        configured (their ``optimizer=`` argument, the net's own ``configure_optimizers``, an override, or the
        CLI's ``--optimizer``)."""
        return torch.optim.SGD(self.trainable_parameters(), lr=self._lr)

    def net_configure_optimizers(self) -> Any:
        """The net's own ``configure_optimizers`` when ``net`` is a LightningModule that defines one, else None."""
        net = self.net
        if (
            isinstance(net, L.LightningModule)
            and type(net).configure_optimizers is not L.LightningModule.configure_optimizers
        ):
            return net.configure_optimizers
        return None

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
                raise ConfigError(
                    f"ReduceLROnPlateau monitors {config.monitor!r}, which was not logged; available: {available}."
                )

    # ---- the plan ----------------------------------------------------------------------------
    def private_loader(self, dataset: Any, seed: int, collate_fn: Callable[[list], Any] = default_collate) -> Any:
        """The private training loader this method's accounting assumes, or None for Poisson sampling.

        :class:`~pl_dp.data.PrivatePublicDataModule` asks the module first, with its private collate (padding to
        one length where the method asks for it); methods whose guarantee rests on other sampling (O2NC: a
        disjoint partition) return their own loader here.
        """
        return None

    def resumed_sampler_state(self) -> dict[str, Any] | None:
        """The sampler state of the checkpoint this fit resumes (None: none): the data module places a new private
        loader there, before Lightning builds its first iterator (and a loader's workers draw ahead)."""
        return None if self._restored is None else self._restored.get("sampler")

    def private_sampler_of(self, loader: Any) -> Any:
        """The sampler behind the private loader, checked against this method's accounting (it must match): Poisson
        sampling, over :attr:`bands` cyclic groups (one, plain Poisson sampling, unless the noise is banded)."""
        if self.privacy is None:
            return getattr(loader, "batch_sampler", None)
        sampler = poisson_sampler_of(loader)
        found = getattr(sampler, "bands", 1)
        if found != self.bands:
            raise PrivacyConfigError(
                f"{type(self).__name__}'s noise is accounted for "
                + (f"cyclic Poisson sampling over {self.bands} groups" if self.bands > 1 else "plain Poisson sampling")
                + ", but the private loader samples "
                + (f"{found} cyclic groups" if found > 1 else "every example at every step (plain Poisson)")
                + ": the accountant would not describe the run. Let pl_dp.data.PrivatePublicDataModule build the "
                f"loader, or build it with pl_dp.privacy.poisson_loader(..., bands={self.bands})."
            )
        if found > 1 and getattr(loader, "num_workers", 0) > 0 and not getattr(loader, "in_order", True):
            raise PrivacyConfigError(
                "the private loader hands batches on out of order (DataLoader in_order=False): cyclic Poisson sampling "
                "needs step t to train the batch of group t mod b. Leave in_order=True with banded noise."
            )
        return sampler

    def setup_privacy(self) -> None:
        """Read the sampler, let the ledger plan σ for the steps this fit plans, arm the budget guard.

        Runs once per fit (idempotent within it; :meth:`on_fit_start` re-arms it): every fit re-reads
        its loader, re-checks that it Poisson-samples, and plans on top of the accountant history
        already spent, so ε composes across fits and resumes and ``epsilon`` is the total.
        """
        if self._plan_ready:
            return
        trainer = self.trainer
        sampler = self.private_sampler_of(trainer.train_dataloader)
        self.setup_distribution(sampler)
        planned = trainer.estimated_stepping_batches
        if not math.isfinite(planned):
            raise ConfigError("private training needs a finite plan: set trainer max_steps or max_epochs.")
        if self.privacy is not None and trainer.accumulate_grad_batches != 1:
            raise PrivacyConfigError(
                "accumulate_grad_batches must be 1: each Poisson batch is one private step "
                "(use a larger batch_size for a larger expected batch)."
            )
        steps_left = max(int(planned) - trainer.global_step, 0)
        restored, self._restored = self._restored, None  # a checkpoint is checked once, by the fit it resumes
        self._plan_ready = True
        self.ledger.planned_steps = int(planned)
        self.ledger.observe_sampler(sampler, self.noise.seeded)
        self._sampler = sampler if isinstance(sampler, CountingBatchSampler) else None
        self._fit_release = None  # banded noise: this fit's mechanism, fixed at its first step
        if self._sampler is not None:  # its position is checkpointed, so a resume continues the epoch
            saved = restored.get("sampler") if restored is not None else None
            if not self._sampler.drawing:
                if saved is not None:
                    self._sampler.load_state_dict(saved)
            elif saved is not None and int(saved["position"]) != self._sampler.first_untaken():
                # Lightning builds the first epoch's iterator before this hook, and a loader's workers draw ahead
                # then: that iteration cannot be moved. The fit trains on from where it began (its positions still
                # follow each other), but the epoch does not continue at the checkpoint's place
                rank_zero_warn(
                    f"the private loader's workers drew batches from sampler position "
                    f"{self._sampler.first_untaken()} before the checkpoint's position {saved['position']} could be "
                    "restored: this fit continues from the former (its privacy accounting is unaffected), not "
                    "mid-epoch where the checkpoint stopped. pl_dp.data.PrivatePublicDataModule places its loader "
                    "at the checkpoint's position; or use num_workers=0."
                )
            self._sampler_start = self._sampler.first_untaken()
            self._batches_consumed = 0
            self._sampler.restart_at(self._sampler_start)  # every epoch of this fit begins at the first untrained
        if self.privacy is None:
            self.set_padding_example()
            return
        report = self.fit_start_checks().run()[PRIVATE_DATA_CHECK]
        self._seal_batching(report)
        self.ledger.fix_delta()
        self.ledger.open_journal(restored, self._journal_directory(), self._broadcast)
        self.prepare_accounting(sampler, restored)
        self.ledger.plan(steps_left, restored, self.allow_privacy_change, int(planned))
        self.collective_bytes = 0  # what the private steps send: the fit-start checks' agreements are not counted

    def prepare_accounting(self, sampler: Any, restored: dict[str, Any] | None) -> None:
        """Wire the accountant to this fit's private sampler, before σ is planned (explicit, once per plan).

        Called after the sampler's position is restored, with the checkpoint's privacy state when the fit
        resumes one. Poisson accountants need nothing; O2NC checks its partition against the checkpoint
        and tells the tree accountant where the next leaf comes from.
        """

    def fit_start_checks(self) -> FitStartChecks:
        """The checks each private fit runs once, in this order, before its first step and before σ is planned
        (:mod:`pl_dp.step.fit_start`): the pre-flight pass over the private set (:meth:`check_private_data`), then
        the per-example independence probe (:meth:`check_independence`), then the precision check
        (:meth:`check_precision`). A method adds its own with
        ``super().fit_start_checks().then(name, check)``."""
        return (
            FitStartChecks()
            .then(PRIVATE_DATA_CHECK, lambda: self.check_private_data())
            .then("independence", lambda: self.check_independence())
            .then("precision", lambda: self.check_precision())
        )

    def check_private_data(self) -> PreflightReport:
        """The pre-flight pass over the private set (:func:`~pl_dp.step.preflight.check_private_set`), once per
        private fit before any step: through the private loader's own ``collate_fn``, in chunks of the expected
        batch size (or of ``max_physical_batch_size``), by index — never through the Poisson sampler."""
        dataset, collate = private_data_of(self.trainer.train_dataloader)
        chunk = self.max_physical_batch_size or math.ceil(self.expected_batch_size or 1)
        with self.precision_context():  # a loss finite in fp32 may overflow in fp16
            return check_private_set(
                dataset,
                collate,
                self.net,
                self.loss_fn,
                chunk,
                transfer=self._to_device,
                values=self.preflight,
                one_shape=self.one_shape_refusal(),
            )

    def one_shape_refusal(self) -> tuple[str, str] | None:
        """Why a private collate that pads each batch to its longest example is refused at fit start, or None: the
        run's :attr:`one_length_reason` — always in half precision; for a two-point step unless the data module keeps
        dynamic padding by choice (``fixed_length=False``)."""
        why = self.one_length_reason
        if why is None or self.fixed_shapes:
            return why
        opted_out = getattr(getattr(self.trainer, "datamodule", None), "fixed_length", None) is False
        return None if opted_out else why

    def _seal_batching(self, report: PreflightReport) -> None:
        """Tell pl_dp's private loader what a batch looks like: every example's structure, as the pre-flight pass
        found it (examples of another are left out, each by itself), and the empty batch (built now, not read at
        the step that samples nothing)."""
        collate = self.trainer.train_dataloader.collate_fn
        if not isinstance(collate, EmptySafeCollate):
            rank_zero_warn(
                "the private loader was not built by pl_dp (Opacus' DPDataLoader, or a DataLoader of your own over a "
                "Poisson batch sampler): its sampling is accepted, but its reading and batching are not sealed — a "
                "record that fails or warns while being read or batched does so at the step that samples it. Build "
                "it with pl_dp.data.PrivatePublicDataModule or pl_dp.privacy.poisson_loader."
            )
            return
        if report.reference is not None:
            collate.expect(report.reference)

    def check_precision(self) -> None:
        """Refuse, at fit start, a run whose passes compute in bf16 or fp16 where neither the trainer's precision nor
        the net's parameters say so (:attr:`computes_in_half_precision` is False): an autocast region or a cast inside
        the forward or a custom backward, a half-precision buffer (:func:`~pl_dp.step.independence.
        half_precision_operators`, in :meth:`passes_precision`). Such a run keeps dynamic padding and dynamic rows, and
        one record's length would move the others' rounding — several C in a zeroth-order release. It looks at the
        operators' dtypes, never at a value, in the probe's batch, its first example alone, and the probe's examples
        padded to the longest a record may be (the data module's ``max_length``, where the run pads each batch to its
        longest) in as many rows as a pass may have (``max_physical_batch_size``, else the expected batch size and four
        standard deviations of a Poisson batch's): a net whose precision follows the batch's shape is not let through
        by the probe's shape alone. As the probe's, its examples are private ones by index where the run has no public
        or validation data."""
        if self.computes_in_half_precision:
            return
        examples, _ = self._probe_examples()
        collate = private_data_of(self.trainer.train_dataloader)[1]
        expected = self.expected_batch_size or len(examples)
        rows = self.max_physical_batch_size or math.ceil(expected + 4 * math.sqrt(expected))
        widest = fill_rows((self._longest_collate(collate) or collate)(examples), rows)
        batches = [self._to_device(batch) for batch in (collate(examples), collate(examples[:1]), widest)]
        found = half_precision_operators(
            self.net, self.loss_fn, batches, self.private_loss_modes, self.passes_precision
        )
        if found:
            named = ", ".join(
                f"{name} ({str(dtype).removeprefix('torch.')})" for name, dtype in list(found.items())[:4]
            )
            raise ConfigError(
                f"the net computes in half precision inside its forward or backward ({named}"
                f"{' …' if len(found) > 4 else ''}), though the trainer's precision is {self.trainer.precision!r} and "
                "its parameters are not bf16 or fp16: an autocast region or a cast to bf16/fp16 in the forward, or a "
                "half-precision buffer. In half precision one record's length changes the rounding of every other "
                "example of its batch, so pl_dp keeps one batch shape in runs that compute so, which it knows from "
                "the trainer's precision and the parameters' dtypes only. Use Trainer(precision='bf16-mixed') (or "
                "'16-mixed') instead of autocasting inside the forward, store a half-precision buffer in fp32, or "
                "compute the forward in fp32."
            )

    def _longest_collate(self, collate: Callable[[list], Any]) -> Callable[[list], Any] | None:
        """The private ``collate`` padding to the data module's ``max_length`` (or to the net's table of absolute
        positions, if smaller), when the run's pads each batch to its longest (:meth:`~pl_dp.data.
        PrivatePublicDataModule.longest_collate`), else None."""
        longest = getattr(getattr(self.trainer, "datamodule", None), "longest_collate", None)
        return None if longest is None else longest(collate, self.net)

    def check_independence(self) -> None:
        """Per-example independence, once per private fit before any step: refuse batch-mixing layers, then probe
        the private loader's collate, the net and the loss together (:func:`~pl_dp.step.independence.
        probe_independence`) on a batch of the expected size (public examples if the method uses them, else
        validation, else private by index) with one example replaced and one added, in eval mode and, for methods
        that take gradients, in training mode, and what a step releases (:meth:`probe_release`) — all in the
        trainer's precision context and, when the run keeps one batch shape, in its micro-batches of
        :attr:`physical_rows` rows (:mod:`pl_dp.methods.precision`)."""
        refuse_batch_mixing_modules(self.net)
        examples, source = self._probe_examples()
        collate = private_data_of(self.trainer.train_dataloader)[1]
        if (why := self.one_shape_refusal()) is not None:
            refuse_varying_batch_shapes(collate, examples, why)
        # the private collate padding to the data module's max_length, when the run's pads each batch to its longest
        longest = self._longest_collate(collate)
        probe_independence(
            self.net,
            self.loss_fn,
            examples,
            self.private_loss_modes,
            source,
            collate=collate,
            transfer=self._to_device,
            context=self.precision_context,
            compute_dtype=self.autocast_dtype,
            rows=self.physical_rows,
            release=self.probe_release(),
            longest=longest,
            batch_size=self.expected_batch_size,
        )
        # a fixed example that is not private, to tell a net or loss that fails for every example from bad records,
        # and to pad the passes of a sharded step (the checks that follow run such passes)
        self._reference = None if source == "private" else self._to_device(collate(examples[:1]))
        self.set_padding_example()

    def padding_example(self) -> Any:
        """A fixed example that is not private, on this module's device: the reference example, else the first
        validation or public one; a non-private run may use its first training example. It pads the passes of a
        sharded step on a rank that sampled fewer examples than another (see
        :meth:`~pl_dp.methods.parallel.DataParallelMixin.set_padding_example`); a private run without validation or
        public data is refused."""
        if self._reference is not None:
            return self._reference
        dataset, collate = private_data_of(self.trainer.train_dataloader)
        datamodule = getattr(self.trainer, "datamodule", None)
        for name in ("val", "public"):
            examples: Any = getattr(datamodule, name, None)
            if hasattr(examples, "__len__") and len(examples):
                return self._to_device(collate([examples[0]]))
        if self.privacy is None and dataset is not None:
            return self._to_device(collate([dataset[0]]))
        raise ConfigError(
            "a sharded private run needs validation or public data: a fixed example that is not private pads the "
            "passes of a rank that sampled fewer examples than another (every rank runs every sharded pass). Give "
            "the datamodule a val (or public) set."
        )

    def probe_batch(self) -> tuple[Any, str]:
        """The probe's examples collated by the private loader, on this module's device, and where they come from
        (:func:`~pl_dp.step.independence.probe_examples`: public, else validation, else private by index)."""
        examples, source = self._probe_examples()
        return self._to_device(private_data_of(self.trainer.train_dataloader)[1](examples)), source

    def _probe_examples(self) -> tuple[list[Any], str]:
        size = min(max(round(self.expected_batch_size or PROBE_SIZE), 2), PROBE_MAX)
        datamodule, loader = getattr(self.trainer, "datamodule", None), self.trainer.train_dataloader
        return probe_examples(datamodule, loader, public=self.requires_public_data, size=size)

    def _to_device(self, batch: Any) -> Any:
        return self.transfer_batch_to_device(batch, self.device, 0)

    def _journal_directory(self) -> Path | None:
        """The privacy journal's place for a new lineage: beside the checkpoints, if this run writes any."""
        if not self.trainer.checkpoint_callbacks:
            return None
        directory = getattr(self.trainer.checkpoint_callback, "dirpath", None) or self.trainer.default_root_dir
        return Path(directory) / JOURNAL_DIRECTORY

    def _write_journal(self) -> None:
        """Record this fit's released steps before something leaves the process (rank 0 writes)."""
        fallback = Path(self.trainer.default_root_dir) / JOURNAL_DIRECTORY
        self.ledger.write_journal(fallback, writer=self.trainer.is_global_zero)

    # ---- Lightning hooks -----------------------------------------------------------------------
    def on_fit_start(self) -> None:
        # every fit draws its own noise key (unless seeded), before the ranks share rank 0's (setup_distribution): a
        # retry in this process from an older checkpoint never draws again the noise of steps an earlier fit released
        self.noise.redraw_secret()
        if self._sampler is not None:  # an earlier fit's loader, if this fit uses it again: it draws anew
            self._sampler.forget_draws()
        self.prepare_strategy()
        self._plan_ready = False  # every fit re-reads its loader and re-plans (ε composes across fits)
        self.privacy_exhausted = False  # the budget guard decides again for this fit's plan
        if self.privacy is not None and self._restored is not None:
            self._refuse_seeded_banded_resume()
            # the resumed checkpoint's spec, checked now: a checkpoint with no step left to train never reaches the
            # plan (Lightning skips the training loop), and would otherwise be resumed under another spec silently
            self.ledger.check_resume(self._restored, self.allow_privacy_change)

    def _refuse_seeded_banded_resume(self) -> None:
        """Refuse to resume a checkpoint with banded noise from a noise seed.

        A resumed fit restarts the banded recursion (w_{<start} = 0), and a seeded key draws the same z_t for step t
        as the run that wrote the checkpoint. If that run released step t (logged it or checkpointed it before it
        stopped), its release carried z_t − Σ_j c_j·w_{t−j} and the resume's carries z_t alone: their difference is
        the earlier run's past noise, which the release of step t − 1 then loses — the checkpoints of the two runs
        alone, with no knowledge of the seed, give that step's clipped gradient without noise. Whether the earlier
        run released steps after this checkpoint cannot be told from the journal (steps inside a band add no
        composition to it), so every such resume is refused. Independent noise (b = 1) resumes bit-identically with
        both seeds set and is not refused.
        """
        if self.bands > 1 and self.noise.seeded:
            raise PrivacyConfigError(
                f"{type(self).__name__} with banded noise (bands={self.bands}) and a noise_seed cannot resume a "
                "checkpoint: the resume restarts the noise recursion and the seed redraws the same noise for the steps "
                "after the checkpoint, so if the interrupted run released any of them, the two runs' checkpoints "
                "together reveal a step's gradient without noise. Resume with noise_seed=None (a fresh secret key; "
                "a banded resume is not bit-identical anyway, its recursion restarts), or rerun from the start."
            )

    def on_train_start(self) -> None:
        # a loader the user built and passes to several fits keeps its sampler: a later fit draws a fresh sampling seed
        # (unless seeded), so a retry from an older checkpoint does not sample again the batches an earlier fit released
        sampler = getattr(self.trainer.train_dataloader, "batch_sampler", None)
        if self.privacy is not None and isinstance(sampler, PoissonBatchSampler):
            sampler.begin_fit()
        self.setup_privacy()

    def on_train_epoch_end(self) -> None:
        self._step_lr_schedulers("epoch")

    def teardown(self, stage: str) -> None:
        """After a fit — ended, stopped or crashed — its loader's draws no step took are forgotten: a later fit that
        uses the loader again (another module's) begins from its position, not from this fit's leftovers."""
        if stage == "fit" and self._sampler is not None:
            self._sampler.forget_draws()

    def on_fit_end(self) -> None:
        """Record the fit's releases in the journal; log the privacy report to every logger."""
        if self.ledger.journal is not None:
            self._write_journal()
        if self.trainer.loggers and self.privacy is not None:
            report = self.privacy_report().to_dict()
            for logger in self.trainer.loggers:
                logger.log_hyperparams({"privacy_report": report})
                logger.save()

    # ---- the step ----------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One private step: ask the guard, draw this step's noise, run the method's math, record it."""
        if self.privacy is not None and self.touches_private_data and not self.ledger.allows_next_step():
            self.trainer.should_stop = True
            self._log_epsilon(final=True)  # the fit ends here: the loggers write its exact ε (should_stop)
            return None
        if self._sampler is not None:
            self._take_position()
        batch_size = batch_size_of(batch)
        mechanism = self.mechanism(batch_size)
        if self.privacy is not None and self.bands > 1 and self.touches_private_data:
            self._check_fit_release(mechanism)
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        self.noise.start_step(self.private_steps)
        attributes = PlainAttributes(self.net) if self.privacy is not None else None
        # nothing record-dependent leaks out; whether a record is sampled does not choose the attention kernel
        sealing = sealed(self.privacy is not None and not self.log_private_metrics)
        with sealing, self._private_randomness(), self.attention_context():
            result = self.private_step(batch, batch_size, mechanism)
        if attributes is not None:  # what the net stored from this batch stays out of copies of it
            attributes.restore()
        if self.touches_private_data:
            self.ledger.record(mechanism)
        self._batches_consumed += 1
        if self._sampler is not None:  # an epoch cut short begins the next at the first batch not trained
            self._sampler.restart_at(self._sampler_start + self._batches_consumed)
        opt.step()  # applies .grad where a first-order method set it; otherwise only advances global_step
        opt.zero_grad(set_to_none=True)
        self._step_lr_schedulers("step")
        self._log_step(result)
        if self.log_private_metrics:
            self._log_private_metrics(batch)

    def _take_position(self) -> None:
        """Take the sampler position of the batch this step trains — the oldest one the current iteration drew and no
        step took (a DataLoader hands batches on in the order its batch sampler yields them; ``in_order=False`` is
        refused at fit start) — and under cyclic sampling (bands > 1) refuse, before anything is released, one that
        is not where the fit's schedule is.

        The k-th step of a fit must train position start + k: cyclic sampling's step t samples group t mod b, and
        the banded accounting (⌈T/b⌉ compositions, b-min-separation) holds for the groups of the steps trained, not
        of the batches drawn. Each epoch begins at the first position no step trained (:meth:`~pl_dp.privacy.
        sampling.CountingBatchSampler.restart_at`); this check stands behind that. It reads positions only (never
        data): whether it raises says nothing about the records."""
        sampler = self._sampler
        if sampler is None:
            return
        drawn, expected = sampler.take(), self._sampler_start + self._batches_consumed
        if self.privacy is not None and self.bands > 1 and drawn != expected:
            raise PrivacyConfigError(
                f"private step {self._batches_consumed} of this fit trains the batch at sampler position {drawn}, but "
                f"cyclic Poisson sampling over {self.bands} groups needs position {expected} there (step t samples "
                "group t mod b): two participations of an example could come closer than b steps, which the banded "
                "accounting excludes. The private loader must hand batches on in the order its batch sampler draws "
                "them (no in_order=False, no loader wrapping or reordering batches) and be iterated by this fit only."
            )

    def _check_fit_release(self, mechanism: Any) -> None:
        """Banded noise: refuse — before the release — a step whose mechanism (σ, q, sensitivity, expected batch size)
        differs from the fit's first step's. A participation's noise spans b rows of the strategy, and the ledger
        records a band at its first step: a σ lowered (or a clip bound raised) within the fit, even at a band's
        start, is not what the accountant composes."""
        if not dataclasses.is_dataclass(mechanism):
            return
        fields = ((f.name, getattr(mechanism, f.name)) for f in dataclasses.fields(mechanism))
        release = {name: value for name, value in fields if value is None or isinstance(value, int | float)}
        if self._fit_release is None:
            self._fit_release = release
            return
        changed = {
            name: (self._fit_release[name], value)
            for name, value in release.items()
            if self._fit_release[name] != value
        }
        if changed:
            said = ", ".join(f"{name} {before!r} -> {now!r}" for name, (before, now) in changed.items())
            raise PrivacyConfigError(
                f"banded noise (bands={self.bands}) releases under one mechanism for a whole fit, but its {said} "
                "changed since the fit's first step (set on the module mid-fit?): one participation's noise spans "
                "b steps and the ledger accounts each band at its first step. Change noise_multiplier, the clip "
                "or the sampling between fits, not within one."
            )

    @contextlib.contextmanager
    def _private_randomness(self) -> Iterator[None]:
        """In a private run, the step's own randomness (dropout in training mode, a net's sampling) comes from a
        generator set secretly per step and rank (:meth:`~pl_dp.privacy.noise.NoiseSource.seed_randomness`), and
        the global generators — public: ``seed_everything`` sets them — are left as they were."""
        if self.privacy is None:
            yield
            return
        with torch.random.fork_rng(devices=[self.device.index] if self.device.type == "cuda" else []):
            self.noise.seed_randomness(self.private_steps, self.global_rank, self.device)
            yield

    def _log_step(self, result: StepResult) -> None:
        self._count_nonfinite(result.nonfinite)
        logging = self._logging_step()
        if self.privacy is not None and self.touches_private_data and (logging or self._batches_consumed == 1):
            self.check_reference()
        if not logging:
            return
        if self.trainer.loggers and self.ledger.journal is not None:
            self._write_journal()  # this step's outputs are about to be logged
        for name, value in result.metrics.items():
            self.log(name, value, on_step=True, on_epoch=False)
        if self.log_private_metrics:
            self.log(
                "diagnostics/not_private/nonfinite_total", float(self.nonfinite_total), on_step=True, on_epoch=False
            )
        self.log("privacy/private_steps", float(self.private_steps), on_step=True, on_epoch=False)
        self._log_epsilon(final=self._last_step_of_fit())

    def _log_epsilon(self, final: bool) -> None:
        """``privacy/epsilon`` — the accountant's exact ε, the report's — and ``privacy/budget_left`` where ε is
        evaluated, and for PRV and PLD ``privacy/epsilon_rdp``, the Rényi-DP upper bound of the same history, at
        every logged step (:class:`~pl_dp.privacy.calibration.EpsilonTracker`).

        RDP and the tree accountant evaluate ε at every logged step. PRV and PLD do on a grid of the plan and at the
        fit's last step only (a fit with neither a logger nor a progress bar, where nothing reads a grid point's ε,
        at the last step only), and there ε goes to the loggers directly, at the step Lightning writes this batch's
        metrics at: through ``self.log`` Lightning would write its last value again at every later step of the
        epoch, an ε the history at those steps does not have. ``self.log(logger=False)`` keeps it in
        ``callback_metrics`` and the progress bar (the latest evaluation).
        """
        if self.privacy is None:
            return
        trainer = self.trainer
        every = trainer.log_every_n_steps
        seen = bool(trainer.loggers) or trainer.progress_bar_callback is not None  # who reads a grid point's ε
        written = seen and every > 0 and trainer.global_step % every == 0
        values = self.ledger.logged_epsilon(final, written=written)
        sparse = "epsilon_rdp" in values  # PRV, PLD: ε is evaluated at some logged steps only
        if "epsilon" in values:
            exact = {
                "privacy/epsilon": values["epsilon"],
                "privacy/budget_left": self.privacy.epsilon - values["epsilon"],
            }
            for name, value in exact.items():
                self.log(name, value, on_step=True, on_epoch=False, prog_bar=True, logger=not sparse)
            if sparse:
                step = trainer.fit_loop.epoch_loop._batches_that_stepped  # where Lightning writes this batch's metrics
                for logger in trainer.loggers:
                    logger.log_metrics(exact, step=step)
        if sparse:
            self.log("privacy/epsilon_rdp", values["epsilon_rdp"], on_step=True, on_epoch=False)

    def _last_step_of_fit(self) -> bool:
        """Whether this step is the fit's last: a stop, ``max_steps`` reached, or the last batch of the last epoch."""
        trainer = self.trainer
        if trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step:
            return True
        max_epochs = trainer.max_epochs
        return bool(trainer.is_last_batch and max_epochs is not None and trainer.current_epoch + 1 >= max_epochs > 0)

    @property
    def nonfinite_total(self) -> int:
        """How many sampled examples contributed 0 so far in this process (see :meth:`_count_nonfinite`; reading it
        waits for the device)."""
        return int(self._nonfinite)

    def _count_nonfinite(self, count: int | torch.Tensor) -> None:
        """Count examples whose per-example value was non-finite or whose pass raised (they contributed 0, keeping
        the bound).

        The count is a function of the private data with no noise — logging it, or even warning that it is not
        zero, would tell an adversary whether a record with an infinite loss was sampled — so it stays in process
        memory (``nonfinite_total``, never pickled or checkpointed) and is logged only under
        ``log_private_metrics``. Bad records are reported before training instead, by the pre-flight pass. It is
        added up on the device it was computed on: a step does not wait for the device to count.
        """
        self._nonfinite = self._nonfinite + count

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

    # ---- checkpointing -------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a pickle or a deep copy of the module holds (``torch.save(model)``, ``copy.deepcopy``, a spawned
        process): no secret and nothing computed from private data without noise. The noise source and the
        Poisson sampler leave their key and seed out (the copy draws its own, so it never replays this run's noise
        or batches, unless the user seeded them); what was declared this process's own (:meth:`add_process_state`:
        the non-finite count, the bytes sent, this fit's set-up) holds its declared default."""
        state = super().__getstate__()
        state.update({name: copy.copy(default) for name, default in self._process_state.items()})
        return state

    def privacy_state_dict(self) -> dict[str, Any]:
        """What must survive a checkpoint for ε to stay right — and nothing secret (no noise key, no sampling seed).

        The ledger (accountant history, the plan it was released under, counters, which secrets were
        ever user-seeded, the journal's place), the direction seed and the sampler's position. Never
        the noise key, the sampling seed or a count computed from private data without noise.
        """
        state: dict[str, Any] = {
            "version": self.PRIVACY_STATE_VERSION,
            "method": type(self).__name__,
            **self.ledger.state_dict(),
            "direction_seed": self.direction_seed,
            "secure_rng": self.noise.secure,
        }
        if self._sampler is not None:
            state["sampler"] = {"position": self._sampler_start + self._batches_consumed}
        return state

    def load_privacy_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the privacy state of a checkpoint; the secrets stay this process's own (fresh).

        A checkpoint written before version 2 also holds the noise generator's state: it is ignored,
        so a resume never replays the noise of the original continuation. A version this pl_dp does not know (a
        newer one's) is refused: what its entries mean may have changed, and ε must not be read from a guess.
        """
        version = state.get("version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= self.PRIVACY_STATE_VERSION:
            raise PrivacyConfigError(
                f"this checkpoint's privacy state has version {version!r}; this pl_dp reads versions 1 to "
                f"{self.PRIVACY_STATE_VERSION}. It was written by another (newer) pl_dp: resume it with that version."
            )
        if state.get("method") != type(self).__name__:
            raise PrivacyConfigError(
                f"this checkpoint was written by {state.get('method')!r}, not {type(self).__name__!r}: "
                "its privacy state cannot be resumed by another method."
            )
        self.ledger.load_state_dict(state)
        self.direction_seed = int(state["direction_seed"])
        self._restored = state
        self._plan_ready = False  # setup_privacy re-reads the loader and checks it against the checkpoint

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.privacy is not None and self.lineage is not None:
            self._write_journal()  # before the checkpoint exists: a resume from it finds every step released
        checkpoint["pl_dp"] = self.privacy_state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "pl_dp" not in checkpoint:
            raise PrivacyConfigError(
                "this checkpoint has no pl_dp privacy state (accountant history, plan, counters): resuming "
                "would restart the accountant from zero and under-report epsilon."
            )
        self.load_privacy_state_dict(checkpoint["pl_dp"])
