"""TextDataModule: texts from lists, CSV, JSONL and datasets; splits; prompt tokenization; dynamic padding."""

import csv
import json

import pytest
from transformers import AutoTokenizer

from pl_dp.data import TextDataModule, read_texts, tokenize_prompts
from pl_dp.nets import minilm_path
from pl_dp.privacy.sampling import poisson_sampler_of

TEXTS = [f"review number {i} " + "great " * (i % 5) for i in range(40)]
LABELS = [i % 2 for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)


def _texts(dataset):
    return list(dataset.texts)


def test_fractions_split_the_pool_with_a_fixed_seed(tokenizer):
    data = TextDataModule((TEXTS, LABELS), tokenizer=tokenizer, public_fraction=0.1, batch_size=4)
    sizes = {name: len(getattr(data, name)) for name in ("private", "public", "val", "test")}
    assert sizes == {"private": 28, "public": 4, "val": 4, "test": 4}  # 10 % each of 40, the rest private
    splits = [set(_texts(getattr(data, name))) for name in ("private", "public", "val", "test")]
    assert set().union(*splits) == set(TEXTS) and sum(map(len, splits)) == len(TEXTS)
    again = TextDataModule((TEXTS, LABELS), tokenizer=tokenizer, public_fraction=0.1, batch_size=4)
    assert _texts(again.test) == _texts(data.test)  # the split seed is fixed: the same split in every run
    other = TextDataModule((TEXTS, LABELS), tokenizer=tokenizer, public_fraction=0.1, batch_size=4, split_seed=1)
    assert _texts(other.test) != _texts(data.test)
    for dataset in (data.private, data.test):  # labels travel with their texts
        assert all(int(item["labels"]) == LABELS[TEXTS.index(text)] for item, text in zip(dataset, dataset.texts))


def test_private_loader_is_poisson_and_batches_are_padded_to_their_longest(tokenizer):
    data = TextDataModule((TEXTS, LABELS), tokenizer=tokenizer, batch_size=4, sampling_seed=0)
    sampler = poisson_sampler_of(data.train_dataloader())
    assert sampler.sample_rate == pytest.approx(4 / len(data.private))
    for batch in data.val_dataloader():
        lengths = batch["attention_mask"].sum(1)
        assert batch["input_ids"].shape[1] == int(lengths.max())  # dynamic padding
        assert ((batch["input_ids"] == 0) == (batch["attention_mask"] == 0)).all()


def test_explicit_splits_from_csv_and_jsonl_files_with_label_names(tmp_path, tokenizer):
    train, test = tmp_path / "train.csv", tmp_path / "test.jsonl"
    with train.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["review", "sentiment"])
        writer.writerows([(text, ["negative", "positive"][label]) for text, label in zip(TEXTS, LABELS)])
    test.write_text("".join(json.dumps({"review": t, "sentiment": y}) + "\n" for t, y in [("so great", 1), ("bad", 0)]))
    data = TextDataModule(
        str(train),
        test=str(test),
        tokenizer=str(minilm_path()),
        text_column="review",
        label_column="sentiment",
        label_names=["negative", "positive"],
        batch_size=4,
    )
    assert len(data.test) == 2 and len(data.val) == 4 and len(data.private) == 36  # test given: no test fraction
    assert [int(item["labels"]) for item in data.test] == [1, 0]
    assert data.hparams["data"] == str(train) and data.hparams["test"] == str(test)  # paths, never texts
    with pytest.raises(KeyError, match="no column"):
        read_texts(str(train))
    with pytest.raises(ValueError, match="label_names"):
        TextDataModule(str(train), tokenizer=tokenizer, text_column="review", label_column="sentiment")


def test_texts_given_in_memory_never_reach_the_hyperparameters(tokenizer):
    data = TextDataModule({"text": TEXTS, "label": LABELS}, tokenizer=tokenizer, batch_size=4)
    assert "data" not in data.hparams and "tokenizer" not in data.hparams
    assert not any("review number" in str(value) for value in data.hparams.values())


class _ColumnTable:
    """The part of datasets.Dataset that TextDataModule reads: column names, and a column by name."""

    def __init__(self, columns):
        self.columns = columns
        self.column_names = list(columns)

    def __getitem__(self, name):
        return self.columns[name]


def test_a_datasets_dataset_is_read_by_its_columns(tokenizer):
    table = _ColumnTable({"sentence": TEXTS, "label": LABELS})
    assert read_texts(table, text_column="sentence") == (TEXTS, LABELS)
    datasets = pytest.importorskip("datasets")
    real = datasets.Dataset.from_dict({"sentence": TEXTS, "label": LABELS})
    data = TextDataModule(real, tokenizer=tokenizer, text_column="sentence", batch_size=4)
    assert len(data.private) == 32


def test_truncation_cuts_the_text_never_the_template(tokenizer):
    long = "the plot was " + "very " * 40 + "long"
    (ids,) = tokenize_prompts([long], tokenizer, "Review: {text} It was {mask}.", max_length=16)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert len(tokens) == 16 and tokens[:5] == ["[CLS]", "review", ":", "the", "plot"]
    assert tokens[-5:] == ["it", "was", "[MASK]", ".", "[SEP]"]
    plain = tokenize_prompts([long, "short"], tokenizer, "{text}", max_length=16)
    assert [t.tolist() for t in plain] == tokenizer([long, "short"], truncation=True, max_length=16)["input_ids"]


def test_bad_prompts_and_labels_are_refused(tokenizer):
    with pytest.raises(ValueError, match="mask token"):  # the text itself holds [MASK]: two masks
        tokenize_prompts(["a [MASK] b"], tokenizer, "{text} It was {mask}.")
    with pytest.raises(ValueError, match="exactly one"):
        tokenize_prompts(["a"], tokenizer, "no text here")
    with pytest.raises(ValueError, match="longer than max_length"):
        tokenize_prompts(["a"], tokenizer, "a long template around {text} that does not fit", max_length=6)
    with pytest.raises(ValueError, match="class index"):
        TextDataModule((["a", "b", "c"], [0, 1, -1]), tokenizer=tokenizer, batch_size=1)
    with pytest.raises(ValueError, match="tokenizer"):
        TextDataModule((TEXTS, LABELS))
    with pytest.raises(TypeError, match="cannot read"):
        read_texts(42)
    with pytest.raises(ValueError, match=r"\.csv"):
        read_texts("data.parquet")
