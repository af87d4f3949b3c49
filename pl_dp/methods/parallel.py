"""Data parallelism for private methods: N processes are one logical private run.

Every rank Poisson-samples its shard of one global batch, sums its clipped per-example
contributions, and the sums are added across ranks *before* the noise; every rank then adds the
same noise draw — one draw per logical step — and applies the same update. Only clipped sums and
counts cross the network, never per-example values. Single device, DDP and — for the zeroth-order methods and
ghost-clipped DP-SGD and Coupling — FSDP2 through Lightning's ``ModelParallelStrategy`` are supported (the method
shards its net itself in ``configure_model``; :mod:`pl_dp.step.shards` says where each rank's block sits);
``FSDPStrategy`` (FSDP1) and DeepSpeed are refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods.host import Host
from pl_dp.privacy.sampling import PoissonBatchSampler
from pl_dp.step.distribution import Distribution, Replicated, Sharded
from pl_dp.step.passes import ShardedPasses
from pl_dp.step.seal import ForwardsInStep
from pl_dp.step.shards import is_sharded, meta_copy, whole


def check_strategy(strategy: Strategy, method: str, shardable: bool) -> None:
    """Refuse, at fit start, a Lightning strategy pl_dp does not support for ``method``.

    Single device and DDP are supported for every method that runs data-parallel; ``ModelParallelStrategy`` (FSDP2
    on a 1-D data-parallel mesh) for the methods that can be sharded (``shardable``). ``FSDPStrategy`` (FSDP1's
    flat parameters) and DeepSpeed shard parameters, gradients and optimizer state in ways the zeroth-order sweeps
    and the per-example clipped sums are not written for: a run whose noise or sensitivity silently differed from
    what is accounted would be worse than a refusal.
    """
    if isinstance(strategy, ModelParallelStrategy):
        if not shardable:
            raise NotImplementedError(
                f"{method} cannot be sharded yet (ModelParallelStrategy): its update needs the whole parameters on "
                "every rank. Use strategy='ddp' (or one device); DPZero, PAZO-M/P/S, and DPSGD and Coupling with "
                "per_sample='bk' or 'ghost', run sharded. A subclass of one of them declares that it runs sharded, "
                "once it is tested so: class MyMethod(DPZero, shardable=True)."
            )
        tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel != 1:
            raise ConfigError(
                f"pl_dp shards the net itself with FSDP2 over the data-parallel ranks and does not apply tensor "
                f"parallelism; got tensor_parallel_size={tensor_parallel}. Use ModelParallelStrategy("
                f"data_parallel_size={strategy.world_size}, tensor_parallel_size=1)."
            )
        return
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise NotImplementedError(
            f"pl_dp supports the single-device and DDP strategies, and ModelParallelStrategy (FSDP2) for the "
            f"zeroth-order methods, book-keeping and ghost clipping; got {type(strategy).__name__}. FSDPStrategy "
            "(FSDP1) and DeepSpeed shard parameters and gradients in ways the per-example clipped sums and the "
            "zeroth-order sweeps are not written for: use strategy='ddp', ModelParallelStrategy(data_parallel_size=N, "
            "tensor_parallel_size=1), or one device."
        )


def shard(net: nn.Module, mesh: Any) -> None:
    """FSDP2 over ``mesh``: ``fully_shard`` each layer that holds parameters, then the whole net.

    Each layer's parameters are all-gathered for its own forward only (peak memory: the shards plus one layer), and
    a backward's reduce-scatter sums the ranks' gradients, as pl_dp's own all-reduce sums the clipped sums of DDP.
    A parameter shared by several layers (tied embeddings) is left to the whole net's group, since FSDP2 shards a
    parameter in one group only.
    """
    holders: dict[int, list[nn.Module]] = {}
    for module in net.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(module)
    layers = []
    for module in net.modules():
        own = list(module.parameters(recurse=False))
        if module is not net and own and all(len(holders[id(p)]) == 1 for p in own):
            layers.append(module)
    for module in reversed(layers):  # children before their parents, as FSDP2 requires (a block's own gain)
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
    # the whole net too (FSDP2 keeps the root's parameters gathered after a forward by default): between forwards
    # every parameter is its shard, which is what the zeroth-order sweeps write
    fully_shard(net, mesh=mesh, reshard_after_forward=True)
    sum_gradients(net)


def sum_gradients(net: nn.Module) -> None:
    """Make every FSDP2 group of ``net`` sum the ranks' gradients with a plain sum (FSDP's default averages them):
    the clipped sums of the ranks add up, as pl_dp's own all-reduce adds them under DDP."""
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@torch.no_grad()
def allocate_gathered(net: nn.Module) -> None:
    """Gather and release every FSDP2 group of ``net`` once, outside inference mode (a collective).

    FSDP2 allocates the memory of a group's gathered parameters at its first all-gather and reuses it: allocated
    under ``torch.inference_mode()`` (a zeroth-order forward, the pre-flight pass) it would hold inference tensors,
    which a later forward with autograd (a public gradient) may not write.
    """
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()


class DataParallelMixin(Host):
    """Collectives of a :class:`~pl_dp.methods.base.PrivateModule` under data parallelism.

    Uses the module's ``trainer``, ``noise``, ``direction_seed``, ``privacy``, ``log_private_metrics``,
    ``collective_bytes`` and ``padding_example()``.
    """

    #: whether the method runs under data parallelism (sum-then-noise collectives; O2NC does not yet)
    supports_data_parallel: bool = True

    #: whether the method's own class declared that it runs with its net sharded by FSDP2 — ``class
    #: MyMethod(DPZero, shardable=True)`` — never inherited: a subclass may change what a step computes, so it is
    #: refused under ``ModelParallelStrategy`` until it says it was tested there (tests/distributed/test_fsdp.py)
    shardable: ClassVar[bool] = False

    def __init_subclass__(cls, *, shardable: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.shardable = shardable

    #: sharded: keeps the ranks' forwards in step when one raises (set by :meth:`configure_model`)
    forwards_in_step: ForwardsInStep | None = None

    #: how a step's work is spread over the processes (:mod:`pl_dp.step.distribution`): one process, replicas (DDP)
    #: or shards (FSDP2), chosen by :meth:`configure_model`; sharded, its passes get their padding example at fit start
    #: (the host declares it its process's own: a copy of the module holds one process's)
    distribution: Distribution

    @property
    def supports_sharding(self) -> bool:
        """Whether this module runs with its net sharded by FSDP2 (``ModelParallelStrategy``): its class declared it
        (:attr:`shardable`: DPZero, PAZO-M/P/S, and DP-SGD and Coupling with ghost clipping)."""
        return self.shardable

    @property
    def sharded(self) -> bool:
        """Whether this fit runs under ``ModelParallelStrategy`` (the net sharded by FSDP2)."""
        return self._trainer is not None and isinstance(self._trainer.strategy, ModelParallelStrategy)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``, shard the net with FSDP2 over the data-parallel ranks (:func:`shard`),
        unless it is sharded already (a net whose own ``configure_model`` did it: then all its trainable parameters
        must be, the net itself too, and its gradients are made to sum over ranks); then watch the net's forwards
        (:class:`~pl_dp.step.seal.ForwardsInStep`), so that one that raises on one rank keeps the ranks in step.
        Otherwise nothing.

        Lightning calls this hook at every fit, test and predict; pl_dp applies the sharding, so that
        ``pl-dp fit --trainer.strategy ModelParallelStrategy`` needs no code from the user.
        """
        if not self.sharded:
            self.distribution = self._replicas()
            return
        check_strategy(self.trainer.strategy, type(self).__name__, self.supports_sharding)
        params = list(self.net.parameters())
        if not is_sharded(params):
            # in a tuple, not registered as a submodule: the structure has no state and never trains
            self._net_structure = (meta_copy(self.net),)
            shard(self.net, self.device_mesh["data_parallel"])
        else:
            whole = [n for n, p in self.net.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
            if whole:  # their gradients would stay on each rank, and each rank would add the whole noise to them
                raise PrivacyConfigError(
                    f"the net is sharded already, but not its trainable parameters {whole[:3]}: shard all of them "
                    "(or leave the sharding to pl_dp, which shards every layer)."
                )
            sum_gradients(self.net)  # a net sharded by its own configure_model averages the ranks' gradients
        if self.forwards_in_step is None or self.forwards_in_step.root is not self.net:
            if self.forwards_in_step is not None:  # a net swapped between fits: its hooks go with it
                self.forwards_in_step.remove()
            self.forwards_in_step = ForwardsInStep(self.net)
        passes = ShardedPasses(self.forwards_on_every_rank, self.forwards_in_step)
        self.distribution = Sharded(self.all_reduce_sum, passes)

    def whole_net(self) -> tuple[nn.Module, dict[str, torch.Tensor] | None]:
        """The net and the values of its parameters and buffers, for a computation that needs the whole parameters
        (DP-ZOPO's pruning score): sharded by FSDP2, the net's structure as it was before sharding
        (:func:`~pl_dp.step.shards.meta_copy`) and its parameters gathered whole (a collective: every rank
        calls it; memory: the whole parameters on every rank while they are used); otherwise the net and None (its
        own values)."""
        if not self.sharded:
            return self.net, None
        structure = getattr(self, "_net_structure", None)
        if structure is None:
            raise ConfigError(
                "this net was sharded by its own configure_model, so pl_dp has no unsharded structure to run the whole "
                "parameters through (DP-ZOPO's pruning score): leave the sharding to pl_dp."
            )
        state = {name: whole(p) for name, p in self.net.named_parameters()}
        return structure[0], {**state, **dict(self.net.named_buffers())}

    def prepare_strategy(self) -> None:
        """At fit start: refuse a strategy this method does not support (:func:`check_strategy`); under FSDP2,
        allocate the gathered parameters' memory before any forward (:func:`allocate_gathered`)."""
        check_strategy(self.trainer.strategy, type(self).__name__, self.supports_sharding)
        if self.sharded:
            allocate_gathered(self.net)

    def forwards_on_every_rank(self, count: int) -> int:
        """The number of forward passes every rank runs for a batch that needs ``count`` on this rank: the most any
        rank needs when the net is sharded (a sharded forward is a collective: every rank must run each one), else
        ``count``. Ranks with fewer examples run the rest on an empty batch."""
        if not self.sharded or not self.data_parallel:
            return count
        self.collective_bytes += 8
        return int(self.trainer.strategy.reduce(torch.tensor(count, device=self.device), reduce_op="max"))

    @property
    def data_parallel(self) -> bool:
        return self._trainer is not None and self._trainer.world_size > 1

    def set_padding_example(self) -> None:
        """Sharded: give the step's passes a fixed example that is not private (the host's ``padding_example()``),
        which pads the passes of a rank with fewer sampled examples than another, at weight 0 (a sharded pass is a
        collective, which every rank runs; a net may not run an empty batch). Otherwise nothing."""
        if self.distribution.passes is not None:
            self.distribution.passes.padding = self.padding_example()

    def _replicas(self) -> Distribution:
        """The layout of a run whose net is not sharded: DDP's replicas, or one process."""
        return Replicated(self.all_reduce_sum) if self.data_parallel else Distribution()

    def setup_distribution(self, sampler: Any) -> None:
        """Make the ranks one logical private run at fit start (nothing to do on one process).

        The layout is checked against the strategy first: a method whose own ``configure_model`` does not call
        pl_dp's would otherwise run DDP as one process per rank (each rank's sum alone under the shared noise draw,
        so that the replicas' difference is un-noised), and is refused sharded.

        Every rank gets rank 0's secrets — the noise key and the sampling seed, in process memory over
        the process group, never through storage — and its direction seed. The private sampler must
        shard one global Poisson batch (each rank would otherwise sample the whole set and an example
        could appear world-size times per step). DDP's gradient all-reduce is switched off: pl_dp sums
        what it needs itself, and .grad is only ever the already-shared privatized gradient.
        """
        if not self.sharded:
            self.distribution = self._replicas()
        elif not isinstance(self.distribution, Sharded):
            raise ConfigError(
                f"{type(self).__name__}.configure_model does not call super().configure_model(): under "
                "ModelParallelStrategy pl_dp shards the net and sets up the passes every rank runs there."
            )
        if self.sharded and self.log_private_metrics:
            raise PrivacyConfigError(
                "log_private_metrics is not available on a sharded net: its statistics of the private batch (forwards "
                "and sums over ranks) would run only on the ranks whose share of the Poisson batch is not empty."
            )
        if not self.data_parallel:
            return
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
            raise PrivacyConfigError(
                f"with {world} processes the private loader must shard one global Poisson batch "
                f"(PoissonBatchSampler(num_replicas={world}, rank={rank}), as PrivatePublicDataModule builds it); "
                f"got {type(sampler).__name__} with num_replicas={getattr(sampler, 'num_replicas', 1)}."
            )
        if getattr(sampler, "bands", 1) > 1 and getattr(sampler, "drawing", False) and not sampler.seeded:
            # every rank runs the same loader configuration, so every rank refuses (no rank waits at the broadcast)
            raise PrivacyConfigError(
                f"banded noise on {world} processes needs num_workers=0 for now: the loader's workers drew batches "
                "with each rank's own sampling seed, so their own cyclic groups, before the ranks share rank 0's "
                "seed here — the first steps would mix two group assignments and break the separation of an "
                "example's participations that the accounting rests on."
            )
        self.noise.share(self._broadcast)
        self.direction_seed = int(self._broadcast(self.direction_seed))  # type: ignore[has-type]  # mypy: cycle
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
