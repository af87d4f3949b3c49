"""Correlated noise: banded matrix factorization (DP-BandMF) for first-order methods.

The matrix mechanism privatizes the prefix sums A·G of the gradients G (rows: steps) through a factorization A = B·C:
it releases C·G + σ·ζ·κ·Z (κ the clip bound C of a method, Z i.i.d. N(0, 1), ζ the sensitivity of C) and reconstructs
B·(C·G + σζκZ) = A·(G + σζκ·C⁻¹Z). In the gradient domain the optimizer therefore sees, at step t,

    ĝ_t = g_t + σ·ζ·κ·w_t,    w = C⁻¹·z,   i.e.  w_t = z_t − Σ_{j=1}^{b−1} c_j·w_{t−j}     (c_0 = 1)

— noise that is anti-correlated across steps, so that much of it cancels in the model (the prefix sums), instead of
adding up as DP-SGD's independent draws do (Denisov, McMahan, Rush, Smith & Thakurta 2022; Choquette-Choo, McMahan,
Rush & Thakurta 2023, "Multi-epoch matrix factorization mechanisms").

**The strategy.** C is b-banded lower-triangular Toeplitz with coefficients c_0..c_{b−1}: :class:`BandedSquareRoot`
takes the first b coefficients of the square root of the prefix-sum matrix, the series of (1 − x)^{−1/2}:
c_0 = 1, c_j = c_{j−1}·(2j − 1)/(2j) (Kalinin & Lampert 2024, "Banded square root matrix factorization for
differentially private model training", §3, BSR for SGD) — closed form, no optimization. C⁻¹ of a banded C is not
banded; the recursion above needs only the last b − 1 outputs w, never z. With b = 1, C = I, ζ = 1 and w = z:
DP-SGD, the same draws and the same arithmetic.

**Sensitivity.** Column i of C holds c_0..c_{b−1} in rows i..i+b−1. An example that takes part in step i moves C·G by
at most κ·‖C[:, i]‖ ≤ κ·ζ with ζ = √(Σ_{j<b} c_j²), the largest column norm; when its participations are at least b
steps apart (b-min-separation) the rows they move are disjoint.

**Amplified accounting.** Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu (NeurIPS 2023, "Amplified
banded matrix factorization: a unified approach to private training", arXiv 2306.08153, Theorem 5 with Theorem 1):
split the private set into b groups, each example into one group drawn independently (add/remove adjacency keeps
neighbouring sets neighbouring), and let step t Poisson-sample group t mod b at rate q
(:class:`~pl_dp.privacy.sampling.CyclicPoissonBatchSampler`). Then the release of T steps is as private as ⌈T/b⌉
Poisson-subsampled Gaussian steps at rate q with noise multiplier σ: the rows one participation moves form a block of
b steps that no other participation of that example meets. jax_privacy's ``BandMFExecutionPlanConfig`` accounts the
same event (``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), ceil(iterations / num_bands))``, with
noise std σ·κ·‖strategy coefficients‖). :class:`~pl_dp.privacy.ledger.PrivacyLedger` records one composition every
b private steps of a fit (the first step of each band), so every accountant of subsampled-Gaussian steps accounts it,
and calibration and the budget guard use the same event.

**Resume and copies.** The past outputs w are secret (with them and a release, an adversary subtracts part of the
noise). They are held in process memory only (:class:`BandedNoise`): never in a checkpoint, a pickle or a deep copy.
A fit restarts the recursion (w_{<start} = 0) and the ledger accounts it as a new banded mechanism: a resumed run,
which draws a fresh noise key and a fresh group assignment anyway, composes its segment with the earlier ones (each
segment is a banded MF mechanism on its own; adaptive composition), at the cost of at most one extra composition per
resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from pl_dp.errors import ConfigError
from pl_dp.privacy.mechanisms import SubsampledGaussian


@dataclass(frozen=True)
class BandedSquareRoot:
    """The b-banded square root of the prefix-sum matrix (Kalinin & Lampert 2024): C lower-triangular Toeplitz with
    c_0 = 1 and c_j = c_{j−1}·(2j − 1)/(2j) for j < b, 0 beyond."""

    bands: int

    def __post_init__(self) -> None:
        if isinstance(self.bands, bool) or int(self.bands) != self.bands or self.bands < 1:
            raise ConfigError(f"bands must be an integer >= 1, got {self.bands!r}.")

    @property
    def coefficients(self) -> tuple[float, ...]:
        """c_0..c_{b−1}: the first b coefficients of the series of (1 − x)^{−1/2}."""
        values = [1.0]
        for j in range(1, self.bands):
            values.append(values[-1] * (2 * j - 1) / (2 * j))
        return tuple(values)

    @property
    def sensitivity(self) -> float:
        """ζ = √(Σ_{j<b} c_j²): the largest column norm of C, the release's sensitivity per participation in units of
        the clip bound (1.0 exactly for b = 1)."""
        return math.sqrt(sum(c * c for c in self.coefficients))

    def matrix(self, steps: int) -> torch.Tensor:
        """C for ``steps`` steps, in float64 (for tests and analysis)."""
        matrix = torch.zeros(steps, steps, dtype=torch.float64)
        for j, c in enumerate(self.coefficients):
            matrix += c * torch.diag(torch.ones(max(steps - j, 0), dtype=torch.float64), -j)
        return matrix


class BandedNoise:
    """The recursion w_t = z_t − Σ_{j=1}^{b−1} c_j·w_{t−j} over the noise of each released tensor, and its secret:
    the last b − 1 outputs of each.

    Elementwise, so a rank that holds a block of a sharded tensor keeps the outputs of its block only (the noise
    source draws blocks independently of the layout). The outputs live in process memory only: pickles and copies
    leave them out (:meth:`__getstate__`), and :meth:`restart` forgets them at every fit start.
    """

    def __init__(self, strategy: BandedSquareRoot) -> None:
        self.strategy = strategy
        self._coefficients = strategy.coefficients
        self._past: dict[int, list[torch.Tensor]] = {}  # per released tensor: w_{t−1}, w_{t−2}, … (newest first)

    def restart(self) -> None:
        """Forget every past output: the next step starts a new banded mechanism (w_{<t} = 0)."""
        self._past = {}

    def correlate_(self, index: int, draw: torch.Tensor) -> torch.Tensor:
        """w_t of the released tensor ``index`` from this step's draw z_t (σζκ-scaled), in place; remembers it."""
        past = self._past.setdefault(index, [])
        if past and past[0].shape != draw.shape:
            raise RuntimeError(
                f"released tensor {index} changed shape within a banded mechanism ({tuple(past[0].shape)} -> "
                f"{tuple(draw.shape)}): the noise recursion runs over a fixed list of tensors."
            )
        for c, earlier in zip(self._coefficients[1:], past):
            draw.sub_(earlier, alpha=c)
        if len(self._coefficients) > 1:
            past.insert(0, draw.clone())
            del past[len(self._coefficients) - 1 :]
        return draw

    def __getstate__(self) -> dict[str, Any]:
        """A copy holds the strategy, never the past outputs (a secret): it starts a new recursion."""
        return {"strategy": self.strategy}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["strategy"])  # type: ignore[misc]


@dataclass(frozen=True, kw_only=True)
class BandedMatrixFactorization(SubsampledGaussian):
    """The per-step release of DP-BandMF: a :class:`~pl_dp.privacy.mechanisms.SubsampledGaussian` whose noise is
    σ·ζ·C·w_t, w the banded recursion of ``correlation`` (see the module's docstring).

    Its accounting is the subsampled Gaussian's with multiplier σ, recorded once per band of b steps by the ledger
    (the participation schema, cyclic Poisson sampling over b groups, is the sampler's; a fit refuses a loader that
    does not implement it). With b = 1 it is DP-SGD's mechanism, bit for bit.
    """

    correlation: BandedNoise

    @classmethod
    def of(cls, mechanism: SubsampledGaussian, correlation: BandedNoise) -> BandedMatrixFactorization:
        """``mechanism``'s release (σ, q, C, expected batch size, releases) with ``correlation``'s noise."""
        return cls(**{f.name: getattr(mechanism, f.name) for f in fields(SubsampledGaussian)}, correlation=correlation)

    @property
    def noise_std(self) -> float:
        """Std of each draw z_t: √releases · σ_main · C · ζ (ζ = 1 for b = 1)."""
        return super().noise_std * self.correlation.strategy.sensitivity

    def _noise(self, index: int, draw: torch.Tensor) -> torch.Tensor:
        return self.correlation.correlate_(index, draw)
