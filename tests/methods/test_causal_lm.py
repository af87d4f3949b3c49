"""Private fine-tuning of a tiny GPT-2 for generation: loss="causal_lm" under DP-SGD (ghost, LoRA), DPZero, PAZO-M,
bf16."""

import pytest
import torch

from pl_dp import PrivacySpec
from pl_dp.data import TextGenerationDataModule
from pl_dp.methods import DPSGD, PAZOM, DPZero
from pl_dp.nets import CausalLM
from tests.conftest import make_trainer
from tests.tiny_hf import CORPUS, tiny_model

TEXTS = [f"{text} number {i}" for i, text in enumerate(CORPUS)]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("gpt2"), "gpt2")


def _method(name, path):
    privacy = PrivacySpec(epsilon=8.0)
    if name == "dpzero":
        return DPZero(CausalLM(model_path=path), loss="causal_lm", lr=1e-3, privacy=privacy, noise_seed=0)
    if name == "pazo-m":  # public sequences enter the update too
        return PAZOM(CausalLM(model_path=path), loss="causal_lm", lr=1e-3, privacy=privacy, noise_seed=0)
    trainable = "lora" if name == "hooks-lora" else "all"
    per_sample = "ghost" if name.startswith("ghost") else "hooks"
    return DPSGD(
        CausalLM(model_path=path, trainable=trainable),
        loss="causal_lm",
        lr=0.5,
        per_sample=per_sample,
        privacy=privacy,
        noise_seed=0,  # seeded secrets: the few noisy steps of a test are the same at every run
    )


@pytest.mark.parametrize("name", ["ghost", "hooks-lora", "dpzero", "pazo-m", "ghost-bf16"])
def test_private_steps_on_texts_lower_the_validation_loss_within_the_budget(name, gpt2_dir):
    public = 0.2 if name == "pazo-m" else 0.0
    data = TextGenerationDataModule(
        data=TEXTS,
        tokenizer=gpt2_dir,
        batch_size=12,
        max_length=24,
        val_fraction=0.2,
        public_fraction=public,
        sampling_seed=0,
    )
    model = _method(name, gpt2_dir)
    precision = "bf16-mixed" if name.endswith("bf16") else "32-true"
    trainer = make_trainer(max_epochs=1, precision=precision, limit_train_batches=3)
    (before,) = trainer.validate(model, datamodule=data, verbose=False)
    trainer.fit(model, datamodule=data)  # the fit-start probe passes through the data's collate
    (after,) = trainer.validate(model, datamodule=data, verbose=False)
    assert model.private_steps > 0 and 0 < model.epsilon <= 8.0
    assert torch.isfinite(torch.tensor(after["val/loss"]))
    if name not in (
        "dpzero",
        "pazo-m",
    ):  # a zeroth-order step of 1e-3 moves a random model's loss little: finite is what is asked
        assert after["val/loss"] < before["val/loss"]


def test_sampling_is_seeded_and_leaves_the_model_as_it_found_it(gpt2_dir):
    net = CausalLM(model_path=gpt2_dir)
    assert net.model.training
    first = net.generate(["the movie was", ""], max_new_tokens=6, seed=3)
    assert first == net.generate(["the movie was", ""], max_new_tokens=6, seed=3) and len(first) == 2
    greedy = net.generate("the plot", max_new_tokens=6, do_sample=False)
    assert greedy == net.generate("the plot", max_new_tokens=6, do_sample=False, seed=None)
    assert net.model.training  # train mode restored


def test_evaluation_logs_the_token_perplexity_and_the_cli_summary_prints_it(gpt2_dir):
    """Issue [record] 41 item 4: a causal-LM run's summary line showed only epsilon. Validation and test log
    ``<stage>/perplexity``, exp(sum NLL / sum tokens) over the whole split (pl_dp.nets.perplexity's number), and
    ``pl-dp fit``'s summary prints the test loss and perplexity."""
    from pl_dp.cli import report
    from pl_dp.nets import perplexity

    data = TextGenerationDataModule(
        data=TEXTS, tokenizer=gpt2_dir, batch_size=12, max_length=24, eval_batch_size=5, sampling_seed=0
    )
    model = _method("ghost", gpt2_dir)
    trainer = make_trainer(max_epochs=1, limit_train_batches=2)
    trainer.fit(model, datamodule=data)
    assert "val/perplexity" in trainer.logged_metrics
    (tested,) = trainer.test(model, datamodule=data, verbose=False)
    expected = perplexity(model.net, data.test_dataloader())  # several batches of unequal token counts
    assert len(data.test_dataloader()) > 1
    torch.testing.assert_close(torch.tensor(tested["test/perplexity"]), torch.tensor(expected), rtol=1e-5, atol=0)
    line = report(model, tested)
    assert f"test loss {tested['test/loss']:.4f}, test perplexity {expected:.2f}" in line and "epsilon" in line
