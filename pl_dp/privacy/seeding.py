"""Counter-based seed derivation shared by the direction engine and the Poisson sampler.

A sub-seed is a pure function of a base seed and a tuple of counters (for example
``(step, query, parameter_index)``), so any random draw can be regenerated in any order,
on any rank, after a resume, without storing it.
"""

from __future__ import annotations

import secrets

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(base_seed: int, *counters: int) -> int:
    """Mix ``base_seed`` and ``counters`` into a 63-bit seed (splitmix64 chain)."""
    h = _splitmix64(base_seed & _MASK64)
    for c in counters:
        h = _splitmix64(h ^ (c & _MASK64))
    return h >> 1


def entropy_seed() -> int:
    """A 63-bit seed from the operating system's entropy pool (``secrets``)."""
    return secrets.randbits(63)
