"""Fixed batch shapes for half-precision runs: the collate pads to one length, the data module chooses when, and a
private step's forwards all run the same number of rows (pl_dp.methods.precision)."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule, TextGenerationDataModule
from pl_dp.data.collate import PaddingCollate
from pl_dp.errors import ConfigError
from pl_dp.methods import DPSGD, DPZero
from pl_dp.nets import CausalLM
from pl_dp.nets.hf import model_positions
from pl_dp.step.batches import fill_rows
from tests.conftest import blobs, make_trainer
from tests.tiny_hf import CORPUS, tiny_model

TEXTS = [f"{text} number {i}" for i, text in enumerate(CORPUS)]
SPEC = PrivacySpec(epsilon=8.0, accountant="rdp")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("gpt2"), "gpt2")


def test_a_fixed_length_pads_every_sequence_field_and_leaves_feature_vectors_alone():
    collate = PaddingCollate(length=6)
    batch = collate([{"input_ids": torch.tensor([5, 6]), "labels": torch.tensor([5, 6])}] * 2)  # equally long
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, 6)
    assert batch["labels"][0, 2:].eq(-100).all() and batch["attention_mask"][0].tolist() == [1, 1, 0, 0, 0, 0]
    tokens, label = collate([(torch.tensor([1, 2, 3]), torch.tensor(1)), (torch.tensor([4]), torch.tensor(0))])
    assert tokens.tolist() == [[1, 2, 3, 0, 0, 0], [4, 0, 0, 0, 0, 0]] and label.shape == (2,)
    features, _ = collate([(torch.ones(4), torch.tensor(1)), (torch.zeros(4), torch.tensor(0))])
    assert features.shape == (2, 4)  # one length, floating point: a feature vector, not a sequence
    with pytest.raises(ValueError, match="longer than the fixed padded length 6"):
        collate([(torch.arange(1, 9), torch.tensor(1))])
    assert PaddingCollate()([{"input_ids": torch.tensor([5, 6])}] * 2)["input_ids"].shape == (2, 2)  # dynamic


class _TaggedCollate(PaddingCollate):
    """A user's subclass that adds a key of its own to every batch."""

    def __call__(self, examples):
        return {**super().__call__(examples), "source": torch.ones(len(examples))}


def test_a_fixed_length_copy_of_a_subclass_keeps_what_the_subclass_adds(gpt2_dir):
    """The private loader of a run that keeps one shape, and the probe, pad with a fixed-length copy of the data
    module's collate: it was a plain PaddingCollate, which dropped a subclass's own behaviour in those batches only."""
    data = TextGenerationDataModule(data=TEXTS, tokenizer=gpt2_dir, max_length=40)
    data.collate_fn = _TaggedCollate(data.collate_fn.pad_values)
    for collate in (data.private_collate(True), data.longest_collate()):
        batch = collate([data.private[i] for i in range(4)])
        assert isinstance(collate, _TaggedCollate) and "source" in batch and collate is not data.collate_fn
    assert data.collate_fn.length is None
    with pytest.raises(ConfigError, match="length must be"):
        data.collate_fn.fixed(0)


def test_a_missing_mask_is_built_from_the_token_ids_whatever_key_comes_first():
    """Labels of another length than the inputs (a prompt's answer), listed first: the mask was built from them."""
    examples = [
        {"labels": torch.tensor([7, 8, 9, 10]), "input_ids": torch.tensor([1, 2])},
        {"labels": torch.tensor([7]), "input_ids": torch.tensor([3, 4, 5])},
    ]
    batch = PaddingCollate()(examples)
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["attention_mask"].shape == batch["input_ids"].shape
    # the ids of one length, the labels ragged: the mask is still the ids' (it was the labels', 5 wide)
    examples = [
        {"labels": torch.tensor([7, 8, 9, 10, 11]), "input_ids": torch.tensor([1, 2, 3])},
        {"labels": torch.tensor([7, 8]), "input_ids": torch.tensor([4, 5, 6])},
    ]
    batch = PaddingCollate()(examples)
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]


def test_the_longest_padding_stops_at_a_table_of_absolute_positions_only(tmp_path):
    """GPT-2 indexes its position table with every padded position, so no batch of it is longer than its 64; Llama
    (rotary) reads a record of 128 tokens, and the checks pad to the data module's max_length for it."""
    for architecture, padded in (("gpt2", 64), ("llama", 128)):
        path = tiny_model(tmp_path / architecture, architecture)
        data = TextGenerationDataModule(data=TEXTS, tokenizer=path, max_length=128)
        batch = data.longest_collate(net=CausalLM(model_path=path))([data.private[i] for i in range(2)])
        assert batch["input_ids"].shape[1] == padded


def test_fill_rows_repeats_the_first_example_up_to_the_rows():
    batch = {"x": torch.arange(6).reshape(3, 2), "y": torch.tensor([7, 8, 9])}
    filled = fill_rows(batch, 5)
    assert filled["y"].tolist() == [7, 8, 9, 7, 7] and filled["x"][3:].eq(batch["x"][0]).all()
    assert fill_rows(batch, 3) is batch and fill_rows(batch, 2) is batch


@pytest.mark.parametrize(
    ("fixed_length", "half", "padded"),
    [(None, True, True), (None, False, False), (True, False, True), (False, True, False)],
)
def test_the_private_loader_pads_past_max_length_in_half_precision_or_when_asked(gpt2_dir, fixed_length, half, padded):
    data = TextGenerationDataModule(data=TEXTS, tokenizer=gpt2_dir, max_length=40, fixed_length=fixed_length)
    collate = data.private_collate(half)
    batch = collate([data.private[i] for i in range(4)])
    assert (batch["input_ids"].shape[1] == 41) == padded
    assert data.collate_fn([data.private[i] for i in range(4)])["input_ids"].shape[1] < 40  # other loaders: dynamic


def test_a_batch_of_records_of_max_length_keeps_padding_in_every_row(gpt2_dir):
    """Hugging Face drops the attention mask of a batch with no padded row (and a GPU then runs FlashAttention, which
    rounds otherwise): the private batches pad one position past the longest record a data module can hold."""
    data = TextGenerationDataModule(
        data=[" ".join(TEXTS)] * 8, tokenizer=gpt2_dir, max_length=40, val_fraction=0.0, test_fraction=0.0, batch_size=4
    )
    batch = data.private_collate(True)([data.private[i] for i in range(4)])
    assert batch["attention_mask"][:, :40].eq(1).all() and batch["attention_mask"][:, 40].eq(0).all()


def test_a_max_length_that_leaves_the_model_no_position_for_padding_is_refused(gpt2_dir):
    """The tiny GPT-2 reads 64 positions: a private batch of records up to 64 tokens padded to 65 would index past
    its position table (an IndexError from inside the pre-flight pass); it is refused by name before any step."""
    net = CausalLM(model_path=gpt2_dir)
    assert model_positions(net) == 64 and model_positions(nn.Linear(2, 2)) is None
    data = TextGenerationDataModule(data=TEXTS, tokenizer=gpt2_dir, max_length=64, batch_size=8)
    model = DPZero(net, loss="causal_lm", privacy=SPEC, noise_seed=0)
    with pytest.raises(ConfigError, match="set max_length to 63 at most"):
        make_trainer(max_steps=1, limit_val_batches=0).fit(model, data)
    assert model.private_steps == 0
    assert data.private_collate(False, positions=64) is data.collate_fn  # a run that pads dynamically is not refused
    data = TextGenerationDataModule(data=TEXTS, tokenizer=gpt2_dir, max_length=63)
    assert data.private_collate(True, positions=64)([data.private[0]])["input_ids"].shape == (1, 64)


def test_fixed_length_true_needs_a_length():
    data = PrivatePublicDataModule(blobs(40), batch_size=8, fixed_length=True)
    with pytest.raises(ConfigError, match=r"PaddingCollate\(length=...\)"):
        data.private_collate()
    given = PaddingCollate(length=12)
    data = PrivatePublicDataModule(blobs(40), batch_size=8, collate_fn=given, fixed_length=True)
    assert data.private_collate() is given


class _Rows(L.Callback):
    """The input shapes of every forward of the net during the private steps (a forward pre-hook)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.recording = False

    def on_train_start(self, trainer, pl_module):
        pl_module.net.register_forward_pre_hook(self._record, with_kwargs=True)
        check_reference = pl_module.check_reference

        def unrecorded() -> None:  # a fixed validation example, not a private batch
            self.recording = False
            check_reference()

        pl_module.check_reference = unrecorded

    def _record(self, module, args, kwargs):
        if self.recording:
            self.shapes.append(tuple((kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape))

    def on_train_batch_start(self, *args):
        self.recording = True

    def on_train_batch_end(self, *args):
        self.recording = False


@pytest.mark.parametrize(
    "method", ["dpzero-bf16", "dpzero-bf16-mixed", "hooks-bf16-mixed", "dpzero-fp32", "hooks-fp32"]
)
def test_every_private_forward_of_a_half_precision_run_has_one_shape(gpt2_dir, method):
    """bf16 weights or bf16-mixed autocast: every forward of a private step runs [physical_rows, max_length], whatever
    the Poisson batch's size; fp32 keeps whole batches, padded to max_length by a two-point step and to each batch's
    longest by a first-order one."""
    dtype = torch.bfloat16 if method == "dpzero-bf16" else None
    net = CausalLM(model_path=gpt2_dir, dtype=dtype)
    if method.startswith("hooks"):
        model = DPSGD(net, loss="causal_lm", lr=0.1, per_sample="hooks", privacy=SPEC, noise_seed=0)
    else:
        model = DPZero(net, loss="causal_lm", lr=1e-3, privacy=SPEC, noise_seed=0)
    data = TextGenerationDataModule(data=TEXTS, tokenizer=gpt2_dir, batch_size=12, max_length=24, sampling_seed=0)
    rows = _Rows()
    precision = "bf16-mixed" if method.endswith("mixed") else "32-true"
    make_trainer(max_steps=4, precision=precision, callbacks=[rows], limit_val_batches=0).fit(model, data)
    assert model.private_steps == 4 and rows.shapes
    if method.endswith("fp32"):
        assert not model.fixed_shapes and model.physical_rows is None
        assert len({shape[0] for shape in rows.shapes}) > 1  # whole Poisson batches
        lengths = {shape[1] for shape in rows.shapes}
        assert lengths == {25} if method == "dpzero-fp32" else len(lengths) > 1  # max_length + 1
        return
    assert model.fixed_shapes and model.physical_rows == 12
    assert set(rows.shapes) == {(12, 25)}, set(rows.shapes)  # max_length + 1: every row padded


@pytest.mark.parametrize("per_sample", ["ghost", "bk"])
def test_ghost_and_book_keeping_under_autocast_compute_in_fp32_and_keep_dynamic_shapes(gpt2_dir, per_sample):
    model = DPSGD(CausalLM(model_path=gpt2_dir), loss="causal_lm", per_sample=per_sample, privacy=SPEC, noise_seed=0)
    data = TextGenerationDataModule(data=TEXTS, tokenizer=gpt2_dir, batch_size=12, max_length=24, sampling_seed=0)
    make_trainer(max_steps=1, precision="bf16-mixed", limit_val_batches=0).fit(model, data)
    assert model.autocast_dtype is None and not model.fixed_shapes


def test_a_half_precision_frozen_base_makes_the_run_compute_in_half_precision():
    net = nn.Sequential(nn.Linear(4, 8).to(torch.bfloat16), nn.Linear(8, 3))
    net[0].requires_grad_(False)
    model = DPZero(net, privacy=SPEC)
    assert model.computes_in_half_precision and model.fixed_shapes
    assert not DPZero(nn.Linear(4, 3), privacy=SPEC).computes_in_half_precision
    assert not DPZero(net, privacy=None).fixed_shapes  # a non-private baseline keeps its batches as they come


def test_a_half_precision_tensor_dataset_run_fills_its_last_micro_batch():
    """Fixed-size features need no padding to a length; the rows are still fixed (max_physical_batch_size)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.bfloat16)
    model = DPZero(net, privacy=SPEC, noise_seed=0, max_physical_batch_size=8)
    half = [TensorDataset(d.tensors[0].to(torch.bfloat16), d.tensors[1]) for d in (blobs(120), blobs(30, seed=4))]
    data = PrivatePublicDataModule(half[0], val=half[1], batch_size=20, sampling_seed=0)
    rows = _Rows()
    make_trainer(max_steps=3, limit_val_batches=0, callbacks=[rows]).fit(model, data)
    assert model.physical_rows == 8 and rows.shapes and {shape[0] for shape in rows.shapes} == {8}


def test_book_keeping_over_a_bf16_frozen_base_runs_every_forward_at_physical_rows(gpt2_dir):
    """LoRA adapters over a bf16 base: book-keeping computes the base in bf16, so its micro-batches are filled too
    (at width 768 a bf16 matmul's rows depend on the number of rows on this CPU: 0.012·C at b = 133 under ghost
    clipping, found by an independent review; ghost clipping now refuses a half-precision base)."""
    net = CausalLM(model_path=gpt2_dir, dtype=torch.bfloat16, trainable="lora")
    model = DPSGD(net, loss="causal_lm", per_sample="bk", privacy=SPEC, noise_seed=0)
    data = TextGenerationDataModule(data=TEXTS, tokenizer=gpt2_dir, batch_size=12, max_length=24, sampling_seed=0)
    rows = _Rows()
    make_trainer(max_steps=4, callbacks=[rows], limit_val_batches=0).fit(model, data)
    assert model.fixed_shapes and model.physical_rows == 12
    assert {shape[0] for shape in rows.shapes} == {12}, rows.shapes
