"""OwnUpdateModule: what the methods that write their update themselves share, stated once (issue [house] 30)."""

import pytest
import torch
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError
from pl_dp.methods import O2NC, PAZOS, FirstOrderModule, OwnUpdateModule, PrivateModule
from tests import catalog
from tests.conftest import blobs, make_trainer

METHODS = catalog.classes()


def test_the_methods_that_write_their_own_update_are_one_family():
    family = {m.__name__ for m in METHODS if issubclass(m, OwnUpdateModule)}
    assert family == {"DPZero", "PAZOM", "PAZOP", "PAZOS", "O2NC"}
    assert all(issubclass(m, FirstOrderModule) for m in METHODS if not issubclass(m, OwnUpdateModule))
    for method in METHODS:  # declared by the family (O2NC opts out of the proximal term), never re-declared
        assert not {"secure_rng_default", "private_loss_modes"} & set(vars(method)), method.__name__
    assert [m.__name__ for m in METHODS if "applies_proximal_term" in vars(m)] == ["O2NC"]


def test_privatemodule_keeps_only_what_every_method_shares():
    for name in ("proximal_anchor", "proximal_terms", "private_losses", "applies_proximal_term"):
        assert not hasattr(PrivateModule, name), name
    model = FirstOrderModule(nn.Linear(2, 2))
    assert not hasattr(model, "masters") and not hasattr(model, "proximal")
    assert not model.noise.secure and model.private_loss_modes == ("train",)


@pytest.mark.parametrize("method", catalog.classes(own_update=True))
def test_each_member_gets_the_family_defaults(method):
    model = method(nn.Linear(2, 2), master_weights=False)
    assert model.noise.secure and model.private_loss_modes == ("eval",)
    assert model.masters.enabled is False and model.hparams["master_weights"] is False
    assert model.proximal is None and model.proximal_anchor is None and model.proximal_terms() == []
    assert method(nn.Linear(2, 2)).masters.enabled


class _Adam:
    def configure_optimizers(self):
        return torch.optim.Adam(self.trainable_parameters(), lr=0.01)


class _AdamPAZOS(_Adam, PAZOS):
    pass


class _AdamO2NC(_Adam, O2NC):
    pass


@pytest.mark.parametrize("method", [_AdamPAZOS, _AdamO2NC])
def test_every_member_refuses_an_optimizer_other_than_plain_sgd(method):
    """Tested for DPZero in test_lightning_conventions; PAZO-S and O2NC get the refusal from the family too."""
    model = method(nn.Linear(4, 3), clip=1.0, privacy=PrivacySpec(epsilon=50.0))
    data = PrivatePublicDataModule(blobs(60), public=blobs(20, seed=5), batch_size=10, public_batch_size=5)
    with pytest.raises(ConfigError, match="accepts only torch.optim.SGD"):
        make_trainer(max_steps=2).fit(model, data)
