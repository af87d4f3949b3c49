"""Step time and peak memory of pl_dp's DP-SGD and DPZero on a GPU, against a plain torch loop, Opacus and a torch
DPZero floor, side by side in one process (issue [gpu], item 3).

    python benchmarks/gpu.py --json gpu.json        # on a CUDA machine: BERT-base and GPT-2-small sizes
    python benchmarks/gpu.py --tiny                 # the same code on CPU, tiny sizes: a smoke test (seconds)

Two models, both random (nothing is downloaded):

* ``bert``: a BERT-base-sized :class:`~pl_dp.nets.TinyTransformerClassifier` (width 768, 12 layers, 12 heads,
  vocabulary 30,522, T = 128, B = 32, 2 classes);
* ``gpt2``: a GPT-2-small-sized causal LM (``transformers.GPT2Config``: width 768, 12 layers, 12 heads, vocabulary
  50,257, tied input and output embeddings) saved to a temporary directory with a small word-level tokenizer and
  loaded through :class:`~pl_dp.nets.CausalLM`; sequences of T = 128 random tokens, B = 32, ``loss="causal_lm"``.

For each model, the cases (each in its own ``try``: a failure is recorded with its error, the others still run):

* ``torch_sgd``: the non-private loop — forward, backward of the mean loss, ``torch.optim.SGD`` step;
* ``opacus_hooks``, ``opacus_ghost``: Opacus' ``PrivacyEngine.make_private`` with ``grad_sample_mode="hooks"`` and
  ``"ghost"`` (σ = 1, C = 1) on the same model. The lookups of every ``nn.Embedding`` get contiguous indices (a
  forward pre-hook; the classifier's positions are an ``expand``-ed ``arange``, which Opacus' embedding norm views
  flat), and the GPT-2 gets explicit ``[B, T]`` position ids (Opacus needs a batch dimension on every lookup). With
  tied embeddings Opacus' ghost norms treat the two uses separately (no cross term): timed as it runs;
* ``torch_mezo``, ``torch_dpzero``: the zeroth-order floor in a few lines of torch — two forwards under ``no_grad``
  and in-place perturbations θ ± λu regenerated from a seed (four sweeps a step: +λ, −2λ, +λ, update); DPZero
  clips each example's difference and adds one Gaussian scalar. Also with bf16 weights (``_bf16``: no fp32 masters,
  so θ drifts by bf16 rounding — a floor for time and memory only);
* ``pl_dp_ghost``, ``pl_dp_hooks``, ``pl_dp_bk``: :class:`~pl_dp.methods.DPSGD` with ``per_sample="ghost"`` /
  ``"hooks"`` / ``"bk"`` (book-keeping: one backward),
  fp32 and ``precision="bf16-mixed"`` (``_bf16mixed``; ghost clipping turns autocast off for its two passes,
  so its bf16-mixed row runs them in fp32);
* ``pl_dp_dpzero_{gaussian,rademacher}``: :class:`~pl_dp.methods.DPZero` (q = 1) with Gaussian and Rademacher
  directions, fp32 weights, and bf16 weights (``_bf16``: the engine keeps fp32 masters; a run in half precision pads
  every private batch to T and runs its forwards on ``physical_rows`` rows).

The torch and Opacus cases step on one fixed batch of B examples. The pl_dp cases run inside ``Trainer.fit`` (as the
other benchmarks time a pl_dp step: ``max_steps`` and a callback) on Poisson batches of expected size B from a private
set of 8·B examples (``sampling_seed=0``: every pl_dp case sees the same batches; their realized sizes are in the
JSON). Each fit's pre-flight pass (``check_private_data``) and independence probe (``check_independence``) — the
fit-start cost — are timed apart from the steps; a probe that refuses is recorded, and the fit is then run again
with the probe bypassed (timing only).

Step time: median over ``--steps`` steps after ``--warmup`` steps, each bracketed by ``torch.cuda.synchronize()``
on CUDA; for the pl_dp cases a step is the training batch with Lightning's per-batch hooks. Peak memory: on CUDA,
``torch.cuda.max_memory_allocated()`` over the timed steps (the stats reset after the warm-up: weights, optimizer
state and kept buffers included; ``allocated_before_mb`` is what was allocated at the reset); on CPU, the growth of
the peak resident set (Linux ``VmHWM``) over the RSS after the warm-up — ``memory_kind`` says which. With
``--rounds R`` every case runs R times round-robin and the step time is the median of the rounds' medians.

Prints a table (each case's time and memory, and their ratios to ``torch_sgd`` and to ``opacus_ghost``, side by side)
and the issue's targets, and writes JSON with ``--json PATH`` (after every case). Measured once on an H200:
docs/performance.md, "On a GPU" (``benchmarks/results/gpu_h200.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _measure import peak_rss_supported, quiet_trainer, reset_peak_rss, status_kb  # noqa: E402

from pl_dp import PrivacySpec  # noqa: E402
from pl_dp.data import PrivatePublicDataModule  # noqa: E402
from pl_dp.data.collate import PaddingCollate  # noqa: E402
from pl_dp.methods import DPSGD, DPZero  # noqa: E402
from pl_dp.nets import CausalLM, TinyTransformerClassifier  # noqa: E402

LR = 1e-5  # small: nothing diverges in a few steps (a non-finite example would make ghost clipping rerun a pass)
SMOOTHING = 1e-3
CLIP = 1.0
SIGMA = 1.0  # the torch and Opacus loops' noise multiplier; pl_dp calibrates its own from PrivacySpec(8.0)


# ---- sizes and models -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    width: int
    layers: int
    heads: int
    bert_vocab: int
    gpt2_vocab: int
    length: int  # T
    batch: int  # B
    steps: int
    warmup: int


FULL = Sizes(
    width=768, layers=12, heads=12, bert_vocab=30522, gpt2_vocab=50257, length=128, batch=32, steps=10, warmup=3
)
TINY = Sizes(width=32, layers=2, heads=2, bert_vocab=100, gpt2_vocab=100, length=16, batch=4, steps=2, warmup=1)


def save_gpt2(path: Path, sizes: Sizes, seed: int = 0) -> Path:
    """A random GPT-2 of ``sizes`` (tied embeddings, the GPT2Config default) and a small word-level tokenizer
    (CausalLM reads its padding token; the benchmark feeds token ids), saved at ``path``: nothing downloads."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1} | {f"w{i}": i + 2 for i in range(30)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(path)
    tf.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = tf.GPT2Config(
        vocab_size=sizes.gpt2_vocab,
        n_embd=sizes.width,
        n_layer=sizes.layers,
        n_head=sizes.heads,
        n_positions=max(sizes.length, 1024),  # GPT-2's
        bos_token_id=1,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    tf.GPT2LMHeadModel(config).save_pretrained(path)
    return path


class Task:
    """One model: a pristine CPU copy, a fixed batch, the per-example losses the torch loops compute, and the
    private set the pl_dp fits sample from."""

    name: str
    description: str
    pl_dp_loss: str
    #: positions past T the pl_dp fits pad every private batch with: one for a Hugging Face net, so that every row has
    #: padding and every batch keeps its attention mask (a record filling every position is refused, see
    #: pl_dp.step.independence.unpadded_batches_error); the token tuples of the classifier carry no mask
    padding: int = 0

    def __init__(self, net: nn.Module, sizes: Sizes, seed: int = 0) -> None:
        self.net, self.sizes = net.train(), sizes
        g = torch.Generator().manual_seed(seed)
        self.data = self.make_data(8 * sizes.batch, g)  # the private set of the pl_dp fits
        self.batch = self.data[: sizes.batch]  # the torch and Opacus loops' fixed batch

    def parameters(self) -> int:
        return sum(p.numel() for p in self.net.parameters() if p.requires_grad)

    def model(self, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
        net = copy.deepcopy(self.net)
        return net.to(device=device, dtype=dtype) if dtype is not None else net.to(device)


class ClassifierTask(Task):
    name, pl_dp_loss = "bert", "cross_entropy"

    def __init__(self, sizes: Sizes) -> None:
        torch.manual_seed(0)
        net = TinyTransformerClassifier(
            vocab_size=sizes.bert_vocab,
            width=sizes.width,
            depth=sizes.layers,
            heads=sizes.heads,
            max_length=sizes.length,
        )
        self.description = (
            f"TinyTransformerClassifier w{sizes.width} d{sizes.layers} h{sizes.heads} V{sizes.bert_vocab}, "
            f"T={sizes.length}, B={sizes.batch}"
        )
        super().__init__(net, sizes)

    def make_data(self, n: int, g: torch.Generator) -> list:
        tokens = torch.randint(1, self.sizes.bert_vocab, (n, self.sizes.length), generator=g)  # 0 is padding
        labels = torch.randint(0, 2, (n,), generator=g)
        return list(zip(tokens, labels))

    def device_batch(self, device) -> tuple:
        x, y = torch.utils.data.default_collate(self.batch)
        return x.to(device), y.to(device)

    def logits(self, net, batch, opacus: bool = False) -> torch.Tensor:
        return net(batch[0]).float()

    def losses(self, net, batch, opacus: bool = False) -> torch.Tensor:
        return F.cross_entropy(self.logits(net, batch, opacus), batch[1], reduction="none")

    def opacus_ghost_loss(self, criterion, net, batch):
        return criterion(self.logits(net, batch, opacus=True), batch[1])


class CausalTask(Task):
    name, pl_dp_loss, padding = "gpt2", "causal_lm", 1

    def __init__(self, sizes: Sizes, workdir: Path) -> None:
        net = CausalLM(model_path=save_gpt2(workdir / "gpt2", sizes))
        self.path = workdir / "gpt2"
        self.description = (
            f"GPT-2 (random, tied) w{sizes.width} d{sizes.layers} h{sizes.heads} V{sizes.gpt2_vocab}, "
            f"T={sizes.length}, B={sizes.batch}"
        )
        super().__init__(net, sizes)

    def make_data(self, n: int, g: torch.Generator) -> list:
        tokens = torch.randint(2, self.sizes.gpt2_vocab, (n, self.sizes.length), generator=g)
        return [{"input_ids": t, "attention_mask": torch.ones_like(t)} for t in tokens]

    def model(self, device, dtype=None):
        if dtype is None:
            return super().model(device)
        return CausalLM(model_path=self.path, dtype=dtype).to(device)  # loaded in bf16, as a user would

    def device_batch(self, device) -> dict:
        batch = torch.utils.data.default_collate(self.batch)
        return {k: v.to(device) for k, v in batch.items()}

    def logits(self, net, batch, opacus: bool = False) -> torch.Tensor:
        kwargs = {}
        if opacus:  # a batch dimension on the position lookups (GPT-2 looks them up as [1, T])
            ids = batch["input_ids"]
            kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
        return net(batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs).float()

    def losses(self, net, batch, opacus: bool = False) -> torch.Tensor:
        logits = self.logits(net, batch, opacus)
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["input_ids"][:, 1:], reduction="none").mean(1)

    def opacus_ghost_loss(self, criterion, net, batch):
        logits = self.logits(net, batch, opacus=True)[:, :-1]
        return criterion(
            logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1), shape=logits.shape
        )


# ---- measuring ---------------------------------------------------------------------------------------------------
class Meter:
    """Synchronized step times and peak memory of one case on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.times: list[float] = []
        self.peak_mb: float | None = None
        self.allocated_before_mb: float | None = None
        self._base: int | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start_memory(self) -> None:
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.allocated_before_mb = torch.cuda.memory_allocated(self.device) / 2**20
        elif peak_rss_supported():
            self._base = reset_peak_rss()

    def stop_memory(self) -> None:
        self.sync()
        if self.cuda:
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self._base is not None:
            self.peak_mb = (status_kb("VmHWM") - self._base) / 1024

    def time(self, op: Callable[[], Any]) -> None:
        self.sync()
        start = time.perf_counter()
        op()
        self.sync()
        self.times.append(time.perf_counter() - start)


def memory_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda max_memory_allocated over the timed steps (MB, absolute: weights and kept state included)"
    if peak_rss_supported():
        return "CPU peak-RSS growth over the RSS after warm-up (MB, Linux VmHWM; not GPU memory)"
    return "n/a"


def run_loop(build: Callable[[], Callable[[], Any]], sizes: Sizes, device: torch.device) -> dict:
    """Warm up, then time ``sizes.steps`` calls of the op ``build()`` returns."""
    op = build()
    meter = Meter(device)
    for _ in range(sizes.warmup):
        op()
    meter.start_memory()
    for _ in range(sizes.steps):
        meter.time(op)
    meter.stop_memory()
    return {"times": meter.times, "peak_mb": meter.peak_mb, "allocated_before_mb": meter.allocated_before_mb}


def contiguous_lookups(net: nn.Module) -> None:
    """Every ``nn.Embedding`` of ``net`` looks up contiguous indices (Opacus' embedding norms view them flat)."""

    def hook(module, args):
        return (args[0].contiguous(), *args[1:]) if not args[0].is_contiguous() else None

    for m in net.modules():
        if isinstance(m, nn.Embedding):
            m.register_forward_pre_hook(hook)


# ---- the torch and Opacus loops ------------------------------------------------------------------------------
def torch_sgd(task: Task, device: torch.device) -> Callable[[], None]:
    net = task.model(device)
    batch = task.device_batch(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)

    def op():
        optimizer.zero_grad(set_to_none=True)
        task.losses(net, batch).mean().backward()
        optimizer.step()

    return op


def opacus(task: Task, device: torch.device, mode: str) -> Callable[[], None]:
    from opacus import PrivacyEngine

    net = task.model(device)
    contiguous_lookups(net)
    batch = task.device_batch(device)
    loader = torch.utils.data.DataLoader(task.batch, batch_size=task.sizes.batch)
    engine = PrivacyEngine()
    kwargs = dict(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=LR),
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        poisson_sampling=False,  # the loop steps on the fixed batch; sampling is no part of the step's cost
        grad_sample_mode=mode,
    )
    if mode == "ghost":
        model, optimizer, criterion, _ = engine.make_private(criterion=nn.CrossEntropyLoss(), **kwargs)

        def op():
            optimizer.zero_grad(set_to_none=True)
            task.opacus_ghost_loss(criterion, model, batch).backward()
            optimizer.step()

        return op
    model, optimizer, _ = engine.make_private(**kwargs)

    def op():
        optimizer.zero_grad(set_to_none=True)
        task.losses(model, batch, opacus=True).mean().backward()
        optimizer.step()

    return op


def torch_zeroth_order(task: Task, device: torch.device, private: bool, dtype=None) -> Callable[[], None]:
    """MeZO (``private=False``) or DPZero in a few lines: u regenerated from a seed for each in-place sweep."""
    net = task.model(device, dtype)
    params = [p for p in net.parameters() if p.requires_grad]
    batch = task.device_batch(device)
    size = task.sizes.batch
    step = [0]

    def sweep(seed: int, scale: float) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        for p in params:
            p.add_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype), alpha=scale)

    @torch.no_grad()
    def op():
        seed = 1000 + step[0]
        sweep(seed, SMOOTHING)
        plus = task.losses(net, batch)
        sweep(seed, -2 * SMOOTHING)
        minus = task.losses(net, batch)
        sweep(seed, SMOOTHING)
        differences = (plus - minus) / (2 * SMOOTHING)
        if private:
            noise = torch.randn((), device=device) * SIGMA * CLIP
            scalar = (differences.clamp(-CLIP, CLIP).sum() + noise) / size
        else:
            scalar = differences.mean()
        sweep(seed, -LR * float(scalar))  # the host reads the scalar once a step, as pl_dp's DPZero does
        step[0] += 1

    return op


# ---- pl_dp inside Trainer.fit ------------------------------------------------------------------------------------
class SyncedSteps(L.Callback):
    """Synchronized wall time of each training batch after ``warmup``, and peak memory over those batches."""

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.meter, self.warmup, self.batches, self.sizes = Meter(device), warmup, 0, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rows = batch[1] if isinstance(batch, (tuple, list)) else batch["input_ids"]
        self.sizes.append(int(rows.shape[0]))
        if self.batches == self.warmup:
            self.meter.start_memory()
        self.meter.sync()
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.meter.sync()
        if self.batches >= self.warmup:
            self.meter.times.append(time.perf_counter() - self._t)
        self.batches += 1

    def on_train_end(self, trainer, pl_module):
        if self.batches > self.warmup:
            self.meter.stop_memory()


def _timed_check(module, name: str, seconds: dict, bypass: bool = False) -> None:
    check = getattr(module, name)

    def timed():
        if bypass:
            seconds[name] = None
            return None
        start = time.perf_counter()
        try:
            return check()
        except Exception:
            seconds[name] = time.perf_counter() - start
            seconds[f"{name}_raised"] = True
            raise
        finally:
            seconds.setdefault(name, time.perf_counter() - start)

    object.__setattr__(module, name, timed)


def pl_dp_fit(task: Task, device: torch.device, build, precision: str, dtype, bypass_probe: bool) -> dict:
    L.seed_everything(0, verbose=False)
    net = task.model(torch.device("cpu"), dtype) if dtype is not None else copy.deepcopy(task.net)
    module = build(net)
    seconds: dict[str, Any] = {}
    _timed_check(module, "check_private_data", seconds)
    _timed_check(module, "check_independence", seconds, bypass=bypass_probe)
    timer = SyncedSteps(device, task.sizes.warmup)
    data = PrivatePublicDataModule(
        task.data,
        batch_size=task.sizes.batch,
        sampling_seed=0,
        collate_fn=PaddingCollate(length=task.sizes.length + task.padding),
    )
    trainer = quiet_trainer(
        accelerator=device.type,
        devices=1,
        precision=precision,
        max_steps=task.sizes.warmup + task.sizes.steps,
        callbacks=[timer],
    )
    try:
        trainer.fit(module, datamodule=data)
    except Exception as error:
        error.fit_start_seconds = seconds  # type: ignore[attr-defined]
        raise
    return {
        "times": timer.meter.times,
        "peak_mb": timer.meter.peak_mb,
        "allocated_before_mb": timer.meter.allocated_before_mb,
        "batch_sizes": timer.sizes,
        "physical_rows": module.physical_rows,
        "preflight_s": seconds.get("check_private_data"),
        "probe_s": seconds.get("check_independence"),
    }


def pl_dp_case(task: Task, device: torch.device, build, precision: str = "32-true", dtype=None) -> dict:
    """A pl_dp fit; if its probe refuses, the refusal is recorded and the fit run again without it (timing only)."""
    try:
        return pl_dp_fit(task, device, build, precision, dtype, bypass_probe=False) | {"probe": "passed"}
    except Exception as error:
        seconds = getattr(error, "fit_start_seconds", {})
        if not seconds.get("check_independence_raised"):
            raise
        refused = f"refused ({type(error).__name__}: {str(error)[:300]}); steps timed with the probe bypassed"
        release()
        out = pl_dp_fit(task, device, build, precision, dtype, bypass_probe=True)
        return out | {"probe": refused, "probe_s": seconds.get("check_independence")}


def dpsgd(task: Task, per_sample: str):
    def build(net):
        privacy = PrivacySpec(8.0, accountant="rdp")
        return DPSGD(net, loss=task.pl_dp_loss, lr=LR, clip=CLIP, per_sample=per_sample, privacy=privacy)

    return build


def dpzero(task: Task, direction: str):
    def build(net):
        privacy = PrivacySpec(8.0, accountant="rdp")
        return DPZero(
            net, loss=task.pl_dp_loss, lr=LR, clip=CLIP, smoothing=SMOOTHING, direction=direction, privacy=privacy
        )

    return build


# ---- the cases ---------------------------------------------------------------------------------------------------
def cases(task: Task, device: torch.device) -> dict[str, tuple[str, Callable[[], dict]]]:
    """name -> (label, run): ``run()`` returns the measurement of one round."""
    s = task.sizes
    bf16 = torch.bfloat16

    def loop(build):
        return lambda: run_loop(build, s, device)

    out = {
        "torch_sgd": ("non-private torch loop (fwd+bwd+SGD)", loop(lambda: torch_sgd(task, device))),
        "opacus_hooks": ("Opacus 1.6 make_private, hooks", loop(lambda: opacus(task, device, "hooks"))),
        "opacus_ghost": ("Opacus 1.6 make_private, ghost", loop(lambda: opacus(task, device, "ghost"))),
        "pl_dp_ghost": ("pl_dp DPSGD ghost, fp32", lambda: pl_dp_case(task, device, dpsgd(task, "ghost"))),
        "pl_dp_hooks": ("pl_dp DPSGD hooks, fp32", lambda: pl_dp_case(task, device, dpsgd(task, "hooks"))),
        "pl_dp_bk": ("pl_dp DPSGD book-keeping, fp32", lambda: pl_dp_case(task, device, dpsgd(task, "bk"))),
        "pl_dp_bk_bf16mixed": (
            "pl_dp DPSGD book-keeping, bf16-mixed (passes in fp32)",
            lambda: pl_dp_case(task, device, dpsgd(task, "bk"), precision="bf16-mixed"),
        ),
        "pl_dp_ghost_bf16mixed": (
            "pl_dp DPSGD ghost, bf16-mixed (passes in fp32)",
            lambda: pl_dp_case(task, device, dpsgd(task, "ghost"), precision="bf16-mixed"),
        ),
        "pl_dp_hooks_bf16mixed": (
            "pl_dp DPSGD hooks, bf16-mixed",
            lambda: pl_dp_case(task, device, dpsgd(task, "hooks"), precision="bf16-mixed"),
        ),
        "torch_mezo": ("MeZO floor (torch), fp32", loop(lambda: torch_zeroth_order(task, device, private=False))),
        "torch_dpzero": ("DPZero floor (torch), fp32", loop(lambda: torch_zeroth_order(task, device, private=True))),
        "torch_dpzero_bf16": (
            "DPZero floor (torch), bf16 weights",
            loop(lambda: torch_zeroth_order(task, device, private=True, dtype=bf16)),
        ),
    }
    for direction in ("gaussian", "rademacher"):
        out[f"pl_dp_dpzero_{direction}"] = (
            f"pl_dp DPZero {direction}, fp32",
            lambda d=direction: pl_dp_case(task, device, dpzero(task, d)),
        )
        out[f"pl_dp_dpzero_{direction}_bf16"] = (
            f"pl_dp DPZero {direction}, bf16 weights",
            lambda d=direction: pl_dp_case(task, device, dpzero(task, d), dtype=bf16),
        )
    return out


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(
    task: Task, device: torch.device, rounds: int, only: list[str] | None, save: Callable[[dict], None]
) -> dict:
    """Every case ``rounds`` times round-robin; ``save`` gets the model's summary so far after each case (a run cut
    off keeps what it measured)."""
    table = cases(task, device)
    names = [n for n in table if not only or n in only]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for name in names:
            if name in errors:
                continue
            release()
            started = time.perf_counter()
            try:
                result = table[name][1]()
            except Exception as error:  # recorded: one failure does not lose the other cases
                errors[name] = f"{type(error).__name__}: {str(error)[:1500]}"
                tail = traceback.format_exc().strip().splitlines()[-6:]
                print(f"{task.name}/{name}: FAILED {errors[name][:300]}\n  " + "\n  ".join(tail), flush=True)
                continue
            finally:
                release()
            print(f"{task.name}/{name}: {time.perf_counter() - started:.1f} s", flush=True)
            runs[name].append(result)
            save(summarize(task, table, [n for n in names if runs[n] or n in errors], runs, errors))
    return summarize(task, table, names, runs, errors)


def summarize(task: Task, table: dict, names: list[str], runs: dict[str, list[dict]], errors: dict[str, str]) -> dict:
    """The model's rows (medians over rounds, ratios to ``torch_sgd`` and ``opacus_ghost``) and targets."""
    rows = {}
    for name in names:
        label = table[name][0]
        if name in errors:
            rows[name] = {"label": label, "error": errors[name]}
            continue
        medians = [statistics.median(r["times"]) for r in runs[name]]
        last = runs[name][-1]
        row = {
            "label": label,
            "step_s": statistics.median(medians),
            "step_s_rounds": medians,
            "step_s_all": [t for r in runs[name] for t in r["times"]],
            "peak_mb": statistics.median([r["peak_mb"] for r in runs[name]]) if last["peak_mb"] is not None else None,
            "allocated_before_mb": last["allocated_before_mb"],
        }
        for key in ("batch_sizes", "physical_rows", "probe"):
            if key in last:
                row[key] = last[key]
        if "preflight_s" in runs[name][0]:  # the fit-start cost of the first round's fit
            row["preflight_s"] = runs[name][0]["preflight_s"]
            row["probe_s"] = runs[name][0]["probe_s"]
        rows[name] = row
    for row in rows.values():
        for ref in ("torch_sgd", "opacus_ghost"):
            base = rows.get(ref, {})
            if "step_s" in row and "step_s" in base:
                row[f"time_over_{ref}"] = row["step_s"] / base["step_s"]
                if row["peak_mb"] is not None and base["peak_mb"]:
                    row[f"peak_over_{ref}"] = row["peak_mb"] / base["peak_mb"]
    return {
        "model": task.name,
        "description": task.description,
        "trainable_parameters": task.parameters(),
        "cases": rows,
        "targets": targets(rows),
    }


#: the issue's targets: (numerator, denominator, quantity, bound)
TARGETS = [
    ("pl_dp_ghost", "opacus_ghost", "step_s", 1.0),
    ("pl_dp_ghost", "torch_sgd", "step_s", 1.3),
    ("pl_dp_bk", "torch_sgd", "step_s", 1.15),
    ("pl_dp_bk", "opacus_ghost", "step_s", 0.8),
    ("pl_dp_bk", "torch_sgd", "peak_mb", 1.1),
    ("pl_dp_dpzero_gaussian", "torch_dpzero", "step_s", 1.1),
    ("pl_dp_dpzero_gaussian", "torch_dpzero", "peak_mb", 1.1),
    ("pl_dp_dpzero_gaussian_bf16", "pl_dp_dpzero_gaussian", "step_s", 0.6),
]


def targets(rows: dict) -> list[dict]:
    out = []
    for num, den, key, bound in TARGETS:
        entry = {"metric": f"{num} / {den} ({key})", "target": bound}
        a, b = rows.get(num, {}).get(key), rows.get(den, {}).get(key)
        if a is None or not b:
            entry["value"], entry["met"] = None, None
            failed = [n for n in (num, den) if "error" in rows.get(n, {})]
            entry["why_not"] = "; ".join(f"{n} failed" for n in failed) or "not measured"
        else:
            entry["value"], entry["met"] = a / b, a / b <= bound
        out.append(entry)
    return out


def print_table(result: dict, device: torch.device, tiny: bool) -> None:
    mem = "peak MB (CUDA)" if device.type == "cuda" else "peak RSS growth MB (CPU)"
    print(f"\n{result['model']}: {result['description']}, {result['trainable_parameters'] / 1e6:.2f}M parameters")
    print(
        f"| case | step ms | ÷ torch SGD | ÷ Opacus ghost | {mem} | mem ÷ torch SGD | mem ÷ Opacus ghost | "
        "pre-flight s | probe s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )

    def num(value, fmt):
        return "—" if value is None else format(value, fmt)

    for row in result["cases"].values():
        if "error" in row:
            print(f"| {row['label']} | FAILED: {row['error'][:120]} | | | | | | | |")
            continue
        print(
            f"| {row['label']} | {1e3 * row['step_s']:.1f} | {num(row.get('time_over_torch_sgd'), '.2f')} | "
            f"{num(row.get('time_over_opacus_ghost'), '.2f')} | {num(row['peak_mb'], '.1f')} | "
            f"{num(row.get('peak_over_torch_sgd'), '.2f')} | {num(row.get('peak_over_opacus_ghost'), '.2f')} | "
            f"{num(row.get('preflight_s'), '.2f')} | {num(row.get('probe_s'), '.2f')} |"
        )
    if tiny or device.type != "cuda":
        print("targets (set for the full sizes on a GPU; this run is not that setting):")
    for t in result["targets"]:
        verdict = "n/a " if t["met"] is None else ("MET " if t["met"] else "MISS")
        why = f" ({t['why_not']})" if t.get("why_not") else ""
        print(f"{verdict} {t['metric']:<62} {num(t['value'], '.3f')} <= {t['target']}{why}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (width 32, 2 layers, T 16, B 4, 2 steps)")
    parser.add_argument("--models", nargs="+", choices=["bert", "gpt2"], default=["bert", "gpt2"])
    parser.add_argument("--cases", nargs="+", default=None, help="only these cases (names as in the JSON)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per case (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every case, round-robin")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu, e.g. with --tiny)")
    warnings.filterwarnings("ignore")
    sizes = TINY if args.tiny else FULL
    if args.steps or args.warmup is not None:
        fields = {**sizes.__dict__, "steps": args.steps or sizes.steps}
        fields["warmup"] = sizes.warmup if args.warmup is None else args.warmup
        sizes = Sizes(**fields)
    device = torch.device(args.device)
    started = time.perf_counter()
    load_before = os.getloadavg()
    results: list[dict] = []
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"

    def summary(models: list[dict]) -> dict:
        return {
            "command": "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": args.device,
            "device_name": device_name,
            "tiny": args.tiny,
            "sizes": sizes.__dict__,
            "rounds": args.rounds,
            "memory_kind": memory_kind(device),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "seconds": time.perf_counter() - started,
            "models": models,
        }

    def save(model: dict) -> None:  # the JSON so far, rewritten after every case
        if args.json:
            args.json.write_text(json.dumps(summary([*results, model]), indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            try:
                task = ClassifierTask(sizes) if name == "bert" else CausalTask(sizes, Path(tmp))
            except Exception as error:
                results.append({"model": name, "error": f"{type(error).__name__}: {error}"})
                print(f"{name}: FAILED to build: {results[-1]['error']}", flush=True)
                continue
            results.append(measure(task, device, args.rounds, args.cases, save))
            del task
            release()
    out = summary(results)
    print(
        f"\n{out['device_name']} ({args.device}), torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"step: median of {sizes.steps} steps after {sizes.warmup} warm-up, median over {args.rounds} round(s); "
        f"memory: {out['memory_kind']}"
    )
    for r in results:
        if "error" in r:
            print(f"\n{r['model']}: FAILED: {r['error']}")
        else:
            print_table(r, device, args.tiny)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
