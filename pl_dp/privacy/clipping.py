"""Per-example clipping of the quantities a method releases.

Scalar clipping (ZO methods) clamps each example's value to [−C, C], i.e. a·min(1, C/|a|)
(PAZO spec A3), so each contribution to a released sum has magnitude ≤ C. A non-finite value
contributes 0 (which keeps the bound) and is counted, never silently propagated (invariant 6).
"""

from __future__ import annotations

import torch


def clip_scalars(values: torch.Tensor, clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clamp per-example scalars to [−clip, clip] in fp32; non-finite entries become 0.

    Returns the clipped values and the number of non-finite entries (a 0-dim tensor, no host
    sync). ``clip=None`` (non-private runs only) skips the clamp but still zeroes non-finite values.
    """
    values = values.float()
    finite = torch.isfinite(values)
    nonfinite = (~finite).sum()
    values = torch.where(finite, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if clip is not None:
        values = values.clamp(-clip, clip)
    return values, nonfinite
