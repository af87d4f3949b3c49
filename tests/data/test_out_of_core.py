"""A private set bigger than one wants in memory: memory-mapped (NumPy) or Arrow-backed (Hugging Face ``datasets``
loaded from local files). Poisson sampling, the pre-flight pass and the probe read it by index; training never
holds it in process memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.methods import DPSGD, DPZero
from tests.conftest import make_trainer

ROWS, FEATURES = 100_000, 128  # 51 MB of float32 on disk


def _anonymous_kb() -> int:
    """Resident anonymous memory of this process (kB): what the process holds, not the file pages it maps."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))


class MemoryMapped(Dataset):
    """Rows of a NumPy memory map on disk, read one by one."""

    def __init__(self, path) -> None:
        self.x = np.lib.format.open_memmap(path / "x.npy", mode="r")
        self.y = np.load(path / "y.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return torch.from_numpy(np.array(self.x[i])), torch.tensor(int(self.y[i]))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    path = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    x = np.lib.format.open_memmap(path / "x.npy", mode="w+", dtype=np.float32, shape=(ROWS, FEATURES))
    for start in range(0, ROWS, 10_000):
        x[start : start + 10_000] = rng.normal(size=(10_000, FEATURES))
    x.flush()
    np.save(path / "y.npy", (np.asarray(x[:, 0]) > 0).astype(np.int64))
    return path


def _arrow(path):
    datasets = pytest.importorskip("datasets")
    if not (path / "arrow").exists():
        x, y = np.load(path / "x.npy", mmap_mode="r"), np.load(path / "y.npy")
        parts = [{"x": np.asarray(x[s : s + 10_000]), "labels": y[s : s + 10_000]} for s in range(0, ROWS, 10_000)]
        datasets.concatenate_datasets([datasets.Dataset.from_dict(p) for p in parts]).save_to_disk(path / "arrow")
    return datasets.load_from_disk(str(path / "arrow")).with_format("torch")  # memory-mapped Arrow


def _dict_loss(net, batch):
    return F.cross_entropy(net(batch["x"]), batch["labels"], reduction="none")


@pytest.mark.parametrize(("source", "cls"), [("numpy memmap", DPSGD), ("arrow", DPZero)])
def test_a_private_set_on_disk_trains_without_being_loaded(files, source, cls):
    private = MemoryMapped(files) if source == "numpy memmap" else _arrow(files)
    loss = "cross_entropy" if source == "numpy memmap" else _dict_loss
    model = cls(nn.Linear(FEATURES, 2), loss=loss, lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=2.0, accountant="rdp"))
    data = PrivatePublicDataModule(private, batch_size=1000)  # q = 0.01
    before = _anonymous_kb()
    make_trainer(max_steps=5).fit(model, data)
    grown_mb = (_anonymous_kb() - before) / 1024
    assert model.private_steps == 5 and model.sample_rate == pytest.approx(0.01)
    assert grown_mb < 20, f"{grown_mb:.0f} MB held after the fit: the 51 MB set was loaded"  # pre-flight read it all
