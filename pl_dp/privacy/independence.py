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

Two checks, both at fit start and before any private step:

* :func:`refuse_batch_mixing_modules` refuses, by type, every known mixing module anywhere in the net,
  whether or not it has parameters: all errors are collected and raised once, each with the module's
  qualified name, its type and a replacement (the shape of Opacus' ``ModuleValidator.validate(strict=True)``).
* :func:`probe_independence` tests behaviour, for any net and any callable loss: it computes the per-example
  losses of a few examples, then of the same examples with one replaced, in the mode(s) in which the method
  evaluates its private losses, and refuses if another example's loss (or, with autograd, the other
  examples' summed gradient) moves, or if the forward pass writes a buffer or a parameter.
  :func:`probe_examples` picks its examples: public data, else validation data, else private data by index.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from torch.utils.data._utils.collate import default_collate

from pl_dp.privacy.losses import PerSampleLoss, batch_size_of, check_per_sample

#: examples in the probe batch (one more is read to replace one of them): a BatchNorm-sized batch
PROBE_SIZE = 8
#: a watched loss "moved" when it changed by more than this fraction of the largest watched loss
#: (plus NOISE_MARGIN times the jitter between two passes over the same examples; see probe_independence)
RELATIVE_TOLERANCE = 1e-5
NOISE_MARGIN = 10.0

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


class IndependenceError(ValueError):
    """A net or loss in which one example's loss or gradient depends on other examples, or which writes a
    statistic of its input into a buffer: it breaks every per-example sensitivity bound."""


def batch_mixing_modules(net: nn.Module) -> list[str]:
    """One line per module of ``net`` known to mix examples or to record statistics of its inputs.

    * every BatchNorm (``BatchNorm1d/2d/3d``, their ``Lazy`` forms, ``SyncBatchNorm``), whatever its ``affine``
      and ``track_running_stats``: in train mode it normalizes each example by the batch's statistics, and its
      running statistics are un-noised averages of the data;
    * InstanceNorm with ``track_running_stats=True``: per example in its output, but its running buffers are
      un-noised statistics of the data, saved in checkpoints.

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


def probe_examples(
    datamodule: Any, private_loader: Any, public: bool = True, size: int = PROBE_SIZE
) -> tuple[Any, str]:
    """Up to ``size + 1`` collated examples for :func:`probe_independence`, and where they come from.

    The first examples, by index, of the first of these with at least three: the datamodule's ``public``
    dataset (only with ``public=True``: pass it for methods that train on public data, whose public set goes
    through the same net and loss; another method's public set need not fit them), its ``val`` dataset (the
    attribute names of :class:`~pl_dp.data.PrivatePublicDataModule`; any object without them is skipped),
    then the private loader's ``dataset``. They are collated with the private loader's ``collate_fn``, so the
    probe sees batches shaped like the private ones.

    Private examples are read only when neither public nor validation data exists, and then by index —
    never through the private loader or its sampler, whose randomness is a secret of the run and whose
    position is checkpointed. Reading them is acceptable because the probe's only output is pass or refuse,
    before any training step: for a net in which each example's loss depends on that example alone, the
    probe passes whatever the data, so its output is a constant and reveals nothing about any example. It
    can refuse only a net that breaks per-example independence — and then nothing is trained, logged or checkpointed,
    the refusal goes only to whoever runs the job (who holds the data already), and its message names
    positions in the probe batch, never values computed from the data.
    """
    collate = getattr(private_loader, "collate_fn", None) or default_collate
    candidates = (
        ("public", getattr(datamodule, "public", None) if public else None),
        ("validation", getattr(datamodule, "val", None)),
        ("private", getattr(private_loader, "dataset", None)),
    )
    for source, dataset in candidates:
        if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__") and len(dataset) >= 3:
            return collate([dataset[i] for i in range(min(len(dataset), size + 1))]), source
    raise IndependenceError(
        "per-example independence is checked at fit start on at least 3 examples (public, "
        "validation or private); the datasets here have fewer."
    )


def probe_independence(
    net: nn.Module,
    loss_fn: PerSampleLoss,
    examples: Any,
    modes: Iterable[Mode] = ("train", "eval"),
    source: str = "probe",
) -> None:
    """Refuse ``net`` and ``loss_fn`` if one example's loss depends on another example or the forward writes state.

    ``examples`` is a collated batch of m ≥ 3 examples (from :func:`probe_examples`, on the net's device).
    The probe batch is the first k = m − 1 of them; its *modified* copy has the middle example (position
    k // 2) replaced by the m-th. Replacing the middle one catches mixing in both directions along the batch
    (a recurrent layer run over the batch dimension carries earlier examples into later ones only). In each
    mode, three passes — the probe batch, the probe batch again, the modified batch — give per-example losses:

    * ``"train"``: the net's modes as they are during training steps (fit start), autograd on — how
      first-order methods compute per-example gradients. The random generators are forked and reset to the
      same state before each pass, so dropout draws the same masks for the same positions. Besides the
      losses, the summed gradient of the watched examples (all but the replaced one) is compared: it catches
      mixing done only by the backward pass, such as ``x + (m - m.detach())`` with ``m`` a batch mean.
    * ``"eval"``: ``net.eval()`` under ``torch.inference_mode()``, exactly as zeroth-order methods evaluate
      their private losses (:func:`pl_dp.zo.per_sample_evaluator`).

    **Tolerance.** A watched loss has moved when ``|ℓ'_j − ℓ_j| > RELATIVE_TOLERANCE·max_i |ℓ_i| + NOISE_MARGIN·ν``,
    ν being the largest change between the two passes over the same examples (the same rule, with norms,
    for the gradient). For a per-example net the watched rows go through the same arithmetic on the same
    values in both passes, so on deterministic kernels they agree bit for bit (ν = 0); 1e-5 (about 80 fp32
    ulps of the largest loss) absorbs a different summation order, and ν absorbs the jitter of
    non-deterministic kernels (GPU atomics, reduced precision), so noise is not mistaken for mixing. Real
    mixing is far above: a parameter-free BatchNorm over 8 examples moves the other losses by 4e-2 to 7e-2 of
    the largest (an MLP on blobs or on the digits), a full batch-mean subtraction by 1e-2 to 2e-2, and even a
    1 % one by 5e-5 to 5e-4, while a per-example net (with or without dropout) moves them by exactly 0.

    **State.** Every buffer and parameter is watched (version counter and identity): a forward that writes
    one stores something computed from the batch, which every checkpoint would release un-noised. Any
    write is refused, even one that looks data-independent on a few examples (a counter, a running maximum
    that the replaced example did not move): the probe cannot tell which. Known false alarm: spectral
    normalization in train mode (its power iteration writes ``_u``, ``_v`` from the weights only). The probe
    leaves the net as it found it — buffers (objects and values) restored, added buffers removed, each
    module's train/eval flag restored, no parameter written (gradients are taken with ``torch.autograd.grad``;
    ``.grad`` is untouched) — and restores the CPU and CUDA random generators, so a run draws the same random
    stream with or without it. It costs three forwards per mode (plus three backwards in ``"train"``), once.

    Raises :class:`IndependenceError` naming the positions, the mode and what to do; the message holds no
    value computed from the examples.
    """
    count = batch_size_of(examples)
    if count < 3:
        raise IndependenceError(f"the independence probe needs at least 3 examples, got {count}.")
    state = _NetState(net)
    problems: list[str] = []
    try:
        with torch.random.fork_rng(devices=state.cuda_devices):
            probe = _Probe(net, loss_fn, examples, count, state)
            for mode in modes:
                problems += probe.findings(mode, source)
    finally:
        state.reset()
    if problems:
        raise IndependenceError(
            "per-example independence is violated:\n  - " + "\n  - ".join(problems) + "\n"
            "Each example's loss and gradient must depend on that example alone, or clipping bounds nothing and "
            "the reported epsilon is wrong. Look for a statistic over the batch dimension in the net or the loss: "
            "a batch mean or normalization (use nn.GroupNorm or nn.LayerNorm), or attention or a recurrent layer "
            "run over the batch dimension (nn.MultiheadAttention, nn.RNN/LSTM/GRU and nn.Transformer expect "
            "[T, B, ...] unless batch_first=True). A forward pass must not write buffers or parameters (use "
            "track_running_stats=False, or compute such statistics from public data before training)."
        )


@dataclass
class _Pass:
    """One forward (and, in train mode, backward) over a batch."""

    losses: torch.Tensor  # [k], fp32, on the CPU
    gradient: tuple[torch.Tensor, ...] | None  # Σ over watched examples of ∇ℓ_j (train mode, trainable params)
    written: list[str]  # buffers and parameters the forward wrote


class _Probe:
    """The three passes of :func:`probe_independence` in one mode, and what they show."""

    def __init__(self, net: nn.Module, loss_fn: PerSampleLoss, examples: Any, count: int, state: _NetState) -> None:
        self.net, self.loss_fn, self.examples, self.count, self.state = net, loss_fn, examples, count, state
        self.size = count - 1
        self.replaced = self.size // 2
        self.watched = [i for i in range(self.size) if i != self.replaced]
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.rng = _RandomState(state.cuda_devices)

    def findings(self, mode: Mode, source: str) -> list[str]:
        """Message lines (positions and names only, no value computed from the examples)."""
        if mode not in _MODE_WORDS:
            raise ValueError(f"the probe's modes are {sorted(_MODE_WORDS)}, got {mode!r}.")
        original = list(range(self.size))
        reference = self._run(original, mode)
        loss_noise, gradient_noise = self._changes(reference, self._run(original, mode))  # jitter of the kernels
        changed = self._run([self.size if i == self.replaced else i for i in original], mode)
        loss_shift, gradient_shift = self._changes(reference, changed)
        where = f"{_MODE_WORDS[mode]}, on a probe batch of {self.size} {source} examples"
        replaced = f"replacing only the example at position {self.replaced}"
        found = []
        losses = reference.losses[self.watched]
        tolerance = RELATIVE_TOLERANCE * _finite_max(losses.abs()) + NOISE_MARGIN * _finite_max(loss_noise)
        moved = [j for j, shift in zip(self.watched, loss_shift.tolist()) if shift > tolerance]
        if moved:
            found.append(f"{where}, {replaced} changed the losses of the examples at positions {moved}")
        elif reference.gradient is not None:  # a non-finite gradient makes the comparison False: not compared
            bound = RELATIVE_TOLERANCE * _norm(reference.gradient) + NOISE_MARGIN * gradient_noise
            if gradient_shift > bound:
                found.append(
                    f"{where}, {replaced} changed the summed gradient of the other examples (positions "
                    f"{self.watched}) though not their losses: the backward pass mixes examples"
                )
        written = sorted(set(reference.written + changed.written))
        if written:
            found.append(
                f"{where}, the forward pass wrote {written}: a buffer or parameter written from the batch is an "
                "un-noised statistic of private data that every checkpoint releases"
            )
        return found

    def _run(self, rows: list[int], mode: Mode) -> _Pass:
        """One pass over a fresh copy of ``rows``, from the same net state and the same random draws."""
        self.state.reset()
        self.rng.reset()
        batch = _rows(self.examples, rows, self.count)
        if mode == "eval":
            self.net.eval()
            with torch.inference_mode():
                losses = check_per_sample(self.loss_fn(self.net, batch), self.size)
            return _Pass(losses.detach().cpu(), None, self.state.written())
        with torch.enable_grad():
            losses = check_per_sample(self.loss_fn(self.net, batch), self.size)
            summed = losses[self.watched].sum()
            gradient = None
            if self.params and summed.requires_grad:
                gradient = torch.autograd.grad(summed, self.params, allow_unused=True, materialize_grads=True)
        return _Pass(losses.detach().cpu(), gradient, self.state.written())

    def _changes(self, reference: _Pass, other: _Pass) -> tuple[torch.Tensor, float]:
        """Watched examples' loss changes, and the norm of the change of their summed gradient (0 without one)."""
        losses = _differences(reference.losses[self.watched], other.losses[self.watched])
        if reference.gradient is None or other.gradient is None:
            return losses, 0.0
        return losses, _norm(a - b for a, b in zip(reference.gradient, other.gradient))


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


def _rows(batch: Any, rows: list[int], count: int) -> Any:
    """A fresh copy of ``batch`` with only ``rows`` (every tensor or per-example list of ``count`` entries)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() and batch.shape[0] == count:
            return batch[torch.tensor(rows, device=batch.device)]
        return batch
    if isinstance(batch, Mapping):
        return {key: _rows(value, rows, count) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        if len(batch) == count and all(isinstance(v, (str, bytes, int, float)) for v in batch):
            return type(batch)(batch[i] for i in rows)  # a per-example list, e.g. texts
        return type(batch)(_rows(value, rows, count) for value in batch)
    return batch


class _Slot(NamedTuple):
    """A buffer or parameter of the net: where it is attached, and the tensor found there."""

    qualified: str
    module: nn.Module
    name: str
    tensor: torch.Tensor

    def written_since(self, version: int) -> bool:
        return getattr(self.module, self.name, None) is not self.tensor or self.tensor._version != version


class _NetState:
    """What the probe must leave as it found it, and which buffers and parameters a forward wrote.

    Writes are seen through each tensor's version counter (bumped by every in-place operation, also under
    ``torch.inference_mode()``) and identity (a reassigned attribute); buffers added by a forward are seen
    by name.
    """

    def __init__(self, net: nn.Module) -> None:
        self.net = net
        self.modes = [(module, module.training) for module in net.modules()]
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
        """Buffers back to their objects and values, added buffers removed, every module's mode restored."""
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
