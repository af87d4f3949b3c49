"""Small reference networks."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class MLP(nn.Sequential):
    """A ReLU multilayer perceptron: ``in_features → hidden... → num_classes``."""

    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (64,), num_classes: int = 10) -> None:
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
