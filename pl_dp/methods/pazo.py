"""PAZO: private zeroth-order optimization with public data (Gong & Li, NeurIPS 2025).

Three ways of using public mini-batch gradients (ordinary backward on public data only: no
clipping, no noise, no privacy cost) with private zeroth-order queries (§3):

* :class:`PAZOM` mixes the public gradient with the private two-point estimate (Algorithm 1);
* :class:`PAZOP` searches inside the span of k public gradients (Algorithm 2);
* :class:`PAZOS` picks the best of k public gradients (+ a noisy one) by private loss queries
  (Algorithm 3).

Privacy (§3.4): each step is one Poisson-subsampled Gaussian mechanism with multiplier σ,
whatever q or k: the q (or k+1) scalar releases each carry noise √q·σ·C on their clipped sum.

The public batch size b′ is set on the datamodule (``public_batch_size``), like the private b,
so that one object owns how batches are drawn.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.methods.base import StepResult
from pl_dp.methods.own_update import OwnUpdateModule
from pl_dp.methods.public import PublicDataMixin
from pl_dp.methods.zeroth_order import ZerothOrderModule
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.step.shards import local
from pl_dp.step.validation import check_positive, positive_integer
from pl_dp.zo.engine import Direction, PerturbationEngine
from pl_dp.zo.estimator import privatize_sum
from pl_dp.zo.subspace import SubspaceEngine


class PAZOM(PublicDataMixin, ZerothOrderModule, shardable=True):
    """PAZO-M (Algorithm 1): θ ← θ − η(α·g_pub + (1−α)·g̃/q).

    g_pub is the mean-loss gradient of one public batch at θ_t (before any perturbation,
    Algorithm 1, line 4); g̃ = Σ_j s_j u_j is DPZero's privatized q-query estimate with directions of
    radius d^{1/4} (sphere, or the Gaussian N(0, d^{−1/2} I) with the same second moment, as the
    experiments draw Gaussians, App. C.2),
    which aligns E‖g̃‖ with ‖∇f‖ so that α is easy to tune. Do not renormalize: E[g̃] = ∇f/√d.

    ``alpha=1`` is public-only SGD: the private batch is never read and no ε is spent;
    ``alpha=0`` with ``radius=√d`` is DPZero. The theory asks α < 2/3 (Thm B.6); any α ∈ [0, 1]
    is accepted.

    Cost per step: 2q private forwards, one public forward+backward; memory: inference + one
    public gradient + one parameter tensor.
    """

    def __init__(self, net: nn.Module, *, alpha: float = 0.5, smoothing: float = 1e-2, **kwargs: Any) -> None:
        super().__init__(net, smoothing=smoothing, **kwargs)
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"alpha must lie in [0, 1], got {alpha!r}.")
        self.alpha = float(alpha)

    @property
    def touches_private_data(self) -> bool:
        return self.alpha < 1.0

    def default_radius(self, dim: int) -> float:
        return dim**0.25

    def private_step(self, batch: Any, batch_size: int, mechanism: SubsampledGaussian) -> StepResult:
        public_grad = self.public_gradient(self.public_batches(1)[0])
        if not self.touches_private_data:  # alpha == 1: public SGD (through the engine: masks apply)
            self.estimator.engine.combine([], extra=[(public_grad, -self.lr), *self.proximal_terms()])
            return StepResult()
        self.log_gradient_similarity(batch, public_grad)
        estimate = self.zeroth_order_estimate(batch, batch_size, mechanism)
        stats = {"train/noisy_directional_derivative": estimate.scalars.abs().mean()}
        if self.log_private_metrics:
            # ‖g̃/q‖ / ‖g_pub‖ and their cosine: post-processing of privatized and public values (safe;
            # the norms §3.1 asks to keep aligned), but one more parameter sweep, so only with the diagnostics
            dot, sq = self.estimator.inner_products(estimate, public_grad)
            pub = math.sqrt(sum(float(g.square().sum()) for g in public_grad))
            stats["diagnostics/zo_to_public_norm_ratio"] = torch.tensor(math.sqrt(sq) / self.queries / max(pub, 1e-30))
            stats["diagnostics/cos_zo_public"] = torch.tensor(dot / max(math.sqrt(sq) * pub, 1e-30))
        self.estimator.apply(
            estimate,
            self.lr * (1.0 - self.alpha) / self.queries,
            extra=[(public_grad, -self.lr * self.alpha), *self.proximal_terms()],
        )
        return StepResult(stats, estimate.nonfinite)


class PAZOP(PublicDataMixin, ZerothOrderModule, shardable=True):
    """PAZO-P (Algorithm 2): zeroth-order search in the span of k public gradients.

    Per step: k disjoint public batches give g_1..g_k, turned into G (``orthonormalize=True``: an
    orthonormal basis of their span; ``False``: unit-norm columns — the paper's two variants);
    each query perturbs along v_j = G·u_j with u_j ∈ ℝ^k (``direction="gaussian"``: N(0, I_k), as in
    the experiments; ``"sphere"``: √k·S^{k−1}, the theory), and θ ← θ − (η/q)·Σ_j s_j v_j. With
    orthonormal G, E[g̃] → G Gᵀ ∇f: the projected gradient.

    A rank-deficient G (e.g. identical or zero public gradients) shrinks to its rank; the rank is
    logged as ``train/public_basis_rank`` (public information). Memory: k parameter-sized buffers
    for G (reused) plus one; cost: 2q private forwards and k public forward+backward passes. η is
    on another scale than DPZero's (‖v‖ ≈ √k, not √d; hence the paper's larger η grids for PAZO-P,
    Tables 12–13).
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        k: int = 3,
        orthonormalize: bool = True,
        direction: str = "gaussian",
        lr: float = 0.5,
        smoothing: float = 1e-2,
        **kwargs: Any,
    ) -> None:
        # the directions' radius is the basis' (k coefficients): no ``radius`` to give
        super().__init__(net, direction=direction, radius=None, lr=lr, smoothing=smoothing, **kwargs)
        if direction not in ("gaussian", "sphere"):
            raise ConfigError(
                f"PAZO-P draws the coefficients of its public-gradient basis: direction must be 'gaussian' or "
                f"'sphere', got {direction!r}."
            )
        self.k = positive_integer("k", k)
        self.orthonormalize = bool(orthonormalize)

    @property
    def public_batches_per_step(self) -> int:
        return self.k

    def build_engine(self, params: list[nn.Parameter]) -> SubspaceEngine:
        if self.direction_mask is not None:
            raise ConfigError(
                "PAZO-P searches the span of public gradients; a coordinate mask (PruningSchedule) is not "
                "supported for it. Use DPZero or PAZO-M with PruningSchedule."
            )
        return SubspaceEngine(
            params, self.direction_seed, self.k, coefficients=self._direction.kind, **self.engine_arguments()
        )

    def private_step(self, batch: Any, batch_size: int, mechanism: SubsampledGaussian) -> StepResult:
        engine = self.estimator.engine
        for c, public in enumerate(self.public_batches(self.k)):
            for slot, grad in zip(engine.basis_slot(c), self.public_gradient(public)):
                slot.copy_(local(grad))
        if self.log_private_metrics:
            self.log_gradient_similarity(batch, [b.mean(dim=0) for b in engine.basis])
        engine.finalize_basis(self.orthonormalize)
        estimate = self.zeroth_order_estimate(batch, batch_size, mechanism)
        self.estimator.apply(estimate, self.lr / self.queries, extra=self.proximal_terms())
        metrics = {
            "train/noisy_directional_derivative": estimate.scalars.abs().mean(),
            "train/public_basis_rank": torch.tensor(float(engine.rank)),
        }
        return StepResult(metrics, estimate.nonfinite)


class PAZOS(PublicDataMixin, OwnUpdateModule[SubsampledGaussian], shardable=True):
    """PAZO-S (Algorithm 3): choose among k public gradients by private loss queries.

    Per step, with k disjoint public batches and their raw gradients g_1..g_k (at θ_t)::

        f_j = ( Σ_i clip_C(f(θ − η g_j; ξ_i)) + N(0, (k+1)·C²σ²) ) / b        j = 1..k
        ĵ = argmin_j f_j;   g_{k+1} = g_ĵ + z′,  z′ ~ N(0, perturb_scale²·I_d)
        f_{k+1} likewise at θ − η g_{k+1};   θ ← θ − η g_{j*},  j* = argmin over all k+1

    The clipped quantity is the per-example *loss itself* (Algorithm 3, lines 6 and 10): C must sit on
    the loss scale.
    ``perturb_scale`` is the std of the exploration noise z′ (not privacy noise; regenerated from a
    seed, never stored). ``perturb_scale=0`` forms no (k+1)-th candidate and makes k releases with
    noise √k·σ·C each (a pl_dp extension: same privacy, less noise; the paper's "no noisy
    candidate" is ϵ = 0, which read literally still spends a (k+1)-th query). Ties go to the lowest
    index; the step always moves (the paper has no "stay" option).

    Candidates are evaluated in place one at a time, keeping only the best gradient so far:
    memory inference + 2 parameter copies. Cost: k+1 private forwards, k public forward+backward.
    Every move goes through the engine, which trains half-precision parameters through fp32 masters
    (``master_weights``, :class:`~pl_dp.methods.own_update.OwnUpdateModule`); the k + 1 noisy scalars a step
    come from the cryptographic generator by default.
    """

    #: a step releases clipped per-example losses (Algorithm 3, lines 6 and 10), which the fit-start probe compares
    releases_losses = True

    def __init__(
        self,
        net: nn.Module,
        *,
        clip: float | None = 2.0,
        k: int = 3,
        perturb_scale: float = 1e-3,
        lr: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(net, lr=lr, **kwargs)
        check_positive("clip", clip, allow_none=self.privacy is None)
        if not (perturb_scale >= 0 and math.isfinite(perturb_scale)):
            raise ConfigError(f"perturb_scale must be a finite number >= 0, got {perturb_scale!r}.")
        self.clip = None if clip is None else float(clip)
        self.k = positive_integer("k", k)
        self.perturb_scale = float(perturb_scale)
        self._explorer: PerturbationEngine | None = None

    @property
    def public_batches_per_step(self) -> int:
        return self.k

    @property
    def candidates(self) -> int:
        """Private loss queries per step: k, plus one for the noisy candidate."""
        return self.k + (1 if self.perturb_scale > 0 else 0)

    def mechanism(self, batch_size: int) -> SubsampledGaussian:
        """k(+1) scalar releases per step, each with per-example sensitivity C."""
        return self._gaussian(batch_size, self.clip, releases=self.candidates)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._explorer = None

    def _exploration(self) -> PerturbationEngine:
        """The engine every move goes through: z′ ~ N(0, I_d) per unit of step size, and the dense moves."""
        if self._explorer is None or self._explorer.moved():
            params = self.trainable_parameters()
            dim = sum(p.numel() for p in params)
            self._explorer = PerturbationEngine(
                params, self.direction_seed, Direction("gaussian", math.sqrt(dim)), masters=self.masters
            )
        return self._explorer

    def master_parameters(self) -> list[torch.Tensor]:
        return self._exploration().weights

    def load_privacy_state_dict(self, state: dict[str, Any]) -> None:
        super().load_privacy_state_dict(state)
        self._explorer = None

    def private_step(self, batch: Any, batch_size: int, mechanism: SubsampledGaussian) -> StepResult:
        engine = self._exploration()

        def move(direction: list[torch.Tensor], alpha: float) -> None:
            engine.combine([], extra=[(direction, alpha)])

        evaluate = self.private_losses(batch, batch_size)
        nonfinite = torch.zeros(())

        def query() -> float:
            nonlocal nonfinite
            value, bad = privatize_sum(evaluate(), self.clip, mechanism, self.noise, self.distribution.sum_reducer)
            nonfinite = nonfinite + bad
            return float(value)

        best_grad, best_value, best_index = None, math.inf, 0
        for j, public in enumerate(self.public_batches(self.k)):
            grad = self.public_gradient(public)  # at θ_t: the parameters are restored after each query
            move(grad, -self.lr)
            value = query()
            move(grad, self.lr)
            if value < best_value:
                best_grad, best_value, best_index = grad, value, j
            del grad
        self.log_gradient_similarity(batch, best_grad)
        move(best_grad, -self.lr)
        chosen = best_index
        if self.perturb_scale > 0:
            key, step = (self.private_steps, self.k), self.lr * self.perturb_scale
            engine.perturb(key, -step)
            if query() < best_value:
                chosen = self.k
            else:
                engine.perturb(key, step)
        engine.combine([], extra=self.proximal_terms())  # also folds a kept exploration move into the masters
        metrics = {"train/chosen_candidate": float(chosen), "train/best_noisy_loss": best_value}
        return StepResult({name: torch.tensor(value) for name, value in metrics.items()}, nonfinite)
