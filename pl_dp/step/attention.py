"""One attention kernel for every private forward of a run whose batches keep one shape.

PyTorch's ``scaled_dot_product_attention`` picks its kernel at each call, from the inputs: on a CUDA device a call
without a mask may run FlashAttention (which takes none), a call with one the memory-efficient or the math kernel,
and they round differently. Hugging Face models pass no mask for a batch none of whose rows is padded, so in a run
whose private batches keep one shape, a batch of records that fill every position and the same batch with one
shorter record in it would run different kernels, and the rounding of every other row — which a zeroth-order step
divides by 2λ — would say whether that record was sampled (0.033·C of a bf16 DPZero release, CUDA's dispatch
emulated on a CPU). The data modules pad one position past the longest record and the pre-flight pass refuses a
record that fills a batch's whole length (:func:`~pl_dp.step.independence.unpadded_batches_error`), but a batch
format that carries its mask otherwise (a tuple, a net that builds the mask from pad ids) escapes both, so the
private forwards of such a run also allow one kernel only: on CUDA the math kernel. Not the memory-efficient one: it
cannot run grouped-query attention, which Hugging Face asks for only when a batch has no mask (Llama, Mistral, Qwen:
fewer key/value heads), so it would fall back to the math kernel for exactly those batches (0.039·C through a tiny
Llama, an independent review, its rounding emulated on a CPU). The math kernel applies a causal flag and an explicit
mask alike (both fill the same scores with −∞ before one softmax), so a batch without a mask and the same batch with
an all-ones mask compute the same; a GPU has not yet confirmed it. Its cost: the attention scores of a micro-batch in
memory (rows × heads × T² values) and slower attention than the fused kernels, in these runs only. A CPU runs one
kernel with a mask or without (a labelled record moved a bf16 release by exactly 1.0·C there): its choice is left
alone.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

#: the attention kernels a private forward may run, by device type (others: the device's own choice)
PINNED_KERNELS: dict[str, list[SDPBackend]] = {"cuda": [SDPBackend.MATH]}


def one_attention_kernel(device: torch.device | str) -> AbstractContextManager[Any]:
    """Only :data:`PINNED_KERNELS` of ``device``'s type for the attention computed inside (see the module docstring);
    nothing on other devices."""
    kernels = PINNED_KERNELS.get(torch.device(device).type)
    return sdpa_kernel(kernels) if kernels else nullcontext()
