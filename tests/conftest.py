"""Shared fixtures: tiny real datasets and a quiet Trainer factory."""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import TensorDataset

os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(2)
warnings.filterwarnings("ignore", message=".*Optimal order is the largest alpha.*")
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")


def make_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def blobs(n: int = 200, dim: int = 4, classes: int = 3, seed: int = 0) -> TensorDataset:
    """Linearly separable Gaussian blobs: a small real classification task."""
    centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(1234)) * 3
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, dim, generator=g)
    return TensorDataset(x, y)


@pytest.fixture
def trainer_factory():
    return make_trainer
