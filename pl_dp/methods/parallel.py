"""Data parallelism for private methods: N processes are one logical private run.

Every rank Poisson-samples its shard of one global batch, sums its clipped per-example
contributions, and the sums are added across ranks *before* the noise; every rank then adds the
same noise draw — one draw per logical step — and applies the same update. Only clipped sums and
counts cross the network, never per-example values. Single device and DDP are supported;
FSDP and DeepSpeed (which shard parameters and gradients) are refused until implemented.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel

from pl_dp.privacy.sampling import PoissonBatchSampler


def check_strategy(strategy: Strategy) -> None:
    """Refuse, at fit start, a Lightning strategy pl_dp does not support yet (single device and DDP are).

    FSDP and DeepSpeed shard parameters, gradients and optimizer state across ranks: the per-step
    clipped sum, the one noise draw per logical step shared by every replica and the zeroth-order
    sweeps are implemented for whole replicas only. Refusing is better than a run whose noise or
    sensitivity silently differs from what is accounted.
    """
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise NotImplementedError(
            f"pl_dp supports the single-device and DDP strategies; got {type(strategy).__name__}. FSDP and "
            "DeepSpeed shard parameters and gradients, for which one noise draw per logical step and the "
            "per-example clipped sums are not implemented yet: use strategy='ddp' (or one device)."
        )


class DataParallelMixin:
    """Collectives of a :class:`~pl_dp.methods.base.PrivateModule` under data parallelism.

    Uses the module's ``trainer``, ``noise``, ``direction_seed``, ``privacy`` and ``collective_bytes``.
    """

    #: whether the method runs under data parallelism (sum-then-noise collectives; O2NC does not yet)
    supports_data_parallel: bool = True

    @property
    def data_parallel(self) -> bool:
        return self._trainer is not None and self._trainer.world_size > 1

    def _setup_data_parallel(self, sampler: Any) -> None:
        """Make the ranks one logical private run at fit start.

        Every rank gets rank 0's secrets — the noise key and the sampling seed, in process memory over
        the process group, never through storage — and its direction seed. The private sampler must
        shard one global Poisson batch (each rank would otherwise sample the whole set and an example
        could appear world-size times per step). DDP's gradient all-reduce is switched off: pl_dp sums
        what it needs itself, and .grad is only ever the already-shared privatized gradient.
        """
        trainer = self.trainer
        world, rank = trainer.world_size, trainer.global_rank
        if not self.supports_data_parallel:
            raise NotImplementedError(
                f"{type(self).__name__} runs on one process for now (got world size {world}): "
                "use devices=1, num_nodes=1."
            )
        if self.privacy is not None and (
            getattr(sampler, "num_replicas", 1) != world or getattr(sampler, "rank", 0) != rank
        ):
            raise ValueError(
                f"with {world} processes the private loader must shard one global Poisson batch "
                f"(PoissonBatchSampler(num_replicas={world}, rank={rank}), as PrivatePublicDataModule builds it); "
                f"got {type(sampler).__name__} with num_replicas={getattr(sampler, 'num_replicas', 1)}."
            )
        self.noise.share(self._broadcast)
        self.direction_seed = int(self._broadcast(self.direction_seed))
        if isinstance(sampler, PoissonBatchSampler):  # one global Poisson batch: the same secret mask on every rank
            sampler.seed, sampler.seeded = self._broadcast((sampler.seed, sampler.seeded))
        wrapped = trainer.strategy.model
        if isinstance(wrapped, DistributedDataParallel):
            wrapped.require_backward_grad_sync = False

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (identity on one process)."""
        return self.trainer.strategy.broadcast(obj, src=0) if self.data_parallel else obj

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over data-parallel ranks through the Lightning strategy (identity on one
        process). Only clipped sums and counts are passed here, never per-example values; the bytes
        sent are counted in ``collective_bytes``."""
        if not self.data_parallel:
            return tensor
        self.collective_bytes += tensor.numel() * tensor.element_size()
        summed = self.trainer.strategy.reduce(tensor.to(self.device).contiguous(), reduce_op="sum")  # NCCL: on GPU
        return summed.to(tensor.device)

    @property
    def sum_reducer(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """:meth:`all_reduce_sum` under data parallelism, else None (for the estimators' ``reduce`` hooks)."""
        return self.all_reduce_sum if self.data_parallel else None
