"""Book-keeping (BK) clipping: DP-SGD's clipped sum Σ_i c(‖g_i‖)·g_i in one backward pass.

Bu, Wang, Zha & Karypis, 2023, "Differentially Private Optimization on Large Model at Small Cost" (ICML; the ``fastDP``
library), Alg. 1. Ghost clipping (:mod:`pl_dp.per_sample.ghost`) runs its first backward again to get the clipped sum
(sharded, a backward of Σ_i c_i·ℓ_i). Every trainable layer's weight gradient is a contraction of what that layer saw in
the first one: for a linear layer with inputs a_{i,t} and output gradients b_{i,t} (example i, position t),

    Σ_i c_i·g_i = Σ_{i,t} (c_i·b_{i,t}) a_{i,t}ᵀ,

one matrix product of the output gradients, each example's rows scaled by its clip weight, with the inputs. So
:class:`BookKeeping` runs, per (micro-)batch:

1. ghost clipping's first pass, unchanged (:class:`~pl_dp.per_sample.GhostClipping`): one backward of Σ_i ℓ_i that
   computes the gradients with respect to the layers' inputs only — no parameter gradient — while Opacus' hooks
   record each example's norm from the layer's input and output gradient. Here the hooks also *keep* that pair
   (the "book": ``(layer, inputs, output gradients)`` per call, and for tied weights per use, from
   :class:`~pl_dp.per_sample.tied.TiedNorms`). The norms are ghost clipping's: a linear layer's (and Hugging Face's
   ``Conv1D``, GPT-2's) by the cheaper of its ghost norm and its instantiated gradient
   (:func:`~pl_dp.per_sample.gram.linear_norms`, Bu et al. 2023, §3.2), an embedding's by Opacus' norm (each
   distinct token's summed output gradients, in the precision the sum adds them in), each floored at a share of its
   positions' mass (:mod:`pl_dp.per_sample.gram`);
2. the clip weights c_i = c(‖g_i‖), 0 for a non-finite norm (the examples are then dropped and the pass run again
   without them, as in ghost clipping);
3. no second backward: each kept call's clipped sum from its book — ``nn.Linear`` (inputs of any rank) one
   matrix product, ``nn.Embedding`` the rows of the scaled output gradients added at the looked-up indices (the
   ``padding_idx`` row gets none, as in autograd), and every other layer (LayerNorm, RMSNorm, GroupNorm, Conv,
   Opacus' recurrent cells, a leaf module of raw parameters) the weighted sum of its per-example gradients from
   Opacus' sampler of that layer, the one its norm came from; raw parameters beside layers (LayerScale) the weighted
   sum of the per-example gradients their norms came from (:mod:`pl_dp.per_sample.raw`).

Time: one forward, the input-gradient half of a backward and the weight-gradient contractions, i.e. about a
non-private step plus the norms (``benchmarks/ghost_first_pass.py``). Memory: the book holds every hooked layer's
input and output gradient until the clip weights are known — the inputs are those autograd saves for the backward
anyway, the output gradients are extra (one activation-sized tensor per layer: for a language model's head,
batch × tokens × vocabulary). The first pass's backward frees the graph as it goes, as a non-private one does
(unless a raw parameter beside layers is used other than directly in a LayerScale product: its per-example gradients
are then taken through the graph after the backward, :mod:`pl_dp.per_sample.raw`).

Privacy: the sum and the norm come from the same per-layer quantities, so each example's contribution is c_i
times the very gradient whose norm set c_i — at most C — whatever the net. The fit-start check
(:func:`~pl_dp.per_sample.verify_per_example_gradients`) therefore compares the per-example gradients this engine
sums (:meth:`BookKeeping.__call__`) with each example's own gradient, row by row: a parameter used outside its
layer or a layer that sees the batch in another dimension is refused before any step, as a net that mixes
examples is refused upstream. Both passes compute in fp32 with autocast off, like ghost clipping.

A net sharded by FSDP2 takes :class:`ShardedBookKeeping`: the same first pass on every rank (FSDP2 gathers each
layer for its forward and backward, and the first pass reduces no gradient), then each parameter's clipped sum over
this rank's examples from the book, summed over the ranks one parameter at a time, of which the rank keeps its block
(where ghost clipping's second backward has FSDP2 reduce-scatter it).

Not supported (refused when the engine is built, naming the layer; ``per_sample="ghost"`` runs it): an
``nn.Embedding`` with ``scale_grad_by_freq`` (its gradient is divided by the token counts of the whole batch, so it
is not a per-example quantity). On a sharded net, what sharded ghost clipping refuses: tied parameters, and trainable
layers without an Opacus sampler.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pl_dp.per_sample.book import Entry, KeepsBook, per_example_gradients, weighted_sum
from pl_dp.per_sample.ghost import (
    GhostClipping,
    GhostNormModule,
    ShardedGhostClipping,
    ShardedGhostNormModule,
)
from pl_dp.per_sample.gradients import full_precision
from pl_dp.per_sample.rms_norm import WithRMSNormSamplers
from pl_dp.step.batches import batch_size_of
from pl_dp.step.losses import PerSampleLoss
from pl_dp.step.shards import local


class BookKeepingNormModule(WithRMSNormSamplers, KeepsBook, GhostNormModule):
    """Ghost clipping's norm module keeping the book (:class:`KeepsBook`), and measuring Hugging Face's RMSNorm
    layers by their closed-form per-example gradients (:mod:`pl_dp.per_sample.rms_norm`: the sum is made of the
    same ones)."""


class ShardedBookKeepingNormModule(KeepsBook, ShardedGhostNormModule):
    """Sharded ghost clipping's norm module (Opacus' for FSDP2) keeping the book: each entry holds the layer as FSDP2
    gathered it for its backward, and this rank's examples' inputs and output gradients."""


class BookKeeping(GhostClipping):
    """The clipped sum Σ_i c(‖g_i‖)·g_i of a batch for the trainable parameters of ``net``, by book-keeping: ghost
    clipping's first pass, then each layer's sum from the inputs and output gradients it kept, with no second
    backward (see the module docstring). Refuses what :class:`~pl_dp.per_sample.GhostClipping` refuses. Called on a
    batch, returns its per-example gradients (as :class:`~pl_dp.per_sample.PerSampleGradients` does): the rows this
    engine sums, for the fit-start check."""

    mode = "bk"
    second_backward = False
    weighted_backward = False

    def __init__(self, net: nn.Module, loss_fn: PerSampleLoss, **first_pass: Any) -> None:
        """``first_pass``: what the class of the first pass takes beyond the net and loss (a sharded net's
        ``passes``)."""
        super().__init__(net, loss_fn, **first_pass)
        self._tied.keep = True
        self._raw.keep = True
        self._book: list[Entry] = []
        #: the per-example gradients of the raw parameters beside layers, from the first pass (:mod:`.raw`)
        self._raw_grads: dict[nn.Parameter, torch.Tensor] = {}

    def _norm_module(self, options: dict[str, Any]) -> GhostNormModule:
        return BookKeepingNormModule(self.net, skipped=frozenset([*self._tied.modules, *self._raw.modules]), **options)

    def _norms(self, batch: Any, size: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Ghost clipping's first pass (``args``, ``kwargs``: what its class takes beyond the batch and its size, a
        sharded one's ``padding``), whose hooks fill the book; its backward frees the graph as it goes (nothing runs
        backward through it again)."""
        self._forget()
        norms, losses = super()._norms(batch, size, *args, **kwargs)
        self._book = [*self._gsm.book, *self._tied.uses]
        self._raw_grads = self._raw.grads
        self._gsm.book, self._tied.uses, self._raw.grads = [], [], {}
        return norms, losses.detach()

    def _weighted_sum(self, losses: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
        """Each kept call's Σ_i c_i·g_i, and the raw parameters' from their per-example gradients, added up per
        parameter (fp32, autocast off)."""
        with full_precision(self.params[0].device):
            return list(self._sums(weights.detach().float()))

    def _sums(self, weights: torch.Tensor | None) -> Iterator[torch.Tensor]:
        """Σ_i c_i·g_i of each trainable parameter in turn, in the order of ``self.params`` (whole-shaped, fp32),
        from the book and the raw parameters' per-example gradients, which are dropped; ``weights`` None: zeros,
        from nothing. A kept call's sums are computed at its first parameter's turn and held until its last one's,
        and its entry is dropped then: beyond the sums handed out, about one layer's are held at once."""
        entries, raw = (self._book, self._raw_grads) if weights is not None else ([], {})
        self._book, self._raw_grads = [], {}
        turns: dict[int, list[int]] = {id(p): [] for p in self.params}
        for k, (module, _, _) in enumerate(entries):
            for name, _ in module.named_parameters(recurse=False):  # by name: FSDP2 swaps shards and gathered copies
                p = self._trained.get((module, name))
                if p is not None:
                    turns[id(p)].append(k)
        book: list[Entry | None] = [*entries]
        del entries
        held: dict[int, dict[nn.Parameter, torch.Tensor]] = {}
        for p in self.params:
            total = None
            for k in turns[id(p)]:
                entry = book[k]
                if entry is not None:
                    held[k] = self._of_trained(entry[0], weighted_sum(self._gsm.GRAD_SAMPLERS, entry, weights))
                    book[k] = None
                part = held[k].pop(p)
                if not held[k]:
                    del held[k]
                total = part if total is None else total.add_(part)
            if p in raw:
                part = torch.einsum("b,b...->...", weights, raw[p])
                total = part if total is None else total.add_(part)
            yield torch.zeros(p.shape, dtype=torch.float32, device=p.device) if total is None else total
        if held:  # a sum computed for no trainable parameter: the book and the parameters disagree
            raise RuntimeError(f"book-keeping computed sums of parameters it does not train: {list(held)}.")

    def __call__(self, batch: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The per-example gradients the clipped sum is made of (one ``[B, *p.shape]`` tensor per parameter, fp32)
        and the per-example losses — for :func:`~pl_dp.per_sample.verify_per_example_gradients`."""
        size = batch_size_of(batch)
        _, losses = self._norms(batch, size)
        book, self._book = self._book, []
        raw, self._raw_grads = self._raw_grads, {}
        grads = {p: torch.zeros((size, *local(p).shape), dtype=torch.float32, device=p.device) for p in self.params}
        with full_precision(self.params[0].device):
            for entry in book:
                for p, g in self._of_trained(entry[0], per_example_gradients(self._gsm.GRAD_SAMPLERS, entry)).items():
                    grads[p] += self._rows_held(p, g.float())
            for p, g in raw.items():
                grads[p] += g
        return list(grads.values()), losses

    def _rows_held(self, param: nn.Parameter, grads: torch.Tensor) -> torch.Tensor:
        """What this engine holds of per-example gradients ``grads`` (``[B, *param.shape]``): all of them."""
        return grads

    def per_example_norms(self, batch: Any) -> torch.Tensor:
        try:
            return super().per_example_norms(batch)
        finally:
            self._forget()

    def reset(self) -> None:
        super().reset()
        self._forget()

    def _forget(self) -> None:
        """Drop the book (a pass that raised, or norms asked for alone)."""
        self._book, self._gsm.book, self._tied.uses, self._raw_grads = [], [], [], {}


class ShardedBookKeeping(BookKeeping, ShardedGhostClipping):
    """Book-keeping on a net sharded by FSDP2 (see the module docstring): sharded ghost clipping's first pass, which
    reduces no gradient, then each parameter's clipped sum over this rank's examples from the book, summed over the
    ranks (one all-reduce per parameter, in the parameters' order on every rank, of the whole-shaped sum: one
    parameter's at a time), of which this rank keeps its block. ``passes`` as for
    :class:`~pl_dp.per_sample.ShardedGhostClipping`, which refuses the same nets. Called on a batch (the fit-start
    check: the same examples on every rank), returns this rank's blocks of the per-example gradients, formed one
    layer at a time."""

    def _norm_module(self, options: dict[str, Any]) -> GhostNormModule:
        return ShardedBookKeepingNormModule(self.net, **options)

    def _weighted_sum(
        self, losses: torch.Tensor, weights: torch.Tensor, zeroed: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """This rank's block of Σ_i c_i·g_i over every rank's examples, per parameter (fp32). ``zeroed`` given (the
        padding example's pass at weight 0, whose gradient may be non-finite: 0·∞ is NaN): zeros, summed as any
        other rank's sums are."""
        blocks = []
        with full_precision(self.params[0].device):
            weights = None if zeroed is not None else weights.detach().float()
            for p, whole_sum in zip(self.params, self._sums(weights)):
                blocks.append(self._block_over_ranks(p, whole_sum))
        self._reached = []
        return blocks

    def _rows_held(self, param: nn.Parameter, grads: torch.Tensor) -> torch.Tensor:
        """This rank's block of per-example gradients ``grads`` (``[B, *param.shape]``): its rows of ``param``."""
        start, stop = self._layouts[param].rows
        return grads[:, start:stop] if param.dim() else grads
