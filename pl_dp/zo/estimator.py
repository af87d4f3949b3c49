"""The privatized q-query two-point estimator (PAZO spec §1.2–1.3), shared by DPZero, PAZO-M and PAZO-P.

For each query j (same private batch, fresh direction u_j, fresh noise):

    s_j = ( Σ_i clip_C(Δ_i(u_j)) + N(0, q·σ²·C²) ) / b,   Δ_i = [f(θ+λu_j; ξ_i) − f(θ−λu_j; ξ_i)] / (2λ)

and the update is θ ← θ − c · Σ_j s_j u_j (+ whatever the method adds), with b the *expected*
batch size. The q scalars are the only private releases; their mechanism is declared by the
caller (a :class:`~pl_dp.privacy.SubsampledGaussian` with ``releases=q``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pl_dp.privacy.clipping import clip_scalars
from pl_dp.privacy.losses import PerSampleLoss, check_per_sample
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.privacy.noise import NoiseSource
from pl_dp.zo.engine import Key, PerturbationEngine

Reduce = Callable[[torch.Tensor], torch.Tensor]


@contextmanager
def eval_mode(net: nn.Module):
    """Dropout off for the ± passes (the MeZO convention): both passes must see the same function."""
    was_training = net.training
    net.eval()
    try:
        yield
    finally:
        net.train(was_training)


def per_sample_evaluator(
    net: nn.Module, loss_fn: PerSampleLoss, batch: Any, batch_size: int
) -> Callable[[], torch.Tensor]:
    """A closure returning the fp32 per-example losses of ``batch`` under inference mode, eval mode."""

    def evaluate() -> torch.Tensor:
        if batch_size == 0:
            return torch.zeros(0)
        with eval_mode(net), torch.inference_mode():
            return check_per_sample(loss_fn(net, batch), batch_size)

    return evaluate


def privatize_sum(
    values: torch.Tensor,
    clip: float | None,
    mechanism: SubsampledGaussian,
    noise: NoiseSource,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One private scalar release: (Σ_i clip_C(values_i) + N(0, noise_std²)) / expected batch size.

    Non-finite values contribute 0 and are counted. ``reduce`` sums the clipped sum and the
    count across data-parallel ranks before the noise is added (once). Returns the privatized
    scalar (shape [1]) and the non-finite count.
    """
    clipped, bad = clip_scalars(values, clip)
    packed = torch.stack([clipped.sum(), bad.float()]).cpu()
    if reduce is not None:
        packed = reduce(packed)
    return mechanism.privatize(packed[:1], noise), packed[1]


@dataclass
class ZerothOrderEstimate:
    """The privatized scalars of one step, their directions, and what the caller still owes."""

    keys: list[Key]
    scalars: torch.Tensor  # [q], privatized: (clipped sum + noise) / expected batch size
    nonfinite: torch.Tensor  # 0-dim count of per-example differences replaced by 0
    pending_restore: float  # the parameters sit at θ − pending_restore·u(keys[-1])


class PrivateTwoPointEstimator:
    """Runs the q queries of one step with a :class:`PerturbationEngine` and privatizes them."""

    def __init__(self, engine: PerturbationEngine, smoothing: float, clip: float | None, queries: int = 1) -> None:
        if not smoothing > 0:
            raise ValueError(f"smoothing must be > 0, got {smoothing}.")
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be > 0, got {clip}.")
        if int(queries) != queries or queries < 1:
            raise ValueError(f"queries must be an integer >= 1, got {queries}.")
        self.engine = engine
        self.smoothing = float(smoothing)
        self.clip = clip
        self.queries = int(queries)

    def estimate(
        self,
        step: int,
        evaluate: Callable[[], torch.Tensor],
        mechanism: SubsampledGaussian,
        noise: NoiseSource,
        reduce: Reduce | None = None,
    ) -> ZerothOrderEstimate:
        """Query the private batch ``queries`` times at the current θ and privatize each scalar.

        ``reduce`` sums a small tensor across data-parallel ranks (identity when None); only the
        clipped sums and non-finite counts cross it — never per-example values.
        """
        keys: list[Key] = []
        scalars = []
        nonfinite = torch.zeros((), dtype=torch.float32)
        for j in range(self.queries):
            key = (step, j)
            diffs = self.engine.two_point(key, self.smoothing, evaluate)
            scalar, bad = privatize_sum(diffs, self.clip, mechanism, noise, reduce)
            scalars.append(scalar)
            nonfinite = nonfinite + bad
            keys.append(key)
            if j < self.queries - 1:
                self.engine.perturb(key, self.smoothing)  # restore before the next direction
        return ZerothOrderEstimate(keys, torch.cat(scalars), nonfinite, self.smoothing)

    def apply(
        self,
        estimate: ZerothOrderEstimate,
        step_size: float,
        extra: Sequence[tuple[Sequence[torch.Tensor | None], float]] = (),
    ) -> None:
        """θ ← θ − step_size · Σ_j s_j u_j (+ ``extra``), fused with the pending restore.

        One host sync (the q scalars), one sweep over the parameters.
        """
        coeffs = [-step_size * s for s in estimate.scalars.tolist()]
        coeffs[-1] += estimate.pending_restore
        self.engine.combine(list(zip(estimate.keys, coeffs)), extra)
