"""Exact per-example gradient norms of parameters tied across modules, for ghost clipping.

A language model whose output projection reuses the input embedding matrix (GPT-2, OPT, Llama-style models with
``tie_word_embeddings``) has one parameter W used twice, so an example's gradient of W is the *sum* of the two
uses' gradients, and its norm is not the two layers' ghost norms combined:

    ‖G_emb + G_head‖² = ‖G_emb‖² + ‖G_head‖² + 2⟨G_emb, G_head⟩.

Every use k of W by an ``nn.Linear`` or ``nn.Embedding`` gives an example's gradient as a sum of outer products
over its positions, G_k = Σ_t u_{k,t} v_{k,t}ᵀ: for a linear layer (W ∈ R^{out×in}) u is the output gradient and v
the input; for an embedding (W ∈ R^{num×dim}) u is the one-hot of the looked-up index and v the output gradient.
Then, for any two uses (k = l included),

    ⟨G_k, G_l⟩ = Σ_{t,s} (u_{k,t}·u_{l,s}) (v_{k,t}·v_{l,s}),

two T×T Gram matrices per example, as in ghost clipping (Li, Tramèr, Liang & Hashimoto, 2022), where a one-hot
factor turns a dot product into a lookup: ``u·onehot(j) = u[j]`` and ``onehot(i)·onehot(j) = [i = j]``. Summing all
pairs gives ‖Σ_k G_k‖² exactly, with no per-example gradient formed; the memory is B·T² per pair. The norm is
raised by a bound on the rounding of these products (:mod:`pl_dp.per_sample.gram`): where the uses nearly cancel
(the head's gradient of a token's row against its embedding's), the fp32 cross terms alone can round the norm to 0
while the sum keeps the difference. The other
parameters of the modules that hold a tied one (a linear layer's bias) get their norms here too, since Opacus'
hooks are kept off those modules.

Privacy: this is what makes clipping bound the *whole* per-example gradient of a tied parameter by C; a norm per
use would undercount it (by up to a factor √2 for two uses of equal size) and the released sum could move by more
than C when one example is added or removed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pl_dp.per_sample.book import fingerprint, record_versions, refuse_another_gradient, refuse_changed_inputs
from pl_dp.per_sample.gradients import OPACUS_RNNS
from pl_dp.per_sample.gram import bias_norms, floored, gram_products, in_chunks, mass, raised_norm


def tied_parameters(net: nn.Module) -> list[tuple[nn.Parameter, list[tuple[str, nn.Module]]]]:
    """Each trainable parameter held by more than one module of ``net``, with its owners as ``(qualified parameter
    name, module)``. Opacus' recurrent layers alias their cells' parameters and are not hooked themselves: they do
    not count."""
    owners: dict[int, tuple[nn.Parameter, list[tuple[str, nn.Module]]]] = {}
    for name, module in net.named_modules(remove_duplicate=False):
        if isinstance(module, OPACUS_RNNS):
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                entry = owners.setdefault(id(p), (p, []))[1]
                if all(m is not module for _, m in entry):
                    entry.append((f"{name}.{pname}" if name else pname, module))
    return [(p, found) for p, found in owners.values() if len(found) > 1]


def unsupported_ties(net: nn.Module) -> list[str]:
    """One line per tied trainable parameter whose owners :class:`TiedNorms` cannot handle: it must be the
    ``weight`` of ``nn.Linear`` and ``nn.Embedding`` modules, embeddings without ``scale_grad_by_freq`` (a gradient
    scaled by the batch's token counts) or ``max_norm`` (a forward that writes the weight), and no owner may hold
    a second tied parameter."""
    lines = []
    ties = tied_parameters(net)
    counts: dict[nn.Module, int] = {}
    for _, found in ties:
        for _, m in found:
            counts[m] = counts.get(m, 0) + 1
    for p, found in ties:
        names = " = ".join(name for name, _ in found)
        if any(type(m) not in (nn.Linear, nn.Embedding) or m.weight is not p for _, m in found):
            kinds = sorted({type(m).__name__ for _, m in found})
            lines.append(f"{names} (in {', '.join(kinds)}): exact norms cover tied weights of Linear and Embedding")
        elif any(isinstance(m, nn.Embedding) and (m.scale_grad_by_freq or m.max_norm is not None) for _, m in found):
            lines.append(f"{names}: an nn.Embedding with scale_grad_by_freq or max_norm (batch-dependent gradients)")
        elif any(counts[m] > 1 for _, m in found):
            lines.append(f"{names}: a module holding it holds another tied parameter")
    return lines


class TiedNorms:
    """Records, during one forward and backward, what the per-example norms of the tied parameters need, then sets
    ``_norm_sample`` (Opacus' per-example norm attribute) on them and on the other parameters of their modules.

    Its hooks are active only between :meth:`start` and :meth:`finish`, and each owning module must run once per
    forward (a layer reused in one forward is refused, as for Opacus' ghost norms). With :attr:`keep` set,
    :meth:`finish` also leaves each use's input and output gradient in :attr:`uses` (book-keeping's clipped sum is
    computed from them, :mod:`pl_dp.per_sample.bk`); they are dropped at the next :meth:`start` or :meth:`clear`.
    With :attr:`sink` set, a backward run again through the last forward's graph (ghost clipping's second one) hands
    each use's input and output gradient to the sink, and records nothing.
    """

    def __init__(self, net: nn.Module) -> None:
        self.groups = [(p, [m for _, m in found]) for p, found in tied_parameters(net)]
        self.modules: dict[nn.Module, str] = {}
        names = {m: n or "<the net itself>" for n, m in net.named_modules()}
        for _, group in self.groups:
            for m in group:
                self.modules[m] = names.get(m, "?")
        self._records: dict[nn.Module, list[Any]] = {}
        self._active = False
        #: whether :meth:`finish` keeps each use's ``(module, [input], output gradient)`` in :attr:`uses`
        self.keep = False
        self.uses: list[tuple[nn.Module, list[torch.Tensor], torch.Tensor]] = []
        #: what takes each use's ``(module, [input], output gradient)`` when the backward runs again (ghost clipping's
        #: second one), in place of the record
        self.sink: Callable[[tuple[nn.Module, list[torch.Tensor], torch.Tensor]], None] | None = None
        self._handles = [m.register_forward_hook(self._record) for m in self.modules]

    def __bool__(self) -> bool:
        return bool(self.groups)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start(self) -> None:
        self._records = {m: [] for m in self.modules}
        self.uses = []
        self._active = True

    def stop(self) -> None:
        self._active = False

    def clear(self) -> None:
        self._active = False
        self._records = {}
        self.uses = []

    def _record(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not (self._active and torch.is_grad_enabled() and output.requires_grad):
            return
        records = self._records[module]
        if records:
            raise NotImplementedError(
                f"ghost clipping cannot handle {self.modules[module]!r} ({type(module).__name__}): it holds a tied "
                "weight and is called more than once in one forward. Use per_sample='hooks'."
            )
        entry = [args[0].detach(), None]
        record_versions(entry[:1])
        records.append(entry)

        def keep(grad: torch.Tensor) -> None:
            if self.sink is not None:  # ghost clipping's second backward: this use's output gradient again
                refuse_another_gradient(grad, entry[2], f"{self.modules[module]!r} ({type(module).__name__})")
                self.sink((module, [entry[0]], grad.detach()))
            else:
                entry[1] = grad.detach()

        output.register_hook(keep)

    def finish(self, size: int) -> list[str]:
        """Set ``_norm_sample`` ([size], fp32) on every parameter of the owning modules; return the names of owners
        whose output gradient has no per-example leading dimension (their norms are then left unset)."""
        self._active = False
        not_per_example = []
        factors: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        for module, records in self._records.items():
            if not records or records[0][1] is None:
                continue  # not used by the loss: its parameters get no gradient from it
            inputs, grad = records[0]
            refuse_changed_inputs([inputs], f"{self.modules[module]!r} ({type(module).__name__})")
            if inputs.shape[0] != size or grad.shape[0] != size:
                not_per_example.append(self.modules[module])
                continue
            factors[module] = _factors(module, inputs, grad)
            if self.keep:
                self.uses.append((module, [inputs], grad))
            records[0][1:] = [None, fingerprint(grad)]  # for a second backward to be checked against
        self._records = {}
        if not_per_example:
            return not_per_example
        done: set[int] = set()
        for weight, group in self.groups:
            used = [factors[m] for m in group if m in factors]
            weight._norm_sample = tied_norm(used) if used else torch.zeros(size, device=weight.device)
            done.add(id(weight))
        for module in self.modules:
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter) and bias.requires_grad and id(bias) not in done:
                out = factors[module][0] if module in factors else None
                bias._norm_sample = torch.zeros(size, device=bias.device) if out is None else bias_norms(out, mass(out))
        return []


def _factors(module: nn.Module, inputs: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(u, v, one_hot)`` of a use, flattened to ``[B, T, ·]`` (fp32): for ``one_hot`` u holds indices ``[B, T]``."""
    size = inputs.shape[0]
    if isinstance(module, nn.Embedding):
        indices = inputs.reshape(size, -1)
        values = grad.reshape(size, indices.shape[1], -1).float()
        if module.padding_idx is not None:  # the padding row gets no gradient
            values = values.masked_fill((indices == module.padding_idx).unsqueeze(-1), 0.0)
        return indices, values, True
    out = grad.reshape(size, -1, grad.shape[-1]).float()
    return out, inputs.reshape(size, -1, inputs.shape[-1]).float(), False


def tied_norm(uses: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> torch.Tensor:
    """‖Σ_k G_k‖ per example ([B], fp32) from the factors of a tied weight's uses, Σ_{k,l} ⟨G_k, G_l⟩ in float64
    raised by its rounding bound (:mod:`pl_dp.per_sample.gram`)."""
    total = bound = torch.zeros(uses[0][1].shape[0], device=uses[0][1].device, dtype=torch.float64)
    for a in uses:
        for b in uses:
            square, error = _inner(a, b, later=len(uses) ** 2)
            total, bound = total + square, bound + error
    return floored(raised_norm(total, bound), sum(_mass(use) for use in uses))


def _inner(
    a: tuple[torch.Tensor, torch.Tensor, bool], b: tuple[torch.Tensor, torch.Tensor, bool], later: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """⟨G_a, G_b⟩ per example ([B], float64) from the factors of two uses of one weight (see the module docstring),
    and the bound on its rounding (:func:`~pl_dp.per_sample.gram.gram_products`; ``later``: the additions it goes
    through after), a chunk of examples at a time (:func:`~pl_dp.per_sample.gram.in_chunks`)."""
    (_, _, a_hot), (_, _, b_hot) = a, b

    def compute(
        ua: torch.Tensor, va: torch.Tensor, ub: torch.Tensor, vb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        va64, vb64 = va.double(), vb.double()
        values = torch.bmm(va64, vb64.transpose(1, 2))
        if a_hot and b_hot:
            rows = (ua.unsqueeze(2) == ub.unsqueeze(1)).to(values.dtype)
        elif a_hot:  # u_a·u_b = u_b[index_a]
            rows = ub.gather(2, ua.unsqueeze(1).expand(-1, ub.shape[1], -1)).transpose(1, 2).double()
        elif b_hot:
            rows = ua.gather(2, ub.unsqueeze(1).expand(-1, ua.shape[1], -1)).double()
        else:
            rows = torch.bmm(ua.double(), ub.double().transpose(1, 2))
        exact = a_hot or b_hot  # a one-hot factor's products are lookups: no rounding
        return gram_products(
            rows,
            values,
            _mass((ua, va64, a_hot)) * _mass((ub, vb64, b_hot)),  # float64 lengths: fp32 ones underflow
            widths=va.shape[2] + (0 if exact else ua.shape[2]),
            terms=va.shape[1] * vb.shape[1] + later,
        )

    squares, bound = in_chunks(compute, a[0], a[1], b[0], b[1])
    return squares, bound


def _mass(factors: tuple[torch.Tensor, torch.Tensor, bool]) -> torch.Tensor:
    """Σ_t |u_t|·|v_t| of one use ([B], float64, :func:`~pl_dp.per_sample.gram.mass`; a one-hot u has norm 1, and a
    padding row's v is zeroed)."""
    u, v, one_hot = factors
    return mass(v) if one_hot else mass(u, v)
