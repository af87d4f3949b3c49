"""Reference networks."""

from pl_dp.nets.mlp import MLP

__all__ = ["MLP"]
