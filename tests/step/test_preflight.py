"""pl_dp.step.preflight without Lightning: every kind of unusable private example is named by index, in one error,
before anything is trained; a clean set passes; the net is left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset, default_collate

from pl_dp.data.collate import PaddingCollate
from pl_dp.errors import DataError
from pl_dp.step.losses import cross_entropy
from pl_dp.step.preflight import check_private_set, nonfinite_field
from tests.conftest import RunningInputMean, blobs


class Broken(Dataset):
    """Blobs with one problem planted at each of a few indices."""

    def __init__(self) -> None:
        self.x, self.y = blobs(40).tensors

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        if i == 3:
            raise OSError("file 3.png is truncated")
        x, y = self.x[i].clone(), self.y[i]
        if i == 7:
            x[2] = float("inf")
        if i == 12:
            y = torch.tensor(10)  # the net has 3 classes
        if i == 21:
            x = torch.zeros(5)  # another width: does not batch with the others
        if i == 30:
            x = torch.full((4,), 3e38)  # finite, but the logits overflow
        return x, y


def test_every_bad_example_is_named_by_index_with_what_is_wrong():
    net = nn.Linear(4, 3)
    nn.init.constant_(net.weight, 1.0)  # example 30's logits overflow to inf
    with pytest.raises(DataError) as error:
        check_private_set(Broken(), default_collate, net, cross_entropy, chunk_size=8)
    message = str(error.value)
    assert "5 of its 40 examples unusable" in message
    expected = [
        "example 3: reading it raised OSError: file 3.png is truncated",
        "example 7: a value in [0] is NaN or infinite",
        "example 12: its loss is NaN or infinite (loss='cross_entropy' gives NaN for a label outside the net's "
        "classes)",
        "example 21: it does not batch with example 0",
        "example 30: its loss is NaN or infinite",
    ]
    lines = [line.strip("- ").strip() for line in message.splitlines() if line.startswith("  - ")]
    assert [line[: len(e)] for line, e in zip(lines, expected)] == expected
    assert "preflight=False" in message


def test_a_tensor_datasets_rows_read_at_once_are_checked_as_its_examples_read_one_by_one(monkeypatch):
    """A plain TensorDataset under a collate that stacks its rows is read a chunk at a time, as the private loader
    reads it: the same examples named for the same faults, the same good example reported, as through a collate the
    pass cannot see inside (read and batched example by example)."""
    x, y = blobs(40).tensors
    x[7, 2], x[25, 0] = float("inf"), float("nan")
    y[12] = 10  # the net has 3 classes
    net = nn.Linear(4, 3)
    messages = []
    for collate in (default_collate, lambda examples: default_collate(examples)):
        with pytest.raises(DataError) as error:
            check_private_set(TensorDataset(x, y), collate, net, cross_entropy, chunk_size=8)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    assert "3 of its 40 examples unusable" in messages[0] and "example 25: a value in [0] is NaN" in messages[0]
    clean = TensorDataset(*blobs(40).tensors)
    reports = [
        check_private_set(clean, collate, net, cross_entropy, chunk_size=16)
        for collate in (default_collate, lambda examples: default_collate(examples))
    ]
    assert [(r.examples, r.chunks) for r in reports] == [(40, 3)] * 2
    assert all(torch.equal(a, b) for a, b in zip(reports[0].reference, reports[1].reference))
    assert check_private_set(clean, default_collate, net, cross_entropy, 16, values=False).reference is not None
    reads = []
    read = TensorDataset.__getitem__
    monkeypatch.setattr(TensorDataset, "__getitem__", lambda self, i: reads.append(i) or read(self, i))
    check_private_set(clean, default_collate, net, cross_entropy, chunk_size=16)
    assert reads == [0]  # the good example reported, not 40 reads


def test_a_clean_set_passes_and_the_net_is_left_as_found():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), RunningInputMean(8, "in place"), nn.Dropout(0.5), nn.Linear(8, 3))
    net.train()
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    report = check_private_set(blobs(50), default_collate, net, cross_entropy, chunk_size=16)
    assert (report.examples, report.chunks) == (50, 4)
    assert torch.equal(torch.rand(3), expected)  # the random stream is untouched
    assert net.training and all(m.training for m in net.modules())
    assert torch.equal(net[1].seen, torch.zeros(8))  # a forward that writes a buffer is undone (the probe refuses it)


def test_padded_text_through_the_run_s_collate():
    """Ragged token examples batch through PaddingCollate; an empty one has no token to score."""

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int):
            ids = torch.arange(1, 1 + (0 if i == 4 else i + 2))
            return {"input_ids": ids, "labels": torch.tensor(i % 2)}

    def mean_embedding_loss(net, batch):
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (net(batch["input_ids"]) * mask).sum(1) / mask.sum(1)  # 0/0 for an empty example
        return F.cross_entropy(pooled, batch["labels"], reduction="none")

    with pytest.raises(DataError, match=r"1 of its 6 examples.*\n  - example 4: its loss is NaN or infinite"):
        check_private_set(Tokens(), PaddingCollate(), nn.Embedding(10, 2), mean_embedding_loss, chunk_size=4)


def test_nonfinite_fields_are_located_in_nested_examples():
    assert nonfinite_field({"x": torch.ones(2), "y": [1.0, float("nan")]}) == "['y'][1]"
    assert nonfinite_field((torch.ones(2), torch.tensor(3))) is None
    assert nonfinite_field(torch.tensor([1.0, float("-inf")])) == "the example"


def test_a_loss_that_fails_for_every_example_is_the_loss_s_fault_and_raised_as_it_is():
    def batch_mean(net, batch):
        return cross_entropy(net, batch).mean()  # breaks the per-example contract, whatever the data

    with pytest.raises(ValueError, match="one value per example") as error:
        check_private_set(blobs(30), default_collate, nn.Linear(4, 3), batch_mean, chunk_size=10)
    assert not isinstance(error.value, DataError)
    assert "every example of the pre-flight pass's first batch" in "".join(error.value.__notes__)


def test_the_pre_flight_pass_leaves_no_plain_attribute_it_grew():
    from tests.step.test_independence import GrowingCache

    net = nn.Sequential(nn.Linear(4, 4), GrowingCache(), nn.Linear(4, 3))
    table = net[1].table
    check_private_set(blobs(50), default_collate, net, cross_entropy, chunk_size=16)
    assert net[1].table is table and net[1].seen == []


def test_an_example_of_another_dtype_is_named():
    """PaddingCollate takes the batch's dtype from its first example: one int64 record among float32 ones would turn
    the others' features into integers whenever it came first (the second review)."""
    examples = [(torch.rand(3 + i % 2), torch.tensor(i % 3)) for i in range(10)]
    examples[6] = (torch.tensor([1, 2, 3]), torch.tensor(0))

    def pooled(net, batch):
        return F.cross_entropy(net(batch[0].float().sum(dim=1, keepdim=True)), batch[1], reduction="none")

    with pytest.raises(DataError, match=r"1 of its 10 examples.*\n  - example 6: its structure differs.*int64"):
        check_private_set(examples, PaddingCollate(), nn.Linear(1, 3), pooled, chunk_size=4)
