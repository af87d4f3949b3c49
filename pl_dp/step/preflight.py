"""The pre-flight pass: every private example is read, batched and scored once, before the first release.

A record that a private step cannot use — a NaN feature, a label the loss rejects, a text longer than the model's
positions, a tensor of another shape — would otherwise show itself only when a Poisson batch samples it: a warning,
a counted non-finite value or a crash at that step, each of which says whether (and when) the record was sampled
(Invariant 10 of the architecture; :mod:`pl_dp.step.seal` keeps such events inside the step). The pre-flight
pass finds them first, over the whole private set in index order — never through the Poisson sampler — and refuses
to train with one :class:`DataError` that names every bad example by index and says what is wrong with it. For
each example, in chunks through the run's own ``collate_fn``:

1. it loads (``dataset[i]`` does not raise) and every floating-point value in it is finite;
2. it has the structure of the others (:func:`~pl_dp.step.batches.example_structure`: keys, types, dtypes) and
   collates together with them (shapes agree);
3. its per-example loss, computed by the run's net and loss in eval mode under ``torch.inference_mode()``, does not
   raise and is finite at the initial parameters.

Privacy: the pass releases nothing. It runs before any training step and its only outcome is to go on or to refuse;
a refusal goes to whoever runs the job (who holds the data), and nothing is trained, logged or checkpointed. Its
message names indices and the error each raised — which may quote a value of that record, so a refusal is not for
publication. What it cannot foresee (a loss that becomes non-finite, or raises, only at later parameters) is handled
inside the step: such an example contributes 0 and is counted privately — on a net sharded by FSDP2 too, where the
rank it raised on still runs the collectives the others run (:class:`~pl_dp.step.seal.ForwardsInStep`).

Cost: one inference pass over the private set, once per fit (``benchmarks/fit_start_checks.py`` measures it);
``preflight=False`` on a method skips the values and the loss — examples are still read and their structure and
batching checked (a pass over the data without the net), since the private loader's batching rule rests on them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from pl_dp.errors import DataError
from pl_dp.step.batches import batch_size_of, example_structure, stacks_tensor_rows
from pl_dp.step.independence import NetState, refuse_varying_batch_shapes, unpadded_batches_error
from pl_dp.step.losses import PerSampleLoss, causal_lm, check_per_sample, cross_entropy
from pl_dp.step.seal import isolate_failures, sealed

#: bad examples listed one by one in the error (the rest are counted)
LISTED = 20


@dataclass(frozen=True)
class PreflightReport:
    """What the pre-flight pass checked, how long it took, and a good example (what every example is shaped like:
    its :func:`~pl_dp.step.batches.example_structure` is every example's)."""

    examples: int
    chunks: int
    seconds: float
    reference: Any = None


def describe(error: BaseException) -> str:
    """``Type: first line of the message``, at most 200 characters."""
    text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return text if len(text) <= 200 else text[:199] + "…"


def nonfinite_field(example: Any, where: str = "") -> str | None:
    """Where in ``example`` a floating-point value is NaN or infinite (``"[0]"``, ``"['pixels']"``), or None."""
    if isinstance(example, torch.Tensor):
        return where or "the example" if example.is_floating_point() and not bool(example.isfinite().all()) else None
    if isinstance(example, np.ndarray):
        return where or "the example" if example.dtype.kind == "f" and not np.isfinite(example).all() else None
    if isinstance(example, (float, np.floating)):
        return None if math.isfinite(example) else where or "the example"
    items: Iterable[tuple[Any, Any]]
    if isinstance(example, Mapping):
        items = example.items()
    elif isinstance(example, Sequence) and not isinstance(example, (str, bytes)):
        items = enumerate(example)
    else:
        return None
    return next((found for key, value in items if (found := nonfinite_field(value, f"{where}[{key!r}]"))), None)


def check_private_set(
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    net: nn.Module,
    loss_fn: PerSampleLoss,
    chunk_size: int,
    transfer: Callable[[Any], Any] = lambda batch: batch,
    values: bool = True,
    one_shape: tuple[str, str] | None = None,
) -> PreflightReport:
    """Check every example of ``dataset`` (see the module docstring); raise :class:`DataError` listing the bad ones.

    ``collate`` is the private loader's ``collate_fn``, ``transfer`` moves a batch to the net's device, and
    ``chunk_size`` examples are batched at a time (the run's expected batch size, so memory is that of a step).
    ``values=False`` checks reading, structure and batching only — no finiteness, no forward pass.
    Each chunk is batched together with the first good example (the *reference*), so examples of different chunks are
    known to batch together too — except a plain ``TensorDataset`` whose collate stacks its rows
    (:func:`~pl_dp.step.batches.stacks_tensor_rows`), whose examples are rows of the same tensors: each chunk's rows are
    read at once, as the private loader reads them, and batch together by construction. When every example of the first
    batch scored makes the loss raise, the fault is the net's or the loss's, not a record's: that error is raised as it
    is (e.g. the per-example loss contract of :func:`~pl_dp.step.losses.check_per_sample`). The net is left as it was
    found (train/eval flags, buffers: :class:`~pl_dp.step.independence.NetState`), and so are the random generators.
    With ``one_shape`` (why the run must keep one batch shape: half precision, a two-point step) every example is also
    batched alone, and a collate that gives two examples batches of different shapes is refused
    (:func:`~pl_dp.step.independence.refuse_varying_batch_shapes`; about 35 µs an example here) — unless the dataset is
    a ``TensorDataset`` (rows of one shape) and the collate's shapes follow its examples' shapes alone
    (:func:`_shapes_follow_shapes`: a collate that trims padding by value would not) —, and so is one whose batch of
    an example that fills every position has no padding (:func:`~pl_dp.step.independence.unpadded_batches_error`).
    """
    start = time.perf_counter()
    problems: dict[int, str] = {}
    size = len(dataset)
    chunk_size = max(1, int(chunk_size))
    reference: tuple[int, Any] | None = None  # the first good example: every chunk is batched with it
    structure: Any = None  # what every example must be shaped like (a collate batches by the first example's)
    shaped: Any = None  # one_shape: the example whose batch's shapes every other's must have (the first read)
    unpadded = False  # one_shape: an example fills every position of its batch
    same_shapes = isinstance(dataset, TensorDataset) and _shapes_follow_shapes(collate)
    # a plain TensorDataset whose collate stacks its rows: read, structured and batched alike by construction
    at_once = stacks_tensor_rows(dataset, collate) and (one_shape is None or same_shapes)
    state = NetState(net)  # a forward that writes a buffer is the probe's to refuse; here it is undone
    try:
        with sealed(), torch.random.fork_rng(devices=state.cuda_devices):  # whether a record warns is private
            net.eval()
            for first in range(0, size, chunk_size):
                indices = list(range(first, min(size, first + chunk_size)))
                if at_once:
                    rows, batch = _tensor_rows(dataset, indices, problems, values)
                else:
                    loaded = _load(dataset, indices, problems)
                    if structure is None and loaded:  # the first chunk's most common structure
                        found = [example_structure(example) for _, example in loaded]
                        structure = max(found, key=found.count)
                    loaded = _of_structure(loaded, structure, problems)
                    rows = ([reference] if reference is not None else []) + loaded
                    rows, batch = _batch(collate, rows, reference, problems, values)
                if batch is None:
                    continue
                if one_shape is not None and not same_shapes:  # every batch of one shape (of those that batch)
                    shaped = rows[0][1] if shaped is None else shaped
                    examples = [shaped] + [example for _, example in rows]
                    unpadded = refuse_varying_batch_shapes(collate, examples, one_shape) or unpadded
                if not values:
                    reference = reference or rows[0]
                    continue
                failed = _score(net, loss_fn, transfer(batch), rows, problems)
                if reference is None:
                    if failed and len(failed) == len(rows):  # every example: the net or the loss, not a record
                        error = failed[0][1]
                        error.add_note("(raised by every example of the pre-flight pass's first batch)")
                        raise error
                    reference = next((row for row in rows if row[0] not in problems), None)
    finally:
        state.reset()
    if problems:
        raise DataError(_message(problems, size))
    if unpadded and one_shape is not None:
        raise unpadded_batches_error(one_shape)
    example = None if reference is None else reference[1] if not at_once else dataset[reference[0]]
    return PreflightReport(size, -(-size // chunk_size), time.perf_counter() - start, example)


def _tensor_rows(
    dataset: TensorDataset, indices: list[int], problems: dict[int, str], values: bool
) -> tuple[list[tuple[int, Any]], Any]:
    """The rows ``indices`` (consecutive) of a plain ``TensorDataset``'s tensors, read at once, and their batch as a
    collate that stacks them makes it (:func:`~pl_dp.step.batches.stacks_tensor_rows`), with ``values`` without the
    rows that hold a NaN or an infinity (problems). Each row is ``(index, None)``: no example is read one by one."""
    stacked = [tensor[indices[0] : indices[-1] + 1].contiguous() for tensor in dataset.tensors]  # as stacking does
    rows: list[tuple[int, Any]] = [(i, None) for i in indices]
    nonfinite = _nonfinite_rows(stacked, len(rows)) if values else []
    for position in nonfinite:
        problems[indices[position]] = _nonfinite_problem(dataset[indices[position]])
    if not nonfinite:
        return rows, stacked
    kept = [position for position in range(len(rows)) if position not in set(nonfinite)]
    return [rows[position] for position in kept], [tensor[kept] for tensor in stacked] if kept else None


def _of_structure(loaded: list[tuple[int, Any]], structure: Any, problems: dict[int, str]) -> list[tuple[int, Any]]:
    """The examples of ``structure``; the others are problems (a collate batches by its first example's keys and
    dtypes, so such an example changes, or breaks, the batch it comes first in)."""
    kept = []
    for i, example in loaded:
        found = example_structure(example)
        if found == structure:
            kept.append((i, example))
        else:
            problems[i] = f"its structure differs from the others' (keys, types or dtypes): {_short(found)}, not " + (
                _short(structure)
            )
    return kept


def _short(structure: Any) -> str:
    text = repr(structure)
    return text if len(text) <= 120 else text[:119] + "…"


def _load(dataset: Any, indices: list[int], problems: dict[int, str]) -> list[tuple[int, Any]]:
    """``(index, example)`` for the examples that load (all at once through ``__getitems__`` when there is one)."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        try:
            return list(zip(indices, getitems(indices)))
        except Exception:  # noqa: BLE001 - found example by example below
            pass
    loaded = []
    for i in indices:
        try:
            loaded.append((i, dataset[i]))
        except Exception as error:  # noqa: BLE001 - reported by index
            problems[i] = f"reading it raised {describe(error)}"
    return loaded


def _batch(
    collate: Callable[[list[Any]], Any],
    rows: list[tuple[int, Any]],
    reference: tuple[int, Any] | None,
    problems: dict[int, str],
    values: bool = True,
) -> tuple[list[tuple[int, Any]], Any]:
    """The rows that batch together (with the reference, when there is one) and, with ``values``, are finite, and
    their batch."""
    if not rows:
        return rows, None
    try:
        batch = collate([example for _, example in rows])
    except Exception:  # noqa: BLE001 - found example by example below
        rows = _batchable(collate, rows, reference, problems)
        if not rows:
            return rows, None
        batch = collate([example for _, example in rows])
    nonfinite = _nonfinite_rows(batch, len(rows)) if values else []
    for position in nonfinite:
        i, example = rows[position]
        problems[i] = _nonfinite_problem(example)
    if nonfinite:
        rows = [row for position, row in enumerate(rows) if position not in set(nonfinite)]
        batch = collate([example for _, example in rows]) if rows else None
    return rows, batch


def _nonfinite_problem(example: Any) -> str:
    """What is wrong with ``example``, whose row of a batch holds a NaN or an infinity."""
    where = nonfinite_field(example)
    if where is None:
        return "its row of the batch holds NaN or infinite values (made by the collate_fn)"
    return f"a value in {where} is NaN or infinite"


def _batchable(
    collate: Callable[[list[Any]], Any],
    rows: list[tuple[int, Any]],
    reference: tuple[int, Any] | None,
    problems: dict[int, str],
) -> list[tuple[int, Any]]:
    kept = []
    for i, example in rows:
        try:
            collate([example])
        except Exception as error:  # noqa: BLE001
            problems[i] = f"batching it alone raised {describe(error)}"
            continue
        if reference is None:
            reference = (i, example)
        try:
            collate([reference[1], example])
        except Exception as error:  # noqa: BLE001
            problems[i] = f"it does not batch with example {reference[0]} (shapes or types differ): {describe(error)}"
            continue
        kept.append((i, example))
    return kept


def _nonfinite_rows(batch: Any, size: int) -> list[int]:
    """Positions of the rows of a collated batch that hold a NaN or an infinity (one pass per tensor)."""
    bad = torch.zeros(size, dtype=torch.bool)
    for tensor in _tensors(batch):
        if tensor.is_floating_point() and tensor.dim() and tensor.shape[0] == size:
            bad |= ~tensor.reshape(size, -1).isfinite().all(dim=1).cpu()
    return bad.nonzero().flatten().tolist()


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return [t for value in values for t in _tensors(value)]


def _shapes_follow_shapes(collate: Callable[[list[Any]], Any]) -> bool:
    """Whether the batch shapes of ``collate`` (unwrapped from pl_dp's empty-safe wrapper) are a function of its
    examples' shapes alone: torch's ``default_collate``, or a collate whose own class declares
    ``shapes_follow_shapes = True`` (:class:`~pl_dp.data.collate.PaddingCollate`; a subclass must declare it again,
    since it may compute otherwise)."""
    inner = getattr(collate, "collate_fn", collate)
    return inner is default_collate or type(inner).__dict__.get("shapes_follow_shapes") is True


def _score(
    net: nn.Module, loss_fn: PerSampleLoss, batch: Any, rows: list[tuple[int, Any]], problems: dict[int, str]
) -> list[tuple[int, Exception]]:
    """Record the examples whose loss raises or is not finite; returns the failures (positions in ``rows``)."""

    def losses_of(part: Any) -> torch.Tensor:
        return check_per_sample(loss_fn(net, part), batch_size_of(part))

    with torch.inference_mode():
        done, failed = isolate_failures(losses_of, batch)
    for position, error in failed:
        problems[rows[position][0]] = f"the loss raised {describe(error)}"
    nonfinite = "its loss is NaN or infinite"
    if loss_fn in (cross_entropy, causal_lm):  # class_losses: an out-of-range label is a NaN loss
        nonfinite += f" (loss={loss_fn.__name__!r} gives NaN for a label outside the net's classes)"
    for positions, losses in done:
        for position in positions[~torch.isfinite(losses.cpu())].tolist():
            problems[rows[int(position)][0]] = nonfinite
    return failed


def _message(problems: dict[int, str], size: int) -> str:
    listed = sorted(problems)[:LISTED]
    more = len(problems) - len(listed)
    return (
        f"the pre-flight check of the private set found {len(problems)} of its {size} examples unusable (nothing "
        "was trained or released):\n  - "
        + "\n  - ".join(f"example {i}: {problems[i]}" for i in listed)
        + (f"\n  - … and {more} more" if more else "")
        + "\nFix or remove them and run again. Inside training such an example could only contribute nothing, and "
        "any warning or crash it caused would say when it was sampled. Values and losses are checked unless the "
        "method has preflight=False (such examples then contribute 0 to their steps, counted only in "
        "model.nonfinite_total); reading, structure and batching always are."
    )
