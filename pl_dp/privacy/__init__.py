"""The privacy mathematics: spec, accountants (and the tree accountant), calibration, clip functions, mechanisms,
noise (independent, or correlated by banded matrix factorization), seeding, the unit of privacy (example or user),
Poisson sampling (over examples or users, or cyclic over groups), the ledger, journal and report.

What a private step is made of besides (its batches, per-example losses, the seal, the pre-flight pass and the
independence probe) is :mod:`pl_dp.step`, the layer below. Plain torch, Opacus and dp-accounting; no Lightning.
"""

from pl_dp.privacy.accountants import (
    PLD,
    PRV,
    RDP,
    Accountant,
    accountant_class,
    accountant_names,
    create_accountant,
    load_accountant,
    register_accountant,
)
from pl_dp.privacy.calibration import EpsilonTracker, StepBudget, calibrate_noise_multiplier
from pl_dp.privacy.clip_functions import ClipFunction, clip_per_example
from pl_dp.privacy.correlated import BandedMatrixFactorization, BandedNoise, BandedSquareRoot
from pl_dp.privacy.mechanisms import Mechanism, SubsampledGaussian
from pl_dp.privacy.noise import NoiseSource
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.sampling import (
    CyclicPoissonBatchSampler,
    EmptySafeCollate,
    PoissonBatchSampler,
    UserPoissonBatchSampler,
    poisson_loader,
    poisson_sampler_of,
)
from pl_dp.privacy.spec import PrivacySpec
from pl_dp.privacy.tree import TreeAccountant, TreeAggregatedGaussian, TreeLeaf, tree_multiplicity, tree_nodes
from pl_dp.privacy.units import PrivacyUnit, UserIndex

__all__ = [
    "PLD",
    "PRV",
    "RDP",
    "Accountant",
    "BandedMatrixFactorization",
    "BandedNoise",
    "BandedSquareRoot",
    "ClipFunction",
    "CyclicPoissonBatchSampler",
    "EmptySafeCollate",
    "EpsilonTracker",
    "Mechanism",
    "NoiseSource",
    "PoissonBatchSampler",
    "PrivacyReport",
    "PrivacySpec",
    "PrivacyUnit",
    "StepBudget",
    "TreeAccountant",
    "TreeAggregatedGaussian",
    "TreeLeaf",
    "UserIndex",
    "UserPoissonBatchSampler",
    "SubsampledGaussian",
    "accountant_class",
    "accountant_names",
    "calibrate_noise_multiplier",
    "clip_per_example",
    "create_accountant",
    "load_accountant",
    "poisson_loader",
    "poisson_sampler_of",
    "register_accountant",
    "tree_multiplicity",
    "tree_nodes",
]
