"""Sharded parameters (FSDP2): where a rank's block sits in the whole tensor, and gradients taken through the shards.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) a parameter is a ``DTensor`` placed ``Shard(0)`` on a 1-D
mesh: each rank holds a block of rows, i.e. one contiguous range of the tensor's row-major flat coordinates.
:class:`ShardLayout` records that range, so that the zeroth-order engine can draw a direction chunk by chunk in
the *global* coordinates (a chunk's seed depends on its number, never on the world size) and write only the part
of each chunk that falls in its shard: rank r's slice of the direction is exactly the slice one process would
draw (Alg. 1 of Zhang et al. 2024, "DPZero", is then the same run on any layout). A plain tensor is its own
whole (offset 0). Only ``Shard(0)`` and ``Replicate`` placements on a 1-D mesh are supported: tensor parallelism
(``Shard`` on another dimension) would make a shard's coordinates non-contiguous. The same layout tells the DP noise
of a sharded gradient which slice of the one whole-tensor draw each rank adds (:func:`block`).

Under FSDP2 the graph's leaves are the gathered copies of the parameters, not the shards: ``torch.autograd.grad``
asked about the shards returns nothing (silently, with ``allow_unused``). Gradients are then taken by ``backward``,
whose reduce-scatter leaves each rank its shard of the sum over ranks (:func:`replicated_gradient`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass(frozen=True)
class ShardLayout:
    """The local block of one parameter: flat coordinates [offset, offset + local numel) of ``shape``.

    ``owner`` says whether this rank speaks for the tensor in a sum over ranks (each coordinate is counted once: a
    replicated tensor is counted by the mesh's rank 0 only).
    """

    shape: torch.Size
    offset: int
    rows: tuple[int, int]
    owner: bool
    group: dist.ProcessGroup | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_size(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) else 1


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a rank writes in place: a ``DTensor``'s local shard (its storage itself), else the tensor."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():  # outside autograd, to_local() is the shard's own tensor, not a differentiable view
        return tensor.to_local()


def shard_layouts(tensors: Sequence[torch.Tensor]) -> list[ShardLayout]:
    """The layouts of ``tensors``, which must be sharded over one process group if any is.

    Plain tensors beside sharded ones are whole replicas on every rank: the group's rank 0 owns them.
    """
    layouts = [layout_of(f"parameter {i}", t) for i, t in enumerate(tensors)]
    groups = {id(a.group): a.group for a in layouts if a.group is not None}
    if len(groups) > 1:
        raise NotImplementedError("the trained parameters are sharded over different process groups.")
    if not groups:
        return layouts
    group = next(iter(groups.values()))
    lead = dist.get_rank(group) == 0
    return [a if a.group is not None else replace(a, owner=lead, group=group) for a in layouts]


def layout_of(name: str, tensor: torch.Tensor) -> ShardLayout:
    """The layout of ``tensor`` (``name`` is for the error): where its local block sits, and its process group."""
    if not isinstance(tensor, DTensor):
        return ShardLayout(tensor.shape, 0, (0, tensor.shape[0] if tensor.dim() else 1), True, None)
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    if mesh.ndim != 1 or not all(p == Shard(0) or isinstance(p, Replicate) for p in placements):
        raise NotImplementedError(
            f"{name} is placed {placements} on a {mesh.ndim}-D mesh: zeroth-order perturbation supports FSDP's "
            "Shard(0) (or Replicate) on a 1-D mesh only. Shard with fully_shard on a 1-D data-parallel mesh "
            "(ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1))."
        )
    sharded = any(isinstance(p, Shard) for p in placements)
    rows = tensor.shape[0] if tensor.dim() else 1
    start, size = 0, rows
    if sharded:  # torch.chunk's rows of this rank, as DTensor places Shard(0)
        size, start = Shard.local_shard_size_and_offset(rows, mesh.size(), mesh.get_local_rank())
    local_shape = tensor.to_local().shape
    if (local_shape[0] if tensor.dim() else 1) != size or tuple(local_shape[1:]) != tuple(tensor.shape[1:]):
        raise NotImplementedError(f"{name}: its local shard {tuple(local_shape)} is not a block of rows.")
    stop = start + size
    row_size = math.prod(tensor.shape[1:]) if tensor.dim() else 1
    owner = sharded or mesh.get_local_rank() == 0
    return ShardLayout(tensor.shape, start * row_size, (start, stop), owner, mesh.get_group())


def sum_over_ranks_(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` summed in place over the ranks of ``group`` (a collective every rank of it calls), the
    :attr:`ShardLayout.group` of what it was computed from; None (one process): ``tensor`` as it is."""
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def half_precision_policies(net: nn.Module) -> list[str]:
    """The modules of ``net`` (by name, with the dtypes) that FSDP2 shards under a ``MixedPrecisionPolicy`` whose
    ``param_dtype``, ``reduce_dtype`` or ``output_dtype`` is bf16 or fp16: their forward and backward compute in half
    precision from parameters stored in fp32 (``fully_shard(..., mp_policy=...)`` in a net's own
    ``configure_model``), their gradients are summed over the ranks in half precision, or their outputs are cast to
    half precision (and the gradients coming back through them rounded). FSDP2 keeps the policy on each module's
    state only."""
    found = []
    for name, module in net.named_modules():
        if isinstance(module, FSDPModule):
            policy = module._get_fsdp_state()._mp_policy
            low = [
                f"{field}={dtype}"
                for field in ("param_dtype", "reduce_dtype", "output_dtype")
                if (dtype := getattr(policy, field)) in (torch.bfloat16, torch.float16)
            ]
            if low:
                found.append(f"{name or '<the net itself>'} ({', '.join(low)})")
    return found


def is_sharded(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (a parameter sharded by FSDP2)."""
    return any(isinstance(t, DTensor) for t in tensors)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered, a collective) of a DTensor; a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def as_gradient_of(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` (this rank's block) as the ``.grad`` of ``param``: a DTensor placed like a sharded parameter."""
    if not isinstance(param, DTensor):
        return grad
    return DTensor.from_local(
        grad, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def block(tensor: torch.Tensor) -> tuple[torch.Size, int]:
    """The whole shape of ``tensor`` and the flat offset of this rank's block in it ((shape, 0) for a plain tensor)."""
    layout = layout_of("tensor", tensor)
    return layout.shape, layout.offset


def replicated_gradient(loss: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """∂loss/∂params for a ``loss`` that every rank computes alike (the same examples on every rank).

    Plain parameters: ``torch.autograd.grad``. FSDP2-sharded ones: ``backward``, whose reduce-scatter (a sum over
    ranks, as :func:`pl_dp.methods.parallel.shard` sets it) leaves each rank its shard of world-size copies of the
    gradient, divided here by the world size; the parameters' ``.grad`` is left as it was. DTensor shards.
    """
    if not is_sharded(params):
        return list(torch.autograd.grad(loss, params, allow_unused=True))
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    loss.backward()
    world = dist.get_world_size(layout_of("parameter", next(p for p in params if isinstance(p, DTensor))).group)
    grads = [None if p.grad is None else p.grad / world for p in params]
    for p, g in zip(params, kept):
        p.grad = g
    return grads


def meta_copy(net: nn.Module) -> nn.Module:
    """A copy of ``net`` whose parameters and buffers are on the meta device: its structure, at no memory.

    Taken before FSDP2 shards ``net`` (sharding swaps the layers' classes and hooks their forwards to all-gather
    their shards), so that a computation that needs the *whole* parameters — DP-ZOPO's data-free path-norm score —
    can run the net's forward with them through ``torch.func.functional_call``.
    """
    memo: dict[int, torch.Tensor] = {}
    for p in net.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in net.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(net, memo)
