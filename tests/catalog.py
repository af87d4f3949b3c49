"""The one catalog of the private methods the tests run: every method class pl_dp exports, with small-run arguments.

Register a new method here, once (tests/test_catalog.py fails until every concrete method in
``pl_dp.methods.__all__`` has an entry): the tests that run every method, or every method with some capability,
draw their lists from :data:`METHODS` and :data:`VARIANTS` through :func:`select`, so the method is in them.

An :class:`Entry` holds an id, the class, and a function returning the keyword arguments of a small run (a net
``nn.Linear(4, 3)`` or a small MLP, a few steps on ``tests.conftest.blobs``): never ``net``, ``privacy`` or
``noise_seed``, which each test chooses. Its capabilities are read from the class (``requires_public_data``,
``shardable``, ``supports_data_parallel``, ``release``, the family it subclasses), never restated here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

import pl_dp.methods
from pl_dp.methods import (
    DPSGD,
    O2NC,
    PAZOM,
    PAZOP,
    PAZOS,
    Coupling,
    DPZero,
    FirstOrderModule,
    OwnUpdateModule,
    PrivateModule,
    ZerothOrderModule,
)
from pl_dp.per_sample import per_sample_mode_names
from pl_dp.privacy.accountants import accountant_class


@dataclass(frozen=True)
class Entry:
    """One method, or one configuration of it (a variant), as the tests build it."""

    id: str
    cls: type[PrivateModule]
    small: Callable[[], dict[str, Any]]
    #: what a variant changes from its method's entry ("per_sample", "clip", "adaptive clip", "optimizer", "noise");
    #: None for the method's own entry
    aspect: str | None = None

    def __repr__(self) -> str:  # the id, in pytest's parameter ids and assertion messages
        return self.id

    @property
    def name(self) -> str:
        return self.cls.__name__

    def kwargs(self, **overrides: Any) -> dict[str, Any]:
        """The small run's keyword arguments, ``overrides`` on top."""
        return {**self.small(), **overrides}

    def build(self, net: nn.Module | None = None, **overrides: Any) -> PrivateModule:
        """The module of a small run on ``net`` (``nn.Linear(4, 3)``: blobs' 4 features and 3 classes)."""
        return self.cls(nn.Linear(4, 3) if net is None else net, **self.kwargs(**overrides))

    # ---- capabilities, as the class states them -----------------------------------------------------------------
    @property
    def zeroth_order(self) -> bool:
        return issubclass(self.cls, ZerothOrderModule)

    @property
    def first_order(self) -> bool:
        return issubclass(self.cls, FirstOrderModule)

    @property
    def own_update(self) -> bool:
        """Writes its update itself (:class:`~pl_dp.methods.OwnUpdateModule`), rather than through an optimizer."""
        return issubclass(self.cls, OwnUpdateModule)

    @property
    def public_data(self) -> bool:
        return self.cls.requires_public_data

    @property
    def data_parallel(self) -> bool:
        return self.cls.supports_data_parallel

    @property
    def shardable(self) -> bool:
        """Runs sharded by FSDP2 as configured: the class declares it, and a first-order method's per-sample mode
        supports it (the module's ``supports_sharding``)."""
        return self.build().supports_sharding

    def accountable(self, accountant: str) -> bool:
        """Whether the accountant named ``accountant`` accounts this method's release."""
        return accountant_class(accountant).supports(self.cls.release)


def exported_methods() -> set[type[PrivateModule]]:
    """Every method pl_dp exports: a ``PrivateModule`` in ``pl_dp.methods.__all__`` with a step of its own."""
    return {
        cls
        for cls in map(vars(pl_dp.methods).get, pl_dp.methods.__all__)
        if isinstance(cls, type)
        and issubclass(cls, PrivateModule)
        and cls.private_step is not PrivateModule.private_step
    }


#: one entry per exported method class, in the order of the docs (zeroth order, then first order)
METHODS: list[Entry] = [
    Entry("dpzero", DPZero, lambda: dict(lr=0.05, clip=1.0, queries=2)),
    Entry("pazo-m", PAZOM, lambda: dict(lr=0.05, clip=1.0, alpha=0.5, queries=2)),
    Entry("pazo-p", PAZOP, lambda: dict(lr=0.05, clip=1.0, queries=2, k=2)),
    Entry("pazo-s", PAZOS, lambda: dict(lr=0.1, clip=2.0, k=2)),
    # T = 4 rounds of B₂ = 4 examples: a tree of a few leaves per epoch (the datamodule's batch size is not used)
    Entry("o2nc", O2NC, lambda: dict(clip=1.0, inner_steps=4, batch_size=4)),
    Entry("dpsgd", DPSGD, lambda: dict(lr=0.1, clip=1.0)),
    # r small: automatic clipping's weight C/(‖g‖+r) saturates C on a large gradient (the audit's canary)
    Entry("coupling", Coupling, lambda: dict(lr=0.1, clip=1.0, r=0.01)),
]


def _variant(base: str, id: str, aspect: str, **changes: Any) -> Entry:
    (entry,) = (entry for entry in METHODS if entry.id == base)
    return Entry(id, entry.cls, lambda: {**entry.small(), **changes}, aspect)


#: configurations of a method the tests of some concern run besides its entry
VARIANTS: list[Entry] = [
    _variant("dpzero", "dpzero-joint", "clip", joint_clip=True),
    # every per-sample mode pl_dp registers, on DP-SGD (its entry uses the default)
    *(
        _variant("dpsgd", f"dpsgd-{mode}", "per_sample", per_sample=mode)
        for mode in per_sample_mode_names()
        if mode != inspect.signature(DPSGD).parameters["per_sample"].default
    ),
    _variant("dpsgd", "dpsgd-ghost-psac", "per_sample", per_sample="ghost", clip_fn="psac"),
    _variant("dpsgd", "dpsgd-automatic", "clip", clip_fn="automatic", r=0.01),
    _variant("dpsgd", "dpsgd-psac", "clip", clip_fn="psac", r=0.01),
    _variant("dpsgd", "dpsgd-psac-adam", "optimizer", lr=0.05, clip_fn="psac", optimizer="adam"),
    # banded correlated noise (matrix factorization) over cyclic Poisson sampling, on both first-order methods
    _variant("dpsgd", "dpsgd-banded", "noise", noise="banded", bands=3),
    _variant("coupling", "coupling-banded", "noise", noise="banded", bands=2),
    # AdaMix's coupling with DP-SGD's constant clip and a private quantile that adapts the threshold each step
    _variant("coupling", "coupling-adamix", "adaptive clip", clip_fn="constant", clip_quantile=0.5, quantile_noise=5.0),
    _variant(
        "coupling",
        "coupling-adamix-ghost",
        "adaptive clip",
        clip_fn="constant",
        clip_quantile=0.5,
        quantile_noise=5.0,
        per_sample="ghost",
    ),
]


def by_id(*ids: str) -> list[Entry]:
    """The entries called ``ids``, in that order."""
    found = {entry.id: entry for entry in [*METHODS, *VARIANTS]}
    return [found[id] for id in ids]


#: the reference method of each family, zeroth order and first order: for tests of what the base does for every
#: method (batching, independence, pre-flight, hostile inputs), run on one method per family to keep the suite short
REPRESENTATIVES: list[Entry] = by_id("dpzero", "dpsgd")


def select(
    entries: list[Entry] | None = None, *, aspects: tuple[str | None, ...] | None = None, **capabilities: Any
) -> list[Entry]:
    """The entries (:data:`METHODS` by default) whose capabilities have the given values, e.g.
    ``select(own_update=True)``, ``select(accountable="rdp")``; ``aspects``: keep only variants of those aspects
    (None: the methods' own entries)."""
    chosen = []
    for entry in METHODS if entries is None else entries:
        if aspects is not None and entry.aspect not in aspects:
            continue
        if all(
            (entry.accountable(value) if name == "accountable" else getattr(entry, name) == value)
            for name, value in capabilities.items()
        ):
            chosen.append(entry)
    return chosen


def classes(entries: list[Entry] | None = None, **capabilities: Any) -> list[type[PrivateModule]]:
    """The classes of the entries (:data:`METHODS` by default) with the given capabilities."""
    return [entry.cls for entry in select(entries, **capabilities)]
