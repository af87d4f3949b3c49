"""Callbacks that talk to pl_dp methods through their documented privacy protocol."""

from pl_dp.callbacks.alpha import AlphaSchedule
from pl_dp.callbacks.budget import PrivacyBudget
from pl_dp.callbacks.pruning import PruningSchedule
from pl_dp.callbacks.resume import AllowPrivacySpecChange
from pl_dp.callbacks.stagewise import StagewiseSchedule
from pl_dp.callbacks.wandb import WandbPrivacyLogger, privacy_config

__all__ = [
    "AllowPrivacySpecChange",
    "AlphaSchedule",
    "PrivacyBudget",
    "PruningSchedule",
    "StagewiseSchedule",
    "WandbPrivacyLogger",
    "privacy_config",
]
