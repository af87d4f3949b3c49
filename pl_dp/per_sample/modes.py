"""The per-sample modes: how a first-order method computes the clipped sum Σ_i c(‖g_i‖)·g_i, one registry entry each.

A mode builds the engine of one fit (:class:`PerSampleEngine`: the clipped sum of a micro-batch, a reset after a
pass that raised, its hooks taken off the net) and says what the method around it must know: whether its passes run
under the trainer's autocast, and whether it runs on a net sharded by FSDP2. ``DPSGD(per_sample=name)`` and
``Coupling(per_sample=name)`` look the name up here; a new mode is one :func:`register_per_sample_mode` call (its
engine, its test in ``tests/per_sample/``, and the modes' list in the docs follow from it).

Every mode releases the same thing: the clipped sum, with the same clip function, noise and accounting. What
differs is how the per-example norms and the weighted sum are computed, and at what memory and time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.per_sample.bk import BookKeeping, ShardedBookKeeping
from pl_dp.per_sample.ghost import GhostClipping, ShardedGhostClipping
from pl_dp.per_sample.gradients import PerSampleGradients
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.step.losses import PerSampleLoss
from pl_dp.step.passes import ShardedPasses


class PerSampleEngine(Protocol):
    """What a first-order method asks of a mode's engine during a fit, and what the fit-start check of its
    per-example gradients reads (:func:`~pl_dp.per_sample.verify_per_example_gradients`)."""

    #: the net, its trainable parameters and their names, and the per-example loss the engine differentiates
    net: nn.Module
    params: list[nn.Parameter]
    names: list[str]
    loss_fn: PerSampleLoss

    def per_example_norms(self, batch: Any) -> torch.Tensor:
        """The per-example gradient norms ‖g_i‖ (fp32) the engine clips by."""
        ...

    def clipped_sum(
        self, batch: Any, clip_fn: ClipFunction, *, rows: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Σ_i c(‖g_i‖)·g_i per trainable parameter (fp32), the per-example norms and the non-finite count."""
        ...

    def reset(self) -> None:
        """Clear what a pass that raised left behind."""
        ...

    def close(self) -> None:
        """Take the engine's hooks off the net."""
        ...


@dataclass(frozen=True)
class PerSampleMode:
    """One way to compute the clipped sum.

    ``build(net, loss_fn, passes)`` returns the fit's engine (``passes``: the sharded step's
    :class:`~pl_dp.step.passes.ShardedPasses`, None unless the net is sharded); ``autocast``: whether the private
    passes run under the trainer's autocast (a mode that computes in fp32 itself says no); ``shards``: whether it
    runs on a net sharded by FSDP2; ``summary``: one line for the docs and the refusal of an unknown name.
    """

    name: str
    build: Callable[[nn.Module, PerSampleLoss, ShardedPasses | None], PerSampleEngine]
    autocast: bool
    shards: bool
    summary: str


_MODES: dict[str, PerSampleMode] = {}


def register_per_sample_mode(mode: PerSampleMode) -> PerSampleMode:
    """Add ``mode`` to the registry; a name is taken once (registering another mode under it raises)."""
    if mode.name in _MODES:
        raise ConfigError(f"a per-sample mode named {mode.name!r} is registered already: {_MODES[mode.name]}.")
    _MODES[mode.name] = mode
    return mode


def get_per_sample_mode(name: str) -> PerSampleMode:
    """The registered mode called ``name``; an unknown name is refused with the list of the known ones."""
    if name not in _MODES:
        known = "; ".join(f"{mode.name!r}: {mode.summary}" for mode in _MODES.values())
        raise ConfigError(f"per_sample must be one of the registered modes, got {name!r}. Known: {known}.")
    return _MODES[name]


def per_sample_mode_names() -> list[str]:
    """The registered modes' names, in registration order."""
    return list(_MODES)


def _per_example_gradients(
    mode: str, net: nn.Module, loss_fn: PerSampleLoss, passes: ShardedPasses | None
) -> PerSampleEngine:
    return PerSampleGradients(net, loss_fn, mode)


def _ghost(net: nn.Module, loss_fn: PerSampleLoss, passes: ShardedPasses | None) -> PerSampleEngine:
    return GhostClipping(net, loss_fn) if passes is None else ShardedGhostClipping(net, loss_fn, passes=passes)


def _bk(net: nn.Module, loss_fn: PerSampleLoss, passes: ShardedPasses | None) -> PerSampleEngine:
    return BookKeeping(net, loss_fn) if passes is None else ShardedBookKeeping(net, loss_fn, passes=passes)


for _name, _summary in (
    ("hooks", "per-example gradients from Opacus' GradSampleModule hooks"),
    ("functorch", "per-example gradients from torch.func.vmap(grad(...)) over single examples"),
):
    register_per_sample_mode(
        PerSampleMode(_name, partial(_per_example_gradients, _name), autocast=True, shards=False, summary=_summary)
    )
register_per_sample_mode(
    PerSampleMode(
        "ghost",
        _ghost,
        autocast=False,
        shards=True,
        summary="ghost clipping (Li et al. 2022): per-example norms, then one weighted backward; fp32, FSDP2",
    )
)
register_per_sample_mode(
    PerSampleMode(
        "bk",
        _bk,
        autocast=False,
        shards=True,
        summary="book-keeping (Bu et al. 2023): ghost clipping's norms, the clipped sum from the same backward; fp32, "
        "FSDP2",
    )
)
