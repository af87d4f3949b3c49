"""The source of DP noise: its own generators, seeded from OS entropy unless told otherwise.

Invariant 2 (ARCHITECTURE.md): DP noise never comes from the global torch RNG, the Lightning
seed or the direction seed. A ``NoiseSource`` owns one ``torch.Generator`` per device, all
derived from one 63-bit seed that is drawn from ``secrets`` by default. Passing ``seed`` makes
the noise reproducible — for tests and for reproducing a run, never for production: anyone who
knows the seed can subtract the noise.
"""

from __future__ import annotations

from typing import Any

import torch

from pl_dp.privacy.seeding import derive_seed, entropy_seed


class NoiseSource:
    """Gaussian noise for DP mechanisms, from dedicated, checkpointable generators."""

    def __init__(self, seed: int | None = None) -> None:
        self.seeded = seed is not None
        self._seed = int(seed) if seed is not None else entropy_seed()
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        device = torch.device(device)
        key = str(device)
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(derive_seed(self._seed, *key.encode()))
            self._generators[key] = g
        return self._generators[key]

    def normal(
        self,
        shape: torch.Size | tuple[int, ...],
        std: float,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """A tensor of i.i.d. N(0, std²) draws."""
        out = torch.empty(shape, device=device, dtype=dtype)
        if std == 0:
            return out.zero_()
        return out.normal_(0.0, std, generator=self.generator(device))

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self._seed,
            "seeded": self.seeded,
            "states": {k: g.get_state() for k, g in self._generators.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seed = int(state["seed"])
        self.seeded = bool(state["seeded"])
        self._generators = {}
        for key, gen_state in state["states"].items():
            self.generator(key).set_state(gen_state)
