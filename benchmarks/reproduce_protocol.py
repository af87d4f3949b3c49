"""The reproduction benchmark's protocol: what is run, on what, and how a setting is chosen.

Read alone, this module says what every number in ``benchmarks/RESULTS.md`` is: the methods (each a
shipped config plus fixed overrides and a base step size per dataset), the datasets, the privacy
levels, the seeds, the step-size grid, the LightningCLI config of one run (:func:`build_config`), the
cells of the tables (:func:`cells`, :func:`grid_jobs`) and the selection rule (:func:`choose`:
validation accuracy only). ``reproduce_runner`` executes it, ``reproduce_report`` tabulates it,
``reproduce.py`` is the command line.

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
"""

from __future__ import annotations

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


# ---- one run: its key in the JSON and its LightningCLI config -----------------------------------
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


# ---- the schedule: which runs fill which table cell, and which η a cell reports ---------------------
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


# ---- the protocol as printed into RESULTS.md ----------------------------------------------------
def protocol_lines(meta) -> list[str]:
    """The protocol section of RESULTS.md, for the plan in ``meta`` (the JSON's description of the run)."""
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
