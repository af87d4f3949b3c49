"""The boundary of the private step (invariant 10), black-box: what surrounds the mechanism — batching,
messages, failures, copies of the module — says nothing about which records were sampled.

Each test runs the public API on D and on D′ (one record more) or on a copy of a trained module, for a
first-order and a zeroth-order method, and fails if the boundary breaks.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import pickle
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset, default_collate

from pl_dp import PrivacySpec
from pl_dp.audit import audit
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import DataError, IndependenceError
from pl_dp.methods import DPSGD, DPZero
from pl_dp.methods.base import PrivateModule
from pl_dp.nets import TinyTransformerClassifier
from pl_dp.per_sample import per_sample_mode_names
from pl_dp.step.distribution import Distribution, Replicated
from tests import catalog
from tests.conftest import blobs, make_trainer

#: the reference method of each family: the base checks batching and records the same way for every method
METHODS = catalog.classes(catalog.REPRESENTATIVES)
SPEC = PrivacySpec(epsilon=5.0, accountant="rdp")


# ---- 1. batching ------------------------------------------------------------------------------------------------
class Sentences(Dataset):
    """Token-id tuples of varied lengths (ids ≥ 1: 0 is padding) and binary labels."""

    def __init__(self, n: int = 48, seed: int = 0, longest: int = 12) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, longest + 1, (n,), generator=g)
        self.tokens = [torch.randint(1, 50, (int(k),), generator=g) for k in lengths]
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i], self.labels[i]


def _transformer(pad_token_id: int | None = 0) -> TinyTransformerClassifier:
    torch.manual_seed(0)
    return TinyTransformerClassifier(
        vocab_size=50, width=16, depth=2, heads=2, max_length=64, pad_token_id=pad_token_id
    )


@pytest.mark.parametrize("cls", METHODS)
def test_one_long_example_moves_the_release_by_at_most_the_clip_bound(cls):
    """The issue's measurement: one 60-token example in a batch of short ones moved the released sum by 3.7·C
    (DP-SGD) and 10·C (DPZero) through padding the net did not mask. With the mask: at most C."""
    long_example = (torch.randint(1, 50, (60,), generator=torch.Generator().manual_seed(7)), torch.tensor(1))
    model = cls(_transformer(), clip=1.0, privacy=PrivacySpec(epsilon=100.0, accountant="rdp", noise_multiplier=1.0))
    data = PrivatePublicDataModule(Sentences(), batch_size=8, fixed_length=False)  # dynamic padding, masked
    result = audit(model, data, trials=20, canary=long_example)
    assert result.canary_influence <= 1.0 + 1e-4, result


@pytest.mark.parametrize("cls", METHODS)
def test_a_net_that_reads_padding_is_refused_through_the_real_collate(cls):
    """Dynamic padding (a zeroth-order run keeps it only by choice: fixed_length=False) and a net that attends to and
    pools over the padding: the probe refuses it, naming the cause."""
    model = cls(_transformer(pad_token_id=None), clip=1.0, privacy=SPEC)
    data = PrivatePublicDataModule(Sentences(), batch_size=8, fixed_length=False)
    with pytest.raises(IndependenceError, match=r"long or outlying example.*padded the batches to different lengths"):
        make_trainer(max_steps=1).fit(model, data)
    assert model.private_steps == 0


def test_a_zeroth_order_run_is_refused_when_its_batches_cannot_have_one_length():
    """The same data without fixed_length=False: a zeroth-order run keeps one padded length (the probe cannot bound a
    sub-ulp dependence on it), and this data module knows no length to pad to — refused before any step, with the
    ways out."""
    model = DPZero(_transformer(pad_token_id=None), clip=1.0, privacy=SPEC)
    refusal = r"one batch shape.*PaddingCollate\(length=\.\.\.\).*fixed_length=False"
    with pytest.raises(IndependenceError, match=refusal):
        make_trainer(max_steps=1).fit(model, PrivatePublicDataModule(Sentences(), batch_size=8))
    assert model.private_steps == 0


def standardize_by_batch(examples):
    """A common tabular habit that mixes examples: each batch's features standardized by that batch's statistics."""
    x, y = default_collate(examples)
    return (x - x.mean(dim=0)) / (x.std(dim=0) + 1e-6), y


@pytest.mark.parametrize("cls", METHODS)
def test_a_collate_that_standardizes_by_batch_is_refused_by_name(cls):
    model = cls(nn.Linear(4, 3), clip=1.0, privacy=SPEC)
    data = PrivatePublicDataModule(blobs(100), batch_size=20, collate_fn=standardize_by_batch)
    with pytest.raises(IndependenceError, match=r"collate_fn \(standardize_by_batch\) mixes them"):
        make_trainer(max_steps=1).fit(model, data)
    assert model.private_steps == 0


@pytest.mark.parametrize("cls", METHODS)
def test_the_audit_batches_through_the_run_s_own_collate(cls, monkeypatch):
    """A mixing collate that the probe were blind to must show in the audit: the canary then moves every row."""
    monkeypatch.setattr(PrivateModule, "check_independence", lambda self: None)
    model = cls(nn.Linear(4, 3), clip=1.0, privacy=PrivacySpec(epsilon=100.0, accountant="rdp", noise_multiplier=1.0))
    data = PrivatePublicDataModule(blobs(100), batch_size=8, collate_fn=standardize_by_batch)
    result = audit(model, data, trials=20, reference_size=8)
    assert result.canary_influence > 1.5, result  # default_collate would have shown 1.0


def test_left_padding_for_a_causal_prompt_is_refused_by_name(tmp_path):
    from transformers import DataCollatorWithPadding

    from pl_dp.data import TextDataModule
    from pl_dp.nets import PromptClassifier
    from tests.tiny_hf import tiny_model

    net = PromptClassifier(["terrible", "great"], model_path=tiny_model(tmp_path / "gpt2", "gpt2"))
    texts = ["the movie was great", "terrible", "a fine film and a great cast", "awful plot"] * 6
    data = TextDataModule(
        (texts, [1, 0, 1, 0] * 6), prompt=net, batch_size=6, val_fraction=0.25, test_fraction=0, fixed_length=False
    )  # dynamic padding by choice: the probe is the guard
    net.tokenizer.padding_side = "left"  # usual for causal LMs; PromptClassifier reads its last token on the right
    data.collate_fn = DataCollatorWithPadding(net.tokenizer)
    model = DPZero(net, clip=1.0, privacy=SPEC)
    with pytest.raises(IndependenceError, match=r"collate_fn \(DataCollatorWithPadding\) mixes them.*left padding"):
        make_trainer(max_steps=1).fit(model, data)


# ---- 2. and 3. a bad record: found before training, silent and harmless inside it --------------------------------
def _with_record(x: torch.Tensor | None = None, label: int | None = None) -> TensorDataset:
    data = blobs(100)
    xs, ys = data.tensors
    extra_x = xs[:1].clone() if x is None else x.reshape(1, -1)
    extra_y = ys[:1].clone() if label is None else torch.tensor([label])
    return TensorDataset(torch.cat([xs, extra_x]), torch.cat([ys, extra_y]))


BAD_RECORDS = {
    "nan-feature": (dict(x=torch.tensor([float("nan"), 0.0, 0.0, 0.0])), r"example 100: a value in \[0\] is NaN"),
    "label-out-of-range": (dict(label=10), r"example 100: its loss is NaN .*a label outside the net's classes"),
}


@pytest.mark.parametrize("record", list(BAD_RECORDS))
@pytest.mark.parametrize("cls", METHODS)
def test_the_pre_flight_pass_names_a_bad_record_before_any_release(cls, record):
    kwargs, message = BAD_RECORDS[record]
    model = cls(nn.Linear(4, 3), clip=1.0, privacy=SPEC)
    with pytest.raises(DataError, match=rf"1 of its 101 examples unusable.*\n  - {message}"):
        make_trainer(max_steps=2).fit(model, PrivatePublicDataModule(_with_record(**kwargs), batch_size=10))
    assert model.private_steps == 0 and not model.accountant.history


def _run_and_capture(cls, dataset, net=None, preflight=False, **method) -> tuple[int, list[str]]:
    """Private steps made and everything the run said: warnings, log records, stdout and stderr."""
    torch.manual_seed(0)
    net = nn.Linear(4, 3) if net is None else net
    model = cls(net, clip=1.0, lr=0.1, privacy=SPEC, preflight=preflight, **method)
    data = PrivatePublicDataModule(dataset, batch_size=50)  # rate ≈ 0.5: the record is sampled in most steps
    out, err, records = io.StringIO(), io.StringIO(), []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
            warnings.simplefilter("always")
            with contextlib.redirect_stderr(err):
                make_trainer(max_steps=6).fit(model, data)
    finally:
        logging.getLogger().removeHandler(handler)
    said = [f"{w.category.__name__}: {w.message}" for w in caught] + [r.getMessage() for r in records]
    return model.private_steps, sorted(said) + [out.getvalue(), err.getvalue()]


@pytest.mark.parametrize("record", list(BAD_RECORDS))
@pytest.mark.parametrize("cls", METHODS)
def test_with_the_pre_flight_off_a_bad_record_changes_nothing_a_run_says_or_how_it_ends(cls, record):
    """On main the NaN record raised a warning in 3/3 runs with it and 0/3 without; the out-of-range label crashed
    the run with IndexError at the step that sampled it. Now: the same steps, the same words, with or without it."""
    steps, said = _run_and_capture(cls, blobs(100))
    steps_with, said_with = _run_and_capture(cls, _with_record(**BAD_RECORDS[record][0]))
    assert steps == steps_with == 6
    assert said == said_with


@pytest.mark.parametrize("cls", METHODS)
def test_the_private_diagnostics_score_an_out_of_range_label_without_ending_the_run(cls):
    """log_private_metrics logs the un-noised training loss and accuracy of each batch (a mode that says it is not
    private) — it scored the batch with F.cross_entropy, which raised IndexError (on CUDA: a device-side assert) at
    the step that sampled the record, outside the seal (an independent review). Now the record's loss is NaN there
    too and it is left out of the accuracy: the run makes the same steps, with or without it."""
    steps, _ = _run_and_capture(cls, blobs(100), log_private_metrics=True)
    steps_with, _ = _run_and_capture(cls, _with_record(label=10), log_private_metrics=True)
    assert steps == steps_with == 6


class Unreliable(Dataset):
    """blobs(100), plus record X at index 100 whose reading warns and, with ``fails``, raises after its first read
    (a file on a failing disk: the pre-flight pass reads it fine, training does not)."""

    def __init__(self, with_x: bool, fails: bool) -> None:
        self.data, self.with_x, self.fails, self.reads = blobs(100), with_x, fails, 0

    def __len__(self) -> int:
        return 100 + self.with_x

    def __getitem__(self, i: int):
        if i == 100:
            warnings.warn("record 100: truncated, padded with zeros", UserWarning, stacklevel=1)
            self.reads += 1
            if self.fails and self.reads > 1:
                raise OSError("record 100 is unreadable")
            return torch.zeros(4), torch.tensor(0)
        return self.data[i]


@pytest.mark.parametrize("fails", [False, True], ids=["warns", "raises"])
@pytest.mark.parametrize("cls", METHODS)
def test_a_record_that_warns_or_fails_when_read_changes_nothing_a_run_says_or_how_it_ends(cls, fails):
    """Reading happens in the loader, outside the step; and the pre-flight pass reads every record (it is sealed too:
    the record passes it, and nothing it says shows)."""
    steps, said = _run_and_capture(cls, Unreliable(False, fails), preflight=True)
    steps_with, said_with = _run_and_capture(cls, Unreliable(True, fails), preflight=True)
    assert steps == steps_with == 6
    assert said == said_with


class Shouting(nn.Module):
    """A net that warns, logs and prints on inputs it finds odd (the outlier record's), and computes normally."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.abs() > 50).any()):
            warnings.warn("input clamped", UserWarning, stacklevel=1)
            logging.getLogger("shouting").warning("input clamped")
            print("note: input clamped")
        return self.linear(x.clamp(-50, 50))


@pytest.mark.parametrize("cls", METHODS)
def test_what_the_net_says_during_the_fit_start_checks_does_not_show(cls):
    """The pre-flight pass runs the net on every private record, the probe on some: their messages are private."""
    odd = _with_record(x=torch.full((4,), 99.0))
    steps, said = _run_and_capture(cls, blobs(100), net=Shouting(), preflight=True)
    steps_with, said_with = _run_and_capture(cls, odd, net=Shouting(), preflight=True)
    assert steps == steps_with == 6
    assert said == said_with


class ExtraKey(Dataset):
    """Dict examples; record X at index 1 carries a stray key, which breaks the batch only when X comes first."""

    def __init__(self, with_x: bool) -> None:
        x, y = blobs(60).tensors
        self.rows = [{"x": x[i], "labels": y[i]} for i in range(60)]
        if with_x:
            self.rows.insert(1, {"x": x[0].clone(), "labels": y[0].clone(), "meta": torch.tensor(1.0)})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]


def _dict_loss(net, batch):
    return F.cross_entropy(net(batch["x"]), batch["labels"], reduction="none")


@pytest.mark.parametrize("cls", METHODS)
def test_a_record_that_breaks_the_batch_only_in_some_positions_is_named_before_training(cls):
    """The first review's case: X batches when it is not first, and makes PaddingCollate raise KeyError when it is the
    lowest index sampled. On main: a crash at that step. Its structure differs, which the pre-flight pass names."""
    model = cls(nn.Linear(4, 3), loss=_dict_loss, clip=1.0, lr=0.1, privacy=SPEC)
    with pytest.raises(DataError, match=r"example 1: its structure differs"):
        make_trainer(max_steps=40).fit(model, PrivatePublicDataModule(ExtraKey(True), batch_size=6))
    assert model.private_steps == 0


class SomeWithAKey(Dataset):
    """The second review's case: records 10–29 carry an extra key; the rest, record 0 included, do not."""

    def __init__(self) -> None:
        x, y = blobs(60).tensors
        self.rows = [
            {"x": x[i], "labels": y[i]} | ({"meta": torch.tensor(1.0)} if 10 <= i < 30 else {}) for i in range(60)
        ]

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int):
        return self.rows[i]


def test_records_of_another_structure_are_named_before_training():
    """They batched among themselves and made a batch fail whenever another record came first: the pre-flight pass
    names them (the collate batches by the first example's keys and dtypes)."""
    model = DPSGD(nn.Linear(4, 3), loss=_dict_loss, clip=1.0, privacy=SPEC)
    with pytest.raises(DataError, match=r"20 of its 60 examples.*\n  - example 10: its structure differs"):
        make_trainer(max_steps=1).fit(model, PrivatePublicDataModule(SomeWithAKey(), batch_size=6))


def test_the_private_loader_leaves_an_example_out_by_its_own_structure_alone():
    """On the previous commit, adding one record to a batch could make the collate drop five others (sensitivity
    unbounded). Now which examples a batch holds is, for each example, a function of that example alone."""
    data = SomeWithAKey()
    loader = PrivatePublicDataModule(data, batch_size=6).train_dataloader()
    collate = loader.collate_fn
    collate.expect(data[0])  # what the pre-flight pass would find, were these records not refused
    for batch in ([12, 15, 18, 21, 24], [3, 5], [3, 12, 40]):
        alone = {i: len(collate([data[i]])["x"]) for i in batch}
        together = collate([data[i] for i in batch])
        assert len(together["x"]) == sum(alone.values())
        with_one_more = collate([data[i] for i in [33, *batch]])
        assert len(with_one_more["x"]) == len(together["x"]) + 1


def test_a_tensor_dataset_s_examples_are_batched_without_comparing_each_one_s_structure(monkeypatch):
    """A TensorDataset's examples are rows of the same tensors, of one structure by construction: comparing each
    sampled example's structure (a cost of every step) could leave none out, so the private loader does not."""
    from pl_dp.privacy import sampling

    data = blobs(60)
    collate = PrivatePublicDataModule(data, batch_size=6).train_dataloader().collate_fn
    collate.expect(data[0])
    compared = []
    structure = sampling.example_structure
    monkeypatch.setattr(sampling, "example_structure", lambda example: compared.append(example) or structure(example))
    x, y = collate([data[i] for i in (3, 7, 11)])
    assert compared == []
    assert torch.equal(x, data.tensors[0][[3, 7, 11]]) and torch.equal(y, data.tensors[1][[3, 7, 11]])
    collate = PrivatePublicDataModule(SomeWithAKey(), batch_size=6).train_dataloader().collate_fn
    collate.expect(SomeWithAKey()[0])
    compared.clear()
    collate([SomeWithAKey()[i] for i in (3, 5)])
    assert len(compared) == 2  # any other dataset's examples are still compared, each one


def test_an_empty_batch_does_not_read_a_record():
    """The empty batch was collated from dataset[0] at the step that sampled nothing: a flaky record 0 ended the run
    then. It is built at fit start now."""

    class FlakyFirst(Dataset):
        def __init__(self) -> None:
            self.data, self.broken = blobs(50), False

        def __len__(self) -> int:
            return 50

        def __getitem__(self, i: int):
            if i == 0 and self.broken:
                raise OSError("record 0 is on a disk that just failed")
            return self.data[i]

    data = FlakyFirst()
    loader = PrivatePublicDataModule(data, batch_size=5).train_dataloader()
    loader.collate_fn.expect(data[0])
    data.broken = True
    x, y = loader.collate_fn([])
    assert x.shape == (0, 4) and y.shape == (0,)


def test_a_dataset_whose_getitems_returns_columns_is_passed_through():
    class Columns(Dataset):
        def __init__(self) -> None:
            self.x, self.y = blobs(40).tensors

        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int):
            return {"x": self.x[i], "labels": self.y[i]}

        def __getitems__(self, indices):
            return {"x": self.x[indices], "labels": self.y[indices]}

    def columns(batch):  # the user's collate for such a dataset: columns as they come, or examples stacked
        return batch if isinstance(batch, dict) else default_collate(batch)

    model = DPSGD(nn.Linear(4, 3), loss=_dict_loss, clip=1.0, privacy=SPEC, preflight=False)
    data = PrivatePublicDataModule(Columns(), val=Columns(), batch_size=8, collate_fn=columns)
    loader = data.train_dataloader()
    assert len(next(iter(loader))["x"]) > 0  # the batch, not its keys
    make_trainer(max_steps=2, limit_val_batches=0).fit(model, data)


def test_a_loader_pl_dp_did_not_build_is_accepted_with_a_warning_that_it_is_not_sealed():
    from opacus.data_loader import DPDataLoader
    from torch.utils.data import DataLoader

    model = DPSGD(nn.Linear(4, 3), clip=1.0, privacy=SPEC)
    loader = DPDataLoader.from_data_loader(DataLoader(blobs(100), batch_size=10))
    with pytest.warns(UserWarning, match="reading and batching are not sealed"):
        make_trainer(max_steps=1).fit(model, train_dataloaders=loader)


# ---- 4. copies of a module or a sampler carry no secret ------------------------------------------------------------
def _trained(cls, sampling_seed=None, **kwargs):
    model = cls(nn.Linear(4, 3), clip=1.0, privacy=SPEC, **kwargs)
    public = blobs(80, seed=3) if model.requires_public_data else None
    data = PrivatePublicDataModule(blobs(100), public=public, batch_size=20, sampling_seed=sampling_seed)
    trainer = make_trainer(max_steps=2)
    trainer.fit(model, data)
    return model, trainer.train_dataloader.batch_sampler


def _noise(model, step: int) -> torch.Tensor:
    model.noise.start_step(step)
    return model.noise.normal((16,), 1.0)


COPIES = {
    "pickle": lambda obj, path: pickle.loads(pickle.dumps(obj)),
    "deepcopy": lambda obj, path: copy.deepcopy(obj),
    "torch.save": lambda obj, path: (
        torch.save(obj, path / "copy.pt"),
        torch.load(path / "copy.pt", weights_only=False),
    )[1],
}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("cls", catalog.classes(accountable="rdp"))  # SPEC's accountant: not O2NC's tree
def test_a_copy_of_the_module_replays_neither_its_noise_nor_its_batches(cls, how, tmp_path):
    """On main a loaded ``torch.save(model)`` reproduced every step's noise and batches."""
    model, sampler = _trained(cls)
    clone = COPIES[how](model, tmp_path)
    # the next steps' noise (the model's key refuses to draw again the steps it drew: a replay)
    steps = range(model.private_steps, model.private_steps + 5)
    assert all(not torch.equal(_noise(clone, t), _noise(model, t)) for t in steps)
    assert all(clone._sampler.batch(i) != model._sampler.batch(i) for i in range(5))
    clone_sampler = COPIES[how](sampler, tmp_path)
    assert all(clone_sampler.batch(i) != sampler.batch(i) for i in range(5))


class _Tensors(pickle.Pickler):
    """Records every tensor a pickle of an object holds."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.tensors: list[torch.Tensor] = []

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
        return NotImplemented


class _LastBatch(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.size = len(batch[1])


@pytest.mark.parametrize("per_sample", per_sample_mode_names())
def test_a_copy_of_a_first_order_module_holds_nothing_the_size_of_a_batch(per_sample):
    """Opacus' ghost clipping kept the last batch's per-example gradient norms, which pickles carried."""
    torch.manual_seed(0)
    model = DPSGD(nn.Linear(4, 3), clip=1.0, privacy=SPEC, per_sample=per_sample)
    last = _LastBatch()
    make_trainer(max_steps=3, callbacks=[last]).fit(model, PrivatePublicDataModule(blobs(200), batch_size=37))
    recorder = _Tensors()
    recorder.dump(model)
    parameter_shapes = {tuple(p.shape) for p in model.parameters()}
    batch_sized = [t for t in recorder.tensors if t.numel() and t.shape[0] == last.size]
    assert last.size not in (3, 4) and not [t for t in batch_sized if tuple(t.shape) not in parameter_shapes]


@pytest.mark.parametrize("noise_seed", [None, 5])
def test_dropout_inside_a_private_step_is_drawn_from_a_secret_generator(noise_seed):
    """Dropout masks from the public global generator (seed_everything) let whoever knows its state see that one
    example more shifts the others' masks (the reviewer measured 1.8 C to 3.2 C). Two runs of one config, seeds and
    all, must draw different masks — unless the user seeded the secrets (reproduction mode)."""
    patterns = []
    for _ in range(2):
        L.seed_everything(0, verbose=False)
        seen: list = []  # training-mode masks, by a hook (a plain attribute of the net is restored after steps)
        net = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5), nn.Linear(64, 3))
        net[1].register_forward_hook(
            lambda module, args, out, seen=seen: seen.append(out == 0) if module.training else None
        )
        model = DPSGD(net, clip=1.0, privacy=SPEC, noise_seed=noise_seed)
        data = PrivatePublicDataModule(blobs(100), batch_size=20, sampling_seed=1)
        make_trainer(max_steps=1).fit(model, data)
        patterns.append(seen[-1])  # the private step's (the fit-start probe's come first)
    assert torch.equal(patterns[0], patterns[1]) == (noise_seed is not None)


class _NoVmap(torch.autograd.Function):
    """An autograd.Function with no vmap rule: torch.func.vmap refuses it, plain autograd runs it."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _TrainOnlyFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        out = self.linear(x)
        return _NoVmap.apply(out) if self.training else out


def test_a_net_that_fails_for_every_example_raises_when_a_validation_example_fails_too():
    """A failing example sits its step out; when a fixed validation example fails too — checked at the first step
    and on the loggers' cadence, whatever was sampled — the net is at fault and the run says so (it trained on noise
    alone, silently, before)."""
    model = DPSGD(_TrainOnlyFunction(), clip=1.0, privacy=SPEC, per_sample="functorch")
    data = PrivatePublicDataModule(blobs(100), val=blobs(20, seed=3), batch_size=20)
    with pytest.raises(RuntimeError, match="vmap") as error:
        make_trainer(max_steps=2, limit_val_batches=0).fit(model, data)
    assert "the net or the loss fails, not a record" in "".join(getattr(error.value, "__notes__", []))
    assert model.private_steps == 1  # raised after the first step, at the check that follows it


@pytest.mark.parametrize("cls", METHODS)
def test_user_seeded_secrets_are_public_and_copies_keep_them(cls):
    model, sampler = _trained(cls, noise_seed=3, sampling_seed=4)
    clone = copy.deepcopy(model)
    assert torch.equal(_noise(clone, 2), _noise(model, 2))
    assert copy.deepcopy(sampler).batch(3) == sampler.batch(3)


def test_a_copy_holds_no_un_noised_count_and_none_of_this_fits_set_up():
    model = DPZero(nn.Linear(4, 3), loss=_nan_for_every_example, clip=1.0, privacy=SPEC, preflight=False)
    make_trainer(max_steps=2).fit(model, PrivatePublicDataModule(blobs(40), batch_size=20))
    assert model.nonfinite_total > 0
    model.collective_bytes = 8
    model.distribution = Replicated(lambda tensor: tensor)  # as a DDP fit sets it up
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert clone.nonfinite_total == 0 and clone.collective_bytes == 0
        assert type(clone.distribution) is Distribution  # one process, until a trainer sets one up


def _nan_for_every_example(net, batch):
    x, y = batch
    return F.cross_entropy(net(x), y, reduction="none") * float("nan")


class _GrowingTable(nn.Module):
    """A positional table grown, as a plain attribute, to the longest input seen (as many models' caches are)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 2)
        self.table = torch.zeros(1, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > len(self.table):
            self.table = torch.zeros(tokens.shape[1], 8, device=tokens.device)
        mask = (tokens != 0).unsqueeze(-1).float()
        hidden = (self.embed(tokens) + self.table[: tokens.shape[1]].to(tokens.device)) * mask
        return self.head(hidden.sum(dim=1) / mask.sum(dim=1).clamp_min(1))


@pytest.mark.parametrize("cls", METHODS)
def test_what_a_net_stores_from_a_private_batch_does_not_stay_in_copies_of_it(cls):
    """The third review: a table grown to the longest record sampled stayed on the net, so torch.save(model) said
    whether one long record was in the data (length 9 without it, 37 with it)."""
    lengths = {}
    for with_x in (False, True):
        data = Sentences(longest=9)
        if with_x:
            data.tokens.append(torch.randint(1, 50, (37,), generator=torch.Generator().manual_seed(3)))
            data.labels = torch.cat([data.labels, torch.tensor([1])])
        model = cls(_GrowingTable(), clip=1.0, privacy=SPEC)
        make_trainer(max_steps=5).fit(model, PrivatePublicDataModule(data, batch_size=24, fixed_length=False))
        lengths[with_x] = len(copy.deepcopy(model).net.table)
    assert lengths[False] == lengths[True] == 1  # as constructed: nothing of a private batch


def test_the_structure_every_example_has_is_checked_without_the_pre_flight_s_losses_too():
    """preflight=False skips values and losses, not the structure: with one int64 record among float32 ones, the
    loader's batching rule would have had no structure to hold, and that record, coming first, turned the others'
    features into integers (the third review)."""
    examples = [(torch.rand(4), torch.tensor(i % 3)) for i in range(60)]
    examples[7] = (torch.tensor([1, 2, 3, 4]), torch.tensor(0))
    model = DPSGD(nn.Linear(4, 3), clip=1.0, privacy=SPEC, preflight=False)
    with pytest.raises(DataError, match=r"example 7: its structure differs.*int64"):
        make_trainer(max_steps=1).fit(model, PrivatePublicDataModule(examples, batch_size=6))
