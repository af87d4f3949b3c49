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

1. one backward of Σ_i ℓ_i that records every example's norm ‖g_i‖, keeping the graph — for the norms only: it
   asks autograd for the gradients with respect to the layers' inputs (outputs, for a first layer or an embedding
   of integer ids) and no parameter, so the weight-gradient matmuls are pruned (:class:`_NormsOnly`);
2. the weights c_i = c(‖g_i‖) of the clipping rule in use (constant, automatic/Auto-S, DP-PSAC — the same
   :class:`~pl_dp.privacy.ClipFunction` as per-example gradients), 0 for a non-finite norm;
3. a second backward: the first one again — of Σ_i ℓ_i, to the same targets, through the kept graph, no parameter
   gradient — whose hooks take each call of a layer measured by a norm sampler (linear layers, embeddings, tied
   weights: norms floored at a share of their positions' mass, :mod:`pl_dp.per_sample.gram`) with its output
   gradient, recomputed by the same operations as the one its norm was taken of, and contract it at once with the
   call's inputs and the clip weights (:func:`~pl_dp.per_sample.book.weighted_sum`, as book-keeping does: float64,
   rounded once). The layers measured by per-example gradients (LayerNorm, RMSNorm, convolutions, leaf modules of
   raw parameters) and the raw parameters beside layers get their sums from those per-example gradients, kept from
   the first pass (:class:`KeepsPerExampleLayers`). Up to pl_dp 0.2 the second backward was of Σ_i c_i·ℓ_i and its
   parameter gradients were the sum: its arithmetic rounded c_i·g_i otherwise than g_i (1.011·C through a frozen
   bf16 layer, 2·C through a bf16 cast between layers), its weight-gradient matmuls added an example's positions in
   fp32 (2–4·C for one example of 2¹⁷ positions planted to round one way), and it added the positions of the layers
   measured by per-example gradients across examples (63·C through a LayerNorm in a batch of 64) — all found by
   independent reviews.

So each example's part of the release is c_i times the very gradient whose norm set c_i, as in book-keeping, when
the two backwards compute the same output gradients. Both run under ``torch.use_deterministic_algorithms(True)``
(on the CPU too: the backward of indexing with repeated indices adds with atomics across threads otherwise, through
which an independent review released 7.6e7·C; on a CUDA device this needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
refused without it), and the second starts from the random state the first started from (a backward that draws —
stochastic rounding in a custom ``autograd.Function``, dropout recomputed by an activation checkpoint without
``preserve_rng_state`` — draws the same numbers: 1.008·C and 2.05·C released before). A backward that still
computes otherwise the second time — one that changes what it reads (a custom ``autograd.Function`` that keeps a
tensor on ``ctx`` and overwrites it: 1.73·C released), or draws from a generator torch's state does not hold
(Python's, NumPy's, a module's own ``torch.Generator``) — is refused: each call's output gradient in the second
backward must have the bits of the first's (:func:`~pl_dp.per_sample.book.fingerprint`, one integer sum per call).
Book-keeping (``per_sample="bk"``, the default) needs none of this, its sums being made of its one backward's own
output gradients. A layer whose input is changed in place after the call is refused in both modes
(:func:`~pl_dp.per_sample.book.refuse_changed_inputs`).

Memory is that of a non-private step (the forward graph and one gradient) plus one layer's norm computation or
contraction and the inputs and output gradients of the layers measured by per-example gradients (LayerNorm's are
small); time is about one forward, one backward, the input-gradient half of another and the contractions (plus the
norms' own work). Up to pl_dp 0.2 the first pass also computed, and dropped, every parameter gradient: about half
of a backward (``benchmarks/ghost_first_pass.py``). Examples whose norm is not finite are dropped: the two passes
are run again on the other examples (a zero weight alone would not do: 0·NaN is NaN), in a batch of the same shape
(filled with copies of one of them, at weight 0), and they are counted. ``rows`` sums only some rows of a batch,
the others at weight 0: the copies that fill a micro-batch to a fixed shape, the examples the fit-start probe does
not watch. Both passes run in fp32 with autocast disabled, whatever the trainer's precision; trainable parameters
must be fp32, and a half-precision frozen base (LoRA adapters over a bf16 model) computes in bf16 and keeps one
batch shape like any half-precision run.

A parameter tied across modules (a language model's output projection reusing its input embedding: GPT-2, OPT,
Llama-style models) gets the norm of the *sum* of its uses' gradients, cross term included
(:mod:`pl_dp.per_sample.tied`); Opacus' hooks, which cover one use only, are kept off the modules that hold it.
Raw parameters held beside layers (a LayerScale ``gamma``, a scale or bias on the net) get exact per-example
gradients from the first pass's own graph (:mod:`pl_dp.per_sample.raw`); Opacus' hooks are kept off the modules that
hold them, and on the layers under those.

Sharded by FSDP2 (DTensor parameters), Opacus' FSDP module records the norms on each layer (FSDP swaps a layer's
parameters between shards and gathered copies); the first pass computes no parameter gradient, so FSDP2 has
nothing to reduce-scatter (each rank's unclipped gradient never exists), and the second, a ``backward`` call,
reduce-scatters and leaves each rank its shard of the clipped sum *over all ranks*: every rank runs the same passes
(collectives) — a micro-batch with a non-finite norm on any rank is run again by all, without those examples, and a
forward or loss that raises on any rank makes all abandon the pass (:class:`~pl_dp.step.seal.PassFailed`; a
forward that raised between two layers first issues the other layers' all-gathers:
:class:`~pl_dp.step.seal.ForwardsInStep`). Tied parameters are refused when sharded. Sharded, the layers measured
by per-example gradients are kept out of the second backward's sums as on one process: each rank makes their sums
of its examples from its book, and they are added over the ranks one parameter at a time (every rank in the same
order), of which each rank keeps its block. Both backwards run deterministically, the second from the first's random
state, as on one process; the second, of Σ_i c_i·ℓ_i, still carries the clip weights through the net's arithmetic and
adds an example's positions in fp32, hence the refusals of half precision above and the advice to prefer
book-keeping for long sequences on a sharded net.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleModuleFastGradientClippingFSDP,
)
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pl_dp.errors import ConfigError
from pl_dp.per_sample.book import (
    Entry,
    KeepsBook,
    fingerprint,
    layer_type,
    reads_inputs,
    record_versions,
    refuse_another_gradient,
    refuse_changed_inputs,
    transposed_linear,
    weighted_sum,
)
from pl_dp.per_sample.gradients import (
    OPACUS_RNNS,
    BroadcastLookups,
    HooksOutputGradients,
    RecordsInEvalMode,
    clear_hook_state,
    full_precision,
    output_tensors,
    refuse_rows_not_examples,
    refuse_unsupported_layers,
)
from pl_dp.per_sample.gram import embedding_norms, linear_norms
from pl_dp.per_sample.raw import RawGradients, children_first, raw_parameter_modules
from pl_dp.per_sample.tied import TiedNorms, tied_parameters, unsupported_ties
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.step.batches import batch_size_of, fill_rows, select_examples
from pl_dp.step.losses import PerSampleLoss, check_per_sample
from pl_dp.step.passes import ShardedPasses
from pl_dp.step.shards import half_precision_policies, is_sharded, layout_of, local, sum_over_ranks_


class MeasuresLinearLayers:
    """Mixin for Opacus' norm modules: ``nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2) are measured by
    :func:`~pl_dp.per_sample.gram.linear_norms` — Gram norms that cannot round low where an example's positions
    nearly cancel (Opacus' fp32 ones can: 16·C released), inputs of any rank — in place of Opacus' linear norm, and
    ``nn.Embedding`` by :func:`~pl_dp.per_sample.gram.embedding_norms`; both floored at a share of the positions'
    mass (see :mod:`pl_dp.per_sample.gram`)."""

    #: Opacus' class-level registry, read through the hook module's class; this module's own copy once built
    NORM_SAMPLERS: dict[type, Any]

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        transposed = {layer_type(m) for m in module.modules() if transposed_linear(m)}
        samplers = {
            **type(self).NORM_SAMPLERS,
            nn.Linear: linear_norms,
            **dict.fromkeys(transposed, linear_norms),
            nn.Embedding: embedding_norms,
        }
        object.__setattr__(self, "NORM_SAMPLERS", samplers)  # before Opacus' __init__, which hooks by it
        super().__init__(module, **kwargs)  # type: ignore[call-arg]  # the Opacus module this mixin comes before


def narrow(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a floating-point type narrower than fp32 (bf16, fp16, the float8 types)."""
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


class RefusesHalfPrecisionCalls:
    """Mixin for Opacus' norm modules: refuses a trainable layer called in half precision — its inputs or output
    gradient narrower than fp32 (bf16, fp16, float8), from an autocast region or a cast inside the net's forward. Its
    norm would be taken of the rounded values, while its sum is contracted from the fp32 ones: 2.97·C released under
    book-keeping (an independent review)."""

    layer_names: dict[nn.Module, str]

    def rearrange_grad_samples(
        self, *, module: nn.Module, backprops: torch.Tensor, loss_reduction: str, batch_first: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        activations, backprops = super().rearrange_grad_samples(  # type: ignore[misc]
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first
        )
        tensors = [t for t in (*activations, backprops) if isinstance(t, torch.Tensor)]
        low = sorted({str(t.dtype) for t in tensors if narrow(t.dtype)})
        if low:
            raise RuntimeError(
                f"cannot clip {getattr(self, 'layer_names', {}).get(module, '?')!r} ({type(module).__name__}): it is "
                f"called in half precision ({', '.join(low)}: an autocast region or a cast inside the net's "
                "forward), and its norm would be taken of rounded values while its gradient is not. Compute the "
                "trainable layers in fp32 (Trainer(precision='bf16-mixed') does, for these modes) or use "
                "per_sample='hooks'."
            )
        return activations, backprops


class RefusesInputsChangedInPlace:
    """Mixin for Opacus' norm modules: refuses a hooked layer whose input was changed in place after the layer's
    call (``out = fc(x); x.mul_(5)`` on an ``x`` that needs no gradient), when its norm is taken; the sums check again
    (:func:`~pl_dp.per_sample.book.refuse_changed_inputs`)."""

    layer_names: dict[nn.Module, str]

    def capture_activations_hook(self, module: nn.Module, forward_input: Any, forward_output: Any) -> None:
        kept = len(getattr(module, "activations", None) or ())
        super().capture_activations_hook(module, forward_input, forward_output)  # type: ignore[misc]
        if len(getattr(module, "activations", None) or ()) > kept:
            record_versions(module.activations[-1])

    def rearrange_grad_samples(
        self, *, module: nn.Module, backprops: torch.Tensor, loss_reduction: str, batch_first: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        activations, backprops = super().rearrange_grad_samples(  # type: ignore[misc]
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first
        )
        if reads_inputs(module):
            name = getattr(self, "layer_names", {}).get(module, "?")
            refuse_changed_inputs(activations, f"{name!r} ({type(module).__name__})")
        return activations, backprops


class GhostNormModule(
    HooksOutputGradients,
    RefusesInputsChangedInPlace,
    RefusesHalfPrecisionCalls,
    MeasuresLinearLayers,
    RecordsInEvalMode,
    GradSampleModuleFastGradientClipping,
):
    """Opacus' fast-gradient-clipping module, recording in eval mode too, and naming a layer it cannot handle.

    A ghost-norm layer (Linear, Embedding) called twice in one forward would have its norm overwritten by its
    second call; Opacus refuses it without saying which layer, this names it.
    """

    layer_names: dict[nn.Module, str]

    def __init__(self, module: nn.Module, *, skipped: frozenset[nn.Module], **kwargs: Any) -> None:
        # modules holding a tied parameter or raw parameters beside layers get no Opacus hook (their norms come from
        # TiedNorms and RawGradients); the layers under them do
        object.__setattr__(self, "skipped", skipped)  # read by iterate_submodules, inside Opacus' __init__
        super().__init__(module, **kwargs)

    def iterate_submodules(self, module: nn.Module) -> Iterator[nn.Module]:
        """The modules to hook, each once: a layer registered under two parents (a norm shared by a block and the
        net) would otherwise get Opacus' hooks twice and its norm recorded twice per call."""
        seen: set[nn.Module] = set()
        for found in self._submodules(module):
            if found not in seen:
                seen.add(found)
                yield found

    def _submodules(self, module: nn.Module) -> Iterator[nn.Module]:
        if module in self.skipped:
            for child in module.children():
                yield from self.iterate_submodules(child)
            return
        yield from super().iterate_submodules(module)  # which recurses through iterate_submodules

    def validate(self, module: nn.Module, *, strict: bool = False) -> list[NotImplementedError]:
        """Opacus' refusal of a trainable module holding buffers (it would measure the module on a copy), for the
        modules it measures: not the skipped ones, whose norms come from the live graph or :mod:`.tied`."""
        errors = [
            NotImplementedError(f"Model contains a trainable layer with buffers that Opacus doesn't support ({name}).")
            for name, m in module.named_modules()
            if m not in self.skipped
            and any(p.requires_grad for p in m.parameters(recurse=False))
            and any(True for _ in m.buffers())
        ]
        if strict and errors:
            raise NotImplementedError(errors)
        return errors

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


class KeepsPerExampleLayers(KeepsBook):
    """What makes the norm module of (one-process) ghost clipping keep, per hooked call of a layer it measures by
    per-example gradients (not by a norm sampler: LayerNorm, RMSNorm, convolutions, leaf modules of raw
    parameters), the inputs and output gradient they come from: those layers' clipped sums are made of the
    per-example gradients whose norms set the clip weights (:mod:`pl_dp.per_sample.book`), not by the second
    backward, which would add their positions across examples."""

    NORM_SAMPLERS: dict[type, Any]

    def keeps(self, module: nn.Module) -> bool:
        return layer_type(module) not in self.NORM_SAMPLERS


class SumsInASecondBackward(KeepsPerExampleLayers):
    """What makes the norm module of one-process ghost clipping keep, per hooked call of a layer it measures by a
    norm sampler (``nn.Linear``, Hugging Face's ``Conv1D``, ``nn.Embedding``), that call's inputs (:attr:`inputs`:
    those autograd keeps for the second backward anyway), and, in the second backward (:attr:`sink` set), hand each
    such call's ``(layer, inputs, output gradient)`` to the sink instead of measuring it. The second backward is the
    first one again, so that output gradient is the very one the call's norm was taken of: refused if not (its bits'
    :func:`~pl_dp.per_sample.book.fingerprint` from the first backward)."""

    layer_names: dict[nn.Module, str]

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        #: per call: its inputs and the :func:`~pl_dp.per_sample.book.fingerprint` of its output gradient
        self.inputs: dict[nn.Module, tuple[list[torch.Tensor], torch.Tensor]] = {}
        #: what takes each call's ``(layer, inputs, output gradient)`` in the second backward
        self.sink: Callable[[Entry], None] | None = None

    def rearrange_grad_samples(
        self, *, module: nn.Module, backprops: torch.Tensor, loss_reduction: str, batch_first: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        activations, backprops = super().rearrange_grad_samples(
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first
        )
        if not self.keeps(module):
            self.inputs[module] = (activations, fingerprint(backprops))
        return activations, backprops

    def capture_backprops_hook(
        self, module: nn.Module, _forward_input: Any, forward_output: Any, loss_reduction: str, batch_first: bool
    ) -> None:
        if self.sink is None:
            super().capture_backprops_hook(  # type: ignore[misc]  # the Opacus module mixed in after this
                module, _forward_input, forward_output, loss_reduction, batch_first
            )
            return
        kept = self.inputs.pop(module, None)
        if kept is not None:
            grad = forward_output[0].detach()
            refuse_another_gradient(grad, kept[1], f"{self.layer_names.get(module, '?')!r} ({type(module).__name__})")
            self.sink((module, kept[0], grad))


class PerExampleLayersNormModule(SumsInASecondBackward, GhostNormModule):
    """Ghost clipping's norm module: keeping the calls of the layers it measures by per-example gradients, and the
    inputs of the others for the second backward."""


class ShardedGhostNormModule(
    RefusesInputsChangedInPlace,
    RefusesHalfPrecisionCalls,
    MeasuresLinearLayers,
    RecordsInEvalMode,
    GradSampleModuleFastGradientClippingFSDP,
):
    """Opacus' fast-gradient-clipping module for FSDP2, recording in eval mode too: norms are kept on each layer."""


class PerExampleLayersShardedNormModule(KeepsPerExampleLayers, ShardedGhostNormModule):
    """Sharded ghost clipping's norm module, keeping the calls of the layers it measures by per-example gradients
    (each entry holds the layer as FSDP2 gathered it for its backward, and this rank's examples' inputs and output
    gradients)."""


class _NormsOnly:
    """Where the first pass's backward must go for every per-example norm to be recorded — and no further.

    In one process a layer's norm hook is a tensor hook on its output
    (:class:`~pl_dp.per_sample.gradients.HooksOutputGradients`), as is :class:`~pl_dp.per_sample.tied.TiedNorms`' on
    each module holding a tied weight: it fires when autograd has the gradient with respect to that output. Sharded,
    Opacus' norm hooks are full backward hooks: a layer's fires once autograd has the gradient with respect to the
    layer's input (at a node autograd inserts between that input and the layer), or, for a layer none of whose inputs
    needs a gradient (the first layer, an embedding of integer ids), with respect to its output. During the first
    pass's forward this records, per hooked call, the gradient edges just below those points: the call's inputs
    (below the inserted node, sharded), or its output if its inputs need no gradient. :meth:`plan` keeps the lowest
    of them — those below which no other lies — and ``torch.autograd.grad(loss, inputs=<them>)`` then runs exactly
    the nodes on a path from the loss to one of them: the gradient flows through every hooked layer, and every branch
    that only leads to a parameter (a layer's weight-gradient matmul, ``AccumulateGrad``) is pruned by autograd. The
    gradients it returns (of a few activations) are dropped.

    Sharded by FSDP2, the forward uses each layer's gathered parameters, not the shards: their identities are
    recorded too, so that a gathered parameter the loss reaches is named.

    The same walk checks that every use of a trainable parameter lies *inside* a call of a module that holds it —
    between the call's output and its inputs, where its hooks measure it. A weight read again elsewhere (``fc(x) + x @
    fc.weight.T``, a head tied by ``F.linear(h, embedding.weight)``, a loss that reads a weight) adds to the gradient
    but not to what the hooks measure: a sum taken from autograd's parameter gradients (sharded ghost clipping's) would
    under-clip its examples, by which one of them could move the sum by more than the clip bound, and a sum contracted
    in the hooks would silently leave that part of the gradient out. The check reads the graph's structure, so a use
    that only some examples switch on (a mask times the extra term) is found whatever the batch.

    With ``full_precision`` (sharded ghost clipping, whose second backward differentiates Σ_i c_i·ℓ_i through this
    graph) the walk also refuses a node whose gradient is below fp32 (bf16, fp16, float8) — a cast, an autocast region
    or a bf16 buffer in the forward: its rounding of c_i·g is not c_i times its rounding of g, so the sum would not be
    made of the gradients the norms were taken of (2·C released through ``.bfloat16().float()``, 1.74·C through a float8
    cast; independent reviews). What a node does inside its backward is not seen: an opaque node — a custom
    ``autograd.Function`` or a ``torch.compile``'d region — that rounds in lower precision while declaring fp32
    gradients moved one example's release to 1.001·C; book-keeping and one-process ghost clipping, whose sums are made
    of the output gradients their norms are taken of (the latter's computed again, deterministically and from the
    same random state), are exact there.
    """

    def __init__(
        self,
        hooked: list[nn.Module],
        tied: list[nn.Module],
        names: dict[nn.Module, str],
        raw: Iterable[nn.Module],
        *,
        mode: str,
        full_precision: bool = False,
    ):
        self.mode = mode  # the per_sample mode a refusal names
        self.full_precision = full_precision
        self.active = False
        self.edges: list[GradientEdge] = []
        #: per hooked call: the module, the nodes of its output and the nodes of its inputs (where the call ends)
        self.calls: list[tuple[nn.Module, list[Node], set[Node]]] = []
        #: the parameters of the holders as the forward saw them (sharded: gathered), by ``id``
        self.gathered: dict[int, tuple[str, nn.Module]] = {}
        self._handles = [m.register_forward_hook(self._below_hook) for m in hooked]
        self._handles += [m.register_forward_hook(self._below_module) for m in tied]
        self._names = names
        #: modules whose raw parameters :class:`~pl_dp.per_sample.raw.RawGradients` checks and measures
        self._raw = frozenset(raw)
        #: the modules whose parameters the walk checks are used inside their calls only
        self._holders = [m for m in names if m not in self._raw]

    def watch_gathered(self) -> None:
        """Record the parameters each layer's forward sees (sharded by FSDP2: its gathered ones, not the shards)."""
        holders = [m for m in self._names if any(p.requires_grad for p in m.parameters(recurse=False))]
        self._handles += [m.register_forward_pre_hook(self._parameters) for m in holders]

    def start(self) -> None:
        self.edges, self.calls, self.gathered, self.active = [], [], {}, True

    def stop(self) -> None:
        self.edges, self.calls, self.gathered, self.active = [], [], {}, False

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _below_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        """A layer with a norm hook: on its output (one process), or Opacus' full backward hook, which its inputs reach
        through autograd's hook node (sharded)."""
        if not (self.active and torch.is_grad_enabled()):
            return
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        self._call(module, inputs, output)
        if not inputs:  # the hook fires at the output
            self.edges += [get_gradient_edge(t) for t in output_tensors(output) if t.requires_grad]
            return
        node = inputs[0].grad_fn  # sharded: the node of the layer's full backward hook, one for all its tensor inputs
        if node is None or node.name() != "BackwardHookFunctionBackward":  # one process: the inputs themselves
            self.edges += [get_gradient_edge(a) for a in inputs]
            return
        self.edges += [GradientEdge(n, k) for n, k in node.next_functions if n is not None]

    def _below_module(self, module: nn.Module, args: tuple, output: Any) -> None:
        """A module holding a tied weight (no Opacus hook): its output's gradient is read by a tensor hook."""
        if not (self.active and torch.is_grad_enabled()):
            return
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        self._call(module, inputs, output)
        self.edges += [get_gradient_edge(t) for t in inputs or output_tensors(output) if t.requires_grad]

    def _call(self, module: nn.Module, inputs: list[torch.Tensor], output: Any) -> None:
        """Record where a hooked call's part of the graph begins (its output as the forward hooks before this one
        left it: in one process the unchangeable view of :class:`~pl_dp.per_sample.gradients.HooksOutputGradients`;
        sharded, before a full backward hook wraps it) and ends (the nodes its inputs come from)."""
        starts = [t.grad_fn for t in output_tensors(output) if t.grad_fn is not None]
        self.calls.append((module, starts, {a.grad_fn for a in inputs if a.grad_fn is not None}))

    def _parameters(self, module: nn.Module, args: tuple) -> None:
        if self.active:
            prefix = self._names[module]
            for name, p in module.named_parameters(recurse=False):
                self.gathered[id(p)] = (f"{prefix}.{name}" if prefix else name, module)

    def plan(self, root: Node) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """The recorded edges below which no other recorded edge lies (the gradient reaches all the others on its
        way to them), and the leaf tensors (``AccumulateGrad`` variables: parameters, gathered or not) that the graph
        of ``root`` reaches — those whose gradient, were it computed, would not be ``None``. Raises if a trainable
        parameter is used outside every call of the modules that hold it (see the class)."""
        targets: dict[Node, list[GradientEdge]] = {}
        for edge in self.edges:
            found = targets.setdefault(edge.node, [])
            if all(e.output_nr != edge.output_nr for e in found):
                found.append(edge)
        reaches: dict[Node, bool] = {}  # whether a target lies at the node or below it
        graph: dict[Node, list[Node]] = {}  # each node's children
        lowest: list[GradientEdge] = []
        leaves: list[torch.Tensor] = []
        half: set[str] = set()
        for node, children in children_first(root):
            graph[node] = children
            if self.full_precision and any(narrow(m.dtype) for m in node._input_metadata):
                half.add(type(node).__name__)
            below = any(reaches[n] for n in children)
            target = node in targets
            if target and not below:
                lowest += targets[node]
            reaches[node] = below or target
            if not children:
                variable = getattr(node, "variable", None)  # an AccumulateGrad node (a leaf of the graph)
                if isinstance(variable, torch.Tensor):
                    leaves.append(variable)
        if half:
            raise ValueError(
                f"per_sample={self.mode!r} cannot clip this sharded net: its graph computes below fp32 "
                f"({sorted(half)[:4]}: a cast, an autocast region or a bf16 buffer in the forward; found at this batch,"
                " the graph is checked at every one), and the second backward would round each clip weight's product "
                "with the gradient otherwise than the gradient whose norm set it. Use per_sample='bk' (the default), "
                "or compute the forward in fp32."
            )
        self._refuse_uses_outside_their_layers(graph)
        return lowest, leaves

    def _refuse_uses_outside_their_layers(self, graph: dict[Node, list[Node]]) -> None:
        """Raise naming the trainable parameters that a node of ``graph`` (each node's children) outside every call
        of their holders uses."""
        holders: dict[int, set[nn.Module]] = {}
        for module in self._holders:
            for p in module._parameters.values():
                if p is not None and p.requires_grad:
                    holders.setdefault(id(p), set()).add(module)
        for key, (_, module) in self.gathered.items():
            holders.setdefault(key, set()).add(module)
        inside: dict[Node, set[nn.Module]] = {}
        for module, starts, ends in self.calls:
            seen: set[Node] = set()
            stack = [n for n in starts if n not in ends]
            while stack:
                node = stack.pop()
                if node in seen:
                    continue
                seen.add(node)
                inside.setdefault(node, set()).add(module)
                children = graph.get(node)
                if children is None:  # a call's part of the graph the loss does not reach
                    children = [n for n, _ in node.next_functions if n is not None]
                stack += [n for n in children if n not in ends and n not in seen]
        outside: set[str] = set()
        for node, children in graph.items():
            for child in children:
                variable = getattr(child, "variable", None)
                owners = holders.get(id(variable), set()) if isinstance(variable, torch.Tensor) else set()
                if owners and not inside.get(node, set()) & owners:
                    outside.add(self._name_of(variable, owners))
        if outside:
            raise ValueError(
                f"per_sample={self.mode!r} cannot clip {sorted(outside)}: the net or the loss uses them outside the "
                "layer that holds them (e.g. a weight read again in another module's forward or in the loss, or an "
                "output head tied by F.linear(h, embedding.weight)), so that layer's hooks would measure only part of "
                "each example's gradient and under-clip it. Use each trainable parameter only through its layer (tie "
                "weights by sharing the parameter between nn.Linear/nn.Embedding modules), or per_sample='functorch'."
            )

    def _name_of(self, variable: torch.Tensor, modules: set[nn.Module]) -> str:
        if id(variable) in self.gathered:
            return self.gathered[id(variable)][0]
        module = next(iter(modules))
        prefix = self._names.get(module, "")
        name = next(n for n, p in module.named_parameters(recurse=False) if p is variable)
        return f"{prefix}.{name}" if prefix else name


class GhostClipping:
    """The clipped sum Σ_i c(‖g_i‖)·g_i of a batch for the trainable parameters of ``net``, by ghost clipping.

    Refused at construction, each with the parameter or layer named: trainable parameters in a precision below
    fp32 (or computed in half precision by an FSDP2 ``MixedPrecisionPolicy``), and trainable parameters tied across
    modules other than the weight of ``nn.Linear`` and ``nn.Embedding`` modules (a language-model head sharing the
    input embeddings is computed exactly, see :mod:`pl_dp.per_sample.tied`). Refused at the first batch: a layer
    called twice in one forward, a parameter whose norm the hooks cannot compute (used outside its module), a layer
    called on a tensor smaller than the batch (shared by it), and a layer that sees the batch merged with another
    dimension.
    A layer called on rows that are not examples but as many as the batch's (a table of B constant tokens every
    example reads) passes the first batch's checks: batches of other sizes tell it apart, which the fit-start check
    every method runs does (:func:`~pl_dp.per_sample.verify_per_example_gradients`, on batches of 2 and 3 examples);
    call it before using the engine directly. A net sharded by FSDP2 takes :class:`ShardedGhostClipping`.
    """

    #: the per-sample mode's name, as the refusals say it (a subclass reusing the first pass names its own)
    mode = "ghost"
    #: whether the first pass keeps its graph for a second backward (book-keeping has none: autograd frees the graph
    #: as the first backward goes)
    second_backward = True
    #: whether the second backward is of Σ_i c_i·ℓ_i, carrying the clip weights through the net's backward (sharded
    #: ghost clipping's, which FSDP2 reduce-scatters), rather than the first backward again
    weighted_backward = False

    def __init__(self, net: nn.Module, loss_fn: PerSampleLoss) -> None:
        self.net = net
        self.loss_fn = loss_fn
        self.names = [n for n, p in net.named_parameters() if p.requires_grad]
        self.params = [p for p in net.parameters() if p.requires_grad]
        #: each trained parameter by (holder, name): what a kept call's sums, which come by name, belong to
        self._trained = {
            (m, name): p for m in net.modules() for name, p in m.named_parameters(recurse=False) if p.requires_grad
        }
        if not self.params:
            raise ConfigError("the model has no trainable parameters (requires_grad=True): nothing to optimize.")
        mixing = batch_dependent_layers(net)
        if mixing:
            raise ConfigError(
                f"per_sample={self.mode!r} cannot clip layers whose gradient depends on the whole batch: {mixing}. "
                "An embedding with scale_grad_by_freq divides its gradient by the batch's token counts, so one "
                "example would change the others' contributions to the clipped sum. Use per_sample='functorch' "
                "(each example's gradient computed alone) or set scale_grad_by_freq=False."
            )
        full = (torch.float32, torch.float64)
        low = [f"{n} ({p.dtype})" for n, p in zip(self.names, self.params) if p.dtype not in full]
        if low:
            raise ConfigError(
                f"per_sample={self.mode!r} needs fp32 trainable parameters, got {low[:3]}"
                f"{' …' if len(low) > 3 else ''}: the clipped sum comes out of autograd in the parameters' dtype, and "
                "summing clipped gradients in half precision would let one example move it by more than the clip "
                "bound. Load the model in fp32 (Trainer(precision='bf16-mixed') keeps fp32 weights) or use "
                "per_sample='hooks'."
            )
        frozen = [f"{n} ({p.dtype})" for n, p in net.named_parameters() if p.dtype not in full]
        if frozen and self.weighted_backward:
            raise ConfigError(
                f"per_sample={self.mode!r} cannot clip a sharded net with half-precision parameters, frozen ones "
                f"included ({frozen[:3]}{' …' if len(frozen) > 3 else ''}): its second backward carries the clip "
                "weights through their half-precision arithmetic, which rounds c_i·g_i otherwise than the g_i whose "
                "norm set c_i (one example released 1.011·C through a frozen bf16 layer). Use per_sample='bk' (the "
                "default), whose sums come from the very backward its norms do, or load the frozen parameters in fp32 "
                "(one process's ghost clipping sums the output gradients its norms are taken of, and takes them)."
            )
        policies = half_precision_policies(net)
        if policies:
            raise ConfigError(
                f"per_sample={self.mode!r} needs its passes to compute in fp32, but FSDP2 shards {policies[:3]} "
                "under a half-precision MixedPrecisionPolicy: the norms would be taken of half-precision gradients "
                "and the clipped sum rounded or reduced in half precision, which lets one example move it by more "
                "than the clip bound (16·C under ghost clipping, found by an independent review). Shard without a "
                "half-precision mp_policy (pl_dp shards the net itself when its configure_model does not); under "
                "Trainer(precision='bf16-mixed') the passes turn autocast off and run in fp32."
            )
        refuse_unsupported_layers(net, self.mode)
        shared = unsupported_ties(net)
        if shared:
            raise ConfigError(
                f"per_sample={self.mode!r} cannot clip these parameters tied across modules: {'; '.join(shared)}. A "
                "shared parameter's per-example norm is that of the sum of its uses' gradients. Freeze or untie "
                "them, or use per_sample='hooks'."
            )
        self._check_layout()
        self._tied = TiedNorms(net)  # no tie when sharded (refused): nothing to do
        self._raw = RawGradients(raw_parameter_modules(net), self.mode)  # none when sharded (refused)
        options = dict(batch_first=True, loss_reduction="sum", strict=True, use_ghost_clipping=True)
        self._gsm = self._norm_module(options)
        self._gsm.layer_names = {m: name or "<the net itself>" for name, m in net.named_modules()}
        self._gsm.disable_hooks()
        hooked = [m for m in self._gsm.iterate_submodules(net) if type(m) not in OPACUS_RNNS]
        modules = {m: name for name, m in net.named_modules()}
        self._targets = _NormsOnly(
            hooked,
            list(self._tied.modules),
            modules,
            self._raw.modules,
            mode=self.mode,
            full_precision=self.weighted_backward,
        )
        self._lookups = BroadcastLookups(net)
        self._raw.keep = True
        #: where the first pass's backward went (its root, its targets, the random state it started from), for the
        #: second to go again
        self._again: tuple[torch.Tensor, list[Any], tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def _check_layout(self) -> None:
        sharded = is_sharded(self.params)
        if sharded != isinstance(self, ShardedGhostClipping):
            raise ConfigError(
                f"the net's parameters are{'' if sharded else ' not'} sharded by FSDP2, and {type(self).__name__} "
                f"is for {'one process' if sharded else 'a sharded net'}: get_per_sample_mode({self.mode!r}).build "
                "chooses the class for the net's layout."
            )

    def _norm_module(self, options: dict[str, Any]) -> GradSampleModuleFastGradientClipping:
        """Opacus' module whose hooks record the per-example norms (the modules of tied and raw parameters skipped)."""
        return PerExampleLayersNormModule(
            self.net, skipped=frozenset([*self._tied.modules, *self._raw.modules]), **options
        )

    def clipped_sum(
        self, batch: Any, clip_fn: ClipFunction, rows: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Σ_i c(‖g_i‖)·g_i per parameter (fp32), the per-example norms ‖g_i‖ (fp32) and the non-finite count.

        The same three values as :func:`~pl_dp.per_sample.clipped_sum` of the per-example gradients. ``rows`` (a
        boolean mask over the batch) sums those rows only, the others at weight 0 (the fit-start probe's watched
        examples).
        """
        size = batch_size_of(batch)
        norms, losses = self._norms(batch, size)
        weights, finite = clip_fn.finite_weights(norms)
        counted = torch.ones_like(finite) if rows is None else rows.to(finite.device)
        weights = weights * counted
        nonfinite = (~finite & counted).sum()
        if self._any_nonfinite(finite):  # 0·NaN is NaN: the others' sum is computed again without them
            del losses
            self._take_book()  # and this pass's graph
            keep = finite.nonzero().squeeze(1)
            if keep.numel():
                part, kept = _finite_rows(batch, keep, counted, size)
                sums, _, more = self.clipped_sum(part, clip_fn, rows=kept)
            else:
                sums, more = self._sum_of_none(clip_fn)
            nonfinite = nonfinite + more
        else:
            sums = self._weighted_sum(losses, weights)
        self._lookups.check(self.loss_fn, batch, size)
        return sums, norms[counted], nonfinite

    def per_example_norms(self, batch: Any) -> torch.Tensor:
        """The per-example gradient norms ‖g_i‖ (fp32) that the first pass computes, and nothing else."""
        try:
            return self._norms(batch, batch_size_of(batch))[0].detach()
        finally:
            self._take_book()

    def _any_nonfinite(self, finite: torch.Tensor) -> bool:
        """Whether the passes must run again without some examples (a non-finite norm)."""
        return not bool(finite.all())

    def _sum_of_none(self, clip_fn: ClipFunction) -> tuple[list[torch.Tensor], torch.Tensor | int]:
        """The clipped sum when every example of the pass had a non-finite norm, and how many more it dropped."""
        return [torch.zeros_like(p, dtype=torch.float32) for p in self.params], 0

    def close(self) -> None:
        """Remove Opacus' hooks from the net (before another fit builds its own on the trainable set it has then)."""
        self._gsm.remove_hooks()
        self._tied.close()
        self._raw.close()
        self._targets.close()

    def reset(self) -> None:
        """Clear what a pass that raised left in the hooks (:func:`~pl_dp.per_sample.gradients.clear_hook_state`)."""
        clear_hook_state(self.net, self.params)
        self._tied.clear()
        self._raw.clear()
        self._targets.stop()
        self._take_book()

    def _first_backward(self, losses: torch.Tensor) -> list[torch.Tensor]:
        """The first pass's backward, of Σ_i ℓ_i with the graph kept, for the norm hooks only: no parameter gradient
        is computed (:class:`_NormsOnly`). It also returns the gradients that the per-example gradients of raw
        parameters beside layers are computed from (:meth:`~pl_dp.per_sample.raw.RawGradients.plan`: at LayerScale
        products, or at a module's outputs), keeping the graph if they need it. Returns the leaf tensors the loss
        depends on."""
        total = losses.sum()
        if total.grad_fn is None:  # no graph: what the backward with respect to the parameters raised
            torch.autograd.grad(total, self.params, allow_unused=True)
        root = total.grad_fn if total.grad_fn is not None else get_gradient_edge(total).node
        lowest, leaves = self._targets.plan(root)
        raw = self._raw.plan(root, losses.shape[0])
        if lowest or raw:
            retain = self.second_backward or self._raw.needs_graph
            state = _random_state(total.device) if self.second_backward else None
            with _repeatable(total.device) if self.second_backward else contextlib.nullcontext():
                grads = torch.autograd.grad(total, lowest + raw, retain_graph=retain, allow_unused=True)
            self._raw.output_grads = list(grads[len(lowest) :])
            if state is not None:
                self._again = (total, lowest + raw, state)
        return leaves

    def _norms(self, batch: Any, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """First pass: the per-example gradient norms (fp32) and the per-example losses, graph kept."""
        self._refuse_frozen()
        self._take_book()  # what an earlier pass kept and no sum took
        for p in self.params:
            p._norm_sample = None
        gsm = self._gsm
        gsm.enable_hooks()
        self._tied.start()
        self._raw.start()
        self._targets.start()
        try:
            with torch.enable_grad(), full_precision(self.params[0].device), self._lookups.expanding(size):
                losses = check_per_sample(self.loss_fn(gsm, batch), size)
                reached = {id(t) for t in self._first_backward(losses)}
        except BaseException:
            self._tied.clear()
            self._raw.clear()
            raise
        finally:
            self._targets.stop()
            gsm.disable_hooks()
            clear_hook_state(self.net, self.params)
        # autocast off, as for the passes: a tied weight's norm (its Gram products) rounded in bf16 would set a clip
        # weight for a sum computed in fp32 (1.004·C found by review); hooks off: the raw parameters' batched backward
        # may pass through hooked layers
        try:
            with full_precision(self.params[0].device):
                not_per_example = self._tied.finish(size)  # the tied parameters' norms, cross terms included
                not_per_example += self._raw.finish(size)
        except BaseException:
            self._raw.clear()
            raise
        missed = []
        for name, p in zip(self.names, self.params):
            norm = p._norm_sample
            if norm is None:
                if id(p) in reached:
                    missed.append(name)
                p._norm_sample = torch.zeros(size, device=p.device)  # a parameter the loss does not use
            elif norm.shape != (size,):
                not_per_example.append(name)
        if missed:  # a zero in place of a norm would let the parameter's part of the gradient pass unclipped
            raise RuntimeError(
                f"the loss depends on {missed}, but Opacus' ghost-clipping hooks recorded no per-example norm for "
                "them: they are used outside the module that holds them (e.g. a weight read directly in another "
                "module's forward), or their layer's input has a shape its norm sampler does not handle. Use "
                "per_sample='hooks' or 'functorch'."
            )
        self._refuse_calls_not_on_the_batch(not_per_example, size)
        with full_precision(self.params[0].device):
            norms = gsm.get_norm_sample().float()  # ‖g_i‖ over all trainable parameters
        gsm.per_sample_gradient_norms = None  # Opacus keeps them: un-noised per-example values of the batch
        for p in self.params:
            p._norm_sample = None
        return norms, losses

    def _refuse_frozen(self) -> None:
        """Raise naming the parameters this engine trains that are frozen now (the hooks would measure the others
        only, and the sums be of the others; book-keeping's would miss theirs), on every rank alike."""
        frozen = [name for name, p in zip(self.names, self.params) if not p.requires_grad]
        if frozen:
            raise ConfigError(
                f"per_sample={self.mode!r} was built to train {frozen[:3]}{' …' if len(frozen) > 3 else ''}, which are "
                "frozen now: freeze or unfreeze parameters before a fit starts (its engine is built then), not during "
                "it."
            )

    def _weighted_sum(self, losses: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
        """Second pass: the first pass's backward again, of Σ_i ℓ_i to the same targets (no parameter gradient),
        whose hooks hand each call of a layer measured by a norm sampler, and each use of a tied weight, with its
        output gradient — the one its norm was taken of, computed again by the same operations — to be contracted
        with the clip weights at once (:func:`~pl_dp.per_sample.book.weighted_sum`: float64, rounded once); every
        other parameter's sum is made of the per-example gradients its norm came from (the first pass's book, the
        raw parameters' gradients). Each example's part of the release is thus c_i times the very gradient whose
        norm set c_i, as in book-keeping. A backward of Σ_i c_i·ℓ_i (up to pl_dp 0.2) rounded c_i·g_i otherwise
        than g_i inside the net's backward, and added an example's positions in fp32 in the weight-gradient
        matmuls: an example of 2¹⁷ positions planted to round one way moved the release by 2–4·C."""
        weights = weights.detach().float()
        sums: dict[int, torch.Tensor] = {}
        again, self._again = self._again, None
        if again is not None:
            total, targets, state = again
            self._gsm.sink = self._tied.sink = lambda entry: self._add_book_sums(sums, [entry], weights)
            try:
                _set_random_state(state, total.device)
                with torch.enable_grad(), full_precision(total.device), _repeatable(total.device):
                    torch.autograd.grad(total, targets, allow_unused=True)
            finally:
                self._gsm.sink = self._tied.sink = None
            del total, targets, state, again
        book, raw = self._take_book()
        self._add_book_sums(sums, book, weights)
        with full_precision(self.params[0].device):
            for p, g in raw.items():
                total = torch.einsum("b,b...->...", weights, g)
                sums[id(p)] = total if id(p) not in sums else sums[id(p)].add_(total)
        return [sums.get(id(p), torch.zeros_like(p, dtype=torch.float32)) for p in self.params]

    def _add_book_sums(self, sums: dict[int, torch.Tensor], book: list[Entry], weights: torch.Tensor) -> None:
        """Add each kept call's Σ_i c_i·g_i (fp32, autocast off; :func:`~pl_dp.per_sample.book.weighted_sum`) into
        ``sums``, by the ``id`` of the trained parameter it is of."""
        with full_precision(self.params[0].device):
            for entry in book:
                for p, total in self._of_trained(
                    entry[0], weighted_sum(self._gsm.GRAD_SAMPLERS, entry, weights)
                ).items():
                    sums[id(p)] = total if id(p) not in sums else sums[id(p)].add_(total)

    def _calls_not_on_the_batch(self, size: int, *, fewer: bool = False) -> list[str]:
        """The kept layers called on a tensor whose first dimension is not the batch's (``fewer``: smaller than the
        batch's — a tensor the batch shares)."""
        book = getattr(self._gsm, "book", [])
        return sorted(
            {
                self._gsm.layer_names.get(m, "?")
                for m, _, grads in book
                if (grads.shape[0] < size if fewer else grads.shape[0] != size)
            }
        )

    def _refuse_calls_not_on_the_batch(self, not_per_example: list[str], size: int) -> None:
        """Refuse the parameters ``not_per_example`` and the kept layers called on a tensor whose first dimension is
        not the batch's. A layer shared between the batch and a learned token broadcast over it gets that call's
        gradient added to the first example's row by Opacus, so neither its norms nor a sum of its rows would be per
        example (18,378·C moved, found by review)."""
        shared = self._calls_not_on_the_batch(size, fewer=True)
        if shared:
            raise RuntimeError(
                f"per_sample={self.mode!r} cannot clip {shared}: called in one forward on the batch ({size} "
                "examples) and on a tensor the batch shares (e.g. a learned token normalized before it is "
                "broadcast), whose gradient Opacus' hooks add to the first example's. Apply the layer after "
                "broadcasting, or use per_sample='functorch' (each example's gradient computed alone)."
            )
        refuse_rows_not_examples(not_per_example + self._calls_not_on_the_batch(size), size, "gradient norms")

    def _of_trained(self, module: nn.Module, values: dict[str, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """``values`` of ``module``'s parameters by name (:mod:`.book`), keyed by the trained parameters they are of."""
        unknown = [name for name in values if (module, name) not in self._trained]
        if unknown:
            raise RuntimeError(
                f"per_sample={self.mode!r} computed sums of {unknown} of {self._gsm.layer_names.get(module, '?')!r}, "
                "which it does not train: the layer's parameters changed after the engine was built."
            )
        return {self._trained[(module, name)]: value for name, value in values.items()}

    def _take_book(self) -> tuple[list[Entry], dict[nn.Parameter, torch.Tensor]]:
        """What the first pass kept for the sums made of per-example gradients (taken: it is not kept after)."""
        book, raw = getattr(self._gsm, "book", []), self._raw.grads
        self._gsm.book, self._raw.grads, self._again = [], {}, None
        if isinstance(self._gsm, SumsInASecondBackward):
            self._gsm.inputs = {}
        return book, raw


class ShardedGhostClipping(GhostClipping):
    """Ghost clipping of a net sharded by FSDP2 (see the module's docstring): every rank runs the same passes, the
    first computes no parameter gradient, the second's ``backward`` leaves each rank its shard of the clipped sum over
    all ranks for the layers measured by a norm sampler, and the other layers' sums are made of per-example gradients
    and added over the ranks (:meth:`_weighted_sum`). ``passes`` is what the passes of the step share
    (:class:`~pl_dp.step.passes.ShardedPasses`: the guard that keeps the ranks' forwards in step, the padding
    example). Parameters tied across modules are refused.
    """

    weighted_backward = True

    def __init__(self, net: nn.Module, loss_fn: PerSampleLoss, *, passes: ShardedPasses) -> None:
        if tied_parameters(net):
            names = [" = ".join(name for name, _ in found) for _, found in tied_parameters(net)]
            raise ConfigError(
                f"per_sample={self.mode!r} cannot clip parameters tied across modules on a sharded net: {names}. Train "
                "them in one process, freeze or untie them."
            )
        whole = [
            name or "<the net itself>"
            for name, m in net.named_modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
            and layer_type(m) not in ShardedGhostNormModule.GRAD_SAMPLERS
        ]
        if whole:  # Opacus' per-example gradients of a module (functorch) copy it, which FSDP2 refuses
            raise ConfigError(
                f"per_sample={self.mode!r} on a net sharded by FSDP2 measures only layers with a norm sampler; "
                f"{whole[:3]} hold raw parameters, whose per-example gradients are computed in one process only (a "
                "leaf module's by Opacus on a copy of it, which FSDP2 does not allow; those beside layers from the "
                "live graph, not on shards). Freeze them, move them into a layer, or train in one process."
            )
        self.passes = passes
        self._reached: list[torch.Tensor] = []  # the leaves the last first pass's graph reaches
        super().__init__(net, loss_fn)
        self._targets.watch_gathered()
        self._layouts = {p: layout_of(name, p) for name, p in zip(self.names, self.params)}
        #: the parameters the second backward sums: those of layers measured by a norm sampler (linear layers,
        #: embeddings: norms floored at a share of their positions' mass, :mod:`.gram`)
        self._by_backward = {
            id(p)
            for m in net.modules()
            if layer_type(m) in self._gsm.NORM_SAMPLERS
            for p in m.parameters(recurse=False)
        }

    def _norm_module(self, options: dict[str, Any]) -> GradSampleModuleFastGradientClipping:
        return PerExampleLayersShardedNormModule(self.net, **options)

    def _norms(self, batch: Any, size: int, padding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """First pass, sharded: ``backward`` of Σ_i ℓ_i with the graph kept and no reduce-scatter (the unclipped
        gradient stays on its rank and is dropped); the norms are read off the layers (and taken off them:
        un-noised per-example values). A loss that raises on any rank makes every rank raise
        :class:`~pl_dp.step.seal.PassFailed` before the backward — or, raised by the padding example (a net or loss
        broken for a fixed non-private example), a ``RuntimeError`` on every rank. A net refused after the backward
        on one rank (a layer whose norms have another length than its batch, which may be this rank's batch size
        only) is refused on every rank (one all-reduce): the others would wait at their next collective."""
        self._refuse_frozen()
        self._take_book()  # what an earlier pass kept and no sum took
        refused: RuntimeError | None = None
        gsm = self._gsm
        holders = {
            id(p): (f"{prefix}.{name}" if prefix else name, m)
            for prefix, m in self.net.named_modules()
            for name, p in m.named_parameters(recurse=False)
        }
        gsm.enable_hooks()
        self._targets.start()
        try:
            with torch.enable_grad(), full_precision(self.params[0].device), self._lookups.expanding(size):
                error: Exception | None = None
                try:
                    with self.passes.guard(backward_follows=True):
                        losses = check_per_sample(self.loss_fn(gsm, batch), size)
                except Exception as raised_here:  # noqa: BLE001 - agreed on by every rank before the backward
                    error = raised_here
                self.passes.check(error, padding=padding)
                reached = self._reached = self._first_backward(losses)  # no parameter gradient: no reduce-scatter
            names = dict(zip(map(id, self.params), self.names))
            owners = {**holders, **self._targets.gathered}  # a shard used directly, or its layer's gathered copy
            missed = sorted(
                {
                    names.get(id(t), owners[id(t)][0])
                    for t in reached
                    if id(t) in owners and not _measured(owners[id(t)][1])
                }
            )
            recorded = any("norm_sample" in m.__dict__ for m in self.net.modules())
            for module in gsm.iterate_submodules(gsm._module) if recorded and not missed else ():
                if "norm_sample" not in module.__dict__:  # a layer this pass did not run (a training-only head)
                    module.norm_sample = [torch.zeros(size, device=losses.device)]
            norms = torch.zeros(size, device=losses.device)
            if recorded and not missed:
                try:
                    norms = gsm.get_norm_sample().float().reshape(-1)
                except RuntimeError as error:  # Opacus stacks the layers' norms: some not of this batch's length
                    refused = error
        finally:
            self._targets.stop()
            gsm.disable_hooks()
            gsm.per_sample_gradient_norms = None  # Opacus keeps them: un-noised per-example values of the batch
            clear_hook_state(self.net, self.params)
        try:
            if missed:
                raise RuntimeError(f"Opacus' FSDP ghost-clipping hooks recorded no per-example norm for {missed}.")
            if refused is not None:
                raise RuntimeError(f"per_sample={self.mode!r} cannot clip this net: {refused}") from refused
            self._refuse_calls_not_on_the_batch([] if norms.shape == (size,) else ["the net"], size)
        except RuntimeError as error:
            refused = error
        if self.passes.agree(int(refused is not None)):
            raise refused or RuntimeError(
                f"per_sample={self.mode!r} cannot clip this net: another rank refused it after its first pass (its "
                "error says why)."
            )
        return norms, losses

    def _any_nonfinite(self, finite: torch.Tensor) -> bool:
        """Whether any rank saw a non-finite norm (one all-reduce): then every rank runs its passes again, without
        its non-finite examples."""
        return bool(self.passes.agree(int(not finite.all())))

    def _sum_of_none(self, clip_fn: ClipFunction) -> tuple[list[torch.Tensor], torch.Tensor | int]:
        """Every example here had a non-finite norm: the passes the other ranks run, on the padding example."""
        return self.padding_sum(self.passes.padding, clip_fn)[0], 0

    def padding_sum(self, batch: Any, clip_fn: ClipFunction) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The passes of a rank with no examples left in a round, on the padding example ``batch`` at weight 0 (again if
        another rank runs its passes again): its shard of the other ranks' clipped sum, no norm, no count. Its
        backward gives every gradient the pass reaches the value 0 before FSDP reduces it: the padding example's
        own gradient may be non-finite at the current parameters, and 0·∞ = NaN would reach every rank's sum at the
        steps where some rank pads, which depend on the sample."""
        size = batch_size_of(batch)
        norms, losses = self._norms(batch, size, padding=True)
        if self._any_nonfinite(torch.ones(size, dtype=torch.bool, device=norms.device)):
            del losses
            return self.padding_sum(batch, clip_fn)
        sums = self._weighted_sum(losses, torch.zeros_like(norms), zeroed=self._reached)
        self._lookups.check(self.loss_fn, batch, size)
        return sums, norms[:0], torch.zeros((), dtype=torch.long, device=norms.device)

    def _weighted_sum(
        self, losses: torch.Tensor, weights: torch.Tensor, zeroed: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Second pass, sharded: ``backward`` of Σ_i c_i·ℓ_i (deterministic algorithms, from the first's random state,
        as on one process), whose reduce-scatter leaves this rank its shard of Σ_i c_i·g_i over every rank's examples,
        for the parameters of the layers measured by a norm sampler (the gradients of the leaves ``zeroed`` are set to 0
        first). The other parameters' sums are made of the per-example gradients their norms came from (the first pass's
        book; zeros for ``zeroed``, the padding example's, which may be non-finite), summed over the ranks one parameter
        at a time in the parameters' order, of which this rank keeps its block — as one process does, and for the same
        reason (see :meth:`GhostClipping._weighted_sum`)."""
        again, self._again = self._again, None
        book, _ = self._take_book()
        for p in self.params:
            p.grad = None
        handles = [leaf.register_hook(torch.zeros_like) for leaf in zeroed or () if leaf.requires_grad]
        try:
            device = self.params[0].device
            if again is not None:  # from the random state the first backward started from, as on one process
                _set_random_state(again[2], device)
            with torch.enable_grad(), full_precision(device), _repeatable(device):
                (weights.detach() * losses).sum().backward()
        finally:
            for handle in handles:
                handle.remove()
            self._reached = []
        from_book: dict[int, torch.Tensor] = {}
        self._add_book_sums(from_book, book if zeroed is None else [], weights.detach().float())
        del book
        sums = []
        for p in self.params:  # the second backward's gradient of a parameter summed from the book is not used
            if id(p) not in self._by_backward:
                whole_sum = from_book.pop(id(p), None)
                zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                sums.append(self._block_over_ranks(p, zeros if whole_sum is None else whole_sum))
            elif p.grad is None:
                sums.append(torch.zeros_like(local(p), dtype=torch.float32))
            else:
                sums.append(local(p.grad).float())
            p.grad = None
        return sums

    def _block_over_ranks(self, param: nn.Parameter, whole_sum: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``whole_sum`` — a sum over this rank's examples, whole-shaped — summed over the ranks
        (an all-reduce that every rank calls, for the same parameters in the same order)."""
        layout = self._layouts[param]
        summed = sum_over_ranks_(whole_sum, layout.group)
        return summed[slice(*layout.rows)].clone() if param.dim() else summed


def batch_dependent_layers(net: nn.Module) -> list[str]:
    """The trainable layers whose gradient is not a sum of per-example gradients, by name: ``nn.Embedding`` with
    ``scale_grad_by_freq`` (divided by the batch's token counts). From the net's structure alone."""
    return [
        f"{name or '<the net itself>'!r} (Embedding with scale_grad_by_freq)"
        for name, m in net.named_modules()
        if isinstance(m, nn.Embedding) and m.scale_grad_by_freq and m.weight.requires_grad
    ]


def _measured(module: nn.Module) -> bool:
    """Whether Opacus' FSDP hooks recorded a norm for every trainable parameter of ``module`` in this pass: its hook
    starts each at zeros of shape ``[B, 1]`` and writes a ``[B]`` norm over it for each parameter its sampler
    measures, so a layer whose input its sampler does not handle (Opacus' linear norm on 4-D inputs, which pl_dp
    used until :func:`~pl_dp.per_sample.gram.linear_norms`) would otherwise count at norm 0 — unclipped (found by an
    independent review)."""
    recorded = module.__dict__.get("norm_sample")
    return recorded is not None and all(norm.dim() == 1 for norm in recorded)


def _finite_rows(batch: Any, keep: torch.Tensor, counted: torch.Tensor, size: int) -> tuple[Any, torch.Tensor]:
    """The rows ``keep`` of ``batch`` (its finite ones), filled back to ``size`` rows with copies of the first — the
    passes keep the batch's shape, whose rounding in half precision every row's result depends on — and the mask of
    the rows to sum: the ``counted`` among them, not the copies."""
    rows = torch.zeros(size, dtype=torch.bool, device=counted.device)
    rows[: keep.numel()] = counted[keep.to(counted.device)]
    return fill_rows(select_examples(batch, keep), size), rows


#: the settings of ``CUBLAS_WORKSPACE_CONFIG`` under which cuBLAS computes alike every time (PyTorch's reproducibility
#: notes)
_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


@contextlib.contextmanager
def _repeatable(device: torch.device) -> Iterator[None]:
    """Run a backward under ``torch.use_deterministic_algorithms(True)``, so that running it again computes the same
    values: on the CPU too, where ``index_put_`` with ``accumulate`` (the backward of indexing with repeated indices)
    otherwise adds with atomic operations across threads, in another order each time — through it an independent
    review released 7.6e7·C under ghost clipping. On a CUDA device cuBLAS computes alike only under a
    ``CUBLAS_WORKSPACE_CONFIG`` set before the process starts: refused without it (a ``ConfigError``, the same at
    every batch), as an operation with no deterministic implementation is refused by torch."""
    if device.type == "cuda" and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _DETERMINISTIC_CUBLAS:
        raise ConfigError(
            "per_sample='ghost' runs its first backward again and sums the output gradients the second computes, "
            "which must be the first's: on a CUDA device that needs deterministic cuBLAS, set "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before the process starts. Or use per_sample='bk' "
            "(the default), whose sums come from its one backward."
        )
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch's random state (the CPU generator's, and ``device``'s on a CUDA device) before a backward that will be
    run again: a backward that draws — stochastic rounding in a custom ``autograd.Function``, an activation checkpoint
    that recomputes dropout without ``preserve_rng_state`` — draws the same numbers the second time (2.05·C released
    through such a checkpoint before, an independent review)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_random_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
