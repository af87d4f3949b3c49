"""PruningSchedule: DP-ZOPO's data-free pruning (Liu et al., NDSS 2025, §IV-D, Algorithms 3–5) as a callback.

At the start of a stage the callback scores every trainable coordinate with the path-norm
saliency ∇ℒ(|θ|) ⊙ |θ| (no data: only the shape of one public/validation example, or
``input_shape``), builds the Importance Matrix for that stage's rate, and hands it to the module
(``set_direction_mask``): from then on both the perturbation and the update touch only the
trained coordinates. Stages come from a :class:`~pl_dp.callbacks.StagewiseSchedule` in the same
Trainer (DP-ZOPO = DP-ZOSO + pruning); without one the run is a single stage.

Privacy: the mask is computed from the current parameters (a DP output) and constants only, so it
is post-processing and costs no budget (Theorem 3); it never reads the private data.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import lightning as L
import torch

from pl_dp.callbacks.protocol import PrivacyCallback, PrivateModuleLike
from pl_dp.callbacks.stagewise import StagewiseSchedule
from pl_dp.errors import ConfigError
from pl_dp.privacy.seeding import SeedDomain, derive_seed
from pl_dp.step.losses import split_inputs_targets
from pl_dp.zo.mask import DirectionMask
from pl_dp.zo.pruning import importance_matrix, path_norm_scores

_STRATEGIES = ("static", "dynamic", "incremental")


class MaskedModule(PrivateModuleLike, Protocol):
    """A zeroth-order method with coordinate masks (DPZero, PAZO-M)."""

    net: torch.nn.Module
    direction_seed: int

    def set_direction_mask(self, mask: DirectionMask | None) -> None: ...

    def whole_net(self) -> tuple[torch.nn.Module, dict[str, torch.Tensor] | None]: ...


class PruningSchedule(PrivacyCallback):
    """DP-ZOPO's masked directions for DPZero and PAZO-M (any module with ``set_direction_mask``).

    Args:
        rates: the fraction of coordinates **trained** per stage (the paper's "pruning rate" r;
            1.0 = no pruning): one float for every stage, or one per stage (e.g. [0.01, 0.02, 0.04]).
        strategy: ``"static"`` (one mask from θ⁰, one rate), ``"dynamic"`` (a fresh mask from θ^{s−1}
            at each stage start), ``"incremental"`` (dynamic, but every previously trained coordinate
            stays trained; rates must not decrease).
        importance: ``"pruning"`` (M_ii = 1 on the trained set) or ``"rank"`` (M_ii from A down to B
            by score rank, a std multiplier of the direction).
        bounds: (A, B) for ``importance="rank"`` (the released code's 1.2 / 0.8).
        score: ``"zo"`` (Algorithm 3's zeroth-order estimate of ∇ℒ) or ``"autograd"`` (exact; data-free
            too, a pl_dp deviation from the paper).
        score_queries: P for the ZO score (the released code uses 1, which makes the score nearly
            random; a warning says so below 4).
        score_smoothing: β of the ZO score (the released code's 1e-3).
        input_shape: shape of the constant all-ones input, batch dimension included, for models that
            set no ``example_input_array`` and datamodules without a public, validation or test set.
    """

    requires = ("set_direction_mask", "whole_net")
    requires_description = "a zeroth-order pl_dp method with coordinate masks (DPZero, PAZO-M)"

    def __init__(
        self,
        rates: float | Sequence[float] = 0.1,
        strategy: str = "static",
        importance: str = "pruning",
        bounds: tuple[float, float] = (1.2, 0.8),
        score: str = "zo",
        score_queries: int = 8,
        score_smoothing: float = 1e-3,
        input_shape: Sequence[int] | None = None,
    ) -> None:
        if strategy not in _STRATEGIES:
            raise ConfigError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}.")
        rate_list = [float(rates)] if isinstance(rates, (int, float)) else [float(r) for r in rates]
        if not rate_list or not all(0.0 < r <= 1.0 for r in rate_list):
            raise ConfigError(f"rates (fractions of coordinates trained) must lie in (0, 1], got {rates!r}.")
        if strategy == "static" and len(set(rate_list)) > 1:
            raise ConfigError("the static strategy prunes once with one rate; give a single float.")
        if strategy == "incremental" and any(b < a for a, b in zip(rate_list, rate_list[1:])):
            raise ConfigError(f"incremental pruning keeps earlier coordinates, so rates must not decrease: {rates!r}.")
        if importance not in ("pruning", "rank"):
            raise ConfigError(f"importance must be 'pruning' or 'rank', got {importance!r}.")
        if score not in ("zo", "autograd"):
            raise ConfigError(f"score must be 'zo' or 'autograd', got {score!r}.")
        if score == "zo" and score_queries < 4:
            warnings.warn(
                f"score_queries={score_queries}: a zeroth-order path-norm score from so few directions is mostly "
                "noise; the released DP-ZOPO code uses 1. Consider more queries or score='autograd'.",
                stacklevel=2,
            )
        self.rates = rate_list
        self.strategy = strategy
        self.importance = importance
        self.bounds = (float(bounds[0]), float(bounds[1]))
        self.score = score
        self.score_queries = int(score_queries)
        self.score_smoothing = float(score_smoothing)
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.stage = -1
        self.mask: DirectionMask | None = None

    # ---- stages ------------------------------------------------------------------------------
    @staticmethod
    def _stagewise(trainer: L.Trainer) -> StagewiseSchedule | None:
        return next((c for c in trainer.callbacks if isinstance(c, StagewiseSchedule)), None)

    def rate(self, stage: int) -> float:
        """r_s, the fraction trained in ``stage``."""
        return self.rates[0] if len(self.rates) == 1 else self.rates[stage]

    def _current_stage(self, trainer: L.Trainer) -> int:
        stagewise = self._stagewise(trainer)
        return 0 if stagewise is None else stagewise.stage_of(trainer.global_step)

    # ---- the score input (shapes only, never private data) ----------------------------------
    def example_input(self, trainer: L.Trainer, pl_module: MaskedModule) -> Any:
        if self.input_shape is not None:
            return torch.ones(self.input_shape, device=pl_module.device)
        example = getattr(pl_module, "example_input_array", None)
        if example is not None:
            return example
        dm = getattr(trainer, "datamodule", None)
        for name in ("public", "val", "test"):
            dataset = getattr(dm, name, None)
            if dataset is not None and len(dataset) > 0:
                inputs, _ = split_inputs_targets(dataset[0])
                if isinstance(inputs, Mapping):
                    return {k: torch.as_tensor(v, device=pl_module.device).unsqueeze(0) for k, v in inputs.items()}
                return torch.as_tensor(inputs, device=pl_module.device).unsqueeze(0)
        raise ConfigError(
            "PruningSchedule needs the input shape for its data-free score: set input_shape, the module's "
            "example_input_array, or give the datamodule a public, val or test set (the private set is never read)."
        )

    def compute_mask(self, trainer: L.Trainer, pl_module: MaskedModule, stage: int) -> DirectionMask:
        """Algorithms 3–4 for ``stage`` at the current parameters (on a sharded net: its whole parameters, gathered on
        every rank for the score, and rank 0's mask on every rank)."""
        net, state = pl_module.whole_net()
        scores = path_norm_scores(
            net,
            self.example_input(trainer, pl_module),
            estimator=self.score,
            queries=self.score_queries,
            smoothing=self.score_smoothing,
            seed=derive_seed(pl_module.direction_seed, SeedDomain.PRUNING_STAGE, stage),
            state=state,
        )
        previous = self.mask if self.strategy == "incremental" else None
        if previous is not None and round(self.rate(stage) * sum(previous.numels)) <= previous.trained:
            warnings.warn(
                f"stage {stage}: rate {self.rate(stage)} adds no coordinate to the {previous.trained} already trained; "
                "the mask is kept.",
                stacklevel=2,
            )
        mask = importance_matrix(scores, self.rate(stage), self.importance, self.bounds, previous)
        # the same on every rank in exact arithmetic; rank 0's, so that no rounding of another device's sums differs
        return trainer.strategy.broadcast(mask, src=0) if state is not None else mask

    # ---- hooks -------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: MaskedModule) -> None:
        stagewise = self._stagewise(trainer)
        stages = 1 if stagewise is None else stagewise.stages
        if len(self.rates) not in (1, stages):
            raise ConfigError(f"{len(self.rates)} pruning rates for {stages} stage(s): give one rate or one per stage.")
        if self.mask is not None:  # resumed: the mask of the stage in progress, exactly
            pl_module.set_direction_mask(self.mask.to(pl_module.device))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: MaskedModule, batch: Any, batch_idx: int) -> None:
        stage = self._current_stage(trainer)
        if stage == self.stage:
            return
        if self.mask is None or self.strategy != "static":
            self.mask = self.compute_mask(trainer, pl_module, stage)
            pl_module.set_direction_mask(self.mask)
        self.stage = stage
        pl_module.log("pruning/trained_fraction", self.mask.fraction, on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "mask": None if self.mask is None else self.mask.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stage = state_dict["stage"]
        self.mask = None if state_dict["mask"] is None else DirectionMask.from_state_dict(state_dict["mask"])
