"""The per-sample modes' registry: DPSGD and Coupling find their mode there, a new mode is one registration, a name
is taken once, an unknown one is refused with the known ones."""

import pytest
import torch
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError
from pl_dp.methods import DPSGD
from pl_dp.per_sample import (
    PerSampleGradients,
    PerSampleMode,
    get_per_sample_mode,
    modes,
    per_sample_mode_names,
    register_per_sample_mode,
)
from tests import catalog
from tests.conftest import blobs, make_trainer


def test_the_shipped_modes_and_what_they_declare():
    assert per_sample_mode_names() == ["hooks", "functorch", "ghost", "bk"]
    assert [get_per_sample_mode(name).autocast for name in per_sample_mode_names()] == [True, True, False, False]
    assert [get_per_sample_mode(name).shards for name in per_sample_mode_names()] == [False, False, True, True]


def test_an_unknown_mode_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match="got 'vmap'. Known: 'hooks'"):
        DPSGD(nn.Linear(4, 3), per_sample="vmap")


def test_a_name_is_taken_once():
    with pytest.raises(ConfigError, match="'hooks' is registered already"):
        register_per_sample_mode(PerSampleMode("hooks", get_per_sample_mode("hooks").build, True, False, "again"))


@pytest.fixture
def mirror():
    """A mode registered by a test: per-example gradients by ``torch.func`` under another name, removed after."""
    mode = register_per_sample_mode(
        PerSampleMode(
            "mirror",
            lambda net, loss_fn, _: PerSampleGradients(net, loss_fn, "functorch"),
            autocast=True,
            shards=False,
            summary="functorch under another name",
        )
    )
    yield mode
    del modes._MODES["mirror"]


def _fit(method, per_sample):
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    model = method(net, lr=0.5, per_sample=per_sample, privacy=PrivacySpec(epsilon=5.0, accountant="rdp"), noise_seed=3)
    data = PrivatePublicDataModule(
        blobs(40), public=blobs(16, seed=5), batch_size=10, public_batch_size=8, seed=2, sampling_seed=2
    )
    make_trainer(max_steps=2).fit(model, data)
    return [p.detach().clone() for p in net.parameters()], model


@pytest.mark.parametrize("method", catalog.classes(first_order=True))  # the methods that take per_sample
def test_a_registered_mode_is_what_the_method_runs(mirror, method):
    """The registry is the only place a method learns its mode from: one registration, and the fits of DPSGD and
    Coupling with it end where those with the mode it mirrors end."""
    mirrored, model = _fit(method, "mirror")
    assert type(model._per_sample) is PerSampleGradients and model._per_sample.mode == "functorch"
    expected, _ = _fit(method, "functorch")
    for a, b in zip(mirrored, expected):
        assert torch.equal(a, b)
