"""AllowPrivacySpecChange: the explicit opt-in to resume a private run under a new privacy plan."""

from __future__ import annotations

import lightning as L


class AllowPrivacySpecChange(L.Callback):
    """Let a run resume from a checkpoint trained under another ``PrivacySpec`` or sample rate.

    Without it such a resume is refused. With it, the checkpoint's accountant history is kept
    (ε already spent is never forgotten), σ is re-planned for the steps left so that the *total*
    meets the new target (or an explicit ``noise_multiplier`` is checked against it), and a
    warning states what changed. A target below what the checkpoint already spent is still an
    error. A checkpoint without pl_dp privacy state stays refused: there is no history to keep.

    Example: ``pl-dp fit --config c.yaml --ckpt_path last.ckpt
    --trainer.callbacks+=pl_dp.callbacks.AllowPrivacySpecChange --model.init_args.privacy.epsilon 4``.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "allow_privacy_change"):
            raise TypeError(f"AllowPrivacySpecChange needs a pl_dp method; got {type(pl_module).__name__}.")
        pl_module.allow_privacy_change = True
