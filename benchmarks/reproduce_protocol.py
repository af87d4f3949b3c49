"""The reproduction benchmark's protocol (second edition): what is run, on what, how each setting is tuned.

Read alone, this module says what every number in ``benchmarks/RESULTS.md`` is: the methods (each a
shipped config, the knobs its paper tunes and their grids), the settings (datasets, public-data shifts,
step budgets), the privacy levels, the seeds, the LightningCLI config of one run (:func:`build_config`),
the schedule of one table cell (:func:`schedule`: tuning stages on seed 0, then the chosen setting on
every seed) and the selection rule (:func:`choose`: validation accuracy only). ``reproduce_runner``
executes it, ``reproduce_report`` tabulates and tests it, ``reproduce.py`` is the command line.
The first edition (η tuned alone, 3 seeds, equal-ish step budgets) is in git history.

Protocol (printed into RESULTS.md):

* Settings. (1) UCI digits, MLP 64-64-10 from scratch (1,208 private / 50 public examples). (2) VADER
  sentiment on frozen MiniLM sentence embeddings, MLP 384-64-2 (4,897 private / 204 public). (3) VADER as a
  prompt on the pretrained MiniLM encoder (label words "terrible"/"great", tied label-word head), fine-tuning
  the encoder's biases and the head (BitFit, 26,880 parameters) — or, for DP-ZOPO, the whole pretrained
  encoder pruned to 0.5–8 % of its coordinates. (4) A synthetic problem in O2NC's regime (``make_classification``,
  10 features, 400,000 private examples, logistic regression).
* Public data at three shifts (class imbalance of the public split, :mod:`pl_dp.data.shift`): none
  (in-distribution), mild (1.5:1, the main tables) and strong (3:1, the first edition's) — the
  shift study repeats every public-data method at ε = 1 under each.
* Step budgets: zeroth-order methods get 5× the first-order steps (the table "Step budgets" gives them).
* Tuning, on the validation split only, with seed 0, in two stages per cell: (1) the clip bound C ×
  step size η (C ∈ C₀ × {0.1, 0.3, 1, 3} for methods with a clip bound that is not folded into η;
  η ∈ η₀·√(C₀/C) × {0.5, 1, 2} — the √ centres the η grid between "no example clipped" and "every
  example clipped"), then η doubled (or halved) while the best η sits at an end of those tried, at most
  twice per C; (2) the method's own knob at the stage-1 choice: α (PAZO-M, Coupling), the public
  batch size b′ (PAZO-P, PAZO-S), DPMD's switch point (the cosine schedule's anneal factor). The best
  of both stages by validation accuracy (ties: the earliest) is then run on fresh evaluation seeds. The
  prompt setting (minutes per run) tunes coordinate-wise: C ∈ C₀ × {0.3, 1, 3} at η₀, then η by the
  widening rule at the chosen C. Test accuracy never enters a choice, and the tuning seed's runs never
  enter a table.
* Seeds: 5 evaluation seeds, 1–5 (3 in the prompt setting), none of them the tuning seed 0. Seed s fixes the
  initialization, the Poisson sampler's seed and the noise seed; two methods with the same network and
  private set share the initialization and the sampled batches at seed s, so comparisons are paired by
  seed (FullPriv samples from private ∪ public, OnlyPub samples no private data, and zeroth- and
  first-order noises are different draws). Claims are judged by a paired t test over the seeds (95 %
  interval of the mean difference, not adjusted for multiple comparisons).
* Accounting: Opacus' RDP accountant, δ = 1/n, add/remove-one adjacency (Poisson sampling) — except
  O2NC, whose tree accountant gives replace-one ε over a partitioned pass; every table labels it.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EPSILONS = (0.1, 1.0, 3.0)
SHIFTS = ("none", "mild", "strong")
MAIN_SHIFT = "mild"
SHIFT_EPSILON = 1.0  # the shift study's ε, as PAZO's Table 7
TUNING_SEED = 0  # every choice is made on this seed's validation accuracy; the tables report other seeds
SEEDS = (1, 2, 3, 4, 5)  # evaluation seeds: fresh runs of the chosen setting, never used to choose
PLOT_EPSILON = 1.0  # the accuracy-vs-time plot's ε, as PAZO's Fig. 5
LR_FACTORS = (0.5, 1.0, 2.0)
CLIP_FACTORS = (0.1, 0.3, 1.0, 3.0)
LR_EXTENSIONS = 2  # η values added beyond the grid's ends per clip bound, while the best sits at an end
ZO_BUDGET = 5  # zeroth-order steps per first-order step
REPLACE_ONE = "replace-one"
ADD_REMOVE = "add/remove"


@dataclass(frozen=True)
class Knob:
    """A method's own tuned hyperparameter (stage 2): a dotted config path and its values (the config's first)."""

    label: str
    path: str
    values: tuple[Any, ...]
    per_setting: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # a setting's own values

    def values_for(self, setting: str) -> tuple[Any, ...]:
        return self.per_setting.get(setting, self.values)


@dataclass(frozen=True)
class Method:
    """One table row: a shipped config, its base η per setting, and what is tuned."""

    name: str
    config: str  # under configs/: "digits/dpzero" (its head and data swapped per setting) or a setting's own
    family: str
    lr: dict[str, float]
    settings: tuple[str, ...]
    tune_clip: bool = True  # False: the clip bound is folded into η (automatic clipping) or not a DP knob
    knob: Knob | None = None
    private: bool = True  # False: trained once, without ε (non-private SGD, OnlyPub, zero-shot)
    shift_study: bool = False  # repeated under each public shift at ε = 1
    train: bool = True  # False: evaluated as loaded (zero-shot)
    overrides: dict[str, Any] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)  # a setting's budget when not the family's

    @property
    def zeroth_order(self) -> bool:
        return self.family.startswith("ZO")

    @property
    def adjacency(self) -> str:
        """O2NC's tree accountant bounds replace-one ε (a partitioned pass); the rest are add/remove-one."""
        return REPLACE_ONE if self.name.startswith("O2NC") else ADD_REMOVE


TABULAR = ("digits", "vader")
ALPHA_PAZO = Knob("α", "model.init_args.alpha", (0.5, 0.2, 0.8))
ALPHA_COUPLING = Knob("α", "model.init_args.alpha", (0.2, 0.05, 0.5))
# digits has 50 public examples: PAZO-P's k = 3 disjoint batches fit b′ ≤ 16
PUBLIC_BATCH = Knob("b′", "data.init_args.public_batch_size", (16, 8, 32), {"digits": (16, 8, 4)})
SWITCH = Knob("anneal factor", "trainer.callbacks.1.init_args.anneal_factor", (2.0, 1.0, 4.0))
PROMPT_DPZOPO = {  # DP-ZOPO on the pretrained encoder: incremental pruning to 0.5, 2 and 8 % of the coordinates
    "trainer.callbacks.2.init_args.rates": [0.005, 0.02, 0.08],
}

METHODS = (
    Method("DPZero", "digits/dpzero", "ZO", {"digits": 0.04, "vader": 0.08}, TABULAR),
    Method("DP-ZOSO", "digits/dpzoso", "ZO", {"digits": 0.08, "vader": 0.08}, TABULAR),
    Method("DP-ZOPO", "digits/dpzopo", "ZO", {"digits": 0.16, "vader": 0.16}, TABULAR),
    Method(  # its shipped passes (3.4× and 2.9× the first-order steps): 17 ms a round, and outside its regime here
        "O2NC", "digits/o2nc", "ZO", {"digits": 1.0, "vader": 1.0}, TABULAR, epochs={"digits": 3, "vader": 1}
    ),
    Method(
        "PAZO-M", "digits/pazo_m", "ZO+PUB", {"digits": 0.4, "vader": 0.4}, TABULAR, knob=ALPHA_PAZO, shift_study=True
    ),
    Method(
        "PAZO-P (orthonormal)",
        "digits/pazo_p",
        "ZO+PUB",
        {"digits": 0.7, "vader": 0.7},
        TABULAR,
        knob=PUBLIC_BATCH,
        shift_study=False,
    ),
    Method(
        "PAZO-P (normalized)",
        "digits/pazo_p",
        "ZO+PUB",
        {"digits": 0.7, "vader": 0.7},
        TABULAR,
        knob=PUBLIC_BATCH,
        shift_study=True,
        overrides={"model.init_args.orthonormalize": False},
    ),
    Method(
        "PAZO-S", "digits/pazo_s", "ZO+PUB", {"digits": 0.1, "vader": 0.2}, TABULAR, knob=PUBLIC_BATCH, shift_study=True
    ),
    Method("DP-SGD", "digits/dpsgd", "FO", {"digits": 0.5, "vader": 0.5}, TABULAR),
    Method("DP-SGD Auto-S", "digits/dpsgd_auto", "FO", {"digits": 0.5, "vader": 0.5}, TABULAR, tune_clip=False),
    Method("DP-PSAC", "digits/dpsgd_psac", "FO", {"digits": 0.5, "vader": 0.5}, TABULAR, tune_clip=False),
    Method("FullPriv", "digits/full_priv", "FO", {"digits": 0.5, "vader": 0.5}, TABULAR, tune_clip=False),
    Method(
        "DPMD",
        "digits/dpmd",
        "FO+PUB",
        {"digits": 0.5, "vader": 0.5},
        TABULAR,
        tune_clip=False,
        knob=SWITCH,
        shift_study=True,
    ),
    Method(
        "Coupling",
        "digits/coupling",
        "FO+PUB",
        {"digits": 0.5, "vader": 0.5},
        TABULAR,
        tune_clip=False,
        knob=ALPHA_COUPLING,
        shift_study=True,
    ),
    Method(
        "OnlyPub", "digits/only_pub", "PUB", {"digits": 0.5, "vader": 0.5}, TABULAR, private=False, shift_study=True
    ),
    Method("SGD (non-private)", "digits/non_priv", "none", {"digits": 0.5, "vader": 0.5}, TABULAR, private=False),
    # the prompt setting: BitFit of the pretrained MiniLM encoder (DP-ZOPO: the whole encoder, pruned)
    Method("Zero-shot", "vader/prompt_dpzero", "none", {}, ("prompt",), private=False, train=False),
    Method(
        "DPZero (BitFit)",
        "vader/prompt_dpzero",
        "ZO",
        {"prompt": 0.003},
        ("prompt",),
        overrides={"model.init_args.net.init_args.trainable": "bias"},
    ),
    Method(
        "DP-ZOPO (pruned encoder)",
        "vader/prompt_dpzopo",
        "ZO",
        {},
        ("prompt",),
        overrides=PROMPT_DPZOPO,
    ),
    Method(
        "DP-SGD (BitFit)",
        "vader/prompt_dpsgd_lora",
        "FO",
        {"prompt": 0.1},
        ("prompt",),
        overrides={"model.init_args.net.init_args.trainable": "bias", "model.init_args.clip_fn": "constant"},
    ),
    # O2NC's regime: n large against d (Zhang, Tran & Cutkosky 2024, Thm. 4.9)
    Method("O2NC (in regime)", "synthetic/o2nc", "ZO", {}, ("synthetic",), epochs={"synthetic": 1}),
    Method(  # the paper's "privacy for free" compares with the same algorithm without noise
        "O2NC (in regime, non-private)",
        "synthetic/o2nc",
        "ZO",
        {},
        ("synthetic",),
        private=False,
        epochs={"synthetic": 1},
    ),
    Method("DP-SGD (logistic)", "synthetic/dpsgd", "FO", {}, ("synthetic",)),
    Method("Logistic regression (non-private)", "synthetic/logreg", "none", {}, ("synthetic",), private=False),
)


@dataclass(frozen=True)
class Setting:
    name: str
    title: str
    data_class: str | None  # None keeps the config's data module
    in_features: int | None  # None keeps the config's net
    num_classes: int | None
    first_order_epochs: int  # the zeroth-order methods get ZO_BUDGET × these
    seeds: tuple[int, ...] = SEEDS
    epsilons: tuple[float, ...] = EPSILONS
    shifted: bool = True  # a bundled public split whose shift the protocol sets
    clip_factors: tuple[float, ...] = CLIP_FACTORS
    lr_factors: tuple[float, ...] = LR_FACTORS  # (1,): η searched by widening alone (coordinate-wise, after C)


SETTINGS = {
    "digits": Setting("digits", "UCI digits (MLP 64-64-10)", None, 64, 10, 10),
    "vader": Setting(
        "vader", "VADER on frozen MiniLM embeddings (MLP 384-64-2)", "pl_dp.data.VaderEmbeddingDataModule", 384, 2, 3
    ),
    "prompt": Setting(  # minutes per run: C at the base η, then η by widening (coordinate-wise); 3 seeds
        "prompt",
        "VADER as a prompt on pretrained MiniLM (BitFit)",
        None,
        None,
        None,
        1,
        (1, 2, 3),
        (1.0,),
        clip_factors=(0.3, 1.0, 3.0),
        lr_factors=(1.0,),
    ),
    "synthetic": Setting(
        "synthetic", "Synthetic, O2NC's regime (logistic regression)", None, None, None, 1, SEEDS, (1.0,), False
    ),
}
DATASETS = SETTINGS  # the first edition's name

#: the correlated-noise study (``benchmarks/correlated_noise.py``), apart from the main tables: DP-SGD with independent
#: noise against banded matrix-factorization noise, η tuned alone (C = the config's 1.0 for both), at the family's
#: epochs and at 4× as many — the regime where correlated noise is reported to help
BANDS = 4
LONG = 4  # epochs × this in the long regime
_DPSGD_LR = {"digits": 0.5, "vader": 0.5}
_BANDED = {"model.init_args.noise": "banded", "model.init_args.bands": BANDS}
CORRELATED_NOISE = (
    Method("DP-SGD, independent noise", "digits/dpsgd", "FO", _DPSGD_LR, TABULAR, tune_clip=False),
    Method(f"DP-SGD, banded noise (b = {BANDS})", "digits/dpsgd", "FO", _DPSGD_LR, TABULAR, False, overrides=_BANDED),
    Method(
        f"DP-SGD, independent noise, {LONG}× epochs",
        "digits/dpsgd",
        "FO",
        _DPSGD_LR,
        TABULAR,
        tune_clip=False,
        epochs={name: SETTINGS[name].first_order_epochs * LONG for name in TABULAR},
    ),
    Method(
        f"DP-SGD, banded noise (b = {BANDS}), {LONG}× epochs",
        "digits/dpsgd",
        "FO",
        _DPSGD_LR,
        TABULAR,
        tune_clip=False,
        overrides=_BANDED,
        epochs={name: SETTINGS[name].first_order_epochs * LONG for name in TABULAR},
    ),
)
BY_NAME = {m.name: m for m in METHODS + CORRELATED_NOISE}


# ---- one run: its key in the JSON and its LightningCLI config -----------------------------------
def run_key(job: dict[str, Any]) -> str:
    eps = "nonprivate" if job["epsilon"] is None else f"{job['epsilon']:g}"
    knobs = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(job["knobs"].items()))
    capped = f"|max_steps={job['max_steps']}" if job.get("max_steps") else ""
    return f"{job['dataset']}|{job['shift']}|{job['method']}|{eps}|{knobs}|seed={job['seed']}{capped}"


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    node: Any = config
    *parents, leaf = dotted.split(".")
    for name in parents:
        node = node[int(name)] if isinstance(node, list) else node.setdefault(name, {})
    if isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for name in dotted.split("."):
        node = node[int(name)] if isinstance(node, list) else node[name]
    return node


@functools.cache
def _config_text(name: str) -> str:
    return (ROOT / "configs" / f"{name}.yaml").read_text()


def shipped_config(method: Method) -> dict[str, Any]:
    import yaml

    config = yaml.safe_load(_config_text(method.config))
    for dotted, value in method.overrides.items():
        _set(config, dotted, value)
    return config


def budget_epochs(method: Method, setting: Setting) -> int:
    if setting.name in method.epochs:
        return method.epochs[setting.name]
    return setting.first_order_epochs * (ZO_BUDGET if method.zeroth_order else 1)


def build_config(job: dict[str, Any]) -> dict[str, Any]:
    """The LightningCLI config of one run: the method's shipped config with the setting and the job's knobs."""
    method, setting = BY_NAME[job["method"]], SETTINGS[job["dataset"]]
    config = shipped_config(method)
    model = config["model"]["init_args"]
    if setting.in_features is not None:
        model["net"]["init_args"].update(in_features=setting.in_features, num_classes=setting.num_classes)
    if setting.data_class is not None:
        config["data"]["class_path"] = setting.data_class
    data = config["data"]["init_args"]
    if setting.shifted:  # also for methods without public data: the private split is the pool minus the public
        data["public_shift"] = job["shift"]
    trainer = config["trainer"]
    trainer["max_epochs"] = budget_epochs(method, setting)
    if job.get("max_steps"):
        trainer["max_steps"] = job["max_steps"]
    trainer.update(num_sanity_val_steps=0, check_val_every_n_epoch=10_000, enable_progress_bar=False)
    config["seed_everything"] = job["seed"]
    # reproduction mode (both secrets seeded): a benchmark's runs must be rerunnable and paired, not private
    data.update(seed=job["seed"], sampling_seed=2_000 + job["seed"])
    for dotted, value in job["knobs"].items():
        _set(config, dotted, value)
    if model.get("privacy") is not None and "noise_seed" not in model:
        model["noise_seed"] = 1_000 + job["seed"]
    if job["epsilon"] is None:
        model["privacy"] = None
    else:
        accountant = "tree" if model["privacy"]["accountant"] == "tree" else "rdp"
        model["privacy"] = {"epsilon": job["epsilon"], "accountant": accountant}
    return config


# ---- the schedule of one cell: tuning stages on seed 0, then the chosen knobs on every seed ----------
LR, CLIP = "model.init_args.lr", "model.init_args.clip"


def base_knobs(method: Method, setting: str) -> dict[str, Any]:
    config = shipped_config(method)
    lr = method.lr.get(setting, _get(config, LR))
    knobs = {LR: lr}
    if method.tune_clip and method.private:
        knobs[CLIP] = _get(config, CLIP)
    if method.knob is not None:
        knobs[method.knob.path] = method.knob.values_for(setting)[0]
    return knobs


def stage_one(method: Method, setting: str, quick: bool) -> list[dict[str, Any]]:
    """C × η (η only where the clip bound is folded into η); η centred at η₀·√(C₀/C)."""
    base = base_knobs(method, setting)
    if not method.train:
        return [base]
    if quick:
        return [base]
    spec = SETTINGS[setting]
    clips = [base[CLIP] * f for f in spec.clip_factors] if CLIP in base else [None]
    out = []
    for clip, factor in itertools.product(clips, spec.lr_factors):
        knobs = dict(base)
        centre = base[LR] if clip is None else base[LR] * math.sqrt(base[CLIP] / clip)
        knobs[LR] = _round(centre * factor)
        if clip is not None:
            knobs[CLIP] = _round(clip)
        out.append(knobs)
    return out


def extend_lr(best: dict[str, Any], tried: list[dict[str, Any]], setting: str, quick: bool) -> dict[str, Any] | None:
    """Stage 1b: when the best η sits at an end of the η values tried at its other knobs, the next η beyond it.

    η doubles (or halves) until the best is inside the tried values, at most ``LR_EXTENSIONS`` times per
    clip bound — so no method's choice is an artefact of where its grid happened to be centred.
    """
    if quick:
        return None
    same = sorted(k[LR] for k in tried if all(k.get(x) == v for x, v in best.items() if x != LR))
    if len(same) >= len(SETTINGS[setting].lr_factors) + LR_EXTENSIONS:
        return None
    if best[LR] == same[-1]:
        return dict(best, **{LR: _round(best[LR] * 2)})
    if best[LR] == same[0]:
        return dict(best, **{LR: _round(best[LR] / 2)})
    return None


def stage_two(method: Method, best: dict[str, Any], setting: str, quick: bool) -> list[dict[str, Any]]:
    if method.knob is None or quick:
        return []
    return [dict(best, **{method.knob.path: v}) for v in method.knob.values_for(setting)[1:]]


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def schedule(cell: tuple, runs: dict[str, dict[str, Any]], seeds, extra: dict[str, Any]):
    """The runs cell ``(setting, shift, method, ε)`` needs so far, and whether its schedule is complete.

    Stage 1 (C × η), stage 1b (η widened while the best sits at an end), stage 2 at stage 1's choice, then
    the overall choice on every seed: each stage is known once the one before has finished, so the runner
    asks again after each finished run.
    """
    setting, shift, name, eps = cell
    method = BY_NAME[name]
    quick = bool(extra.get("max_steps"))

    def job(knobs, seed=TUNING_SEED):
        return dict(dataset=setting, shift=shift, method=name, epsilon=eps, knobs=knobs, seed=seed, **extra)

    jobs = [job(k) for k in stage_one(method, setting, quick)]
    first = [runs.get(run_key(j)) for j in jobs]
    if None in first:
        return jobs, False
    while (best := choose(first)) is not None and method.train:
        wider = extend_lr(best["knobs"], [r["knobs"] for r in first], setting, quick)
        if wider is None:
            break
        jobs.append(job(wider))
        if (found := runs.get(run_key(jobs[-1]))) is None:
            return jobs, False
        first.append(found)
    if best is None:
        return jobs, True
    second = [job(k) for k in stage_two(method, best["knobs"], setting, quick)]
    jobs += second
    found = [runs.get(run_key(j)) for j in second]
    if None in found:
        return jobs, False
    chosen = choose(first + found)
    finals = [job(chosen["knobs"], s) for s in seeds if s != TUNING_SEED and s in SETTINGS[setting].seeds]
    jobs += finals
    return jobs, all(run_key(j) in runs for j in finals)


def choose(cell_runs: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The tuning seed's run with the best validation accuracy (ties: the earliest in the schedule)."""
    ok = [r for r in cell_runs if r is not None and "error" not in r and r["seed"] == TUNING_SEED]
    return max(ok, key=lambda r: r["val_acc"]) if ok else None


def cells(settings, methods, epsilons, shifts=SHIFTS) -> list[tuple]:
    """(setting, shift, method, ε or None) for every table cell to fill, in the order they are run.

    First the tabular main tables at ε = 1 (and the trained-once rows), then the prompt and synthetic
    settings, then the shift study, then the other levels: an interrupted run has the headline cells.
    """
    order: dict[int, list[tuple]] = {0: [], 1: [], 2: [], 3: []}
    for setting in settings:
        spec = SETTINGS[setting]
        levels = [e for e in spec.epsilons if e in epsilons] or list(spec.epsilons)
        for name in methods:
            method = BY_NAME[name]
            if setting not in method.settings:
                continue
            shift = MAIN_SHIFT if spec.shifted else "none"
            for eps in levels if method.private else [None]:
                group = 1 if setting not in TABULAR else 0 if eps in (None, SHIFT_EPSILON) else 3
                order[group].append((setting, shift, name, eps))
            if method.shift_study and setting in TABULAR:
                eps = SHIFT_EPSILON if method.private else None
                order[2] += [(setting, s, name, eps) for s in shifts if s != MAIN_SHIFT]
    return [cell for group in sorted(order) for cell in order[group]]


# ---- the protocol as printed into RESULTS.md ----------------------------------------------------
def protocol_lines(meta) -> list[str]:
    """The protocol section of RESULTS.md (this module's docstring), with the quick mode's cap if any."""
    text = __doc__.partition("Protocol (printed into RESULTS.md):")[2].strip()
    lines = []
    for line in text.splitlines():
        if line.startswith("* "):
            lines.append(line)
        elif lines:
            lines[-1] += " " + line.strip()
    if meta.get("max_steps"):
        lines.append(f"* Quick smoke mode: every run capped at {meta['max_steps']} steps, no tuning, one seed.")
    return lines
