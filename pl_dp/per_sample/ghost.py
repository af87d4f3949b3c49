"""Ghost clipping: DP-SGD's clipped sum Σ_i c(‖g_i‖)·g_i without forming any per-example gradient.

The norm of a per-example gradient needs only what backpropagation already has. For a linear layer applied to
an example's T positions, with inputs a_t and output gradients b_t, the example's weight gradient is
Σ_t b_t a_tᵀ and

    ‖Σ_t b_t a_tᵀ‖²_F = Σ_{t,s} (b_t·b_s)(a_t·a_s),

the product of two T×T Gram matrices instead of a d_out×d_in matrix per example (Goodfellow, 2015, "Efficient
Per-Example Gradient Computations", for T = 1; Li, Tramèr, Liang & Hashimoto, 2022, "Large Language Models Can
Be Strong Differentially Private Learners", ghost clipping for sequences). Opacus'
``GradSampleModuleFastGradientClipping`` computes these norms in its hooks: ghost norms for ``nn.Linear`` and
``nn.Embedding``, and for the other layers it supports (LayerNorm, Conv, …) the per-example gradient of that one
layer, reduced to its norm at once. :class:`GhostClipping` runs, per (micro-)batch:

1. one backward of Σ_i ℓ_i that records every example's norm ‖g_i‖, keeping the graph;
2. the weights c_i = c(‖g_i‖) of the clipping rule in use (constant, automatic/Auto-S, DP-PSAC — the same
   :class:`~pl_dp.privacy.ClipFunction` as per-example gradients), 0 for a non-finite norm;
3. a second backward, of Σ_i c_i·ℓ_i through the kept graph, whose parameter gradients are Σ_i c_i·g_i: the
   clipped sum itself.

Memory is that of a non-private step (the forward graph and one gradient) plus one layer's norm computation;
time is about one forward and two backwards. Examples whose norm is not finite are dropped: the two passes are
run again on the other examples (a zero weight alone would not do: 0·NaN is NaN in the second backward), and
they are counted. Both passes run in fp32 with autocast disabled, whatever the trainer's precision, so that each
weight is applied to the very gradient whose norm it was computed from; trainable parameters must be fp32.

A parameter tied across modules (a language model's output projection reusing its input embedding: GPT-2, OPT,
Llama-style models) gets the norm of the *sum* of its uses' gradients, cross term included
(:mod:`pl_dp.per_sample.tied`); Opacus' hooks, which cover one use only, are kept off the modules that hold it.

Sharded by FSDP2 (DTensor parameters), Opacus' FSDP module records the norms on each layer (FSDP swaps a layer's
parameters between shards and gathered copies), both passes are ``backward`` calls — the first reduce-scatters
nothing (its gradient is unclipped), the second's reduce-scatter leaves each rank its shard of the clipped sum
*over all ranks*: every rank runs the same passes (collectives) — a micro-batch with a non-finite norm on any rank is
run again by all, without those examples, and a loss that raises on any rank makes all abandon the pass
(:class:`~pl_dp.privacy.seal.PassFailed`). Tied parameters are refused when sharded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleModuleFastGradientClippingFSDP,
)
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin, DefaultReduceScatter

from pl_dp.per_sample.gradients import (
    BroadcastLookups,
    RecordsInEvalMode,
    clear_hook_state,
    refuse_rows_not_examples,
    unsupported_layers,
)
from pl_dp.per_sample.tied import TiedNorms, tied_parameters, unsupported_ties
from pl_dp.privacy.batches import batch_size_of, select_examples
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.privacy.losses import PerSampleLoss, check_per_sample
from pl_dp.privacy.seal import PADDING_FAILED, PassFailed
from pl_dp.privacy.shards import is_sharded, layout_of, local


class _GhostNormModule(RecordsInEvalMode, GradSampleModuleFastGradientClipping):
    """Opacus' fast-gradient-clipping module, recording in eval mode too, and naming a layer it cannot handle.

    A ghost-norm layer (Linear, Embedding) called twice in one forward would have its norm overwritten by its
    second call; Opacus refuses it without saying which layer, this names it.
    """

    layer_names: dict[nn.Module, str]

    def __init__(self, module: nn.Module, *, skipped: frozenset[nn.Module], **kwargs: Any) -> None:
        # modules holding a tied parameter get no Opacus hook: their norms come from TiedNorms
        object.__setattr__(self, "skipped", skipped)  # read by iterate_submodules, inside Opacus' __init__
        super().__init__(module, **kwargs)

    def iterate_submodules(self, module: nn.Module) -> Iterator[nn.Module]:
        yield from (m for m in super().iterate_submodules(module) if m not in self.skipped)

    def capture_activations_hook(self, module: nn.Module, forward_input: Any, forward_output: Any) -> None:
        if (
            self.hooks_enabled
            and torch.is_grad_enabled()
            and getattr(module, "activations", None)
            and type(module) in self.NORM_SAMPLERS
        ):
            raise NotImplementedError(
                f"ghost clipping cannot handle {self.layer_names.get(module, '?')!r} ({type(module).__name__}): it is "
                "called more than once in one forward (a reused layer or tied weights), and Opacus' ghost norm of "
                "such a layer covers one call only. Use per_sample='hooks'."
            )
        super().capture_activations_hook(module, forward_input, forward_output)


class _ShardedGhostNormModule(RecordsInEvalMode, GradSampleModuleFastGradientClippingFSDP):
    """Opacus' fast-gradient-clipping module for FSDP2, recording in eval mode too: norms are kept on each layer."""


class _NoReduceScatter(DefaultAllocMixin, ReduceScatter):
    """An FSDP2 reduce-scatter that sends nothing (and leaves zeros): for the first ghost pass, whose parameter
    gradients are discarded — each rank's *unclipped* gradient sum, which must not cross the wire. FSDP2's hook for a
    custom reduce-scatter (``set_custom_reduce_scatter``) is public; its base classes live in a private module."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> None:
        output_tensor.zero_()


@contextmanager
def _gradients_stay_local(net: nn.Module) -> Iterator[None]:
    """Within: a backward reduce-scatters nothing (:class:`_NoReduceScatter`)."""
    modules = [m for m in net.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_custom_reduce_scatter(_NoReduceScatter())
    try:
        yield
    finally:
        for m in modules:
            m.set_custom_reduce_scatter(DefaultReduceScatter())


class GhostClipping:
    """The clipped sum Σ_i c(‖g_i‖)·g_i of a batch for the trainable parameters of ``net``, by ghost clipping.

    Refused at construction, each with the parameter or layer named: trainable parameters in a precision below
    fp32, and trainable parameters tied across modules other than the weight of ``nn.Linear`` and ``nn.Embedding``
    modules (a language-model head sharing the input embeddings is computed exactly, see
    :mod:`pl_dp.per_sample.tied`). Refused at the first batch: a layer called twice in one
    forward, a parameter whose norm the hooks cannot compute (used outside its module, or an ``nn.Linear`` whose
    input is neither ``[B, d]`` nor ``[B, T, d]``), and a layer that sees the batch merged with another dimension.
    """

    def __init__(self, net: nn.Module, loss_fn: PerSampleLoss) -> None:
        self.net = net
        self.loss_fn = loss_fn
        self.names = [n for n, p in net.named_parameters() if p.requires_grad]
        self.params = [p for p in net.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to optimize.")
        full = (torch.float32, torch.float64)
        low = [f"{n} ({p.dtype})" for n, p in zip(self.names, self.params) if p.dtype not in full]
        if low:
            raise ValueError(
                f"per_sample='ghost' needs fp32 trainable parameters, got {low[:3]}{' …' if len(low) > 3 else ''}: "
                "the clipped sum comes out of autograd in the parameters' dtype, and summing clipped gradients in "
                "half precision would let one example move it by more than the clip bound. Load the model in fp32 "
                "(Trainer(precision='bf16-mixed') keeps fp32 weights) or use per_sample='hooks'."
            )
        unsupported = unsupported_layers(net)
        if unsupported:
            raise ValueError(
                "per_sample='ghost' cannot compute per-example gradient norms for these trainable layers:\n  - "
                + "\n  - ".join(unsupported)
                + "\n(opacus.validators.ModuleValidator.fix(net) swaps them), or freeze them (requires_grad=False)."
            )
        shared = unsupported_ties(net)
        if shared:
            raise ValueError(
                f"per_sample='ghost' cannot clip these parameters tied across modules: {'; '.join(shared)}. A shared "
                "parameter's per-example norm is that of the sum of its uses' gradients. Freeze or untie them, or use "
                "per_sample='hooks'."
            )
        self.sharded = is_sharded(self.params)
        #: sharded: a fixed non-private example run at weight 0 where this rank's pass would otherwise be empty (a
        #: pass is a collective, and a net may not run an empty batch); set by the method at fit start
        self.padding: Any = None
        self.group = layout_of(self.names[0], self.params[0]).group if self.sharded else None
        if self.sharded and tied_parameters(net):
            names = [" = ".join(name for name, _ in found) for _, found in tied_parameters(net)]
            raise ValueError(
                f"per_sample='ghost' cannot clip parameters tied across modules on a sharded net: {names}. Train "
                "them in one process, freeze or untie them."
            )
        self._tied = TiedNorms(net)  # no tie when sharded: nothing to do
        options = dict(batch_first=True, loss_reduction="sum", strict=True, use_ghost_clipping=True)
        if self.sharded:
            self._gsm = _ShardedGhostNormModule(net, **options)
        else:
            self._gsm = _GhostNormModule(net, skipped=frozenset(self._tied.modules), **options)
        self._gsm.layer_names = {m: name or "<the net itself>" for name, m in net.named_modules()}
        self._gsm.disable_hooks()
        self._lookups = BroadcastLookups(net)

    def clipped_sum(
        self, batch: Any, clip_fn: ClipFunction, padding: bool = False
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Σ_i c(‖g_i‖)·g_i per parameter (fp32), the per-example norms ‖g_i‖ (fp32) and the non-finite count.

        The same three values as :func:`~pl_dp.per_sample.clipped_sum` of the per-example gradients. Sharded,
        ``padding`` runs ``batch`` (:attr:`padding`) at weight 0: the passes, collectives included, without a sum.
        """
        size = batch_size_of(batch)
        norms, losses = self._sharded_norms(batch, size, padding) if self.sharded else self._norms(batch, size)
        weights, finite = clip_fn.finite_weights(norms)
        if padding:
            weights, finite = torch.zeros_like(weights), torch.ones_like(finite)
        nonfinite = (~finite).sum()
        if self.sharded:
            sums, norms, nonfinite = self._sharded_sum(batch, clip_fn, norms, losses, weights, finite)
            return sums, norms[:0] if padding else norms, nonfinite
        if bool(nonfinite):  # 0·NaN is NaN: the others' sum is computed again without them
            del losses
            keep = finite.nonzero().squeeze(1)
            if keep.numel():
                sums, _, more = self.clipped_sum(select_examples(batch, keep), clip_fn)
                nonfinite = nonfinite + more
            else:
                sums = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        else:
            sums = self._weighted_sum(losses, weights)
        self._lookups.check(self.loss_fn, batch, size)
        return sums, norms, nonfinite

    def per_example_norms(self, batch: Any) -> torch.Tensor:
        """The per-example gradient norms ‖g_i‖ (fp32) that the first pass computes, and nothing else."""
        size = batch_size_of(batch)
        return (self._sharded_norms(batch, size) if self.sharded else self._norms(batch, size))[0].detach()

    def close(self) -> None:
        """Remove Opacus' hooks from the net (before another fit builds its own on the trainable set it has then)."""
        self._gsm.remove_hooks()
        self._tied.close()

    def reset(self) -> None:
        """Clear what a pass that raised left in the hooks (:func:`~pl_dp.per_sample.gradients.clear_hook_state`)."""
        clear_hook_state(self.net, self.params)
        self._tied.clear()

    def _norms(self, batch: Any, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """First pass: the per-example gradient norms (fp32) and the per-example losses, graph kept."""
        for p in self.params:
            p._norm_sample = None
        gsm = self._gsm
        gsm.enable_hooks()
        self._tied.start()
        try:
            with torch.enable_grad(), _full_precision(self.params[0].device), self._lookups.expanding(size):
                losses = check_per_sample(self.loss_fn(gsm, batch), size)
                grads = torch.autograd.grad(losses.sum(), self.params, retain_graph=True, allow_unused=True)
        except BaseException:
            self._tied.clear()
            raise
        finally:
            gsm.disable_hooks()
            clear_hook_state(self.net, self.params)
        not_per_example = self._tied.finish(size)  # the tied parameters' norms, cross terms included
        missed = []
        for name, p, g in zip(self.names, self.params, grads):
            norm = p._norm_sample
            if norm is None:
                if g is not None:
                    missed.append(name)
                p._norm_sample = torch.zeros(size, device=p.device)  # a parameter the loss does not use
            elif norm.shape != (size,):
                not_per_example.append(name)
        del grads
        if missed:  # a zero in place of a norm would let the parameter's part of the gradient pass unclipped
            raise RuntimeError(
                f"the loss depends on {missed}, but Opacus' ghost-clipping hooks recorded no per-example norm for "
                "them: they are used outside the module that holds them (e.g. a weight read directly in another "
                "module's forward), or their layer's input has a shape its norm sampler does not handle (nn.Linear: "
                "[batch, width] or [batch, tokens, width]). Use per_sample='hooks' or 'functorch'."
            )
        refuse_rows_not_examples(not_per_example, size, "gradient norms")
        norms = gsm.get_norm_sample().float()  # ‖g_i‖ over all trainable parameters
        gsm.per_sample_gradient_norms = None  # Opacus keeps them: un-noised per-example values of the batch
        for p in self.params:
            p._norm_sample = None
        return norms, losses

    def _sharded_norms(self, batch: Any, size: int, padding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """First pass, sharded: ``backward`` of Σ_i ℓ_i with the graph kept and no reduce-scatter (the unclipped
        gradient stays on its rank and is dropped); the norms are read off the layers (and taken off them:
        un-noised per-example values). A loss that raises on any rank makes every rank raise
        :class:`~pl_dp.privacy.seal.PassFailed` before the backward — or, raised by the padding example (a net or loss
        broken for a fixed non-private example), a ``RuntimeError`` on every rank."""
        gsm = self._gsm
        holders = {id(p): m for m in self.net.modules() for p in m.parameters(recurse=False)}
        gsm.enable_hooks()
        try:
            with torch.enable_grad(), _full_precision(self.params[0].device), self._lookups.expanding(size):
                error: Exception | None = None
                try:
                    losses = check_per_sample(self.loss_fn(gsm, batch), size)
                except Exception as raised_here:  # noqa: BLE001 - agreed on by every rank before the backward
                    error = raised_here
                raised = torch.tensor([0.0 if error is None else 2.0 if padding else 1.0])
                dist.all_reduce(raised, op=dist.ReduceOp.MAX, group=self.group)
                if float(raised) == 2.0:
                    raise RuntimeError(PADDING_FAILED) from error
                if float(raised) == 1.0:
                    raise PassFailed(here=error is not None) from error
                with _gradients_stay_local(self.net):
                    losses.sum().backward(retain_graph=True)
            missed = [
                name
                for name, p in zip(self.names, self.params)
                if p.grad is not None and "norm_sample" not in holders[id(p)].__dict__
            ]
            recorded = any("norm_sample" in m.__dict__ for m in self.net.modules())
            norms = gsm.get_norm_sample().float().reshape(-1) if recorded else torch.zeros(size, device=losses.device)
        finally:
            gsm.disable_hooks()
            gsm.per_sample_gradient_norms = None  # Opacus keeps them: un-noised per-example values of the batch
            clear_hook_state(self.net, self.params)
            for p in self.params:
                p.grad = None
        if missed:
            raise RuntimeError(f"Opacus' FSDP ghost-clipping hooks recorded no per-example norm for {missed}.")
        refuse_rows_not_examples([] if norms.shape == (size,) else ["the net"], size, "gradient norms")
        return norms, losses

    def _sharded_sum(
        self,
        batch: Any,
        clip_fn: ClipFunction,
        norms: torch.Tensor,
        losses: torch.Tensor,
        weights: torch.Tensor,
        finite: torch.Tensor,
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Second pass, sharded: this rank's shard of Σ_i c_i·g_i over every rank's examples. Whether any rank saw a
        non-finite norm is agreed first (one all-reduce), so that all run the pass again without those examples."""
        nonfinite = (~finite).sum()
        flag = nonfinite.reshape(1).float()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if bool(flag):  # 0·NaN is NaN: every rank runs the passes again, without its non-finite examples
            del losses
            keep = finite.nonzero().squeeze(1)
            part = select_examples(batch, keep) if keep.numel() else self.padding
            sums, _, more = self.clipped_sum(part, clip_fn, padding=not keep.numel())
            return sums, norms, nonfinite + more
        for p in self.params:
            p.grad = None
        with torch.enable_grad(), _full_precision(self.params[0].device):
            (weights.detach() * losses).sum().backward()
        sums = [
            torch.zeros_like(local(p), dtype=torch.float32) if p.grad is None else local(p.grad).float()
            for p in self.params
        ]
        for p in self.params:
            p.grad = None
        self._lookups.check(self.loss_fn, batch, batch_size_of(batch))
        return sums, norms, nonfinite

    def _weighted_sum(self, losses: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
        """Second pass, hooks off: the gradient of Σ_i c_i·ℓ_i through the kept graph is Σ_i c_i·g_i."""
        with torch.enable_grad(), _full_precision(self.params[0].device):  # autocast would reach the backward's ops
            grads = torch.autograd.grad((weights.detach() * losses).sum(), self.params, allow_unused=True)
        return [
            torch.zeros_like(p, dtype=torch.float32) if g is None else g.float() for p, g in zip(self.params, grads)
        ]


def _full_precision(device: torch.device) -> torch.autocast:
    """Autocast off: the passes compute in the parameters' precision (fp32) under a mixed-precision trainer."""
    return torch.autocast(device_type=device.type, enabled=False)
