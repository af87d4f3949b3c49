"""Private hyperparameter tuning: a random number of trials, only the best released (Papernot & Steinke 2022).

Papernot & Steinke ("Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022) bound the Rényi-DP
cost of running a private training algorithm Q a *random* number K of times, each time with hyperparameters
drawn at random, and releasing only the best output (K itself and the other outputs stay hidden). K follows
either a truncated negative binomial distribution D_{η,γ} (their Definition 1: P[K = k] ∝ (1 − γ)^k ·
binom(k + η − 1, k) on k ≥ 1; η = 1 is the geometric distribution, η = 0 the logarithmic one) or a Poisson
distribution (K = 0, nothing released, is then possible). Google's dp-accounting implements both bounds as
``RepeatAndSelectDpEvent(event, mean, shape)`` for its RDP accountant (Theorem 2 for the truncated negative
binomial, Theorem 6 for Poisson, shape = ∞); :func:`search_epsilon` is that event and accountant, nothing more.

This module holds the Lightning-free parts of ``pl-dp tune`` (:mod:`pl_dp.tuning`):

* :class:`TrialCount` — the distribution of K (mean and shape, dp-accounting's parameters) and the probability
  of one more trial given that k ran, P[K > k | K ≥ k]: the search draws *after each trial* whether to go on, so
  K is never drawn up front and never stored (a state file on disk holds no secret, invariant 2). The product of
  these continuation probabilities is P[K = k] exactly (the chain rule).
* :class:`SecretCoin` — the uniforms those draws take, from the operating system's CSPRNG (``secrets``), as
  the DP noise's key is (:mod:`pl_dp.privacy.noise`); a seed exists for tests only.
* :func:`trial_event` — the DpEvent of one trial: its accountant history of Poisson-subsampled Gaussian steps.
* :func:`search_epsilon` — ε of the whole search at δ, by dp-accounting's RDP accountant.

Privacy effect: the search's (ε, δ) covers the best model, its score and the trial's privacy record, provided
every trial is the same mechanism (same σ, q and planned steps: the search refuses hyperparameters that change them,
accounts each trial by its plan, fixed before any step, and stops, releasing nothing, when a trial planned another
event than the first), the score is computed on data outside
the protected set, and nothing else of the search — its count of trials, the other trials' outputs — is released.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

from pl_dp.errors import PrivacyConfigError
from pl_dp.privacy.accountants import history_event

#: the shape of dp-accounting's Poisson distribution of K
POISSON = math.inf
#: relative accuracy of the halting probability γ solved from the mean (dp-accounting's own tolerance)
GAMMA_TOLERANCE = 1e-9
#: where a tail sum of P[K = j] stops: the terms left are below this fraction of the sum
TAIL_PRECISION = 1e-17


@dataclass(frozen=True, kw_only=True)
class TrialCount:
    """The distribution of the number of trials K, as dp-accounting's ``RepeatAndSelectDpEvent`` names it.

    Args:
        mean: E[K], more than 1 (one trial is no search: use ``pl-dp fit``).
        shape: η ≥ 0 of the truncated negative binomial (0: logarithmic, 1: geometric), or ``math.inf``
            (:data:`POISSON`): Poisson with this mean, where K = 0 (no trial, nothing released) is possible.

    The searches draw K with the halting probability :attr:`gamma`, solved from ``mean`` so that the mean drawn is
    at most ``mean`` and γ at least the one dp-accounting solves: Papernot & Steinke's bound grows with E[K] and
    with log(1/γ), so the ε dp-accounting reports for ``mean`` bounds the distribution drawn.
    """

    mean: float
    shape: float

    def __post_init__(self) -> None:
        if not (isinstance(self.mean, (int, float)) and self.mean > 1 and math.isfinite(self.mean)):
            raise PrivacyConfigError(
                f"the mean number of trials must be a finite number above 1, got {self.mean!r}: one trial is no "
                "search (use pl-dp fit)."
            )
        if not (isinstance(self.shape, (int, float)) and self.shape >= 0):
            raise PrivacyConfigError(
                f"the shape of the number of trials must be >= 0 (0 logarithmic, 1 geometric, a truncated negative "
                f"binomial otherwise) or inf (Poisson), got {self.shape!r}."
            )

    @property
    def is_poisson(self) -> bool:
        return self.shape == POISSON

    @cached_property
    def gamma(self) -> float:
        """γ of D_{η,γ}: the smallest-mean end of a bisection to dp-accounting's tolerance (truncated negative
        binomial only). Its mean is at most :attr:`mean`; dp-accounting accounts the other end, a smaller γ."""
        if self.is_poisson:
            raise ValueError("a Poisson number of trials has no halting probability.")
        if self.shape == 1:
            return 1 / self.mean
        low, high = 0.0, min(1.0, 2 * (self.shape + 1) / self.mean)
        while high > low * (1 + GAMMA_TOLERANCE):
            middle = (low + high) / 2
            if truncated_negative_binomial_mean(middle, self.shape) < self.mean:
                high = middle
            else:
                low = middle
        return high

    def log_probability(self, count: int) -> float:
        """log P[K = count] (−inf outside the support)."""
        if count < 0 or (count == 0 and not self.is_poisson):
            return -math.inf
        if self.is_poisson:
            return -self.mean + count * math.log(self.mean) - math.lgamma(count + 1)
        gamma, shape = self.gamma, self.shape
        if shape == 0:  # logarithmic: (1 − γ)^k / (k · ln(1/γ))
            return count * math.log1p(-gamma) - math.log(count) - math.log(-math.log(gamma))
        # (1 − γ)^k / (γ^−η − 1) · Γ(k + η) / (Γ(η) · k!)
        return (
            count * math.log1p(-gamma)
            - math.log(math.expm1(-shape * math.log(gamma)))
            + math.lgamma(count + shape)
            - math.lgamma(shape)
            - math.lgamma(count + 1)
        )

    def probability(self, count: int) -> float:
        """P[K = count]."""
        return math.exp(self.log_probability(count))

    def survival(self, count: int) -> float:
        """P[K ≥ count], summed over the tail (accurate where 1 − P[K < count] would cancel)."""
        total, term_ratio_limit = 0.0, 0.0 if self.is_poisson else 1 - self.gamma
        j = max(count, 0 if self.is_poisson else 1)
        while True:
            term = self.probability(j)
            total += term
            ratio = max(self._ratio(j), term_ratio_limit)  # bounds every later ratio P[j+2]/P[j+1], ...
            if ratio < 1 and term * ratio / (1 - ratio) <= TAIL_PRECISION * total:
                return min(total, 1.0)
            j += 1

    def _ratio(self, count: int) -> float:
        """P[K = count + 1] / P[K = count] (for count ≥ 1; Poisson also at 0)."""
        if self.is_poisson:
            return self.mean / (count + 1)
        return (1 - self.gamma) * (count + self.shape) / (count + 1)

    def more_probability(self, finished: int) -> float:
        """P[K > finished | K ≥ finished]: the probability that one more trial runs after ``finished`` trials.

        Before any trial (``finished`` = 0) it is P[K ≥ 1]: 1 for the truncated negative binomial, 1 − e^−mean for
        Poisson. Going on with these probabilities, trial after trial, gives P[K = k] = S(k)/S(0) · P[K = k]/S(k)
        with S the survival function, so K has exactly its distribution without ever being drawn whole.
        """
        if finished < 0:
            raise ValueError(f"finished must be >= 0, got {finished}.")
        return _more_probability(self, finished)

    def event(self, trial: dp_event.DpEvent) -> dp_event.DpEvent:
        """The DpEvent of the whole search: ``trial`` repeated K times, the best released."""
        return dp_event.RepeatAndSelectDpEvent(trial, float(self.mean), float(self.shape))

    def describe(self) -> str:
        """The distribution in words (the privacy report's line)."""
        if self.is_poisson:
            return f"Poisson with mean {self.mean:g}"
        kind = {0.0: "logarithmic", 1.0: "geometric"}.get(self.shape, "truncated negative binomial")
        return f"{kind} (shape {self.shape:g}) with mean {self.mean:g}"


@lru_cache(maxsize=4096)
def _more_probability(count: TrialCount, finished: int) -> float:
    """:meth:`TrialCount.more_probability`, computed once per distribution and number of finished trials.

    The truncated negative binomial has no K = 0: the first trial always runs (exactly 1, where S(1)/S(0) summed
    in floats rounds below 1 and left P[K = 0] ~ 1e-14, found by review)."""
    if finished == 0 and not count.is_poisson:
        return 1.0
    survived = count.survival(finished) if finished else 1.0
    return 0.0 if survived == 0 else min(count.survival(finished + 1) / survived, 1.0)


def truncated_negative_binomial_mean(gamma: float, shape: float) -> float:
    """E[K] of D_{η,γ} (Papernot & Steinke 2022, Definition 1): η(1 − γ) / (γ(1 − γ^η)), (1 − γ)/(γ ln(1/γ)) at
    η = 0, 1/γ at η = 1."""
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must lie in (0, 1], got {gamma}.")
    if gamma == 1:
        return 1.0
    if shape == 0:
        return (1 - gamma) / (gamma * -math.log(gamma))
    return shape * (1 - gamma) / (gamma * -math.expm1(shape * math.log(gamma)))


class SecretCoin:
    """Uniform draws in [0, 1) that decide whether a search runs one more trial: a secret of the search.

    Drawn from the operating system's CSPRNG (``secrets``), never stored: the decisions made are in the search's
    state, the generator is not. ``seed`` (tests, reproduction) makes them reproducible — and K known to whoever
    knows the seed, against whom the search's ε then holds no more.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seeded = seed is not None
        self._generator: random.Random = random.Random(seed) if seed is not None else secrets.SystemRandom()

    def __getstate__(self) -> dict[str, object]:
        raise TypeError("a SecretCoin holds a secret of the search: it cannot be pickled or copied.")

    def uniform(self) -> float:
        return self._generator.random()

    def choice(self, count: int) -> int:
        """An index in range(count), uniformly (the candidate a random-search trial runs)."""
        return self._generator.randrange(count)

    def one_more(self, distribution: TrialCount, finished: int) -> bool:
        """Whether trial ``finished + 1`` runs: true with :meth:`TrialCount.more_probability`."""
        return self.uniform() < distribution.more_probability(finished)


History = Sequence[Sequence[float]]


def trial_event(history: History) -> dp_event.DpEvent:
    """The DpEvent of one trial: its accountant history of ``(σ, q, steps)`` rows
    (:func:`~pl_dp.privacy.accountants.history_event`)."""
    if not history:
        raise PrivacyConfigError("a trial released no private step: it has no privacy event to repeat.")
    return history_event(history)


def search_epsilon(history: History, count: TrialCount, delta: float, then: History = ()) -> float:
    """ε at ``delta`` of a search whose trials each released ``history`` and whose number of trials follows ``count``
    (dp-accounting's RDP accountant of ``RepeatAndSelectDpEvent``, add/remove-one adjacency), composed with the steps
    of ``then``: the released model's training after the search, if any."""
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    # dp-accounting logs a warning for each Rényi order whose series does not converge (small σ, low orders) and
    # leaves that order out: ε is the minimum over the orders kept, still an upper bound, so the lines are hidden
    absl, level = logging.getLogger("absl"), logging.getLogger("absl").level
    absl.setLevel(logging.ERROR)
    try:
        accountant.compose(count.event(trial_event(history)))
        if then:
            accountant.compose(trial_event(then))
        return float(accountant.get_epsilon(delta))
    finally:
        absl.setLevel(level)


def release_epsilon(search: Mapping[str, Any], history: History, private_steps: int | None, delta: float) -> float:
    """ε at ``delta`` of a model a search released (its checkpoint's ``search`` record), whose own accountant holds
    ``history`` after ``private_steps`` steps: the search's bound over its planned trial event, composed with the
    whole ``history`` again when the model was trained on after the search (an upper bound), the search alone when
    it was not (the released trial's own steps, ``released_steps``, fit in the planned event).

    The one place the ε of a search's release is computed: the privacy report and the ledger (``model.epsilon``,
    the fit summary) both use it, so no figure of a release leaves the search's cost out (found by review)."""
    count = TrialCount(mean=float(search["mean"]), shape=float(search["shape"]))
    trial: History = search.get("history", history)
    released_steps = search.get("released_steps")
    untouched = (released_steps is not None and released_steps == private_steps) or [list(r) for r in history] == [
        list(r) for r in trial
    ]
    return search_epsilon(trial, count, delta, then=() if untouched else history)
