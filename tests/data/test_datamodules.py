"""Every data module takes the base's loader options by keyword and saves its plain arguments as hyperparameters."""

import pytest
from torch.utils.data import Dataset

from pl_dp.data import DigitsDataModule, SyntheticClassificationDataModule


@pytest.mark.parametrize(
    "make", [lambda **kw: DigitsDataModule(**kw), lambda **kw: SyntheticClassificationDataModule(n_samples=2_000, **kw)]
)
def test_loader_options_reach_every_loader(make):
    data = make(num_workers=0, pin_memory=True, seed=3)
    assert data.loader_kwargs == {"num_workers": 0, "pin_memory": True}
    assert data.val_dataloader().pin_memory and data.train_dataloader().pin_memory
    assert data.hparams["pin_memory"] is True and data.hparams["seed"] == 3
    assert data.hparams["sampling_seed"] is None  # a default the subclass never names is saved too
    assert not {"private", "splits"} & set(data.hparams)  # datasets never are
    assert not any(isinstance(value, Dataset) for value in data.hparams.values())


def test_bundled_modules_take_only_the_data_positionally():
    with pytest.raises(TypeError):
        DigitsDataModule(32)


def test_user_of_samples_users_and_is_never_a_hyperparameter():
    """``user_of`` (a list or a callable): q and the epoch count users, a batch larger than the users is refused with
    the reason, the ids never reach the hyperparameters, and with ``merge_public`` the ids cover both sets."""
    from pl_dp.data import PrivatePublicDataModule
    from pl_dp.errors import ConfigError
    from pl_dp.privacy import poisson_sampler_of
    from tests.conftest import blobs

    names = [f"person{i % 10}" for i in range(100)]
    for user_of in (names, lambda index: names[index]):
        data = PrivatePublicDataModule(blobs(100), batch_size=5, user_of=user_of, sampling_seed=0)
        assert data.privacy_unit.kind == "user" and data.privacy_unit.population == 10 and data.sample_rate == 0.5
        assert len(data.train_dataloader()) == 2  # an epoch: U // batch_size steps
        assert poisson_sampler_of(data.train_dataloader()).unit == data.privacy_unit
        assert "user_of" not in data.hparams and not any("person" in str(v) for v in data.hparams.values())
    with pytest.raises(ConfigError, match="larger than the private dataset \\(10 users\\): under user-level privacy"):
        PrivatePublicDataModule(blobs(100), batch_size=20, user_of=names)
    with pytest.raises(ConfigError, match="user of each of the 130 private examples"):
        PrivatePublicDataModule(blobs(100), public=blobs(30), merge_public=True, batch_size=5, user_of=names)
    merged = PrivatePublicDataModule(
        blobs(100), public=blobs(30), merge_public=True, batch_size=5, user_of=names + ["public"] * 30
    )
    assert merged.privacy_unit.population == 11
