"""What a private step is made of, below its privacy mathematics: the structure of a batch (``batches``), the
per-example loss contract (``losses``), input checks (``validation``), the seal around a private step (``seal``:
nothing it prints, warns, raises or how it ends depends on which records were sampled), the pre-flight pass over
the private set (``preflight``), the fit-start probe of per-example independence (``independence``), the shard
layout of a net under FSDP2 (``shards``), the passes of a sharded step, which every rank runs (``passes``), and how
a step's work is spread over processes (``distribution``: one, DDP replicas or FSDP2 shards, chosen at set-up).

Plain torch; imports no other pl_dp layer and no Lightning.
"""

from pl_dp.step.batches import batch_size_of, example_structure
from pl_dp.step.independence import (
    batch_mixing_modules,
    probe_examples,
    probe_independence,
    refuse_batch_mixing_modules,
)
from pl_dp.step.losses import check_per_sample, resolve_loss
from pl_dp.step.preflight import check_private_set
from pl_dp.step.seal import isolate_failures, sealed

__all__ = [
    "batch_mixing_modules",
    "batch_size_of",
    "check_per_sample",
    "check_private_set",
    "example_structure",
    "isolate_failures",
    "probe_examples",
    "probe_independence",
    "refuse_batch_mixing_modules",
    "resolve_loss",
    "sealed",
]
