"""Exact per-example gradients of raw parameters held beside layers, from the live graph, for ghost and BK clipping.

A LayerScale block (Touvron, Cord, Sablayrolles, Synnaeve & Jégou, 2021, "Going deeper with Image Transformers",
CaiT; also ViT variants and ConvNeXt, Liu et al. 2022) computes ``x + gamma * f(x)``: ``gamma`` is a raw
``nn.Parameter`` of the block, beside the block's own layers; a learnable scale or bias on the net itself is the
same. Opacus has no norm sampler for such a module, and its fallback measures the whole module by ``torch.func``
on a copy taken when the engine is built, from its first input only (a gate, a scale set later or a training-mode
branch went unseen: up to 3.4·C, found by review). Here the module's layers keep their own hooks and its raw
parameters θ are differentiated in the graph the first pass has just built — the very function the second pass
(ghost) or the book (BK) sums, dropout masks and state included. Examples are independent (invariant 8), so the
gradient G of Σ_j ℓ_j at any batch-first tensor has row i = ∂ℓ_i/∂(row i), and a forward hook records the module's
call (one per forward):

* **Through products** (LayerScale): when every path from the loss to θ passes through a product ``q * h``
  (``MulBackward0``) inside a recorded call whose factor q reaches θ and has no batch dimension while h is batch
  first, the first backward also returns G at each product's output; row i of G ⊙ h summed to q's shape is example
  i's gradient of q, and one batched vector-Jacobian product from q (no batch dimension: B·|q| work) carries it to
  θ. Cost: one element-wise product per use, O(B·|h|) — as for a layer's ghost norm — and no cross-row arithmetic.
* **From the outputs** (any other use: a bias added, a division): the first backward returns G at the call's outputs
  o, and example i's gradient is (∂o/∂θ)ᵀ G⁽ⁱ⁾, G⁽ⁱ⁾ being G with every row but i zeroed: one vector-Jacobian product
  per example, batched (``torch.autograd.grad(..., is_grads_batched=True)``, vmap over the cotangents) in chunks of at
  most :data:`CHUNK_ELEMENTS` cotangent elements — B·|o| work per example through the module's graph from o to θ.
  A non-finite value of one row reaches every row of such a batched backward (0·∞ = NaN): a non-finite per-example
  gradient in a batch of more than one example raises, and the seal computes the batch again in halves, down to
  single examples (:func:`~pl_dp.step.seal.isolate_failures`), where it is dropped and counted as any other.

Which applies is decided per step from the graph's structure, whatever the batch: the products of every recorded call
are used if every path from the loss to the raw parameters passes through one of them; a module with a parameter
reached otherwise takes the second way, which is exact only if every use the loss depends on lies below its call's
outputs — :meth:`RawGradients.check` refuses a parameter reachable without passing through them (read in the loss,
in another module, or through an output that is not a returned tensor), and a second call of the module is refused.
Each example's contribution is then c_i times the gradient whose norm set c_i: at most C. The per-example gradients
are B·|θ| (kept for BK's sum).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pl_dp.per_sample.gradients import OPACUS_RNNS

#: at most this many elements of batched cotangents at once (a chunk of examples times the call's outputs)
CHUNK_ELEMENTS = 2**24


def raw_parameter_modules(net: nn.Module) -> dict[nn.Module, str]:
    """The modules of ``net`` that hold trainable raw parameters beside trainable layers (or the net itself around
    them), by name: their parameters are differentiated by :class:`RawGradients`, their layers by their own hooks.
    From the net's structure alone; a leaf module of raw parameters stays with Opacus' sampler."""
    found = {}
    for name, module in net.named_modules():
        children = any(p.requires_grad for child in module.children() for p in child.parameters())
        measured = type(module) in GradSampleModuleFastGradientClipping.GRAD_SAMPLERS or type(module) in OPACUS_RNNS
        own = any(p.requires_grad for p in module.parameters(recurse=False))
        if own and children and not measured:  # Opacus' recurrent layers hold their cells' parameters
            found[module] = name or "<the net itself>"
    return found


class RawGradients:
    """Per-example gradients of the raw parameters of ``modules`` (see the module docstring), between :meth:`start`
    and :meth:`finish` of one first pass. With :attr:`keep` set, :meth:`finish` leaves them in :attr:`grads`
    (book-keeping's sum is computed from them); they are dropped at the next :meth:`start` or :meth:`clear`."""

    def __init__(self, modules: dict[nn.Module, str], mode: str) -> None:
        self.modules = modules
        self.mode = mode
        self.params = {m: [p for p in m.parameters(recurse=False) if p.requires_grad] for m in modules}
        #: per call: the module, its output tensors that need a gradient, and the nodes its inputs come from
        self.calls: list[tuple[nn.Module, list[torch.Tensor], set[Node]]] = []
        #: the gradients at the edges :meth:`plan` returned, in order, set by the first backward
        self.output_grads: list[torch.Tensor | None] = []
        self.keep = False
        self.grads: dict[nn.Parameter, torch.Tensor] = {}
        self._products: list[Product] = []  # what :meth:`plan` found
        self._from_outputs: list[tuple[nn.Module, list[torch.Tensor]]] = []
        #: whether :meth:`finish` differentiates through the graph again (the first backward must keep it)
        self.needs_graph = False
        self._active = False
        self._handles = [m.register_forward_hook(self._record, with_kwargs=True) for m in modules]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start(self) -> None:
        self.clear()
        self._active = True

    def clear(self) -> None:
        self.calls, self.output_grads, self.grads, self._products, self._from_outputs = [], [], {}, [], []
        self.needs_graph = self._active = False

    def _record(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (self._active and torch.is_grad_enabled()):
            return
        if any(m is module for m, _, _ in self.calls):  # a second call's graph may contain the first's
            raise NotImplementedError(
                f"per_sample={self.mode!r} cannot handle {self.modules[module]!r} ({type(module).__name__}): it holds "
                "raw parameters and is called more than once in one forward. Use per_sample='functorch'."
            )
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.grad_fn is not None]
        tensors = [output] if isinstance(output, torch.Tensor) else output
        outputs = [t for t in tensors if isinstance(t, torch.Tensor)] if isinstance(tensors, (list, tuple)) else []
        self.calls.append((module, [t for t in outputs if t.requires_grad], {a.grad_fn for a in inputs}))

    def plan(self, root: Node, size: int) -> list[GradientEdge]:
        """Where the first backward must return the gradient: at the output of each product that scales the batch by
        a raw parameter inside a recorded call (:func:`_products`) — enough if every path from ``root`` (the loss) to
        the raw parameters passes through one of them — and at the outputs of the calls of modules with a parameter
        reached otherwise. Refuses such a parameter if ``root`` reaches it without passing through its module's
        outputs (:meth:`check`)."""
        if not self.modules:  # nothing to walk the graph for
            return []
        targets = {id(p) for params in self.params.values() for p in params}
        reaching = _reaching(root, targets)
        found: dict[Node, Product] = {}
        for _, outputs, ends in self.calls:
            for product in _products(outputs, ends, reaching, size):
                found.setdefault(product.node, product)
        elsewhere = _reached(root, targets, {(product.node, product.side) for product in found.values()})
        modules = [m for m, params in self.params.items() if any(id(p) in elsewhere for p in params)]
        self.check(root, modules)
        self._products = list(found.values())
        self._from_outputs = [(m, outputs) for m, outputs, _ in self.calls if m in modules]
        self.needs_graph = bool(self._from_outputs) or any(not _is_parameter(p) for p in self._products)
        return [GradientEdge(product.node, 0) for product in self._products] + [
            get_gradient_edge(t) for _, outputs in self._from_outputs for t in outputs
        ]

    def check(self, root: Node, modules: list[nn.Module]) -> None:
        """Refuse a raw parameter of ``modules`` that the graph of ``root`` (the loss) reaches without passing
        through an output of its module's call: that use would be summed by the release but left out of the
        per-example gradients taken from those outputs."""
        calls = {m: outputs for m, outputs, _ in self.calls}
        outside = []
        for module in modules:
            blocked = {(t.grad_fn, t.output_nr) for t in calls.get(module, []) if t.grad_fn is not None}
            params = {id(p): p for p in self.params[module]}
            outside += [self._name(module, params[key]) for key in _reached(root, set(params), blocked, outputs=True)]
        if outside:
            raise ValueError(
                f"per_sample={self.mode!r} cannot clip {sorted(outside)}: the net or the loss uses them outside the "
                "call of the module that holds them (read in another module, in the loss, or through an output the "
                "module does not return as a tensor), where their per-example gradients are measured. Use each raw "
                "parameter only inside its module's forward, or per_sample='functorch'."
            )

    def _name(self, module: nn.Module, p: torch.Tensor) -> str:
        prefix = self.modules[module]
        name = next(n for n, q in module.named_parameters(recurse=False) if q is p)
        return name if prefix == "<the net itself>" else f"{prefix}.{name}"

    def finish(self, size: int) -> list[str]:
        """Set ``_norm_sample`` ([size], fp32) on every raw parameter from its per-example gradients (zero where the
        loss does not use it); return the names of calls whose outputs are not batch first. Raises if a per-example
        gradient taken from a call's outputs is non-finite in a batch of more than one example (see the module
        docstring)."""
        self._active = False
        grads = iter(self.output_grads)
        by_outputs = {m for m, _ in self._from_outputs}
        through = [p for m, params in self.params.items() if m not in by_outputs for p in params]
        per_example = dict(zip(through, _through_products(self._products, grads, through, size)))
        not_per_example = []
        for module, outputs in self._from_outputs:
            pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
            if any(o.shape[0] != size for o, _ in pairs):
                not_per_example.append(self.modules[module])
                continue
            found = _per_example(pairs, self.params[module], size)
            if size > 1 and not all(bool(g.isfinite().all()) for g in found):
                raise FloatingPointError(
                    f"a non-finite per-example gradient of the raw parameters of {self.modules[module]!r}: a batched "
                    "backward spreads one example's non-finite values to the others; the batch is computed again "
                    "in parts (pl_dp.step.seal.isolate_failures)."
                )
            per_example.update(zip(self.params[module], found))
        for params in self.params.values():
            for p in params:
                g = per_example.get(p)
                p._norm_sample = torch.zeros(size, device=p.device) if g is None else g.flatten(1).norm(dim=1)
                if self.keep and g is not None:
                    self.grads[p] = g
        self.calls, self.output_grads, self._products, self._from_outputs = [], [], [], []
        return not_per_example


def _per_example(pairs: list[tuple[torch.Tensor, torch.Tensor]], params: list[nn.Parameter], size: int) -> list:
    """g_i = (∂o/∂θ)ᵀ G⁽ⁱ⁾ for every example i and raw parameter θ (fp32, ``[size, *θ.shape]``), by batched
    vector-Jacobian products through the kept graph, in chunks of at most :data:`CHUNK_ELEMENTS` cotangent elements."""
    result = [torch.zeros((size, *p.shape), dtype=torch.float32, device=p.device) for p in params]
    if not pairs or size == 0:
        return result
    outputs = [o for o, _ in pairs]
    chunk = max(1, min(size, CHUNK_ELEMENTS // max(1, sum(o.numel() for o in outputs))))
    for start in range(0, size, chunk):
        rows = torch.arange(start, min(start + chunk, size), device=outputs[0].device)
        steps = torch.arange(len(rows), device=rows.device)
        cotangents = []
        for _, g in pairs:
            batched = torch.zeros((len(rows), *g.shape), dtype=g.dtype, device=g.device)
            batched[steps, rows] = g[rows]
            cotangents.append(batched)
        found = torch.autograd.grad(
            outputs, params, cotangents, retain_graph=True, is_grads_batched=True, allow_unused=True
        )
        for total, g in zip(result, found):
            if g is not None:
                total[start : start + len(rows)] = g.float()
    return result


class Product(NamedTuple):
    """A product ``q * h`` in the graph (its ``MulBackward0`` node): ``q`` reaches raw parameters and has no batch
    dimension (it broadcasts over the rows of ``h``), ``h`` is batch first; ``side`` is q's operand (0 or 1)."""

    node: Node
    side: int
    q: torch.Tensor
    h: torch.Tensor


def _products(outputs: list[torch.Tensor], ends: set[Node], reaching: set[Node], size: int) -> list[Product]:
    """The products ``q * h`` between a call's ``outputs`` and the nodes its inputs come from (``ends``) whose factor
    q comes from a node in ``reaching`` (it reaches a raw parameter) and has no batch dimension while h is batch first
    (a LayerScale ``gamma * h``): the graph's structure, and the operands autograd saved for the product's backward
    (``_saved_self``, ``_saved_other``)."""
    found: list[Product] = []
    seen: set[Node] = set(ends)
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        product = _product(node, reaching, size)
        if product is not None:
            found.append(product)
        skipped = -1 if product is None else product.side
        stack += [n for k, (n, _) in enumerate(node.next_functions) if n is not None and k != skipped]
    return found


def _product(node: Node, reaching: set[Node], size: int) -> Product | None:
    """``node`` as a :class:`Product` whose q comes from a node in ``reaching``, or None."""
    if node.name() != "MulBackward0":
        return None
    saved = (node._saved_self, node._saved_other)
    for side in (0, 1):
        source, h = node.next_functions[side][0], saved[1 - side]
        if source is None or h is None or h.dim() == 0 or h.shape[0] != size:
            continue
        q = saved[side]
        if q is None and source in reaching:  # not saved (h needs no gradient): the parameter, if it is the operand
            variable = getattr(source, "variable", None)
            q = variable if isinstance(variable, torch.Tensor) else None
        if q is None or q.dim() > h.dim():
            continue
        padded = (1,) * (h.dim() - q.dim()) + tuple(q.shape)
        if padded[0] == 1 and torch.broadcast_shapes(padded, h.shape) == h.shape and source in reaching:
            return Product(node, side, q, h)
    return None


def children_first(root: Node) -> Iterator[tuple[Node, list[Node]]]:
    """Every node of the autograd graph of ``root`` once, after all of its children, with its children (an iterative
    post-order walk: a graph can be deeper than Python's recursion limit). A node's children are read once: when it
    comes back to the top of the stack, every child pushed above it has been walked (the graph has no cycle)."""
    done: set[Node] = set()
    expanded: dict[Node, list[Node]] = {}
    stack = [root]
    while stack:
        node = stack[-1]
        if node in done:
            stack.pop()
            continue
        children = expanded.get(node)
        if children is None:
            children = expanded[node] = [n for n, _ in node.next_functions if n is not None]
            pending = [n for n in children if n not in done]
            if pending:
                stack += pending
                continue
        stack.pop()
        done.add(node)
        yield node, children


def _reaching(root: Node, targets: set[int]) -> set[Node]:
    """The nodes of the graph of ``root`` below which one of the parameters ``targets`` (by ``id``) lies, found in
    one walk (children before parents)."""
    reaches: dict[Node, bool] = {}
    for node, children in children_first(root):
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        own = isinstance(variable, torch.Tensor) and id(variable) in targets
        reaches[node] = own or any(reaches[n] for n in children)
    return {node for node, found in reaches.items() if found}


def _reached(root: Node, targets: set[int], blocked: set[tuple[Node, int]], outputs: bool = False) -> set[int]:
    """The ``targets`` (parameters, by ``id``) the graph of ``root`` reaches without taking an edge in ``blocked``:
    ``(node, k)``, the k-th of a node's ``next_functions`` — or, with ``outputs``, an edge to ``(node, output_nr)``
    (a tensor's gradient edge)."""
    reached: set[int] = set()
    seen: set[Node] = set()
    stack = [root]
    while stack and len(reached) < len(targets):
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, torch.Tensor) and id(variable) in targets:
            reached.add(id(variable))
        for k, (child, nr) in enumerate(node.next_functions):
            if child is not None and ((child, nr) if outputs else (node, k)) not in blocked:
                stack.append(child)
    return reached


def _through_products(
    products: list[Product], grads: Iterator[torch.Tensor | None], params: list[nn.Parameter], size: int
) -> list[torch.Tensor]:
    """Per-example gradients ``[size, *θ.shape]`` (fp32) of ``params`` through ``products`` (``grads``: the gradient
    G at each product's output): row i of G ⊙ h summed to q's shape is example i's gradient of q (q is the same for
    every row), and a batched vector-Jacobian product from q — no batch dimension: B·|q| work — carries it to the
    parameters."""
    result = [torch.zeros((size, *p.shape), dtype=torch.float32, device=p.device) for p in params]
    for product in products:
        g = next(grads)
        if g is None or not params:
            continue
        q = product.q
        padded = (1,) * (product.h.dim() - q.dim()) + tuple(q.shape)
        own = (g.float() * product.h.float()).sum_to_size((size, *padded[1:])).reshape(size, *q.shape)
        source = product.node.next_functions[product.side]
        variable = getattr(source[0], "variable", None)
        if _is_parameter(product):
            found: tuple[torch.Tensor | None, ...] = tuple(own if variable is p else None for p in params)
        else:
            found = torch.autograd.grad(
                [GradientEdge(*source)],
                params,
                [own.to(q.dtype)],
                retain_graph=True,
                is_grads_batched=True,
                allow_unused=True,
            )
        for total, part in zip(result, found):
            if part is not None:
                total += part.float()
    return result


def _is_parameter(product: Product) -> bool:
    """Whether a product's factor q is a parameter itself (its edge leads to an ``AccumulateGrad`` node)."""
    return isinstance(getattr(product.node.next_functions[product.side][0], "variable", None), torch.Tensor)
