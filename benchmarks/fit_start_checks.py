"""Cost of the fit-start checks — the pre-flight pass over the private set and the independence probe — next to a
training step, for the digits MLP and the packaged MiniLM on VADER.

    python benchmarks/fit_start_checks.py            # ~3 minutes on 2 CPU cores
    python benchmarks/fit_start_checks.py --quick    # the digits cases only

Each case builds the method and datamodule of a shipped config (``configs/digits/dpsgd.yaml``,
``configs/digits/dpzero.yaml``, ``configs/vader/dpsgd_ghost.yaml``, ``configs/vader/prompt_dpzero.yaml``), fits a few
steps, and times ``check_private_data`` (pre-flight: every private example read, batched and scored once),
``check_independence`` (the probe: a batch of the expected size collated several ways, in each mode the method
uses) and the training steps after the first (median). Both checks run once per private fit. Prints a table and
JSON (``--json PATH`` to save; the committed copy is ``benchmarks/results/fit_start_checks.json``).
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


def measure(quick: bool, steps: int) -> list[dict]:
    rows = []
    for name, build in _cases(quick).items():
        L.seed_everything(0, verbose=False)
        model, data = build()
        seconds: dict[str, float] = {}
        _timed(model, "check_private_data", seconds)
        _timed(model, "check_independence", seconds)
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
                "step_s": step,
                "preflight_in_steps": seconds["check_private_data"] / step,
                "probe_in_steps": seconds["check_independence"] / step,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = measure(args.quick, args.steps)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; step: median of steps 2..{args.steps}")
    header = ("n", "pre-flight", "probe", "step", "pre-flight/step", "probe/step")
    print(f"{'case':42s} " + " ".join(f"{h:>{w}s}" for h, w in zip(header, (6, 11, 8, 8, 16, 11))))
    for r in rows:
        print(
            f"{r['case']:42s} {r['private_examples']:6d} {r['preflight_s']:10.2f}s {r['probe_s']:7.2f}s "
            f"{r['step_s']:7.3f}s {r['preflight_in_steps']:15.1f}x {r['probe_in_steps']:10.1f}x"
        )
    print(json.dumps(rows, indent=1))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
