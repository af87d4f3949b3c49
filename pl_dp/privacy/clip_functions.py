"""Per-example clipping: the weight rules of first-order methods and the clip of zeroth-order releases.

:class:`ClipFunction` holds the three rules of DP-SGD (Abadi et al. 2016), automatic clipping (Bu et al. 2022) and
DP-PSAC (Xia et al. 2023, §5, Algorithm 1), written as one abstraction (a pl_dp choice). Each rule gives a
per-example factor c(s) for a gradient of norm s, so the clipped gradient is c(s)·g, and states its sensitivity
S = sup_s s·c(s): the bound on one example's contribution that the Gaussian noise σ·S is calibrated to. All three
bound s·c(s) by C.

:func:`clip_per_example` clips the quantities a zeroth-order method releases. Each example's value — a scalar, or a
row of m scalars — is scaled by min(1, C/‖v‖₂). For a scalar this is the clamp to [−C, C] (clip_C of Gong & Li
2025, Eq. 2, which the paper leaves undefined for scalars; symmetric clamping is the pl_dp reading); for a row it is
the joint L2 clip of DP-AggZO. Either way each contribution to a released sum has norm ≤ C. An example with a
non-finite value contributes 0 (which keeps the bound) and is counted, never silently propagated into a release.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from pl_dp.errors import ConfigError


@dataclass(frozen=True)
class ClipFunction:
    """A per-example weight rule.

    ``kind``:
        * ``"constant"`` — min(1, C/s): DP-SGD (Abadi et al.);
        * ``"automatic"`` — C/(s + r): Auto-S / NSGD (Bu et al.); r > 0;
        * ``"psac"`` — C/(s + r/(s + r)): DP-PSAC (Xia et al., AAAI 2023); r ∈ (0, 1].
    """

    kind: str = "constant"
    clip: float = 1.0
    r: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "automatic", "psac"):
            raise ConfigError(f"clip_fn must be 'constant', 'automatic' or 'psac', got {self.kind!r}.")
        if not (isinstance(self.clip, (int, float)) and self.clip > 0 and math.isfinite(self.clip)):
            raise ConfigError(f"clip must be a finite number > 0, got {self.clip!r}.")
        if self.kind != "constant" and not self.r > 0:
            raise ConfigError(f"r must be > 0 for {self.kind} clipping, got {self.r!r}.")
        if self.kind == "psac" and self.r > 1:
            warnings.warn(f"PSAC's analysis assumes r in (0, 1]; r={self.r} makes w monotone.", stacklevel=2)

    @property
    def sensitivity(self) -> float:
        """sup_s s·c(s) = C for all three rules (attained only by constant clipping)."""
        return float(self.clip)

    @property
    def max_weight(self) -> float:
        """sup_s c(s): 1 (constant), C/r (automatic), C/(2√r − r) (PSAC, r ≤ 1; Xia et al. 2023, App. A, Eq. 7)."""
        if self.kind == "constant":
            return 1.0
        if self.kind == "automatic":
            return self.clip / self.r
        return self.clip / (2 * math.sqrt(self.r) - self.r) if self.r <= 1 else self.clip

    def weights(self, norms: torch.Tensor) -> torch.Tensor:
        """c(s) for a vector of per-example gradient norms."""
        s = norms.float()
        if self.kind == "constant":
            return (self.clip / s.clamp_min(1e-30)).clamp(max=1.0)
        if self.kind == "automatic":
            return self.clip / (s + self.r)
        return self.clip / (s + self.r / (s + self.r))

    def finite_weights(self, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c(s) in fp32 for every finite norm and 0 for a non-finite one, with the mask of finite norms.

        An example whose gradient norm is not finite contributes nothing (its weight is 0, which keeps the
        sensitivity bound); the caller counts it from the mask.
        """
        finite = torch.isfinite(norms)
        safe = torch.where(finite, norms, torch.zeros_like(norms))
        return torch.where(finite, self.weights(safe), 0.0), finite


def clip_per_example(values: torch.Tensor, clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip ``values`` ([B] scalars or [B, m] rows) per example to L2 norm ``clip``, in fp32.

    Returns the clipped values and the number of examples with a non-finite entry (a 0-dim
    tensor, no host sync). ``clip=None`` (non-private runs only) skips the clip but still zeroes
    non-finite examples.
    """
    values = values.float()
    rows = values.unsqueeze(1) if values.dim() == 1 else values
    finite = torch.isfinite(rows).all(dim=1)
    rows = torch.where(finite.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    if clip is not None:
        rows = rows * (clip / rows.norm(dim=1, keepdim=True).clamp_min(clip))
    return rows.reshape(values.shape), (~finite).sum()
