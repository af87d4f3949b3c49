"""The boundary of the private step: nothing it prints, warns, logs, raises or how it ends may depend on its batch.

The mechanisms bound what one example changes in the *released* sums; the step around them must not say more.
Two channels escape any noise and are closed here (threat model: docs/privacy-model.md):

* **Messages.** A warning, a log record or a line on stdout/stderr raised while a private batch is evaluated —
  "non-finite value", a tokenizer's notice about one long text — appears or not depending on which records were
  sampled, and loggers save the console (W&B's ``output.log``). :func:`sealed` consumes them silently.
* **Failures.** An exception raised by one record (a label the loss rejects, an input the net cannot take) ends
  the run at the step that samples it: membership and timing disclosed. :func:`isolate_failures` evaluates the
  batch again in halves, down to single examples, so that only the examples that fail alone are left out; the
  caller gives them zero weight (which keeps every sensitivity bound) and counts them privately.

Both are a safety net behind the pre-flight pass (:mod:`pl_dp.step.preflight`), which finds bad records before
the first release and says which; what it cannot foresee (a failure that depends on the parameters too) is
absorbed here. Left to the user's contract: output written by C code directly to the file descriptors, a
process-killing fault (segmentation fault, a CUDA device-side assert, which poisons the context), and time — a
step that isolates a failure takes longer.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch

from pl_dp.step.batches import batch_size_of, select_examples

T = TypeVar("T")


class _Discard:
    """A text stream that keeps nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        return None


def _discard_warning(*args: Any, **kwargs: Any) -> None:
    return None


def _discard_record(self: logging.Logger, record: logging.LogRecord) -> None:
    return None


def _silenced(filters: list[Any]) -> list[Any]:
    """The warning filters inside a sealed block: each of ``filters`` in its place, its action turned into
    ``"ignore"`` unless it is ``"error"``, then one that ignores every other warning.

    The first filter that matches a warning decides, as before, whether it is raised; every other warning is ignored
    — and an ignored warning is the one Python writes to no once-registry (``__warningregistry__``,
    ``warnings.onceregistry``): only a warning that is shown, or would be, marks its location as seen.
    """
    return [("error" if f[0] == "error" else "ignore", *f[1:]) for f in filters] + [("ignore", None, Warning, None, 0)]


def _discard_once(self: logging.Logger, *args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def sealed(active: bool = True) -> Iterator[None]:
    """Inside the block, warnings, log records and writes to ``sys.stdout``/``sys.stderr`` vanish — and leave no
    trace that would change what is shown after it.

    Warnings are ignored by Python's filters, rewritten in place for the block (:func:`_silenced`) and put back
    after it: an ignored warning marks nothing as seen, so whether a warning is shown *after* the block does not
    depend on what was raised inside it (a warning a private record raised first would otherwise hide the same
    warning raised later by public data). The filters' version is left alone, so the once-registries stay valid
    and no warning already shown is shown twice (``catch_warnings`` would reset them all). A warning turned into an
    error (``-W error``) is still raised. Log records are dropped before any handler; a library's once-only log
    helpers on ``logging.Logger`` (Hugging Face's ``warning_once``, whose cache would remember a message a private
    record caused) are not called. ``active=False`` changes nothing (non-private runs, and
    ``log_private_metrics=True``, whose outputs are not private anyway).
    """
    if not active:
        yield
        return
    filters = cast(list[Any], warnings.filters)  # the list itself, rewritten in place (typeshed: a Sequence)
    kept_filters = filters[:]
    once = {name: value for name, value in vars(logging.Logger).items() if hasattr(value, "cache_clear")}
    show, out, err, handle = warnings.showwarning, sys.stdout, sys.stderr, logging.Logger.handle
    filters[:] = _silenced(kept_filters)
    warnings.showwarning = _discard_warning
    sys.stdout = sys.stderr = _Discard()
    logging.Logger.handle = _discard_record  # not logging.disable(): it clears every logger's cache, twice a step
    for name in once:
        setattr(logging.Logger, name, _discard_once)
    try:
        yield
    finally:
        filters[:] = kept_filters
        warnings.showwarning, sys.stdout, sys.stderr, logging.Logger.handle = show, out, err, handle
        for name, value in once.items():
            setattr(logging.Logger, name, value)


#: what every rank of a sharded run raises when the padding example — fixed and not private — fails
PADDING_FAILED = (
    "the net or the loss fails on the fixed validation or public example that pads the passes of a sharded step "
    "(where a rank sampled fewer examples than another): the net is broken, whatever was sampled"
)


class ForwardsInStep:
    """Keeps the ranks of an FSDP2-sharded net in step when its forward raises on one of them.

    A sharded forward is a sequence of collectives: each FSDP2 group all-gathers its parameters in its pre-forward
    hook (once per call of its module). A record that makes the forward raise on one rank would leave the other ranks
    waiting in the next group's all-gather — a hang, or an abort, at the step that sampled the record (invariant 10).
    Run each collective pass of per-example computation inside :meth:`guard`: on a raise, this rank resets FSDP's
    per-pass state (``FSDPModule.reset_iter_state``, PyTorch's documented recovery after a forward that raised:
    every group resharded), then issues the all-gathers the other ranks still run in that forward (``unshard`` and
    ``reshard`` of the groups that follow, in the order of the last forward that completed here *in the same mode*
    — training flag and autograd — since a net may run other layers in training mode), and lets the exception go
    on, so that it meets the other ranks at their next collective: the agreement on which passes failed
    (:class:`PassFailed`, the zeroth-order retries).

    FSDP plans a backward's prefetched all-gathers from its post-forward history, which a rank that caught up and a
    rank that did not would hold differently: the next backward would hang. So every rank resets that state at the
    start of every guarded pass, at the end of every pass that no backward follows, and when the ranks abandon a
    pass together (:meth:`abandon`). This also keeps a net that only runs forwards (the zeroth-order methods) from
    growing that history for the whole run.

    Assumes what FSDP2 assumes of a net: in one mode its groups run in the same order in every forward (no
    data-dependent skipping of sharded layers), and one forward of the net per pass (a loss that runs the net twice
    and raises between the two is not caught up). A layer that activation checkpointing runs again in the backward
    gathers there, outside the net's forward: that is not part of the order. Only the forward and the loss are
    guarded: an exception raised in a backward (a custom autograd function) on one rank still ends the run.
    """

    def __init__(self, net: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(net, FSDPModule):
            raise ValueError(
                "the net is sharded, but not as a whole: apply fully_shard to the net itself after its layers "
                "(FSDP2's recommended use), so that its forward starts and ends in one FSDP2 root."
            )
        self.root = net
        self.orders: dict[tuple[bool, bool], list[Any]] = {}  # per mode: the groups of the last completed forward
        self.current: list[Any] = []  # the groups of the forward under way, as they gathered
        self.forwarding = False  # inside a forward of the net (not, e.g., a checkpointed layer recomputed in backward)
        self.completed = False  # whether a forward completed inside the current guard
        groups = [module for module in net.modules() if isinstance(module, FSDPModule)]
        self.handles = [net.register_forward_pre_hook(self._start)]
        self.handles += [group.register_forward_pre_hook(self._gathered) for group in groups]
        self.handles.append(net.register_forward_hook(self._finish))

    def _mode(self) -> tuple[bool, bool]:
        return bool(self.root.training), torch.is_grad_enabled()

    def _start(self, module: torch.nn.Module, args: Any) -> None:
        self.current, self.forwarding = [], True

    def _gathered(self, module: torch.nn.Module, args: Any) -> None:
        if self.forwarding:  # after FSDP's own pre-forward hook (prepended): the group is gathered
            self.current.append(module)

    def _finish(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.orders[self._mode()] = list(self.current)
        self.forwarding, self.completed = False, True

    @contextlib.contextmanager
    def guard(self, backward_follows: bool = False) -> Iterator[None]:
        """One collective pass of per-example computation (forward and loss): see the class docstring. Without
        ``backward_follows`` the pass's FSDP state is reset when it ends, on every rank; with it, the caller
        agrees with the other ranks on whether the pass failed and calls :meth:`abandon` on every rank if so."""
        self.root.reset_iter_state()
        self.current, self.forwarding, self.completed = [], False, False
        order = self.orders.get(self._mode(), [])
        try:
            yield
        except Exception:
            self.root.reset_iter_state()  # reshards every group, so that each gather below is one
            if not self.completed:
                with torch.no_grad():
                    for module in order[len(self.current) :]:
                        module.unshard()
                        module.reshard()
            self.root.reset_iter_state()
            raise
        if not backward_follows:
            self.root.reset_iter_state()

    def abandon(self) -> None:
        """Reset FSDP's per-pass state: every rank calls it when the ranks abandon a pass together."""
        self.root.reset_iter_state()

    def remove(self) -> None:
        """Take this object's hooks off the net."""
        for handle in self.handles:
            handle.remove()


class PassFailed(Exception):
    """A collective pass (a sharded forward and backward) that every rank abandons because the per-example
    computation raised on some rank — ``here``: on this one. Raised on every rank at once, before the pass's first
    collective after the loss, so that the ranks stay in step; the caller isolates the failing examples in later
    passes that every rank runs as well."""

    def __init__(self, here: bool) -> None:
        super().__init__("a per-example computation raised on some rank: the pass is run again without it")
        self.here = here


def isolate_failures(
    compute: Callable[[Any], T], batch: Any, reset: Callable[[], None] | None = None
) -> tuple[list[tuple[torch.Tensor, T]], list[tuple[int, Exception]]]:
    """``compute(batch)``; if it raises, ``compute`` of each half, recursively, down to single examples.

    Returns the parts that computed, as ``(positions in batch, result)``, and the examples that fail alone, as
    ``(position, exception)``. Without a failure this is one call on ``batch`` itself: ``[(arange(B), result)]``.
    A part is computed from the examples it holds only (per-example independence, checked at fit start), so the
    results are those of the whole batch less the failing examples. ``reset`` runs after every failure (to clear
    what a failed pass left behind, e.g. recorded activations). Only ``Exception`` is caught: an interrupt still
    stops the run.

    A net or loss that fails for every example makes every example sit out, silently: the method checks a fixed
    validation or public example on a schedule of its own (:meth:`~pl_dp.methods.base.PrivateModule.check_reference`)
    and raises there, whatever was sampled. An empty batch is computed as it is (nothing to isolate).
    """
    size = batch_size_of(batch)
    if size == 0:
        return [(torch.arange(0), compute(batch))], []
    done: list[tuple[torch.Tensor, T]] = []
    failed: list[tuple[int, Exception]] = []
    pending = [torch.arange(size)]
    while pending:
        positions = pending.pop()
        part = batch if len(positions) == size else select_examples(batch, positions)
        try:
            done.append((positions, compute(part)))
        except Exception as error:  # noqa: BLE001 - any failure of one record must stay inside the step
            if reset is not None:
                reset()
            if len(positions) == 1:
                failed.append((int(positions[0]), error))
            else:
                half = len(positions) // 2
                pending += [positions[half:], positions[:half]]
    return done, failed


#: the entries of a module's ``__dict__`` that are not plain attributes (parameters, buffers, submodules, mode)
_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules", "training"})
#: what every ``nn.Module`` keeps in its ``__dict__`` (its registries, its hooks' dicts; no cache of a forward's),
#: less the set of its non-persistent buffers' names, which a forward that registers a buffer changes
_MODULE_STATE = frozenset(torch.nn.Module().__dict__) - {"_non_persistent_buffers_set"}


class PlainAttributes:
    """The plain attributes of every module of a net — a cache a forward grows (a positional table as long as the
    longest input seen), a list it appends to — and its buffers as they are bound now, to put back with
    :meth:`restore`.

    Whatever a forward stores there from a private batch stays on the net, and a pickle or a deep copy of the
    module carries it (a table's length says how long the longest record sampled was). Restored after the
    fit-start checks and after every private step: added attributes removed, reassigned ones put back, lists,
    dicts and sets (and their subclasses: an ``OrderedDict`` or ``Counter`` cache) refilled, buffers a forward
    registers or binds anew (a rotary table grown to the longest input, as Hugging Face's dynamic RoPE does) put back
    with their persistence; parameters and submodules are not touched. A tensor written in place, attribute or buffer,
    is not restored: the probe refuses a forward that writes a buffer, and a tensor attribute is the user's contract.
    """

    def __init__(self, net: torch.nn.Module) -> None:
        self.attributes = [(module, module.__dict__.copy(), module._buffers.copy()) for module in net.modules()]
        #: each list, dict and set held in a plain attribute: its module, name and a copy of its contents
        self.contents = [
            (module, key, copy.copy(value))
            for module, attributes, _ in self.attributes
            for key in attributes.keys() - _MODULE_STATE  # a few keys a module: its own attributes
            if isinstance(value := attributes[key], (list, dict, set))
        ]

    def restore(self) -> None:
        for module, saved, buffers in self.attributes:
            current = module.__dict__
            if not _same_entries(current, saved):  # most modules: nothing added, removed or reassigned (checked in C)
                for key in [key for key in current if key not in saved and key not in _REGISTRIES]:
                    del current[key]
                for key, value in saved.items():
                    if key not in _REGISTRIES and current.get(key) is not value:
                        current[key] = value
            if not _same_entries(module._buffers, buffers):
                module._buffers.clear()
                module._buffers.update(buffers)
        for module, key, saved in self.contents:
            value = module.__dict__[key]  # the object the attribute held before, put back above
            if isinstance(value, list) and len(value) == len(saved) and all(map(operator.is_, value, saved)):
                continue
            if isinstance(value, dict) and isinstance(saved, dict) and _same_entries(value, saved):
                continue
            try:
                if isinstance(value, list):
                    value[:] = saved
                else:  # a dict, or a set (whose elements nothing compares: always refilled)
                    value.clear()
                    value.update(saved)
            except Exception:  # noqa: BLE001 - a container that refuses to be refilled: a copy of it in its place
                module.__dict__[key] = saved


def _same_entries(current: dict, saved: dict) -> bool:
    """Whether two dicts hold the same key objects mapping to the same value objects, in the same order."""
    return (
        len(current) == len(saved)
        and all(map(operator.is_, current.keys(), saved.keys()))
        and all(map(operator.is_, current.values(), saved.values()))
    )
