"""The per-step DP mechanism: one object that both adds the noise and feeds the accountant.

Each method declares its per-step mechanism (noise multiplier, sample rate, releases) in one place. A
:class:`SubsampledGaussian` carries σ, the sample rate, the per-example sensitivity C, the number
of sums released from the same batch and the expected batch size. The noise std of each
release and the accountant step are both computed from it, so accounting cannot drift from
the code that adds noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pl_dp.errors import PrivacyConfigError
from pl_dp.privacy.noise import NoiseSource

if TYPE_CHECKING:  # the accountants declare which mechanisms they account: they import this module
    from pl_dp.privacy.accountants import Accountant


class Mechanism(Protocol):
    """What a method's per-step release is to the rest of pl_dp: one interface, several mechanisms
    (:class:`SubsampledGaussian`; :class:`~pl_dp.privacy.tree.TreeAggregatedGaussian` for O2NC), as Opacus' accountants
    are one interface over several analyses.

    ``noise_multiplier`` is σ (0: the non-private run of the same method, which records nothing). :meth:`account`
    records one released step with each accountant given — the mechanism knows what an accountant must be told of it
    (σ and the sample rate; a tree's leaf) and refuses an accountant that cannot account it. The base asks the method
    for its mechanism before each step, hands it to the method's step (which adds noise through it only) and then to
    the ledger: so the noise added and the step recorded come from one object.
    """

    @property
    def noise_multiplier(self) -> float:
        """σ, the noise multiplier of the step (0: not private)."""
        ...

    def account(self, *accountants: Accountant | None) -> None:
        """Record one step of this mechanism with each accountant given (nothing for a non-private run)."""
        ...


@dataclass(frozen=True)
class SubsampledGaussian:
    """A Poisson-subsampled Gaussian mechanism releasing ``releases`` noisy sums per step.

    Each released sum Σ_i c_i has per-example contributions of L2 norm ≤ ``sensitivity`` (C)
    under add/remove-one adjacency, so its sensitivity is C. Releasing m such sums from the same
    batch with noise std √m·σ·C each is, by Gaussian composition (GDP: μ² = m·1/(mσ²)), exactly
    one Gaussian mechanism with multiplier σ — what the accountant records (Gong & Li 2025, §3.4,
    after Dong, Roth & Su's composition of Gaussian mechanisms). The released value is
    (sum + noise) / expected batch size (Poisson sampling: never divide by the realized size,
    which would make the scale data-dependent).

    ``noise_multiplier=0`` is the non-private run of the same method: no noise, no accounting.

    ``auxiliary_noise_multiplier`` σ_a declares one more release on the same batch with
    per-example sensitivity 1 (e.g. AdaMix's count of examples under the clip threshold). The
    two are one Gaussian mechanism with multiplier σ when 1/σ_main² + 1/σ_a² = 1/σ², so the main
    release gets σ_main = (σ⁻² − σ_a⁻²)^{−1/2} > σ and the accountant records σ (Andrew et al.
    2021; accounting σ_main instead under-reports ε, Opacus issue #807).
    """

    noise_multiplier: float
    sample_rate: float
    sensitivity: float
    expected_batch_size: float
    releases: int = 1
    auxiliary_noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}.")
        if self.noise_multiplier > 0 and not self.sensitivity > 0:
            raise ValueError(f"a private mechanism needs a finite sensitivity > 0, got {self.sensitivity}.")
        if self.releases < 1:
            raise ValueError(f"releases must be >= 1, got {self.releases}.")
        if not self.expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {self.expected_batch_size}.")
        aux = self.auxiliary_noise_multiplier
        if self.is_private and aux is not None and not aux > self.noise_multiplier:
            raise PrivacyConfigError(
                f"the auxiliary release's noise multiplier ({aux}) must exceed the step's noise multiplier "
                f"({self.noise_multiplier}): together they may not spend more than one Gaussian with sigma."
            )

    @property
    def is_private(self) -> bool:
        return self.noise_multiplier > 0

    @property
    def main_noise_multiplier(self) -> float:
        """σ_main: σ, or (σ⁻² − σ_a⁻²)^{−1/2} when an auxiliary release shares the budget."""
        if not self.is_private or self.auxiliary_noise_multiplier is None:
            return self.noise_multiplier
        return (self.noise_multiplier**-2 - self.auxiliary_noise_multiplier**-2) ** -0.5

    @property
    def noise_std(self) -> float:
        """Std of the Gaussian noise added to each released sum: √releases · σ_main · C."""
        if not self.is_private:
            return 0.0
        return math.sqrt(self.releases) * self.main_noise_multiplier * self.sensitivity

    def privatize_auxiliary(self, count: torch.Tensor, noise: NoiseSource) -> torch.Tensor:
        """(count + N(0, σ_a²)) / expected batch size, for the auxiliary sensitivity-1 release."""
        if self.auxiliary_noise_multiplier is None:
            raise ValueError("this mechanism declares no auxiliary release.")
        std = self.auxiliary_noise_multiplier if self.is_private else 0.0
        return (count + noise.normal(count.shape, std, count.device, count.dtype)) / self.expected_batch_size

    def privatize(self, sums: torch.Tensor, noise: NoiseSource) -> torch.Tensor:
        """(sums + N(0, noise_std²)) / expected batch size, for a tensor of released sums."""
        noisy = sums + self._noise(0, noise.normal(sums.shape, self.noise_std, sums.device, sums.dtype))
        return noisy / self.expected_batch_size

    def _noise(self, index: int, draw: torch.Tensor) -> torch.Tensor:
        """The noise added to released tensor ``index`` from this step's draw: the draw itself (independent noise;
        :class:`~pl_dp.privacy.correlated.BandedMatrixFactorization` correlates it across steps)."""
        return draw

    def privatize_(
        self,
        sums: Sequence[torch.Tensor],
        noise: NoiseSource,
        *,
        blocks: Sequence[tuple[torch.Size, int]] | None = None,
    ) -> None:
        """In-place version for a vector release split into tensors (e.g. one gradient per parameter).

        The noise is one draw laid over the tensors end to end (:meth:`NoiseSource.normal_like`). ``blocks``: the sums
        are this rank's blocks of sharded tensors (:func:`~pl_dp.step.shards.block`: each one's whole shape and flat
        offset); each rank adds its blocks of the draw one process makes: one draw per logical step, whatever the
        layout.
        """
        if self.is_private and sums:
            for i, (t, part) in enumerate(zip(sums, noise.normal_like(sums, self.noise_std, blocks=blocks))):
                t.add_(self._noise(i, part))
        for t in sums:
            t.div_(self.expected_batch_size)

    def account(self, *accountants: Accountant | None) -> None:
        """Record one step of this mechanism with each accountant given (nothing for a non-private run)."""
        for accountant in accountants:
            if self.is_private and accountant is not None:
                accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
