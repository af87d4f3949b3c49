"""Cost of keeping one batch shape in half precision: DPZero (and DP-SGD with hooks) on text, fp32 against bf16 with
dynamic padding (the old, leaky path) and bf16 with fixed shapes (the default since [halfprec]), side by side.

    python benchmarks/half_precision.py --json benchmarks/results/half_precision.json   # ~8 minutes on 2 CPU cores
    python benchmarks/half_precision.py --quick                                         # a smoke test, ~1 minute

A private run that computes in half precision (bf16/fp16 parameters, or a trainer that autocasts) pads every private
batch to the data module's ``max_length`` and runs every private forward on ``physical_rows`` rows (the last
micro-batch filled with copies of its first example): the bf16 rounding of an example's loss would otherwise depend on
the padded length, i.e. on the other examples sampled (``pl_dp.methods.precision``). This prices that, per case, in
one process, with the same Poisson batches (fixed sampling seed) in every variant:

* **fp32, dynamic**: fp32 weights, batches padded to their longest example (``fixed_length=False``: the baseline);
* **fp32, fixed (default)**: what a zeroth-order fp32 run does since the H200 session: padded to ``max_length``,
  whole batches (no row filling);
* **bf16, dynamic (old)**: bf16 weights, dynamic padding and no row filling — the path before the fix, which leaks;
  *timing only: refused by the probe* (``check_independence`` and the pre-flight pass's shape check are bypassed,
  ``physical_rows`` is None);
* **bf16, dynamic + rows**: what ``fixed_length=False`` runs now (dynamic padding, rows filled), to split the cost
  into padding and rows; refused by the probe too (bypassed the same way, timing only);
* **bf16, fixed (default)**: ``fixed_length=None`` on the data module, nothing bypassed — the probe runs and passes.

Cases: a random GPT-2 (4 layers, width 128, byte-level BPE of 2,048 tokens trained on Python's standard-library
docstrings as in ``benchmarks/generation.py``; 1.06M parameters) with ``loss="causal_lm"`` on VADER's emoji
descriptions (``TextGenerationDataModule``, ``max_length=32``, b = 64); the packaged MiniLM prompt classifier
(``configs/vader/prompt_dpzero.yaml``: encoder weights in bf16 via ``dtype=``, the 768-parameter head fp32 and
trained) on ``VaderSentimentDataModule`` at ``max_length`` 8 (the default) and 32 (b = 32); and DP-SGD
``per_sample="hooks"`` on the GPT-2, fp32 weights, ``precision="bf16-mixed"`` against ``"32-true"``.

Each variant is one ``Trainer.fit`` of ``--steps`` steps (``preflight=False``: the pre-flight pass is no step cost),
``--rounds`` rounds round-robin over the variants; the step time is the median over rounds of the median of the steps
after the first two (``StepTimer``: the training batch with Lightning's hooks). The fit-start probe runs, and is
timed, in the first round of each variant that does not bypass it (later rounds bypass it: it costs no step time);
a probe that raises is recorded, and that variant timed with the probe bypassed. Tokens per forward pass are what
the private forwards compute (rows × padded length, summed over a step's micro-batches) against the real tokens
(attention mask 1), averaged over the steps of the first round. The 1-minute load average is recorded before and after
(the latter includes this script's own two threads). Prints a table and JSON (``--json PATH``; the committed copy is
``benchmarks/results/half_precision.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _measure import StepTimer, quiet_trainer  # noqa: E402
from generation import docstring_sentences, emoji_descriptions, random_gpt2  # noqa: E402

from pl_dp import PrivacySpec  # noqa: E402
from pl_dp.data import TextGenerationDataModule, VaderSentimentDataModule  # noqa: E402
from pl_dp.methods import DPSGD, DPZero  # noqa: E402
from pl_dp.nets import CausalLM, PromptClassifier  # noqa: E402

WARMUP = 2  # steps left out of each fit's timing


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    half_weights: bool  # bf16 weights (else fp32)
    precision: str  # the trainer's
    fixed_length: bool | None  # the data module's
    rows: bool  # fill micro-batches to physical_rows (False: the old path)
    bypass_probe: bool  # timing only: the probe refuses this run


BYPASSED = "timing only: refused by the probe"
ZO_VARIANTS = [
    Variant("fp32", "fp32, dynamic (fixed_length=False)", False, "32-true", False, True, False),
    Variant("fp32_fixed", "fp32, fixed (default)", False, "32-true", None, True, False),
    Variant("bf16_old", f"bf16, dynamic, no rows (old; {BYPASSED})", True, "32-true", False, False, True),
    Variant("bf16_rows", f"bf16, dynamic + rows ({BYPASSED})", True, "32-true", False, True, True),
    Variant("bf16_fixed", "bf16, fixed (default)", True, "32-true", None, True, False),
]
MIXED_VARIANTS = [
    Variant("fp32", "32-true, dynamic", False, "32-true", None, True, False),
    Variant("bf16_old", f"bf16-mixed, dynamic, no rows (old; {BYPASSED})", False, "bf16-mixed", False, False, True),
    Variant("bf16_fixed", "bf16-mixed, fixed (default)", False, "bf16-mixed", None, True, False),
]


def unprobed(cls: type, rows: bool = True) -> type:
    """``cls`` with the fit-start checks that refuse dynamic padding in half precision bypassed — the probe
    (``check_independence``) and the pre-flight pass's shape check — and, with ``rows=False``, without row filling
    either: the path before the fix. Timing only (the step is what is timed; these runs are refused)."""
    from pl_dp.step import preflight

    class Unprobed(cls):
        if not rows:
            physical_rows = None  # every private forward on the batch as sampled, as before the fix

        def check_independence(self) -> None:  # timing only: refused by the probe
            pass

        def check_private_data(self):  # timing only: the shape check refuses a collate that pads per batch
            refuse = preflight.refuse_varying_batch_shapes
            preflight.refuse_varying_batch_shapes = lambda *args, **kwargs: None
            try:
                return super().check_private_data()
            finally:
                preflight.refuse_varying_batch_shapes = refuse

    Unprobed.__name__ = Unprobed.__qualname__ = f"{cls.__name__}{'Unprobed' if rows else 'OldPath'}"
    return Unprobed


def method_class(cls: type, variant: Variant) -> type:
    return unprobed(cls, variant.rows) if variant.bypass_probe else cls


def tiny_gpt2(workdir: Path, quick: bool) -> Path:
    """A byte-level BPE tokenizer (2,048 tokens, public docstrings) and a random GPT-2 (4 layers, width 128)."""
    return random_gpt2(workdir, docstring_sentences()[: 2000 if quick else None], width=128, layers=4)


@dataclass
class Case:
    name: str
    method: str
    batch_size: int
    max_length: int
    variants: list[Variant]
    net: dict  # half_weights -> a pristine net, deep-copied for each fit
    build: object  # (net, variant) -> (module, datamodule)


def cases(workdir: Path, quick: bool, names: list[str] | None) -> list[Case]:
    spec = PrivacySpec(epsilon=8.0)
    out = []
    wanted = set(names or ["gpt2", "minilm8", "minilm32", "dpsgd_hooks"])
    if wanted & {"gpt2", "dpsgd_hooks"}:
        model = tiny_gpt2(workdir, quick)
        texts = emoji_descriptions()[: 800 if quick else None]
        gpt = {False: CausalLM(model_path=model), True: CausalLM(model_path=model, dtype=torch.bfloat16)}

        def text_data(variant: Variant) -> TextGenerationDataModule:
            return TextGenerationDataModule(
                data=texts,
                tokenizer=model,
                max_length=32,
                batch_size=64,
                sampling_seed=0,
                fixed_length=variant.fixed_length,
            )

        if "gpt2" in wanted:

            def build_zo(net, variant):
                module = method_class(DPZero, variant)(
                    net, loss="causal_lm", lr=1e-3, clip=1.0, smoothing=1e-3, privacy=spec, preflight=False
                )
                return module, text_data(variant)

            out.append(Case("GPT-2 4x128 (1.06M), emoji, DPZero", "DPZero", 64, 32, ZO_VARIANTS, gpt, build_zo))
        if "dpsgd_hooks" in wanted:

            def build_sgd(net, variant):
                module = method_class(DPSGD, variant)(
                    net, loss="causal_lm", lr=1e-3, clip=1.0, per_sample="hooks", privacy=spec, preflight=False
                )
                return module, text_data(variant)

            out.append(
                Case("GPT-2 4x128 (1.06M), emoji, DP-SGD hooks", "DPSGD", 64, 32, MIXED_VARIANTS, gpt, build_sgd)
            )
    minilm = None
    for length in (8, 32):
        if f"minilm{length}" not in wanted:
            continue
        if minilm is None:
            words = ["terrible", "great"]
            minilm = {
                False: PromptClassifier(words, trainable="head"),
                True: PromptClassifier(words, trainable="head", dtype=torch.bfloat16),
            }

        def build_prompt(net, variant, length=length):
            module = method_class(DPZero, variant)(
                net, lr=3e-3, clip=10.0, smoothing=1e-3, privacy=spec, preflight=False
            )
            data = VaderSentimentDataModule(
                batch_size=32, prompt=net, max_length=length, sampling_seed=0, fixed_length=variant.fixed_length
            )
            return module, data

        out.append(
            Case(
                f"MiniLM prompt head, VADER len {length}, DPZero",
                "DPZero",
                32,
                length,
                ZO_VARIANTS,
                minilm,
                build_prompt,
            )
        )
    return out


class TokenCount(L.Callback):
    """Per step: the real tokens of the private batch and the tokens its private forwards compute."""

    def __init__(self) -> None:
        self.real: list[int] = []
        self.padded: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        mask = batch["attention_mask"]
        size, length = mask.shape
        rows = pl_module.physical_rows
        computed = size if rows is None or size == 0 else math.ceil(size / rows) * rows
        self.real.append(int(mask.sum()))
        self.padded.append(computed * length)


def fit_once(case: Case, variant: Variant, steps: int, probe: bool) -> dict:
    """One fit of ``steps`` steps; with ``probe``, the fit-start probe runs (where the variant does not bypass it) and
    is timed; without, it is bypassed (the step is the same: later rounds skip its cost)."""
    L.seed_everything(0, verbose=False)
    net = copy.deepcopy(case.net[variant.half_weights])
    module, data = case.build(net, variant if probe else replace(variant, bypass_probe=True))
    probe_s: list[float] = []
    check = module.check_independence

    def timed_probe() -> None:
        start = time.perf_counter()
        check()
        probe_s.append(time.perf_counter() - start)

    object.__setattr__(module, "check_independence", timed_probe)
    timer, tokens = StepTimer(), TokenCount()
    trainer = quiet_trainer(max_steps=steps, devices=1, precision=variant.precision, callbacks=[timer, tokens])
    load = os.getloadavg()[0]
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    return {
        "load": load,
        "steps": timer.times[WARMUP:],
        "fit_s": time.perf_counter() - start,
        "probe_s": probe_s[0] if probe and not variant.bypass_probe else None,
        "real_tokens": statistics.mean(tokens.real),
        "computed_tokens": statistics.mean(tokens.padded),
        "physical_rows": module.physical_rows,
    }


def measure(case: Case, steps: int, rounds: int) -> dict:
    """``rounds`` rounds over the variants; the probe runs in the first round only (where not bypassed). A variant
    whose probe raises is recorded so, and timed with the probe bypassed."""
    runs: dict[str, list[dict]] = {v.key: [] for v in case.variants}
    probes: dict[str, str] = {}
    for round_ in range(rounds):
        for variant in case.variants:
            first = round_ == 0 and not variant.bypass_probe
            try:
                run = fit_once(case, variant, steps, probe=first)
            except Exception as error:
                if not first:
                    raise
                probes[variant.key] = f"FAILED ({type(error).__name__}: {error}); timed with the probe bypassed"
                print(f"{case.name}, {variant.label}: the probe raised {type(error).__name__}: {error}", flush=True)
                run = fit_once(case, variant, steps, probe=False)
            else:
                if first:
                    probes[variant.key] = f"passed in {run['probe_s']:.1f} s"
            runs[variant.key].append(run)
    variants = {}
    for v in case.variants:
        medians = [statistics.median(r["steps"]) for r in runs[v.key]]
        first = runs[v.key][0]
        variants[v.key] = {
            "label": v.label,
            "weights": "bf16" if v.half_weights else "fp32",
            "precision": v.precision,
            "fixed_length": v.fixed_length,
            "probe": probes.get(v.key, f"bypassed ({BYPASSED})"),
            "probe_s": first["probe_s"],
            "physical_rows": first["physical_rows"],
            "step_s": statistics.median(medians),
            "step_s_rounds": medians,
            "slowest_step_s_rounds": [max(r["steps"]) for r in runs[v.key]],
            "fit_s_rounds": [r["fit_s"] for r in runs[v.key]],
            "real_tokens_per_step": first["real_tokens"],
            "computed_tokens_per_forward_pass": first["computed_tokens"],
        }
    base = variants["fp32"]["step_s"]
    old = variants["bf16_old"]["step_s"]
    for row in variants.values():
        row["over_fp32"] = row["step_s"] / base
        row["over_bf16_old"] = row["step_s"] / old
    loads = [r["load"] for runs_ in runs.values() for r in runs_]
    return {
        "case": case.name,
        "method": case.method,
        "load_average_1min_at_fit_starts": [min(loads), max(loads)],
        "expected_batch": case.batch_size,
        "max_length": case.max_length,
        "variants": variants,
        "fixed_over_old": variants["bf16_fixed"]["step_s"] / old,
        "fixed_over_fp32": variants["bf16_fixed"]["step_s"] / base,
        "fp32_fixed_over_fp32": variants["fp32_fixed"]["step_s"] / base if "fp32_fixed" in variants else None,
    }


def print_table(results: list[dict]) -> None:
    print(
        "\n| case | variant | rows | step ms | ÷ fp32 | ÷ bf16 old | tokens computed / real per forward | "
        "step ms per round | fit-start probe |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        for v in r["variants"].values():
            rounds = ", ".join(f"{1000 * s:.0f}" for s in v["step_s_rounds"])
            computed, real = v["computed_tokens_per_forward_pass"], v["real_tokens_per_step"]
            print(
                f"| {r['case']} | {v['label']} | {v['physical_rows'] or 'all'} | {1000 * v['step_s']:.1f} | "
                f"{v['over_fp32']:.2f} | {v['over_bf16_old']:.2f} | {computed:.0f} / {real:.0f} = "
                f"{computed / real:.2f} | {rounds} | {v['probe'][:60]} |"
            )
    print(
        "\n| case | fixed ÷ old bf16 | fixed ÷ fp32 | fp32 fixed ÷ fp32 dynamic | load average (1 min) at fit starts |"
        "\n|---|---|---|---|---|"
    )
    for r in results:
        low, high = r["load_average_1min_at_fit_starts"]
        fp32_fixed = "—" if r["fp32_fixed_over_fp32"] is None else f"{r['fp32_fixed_over_fp32']:.2f}"
        print(
            f"| {r['case']} | {r['fixed_over_old']:.2f} | {r['fixed_over_fp32']:.2f} | {fp32_fixed} | "
            f"{low:.2f}–{high:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, one round, small corpora: a smoke test")
    parser.add_argument("--steps", type=int, default=20, help="steps per fit (the first two are not timed)")
    parser.add_argument("--rounds", type=int, default=5, help="fits per variant, round-robin")
    parser.add_argument("--cases", nargs="*", choices=["gpt2", "minilm8", "minilm32", "dpsgd_hooks"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 5, 1
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        failed = []
        for case in cases(Path(tmp), args.quick, args.cases):
            try:
                results.append(measure(case, args.steps, args.rounds))
            except Exception as error:  # a case pl_dp cannot run: say so, measure the others
                failed.append({"case": case.name, "error": f"{type(error).__name__}: {error}"})
                print(f"{case.name}: FAILED, {failed[-1]['error'][:2000]}", flush=True)
                continue
            print(f"{case.name}: done ({time.perf_counter() - started:.0f} s)", flush=True)
    load_after = os.getloadavg()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average (1/5/15 min) before "
        f"{load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, after {load_after[0]:.2f} (with this run); "
        f"step: median over {args.rounds} rounds of the median of steps {WARMUP + 1}..{args.steps}"
    )
    print_table(results)
    for f in failed:
        print(f"FAILED: {f['case']}: {f['error'][:500]}")
    out = {
        "command": "python benchmarks/half_precision.py" + (" --quick" if args.quick else ""),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "steps_per_fit": args.steps,
        "untimed_steps": WARMUP,
        "rounds": args.rounds,
        "seconds": time.perf_counter() - started,
        "cases": results,
        "failed": failed,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
