"""Fine-tuning a real pretrained transformer offline: packaged MiniLM, VADER lexicon, ZO methods on it."""

import json
import warnings

import lightning as L
import pytest
import torch

from pl_dp import PrivacySpec
from pl_dp.data import (
    TextDataModule,
    VaderEmbeddingDataModule,
    VaderSentimentDataModule,
    minilm_embeddings,
    vader_lexicon,
    vader_splits,
)
from pl_dp.errors import ConfigError
from pl_dp.methods import DPSGD, PAZOM, DPZero
from pl_dp.nets import MLP, HFClassifier, MiniLMClassifier, minilm_path
from tests.conftest import make_trainer


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def vader():
    return VaderSentimentDataModule(batch_size=16, public_batch_size=8)


def test_packaged_minilm_loads_offline_and_runs(vader):
    net = MiniLMClassifier(num_labels=2)
    assert sum(p.numel() for p in net.parameters()) == 22_713_986  # 22.7M: MiniLM-L6 + a new 2-way head
    batch = vader.collate_fn([vader.test[i] for i in range(4)])  # padded to the longest of the four
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert logits.shape == (4, 2) and torch.isfinite(logits).all()
    bias = MiniLMClassifier(trainable="bias")
    names = [n for n, p in bias.model.named_parameters() if p.requires_grad]
    assert names and all(n.endswith(".bias") or n.startswith("classifier.") or ".pooler." in n for n in names)
    with pytest.raises(ConfigError, match="trainable"):
        MiniLMClassifier(trainable="some")


def test_vader_labels_follow_the_lexicon_and_splits_are_fixed_and_disjoint(vader):
    lexicon = {}
    for text, mean in vader_lexicon():
        lexicon.setdefault(text, []).append(mean)
    splits = vader_splits()
    seen = set()
    for texts, labels in splits.values():
        for text, label in zip(texts, labels.tolist()):
            means = lexicon[text]
            assert abs(sum(means) / len(means)) >= 0.5 and all(label == int(m > 0) for m in means)
        assert not seen & set(texts)
        seen |= set(texts)
    assert "d:" not in seen  # rated -2.9 and 1.2 in the file: ambiguous, dropped
    again = vader_splits()
    assert all(again[k][0] == splits[k][0] for k in splits)
    public, private = splits["public"][1].float().mean(), splits["private"][1].float().mean()
    assert public > private + 0.2  # the documented class-imbalance shift of the public split


def test_vader_is_a_text_datamodule_with_the_same_splits_and_tokens(vader):
    """Each entry alone, truncated at max_length=8 as before; batches padded per batch instead of to 8."""
    from transformers import AutoTokenizer

    assert isinstance(vader, TextDataModule)
    assert [len(getattr(vader, n)) for n in ("private", "public", "val", "test")] == [4897, 204, 680, 1020]
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)
    texts, labels = vader_splits()["test"]
    expected = tokenizer(texts, truncation=True, max_length=8)["input_ids"]
    assert [vader.test[i]["input_ids"].tolist() for i in range(len(texts))] == expected
    assert torch.equal(vader.test.labels, labels)


def _tiny_bert(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("method", [DPZero, PAZOM])
def test_zo_methods_train_a_tiny_local_bert(tmp_path, vader, method):
    L.seed_everything(0)
    net = HFClassifier(_tiny_bert(tmp_path), num_labels=2, trainable="last-1")
    model = method(net, lr=1e-3, clip=1.0, smoothing=1e-3, privacy=PrivacySpec(epsilon=2.0, accountant="rdp"))
    make_trainer(max_steps=3, limit_val_batches=0).fit(model, vader)
    assert model.private_steps == 3 and 0 < model.epsilon <= 2.0


def test_zo_steps_on_minilm_change_only_the_trainable_parameters(vader):
    for method in (DPZero, PAZOM):
        L.seed_everything(0)
        net = MiniLMClassifier(trainable="bias")
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        spec = PrivacySpec(epsilon=2.0, accountant="rdp")
        # preflight=False: a MiniLM pass over VADER's private set (~10 s here) is not what this test is about
        model = method(net, lr=1e-2, clip=1.0, smoothing=1e-3, privacy=spec, preflight=False)
        make_trainer(max_steps=2, limit_val_batches=0).fit(model, vader)
        for n, p in net.named_parameters():
            assert torch.equal(p, before[n]) != p.requires_grad, n  # trainable moved, frozen did not


def test_dpsgd_per_sample_hooks_on_a_local_bert(tmp_path, vader):
    """from_pretrained returns eval mode, where Opacus' hooks record nothing: the wrapper trains."""
    from pl_dp.methods import DPSGD

    L.seed_everything(0)
    net = HFClassifier(_tiny_bert(tmp_path), num_labels=2, trainable="last-1")
    assert net.training
    model = DPSGD(net, lr=0.1, clip=1.0, privacy=PrivacySpec(epsilon=2.0, accountant="rdp"))
    make_trainer(max_steps=2, limit_val_batches=0).fit(model, vader)
    assert model.private_steps == 2


@pytest.mark.parametrize("per_sample", ["hooks", "ghost"])
def test_dpsgd_fine_tunes_every_parameter_of_a_local_bert(tmp_path, vader, per_sample):
    """Full fine-tuning: the position embeddings, looked up once for the batch, get per-example gradients too."""
    L.seed_everything(0)
    net = HFClassifier(_tiny_bert(tmp_path), num_labels=2, trainable="all")
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    model = DPSGD(net, lr=0.1, clip=1.0, per_sample=per_sample, privacy=PrivacySpec(epsilon=2.0, accountant="rdp"))
    make_trainer(max_steps=2, limit_val_batches=0).fit(model, vader)
    assert model.private_steps == 2 and 0 < model.epsilon <= 2.0
    assert all(not torch.equal(p, before[n]) for n, p in net.named_parameters())


@pytest.fixture(scope="module")
def vader_embeddings():
    return VaderEmbeddingDataModule(batch_size=64)


def test_vader_embeddings_are_the_fixed_splits_as_unit_minilm_vectors(vader, vader_embeddings):
    splits = vader_splits()
    for name in ("private", "public", "val", "test"):
        features, labels = getattr(vader_embeddings, name).tensors
        assert features.shape == (len(splits[name][0]), 384)
        assert torch.equal(labels, splits[name][1]) and len(getattr(vader, name)) == len(labels)
        assert torch.allclose(features.norm(dim=1), torch.ones(len(labels)), atol=1e-5)
    good, great, awful = minilm_embeddings(["good", "great", "awful"])
    assert good @ great > good @ awful + 0.1  # a pretrained encoder, not random weights


def test_dp_sgd_learns_sentiment_from_the_frozen_embeddings(vader_embeddings):
    L.seed_everything(0)
    model = DPSGD(MLP(384, [], 2), lr=2.0, clip=1.0, privacy=PrivacySpec(1.0, accountant="rdp"), noise_seed=0)
    trainer = make_trainer(max_epochs=3)
    trainer.fit(model, vader_embeddings)
    accuracy = trainer.test(model, vader_embeddings, verbose=False)[0]["test/acc"]
    majority = 1 - vader_embeddings.test.tensors[1].float().mean().item()
    assert model.epsilon <= 1.0
    assert accuracy > majority + 0.15, (accuracy, majority)


@pytest.mark.parametrize("config_pad", [None, 5], ids=["none", "another"])
def test_a_decoder_classifier_reads_each_padded_text_at_its_own_last_token(tmp_path, config_pad):
    """GPT-2's classifier takes its logits at each row's last token that is not ``config.pad_token_id``; the text
    modules pad with the tokenizer's pad id (``token_padding``). With no id in the config a batch of two was refused;
    with another one the short text was classified from a padding position."""
    from transformers import AutoTokenizer

    from pl_dp.data.text import token_padding
    from tests.tiny_hf import tiny_model

    path = tiny_model(tmp_path, "gpt2")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "pad_token_id": config_pad}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = HFClassifier(path, num_labels=2).eval()
    said = [str(w.message) for w in caught if "pads with token id" in str(w.message)]
    assert len(said) == (config_pad is not None)  # another id in the config is replaced, and said
    tokenizer = AutoTokenizer.from_pretrained(path)
    short, long = (
        torch.tensor(tokenizer(text)["input_ids"]) for text in ("a good film", "a good film with a long end")
    )
    collate = token_padding(tokenizer)
    with torch.no_grad():
        together = net(**collate([{"input_ids": short}, {"input_ids": long}]))
        alone = net(**collate([{"input_ids": short}]))
    torch.testing.assert_close(together[0], alone[0])
