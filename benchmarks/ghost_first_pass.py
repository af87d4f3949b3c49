"""Ghost clipping's first pass, norms only, against the full backward it replaced (issue 29 of [scale]).

    python benchmarks/ghost_first_pass.py            # ~6 minutes on 2 CPU cores
    python benchmarks/ghost_first_pass.py --quick    # small sizes, smoke test
    python benchmarks/ghost_first_pass.py --one-pass --json benchmarks/results/bk_one_pass.json  # BK, ~10 minutes

Until this change the first pass was a backward of Σ_i ℓ_i with respect to every trainable parameter, whose
gradients were dropped: Opacus' hooks record the per-example norms from the layers' inputs and output gradients
only. It now asks autograd for the gradients with respect to the edges just below the hooked layers
(``pl_dp.per_sample.ghost._NormsOnly``), so the weight-gradient matmuls are pruned. The old pass is kept here
only (:class:`FullFirstPass`, the one line it was). For each case both engines run on the same batch, interleaved
round by round after a warm-up round, and the medians are reported with their ratios:

* ``norms``: the first pass alone (forward, backward for the norms): ``per_example_norms``;
* ``clipped sum``: both passes, what a DP-SGD step spends on clipping (``clipped_sum``);
* a non-private forward + backward of the summed loss, the reference for both;
* the peak resident-memory growth of ``clipped_sum`` (Linux), and the norms' largest relative difference.

Prints a table and JSON (``--json PATH`` to save; the committed copy is
``benchmarks/results/ghost_first_pass.json``).

``--one-pass`` measures instead what a DP-SGD step spends on its clipped sum with each engine, side by side in one
run (issue 39 of [fast]; committed as ``benchmarks/results/bk_one_pass.json``), on the cases above, a tiny GPT-2
with tied input and output embeddings, a tiny Llama-style model (RMSNorm layers, tied embeddings) and the digits MLP
of the small whole run (64-64-10 at B = 48; ``--cases digits mlp transformer minilm gpt2 llama``). On a net with
Hugging Face RMSNorm layers, ``bk_torch_func_rms_norm`` is BK with those layers left to Opacus' ``torch.func`` copies
(``pl_dp.per_sample.rms_norm`` finding none), in the same rotation:

* ``non_private``: a forward and backward of the summed loss;
* ``opacus_ghost``: Opacus 1.6's ghost clipping (``GradSampleModuleFastGradientClipping`` with its optimizer and
  loss wrapper, loss reduction "sum", C = 1): ``loss.backward()``, its two backward passes, which leave the clipped
  sum in ``.grad`` (no optimizer step: no engine here adds noise). As for pl_dp's engines, its hooks record in eval
  mode too (the cases run without dropout) and lookups broadcast over the batch (BERT's and GPT-2's positions) get
  one row per example; a case Opacus refuses is recorded with its error;
* ``ghost``: :class:`~pl_dp.per_sample.GhostClipping` (norms, then a second backward);
* ``bk``: :class:`~pl_dp.per_sample.BookKeeping` (the same first pass; the clipped sum from what it kept);
* ``hooks``: :class:`~pl_dp.per_sample.PerSampleGradients` with Opacus' hooks (``per_sample="hooks"``, the default):
  every per-example gradient formed, their norms, the weighted sum; a case it refuses is recorded with its error.

Medians of interleaved rounds after a warm-up round, ratios to ``non_private`` and to ``opacus_ghost``, the peak
resident-memory growth of each, and the relative difference of BK's clipped sum from ghost clipping's (the norm of
the difference over all parameters over the norm of ghost clipping's sum).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _measure import peak_rss_supported, reset_peak_rss, status_kb  # noqa: E402

from pl_dp.nets import MLP, TinyTransformerClassifier  # noqa: E402
from pl_dp.per_sample import BookKeeping, GhostClipping, PerSampleGradients, rms_norm  # noqa: E402
from pl_dp.per_sample.gradients import BroadcastLookups, RecordsInEvalMode  # noqa: E402
from pl_dp.privacy import ClipFunction  # noqa: E402
from pl_dp.step.losses import causal_lm, cross_entropy  # noqa: E402


class FullFirstPass(GhostClipping):
    """The first pass as it was: a backward of Σ_i ℓ_i with respect to every trainable parameter (then dropped)."""

    def _first_backward(self, losses):
        grads = torch.autograd.grad(losses.sum(), self.params, retain_graph=True, allow_unused=True)
        return [p for p, g in zip(self.params, grads) if g is not None]


def make_case(name: str, quick: bool):
    """(net, batch, description): the step-cost benchmark's MLP and transformer, and the packaged MiniLM."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name in ("mlp", "digits"):
        hidden, batch = ((128, 128), 64) if quick else ((2048, 2048), 256)
        if name == "digits":  # the small whole run's net and expected batch (benchmarks/opacus_epoch.py)
            hidden, batch = (64,), 48
        net = MLP(64, hidden, 10)
        x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
        return net, (x, y), f"MLP 64-{'-'.join(map(str, hidden))}-10, B={batch}"
    if name == "transformer":
        width, depth, batch = (64, 1, 16) if quick else (256, 4, 64)
        net = TinyTransformerClassifier(width=width, depth=depth)
        tokens = torch.randint(1, 2000, (batch, 64), generator=g)
        return (
            net,
            (tokens, torch.randint(0, 2, (batch,), generator=g)),
            f"transformer w{width} d{depth}, B={batch}, T=64",
        )
    if name == "minilm":  # the packaged pretrained all-MiniLM-L6-v2, every parameter trainable
        from pl_dp.nets import MiniLMClassifier

        net = MiniLMClassifier(num_labels=2).eval()  # no dropout: both engines see the same function
        batch, length = (8, 16) if quick else (32, 32)
        tokens = torch.randint(1000, 30000, (batch, length), generator=g)
        return net, (tokens, torch.randint(0, 2, (batch,), generator=g)), f"MiniLM-L6 (all), B={batch}, T={length}"
    # random causal language models with tied input and output embeddings: GPT-2 (the GPT2Config default), and a
    # Llama-style one (RMSNorm layers, grouped-query attention)
    causal = {
        "gpt2": ("GPT-2", _tiny_gpt2, (256, 4, 8000, 32, 64)),
        "llama": ("Llama", _tiny_llama, (128, 4, 8000, 16, 64)),
    }
    if name in causal:
        label, build, full = causal[name]
        width, depth, vocab, batch, length = (32, 1, 500, 8, 16) if quick else full
        net = build(width, depth, vocab).eval()
        ids = torch.randint(2, vocab, (batch, length), generator=g)
        return (
            net,
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            f"{label} tied w{width} d{depth} V{vocab}, B={batch}, T={length}",
        )
    raise ValueError(name)


def _tiny_llama(width: int, depth: int, vocab: int):
    """A random Llama-style model with tied embeddings, loaded by CausalLM (no download)."""
    import transformers as tf

    return _saved_causal_lm(
        tf.LlamaForCausalLM,
        tf.LlamaConfig(
            vocab_size=vocab,
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=depth,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=1,
        ),
    )


def _tiny_gpt2(width: int, depth: int, vocab: int):
    """A random GPT-2 with tied embeddings, loaded by CausalLM (no download)."""
    import transformers as tf

    config = tf.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=depth, n_head=4, bos_token_id=1, eos_token_id=1)
    return _saved_causal_lm(tf.GPT2LMHeadModel, config)


def _saved_causal_lm(model_class, config):
    """A random ``model_class(config)`` saved with a word-level tokenizer and loaded by CausalLM."""
    import tempfile

    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    from pl_dp.nets import CausalLM

    path = Path(tempfile.mkdtemp(prefix="bk-causal-"))
    tokenizer = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>").save_pretrained(path)
    model_class(config).save_pretrained(path)
    return CausalLM(model_path=path)


def _loss_of(batch):
    return causal_lm if isinstance(batch, dict) else cross_entropy


def _timed(op) -> float:
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def _peak_mb(op) -> float | None:
    if not peak_rss_supported():
        return None
    base = reset_peak_rss()
    op()
    return (status_kb("VmHWM") - base) / 1024


def measure(name: str, quick: bool, rounds: int) -> dict:
    net, batch, description = make_case(name, quick)
    params = sum(p.numel() for p in net.parameters() if p.requires_grad)
    fn = ClipFunction("constant", 1.0)
    engines = {"before": FullFirstPass(copy.deepcopy(net), cross_entropy), "after": GhostClipping(net, cross_entropy)}
    plain = copy.deepcopy(net)
    walk: list[float] = []  # the time the new pass spends walking the graph for its targets
    plan = engines["after"]._targets.plan

    def timed_plan(root):
        start = time.perf_counter()
        try:
            return plan(root)
        finally:
            walk.append(time.perf_counter() - start)

    engines["after"]._targets.plan = timed_plan  # type: ignore[method-assign]

    def non_private():
        plain.zero_grad(set_to_none=True)
        cross_entropy(plain, batch).sum().backward()

    ops = {"non_private": non_private}
    for label, engine in engines.items():
        ops[f"norms_{label}"] = lambda engine=engine: engine.per_example_norms(batch)
        ops[f"clipped_sum_{label}"] = lambda engine=engine: engine.clipped_sum(batch, fn)
    times: dict[str, list[float]] = {k: [] for k in ops}
    for r in range(rounds + 1):  # the first round warms up
        for key, op in ops.items():
            elapsed = _timed(op)
            if r:
                times[key].append(elapsed)
    norms = {label: engine.per_example_norms(batch) for label, engine in engines.items()}
    sums = {label: engine.clipped_sum(batch, fn)[0] for label, engine in engines.items()}
    peaks = {label: _peak_mb(lambda engine=engine: engine.clipped_sum(batch, fn)) for label, engine in engines.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    sum_error = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(sums["after"], sums["before"]))
    return {
        "case": name,
        "description": description,
        "trainable_parameters": params,
        "non_private_fwd_bwd_ms": 1e3 * med["non_private"],
        "norms_before_ms": 1e3 * med["norms_before"],
        "norms_after_ms": 1e3 * med["norms_after"],
        "clipped_sum_before_ms": 1e3 * med["clipped_sum_before"],
        "clipped_sum_after_ms": 1e3 * med["clipped_sum_after"],
        "norms_after_over_before": med["norms_after"] / med["norms_before"],
        "clipped_sum_after_over_before": med["clipped_sum_after"] / med["clipped_sum_before"],
        "clipped_sum_before_over_non_private": med["clipped_sum_before"] / med["non_private"],
        "clipped_sum_after_over_non_private": med["clipped_sum_after"] / med["non_private"],
        "graph_walk_ms": 1e3 * statistics.median(walk),
        "clipped_sum_peak_mb_before": peaks["before"],
        "clipped_sum_peak_mb_after": peaks["after"],
        "norms_max_relative_difference": float(((norms["after"] - norms["before"]).abs() / norms["before"]).max()),
        "clipped_sum_max_relative_difference": sum_error,
    }


class _PerSampleCriterion(torch.nn.Module):
    """pl_dp's per-sample loss ``(net, batch) -> [B]`` as a criterion for Opacus' loss wrapper (which sets
    ``reduction`` to "none" around its call)."""

    def __init__(self, loss_fn) -> None:
        super().__init__()
        self.loss_fn, self.reduction = loss_fn, "sum"

    def forward(self, net, batch):
        return self.loss_fn(net, batch)


def _opacus_ghost(net, batch, loss_fn):
    """Opacus 1.6's ghost clipping: ``loss.backward()`` runs its two passes and leaves the clipped sum in ``.grad``."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    class Recording(RecordsInEvalMode, GradSampleModuleFastGradientClipping):
        """Opacus' module, recording in eval mode too (the cases run without dropout; Opacus records in training
        mode only), as pl_dp's engines do."""

    model = Recording(net, loss_reduction="sum", max_grad_norm=1.0, use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=len(next(iter(batch.values())) if isinstance(batch, dict) else batch[1]),
        loss_reduction="sum",
    )
    criterion = DPLossFastGradientClipping(model, optimizer, _PerSampleCriterion(loss_fn), loss_reduction="sum")
    lookups = BroadcastLookups(net)
    size = len(next(iter(batch.values())) if isinstance(batch, dict) else batch[1])

    def op():
        optimizer.zero_grad(set_to_none=True)
        with lookups.expanding(size):
            loss = criterion(model, batch)
        loss.backward()

    return op


def measure_one_pass(name: str, quick: bool, rounds: int) -> dict:
    """Non-private, Opacus ghost, pl_dp ghost, pl_dp BK and pl_dp hooks on one case, interleaved (see
    ``--one-pass``)."""
    net, batch, description = make_case(name, quick)
    loss_fn = _loss_of(batch)
    params = sum(p.numel() for p in net.parameters() if p.requires_grad)
    fn = ClipFunction("constant", 1.0)
    engines = {"ghost": GhostClipping(copy.deepcopy(net), loss_fn), "bk": BookKeeping(copy.deepcopy(net), loss_fn)}
    plain = copy.deepcopy(net)

    def non_private():
        plain.zero_grad(set_to_none=True)
        loss_fn(plain, batch).sum().backward()

    ops = {"non_private": non_private}
    errors = {}
    try:
        ops["opacus_ghost"] = _opacus_ghost(copy.deepcopy(net), batch, loss_fn)
        ops["opacus_ghost"]()
    except Exception as error:  # noqa: BLE001 - recorded: Opacus refuses some nets pl_dp clips
        ops.pop("opacus_ghost", None)
        errors["opacus_ghost"] = f"{type(error).__name__}: {error}"[:300]
    try:
        engines["hooks"] = PerSampleGradients(copy.deepcopy(net), loss_fn, "hooks")
    except Exception as error:  # noqa: BLE001 - recorded: Opacus' hooks refuse some layers the other engines clip
        errors["hooks"] = f"{type(error).__name__}: {error}"[:300]
    if rms_norm.rms_norm_samplers(net):  # Hugging Face RMSNorm layers: BK as it was, with Opacus' torch.func copies
        with mock.patch.object(rms_norm, "rms_norm_samplers", lambda module: {}):
            engines["bk_torch_func_rms_norm"] = BookKeeping(copy.deepcopy(net), loss_fn)
    for label, engine in engines.items():
        ops[label] = lambda engine=engine: engine.clipped_sum(batch, fn)
    times: dict[str, list[float]] = {k: [] for k in ops}
    for r in range(rounds + 1):  # the first round warms up
        for key, op in ops.items():
            elapsed = _timed(op)
            if r:
                times[key].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    peaks = {k: _peak_mb(op) for k, op in ops.items()}
    sums = {label: engine.clipped_sum(batch, fn)[0] for label, engine in engines.items()}
    row = {
        "case": name,
        "description": description,
        "trainable_parameters": params,
        "errors": errors,
        "bk_sum_relative_difference_from_ghost": float(
            torch.sqrt(sum((a - b).double().square().sum() for a, b in zip(sums["bk"], sums["ghost"])))
            / torch.sqrt(sum(b.double().square().sum() for b in sums["ghost"]))
        ),
    }
    for key in ops:
        row[f"{key}_ms"] = 1e3 * med[key]
        row[f"{key}_peak_mb"] = peaks[key]
        row[f"{key}_over_non_private"] = med[key] / med["non_private"]
        if "opacus_ghost" in med:
            row[f"{key}_over_opacus_ghost"] = med[key] / med["opacus_ghost"]
    row["bk_over_ghost"] = med["bk"] / med["ghost"]
    if "bk_torch_func_rms_norm" in med:
        row["bk_over_bk_torch_func_rms_norm"] = med["bk"] / med["bk_torch_func_rms_norm"]
    if "hooks" in med:
        row["bk_over_hooks"] = med["bk"] / med["hooks"]
    return row


def print_one_pass(rows: list[dict]) -> None:
    print(
        f"{'case':40} {'fwd+bwd':>8} {'opacus':>8} {'ghost':>8} {'bk':>8} {'hooks':>8} "
        f"{'÷ fwd+bwd opacus|ghost|bk|hooks':>31} {'bk ÷ opacus':>11} {'peak MB np|opacus|ghost|bk|hooks':>33}"
    )
    for r in rows:
        opacus = f"{r['opacus_ghost_ms']:8.1f}" if "opacus_ghost_ms" in r else f"{'refused':>8}"
        ratio = f"{r['opacus_ghost_over_non_private']:.2f}" if "opacus_ghost_ms" in r else "-"
        over = f"{r['bk_over_opacus_ghost']:.2f}" if "bk_over_opacus_ghost" in r else "-"
        peaks = "|".join(
            "-" if r.get(f"{k}_peak_mb") is None else f"{r[f'{k}_peak_mb']:.0f}"
            for k in ("non_private", "opacus_ghost", "ghost", "bk", "hooks")
        )
        hooks = f"{r['hooks_ms']:8.1f}" if "hooks_ms" in r else f"{'refused':>8}"
        hooks_ratio = f"{r['hooks_over_non_private']:.2f}" if "hooks_ms" in r else "-"
        ratios = "|".join([ratio, f"{r['ghost_over_non_private']:.2f}", f"{r['bk_over_non_private']:.2f}", hooks_ratio])
        print(
            f"{r['description']:40} {r['non_private_ms']:>8.1f} {opacus} {r['ghost_ms']:>8.1f} {r['bk_ms']:>8.1f} "
            f"{hooks} {ratios:>31} {over:>11} {peaks:>33}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", nargs="+", default=None)
    parser.add_argument("--one-pass", action="store_true", help="non-private, Opacus ghost, pl_dp ghost, BK, hooks")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    cases = args.cases or (["mlp", "transformer", "minilm"] + (["gpt2", "digits"] if args.one_pass else []))
    load_start = os.getloadavg()[0]
    rows = [(measure_one_pass if args.one_pass else measure)(name, args.quick, rounds) for name in cases]
    load_end = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPU cores, medians of "
        f"{rounds} interleaved rounds; load average (1 min) {load_start:.1f} at the start, {load_end:.1f} at the end"
    )
    if args.one_pass:
        print_one_pass(rows)
        return _write(args.json, rounds, load_start, load_end, rows)
    print(
        f"{'case':38} {'fwd+bwd':>8} {'norms old':>10} {'new':>7} {'ratio':>6} {'both passes old':>16} {'new':>7} "
        f"{'ratio':>6} {'÷ fwd+bwd old|new':>18} {'walk':>6} {'peak MB old|new':>16}"
    )
    for r in rows:
        peak = (
            f"{r['clipped_sum_peak_mb_before']:.0f}|{r['clipped_sum_peak_mb_after']:.0f}"
            if r["clipped_sum_peak_mb_before"] is not None
            else "-"
        )
        print(
            f"{r['description']:38} {r['non_private_fwd_bwd_ms']:>8.1f} {r['norms_before_ms']:>10.1f} "
            f"{r['norms_after_ms']:>7.1f} {r['norms_after_over_before']:>6.2f} {r['clipped_sum_before_ms']:>16.1f} "
            f"{r['clipped_sum_after_ms']:>7.1f} {r['clipped_sum_after_over_before']:>6.2f} "
            f"{r['clipped_sum_before_over_non_private']:>9.2f}|{r['clipped_sum_after_over_non_private']:<8.2f} "
            f"{r['graph_walk_ms']:>6.2f} {peak:>16}"
        )
    _write(args.json, rounds, load_start, load_end, rows)


def _write(path: Path | None, rounds: int, load_start: float, load_end: float, rows: list[dict]) -> None:
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "rounds": rounds,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "rows": rows,
    }
    if path:
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
