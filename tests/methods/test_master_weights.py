"""Zeroth-order methods on a bf16 model: fp32 masters train it, its weights are their rounding, and the
masters survive engine rebuilds, dtype changes and checkpoints."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.callbacks import StagewiseSchedule
from pl_dp.data import DigitsDataModule, digits_splits
from pl_dp.methods import O2NC, PAZOM, PAZOP, PAZOS, DPZero
from pl_dp.methods.own_update import MASTER_WEIGHTS_KEY
from tests.conftest import make_trainer
from tests.methods.test_checkpoint import Crash


class MLP(nn.Module):
    """64 → 32 → 10 on the digits; casts its fp32 inputs to its own dtype."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        L.seed_everything(0)
        self.hidden, self.out = nn.Linear(64, 32), nn.Linear(32, 10)
        self.to(dtype)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x.to(self.hidden.weight.dtype))))


def _private_loss(net):
    x, y = digits_splits()[0].tensors
    with torch.no_grad():
        return F.cross_entropy(net(x).float(), y).item()


def _assert_weights_are_the_rounding_of_the_masters(model):
    for p, m in zip(model.trainable_parameters(), model.master_parameters()):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.isfinite(m).all() and torch.equal(p.detach(), m.to(torch.bfloat16))


def test_dpzero_trains_a_bf16_mlp_on_digits():
    net = MLP()
    before = _private_loss(net)
    model = DPZero(net, lr=2e-2, clip=1.0, smoothing=1e-3, privacy=PrivacySpec(8.0, accountant="rdp"), noise_seed=1)
    make_trainer(max_steps=40, limit_val_batches=0).fit(model, DigitsDataModule(sampling_seed=3))
    assert _private_loss(net) < before - 0.01  # progress, seeded secrets: no flakiness
    _assert_weights_are_the_rounding_of_the_masters(model)
    # the masters carry what bf16 cannot hold
    assert any(not torch.equal(m, p.detach().float()) for p, m in zip(net.parameters(), model.master_parameters()))
    assert model.masters.nbytes == 4 * sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize(
    "make",
    [
        lambda net: PAZOM(net, lr=1e-2, privacy=PrivacySpec(8.0, accountant="rdp"), noise_seed=1),
        lambda net: PAZOP(net, lr=0.1, k=2, privacy=PrivacySpec(8.0, accountant="rdp"), noise_seed=1),
        lambda net: PAZOS(net, lr=0.05, k=2, privacy=PrivacySpec(8.0, accountant="rdp"), noise_seed=1),
        lambda net: O2NC(net, inner_steps=4, privacy=PrivacySpec(8.0), noise_seed=1),
    ],
    ids=["pazo-m", "pazo-p", "pazo-s", "o2nc"],
)
def test_every_zeroth_order_method_trains_bf16_through_fp32_masters(make):
    model = make(MLP())
    make_trainer(max_steps=8, limit_val_batches=0).fit(model, DigitsDataModule(sampling_seed=3))
    _assert_weights_are_the_rounding_of_the_masters(model)


def test_dp_zopo_rebuilds_its_engine_for_each_mask_and_keeps_the_masters():
    """Stagewise + pruning: a new mask per stage rebuilds the engine; the masters carry over, only the mask moves."""
    from pl_dp.callbacks import PruningSchedule

    model = DPZero(MLP(), lr=2e-2, clip=1.0, privacy=PrivacySpec(8.0, accountant="rdp"), noise_seed=1)
    before = [p.detach().clone() for p in model.trainable_parameters()]
    callbacks = [StagewiseSchedule(stages=2), PruningSchedule([0.2, 0.4], strategy="incremental", score="autograd")]
    make_trainer(max_steps=8, limit_val_batches=0, callbacks=callbacks).fit(model, DigitsDataModule(sampling_seed=3))
    _assert_weights_are_the_rounding_of_the_masters(model)
    mask = model.direction_mask
    for p, b, idx in zip(model.trainable_parameters(), before, mask.indices):
        if idx is not None:  # coordinates never trained are untouched
            kept = torch.zeros(p.numel(), dtype=torch.bool)
            kept[idx] = True
            assert torch.equal(p.detach().view(-1)[~kept], b.view(-1)[~kept])


def test_master_weights_false_writes_bf16_in_place():
    model = DPZero(MLP(), lr=2e-2, clip=1.0, master_weights=False, privacy=None)
    make_trainer(max_steps=3, limit_val_batches=0).fit(model, DigitsDataModule())
    assert model.masters.nbytes == 0 and model.hparams.master_weights is False
    assert all(m is p for m, p in zip(model.master_parameters(), model.trainable_parameters()))


def test_the_proximal_anchor_of_a_bf16_model_is_its_fp32_master():
    schedule = StagewiseSchedule(stages=2, proximal=1e-2)
    model = DPZero(MLP(), lr=2e-2, clip=1.0, privacy=None)
    make_trainer(max_steps=6, limit_val_batches=0, callbacks=[schedule]).fit(model, DigitsDataModule())
    assert all(a.dtype == torch.float32 for a in model.proximal_anchor)
    _assert_weights_are_the_rounding_of_the_masters(model)


def test_a_dtype_change_between_fits_rebuilds_the_engine_on_the_new_weights():
    model = DPZero(MLP(), lr=2e-2, clip=1.0, privacy=None)
    make_trainer(max_steps=3, limit_val_batches=0).fit(model, DigitsDataModule())
    assert model.masters.nbytes > 0
    model.net.float()  # the fp32 weights are written in place: no master, no extra memory
    make_trainer(max_steps=3, limit_val_batches=0).fit(model, DigitsDataModule())
    assert model.masters.nbytes == 0
    assert all(m is p for m, p in zip(model.master_parameters(), model.trainable_parameters()))
    model.net.bfloat16()
    make_trainer(max_steps=3, limit_val_batches=0).fit(model, DigitsDataModule())
    _assert_weights_are_the_rounding_of_the_masters(model)


@pytest.mark.parametrize(
    "make",
    [
        lambda net: DPZero(net, lr=2e-2, clip=1.0, privacy=PrivacySpec(8.0, accountant="rdp"), noise_seed=1),
        lambda net: PAZOS(net, lr=0.05, k=2, privacy=PrivacySpec(8.0, accountant="rdp"), noise_seed=1),
        lambda net: O2NC(net, inner_steps=4, privacy=PrivacySpec(8.0), noise_seed=1),
    ],
    ids=["dpzero", "pazo-s", "o2nc"],
)
def test_a_move_after_the_fit_rebuilds_the_engine_on_the_moved_weights(make):
    """Lightning moves a module back to the CPU after a fit on a GPU; what uses the module next (an audit, a user's
    own step) must not draw into the old placement's buffers or read its masters (on CUDA the audit raised
    "Expected a 'cuda' device type for generator"). A dtype move is the same event on a CPU."""
    model = make(MLP())
    make_trainer(max_steps=2, limit_val_batches=0).fit(model, DigitsDataModule(sampling_seed=3))
    model.net.float()
    assert all(m is p for m, p in zip(model.master_parameters(), model.trainable_parameters()))


def _resume_case(tmp_path, make_model):
    """An uninterrupted run against a crash at step 5 resumed from the checkpoint of step 4 (both secrets seeded)."""
    dm = lambda: DigitsDataModule(sampling_seed=3)  # noqa: E731
    reference = make_model()
    make_trainer(max_steps=8, limit_val_batches=0).fit(reference, dm())
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_steps=8, limit_val_batches=0, callbacks=[ckpt, Crash(5)], enable_checkpointing=True).fit(
            make_model(), dm()
        )
    path = tmp_path / "step=4.ckpt"
    resumed = make_model()
    make_trainer(max_steps=8, limit_val_batches=0).fit(resumed, dm(), ckpt_path=str(path))
    return reference, resumed, torch.load(path, weights_only=False)


@pytest.mark.parametrize("method", ["dpzero", "o2nc"])
def test_a_bf16_resume_restores_the_masters_and_is_bit_identical(tmp_path, method):
    def make_model():
        if method == "o2nc":
            return O2NC(MLP(), inner_steps=2, output="last_iterate", privacy=PrivacySpec(8.0), noise_seed=1)
        return DPZero(MLP(), lr=1e-3, clip=1.0, privacy=PrivacySpec(8.0, accountant="rdp"), noise_seed=1)

    reference, resumed, checkpoint = _resume_case(tmp_path, make_model)
    weights = checkpoint["state_dict"]
    saved = weights["master_weights._extra_state"]  # beside the weights, as under FSDP2
    assert sorted(saved) == sorted(name for name, p in resumed.named_parameters() if p.requires_grad)
    for name, master in saved.items():
        assert master.dtype == torch.float32 and torch.equal(weights[name], master.to(torch.bfloat16))
    for a, b in zip(resumed.master_parameters(), reference.master_parameters()):
        assert torch.equal(a, b)  # a resume from the bf16 rounding alone would differ here
    for a, b in zip(resumed.net.parameters(), reference.net.parameters()):
        assert torch.equal(a, b)


def test_every_audit_trial_of_a_bf16_model_starts_from_the_same_masters():
    from pl_dp.audit import audit
    from pl_dp.data import PrivatePublicDataModule
    from tests.conftest import blobs

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 3)

        def forward(self, x):
            return self.layer(x.to(self.layer.weight.dtype))

    torch.manual_seed(0)
    spec = PrivacySpec(epsilon=100.0, accountant="rdp", noise_multiplier=1.5)
    model = DPZero(Net().bfloat16(), clip=1.0, queries=2, privacy=spec, noise_seed=0)
    starts, step = [], model.private_step

    def recorded(*args, **kwargs):
        starts.append(torch.cat([m.flatten().clone() for m in model.master_parameters()]))
        return step(*args, **kwargs)

    model.private_step = recorded
    audit(model, PrivatePublicDataModule(blobs(40), batch_size=8), trials=20)
    assert len(starts) > 40 and all(torch.equal(s, starts[0]) for s in starts[:-1])  # the last is the real step
    _assert_weights_are_the_rounding_of_the_masters(model)


def test_dpzero_fine_tunes_a_bf16_causal_lm_through_fp32_masters(tmp_path, monkeypatch):
    """Prompt-based fine-tuning of a (tiny, random) OPT loaded in bf16: every weight gets a master."""
    from pl_dp.data import TextDataModule
    from pl_dp.nets import PromptClassifier
    from tests.nets.test_prompt import LABELS, TEXTS
    from tests.tiny_hf import tiny_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    L.seed_everything(0)
    net = PromptClassifier(["terrible", "great"], model_path=tiny_model(tmp_path, "opt"), dtype=torch.bfloat16)
    data = TextDataModule((TEXTS * 4, LABELS * 4), val=(TEXTS, LABELS), test_fraction=0, prompt=net, batch_size=8)
    model = DPZero(net, lr=1e-2, clip=1.0, privacy=PrivacySpec(epsilon=2.0, accountant="rdp"))
    make_trainer(max_steps=3, limit_val_batches=0).fit(model, data)
    assert model.private_steps == 3
    _assert_weights_are_the_rounding_of_the_masters(model)


def test_a_checkpoint_of_pl_dp_0_2_resumes_with_the_masters_it_kept_apart():
    """pl_dp 0.2 kept a one-process run's masters in the checkpoint's ``pl_dp_master_weights`` entry, not in its
    state dict: such a checkpoint still loads strictly, and the next engine starts from those masters."""
    model = DPZero(nn.Linear(4, 3).to(torch.bfloat16), lr=0.1)
    model.masters.weights(list(model.net.parameters()))  # an engine built: the masters exist
    state = model.state_dict()
    masters = state.pop("master_weights._extra_state")  # where 0.2 did not write them
    assert {name: m.dtype for name, m in masters.items()} == {"net.weight": torch.float32, "net.bias": torch.float32}
    masters["net.weight"] += 2.0**-20  # below bf16's rounding: still the master of the same bf16 weight
    fresh = DPZero(nn.Linear(4, 3).to(torch.bfloat16), lr=0.1)
    checkpoint = {"state_dict": state, "pl_dp": model.privacy_state_dict(), MASTER_WEIGHTS_KEY: masters}
    fresh.on_load_checkpoint(checkpoint)  # as Lightning: the hook, then the state dict
    fresh.load_state_dict(state)  # strict
    assert torch.equal(fresh.masters.weights(list(fresh.net.parameters()))[0], masters["net.weight"])


def test_the_masters_travel_in_the_state_dict_and_a_fresh_module_starts_from_them():
    model = DPZero(nn.Linear(4, 3).to(torch.bfloat16), lr=0.1)
    model.masters.weights(list(model.net.parameters()))
    state = model.state_dict()
    state["master_weights._extra_state"]["net.weight"] += 2.0**-20
    fresh = DPZero(nn.Linear(4, 3).to(torch.bfloat16), lr=0.1)
    fresh.load_state_dict(state)  # strict
    expected = state["master_weights._extra_state"]["net.weight"]
    assert torch.equal(fresh.masters.weights(list(fresh.net.parameters()))[0], expected)
