"""Constructors: the net positional, everything else by keyword, each class stating only what it adds."""

import pytest
from torch import nn

from pl_dp.methods import PAZOM, PAZOP, Coupling, DPZero
from tests import catalog

#: every method pl_dp exports (tests/test_catalog.py checks that the catalog holds each)
METHODS = catalog.classes()


@pytest.mark.parametrize("method", METHODS)
def test_only_the_net_is_positional(method):
    with pytest.raises(TypeError):
        method(nn.Linear(2, 2), "mse")
    model = method(nn.Linear(2, 2), loss="mse", lr=0.25, preflight=False)
    assert model.loss_fn is not None and model.lr == 0.25 and not model.preflight


@pytest.mark.parametrize("method", METHODS)
def test_hyperparameters_hold_every_argument_of_the_chain_with_its_default(method):
    """Arguments forwarded through ``**kwargs`` are saved with the values the base received (defaults included)."""
    hparams = method(nn.Linear(2, 2)).hparams
    assert {"loss", "lr", "privacy", "noise_seed", "secure_rng", "max_physical_batch_size", "preflight"} <= set(hparams)
    assert "net" not in hparams and "kwargs" not in hparams


def test_a_subclass_default_reaches_the_base():
    assert Coupling(nn.Linear(2, 2)).clip_function.kind == "automatic"  # FirstOrderModule's default is constant
    assert PAZOP(nn.Linear(2, 2)).hparams["lr"] == 0.5 and PAZOP(nn.Linear(2, 2)).lr == 0.5
    assert PAZOM(nn.Linear(2, 2)).smoothing == 1e-2 and DPZero(nn.Linear(2, 2)).smoothing == 1e-3


def test_pazop_takes_no_radius():
    """PAZO-P's directions live in the k-dimensional span of public gradients: a radius is refused, not ignored."""
    with pytest.raises(TypeError):
        PAZOP(nn.Linear(2, 2), radius=3.0)
