"""First-order per-example gradients and their clipped, weighted sum. Plain torch + Opacus."""

from pl_dp.per_sample.bk import BookKeeping, ShardedBookKeeping
from pl_dp.per_sample.ghost import GhostClipping, ShardedGhostClipping
from pl_dp.per_sample.gradients import PerSampleGradients, clipped_sum, verify_per_example_gradients
from pl_dp.per_sample.modes import (
    PerSampleMode,
    get_per_sample_mode,
    per_sample_mode_names,
    register_per_sample_mode,
)

__all__ = [
    "BookKeeping",
    "GhostClipping",
    "PerSampleGradients",
    "PerSampleMode",
    "ShardedBookKeeping",
    "ShardedGhostClipping",
    "clipped_sum",
    "get_per_sample_mode",
    "per_sample_mode_names",
    "register_per_sample_mode",
    "verify_per_example_gradients",
]
