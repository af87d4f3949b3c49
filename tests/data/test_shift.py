"""pl_dp.data.shift: the bundled datasets' public splits at three class-imbalance levels."""

import numpy as np
import pytest
import torch

from pl_dp.data import DigitsDataModule, digits_splits, vader_splits
from pl_dp.data.shift import PUBLIC_SHIFTS, public_shift_weights
from pl_dp.errors import ConfigError


def test_weights_fall_linearly_by_the_shift_ratio():
    labels = np.arange(10)
    strong = public_shift_weights(labels, 10, "strong")
    assert np.allclose(strong, 1.5 - labels / 9.0)  # the bundled public split before the levels existed
    for shift, ratio in PUBLIC_SHIFTS.items():
        w = public_shift_weights(labels, 10, shift)
        assert w[0] / w[-1] == pytest.approx(ratio) and np.all(np.diff(w) <= 0)
        last = public_shift_weights(np.array([0, 1]), 2, shift, favoured="last")
        assert last[1] / last[0] == pytest.approx(ratio)
    with pytest.raises(ConfigError, match="public_shift"):
        public_shift_weights(labels, 10, "huge")


def test_stronger_shift_more_imbalanced_public_split_same_evaluation_splits():
    shares = {}
    for shift in PUBLIC_SHIFTS:
        private, public, val, test = digits_splits(public_fraction=0.3, public_shift=shift)
        counts = torch.bincount(public.tensors[1], minlength=10).double()
        shares[shift] = float(counts[:5].sum() / counts.sum())  # share of the favoured half (classes 0–4)
        assert len(private) + len(public) == 1258 and len(val) == 180 and len(test) == 359
        assert torch.equal(val.tensors[0], digits_splits()[2].tensors[0])  # validation and test never move
    assert shares["none"] < shares["mild"] < shares["strong"]
    positives = {s: float(vader_splits(0.3, s)["public"][1].float().mean()) for s in PUBLIC_SHIFTS}
    assert positives["none"] < positives["mild"] < positives["strong"]


def test_datamodule_takes_the_shift():
    default, none = DigitsDataModule(), DigitsDataModule(public_shift="none")
    assert torch.equal(default.public.tensors[1], digits_splits()[1].tensors[1])
    assert not torch.equal(default.public.tensors[1], none.public.tensors[1])
    assert none.hparams.public_shift == "none"
