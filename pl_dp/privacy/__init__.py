"""Privacy core: spec, accountants, calibration, mechanisms, clipping, sampling, noise, per-example independence,
the pre-flight pass over the private set and the seal around a private step.

Plain torch, Opacus and dp-accounting; no Lightning imports.
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
from pl_dp.privacy.batches import batch_size_of
from pl_dp.privacy.calibration import EpsilonTracker, StepBudget, calibrate_noise_multiplier
from pl_dp.privacy.clip_functions import ClipFunction, clip_per_example
from pl_dp.privacy.independence import (
    IndependenceError,
    batch_mixing_modules,
    probe_examples,
    probe_independence,
    refuse_batch_mixing_modules,
)
from pl_dp.privacy.losses import check_per_sample, resolve_loss
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.privacy.noise import NoiseSource
from pl_dp.privacy.preflight import DataError, check_private_set
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.sampling import EmptySafeCollate, PoissonBatchSampler, poisson_loader, poisson_sampler_of
from pl_dp.privacy.seal import isolate_failures, sealed
from pl_dp.privacy.spec import PrivacySpec
from pl_dp.privacy.tree import TreeAccountant, TreeAggregatedGaussian, TreeLeaf, tree_multiplicity, tree_nodes

__all__ = [
    "PLD",
    "PRV",
    "RDP",
    "Accountant",
    "ClipFunction",
    "DataError",
    "EmptySafeCollate",
    "EpsilonTracker",
    "IndependenceError",
    "NoiseSource",
    "PoissonBatchSampler",
    "PrivacyReport",
    "PrivacySpec",
    "StepBudget",
    "TreeAccountant",
    "TreeAggregatedGaussian",
    "TreeLeaf",
    "SubsampledGaussian",
    "accountant_class",
    "accountant_names",
    "batch_mixing_modules",
    "batch_size_of",
    "calibrate_noise_multiplier",
    "check_per_sample",
    "check_private_set",
    "clip_per_example",
    "create_accountant",
    "load_accountant",
    "isolate_failures",
    "poisson_loader",
    "poisson_sampler_of",
    "probe_examples",
    "probe_independence",
    "refuse_batch_mixing_modules",
    "register_accountant",
    "resolve_loss",
    "sealed",
    "tree_multiplicity",
    "tree_nodes",
]
