"""Per-step time and peak memory of pl_dp's zeroth-order step, against two forwards and Opacus.

    python benchmarks/step_cost.py            # full run (~2-3 minutes on 2 CPU cores)
    python benchmarks/step_cost.py --quick    # tiny models, smoke test

For each case (digits MLP 64-2048-2048-10 at batch 256; a 3.7M-parameter transformer at batch
64; opt-in ``--cases minilm``: the packaged pretrained MiniLM, 22.7M, at batch 32), measured side
by side in one process with interleaved repeats and medians:

* ``engine / 2 fwd``   — one DPZero step (q=1, clip + noise) on the bare engine, over two
  inference forwards of the same batch;
* ``lightning / 2 fwd`` — one DPZero ``training_step`` inside ``Trainer.fit`` (Poisson batches of
  the same expected size), over two forwards;
* ``dpzero / opacus``   — engine step over an Opacus DP-SGD step (GradSampleModule + DPOptimizer)
  on the same model and batch;
* ``MeZO / 2 fwd``, ``engine / MeZO`` — MeZO's step in a few lines of torch (directions redrawn by ``torch.randn``
  in four sweeps, no clipping or noise) over two forwards, and the DPZero engine step over it;

``--suite fine_tune`` (what ``--cases minilm`` runs by default) fine-tunes every parameter with DPZero,
PAZO-M, DP-SGD on per-example gradients (Opacus hooks), DP-SGD with ghost clipping and non-private SGD,
side by side: each method in its own fresh process (``--rounds`` round-robin), the same Poisson batches for
all (fixed sampling seed), the median step time of the steps after two warm-up steps, and resident memory
(RSS) over what was resident before ``Trainer.fit``: kept between steps, a step's transient peak, and the
fit's peak. The machine's load average is recorded at the start and end. For MiniLM:

    python benchmarks/step_cost.py --cases minilm --json benchmarks/results/step_cost_minilm.json

``--suite logging`` times a DPZero step on the small digits MLP when every step logs its metrics
(``log_every_n_steps=1``) over logging on Lightning's default cadence, interleaved fits.

``--suite directions`` prices the random directions: one perturbation sweep (draw + add) per parameter, in
ns, for each direction kind on all threads and for Gaussians on one thread (torch's generator without
pl_dp's chunked parallel draw), against one ``add_`` over the same parameters (the floor: a sweep
cannot cost less than reading and writing them once); and the DPZero step in the Lightning loop over
two forwards with the directions redrawn three times a query (``cache_directions=False``), kept
(the default below 256 MiB), Rademacher and low-rank.

``--suite queries`` compares q = 4 two-sided queries (8 forwards) with the one-sided estimator at
q = 4 (5 forwards) and q = 7 (8 forwards): step time on the bare engine and the mean squared error
of the non-private estimate Σ_j Δ_j u_j / q against the batch gradient, relative to ‖∇f‖², over
repeated draws.

``--suite pruning`` times DP-ZOPO's masked step (a :class:`DirectionMask` training 1 %, 10 % or
100 % of the coordinates) and the perturbation sweep alone, over the unmasked step, interleaved.

And, each in a fresh subprocess, the peak RSS growth of inference, a DPZero step and an Opacus
step over the memory live after setup (parameters, batch, persistent buffers), to check ZO
memory ≤ inference + largest tensor + 5 % of parameters, and DPZero's extra memory over
inference ≤ 0.15 × Opacus'. Prints a table and JSON (``--json PATH`` to save).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from step_suites.directions import directions_table, time_directions  # noqa: E402
from step_suites.fine_tune import fine_tune_case, fine_tune_probe, fine_tune_table  # noqa: E402
from step_suites.first_order import first_order_table, time_first_order  # noqa: E402
from step_suites.pruning import pruning_table, time_pruning  # noqa: E402
from step_suites.queries import queries_table, time_queries  # noqa: E402
from step_suites.zo import memory_case, memory_probe, table, time_case, time_logging  # noqa: E402

warnings.filterwarnings("ignore")


TARGETS = [  # (metric, case or None for every case, bound)
    ("pazo_m_over_dpzero", None, 1.3),
    ("engine_over_two_forwards", "transformer", 1.15),
    ("lightning_over_two_forwards", "digits-mlp", 1.15),  # [fast] issue 39
    ("lightning_over_two_forwards", "transformer", 1.05),
    ("dpzero_over_opacus", None, 0.30),
    ("dpzero_extra_over_opacus_extra", None, 0.15),
    ("dpsgd_constant_over_opacus", None, 1.05),
    ("dpsgd_automatic_over_constant", None, 1.05),
    ("dpsgd_psac_over_constant", None, 1.05),
    ("coupling_over_dpsgd_plus_public", None, 1.0),
    ("masked_step_1_over_unmasked", None, 1.10),
    ("ghost_over_sgd_fit_peak", None, 2.0),
]


def machine_load() -> dict:
    """CPU count and load averages when the run ended (timings on a shared machine are only as good as this)."""
    import os

    return {"cpus": os.cpu_count(), "load_average_1_5_15_min": list(os.getloadavg())}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models and few repeats (smoke test)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--suite",
        choices=["all", "zo", "directions", "queries", "first_order", "pruning", "logging", "fine_tune"],
        default="all",
        help="all: every suite but fine_tune on digits-mlp and transformer; on minilm, fine_tune only",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=["digits-mlp", "transformer", "minilm"],
        default=["digits-mlp", "transformer"],
        help="minilm (the packaged pretrained MiniLM at batch 32) is opt-in: per-example gradients need ~3 GB",
    )
    parser.add_argument("--rounds", type=int, default=2, help="fine_tune: fresh processes per method (round-robin)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--memory-probe", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--fine-tune-probe", nargs=3, metavar=("CASE", "METHOD", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        print(memory_probe(*args.memory_probe, args.quick))
        return
    if args.fine_tune_probe:
        name, method, steps = args.fine_tune_probe
        print(json.dumps(fine_tune_probe(name, method, args.quick, int(steps))))
        return
    torch.set_num_threads(2)
    repeats = args.repeats or (3 if args.quick else 9)
    rows, directions, queries, first_order, pruning, fine_tune = [], [], [], [], [], []
    for name in args.cases:
        if args.suite == "fine_tune" or (args.suite == "all" and name == "minilm"):
            fine_tune.append(fine_tune_case(name, args.quick, args.rounds))
            continue
        if args.suite in ("all", "zo"):
            row = time_case(name, args.quick, repeats)
            row.update(memory_case(name, args.quick, probes=1 if args.quick else 3))
            rows.append(row)
        if args.suite in ("all", "directions"):
            directions.append(time_directions(name, args.quick, repeats))
        if args.suite in ("all", "queries"):
            queries.append(time_queries(name, args.quick, repeats))
        if args.suite in ("all", "first_order"):
            first_order.append(time_first_order(name, args.quick, repeats))
        if args.suite in ("all", "pruning"):
            pruning.append(time_pruning(name, args.quick, repeats))
    small_cases = any(name != "minilm" for name in args.cases)
    logging_row = time_logging(repeats) if args.suite == "logging" or (args.suite == "all" and small_cases) else None
    checks = []
    for metric, case, bound in TARGETS:
        for r in rows + first_order + pruning + fine_tune:
            if metric not in r:
                continue
            if case in (None, r["case"]):
                checks.append(
                    {
                        "case": r["case"],
                        "metric": metric,
                        "value": r[metric],
                        "target": bound,
                        "met": r[metric] <= bound,
                    }
                )
    budgets = {"dpzero": "zo", "pazo_m": "pazo_m", "pazo_p": "pazo_p", "pazo_s": "pazo_s"}
    checks += [
        {
            "case": r["case"],
            "metric": f"{m}_peak_mb",
            "value": r[f"{m}_peak_mb"],
            "target": r[f"{b}_memory_budget_mb"],
            "met": r[f"{m}_peak_mb"] <= r[f"{b}_memory_budget_mb"],
        }
        for r in rows
        for m, b in budgets.items()
    ]
    result = {
        "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
        "repeats": repeats,
        "machine": machine_load(),
        "rows": rows,
        "directions": directions,
        "queries": queries,
        "first_order": first_order,
        "pruning": pruning,
        "fine_tune": fine_tune,
        "logging": logging_row,
        "targets": checks,
    }
    if rows:
        print(table(rows))
    for part, render in ((directions, directions_table), (queries, queries_table)):
        if part:
            print()
            print(render(part))
    if first_order:
        print()
        print(first_order_table(first_order))
    if pruning:
        print()
        print(pruning_table(pruning))
    if fine_tune:
        print()
        print(fine_tune_table(fine_tune))
    if logging_row:
        print()
        row = logging_row
        print(
            f"logging ({row['case']}, DPZero B=64): every step {row['log_every_step_ms']:.2f} ms, "
            f"every 50 steps {row['log_every_50_ms']:.2f} ms, ratio {row['every_step_over_cadence']:.2f}"
        )
    print()
    for c in checks:
        print(
            f"{'MET ' if c['met'] else 'MISS'} {c['case']:<12} {c['metric']:<32} {c['value']:.3f} <= {c['target']:.3f}"
        )
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
