"""pl_dp's error family: its shape, and the exact class of representative refusals across the layers."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError, DataError, IndependenceError, PlDpError, PrivacyConfigError
from pl_dp.methods import DPSGD, DPZero
from pl_dp.privacy import ClipFunction, create_accountant
from pl_dp.step.losses import cross_entropy, kind_of
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


# ---- refusals a user can read (issue [record], item 1): raised at fit start, named by type, never by value ----------


class ReturnsLogitsAndHidden(nn.Module):
    """A net written for plain PyTorch training: ``return logits, hidden``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.relu(self.hidden(x))
        return self.head(hidden), hidden


#: label names of the private set below: no refusal may quote one
LABEL_NAMES = ("label-kestrel", "label-osprey", "label-plover")


class NamedLabels(Dataset):
    """A user's own dataset: features, and the class as its name (a ``str``)."""

    def __init__(self, n: int = 40) -> None:
        self.data = blobs(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        x, y = self.data[i]
        return x, LABEL_NAMES[int(y)]


class BagOfWords(nn.Module):
    """A bag-of-words classifier over ``[batch, words]`` indices through ``nn.EmbeddingBag``."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(words))


def bags(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 10, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g))


def _fit(model, dataset, steps: int = 1):
    make_trainer(max_steps=steps).fit(model, datamodule=PrivatePublicDataModule(dataset, batch_size=8))


@pytest.mark.parametrize("method", [DPSGD, DPZero])
def test_a_net_that_returns_a_tuple_is_refused_at_fit_start_naming_what_it_returned(method):
    model = method(ReturnsLogitsAndHidden(), lr=0.1, clip=1.0, privacy=SPEC)
    with pytest.raises(ConfigError, match=r"the net returned a tuple of 2 \(Tensor, Tensor\), not a tensor of logits"):
        _fit(model, blobs(40))
    assert model.private_steps == 0


def test_the_tuple_refusal_says_return_the_logits_or_pass_a_loss():
    with pytest.raises(
        ConfigError, match=r"shape \(batch, classes\).*`return logits`.*pass loss= a callable"
    ) as raised:
        cross_entropy(ReturnsLogitsAndHidden(), tuple(blobs(4)[:]))
    assert type(raised.value) is ConfigError


@pytest.mark.parametrize("preflight", [True, False], ids=["preflight", "probe"])
def test_string_labels_are_refused_at_fit_start_with_how_to_map_them_and_no_label_value(preflight):
    model = DPSGD(nn.Linear(4, 3), lr=0.1, clip=1.0, privacy=SPEC, preflight=preflight)
    with pytest.raises(DataError, match=r"labels of the batch are a tuple of str.*integer class index") as raised:
        _fit(model, NamedLabels())
    message = str(raised.value) + "".join(getattr(raised.value, "__notes__", ()))
    assert "index[label]" in message and not any(name in message for name in LABEL_NAMES)
    assert model.private_steps == 0


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_embedding_bag_is_refused_by_the_opacus_modes_before_any_pass_with_a_pointer_to_functorch(mode):
    model = DPSGD(BagOfWords(), lr=0.1, clip=1.0, privacy=SPEC, per_sample=mode)
    with pytest.raises(
        ConfigError, match=rf"(?s)per_sample='{mode}'.*'bag' \(EmbeddingBag\).*use per_sample='functorch'"
    ):
        _fit(model, bags())
    assert model.private_steps == 0


def test_embedding_bag_trains_under_functorch():
    model = DPSGD(BagOfWords(), lr=0.1, clip=1.0, privacy=SPEC, per_sample="functorch")
    _fit(model, bags(), steps=2)
    assert model.private_steps == 2


def test_what_a_refusal_names_is_a_type_never_a_value():
    secret = torch.tensor([[123.25, 456.5]])
    assert kind_of((secret, secret)) == "a tuple of 2 (Tensor, Tensor)"
    assert kind_of(("label-kestrel", "label-osprey")) == "a tuple of str"  # no value, not even how many
    assert kind_of({"logits": secret, "hidden": secret}) == "a dict with keys ['hidden', 'logits']"
    assert kind_of(None) == "None" and kind_of(3.5) == "a float"
