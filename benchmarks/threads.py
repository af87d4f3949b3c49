"""Torch's CPU threads on a small, shared machine: a pl_dp step and an Opacus step at 1 thread against torch's default
(issue [record] 41, item 5), side by side in one process.

    python benchmarks/threads.py --json benchmarks/results/threads.json   # ~5 minutes on 2 shared CPU cores
    python benchmarks/threads.py --quick                                   # one round of 2 steps, smoke test

torch runs its CPU operators on ``torch.get_num_threads()`` threads, by default as many as the machine has physical
cores, whatever else runs there. For each thread count (1, and the default the process started with) and each round
(``--rounds``, the order of the thread counts alternating round by round), on the digits MLP 64-128-128-10 at
expected batch 64 (``--wide``: 64-2048-2048-10 at 256, the wide MLP of ``step_cost.py``):

* ``dpzero``: a DPZero step (q = 1) inside ``Trainer.fit`` on Poisson batches;
* ``dpsgd``: a DP-SGD step (Opacus hooks, constant clipping) inside ``Trainer.fit`` on Poisson batches;
* ``opacus``: an Opacus DP-SGD step (``GradSampleModule`` + ``DPOptimizer``) on a fixed batch.

Step time: the median of each fit's steps after two warm-up steps (Opacus: of ``--steps`` calls after one), then the
median over rounds; the ratio is 1 thread over the default. The load average (1 min) is recorded at the start and end
and ``OMP_WAIT_POLICY`` as the process saw it (OpenMP reads it at start: it cannot change in a run). Prints a table
and JSON (``--json PATH`` to save; the committed copy is ``benchmarks/results/threads.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step_suites.common import fixed_batch, lightning_step_times, make_case, opacus_op, timed  # noqa: E402

METHODS = {"dpzero": "dpzero", "dpsgd": "dpsgd_constant"}


def measure(threads: int, wide: bool, steps: int) -> dict[str, float]:
    """Median step seconds of every case at ``threads`` threads."""
    torch.set_num_threads(threads)
    net, private, public, batch_size = make_case("digits-mlp", quick=not wide)
    times = {
        name: statistics.median(lightning_step_times(method, net, private, public, batch_size, steps=steps + 2))
        for name, method in METHODS.items()
    }
    opacus = opacus_op(net, fixed_batch(private, batch_size))
    opacus()
    times["opacus"] = statistics.median(timed(opacus) for _ in range(steps))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of 2 steps")
    parser.add_argument("--wide", action="store_true", help="the wide MLP 64-2048-2048-10 at batch 256")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per fit (after two warm-up steps)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rounds, steps = args.rounds or (1 if args.quick else 3), args.steps or (2 if args.quick else 6)
    default = torch.get_num_threads()
    counts = sorted({1, default})
    load_start = os.getloadavg()[0]
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    for r in range(rounds):
        for n in counts if r % 2 == 0 else counts[::-1]:
            runs[n].append(measure(n, args.wide, steps))
    torch.set_num_threads(default)
    load_end = os.getloadavg()[0]
    cases = ["dpzero", "dpsgd", "opacus"]
    median = {n: {c: statistics.median(run[c] for run in runs[n]) for c in cases} for n in counts}
    rows = [
        {
            "case": c,
            **{f"threads_{n}_ms": 1e3 * median[n][c] for n in counts},
            "one_over_default": median[1][c] / median[default][c],
        }
        for c in cases
    ]
    print(
        f"torch {torch.__version__}, default {default} threads on {os.cpu_count()} CPUs, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}; medians of {rounds} rounds of {steps} steps; load average "
        f"(1 min) {load_start:.1f} at the start, {load_end:.1f} at the end"
    )
    print("| case | " + " | ".join(f"{n} thread(s) ms" for n in counts) + " | 1 thread ÷ default |")
    print("|---|" + "---|" * (len(counts) + 1))
    for row in rows:
        times = " | ".join(f"{row[f'threads_{n}_ms']:.1f}" for n in counts)
        print(f"| {row['case']} | {times} | {row['one_over_default']:.2f} |")
    result = {
        "torch": torch.__version__,
        "default_threads": default,
        "cpu_count": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "model": "MLP 64-2048-2048-10, batch 256" if args.wide else "MLP 64-128-128-10, batch 64",
        "rounds": rounds,
        "steps": steps,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
