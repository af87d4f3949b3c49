"""SyntheticClassificationDataModule: fixed splits, dtypes, no public split by default, a short O2NC fit."""

import torch

from pl_dp import PrivacySpec
from pl_dp.data import SyntheticClassificationDataModule, synthetic_splits
from pl_dp.methods import O2NC
from pl_dp.nets import MLP
from tests.conftest import make_trainer

N = 4_000  # small: the default 500,000 rows take seconds to generate


def _data(**kwargs) -> SyntheticClassificationDataModule:
    return SyntheticClassificationDataModule(n_samples=N, batch_size=32, **kwargs)


def test_split_sizes_and_no_public_split_by_default():
    data = _data()
    sizes = {name: len(getattr(data, name)) for name in ("private", "val", "test")}
    assert sizes == {"private": 3_200, "val": 400, "test": 400}  # 10 % validation, 10 % test, the rest private
    assert data.public is None
    public = _data(public_fraction=0.1)
    assert (len(public.private), len(public.public), len(public.val)) == (2_880, 320, 400)
    assert public.public_batch_size == 64


def test_splits_are_fixed_and_independent_of_the_training_seed():
    a, b = _data(seed=0), _data(seed=7, sampling_seed=3)
    for name in ("private", "val", "test"):
        for left, right in zip(getattr(a, name).tensors, getattr(b, name).tensors):
            assert torch.equal(left, right), name
    private, _, val, test = synthetic_splits(n_samples=N)
    rows = {tuple(r.tolist()) for r in torch.cat([private.tensors[0], val.tensors[0], test.tensors[0]])}
    assert len(rows) == N  # disjoint splits covering every row


def test_features_are_standardized_float32_and_labels_binary():
    data = _data(n_features=6, n_informative=3)
    x, y = data.private.tensors
    assert x.dtype == torch.float32 and x.shape == (3_200, 6)
    assert y.dtype == torch.long and set(y.unique().tolist()) == {0, 1}
    vx = data.val.tensors[0]  # standardized with the validation split's statistics
    assert torch.allclose(vx.mean(0), torch.zeros(6), atol=1e-5)
    assert torch.allclose(vx.std(0, unbiased=False), torch.ones(6), atol=1e-4)
    assert data.hparams.n_features == 6 and data.hparams.seed == 0


def test_a_short_o2nc_fit_learns_and_spends_at_most_its_budget():
    torch.manual_seed(0)
    model = O2NC(
        MLP(10, hidden=[], num_classes=2),
        smoothing=1.0,
        inner_steps=8,
        batch_size=16,
        directions_per_sample=4,
        output="last_average",
        privacy=PrivacySpec(epsilon=8.0, accountant="tree"),
        noise_seed=0,
    )
    data = _data()
    trainer = make_trainer(max_epochs=1)
    trainer.fit(model, data)
    assert 0 < model.epsilon <= 8.0 + 1e-6
    (metrics,) = trainer.test(model, datamodule=data, verbose=False)
    assert metrics["test/acc"] > 0.7  # logistic regression reaches about 0.89 at full size
