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
