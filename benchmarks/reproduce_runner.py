"""The reproduction benchmark's runner: train each run of the protocol in worker processes, store every record.

:func:`run_one` trains, validates and tests one job (a dict: setting, public shift, method, ε, knobs,
seed) through the ``pl-dp`` LightningCLI and returns its record (accuracies, ε spent, σ, steps, median
step time, peak memory, or the error); it never raises. :class:`Store` is the JSON of finished runs
(``results/reproduce.json``), rewritten atomically after each run, so a rerun skips every finished run
and an interrupted benchmark resumes where it stopped. :func:`execute` keeps the workers busy with the
runs of the earliest unfinished cells (:func:`~reproduce_protocol.schedule` says which runs a cell needs
next), so cells complete in the protocol's order.
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

from reproduce_protocol import BY_NAME, build_config, run_key, schedule


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
        if BY_NAME[job["method"]].train:
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        val = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]
        test = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
        model = cli.model
        record.update(
            val_acc=float(val["val/acc"]),
            test_acc=float(test["test/acc"]),
            epsilon_spent=float(model.epsilon) if model.privacy is not None else None,
            noise_multiplier=None if model.privacy is None else float(model.noise_multiplier),
            private_steps=int(getattr(model, "private_steps", 0)),
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


def execute(store: Store, plan: list[tuple], seeds, jobs: int, extra: dict[str, Any]) -> None:
    """Run every cell's schedule to completion, the earliest cells' runs first, ``jobs`` at a time."""
    open_cells = list(plan)
    submitted: set[str] = set()
    done, t0 = 0, time.perf_counter()

    def next_job() -> dict[str, Any] | None:
        for cell in list(open_cells):
            needed, complete = schedule(cell, store.runs, seeds, extra)
            if complete:
                open_cells.remove(cell)
                continue
            for job in needed:
                key = run_key(job)
                if key not in store.runs and key not in submitted:
                    submitted.add(key)
                    return job
        return None

    def finished(record: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        store.add(record)
        acc = f"val {record['val_acc']:.3f} test {record['test_acc']:.3f}" if "error" not in record else record["error"]
        print(f"[{done} {time.perf_counter() - t0:6.0f}s] {record['key']}: {acc}", flush=True)

    if jobs <= 1:
        _init_worker()
        while (job := next_job()) is not None:
            finished(run_one(job))
        return
    context = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=_init_worker) as pool:
        running: set[futures.Future] = set()
        while True:
            while len(running) < jobs and (job := next_job()) is not None:
                running.add(pool.submit(run_one, job))
            if not running:
                return
            complete, running = futures.wait(running, return_when=futures.FIRST_COMPLETED)
            for f in complete:
                finished(f.result())
