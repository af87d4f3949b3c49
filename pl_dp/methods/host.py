"""What the mixins of :class:`~pl_dp.methods.base.PrivateModule` use of the module they are mixed into.

Each mixin (:class:`~pl_dp.methods.parallel.DataParallelMixin`, :class:`~pl_dp.methods.evaluation.EvaluationMixin`,
:class:`~pl_dp.methods.public.PublicDataMixin`) is written against :class:`ModuleHost`: for the type checker it
derives from the protocol, so that every attribute it reads of its host is declared once, here, and checked; at run
time it derives from ``object`` only (``Host``), and ``PrivateModule`` — a LightningModule — provides them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import lightning as L
import torch
from torch import nn

if TYPE_CHECKING:
    from pl_dp.privacy.noise import NoiseSource
    from pl_dp.privacy.spec import PrivacySpec


class ModuleHost(Protocol):
    """The attributes and methods of a private module that its mixins use."""

    net: nn.Module
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    privacy: PrivacySpec | None
    noise: NoiseSource
    direction_seed: int
    collective_bytes: int
    log_private_metrics: bool
    _metrics: nn.ModuleDict
    _trainer: L.Trainer | None
    _current_fx_name: str | None

    @property
    def trainer(self) -> L.Trainer: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def device_mesh(self) -> Any: ...

    @property
    def data_parallel(self) -> bool: ...

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None: ...

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any: ...

    def trainable_parameters(self) -> list[nn.Parameter]: ...

    def padding_example(self) -> Any: ...

    def on_train_start(self) -> None: ...


# the base of a mixin: ModuleHost for the type checker, object at run time
if TYPE_CHECKING:
    Host = ModuleHost
else:
    Host = object
