"""Public data for the methods that use it (PAZO-M/P/S, Coupling): batches and gradients, at no privacy cost.

Public batches come from the datamodule (:meth:`~pl_dp.data.PrivatePublicDataModule.public_batches`:
k disjoint batches per call); their gradients are exact, with no clipping and no noise, because
public data is not protected (Liu et al. 2023, Coupling; Gong & Li 2025, PAZO). Methods mix in
:class:`PublicDataMixin` before their private base.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pl_dp.errors import ConfigError
from pl_dp.methods.host import Host
from pl_dp.step.batches import batch_size_of
from pl_dp.step.losses import check_per_sample
from pl_dp.step.shards import replicated_gradient


class PublicDataMixin(Host):
    """Public batches and gradients for a :class:`~pl_dp.methods.base.PrivateModule` that needs public data."""

    requires_public_data = True

    @property
    def public_batches_per_step(self) -> int:
        """How many disjoint public batches one step draws (PAZO-P and PAZO-S: k)."""
        return 1

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[safe-super]  # the host's (a LightningModule's), not the protocol's
        self._public_source().check_public(self.public_batches_per_step)  # fail now, not at step 1

    def _public_source(self) -> Any:
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "public_batches"):
            raise ConfigError(
                f"{type(self).__name__} needs public data: train with a PrivatePublicDataModule "
                "(or a subclass) that has a public dataset."
            )
        return dm

    def public_batches(self, k: int = 1) -> list[Any]:
        """``k`` disjoint public batches on this module's device. Public data costs no privacy."""
        return [self.transfer_batch_to_device(b, self.device, 0) for b in self._public_source().public_batches(k)]

    def public_gradient(self, batch: Any) -> list[torch.Tensor]:
        """∇ of the mean loss over a public batch at the current parameters: no clipping, no noise.

        Every rank draws the same public batches, so the gradient is the same on every rank; sharded (FSDP2),
        each rank gets its shard of it (:func:`~pl_dp.step.shards.replicated_gradient`).
        """
        params = self.trainable_parameters()
        with torch.enable_grad():
            losses = check_per_sample(self.loss_fn(self.net, batch), batch_size_of(batch))
            grads = replicated_gradient(losses.mean(), params)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    def log_gradient_similarity(self, batch: Any, public_grad: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Log γ = ‖g_pub − ∇f(θ; B_private)‖ and their cosine (the γ-similarity of PAZO, Assumption 3.3).

        Only with ``log_private_metrics``: this backpropagates through the private batch without
        clipping or noise. Returns the private batch gradient (or None when disabled or empty).
        """
        if not self.log_private_metrics or batch_size_of(batch) == 0:
            return None
        private_grad = self.public_gradient(batch)  # the same computation; the data is private here
        diff = sum(float((a - b).square().sum()) for a, b in zip(public_grad, private_grad))
        dot = sum(float((a * b).sum()) for a, b in zip(public_grad, private_grad))
        norms = [math.sqrt(sum(float(t.square().sum()) for t in g)) for g in (public_grad, private_grad)]
        self.log("diagnostics/not_private/gamma", math.sqrt(diff), on_step=True, on_epoch=False)
        self.log(
            "diagnostics/not_private/cos_public_private",
            dot / max(norms[0] * norms[1], 1e-30),
            on_step=True,
            on_epoch=False,
        )
        return private_grad
