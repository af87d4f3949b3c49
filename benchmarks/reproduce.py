"""Privacy–utility reproduction: every pl_dp method on two datasets, five ε, three seeds.

    python benchmarks/reproduce.py            # full run (about an hour on 2 CPU cores); resumable
    python benchmarks/reproduce.py --quick    # smoke run: 1 seed, 1 setting, a few steps (~2 min)
    python benchmarks/reproduce.py --report   # rebuild RESULTS.md and the plots from the JSON only

Protocol (printed into RESULTS.md):

* Datasets: UCI digits (MLP 64-64-10, 1,208 private / 50 public, class-imbalanced public split)
  and VADER sentiment on frozen MiniLM sentence embeddings (MLP 384-64-2, 4,897 private / 204
  public, positive-shifted public split; :class:`pl_dp.data.VaderEmbeddingDataModule`).
* Every method starts from its shipped config in ``configs/digits/`` (model, clipping, callbacks,
  epochs); the VADER runs swap in the embedding data and a 384-input head and scale the epochs so
  both datasets train for about the same number of steps. Every run uses Opacus' RDP accountant
  (the tree accountant for O2NC) — PRV, the configs' default, is tighter but costs seconds per run.
* Levels: ε ∈ {0.1, 0.5, 1, 2, 3} at δ = 1/n, and the same method without noise ("non-private").
  Non-private SGD on private ∪ public and OnlyPub (public data only) are trained once, not per ε.
* Tuning: the step size η is the only tuned knob, over ``base η × {0.5, 1, 2}`` per method and
  dataset, with seed 0, on the validation split. The chosen η is then run with seeds 1 and 2;
  the tables give the test accuracy (mean ± std over seeds 0, 1, 2) of the chosen η. Test
  accuracy never enters a choice.
* Cost: median wall time per training step (after two warm-up steps) and peak RSS growth during
  training over what was live after the warm-up (Linux), each run in a worker process with one
  torch thread, ``--jobs`` workers side by side.

Results accumulate in ``results/reproduce.json`` (one record per run, written after every run):
a rerun skips every finished run, so an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EPSILONS = (0.1, 0.5, 1.0, 2.0, 3.0)
SEEDS = (0, 1, 2)
LR_GRID = (0.5, 1.0, 2.0)
PLOT_EPSILON = 1.0  # the accuracy-vs-time plot's ε, as PAZO's Fig. 5


@dataclass(frozen=True)
class Method:
    """One table row: a shipped config plus fixed overrides and the base step size per dataset."""

    name: str
    config: str
    family: str
    lr: dict[str, float]
    private: bool = True  # False: trained once, without ε (non-private SGD, OnlyPub)
    overrides: dict[str, Any] = field(default_factory=dict)


METHODS = (
    Method("DPZero", "dpzero", "ZO", {"digits": 0.04, "vader": 0.08}),
    # DPZero with the cheaper directions (same privacy; speed and accuracy against Gaussian directions)
    Method(
        "DPZero (Rademacher)",
        "dpzero",
        "ZO",
        {"digits": 0.04, "vader": 0.08},
        overrides={"model.init_args.direction": "rademacher"},
    ),
    Method(  # base η doubled: with DPZero's, low-rank's choice sat at the top of the grid (0.08 on digits at ε = 1)
        "DPZero (low-rank)",
        "dpzero",
        "ZO",
        {"digits": 0.08, "vader": 0.16},
        overrides={"model.init_args.direction": "lowrank"},
    ),
    Method("DP-ZOSO", "dpzoso", "ZO", {"digits": 0.08, "vader": 0.08}),
    Method("DP-ZOPO", "dpzopo", "ZO", {"digits": 0.16, "vader": 0.16}),
    Method("O2NC", "o2nc", "ZO", {"digits": 1.0, "vader": 1.0}),
    Method("PAZO-M", "pazo_m", "ZO+PUB", {"digits": 0.4, "vader": 0.4}),
    Method("PAZO-P (orthonormal)", "pazo_p", "ZO+PUB", {"digits": 0.7, "vader": 0.7}),
    Method(
        "PAZO-P (normalized)",
        "pazo_p",
        "ZO+PUB",
        {"digits": 0.7, "vader": 0.7},
        overrides={"model.init_args.orthonormalize": False},
    ),
    Method("PAZO-S", "pazo_s", "ZO+PUB", {"digits": 0.1, "vader": 0.2}),
    Method("DP-SGD", "dpsgd", "FO", {"digits": 0.5, "vader": 0.5}),
    Method("DP-SGD Auto-S", "dpsgd_auto", "FO", {"digits": 0.5, "vader": 0.5}),
    Method("DP-PSAC", "dpsgd_psac", "FO", {"digits": 0.5, "vader": 0.5}),
    Method("FullPriv", "full_priv", "FO", {"digits": 0.5, "vader": 0.5}),
    Method("DPMD", "dpmd", "FO+PUB", {"digits": 0.5, "vader": 0.5}),
    Method("Coupling", "coupling", "FO+PUB", {"digits": 0.5, "vader": 0.5}),
    Method("OnlyPub", "only_pub", "PUB", {"digits": 0.5, "vader": 0.5}, private=False),
    Method("SGD (non-private)", "non_priv", "none", {"digits": 0.5, "vader": 0.5}, private=False),
)
BY_NAME = {m.name: m for m in METHODS}


@dataclass(frozen=True)
class Dataset:
    name: str
    title: str
    data_class: str | None  # None keeps the config's DigitsDataModule
    in_features: int
    num_classes: int
    epoch_scale: float  # × the config's epochs: about equal step counts on both datasets


DATASETS = {
    "digits": Dataset("digits", "UCI digits (MLP 64-64-10)", None, 64, 10, 1.0),
    "vader": Dataset(
        "vader", "VADER on frozen MiniLM embeddings (MLP 384-64-2)", "pl_dp.data.VaderEmbeddingDataModule", 384, 2, 0.25
    ),
}


# ---- one run -----------------------------------------------------------------------------------
def run_key(job: dict[str, Any]) -> str:
    eps = "nonprivate" if job["epsilon"] is None else f"{job['epsilon']:g}"
    capped = f"|max_steps={job['max_steps']}" if job.get("max_steps") else ""
    return f"{job['dataset']}|{job['method']}|{eps}|lr={job['lr']:g}|seed={job['seed']}{capped}"


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    node = config
    *parents, leaf = dotted.split(".")
    for name in parents:
        node = node.setdefault(name, {})
    node[leaf] = value


def build_config(job: dict[str, Any]) -> dict[str, Any]:
    """The LightningCLI config of one run: the method's shipped config with the job's overrides."""
    import yaml

    method, dataset = BY_NAME[job["method"]], DATASETS[job["dataset"]]
    config = yaml.safe_load((ROOT / "configs" / "digits" / f"{method.config}.yaml").read_text())
    model = config["model"]["init_args"]
    for dotted, value in method.overrides.items():
        _set(config, dotted, value)
    model["net"]["init_args"].update(in_features=dataset.in_features, num_classes=dataset.num_classes)
    if dataset.data_class is not None:
        config["data"]["class_path"] = dataset.data_class
    trainer = config["trainer"]
    trainer["max_epochs"] = max(1, round(trainer["max_epochs"] * dataset.epoch_scale))
    if job.get("max_steps"):
        trainer["max_steps"] = job["max_steps"]
    trainer.update(num_sanity_val_steps=0, check_val_every_n_epoch=10_000)  # one evaluation, after fit
    config["seed_everything"] = job["seed"]
    # reproduction mode (both secrets seeded): a benchmark's runs must be rerunnable, not private
    config["data"]["init_args"].update(seed=job["seed"], sampling_seed=2_000 + job["seed"])
    model["lr"] = job["lr"]
    if "privacy" in model and model["privacy"] is not None and "noise_seed" not in model:
        model["noise_seed"] = 1_000 + job["seed"]
    if job["epsilon"] is None:
        model["privacy"] = None
    else:
        accountant = "tree" if model["privacy"]["accountant"] == "tree" else "rdp"
        model["privacy"] = {"epsilon": job["epsilon"], "accountant": accountant}
    return config


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


# ---- the schedule ------------------------------------------------------------------------------
def cells(datasets, methods, epsilons):
    """(dataset, method, ε or None) for every table cell to fill."""
    for dataset in datasets:
        for method in methods:
            levels = (*epsilons, None) if BY_NAME[method].private else (None,)
            for eps in levels:
                yield dataset, method, eps


def grid_jobs(cell, lr_grid, extra):
    dataset, method, eps = cell
    base = BY_NAME[method].lr[dataset]
    return [dict(dataset=dataset, method=method, epsilon=eps, lr=base * m, seed=0, **extra) for m in lr_grid]


def choose(cell_runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The seed-0 run with the best validation accuracy (ties: the smaller η)."""
    ok = [r for r in cell_runs if "error" not in r]
    return max(ok, key=lambda r: (r["val_acc"], -r["lr"])) if ok else None


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


# ---- the report --------------------------------------------------------------------------------
def summarize(runs: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """Per cell: the chosen η (by seed-0 validation accuracy) and its runs over the seeds.

    Only runs of the current plan count: runs left in the JSON by an earlier grid, base η or step
    cap are ignored, so they can never widen the documented grid.
    """
    by_cell: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs.values():
        method = BY_NAME.get(r["method"])
        if method is None or r.get("max_steps") != meta.get("max_steps"):
            continue
        if not any(math.isclose(r["lr"], method.lr[r["dataset"]] * m) for m in meta["lr_grid"]):
            continue
        by_cell.setdefault((r["dataset"], r["method"], r["epsilon"]), []).append(r)
    seeds = tuple(meta["seeds"])
    out = {}
    for cell, rs in by_cell.items():
        best = choose([r for r in rs if r["seed"] == 0])
        if best is None:
            out[cell] = {"failed": True, "errors": sorted({r["error"] for r in rs if "error" in r})}
            continue
        chosen = [r for r in rs if r["lr"] == best["lr"] and r["seed"] in seeds and "error" not in r]
        accs = [100 * r["test_acc"] for r in chosen]
        out[cell] = {
            "lr": best["lr"],
            "seeds": len(chosen),
            "mean": statistics.fmean(accs),
            "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "step_ms": statistics.median(r["step_ms"] for r in chosen if r.get("step_ms") is not None),
            "peak_mb": _median_or_none([r.get("peak_mb") for r in chosen]),
            "epsilon_spent": max(r["epsilon_spent"] for r in chosen),
            "steps": chosen[0]["steps"],
        }
    return out


def _median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _cell_text(s: dict[str, Any] | None, seeds: int) -> str:
    if s is None:
        return "—"
    if s.get("failed"):
        return "failed"
    if s["seeds"] < seeds:  # an interrupted run: say how many seeds the number rests on
        return f"{s['mean']:.1f} ({s['seeds']} of {seeds} seeds)"
    return f"{s['mean']:.1f} ± {s['std']:.1f}"


def level_label(eps: float | None) -> str:
    return "non-private" if eps is None else f"ε={eps:g}"


def accuracy_table(summary, dataset: str, methods, epsilons, seeds: int) -> list[str]:
    head = ["Family", "Method", *(level_label(e) for e in epsilons), "non-private"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in methods:
        method = BY_NAME[name]
        if method.private:
            cells_ = [_cell_text(summary.get((dataset, name, e)), seeds) for e in (*epsilons, None)]
        else:  # trained once: spends no ε on the private data (OnlyPub) or is not private at all
            value = _cell_text(summary.get((dataset, name, None)), seeds)
            cells_ = [f"*{value}*" if name == "OnlyPub" else "" for _ in epsilons] + [value]
        lines.append("| " + " | ".join([method.family, name, *cells_]) + " |")
    return lines


def lr_table(summary, dataset: str, methods, epsilons) -> list[str]:
    head = ["Method", "base η", *(level_label(e) for e in epsilons), "non-private"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in methods:
        levels = (*epsilons, None) if BY_NAME[name].private else (None,)
        chosen = {e: summary.get((dataset, name, e), {}).get("lr") for e in levels}
        row = [name, f"{BY_NAME[name].lr[dataset]:g}"]
        row += [f"{chosen[e]:g}" if chosen.get(e) else "" for e in (*epsilons, None)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def cost_table(summary, datasets, methods) -> list[str]:
    head = ["Method"]
    for d in datasets:
        head += [f"{d}: ms/step", f"{d}: peak MB", f"{d}: steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in methods:
        row = [name]
        for d in datasets:
            rows = [s for (ds, m, _), s in summary.items() if ds == d and m == name and not s.get("failed")]
            ms = _median_or_none([s["step_ms"] for s in rows])
            mb = _median_or_none([s["peak_mb"] for s in rows])
            steps = _median_or_none([s["steps"] for s in rows])
            row += [
                "" if ms is None else f"{ms:.2f}",
                "" if mb is None else f"{mb:.1f}",
                "" if steps is None else f"{steps:.0f}",
            ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


# ---- the papers' claims, checked on our numbers --------------------------------------------------
PAZO = ("PAZO-M", "PAZO-P (orthonormal)", "PAZO-P (normalized)", "PAZO-S")


def _acc(summary, dataset, method, eps):
    s = summary.get((dataset, method, eps))
    return None if s is None or s.get("failed") else s


def _compare(summary, datasets, winner, loser, epsilons, ties_win=False):
    """(cells where winner's mean > loser's (≥ with ``ties_win``), cells compared, cells where the
    gap exceeds one pooled std — counted only where both sides have at least two seeds)."""
    wins = compared = clear = 0
    for d in datasets:
        for e in epsilons:
            a, b = _acc(summary, d, winner, e), _acc(summary, d, loser, e)
            if a is None or b is None:
                continue
            compared += 1
            gap = round(a["mean"] - b["mean"], 6)
            wins += gap >= 0 if ties_win else gap > 0
            clear += min(a["seeds"], b["seeds"]) > 1 and abs(gap) > math.hypot(a["std"], b["std"])
    return wins, compared, clear


def _verdict(wins: int, compared: int) -> str:
    if compared == 0:
        return "not run"
    if wins == compared:
        return "**reproduces**"
    return "**does not reproduce**" if wins == 0 else f"**partly** ({wins}/{compared} cells)"


def claims(summary, datasets, epsilons) -> list[str]:
    rows = []

    def pairwise(claim, source, pairs, eps_set, ties_win=False):
        wins = compared = clear = 0
        evidence = []
        for winner, loser in pairs:
            w, c, cl = _compare(summary, datasets, winner, loser, eps_set, ties_win)
            wins, compared, clear = wins + w, compared + c, clear + cl
            if c:
                evidence.append(f"{winner} {'≥' if ties_win else '>'} {loser} in {w}/{c} cells")
        rows.append((claim, source, _verdict(wins, compared), "; ".join(evidence), clear, compared))

    def cellwise(claim, source, outcomes, evidence):
        """A claim judged on one outcome per compared cell (dataset, ε or variant); no seed-noise count."""
        rows.append((claim, source, _verdict(sum(outcomes), len(outcomes)), evidence, None, None))

    pairwise(
        "Every PAZO variant beats DPZero at every ε",
        "PAZO Tables 2–5",
        [(p, "DPZero") for p in PAZO],
        epsilons,
    )
    small = [e for e in epsilons if e <= 0.5]
    best_pazo_vs_fo = []
    for d in datasets:
        for e in small:
            pazo = [s for p in PAZO if (s := _acc(summary, d, p, e))]
            fo = [s for m in ("DPMD", "Coupling") if (s := _acc(summary, d, m, e))]
            if pazo and fo:
                best_pazo_vs_fo.append(max(s["mean"] for s in pazo) > max(s["mean"] for s in fo))
    cellwise(
        "At small ε (≤ 0.5) the best PAZO variant beats the best first-order method with public data (DPMD, Coupling)",
        "PAZO §5.2, Tables 2–5",
        best_pazo_vs_fo,
        f"best PAZO > best FO+PUB in {sum(best_pazo_vs_fo)}/{len(best_pazo_vs_fo)} (dataset, ε) cells",
    )
    drops = []
    lo, hi = EPSILONS[0], EPSILONS[-1]
    for d in datasets:
        fo = [(_acc(summary, d, "DP-SGD", hi), _acc(summary, d, "DP-SGD", lo))]
        pz = [(_acc(summary, d, p, hi), _acc(summary, d, p, lo)) for p in PAZO]
        fo_drop = [a["mean"] - b["mean"] for a, b in fo if a and b]
        pz_drop = [a["mean"] - b["mean"] for a, b in pz if a and b]
        if fo_drop and pz_drop:
            drops.append((d, fo_drop[0], statistics.fmean(pz_drop)))
    cellwise(
        f"First-order DP-SGD loses more accuracy than PAZO as ε shrinks from {hi:g} to {lo:g}",
        "PAZO §5.2",
        [f > p for _, f, p in drops],
        "; ".join(f"{d}: DP-SGD −{f:.1f} vs PAZO (mean of variants) −{p:.1f} points" for d, f, p in drops),
    )
    over_public = []
    for d in datasets:
        pub = _acc(summary, d, "OnlyPub", None)
        for e in epsilons:
            pazo = [s["mean"] for p in PAZO if (s := _acc(summary, d, p, e))]
            if pub and pazo:
                over_public.append((d, e, max(pazo) - pub["mean"]))
    cellwise(
        "The best PAZO variant improves on public-only training (OnlyPub) at every ε (by 4–9 points there)",
        "PAZO Table 6",
        [g > 0 for *_, g in over_public],
        "; ".join(f"{d} {level_label(e)}: {g:+.1f}" for d, e, g in over_public),
    )
    pairwise(
        "DP-ZOSO and DP-ZOPO beat DPZero",
        "DP-ZOPO Table II",
        [("DP-ZOSO", "DPZero"), ("DP-ZOPO", "DPZero")],
        epsilons,
    )
    pairwise(
        "Coupling beats FullPriv and DPMD at ε = 2",
        "Coupling Table 3",
        [("Coupling", "FullPriv"), ("Coupling", "DPMD")],
        [e for e in epsilons if e == 2.0] or epsilons[-1:],
    )
    only_pub = []
    for d in datasets:
        pub = _acc(summary, d, "OnlyPub", None)
        coupled = [(e, s) for e in epsilons if (s := _acc(summary, d, "Coupling", e))]
        if pub:
            only_pub += [(d, e, s["mean"], pub["mean"]) for e, s in coupled]
    at2 = [x for x in only_pub if x[1] == 2.0] or only_pub
    cellwise(
        "Coupling beats OnlyPub (ε = 2)",
        "Coupling Table 3",
        [c > p for _, _, c, p in at2],
        "; ".join(f"{d} {level_label(e)}: {c:.1f} vs {p:.1f}" for d, e, c, p in at2),
    )
    pairwise(
        "DP-PSAC ≥ Auto-S ≥ DP-SGD (constant clipping)",
        "DP-PSAC Table 2",
        [("DP-PSAC", "DP-SGD Auto-S"), ("DP-SGD Auto-S", "DP-SGD")],
        epsilons,
        ties_win=True,
    )
    speed = []
    for d in datasets:
        fo = [s["step_ms"] for e in epsilons if (s := _acc(summary, d, "DP-SGD", e))]
        for p in PAZO:
            zo = [s["step_ms"] for e in epsilons if (s := _acc(summary, d, p, e))]
            if fo and zo:
                speed.append((d, p, statistics.median(fo) / statistics.median(zo)))
    cellwise(
        "A PAZO step is faster than a DP-SGD step (2–16× on GPU)",
        "PAZO Table 8",
        [r > 1 for *_, r in speed],
        "; ".join(f"{d} {p}: {r:.2f}×" for d, p, r in speed),
    )
    lines = ["| Claim | Source | On our data | Evidence (test accuracy %, mean over seeds) | Gap > 1 pooled std |"]
    lines.append("|---|---|---|---|---|")
    for claim, source, verdict, evidence, clear, compared in rows:
        sig = "" if clear is None else f"{clear}/{compared}"
        lines.append(f"| {claim} | {source} | {verdict} | {evidence} | {sig} |")
    return lines


# ---- plots ---------------------------------------------------------------------------------------
STYLE = {"ZO": "o--", "ZO+PUB": "s-", "FO": "^:", "FO+PUB": "D-.", "PUB": "", "none": ""}


def _color(name: str):
    import matplotlib

    return matplotlib.colormaps["tab20"](list(BY_NAME).index(name) % 20)


def plot_accuracy_vs_epsilon(summary, datasets, methods, epsilons, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datasets), figsize=(7 * len(datasets), 5.8), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for name in methods:
            method = BY_NAME[name]
            if not method.private:
                s = _acc(summary, d, name, None)
                if s:
                    ax.axhline(s["mean"], ls=":" if name == "OnlyPub" else "--", color="gray", lw=1)
                    ax.annotate(name, (epsilons[0], s["mean"]), fontsize=7, color="gray", va="bottom")
                continue
            pts = [(e, s) for e in epsilons if (s := _acc(summary, d, name, e))]
            if pts:
                ax.errorbar(
                    [e for e, _ in pts],
                    [s["mean"] for _, s in pts],
                    yerr=[s["std"] for _, s in pts],
                    fmt=STYLE[method.family],
                    capsize=2,
                    label=name,
                    ms=4,
                    color=_color(name),
                )
        ax.set_xscale("log")
        ax.set_xticks(list(epsilons), [f"{e:g}" for e in epsilons])
        ax.set_xlabel("ε (δ = 1/n)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(DATASETS[d].title)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy_vs_time(summary, datasets, methods, eps: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(datasets), figsize=(7 * len(datasets), 5), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for name in methods:
            s = _acc(summary, d, name, eps if BY_NAME[name].private else None)
            if s and s.get("step_ms"):
                marker = STYLE[BY_NAME[name].family][:1] or "x"
                ax.errorbar(s["step_ms"], s["mean"], yerr=s["std"], fmt=marker, capsize=2, color=_color(name))
                ax.annotate(name, (s["step_ms"], s["mean"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("median wall time per training step (ms, 1 CPU thread)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{DATASETS[d].title}, ε = {eps:g}")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(store: Store, out: Path, results_md: Path) -> str:
    meta = store.data["meta"]
    datasets, methods, epsilons = meta["datasets"], meta["methods"], tuple(meta["epsilons"])
    summary = summarize(store.runs, meta)
    plots = {
        "eps": out / "accuracy_vs_epsilon.png",
        "time": out / "accuracy_vs_step_time.png",
    }
    plot_accuracy_vs_epsilon(summary, datasets, methods, epsilons, plots["eps"])
    plot_eps = PLOT_EPSILON if PLOT_EPSILON in epsilons else epsilons[-1]
    plot_accuracy_vs_time(summary, datasets, methods, plot_eps, plots["time"])
    rel = {k: os.path.relpath(p, results_md.parent) for k, p in plots.items()}
    errors = [r for r in store.runs.values() if "error" in r]
    spent = [r["epsilon_spent"] / r["epsilon"] for r in store.runs.values() if r["epsilon"] and "error" not in r]
    lines = [
        "# Reproduction: privacy–utility of every pl_dp method",
        "",
        f"Generated by `{meta['command']}` on {meta['machine']} ({meta['date']}); "
        f"{len(store.runs)} runs, {len(errors)} of them failed, "
        f"{sum(r['fit_s'] for r in store.runs.values()) / 60:.0f} worker-minutes.",
        "Regenerate: `python benchmarks/reproduce.py` (resumes from `benchmarks/results/reproduce.json`; "
        "delete it to start over), or `--report` to rebuild this page from the JSON.",
        "",
        f"Every private run stayed within its target: ε spent / target ≤ {max(spent, default=0):.4f} over "
        f"{len(spent)} private runs (the accountant's exact ε after the last step).",
        "",
        "## Protocol",
        "",
        *_protocol(meta),
        "",
    ]
    for d in datasets:
        lines += [
            f"## {DATASETS[d].title}",
            "",
            "Test accuracy (%), mean ± sample std over seeds "
            + ", ".join(map(str, meta["seeds"]))
            + ", of the step size chosen on the validation split. *Italics*: OnlyPub reads no private "
            "example and spends no ε, so the same runs fill every column.",
            "",
            *accuracy_table(summary, d, methods, epsilons, len(meta["seeds"])),
            "",
            "Chosen step size η per cell (grid: base η × " + ", ".join(f"{m:g}" for m in meta["lr_grid"]) + "):",
            "",
            *lr_table(summary, d, methods, epsilons),
            "",
        ]
    lines += [
        f"![accuracy vs epsilon]({rel['eps']})",
        "",
        "## Cost per step",
        "",
        "Median over the reported runs of each method's median step time (Lightning training batch, "
        "warm-up excluded) and peak RSS growth during training (Linux `VmHWM`, reset after two warm-up "
        f"steps), with {meta['jobs']} worker process(es) of one torch thread each running side by side.",
        "",
        *cost_table(summary, datasets, methods),
        "",
        f"![accuracy vs step time]({rel['time']})",
        "",
        "## The papers' claims on our data",
        "",
        "A claim *reproduces* when it holds for the mean test accuracy in every compared (dataset, ε) cell;"
        " the last column counts the cells where the gap is larger than one pooled seed std"
        " (√(s₁² + s₂²)) — the rest are within seed noise.",
        "",
        *claims(summary, datasets, epsilons),
        "",
    ]
    if errors:
        lines += ["## Failed runs", ""]
        lines += [f"* `{r['key']}`: {r['error']}" for r in sorted(errors, key=lambda r: r["key"])]
        lines.append("")
    text = "\n".join(lines)
    results_md.write_text(text)
    return text


def _protocol(meta) -> list[str]:
    return [
        f"* Datasets: {', '.join(DATASETS[d].title for d in meta['datasets'])}. Fixed splits (private, "
        "public, validation, test); the public split is distribution-shifted (class imbalance).",
        "* Each method is its shipped `configs/digits/<name>.yaml` (clipping, callbacks, epochs) with the "
        "dataset's head and data swapped in; epochs × "
        + ", ".join(f"{DATASETS[d].epoch_scale:g} ({d})" for d in meta["datasets"])
        + ". Opacus' RDP accountant (tree accountant for O2NC), δ = 1/n.",
        f"* Levels: ε ∈ {{{', '.join(f'{e:g}' for e in meta['epsilons'])}}} and the same method without noise"
        " (non-private). SGD (non-private, on private ∪ public) and OnlyPub are trained once.",
        "* Tuning: the step size only, over base η × {"
        + ", ".join(f"{m:g}" for m in meta["lr_grid"])
        + "}, with seed 0, by validation accuracy; the chosen η is rerun with the other seeds. Test accuracy "
        "never enters a choice. Seeds set the initialization, the Poisson sampler, the public batches and "
        "the DP noise.",
        *([f"* Each run is capped at {meta['max_steps']} steps (quick smoke mode)."] if meta.get("max_steps") else []),
    ]


# ---- entry point ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
