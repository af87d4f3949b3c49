"""Cost of the fit-start checks — the pre-flight pass over the private set and the independence probe — next to a
training step, for the digits MLP and the packaged MiniLM on VADER.

    python benchmarks/fit_start_checks.py            # ~1 minute on 2 quiet CPU cores
    python benchmarks/fit_start_checks.py --quick    # the digits cases only

Each case builds the method and datamodule of a shipped config (``configs/digits/dpsgd.yaml``,
``configs/digits/dpzero.yaml``, ``configs/vader/dpsgd_ghost.yaml``, ``configs/vader/prompt_dpzero.yaml``), fits a few
steps, and times ``check_private_data`` (pre-flight: every private example read, batched and scored once),
``check_independence`` (the probe: a batch of the expected size collated several ways, in each mode the method
uses, and what a step releases compared between neighbouring batches) and the training steps after the first
(median). Both checks run once per private fit: ``preflight_s`` and ``probe_s`` are those first calls, as a fit pays
them. The probe's release check (``module.probe_release()``: clipped two-point differences along a few directions for
a zeroth-order method, the clipped gradient sum for a first-order one) is priced in the same process right after
that first call: ``check_independence`` runs again ``--repeats`` times with the release check and as many times
without it (``probe_release`` patched to return None), alternating; ``probe_warm_s`` and ``probe_no_release_s`` are
their medians and ``release_s`` the difference. The 1-minute load average before and after is in the JSON. Prints a
table and JSON (``--json PATH`` to save; the committed copy is ``benchmarks/results/fit_start_checks.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _measure import StepTimer, quiet_trainer  # noqa: E402

from pl_dp import PrivacySpec  # noqa: E402
from pl_dp.data import DigitsDataModule, VaderSentimentDataModule  # noqa: E402
from pl_dp.methods import DPSGD, DPZero  # noqa: E402
from pl_dp.nets import MLP, MiniLMClassifier, PromptClassifier  # noqa: E402


def _cases(quick: bool) -> dict:
    spec = PrivacySpec(epsilon=2.0)
    cases = {
        "digits MLP, DP-SGD (b=64)": lambda: (
            DPSGD(MLP(64, [64], 10), lr=0.5, clip=1.0, privacy=spec),
            DigitsDataModule(batch_size=64),
        ),
        "digits MLP, DPZero (b=64)": lambda: (
            DPZero(MLP(64, [64], 10), lr=0.02, clip=2.0, smoothing=1e-3, privacy=spec),
            DigitsDataModule(batch_size=64),
        ),
    }
    if not quick:
        cases |= {
            "VADER MiniLM full, DP-SGD ghost (b=32)": lambda: (
                DPSGD(MiniLMClassifier(trainable="all"), per_sample="ghost", lr=0.1, clip_fn="automatic", privacy=spec),
                VaderSentimentDataModule(batch_size=32),
            ),
            "VADER MiniLM prompt head, DPZero (b=32)": lambda: (
                DPZero(PromptClassifier(["terrible", "great"], trainable="head"), lr=3e-3, clip=10.0, privacy=spec),
                VaderSentimentDataModule(batch_size=32),
            ),
        }
    return cases


def _timed(module, name: str, seconds: dict) -> None:
    check = getattr(module, name)

    def timed():
        start = time.perf_counter()
        result = check()
        seconds[name] = time.perf_counter() - start
        return result

    object.__setattr__(module, name, timed)


def _probe_with_and_without_release(module, repeats: int, seconds: dict) -> None:
    """After the fit's own probe (timed by :func:`_timed`), run the probe ``repeats`` times with the release check and
    as many times without it (``probe_release`` returning None), alternating; record both medians."""
    check = module.check_independence

    def twice():
        check()  # the fit's own call, timed as it is paid
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for release in (False, True):
                if not release:
                    object.__setattr__(module, "probe_release", lambda: None)
                try:
                    start = time.perf_counter()
                    check()
                    times[release].append(time.perf_counter() - start)
                finally:
                    module.__dict__.pop("probe_release", None)
        seconds["probe_warm"] = statistics.median(times[True])
        seconds["probe_no_release"] = statistics.median(times[False])
        seconds["has_release"] = module.probe_release() is not None

    object.__setattr__(module, "check_independence", twice)


def measure(quick: bool, steps: int, repeats: int) -> list[dict]:
    rows = []
    for name, build in _cases(quick).items():
        L.seed_everything(0, verbose=False)
        model, data = build()
        seconds: dict[str, float] = {}
        _timed(model, "check_private_data", seconds)
        _timed(model, "check_independence", seconds)
        _probe_with_and_without_release(model, repeats, seconds)
        timer = StepTimer()
        trainer = quiet_trainer(max_steps=steps, devices=1, callbacks=[timer])
        trainer.fit(model, data)
        step = statistics.median(timer.times[1:])
        rows.append(
            {
                "case": name,
                "private_examples": len(trainer.train_dataloader.dataset),
                "preflight_s": seconds["check_private_data"],
                "probe_s": seconds["check_independence"],
                "probe_warm_s": seconds["probe_warm"],
                "probe_no_release_s": seconds["probe_no_release"],
                "release_s": seconds["probe_warm"] - seconds["probe_no_release"],
                "release_checked": seconds["has_release"],
                "step_s": step,
                "preflight_in_steps": seconds["check_private_data"] / step,
                "probe_in_steps": seconds["check_independence"] / step,
                "release_in_steps": (seconds["probe_warm"] - seconds["probe_no_release"]) / step,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="probe calls with and without the release check")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = measure(args.quick, args.steps, args.repeats)
    load_after = os.getloadavg()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; step: median of steps 2..{args.steps}; "
        f"probe: the fit's own call; warm: median of {args.repeats} later calls with / without the release check; "
        f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after (with this run)"
    )
    header = (
        "n",
        "pre-flight",
        "probe",
        "probe warm",
        "w/o release",
        "release",
        "step",
        "pre-flight/step",
        "probe/step",
        "release/step",
    )
    widths = (6, 11, 8, 11, 12, 8, 8, 16, 11, 13)
    print(f"{'case':42s} " + " ".join(f"{h:>{w}s}" for h, w in zip(header, widths)))
    for r in rows:
        print(
            f"{r['case']:42s} {r['private_examples']:6d} {r['preflight_s']:10.2f}s {r['probe_s']:7.2f}s "
            f"{r['probe_warm_s']:10.2f}s {r['probe_no_release_s']:11.2f}s {r['release_s']:7.2f}s "
            f"{r['step_s']:7.3f}s {r['preflight_in_steps']:15.1f}x {r['probe_in_steps']:10.1f}x "
            f"{r['release_in_steps']:12.1f}x"
        )
    result = {
        "command": "python benchmarks/fit_start_checks.py" + (" --quick" if args.quick else ""),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "steps": args.steps,
        "repeats": args.repeats,
        "cases": rows,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
