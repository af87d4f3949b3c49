"""DPZero: private zeroth-order optimization with two-point scalar queries (Zhang et al. 2024)."""

from __future__ import annotations

from typing import Any

from pl_dp.methods.base import StepResult
from pl_dp.methods.zeroth_order import ZerothOrderModule
from pl_dp.privacy.mechanisms import SubsampledGaussian


class DPZero(ZerothOrderModule, shardable=True):
    """DPZero (Zhang et al. 2024) as written by Gong & Li 2025 (Eq. 2; q queries as in §3.1).

    Per step, on one Poisson batch B with expected size b, for j = 1..q::

        s_j = ( Σ_{i∈B} clip_C([f(θ+λu_j; ξ_i) − f(θ−λu_j; ξ_i)] / (2λ)) + N(0, q·C²σ²) ) / b
        θ ← θ − (η/q) · Σ_j s_j u_j

    with u_j ~ N(0, I_d) (``direction="gaussian"``, the papers' experiments) or uniform on
    √d·S^{d−1} (``"sphere"``). Privacy: the q scalars are the only releases; together they are one
    subsampled Gaussian mechanism with multiplier σ (the accountant never sees √q·σ).

    Cost: 2q forward passes, no backward, memory of inference plus one parameter-sized buffer
    (the largest tensor); three parameter sweeps per query.
    """

    def private_step(self, batch: Any, batch_size: int, mechanism: SubsampledGaussian) -> StepResult:
        estimate = self.zeroth_order_estimate(batch, batch_size, mechanism)
        self.estimator.apply(estimate, self.lr / self.queries, extra=self.proximal_terms())
        return StepResult({"train/noisy_directional_derivative": estimate.scalars.abs().mean()}, estimate.nonfinite)
