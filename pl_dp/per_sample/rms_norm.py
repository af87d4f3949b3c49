"""Per-example gradients of Hugging Face's RMSNorm layers (Llama's, and the many models that copy it) in closed form.

Root-mean-square layer normalization (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization", Eq. 4) scales
each position's normalized input by a learned gain g: y_t = g ⊙ x̂_t with x̂_t = x_t / √(mean(x_t²) + ε). Its
per-example gradient is therefore Σ_t b_t ⊙ x̂_t (b_t: the gradient at the output) — one elementwise product and a
sum, from what Opacus' hooks record anyway. ``transformers`` writes the layer as a module of its own in each model
(``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, …), which Opacus knows only for ``torch.nn.RMSNorm``: it
differentiated them per example with ``torch.func`` over a functional copy of the module at every call: on a small
Llama, book-keeping's clipped sum took 1.54× a non-private step with it and 1.21× with this, side by side in one
process (``benchmarks/ghost_first_pass.py --one-pass --cases llama``).

:class:`WithRMSNormSamplers` gives an Opacus hook module the closed form, :func:`rms_norm_grad_sample`, for each
layer class of its net that :func:`computes_rms_norm`: a class named ``…RMSNorm`` holding one 1-D ``weight`` and a float
``variance_epsilon`` whose forward equals Hugging Face's formula (the input in fp32, normalized, cast back to the
input's dtype, times the weight) on fixed random inputs of several shapes and dtypes. On that module only: Opacus'
registry is left alone, so what another engine, a user's own Opacus or a sharded net computes never depends on which
nets this process saw. A class whose forward computes anything else keeps Opacus' ``torch.func`` path.

Used by ``"hooks"`` and ``"bk"``, whose clipped sum is made of the very per-example gradients whose norms set the clip
weights: each example's contribution then stays within C whatever this function computes, and that it is the
example's true gradient is what the fit-start check (:func:`~pl_dp.per_sample.verify_per_example_gradients`) compares,
row by row, before any step. Not by ``"ghost"``, whose sum comes from autograd: there a norm that fell short of the
true one would under-clip, and its fit-start check compares the total norm only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from opacus.utils.tensor_utils import sum_over_all_but_batch_and_last_n
from torch import nn


def normalized(layer: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """x̂ as Hugging Face's RMSNorm computes it: the input in fp32, divided by its root mean square over the last
    dimension (plus ``variance_epsilon``), cast back to the input's dtype."""
    hidden = inputs.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)
    return hidden.to(inputs.dtype)


def rms_norm_grad_sample(
    layer: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Each example's gradient of the gain, Σ_t b_t ⊙ x̂_t (Opacus' grad-sampler signature; batch first)."""
    if not layer.weight.requires_grad:
        return {}
    products = normalized(layer, activations[0]).to(backprops.dtype) * backprops
    return {layer.weight: sum_over_all_but_batch_and_last_n(products, 1)}


def computes_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face-style RMSNorm: one 1-D ``weight``, a float ``variance_epsilon``, and a
    forward that equals ``weight * normalized(x)`` on fixed random inputs (public: drawn from a fixed seed) of three
    shapes — a sequence of 3 and of 9 positions, a 2-D batch — in fp32 and, as a mixed-precision forward hands it,
    bf16."""
    weight = getattr(module, "weight", None)
    parameters = list(module.parameters())
    if not (
        isinstance(weight, nn.Parameter)
        and len(parameters) == 1
        and parameters[0] is weight
        and weight.dim() == 1
        and type(weight.data) is torch.Tensor  # not a DTensor shard nor a meta tensor
        and not weight.is_meta
        and isinstance(getattr(module, "variance_epsilon", None), float)
    ):
        return False
    generator = torch.Generator().manual_seed(0)
    width = weight.numel()
    shapes = [(2, 3, width), (1, 9, width), (5, width)]
    inputs = [torch.randn(shape, generator=generator).to(weight.device) for shape in shapes]
    inputs.append(inputs[0].to(torch.bfloat16))
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        for x in inputs:
            try:
                output = module(x)
            except Exception:  # noqa: BLE001 - a layer that cannot take these inputs keeps Opacus' own path
                return False
            expected = weight * normalized(module, x)
            if not (
                isinstance(output, torch.Tensor)
                and output.shape == expected.shape
                and output.dtype == expected.dtype
                and torch.allclose(output, expected)
            ):
                return False
    return True


def rms_norm_samplers(net: nn.Module) -> dict[type, Callable[..., dict[nn.Parameter, torch.Tensor]]]:
    """:func:`rms_norm_grad_sample` for each class of ``net``'s modules (named ``…RMSNorm``) that
    :func:`computes_rms_norm`, each class checked on every one of its modules."""
    verdicts: dict[type, bool] = {}
    for module in net.modules():
        kind = type(module)
        if kind.__name__.endswith("RMSNorm") and kind is not nn.RMSNorm and verdicts.get(kind, True):
            verdicts[kind] = computes_rms_norm(module)
    return {kind: rms_norm_grad_sample for kind, closed_form in verdicts.items() if closed_form}


class WithRMSNormSamplers:
    """Mixin for Opacus' hook modules: the grad samplers of this module are Opacus' (as registered when it is built)
    and the closed form of :func:`rms_norm_samplers` for the Hugging Face RMSNorm layers of the net it wraps."""

    #: Opacus' class-level registry, read through the hook module's class; this module's own copy once built
    GRAD_SAMPLERS: dict[type, Any]

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        # before Opacus' __init__, which prepares a torch.func copy of every layer without a sampler
        object.__setattr__(self, "GRAD_SAMPLERS", {**type(self).GRAD_SAMPLERS, **rms_norm_samplers(module)})
        super().__init__(module, **kwargs)  # type: ignore[call-arg]  # the Opacus module this mixin comes before
