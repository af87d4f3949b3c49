"""Per-example clipping of the quantities a zeroth-order method releases.

Each example's value — a scalar, or a row of m scalars — is scaled by min(1, C/‖v‖₂). For a
scalar this is the clamp to [−C, C] (clip_C of Gong & Li 2025, Eq. 2, which the paper leaves
undefined for scalars; symmetric clamping is the pl_dp reading); for a row it is the joint L2 clip of
DP-AggZO. Either way each contribution to a released sum has norm ≤ C. An example with a
non-finite value contributes 0 (which keeps the bound) and is counted, never silently
propagated into a release.
"""

from __future__ import annotations

import torch


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
