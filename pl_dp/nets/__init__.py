"""Reference networks."""

from pl_dp.nets.mlp import MLP
from pl_dp.nets.transformer import TinyTransformerClassifier

__all__ = ["MLP", "TinyTransformerClassifier"]
