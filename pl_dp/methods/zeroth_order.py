"""Shared plumbing of the zeroth-order methods: engine, estimator, direction seed, hyperparameters.

The math of each method lives in its own module (``dpzero.py``, ``pazo.py``); this class only
wires :mod:`pl_dp.zo`'s two-point estimator into :class:`~pl_dp.methods.own_update.OwnUpdateModule` (the family
of methods that write their update themselves: fp32 masters, plain SGD, the proximal term).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pl_dp.methods.own_update import OwnUpdateModule
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.step.validation import check_positive, positive_integer
from pl_dp.zo.engine import Direction, PerturbationEngine
from pl_dp.zo.estimator import PrivateTwoPointEstimator, ZerothOrderEstimate
from pl_dp.zo.mask import DirectionMask


class ZerothOrderModule(OwnUpdateModule[SubsampledGaussian]):
    """A private method that queries the private batch only through two-point loss differences.

    Args (beyond :class:`~pl_dp.methods.own_update.OwnUpdateModule`):
        clip: C, the bound each example's scalar finite difference is clamped to. Required for
            private runs; ``None`` (no clipping) only without privacy.
        smoothing: λ, the finite-difference radius.
        queries: q, directions per step (each a private release; noise std √q·σ·C per query).
        direction: ``"gaussian"`` (default, as in the papers' experiments), ``"sphere"``, or one of
            ``"rademacher"`` (±1 per coordinate) and ``"lowrank"`` (a·bᵀ per matrix), which cost a
            fraction of a Gaussian's random numbers on a CPU (on an H200 Rademacher steps were 1.07-1.5×
            slower than Gaussian ones: docs/performance.md); see :class:`~pl_dp.zo.engine.Direction`.
        radius: sphere radius (or matching Gaussian second moment); ``None`` means the method's
            default (√d for DPZero).
        joint_clip: L2-clip each example's q-vector of differences to C and add one q-dimensional
            Gaussian (std σ·C per coordinate) instead of q scalar clamps with std √q·σ·C each —
            same privacy, less noise; off by default (the papers clip each scalar).
        cache_directions: keep the step's q directions after their first draw (one draw per query
            instead of three) at one copy of the trained parameters per direction; ``None`` (default)
            keeps as many as fit in 256 MiB (:data:`~pl_dp.zo.engine.CACHE_BUDGET_BYTES`).
        one_sided: difference f(θ + λu_j) against one shared f(θ) — q + 1 forwards instead of 2q,
            same privacy, more variance per query (see :class:`~pl_dp.zo.PrivateTwoPointEstimator`).

    The directions are seeded from ``torch.initial_seed()`` (so ``seed_everything`` makes them
    reproducible) and a step counter; they never share a generator with the DP noise. The q noisy
    scalars of a step are drawn from the cryptographic generator by default (``secure_rng``).
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        clip: float | None = 1.0,
        smoothing: float = 1e-3,
        queries: int = 1,
        direction: str = "gaussian",
        radius: float | None = None,
        joint_clip: bool = False,
        cache_directions: bool | None = None,
        one_sided: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(net, **kwargs)
        check_positive("clip", clip, allow_none=self.privacy is None)
        check_positive("smoothing", smoothing)
        self.clip = None if clip is None else float(clip)
        self.queries = positive_integer("queries", queries)
        self.joint_clip = bool(joint_clip)
        self.cache_directions = cache_directions
        self.one_sided = bool(one_sided)
        self._smoothing = float(smoothing)
        self._direction = Direction(direction, radius)
        self._estimator: PrivateTwoPointEstimator | None = None
        self.direction_mask: DirectionMask | None = None

    @property
    def smoothing(self) -> float:
        """λ; settable (schedules change it between steps)."""
        return self._smoothing

    @smoothing.setter
    def smoothing(self, value: float) -> None:
        check_positive("smoothing", value)
        self._smoothing = float(value)
        if self._estimator is not None:
            self._estimator.smoothing = float(value)

    def default_radius(self, dim: int) -> float | None:
        """The method's direction radius when the user gives none (None: √d)."""
        return None

    def set_direction_mask(self, mask: DirectionMask | None) -> None:
        """Confine perturbation and update to ``mask``'s coordinates (set by PruningSchedule; None: all).

        The engine is rebuilt with the mask before the next step; d (and a default radius that
        depends on it) becomes the number of trained coordinates. The mask is data-independent
        (or a function of past DP outputs), so it needs no accounting.
        """
        self.direction_mask = mask
        self._estimator = None

    def build_engine(self, params: list[nn.Parameter]) -> PerturbationEngine:
        """The perturbation engine of this method (PAZO-P overrides it with a subspace engine)."""
        mask = self.direction_mask
        direction = self._direction
        if direction.radius is None:
            dim = mask.trained if mask is not None else sum(p.numel() for p in params)
            direction = Direction(direction.kind, self.default_radius(dim))
        return PerturbationEngine(params, self.direction_seed, direction, mask=mask, **self.engine_arguments())

    def engine_arguments(self) -> dict[str, Any]:
        """How the engine keeps directions (the user's ``cache_directions``, for the step's q directions) and
        where it keeps the fp32 masters of half-precision parameters (this module's store: they outlive the
        engine, which is rebuilt at every fit start and mask change)."""
        return {"cache_directions": self.cache_directions, "cache_size": self.queries, "masters": self.masters}

    @property
    def estimator(self) -> PrivateTwoPointEstimator:
        if self._estimator is None or self._estimator.engine.moved():
            engine = self.build_engine(self.trainable_parameters())
            self._estimator = PrivateTwoPointEstimator(
                engine, self._smoothing, self.queries, self.joint_clip, self.one_sided
            )
        return self._estimator

    def master_parameters(self) -> list[torch.Tensor]:
        return self.estimator.engine.weights

    def on_train_start(self) -> None:
        super().on_train_start()
        self._estimator = None  # rebuilt on the parameters as they are now (freezing, device and dtype moves)

    def mechanism(self, batch_size: int) -> SubsampledGaussian:
        """q scalar releases per step, each with per-example sensitivity C (Gong & Li 2025, §3.4);
        with ``joint_clip``, one q-vector release with per-example L2 sensitivity C."""
        return self._gaussian(batch_size, self.clip, releases=1 if self.joint_clip else self.queries)

    def zeroth_order_estimate(self, batch: Any, batch_size: int, mechanism: SubsampledGaussian) -> ZerothOrderEstimate:
        """Privatized q-query two-point estimate at the current parameters (θ left at θ − λu_q)."""
        evaluate = self.private_losses(batch, batch_size)
        reduce = self.distribution.sum_reducer
        return self.estimator.estimate(self.private_steps, evaluate, mechanism, self.noise, reduce)

    def load_privacy_state_dict(self, state: dict[str, Any]) -> None:
        super().load_privacy_state_dict(state)
        self._estimator = None
