"""The precision a private step computes in, and the batch shape it must then keep (mixed into every method).

In half precision the rounding of an example's result depends on the shape of the batch it is computed in: a longer
padded length groups the sums over positions (attention, the loss) differently, and a bf16 loss moves by ~1e-4. A
zeroth-order step divides that by 2λ (0.05·C per example at λ = 1e-3), so one long record joining the batch moved
the other examples' clipped differences, and the released sum, by several C; a first-order step under autocast moved
the others' clipped gradient sum by 0.05·C at b = 256. Padding every private batch to one length makes each example's
result bit-identical whoever else was sampled (measured on CPU in fp32, bf16 and bf16-mixed, and whatever the number
of rows: docs/privacy-model.md). So a private run that computes in half precision keeps one shape:

* its private loader pads to one length — the data module's ``fixed_length`` (:class:`~pl_dp.data.
  PrivatePublicDataModule` reads :attr:`PrecisionMixin.fixed_shapes`; the text modules pad one position past their
  ``max_length``, so every row has padding and every batch its attention mask: Hugging Face drops the mask of a
  batch with no padded row, and a GPU then runs another attention kernel);
* every forward of its private passes runs :attr:`PrecisionMixin.physical_rows` rows: the batch is cut into
  micro-batches of that many examples, and the last is filled with copies of its first example whose results are
  dropped (:func:`~pl_dp.step.batches.fill_rows`), so that no kernel is chosen by how many records were sampled
  (on this machine's CPU a bf16 matmul 768 wide rounds its rows differently for 30 of 63 row counts; a GPU library
  picks its algorithm by shape too);
* the fit-start checks run in the trainer's precision context (:meth:`PrecisionMixin.precision_context`), and the
  probe compares what a step releases in it (:func:`~pl_dp.step.independence.probe_independence`);
* every private forward runs one attention kernel (:meth:`PrecisionMixin.attention_context`): whether a batch has
  a padded row must not choose it (:mod:`pl_dp.step.attention`).

Which runs compute in half precision is read from the trainer's precision and the parameters' dtypes; a net that
autocasts or casts to bf16/fp16 inside its own forward, in a run that says fp32, is refused at fit start
(``check_precision``, a fit-start check).

fp32 first-order runs keep dynamic padding: their rounding moves an example's gradient by about one fp32 ulp. An fp32
zeroth-order step pads to one length too wherever the data module can (:attr:`PrecisionMixin.pads_to_one_length`,
overridden by the two-point methods), though its rows stay dynamic: a two-point difference sees a loss only to one
ulp, divided by 2λ, so a dependence on the padded length smaller than an ulp along the probe's few directions can
still be an ulp along a step's (on an H200, a net whose loss reads the padded length passed the probe's directions
and moved the release of b = 4096 by 0.019·C along the step's). ``fixed_length=False`` keeps dynamic padding, with
the probe as the only guard.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from pl_dp.per_sample.gradients import full_precision
from pl_dp.step.attention import one_attention_kernel
from pl_dp.step.independence import HALF_PRECISION_SHAPES, has_half_precision_parameters

#: the most rows a private forward runs in a run with fixed shapes, when ``max_physical_batch_size`` is not set
FIXED_ROWS = 32
#: the dtype a trainer's precision autocasts to, by the prefix of Lightning's precision name
_AUTOCAST = {"bf16": torch.bfloat16, "16": torch.float16}


class PrecisionMixin:
    """Which precision the private passes compute in, and what follows from it (see the module docstring)."""

    #: whether the method's private passes run under the trainer's autocast (ghost clipping turns it off: False)
    private_passes_autocast: bool = True

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The half-precision dtype the trainer autocasts the private passes to (``bf16-mixed``, ``16-mixed``), or
        None (fp32, true-precision trainers, and methods whose passes turn autocast off)."""
        trainer = getattr(self, "_trainer", None)
        precision = str(getattr(trainer, "precision", "32-true"))
        if not self.private_passes_autocast or not precision.endswith("-mixed"):
            return None
        return _AUTOCAST.get(precision.split("-")[0])

    @property
    def computes_in_half_precision(self) -> bool:
        """Whether the private passes round in bf16 or fp16: the trainer autocasts them, or a parameter of the net is
        in half precision (its own dtype, ``bf16-true``/``16-true``, or a frozen half-precision base under a LoRA)."""
        return self.autocast_dtype is not None or has_half_precision_parameters(self.net)  # type: ignore[attr-defined]

    @property
    def fixed_shapes(self) -> bool:
        """Whether the private batches must keep one shape: a private run that computes in half precision."""
        return self.privacy is not None and self.computes_in_half_precision  # type: ignore[attr-defined]

    @property
    def one_length_reason(self) -> tuple[str, str] | None:
        """Why this run's private batches must keep one padded length, in the words of the refusal of a collate that
        pads each batch to its longest (:func:`~pl_dp.step.independence.refuse_varying_batch_shapes`), or None: in
        half precision (:attr:`fixed_shapes`)."""
        return HALF_PRECISION_SHAPES if self.fixed_shapes else None

    @property
    def pads_to_one_length(self) -> bool:
        """Whether the private loader pads every batch to one length where the data module leaves it open
        (``fixed_length=None``): whenever :attr:`one_length_reason` gives a reason."""
        return self.one_length_reason is not None

    @property
    def physical_rows(self) -> int | None:
        """The rows of every forward of a private pass when :attr:`fixed_shapes`: ``max_physical_batch_size``, else the
        expected batch size up to :data:`FIXED_ROWS`; None otherwise (micro-batches of ``max_physical_batch_size``, or
        the whole batch)."""
        if not self.fixed_shapes:
            return None
        given = self.max_physical_batch_size  # type: ignore[attr-defined]
        expected = self.expected_batch_size or 1  # type: ignore[attr-defined]
        return given or min(math.ceil(expected), FIXED_ROWS)

    def attention_context(self) -> AbstractContextManager[Any]:
        """One attention kernel for the private forwards of a run that keeps one shape (:attr:`pads_to_one_length`;
        :func:`~pl_dp.step.attention.one_attention_kernel` on the net's device), else nothing."""
        if not self.pads_to_one_length:
            return nullcontext()
        return one_attention_kernel(self.device)  # type: ignore[attr-defined]

    @contextmanager
    def precision_context(self) -> Iterator[None]:
        """The trainer's precision context of a training step (autocast under ``bf16-mixed``) and
        :meth:`attention_context`, for what runs outside one and must compute as a step does: the fit-start checks,
        the audit."""
        trainer = getattr(self, "_trainer", None)
        precision = trainer.precision_plugin.train_step_context() if trainer is not None else nullcontext()
        with precision, self.attention_context():
            yield

    @contextmanager
    def passes_precision(self) -> Iterator[None]:
        """:meth:`precision_context` as the private passes compute in it: with autocast off for a per-sample mode whose
        passes turn it off (ghost clipping, book-keeping: :attr:`private_passes_autocast`)."""
        autocast = self.private_passes_autocast  # full_precision reads autocast's state: made inside the trainer's
        with self.precision_context(), nullcontext() if autocast else full_precision(self.device):  # type: ignore[attr-defined]
            yield
