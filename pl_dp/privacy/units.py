"""Whom a run's guarantee protects: one example, or one user with all of their examples.

Example-level DP protects one record; a person who wrote 200 of the records is protected only at about 200·ε
(group privacy). User-level DP protects one user — all of their examples at once — under add/remove-one-user
adjacency. pl_dp gets it the way dp-transformers' ``AuthorIndexedDataset`` does: Poisson sampling over users at
rate q = users per batch / number of users, and one example of each sampled user, drawn uniformly
(:class:`~pl_dp.privacy.sampling.UserPoissonBatchSampler`). Adding or removing a user then changes at most one row
of any batch, so each method's bound C on one row's contribution and the subsampled-Gaussian accounting at the
user sample rate hold as they are (Charles et al., 2024, "Fine-tuning large language models with user-level
differential privacy", example-level sampling of users with one example per sampled user).

:class:`PrivacyUnit` is the one owner of the fact: the private sampler states it, the ledger records it (δ's default
is 1 / its population), and the report, the W&B config and the checkpoint read it from there.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Union

import numpy as np
import torch

from pl_dp.errors import ConfigError, DataError, PrivacyConfigError

#: the units of privacy pl_dp offers
UNITS = ("example", "user")

#: each private example's user: a sequence of user ids (one per example), or a callable index → user id
UserOf = Union[Sequence[Hashable], Callable[[int], Hashable]]


@dataclass(frozen=True)
class PrivacyUnit:
    """The unit of privacy of a run and how many of them the private set holds.

    Args:
        kind: ``"example"`` (add/remove one example) or ``"user"`` (add/remove one user with all of their examples).
        population: the number of examples, or of users, in the private set: the n of q = b/n and of δ's default
            1/n (treated as public, as Opacus treats the dataset size).
    """

    kind: str
    population: int

    def __post_init__(self) -> None:
        if self.kind not in UNITS:
            raise PrivacyConfigError(f"the unit of privacy must be one of {UNITS}, got {self.kind!r}.")
        if self.population < 1:
            raise ConfigError(f"the private set holds no {self.kind}: there is nothing to train on privately.")

    @property
    def plural(self) -> str:
        """``"examples"`` or ``"users"``."""
        return f"{self.kind}s"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> PrivacyUnit:
        return cls(str(state["kind"]), int(state["population"]))


class UserIndex:
    """Which private examples belong to which user, in the form the user-level sampler draws from.

    Users are numbered 0…U−1 in order of their first example; the examples of user ``u`` are
    ``order[offsets[u]:offsets[u + 1]]`` (``counts[u]`` of them). Built once from one user id per example.

    The user ids are private data, like the examples: nothing here is logged or saved (a data module keeps
    ``user_of`` out of its hyperparameters). Only U, the number of users, is shown (as n is).
    """

    def __init__(self, user_ids: Sequence[Hashable]) -> None:
        user_ids = [_compared_value(user) for user in user_ids]
        missing = sum(1 for user in user_ids if _missing(user))
        if missing:
            raise DataError(
                f"{missing} private example(s) name no user (None, NaN, pandas' NA or NaT, an empty string, or "
                f"{sorted(_MISSING_TEXTS - {''})} as text): they would all be pooled into one user, or each counted "
                "as a user of its own, and a person among them protected as neither. Give every example its user id "
                "(or drop the examples that have none) before training."
            )
        by_identity = sorted({name for user in user_ids for name in _identity_hashed(user)})
        if by_identity:
            raise ConfigError(
                f"user ids of type {by_identity} are told apart by object identity, not by value: two equal ids would "
                "be two users, and a person with several examples protected as several people. Give each example's "
                "user id as a string or an integer."
            )
        if len({isinstance(user, str) for user in user_ids}) > 1:
            raise ConfigError(
                "the user ids mix strings and numbers: '7' and 7 would be two users, and a person whose id is written "
                "both ways protected as two people. Give every user id in one type (e.g. all as strings)."
            )
        numbers: dict[Hashable, int] = {}
        try:
            user_of_example = np.fromiter(
                (numbers.setdefault(user, len(numbers)) for user in user_ids), dtype=np.int64, count=len(user_ids)
            )
        except TypeError as error:
            raise ConfigError(
                f"a user id must be hashable (a string or an integer), got {error}: give one user id per example."
            ) from error
        if not len(user_of_example):
            raise ConfigError("the private set holds no example, so no user: there is nothing to train on privately.")
        self.num_examples = len(user_of_example)
        self.num_users = len(numbers)
        self.order = np.argsort(user_of_example, kind="stable")
        self.counts = np.bincount(user_of_example, minlength=self.num_users)
        self.offsets = np.concatenate(([0], np.cumsum(self.counts)))

    @classmethod
    def of(cls, user_of: UserOf, num_examples: int) -> UserIndex:
        """The index of ``num_examples`` examples whose users ``user_of`` names (a sequence, or index → user id)."""
        if callable(user_of):
            return cls([user_of(index) for index in range(num_examples)])
        if isinstance(user_of, Mapping):  # its iteration gives its keys, not the ids
            raise ConfigError(
                "user_of must be a sequence of user ids (one per private example, in the examples' order) or a "
                "callable index -> user id, not a mapping: for a dict index -> id, pass user_of=ids.__getitem__."
            )
        if isinstance(user_of, (str, bytes)) or len(user_of) != num_examples:
            found = "a string" if isinstance(user_of, (str, bytes)) else f"{len(user_of)} user ids"
            raise ConfigError(
                f"user_of must name the user of each of the {num_examples} private examples (a sequence of that "
                f"length, or a callable index -> user id); got {found}."
            )
        return cls(user_of)

    @property
    def unit(self) -> PrivacyUnit:
        return PrivacyUnit("user", self.num_users)

    def one_example_each(self, users: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One example of each of ``users`` (distinct user numbers), each uniform among that user's examples and
        drawn from ``rng`` (the sampler's secret randomness), in the order of ``users``."""
        return self.order[self.offsets[users] + rng.integers(0, self.counts[users])]


#: what a missing id becomes as text (``str(None)``, a float or pandas column's empty cell written out)
_MISSING_TEXTS = frozenset({"", "none", "nan", "<na>", "nat", "null"})


def _compared_value(user: Any) -> Any:
    """The value a user id is compared by: a tensor's or an array's one element (a tensor is hashed by its identity,
    so a column of ids read as tensors made each example a user of its own: found by review), a NumPy or Arrow
    scalar's Python value, a tuple's or a frozenset's elements' (a composite id of tensors split its user too); the id
    itself otherwise."""
    if isinstance(user, (torch.Tensor, np.ndarray)):
        if (user.size if isinstance(user, np.ndarray) else user.numel()) != 1:
            raise ConfigError(
                f"a user id must be one value, got a {type(user).__name__} of shape {tuple(user.shape)}: give one user "
                "id per example."
            )
        return user.item()
    if isinstance(user, np.generic):
        return user.item()
    if _package(user) == "pyarrow" and hasattr(user, "as_py"):  # a datasets column in Arrow format
        return _compared_value(user.as_py())
    if isinstance(user, tuple):
        values = [_compared_value(part) for part in user]
        return type(user)(*values) if hasattr(user, "_fields") else tuple(values)  # a namedtuple, or a tuple
    if isinstance(user, frozenset):
        return frozenset(_compared_value(part) for part in user)
    return user


def _identity_hashed(user: Any) -> Iterator[str]:
    """The names of the types in ``user`` (a composite id's parts too) whose objects are told apart by identity."""
    if isinstance(user, (tuple, frozenset)):
        for part in user:
            yield from _identity_hashed(part)
    elif type(user).__hash__ is object.__hash__:
        yield type(user).__name__


def _missing(user: Any) -> bool:
    """Whether a user id names nobody (or a composite id has a part that does): None, NaN (a float column's empty
    cell), pandas' NA and NaT, an empty string or one of :data:`_MISSING_TEXTS` (how a missing id reads once written
    as text), as ``str`` or ``bytes``."""
    if isinstance(user, (tuple, frozenset)):
        return any(_missing(part) for part in user)
    if isinstance(user, numbers.Number) and not isinstance(user, numbers.Rational):  # NaN is unequal to itself
        return bool(user != user)
    if isinstance(user, (str, bytes)):
        text = user.decode(errors="replace") if isinstance(user, bytes) else user
        return text.strip().lower() in _MISSING_TEXTS
    if _package(user) == "pandas":  # pd.NA, pd.NaT (nullable and datetime columns)
        import pandas

        return bool(pandas.isna(user))
    return user is None


def _package(value: Any) -> str:
    """The top-level package that defines ``value``'s type."""
    return type(value).__module__.split(".")[0]
