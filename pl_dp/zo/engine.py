"""Seeded, in-place parameter perturbation: the core of every zeroth-order method.

Design (directions regenerated from a seed, never stored; perturbation in place; restore fused
with the update):

* **A direction is a pure function of (seed, key, parameter, chunk).** The trained coordinates of
  each parameter are cut into chunks of a fixed size (:data:`CPU_CHUNK` on CPU; one chunk per
  tensor on accelerators, whose generators are parallel already), and chunk ``c`` of parameter
  ``i`` of direction ``key`` is drawn from a generator seeded with ``derive_seed(derive_seed(seed, *key, i), c)``.
  Any slice can be regenerated in any order (sharding, resume, replay), the user's global RNG
  stream is untouched, and since the chunk size never depends on the thread count, a direction
  is bit-identical on 1 or 64 cores and on every data-parallel rank.
* **Drawn on all cores.** torch's CPU generator fills a tensor on one thread (about 6 ns per
  Gaussian here, some 35 times an ``add_``); the chunks of a sweep are drawn and applied on
  ``torch.get_num_threads()`` threads (:mod:`pl_dp.zo.threads`), each drawing into its own
  chunk-sized scratch buffer.
* **In place, three sweeps per query.** Perturbation is ``p.add_`` under ``no_grad``; a two-point
  query leaves θ at θ − λu so that the caller fuses the restore with the update in one sweep
  (θ ← θ + (λ − η·s)·u, :meth:`combine`).
* **Fewer draws** (``cache_directions``): a direction's raw draw is kept after its first sweep,
  so a query draws once instead of three times, at the price of one copy of the trained
  coordinates per kept direction. Off for models whose copy exceeds :data:`CACHE_BUDGET_BYTES`
  unless asked for.
* **Cheaper directions.** ``"rademacher"`` draws one random bit per coordinate (±1, Spall 1992's
  SPSA perturbation) instead of a Gaussian; ``"lowrank"`` draws u = a·bᵀ per matrix (Chen et al.
  2025, LOZO) — m + n Gaussians added with one broadcast ``addcmul_`` instead of m·n. Both have E[u uᵀ] = I like
  the Gaussian; directions are data-independent, so no choice changes the privacy analysis.
* Only parameters with ``requires_grad`` are perturbed; d counts only those.
* With a :class:`~pl_dp.zo.mask.DirectionMask` (DP-ZOPO) only the kept coordinates are drawn
  (the RNG sweep shrinks with r) and scattered in place with ``index_add_`` on a ``view`` of the
  parameter — never ``param[idx] += …``, which updates a copy (the bug that makes the masked
  perturbation and update of the released DP-ZOPO code no-ops); a non-contiguous parameter raises
  instead of silently copying. d is then the number of kept coordinates.

* **Half precision: fp32 masters.** A bf16/fp16 parameter is trained through an fp32 master
  (:class:`~pl_dp.zo.master.MasterWeights`), and the parameter is only ever written as a rounding:
  ``param = (master + pending perturbation).to(dtype)``. A perturbation is kept as coefficients
  (``_pending``), not added into the master, so restoring it is exact (the parameter is bit-identical
  after any number of perturb/restore cycles) and a fused restore + update adds only the update to the
  master, where updates far below a bf16 ulp accumulate. Directions of such parameters are drawn in
  fp32. Memory: the masters take 4 bytes per trained half-precision coordinate, and a kept direction
  is fp32 too. fp32 and fp64 parameters are their own "master" and are written in place as before:
  no copy, no extra sweep. Without masters, in-place bf16 perturbation drifts and loses small steps —
  the fp16 collapses reported for MeZO (Malladi et al. 2023).

Every write goes through :meth:`PerturbationEngine._place_chunk` (drawn chunks),
:meth:`PerturbationEngine.place` (kept directions, dense extra terms) or the low-rank ``addcmul_`` in
:meth:`PerturbationEngine._sweep`, all on the tensors of ``self.weights`` (the parameters, or their
masters); :meth:`PerturbationEngine._present` is the only writer of a mastered parameter.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.privacy.seeding import derive_seed
from pl_dp.step.shards import local, shard_layouts
from pl_dp.zo import threads
from pl_dp.zo.mask import DirectionMask
from pl_dp.zo.master import MasterWeights

Key = tuple[int, ...]

#: coordinates per generator on CPU. Fixed (never derived from the thread count) so that a direction is the same
#: on any number of cores; 2^15 is ATen's grain size, so one chunk's ``add_`` stays on its thread, and its scratch
#: (128 KiB of float32) stays in a core's cache between the draw and the add.
CPU_CHUNK = 1 << 15

#: below this many drawn coordinates a sweep runs on the calling thread (handing chunks to threads costs more)
PARALLEL_MIN = 1 << 17

#: ``cache_directions=None`` keeps directions while one copy of the drawn coordinates takes at most this many bytes
CACHE_BUDGET_BYTES = 256 * 2**20

DIRECTION_KINDS = ("gaussian", "sphere", "rademacher", "lowrank")

#: most perturbations of half-precision parameters kept pending (unrestored) at once; older ones are folded
#: into the masters, so a caller that never restores does not make every sweep redraw a growing list
MAX_PENDING = 8


@dataclass(frozen=True)
class Direction:
    """Distribution of the direction u ∈ ℝ^d.

    * ``"gaussian"``: u ~ N(0, (r²/d)·I_d), the Gaussian with the same second moment as the sphere
      of radius r (Gong & Li 2025 use spheres in the theory and N(0, I_d) in the experiments,
      App. C.2; matching the second moment keeps PAZO-M's radius-d^{1/4} norm alignment, §3.1);
    * ``"sphere"``: u uniform on r·S^{d−1};
    * ``"rademacher"``: u = (r/√d)·ε with independent signs ε_k = ±1 (‖u‖ = r exactly);
    * ``"lowrank"``: for each contiguous matrix (or higher-dimensional tensor viewed as
      ``shape[0] × rest``) u = (r/√d)·a·bᵀ with a, b standard Gaussian, and a Gaussian for vectors.

    All four have E[u uᵀ] = (r²/d)·I. ``radius=None`` means r = √d, i.e. E[u uᵀ] = I_d (DPZero,
    MeZO); PAZO-M uses r = d^{1/4}.
    """

    kind: str = "gaussian"
    radius: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in DIRECTION_KINDS:
            raise ConfigError(f"direction must be one of {', '.join(map(repr, DIRECTION_KINDS))}, got {self.kind!r}.")
        if self.radius is not None and not self.radius > 0:
            raise ConfigError(f"direction radius must be > 0, got {self.radius}.")

    def resolved_radius(self, dim: int) -> float:
        return math.sqrt(dim) if self.radius is None else float(self.radius)


class Chunk(NamedTuple):
    """Trained coordinates [start, stop) of this rank's block of parameter ``index``, drawn from one generator.

    Coordinates count in row-major order, or, under a mask that keeps part of the tensor, in the
    mask's index order. ``number`` is the chunk's position within the whole parameter (part of its seed):
    chunk ``number`` covers ``drawn`` coordinates of the whole tensor, of which this rank's block holds
    those from ``skip`` on (all of them, ``skip = 0``, unless the tensor is sharded and the chunk straddles
    the edge of the block).
    """

    index: int
    number: int
    start: int
    stop: int
    skip: int
    drawn: int


class PerturbationEngine:
    """In-place perturbation of a set of parameters along seed-regenerated directions.

    Args:
        params: the parameters; those without ``requires_grad`` are left alone.
        seed: base seed of every direction.
        direction: a :class:`Direction` or its kind (``radius`` then sets its radius).
        mask: restricts (and optionally scales) the directions to some coordinates: u = M·z.
        cache_directions: keep the raw draw of the last ``cache_size`` directions perturbed along
            (one copy of the drawn coordinates each; low-rank factors are redrawn, they cost m + n
            numbers). ``None``: as many as fit in :data:`CACHE_BUDGET_BYTES`, up to ``cache_size``.
        cache_size: how many directions to keep (a method passes its number of queries).
        masters: where the fp32 masters of half-precision parameters live (a method passes one store for
            all the engines it builds, so that the masters survive a rebuild); ``None``: a store of this
            engine's own. ``MasterWeights(enabled=False)`` writes half-precision parameters in place.

    ``params`` are the module's parameters; ``weights`` the tensors that hold their trained values (the
    parameter itself, or the fp32 master of a bf16/fp16 one). A caller that writes ``weights`` directly
    calls :meth:`sync` afterwards.

    Sharded parameters (FSDP2 DTensors, see :mod:`pl_dp.step.shards`): ``params`` and ``weights`` are then
    this rank's local blocks (the masters are sharded like their parameters). Chunks are planned over the whole
    tensor and each rank draws those that meet its block, the ones across its edges in full (at most two per
    parameter), so that every rank writes exactly its slice of the direction one process would draw; d, the
    radius and a sphere's norm are those of the whole direction (the norm sums one value per chunk over the
    ranks: 8 bytes a chunk per sphere direction).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        seed: int,
        direction: Direction | str = "gaussian",
        radius: float | None = None,
        mask: DirectionMask | None = None,
        cache_directions: bool | None = None,
        cache_size: int = 1,
        masters: MasterWeights | None = None,
    ) -> None:
        trained = [p for p in params if p.requires_grad]
        if not trained:
            raise ConfigError("the model has no trainable parameters (requires_grad=True): nothing to optimize.")
        self.layouts = shard_layouts(trained)
        self.group = self.layouts[0].group
        self.masters = MasterWeights() if masters is None else masters
        weights = self.masters.weights(trained)
        self._mastered = [w is not p for w, p in zip(weights, trained)]
        self.params, self.weights = [local(p) for p in trained], [local(w) for w in weights]
        self._trained, self._placement = trained, [(p.device, p.dtype) for p in trained]
        self._any_mastered, self._all_mastered = any(self._mastered), all(self._mastered)
        self._pending: dict[Key, float] = {}  # perturbation of the mastered parameters, not in their masters
        if isinstance(cache_size, bool) or int(cache_size) != cache_size or cache_size < 1:
            raise ConfigError(f"cache_size must be an integer >= 1, got {cache_size!r}.")
        self.seed = int(seed)
        self.direction = Direction(direction, radius) if isinstance(direction, str) else direction
        self.mask = None if mask is None else self._check_mask(mask)
        self._windows, self._local_indices = self._plan_windows()
        self.counts = [stop - start for start, stop in self._windows]  # this rank's, in coordinates drawn
        self.total_counts = [self.mask.count(i) if self.mask else a.numel for i, a in enumerate(self.layouts)]
        self.dim = sum(self.total_counts)
        self.radius = self.direction.resolved_radius(self.dim)
        # low-rank parameters: drawn as a·bᵀ; added with one addcmul_ when the whole tensor is trained ("outer")
        lowrank = self.direction.kind == "lowrank"
        self._factored = [lowrank and w.dim() >= 2 and w.is_contiguous() for w in self.weights]
        self._outer = [f and self._indices(i) is None and self._values(i) is None for i, f in enumerate(self._factored)]
        self._chunk_sizes = [self._chunk_size(i) for i in range(len(self.weights))]
        self.chunks = self._plan_chunks()
        self._chunks_of: dict[int, list[Chunk]] = {}
        for chunk in self.chunks:
            self._chunks_of.setdefault(chunk.index, []).append(chunk)
        self._cpu_chunks = [c for c in self.chunks if self._group(c)[0].type == "cpu"]
        self._other_chunks = [c for c in self.chunks if self._group(c)[0].type != "cpu"]
        self._parallel = sum(c.stop - c.start for c in self._cpu_chunks) >= PARALLEL_MIN
        copy_bytes = sum((c.stop - c.start) * self.weights[c.index].element_size() for c in self.chunks)
        if cache_directions is None:
            cache_size = min(cache_size, CACHE_BUDGET_BYTES // copy_bytes) if copy_bytes else 0
        self.cache_size = int(cache_size) if cache_directions is not False and copy_bytes else 0
        self._cache: OrderedDict[Key, list[torch.Tensor | None]] = OrderedDict()
        self._norm_cache: dict[Key, float] = {}
        self._parameter_seeds: dict[tuple[Key, int], int] = {}
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._scratch: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    @property
    def cache_directions(self) -> bool:
        """Whether swept directions are kept (``cache_size`` of them) instead of redrawn."""
        return self.cache_size > 0

    def moved(self) -> bool:
        """Whether a parameter it was built on has since moved to another device or dtype (Lightning moves a module
        back to the CPU after a fit): its masters, buffers and generators then belong to the old placement, and the
        owner builds a new engine."""
        return any((p.device, p.dtype) != placement for p, placement in zip(self._trained, self._placement))

    def _check_mask(self, mask: DirectionMask) -> DirectionMask:
        numels = [a.numel for a in self.layouts]
        if list(mask.numels) != numels:
            raise ValueError(f"the direction mask was built for tensors of sizes {mask.numels}, not {numels}.")
        if mask.trained == 0:
            raise ValueError("the direction mask keeps no coordinate: nothing would be trained.")
        return mask.to(self.params[0].device)

    def _indices(self, index: int) -> torch.Tensor | None:
        """The kept flat indices of this rank's block of parameter ``index`` (None: all)."""
        return self._local_indices[index]

    def _values(self, index: int) -> torch.Tensor | None:
        return None if self.mask is None else self.mask.value(index)

    def _plan_windows(self) -> tuple[list[tuple[int, int]], list[torch.Tensor | None]]:
        """Per parameter, this rank's coordinates [start, stop) in the order drawn, and its kept local flat indices."""
        windows: list[tuple[int, int]] = []
        indices: list[torch.Tensor | None] = []
        for i, (w, layout) in enumerate(zip(self.weights, self.layouts)):
            kept = None if self.mask is None else self.mask.indices[i]
            if kept is None:
                windows.append((layout.offset, layout.offset + w.numel()))
                indices.append(None)
                continue
            bounds = torch.tensor([layout.offset, layout.offset + w.numel()], device=kept.device)
            start, stop = torch.searchsorted(kept, bounds).tolist()  # the mask's indices are sorted
            windows.append((start, stop))
            indices.append(kept[start:stop] - layout.offset if layout.offset else kept[start:stop])
        return windows, indices

    def _chunk_size(self, index: int) -> int:
        w = self.weights[index]
        # one chunk per tensor on accelerators, and for a non-contiguous tensor swept whole (no flat view)
        whole = w.device.type != "cpu" or (self._indices(index) is None and not w.is_contiguous())
        return max(self.total_counts[index], 1) if whole else CPU_CHUNK

    def _plan_chunks(self) -> list[Chunk]:
        """The chunks that meet this rank's block of each parameter (every chunk, unsharded)."""
        chunks = []
        for i, (start, stop) in enumerate(self._windows):
            if self._outer[i] or stop <= start:
                continue
            size, total = self._chunk_sizes[i], self.total_counts[i]
            for number in range(start // size, -(-stop // size)):
                first, last = number * size, min((number + 1) * size, total)
                lo, hi = max(first, start), min(last, stop)
                chunks.append(Chunk(i, number, lo - start, hi - start, lo - first, last - first))
        return chunks

    # ---- drawing ---------------------------------------------------------------------------
    def _factors(self, key: Key, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """a ∈ ℝ^m, b ∈ ℝ^n of the low-rank draw a·bᵀ of parameter ``index`` (the whole tensor, viewed as m × n)."""
        p, layout = self.weights[index], self.layouts[index]
        rows = layout.shape[0]
        g = threads.generator(p.device)
        g.manual_seed(self._parameter_seed(key, index))
        ab = torch.empty(rows + layout.row_size, device=p.device, dtype=p.dtype).normal_(generator=g)
        return ab[:rows], ab[rows:]

    def _local_factors(self, key: Key, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of a that this rank's block holds, and b: its block of a·bᵀ is their outer product."""
        a, b = self._factors(key, index)
        first, last = self.layouts[index].rows
        return a[first:last], b

    def _parameter_seed(self, key: Key, index: int) -> int:
        """``derive_seed(seed, *key, index)``: the seed of parameter ``index``'s low-rank factors, and the root of its
        chunks' seeds ``derive_seed(·, chunk)`` (memoized: a sweep asks once per chunk)."""
        seed = self._parameter_seeds.get((key, index))
        if seed is None:
            if len(self._parameter_seeds) > 4096:
                self._parameter_seeds.clear()
            seed = self._parameter_seeds[(key, index)] = derive_seed(self.seed, *key, index)
        return seed

    def _fill(self, key: Key, chunk: Chunk, out: torch.Tensor) -> torch.Tensor:
        """Draw this rank's part of chunk ``chunk`` of the unscaled M·z of direction ``key`` into ``out`` (1-D)."""
        size = chunk.stop - chunk.start
        if chunk.drawn == size:
            return self._draw(key, chunk.index, chunk.number, out)
        whole = self._draw(key, chunk.index, chunk.number, self._scratch_for(chunk, "drawn"))
        return out.copy_(whole[chunk.skip : chunk.skip + size])

    def _draw(self, key: Key, index: int, number: int, out: torch.Tensor) -> torch.Tensor:
        """Draw chunk ``number`` of parameter ``index`` of the unscaled M·z of direction ``key`` — the whole chunk,
        in the whole tensor's coordinates — into ``out`` (1-D, the chunk's size) and return it."""
        p = self.weights[index]
        first = number * self._chunk_sizes[index]
        last = first + out.numel()
        if self._factored[index]:  # a low-rank parameter under a mask: the kept entries of a·bᵀ
            a, b = self._factors(key, index)
            kept = None if self.mask is None else self.mask.indices[index]
            flat = torch.arange(first, last, device=p.device) if kept is None else kept[first:last]
            torch.mul(a[flat // b.numel()], b[flat % b.numel()], out=out)
        else:
            g = threads.generator(p.device)
            g.manual_seed(derive_seed(self._parameter_seed(key, index), number))
            if self.direction.kind == "rademacher":
                rademacher_(out, g)
            else:
                out.normal_(generator=g)
        value = self._values(index)
        if value is not None:
            out.mul_(value[first:last])
        return out

    def _scratch_for(self, chunk: Chunk, slot: int | str = 0) -> torch.Tensor:
        """The calling thread's buffer number ``slot`` for one chunk of parameter ``chunk.index``: this rank's part of
        it, or, with ``slot="drawn"``, the whole chunk."""
        p = self.weights[chunk.index]
        k = (threading.get_ident(), p.device, p.dtype, slot)
        buf = self._scratch.get(k)
        whole = slot == "drawn"
        if buf is None:
            size = max(c.drawn if whole else c.stop - c.start for c in self.chunks if self._group(c) == k[1:3])
            buf = self._scratch[k] = torch.empty(size, device=p.device, dtype=p.dtype)
        size = chunk.drawn if whole else chunk.stop - chunk.start
        return buf if buf.numel() == size else buf[:size]

    def _group(self, chunk: Chunk) -> tuple[torch.device, torch.dtype]:
        p = self.weights[chunk.index]
        return p.device, p.dtype

    def _run(self, work: Callable[[Chunk], None]) -> None:
        """``work(chunk)`` for every drawn chunk: CPU chunks on all cores, others in order."""
        threads.run_all(work, self._cpu_chunks, parallel=self._parallel)
        threads.run_all(work, self._other_chunks, parallel=False)  # accelerators: their generators are parallel

    def _buffer(self, index: int) -> torch.Tensor:
        """A flat buffer for the whole draw of parameter ``index`` (shared by the parameters of a device and dtype)."""
        p = self.weights[index]
        k = (p.device, p.dtype)
        buf = self._buffers.get(k)
        if buf is None:
            size = max(self.counts[i] for i, q in enumerate(self.weights) if (q.device, q.dtype) == k)
            buf = self._buffers[k] = torch.empty(size, device=p.device, dtype=p.dtype)
        return buf[: self.counts[index]]

    def _shaped(self, values: torch.Tensor, index: int) -> torch.Tensor:
        """A flat draw of parameter ``index`` shaped as :meth:`raw` returns it."""
        return values.view(self.weights[index].shape) if self._indices(index) is None else values

    def _kept(self, key: Key) -> list[torch.Tensor | None]:
        """The kept raw draw of ``key``, drawn now on all cores if it is not kept yet (least recent evicted)."""
        entry = self._cache.get(key)
        if entry is not None:
            self._cache.move_to_end(key)
            return entry
        if len(self._cache) >= self.cache_size:
            _, entry = self._cache.popitem(last=False)  # reuse the oldest direction's memory
        else:
            entry = [None if outer else w.new_empty(n) for w, n, outer in zip(self.weights, self.counts, self._outer)]
        self._run(lambda c: self._fill(key, c, entry[c.index][c.start : c.stop]))
        self._cache[key] = entry
        return entry

    def forget_directions(self) -> None:
        """Drop kept directions and norms (call when what a key means changes, e.g. a new basis)."""
        self._cache.clear()
        self._norm_cache.clear()

    def raw(self, key: Key, index: int) -> torch.Tensor:
        """The unscaled draw M·z of direction ``key`` for parameter ``index`` (a view of a shared or kept buffer).

        Shaped like the parameter, or, under a mask that keeps part of it, a flat tensor with one
        entry per kept coordinate (in the mask's index order). Place it with :meth:`place`.
        """
        entry = self._cache.get(key)
        if entry is not None and entry[index] is not None:
            return self._shaped(entry[index], index)
        out = self._buffer(index)
        if self._outer[index]:
            a, b = self._local_factors(key, index)
            torch.outer(a, b, out=out.view(a.numel(), b.numel()))
        for chunk in self._chunks_of.get(index, []):
            self._fill(key, chunk, out[chunk.start : chunk.stop])
        return self._shaped(out, index)

    def place(self, target: torch.Tensor, index: int, values: torch.Tensor, alpha: float) -> None:
        """target ← target + alpha·values at parameter ``index``'s trained coordinates, in place.

        ``values`` is what :meth:`raw` returns (dense, or one entry per kept coordinate).
        """
        idx = self._indices(index)
        if idx is None:
            target.add_(values, alpha=alpha)
        elif idx.numel():
            target.view(-1).index_add_(0, idx, values.to(target.dtype), alpha=alpha)

    def _place_chunk(self, target: torch.Tensor, chunk: Chunk, values: torch.Tensor, alpha: float) -> None:
        """target ← target + alpha·values at the coordinates of ``chunk``, in place (``values``: 1-D)."""
        idx = self._indices(chunk.index)
        if idx is not None:
            target.view(-1).index_add_(0, idx[chunk.start : chunk.stop], values, alpha=alpha)
        elif target.is_contiguous():
            target.view(-1)[chunk.start : chunk.stop].add_(values, alpha=alpha)
        else:  # a non-contiguous parameter is one chunk (see _plan_chunks)
            target.add_(values.view(target.shape), alpha=alpha)

    def accumulate(self, target: torch.Tensor, key: Key, index: int, alpha: float) -> None:
        """target ← target + alpha·(M·z)(key) for parameter ``index`` (unscaled; see :meth:`scale`)."""
        if self.counts[index]:
            self.place(target, index, self.raw(key, index), alpha)

    def scale(self, key: Key) -> float:
        """Factor mapping the raw draw of ``key`` (N(0, I), ±1 or a·bᵀ entries) to the direction u."""
        if self.direction.kind != "sphere":
            return self.radius / math.sqrt(self.dim)
        norm = self._norm_cache.get(key)
        if norm is None and self.group is not None:
            norm = self._sharded_norm(key)
        elif norm is None:
            squares: list[torch.Tensor | None] = [None] * len(self.chunks)
            position = {c: k for k, c in enumerate(self.chunks)}
            if self.cache_size:
                entry = self._kept(key)

                def work(c: Chunk) -> None:
                    squares[position[c]] = entry[c.index][c.start : c.stop].double().square().sum()

            else:

                def work(c: Chunk) -> None:
                    squares[position[c]] = self._fill(key, c, self._scratch_for(c)).double().square().sum()

            self._run(work)
            norm = math.sqrt(math.fsum(float(s) for s in squares))
        if len(self._norm_cache) > 64:
            self._norm_cache.clear()
        self._norm_cache[key] = norm
        return self.radius / norm

    def _sharded_norm(self, key: Key) -> float:
        """‖M·z‖ of a sharded direction, as one process computes it: each chunk's sum of squares is computed whole by
        the rank whose block holds its first coordinate, the sums are gathered by an all-reduce (each position has
        one non-zero term, so the sum is exact), and ``math.fsum`` — exact, order-free — adds them up."""
        base, positions = 0, {}
        for i, (size, total) in enumerate(zip(self._chunk_sizes, self.total_counts)):
            positions[i] = base
            base += 0 if self._outer[i] else -(-total // size)
        squares = torch.zeros(base, dtype=torch.float64, device=self.weights[0].device)

        def work(c: Chunk) -> None:
            if c.skip == 0 and self.layouts[c.index].owner:
                whole = self._draw(key, c.index, c.number, self._scratch_for(c, "drawn"))
                squares[positions[c.index] + c.number] = whole.double().square().sum()

        self._run(work)
        dist.all_reduce(squares, group=self.group)
        return math.sqrt(math.fsum(squares.tolist()))

    def direction_tensors(self, key: Key) -> list[torch.Tensor]:
        """Materialize u for ``key`` (one tensor per parameter, in the dtype of ``weights``). Tests and diagnostics."""
        s = self.scale(key)
        out = [torch.zeros_like(w) for w in self.weights]
        for i, t in enumerate(out):
            self.accumulate(t, key, i, s)
        return out

    # ---- sweeps ----------------------------------------------------------------------------
    def _sweep(
        self,
        direct: Sequence[tuple[Key, float]],
        mastered: Sequence[tuple[Key, float]] = (),
        times: int = 1,
    ) -> None:
        """w ← w + Σ_j alpha_j·(M·z)(key_j) on ``weights``: the ``direct`` terms on the parameters written in
        place, each added ``times`` times from one draw; the ``mastered`` terms (once) on the fp32 masters.

        Kept directions are added tensor by tensor; the others are drawn chunk by chunk on all
        cores, each chunk added while it is still in cache; low-rank factors are redrawn (m + n
        numbers) and added with one broadcast ``addcmul_`` per matrix (elementwise: a block of rows gets exactly
        the values the whole matrix gets, which ``addr_``'s BLAS kernel does not promise). Mastered parameters are
        not written here (:meth:`_present` does).
        """
        drawn = ([(key, alpha) for key, alpha in direct if key not in self._cache], times)
        drawn_masters = ([(key, alpha) for key, alpha in mastered if key not in self._cache], 1)
        if drawn[0] or drawn_masters[0]:

            def work(chunk: Chunk) -> None:
                terms, repeat = drawn_masters if self._mastered[chunk.index] else drawn
                if not terms:
                    return
                scratch = self._scratch_for(chunk)
                target = self.weights[chunk.index]
                for key, alpha in terms:
                    z = self._fill(key, chunk, scratch)
                    for _ in range(repeat):
                        self._place_chunk(target, chunk, z, alpha)

            self._run(work)
        for i, w in enumerate(self.weights):
            terms, repeat = (mastered, 1) if self._mastered[i] else (direct, times)
            for key, alpha in terms:
                entry = self._cache.get(key)
                if self._outer[i]:
                    a, b = self._local_factors(key, i)
                    matrix = w.view(a.numel(), b.numel())
                    for _ in range(repeat):
                        matrix.addcmul_(a.unsqueeze(1), b, value=alpha)
                elif entry is not None:
                    for _ in range(repeat):
                        self.place(w, i, self._shaped(entry[i], i), alpha)

    def _present(self) -> None:
        """Write each mastered parameter as the rounding of its master plus the pending perturbation.

        ``param ← (master + Σ_k pending_k·(M·z)(k)).to(param.dtype)`` at the trained coordinates (the
        others already hold their master's rounding), computed chunk by chunk in fp32 on all cores.
        """
        if not self._any_mastered:
            return
        pending = list(self._pending.items())

        def work(chunk: Chunk) -> None:
            i = chunk.index
            if not self._mastered[i]:
                return
            master, param = self.weights[i], self.params[i]
            if not pending and self._indices(i) is None:
                if param.is_contiguous():
                    param.view(-1)[chunk.start : chunk.stop].copy_(master.view(-1)[chunk.start : chunk.stop])
                else:  # a non-contiguous parameter is one chunk
                    param.copy_(master)
                return
            value = self._read_chunk(master, chunk, self._scratch_for(chunk, 1))
            for key, alpha in pending:
                entry = self._cache.get(key)
                if entry is not None:
                    value.add_(entry[i][chunk.start : chunk.stop], alpha=alpha)
                else:
                    value.add_(self._fill(key, chunk, self._scratch_for(chunk)), alpha=alpha)
            self._write_chunk(param, chunk, value)

        self._run(work)
        for i, (master, param) in enumerate(zip(self.weights, self.params)):
            if not (self._mastered[i] and self._outer[i]):
                continue
            if not pending:
                param.copy_(master)
                continue
            value = self._buffer(i).view(param.shape[0], -1)
            value.copy_(master.view(value.shape))
            for key, alpha in pending:
                a, b = self._local_factors(key, i)
                value.addcmul_(a.unsqueeze(1), b, value=alpha)
            param.view(value.shape).copy_(value)

    def _read_chunk(self, source: torch.Tensor, chunk: Chunk, out: torch.Tensor) -> torch.Tensor:
        """``out`` (1-D) ← ``source`` at the coordinates of ``chunk``."""
        idx = self._indices(chunk.index)
        if idx is not None:
            return torch.index_select(source.view(-1), 0, idx[chunk.start : chunk.stop], out=out)
        if source.is_contiguous():
            return out.copy_(source.view(-1)[chunk.start : chunk.stop])
        out.view(source.shape).copy_(source)  # a non-contiguous parameter is one chunk
        return out

    def _write_chunk(self, target: torch.Tensor, chunk: Chunk, values: torch.Tensor) -> None:
        """``target`` ← ``values`` (1-D, rounded to ``target``'s dtype) at the coordinates of ``chunk``."""
        idx = self._indices(chunk.index)
        if idx is not None:
            target.view(-1).index_copy_(0, idx[chunk.start : chunk.stop], values.to(target.dtype))
        elif target.is_contiguous():
            target.view(-1)[chunk.start : chunk.stop].copy_(values)
        else:
            target.copy_(values.view(target.shape))

    def _fold(self, keep: int) -> None:
        """Add all but the ``keep`` most recent pending perturbations into the masters (θ does not change)."""
        old = list(self._pending.items())[: max(len(self._pending) - keep, 0)]
        for key, _ in old:
            del self._pending[key]
        if old:
            self._sweep([], old)

    @torch.no_grad()
    def perturb(self, key: Key, step_size: float, times: int = 1) -> None:
        """θ ← θ + step_size · u(key), applied ``times`` times from one draw.

        Parameters written in place: moving by −λu twice rather than by −2λu once keeps the later +λu
        restore (nearly) exact in floating point: fl(fl(p − a) + a) = p whenever |a| ≪ |p|, while
        fl(fl(p + a) − 2a) + a accumulates a rounding error every cycle. Half-precision parameters:
        the step is added to the pending coefficient of ``key`` (exactly: the restore brings it back to
        0) and the parameters are rewritten from their masters. With ``cache_directions`` the draw is
        kept for the sweeps that follow.
        """
        alpha = step_size * self.scale(key)
        if self.cache_size:
            self._kept(key)
        if not self._all_mastered:
            self._sweep([(key, alpha)], times=times)
        if self._any_mastered:
            total = self._pending.pop(key, 0.0) + alpha * times
            if total != 0.0:
                self._pending[key] = total
                self._fold(MAX_PENDING)
            self._present()

    @torch.no_grad()
    def combine(
        self,
        terms: Sequence[tuple[Key, float]],
        extra: Sequence[tuple[Sequence[torch.Tensor | None], float]] = (),
    ) -> None:
        """θ ← θ + Σ_j c_j · u(key_j) + Σ_k a_k · t_k in one sweep over the parameters.

        ``extra`` adds dense per-parameter tensors (e.g. a public gradient, the proximal term) after
        the directions; under a mask only their trained coordinates are applied (unscaled by M). A
        ``t_k`` may be ``weights`` itself (it then reads θ after the directions). Half-precision
        parameters: the pending perturbation and the c_j are summed per key as coefficients first, so
        a restore fused with an update adds only the update to the masters.
        """
        scaled = [(key, coeff * self.scale(key)) for key, coeff in terms if coeff != 0.0]
        mastered: list[tuple[Key, float]] = []
        if self._any_mastered:
            merged: dict[Key, float] = {}
            for key, alpha in scaled:
                merged[key] = merged.get(key, 0.0) + alpha
            for key, alpha in self._pending.items():
                merged[key] = merged.get(key, 0.0) + alpha
            self._pending.clear()
            mastered = [(key, alpha) for key, alpha in merged.items() if alpha != 0.0]
        self._sweep(scaled, mastered)
        for i, w in enumerate(self.weights):
            idx = self._indices(i)
            for tensors, alpha in extra:
                t = None if tensors[i] is None else local(tensors[i])
                if t is not None and alpha != 0.0:
                    self.place(w, i, t if idx is None else t.reshape(-1).index_select(0, idx), alpha)
        self._present()

    @torch.no_grad()
    def sync(self) -> None:
        """Rewrite the half-precision parameters from their masters, after ``weights`` were written directly.

        Each becomes the rounding of its master (plus any pending perturbation). Nothing to do when
        every parameter is written in place.
        """
        self._present()

    def two_point(self, key: Key, smoothing: float, evaluate: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Per-example [f(θ + λu) − f(θ − λu)] / (2λ) for direction ``key`` (Gong & Li 2025, Eq. 1).

        Leaves the parameters at θ − λu: the caller restores them, ideally fused with its
        update via :meth:`combine` (adding +λ to the coefficient of ``key``).
        """
        self.perturb(key, smoothing)
        f_plus = evaluate()
        self.perturb(key, -smoothing, times=2)
        f_minus = evaluate()
        return (f_plus - f_minus) / (2.0 * smoothing)


_SIGN_BIT = -(2**31)
_ONE_BITS = 0x3F800000  # the bits of 1.0f
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def rademacher_(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill the 1-D ``out`` with independent ±1, one random bit each, and return it.

    The generator yields 64-bit words; bit j of each 32-bit half becomes the sign of a float 1.0
    (shifted into the sign position, masked, or-ed with the bits of 1.0): 32 coordinates per word
    of random numbers, about 1 ns per coordinate on a CPU against 6 ns for ``normal_``.
    """
    n = out.numel()
    words = torch.empty(-(-n // 64), dtype=torch.int64, device=out.device)
    words.random_(-(2**63), None, generator=generator)  # the full 64-bit range
    halves = words.view(torch.int32)[: -(-n // 32)].unsqueeze(1)
    shifts = _SHIFTS.get(out.device)
    if shifts is None:
        shifts = _SHIFTS[out.device] = torch.arange(32, dtype=torch.int32, device=out.device)
    in_place = out.dtype == torch.float32 and n % 32 == 0
    bits = torch.bitwise_left_shift(halves, shifts, out=out.view(torch.int32).view(-1, 32) if in_place else None)
    bits.bitwise_and_(_SIGN_BIT).bitwise_or_(_ONE_BITS)
    if not in_place:
        out.copy_(bits.view(torch.float32).view(-1)[:n])
    return out
