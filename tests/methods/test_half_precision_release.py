"""Half precision, black box: a record may move what a private step releases by its own clipped contribution only.

Each test runs the public API — a method, a data module, a quiet Trainer with the run's ``precision`` — and measures
with :func:`pl_dp.audit.release_shift` how far the noise-free release of one step moves between D (the whole
private set, b = |D| = 256 at sample rate 1) and D ∪ {canary}, the canary in the first row, in units of the clip
bound C (issue 37).

The canary trick. The silent canary is a long sequence (44 tokens; the others have 6 to 9) whose labels are all
−100: its loss is 0 at every θ, so its own contribution — clipped two-point difference, clipped gradient — is
exactly 0, yet it changes the batch's padded length. Whatever the release moves is then the *other* examples'
contributions moving with the batch's shape: in bf16 (weights, or ``bf16-mixed`` autocast) every other sequence's
loss rounds differently when the batch is padded to another length, by ~1e-4, and a zeroth-order step divides that
by 2λ = 2e-3.

The tolerance. The others may move by at most ``TOLERANCE`` = 0.01·C, the tolerance the privacy report states.
Measured here with dynamic padding: 2e-3·C in fp32, 0.06 to 0.8·C in half precision; padded to one fixed length:
0 (5e-6·C for ghost clipping, which computes in fp32). A canary with labels moves the release by its own clipped
contribution as well: at most C, so at most ``1 + TOLERANCE`` in all. The zeroth-order steps use q = 4 directions,
and the shift is the root mean square of the q released scalars' moves (‖v‖·b/(C·√q)): one direction along which
the others happen to be clipped matters less.

Nets and data that cannot meet this are refused at fit start, before any private step, with an
:class:`~pl_dp.step.independence.IndependenceError` that names the cause and the fix.

Three cases that repeat another's path with other weights or another method take 12 to 27 s each on a CPU: they are
``slow`` there (``make test-slow``) and run with the rest under ``make test-gpu``, where the kernels depend on shape.
"""

import json
import random

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, TensorDataset

from pl_dp import PrivacySpec
from pl_dp.audit import release_shift
from pl_dp.data import PrivatePublicDataModule, TextGenerationDataModule
from pl_dp.data.collate import PaddingCollate
from pl_dp.data.generation import tokenize_sequences
from pl_dp.errors import ConfigError, IndependenceError
from pl_dp.methods import DPSGD, DPZero
from pl_dp.nets import CausalLM
from pl_dp.step import attention
from pl_dp.step.losses import IGNORE_INDEX, causal_lm
from tests.conftest import DEVICE, blobs, make_trainer
from tests.tiny_hf import tiny_model

#: how far a record whose own contribution is 0 may move the release, in units of C
TOLERANCE = 0.01
#: the private set, all of it in every batch (sample rate 1): b = 256
SIZE = 256
MAX_LENGTH = 48
_PHRASES = ["the movie was great", "the plot was terrible", "a fine film", "an awful film", "the actors were great"]
TEXTS = [f"{_PHRASES[i % 5]} {i}" for i in range(SIZE)]  # 5 to 9 tokens with the end token
#: ``slow`` on a CPU only: under ``make test-gpu`` these cases run with the fast ones
SLOW_ON_CPU = pytest.mark.slow if DEVICE.type == "cpu" else ()
SPEC = PrivacySpec(epsilon=100.0, noise_multiplier=1.0, accountant="rdp")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """The tiny GPT-2, without dropout: a first-order step runs in training mode, where dropout masks would depend
    on the batch's shape too; the measurement isolates rounding."""
    path = tiny_model(tmp_path_factory.mktemp("gpt2"), "gpt2")
    config = json.loads((path / "config.json").read_text())
    config.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _texts(gpt2_dir) -> TextGenerationDataModule:
    return TextGenerationDataModule(
        data=TEXTS, tokenizer=gpt2_dir, max_length=MAX_LENGTH, val_fraction=0.0, test_fraction=0.0, batch_size=SIZE
    )


def _long_sequence(tokenizer, labelled: bool) -> dict[str, torch.Tensor]:
    """One item as :class:`~pl_dp.data.generation.TokenSequences` gives it: " great" 43 times and the end token; with
    ``labelled=False`` every label is −100 (no target: loss 0 and gradient 0 at every θ). With labels, its clipped
    differences are ±C along most directions (one token, predicted 43 times: a steep loss)."""
    ids = torch.tensor(tokenizer(" great" * 43)["input_ids"] + [tokenizer.eos_token_id])
    labels = ids.clone() if labelled else torch.full_like(ids, IGNORE_INDEX)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _dpzero(net: nn.Module, loss="causal_lm") -> DPZero:
    torch.manual_seed(0)  # the directions: seeded from torch's initial seed
    return DPZero(net, loss=loss, clip=1.0, smoothing=1e-3, queries=4, privacy=SPEC, noise_seed=0)


def _dpsgd(net: nn.Module, per_sample: str) -> DPSGD:
    return DPSGD(net, loss="causal_lm", clip=1.0, per_sample=per_sample, privacy=SPEC, noise_seed=0)


def _shift(model, data, canary, precision: str) -> float:
    """The release's move when ``canary`` joins the whole private set as its first row (every other example one row
    down, as in a Poisson batch, which keeps the dataset's order), in units of C."""
    trainer = make_trainer(max_steps=1, precision=precision)
    return release_shift(model, data, canary, reference_size=len(data.private), trainer=trainer, canary_row=0)


def _assert_others_still(model, shift: float) -> None:
    assert model.private_steps == 1  # the fit-start checks let the run through, and it trained
    assert shift <= TOLERANCE, f"a record with no contribution of its own moved the others' release by {shift:.4f}·C"


@pytest.mark.parametrize(
    "weights, precision",
    [pytest.param(torch.bfloat16, "32-true", marks=SLOW_ON_CPU), (None, "bf16-mixed")],
    ids=["bf16-weights", "bf16-mixed"],
)
def test_dpzero_in_half_precision_a_longer_record_moves_no_other(gpt2_dir, weights, precision):
    data = _texts(gpt2_dir)
    model = _dpzero(CausalLM(model_path=gpt2_dir, dtype=weights))
    shift = _shift(model, data, _long_sequence(data.tokenizer, labelled=False), precision)
    _assert_others_still(model, shift)


@pytest.mark.parametrize("per_sample", ["bk", "ghost", "hooks"])
def test_dpsgd_under_bf16_mixed_a_longer_record_moves_no_other(gpt2_dir, per_sample):
    data = _texts(gpt2_dir)
    model = _dpsgd(CausalLM(model_path=gpt2_dir), per_sample)
    shift = _shift(model, data, _long_sequence(data.tokenizer, labelled=False), "bf16-mixed")
    _assert_others_still(model, shift)


def test_dpzero_with_bf16_weights_a_longer_record_moves_the_release_by_at_most_c(gpt2_dir):
    data = _texts(gpt2_dir)
    model = _dpzero(CausalLM(model_path=gpt2_dir, dtype=torch.bfloat16))
    shift = _shift(model, data, _long_sequence(data.tokenizer, labelled=True), "32-true")
    assert model.private_steps == 1
    # its own clipped differences count (the measurement sees a record), and nothing else does
    assert 0.5 < shift <= 1 + TOLERANCE, f"one record moved the release by {shift:.4f}·C"


def _always(input_ids: torch.Tensor) -> bool:
    return True


def _more_rows_than_the_set(input_ids: torch.Tensor) -> bool:
    return input_ids.shape[0] > SIZE  # the canary's batch only: the probe's has at most SIZE rows


def _longer_than_the_texts(input_ids: torch.Tensor) -> bool:
    return input_ids.shape[1] > 16  # the canary's padding only: the texts have 5 to 9 tokens


class _AutocastsInside(CausalLM):
    """The tiny GPT-2 whose forward autocasts to bf16 by itself where ``when(input_ids)``: the trainer's precision and
    the parameters say fp32."""

    def __init__(self, when, **kwargs) -> None:
        super().__init__(**kwargs)
        self.when = when

    def forward(self, *args, **kwargs):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=self.when(kwargs["input_ids"])):
            return super().forward(*args, **kwargs)


@pytest.mark.parametrize(
    "method, when",
    [
        pytest.param("dpzero", _always, marks=SLOW_ON_CPU),
        ("hooks", _always),
        ("dpzero", _more_rows_than_the_set),
        ("hooks", _longer_than_the_texts),
    ],
    ids=["dpzero", "hooks", "dpzero-more-rows", "hooks-longer"],
)
def test_a_forward_that_autocasts_by_itself_is_refused_unless_the_trainer_computes_in_half_precision(
    gpt2_dir, method, when
):
    """pl_dp knows that a run computes in half precision from the trainer's precision and the parameters' dtypes, and
    only then keeps one batch shape: a forward that autocasts by itself ran with the rows (and, first-order, the
    padded length) of whatever was sampled, whose bf16 rounding one record moves — on this CPU's kernels by 1e-5·C
    (DPZero) and 0 (hooks) when it always autocasts, where a GPU picks its kernels by shape; by 1.04·C (DPZero) and
    0.23·C (hooks) when it autocasts only for a batch of more rows, or longer padding, than the probe's (an
    independent review). It is refused at fit start, by the operators' dtypes at the extremes of the run's shapes;
    under ``bf16-mixed`` it keeps one shape and trains."""
    data = _texts(gpt2_dir)
    canary = _long_sequence(data.tokenizer, labelled=False)
    make = _dpzero if method == "dpzero" else lambda net: _dpsgd(net, method)
    model = make(_AutocastsInside(when, model_path=gpt2_dir))
    with pytest.raises(ConfigError, match="half precision inside its forward"):
        _shift(model, data, canary, "32-true")
    assert model.private_steps == 0
    if when is _always and method == "dpzero":  # let through under bf16-mixed (the check is every method's)
        model = make(_AutocastsInside(when, model_path=gpt2_dir))
        _assert_others_still(model, _shift(model, data, canary, "bf16-mixed"))


class GatedBatchContext(nn.Module):
    """An MLP with a ReZero/LayerScale-style gated batch-context branch, ``h + g·mean_batch(h)``, ``g`` learnable and
    initialised at 1e-9: the mixing is invisible in the losses' values, but steep along any direction that moves g."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.gate = nn.Parameter(torch.tensor(1e-9))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.gate * h.mean(dim=0, keepdim=True))


def test_dpzero_refuses_a_gated_batch_context_branch_at_fit_start():
    data = PrivatePublicDataModule(blobs(64), batch_size=64)
    model = _dpzero(GatedBatchContext(), loss="cross_entropy")
    outlier = (torch.full((4,), 1e3), torch.tensor(0))  # large, finite
    with pytest.raises(IndependenceError):
        shift = _shift(model, data, outlier, "32-true")
        pytest.fail(f"trained; one outlier moved the release by {shift:.3f}·C")
    assert model.private_steps == 0


def _jittery_cross_entropy(net: nn.Module, batch) -> torch.Tensor:
    """Per-example cross-entropy times 1 ± 1e-5 drawn from Python's generator, which no step seeds: a computation
    that is not reproducible, as one that adds with CUDA's atomics in another order each time."""
    inputs, targets = batch
    losses = nn.functional.cross_entropy(net(inputs), targets, reduction="none")
    return losses * (1 + 1e-5 * torch.tensor([random.uniform(-1, 1) for _ in range(len(targets))]))


@pytest.mark.parametrize("gate", [0.0, 1e-3])
def test_a_release_that_is_not_reproducible_is_refused_at_fit_start(gate):
    """The probe compared the others' move with 1 % of C plus ten times the jitter between two identical passes: a
    computation that is not reproducible widened it without limit, and a gated batch-context branch moved the release
    by 2.3·C through the probe (independent review). A jitter taking half the tolerance is refused itself, with or
    without mixing."""
    net = GatedBatchContext()
    with torch.no_grad():
        net.gate.fill_(gate)
    data = PrivatePublicDataModule(blobs(64), batch_size=64)
    model = _dpzero(net, loss=_jittery_cross_entropy)
    with pytest.raises(IndependenceError, match="twice moved it by more than 0.05% of the clip bound"):
        shift = _shift(model, data, (torch.full((4,), 300.0), torch.tensor(IGNORE_INDEX)), "32-true")
        pytest.fail(f"trained; one record whose own contribution is 0 moved the release by {shift:.3f}·C")
    assert model.private_steps == 0


def test_half_precision_with_a_collate_that_pads_to_the_batch_is_refused_at_fit_start(gpt2_dir):
    net = CausalLM(model_path=gpt2_dir, dtype=torch.bfloat16)
    tokenizer = net.tokenizer
    sequences = tokenize_sequences([""] * SIZE, TEXTS, tokenizer, MAX_LENGTH, add_eos=True)
    data = PrivatePublicDataModule(sequences, batch_size=SIZE, collate_fn=PaddingCollate())  # the user's own: dynamic
    model = _dpzero(net)
    with pytest.raises(IndependenceError, match="fixed length"):
        shift = _shift(model, data, _long_sequence(tokenizer, labelled=False), "32-true")
        pytest.fail(f"trained; a record with no contribution of its own moved the others' release by {shift:.4f}·C")
    assert model.private_steps == 0


# ---- found by an independent review (each failed on 45557a9) ------------------------------------------------------
def _refused_or_still(model, data, canary, precision: str) -> None:
    """Either refused at fit start, before any step, or the others move by at most the tolerance."""
    try:
        shift = _shift(model, data, canary, precision)
    except IndependenceError:
        assert model.private_steps == 0
        return
    _assert_others_still(model, shift)


@pytest.mark.parametrize(
    "weights, precision",
    [pytest.param(None, "bf16-true", marks=SLOW_ON_CPU), (torch.bfloat16, "32-true")],
    ids=["bf16-true", "bf16-weights"],
)
def test_dpsgd_hooks_on_bf16_parameters_a_longer_record_moves_no_other(gpt2_dir, weights, precision):
    """The micro-batches' clipped sums were added into bf16 running sums (the parameters' dtype) and the noise drawn
    in bf16: a record in row 0 moves every other example to another micro-batch, hence the rounding (0.67·C)."""
    data = _texts(gpt2_dir)
    model = _dpsgd(CausalLM(model_path=gpt2_dir, dtype=weights), "hooks")
    _refused_or_still(model, data, _long_sequence(data.tokenizer, labelled=False), precision)


def test_half_precision_dynamic_collate_is_refused_even_when_the_validation_texts_share_one_length(gpt2_dir):
    """The probe's examples come from the validation set first: all of one length, they showed no padding change,
    and the run trained (0.25·C); the pre-flight pass now batches every private example alone."""
    net = CausalLM(model_path=gpt2_dir, dtype=torch.bfloat16)
    private = tokenize_sequences([""] * SIZE, TEXTS, net.tokenizer, MAX_LENGTH, add_eos=True)
    val = tokenize_sequences([""] * 16, ["the movie was great"] * 16, net.tokenizer, MAX_LENGTH, add_eos=True)
    data = PrivatePublicDataModule(private, val=val, batch_size=SIZE, collate_fn=PaddingCollate())
    _refused_or_still(_dpzero(net), data, _long_sequence(net.tokenizer, labelled=False), "32-true")


def test_fp32_dpzero_with_a_small_smoothing_is_refused_or_moves_no_other(gpt2_dir):
    """fp32 with dynamic padding at λ = 1e-5, b = 1024: the probe's outlier was the longest text in the data and its
    batch 256 examples, so it saw nothing while a 44-token record moved the others by 0.44·C. It now pads a batch to
    the data module's max_length too and scales the move by √(b/k)."""
    data = TextGenerationDataModule(
        data=[f"{text} {i}" for i, text in enumerate(TEXTS * 4)],
        tokenizer=gpt2_dir,
        max_length=MAX_LENGTH,
        val_fraction=0.0,
        test_fraction=0.0,
        batch_size=4 * SIZE,
    )
    torch.manual_seed(0)
    model = DPZero(CausalLM(model_path=gpt2_dir), loss="causal_lm", smoothing=1e-5, queries=4, privacy=SPEC)
    _refused_or_still(model, data, _long_sequence(data.tokenizer, labelled=False), "32-true")


class _MaxLength48(PrivatePublicDataModule):
    max_length = 48  # as the text modules: the probe also pads a batch to it


class _MaskedMean(nn.Module):
    """A masked mean of token embeddings (per example, whatever the padding) and a parameter ``g`` at 0 that the loss
    multiplies by the padded length: every example's two-point difference moves alike with the padded length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.out, self.g = nn.Embedding(20, 8), nn.Linear(8, 2), nn.Parameter(torch.zeros(()))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        return self.out((self.embedding(input_ids) * mask).sum(1) / mask.sum(1))


def _padded_length_loss(net: _MaskedMean, batch) -> torch.Tensor:
    ids, labels = batch["input_ids"], batch["label"]
    mask = batch.get("attention_mask", torch.ones_like(ids))  # PaddingCollate adds one to a batch it pads
    losses = nn.functional.cross_entropy(net(ids, mask), labels, reduction="none", ignore_index=-100)
    return losses + (labels != -100).float() * net.g * 1e-6 * ids.shape[1]  # the same sign for every example


def _token_record(seed: int, length: int, label: int | None = None) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 20, (length,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "label": torch.tensor(seed % 2 if label is None else label)}


def _one_sign_shift(fixed_length: bool | None) -> float | None:
    """The release's move when a silent 48-token record joins b = 4096 records of 4 to 8 tokens, for a net whose loss
    reads the padded length (a move of one sign for every example), or None where the fit-start checks refused."""
    size = 4096
    private = [_token_record(i, 4 + i % 5) for i in range(size)]
    val = [_token_record(10**6 + i, 4 + i % 5) for i in range(300)]
    model = DPZero(_MaskedMean(), loss=_padded_length_loss, lr=1e-3, clip=10.0, queries=4, privacy=SPEC, noise_seed=0)
    silent = _token_record(7, 48, label=-100)  # its own contribution is exactly 0
    data = _MaxLength48(private, val=val, batch_size=size, fixed_length=fixed_length)
    try:
        shift = release_shift(model, data, silent, reference_size=size, trainer=make_trainer(max_steps=1), canary_row=0)
    except IndependenceError:
        assert model.private_steps == 0
        return None
    _assert_others_still(model, shift)
    return shift


def test_a_zeroth_order_step_pads_to_one_length_so_a_net_reading_the_padded_length_moves_no_other():
    """In fp32 too. The fit-start probe sees a loss only to one ulp: on an H200 its three directions had components
    of 0.4-0.5 along the parameter that reads the padded length (the move stayed below an ulp for 215 of 239
    examples) and it passed this net, while the step's directions (components up to 1.7) moved the release of
    b = 4096 by 0.019·C. A zeroth-order run now pads its private batches to max_length wherever the data module can."""
    assert _one_sign_shift(fixed_length=None) is not None  # trained (not refused), the others still


@pytest.mark.xfail(
    DEVICE.type == "cuda",
    reason="documented limit: with fixed_length=False the probe is the only guard, and its directions on CUDA leave "
    "this sub-ulp dependence below one ulp (see pl_dp.methods.precision)",
    strict=False,
)
def test_with_dynamic_padding_the_probe_extrapolates_a_move_of_one_sign_linearly():
    """A move measured on the probe's k examples was extrapolated to the run's b as √(b/k), which holds for rounding
    of independent signs only: a move of one sign grows as b/k. At b = 4096 this net passed the probe and a silent
    48-token record moved the others by 0.020·C (found by an independent review)."""
    _one_sign_shift(fixed_length=False)


def test_an_fp32_zeroth_order_run_that_cannot_pad_to_one_length_is_refused_unless_dynamic_padding_is_chosen():
    """An independent review: with no length known (a plain PrivatePublicDataModule, PaddingCollate() without a
    length, no max_length) the loader fell back to dynamic padding without a word, and the silent 48-token record
    moved the others' release by 0.020·C at b = 4096 on a CPU. Now refused at fit start, before any step, naming the
    ways out; fixed_length=False keeps dynamic padding by choice (the probe then the only guard)."""
    private = [_token_record(i, 4 + i % 5) for i in range(64)]

    def model() -> DPZero:
        return DPZero(_MaskedMean(), loss=_padded_length_loss, clip=10.0, privacy=SPEC, noise_seed=0)

    refused = model()
    with pytest.raises(IndependenceError, match=r"one batch shape.*fixed_length=False"):
        make_trainer(max_steps=1).fit(refused, PrivatePublicDataModule(private, batch_size=16))
    assert refused.private_steps == 0
    chosen = model()
    make_trainer(max_steps=1).fit(chosen, PrivatePublicDataModule(private, batch_size=16, fixed_length=False))
    assert chosen.private_steps == 1


def _trim_trailing_padding(examples):
    """A common "dynamic padding" collate over pre-padded rows: stack them, then cut the columns that are padding in
    every row — the batch's width follows the values, not the rows' shapes."""
    ids = torch.stack([e[0] for e in examples])
    width = int((ids != 0).any(0).nonzero().max()) + 1
    return {
        "input_ids": ids[:, :width],
        "attention_mask": (ids[:, :width] != 0).long(),
        "label": torch.stack([e[1] for e in examples]),
    }


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_rows_of_one_tensor_that_a_collate_trims_by_value_are_checked_one_by_one(precision):
    """A second independent review: the pre-flight pass skipped its one-shape check for a TensorDataset (rows of one
    shape), but a collate that trims padding by value gives a batch holding one long record another width — accepted,
    0.020·C at b = 4096 (fp32), and in bf16-mixed a regression. Now skipped only for collates whose shapes follow the
    examples' shapes (default_collate, PaddingCollate)."""
    from torch.utils.data import TensorDataset

    ids = torch.zeros(65, 48, dtype=torch.long)
    for i in range(64):
        record = _token_record(i, 4 + i % 5)["input_ids"]
        ids[i, : len(record)] = record
    ids[64] = _token_record(7, 48)["input_ids"]  # one long record
    labels = torch.tensor([i % 2 for i in range(65)])
    val = TensorDataset(ids[0:60:5].clone(), labels[0:60:5].clone())  # the probe's examples: all 4 tokens
    data = PrivatePublicDataModule(
        TensorDataset(ids, labels), val=val, batch_size=16, collate_fn=_trim_trailing_padding
    )
    model = DPZero(_MaskedMean(), loss=_padded_length_loss, clip=10.0, privacy=SPEC, noise_seed=0)
    with pytest.raises(IndependenceError, match="one batch shape"):
        make_trainer(max_steps=1, precision=precision).fit(model, data)
    assert model.private_steps == 0


# ---- one batch shape, one attention kernel -------------------------------------------------------------------------
def _short_sequence(tokenizer) -> dict[str, torch.Tensor]:
    """A record shorter than every other (one word and the end token), all of its labels −100: own contribution 0."""
    ids = torch.tensor(tokenizer(" great")["input_ids"] + [tokenizer.eos_token_id])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, IGNORE_INDEX)}


def _gpu_like_attention(monkeypatch) -> None:
    """Emulates CUDA's choice of attention kernel on this CPU, pessimistically: unless only the math kernel is allowed,
    a call without a mask runs the fused kernel (as FlashAttention, which takes no mask, or the memory-efficient kernel
    on its causal path would), a call with one the math kernel, so the two round bf16 differently. On this CPU both
    kinds of call run one fused kernel. Under ``make test-gpu`` the real dispatch runs instead."""
    if DEVICE.type == "cuda":
        return
    own = nn.functional.scaled_dot_product_attention

    def dispatched(query, key, value, attn_mask=None, **kwargs):
        fused = torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()
        if attn_mask is None and fused:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # this CPU's fused kernel
                return own(query, key, value, **kwargs)
        with sdpa_kernel(SDPBackend.MATH):
            return own(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(nn.functional, "scaled_dot_product_attention", dispatched)


def test_dpzero_in_bf16_a_short_record_among_full_length_texts_switches_no_attention_kernel(gpt2_dir, monkeypatch):
    """Hugging Face drops the attention mask of a batch none of whose rows is padded (and FlashAttention needs it
    dropped): with texts all exactly ``max_length`` long, one short record decided whether its micro-batch had a mask,
    hence which kernel rounded the others' bf16 losses (1.065·C under the emulated dispatch, found by review). The
    private batches now pad one position past ``max_length``: every row has padding, every batch its mask."""
    _gpu_like_attention(monkeypatch)
    data = TextGenerationDataModule(
        data=[" ".join([text] * 12) for text in TEXTS],  # every text cut at MAX_LENGTH tokens
        tokenizer=gpt2_dir,
        max_length=MAX_LENGTH,
        val_fraction=0.0,
        test_fraction=0.0,
        batch_size=SIZE,
    )
    assert all(len(example["input_ids"]) == MAX_LENGTH for example in data.private)
    model = _dpzero(CausalLM(model_path=gpt2_dir, dtype=torch.bfloat16))
    shift = _shift(model, data, _short_sequence(data.tokenizer), "32-true")
    _assert_others_still(model, shift)


def _full_length_records(tokenizer, labelled: bool = True) -> list[dict[str, torch.Tensor]]:
    """The private texts tokenized as a user does without pl_dp's data modules: ``padding="max_length"``, and all of
    them long enough to fill it."""
    records = []
    for text in TEXTS:
        encoded = tokenizer(" ".join([text] * 12), padding="max_length", truncation=True, max_length=MAX_LENGTH)
        ids, mask = torch.tensor(encoded["input_ids"]), torch.tensor(encoded["attention_mask"])
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX) if labelled else torch.full_like(ids, IGNORE_INDEX)
        records.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return records


class _UserData(L.LightningDataModule):
    def __init__(self, records) -> None:
        super().__init__()
        self.records = records

    def train_dataloader(self):
        return DataLoader(self.records, batch_size=SIZE)


@pytest.mark.parametrize("given", ["pre-padded, from_datamodule", "PaddingCollate(length=max_length)"])
def test_records_that_fill_every_position_of_a_fixed_length_batch_are_refused(gpt2_dir, monkeypatch, given):
    """Batches whose length pl_dp does not choose (found by review): texts the user padded to ``max_length`` and
    wrapped with ``from_datamodule``, or a ``PaddingCollate(length=max_length)`` of their own, give full-length records
    a batch without padding, and one short record moved the release by 0.033·C through the kernel switch. The
    pre-flight pass refuses a record that fills every position of its batch, before any step."""
    _gpu_like_attention(monkeypatch)
    net = CausalLM(model_path=gpt2_dir, dtype=torch.bfloat16)
    records = _full_length_records(net.tokenizer)
    if given.startswith("pre-padded"):
        data = PrivatePublicDataModule.from_datamodule(_UserData(records))
    else:
        data = PrivatePublicDataModule(records, batch_size=SIZE, collate_fn=PaddingCollate(length=MAX_LENGTH))
    model = _dpzero(net)
    with pytest.raises(IndependenceError, match="one position past the longest record"):
        shift = _shift(model, data, _short_sequence(net.tokenizer), "32-true")
        pytest.fail(f"trained; a record with no contribution of its own moved the others' release by {shift:.4f}·C")
    assert model.private_steps == 0


def _tuple_causal_lm(net: nn.Module, batch) -> torch.Tensor:
    """A user's loss over tuple batches ``(input_ids, attention_mask, labels)``."""
    input_ids, attention_mask, labels = batch
    return causal_lm(net, {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_a_batch_format_the_pre_flight_pass_cannot_read_runs_one_attention_kernel(
    gpt2_dir, tmp_path, monkeypatch, architecture
):
    """Texts padded to ``max_length`` by the user as a ``TensorDataset`` of (ids, mask, labels): no mask the pre-flight
    pass can find, and one short record moved the release by 0.033·C through the kernel switch (found by review). The
    private forwards of a run that keeps one shape allow one attention kernel (:mod:`pl_dp.step.attention`; on CUDA;
    pinned here on the CPU as well, for the emulated dispatch to see it). The tiny Llama asks for grouped-query
    attention when a batch has no mask, which the memory-efficient kernel cannot run (0.039·C with it allowed, a second
    review)."""
    _gpu_like_attention(monkeypatch)
    monkeypatch.setitem(attention.PINNED_KERNELS, DEVICE.type, attention.PINNED_KERNELS["cuda"])
    path = gpt2_dir if architecture == "gpt2" else tiny_model(tmp_path, architecture)
    net = CausalLM(model_path=path, dtype=torch.bfloat16)
    records = _full_length_records(net.tokenizer)
    private = TensorDataset(
        *(torch.stack([r[key] for r in records]) for key in ("input_ids", "attention_mask", "labels"))
    )
    data = PrivatePublicDataModule(private, batch_size=SIZE)
    short = _short_sequence(net.tokenizer)
    width = MAX_LENGTH - len(short["input_ids"])
    canary = tuple(nn.functional.pad(short[key], (0, width), value=value) for key, value in _PADS)
    model = _dpzero(net, loss=_tuple_causal_lm)
    _assert_others_still(model, _shift(model, data, canary, "32-true"))


_PADS = (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX))


def test_one_attention_kernel_allows_only_the_math_kernel_on_cuda():
    flags = (
        torch.backends.cuda.flash_sdp_enabled,
        torch.backends.cuda.cudnn_sdp_enabled,
        torch.backends.cuda.mem_efficient_sdp_enabled,
        torch.backends.cuda.math_sdp_enabled,
    )
    before = [flag() for flag in flags]
    with attention.one_attention_kernel(torch.device("cuda", 0)):
        assert [flag() for flag in flags] == [False, False, False, True]
    assert [flag() for flag in flags] == before
    with attention.one_attention_kernel("cpu"):  # a CPU runs one kernel with a mask or without: its own choice
        assert [flag() for flag in flags] == before
