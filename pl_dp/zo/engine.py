"""Seeded, in-place parameter perturbation: the core of every zeroth-order method.

Design (ARCHITECTURE "The ZO engine", ANCHORS part 1 (b) items 1–3):

* A direction is never stored. The slice of direction ``key`` for parameter ``i`` is drawn
  from a dedicated ``torch.Generator`` re-seeded with ``derive_seed(seed, *key, i)``, into one
  reusable buffer the size of the largest parameter. Any slice can be regenerated in any order
  (sharding, resume, replay), and the user's global RNG stream is untouched.
* Perturbation is in place (``p.add_``) under ``no_grad``; a two-point query leaves θ at
  θ − λu so that the caller can fuse the restore with the update in one sweep
  (θ ← θ + (λ − η·s)·u): three sweeps per query instead of four.
* Only parameters with ``requires_grad`` are perturbed; d counts only those.
* With a :class:`~pl_dp.zo.mask.DirectionMask` (DP-ZOPO) only the kept coordinates are drawn
  (the RNG sweep shrinks with r) and scattered in place with ``index_add_`` on a ``view`` of the
  parameter — never ``param[idx] += …``, which updates a copy (dpzopo spec §8 item 1); a
  non-contiguous parameter raises instead of silently copying. d is then the number of kept
  coordinates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pl_dp.privacy.seeding import derive_seed
from pl_dp.zo.mask import DirectionMask

Key = tuple[int, ...]


@dataclass(frozen=True)
class Direction:
    """Distribution of the direction u ∈ ℝ^d.

    ``kind="gaussian"``: u ~ N(0, (r²/d)·I_d), the Gaussian with the same second moment as the
    sphere of radius r (PAZO spec A1); ``kind="sphere"``: u uniform on r·S^{d−1}. ``radius=None``
    means r = √d, i.e. E[u uᵀ] = I_d (DPZero, MeZO); PAZO-M uses r = d^{1/4}.
    """

    kind: str = "gaussian"
    radius: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("gaussian", "sphere"):
            raise ValueError(f"direction must be 'gaussian' or 'sphere', got {self.kind!r}.")
        if self.radius is not None and not self.radius > 0:
            raise ValueError(f"direction radius must be > 0, got {self.radius}.")

    def resolved_radius(self, dim: int) -> float:
        return math.sqrt(dim) if self.radius is None else float(self.radius)


class PerturbationEngine:
    """In-place perturbation of a set of parameters along seed-regenerated directions.

    ``mask`` restricts (and optionally scales) the directions to some coordinates: u = M·z.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        seed: int,
        direction: Direction | str = "gaussian",
        radius: float | None = None,
        mask: DirectionMask | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to optimize.")
        self.seed = int(seed)
        self.direction = Direction(direction, radius) if isinstance(direction, str) else direction
        self.mask = None if mask is None else self._check_mask(mask)
        self.dim = self.mask.trained if self.mask is not None else sum(p.numel() for p in self.params)
        self.radius = self.direction.resolved_radius(self.dim)
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._norm_cache: dict[Key, float] = {}

    def _check_mask(self, mask: DirectionMask) -> DirectionMask:
        numels = [p.numel() for p in self.params]
        if list(mask.numels) != numels:
            raise ValueError(f"the direction mask was built for tensors of sizes {mask.numels}, not {numels}.")
        if mask.trained == 0:
            raise ValueError("the direction mask keeps no coordinate: nothing would be trained.")
        return mask.to(self.params[0].device)

    def _indices(self, index: int) -> torch.Tensor | None:
        return None if self.mask is None else self.mask.indices[index]

    # ---- drawing ---------------------------------------------------------------------------
    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        k = (p.device, p.dtype)
        buf = self._buffers.get(k)
        if buf is None:
            size = max(q.numel() for q in self.params if (q.device, q.dtype) == k)
            buf = self._buffers[k] = torch.empty(size, device=p.device, dtype=p.dtype)
        return buf

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device)
        return g

    def raw(self, key: Key, index: int) -> torch.Tensor:
        """The unscaled draw M·z of direction ``key`` for parameter ``index`` (a view of a shared buffer).

        Shaped like the parameter, or, under a mask that keeps part of it, a flat tensor with one
        entry per kept coordinate (in the mask's index order). Place it with :meth:`accumulate`.
        """
        p = self.params[index]
        g = self._generator(p.device)
        g.manual_seed(derive_seed(self.seed, *key, index))
        idx = self._indices(index)
        z = self._buffer(p)[: p.numel() if idx is None else idx.numel()].normal_(generator=g)
        value = None if self.mask is None else self.mask.value(index)
        if value is not None:
            z.mul_(value)
        return z.view_as(p) if idx is None else z

    def place(self, target: torch.Tensor, index: int, values: torch.Tensor, alpha: float) -> None:
        """target ← target + alpha·values at parameter ``index``'s trained coordinates, in place.

        ``values`` is what :meth:`raw` returns (dense, or one entry per kept coordinate).
        """
        idx = self._indices(index)
        if idx is None:
            target.add_(values, alpha=alpha)
        elif idx.numel():
            target.view(-1).index_add_(0, idx, values, alpha=alpha)

    def accumulate(self, target: torch.Tensor, key: Key, index: int, alpha: float) -> None:
        """target ← target + alpha·(M·z)(key) for parameter ``index`` (unscaled; see :meth:`scale`)."""
        idx = self._indices(index)
        if idx is None or idx.numel():
            self.place(target, index, self.raw(key, index), alpha)

    def scale(self, key: Key) -> float:
        """Factor mapping the raw N(0, I) draw of ``key`` to the direction u."""
        if self.direction.kind == "gaussian":
            return self.radius / math.sqrt(self.dim)
        norm = self._norm_cache.get(key)
        if norm is None:
            sq = sum(float(self.raw(key, i).double().square().sum()) for i in range(len(self.params)))
            norm = math.sqrt(sq)
            if len(self._norm_cache) > 64:
                self._norm_cache.clear()
            self._norm_cache[key] = norm
        return self.radius / norm

    def direction_tensors(self, key: Key) -> list[torch.Tensor]:
        """Materialize u for ``key`` (one tensor per parameter). For tests and diagnostics only."""
        s = self.scale(key)
        out = [torch.zeros_like(p) for p in self.params]
        for i, t in enumerate(out):
            self.accumulate(t, key, i, s)
        return out

    # ---- sweeps ----------------------------------------------------------------------------
    @torch.no_grad()
    def perturb(self, key: Key, step_size: float, times: int = 1) -> None:
        """θ ← θ + step_size · u(key), applied ``times`` times from one draw.

        Moving by −λu twice rather than by −2λu once keeps the later +λu restore (nearly) exact
        in floating point: fl(fl(p − a) + a) = p whenever |a| ≪ |p|, while fl(fl(p + a) − 2a) + a
        accumulates a rounding error every cycle.
        """
        alpha = step_size * self.scale(key)
        for i, p in enumerate(self.params):
            idx = self._indices(i)
            if idx is not None and not idx.numel():
                continue
            z = self.raw(key, i)
            for _ in range(times):
                self.place(p, i, z, alpha)

    @torch.no_grad()
    def combine(
        self,
        terms: Sequence[tuple[Key, float]],
        extra: Sequence[tuple[Sequence[torch.Tensor | None], float]] = (),
    ) -> None:
        """θ ← θ + Σ_j c_j · u(key_j) + Σ_k a_k · t_k in one sweep over the parameters.

        ``extra`` adds dense per-parameter tensors (e.g. a public gradient, the proximal term) in
        the same pass; under a mask only their trained coordinates are applied (unscaled by M).
        """
        scaled = [(key, coeff * self.scale(key)) for key, coeff in terms if coeff != 0.0]
        for i, p in enumerate(self.params):
            for key, alpha in scaled:
                self.accumulate(p, key, i, alpha)
            idx = self._indices(i)
            for tensors, alpha in extra:
                t = tensors[i]
                if t is not None and alpha != 0.0:
                    self.place(p, i, t if idx is None else t.reshape(-1).index_select(0, idx), alpha)

    def two_point(self, key: Key, smoothing: float, evaluate: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Per-example [f(θ + λu) − f(θ − λu)] / (2λ) for direction ``key`` (PAZO spec Eq. 1).

        Leaves the parameters at θ − λu: the caller restores them, ideally fused with its
        update via :meth:`combine` (adding +λ to the coefficient of ``key``).
        """
        self.perturb(key, smoothing)
        f_plus = evaluate()
        self.perturb(key, -smoothing, times=2)
        f_minus = evaluate()
        return (f_plus - f_minus) / (2.0 * smoothing)
