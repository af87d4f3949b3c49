"""pl_dp's error family: its shape, and the exact class of representative refusals across the layers."""

import pytest
from torch import nn
from torch.utils.data import DataLoader

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError, DataError, IndependenceError, PlDpError, PrivacyConfigError
from pl_dp.methods import DPSGD, DPZero
from pl_dp.privacy import ClipFunction, create_accountant
from tests.conftest import blobs, make_trainer

SPEC = PrivacySpec(epsilon=1.0, accountant="rdp")


@pytest.mark.parametrize("cls", [ConfigError, PrivacyConfigError, DataError, IndependenceError])
def test_every_refusal_is_a_value_error_and_a_pl_dp_error(cls):
    assert issubclass(cls, PlDpError) and issubclass(cls, ValueError)
    assert issubclass(PlDpError, ValueError)


def test_a_privacy_refusal_is_a_config_refusal_and_the_others_are_not():
    assert issubclass(PrivacyConfigError, ConfigError)
    for other in (DataError, IndependenceError):
        assert not issubclass(other, ConfigError) and not issubclass(ConfigError, other)


@pytest.mark.parametrize(
    ("refuse", "cls", "match"),
    [
        (lambda: PrivacySpec(epsilon=-1), PrivacyConfigError, "epsilon"),
        (lambda: PrivacySpec(epsilon=1.0, accountant="nope"), PrivacyConfigError, "accountant"),
        (lambda: create_accountant("nope"), PrivacyConfigError, "unknown accountant"),
        (lambda: DPZero(nn.Linear(2, 2), lr=0.0, clip=1.0, privacy=SPEC), ConfigError, "lr"),
        (lambda: DPSGD(nn.Linear(2, 2), per_sample="vmap", privacy=SPEC), ConfigError, "per_sample"),
        (lambda: ClipFunction("median"), ConfigError, "clip_fn"),
        (lambda: PrivatePublicDataModule(blobs(10), batch_size=11), ConfigError, "batch_size"),
    ],
    ids=["epsilon", "accountant-name", "create-accountant", "dpzero-lr", "per-sample-mode", "clip-fn", "batch-size"],
)
def test_refusals_raise_their_exact_class(refuse, cls, match):
    with pytest.raises(cls, match=match) as raised:
        refuse()
    assert type(raised.value) is cls


def test_a_fixed_size_shuffled_loader_is_refused_at_fit_start_as_a_privacy_refusal():
    model = DPZero(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC)
    with pytest.raises(PrivacyConfigError, match="Poisson") as raised:
        make_trainer(max_steps=1).fit(model, train_dataloaders=DataLoader(blobs(40), batch_size=8, shuffle=True))
    assert type(raised.value) is PrivacyConfigError
    assert model.private_steps == 0
