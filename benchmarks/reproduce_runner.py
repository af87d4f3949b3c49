"""The reproduction benchmark's runner: train each run of the protocol in worker processes, store every record.

:func:`run_one` trains, validates and tests one job (a dict: dataset, method, ε, η, seed) through the
``pl-dp`` LightningCLI and returns its record (accuracies, ε spent, σ, steps, median step time, peak
memory, or the error); it never raises. :class:`Store` is the JSON of finished runs
(``results/reproduce.json``), rewritten atomically after each run, so a rerun skips every finished run
and an interrupted benchmark resumes where it stopped. :func:`execute` runs the η grid (seed 0) of
every cell and, as soon as a cell's grid is done, its chosen η on the other seeds.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import multiprocessing
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from reproduce_protocol import build_config, choose, grid_jobs, run_key


# ---- one run -----------------------------------------------------------------------------------
def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """Train, validate and test one configuration; never raises (errors are recorded)."""
    from _measure import PeakMemory, StepTimer

    from pl_dp.cli import PlDpCLI

    record = dict(job, key=run_key(job))
    start = time.perf_counter()
    try:
        cli = PlDpCLI(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=build_config(job),
            run=False,
            save_config_callback=None,
            auto_configure_optimizers=False,
        )
        timer, memory = StepTimer(), PeakMemory()
        cli.trainer.callbacks.extend([timer, memory])
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        val = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]
        test = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
        model = cli.model
        record.update(
            val_acc=float(val["val/acc"]),
            test_acc=float(test["test/acc"]),
            epsilon_spent=float(model.epsilon),
            noise_multiplier=None if model.privacy is None else float(model.noise_multiplier),
            private_steps=int(model.private_steps),
            steps=len(timer.times),
            step_ms=1000 * statistics.median(timer.times[2:] or timer.times) if timer.times else None,
            peak_mb=memory.peak_mb,
        )
    except Exception as err:  # a diverged or refused configuration is a result, not a crash
        record["error"] = f"{type(err).__name__}: {err}"[:500]
    record["fit_s"] = time.perf_counter() - start
    return record


def _init_worker() -> None:
    import logging

    import lightning  # noqa: F401  (configures its loggers on import; quiet them afterwards)
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ---- the store and the schedule ------------------------------------------------------------------
class Store:
    """The JSON of finished runs, rewritten atomically after each one."""

    def __init__(self, path: Path, meta: dict[str, Any], keep_meta: bool = False) -> None:
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {"meta": meta, "runs": {}}
        if not keep_meta:  # a report-only call describes the run that produced the JSON
            self.data["meta"] = meta

    @property
    def runs(self) -> dict[str, dict[str, Any]]:
        return self.data["runs"]

    def add(self, record: dict[str, Any]) -> None:
        self.runs[record["key"]] = record
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        tmp.replace(self.path)


def execute(store: Store, plan: list[tuple], lr_grid, seeds, jobs: int, extra: dict[str, Any]) -> None:
    """Grid (seed 0) for every cell; as soon as a cell's grid is done, its chosen η on the other seeds."""
    pending: list[dict[str, Any]] = []
    waiting: dict[tuple, list[str]] = {}
    for cell in plan:
        grid = grid_jobs(cell, lr_grid, extra)
        waiting[cell] = [run_key(j) for j in grid]
        pending += [j for j in grid if run_key(j) not in store.runs]

    def follow_ups() -> list[dict[str, Any]]:
        out = []
        for cell, keys in list(waiting.items()):
            if all(k in store.runs for k in keys):
                del waiting[cell]
                best = choose([store.runs[k] for k in keys])
                if best is not None:
                    more = [dict(best_job(best), seed=s) for s in seeds if s != 0]
                    out += [j for j in more if run_key(j) not in store.runs]
        return out

    pending += follow_ups()
    total, done, t0 = len(pending), 0, time.perf_counter()

    def finished(record):
        nonlocal done
        done += 1
        store.add(record)
        acc = f"val {record['val_acc']:.3f} test {record['test_acc']:.3f}" if "error" not in record else record["error"]
        print(f"[{done}/{total}+ {time.perf_counter() - t0:6.0f}s] {record['key']}: {acc}", flush=True)

    if jobs <= 1:
        _init_worker()
        while pending:
            finished(run_one(pending.pop(0)))
            new = follow_ups()
            total += len(new)
            pending += new
        return
    context = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=_init_worker) as pool:
        running = {pool.submit(run_one, j) for j in pending}
        while running:
            complete, running = futures.wait(running, return_when=futures.FIRST_COMPLETED)
            for f in complete:
                finished(f.result())
            new = follow_ups()
            total += len(new)
            running |= {pool.submit(run_one, j) for j in new}


def best_job(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("dataset", "method", "epsilon", "lr", "seed", "max_steps")
    return {k: record[k] for k in keys if k in record}
