"""The source of DP noise: a secret of the run, drawn from OS entropy and held in process memory only.

The DP noise is one of the two secrets of a run (the other is the Poisson sampling randomness;
threat model: docs/privacy-model.md). A :class:`NoiseSource` owns a 256-bit key drawn from the operating
system's CSPRNG (``secrets``) and derives every draw from (key, private step, draw index) — so the
noise of step t never depends on how many draws earlier steps made, and nothing but the key is
state. It has no ``state_dict`` on purpose: the key is never written to a checkpoint, hparams, a
log or an artifact, and a resumed run draws a new key (privacy state survives a checkpoint, secrets do not):
:meth:`~pl_dp.privacy.seeding.CopiesDrawTheirOwnSecret.redraw_secret` at every fit start, so a resume in the same
process (a retry from an older checkpoint) draws fresh noise too. Pickles and deep copies (``torch.save(model)``,
``copy.deepcopy``) leave the key out, and the copy draws a key of its own. As a guard behind that, an unseeded source
refuses to draw a second time for a (step, draw) it has drawn under its key: the draws of a training step (step ≥ 0)
must come in increasing order of (step, draw) per key.

Two generators:

* ``secure=False`` — a ``torch.Generator`` per chunk of 2²⁰ values of a draw, set from the key: on the CPU its whole
  Mersenne Twister state (19,937 bits) is drawn from SHAKE-256 of (key, step, draw, chunk) — a CPU seed keeps 32
  bits only, which a search over 2³² seeds would recover from a release — and on an accelerator its Philox seed (64
  bits). As fast as torch's own ``normal_``, but Mersenne Twister / Philox are not cryptographic generators.
* ``secure=True`` — SHAKE-256 of (key, step, draw, chunk) as a cryptographic stream of uniforms,
  Box–Muller in float64, and the sum of four such draws divided by two (the floating-point
  hardening of Holohan & Braghin 2021, "Secure random sampling in differential privacy", which
  Opacus' ``secure_mode`` also uses). Costs ~4× a torch draw plus hashing; negligible for the
  few scalars a zeroth-order step releases, measured for a full gradient in
  ``benchmarks/secure_noise.py``.

Chunks make a draw a function of (key, step, draw, chunk) alone: a rank holding a block of a sharded tensor draws
the chunks that meet its block and adds exactly its slice of the draw one process makes (invariant 11), in memory
and time of its block, not of the whole tensor.

Passing ``seed`` derives the key from it, which makes the noise reproducible (tests, reproducing a
run, bit-identical resume) — and removable by anyone who knows the seed: such a run's ε is no
guarantee against them, and its privacy report says so.
"""

from __future__ import annotations

import functools
import hashlib
import math
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pl_dp.privacy.seeding import CopiesDrawTheirOwnSecret, derive_seed, secret_cpu_generator, secret_cpu_state

_KEY_BYTES = 32


def _tag_counter(tag: bytes) -> tuple[int]:
    """A draw's domain (``b"noise"``, ``b"randomness"``) as a counter of the seed chain."""
    return (int.from_bytes(hashlib.sha256(tag).digest()[:8], "little"),)


_CHUNK = 1 << 20
_LOW53 = (1 << 53) - 1


class NoiseSource(CopiesDrawTheirOwnSecret):
    """Gaussian noise for DP mechanisms from a secret key, counter-based per private step.

    Args:
        seed: ``None`` (default) draws the key from OS entropy. An integer derives it from the
            seed: reproducible, and no guarantee against whoever knows the seed.
        secure: draw from a cryptographic generator (SHAKE-256) with floating-point hardening
            instead of torch's generator.
    """

    def __init__(self, seed: int | None = None, secure: bool = False) -> None:
        self.seeded = seed is not None
        self.secure = bool(secure)
        if seed is None:
            self._key = self._draw_secret()
        else:
            self._key = hashlib.sha256(b"pl_dp noise seed " + str(int(seed)).encode()).digest()
        self._step = 0
        self._draws = 0
        # the (step, draw) of this key's latest draw for a training step: an unseeded key never draws one twice
        self._last_draw: tuple[int, int] | None = None

    secret = "_key"  # left out of pickles and deep copies, which draw their own (CopiesDrawTheirOwnSecret)

    def _draw_secret(self) -> bytes:
        return secrets.token_bytes(_KEY_BYTES)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if self.secret not in state:  # a key of its own: none of its draws is made yet
            self._last_draw = None

    def redraw_secret(self) -> None:
        """A fresh key from OS entropy for a new fit (unless seeded): no draw of an earlier fit is ever made again."""
        if not self.seeded:
            super().redraw_secret()
            self._last_draw = None

    def start_step(self, step: int) -> None:
        """Draws from now on belong to private step ``step`` (a pure function of key, step, draw index)."""
        self._step = int(step)
        self._draws = 0

    def normal(
        self,
        shape: torch.Size | tuple[int, ...],
        std: float,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        block: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """A tensor of i.i.d. N(0, std²) draws (the next draw of the current step), shaped ``shape``.

        The draw is made in chunks of 2²⁰ values, each a function of (key, step, draw, chunk) alone. ``block``:
        ``(offset, count)``, only the flat coordinates [offset, offset + count) of that draw, as a 1-D tensor — a
        rank's block of a sharded tensor: exactly its slice of the whole draw, from the chunks that meet it (memory
        and time O(count + 2 chunks), not O(whole tensor)).
        """
        numel = math.prod(shape)
        (values,) = self.normal_blocks(numel, std, [(0, numel) if block is None else block], device, dtype)
        return values.view(shape) if block is None else values

    def normal_like(
        self,
        tensors: Sequence[torch.Tensor],
        std: float,
        *,
        blocks: Sequence[tuple[torch.Size, int]] | None = None,
    ) -> Iterator[torch.Tensor]:
        """One draw (the next of the current step) of i.i.d. N(0, std²) values laid over whole tensors end to end, in
        the order given: each tensor's piece, shaped like it — one generator state and one call to it for a release of
        many small tensors, where a draw per tensor paid both for each (:meth:`normal_blocks`).

        ``blocks``: the tensors are blocks of whole tensors (a rank's shards: each one's whole shape and flat offset in
        it); each gets its slice of the draw one process makes for the whole tensors. The draw is on the tensors'
        device, in the widest of their dtypes. Tensors on several devices, a block outside its tensor, or a list of
        blocks of another length than the tensors, are refused: the last two would leave a coordinate with another's
        noise, or none. No tensors: no draw.
        """
        if not tensors:
            return iter(())
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"one draw is made on one device; these tensors are on {sorted(map(str, devices))}.")
        wholes = [(t.shape, 0) for t in tensors] if blocks is None else blocks
        spans, numel = [], 0
        for t, (shape, offset) in zip(tensors, wholes, strict=True):
            if not 0 <= offset <= offset + t.numel() <= math.prod(shape):
                raise ValueError(f"a block of {t.numel()} values at {offset} does not lie in a tensor of {shape}.")
            spans.append((numel + offset, t.numel()))
            numel += math.prod(shape)
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
        parts = self.normal_blocks(numel, std, spans, tensors[0].device, dtype)
        return (part.view_as(t) for part, t in zip(parts, tensors))

    def normal_blocks(
        self,
        numel: int,
        std: float,
        blocks: Sequence[tuple[int, int]],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Iterator[torch.Tensor]:
        """Blocks of one draw (the next draw of the current step) of ``numel`` i.i.d. N(0, std²) values: for each
        ``(offset, count)`` of ``blocks``, the draw's flat coordinates [offset, offset + count) as a 1-D tensor.

        The draw is taken when this is called; its blocks are made as they are iterated, from the chunks of 2²⁰ values
        that meet them (each a function of (key, step, draw, chunk) alone), so a release of many tensors is one draw
        whatever its layout: one process reads the whole of each tensor, a rank of a sharded run its block. Blocks in
        increasing order make each chunk once; one that lies in one chunk is a view of it (which keeps the chunk).
        Memory: the block being made, the chunk it is made from, and what the caller keeps of the blocks before.
        """
        draw = self._draws
        self._draws += 1
        self._refuse_replay(draw)
        spans = [(int(start), int(count)) for start, count in blocks]
        for start, count in spans:
            if not 0 <= start <= start + count <= numel:
                raise ValueError(f"block {(start, count)} does not lie in a draw of {numel} values.")
        device = torch.device(device)
        key, counter, secure = self._key, (self._step, draw), self.secure  # bound now, however late the blocks are read

        def make_chunk(chunk: int) -> torch.Tensor:
            size = min(_CHUNK, numel - chunk * _CHUNK)
            if secure:  # float64 on the CPU
                return _secure_normal_chunk(key, (*counter, chunk), size, std).to(device=device, dtype=dtype)
            generator = _generator(key, device, b"noise", *counter, chunk)
            return torch.empty(size, device=device, dtype=dtype).normal_(0.0, std, generator=generator)

        return _blocks(make_chunk, std, spans, device, dtype)

    def _refuse_replay(self, draw: int) -> None:
        """Refuse a draw of an unseeded key for a training step (≥ 0) at or before its latest one.

        Each draw is a function of (key, step, draw): made twice, it is the same noise, and the two releases that
        carry it differ by a noiseless difference (of two batches' sums, or of a banded recursion's past outputs).
        pl_dp redraws the key at every fit start, so this never fires in a fit; it guards against a path that
        forgets to. Negative steps are the one-step audit's trials (:mod:`pl_dp.audit`), which release nothing.
        A seeded key (reproduction mode) replays by design: a bit-identical resume draws the same noise again.
        """
        if self.seeded or self._step < 0:
            return
        if self._last_draw is not None and (self._step, draw) <= self._last_draw:
            raise RuntimeError(
                f"the noise source was asked for draw {draw} of private step {self._step} after it drew "
                f"{self._last_draw[1]} of step {self._last_draw[0]} under the same secret key: that noise may be out "
                "already, and a release carrying it again would let the difference of the two cancel it. A fit draws "
                "a fresh key at its start (PrivateModule.on_fit_start); code that reuses a NoiseSource for steps it "
                "drew before must call redraw_secret() first."
            )
        self._last_draw = (self._step, draw)

    def seed_randomness(self, step: int, rank: int, device: torch.device) -> None:
        """Put torch's global CPU generator (and ``device``'s, on an accelerator) in a secret state for the other
        randomness of private step ``step`` on data-parallel rank ``rank`` (dropout, a net's own sampling): a
        function of the key, apart from every noise draw. Dropout masks drawn from a public generator
        (``seed_everything``) would let an adversary who knows its state see that adding one example shifts the
        masks of the examples after it; from a secret one, each example's masks are fresh and independent of the
        others, as the analysis of a subsampled Gaussian step with randomized per-example terms assumes. The caller
        restores the generators afterwards (``torch.random.fork_rng``)."""
        torch.set_rng_state(secret_cpu_state(_material(self._key, b"randomness", step, rank)))
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(derive_seed(_seed63(self._key), *_tag_counter(b"randomness"), step, rank))

    def share(self, broadcast: Callable[[Any], Any]) -> None:
        """Make every data-parallel rank use rank 0's key: one draw per logical step, whatever the world size.

        ``broadcast`` sends rank 0's object to all ranks (e.g. a Lightning strategy's ``broadcast``).
        The key crosses only the process group of the run, never storage.
        """
        key, self.seeded = broadcast((self._key, self.seeded))
        if key != self._key:  # rank 0's key, none of whose draws this rank made
            self._key, self._last_draw = key, None

    def describe(self) -> str:
        """What protects the noise, for the privacy report (never the key itself)."""
        generator = "SHAKE-256 CSPRNG, Holohan–Braghin hardening" if self.secure else "torch generator"
        origin = "user seed (no guarantee against whoever knows it)" if self.seeded else "OS entropy"
        return f"{generator}; key from {origin}"


def _blocks(
    make_chunk: Callable[[int], torch.Tensor],
    std: float,
    spans: list[tuple[int, int]],
    device: torch.device,
    dtype: torch.dtype,
) -> Iterator[torch.Tensor]:
    """The values of ``spans`` of one draw (:meth:`NoiseSource.normal_blocks`) from its chunks (``make_chunk``), the
    chunk last made held for the next span."""
    held: tuple[int, torch.Tensor] | None = None

    def chunk_values(chunk: int) -> torch.Tensor:
        nonlocal held
        if held is None or held[0] != chunk:
            held = None  # the chunk before is not kept while the next is made
            held = (chunk, make_chunk(chunk))
        return held[1]

    for start, count in spans:
        if std == 0 or count == 0:
            yield torch.zeros(count, device=device, dtype=dtype)
            continue
        first, last = start // _CHUNK, (start + count - 1) // _CHUNK
        if first == last:
            yield chunk_values(first)[start - first * _CHUNK : start - first * _CHUNK + count]
            continue
        out = torch.empty(count, device=device, dtype=dtype)
        for chunk in range(first, last + 1):
            low = chunk * _CHUNK
            values = chunk_values(chunk)
            begin, end = max(start, low), min(start + count, low + values.numel())
            out[begin - start : end - start] = values[begin - low : end - low]
        yield out


def _generator(key: bytes, device: torch.device, tag: bytes, *counters: int) -> torch.Generator:
    """A torch generator for (``key``, ``tag``, ``counters``): on the CPU in a full 19,937-bit state drawn from the key
    (a CPU seed keeps 32 bits only: :func:`~pl_dp.privacy.seeding.secret_cpu_state`); on an accelerator seeded with 64
    bits (Philox)."""
    if device.type == "cpu":
        return secret_cpu_generator(_material(key, tag, *counters))
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(_seed63(key), *_tag_counter(tag), *counters))
    return generator


def _material(key: bytes, tag: bytes, *counters: int) -> bytes:
    return key + tag + b"".join(int(c).to_bytes(8, "little", signed=True) for c in counters)


def _seed63(key: bytes) -> int:
    return int.from_bytes(key[:8], "little") >> 1


def _secure_normal_chunk(key: bytes, counter: tuple[int, ...], size: int, std: float) -> torch.Tensor:
    """(Σ_{j<4} N_j)/2 · std in float64 for ``size`` ≤ 2²⁰ values, each N_j by Box–Muller from 53-bit uniforms of
    SHAKE-256(key, counter): the uniforms take 32 bytes a value, so draws are made a chunk at a time."""
    pairs = (size + 1) // 2
    prefix = key + b"".join(int(c).to_bytes(8, "little", signed=True) for c in counter)
    stream = hashlib.shake_256(prefix).digest(4 * 2 * pairs * 8)
    words = torch.frombuffer(bytearray(stream), dtype=torch.int64)
    uniform = ((words >> 11) & _LOW53).double().mul_(2.0**-53).view(4, 2, pairs)  # [0, 1), 53 random bits
    radius = torch.sqrt(-2.0 * torch.log1p(-uniform[:, 0]))  # log(1 − u), 1 − u ∈ (0, 1]: never log(0)
    angle = uniform[:, 1].mul_(2.0 * math.pi)
    normals = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)[:, :size]
    return normals.sum(dim=0).mul_(std / 2.0)
