"""Large logical batches: a Poisson batch split into physical micro-batches releases the same step."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.step.batches import batch_size_of
from tests import catalog
from tests.conftest import blobs, make_trainer

#: every method but the zeroth-order ones after the first (their private passes are pl_dp.zo's one two-point
#: estimator, which DPZero runs here: two fits a case keep the list short), and the configurations that change how a
#: micro-batch is computed: every per-sample mode, the adaptive clip threshold (AdaMix's private quantile), and banded
#: correlated noise (a step's noise depends on the earlier steps')
METHODS = {
    entry.id: entry
    for entry in [
        *catalog.select(zeroth_order=True)[:1],
        *catalog.select(zeroth_order=False),
        *catalog.select(catalog.VARIANTS, aspects=("per_sample", "adaptive clip", "noise")),
    ]
}


class _SizeRecordingLoss(L.Callback):
    """Per-example cross-entropy that remembers the largest batch it saw inside training steps."""

    def __init__(self) -> None:
        self.largest, self.recording = 0, False

    def __call__(self, net, batch):
        x, y = batch
        if self.recording:
            self.largest = max(self.largest, batch_size_of(batch))
        return F.cross_entropy(net(x), y, reduction="none")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.recording = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.recording = False


@pytest.mark.parametrize("name", list(METHODS))
def test_micro_batches_release_the_same_step_as_one_pass(name):
    entry = METHODS[name]
    runs = {}
    for physical in (None, 3):
        L.seed_everything(0)
        loss = _SizeRecordingLoss()
        model = entry.build(
            loss=loss, privacy=PrivacySpec(epsilon=10.0), noise_seed=1, max_physical_batch_size=physical
        )
        dm = PrivatePublicDataModule(
            blobs(120), public=blobs(40, seed=3), batch_size=20, public_batch_size=3, sampling_seed=2
        )
        make_trainer(max_steps=3, callbacks=[loss]).fit(model, dm)
        runs[physical] = (model, loss.largest)
    (whole, largest_whole), (split, largest_split) = runs[None], runs[3]
    if entry.kwargs().get("per_sample") != "functorch":  # vmap calls the loss one example at a time either way
        assert largest_whole > 3 and largest_split <= 3  # the physical batch bounds every private pass
    assert split.accountant.history == whole.accountant.history  # one release per logical step
    for a, b in zip(split.net.parameters(), whole.net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # equal up to the order of summation
