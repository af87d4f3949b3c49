"""Callbacks that talk to pl_dp methods through their documented privacy protocol."""

from pl_dp.callbacks.alpha import AlphaSchedule
from pl_dp.callbacks.budget import PrivacyBudget

__all__ = ["AlphaSchedule", "PrivacyBudget"]
