"""Directions inside the span of k public gradients (PAZO-P: Gong & Li 2025, §3.2, Algorithm 2).

v = G·u with G = [g_1 … g_k] ∈ ℝ^{d×k} and u ∈ ℝ^k drawn from the step's seed. Only G is stored
(k parameter-sized buffers, reused every step); u is k numbers, regenerated from the key; v is
formed chunk by chunk on all cores, like any engine's directions, and kept whole only under the
engine's ``cache_directions``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.privacy.seeding import SeedDomain, derive_seed
from pl_dp.step.shards import sum_over_ranks_
from pl_dp.zo.engine import Chunk, Direction, Key, PerturbationEngine
from pl_dp.zo.master import MasterWeights


class SubspaceEngine(PerturbationEngine):
    """A :class:`PerturbationEngine` whose directions are G·u for a per-step basis G.

    Args:
        params: the perturbed parameters (d numbers in total).
        seed: base seed of the coefficients u.
        k: number of basis vectors (public gradients).
        coefficients: distribution of u ∈ ℝ^r (r = effective rank): ``"gaussian"`` N(0, I_r) (default,
            as in the experiments, Gong & Li 2025, App. C.2) or ``"sphere"``, uniform on √r·S^{r−1}
            (the theory, Algorithm 2).
        cache_directions, cache_size: as for :class:`PerturbationEngine` (a kept v saves k − 1 of
            the k ``add_`` per coordinate that each sweep would otherwise redo).
        masters: as for :class:`PerturbationEngine`; the basis of a half-precision parameter is fp32, like
            its master.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        seed: int,
        k: int,
        coefficients: str = "gaussian",
        cache_directions: bool | None = None,
        cache_size: int = 1,
        masters: MasterWeights | None = None,
    ) -> None:
        super().__init__(
            params,
            seed,
            Direction("gaussian"),
            cache_directions=cache_directions,
            cache_size=cache_size,
            masters=masters,
        )
        if isinstance(k, bool) or int(k) != k or k < 1:
            raise ConfigError(f"k must be an integer >= 1, got {k!r}.")
        self.k = int(k)
        if coefficients not in ("gaussian", "sphere"):
            raise ConfigError(f"subspace coefficients must be 'gaussian' or 'sphere', got {coefficients!r}.")
        self.coefficients_kind = coefficients
        # in the dtype of the weights: fp32 for half-precision parameters (an orthonormal basis rounded to bf16 is not)
        self.basis = [torch.zeros((self.k, *w.shape), dtype=w.dtype, device=w.device) for w in self.weights]
        self.rank = 0
        self._coeff_cache: dict[Key, torch.Tensor] = {}

    # ---- the basis ----------------------------------------------------------------------------
    def basis_slot(self, c: int) -> list[torch.Tensor]:
        """Views of column ``c`` of G, one per parameter, to write a gradient into."""
        return [b[c] for b in self.basis]

    @torch.no_grad()
    def finalize_basis(self, orthonormalize: bool = True, tolerance: float = 1e-10) -> None:
        """Turn the k raw columns into G (Algorithm 2, line 4: "(ortho)normalized"), in place.

        The paper does not say how to orthonormalize; the method below is a pl_dp choice.

        ``orthonormalize=True``: an orthonormal basis of span{g_1..g_k}. From the float64 Gram
        matrix M = GᵀG = VΛVᵀ, Q = G·V_r·Λ_r^{−1/2}, keeping eigenvalues above
        ``tolerance``·λ_max — rank-deficient or zero gradients shrink the basis instead of
        producing NaNs (``rank`` says how many columns remain). Memory: the k buffers plus one
        block of 2¹⁶ columns in float64, never a d×k float64 matrix.

        ``orthonormalize=False``: columns scaled to unit norm, g_j / max(‖g_j‖, tiny).
        """
        gram = torch.zeros(self.k, self.k, dtype=torch.float64)
        for part in self._chunks():
            part = part.double()
            gram += (part @ part.T).cpu()
        sum_over_ranks_(gram, self.group)  # sharded: each rank holds a block of every column
        if orthonormalize:
            evals, evecs = torch.linalg.eigh(gram)
            top = float(evals.max()) if evals.numel() else 0.0
            keep = evals > tolerance * top if top > 0 else torch.zeros_like(evals, dtype=torch.bool)
            transform = evecs[:, keep] / evals[keep].sqrt()  # k × r
            self.rank = int(keep.sum())
        else:
            norms = gram.diagonal().sqrt().clamp_min(torch.finfo(torch.float64).tiny)
            transform = torch.diag(1.0 / norms)
            self.rank = self.k
        for part in self._chunks():
            mixed = transform.T.to(part.device) @ part.double()
            part[: self.rank].copy_(mixed)
            part[self.rank :].zero_()
        self._coeff_cache.clear()
        self.forget_directions()

    def _chunks(self, size: int = 1 << 16) -> Iterator[torch.Tensor]:
        """Column blocks [k, ≤size] of every basis tensor: float64 work stays O(k·size), not O(k·d)."""
        for b in self.basis:
            flat = b.reshape(self.k, -1)
            for start in range(0, flat.shape[1], size):
                yield flat[:, start : start + size]

    # ---- directions ---------------------------------------------------------------------------
    def coefficients(self, key: Key) -> torch.Tensor:
        """u ∈ ℝ^rank for direction ``key`` (float64, CPU)."""
        u = self._coeff_cache.get(key)
        if u is None:
            g = torch.Generator().manual_seed(derive_seed(self.seed, *key, SeedDomain.SUBSPACE_COEFFICIENTS))
            u = torch.randn(self.rank, generator=g, dtype=torch.float64)
            if self.coefficients_kind == "sphere" and self.rank > 0:
                u = u * (math.sqrt(self.rank) / u.norm())
            if len(self._coeff_cache) > 64:
                self._coeff_cache.clear()
            self._coeff_cache[key] = u
        return u

    def _fill(self, key: Key, chunk: Chunk, out: torch.Tensor) -> torch.Tensor:
        """Chunk ``chunk`` of v = G·u for direction ``key``."""
        out.zero_()
        for c, weight in enumerate(self.coefficients(key).tolist()):
            out.add_(self.basis[chunk.index][c].view(-1)[chunk.start : chunk.stop], alpha=weight)
        return out

    def scale(self, key: Key) -> float:
        return 1.0

    def direction_tensors(self, key: Key) -> list[torch.Tensor]:
        return [self.raw(key, i).clone() for i in range(len(self.params))]


def flat_basis(engine: SubspaceEngine) -> torch.Tensor:
    """G as a dense d × rank matrix (tests and diagnostics only)."""
    return torch.cat([b[: engine.rank].reshape(engine.rank, -1) for b in engine.basis], dim=1).T
