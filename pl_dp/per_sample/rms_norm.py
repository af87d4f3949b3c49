"""Per-example gradients of Hugging Face's RMSNorm layers (Llama's, and the many models that copy it) in closed form.

Root-mean-square layer normalization (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization", Eq. 4) scales
each position's normalized input by a learned gain g: y_t = g ⊙ x̂_t with x̂_t = x_t / √(mean(x_t²) + ε). Its
per-example gradient is therefore Σ_t b_t ⊙ x̂_t (b_t: the gradient at the output) — one elementwise product and a
sum, from what Opacus' hooks record anyway. ``transformers`` writes the layer as a module of its own in each model
(``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, …), which Opacus knows only for ``torch.nn.RMSNorm``: it
differentiated them per example with ``torch.func`` over a functional copy of the module at every call: on a small
Llama, book-keeping's clipped sum took 1.49× a non-private step with it and 1.38× with this
(``benchmarks/ghost_first_pass.py --one-pass --cases llama``).

:func:`register_rms_norms` finds such layers by what they compute: a module of a class named ``…RMSNorm`` holding one
1-D ``weight`` and a float ``variance_epsilon`` whose forward, on a fixed random input, equals Hugging Face's formula
(the input in fp32, normalized, cast back to the input's dtype, times the weight) to float rounding. It then registers
:func:`rms_norm_grad_sample` for that class with Opacus (``register_grad_sampler``, Opacus' extension point), so that
every engine built on Opacus' hooks in one process — ``"hooks"``, ``"ghost"`` and ``"bk"`` — takes it. A class whose
forward computes anything else keeps the ``torch.func`` path. A net sharded by FSDP2 keeps refusing these layers
(:func:`is_registered_rms_norm`): what it accepts does not depend on which engines the process built before.

Privacy: the norm that sets an example's clip weight and the gradient that weight scales both come from this one
function of that example's own input and output gradient, so each contribution stays within C whatever the layer
computes; that they are the example's true gradient is what the fit-start check
(:func:`~pl_dp.per_sample.verify_per_example_gradients`) compares, before any step.
"""

from __future__ import annotations

import torch
from opacus.grad_sample import register_grad_sampler
from opacus.utils.tensor_utils import sum_over_all_but_batch_and_last_n
from torch import nn

#: the classes registered so far (by :func:`register_rms_norms`): a class is checked once per process
_REGISTERED: set[type] = set()


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
    forward that equals ``weight * normalized(x)`` on a fixed random fp32 input (public: drawn from a fixed seed)."""
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
    inputs = torch.randn(2, 3, weight.numel(), generator=generator).to(weight.device)
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        try:
            output = module(inputs)
        except Exception:  # noqa: BLE001 - a layer that cannot take this input is not one to register
            return False
        expected = weight * normalized(module, inputs)
    return isinstance(output, torch.Tensor) and output.shape == expected.shape and torch.allclose(output, expected)


def is_registered_rms_norm(kind: type) -> bool:
    """Whether :func:`register_rms_norms` registered ``kind`` in this process."""
    return kind in _REGISTERED


def register_rms_norms(net: nn.Module) -> list[type]:
    """Register :func:`rms_norm_grad_sample` with Opacus for each class of ``net``'s modules that
    :func:`computes_rms_norm` (once per class and process); the classes registered by this call."""
    registered = []
    for module in net.modules():
        kind = type(module)
        if kind in _REGISTERED or not kind.__name__.endswith("RMSNorm") or kind is nn.RMSNorm:
            continue
        if computes_rms_norm(module):
            register_grad_sampler(kind)(rms_norm_grad_sample)
            _REGISTERED.add(kind)
            registered.append(kind)
    return registered
