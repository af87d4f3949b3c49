"""Coordinate masks for zeroth-order directions (DP-ZOPO: Liu et al., NDSS 2025, §IV-D).

The paper samples v = M·z, z ~ N(0, I_d), with M diagonal: 0 on frozen coordinates, 1 or a rank-based
weight on the trained ones (Algorithms 3–4), and stores the mask sparsely (indices and values, §IV-D1).

A :class:`DirectionMask` confines the perturbation u = M·z to the trained coordinates: per
parameter tensor, the sorted flat indices of the coordinates that move (``None`` = all of them)
and optionally their std multipliers M_ii (the rank-based Importance Matrix). Memory is
O(r·d): 8 bytes per kept index (plus 4 per value when importance-scaled), nothing for a tensor
kept whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DirectionMask:
    """Which coordinates of each trainable tensor are perturbed and updated, and by how much.

    Args:
        numels: number of coordinates of each parameter tensor (the engine checks them).
        indices: per tensor, a sorted 1-D int64 tensor of kept flat indices, or ``None`` for all.
        values: per tensor, the std multipliers M_ii of the kept coordinates (same order as the
            indices; ``None`` = 1), or ``None`` for a pruning-only mask.
    """

    numels: list[int]
    indices: list[torch.Tensor | None]
    values: list[torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        if len(self.indices) != len(self.numels):
            raise ValueError(f"the mask has {len(self.indices)} index tensors for {len(self.numels)} parameters.")
        if self.values is not None and len(self.values) != len(self.numels):
            raise ValueError(f"the mask has {len(self.values)} value tensors for {len(self.numels)} parameters.")
        for i, idx in enumerate(self.indices):
            if idx is None:
                continue
            if idx.dim() != 1 or idx.dtype != torch.int64:
                raise ValueError(f"mask indices of parameter {i} must be a 1-D int64 tensor.")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.numels[i]):
                raise ValueError(f"mask indices of parameter {i} fall outside its {self.numels[i]} coordinates.")
            values = None if self.values is None else self.values[i]
            if values is not None and values.numel() != idx.numel():
                raise ValueError(f"parameter {i}: {values.numel()} mask values for {idx.numel()} indices.")

    def count(self, index: int) -> int:
        """Number of trained coordinates of parameter ``index``."""
        idx = self.indices[index]
        return self.numels[index] if idx is None else int(idx.numel())

    @property
    def trained(self) -> int:
        """Total number of trained coordinates, r·d."""
        return sum(self.count(i) for i in range(len(self.numels)))

    @property
    def fraction(self) -> float:
        """r: the fraction of coordinates trained (the paper's "pruning rate")."""
        return self.trained / max(1, sum(self.numels))

    def value(self, index: int) -> torch.Tensor | None:
        return None if self.values is None else self.values[index]

    def dense(self, shapes: Sequence[torch.Size] | None = None) -> list[torch.Tensor]:
        """The diagonal of M per tensor as dense float tensors (0 off the mask). Tests and diagnostics."""
        out = []
        for i, numel in enumerate(self.numels):
            m = torch.zeros(numel)
            idx, val = self.indices[i], self.value(i)
            target = slice(None) if idx is None else idx.cpu()
            m[target] = 1.0 if val is None else val.float().cpu()
            out.append(m if shapes is None else m.view(shapes[i]))
        return out

    def to(self, device: torch.device | str) -> DirectionMask:
        move = [None if t is None else t.to(device) for t in self.indices]
        values = None if self.values is None else [None if t is None else t.to(device) for t in self.values]
        return DirectionMask(list(self.numels), move, values)

    def state_dict(self) -> dict[str, Any]:
        cpu = self.to("cpu")
        return {"numels": cpu.numels, "indices": cpu.indices, "values": cpu.values}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> DirectionMask:
        return cls(list(state["numels"]), list(state["indices"]), state["values"])
