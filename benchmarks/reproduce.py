"""Privacy–utility reproduction (second edition): every pl_dp method, tuned per method, in four settings.

    python benchmarks/reproduce.py            # full run (175 worker-minutes, 1.5 hours with --jobs 2); resumable
    python benchmarks/reproduce.py --quick    # smoke run: digits and synthetic, ε = 1, 1 seed, no tuning, 24 steps
    python benchmarks/reproduce.py --report   # rebuild RESULTS.md and the plots from the JSON only

This file is the command line. The benchmark is three modules, each readable alone:
``reproduce_protocol.py`` (methods, settings, shifts, levels, seeds, tuning stages, the config of one run,
the selection rule), ``reproduce_runner.py`` (worker processes, the resumable JSON store) and
``reproduce_report.py`` (tables, paired tests of the papers' claims, plots, RESULTS.md).

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
from reproduce_protocol import BY_NAME, EPSILONS, METHODS, ROOT, SEEDS, SETTINGS, SHIFTS, cells  # noqa: E402, F401
from reproduce_report import PAZO, claims, report, summarize  # noqa: E402, F401  (PAZO, claims: for the tests)
from reproduce_runner import Store, execute  # noqa: E402


# ---- entry point ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    protocol = "".join(reproduce_protocol.__doc__.partition("Protocol (printed into RESULTS.md):")[1:])
    parser = argparse.ArgumentParser(
        description=f"{__doc__}\n{protocol}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: digits, synthetic, ε = 1, 1 seed, 24 steps")
    parser.add_argument("--report", action="store_true", help="only rebuild RESULTS.md and the plots from the JSON")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/, quick: benchmarks/quick)"
    )
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=None)
    parser.add_argument("--shifts", nargs="+", choices=SHIFTS, default=None, help="public shifts of the shift study")
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
        "datasets": args.settings or (["digits", "synthetic"] if quick else list(SETTINGS)),
        "methods": args.methods or [m.name for m in METHODS],
        "epsilons": args.epsilons or ([1.0] if quick else list(EPSILONS)),
        "shifts": args.shifts or (["mild"] if quick else list(SHIFTS)),
        "seeds": [0] if quick else list(SEEDS),
        "max_steps": 24 if quick else None,
        "jobs": args.jobs,
        "command": "python benchmarks/reproduce.py" + (" --quick" if quick else ""),
        "machine": f"{os.cpu_count()} CPU cores, torch {_torch_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    store = Store(data_dir / "reproduce.json", meta, keep_meta=args.report)
    meta = store.data["meta"]
    plan = cells(meta["datasets"], meta["methods"], meta["epsilons"], meta["shifts"])
    if not args.report:
        extra = {"max_steps": meta["max_steps"]} if meta["max_steps"] else {}
        execute(store, plan, meta["seeds"], args.jobs, extra)
    print(report(store, data_dir, results_md, plan))
    print(f"wrote {results_md}, {store.path} and the plots in {data_dir}")


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
