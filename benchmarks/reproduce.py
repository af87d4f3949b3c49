"""Privacy–utility reproduction: every pl_dp method on two datasets, five ε, three seeds.

    python benchmarks/reproduce.py            # full run (about an hour on 2 CPU cores); resumable
    python benchmarks/reproduce.py --quick    # smoke run: 1 seed, 1 setting, a few steps (~2 min)
    python benchmarks/reproduce.py --report   # rebuild RESULTS.md and the plots from the JSON only

This file is the command line. The benchmark is three modules, each readable alone:
``reproduce_protocol.py`` (methods, datasets, levels, seeds, step-size grid, the config of one run,
the selection rule), ``reproduce_runner.py`` (worker processes, the resumable JSON store) and
``reproduce_report.py`` (tables, the papers' claims, plots, RESULTS.md).

Results accumulate in ``results/reproduce.json`` (one record per run, written after every run):
a rerun skips every finished run, so an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also when loaded by path

import reproduce_protocol  # noqa: E402
from reproduce_protocol import BY_NAME, DATASETS, EPSILONS, LR_GRID, METHODS, ROOT, SEEDS, cells  # noqa: E402, F401
from reproduce_report import PAZO, claims, report, summarize  # noqa: E402, F401  (PAZO, claims: for the tests)
from reproduce_runner import Store, execute  # noqa: E402


# ---- entry point ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    protocol = "".join(reproduce_protocol.__doc__.partition("Protocol (printed into RESULTS.md):")[1:])
    parser = argparse.ArgumentParser(
        description=f"{__doc__}\n{protocol}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: digits, ε ∈ {1}, 1 seed, 1 setting, 24 steps")
    parser.add_argument("--report", action="store_true", help="only rebuild RESULTS.md and the plots from the JSON")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/, quick: benchmarks/quick)"
    )
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), default=None)
    parser.add_argument("--methods", nargs="+", choices=[m.name for m in METHODS], default=None)
    parser.add_argument("--epsilons", nargs="+", type=float, default=None)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    quick = args.quick
    out = args.out or (ROOT / "benchmarks" / ("quick" if quick else ""))
    results_md = out / "RESULTS.md"
    data_dir = out / "results" if not quick else out
    data_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "datasets": args.datasets or (["digits"] if quick else list(DATASETS)),
        "methods": args.methods or [m.name for m in METHODS],
        "epsilons": args.epsilons or ([1.0] if quick else list(EPSILONS)),
        "seeds": [0] if quick else list(SEEDS),
        "lr_grid": [1.0] if quick else list(LR_GRID),
        "max_steps": 24 if quick else None,
        "jobs": args.jobs,
        "command": "python benchmarks/reproduce.py" + (" --quick" if quick else ""),
        "machine": f"{os.cpu_count()} CPU cores, torch {_torch_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    store = Store(data_dir / "reproduce.json", meta, keep_meta=args.report)
    if not args.report:
        plan = list(cells(meta["datasets"], meta["methods"], meta["epsilons"]))
        extra = {"max_steps": meta["max_steps"]} if meta["max_steps"] else {}
        execute(store, plan, meta["lr_grid"], meta["seeds"], args.jobs, extra)
    print(report(store, data_dir, results_md))
    print(f"wrote {results_md}, {store.path} and the plots in {data_dir}")


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
