"""Privacy core: spec, accountants, calibration, mechanisms, clipping, sampling, noise, per-example independence.

Plain torch, Opacus and dp-accounting; no Lightning imports.
"""

from pl_dp.privacy.accountants import (
    PLD,
    PRV,
    RDP,
    Accountant,
    accountant_names,
    create_accountant,
    register_accountant,
)
from pl_dp.privacy.budget import EpsilonTracker, StepBudget, calibrate_noise_multiplier
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.privacy.clipping import clip_per_example
from pl_dp.privacy.independence import (
    IndependenceError,
    batch_mixing_modules,
    probe_examples,
    probe_independence,
    refuse_batch_mixing_modules,
)
from pl_dp.privacy.losses import batch_size_of, check_per_sample, resolve_loss
from pl_dp.privacy.mechanisms import SubsampledGaussian
from pl_dp.privacy.noise import NoiseSource
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.sampling import EmptySafeCollate, PoissonBatchSampler, poisson_loader, poisson_sampler_of
from pl_dp.privacy.spec import PrivacySpec
from pl_dp.privacy.tree import TreeAccountant, TreeAggregatedGaussian, TreeLeaf, tree_multiplicity, tree_nodes

__all__ = [
    "PLD",
    "PRV",
    "RDP",
    "Accountant",
    "ClipFunction",
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
    "accountant_names",
    "batch_mixing_modules",
    "batch_size_of",
    "calibrate_noise_multiplier",
    "check_per_sample",
    "clip_per_example",
    "create_accountant",
    "poisson_loader",
    "poisson_sampler_of",
    "probe_examples",
    "probe_independence",
    "refuse_batch_mixing_modules",
    "register_accountant",
    "resolve_loss",
    "tree_multiplicity",
    "tree_nodes",
]
