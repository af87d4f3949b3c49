"""Counter-based seed derivation shared by the direction engine and the Poisson sampler.

A sub-seed is a pure function of a base seed and a tuple of counters (for example
``(step, query, parameter_index)``), so any random draw can be regenerated in any order,
on any rank, after a resume, without storing it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import secrets
import struct
from typing import Any

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@enum.unique
class SeedDomain(enum.IntEnum):
    """The tags that keep pl_dp's streams of data-independent randomness apart: each stream derives its seeds as
    ``derive_seed(base, SeedDomain.X, ...)``, so no two streams ever draw from the same seed. One place, so a new
    stream takes a new tag instead of reusing one (the values are those the streams have always used: a run seeded
    the same way draws the same directions)."""

    #: a module's direction seed, from ``torch.initial_seed()`` (``PrivateModule.direction_seed``)
    DIRECTIONS = 0xD1EC
    #: PAZO-P's coefficients in the public-gradient basis (:class:`~pl_dp.zo.subspace.SubspaceEngine`)
    SUBSPACE_COEFFICIENTS = 0xC0EF
    #: the random inputs of data-free pruning scores (:func:`~pl_dp.zo.pruning.path_norm_scores`)
    PRUNING_SCORES = 0x5C0E
    #: a pruning stage's scoring seed (:class:`~pl_dp.callbacks.PruningSchedule`)
    PRUNING_STAGE = 0x9A0E
    #: O2NC's directions and query points per round
    O2NC_ROUNDS = 0x0A2C
    #: the directions along which the fit-start probe compares a zeroth-order step's release
    PROBE_DIRECTIONS = 0x9B0E


def derive_seed(base_seed: int, *counters: int) -> int:
    """Mix ``base_seed`` and ``counters`` into a 63-bit seed (splitmix64 chain)."""
    h = _splitmix64(base_seed & _MASK64)
    for c in counters:
        h = _splitmix64(h ^ (c & _MASK64))
    return h >> 1


def entropy_seed() -> int:
    """A 63-bit seed from the operating system's entropy pool (``secrets``)."""
    return secrets.randbits(63)


class CopiesDrawTheirOwnSecret:
    """Mixin: a pickle or a deep copy (``torch.save(model)``, ``copy.deepcopy``) leaves the secret attribute named
    ``secret`` out — unless ``seeded``: a user's seed is public — and the copy draws its own (``_draw_secret``), so
    it never replays the original's draws."""

    secret: str
    seeded: bool

    def _draw_secret(self) -> Any:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if not self.seeded:
            del state[self.secret]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.secret not in state:
            setattr(self, self.secret, self._draw_secret())

    def redraw_secret(self) -> None:
        """Draw a fresh secret from OS entropy, unless ``seeded`` (a user's seed is kept: reproduction mode).

        Called at every fit start: a fit never draws with an earlier fit's secret, so a retry in the same process from
        an older checkpoint (a notebook, a retry loop after a crash) does not replay randomness that an earlier fit
        already released — noise whose second use would cancel in the difference of two releases, or batches whose
        second use is not the fresh Poisson sample the accountant composes."""
        if not self.seeded:
            setattr(self, self.secret, self._draw_secret())


#: where the 624 words of the Mersenne Twister sit in a torch CPU generator's state (after the initial seed, the
#: position ``left``, ``seeded`` and ``next``: 8 + 4 + 4 + 8 bytes), each stored in 8 bytes
_MT_OFFSET, _MT_WORDS = 24, 624


@functools.cache
def _cpu_state_template() -> bytes:
    """A torch CPU generator state whose layout is checked against the Mersenne Twister's own seeding (the words of
    ``manual_seed(5489)``), so that :func:`secret_cpu_generator` never writes a state it misreads; returned with
    initial seed 0 and ``left`` = 1 (the next draw twists the words :func:`secret_cpu_state` writes)."""
    state = bytearray(torch.Generator().manual_seed(5489).get_state().tolist())
    words = [5489]
    for i in range(1, _MT_WORDS):
        words.append((1812433253 * (words[-1] ^ (words[-1] >> 30)) + i) & 0xFFFFFFFF)
    if list(struct.unpack_from(f"<{_MT_WORDS}Q", state, _MT_OFFSET)) != words:
        raise RuntimeError(
            "this torch build's CPU generator state has an unknown layout, so pl_dp cannot seed it with a full-entropy "
            "secret: use secure_rng=True (SHAKE-256 noise) on this build."
        )
    struct.pack_into("<Qii", state, 0, 0, 1, 1)  # initial seed 0, left = 1, seeded
    return bytes(state)


def secret_cpu_state(material: bytes) -> torch.Tensor:
    """A torch CPU generator state (Mersenne Twister, 19,937 bits) drawn from SHAKE-256(``material``).

    ``torch.Generator().manual_seed(s)`` keeps only the low 32 bits of ``s`` on the CPU, so a secret passed as a
    seed could be found by trying all 2³² seeds against a release (hours on one core). A state filled from the
    secret key has no such shortcut. ``initial_seed()`` of such a generator reports 0, never the secret.
    """
    state = bytearray(_cpu_state_template())
    words = np.frombuffer(state, dtype="<u8", count=_MT_WORDS, offset=_MT_OFFSET)  # a view: writes go to state
    words[:] = np.frombuffer(hashlib.shake_256(material).digest(4 * _MT_WORDS), dtype="<u4")
    return torch.frombuffer(state, dtype=torch.uint8)  # which keeps state alive, no one else holding it


def secret_cpu_generator(material: bytes) -> torch.Generator:
    """A CPU ``torch.Generator`` in the state :func:`secret_cpu_state` derives from ``material``."""
    generator = torch.Generator()
    generator.set_state(secret_cpu_state(material))
    return generator
