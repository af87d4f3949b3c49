"""Zeroth-order engine: seeded in-place perturbation and privatized two-point estimates.

Plain torch; no Lightning imports.
"""

from pl_dp.zo.engine import Direction, PerturbationEngine
from pl_dp.zo.estimator import (
    PrivateTwoPointEstimator,
    ZerothOrderEstimate,
    eval_mode,
    per_sample_evaluator,
    privatize_sum,
    privatize_sums,
)
from pl_dp.zo.mask import DirectionMask
from pl_dp.zo.master import MasterWeights
from pl_dp.zo.pruning import importance_matrix, path_norm_scores
from pl_dp.zo.subspace import SubspaceEngine, flat_basis

__all__ = [
    "Direction",
    "DirectionMask",
    "MasterWeights",
    "PerturbationEngine",
    "PrivateTwoPointEstimator",
    "SubspaceEngine",
    "ZerothOrderEstimate",
    "eval_mode",
    "flat_basis",
    "importance_matrix",
    "path_norm_scores",
    "per_sample_evaluator",
    "privatize_sum",
    "privatize_sums",
]
