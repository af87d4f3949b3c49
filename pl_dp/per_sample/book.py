"""What book-keeping keeps of a layer's call (its inputs and output gradient), and the per-example gradients and
their weighted sum Σ_i c_i·g_i computed from it.

Bu, Wang, Zha & Karypis, 2023, "Differentially Private Optimization on Large Model at Small Cost" (ICML), Alg. 1:
a layer's weight gradient is a contraction of what it saw in the forward and backward, so once the clip weights
c_i are known its clipped sum needs no second backward. :mod:`pl_dp.per_sample.bk` computes every layer's sum this
way from what it kept; :mod:`pl_dp.per_sample.ghost` the sums of the layers it measures by per-example gradients
(LayerNorm, RMSNorm, convolutions) from what it kept, and, on one process, the others' from each call's output
gradient as its second backward computes it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
from torch import nn
from torch.distributed.fsdp import FSDPModule

from pl_dp.per_sample.gram import rows_per_chunk

#: what the book keeps of one call of a layer: the layer, its inputs, its output gradient (batch first)
Entry = tuple[nn.Module, list[torch.Tensor], torch.Tensor]


def layer_type(module: nn.Module) -> type:
    """The layer class ``module`` is measured as: its own, or for a layer FSDP2 sharded (whose class it swaps for
    ``FSDP<Layer>(FSDPModule, <Layer>)``) the layer's, as Opacus' FSDP module looks its samplers up."""
    kind = type(module)
    return kind.__bases__[1] if isinstance(module, FSDPModule) else kind


def transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``Conv1D`` (GPT-2): ``x @ W + b`` with ``W`` stored ``[in, out]``. Told
    by name, so that this plain-torch layer imports no ``transformers``."""
    kind = layer_type(module)
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers.")


class KeepsBook:
    """Mixin for Opacus' norm modules: keeps, per hooked call of a layer it :meth:`keeps`, the inputs and output
    gradient its norm was computed from (:attr:`book`), for a clipped sum made of those per-example quantities."""

    book: list[Entry]

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)  # type: ignore[call-arg]  # the Opacus module mixed in after this
        self.book = []

    def keeps(self, module: nn.Module) -> bool:
        """Whether the calls of ``module`` go in the book (every hooked layer's here)."""
        return True

    def rearrange_grad_samples(
        self, *, module: nn.Module, backprops: torch.Tensor, loss_reduction: str, batch_first: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        activations, backprops = super().rearrange_grad_samples(  # type: ignore[misc]
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first
        )
        if self.keeps(module):
            record_versions([backprops])  # it is the live gradient's alias: a later backward may change it in place
            self.book.append((module, activations, backprops))
        return activations, backprops


def reads_inputs(module: nn.Module) -> bool:
    """Whether the per-example norms and sums of ``module``'s trainable parameters read its inputs: not for a linear
    layer (``nn.Linear``, Hugging Face's ``Conv1D``) that trains its bias alone (BitFit), whose bias gradient is the sum
    of its output gradients — and for whose frozen weight autograd saves no input, so a forward may change it."""
    trained = [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]
    return trained != ["bias"] or not (layer_type(module) is nn.Linear or transposed_linear(module))


def record_versions(tensors: Iterable[Any]) -> None:
    """Remember the version of each tensor a layer's call is measured from (autograd's in-place counter, which a
    detached tensor shares with the one it was detached from), for :func:`refuse_changed_inputs`."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t._pl_dp_version = t._version  # type: ignore[attr-defined]


def refuse_changed_inputs(tensors: Iterable[Any], layer: str) -> None:
    """Raise if a tensor :func:`record_versions` saw was changed in place since: by the forward after the layer's call
    (``out = fc(x); x.mul_(5)``), by the loss (token ids masked in place), or by a backward that overwrites a tensor it
    kept. The passes compute no weight gradient, so autograd never unpacks its saved copy and its own version check
    never runs: a norm or sum taken of the changed values would be silently wrong (a sum 5× the gradient), or the
    norm of one and the sum of the other (2.5·C released under book-keeping, a custom backward overwriting the next
    layer's input; independent reviews). Whether it happens depends on the net's code, not on the examples. The
    callers skip the layers whose sums do not read their inputs (:func:`reads_inputs`)."""
    if any(isinstance(t, torch.Tensor) and getattr(t, "_pl_dp_version", t._version) != t._version for t in tensors):
        raise RuntimeError(
            f"cannot clip {layer}: its input was changed in place after the layer used it (in the forward, the loss "
            "or a custom backward), so its per-example norm or clipped sum would be taken of the changed values, not "
            "of those the layer computed with. Change a copy (x = x.clone()) instead."
        )


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Each row's (last dimension's) bits read as integers of their width and summed, wrapping around: the same for two
    tensors of the same bits, and for two that differ only by a rare coincidence — what tells ghost clipping's second
    backward from its first. Integers of the values' own width add without a copy, at the speed of a float sum (a
    float64 or int64 sum converts every value first: 13× slower here)."""
    rows = tensor.detach().contiguous().reshape(-1, tensor.shape[-1] if tensor.dim() else 1)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[rows.element_size()]
    return rows.view(bits).sum(-1, dtype=bits)


def refuse_changed_gradient(grad: torch.Tensor, layer: str) -> None:
    """Raise if a kept output gradient (which :class:`KeepsBook` kept, its version recorded) was changed in place
    after its norm was taken: autograd hands one gradient tensor to every branch of a sum, and a custom backward on
    another branch that changes its incoming gradient in place changes the kept one, of which the sum would then be
    made (1.36·C released under book-keeping; found by an independent review)."""
    if getattr(grad, "_pl_dp_version", grad._version) != grad._version:
        raise RuntimeError(
            f"cannot clip {layer}: its output gradient was changed in place after its norm was taken (a custom "
            "backward that changes the gradient it is given, on another branch), so the clipped sum would not be made "
            "of the gradient the norm was taken of. Change a copy in that backward (g = g * scale, not g.mul_(scale))."
        )


def refuse_another_gradient(grad: torch.Tensor, first: torch.Tensor, layer: str) -> None:
    """Raise if the output gradient ``grad`` of a second backward is not the one whose :func:`fingerprint` the first
    took: a backward that changes what it reads (a custom ``autograd.Function`` that keeps a tensor on ``ctx`` and
    overwrites it: 1.73·C released), or that draws from a generator torch's random state does not hold (Python's,
    NumPy's, a module's own ``torch.Generator``: 1.008·C; independent reviews)."""
    if not torch.equal(fingerprint(grad), first):
        raise RuntimeError(
            f"per_sample='ghost' cannot clip {layer}: the backward run again computed another output gradient than "
            "the first (a custom backward that changes what it reads, or draws from a generator other than torch's "
            "own), and the sum would not be made of the gradient the norm was taken of. Use per_sample='bk' (the "
            "default), whose sums come from its one backward."
        )


def per_example_gradients(samplers: Mapping[type, Any], entry: Entry) -> dict[str, torch.Tensor]:
    """The per-example gradients ``[B, *p.shape]`` of one kept call's trainable parameters, by their names in the
    layer, from Opacus' sampler of its layer (``samplers``: its registry; ``torch.func`` for a leaf module of raw
    parameters), the ``padding_idx`` row of an embedding at zero as autograd leaves it. By name, not by tensor:
    FSDP2 swaps a layer's parameters between the shards that are trained and the gathered copies (which it keeps
    after the backward under ``set_reshard_after_backward(False)``)."""
    module, activations, backprops = entry
    if reads_inputs(module):
        refuse_changed_inputs(activations, f"a {type(module).__name__}")
    refuse_changed_gradient(backprops, f"a {type(module).__name__}")
    sampler = samplers.get(layer_type(module), ft_compute_per_sample_gradient)
    names = {id(p): name for name, p in module.named_parameters(recurse=False)}
    grads = {names[id(p)]: g for p, g in sampler(module, activations, backprops).items() if p.requires_grad}
    if isinstance(module, nn.Embedding) and module.padding_idx is not None and "weight" in grads:
        grads["weight"][:, module.padding_idx] = 0
    return grads


def weighted_sum(samplers: Mapping[type, Any], entry: Entry, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Σ_i c_i·g_i of one kept call's trainable parameters (fp32), by their names in the layer (as
    :func:`per_example_gradients`), ``weights`` the clip weights c_i (see the module docstring): a contraction for
    ``nn.Linear`` and ``nn.Embedding``, the weighted per-example gradients otherwise. The contractions add every
    example's positions in float64 (each product of fp32 numbers exact) and round the total to fp32 once: in fp32 the
    rounding of one example's own positions, whose scaled sizes the mass floor bounds only by 2¹⁰·C, grows with their
    number (T·2⁻¹⁴·C; a review moved the release by 2·C with 2¹⁷ positions of a linear layer and 31·C with 2²⁰ of
    an embedding), where float64's stays below 2⁻⁴³·T·C.
    The contraction is for those exact classes only, as their norm samplers are: a subclass's ``forward`` may do more
    after the layer's own (scale its output, as muP read-outs and BART's scaled embeddings do), which the kept
    output gradient has already gone through — its sum comes from the per-example gradients its norm was taken of."""
    module, activations, backprops = entry
    if reads_inputs(module):
        refuse_changed_inputs(activations, f"a {type(module).__name__}")
    refuse_changed_gradient(backprops, f"a {type(module).__name__}")
    if backprops.shape[0] != len(weights):  # refused with the layer named after the first pass; never broadcast
        raise RuntimeError(f"a kept call of {type(module).__name__} has {backprops.shape[0]} rows, not one per example")
    transposed = transposed_linear(module)
    kind = layer_type(module)
    if kind is nn.Linear or transposed:
        out = backprops.reshape(-1, backprops.shape[-1])
        inputs = activations[0].reshape(out.shape[0], -1)
        rows = weights if out.shape[0] == len(weights) else weights.repeat_interleave(out.shape[0] // len(weights))
        bias, weight = module.bias is not None and module.bias.requires_grad, module.weight.requires_grad
        totals: dict[str, torch.Tensor] = {}
        step = rows_per_chunk(out.shape[1] + inputs.shape[1], out.device)
        for start in range(0, max(out.shape[0], 1), step):  # in float64 (see the docstring), a chunk of rows at a time
            part, given, scale = (t[start : start + step].double() for t in (out, inputs, rows))
            if bias:
                _accumulate(totals, "bias", scale @ part)
            if weight:  # the rows' weights c_i scale the narrower of the two factors
                if part.shape[1] <= given.shape[1]:
                    part = part * scale[:, None]
                else:
                    given = given * scale[:, None]
                _accumulate(totals, "weight", given.T @ part if transposed else part.T @ given)
        return {name: total.float() for name, total in totals.items()}
    if kind is nn.Embedding:  # the rows of the tokens looked up, each its positions' scaled output gradients added
        ids = activations[0].reshape(backprops.shape[0], -1)
        scaled = backprops.reshape(ids.shape[0], ids.shape[1], -1)
        tokens, row_of = torch.unique(ids, return_inverse=True)  # only the rows looked up: not a [V, d] float64 table
        rows = torch.zeros(len(tokens), scaled.shape[2], dtype=torch.float64, device=scaled.device)
        step = rows_per_chunk(ids.shape[1] * scaled.shape[2], scaled.device)
        for start in range(0, ids.shape[0], step):
            part = scaled[start : start + step].double() * weights[start : start + step].double()[:, None, None]
            rows.index_add_(0, row_of[start : start + step].reshape(-1), part.reshape(-1, part.shape[2]))
        if module.padding_idx is not None:  # autograd leaves the padding row at zero
            rows[tokens == module.padding_idx] = 0
        total = torch.zeros(module.num_embeddings, scaled.shape[2], dtype=torch.float32, device=scaled.device)
        total[tokens] = rows.float()
        return {"weight": total}
    grads = per_example_gradients(samplers, entry)
    return {name: torch.einsum("b,b...->...", weights, g.float()) for name, g in grads.items()}


def _accumulate(totals: dict[str, torch.Tensor], name: str, part: torch.Tensor) -> None:
    totals[name] = part if name not in totals else totals[name].add_(part)
