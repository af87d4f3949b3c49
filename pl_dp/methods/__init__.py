"""One LightningModule per private method (manual optimization)."""

from pl_dp.methods.base import PrivateModule, StepResult
from pl_dp.methods.dpzero import DPZero
from pl_dp.methods.first_order import DPSGD, Coupling, FirstOrderModule
from pl_dp.methods.o2nc import O2NC
from pl_dp.methods.own_update import OwnUpdateModule
from pl_dp.methods.pazo import PAZOM, PAZOP, PAZOS
from pl_dp.methods.zeroth_order import ZerothOrderModule

__all__ = [
    "DPSGD",
    "Coupling",
    "FirstOrderModule",
    "O2NC",
    "OwnUpdateModule",
    "PAZOM",
    "PAZOP",
    "PAZOS",
    "DPZero",
    "PrivateModule",
    "StepResult",
    "ZerothOrderModule",
]
