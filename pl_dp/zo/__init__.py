"""Zeroth-order engine: seeded in-place perturbation and privatized two-point estimates.

Plain torch; no Lightning imports.
"""

from pl_dp.zo.engine import Direction, PerturbationEngine
from pl_dp.zo.estimator import (
    PrivateTwoPointEstimator,
    ZerothOrderEstimate,
    eval_mode,
    per_sample_evaluator,
)

__all__ = [
    "Direction",
    "PerturbationEngine",
    "PrivateTwoPointEstimator",
    "ZerothOrderEstimate",
    "eval_mode",
    "per_sample_evaluator",
]
