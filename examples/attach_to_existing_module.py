"""Train *your own* LightningModule privately with DPZero, on your own data.

The user's module below knows nothing about privacy: it is an ordinary regression model on
scikit-learn's bundled diabetes data (442 patients, 10 features), with its own validation and
test steps that log a torchmetrics metric. pl_dp wraps it as the `net` of a DPZero run: the private
method replaces training only (Poisson sampling, noise calibrated for ε = 3, a stop before the
budget would be exceeded); the module's own evaluation, metrics and predict step run as written.

    python examples/attach_to_existing_module.py
"""

from __future__ import annotations

import lightning as L
import torch
import torchmetrics
from sklearn.datasets import load_diabetes
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.callbacks import PrivacyBudget
from pl_dp.data import PrivatePublicDataModule
from pl_dp.methods import DPZero


class DiabetesRegressor(L.LightningModule):
    """A user's existing (non-private) LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1))
        self.val_mae = torchmetrics.MeanAbsoluteError()
        self.test_mse = torchmetrics.MeanSquaredError()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(1)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mae(self(x), y)
        self.log("val_mae", self.val_mae, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_mse(self(x), y)
        self.log("test_mse", self.test_mse)


def per_example_squared_error(net: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return (net(x) - y) ** 2  # one value per example: the contract pl_dp enforces


def diabetes_splits(seed: int = 0):
    data = load_diabetes()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(data.target, dtype=torch.float32)
    y = (y - y.mean()) / y.std()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, test = order[:350], order[350:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def main(epochs: int = 40) -> dict[str, float]:
    L.seed_everything(0)
    train, test = diabetes_splits()
    data = PrivatePublicDataModule(train, val=test, test=test, batch_size=35)
    model = DPZero(
        DiabetesRegressor(),
        loss=per_example_squared_error,
        lr=0.05,
        clip=2.0,
        smoothing=1e-3,
        queries=4,
        privacy=PrivacySpec(epsilon=3.0, accountant="rdp"),
    )
    trainer = L.Trainer(
        max_epochs=epochs,
        callbacks=[PrivacyBudget()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    baseline = float(((test.tensors[1] - train.tensors[1].mean()) ** 2).mean())
    trainer.fit(model, data)
    val_mae = float(trainer.callback_metrics["val_mae"])  # logged by the user's own validation_step
    mse = trainer.test(model, data, verbose=False)[0]["test_mse"]  # logged by the user's own test_step
    predictions = torch.cat(trainer.predict(model, data))  # the user's forward, on the test set
    result = {
        "test_mse": mse,
        "predict_mean_mse": baseline,
        "val_mae": val_mae,
        "predictions": predictions,
        "epsilon": model.epsilon,
        "delta": model.delta,
    }
    print(
        f"private test MSE {mse:.3f} (predicting the mean: {baseline:.3f}) | "
        f"epsilon {model.epsilon:.3f} at delta {model.delta:.2e}"
    )
    return result


if __name__ == "__main__":
    main()
