"""First-order per-example gradients and their clipped, weighted sum. Plain torch + Opacus."""

from pl_dp.per_sample.ghost import GhostClipping, ShardedGhostClipping
from pl_dp.per_sample.gradients import PerSampleGradients, clipped_sum, verify_per_example_gradients

__all__ = [
    "GhostClipping",
    "PerSampleGradients",
    "ShardedGhostClipping",
    "clipped_sum",
    "verify_per_example_gradients",
]
