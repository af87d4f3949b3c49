"""Per-example gradients, through Opacus' hooks (default) or ``torch.func``.

* ``mode="hooks"`` wraps the network in Opacus' ``GradSampleModule`` (the layers Opacus
  supports: Linear, Conv, Embedding, LayerNorm, GroupNorm, RNNs, …) and reads ``grad_sample``
  after one backward of the summed per-example losses. Modules in eval mode (a pretrained model
  from ``from_pretrained``, a ``peft`` model, frozen dropout) get per-example gradients too.
* ``mode="functorch"`` uses ``torch.func.vmap(grad(...))`` over single examples: any layer whose
  forward has no Python control flow on tensor values, more memory for large batches. Hugging Face
  ``transformers`` models branch on their attention masks (``mask.all()``), which ``vmap`` cannot
  follow, so they are refused with a pointer to ``"hooks"``.

Either way the per-example loss is the user's contract ``(net, batch) -> Tensor[B]``. For the clipped sum
without per-example gradients (ghost clipping), see :mod:`pl_dp.per_sample.ghost`.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from opacus import GradSampleModule
from opacus.grad_sample.functorch import prepare_layer
from opacus.layers import DPGRU, DPLSTM, DPRNN
from opacus.utils.module_utils import trainable_modules
from torch import nn
from torch.func import functional_call, grad, vmap

from pl_dp.errors import ConfigError
from pl_dp.per_sample.rms_norm import WithRMSNormSamplers
from pl_dp.privacy.clip_functions import ClipFunction
from pl_dp.step.batches import batch_size_of, select_examples
from pl_dp.step.losses import PerSampleLoss, check_per_sample
from pl_dp.step.shards import layout_of, local, replicated_gradient, sum_over_ranks_, whole

if TYPE_CHECKING:  # the engines' protocol lives with the registry, which imports this module
    from pl_dp.per_sample.modes import PerSampleEngine


class _Functional(nn.Module):
    """Presents ``net`` with substituted parameters as a module, for the user's loss callable."""

    def __init__(self, net: nn.Module, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.net = net
        self.params = params

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.net, self.params, args, kwargs)


class RecordsInEvalMode:
    """Mixin for Opacus' hook classes: record activations whenever the hooks are enabled, in eval mode too.

    Opacus records a layer's input in its forward hook only when ``module.training`` is set, but its backward
    hook runs in either mode and raises ``No activations detected for <layer>`` when nothing was recorded. A
    pretrained Hugging Face model is in eval mode after ``from_pretrained`` (and Lightning keeps submodule modes),
    and ``peft`` wraps it as it is, so every trainable layer of a user's ``PeftModel`` hits that error. Here the
    hooks are enabled only around one per-example computation (per-example gradients or norms), so the training
    flag need not gate recording: the layer's mode keeps deciding its forward (dropout), and its input is
    recorded either way. The flag is raised only while Opacus' hook reads it, after the forward ran.
    """

    def capture_activations_hook(self, module: nn.Module, forward_input: Any, forward_output: Any) -> None:
        training = module.training
        module.training = True
        try:
            super().capture_activations_hook(module, forward_input, forward_output)
        finally:
            module.training = training


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, or a tuple or list of them), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    return [t for t in output if isinstance(t, torch.Tensor)] if isinstance(output, (tuple, list)) else []


class _Unchangeable(torch.autograd.Function):
    """The identity on a hooked call's output, as a view made inside a custom ``autograd.Function``, which autograd
    forbids changing in place. A change in place after the call would take a part of the output's gradient past a hook
    on the output's own node, through the base of an output that is itself a view (``nn.Linear`` returns one on
    contiguous ``[B, T, d]`` inputs — on a transposed input only when B = 1 or T = 1, so the part missed would depend on
    the batch; found by review). Opacus' full backward hooks refused such changes the same way."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor) -> torch.Tensor:
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class HooksOutputGradients:
    """Mixin for Opacus' hook modules of one process (per-example gradients, and the norms of ghost clipping and
    book-keeping): each hooked call's output gradient reaches Opacus' backward hook through a tensor hook on the
    call's first output, made unchangeable in place (:class:`_Unchangeable`) by its forward hook, instead of a full
    backward hook on the layer (whose hook Opacus reads the first output's gradient of too). The gradient is the same
    one, and the hook fires once per backward through the call, as a full backward hook's does; but a full backward
    hook wraps every call's inputs and outputs in autograd nodes of its own and runs Python around them, about 0.3 ms a
    layer and pass on a CPU — as much as the digits MLP's whole forward. As under a full backward hook, neither the
    output nor (in the call) an input may be changed in place: the recorded input would not be what the layer computed
    with, and Opacus computes the per-example gradient from it (a ``LayerScale`` multiplying its input in place, found
    by review)."""

    hooks_enabled: bool
    _module: nn.Module
    GRAD_SAMPLERS: dict[type, Any]
    #: per hooked module, each of its running calls' tensor inputs and their versions (a call may be nested in itself)
    _input_versions: dict[nn.Module, list[list[tuple[torch.Tensor, int]]]]

    def add_hooks(
        self, *, loss_reduction: str = "mean", batch_first: bool = True, force_functorch: bool = False
    ) -> None:
        """Opacus' ``add_hooks`` (the same modules, and ``prepare_layer`` for those without a sampler), with the
        output's tensor hook (and a check of its inputs' versions) in place of the full backward hook."""
        if hasattr(self._module, "autograd_grad_sample_hooks"):
            raise ValueError("Trying to add hooks twice to the same model")
        handles: list[Any] = []
        self._module.autograd_grad_sample_hooks = handles
        self.autograd_grad_sample_hooks = handles
        for module in self.iterate_submodules(self._module):  # type: ignore[attr-defined]
            if type(module) in OPACUS_RNNS:  # Opacus hooks their RNNLinear layers instead
                continue
            if force_functorch or self._get_module_type(module) not in self.GRAD_SAMPLERS:  # type: ignore[attr-defined]
                prepare_layer(module, batch_first=batch_first)
            record = partial(self._record_call, loss_reduction=loss_reduction, batch_first=batch_first)
            handles.append(module.register_forward_pre_hook(self._note_inputs))
            handles.append(module.register_forward_hook(record))
        self.enable_hooks()  # type: ignore[attr-defined]

    def enable_hooks(self) -> None:
        """Opacus' switch, which each pass turns on at its start: what a call that raised left noted is dropped."""
        self._input_versions = {}
        super().enable_hooks()  # type: ignore[misc]

    def _note_inputs(self, module: nn.Module, args: tuple) -> None:
        if self.hooks_enabled and torch.is_grad_enabled():
            versions = [(a, a._version) for a in args if isinstance(a, torch.Tensor)]
            self._input_versions.setdefault(module, []).append(versions)

    def _record_call(
        self, module: nn.Module, forward_input: Any, forward_output: Any, *, loss_reduction: str, batch_first: bool
    ) -> Any:
        if not (self.hooks_enabled and torch.is_grad_enabled()):
            return None
        noted = self._input_versions.get(module)
        if noted and any(tensor._version != version for tensor, version in noted.pop()):
            raise RuntimeError(
                f"cannot record the per-example gradients of {type(module).__name__}: its forward changed its input in "
                "place, so the input recorded for them is not the one the layer computed with. Change a copy of the "
                "input (x = x * scale, not x.mul_(scale))."
            )
        self.capture_activations_hook(module, forward_input, forward_output)  # type: ignore[attr-defined]
        outputs = output_tensors(forward_output)
        if not outputs or not outputs[0].requires_grad:
            return None
        watched = _Unchangeable.apply(outputs[0])
        watched.register_hook(
            partial(self._output_gradient, module, loss_reduction=loss_reduction, batch_first=batch_first)
        )
        if isinstance(forward_output, torch.Tensor):
            return watched
        rest = iter([watched, *outputs[1:]])
        items = [next(rest) if isinstance(t, torch.Tensor) else t for t in forward_output]
        return forward_output._make(items) if hasattr(forward_output, "_make") else type(forward_output)(items)

    def _output_gradient(
        self, module: nn.Module, grad: torch.Tensor, *, loss_reduction: str, batch_first: bool
    ) -> None:
        self.capture_backprops_hook(module, None, (grad,), loss_reduction, batch_first)  # type: ignore[attr-defined]


class _RecordingGradSampleModule(HooksOutputGradients, WithRMSNormSamplers, RecordsInEvalMode, GradSampleModule):
    """Opacus' ``GradSampleModule`` recording activations in eval mode too (see :class:`RecordsInEvalMode`), with the
    closed form of Hugging Face's RMSNorm layers (:mod:`pl_dp.per_sample.rms_norm`)."""


class BroadcastLookups:
    """Gives each example its own rows in a trainable ``nn.Embedding`` that the net looks up once for the batch.

    BERT's and GPT-2's position embeddings are looked up with position ids of shape ``[1, T]`` and the result is
    broadcast over the batch, so Opacus' hooks see one "example" in that layer and cannot split its gradient by
    example (the whole of full fine-tuning fails on it). During the per-example passes such indices (leading size
    1 in a batch of B > 1) are expanded to ``[B, T]``: the same rows, once per example. This changes nothing when
    the lookup's output is broadcast over the batch, which :meth:`check` verifies once, on the first batch where
    an expansion happened, by comparing the per-example losses with and without it (eval mode, no autograd).
    """

    def __init__(self, net: nn.Module) -> None:
        self.net = net
        self.embeddings = {
            m: name or "<the net itself>"
            for name, m in net.named_modules()
            if isinstance(m, nn.Embedding) and m.weight.requires_grad
        }
        self.expanded: set[str] = set()
        self.checked = False

    @contextlib.contextmanager
    def expanding(self, size: int) -> Iterator[None]:
        """Within the block, lookups of a batch of ``size`` examples with leading size 1 are expanded to ``size``.

        Indices are also made contiguous (an ``expand``-ed index tensor is not): Opacus' ghost norm of an
        embedding views them flat.
        """
        if not self.embeddings:
            yield
            return

        def expand(module: nn.Module, args: tuple) -> tuple | None:
            if not args or not isinstance(args[0], torch.Tensor):
                return None
            indices = args[0]
            if size > 1 and indices.dim() >= 1 and indices.shape[0] == 1:
                self.expanded.add(self.embeddings[module])
                indices = indices.expand(size, *indices.shape[1:])
            return None if indices.is_contiguous() else (indices.contiguous(), *args[1:])

        # first: the hooks that record each call's inputs see the indices it computes with
        handles = [m.register_forward_pre_hook(expand, prepend=True) for m in self.embeddings]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def check(self, loss_fn: PerSampleLoss, batch: Any, size: int) -> None:
        """Refuse (once, after the first expansion) a net whose losses change when a lookup is expanded."""
        if self.checked or not self.expanded:
            return
        modes = {m: m.training for m in self.net.modules()}
        try:
            self.net.eval()  # no dropout: the two forwards must be comparable
            with torch.no_grad():
                plain = check_per_sample(loss_fn(self.net, batch), size)
                with self.expanding(size):
                    expanded = check_per_sample(loss_fn(self.net, batch), size)
        finally:
            for m, training in modes.items():
                m.training = training
        if not torch.allclose(plain, expanded, rtol=1e-4, atol=1e-6, equal_nan=True):
            raise RuntimeError(
                f"{sorted(self.expanded)} are looked up once for the whole batch (indices of leading size 1), and "
                "giving each example its own lookup changes the per-example losses: their output is not simply "
                "broadcast over the batch, so their gradient cannot be split by example. Freeze them "
                "(requires_grad=False) or use per_sample='functorch'."
            )
        self.checked = True


OPACUS_RNNS = (DPRNN, DPLSTM, DPGRU)
#: trainable layers whose per-example gradients and norms Opacus computes only for its own replacement of them
_REPLACED_BY_OPACUS = {nn.MultiheadAttention: "DPMultiheadAttention", nn.RNNBase: "DPRNN, DPLSTM or DPGRU"}


#: trainable layers whose per-example gradients Opacus' hooks get wrong, and what to use instead. Opacus' sampler of
#: ``nn.EmbeddingBag`` unpacks ``(input, offsets)``, so a bag called on a 2-D batch of indices fails with "not enough
#: values to unpack"; called with offsets, it adds a row once however often a bag repeats its index.
_WRONG_UNDER_OPACUS = {
    nn.EmbeddingBag: "Opacus' hooks compute no correct per-example gradient for it (they need offsets and count an "
    "index repeated in a bag once); use per_sample='functorch', or nn.Embedding followed by a sum or mean over the bag"
}


def unsupported_layers(net: nn.Module) -> list[str]:
    """One line per trainable layer of ``net`` that Opacus' hooks cannot give per-example gradients or norms for.

    Found from the net's structure alone, when the engine is built at fit start: never from the data."""
    found = []
    for name, module in trainable_modules(net):
        label = f"{name or '<the net itself>'!r} ({type(module).__name__})"
        for kind, replacement in _REPLACED_BY_OPACUS.items():
            if isinstance(module, kind) and not isinstance(module, OPACUS_RNNS):
                found.append(f"{label}: use Opacus' {replacement}")
        found += [f"{label}: {advice}" for kind, advice in _WRONG_UNDER_OPACUS.items() if isinstance(module, kind)]
    return found


def refuse_unsupported_layers(net: nn.Module, mode: str) -> None:
    """Refuse, naming each one and what works instead, the trainable layers of ``net`` for which Opacus' hooks —
    which ``per_sample=mode`` is built on — give no per-example gradient or norm (:func:`unsupported_layers`)."""
    unsupported = unsupported_layers(net)
    if unsupported:
        raise ConfigError(
            f"per_sample={mode!r} cannot compute per-example gradients or their norms for these trainable layers:\n"
            "  - " + "\n  - ".join(unsupported) + "\n(opacus.validators.ModuleValidator.fix(net) swaps the attention "
            "and recurrent layers; Opacus' DPMultiheadAttention takes no causal masks). Or use per_sample='functorch' "
            "(torch.func differentiates them as they are; not on a net sharded by FSDP2), a zeroth-order method "
            "(DPZero needs only forward passes), or freeze them (requires_grad=False)."
        )


def full_precision(device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Autocast off on ``device``'s type, so that what runs inside computes in the tensors' own precision (fp32 under
    a mixed-precision trainer); nothing where autocast is off already (an autocast context costs ~10 µs to enter,
    several times a step)."""
    device_type = torch.device(device).type
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def clear_hook_state(net: nn.Module, params: Sequence[nn.Parameter]) -> None:
    """Leave nothing of a per-example pass in Opacus' hooks: recorded inputs, call counters and partial per-example
    gradients (ghost norms, ``_norm_sample``, are reset by the next ghost pass). A layer run but not reached by the
    backward — or a pass that raised halfway — keeps some, and the counters would then misalign the next pass."""
    for module in net.modules():
        # Opacus' FSDP module keeps its call counters and per-example norms on the layers
        for attr in ("activations", "max_batch_len", "_forward_counter", "norm_sample"):
            if attr in module.__dict__:  # its own attribute (a wrapper such as peft's may forward the name)
                delattr(module, attr)
    for p in params:
        p._forward_counter = 0
        p.grad_sample = None
        if hasattr(p, "_current_grad_sample"):
            del p._current_grad_sample


def refuse_rows_not_examples(names: list[str], size: int, what: str) -> None:
    """Raise when a layer's per-example quantities came back with a leading size other than the batch's."""
    if names:  # clipping rows that are not examples would bound no example's contribution
        raise RuntimeError(
            f"Opacus' hooks returned {what} per input row, not per example, for {names} (a batch of {size}): the "
            "model merges the batch dimension with another before these layers (OPT's fc1 and fc2 see "
            "[batch x tokens, width]) or feeds them one input for the whole batch. Train other parameters (e.g. "
            "trainable='lora' on the attention projections) or use a zeroth-order method."
        )


def _refuse_transformers_under_vmap(net: nn.Module) -> None:
    """Refuse ``per_sample="functorch"`` for a net holding a Hugging Face ``transformers`` model (see the module
    docstring): better at fit start than a ``vmap`` error from inside the attention-mask code at the first step."""
    transformers = sys.modules.get("transformers")  # loaded whenever such a model exists
    if transformers is None:
        return
    found = next((name for name, m in net.named_modules() if isinstance(m, transformers.PreTrainedModel)), None)
    if found is not None:
        raise NotImplementedError(
            f"per_sample='functorch' cannot differentiate the Hugging Face model {found or 'net'!r} per example: "
            "torch.func.vmap cannot follow its data-dependent control flow (attention-mask checks call .item()). "
            "Use per_sample='hooks' (Opacus' per-layer hooks: Linear, Embedding, LayerNorm and the LoRA adapters "
            "of peft models are supported)."
        )


def _unsqueeze(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.unsqueeze(0)
    if isinstance(batch, Mapping):
        return {k: _unsqueeze(v) for k, v in batch.items()}
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return type(batch)(_unsqueeze(v) for v in batch)
    return batch


class PerSampleGradients:
    """Computes ∇ℓ_i(θ) for every example of a batch, for the trainable parameters of ``net``."""

    def __init__(self, net: nn.Module, loss_fn: PerSampleLoss, mode: str = "hooks") -> None:
        if mode not in ("hooks", "functorch"):
            raise ConfigError(f"per-sample gradient mode must be 'hooks' or 'functorch', got {mode!r}.")
        self.net = net
        self.loss_fn = loss_fn
        self.mode = mode
        self.names = [n for n, p in net.named_parameters() if p.requires_grad]
        self.params = [p for p in net.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no trainable parameters (requires_grad=True): nothing to optimize.")
        self._gsm: GradSampleModule | None = None
        if mode == "hooks":
            refuse_unsupported_layers(net, mode)
            self._gsm = _RecordingGradSampleModule(net, batch_first=True, loss_reduction="sum", strict=True)
            self._gsm.disable_hooks()
            self._lookups = BroadcastLookups(net)
        else:
            _refuse_transformers_under_vmap(net)

    def close(self) -> None:
        """Remove Opacus' hooks from the net (before another fit builds its own on the trainable set it has then)."""
        if self._gsm is not None:
            self._gsm.remove_hooks()
            self._gsm = None

    def reset(self) -> None:
        """Clear what a pass that raised left in the hooks (:func:`clear_hook_state`)."""
        clear_hook_state(self.net, self.params)

    def __call__(self, batch: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per-example gradients (one ``[B, *p.shape]`` tensor per parameter) and the per-example losses."""
        size = batch_size_of(batch)
        if self.mode == "hooks":
            return self._hooks(batch, size)
        return self._functorch(batch, size)

    def per_example_norms(self, batch: Any) -> torch.Tensor:
        """‖g_i‖ over every trainable parameter (fp32), from the per-example gradients."""
        per_example, _ = self(batch)
        squares = [g.reshape(g.shape[0], -1).float().square().sum(dim=1) for g in per_example]
        return torch.stack(squares).sum(dim=0).sqrt().detach()

    def clipped_sum(
        self, batch: Any, clip_fn: ClipFunction, rows: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """:func:`clipped_sum` of this batch's per-example gradients (freed before returning); with ``rows`` (a boolean
        mask over the batch), of those rows' only — the others are computed in the batch, then dropped (rows that fill
        a batch to a fixed shape; the examples the probe does not watch)."""
        per_example, _ = self(batch)
        if rows is not None:
            per_example = [g[rows.to(g.device)] for g in per_example]
        return clipped_sum(per_example, clip_fn)

    def _hooks(self, batch: Any, size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        gsm = self._gsm
        gsm.enable_hooks()
        try:
            with self._lookups.expanding(size):
                losses = check_per_sample(self.loss_fn(gsm, batch), size)
            grads = torch.autograd.grad(losses.sum(), self.params, allow_unused=True)  # the hooks fill grad_sample
        finally:
            gsm.disable_hooks()
        out, missed, not_per_example = [], [], []
        for name, p, g in zip(self.names, self.params, grads):
            gs = getattr(p, "grad_sample", None)
            p.grad_sample = None
            if gs is None and g is not None:
                missed.append(name)
            elif gs is not None and gs.shape[0] != size:
                not_per_example.append(name)
            out.append(gs if gs is not None else torch.zeros((size, *p.shape), dtype=p.dtype, device=p.device))
        if missed:  # a zero in place of a gradient would train silently on noise alone
            raise RuntimeError(
                f"the loss depends on {missed}, but Opacus' hooks recorded no per-example gradient for them: they "
                "are used outside the module that holds them (e.g. a weight read directly in another module's "
                "forward). Use per_sample='functorch' or restructure the net so each parameter is used by its module."
            )
        refuse_rows_not_examples(not_per_example, size, "gradients")
        self._lookups.check(self.loss_fn, batch, size)
        return out, losses.detach()

    def _functorch(self, batch: Any, size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        frozen = {n: p.detach() for n, p in self.net.named_parameters() if not p.requires_grad}
        buffers = dict(self.net.named_buffers())

        def single_loss(trainable: dict[str, torch.Tensor], example: Any) -> tuple[torch.Tensor, torch.Tensor]:
            module = _Functional(self.net, {**trainable, **frozen, **buffers})
            loss = check_per_sample(self.loss_fn(module, _unsqueeze(example)), 1).sum()
            return loss, loss.detach()

        trainable = {n: p.detach() for n, p in zip(self.names, self.params)}
        grads, losses = vmap(grad(single_loss, has_aux=True), in_dims=(None, 0), randomness="different")(
            trainable, batch
        )
        return [grads[n] for n in self.names], losses


#: sizes of the probe batches on which :func:`verify_per_example_gradients` compares the per-example gradients
VERIFY_SIZES = (2, 3)


#: a clip no probe gradient reaches: every weight c_i is 1, so a clipped sum is the plain sum Σ_i g_i
UNCLIPPED = ClipFunction("constant", 1e30)


def verify_per_example_gradients(
    per_sample: PerSampleEngine, examples: Any, sizes: Sequence[int] = VERIFY_SIZES, rtol: float = 1e-3
) -> None:
    """Refuse a net whose clipping would not bound each example's contribution, checked on a few examples.

    Clipping bounds an example's contribution only if what is clipped is that example's whole gradient. Opacus'
    hooks see a layer's own calls and take the first dimension of its input as the batch, so two kinds of nets
    break this silently: a parameter also read outside its module (``F.linear(h, self.embedding.weight)``, a bias
    added again by hand) — its per-example gradient misses that use — and a layer that sees the batch in another
    dimension (time-major ``[T, B, d]`` input, ``batch_first=False``, a ``[T, T]`` position table) — its rows are
    positions, and they pass a shape check whenever T equals the batch size. Here, before any step, probe batches
    of each size in ``sizes`` are compared with the autograd gradient of each example's loss computed alone:

    * an engine that returns per-example gradients when called (:class:`PerSampleGradients`, and
      :class:`~pl_dp.per_sample.BookKeeping`, whose clipped sum is made of the very rows it measures): each row must
      equal the example's own gradient to within ``rtol`` (relative); and for an engine that computes its sum and
      its norms apart from those rows (book-keeping's per-layer contractions and norm samplers), its clipped sum with
      every weight 1 must equal the sum of the examples' own gradients (within ``rtol``), and each norm it clips by
      must be at least the example's true norm (as below). On a net sharded by FSDP2 (every rank runs the same probe
      batch) the rows and the sum are this rank's blocks, and their errors are added over the ranks, so that every
      rank refuses or passes alike;
    * an engine that returns only norms (``per_example_norms``: :class:`~pl_dp.per_sample.GhostClipping`, whose
      second pass differentiates the weighted losses, so the clipped quantity is the true gradient): each
      per-example norm must be at least the true norm (within ``rtol``) — a larger norm only clips harder.

    Modules run in eval mode (dropout off) during the check and get their modes back after it. ``examples``
    comes from :func:`pl_dp.step.independence.probe_examples` (public or validation examples, private ones by
    index only when neither exists); the check's only output is pass or refuse before training: for a net whose
    per-example gradients are right it passes whatever the data.
    """
    count = batch_size_of(examples)
    net, params = per_sample.net, per_sample.params
    gradients = per_sample if callable(per_sample) else None  # its rows are what it sums; else: norms only
    # an engine that computes its sum apart from its rows (book-keeping): the sum itself is checked too
    separate_sum = gradients is not None and not isinstance(per_sample, PerSampleGradients)
    modes = {module: module.training for module in net.modules()}
    net.eval()
    wrong: dict[str, float] = {}
    try:
        for size in (k for k in sizes if k <= count):
            batch = select_examples(examples, torch.arange(size))
            rows = [] if gradients is None else gradients(batch)[0]
            # the norms clipped by, where they are not the rows' (ghost clipping; book-keeping's norm samplers)
            norms = per_sample.per_example_norms(batch) if gradients is None or separate_sum else None
            # on a sharded net: the rows, and the totals of the examples' own gradients, are this rank's blocks
            totals = [torch.zeros_like(local(p), dtype=torch.float64) for p in params]
            for i in range(size):
                with torch.enable_grad():
                    single = select_examples(examples, torch.tensor([i]))
                    own = replicated_gradient(check_per_sample(per_sample.loss_fn(net, single), 1).sum(), params)
                squares = sum(float(whole(g.double().square().sum())) for g in own if g is not None)
                reference = max(math.sqrt(squares), 1e-12)
                if norms is not None and math.sqrt(squares) - float(norms[i]) > rtol * math.sqrt(squares):
                    shortfall = 1 - float(norms[i]) / reference
                    wrong["ghost norms"] = max(wrong.get("ghost norms", 0.0), shortfall)
                if gradients is None:
                    continue
                for name, p, row, total, g in zip(per_sample.names, params, rows, totals, own):
                    target = torch.zeros_like(row[i]) if g is None else local(g)
                    total += target.double()
                    error = _norm_over_ranks(name, p, (row[i] - target).double())
                    if error > max(rtol, 16 * torch.finfo(row.dtype).eps) * reference:  # bf16 weights round at 1e-2
                        wrong[name] = max(wrong.get(name, 0.0), error / reference)
            if separate_sum:  # weights 1 (no example reaches the bound): the sum must be Σ_i g_i
                sums = per_sample.clipped_sum(batch, UNCLIPPED)[0]
                named = list(zip(per_sample.names, params, sums, totals))
                scale = max(math.sqrt(sum(_norm_over_ranks(n, p, t) ** 2 for n, p, _, t in named)), 1e-12)
                for name, p, summed, total in named:
                    # a sharded rank's sum is its block of the sum over the ranks, each of which ran this batch
                    error = _norm_over_ranks(name, p, summed.double() - total * _copies(name, p))
                    if error > rtol * scale:
                        wrong[f"{name} (summed)"] = max(wrong.get(f"{name} (summed)", 0.0), error / scale)
    finally:
        for module, training in modes.items():
            module.training = training
    if _on_any_rank(per_sample.names, params, bool(wrong)):
        worst = sorted(wrong, key=wrong.get, reverse=True) or ["parameters checked on another rank"]
        raise RuntimeError(
            f"the per-example gradients of {worst} are not each example's own gradient (relative error up to "
            f"{max([float(v) for v in wrong.values()], default=math.nan):.3g} on a probe batch here): clipping them "
            "would not bound an example's contribution. Either a parameter is also used outside its module (e.g. a "
            "weight read directly in another module's forward, a tied weight used functionally), or a layer sees the "
            "batch in another dimension than the first (time-major input, batch_first=False). Restructure the net, "
            "freeze these parameters, or use per_sample='functorch'."
        )


def _norm_over_ranks(name: str, param: torch.Tensor, block: torch.Tensor) -> float:
    """The norm of a tensor of which this rank holds ``block``, laid out as ``param`` (``name`` for errors): its own
    norm on one process; on a sharded net the squares of every rank's block added (a collective), so that every rank
    refuses or passes alike."""
    group = layout_of(name, param).group
    if group is None:
        return float(torch.linalg.vector_norm(block))
    return math.sqrt(float(sum_over_ranks_(block.square().sum().reshape(1), group)))


def _on_any_rank(names: Sequence[str], params: Sequence[torch.Tensor], found: bool) -> bool:
    """Whether any rank ``found`` something, on a net sharded by FSDP2 (a collective), else ``found``: a check that
    one rank fails and another passes would leave the other waiting at the first step's collectives. The ranks run
    the same probe batch on the same gathered layers, and the errors they compare are added over the ranks, but a
    norm compared on one rank alone could round differently at the tolerance's edge."""
    group = next((layout.group for layout in map(layout_of, names, params) if layout.group is not None), None)
    if group is None:
        return found
    return bool(sum_over_ranks_(torch.tensor([float(found)]), group) > 0)


def _copies(name: str, param: torch.Tensor) -> int:
    """How many ranks add their sums into the block of ``param`` this rank holds (1 on one process)."""
    group = layout_of(name, param).group
    return 1 if group is None else dist.get_world_size(group)


def clipped_sum(
    per_sample: Sequence[torch.Tensor], clip_fn: ClipFunction
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Σ_i c(‖g_i‖)·g_i per parameter, with the flat per-example norm over all parameters (as in the papers:
    no per-layer clipping).

    A non-finite per-example gradient gets weight 0 (its contribution stays within the bound) and is
    counted. Returns the sums (fp32), the per-example norms (fp32) and the non-finite count.
    """
    # per-parameter norms first: no temporary the size of the per-example gradients. Norms and sums are
    # accumulated in fp32 whatever the gradients' dtype (bf16/fp16 under autocast): a norm rounded low in
    # half precision would let a clipped contribution exceed C, and a sum rounded in half precision moves with
    # every example in it (autocast would run the weighted sum's einsum in bf16: 0.35·C at b = 130, found by the probe).
    with full_precision(per_sample[0].device) if per_sample else contextlib.nullcontext():
        return _clipped_sum(per_sample, clip_fn)


def _clipped_sum(
    per_sample: Sequence[torch.Tensor], clip_fn: ClipFunction
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    per_param = torch.stack(
        [torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1, dtype=torch.float32) for g in per_sample], dim=1
    )
    norms = torch.linalg.vector_norm(per_param, dim=1)
    weights, finite = clip_fn.finite_weights(norms)
    nonfinite = (~finite).sum()
    masked = bool(nonfinite)  # one host sync; a copy of the per-example tensors only when needed
    sums = []
    for g in per_sample:
        if masked:
            g = torch.where(finite.view(-1, *[1] * (g.dim() - 1)), g, torch.zeros((), dtype=g.dtype, device=g.device))
        sums.append(torch.einsum("b,b...->...", weights, g if g.dtype == torch.float32 else g.float()))
    return sums, norms, nonfinite
