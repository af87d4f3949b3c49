"""Per-example independence: refuse nets and losses that mix the examples of a batch.

Each example's loss (and gradient) must depend on that example alone, and nothing computed from private data
may leave the process un-noised.

Every sensitivity bound in pl_dp — C for a clipped per-example gradient (Abadi et al., 2016) or for a clipped
per-example loss difference (Zhang et al., 2024, DPZero) — assumes that example i's contribution is a function
of example i alone. A layer that computes a statistic over the batch (BatchNorm in train mode, a batch mean,
attention or a recurrent layer run over the batch dimension) makes every contribution depend on every example:
removing one example then moves all B clipped terms, the released sum moves by up to 2C·B instead of C, and
the reported ε describes a mechanism that was never run. Clipping cannot see this, and neither do the usual
guards: Opacus' grad-sample hooks and ``ModuleValidator`` inspect only layers with trainable parameters, so a
``BatchNorm1d(affine=False)`` passes them, and a zeroth-order method never inspects layers at all. Running
statistics written by the forward pass (BatchNorm's, InstanceNorm's with ``track_running_stats=True``) are a
second leak: un-noised statistics of the private set, saved in every checkpoint.

Batching is part of the path: a ``collate_fn`` that standardizes features by the batch, pads on the left, or pads
every example to the longest of its batch for a net that does not mask the padding makes an example's loss depend
on which other examples were sampled, exactly as a mixing layer does. So the probe builds its batches through the
private loader's own ``collate_fn`` and changes them the way Poisson sampling does: an example replaced, and one
added — a long or outlying one.

Precision is part of the path too: in bf16 or fp16 the rounding of an example's result depends on the shape of the
batch it is computed in, so a record that changes the padded length moves every other example's result — by ~1e-4
in a loss, which a zeroth-order step divides by 2λ. A half-precision run keeps one batch shape
(:mod:`pl_dp.methods.precision`), and the probe runs in the run's precision and compares what a step *releases*.
Whether a run computes in half precision is read from the trainer's precision and the parameters' dtypes;
:func:`half_precision_operators` names what a forward computes in bf16 or fp16 besides (an autocast region inside
it), which a run that says fp32 is refused for.

Three checks, all at fit start and before any private step:

* :func:`refuse_batch_mixing_modules` refuses, by type, every known mixing module anywhere in the net,
  whether or not it has parameters: all errors are collected and raised once, each with the module's
  qualified name, its type and a replacement (the shape of Opacus' ``ModuleValidator.validate(strict=True)``).
* :func:`refuse_varying_batch_shapes`, for a run that must keep one batch shape, refuses a private collate that
  gives batches of different examples different shapes (padding to the longest of each batch).
* :func:`probe_independence` tests behaviour, for any collate, net and callable loss: it computes the per-example
  losses of a batch of examples (the expected batch size, up to ``PROBE_MAX``), then of the same batch with one
  example replaced and with one added, in eval mode with an outlier and, for methods that take gradients, in
  training mode with autograd, and refuses if another example's loss (or, with autograd, the other examples'
  summed gradient) moves, or if the forward pass writes a buffer or a parameter; given the method's
  :class:`Release`, it also refuses when the other examples' part of what a step releases (clipped two-point
  differences, clipped gradients) moves by more than ``RELEASE_TOLERANCE``·C. Every pass runs in the trainer's
  precision context. Its message says whether the collate is what mixes. :func:`probe_examples` picks its
  examples: public data, else validation data, else private data by index.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.data._utils.collate import default_collate

from pl_dp.errors import ConfigError, IndependenceError
from pl_dp.step.batches import batch_size_of, fill_rows, split_batch
from pl_dp.step.losses import PerSampleLoss, check_per_sample
from pl_dp.step.seal import PlainAttributes, sealed
from pl_dp.step.shards import half_precision_policies

#: examples in the probe batch when no expected batch size is given (a BatchNorm-sized batch), and at most
PROBE_SIZE = 8
PROBE_MAX = 256
#: examples among which the outlier (the longest, then the largest) is chosen, at least
SCAN = 1024
#: a watched loss "moved" when it changed by more than this fraction of the largest watched loss
#: (plus NOISE_MARGIN times the jitter between two passes over the same examples; see probe_independence)
RELATIVE_TOLERANCE = 1e-5
NOISE_MARGIN = 10.0
#: in training mode, the positions (nearest the middle first) and the copies tried for a variant of the batch's shapes
TRAIN_POSITIONS = 4
#: a net trained in half precision rounds each layer's output to 8 (bf16) or 11 (fp16) bits: the fraction of that
#: dtype's machine epsilon a watched loss may move by when the batch is padded to another length (see
#: probe_independence)
HALF_PRECISION_ULPS = 1 / 8
#: the most the other examples' part of one release may move when one example is replaced or added, in units of the
#: clip bound C (a record's presence then moves a release by at most (1 + RELEASE_TOLERANCE)·C; see probe_independence)
RELEASE_TOLERANCE = 0.01
#: the dtypes whose rounding depends on the shape of the batch a result is computed in, at the scale a private step sees
HALF_PRECISION = (torch.bfloat16, torch.float16)

Mode = Literal["train", "eval"]
_MODE_WORDS: dict[str, str] = {
    "train": "in training mode with autograd, as first-order methods compute per-example gradients",
    "eval": "in eval mode under torch.inference_mode(), as zeroth-order methods evaluate private losses",
}

_BATCH_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
)
_INSTANCE_NORMS = (
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
)


@dataclass(frozen=True)
class Release:
    """What a method's private step releases, for :func:`probe_independence` to compare between neighbouring batches.

    ``compute(batch, keep)`` runs the method's own private computation on a collated batch (on the net's device), for
    the examples of ``keep`` (a boolean mask over the batch's rows, on the CPU), in units of the clip bound C. With
    ``per_example`` it returns each kept example's contribution to each scalar release, ``[kept, releases]`` (a
    zeroth-order method: its clipped two-point difference along each direction); otherwise the kept examples' summed
    contribution to each release, one tensor per release (a first-order method: the sum of their clipped gradients).
    It must leave the net's parameters as it found them. ``what`` names the releases in a refusal.
    """

    compute: Callable[[Any, torch.Tensor], Any]
    what: str
    per_example: bool = False


def has_half_precision_parameters(net: nn.Module) -> bool:
    """Whether a floating-point parameter of ``net`` is bf16 or fp16, or FSDP2 gathers some in bf16 or fp16 for the
    forward (:func:`~pl_dp.step.shards.half_precision_policies`): its layers then round to 8 or 11 bits, whatever
    the trainer's precision."""
    return any(p.dtype in HALF_PRECISION for p in net.parameters()) or bool(half_precision_policies(net))


class _HalfPrecisionOperators(TorchDispatchMode):
    """Records the operators that return a bf16 or fp16 tensor (by name, with the first such dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, torch.dtype] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.dtype in HALF_PRECISION:
                self.found.setdefault(func.overloadpacket.__name__, value.dtype)
        return out


def half_precision_operators(
    net: nn.Module,
    loss_fn: PerSampleLoss,
    batches: Sequence[Any],
    modes: Iterable[Mode] = ("train", "eval"),
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> dict[str, torch.dtype]:
    """The operators that ``loss_fn(net, batch)`` computes in bf16 or fp16 (by name, with the dtype) for each of
    ``batches``, in each of ``modes`` (training mode: the forward and a backward to the trainable parameters; eval
    mode: the forward), under ``context`` (the trainer's precision context): what the net's parameters and the
    trainer's precision do not say — an autocast region or a cast inside the forward or a custom backward, a
    half-precision buffer. Seen below autocast, as the kernels run (a ``TorchDispatchMode``); arithmetic outside torch
    (NumPy) is not seen, nor precision chosen by a shape none of ``batches`` has: give the extremes of the run's (one
    example; the longest padding and the most rows). The net is left as it was found (:class:`NetState`), the random
    generators too, and nothing the passes print is shown."""
    state = NetState(net)
    seen = _HalfPrecisionOperators()
    params = [p for p in net.parameters() if p.requires_grad]
    try:
        with sealed(), torch.random.fork_rng(devices=state.cuda_devices):  # the batches may be private
            for mode, batch in ((mode, batch) for mode in modes for batch in batches):
                net.train(mode == "train")
                with torch.set_grad_enabled(mode == "train"), context(), seen:
                    losses = loss_fn(net, batch)
                    if mode == "train" and params and losses.requires_grad:
                        torch.autograd.grad(losses.sum(), params, allow_unused=True)
                state.reset()
    finally:
        state.reset()
    return seen.found


def batch_mixing_modules(net: nn.Module) -> list[str]:
    """One line per module of ``net`` known to mix examples or to record statistics of its inputs.

    * every BatchNorm (``BatchNorm1d/2d/3d``, their ``Lazy`` forms, ``SyncBatchNorm``), whatever its ``affine``
      and ``track_running_stats``: in train mode it normalizes each example by the batch's statistics, and its
      running statistics are un-noised averages of the data;
    * InstanceNorm with ``track_running_stats=True``: per example in its output, but its running buffers are
      un-noised statistics of the data, saved in checkpoints;
    * ``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm``: its forward renormalizes, in place, the weight rows
      the batch looks up — un-noised writes of the private batch's tokens into the weights (torch's documented
      behaviour), trainable or frozen.

    These are the modules Opacus' ``ModuleValidator`` refuses for this reason (its GRU, LSTM and
    MultiheadAttention rules are about computing per-sample gradients, not about mixing); unlike it, modules
    without trainable parameters are checked too.
    """
    found = []
    for name, module in net.named_modules():
        label = f"{name or '<the net itself>'!r} ({type(module).__name__})"
        if isinstance(module, _BATCH_NORMS):
            found.append(
                f"{label}: BatchNorm normalizes each example with statistics of the whole batch. Replace it "
                "with nn.GroupNorm or nn.LayerNorm (opacus.validators.ModuleValidator.fix(net) swaps every "
                "BatchNorm for a GroupNorm); for a pretrained net whose statistics stay frozen, "
                "torchvision.ops.FrozenBatchNorm2d is the same per-example affine map without batch statistics"
            )
        elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            found.append(
                f"{label}: max_norm={module.max_norm:g} renormalizes, in place during the forward, the rows of its "
                "weight that the batch looks up: which tokens the private examples hold is written into the weights, "
                "un-noised, and every checkpoint saves it. Use max_norm=None (normalize the looked-up vectors in the "
                "forward instead, e.g. F.normalize)"
            )
        elif isinstance(module, _INSTANCE_NORMS) and module.track_running_stats:
            found.append(
                f"{label}: track_running_stats=True writes un-noised running statistics of the data into its "
                "buffers, which every checkpoint saves. Use track_running_stats=False "
                "(opacus.validators.ModuleValidator.fix(net) does this)"
            )
    return found


def refuse_batch_mixing_modules(net: nn.Module) -> None:
    """Raise one :class:`IndependenceError` listing every module of :func:`batch_mixing_modules`, if any."""
    found = batch_mixing_modules(net)
    if found:
        raise IndependenceError(
            "per-example independence: the net contains modules that mix the examples of a batch "
            "or record statistics of private data, which clipping does not bound, so the reported epsilon "
            "would not hold:\n  - " + "\n  - ".join(found)
        )


#: why a run that computes in half precision keeps one batch shape, and what else it can do (the refusal's words)
HALF_PRECISION_SHAPES = (
    "the run computes in bf16 or fp16, where the rounding of every example's result depends on the shape of the batch "
    "it is computed in",
    "or train in fp32",
)
#: why a private zeroth-order run keeps one padded length in fp32 too, and what else it can do
TWO_POINT_SHAPES = (
    "a zeroth-order step sees each loss only to one ulp and divides a loss difference by 2λ, so a dependence on the "
    "padded length below what the fit-start probe's directions resolve may still move the release along a step's",
    "or keep dynamic padding with fixed_length=False on the data module, the probe then the only guard",
)


def refuse_varying_batch_shapes(
    collate: Callable[[list[Any]], Any], examples: Iterable[Any], why: tuple[str, str]
) -> bool:
    """For a run whose private batches must keep one shape (``why``: :data:`HALF_PRECISION_SHAPES`,
    :data:`TWO_POINT_SHAPES`): raise :class:`IndependenceError` unless ``collate`` (the private loader's) gives a
    batch of each of ``examples`` the same shapes (the pre-flight pass checks the whole private set so, the probe its
    own examples). Returns whether one of them fills every position of its batch (:func:`unpadded_batches_error`).

    A collate that pads each batch to its own longest example lets one long record move every other example's
    contribution through the rounding of sums over positions. The check is on every example of the private set
    because the probe's few examples may all be of one length. The message holds no value of the examples.
    """
    first: Any = None
    filled = False
    for example in examples:
        batch = collate([example])
        filled = filled or (isinstance(batch, Mapping) and _fills_every_position(batch.get("attention_mask")))
        shapes = batch_shapes(batch)
        if first is None:
            first = shapes
        elif shapes != first:
            collate = getattr(collate, "collate_fn", collate)
            name = getattr(collate, "__qualname__", None) or type(collate).__qualname__
            cause, alternative = why
            raise IndependenceError(
                f"per-example independence needs one batch shape here: {cause}. But the private loader's collate_fn "
                f"({name}) gives batches of different examples different shapes (it pads each batch to its longest "
                "example), so one long record would move every other example's contribution. Pad the private batches "
                "to one fixed length: collate_fn=PaddingCollate(length=...) on the data module (TextDataModule and "
                f"TextGenerationDataModule pad one past their max_length by default); {alternative}."
            )
    return filled


def unpadded_batches_error(why: tuple[str, str]) -> IndependenceError:
    """The refusal of a run whose private batches keep one shape (``why``, as for
    :func:`refuse_varying_batch_shapes`) but in which an example fills every position of its batch.

    One shape is not yet one computation: an example with an ``attention_mask`` of 1 throughout makes a batch of only
    such examples one without padding, whose attention mask Hugging Face drops — and on a GPU a batch without a mask
    runs FlashAttention, one with a mask another kernel, so whether one short record is sampled changes the rounding
    of every row of its batch (0.033·C of a bf16 DPZero release, CUDA's dispatch emulated on a CPU)."""
    cause, alternative = why
    return IndependenceError(
        f"per-example independence needs one batch computation here: {cause}. But a private batch of the private "
        "loader's collate_fn can have no padding at all (an example fills every position: its attention_mask is 1 "
        "throughout), and Hugging Face models drop the attention mask of such a batch: on a GPU it then runs another "
        "attention kernel (FlashAttention) than a batch with one shorter record, so whether a short record is sampled "
        "would move every other example's contribution. Pad the private batches one position past the longest "
        "record: collate_fn=PaddingCollate(length=...) above it (TextDataModule and TextGenerationDataModule pad one "
        f"past their max_length), or cut the records one token shorter; {alternative}."
    )


def _fills_every_position(mask: Any) -> bool:
    """Whether an attention mask (one example's: [1, T]) is nonzero at every position."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.ne(0).all())


def probe_examples(
    datamodule: Any, private_loader: Any, public: bool = True, size: int = PROBE_SIZE
) -> tuple[list[Any], str]:
    """Up to ``size`` examples and an outlier (the last of the list) for :func:`probe_independence`, and their source.

    The examples come from the first of these with at least three: the datamodule's ``public`` dataset (only with
    ``public=True``: pass it for methods that train on public data, whose public set goes through the same net and
    loss; another method's public set need not fit them), its ``val`` dataset (the attribute names of
    :class:`~pl_dp.data.PrivatePublicDataModule`; any object without them is skipped), then the private loader's
    ``dataset``. Among its first ``max(SCAN, 4·size)`` examples the *outlier* is the largest — the most elements
    (the longest text), then the largest norm — since a long example changes the padding of a batch and an outlying
    one its statistics; the batch is the first ``size`` of the examples shorter than it (when there are two or
    more: the outlier then lengthens the padding of every probe batch), else of the others, in index order.

    Private examples are read only when neither public nor validation data exists, and then by index —
    never through the private loader or its sampler, whose randomness is a secret of the run and whose
    position is checkpointed. Reading them is acceptable because the probe's only output is pass or refuse,
    before any training step: for a net in which each example's result depends on that example alone, bit for
    bit, the probe passes whatever the data, so its output is a constant and reveals nothing about any example. It
    refuses a net that breaks per-example independence — and also one whose rounding moves the others near the
    tolerance (fp32 with dynamic padding and a small smoothing), where the outcome can depend on the examples. Either
    way nothing is trained, logged or checkpointed, the refusal goes only to whoever runs the job (who holds the data
    already), and its message names positions in the probe batch, never values computed from the data.
    """
    candidates = (
        ("public", getattr(datamodule, "public", None) if public else None),
        ("validation", getattr(datamodule, "val", None)),
        ("private", getattr(private_loader, "dataset", None)),
    )
    for source, dataset in candidates:
        if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__") and len(dataset) >= 3:
            with sealed():  # reading a private record may warn or fail: that is its own, and private
                window = [
                    e for e in map(_read(dataset), range(min(len(dataset), max(SCAN, 4 * size)))) if e is not _SKIP
                ]
            if len(window) < 3:
                continue
            extents = [_extent(example) for example in window]
            outlier = max(range(len(window)), key=extents.__getitem__)
            # only shorter examples when there are two, so that the outlier lengthens every probe batch's padding
            shorter = [i for i in range(len(window)) if extents[i][0] < extents[outlier][0]]
            members = shorter if len(shorter) >= 2 else [i for i in range(len(window)) if i != outlier]
            return [window[i] for i in members[:size]] + [window[outlier]], source
    raise IndependenceError(
        "per-example independence is checked at fit start on at least 3 examples (public, "
        "validation or private); the datasets here have fewer."
    )


_SKIP = object()


def _read(dataset: Any) -> Callable[[int], Any]:
    """``dataset[i]``, or a marker when reading it raises (the pre-flight pass reports such examples)."""

    def read(index: int) -> Any:
        try:
            return dataset[index]
        except Exception:  # noqa: BLE001
            return _SKIP

    return read


def probe_independence(
    net: nn.Module,
    loss_fn: PerSampleLoss,
    examples: Sequence[Any],
    modes: Iterable[Mode] = ("train", "eval"),
    source: str = "probe",
    collate: Callable[[list[Any]], Any] = default_collate,
    transfer: Callable[[Any], Any] | None = None,
    *,
    context: Callable[[], AbstractContextManager[Any]] | None = None,
    compute_dtype: torch.dtype | None = None,
    rows: int | None = None,
    release: Release | None = None,
    longest: Callable[[list[Any]], Any] | None = None,
    batch_size: float | None = None,
) -> None:
    """Refuse ``net`` and ``loss_fn`` — with the loader's ``collate`` — if one example's loss depends on another
    example, or if the forward writes state.

    ``examples`` are m ≥ 3 uncollated examples (from :func:`probe_examples`): the probe batch is the first k = m − 1
    of them and the last is an *outlier* (a long or outlying example). Every batch is built by ``collate`` — the
    private loader's own, so padding, masks and whatever else it does to a batch are part of what is probed — and
    moved by ``transfer`` (e.g. to the net's device). Variants of the probe batch:

    * *outlier replaced*: the middle example (position k // 2) replaced by the outlier, and *outlier added*: the
      outlier appended. In eval mode under ``torch.inference_mode()``, always. A longer example changes every
      example's padding, an outlying one every batch statistic: a net that does not mask its padding, a collate that
      standardizes by the batch or pads on the left, a loss normalized by the batch move the other examples' losses.
    * *replaced in training mode*: the middle example replaced by the outlier — or, when that would change the
      batch's padded shape, by a copy of another example of the batch; when the middle example is the only one as
      long as the batch, the position nearest the middle whose replacement keeps the shape — in training mode with
      autograd (only with ``"train"`` in ``modes``: how first-order methods compute per-example gradients). The
      shape stays, so the random generators, reset to one state before each pass, give every position the same
      dropout mask (a batch of another shape would draw other masks: that is why nothing is added here).
      Besides the losses, the summed gradient of the watched examples is compared: it catches mixing done only by
      the backward pass, such as ``x + (m - m.detach())`` with ``m`` a batch mean.

    Replacing the middle example catches mixing in both directions along the batch (a recurrent layer run over
    the batch dimension carries earlier examples into later ones only); the watched examples are all the others.
    Each mode's reference batch is run twice, which measures the jitter of its kernels.

    **Tolerance.** A watched loss has moved when ``|ℓ'_j − ℓ_j| > RELATIVE_TOLERANCE·max_i |ℓ_i| + NOISE_MARGIN·ν``,
    ν being the largest change between the two passes over the same examples (the same rule, with norms,
    for the gradient). For a per-example net the watched rows go through the same arithmetic on the same
    values, so on deterministic kernels they agree to the last bits; 1e-5 (about 80 fp32 ulps of the largest loss)
    absorbs a different summation order (a longer padded length, one more row), and ν absorbs the jitter of
    non-deterministic kernels (GPU atomics, reduced precision), so noise is not mistaken for mixing. Real
    mixing is far above: a parameter-free BatchNorm over 8 examples moves the other losses by 4e-2 to 7e-2 of
    the largest (an MLP on blobs or on the digits), a full batch-mean subtraction by 1e-2 to 2e-2, and even a
    1 % one by 5e-5 to 5e-4, while a per-example net (with or without dropout) moves them by exactly 0.
    A net trained in bf16 or fp16 (most of its trainable coordinates in that dtype) rounds every layer's output to 8
    or 11 bits, and a longer padded length changes which side of a rounding boundary a sum falls on (a tiny OPT in
    bf16 moved a watched loss by 4.5e-5 of the largest, padded from 6 to 11 tokens). Only there — a variant whose
    batch has other shapes than the reference's — the relative tolerance is ``HALF_PRECISION_ULPS`` of the dtype's
    machine epsilon (1e-3 for bf16, 1.2e-4 for fp16), a weaker check that still catches a BatchNorm or a batch
    mean; every variant of the reference's shapes (and every fp32 net) keeps 1e-5.

    **Precision and shape.** ``context`` is entered around every pass: the trainer's precision context (autocast for
    ``bf16-mixed``/``16-mixed``), so the probe rounds as the steps do; ``compute_dtype`` is the dtype the passes round
    in when it is not the net's (autocast's). With ``rows`` (a run whose private batches keep one shape), every batch
    is cut into micro-batches of ``rows`` examples, each filled to ``rows`` rows (:func:`~pl_dp.step.batches.
    fill_rows`), as the method's private passes are.

    **What is released.** Loss values are not what a private step releases: a zeroth-order step releases each
    example's two-point difference [f(θ+λu) − f(θ−λu)]/(2λ), clipped to C, which turns a loss change of 1e-4 (bf16
    rounding that depends on the padded length) into 0.05·C at λ = 1e-3, and a mixing tiny in value but steep in θ
    (a gated batch statistic ``h + g·mean(h)`` with ``g`` near 0) into an O(1) change. With ``release`` the probe
    also runs the method's own release (:class:`Release`) in eval mode on the reference batch (twice: the jitter),
    with the outlier in place of the middle example, added at the end and inserted first (which moves every other
    example one row down), and refuses when the watched examples' part of a release moved by more than
    ``RELEASE_TOLERANCE``·C (1 %, less ``NOISE_MARGIN`` times the jitter), in the largest release; a jitter that
    would take more than half of that tolerance is refused itself (a computation that is not reproducible had the
    jitter widen the tolerance without limit: 2.3·C of mixing passed, found by review). A record's presence then moves
    a release by at most (1 + RELEASE_TOLERANCE)·C. Two things make the check reach past the probe's own
    examples: ``longest`` (the private collate padding to the most positions a record may have, the data module's
    ``max_length``, when the run's pads each batch to its longest) adds the variant of the reference batch padded to
    that length — a record as long as any moves the others' rounding so, whatever the probe's examples' lengths; and
    with ``batch_size`` (the run's expected batch size b) a move measured on the probe's k watched examples is
    extrapolated to b examples when b > k. Per-example releases (zeroth-order) give each watched example's move δ_j,
    and the move at b is taken as b·|mean δ| + 2·√b·sd(δ): a part of one sign grows as b (a term that reads the padded
    length through a parameter near 0 moves every example alike), rounding of independent signs as √b (fp32 with
    dynamic padding and a small smoothing: 0.012·C at k = 256 was 0.024·C at b = 1024; both found by independent
    reviews). Summed releases (first-order) count b/k times their move.

    **State.** Every buffer and parameter is watched (version counter and identity): a forward that writes
    one stores something computed from the batch, which every checkpoint would release un-noised. Any
    write is refused, even one that looks data-independent on a few examples (a counter, a running maximum
    that the replaced example did not move): the probe cannot tell which. Known false alarm: spectral
    normalization in train mode (its power iteration writes ``_u``, ``_v`` from the weights only). The probe
    leaves the net as it found it — buffers (objects and values) restored, added buffers removed, each
    module's train/eval flag restored, no parameter written (gradients are taken with ``torch.autograd.grad``;
    ``.grad`` is untouched) — and restores the CPU and CUDA random generators, so a run draws the same random
    stream with or without it. It costs four forwards (plus three forwards and backwards with ``"train"``), once.

    Raises :class:`IndependenceError` naming the positions, the variant, the collate when it is what mixes (an
    example's own row of the batch changed) and what to do; the message holds no value computed from the examples.
    """
    count = len(examples)
    if count < 3:
        raise IndependenceError(f"the independence probe needs at least 3 examples, got {count}.")
    for mode in modes:
        if mode not in _MODE_WORDS:
            raise ConfigError(f"the probe's modes are {sorted(_MODE_WORDS)}, got {mode!r}.")
    state = NetState(net)
    problems: list[str] = []
    try:
        with sealed(), torch.random.fork_rng(devices=state.cuda_devices):  # its examples may be private
            probe = _Probe(
                net, loss_fn, list(examples), collate, transfer or (lambda batch: batch), state, context, rows
            )
            if compute_dtype is not None:
                probe.repadded_tolerance = _repadded_tolerance(compute_dtype)
            problems += probe.findings("eval", source)
            if "train" in modes:
                problems += probe.findings("train", source)
            if release is not None:
                problems += probe.release_findings(release, source, longest, batch_size)
    finally:
        state.reset()
    if problems:
        raise IndependenceError(
            "per-example independence is violated:\n  - " + "\n  - ".join(problems) + "\n"
            "Each example's loss and gradient must depend on that example alone, or clipping bounds nothing and "
            "the reported epsilon is wrong. Look for a statistic over the batch dimension in the collate_fn, the net "
            "or the loss: a batch mean or normalization (use nn.GroupNorm or nn.LayerNorm; standardize features "
            "with statistics fixed before training, in the Dataset), padding the net does not mask (pad on the "
            "right and pass an attention mask the net honours: pl_dp.data.PaddingCollate adds one to dict "
            "examples), or attention or a recurrent layer run over the batch dimension (nn.MultiheadAttention, "
            "nn.RNN/LSTM/GRU and nn.Transformer expect [T, B, ...] unless batch_first=True). A forward pass must "
            "not write buffers or parameters (use track_running_stats=False, or compute such statistics from "
            "public data before training)."
        )


@dataclass
class _Pass:
    """One forward (and, in train mode, backward) over a batch."""

    batch: Any  # as collated, before transfer
    losses: torch.Tensor  # [rows], fp32, on the CPU
    gradient: tuple[torch.Tensor, ...] | None  # Σ over watched examples of ∇ℓ_j (train mode, trainable params)
    written: list[str]  # buffers and parameters the forward wrote


class _Probe:
    """The passes of :func:`probe_independence`, and what they show."""

    def __init__(
        self,
        net: nn.Module,
        loss_fn: PerSampleLoss,
        examples: list[Any],
        collate: Callable[[list[Any]], Any],
        transfer: Callable[[Any], Any],
        state: NetState,
        context: Callable[[], AbstractContextManager[Any]] | None = None,
        rows: int | None = None,
    ) -> None:
        self.net, self.loss_fn, self.collate, self.transfer, self.state = net, loss_fn, collate, transfer, state
        self.context = context or nullcontext
        self.rows = rows
        self.examples = examples
        self.size = len(examples) - 1  # k; position k of a variant is the stand-in
        self.middle = self.size // 2
        self.reference = list(range(self.size))
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.repadded_tolerance = _repadded_tolerance(_trained_dtype(net))
        self.rng = _RandomState(state.cuda_devices)
        self.watched: list[int] = []  # the positions compared, set for each mode by findings()

    def _plan(self, mode: Mode) -> tuple[int, Any, str, dict[str, list[int]]]:
        """The position replaced, the example that replaces it (and, in eval mode, is added), its description, and
        the variants (name → rows; row k is the stand-in).

        Eval mode: the middle example replaced by the outlier, and the outlier added. Training mode keeps the
        batch's shapes (a batch of another shape would draw other dropout masks): the middle example replaced by
        the outlier if that keeps them, else by a copy of another example of the batch; and when the middle
        example is the only one as long as the batch (anything in its place shortens the padding), the position
        nearest the middle that does keep them. A few collations, no forward pass."""
        outlier = (self.examples[-1], "a long or outlying example")
        if mode == "eval":
            replaced = [self.size if i == self.middle else i for i in self.reference]
            return (
                self.middle,
                *outlier,
                {
                    f"replacing only the example at position {self.middle} by": replaced,
                    f"adding at position {self.size}": [*self.reference, self.size],
                },
            )
        shapes = batch_shapes(self.collate([self.examples[i] for i in self.reference]))
        tries = [
            (position, stand_in)
            for position in sorted(self.reference, key=lambda p: (abs(p - self.middle), p))[:TRAIN_POSITIONS]
            for stand_in in ([outlier] if position == self.middle else [])
            + [(self.examples[j], f"a copy of the example at position {j}") for j in self.reference if j != position][
                :TRAIN_POSITIONS
            ]
        ]
        position, stand_in = next(
            ((p, c) for p, c in tries if batch_shapes(self._collate(p, c[0])) == shapes), (self.middle, outlier)
        )
        replaced = [self.size if i == position else i for i in self.reference]
        return position, *stand_in, {f"replacing only the example at position {position} by": replaced}

    def _collate(self, position: int, stand_in: Any) -> Any:
        return self.collate([stand_in if i == position else self.examples[i] for i in self.reference])

    def findings(self, mode: Mode, source: str) -> list[str]:
        """Message lines (positions and names only, no value computed from the examples)."""
        position, stand_in, described, variants = self._plan(mode)
        self.watched = [i for i in self.reference if i != position]
        base = self._run(self.reference, stand_in, mode)
        loss_noise, gradient_noise = self._changes(base, self._run(self.reference, stand_in, mode))  # kernel jitter
        found = []
        for variant, rows in variants.items():
            changed = self._run(rows, stand_in, mode)
            loss_shift, gradient_shift = self._changes(base, changed)
            repadded = batch_shapes(changed.batch) != batch_shapes(base.batch)
            relative = self.repadded_tolerance if repadded else RELATIVE_TOLERANCE
            tolerance = relative * _finite_max(base.losses[self.watched].abs()) + NOISE_MARGIN * _finite_max(loss_noise)
            where = f"{_MODE_WORDS[mode]}, on a probe batch of {self.size} {source} examples, {variant} {described}"
            moved = [j for j, shift in zip(self.watched, loss_shift.tolist()) if shift > tolerance]
            mixed = None
            if moved:
                mixed = f"changed the losses of the examples at positions {moved}"
            elif base.gradient is not None:  # a non-finite gradient makes the comparison False: not compared
                bound = relative * _norm(base.gradient) + NOISE_MARGIN * gradient_noise
                if gradient_shift > bound:
                    mixed = (
                        f"changed the summed gradient of the other examples (positions {self.watched}) though not "
                        "their losses: the backward pass mixes examples"
                    )
            if mixed is not None:
                found.append(f"{where}, {mixed}{self._blame(base.batch, changed.batch)}")
            written = sorted(set(base.written + changed.written))
            if written:
                found.append(
                    f"{_MODE_WORDS[mode]}, on a probe batch of {self.size} {source} examples, the forward pass wrote "
                    f"{written}: a buffer or parameter written from the batch is an un-noised statistic of private "
                    "data that every checkpoint releases"
                )
        return list(dict.fromkeys(found))

    def _blame(self, reference: Any, other: Any) -> str:
        """Which part mixes: the collate (an example's own row changed) or what follows it (the net or the loss)."""
        collate = self._collate_blame(reference, other, self.watched)
        if collate:
            return collate
        if batch_shapes(reference) != batch_shapes(other):
            return (
                ". The collate kept each example's row but padded the batches to different lengths, so the net or "
                "the loss reads padding: give it the attention mask and honour it (PaddingCollate adds one to dict "
                "examples; TinyTransformerClassifier treats pad_token_id as padding)"
            )
        return ""

    def _collate_blame(self, reference: Any, other: Any, watched: list[int]) -> str:
        """The message when the collate mixes (a watched example's own row changed between two batches), else ""."""
        fields = _changed_rows(reference, other, watched, self.size, batch_size_of(other))
        if not fields:
            return ""
        collate = getattr(self.collate, "collate_fn", self.collate)  # EmptySafeCollate wraps the user's
        name = getattr(collate, "__qualname__", None) or type(collate).__qualname__
        return (
            f". The private loader's collate_fn ({name}) mixes them: the watched examples' own rows of "
            f"{', '.join(fields)} changed, so it computes each row from the whole batch (per-batch statistics "
            "such as standardization, or left padding). Compute such statistics once before training, in the "
            "Dataset, and pad on the right with an attention mask (pl_dp.data.PaddingCollate)"
        )

    def _run(self, rows: list[int], stand_in: Any, mode: Mode) -> _Pass:
        """One pass over a freshly collated batch of ``rows``, from the same net state and the same random draws."""
        self.state.reset()
        self.rng.reset()
        collated = self.collate([stand_in if i == self.size else self.examples[i] for i in rows])
        batch = self.transfer(collated)
        if mode == "eval":
            self.net.eval()
            with torch.inference_mode(), self.context():
                losses = self._losses(batch, len(rows))
            return _Pass(collated, losses.detach().cpu(), None, self.state.written())
        with torch.enable_grad(), self.context():
            losses = self._losses(batch, len(rows))
            summed = losses[self.watched].sum()
            gradient = None
            if self.params and summed.requires_grad:
                gradient = torch.autograd.grad(summed, self.params, allow_unused=True, materialize_grads=True)
        return _Pass(collated, losses.detach().cpu(), gradient, self.state.written())

    def _losses(self, batch: Any, count: int) -> torch.Tensor:
        """The per-example losses of ``batch``, in micro-batches of ``rows`` filled to ``rows`` rows if set."""
        if self.rows is None:
            return check_per_sample(self.loss_fn(self.net, batch), count)
        parts = split_batch(batch, self.rows)
        return torch.cat(
            [
                check_per_sample(self.loss_fn(self.net, fill_rows(part, self.rows)), self.rows)[: batch_size_of(part)]
                for part in parts
            ]
        )

    def release_findings(
        self,
        release: Release,
        source: str,
        longest: Callable[[list[Any]], Any] | None = None,
        batch_size: float | None = None,
    ) -> list[str]:
        """Message lines for the releases (see :func:`probe_independence`): eval mode, the outlier in place of the
        middle example, added at the end and inserted first, and the batch padded by ``longest``; the watched examples
        are all the others, a move counts √(``batch_size``/k) times."""
        outlier = self.examples[-1]
        watched = [i for i in self.reference if i != self.middle]
        variants: dict[str, tuple[list[int], Callable[[list[Any]], Any]]] = {
            f"replacing only the example at position {self.middle} by a long or outlying example": (
                [self.size if i == self.middle else i for i in self.reference],
                self.collate,
            ),
            f"adding a long or outlying example at position {self.size}": ([*self.reference, self.size], self.collate),
            "inserting a long or outlying example at position 0 (every other example one row down)": (
                [self.size, *self.reference],
                self.collate,
            ),
        }
        base, base_batch = self._released(release, self.reference, outlier, watched)
        first = self.examples[:1]
        if longest is not None and batch_shapes(longest(first)) != batch_shapes(self.collate(first)):
            # the run pads dynamically: a record as long as any may be moves the others' rounding so
            variants["padding it to the most positions a record may have (the data module's max_length)"] = (
                self.reference,
                longest,
            )
        size = max(float(batch_size or 0.0), float(len(watched)))  # the batch a move is extrapolated to

        def shift(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
            return _release_shift(a, b, size / len(watched), release.per_example)

        jitter = shift(base, self._released(release, self.reference, outlier, watched)[0])
        extrapolated = f" (extrapolated to the expected batch of {size:.0f})" if size > len(watched) else ""
        if 2 * NOISE_MARGIN * jitter > RELEASE_TOLERANCE:  # the noise would eat more than half of the tolerance
            return [
                f"in eval mode, on a probe batch of {self.size} {source} examples, computing {release.what} of the "
                f"same batch twice moved it by more than {RELEASE_TOLERANCE / (2 * NOISE_MARGIN):.2%} of the clip "
                f"bound{extrapolated}: the computation is not reproducible (an operation that adds in another "
                "order each time, as CUDA's atomic index_add_ and scatter_add_ do, or randomness the step does not "
                "seed), and the probe cannot tell one example's influence on the others from that noise. Make it "
                "reproducible "
                "(torch.use_deterministic_algorithms(True) before the fit; on CUDA with "
                "CUBLAS_WORKSPACE_CONFIG=:4096:8)"
            ]
        tolerance = RELEASE_TOLERANCE - NOISE_MARGIN * jitter  # a move, measured through that noise, within the bound
        found = []
        for variant, (rows, collate) in variants.items():
            changed, changed_batch = self._released(release, rows, outlier, watched, collate)
            if shift(base, changed) > tolerance:
                blame = self._release_blame(base_batch, changed_batch, rows, watched)
                found.append(
                    f"in eval mode, on a probe batch of {self.size} {source} examples, {variant} moved {release.what} "
                    f"of the {len(watched)} other examples by more than {RELEASE_TOLERANCE:.0%} of the clip bound"
                    f"{extrapolated}{blame}"
                )
        return found

    def _rows(self, rows: list[int], stand_in: Any) -> list[Any]:
        """The examples of ``rows`` (row k: ``stand_in``), uncollated."""
        return [stand_in if i == self.size else self.examples[i] for i in rows]

    def _released(
        self,
        release: Release,
        rows: list[int],
        stand_in: Any,
        watched: list[int],
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> tuple[list[torch.Tensor], Any]:
        """The releases of the ``watched`` examples in a freshly collated batch of ``rows`` (by ``collate``, the
        private loader's by default), from the same net state and random draws (float64, on the CPU; per-example
        releases as one tensor per release, the watched examples in their order), and the collated batch."""
        self.state.reset()
        self.rng.reset()
        collated = (collate or self.collate)(self._rows(rows, stand_in))
        keep = torch.tensor([i in watched for i in rows])
        self.net.eval()
        with self.context():
            released = release.compute(self.transfer(collated), keep)
        if release.per_example:  # [kept, releases] → one tensor of per-example contributions per release
            released = released.detach().reshape(int(keep.sum()), -1).T
        return [r.detach().double().cpu().flatten() for r in released], collated

    def _release_blame(self, reference: Any, other: Any, rows: list[int], watched: list[int]) -> str:
        """Why a release moved: the padded length changed the rounding, the collate mixes, or what follows it does."""
        if batch_shapes(reference) != batch_shapes(other):
            return (
                ". The batches were padded to different lengths, and the other examples' results moved with the padded "
                "length: rounding that depends on it (sums over positions, in attention and in the loss, are grouped "
                "differently: in bf16 or fp16 that moves a loss by ~1e-4, and a two-point difference divides it by "
                "2λ), or a net that reads the padding (a max_length beyond the model's positions). Pad the private "
                "batches to one fixed length the model supports: fixed_length=True on the data module "
                "(TextDataModule and TextGenerationDataModule pad one past their max_length, automatically when the "
                "run computes in half precision), or PaddingCollate(length=...) as its collate_fn; or train in fp32 "
                "with a larger smoothing"
            )
        if rows[0] != self.size and (collate := self._collate_blame(reference, other, watched)):  # rows aligned
            return collate
        return (
            ", though the batches have the same shapes: the release depends on the other examples — a mixing "
            "small in value but steep in the parameters (a gated batch statistic such as h + g·mean(h) with g near "
            "0, which a loss comparison cannot see), or rounding that depends on an example's row. Remove the batch "
            "statistic from the net"
        )

    def _changes(self, reference: _Pass, other: _Pass) -> tuple[torch.Tensor, float]:
        """Watched examples' loss changes, and the norm of the change of their summed gradient (0 without one)."""
        losses = _differences(reference.losses[self.watched], other.losses[self.watched])
        if reference.gradient is None or other.gradient is None:
            return losses, 0.0
        return losses, _norm(a - b for a, b in zip(reference.gradient, other.gradient))


def _extent(example: Any) -> tuple[int, float]:
    """(elements, squared norm of the finite floating-point values) of an example: how long, then how outlying."""
    if isinstance(example, torch.Tensor):
        values = example.detach().double() if example.is_floating_point() else None
        norm = float(values[values.isfinite()].square().sum()) if values is not None else 0.0
        return example.numel(), norm
    if isinstance(example, (str, bytes)):
        return len(example), 0.0
    if isinstance(example, float):
        return 1, example * example if math.isfinite(example) else 0.0
    if isinstance(example, Mapping):
        parts = [_extent(v) for v in example.values()]
    elif isinstance(example, (list, tuple)):
        parts = [_extent(v) for v in example]
    else:
        return 1, 0.0
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def _changed_rows(
    reference: Any, other: Any, watched: list[int], size: int, other_size: int, where: str = ""
) -> list[str]:
    """The fields of two collated batches in which a watched example's own row differs (on their common extent)."""
    if isinstance(reference, torch.Tensor) and isinstance(other, torch.Tensor):
        if (
            reference.dim() == 0
            or reference.shape[0] != size
            or other.dim() != reference.dim()
            or other.shape[0] != other_size
        ):
            return []
        common = tuple(slice(0, min(a, b)) for a, b in zip(reference.shape[1:], other.shape[1:]))
        index = torch.tensor(watched)
        a, b = reference[index][(slice(None),) + common], other[index][(slice(None),) + common]
        same = a.shape == b.shape and bool(
            ((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b).all()
        )
        return [] if same else [where or "the batch"]
    if isinstance(reference, Mapping) and isinstance(other, Mapping):
        return [
            f
            for key in reference
            if key in other
            for f in _changed_rows(reference[key], other[key], watched, size, other_size, f"{where}[{key!r}]")
        ]
    if isinstance(reference, (list, tuple)) and isinstance(other, (list, tuple)):
        if (
            len(reference) == size
            and len(other) == other_size
            and all(isinstance(v, (str, bytes, int, float)) for v in reference)
        ):
            return [] if all(reference[i] == other[i] for i in watched) else [where or "the batch"]
        return [
            f
            for key, (a, b) in enumerate(zip(reference, other))
            for f in _changed_rows(a, b, watched, size, other_size, f"{where}[{key}]")
        ]
    return []


def _release_shift(reference: list[torch.Tensor], other: list[torch.Tensor], growth: float, per_example: bool) -> float:
    """The largest change of one release between two runs over the k watched examples, extrapolated to b = ``growth``·k
    examples (``growth`` ≥ 1; inf when a value is finite in one run only): of a summed release, its L2 change times
    b/k; of a release given per example (moves δ_j), b·|mean δ| + 2·√b·sd(δ) — or |Σ δ| when b = k."""
    if len(reference) != len(other):
        return math.inf
    shifts = []
    for a, b in zip(reference, other):
        if not per_example:
            shifts.append(float(_differences(a, b).norm()) * growth)
            continue
        same = (a == b) | (a.isnan() & b.isnan())
        moves = torch.where(same, torch.zeros_like(a), b - a)
        if not bool(moves.isfinite().all()):
            shifts.append(math.inf)
        elif growth <= 1.0:
            shifts.append(abs(float(moves.sum())))
        else:
            size = growth * moves.numel()
            spread = float(moves.std()) if moves.numel() > 1 else 0.0
            shifts.append(size * abs(float(moves.mean())) + 2 * math.sqrt(size) * spread)
    return max(shifts, default=0.0)


def _repadded_tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of a watched loss in a batch padded to another length, for a net rounding in ``dtype``."""
    return max(RELATIVE_TOLERANCE, HALF_PRECISION_ULPS * torch.finfo(dtype).eps)


def _trained_dtype(net: nn.Module) -> torch.dtype:
    """The floating dtype of most of ``net``'s trainable coordinates (of all its parameters if none trains)."""
    params = [p for p in net.parameters() if p.is_floating_point()]
    trained = [p for p in params if p.requires_grad] or params
    counts: dict[torch.dtype, int] = {}
    for p in trained:
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=lambda dtype: counts[dtype]) if counts else torch.float32


def batch_shapes(batch: Any) -> Any:
    """The tensor shapes of a collated batch but for the batch dimension, in its structure."""
    if isinstance(batch, torch.Tensor):
        return tuple(batch.shape[1:])
    if isinstance(batch, Mapping):
        return {key: batch_shapes(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [batch_shapes(value) for value in batch]
    return None


def _differences(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a − b| elementwise, 0 where both hold the same non-finite value, inf where only one is finite."""
    diff = (a - b).abs()
    same = (a == b) | (a.isnan() & b.isnan())
    return torch.where(same, torch.zeros_like(diff), torch.nan_to_num(diff, nan=math.inf))


def _finite_max(values: torch.Tensor) -> float:
    finite = values[torch.isfinite(values)]
    return float(finite.max()) if finite.numel() else 0.0


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of all entries of ``tensors``, in float64, with one host sync (tensors consumed one by one)."""
    norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]
    return float(torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))) if norms else 0.0


class _Slot(NamedTuple):
    """A buffer or parameter of the net: where it is attached, and the tensor found there."""

    qualified: str
    module: nn.Module
    name: str
    tensor: torch.Tensor

    def written_since(self, version: int) -> bool:
        return getattr(self.module, self.name, None) is not self.tensor or self.tensor._version != version


class NetState:
    """What the probe and the pre-flight pass must leave as they found it, and which buffers and parameters a
    forward wrote.

    Writes are seen through each tensor's version counter (bumped by every in-place operation, also under
    ``torch.inference_mode()``) and identity (a reassigned attribute); buffers added by a forward are seen
    by name. Plain attributes (a cache a forward grows, a list it appends to) are put back too
    (:class:`~pl_dp.step.seal.PlainAttributes`), so that nothing the checks computed from the examples stays on
    the net, where a pickle of the module would carry it.
    """

    def __init__(self, net: nn.Module) -> None:
        self.net = net
        self.modes = [(module, module.training) for module in net.modules()]
        self.attributes = PlainAttributes(net)
        modules = list(net.named_modules())
        self.buffers = [
            _Slot(f"{prefix}.{name}" if prefix else name, module, name, tensor)
            for prefix, module in modules
            for name, tensor in module.named_buffers(recurse=False)
        ]
        self.parameters = [
            _Slot(f"{prefix}.{name}" if prefix else name, module, name, tensor)
            for prefix, module in modules
            for name, tensor in module.named_parameters(recurse=False)
        ]
        self.saved = [slot.tensor.detach().clone() for slot in self.buffers]
        self.buffer_names = {name for name, _ in net.named_buffers()}
        self.cuda_devices = sorted(
            {slot.tensor.device.index for slot in self.buffers + self.parameters if slot.tensor.is_cuda}
        )
        self.versions = self._versions()

    def _versions(self) -> list[int]:
        return [slot.tensor._version for slot in self.buffers + self.parameters]

    def _added_buffers(self) -> list[str]:
        return sorted({name for name, _ in self.net.named_buffers()} - self.buffer_names)

    def written(self) -> list[str]:
        """Qualified names of the buffers and parameters written (or added) since the last :meth:`reset`."""
        slots = self.buffers + self.parameters
        return [s.qualified for s, v in zip(slots, self.versions) if s.written_since(v)] + self._added_buffers()

    @torch.no_grad()
    def reset(self) -> None:
        """Buffers back to their objects and values, added buffers removed, plain attributes and every module's
        mode restored."""
        self.attributes.restore()
        for name in self._added_buffers():
            owner, _, attribute = name.rpartition(".")
            delattr(self.net.get_submodule(owner), attribute)
        for slot, version, saved in zip(self.buffers, self.versions, self.saved):
            if slot.written_since(version):
                setattr(slot.module, slot.name, slot.tensor)
                slot.tensor.copy_(saved)
        for module, training in self.modes:
            module.training = training
        self.versions = self._versions()


class _RandomState:
    """The CPU and CUDA generator states at the start of the probe, to give every pass the same draws."""

    def __init__(self, cuda_devices: list[int]) -> None:
        self.cuda_devices = cuda_devices
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(device) for device in cuda_devices]

    def reset(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.cuda_devices, self.cuda):
            torch.cuda.set_rng_state(state, device)
