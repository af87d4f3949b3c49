"""How often a private step waits for the device: a read of a device tensor's value on the host (``.item()``,
``float(t)``, ``int(t)``, ``bool(t)``: each calls ``aten::_local_scalar_dense``) or a copy of it to the host
(``.cpu()``) is a synchronization on a GPU. Counted here on CPU — by the dispatcher for the scalar reads, by
wrapping ``Tensor.cpu`` for the copies — over a whole ``training_step``, for nets of 1 and 6 hidden layers: the count
must not grow with the net (docs/performance.md gives it per method). ``.tolist()`` and ``.numpy()`` are not
counted: in the step path they read host tensors only (a generator's state, the public batch's indices, the
zeroth-order scalars after their one ``.cpu()``), which a CPU run cannot tell from device tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from tests import catalog
from tests.conftest import blobs, make_trainer

#: the most a step waits for the device, by catalog id
BOUNDS = {
    "dpzero": 1,  # the q queries' clipped sums, copied to the host at once, where their noise is drawn
    "pazo-m": 1,  # likewise (its public gradient stays on the device)
    "dpsgd": 1,  # book-keeping (the default): whether a norm is non-finite: the pass runs again without it
    "dpsgd-ghost": 1,  # likewise: the second pass runs again without it
    "dpsgd-hooks": 1,  # whether a per-example gradient is non-finite: a copy of them only when one is
    "coupling": 1,  # DP-SGD's, beside a public gradient that stays on the device
}


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counted(reads: _HostReads) -> Iterator[None]:
    """``reads`` counts the scalar reads, and ``.cpu()`` calls (no dispatch for a CPU tensor's) by wrapping it."""
    original = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        reads.count += 1
        return original(self, *args, **kwargs)

    torch.Tensor.cpu = cpu
    try:
        with reads:
            yield
    finally:
        torch.Tensor.cpu = original


def _net(hidden_layers: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(4, 16), nn.Tanh()]
    for _ in range(hidden_layers):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 3))


def _reads_per_step(entry: catalog.Entry, hidden_layers: int) -> list[int]:
    model = entry.build(_net(hidden_layers), privacy=PrivacySpec(epsilon=2.0, delta=1e-5))
    counts: list[int] = []
    step = model.training_step

    def counted_step(*args, **kwargs):
        reads = _HostReads()
        with _counted(reads):
            out = step(*args, **kwargs)
        counts.append(reads.count)
        return out

    model.training_step = counted_step
    public = blobs(50, seed=3) if entry.public_data else None
    make_trainer(max_steps=5, log_every_n_steps=50).fit(
        model, PrivatePublicDataModule(blobs(200), batch_size=32, public=public)
    )
    return counts[1:-1]  # the first step checks the reference example and fills caches, the last one logs


@pytest.mark.slow  # 10 fits, 30 s: run by `make test-slow` (and CI)
@pytest.mark.parametrize("entry", catalog.by_id(*BOUNDS), ids=list(BOUNDS))
def test_a_private_step_waits_for_the_device_a_bounded_number_of_times_whatever_the_net(entry):
    small, deep = _reads_per_step(entry, 1), _reads_per_step(entry, 6)
    assert small == deep, "the count grows with the number of layers"
    assert max(deep) <= BOUNDS[entry.id], f"{entry.id}: {deep} host reads per step"
