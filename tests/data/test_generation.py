"""TextGenerationDataModule: texts and prompt/completion pairs to right-padded, masked, Poisson-sampled batches."""

import csv
import json
import logging
import pickle

import pytest
import torch

from pl_dp.data import TextGenerationDataModule
from pl_dp.data.collate import PaddingCollate
from pl_dp.errors import ConfigError, IndependenceError
from pl_dp.nets import CausalLM, minilm_path
from pl_dp.step.independence import probe_examples, probe_independence
from pl_dp.step.losses import causal_lm
from tests.tiny_hf import CORPUS, tiny_model

TEXTS = [f"{text} number {i}" for i, text in enumerate(CORPUS)]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("gpt2"), "gpt2")


def test_texts_from_a_list_become_right_padded_masked_batches(gpt2_dir):
    data = TextGenerationDataModule(data=TEXTS, tokenizer=gpt2_dir, batch_size=8, max_length=20)
    assert len(data.private) + len(data.val) + len(data.test) == len(TEXTS)
    eos = data.tokenizer.eos_token_id
    item = data.private[0]
    assert torch.equal(item["labels"], item["input_ids"]) and item["attention_mask"].all()
    lengths = {len(data.private[i]["input_ids"]) for i in range(len(data.private))}
    assert max(lengths) == 20 and len(lengths) > 1  # cut to max_length; texts of several lengths
    short = next(i for i in range(len(data.private)) if len(data.private[i]["input_ids"]) < 20)
    assert data.private[short]["input_ids"][-1] == eos  # ended, when not cut
    batch = data.collate_fn([data.private[i] for i in range(6)])
    mask, labels = batch["attention_mask"], batch["labels"]
    assert batch["input_ids"].shape == mask.shape == labels.shape
    assert torch.equal(labels == -100, mask == 0)  # padding: no loss, masked
    assert (mask.cummin(dim=1).values == mask).all()  # right padding: each row's tokens first
    assert "data" not in data.hparams and data.hparams["max_length"] == 20  # texts in memory are never saved


def test_prompt_completion_columns_from_files_put_the_loss_on_the_completion(gpt2_dir, tmp_path):
    rows = [
        {"question": f"Q{i}: how was it?", "answer": f" it was {'great' if i % 2 else 'terrible'}"} for i in range(20)
    ]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = tmp_path / "pairs.csv"
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    columns = dict(prompt_column="question", completion_column="answer", tokenizer=gpt2_dir, batch_size=4)
    from_csv = TextGenerationDataModule(data=path, **columns)
    from_jsonl = TextGenerationDataModule(data=jsonl, **columns)
    tokenizer = from_csv.tokenizer
    for data in (from_csv, from_jsonl):
        assert data.hparams["data"] in (path, jsonl)  # a path is kept
        item = data.private[0]
        ids, labels = item["input_ids"], item["labels"]
        prompt = len(tokenizer(tokenizer.decode(ids[labels == -100]))["input_ids"])
        assert prompt > 0 and (labels[:prompt] == -100).all() and torch.equal(labels[prompt:], ids[prompt:])
        assert tokenizer.decode(ids[prompt:-1]).startswith(" it was")
    with pytest.raises(ConfigError, match="both prompt_column and completion_column"):
        TextGenerationDataModule(data=path, prompt_column="question", tokenizer=gpt2_dir)


def _split_of(data):
    """Each sequence's split, ``{token ids: name}`` (an empty public split is None)."""
    splits = {name: getattr(data, name) for name in ("private", "public", "val", "test")}
    return {
        tuple(item["input_ids"].tolist()): name
        for name, dataset in splits.items()
        if dataset is not None
        for item in dataset
    }


def test_adding_one_text_moves_no_other_text_between_splits(gpt2_dir):
    pool = [f"{text} number {i}" for i, text in enumerate(CORPUS * 5)]  # 300 distinct texts
    arguments = dict(tokenizer=gpt2_dir, public_fraction=0.1, batch_size=8, max_length=64)
    before = _split_of(TextGenerationDataModule(data=pool, **arguments))
    assert len(before) == len(pool) and set(before.values()) == {"private", "public", "val", "test"}
    for k in range(4):
        after = _split_of(TextGenerationDataModule(data=pool + [f"my private note {k}"], **arguments))
        assert len(after) == len(pool) + 1 and {ids: after[ids] for ids in before} == before


def test_the_fit_start_probe_passes_through_its_collate_and_refuses_left_padding(gpt2_dir):
    data = TextGenerationDataModule(data=TEXTS, tokenizer=gpt2_dir, batch_size=8, max_length=32)
    net = CausalLM(model_path=gpt2_dir)  # in training mode: dropout on
    examples, source = probe_examples(data, data.train_dataloader(), size=8)
    assert source == "validation" and len({len(e["input_ids"]) for e in examples}) > 1  # the probe batch is padded
    probe_independence(net, causal_lm, examples, ("train", "eval"), source, collate=data.collate_fn)

    def left_padded(items):  # padding the model is not told about: it attends to the pad tokens before the text
        batch = PaddingCollate()([{k: v.flip(0) for k, v in item.items()} for item in items])
        batch = {k: v.flip(1) for k, v in batch.items()}
        return batch | {"attention_mask": torch.ones_like(batch["attention_mask"])}

    with pytest.raises(IndependenceError, match="collate"):
        probe_independence(net, causal_lm, examples, ("eval",), source, collate=left_padded)


def _slow_bpe_tokenizer(directory):
    """A Python (not Rust) BPE tokenizer, CTRL's, with a tiny vocabulary: it caches every word it splits."""
    from transformers import CTRLTokenizer

    vocab = {token: i for i, token in enumerate(["<unk>", "a", "b", "c", "ab", "a@@", "b@@", "ab@@"])}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\na b\n")
    return CTRLTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"))


@pytest.mark.parametrize("kind", ["fast", "python"])
def test_a_long_private_text_leaves_no_trace_on_the_console_or_the_tokenizer(
    kind, tmp_path, capfd, caplog, monkeypatch
):
    """Past the model's 512 positions transformers printed a notice and flagged the tokenizer; a Python BPE tokenizer
    kept the text's words in its cache — on the tokenizer a CausalLM holds and a pickle of the net carries."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # its records reach caplog too
    caplog.set_level(logging.DEBUG)
    texts = [f"a short note number {i}" for i in range(40)]
    long = "a confidential note " * 200  # 600 tokens for MiniLM
    pickles = []
    for pool in (texts, texts + [long]):
        if kind == "fast":
            tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)
        else:
            tokenizer = _slow_bpe_tokenizer(tmp_path)
        capfd.readouterr()
        caplog.clear()
        data = TextGenerationDataModule(data=pool, val=["v one"], test=["t one"], tokenizer=tokenizer, max_length=32)
        assert capfd.readouterr() == ("", "") and caplog.records == []
        assert tokenizer.deprecation_warnings == {}
        pickles.append(pickle.dumps(tokenizer))
    assert len(data.private) == len(texts) + 1 and pickles[0] == pickles[1]
