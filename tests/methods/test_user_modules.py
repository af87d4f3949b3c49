"""Modules nobody here wrote, used as a practitioner would: the Lightning docs' LitAutoEncoder (no ``forward``),
Lightning's own demo ``LightningTransformer`` (``forward(inputs, target)``, ``nn.MultiheadAttention``), a bf16 net
whose loss casts its inputs, and a LightningModule's own ``configure_optimizers``."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError
from pl_dp.methods import DPSGD, DPZero
from tests import catalog
from tests.conftest import blobs, make_trainer

SPEC = PrivacySpec(epsilon=5.0, accountant="rdp")


class LitAutoEncoder(L.LightningModule):
    """The Lightning docs' first example ("Lightning in 15 minutes"), on 16 features: no ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 16))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return F.mse_loss(self.decoder(self.encoder(x)), x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def reconstruction(net: LitAutoEncoder, batch) -> torch.Tensor:
    x, _ = batch
    return (net.decoder(net.encoder(x)) - x).square().mean(dim=1)


def _features() -> PrivatePublicDataModule:
    def data(seed):
        x, y = blobs(80, dim=16, seed=seed).tensors
        return TensorDataset(x, y)

    return PrivatePublicDataModule(data(0), val=data(1), test=data(2), batch_size=16)


@pytest.mark.parametrize("cls", catalog.classes(catalog.REPRESENTATIVES))
def test_a_module_without_forward_is_evaluated_through_the_user_s_loss(cls):
    """On main: trained, then crashed in validation ("missing the required forward function")."""
    model = cls(LitAutoEncoder(), loss=reconstruction, clip=1.0, lr=0.01, privacy=SPEC)
    trainer = make_trainer(max_epochs=1, limit_train_batches=3, num_sanity_val_steps=1)
    trainer.fit(model, _features())
    assert "val/loss" in trainer.callback_metrics and "val/acc" not in trainer.callback_metrics
    assert "test/loss" in trainer.test(model, _features(), verbose=False)[0]


def _tokens(seed: int, n: int = 24, length: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 50, (n, length + 1), generator=g)
    return TensorDataset(sequences[:, :-1], sequences[:, 1:])


def next_token(net: LightningTransformer, batch) -> torch.Tensor:
    """Mean next-token negative log-likelihood per sequence (the demo's forward returns log-probabilities)."""
    inputs, target = batch
    log_probs = net(inputs, target)  # [B·T, V]
    return F.nll_loss(log_probs, target.reshape(-1), reduction="none").view(len(inputs), -1).mean(dim=1)


def _transformer() -> LightningTransformer:
    torch.manual_seed(0)
    net = LightningTransformer(vocab_size=50)
    net.model.transformer.dropout = 0.0
    return net


def test_lightning_s_demo_transformer_trains_and_validates_with_dpzero():
    """On main: crashed in the sanity check (``forward(inputs, target)`` called with the inputs alone)."""
    model = DPZero(_transformer(), loss=next_token, clip=1.0, lr=1e-3, privacy=SPEC)
    data = PrivatePublicDataModule(_tokens(0), val=_tokens(1), batch_size=6)
    trainer = make_trainer(max_epochs=1, limit_train_batches=2, num_sanity_val_steps=1)
    trainer.fit(model, data)
    assert model.private_steps == 2 and "val/loss" in trainer.callback_metrics


@pytest.mark.parametrize("per_sample", ["hooks", "ghost", "bk"])
def test_per_example_gradient_hooks_refuse_multihead_attention_at_fit_start_naming_what_works(per_sample):
    """On main: Opacus failed mid-step (TypeError: missing 'key' and 'value'). Every mode built on Opacus' hooks
    refuses it in the same words, the default (book-keeping) too."""
    model = DPSGD(_transformer(), loss=next_token, clip=1.0, privacy=SPEC, per_sample=per_sample)
    data = PrivatePublicDataModule(_tokens(0), val=_tokens(1), batch_size=6)
    with pytest.raises(ConfigError, match=rf"(?s)per_sample='{per_sample}'.*MultiheadAttention.*'functorch'.*DPZero"):
        make_trainer(max_steps=1).fit(model, data)
    assert model.private_steps == 0
    model = DPSGD(_transformer(), loss=next_token, clip=1.0, privacy=SPEC, per_sample="functorch")  # what works
    make_trainer(max_steps=1).fit(model, data)
    assert model.private_steps == 1


def test_a_bf16_net_whose_loss_casts_its_inputs_validates():
    """On main: validation called the bf16 net on fp32 inputs itself (a dtype error)."""

    def casting(net, batch):
        x, y = batch
        return F.cross_entropy(net(x.to(torch.bfloat16)).float(), y, reduction="none")

    model = DPZero(nn.Linear(16, 3).to(torch.bfloat16), loss=casting, clip=1.0, lr=0.01, privacy=SPEC)
    trainer = make_trainer(max_epochs=1, limit_train_batches=2, num_sanity_val_steps=1)
    trainer.fit(model, _features())
    assert "val/loss" in trainer.callback_metrics


def test_first_order_methods_use_the_net_s_own_configure_optimizers():
    """On main: DPSGD(LitAutoEncoder()) trained with SGD at lr 0.1, silently ignoring the module's Adam."""
    model = DPSGD(LitAutoEncoder(), loss=reconstruction, clip=1.0, privacy=SPEC)
    trainer = make_trainer(max_steps=2)
    trainer.fit(model, _features())
    assert isinstance(trainer.optimizers[0], torch.optim.Adam) and model.lr == 1e-3
    with pytest.raises(ConfigError, match="both the net's configure_optimizers and DPSGD"):
        make_trainer(max_steps=1).fit(DPSGD(LitAutoEncoder(), loss=reconstruction, optimizer="adamw"), _features())


class OwnAdam(L.LightningModule):
    """A user's net with its own optimizer and schedule, and hyperparameters of its own."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 3))

    def forward(self, x):
        return self.layer(x)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)}


def test_the_hyperparameters_record_the_net_s_own_optimizer(tmp_path):
    """On main: trained with the net's Adam at lr 1e-2, the hparams (loggers, checkpoints) said sgd at lr 0.1."""
    logger = CSVLogger(tmp_path)
    model = DPSGD(OwnAdam(), clip=1.0, privacy=SPEC)
    trainer = make_trainer(max_steps=2, logger=logger)
    trainer.fit(model, _features())
    assert isinstance(trainer.optimizers[0], torch.optim.Adam)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    saved = torch.load(tmp_path / "run.ckpt", weights_only=False)["hyper_parameters"]
    assert (saved["optimizer"], saved["lr"]) == ("net", 1e-2)
    logged = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())
    assert (logged["optimizer"], logged["lr"]) == ("net", 1e-2)
    assert logged["net_optimizer"]["class"] == "Adam" and logged["net_optimizer"]["lr"] == 1e-2
    assert logged["net_lr_schedulers"] == ["StepLR"] and logged["net_hparams"] == {"width": 8}
    loaded = DPSGD.load_from_checkpoint(tmp_path / "run.ckpt", net=OwnAdam())  # the record builds the method again
    assert loaded.optimizer_name == "net" and loaded.private_steps == 2
    # a net without its own optimizer keeps the method's, as recorded
    plain = DPSGD(nn.Linear(16, 3), clip=1.0, optimizer="adam", lr=0.05, privacy=SPEC)
    make_trainer(max_steps=1).fit(plain, _features())
    assert (plain.hparams["optimizer"], plain.hparams["lr"]) == ("adam", 0.05) and "net_optimizer" not in plain.hparams
    with pytest.raises(ConfigError, match="optimizer='net' uses the net's own configure_optimizers"):
        make_trainer(max_steps=1).fit(DPSGD(nn.Linear(16, 3), clip=1.0, optimizer="net"), _features())


def test_methods_that_write_their_own_update_say_the_net_s_optimizer_is_not_used():
    model = DPZero(LitAutoEncoder(), loss=reconstruction, clip=1.0, lr=0.02, privacy=SPEC)
    with pytest.warns(UserWarning, match=r"configure_optimizers is not used.*lr=0.02"):
        make_trainer(max_steps=1).fit(model, _features())


def test_a_built_in_loss_on_a_batch_without_targets_says_to_pass_a_callable():
    data = PrivatePublicDataModule(TensorDataset(torch.randn(40, 16)), batch_size=8)  # inputs only
    with pytest.raises(TypeError, match=r"pass loss= a callable \(net, batch\) -> Tensor\[B\]"):
        make_trainer(max_steps=1).fit(DPSGD(nn.Linear(16, 3), clip=1.0, privacy=SPEC), data)


class _NoisyEvaluation(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 3)

    def forward(self, x):
        return self.layer(x)

    def validation_step(self, batch, batch_idx):
        warnings.warn("a note from the user's validation", UserWarning, stacklevel=1)


def test_each_distinct_warning_is_shown_once_however_often_epsilon_is_evaluated():
    """Each evaluation of epsilon wrapped Opacus' conversion in warnings.catch_warnings(), which resets every
    once-registry: a warning shown once per run came back after every logged step (27 times in a 5-epoch fit)."""
    model = DPSGD(_NoisyEvaluation(), clip=1.0, privacy=PrivacySpec(epsilon=5.0))  # PRV: evaluations converted by RDP
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        make_trainer(max_epochs=3, log_every_n_steps=1).fit(model, _features())
    assert sum("a note from the user's validation" in str(w.message) for w in caught) == 1
