"""First-order private methods: DP-SGD with constant, automatic or PSAC clipping, and Coupling.

Shared mechanics (per-example gradients, weighted clipping, noise, optimizer) live in
:class:`FirstOrderModule`; each method adds only its update rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import torch
from torch import nn

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods.base import PrivateModule, StepResult
from pl_dp.methods.public import PublicDataMixin
from pl_dp.per_sample import ShardedGhostClipping, verify_per_example_gradients
from pl_dp.per_sample.modes import PerSampleEngine, get_per_sample_mode
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.privacy.correlated import BandedMatrixFactorization, BandedNoise, BandedSquareRoot
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.step.batches import batch_size_of, fill_rows, split_batch
from pl_dp.step.fit_start import FitStartChecks
from pl_dp.step.independence import Release
from pl_dp.step.losses import check_per_sample
from pl_dp.step.seal import PlainAttributes, sealed
from pl_dp.step.shards import as_gradient_of, local

T = TypeVar("T")
_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
#: the noise strategies of ``noise=``: i.i.d. draws (DP-SGD), or correlated by banded matrix factorization
NOISE_STRATEGIES = ("independent", "banded")
#: ``optimizer=`` for the net's own ``configure_optimizers`` (what the hyperparameters record when it is used)
NET_OPTIMIZER = "net"


class FirstOrderModule(PrivateModule[SubsampledGaussian]):
    """Per-example gradients → weighted clipping → one Gaussian noise draw → a torch optimizer.

    Args (beyond :class:`~pl_dp.methods.base.PrivateModule`):
        clip: C, the sensitivity bound (for ``"automatic"``/``"psac"``, the scale that couples with η).
            ``None`` only without privacy: plain mini-batch gradients, no per-example work.
        clip_fn: ``"constant"`` min(1, C/s), ``"automatic"`` C/(s+r), ``"psac"`` C/(s + r/(s+r)).
        r: the regularizer of automatic and PSAC clipping.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"`` — post-processing of the privatized
            gradient, so momentum and adaptive steps cost no privacy. When ``net`` is a LightningModule with its
            own ``configure_optimizers``, that is used instead (leave ``optimizer``, ``momentum`` and
            ``weight_decay`` at their defaults, or say ``optimizer="net"``; ``lr`` is then the net optimizer's). The
            hyperparameters then record what optimizes: ``optimizer: "net"`` and the net optimizer's ``lr``, and for
            the loggers also ``net_optimizer`` (its class and settings), ``net_lr_schedulers`` and ``net_hparams``.
        momentum, weight_decay: optimizer options.
        per_sample: a registered per-sample mode (:mod:`pl_dp.per_sample.modes`): ``"bk"`` (the default: book-keeping,
            Bu et al. 2023 — ghost clipping's per-example norms and the clipped sum from the same single backward pass;
            the fastest exact mode measured, or within 13 % of it, from a 5k-parameter MLP to BERT-base on a GPU; on a
            net sharded by FSDP2 too; see :mod:`pl_dp.per_sample.bk`), ``"ghost"`` (ghost clipping, Li et al. 2022:
            per-example gradient norms from Opacus' GradSampleModuleFastGradientClipping, then the same backward again,
            whose output gradients are contracted with the clip weights; about book-keeping's memory at 1.2–1.3× its
            time, on one process or sharded;
            see :mod:`pl_dp.per_sample.ghost`), ``"hooks"`` (Opacus' GradSampleModule: every per-example gradient formed
            — B times the trainable parameters in memory; its passes run under the trainer's autocast) or
            ``"functorch"`` (``torch.func.vmap``: layers Opacus' hooks do not support). ``"bk"`` and ``"ghost"`` compute
            in fp32 even under a mixed-precision trainer. Same clipping rules, noise and accounting in every mode.
        clip_quantile: adaptive clipping (AdaMix's rule, with constant clipping only): the threshold
            R_t follows the ``clip_quantile`` quantile of per-example gradient norms by the geometric
            update R ← R·exp(−η_C·(b̃ − γ)) of Andrew et al. 2021, where b̃ is the *privatized*
            fraction of examples with ‖g_i‖ ≤ R (a count with noise ``quantile_noise``, sensitivity 1).
            ``clip`` is the initial R. The count is a second release on the same batch: its
            privacy is paid by raising the gradient noise to σ_main = (σ⁻² − σ_b⁻²)^{−1/2}, and the
            accountant records σ for the pair.
        quantile_noise: σ_b, the count's noise std; ``None`` means expected batch size / 20.
        quantile_lr: η_C of the geometric update.
        noise: ``"independent"`` (DP-SGD's i.i.d. draws) or ``"banded"``: correlated noise by banded matrix
            factorization (DP-BandMF, :mod:`pl_dp.privacy.correlated`): the noise of step t is σ·ζ·C·w_t with
            w_t = z_t − Σ_{j<b} c_j·w_{t−j}, the coefficients of the banded square root (Kalinin & Lampert 2024),
            accounted with amplification as one subsampled Gaussian step per ``bands`` steps (Choquette-Choo et al.
            2023) under cyclic Poisson sampling over ``bands`` groups, which the data module builds. See
            docs/correlated-noise.md.
        bands: b, the number of bands of the strategy (``noise="banded"`` only). b = 1 is DP-SGD, bit for bit;
            a larger b cancels more noise across steps, with fewer compositions but each example sampled in one step
            of every b. Keeps b − 1 past noise outputs (model-sized tensors, in process memory only).
    """

    private_loss_modes = ("train",)  # per-example gradients in training mode

    @property
    def private_passes_autocast(self) -> bool:  # type: ignore[override]
        """Whether the per-sample mode's passes run under the trainer's autocast (ghost clipping computes in fp32)."""
        return get_per_sample_mode(self.per_sample_mode).autocast

    @property
    def supports_sharding(self) -> bool:
        """Sharded (FSDP2) with a mode that shards (ghost clipping): per-example gradients of gathered layers would
        not be sharded."""
        return self.shardable and get_per_sample_mode(self.per_sample_mode).shards

    def __init__(
        self,
        net: nn.Module,
        *,
        clip: float | None = 1.0,
        clip_fn: str = "constant",
        r: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        per_sample: str = "bk",
        clip_quantile: float | None = None,
        quantile_noise: float | None = None,
        quantile_lr: float = 0.2,
        noise: str = "independent",
        bands: int = 1,
        lr: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(net, lr=lr, **kwargs)
        if noise not in NOISE_STRATEGIES:
            raise ConfigError(f"noise must be one of {list(NOISE_STRATEGIES)}, got {noise!r}.")
        strategy = BandedSquareRoot(bands)  # refuses a bands that is not an integer >= 1
        if noise == "independent" and bands != 1:
            raise ConfigError(f"bands={bands} needs noise='banded': independent noise has no bands.")
        if bands > 1 and clip_quantile is not None:
            raise ConfigError(
                "adaptive clipping (clip_quantile) changes the clip bound between the steps one banded noise draw "
                "spans, which the banded analysis does not cover: use a fixed clip with noise='banded', bands > 1."
            )
        self.bands = strategy.bands
        #: the banded recursion and its secret past outputs (None: independent noise)
        self.noise_correlation = BandedNoise(strategy) if noise == "banded" else None
        if clip_quantile is not None:
            if not 0.0 < clip_quantile < 1.0:
                raise ConfigError(f"clip_quantile must lie in (0, 1), got {clip_quantile!r}.")
            if clip_fn != "constant" or clip is None:
                raise ConfigError("adaptive clipping (clip_quantile) needs clip_fn='constant' and an initial clip.")
            if quantile_noise is not None and not quantile_noise > 0:
                raise PrivacyConfigError(f"quantile_noise must be > 0, got {quantile_noise!r}.")
        self.clip_quantile = clip_quantile
        self.quantile_noise = quantile_noise
        self.quantile_lr = float(quantile_lr)
        if clip is None and self.privacy is not None:
            raise ConfigError("clip must be a number > 0 for a private run, got None.")
        if optimizer not in _OPTIMIZERS and optimizer != NET_OPTIMIZER:
            raise ConfigError(
                f"optimizer must be one of {sorted(_OPTIMIZERS)} or {NET_OPTIMIZER!r} (the net's "
                f"configure_optimizers), got {optimizer!r}."
            )
        self.clip_function = None if clip is None else ClipFunction(clip_fn, clip, r)
        self.optimizer_name = optimizer
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        get_per_sample_mode(per_sample)  # an unknown name is refused here, with the known ones
        self.per_sample_mode = per_sample
        self._per_sample: PerSampleEngine | None = None

    def configure_optimizers(self) -> Any:
        """The optimizer named by ``optimizer`` (with ``lr``, ``momentum``, ``weight_decay``) — or, when ``net`` is a
        LightningModule with its own ``configure_optimizers``, that one (its optimizers and LR schedulers, as
        returned; the privatized gradient is post-processing, so any optimizer costs no privacy)."""
        own = self.net_configure_optimizers()
        if own is None and self.optimizer_name == NET_OPTIMIZER:
            raise ConfigError(
                f"optimizer={NET_OPTIMIZER!r} uses the net's own configure_optimizers, but {type(self.net).__name__} "
                "is not a LightningModule that defines one."
            )
        if own is not None:
            if self.optimizer_name not in ("sgd", NET_OPTIMIZER) or (self.momentum, self.weight_decay) != (0.0, 0.0):
                raise ConfigError(
                    f"both the net's configure_optimizers and {type(self).__name__}(optimizer={self.optimizer_name!r}, "
                    f"momentum={self.momentum}, weight_decay={self.weight_decay}) say how to optimize: keep one "
                    "(the method's arguments at their defaults use the net's)."
                )
            return own()
        kwargs: dict[str, Any] = {"lr": self._lr, "weight_decay": self.weight_decay}
        if self.optimizer_name == "sgd":
            kwargs["momentum"] = self.momentum
        return _OPTIMIZERS[self.optimizer_name](self.trainable_parameters(), **kwargs)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self._record_net_optimizer()

    def _record_net_optimizer(self) -> None:
        """When the net's own ``configure_optimizers`` optimizes, say so in the hyperparameters (the checkpoints')
        and in what the loggers record (Lightning logs them after this hook): ``optimizer: "net"`` and the net
        optimizer's starting ``lr`` — values the constructor takes back (``load_from_checkpoint``) — and, for the
        loggers only, its class and settings, its LR schedulers and the net's own ``hparams``. All of it is
        configuration, public."""
        optimizers = self.trainer.optimizers
        if self.net_configure_optimizers() is None or not optimizers:
            return
        optimizer = optimizers[0]
        group = optimizer.param_groups[0]
        lr = float(group.get("initial_lr", group["lr"]))  # a scheduler has not stepped yet; initial_lr is its start
        settings = {k: _plain(v) for k, v in optimizer.defaults.items() if _plain(v) is not None}
        settings["lr"] = lr
        for hparams in (self.hparams, self._hparams_initial):
            hparams.update(optimizer=NET_OPTIMIZER, lr=lr)
        self._hparams_initial.update(
            net_optimizer={"class": type(optimizer).__name__, **settings},
            net_lr_schedulers=[type(config.scheduler).__name__ for config in self.trainer.lr_scheduler_configs],
        )
        net_hparams = dict(getattr(self.net, "hparams", None) or {})
        if net_hparams:
            self._hparams_initial["net_hparams"] = {k: _plain(v) for k, v in net_hparams.items()}

    def mechanism(self, batch_size: int) -> SubsampledGaussian:
        """One d-dimensional release per step: the weighted per-example sum, sensitivity C (the current
        R_t with adaptive clipping, plus the sensitivity-1 count as an auxiliary release)."""
        sensitivity = None if self.clip_function is None else self.clip_function.sensitivity
        count_noise = self.quantile_noise
        if self.clip_quantile is not None and count_noise is None:
            count_noise = (self.expected_batch_size or max(batch_size, 1)) / 20.0
        gaussian = self._gaussian(
            batch_size, sensitivity, auxiliary_noise_multiplier=None if self.clip_quantile is None else count_noise
        )
        if self.noise_correlation is None:
            return gaussian
        return BandedMatrixFactorization.of(gaussian, self.noise_correlation)

    def prepare_accounting(self, sampler: Any, restored: dict[str, Any] | None) -> None:
        """Banded noise: every fit starts a new banded mechanism — the recursion forgets its past outputs, as the
        ledger counts this fit's bands from its first step (a resume, with its fresh noise key and groups, too). Its
        groups must then hold for the whole fit: a loader rebuilt within it draws new ones, so that is refused."""
        super().prepare_accounting(sampler, restored)
        if self.bands > 1 and self.trainer.reload_dataloaders_every_n_epochs:
            raise PrivacyConfigError(
                "reload_dataloaders_every_n_epochs rebuilds the private loader within the fit, and with it the cyclic "
                "groups (drawn from a fresh secret seed) in the middle of a banded mechanism: an example could take "
                f"part twice within {self.bands} steps, which its accounting excludes. Leave it at 0 with banded noise."
            )
        if self.noise_correlation is not None:
            self.noise_correlation.restart()

    def on_train_start(self) -> None:
        if self._per_sample is not None:  # a new fit may train another set of parameters
            self._per_sample.close()
            self._per_sample = None
        if self.clip_function is not None:  # before the fit-start checks: the probe runs the step's clipped sum
            mode = get_per_sample_mode(self.per_sample_mode)
            self._per_sample = mode.build(self.net, self.loss_fn, self.distribution.passes)
        super().on_train_start()

    def fit_start_checks(self) -> FitStartChecks:
        """The base's checks, then that each clipped row is one example's whole gradient
        (:func:`~pl_dp.per_sample.verify_per_example_gradients`, on the probe's batch)."""
        return super().fit_start_checks().then("per-example gradients", self._verify_per_example_gradients)

    def _verify_per_example_gradients(self) -> None:
        if self._per_sample is None:  # no clipping: nothing per example to verify
            return
        attributes = PlainAttributes(self.net)  # what the net stores from the (maybe private) examples
        with sealed():  # its examples may be private: whether they make the net speak is too
            verify_per_example_gradients(self._per_sample, self.probe_batch()[0])
        attributes.restore()

    def reference_pass(self, batch: Any) -> None:
        """The clipped sum of ``batch``, computed and discarded (see :meth:`PrivateModule.check_reference`)."""
        if self._per_sample is not None:
            self._per_sample.clipped_sum(batch, self.clip_function)

    def _clipped_sum(
        self, examples: Any, watched: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The per-sample engine's clipped sum of a micro-batch (of its ``watched`` rows only, if given: the probe's);
        in a run that keeps one batch shape, computed in the micro-batch filled to :attr:`physical_rows` rows, the
        filling rows at weight 0 (:mod:`pl_dp.methods.precision`)."""
        physical = self.physical_rows
        if physical is None:
            return self._per_sample.clipped_sum(examples, self.clip_function, rows=watched)
        size = batch_size_of(examples)
        rows = torch.arange(max(physical, size)) < size
        if watched is not None:
            rows[:size] &= watched.to(rows.device)
        return self._per_sample.clipped_sum(fill_rows(examples, physical), self.clip_function, rows=rows)

    def probe_release(self) -> Release | None:
        """The clipped gradient sum of the kept examples, in units of C, through the step's micro-batches (see
        :class:`~pl_dp.step.independence.Release`), in a run that computes in half precision — where rounding that
        depends on the batch's shape moves it (in fp32, by 1e-5·C at b = 256; the training-mode probe compares the
        other examples' summed gradient already, at 1e-5 of its norm, and the release check costs about three
        probes on MiniLM). Not on a sharded net, whose ranks hold different blocks of the sum."""
        if self._per_sample is None or self.distribution.sharded or not self.computes_in_half_precision:
            return None
        clip = self.clip_function.sensitivity

        def clipped_gradient(batch: Any, keep: torch.Tensor) -> list[torch.Tensor]:
            total: list[torch.Tensor] = []
            start = 0
            for part in split_batch(batch, self.physical_rows or self.max_physical_batch_size):
                size = batch_size_of(part)
                watched, start = keep[start : start + size], start + size
                if not bool(watched.any()):  # a micro-batch of the outlier alone: nothing watched in it
                    continue
                with torch.enable_grad():
                    sums = self._clipped_sum(part, watched)[0]
                total = sums if not total else [t + s for t, s in zip(total, sums)]
            return [torch.cat([t.reshape(-1) for t in total]) / clip]

        return Release(clipped_gradient, "the clipped gradient sum a step releases")

    def private_gradient(
        self, batch: Any, batch_size: int, mechanism: SubsampledGaussian
    ) -> tuple[list[torch.Tensor], StepResult]:
        """(Σ_i c(‖g_i‖)·g_i + N(0, σ²C²·I)) / expected batch size, one tensor per parameter, in fp32 (or the
        parameter's dtype if wider): the sums and the noise are never rounded to a half-precision parameter's dtype
        before the noise is added — a bf16 running sum rounds the micro-batches' sums in an order that depends on
        which examples were sampled (0.67·C at b = 256, found by an independent review); :meth:`set_gradients`
        rounds the privatized gradient."""
        params = self.trainable_parameters()
        sums = [torch.zeros_like(local(p), dtype=torch.promote_types(p.dtype, torch.float32)) for p in params]
        physical = self.physical_rows or self.max_physical_batch_size
        parts = split_batch(batch, physical) if batch_size > 0 else []
        distribution, blocks = self.distribution, self.distribution.noise_blocks(params)
        if self.clip_function is None:  # non-private baseline: the plain mean gradient

            def gradient(part: Any, weight: float = 1.0) -> list[torch.Tensor | None]:
                with torch.enable_grad():
                    losses = check_per_sample(self.loss_fn(self.net, part), batch_size_of(part))
                    return distribution.gradient_of_sum(losses.sum() * weight, params)

            for grads in self._passes(parts, gradient, pad=partial(gradient, weight=0.0))[0]:
                for s, g in zip(sums, grads):
                    if g is not None:
                        s.add_(g)
            sums, _ = distribution.sum_with_count(sums, torch.zeros(()))
            mechanism.privatize_(sums, self.noise, blocks=blocks)
            return sums, StepResult()
        device = params[0].device
        norms, nonfinite = [torch.zeros(0, device=device)], torch.zeros((), dtype=torch.long, device=device)

        def padding_sum(example: Any) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
            # sharded, hence ghost clipping (supports_sharding)
            return cast(ShardedGhostClipping, self._per_sample).padding_sum(example, self.clip_function)

        # one physical micro-batch at a time, clipped sums added up (one noise draw below)
        done, failed = self._passes(parts, self._clipped_sum, pad=padding_sum)
        for part_sums, part_norms, part_nonfinite in done:
            for s, t in zip(sums, part_sums):
                s.add_(t.to(s.dtype))
            norms.append(part_norms)
            nonfinite = nonfinite + part_nonfinite
        nonfinite = nonfinite + failed
        norms = torch.cat(norms)
        sums, nonfinite = distribution.sum_with_count(sums, nonfinite)
        result = StepResult(nonfinite=nonfinite)
        if self.log_private_metrics and batch_size > 0:
            result.metrics.update(self._clip_diagnostics(sums, norms, mechanism))
        mechanism.privatize_(sums, self.noise, blocks=blocks)
        if self.clip_quantile is not None:
            result.metrics.update(self._adapt_clip(norms, mechanism))
        return sums, result

    def _passes(self, parts: list[Any], compute: Callable[[Any], T], *, pad: Callable[[Any], T]) -> tuple[list[T], int]:
        """``compute(part)`` of each micro-batch, and how many examples were left out, as the run's distribution
        runs passes (:meth:`~pl_dp.step.distribution.Distribution.run`; ``pad``: the padding example's pass, at
        weight 0, of a sharded rank with fewer micro-batches): in a private run an example whose pass raises is
        left out (weight 0) and counted — no record-dependent crash."""
        reset = None if self._per_sample is None else self._per_sample.reset
        return self.distribution.run(parts, compute, pad=pad, isolate=self.privacy is not None, reset=reset)

    def _clip_diagnostics(
        self, sums: list[torch.Tensor], norms: torch.Tensor, mechanism: SubsampledGaussian
    ) -> dict[str, torch.Tensor]:
        """Not differentially private: un-noised per-example information (the clip or amplified fraction, and
        the signal-to-noise ratio of Liu et al. 2023, §5.3)."""
        prefix = "diagnostics/not_private/"
        squares = torch.stack([s.double().square().sum() for s in sums]).sum().reshape(1)
        signal = math.sqrt(self.distribution.squared_norm(squares))
        dim = sum(p.numel() for p in self.trainable_parameters())
        noise = mechanism.noise_std * math.sqrt(dim)  # E‖σC·Z‖ ≈ σC√d
        fn = self.clip_function
        if fn.kind == "constant":
            affected = {"clip_fraction": (norms > fn.clip).float().mean()}
        else:
            affected = {"amplified_fraction": (fn.weights(norms) > 1).float().mean()}
        out = {prefix + k: v for k, v in affected.items()}
        out[prefix + "snr"] = torch.tensor(signal / noise if noise > 0 else math.inf)
        return out

    def _adapt_clip(self, norms: torch.Tensor, mechanism: SubsampledGaussian) -> dict[str, torch.Tensor]:
        """R ← R·exp(−η_C(b̃ − γ)) with b̃ the privatized fraction of norms ≤ R (the auxiliary release)."""
        below = self.all_reduce_sum((norms <= self.clip_function.clip).sum().float().reshape(1)).cpu()
        fraction = float(mechanism.privatize_auxiliary(below, self.noise))
        clip = self.clip_function.clip * math.exp(-self.quantile_lr * (fraction - self.clip_quantile))
        self.clip_function = ClipFunction("constant", clip)
        return {"train/clip": torch.tensor(clip), "train/noisy_fraction_below_clip": torch.tensor(fraction)}

    def privacy_state_dict(self) -> dict[str, Any]:
        state = super().privacy_state_dict()
        if self.clip_function is not None:
            state["clip"] = self.clip_function.clip  # adaptive clipping: a function of privatized releases
        return state

    def load_privacy_state_dict(self, state: dict[str, Any]) -> None:
        super().load_privacy_state_dict(state)
        if self.clip_function is not None and "clip" in state:
            self.clip_function = ClipFunction(self.clip_function.kind, state["clip"], self.clip_function.r)

    @staticmethod
    def set_gradients(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        """``.grad`` ← the privatized gradient, in each parameter's dtype (noise was added in fp32); a sharded
        parameter's gradient is its shard."""
        for p, g in zip(params, grads):
            p.grad = as_gradient_of(p, g.to(p.dtype))


class DPSGD(FirstOrderModule, shardable=True):
    """DP-SGD (Abadi et al. 2016) with a choice of per-example weight (Bu et al. 2022; Xia et al. 2023, §5).

    Per step on a Poisson batch of expected size b::

        ĝ = ( Σ_i c(‖g_i‖)·g_i + N(0, σ²C²·I_d) ) / b,    then the optimizer steps on ĝ

    with c = min(1, C/s) (``clip_fn="constant"``), C/(s + r) (``"automatic"``, Auto-S/NSGD) or
    C/(s + r/(s + r)) (``"psac"``, DP-PSAC, r = 0.1 by default). All three bound each example's
    contribution by C, so the accounting is DP-SGD's. Normalized by the expected b, never the
    realized batch size (Xia et al. 2023, Algorithm 1, also divide by the fixed input B).

    The default ``per_sample="bk"`` releases this sum without forming any per-example gradient, from one backward
    pass (book-keeping, Bu, Wang, Zha & Karypis 2023, "Differentially Private Optimization on Large Model at Small
    Cost", Alg. 1); ``per_sample="ghost"`` (ghost clipping, Li et al. 2022, "Large Language Models Can Be Strong
    Differentially Private Learners") runs that backward again instead of keeping the book, at about the memory of
    a non-private step.
    """

    def private_step(self, batch: Any, batch_size: int, mechanism: SubsampledGaussian) -> StepResult:
        grads, result = self.private_gradient(batch, batch_size, mechanism)
        self.set_gradients(self.trainable_parameters(), grads)
        return result


@runtime_checkable
class AlphaPlan(Protocol):
    """A callback that sets :class:`Coupling`'s α by the step (:class:`~pl_dp.callbacks.AlphaSchedule`): the first
    step in [``first``, ``last``) at which it would set α = 1, or ``None`` — what a banded Coupling checks at fit
    start (the callbacks import the methods' protocols, never the reverse)."""

    def first_step_at_alpha_one(self, pl_module: Any, first: int, last: int) -> int | None: ...


class Coupling(PublicDataMixin, FirstOrderModule, shardable=True):
    """Coupling of public and private gradients (Liu, Bu, Wang, Zha & Karypis 2023, §3).

        G = α · (1/b′) Σ_j ∇ℓ_j(θ)  +  (1 − α) · (Σ_i c(‖g_i‖) g_i + σR·Z) / b

    written into ``.grad`` for the optimizer. A pl_dp choice: the paper writes both terms as sums
    over one batch size B; per-term means are the same update with η rescaled by B when b′ = b. The
    paper's clipping is automatic with R = γ = 1: ``clip_fn="automatic", clip=1, r=1`` (defaults).

    ``alpha``: a float in [0, 1], or ``"auto"`` for Eq. 5 in its per-term-mean form,
    α = 1 / (1 + b·√(2κ/(b² + σ²d))), computed at fit start from σ, the expected b and d. κ = L·ℒ₀
    (``kappa``) is not observable: tune α once on a reference setting and recover κ with
    :meth:`kappa_from_alpha`, or estimate ℒ₀ as the initial mean loss on public data and L by a
    curvature estimate on public data — never on private data (the paper gives no
    estimator, §4.3). Eq. 5 assumes automatic clipping with γ = R = 1.

    AdaMix (Golatkar et al.) as a configuration: ``alpha=0.5, clip_fn="constant",
    clip_quantile=0.9`` — the threshold follows the 90 % quantile of per-example norms through a
    *privatized* count (see :class:`FirstOrderModule`); the Coupling paper states the 90 % quantile of
    per-sample norms (§3) and elsewhere a quantile of public norms (§6), which is not what AdaMix does
    on private data. Its "adaptive projection" is not reproduced (the paper's §5 does not specify it).

    ``noise="banded"`` correlates the private term's noise across steps (:class:`FirstOrderModule`); mixing in the
    public gradient is post-processing of that release. With bands > 1 every step must read its private batch
    (α < 1): a step that skipped it would break the schedule of releases the band's accounting rests on, so such a
    step is refused.

    Baselines as configurations: OnlyPub (α = 1: the private data is never read and no ε is
    spent), OnlyPriv (α = 0: DP-SGD on private data, no public work), FullPriv (α = 0 with the
    public examples moved into the private set), NonPriv (``privacy=None, clip=None``); DPMD is
    Coupling + :class:`~pl_dp.callbacks.AlphaSchedule`.
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        alpha: float | str = 0.5,
        kappa: float | None = None,
        clip_fn: str = "automatic",
        r: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(net, clip_fn=clip_fn, r=r, **kwargs)
        if alpha == "auto":
            if kappa is None or not kappa > 0:
                raise ConfigError("alpha='auto' needs kappa = L·L0 > 0 (see Coupling.kappa_from_alpha).")
            self._alpha: float | None = None
        else:
            self._alpha = self._check_alpha(alpha)
        self.alpha_policy = alpha
        self.kappa = kappa

    @staticmethod
    def _check_alpha(alpha: Any) -> float:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"alpha must be a number in [0, 1] or 'auto', got {alpha!r}.")
        return float(alpha)

    @property
    def alpha(self) -> float:
        """Current public weight α (settable, e.g. by :class:`~pl_dp.callbacks.AlphaSchedule`)."""
        if self._alpha is None:
            raise RuntimeError("alpha='auto' is resolved at fit start, once sigma is known.")
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha = self._check_alpha(value)

    @staticmethod
    def alpha_from_kappa(kappa: float, batch_size: float, noise_multiplier: float, dim: int) -> float:
        """Eq. 5 (per-term means): α = 1 / (1 + b·√(2κ / (b² + σ²d)))."""
        return 1.0 / (1.0 + batch_size * math.sqrt(2.0 * kappa / (batch_size**2 + noise_multiplier**2 * dim)))

    @staticmethod
    def kappa_from_alpha(alpha: float, batch_size: float, noise_multiplier: float, dim: int) -> float:
        """The inverse of Eq. 5: κ = (1/α − 1)²·(b² + σ²d) / (2b²), to reuse a tuned α elsewhere."""
        return (1.0 / alpha - 1.0) ** 2 * (batch_size**2 + noise_multiplier**2 * dim) / (2.0 * batch_size**2)

    @property
    def touches_private_data(self) -> bool:
        return self._alpha is None or self._alpha < 1.0

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.alpha_policy == "auto":
            dim = sum(p.numel() for p in self.trainable_parameters())
            self._alpha = self.alpha_from_kappa(self.kappa, self.expected_batch_size, self.noise_multiplier, dim)
        if self.privacy is not None and self.bands > 1:
            self._refuse_alpha_one()

    def _refuse_alpha_one(self) -> None:
        """With bands > 1, refuse at fit start — before any ε is spent — an α of 1 this fit would step with: the
        module's own, or a callback's that sets α by the step (:class:`AlphaPlan`, e.g.
        :class:`~pl_dp.callbacks.AlphaSchedule`: its values are a function of the step and its configuration). The
        step itself refuses it too (:meth:`private_step`)."""
        trainer = self.trainer
        first, last = trainer.global_step, max(int(trainer.estimated_stepping_batches), trainer.global_step)
        found = ["the module's alpha is 1"] if self._alpha == 1.0 else []
        for callback in trainer.callbacks:
            step = callback.first_step_at_alpha_one(self, first, last) if isinstance(callback, AlphaPlan) else None
            if step is not None:
                found.append(f"{type(callback).__name__} reaches alpha=1 at step {step}")
        if found:
            raise PrivacyConfigError(
                f"{'; '.join(found)}: alpha=1 skips the private batch, but banded noise with bands={self.bands} must "
                "read it at every step (a step that skipped it would break the schedule its accounting rests on): "
                "keep alpha < 1 (an AlphaSchedule's period, anneal_steps or anneal_factor x planned steps / 2, "
                "beyond the plan), or use noise='independent'."
            )

    def private_step(self, batch: Any, batch_size: int, mechanism: SubsampledGaussian) -> StepResult:
        params, alpha = self.trainable_parameters(), self.alpha
        if alpha == 1.0 and self.bands > 1:
            raise PrivacyConfigError(
                f"alpha=1 skips the private batch, but banded noise with bands={self.bands} releases at every step of "
                "a band (its accounting counts steps, one composition per band): keep alpha < 1 with noise='banded', "
                "or use noise='independent'."
            )
        combined = [torch.zeros_like(local(p)) for p in params]
        result = StepResult({"train/alpha": torch.tensor(alpha)})
        if alpha > 0.0:
            for c, g in zip(combined, self.public_gradient(self.public_batches(1)[0])):
                c.add_(local(g), alpha=alpha)
        if alpha < 1.0:
            private, part = self.private_gradient(batch, batch_size, mechanism)
            for c, g in zip(combined, private):
                c.add_(g, alpha=1.0 - alpha)
            result.metrics.update(part.metrics)
            result.nonfinite = part.nonfinite
        self.set_gradients(params, combined)
        return result


def _plain(value: Any) -> Any:
    """A setting as plain data for the loggers (numbers, strings, booleans, lists of them); None for what is not."""
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, bool | int | float | str) for v in value):
        return list(value)
    return None if value is None else str(value)
