"""Shared fixtures: tiny real datasets, a quiet Trainer factory, and modules that break per-example independence."""

from __future__ import annotations

import os
import tempfile
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp.audit import quiet_trainer

os.environ.setdefault("WANDB_MODE", "offline")
#: the name of this pytest-xdist worker (``make test`` runs the suite in one worker a core), or ``None`` in a plain run
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if XDIST_WORKER else 2)  # a worker a core: one thread each
warnings.filterwarnings("ignore", message=".*Optimal order is the largest alpha.*")
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")


_ROOT_DIR = tempfile.mkdtemp(prefix="pl_dp_tests_")  # Lightning's and pl_dp's default files, out of the repo

#: the device the suite's trainers (and the tests that take the ``device`` fixture) run on: ``cpu``, or what
#: ``PL_DP_TEST_DEVICE`` names (``make test-gpu``: ``cuda``). The one place that knows it.
DEVICE = torch.device(os.environ.get("PL_DP_TEST_DEVICE", "cpu"))
_NO_DEVICE = DEVICE.type == "cuda" and not torch.cuda.is_available()


def make_trainer(**kwargs) -> L.Trainer:
    """The audits' quiet one-process Trainer on :data:`DEVICE`, writing its default files out of the repo."""
    return quiet_trainer(**{"default_root_dir": _ROOT_DIR, "accelerator": DEVICE.type, **kwargs})


@pytest.fixture
def device() -> torch.device:
    """:data:`DEVICE`, for a test that builds its tensors and nets itself."""
    return DEVICE


def blobs(n: int = 200, dim: int = 4, classes: int = 3, seed: int = 0) -> TensorDataset:
    """Linearly separable Gaussian blobs: a small real classification task."""
    centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(1234)) * 3
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, dim, generator=g)
    return TensorDataset(x, y)


class SubtractBatchMean(nn.Module):
    """No parameters, in no known list: subtracts ``strength`` times the batch mean (BatchNorm-like mixing)."""

    def __init__(self, strength: float = 1.0) -> None:
        super().__init__()
        self.strength = strength

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.strength * x.mean(dim=0, keepdim=True)


class RunningInputMean(nn.Module):
    """Records the batch mean of its input in forward: in place, by reassignment, or into a frozen parameter."""

    def __init__(self, width: int, how: str) -> None:
        super().__init__()
        self.how = how
        if how == "frozen parameter":
            self.seen = nn.Parameter(torch.zeros(width), requires_grad=False)
        else:
            self.register_buffer("seen", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.how == "reassign":
                self.seen = 0.9 * self.seen + 0.1 * x.mean(dim=0)
            else:
                self.seen.mul_(0.9).add_(x.mean(dim=0), alpha=0.1)
        return x


@pytest.fixture
def trainer_factory():
    return make_trainer


def pytest_collection_modifyitems(session, config, items):
    """The modules whose tests wait for a run started in the background (tests/background.py) run after the others,
    each in one piece and in their order: the runs have the whole session to end in. Under pytest-xdist, which runs
    those runs in the test that needs them, they go first instead: the longest modules, handed out while the other
    workers still have the short ones to balance them."""
    from tests import background

    if _NO_DEVICE:
        skip = pytest.mark.skip(reason=f"PL_DP_TEST_DEVICE={DEVICE.type}: no CUDA device on this machine")
        for item in items:
            item.add_marker(skip)
        return
    waiting = {item.module for item in items if any(job.wanted(item) for job in background.JOBS)}
    items.sort(key=lambda item: (getattr(item, "module", None) in waiting) != bool(XDIST_WORKER))  # stable sort


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _NO_DEVICE:
        terminalreporter.write_line(f"PL_DP_TEST_DEVICE={DEVICE.type}: no CUDA device here, every test skipped")


@pytest.fixture(scope="session", autouse=True)
def background_runs(request, tmp_path_factory):
    """Start the subprocess runs of the selected tests in the background (tests/background.py); end any still
    running when the session ends."""
    from tests import background

    # in workers, whose other worker keeps the second core busy, each run starts when its test asks for it
    started = [] if _NO_DEVICE or XDIST_WORKER else background.start(request.session.items, tmp_path_factory)
    yield
    for job in started:
        job.cancel()
