"""fp32 master weights of half-precision parameters, kept across engines and checkpoints.

A bf16 weight has 8 significant bits: adding λu in place and subtracting it again leaves a rounding
error each time (drift), and an update below half the weight's ulp (2⁻⁹ to 2⁻⁸ of it) vanishes —
the cause of the fp16 collapses reported for MeZO (Malladi et al. 2023, "Fine-Tuning Language Models
with Just Forward Passes"). A :class:`MasterWeights` store keeps an fp32 copy of every bf16/fp16
parameter an engine trains; the engine updates the copy and writes its rounding into the parameter,
so that the parameter is always ``(master + current perturbation).to(dtype)``. fp32 and fp64
parameters have no copy: they are written in place, as without a store.

Memory: 4 bytes per trained half-precision coordinate (the weights themselves take 2), plus a bf16
comparison buffer while an engine is built. Only that; a checkpoint holds the masters too (see
:meth:`MasterWeights.state_dict`).

The store outlives the engines that use it: a method rebuilds its engine when training starts (the
model may have moved to another device or dtype), when a pruning mask changes, or after loading a
checkpoint, and the masters must survive each rebuild. A master is only reused while the parameter
is still its rounding — a parameter written from outside (``load_state_dict``, a user's edit) gets a
new master copied from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

HALF_DTYPES = (torch.bfloat16, torch.float16)


class MasterWeights:
    """fp32 masters of the half-precision parameters of one model (one engine at a time).

    Args:
        enabled: keep masters (default). ``False`` writes half-precision parameters in place, as
            MeZO does: no extra memory, at the price of the drift and lost updates above.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)
        # (parameter, master) pairs, matched by identity: plain references, so that the store pickles and
        # deep-copies along with the model that holds the same parameters
        self._masters: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._offered: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def _get(table: list[tuple[torch.Tensor, torch.Tensor]], p: torch.Tensor) -> torch.Tensor | None:
        return next((master for q, master in table if q is p), None)

    @torch.no_grad()
    def weights(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """The tensor an engine writes for each of ``params``: the parameter itself, or its fp32 master.

        A half-precision parameter's master is, in this order: one offered by a checkpoint
        (:meth:`load_state_dict`), the one kept from an earlier engine, or a fresh copy of the
        parameter — the first that rounds exactly to the parameter (moved to its device if needed).
        Masters of parameters not in ``params`` are dropped.
        """
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        out: list[torch.Tensor] = []
        for p in params:
            if not self.enabled or p.dtype not in HALF_DTYPES:
                out.append(p)
                continue
            master = None
            offered, kept_master = self._get(self._offered, p), self._get(self._masters, p)
            for candidate, copy in ((offered, True), (kept_master, False)):
                if candidate is None or candidate.shape != p.shape:
                    continue
                # an offered master is copied (never shared with whoever offered it); a kept one moves if p did
                candidate = candidate.to(device=p.device, dtype=torch.float32, copy=copy)
                if torch.equal(candidate.to(p.dtype), p.detach()):
                    master = candidate
                    break
            if master is None:
                master = torch.empty_like(p, dtype=torch.float32).copy_(p.detach())  # keeps p's strides
            kept.append((p, master))
            out.append(master)
        self._masters = kept
        self._offered = []
        return out

    def master_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s fp32 master, or None (not half precision, not trained yet, or masters disabled)."""
        return self._get(self._masters, p)

    @property
    def nbytes(self) -> int:
        """Memory taken by the masters."""
        return sum(m.numel() * m.element_size() for _, m in self._masters)

    def state_dict(self, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
        """The masters by parameter name (model weights, not secrets: safe to checkpoint).

        References, like a module's ``state_dict``: no copy of the masters is made to save them.
        """
        out = {}
        for name, p in named_parameters:
            master = self.master_of(p)
            if master is not None:
                out[name] = master.detach()
        return out

    def load_state_dict(
        self, state: dict[str, torch.Tensor], named_parameters: Iterable[tuple[str, nn.Parameter]]
    ) -> None:
        """Offer saved masters to the next :meth:`weights`, which takes each one that rounds to its parameter.

        Checked then, not now: a checkpoint's masters are often offered before its weights are loaded.
        """
        for name, p in named_parameters:
            master = state.get(name)
            # a master is offered to a parameter of its layout only: a sharded run's blocks are no master of a
            # whole parameter (a sharded state dict loaded on one process), nor a whole tensor of a block
            if master is not None and isinstance(master, DTensor) == isinstance(p, DTensor):
                self._offered.append((p, master))


class MasterWeightsState(nn.Module):
    """A model's fp32 masters as this submodule's extra state: part of the model's state dict, in every layout.

    One process or DDP, a checkpoint's ``state_dict`` then holds each master beside its weight. Under FSDP2 a
    distributed checkpoint (``torch.distributed.checkpoint``, what Lightning's ``ModelParallelStrategy`` writes by
    default) saves the model's state dict by shard — a master is sharded like its parameter — and anything outside
    it whole from rank 0 only, which would hold one rank's blocks: as extra state, each rank saves its blocks and a
    resume loads them in place. At load time the state dict is also the *template* a distributed checkpoint is read
    into, so every trained half-precision parameter has an entry even before its master exists (an fp32 copy of the
    parameter, which is also what its master would start from). Loaded masters are offered to the next engine
    (:meth:`MasterWeights.load_state_dict`), which takes each one only if it still rounds to its parameter.

    Args:
        masters: the method's store.
        named_parameters: the method's ``named_parameters`` (the masters are keyed by those names).
    """

    def __init__(
        self, masters: MasterWeights, named_parameters: Callable[[], Iterable[tuple[str, nn.Parameter]]]
    ) -> None:
        super().__init__()
        self.masters = masters
        self.named_parameters_of_model = named_parameters

    @torch.no_grad()
    def get_extra_state(self) -> dict[str, torch.Tensor]:
        if not self.masters.enabled:
            return {}
        return {
            name: p.detach().float() if (master := self.masters.master_of(p)) is None else master.detach()
            for name, p in self.named_parameters_of_model()
            if p.requires_grad and p.dtype in HALF_DTYPES
        }

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.masters.load_state_dict(state, self.named_parameters_of_model())
