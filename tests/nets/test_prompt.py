"""Prompt-based classification (PromptClassifier): masked, causal and sentence-encoder models, offline."""

import lightning as L
import pytest
import torch

from pl_dp import PrivacySpec
from pl_dp.data import TextDataModule, minilm_embeddings, tokenize_prompts
from pl_dp.data.collate import PaddingCollate
from pl_dp.errors import ConfigError
from pl_dp.methods import DPSGD, DPZero
from pl_dp.nets import PromptClassifier
from pl_dp.step.independence import probe_independence
from pl_dp.step.losses import cross_entropy
from tests.conftest import make_trainer
from tests.tiny_hf import tiny_model

TEXTS = [
    "the movie was great",
    "awful",
    "the plot was terrible and the ending was terrible",
    "a fine film",
    "great",
    "an awful film with a terrible plot",
    "It was great",
    "terrible actors",
    "the actors were great and the movie was fine",
]
LABELS = [1, 0, 0, 1, 1, 0, 1, 0, 1]
# fine-tuning tests train on TEXTS * 4 and validate on TEXTS, given explicitly: split by fractions, every copy of a
# text lands in the same split, and nine distinct texts are too few for a validation fraction to be reliable


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module", params=["bert-mlm", "gpt2", "opt"])
def tiny_lm(request, tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def minilm():
    return PromptClassifier(["terrible", "great"])


def _examples(net, texts=TEXTS, labels=LABELS):
    ids = tokenize_prompts(texts, net.tokenizer, net.template, 64)
    return [
        {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": torch.tensor(y)} for x, y in zip(ids, labels)
    ]


def _batch(net, texts=TEXTS, labels=LABELS):
    return PaddingCollate()(_examples(net, texts, labels))


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def test_lm_scores_are_the_label_word_logits_at_the_decision_position(tiny_lm):
    """Masked LM: at the mask; causal LM: at the last token — the rows of the full [B, T, V] logits."""
    net = PromptClassifier(["terrible", "great"], model_path=tiny_lm).eval()
    assert net.kind == ("masked" if "bert" in tiny_lm.name else "causal")
    batch = _inputs(_batch(net))
    with torch.no_grad():
        scores = net(**batch)
        full = net.model(**batch).logits  # the hook is idle outside forward: every position's logits
    ids = batch["input_ids"]
    if net.kind == "masked":
        positions = (ids == net.tokenizer.mask_token_id).int().argmax(1)
    else:
        positions = batch["attention_mask"].sum(1) - 1
    expected = full[torch.arange(len(ids)), positions][:, net.label_token_ids]
    assert scores.dtype == torch.float32 and scores.shape == (len(TEXTS), 2)
    torch.testing.assert_close(scores, expected)
    words = net.tokenizer.convert_ids_to_tokens(net.label_token_ids.tolist())
    assert [w.lstrip("Ġ") for w in words] == ["terrible", "great"]


def test_padding_changes_no_other_examples_score_and_the_probe_passes(tiny_lm):
    """Each example scored alone equals its row in a padded batch; pl_dp's independence probe accepts the net."""
    net = PromptClassifier(["terrible", "great"], model_path=tiny_lm).eval()
    batch = _batch(net)
    with torch.no_grad():
        together = net(**_inputs(batch))
        alone = torch.cat(
            [net(input_ids=ids[mask.bool()][None]) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        )
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    net.train()
    probe_independence(net, cross_entropy, _examples(net), modes=("train", "eval"), collate=PaddingCollate())


def test_sentence_encoder_scores_against_the_label_words_embeddings(minilm):
    """The packaged MiniLM has no LM head: the head starts at the label words' sentence embeddings."""
    assert minilm.kind == "encoder" and minilm.template == "{text}"
    torch.testing.assert_close(minilm.head.weight, minilm_embeddings(["terrible", "great"]), atol=1e-5, rtol=1e-5)
    minilm.eval()
    with torch.no_grad():
        scores = minilm(**_inputs(_batch(minilm, ["a wonderful day", "a horrible mess"], [1, 0])))
    assert scores.argmax(1).tolist() == [1, 0]  # zero-shot: the pretrained encoder already knows
    cosines = minilm_embeddings(["a wonderful day"]) @ minilm.head.weight.T
    torch.testing.assert_close(scores[0], minilm.scale * cosines[0], atol=1e-4, rtol=1e-4)
    probe_independence(minilm, cross_entropy, _examples(minilm), modes=("eval",), collate=PaddingCollate())


@pytest.mark.parametrize("method", [DPZero, DPSGD])
def test_private_prompt_fine_tuning_moves_only_the_trainable_parameters(tiny_lm, method):
    L.seed_everything(0)
    net = PromptClassifier(["terrible", "great"], model_path=tiny_lm, trainable="last-1")
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    assert {n for n, p in net.named_parameters() if p.requires_grad} == {
        n
        for n in before
        if ".1." in n  # the last of the two transformer blocks
    }
    # max_length below the tiny models' 64 positions: a zeroth-order step pads one past it (a max_length of 64 is
    # refused); padded beyond them, a causal LM's scores of the other texts move (1.2·C in fp32)
    data = TextDataModule(
        (TEXTS * 4, LABELS * 4), val=(TEXTS, LABELS), test_fraction=0, prompt=net, batch_size=8, max_length=63
    )
    model = method(net, lr=1e-2, clip=1.0, privacy=PrivacySpec(epsilon=2.0, accountant="rdp"))
    if method is DPSGD and tiny_lm.name.startswith("opt"):  # OPT's fc1/fc2 see [batch x tokens, width]
        with pytest.raises(RuntimeError, match="per input row, not per example"):
            make_trainer(max_steps=2, limit_val_batches=0).fit(model, data)
        return
    make_trainer(max_steps=2, limit_val_batches=0).fit(model, data)
    assert model.private_steps == 2
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n]) != p.requires_grad, n


def test_minilm_head_fine_tuning_with_dpzero_keeps_the_encoder_bit_identical():
    L.seed_everything(0)
    net = PromptClassifier(["terrible", "great"], trainable="head")
    encoder = {n: p.detach().clone() for n, p in net.model.named_parameters()}
    head = net.head.weight.detach().clone()
    data = TextDataModule((TEXTS * 4, LABELS * 4), val=(TEXTS, LABELS), test_fraction=0, prompt=net, batch_size=8)
    model = DPZero(net, lr=1e-2, clip=1.0, privacy=PrivacySpec(epsilon=1.0, accountant="rdp"))
    make_trainer(max_steps=3, limit_val_batches=0).fit(model, data)
    assert not torch.equal(net.head.weight, head)
    assert all(torch.equal(p, encoder[n]) for n, p in net.model.named_parameters())


def test_prompt_configuration_errors(tiny_lm, minilm):
    kind = "masked" if "bert" in tiny_lm.name else "causal"
    with pytest.raises(ConfigError, match="template"):
        PromptClassifier(
            ["bad", "good"], model_path=tiny_lm, template="{text} It was" if kind == "masked" else "{mask}"
        )
    with pytest.raises(ConfigError, match="single token"):
        PromptClassifier(["bad", "extraordinarily"], model_path=tiny_lm)
    with pytest.raises(ConfigError, match="separate head"):
        PromptClassifier(["terrible", "great"], model_path=tiny_lm, trainable="head")
    with pytest.raises(ConfigError, match="one word per class"):
        PromptClassifier("great", model_path=tiny_lm)


@pytest.mark.parametrize(
    "architecture, privacy",
    [pytest.param("minilm", PrivacySpec(1.0, accountant="rdp"), marks=pytest.mark.slow), ("bert-mlm", None)],
)
def test_dp_zopo_data_free_pruning_scores_a_prompt_classifier(tmp_path, architecture, privacy):
    """The pruning score runs the net in float64 on all-ones token ids (no mask token, no data)."""
    from pl_dp.callbacks import PruningSchedule, StagewiseSchedule

    L.seed_everything(0)
    path = None if architecture == "minilm" else tiny_model(tmp_path, architecture)
    net = PromptClassifier(["terrible", "great"], model_path=path, trainable="head" if path is None else "all")
    data = TextDataModule((TEXTS * 4, LABELS * 4), val=(TEXTS, LABELS), test_fraction=0, prompt=net, batch_size=8)
    model = DPZero(net, lr=1e-3, clip=1.0, privacy=privacy)
    callbacks = [StagewiseSchedule(stages=2), PruningSchedule(rates=[0.1, 0.2], strategy="incremental")]
    make_trainer(max_steps=4, limit_val_batches=0, callbacks=callbacks).fit(model, data)
    assert model.direction_mask.fraction == pytest.approx(0.2, abs=1e-3)
