"""What pl_dp does with bad records in *your* private data: it names them before training, by index.

A private run must not show, through a warning or a crash at the step that samples it, that a broken record is in
the data. So every private fit starts with a pre-flight pass over the whole private set (each example read,
batched and scored once, by index — never through the secret Poisson sampler) and refuses to train while any
example is unusable, with one error that lists them all. Here two records of scikit-learn's digits are broken on
purpose — a NaN pixel and a label that is not a class — the first fit is refused with both named, the listed
examples are dropped, and the second fit trains.

    python examples/check_your_data.py
"""

from __future__ import annotations

import re

import lightning as L
import torch
from sklearn.datasets import load_digits
from torch.utils.data import Subset, TensorDataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import DataError
from pl_dp.methods import DPSGD
from pl_dp.nets import MLP


def broken_digits() -> TensorDataset:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    x[123, 5] = float("nan")  # a sensor glitch
    y[456] = 10  # a label that is not one of the 10 classes
    return TensorDataset(x, y)


def fit(private, max_steps: int) -> DPSGD:
    model = DPSGD(MLP(64, [32], 10), lr=0.5, clip=1.0, privacy=PrivacySpec(epsilon=2.0))
    trainer = L.Trainer(
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu"
    )
    trainer.fit(model, PrivatePublicDataModule(private, batch_size=64))
    return model


def main(max_steps: int = 30) -> dict:
    private = broken_digits()
    try:
        fit(private, max_steps)
    except DataError as error:
        print(error)
        bad = sorted({int(i) for i in re.findall(r"example (\d+):", str(error))})
    else:
        raise RuntimeError("the pre-flight pass let a broken record through")
    clean = Subset(private, [i for i in range(len(private)) if i not in bad])
    model = fit(clean, max_steps)
    print(f"dropped {bad}; trained {model.private_steps} private steps, epsilon {model.epsilon:.3f}")
    return {"bad": bad, "private_steps": model.private_steps, "epsilon": model.epsilon}


if __name__ == "__main__":
    main()
