"""LoRA adapters through peft: zeroth-order methods move only adapters (and head), DP-SGD's hooks see them."""

import contextlib
import functools
import warnings
from collections.abc import Callable

import lightning as L
import pytest
import torch

from pl_dp import PrivacySpec
from pl_dp.data import TextDataModule
from pl_dp.methods import DPSGD, DPZero
from pl_dp.nets import HFClassifier, PromptClassifier
from tests.conftest import make_trainer
from tests.nets.test_prompt import LABELS, TEXTS
from tests.tiny_hf import tiny_model

pytest.importorskip("peft")

GHOST = functools.partial(DPSGD, per_sample="ghost")  # DP-SGD with ghost clipping


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _data(tokenizer=None, prompt=None):
    return TextDataModule(
        (TEXTS * 4, LABELS * 4), val=(TEXTS, LABELS), test_fraction=0, tokenizer=tokenizer, prompt=prompt, batch_size=8
    )


def _fit_and_check(net, method, data, trainable_names):
    """Two private steps; every trainable parameter moved, every other one is bit-identical."""
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    assert {n for n, p in net.named_parameters() if p.requires_grad} == trainable_names
    L.seed_everything(0)
    kwargs = {"smoothing": 1e-2} if method is DPZero else {}
    model = method(net, lr=0.5, clip=1.0, privacy=PrivacySpec(epsilon=4.0, accountant="rdp"), noise_seed=0, **kwargs)
    make_trainer(max_steps=2, limit_val_batches=0).fit(model, data)
    assert model.private_steps == 2
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n]) != (n in trainable_names), n


@pytest.mark.parametrize(
    "architecture, method",
    [
        ("bert-mlm", DPZero),
        ("bert-mlm", DPSGD),
        ("bert-mlm", GHOST),
        ("gpt2", DPSGD),
        ("opt", DPSGD),
        pytest.param("minilm", DPZero, marks=pytest.mark.slow),
    ],
    ids=["bert-mlm-dpzero", "bert-mlm-dpsgd", "bert-mlm-ghost", "gpt2-dpsgd", "opt-dpsgd", "minilm-dpzero"],
)
def test_prompt_lora_trains_only_the_adapters_and_the_head(tmp_path, architecture, method):
    """GPT-2's adapters sit on its Conv1D attention; OPT's on q/v projections, which see one row per example; the
    packaged MiniLM (a sentence encoder) trains its label-word head too."""
    path = None if architecture == "minilm" else tiny_model(tmp_path, architecture)
    net = PromptClassifier(["terrible", "great"], model_path=path, trainable="lora")
    adapters = {n for n, _ in net.named_parameters() if ".lora_" in n}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    _fit_and_check(net, method, _data(prompt=net), adapters | ({"head.weight"} if path is None else set()))


@pytest.mark.parametrize("method", [DPZero, DPSGD, GHOST], ids=["dpzero", "dpsgd", "ghost"])
def test_seq_cls_lora_trains_adapters_and_the_head_copy(tmp_path, method):
    """peft's task_type="SEQ_CLS" wraps the head in a ModulesToSaveWrapper: its trainable copy is the head."""
    path = tiny_model(tmp_path, "bert-cls")
    net = HFClassifier(path, trainable="lora", lora_rank=4, lora_targets=["query", "value"])
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert (
        any(".lora_A." in n for n in trainable)
        and "model.base_model.model.classifier.modules_to_save.default.weight" in trainable
    )
    _fit_and_check(net, method, _data(tokenizer=path), trainable)


@pytest.mark.parametrize("method", [DPZero, DPSGD, GHOST], ids=["dpzero", "dpsgd", "ghost"])
def test_a_users_peft_model_is_a_net(tmp_path, method):
    """A PeftModel straight from from_pretrained (eval mode, as Lightning keeps it) trains under both families."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    path = tiny_model(tmp_path, "bert-cls")
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, local_files_only=True)
    assert not base.training
    net = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"]))
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    _fit_and_check(net, method, _data(tokenizer=path), trainable)


def test_functorch_per_sample_gradients_refuse_hugging_face_models_clearly(tmp_path):
    path = tiny_model(tmp_path, "bert-cls")
    net = HFClassifier(path, trainable="last-1")
    model = DPSGD(net, per_sample="functorch", privacy=PrivacySpec(2.0, accountant="rdp"))
    with pytest.raises(NotImplementedError, match="per_sample='hooks'"):
        make_trainer(max_steps=1, limit_val_batches=0).fit(model, _data(tokenizer=path))


@pytest.mark.parametrize("architecture", ["gpt2", "opt"])
def test_lora_builds_without_peft_correcting_its_config(tmp_path, architecture):
    """Issue [record] 41 item 4: every LoRA build of GPT-2 warned "fan_in_fan_out is set to False but the target
    module is `Conv1D`": pl_dp's LoraConfig now says how the target layers store their weight (OPT's are Linear)."""
    from pl_dp.nets import CausalLM

    path = tiny_model(tmp_path, architecture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = CausalLM(model_path=path, trainable="lora")
    assert not [str(w.message) for w in caught if "fan_in_fan_out" in str(w.message)]
    assert any(".lora_A." in name for name, _ in net.named_parameters())


def test_pl_dp_hides_transformers_deprecation_of_what_peft_reads_only_on_its_command_line(tmp_path):
    """transformers' FutureWarning that ``is_gradient_checkpointing`` is deprecated comes from peft's own
    ``get_peft_model`` at every LoRA build: the command line hides it; the library leaves the caller's warnings
    alone."""
    from pl_dp.cli import quiet_lightning
    from pl_dp.nets import CausalLM

    path = tiny_model(tmp_path, "gpt2")

    def deprecations(quiet: Callable[[], contextlib.AbstractContextManager[None]]) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet():
                CausalLM(model_path=path, trainable="lora")
        return sum("is_gradient_checkpointing" in str(w.message) for w in caught)

    if deprecations(contextlib.nullcontext) == 0:
        pytest.skip("this peft and transformers do not raise the deprecation")
    assert deprecations(quiet_lightning) == 0
