"""The methods that write their update themselves: zeroth-order (DPZero, PAZO-M/P), PAZO-S and O2NC.

They release a few noisy scalars or small vectors a step and move the parameters through a perturbation engine,
never through ``.grad``; what that implies lives here, once:

* the optimizer holds η only, so only plain SGD is accepted (:func:`refuse_unless_plain_sgd`);
* half-precision parameters are trained through fp32 masters (:mod:`pl_dp.zo.master`), which the model's state dict
  holds beside the weights, in every layout (the ``master_weights`` submodule's extra state);
* a :class:`~pl_dp.callbacks.StagewiseSchedule`'s proximal term enters the update (:meth:`proximal_terms`) of the
  methods that declare ``applies_proximal_term``; the schedule refuses a term for any other method;
* private losses are evaluated in eval and inference mode (:meth:`private_losses`), and the noise comes from the
  cryptographic generator by default (cheap for a few scalars).

First-order methods (:class:`~pl_dp.methods.first_order.FirstOrderModule`) hand a privatized gradient to any
optimizer instead and share none of this.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.methods.base import MechanismT, PrivateModule
from pl_dp.privacy.clip_functions import clip_per_example
from pl_dp.privacy.seeding import SeedDomain, derive_seed
from pl_dp.step.batches import batch_size_of
from pl_dp.step.independence import TWO_POINT_SHAPES, Release
from pl_dp.zo.engine import Direction, PerturbationEngine
from pl_dp.zo.estimator import clipped_differences, per_sample_evaluator
from pl_dp.zo.master import MasterWeights, MasterWeightsState

#: the checkpoint entry where pl_dp 0.2 kept the fp32 masters of a one-process run's half-precision parameters,
#: before they were the model's extra state in every layout; read when such a checkpoint is resumed
MASTER_WEIGHTS_KEY = "pl_dp_master_weights"
#: random directions along which the fit-start probe compares a step's release (:meth:`OwnUpdateModule.probe_release`)
PROBE_DIRECTIONS = 3


def refuse_unless_plain_sgd(module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` is ``torch.optim.SGD`` without momentum, weight decay or Nesterov.

    For methods that write their update themselves (zeroth-order, O2NC): the optimizer holds η only.
    """
    plain = isinstance(optimizer, torch.optim.SGD) and all(
        not group.get("momentum") and not group.get("weight_decay") and not group.get("nesterov")
        for group in optimizer.param_groups
    )
    if not plain:
        raise ConfigError(
            f"{type(module).__name__} applies its own update (it writes no gradient for an optimizer), so it "
            "accepts only torch.optim.SGD without momentum, weight decay or Nesterov, which holds the step size "
            f"for LR schedulers; got {type(optimizer).__name__} with {optimizer.defaults}. Remove --optimizer "
            "(or configure_optimizers' override), or use a first-order method (DPSGD, Coupling) for Adam-style "
            "updates on the privatized gradient."
        )


class OwnUpdateModule(PrivateModule[MechanismT]):
    """A private method that writes its update itself, through a perturbation engine (no ``.grad``, no optimizer step).

    Args (beyond :class:`~pl_dp.methods.base.PrivateModule`):
        master_weights: train bf16/fp16 parameters through fp32 master copies (default): restores are exact,
            updates below a bf16 ulp accumulate, and the parameters are always the rounding of the masters
            (:mod:`pl_dp.zo.master`); a checkpoint holds the masters too. Costs 4 bytes per trained
            half-precision coordinate; ``False`` perturbs and updates them in place (MeZO's way), for models whose
            masters do not fit in memory. No effect on fp32 parameters, which are always written in place.

    A subclass builds its engine with ``masters=self.masters`` (the store outlives the engines, which are rebuilt at
    every fit start and mask change) and returns the engine's weights from :meth:`master_parameters`.
    """

    #: a few noisy scalars or small vectors a step: the cryptographic generator costs microseconds
    secure_rng_default = True
    #: whether the update includes a StagewiseSchedule's proximal term (:meth:`proximal_terms`); a schedule with
    #: one refuses a method that does not (its term would be dropped silently)
    applies_proximal_term: bool = True
    private_loss_modes = ("eval",)  # private_losses
    #: whether a step releases clipped per-example losses (PAZO-S) rather than two-point differences
    releases_losses: bool = False

    @property
    def one_length_reason(self) -> tuple[str, str] | None:
        """In fp32 too, for a private two-point step (it divides a loss difference by 2λ): its view of a loss is
        quantized to one ulp, so a dependence on the padded length below that resolution along the fit-start probe's
        directions can exceed it along a step's — the probe cannot bound it, one length removes it (see
        :mod:`pl_dp.methods.precision`)."""
        reason = super().one_length_reason
        if reason is None and self.privacy is not None and not self.releases_losses:
            return TWO_POINT_SHAPES
        return reason

    def __init__(self, net: nn.Module, *, master_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(net, **kwargs)
        # fp32 masters of half-precision parameters, written by the method's engine
        self.masters = MasterWeights(enabled=master_weights)
        self.master_weights = MasterWeightsState(self.masters, self.named_parameters)  # in the state dict
        self.register_load_state_dict_pre_hook(self._take_earlier_masters)
        self.proximal: Any = None  # a ProximalAnchor while a StagewiseSchedule holds one

    # ---- the step -------------------------------------------------------------------------------
    def private_losses(self, batch: Any, batch_size: int) -> Callable[[], torch.Tensor]:
        """A closure giving the fp32 per-example losses of the private ``batch`` at the current parameters (eval mode,
        inference mode, micro-batched by ``max_physical_batch_size``). In a private run an example whose loss raises
        gets NaN — it contributes 0, counted — instead of ending the run at the step that sampled it
        (:func:`~pl_dp.step.seal.isolate_failures`; sharded, by passes every rank runs:
        :func:`~pl_dp.zo.estimator.per_sample_evaluator`)."""
        return per_sample_evaluator(
            self.net,
            self.loss_fn,
            batch,
            batch_size,
            self.max_physical_batch_size,
            isolate=self.privacy is not None,
            sharded=self.distribution.passes,  # forwards are collectives: every rank runs as many
            rows=self.physical_rows,  # a run in half precision: every forward of one shape (methods.precision)
        )

    def probe_release(self) -> Release | None:
        """What a step releases of each example, as the fit-start probe compares it (:class:`~pl_dp.privacy.
        independence.Release`), in units of C: by default its two-point difference [f(θ+λu) − f(θ−λu)]/(2λ) clipped
        to C (λ = ``smoothing``), along :data:`PROBE_DIRECTIONS` Gaussian directions over every trained coordinate —
        not only a mask's or a subspace's, which change during training — through :meth:`private_losses` (the
        step's micro-batches, in the precision context the probe enters). Methods that release clipped losses
        (PAZO-S) set ``releases_losses``. θ is left bit for bit as it was (restored by the engine, then from a copy
        of the trained parameters: one copy, at fit start)."""
        clip = getattr(self, "clip", None)
        if self.privacy is None or clip is None:
            return None
        if self.releases_losses:

            def losses(batch: Any, keep: torch.Tensor) -> torch.Tensor:
                values = self.private_losses(batch, batch_size_of(batch))()
                return clip_per_example(values, clip)[0][keep.to(values.device)].reshape(-1, 1) / clip

            return Release(losses, "the clipped losses a step releases", per_example=True)
        params = self.trainable_parameters()
        direction = Direction("gaussian", math.sqrt(sum(p.numel() for p in params)))
        seed = derive_seed(self.direction_seed, SeedDomain.PROBE_DIRECTIONS)

        def differences(batch: Any, keep: torch.Tensor) -> torch.Tensor:
            saved = [p.detach().clone() for p in params]
            try:
                engine = PerturbationEngine(params, seed, direction, masters=self.masters)
                evaluate = self.private_losses(batch, batch_size_of(batch))
                keys = [(0, j) for j in range(PROBE_DIRECTIONS)]
                values = clipped_differences(engine, keys, self.smoothing, evaluate, clip)
            finally:
                with torch.no_grad():
                    for p, s in zip(params, saved):
                        p.copy_(s)
            return values[keep.to(values.device)] / clip

        return Release(differences, "the clipped two-point differences a step releases", per_example=True)

    def on_train_start(self) -> None:
        refuse_unless_plain_sgd(self, self.optimizers(use_pl_optimizer=False))
        if self.net_configure_optimizers() is not None:
            rank_zero_warn(
                f"{type(self).__name__} writes its update itself: the net's own configure_optimizers is not "
                f"used. Plain SGD holds the step size (lr={self.lr:g}). DPSGD and Coupling use the net's "
                "optimizer."
            )
        super().on_train_start()

    # ---- the proximal term of a StagewiseSchedule ------------------------------------------------
    @property
    def proximal_anchor(self) -> list[torch.Tensor] | None:
        """The anchor θ^{s−1} of the current stage's proximal term, if a schedule set one."""
        return None if self.proximal is None else self.proximal.anchor

    def proximal_terms(self) -> list[tuple[list[torch.Tensor], float]]:
        """The proximal gradient step as dense ``extra`` terms for a fused engine sweep ([] without one)."""
        return [] if self.proximal is None else self.proximal.terms(self.lr, self.master_parameters())

    # ---- checkpointing: the masters beside the weights -----------------------------------------
    @staticmethod
    def _take_earlier_masters(module: OwnUpdateModule, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A state dict of pl_dp 0.2 has no masters (a one-process run's are in the checkpoint's
        :data:`MASTER_WEIGHTS_KEY`, offered by :meth:`on_load_checkpoint`): it loads strictly all the same."""
        state_dict.setdefault(f"{prefix}master_weights._extra_state", {})

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        # a one-process checkpoint of pl_dp 0.2 holds its masters here; taken by the next engine, each one only if
        # the loaded weight is still its rounding
        self.masters.load_state_dict(checkpoint.get(MASTER_WEIGHTS_KEY, {}), self.named_parameters())
