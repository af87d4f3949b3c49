"""TextDataModule: texts from lists, CSV, JSONL and datasets; splits; prompt tokenization; dynamic padding."""

import csv
import json
import logging
import pickle

import pytest
from transformers import AutoTokenizer

from pl_dp.data import TextDataModule, read_texts, tokenize_prompts
from pl_dp.data.text import carve_splits
from pl_dp.errors import ConfigError
from pl_dp.nets import minilm_path
from pl_dp.privacy.sampling import poisson_sampler_of

TEXTS = [f"review number {i} " + "great " * (i % 5) for i in range(40)]
LABELS = [i % 2 for i in range(40)]
SPLITS = ("private", "public", "val", "test")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)


def _texts(dataset):
    return list(dataset.texts)


def _split_of(data):
    """Each record's split: ``{(text, label): name}`` (an empty public split is None)."""
    splits = {name: getattr(data, name) for name in SPLITS}
    return {
        (text, int(label)): name
        for name, dataset in splits.items()
        if dataset is not None
        for text, label in zip(dataset.texts, dataset.labels)
    }


def test_fractions_split_the_pool_with_a_fixed_seed(tokenizer):
    data = TextDataModule((TEXTS, LABELS), tokenizer=tokenizer, public_fraction=0.1, batch_size=4)
    sizes = {name: len(getattr(data, name)) for name in SPLITS}
    # each Binomial(40, 0.1) and the rest private; pinned: a given pool and seed give the same split in every release
    assert sizes == {"private": 24, "public": 4, "val": 4, "test": 8}
    splits = [set(_texts(getattr(data, name))) for name in SPLITS]
    assert set().union(*splits) == set(TEXTS) and sum(map(len, splits)) == len(TEXTS)
    again = TextDataModule((TEXTS, LABELS), tokenizer=tokenizer, public_fraction=0.1, batch_size=4)
    assert _texts(again.test) == _texts(data.test)  # the split seed is fixed: the same split in every run
    other = TextDataModule((TEXTS, LABELS), tokenizer=tokenizer, public_fraction=0.1, batch_size=4, split_seed=1)
    assert _texts(other.test) != _texts(data.test)
    for dataset in (data.private, data.test):  # labels travel with their texts
        assert all(int(item["labels"]) == LABELS[TEXTS.index(text)] for item, text in zip(dataset, dataset.texts))


POOL = [f"review {i}: " + ("a fine film " if i % 2 else "an awful film ") * (1 + i % 4) for i in range(300)]
POOL_LABELS = [i % 2 for i in range(300)]
NEW = [(f"my private review {k}", k % 2) for k in range(8)]


def test_adding_one_record_moves_no_other_record_between_splits(tokenizer):
    arguments = dict(tokenizer=tokenizer, public_fraction=0.1, batch_size=4)  # val and test: 0.1 each
    before = _split_of(TextDataModule((POOL, POOL_LABELS), **arguments))
    others = [f"another review {i}" for i in range(100)]  # a pool with none of POOL's records
    for text, label in NEW:
        after = _split_of(TextDataModule((POOL + [text], POOL_LABELS + [label]), **arguments))
        assert {record: after[record] for record in before} == before  # every record of D stays where it was
        elsewhere = _split_of(TextDataModule(([text] + others, [label] + [0] * 100), **arguments))
        assert elsewhere[(text, label)] == after[(text, label)]  # the record's own split, whatever the others
    assert set(before.values()) == set(SPLITS)


def test_duplicated_records_share_a_split(tokenizer):
    texts, labels = TEXTS + TEXTS[::-1] + TEXTS, LABELS + LABELS[::-1] + LABELS  # each record three times
    data = TextDataModule((texts, labels), tokenizer=tokenizer, public_fraction=0.1, batch_size=4)
    for name in SPLITS:
        dataset = getattr(data, name)
        assert all(_texts(dataset).count(text) == 3 for text in _texts(dataset))  # no copy elsewhere
    assert sum(len(getattr(data, name)) for name in SPLITS) == len(texts)


def test_fractions_are_expected_shares_of_a_large_pool():
    n, fractions = 20_000, {"test": 0.1, "val": 0.15, "public": 0.05}
    records = ([f"record {i}" for i in range(n)], [i % 3 for i in range(n)])
    splits = carve_splits(records, {}, fractions["test"], fractions["val"], fractions["public"], split_seed=3)
    for name, fraction in (fractions | {"private": 0.7}).items():
        count = len(splits[name][0])
        assert abs(count - n * fraction) < 4 * (n * fraction * (1 - fraction)) ** 0.5, (name, count)
        assert all(label == int(text.split()[1]) % 3 for text, label in zip(*splits[name]))
    with pytest.raises(ConfigError, match="nothing would be left private"):
        carve_splits(records, {}, 0.5, 0.3, 0.2, split_seed=0)
    with pytest.raises(ConfigError, match=r"val_fraction must lie in \[0, 1\)"):
        carve_splits(records, {}, 0.1, 1.0, 0.0, split_seed=0)


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
    assert len(data.test) == 2 and len(data.val) + len(data.private) == 40  # test given: no test fraction
    assert 0 < len(data.val) < 40
    assert [int(item["labels"]) for item in data.test] == [1, 0]
    assert data.hparams["data"] == str(train) and data.hparams["test"] == str(test)  # paths, never texts
    with pytest.raises(KeyError, match="no column"):
        read_texts(str(train))
    with pytest.raises(ConfigError, match="label_names"):
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
    assert _split_of(data) == _split_of(TextDataModule((TEXTS, LABELS), tokenizer=tokenizer, batch_size=4))


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
    with pytest.raises(ConfigError, match="exactly one"):
        tokenize_prompts(["a"], tokenizer, "no text here")
    with pytest.raises(ConfigError, match="longer than max_length"):
        tokenize_prompts(["a"], tokenizer, "a long template around {text} that does not fit", max_length=6)
    with pytest.raises(ConfigError, match="class index"):
        TextDataModule((["a", "b", "c"], [0, 1, -1]), tokenizer=tokenizer, batch_size=1)
    with pytest.raises(ConfigError, match="tokenizer"):
        TextDataModule((TEXTS, LABELS))
    with pytest.raises(TypeError, match="cannot read"):
        read_texts(42)
    with pytest.raises(ConfigError, match=r"\.csv"):
        read_texts("data.parquet")


def test_a_long_private_text_leaves_no_trace_on_the_console_or_the_tokenizer(capfd, caplog, monkeypatch):
    """A text past the model's 512 positions made transformers print a notice and flag the tokenizer (which a net
    holds and a pickle carries) — only when that record is in the data."""
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # its records reach caplog too
    caplog.set_level(logging.DEBUG)
    long = "what a film " * 250  # about 750 tokens
    evaluation = (["so great", "bad"], [1, 0])
    pickles = []
    for texts, labels in ((TEXTS, LABELS), (TEXTS + [long], LABELS + [1])):
        tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)
        capfd.readouterr()
        caplog.clear()
        data = TextDataModule(
            (texts, labels), val=evaluation, test=evaluation, tokenizer=tokenizer, max_length=32, batch_size=4
        )
        assert capfd.readouterr() == ("", "") and caplog.records == []
        assert tokenizer.deprecation_warnings == {}
        pickles.append(pickle.dumps(tokenizer))
    assert long in data.private.texts and pickles[0] == pickles[1]


def test_a_user_column_samples_users_and_keeps_each_user_in_one_split(tmp_path, tokenizer):
    """``user_column``: every record of a user lands in one split, the private loader samples users (one record of
    each), and the user ids reach neither the hyperparameters nor a checkpoint."""
    users = [f"author{i % 7}" if i < 30 else "prolific" for i in range(40)]  # 7 authors of 4-5 texts, one of 10
    path = tmp_path / "texts.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "label", "author"])
        writer.writerows(zip(TEXTS, LABELS, users))
    data = TextDataModule(path, tokenizer=tokenizer, user_column="author", batch_size=2, sampling_seed=0)
    where = _split_of(data)
    split_of_user = {}
    for text, label, user in zip(TEXTS, LABELS, users):
        assert split_of_user.setdefault(user, where[(text, label)]) == where[(text, label)]
    private_users = {user for user in users if split_of_user[user] == "private"}
    assert data.privacy_unit.kind == "user" and data.privacy_unit.population == len(private_users)
    assert data.sample_rate == 2 / len(private_users)
    sampler = poisson_sampler_of(data.train_dataloader())
    texts_of = {text: user for text, user in zip(TEXTS, users)}
    for step in range(50):
        sampled = [texts_of[data.private.texts[i]] for i in sampler.batch(step)]
        assert len(sampled) == len(set(sampled))  # one record per sampled user
    assert data.hparams["user_column"] == "author" and "user_of" not in data.hparams
    with pytest.raises(ConfigError, match="either user_column .* or user_of"):
        TextDataModule(path, tokenizer=tokenizer, user_column="author", user_of=users)


def test_token_ids_are_padded_with_the_tokenizers_pad_token(tmp_path):
    """A decoder's sequence classifier reads the last token that is not its pad token: padded with 0 where the pad
    token is another id (OPT's is 1), every padded row was classified from a padding position (found by review)."""
    from pl_dp.data import TextGenerationDataModule
    from tests.tiny_hf import save_bpe_tokenizer

    save_bpe_tokenizer(tmp_path)
    decoder = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    decoder.pad_token = decoder.eos_token  # id 1, as OPT's
    texts = [["the movie was great", "an awful film that nobody liked at all"][i % 2] + f" {i}" for i in range(40)]
    for data in (
        TextGenerationDataModule(data=texts, tokenizer=decoder, max_length=16, batch_size=4),
        TextDataModule((texts, [0, 1] * 20), tokenizer=decoder, template="{text}", max_length=16, batch_size=4),
    ):
        batch = data.collate_fn([data.private[i] for i in range(len(data.private))])
        padding = batch["attention_mask"] == 0
        assert padding.any() and batch["input_ids"][padding].eq(1).all()
