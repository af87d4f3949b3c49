"""The privatized q-query two-point estimator, shared by DPZero, PAZO-M and PAZO-P.

DPZero's estimator as written by Gong & Li 2025 (Eq. 2), with q queries as in their Algorithms 1–2
(noise variance q·C²σ² per query, the same privacy per step for any q, §3.4).

For each query j (same private batch, fresh direction u_j, fresh noise):

    s_j = ( Σ_i clip_C(Δ_i(u_j)) + N(0, q·σ²·C²) ) / b,   Δ_i = [f(θ+λu_j; ξ_i) − f(θ−λu_j; ξ_i)] / (2λ)

or, one-sided, Δ_i = [f(θ+λu_j; ξ_i) − f(θ; ξ_i)] / λ with f(θ) evaluated once for all q queries
(ZO-Bench's ``one_side``, Zhang et al. 2024): q + 1 forwards instead of 2q.

and the update is θ ← θ − c · Σ_j s_j u_j (+ whatever the method adds), with b the *expected*
batch size. The q scalars are the only private releases; their mechanism is declared by the
caller (a :class:`~pl_dp.privacy.SubsampledGaussian` with ``releases=q``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.privacy.clip_functions import clip_per_example
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.privacy.noise import NoiseSource
from pl_dp.step.batches import batch_size_of, device_of, fill_rows, select_examples, split_batch
from pl_dp.step.losses import PerSampleLoss, check_per_sample
from pl_dp.step.passes import ShardedPasses
from pl_dp.step.seal import isolate_failures
from pl_dp.zo.engine import Key, PerturbationEngine

Reduce = Callable[[torch.Tensor], torch.Tensor]


@contextmanager
def eval_mode(net: nn.Module) -> Iterator[None]:
    """Dropout off for the ± passes (the MeZO convention): both passes must see the same function."""
    was_training = net.training
    net.eval()
    try:
        yield
    finally:
        net.train(was_training)


def per_sample_evaluator(
    net: nn.Module,
    loss_fn: PerSampleLoss,
    batch: Any,
    batch_size: int,
    max_physical_batch_size: int | None = None,
    isolate: bool = False,
    sharded: ShardedPasses | None = None,
    rows: int | None = None,
) -> Callable[[], torch.Tensor]:
    """A closure returning the fp32 per-example losses of ``batch`` under inference mode, eval mode.

    With ``max_physical_batch_size`` the forward passes run micro-batch by micro-batch and the losses
    are concatenated: memory is bounded by the physical batch, the released sums are the same. With ``rows`` (a run
    whose private batches keep one shape: half precision) every forward runs exactly ``rows`` rows: the batch is cut
    into micro-batches of ``rows`` examples and each is filled to ``rows`` rows (:func:`~pl_dp.step.batches.
    fill_rows`; the filling rows' losses are dropped), so no example's rounding depends on how many were sampled.
    With ``isolate`` (private runs), an example whose loss raises gets a NaN loss instead of ending the step
    (:func:`~pl_dp.step.seal.isolate_failures`): every difference it enters is non-finite, so it contributes 0 to
    the release and is counted with the other non-finite values.

    ``sharded`` (a net sharded by FSDP2: :class:`~pl_dp.step.passes.ShardedPasses`): a sharded net's forward is a
    collective (FSDP all-gathers each layer), which every rank must run as often as the others, whatever its share
    of the Poisson batch. As many passes run as the most any rank needs (agreed when the closure is made): the
    micro-batches, then the padding example (fixed and not private, whose losses are dropped; a net may not run an
    empty batch). Then the examples of micro-batches whose loss raised are run one by one, as many passes on every
    rank as the most any rank needs, and each that raises again gets NaN. Each pass runs in the passes' guard, so
    that a forward that raises between two layers' all-gathers on one rank still issues the rest of them.
    """
    micro_batches = split_batch(batch, rows or max_physical_batch_size) if batch_size else []
    real = len(micro_batches)
    if sharded is not None:
        micro_batches += [sharded.padding] * (sharded.passes(real) - real)

    def losses_of(part: Any) -> torch.Tensor:
        size = batch_size_of(part)
        if rows is None or size >= rows:
            return check_per_sample(loss_fn(net, part), size)
        return check_per_sample(loss_fn(net, fill_rows(part, rows)), rows)[:size]

    def isolated(part: Any) -> torch.Tensor:
        done, failed = isolate_failures(losses_of, part)
        if not failed:
            return done[0][1]
        losses = torch.full((batch_size_of(part),), math.nan, device=device_of(part))
        for positions, values in done:
            losses[positions.to(losses.device)] = values.to(losses.device)
        return losses

    def or_none(part: Any, passes: ShardedPasses) -> torch.Tensor | None:
        try:
            with passes.guard():
                return losses_of(part)
        except Exception:  # noqa: BLE001 - any failure of one record must stay inside the step
            return None

    def collectively(parts: list[Any], passes: ShardedPasses) -> list[torch.Tensor]:
        losses = [or_none(part, passes) for part in parts]
        retry = [
            select_examples(part, torch.tensor([i]))
            for part, loss in zip(parts[:real], losses[:real])
            if loss is None
            for i in range(batch_size_of(part))
        ]
        rounds = passes.passes(len(retry), padding_failed=any(loss is None for loss in losses[real:]))
        alone = [or_none(retry[r] if r < len(retry) else passes.padding, passes) for r in range(rounds)][: len(retry)]
        singles = iter(torch.full((1,), math.nan, device=device_of(batch)) if v is None else v for v in alone)
        return [
            loss if loss is not None else torch.cat([next(singles) for _ in range(batch_size_of(part))])
            for part, loss in zip(parts[:real], losses[:real])
        ]

    def evaluate() -> torch.Tensor:
        if not micro_batches:
            return torch.zeros(0)
        with eval_mode(net), torch.inference_mode():
            if sharded is not None:
                losses = collectively(micro_batches, sharded)
            else:
                losses = [(isolated if isolate else losses_of)(part) for part in micro_batches][:real]
        if not losses:
            return torch.zeros(0)
        return losses[0] if len(losses) == 1 else torch.cat(losses)

    return evaluate


def clipped_differences(
    engine: PerturbationEngine,
    keys: Sequence[Key],
    smoothing: float,
    evaluate: Callable[[], torch.Tensor],
    clip: float,
) -> torch.Tensor:
    """``[B, len(keys)]``: each example's two-point difference [f(θ+λu) − f(θ−λu)]/(2λ) along each key's direction,
    clipped to [−``clip``, ``clip``] (0 where not finite) — what a step releases of each example, before the sum and
    the noise (the fit-start probe compares it between neighbouring batches). θ is restored after each direction:
    exactly for parameters trained through fp32 masters, to the rounding of ``θ − λu + λu`` otherwise."""
    columns = []
    for key in keys:
        diffs = engine.two_point(key, smoothing, evaluate)
        engine.perturb(key, smoothing)
        columns.append(clip_per_example(diffs, clip)[0])
    return torch.stack(columns, dim=1)


def privatize_sum(
    values: torch.Tensor,
    clip: float | None,
    mechanism: SubsampledGaussian,
    noise: NoiseSource,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One private release: (Σ_i clip_C(v_i) + N(0, noise_std²·I)) / expected batch size.

    ``values`` is [B] (one scalar per example: a clamp to [−C, C], released as shape [1]) or
    [B, m] (a row per example, L2-clipped jointly, released as shape [m]). Examples with a
    non-finite value contribute 0 and are counted. ``reduce`` sums the clipped sums and the count
    across data-parallel ranks before the noise is added (once). Returns the release and the count.
    """
    return privatize_sums([values], clip, mechanism, noise, reduce)[0]


def privatize_sums(
    values: Sequence[torch.Tensor],
    clip: float | None,
    mechanism: SubsampledGaussian,
    noise: NoiseSource,
    reduce: Reduce | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`privatize_sum` of each of ``values``, in order (the same noise draws as one call each), with one copy
    to the host and one ``reduce`` for all of them: a step waits for the device once, not once per release."""
    packed, sizes = [], []
    for v in values:
        clipped, bad = clip_per_example(v, clip)
        sums = (clipped.unsqueeze(1) if clipped.dim() == 1 else clipped).sum(dim=0)
        packed += [sums, bad.float().reshape(1)]
        sizes.append(sums.numel() + 1)
    flat = torch.cat(packed).cpu()
    if reduce is not None:
        flat = reduce(flat)
    return [(mechanism.privatize(part[:-1], noise), part[-1]) for part in flat.split(sizes)]


@dataclass
class ZerothOrderEstimate:
    """The privatized scalars of one step, their directions, and what the caller still owes."""

    keys: list[Key]
    scalars: torch.Tensor  # [q], privatized: (clipped sum + noise) / expected batch size
    nonfinite: torch.Tensor  # 0-dim count of per-example differences replaced by 0
    pending_restore: float  # the parameters sit at θ − pending_restore·u(keys[-1])


class PrivateTwoPointEstimator:
    """Runs the q queries of one step with a :class:`PerturbationEngine` and privatizes them.

    ``joint_clip=False`` (the papers): each query's per-example scalar is clamped to [−C, C] and
    each of the q sums gets noise √q·σ·C. ``joint_clip=True`` (a pl_dp option, the vector mechanism
    of DP-AggZO): each example's q-vector of differences is L2-clipped to C and the q-vector of sums
    gets one q-dimensional Gaussian with std σ·C per coordinate — the same privacy (sensitivity C,
    one mechanism with multiplier σ) without the √q noise penalty when the q differences of an
    example are small together.

    ``one_sided=True`` differences f(θ + λu_j) against one shared f(θ): q + 1 forwards instead of
    2q, with the same privacy (each released scalar is still a clamped per-example difference).
    The trade is in variance, not in privacy or (to second order) bias: the one-sided difference
    is uᵀ∇f + (λ/2)·uᵀ∇²f·u + O(λ²) where the two-sided one is uᵀ∇f + O(λ²). The middle term
    averages out of the gradient estimate (E[(uᵀAu)·u] = 0 for a symmetric u) but adds variance,
    shifts each example's value before the clamp, and the loss's rounding error is divided by λ
    instead of 2λ. At equal forwards it buys about twice the queries (q = 2m − 1 for m two-sided
    ones): the DP noise of a step does not change with q (each of the q scalars carries √q·σ·C,
    averaged over q), while the direction-sampling variance falls about as 1/q
    (``benchmarks/step_cost.py --suite queries`` measures both).
    """

    def __init__(
        self,
        engine: PerturbationEngine,
        smoothing: float,
        queries: int = 1,
        joint_clip: bool = False,
        one_sided: bool = False,
    ) -> None:
        if not smoothing > 0:
            raise ConfigError(f"smoothing must be > 0, got {smoothing}.")
        if int(queries) != queries or queries < 1:
            raise ConfigError(f"queries must be an integer >= 1, got {queries}.")
        self.engine = engine
        self.smoothing = float(smoothing)
        self.queries = int(queries)
        self.joint_clip = bool(joint_clip)
        self.one_sided = bool(one_sided)

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
        results = []
        # the clamp is the mechanism's sensitivity, the bound its noise is scaled to: one owner for both
        clip = mechanism.sensitivity if math.isfinite(mechanism.sensitivity) else None  # inf: a non-private run
        baseline = evaluate() if self.one_sided else None
        restore = -self.smoothing if self.one_sided else self.smoothing  # θ sits at θ − restore·u after a query
        for j in range(self.queries):
            key = (step, j)
            if baseline is None:
                diffs = self.engine.two_point(key, self.smoothing, evaluate)
            else:
                self.engine.perturb(key, self.smoothing)
                diffs = (evaluate() - baseline) / self.smoothing
            results.append(diffs)
            keys.append(key)
            if j < self.queries - 1:
                self.engine.perturb(key, restore)  # restore before the next direction
        if self.joint_clip:
            scalars, nonfinite = privatize_sum(torch.stack(results, dim=1), clip, mechanism, noise, reduce)
        else:  # one release per query, all drawn once the last query is in: one wait for the device
            released = privatize_sums(results, clip, mechanism, noise, reduce)
            scalars = torch.cat([r[0] for r in released])
            nonfinite = sum((r[1] for r in released), torch.zeros(()))
        return ZerothOrderEstimate(keys, scalars, nonfinite, restore)

    @torch.no_grad()
    def inner_products(self, estimate: ZerothOrderEstimate, tensors: Sequence[torch.Tensor]) -> tuple[float, float]:
        """(⟨g̃, t⟩, ‖g̃‖²) for g̃ = Σ_j s_j u_j, one parameter at a time (diagnostics; one more sweep)."""
        coeffs = [(key, s * self.engine.scale(key)) for key, s in zip(estimate.keys, estimate.scalars.tolist())]
        dot = sq = 0.0
        for i, t in enumerate(tensors):
            g = torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32))  # bf16 would round g̃
            for key, c in coeffs:
                self.engine.accumulate(g, key, i, c)
            dot += float((g * t).sum())
            sq += float(g.square().sum())
        return dot, sq

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
