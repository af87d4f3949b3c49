"""benchmarks/reproduce.py: tuning on validation only, the staged schedule, paired tests, the quick run end to end."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    if name not in sys.modules:  # dataclasses need the module registered while it executes
        sys.path.insert(0, str(ROOT / "benchmarks"))
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _record(job, val, test):
    protocol = _load("reproduce_protocol")
    return dict(job, key=protocol.run_key(job), val_acc=val, test_acc=test, step_ms=1.0, steps=10, epsilon_spent=0.9)


def test_schedule_tunes_in_stages_on_seed_zero_and_chooses_on_validation_only():
    protocol, report = _load("reproduce_protocol"), _load("reproduce_report")
    cell = ("digits", "mild", "PAZO-M", 1.0)
    runs = {}
    jobs, complete = protocol.schedule(cell, runs, protocol.SEEDS, {})
    assert not complete and len(jobs) == 12 and {j["seed"] for j in jobs} == {protocol.TUNING_SEED}  # C × η
    clips = sorted({j["knobs"][protocol.CLIP] for j in jobs})
    assert clips == pytest.approx([0.2, 0.6, 2.0, 6.0])
    for i, job in enumerate(jobs):  # job 4 (C = 0.6, the middle η) is best on validation, job 0 best on test
        runs[protocol.run_key(job)] = _record(job, val=0.9 if i == 4 else 0.5, test=0.99 if i == 0 else 0.6)
    stage_two, complete = protocol.schedule(cell, runs, protocol.SEEDS, {})
    added = stage_two[12:]
    assert not complete and len(added) == 2  # stage 2: α at stage 1's choice
    assert all(j["knobs"][protocol.LR] == jobs[4]["knobs"][protocol.LR] for j in added)
    assert sorted(j["knobs"][protocol.ALPHA_PAZO.path] for j in added) == [0.2, 0.8]
    for job in added:
        runs[protocol.run_key(job)] = _record(job, val=0.1, test=0.99)  # worse on validation: not chosen
    final, complete = protocol.schedule(cell, runs, protocol.SEEDS, {})
    seeds = final[14:]
    assert not complete and [j["seed"] for j in seeds] == [1, 2, 3, 4, 5]  # fresh seeds, not the tuning seed
    assert all(j["knobs"] == jobs[4]["knobs"] for j in seeds)
    for s, job in enumerate(seeds, start=1):
        runs[protocol.run_key(job)] = _record(job, val=0.0, test=0.6 + 0.01 * s)
    assert protocol.schedule(cell, runs, protocol.SEEDS, {})[1]
    meta = {"seeds": list(protocol.SEEDS), "max_steps": None}
    summary = report.summarize(runs, meta, [cell])[cell]
    assert summary["knobs"] == jobs[4]["knobs"] and summary["n"] == 5 and summary["tuning_runs"] == 14
    assert summary["mean"] == pytest.approx(63.0)  # seeds 1–5: 61 … 65; the tuning run's test accuracy never counts


def test_ties_go_to_the_earliest_run_of_the_schedule():
    protocol = _load("reproduce_protocol")
    job = dict(dataset="digits", shift="mild", method="DP-SGD", epsilon=1.0, seed=protocol.TUNING_SEED)
    first, second = (_record(dict(job, knobs={protocol.LR: lr}), val=0.5, test=t) for lr, t in ((0.1, 0.2), (0.2, 0.9)))
    assert protocol.choose([first, second]) is first and protocol.choose([second, first]) is second


def test_paired_interval_matches_scipy():
    from scipy import stats

    report = _load("reproduce_report")
    a = {0: 80.0, 1: 82.5, 2: 79.0, 3: 85.0, 4: 81.0}
    b = {0: 78.0, 1: 80.0, 2: 79.5, 3: 81.0, 4: 80.0, 9: 0.0}  # seed 9 has no partner: left out
    p = report.paired("x", a, b)
    reference = stats.ttest_rel([a[s] for s in range(5)], [b[s] for s in range(5)]).confidence_interval(0.95)
    assert p.n == 5 and p.low == pytest.approx(reference.low) and p.high == pytest.approx(reference.high)
    assert p.sign() == (1 if reference.low > 0 else -1 if reference.high < 0 else 0)


def test_claims_say_plainly_when_they_reverse_or_cannot_be_told_apart():
    report = _load("reproduce_report")
    ahead = report.Claim("P", "a beats b", "T", [report.paired("c", {0: 80, 1: 81, 2: 82}, {0: 70, 1: 70.5, 2: 71})])
    behind = report.Claim("P", "a beats b", "T", [report.paired("c", {0: 60, 1: 61, 2: 62}, {0: 70, 1: 70.5, 2: 71})])
    noise = report.Claim("P", "a beats b", "T", [report.paired("c", {0: 70, 1: 72, 2: 68}, {0: 71, 1: 69, 2: 70})])
    assert ahead.verdict == "**reproduces**" and behind.verdict == "**reverses**"
    assert noise.verdict == "**no difference detected**"
    at_least = report.Claim("P", "a ≥ b", "T", behind.comparisons, at_least=True)
    assert at_least.verdict.startswith("**contradicted**") and not at_least.reproduces
    consistent = report.Claim("P", "a ≥ b", "T", noise.comparisons, at_least=True)
    assert consistent.verdict.startswith("**consistent**") and not consistent.reproduces
    assert report.Claim("P", "a ≥ b", "T", ahead.comparisons, at_least=True).verdict == "**holds**"
    # non-inferiority: "a within 2 points of b" needs the whole interval above −2
    close = report.paired("c", {0: 79.0, 1: 79.5, 2: 80.0}, {0: 80.0, 1: 80.0, 2: 80.5})
    far = report.paired("c", {0: 70.0, 1: 76.0, 2: 79.0}, {0: 80.0, 1: 80.0, 2: 80.5})
    assert report.Claim("P", "within 2", "T", [close], threshold=-2.0).verdict == "**reproduces**"
    assert report.Claim("P", "within 2", "T", [far], threshold=-2.0).verdict == "**no difference detected**"
    assert report.Claim("P", "a beats b", "T", [report.paired("c", {0: 1.0}, {0: 0.0})]).verdict.startswith(
        "**untested**"
    )


def test_every_method_builds_in_every_setting_with_its_knobs():
    protocol = _load("reproduce_protocol")
    for method in protocol.METHODS:
        for setting in method.settings:
            cell = (setting, protocol.MAIN_SHIFT, method.name, 1.0 if method.private else None)
            for job in protocol.schedule(cell, {}, protocol.SEEDS, {})[0]:
                config = protocol.build_config(job)
                for path, value in job["knobs"].items():
                    assert protocol._get(config, path) == value
                assert config["seed_everything"] == job["seed"]
                assert config["trainer"]["max_epochs"] == protocol.budget_epochs(method, protocol.SETTINGS[setting])
            if method.knob is not None:  # the knob's path exists in the shipped config
                protocol._get(protocol.shipped_config(method), method.knob.path)


@pytest.mark.slow
def test_quick_run_writes_tables_plots_and_resumes(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, "benchmarks/reproduce.py", "--quick", "--jobs", "2", "--out", str(tmp_path)]
    first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]

    protocol = _load("reproduce_protocol")
    runs = list(json.loads((tmp_path / "reproduce.json").read_text())["runs"].values())
    expected = {m.name for m in protocol.METHODS if {"digits", "synthetic"} & set(m.settings)}
    assert {r["method"] for r in runs} == expected
    assert not [r["error"] for r in runs if "error" in r]
    for r in runs:
        assert r["steps"] == 24 and r["step_ms"] > 0
        if r["epsilon"] is not None:  # every private run stays within its target
            assert 0 < r["epsilon_spent"] <= r["epsilon"] + 1e-9 and r["private_steps"] > 0

    text = (tmp_path / "RESULTS.md").read_text()
    number = re.compile(r"\d+\.\d ± \d+\.\d( \(collapsed\))?")
    rows = [line.strip("| ").split(" | ") for line in text.splitlines() if re.match(r"\| (ZO|FO|PUB|none)", line)]
    assert len(rows) == len(expected)
    for row in rows:  # every filled cell is a mean ± std (the quick mode has one seed: ± 0.0)
        filled = [cell for cell in row[2:] if cell.strip()]
        assert filled and all(number.fullmatch(cell.strip()) for cell in filled), row
    assert "O2NC (replace-one ε; outside its regime)" in text and "O2NC (in regime) (replace-one ε)" in text
    assert "## Verdicts" in text and "## The papers' claims on our data" in text and "**untested** (one seed)" in text
    for png in ("accuracy_vs_epsilon.png", "accuracy_vs_step_time.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert f"]({png})" in text

    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not re.search(r"^\[\d+ ", again.stdout, re.M), "a finished run was trained again"


def test_step_size_grid_widens_while_the_best_sits_at_an_end():
    protocol = _load("reproduce_protocol")
    cell = ("digits", "mild", "DP-SGD Auto-S", 1.0)  # η only: three values
    runs = {}
    jobs, _ = protocol.schedule(cell, runs, protocol.SEEDS, {})
    lrs = [j["knobs"][protocol.LR] for j in jobs]
    for job in jobs:  # the largest η is best on validation
        runs[protocol.run_key(job)] = _record(job, val=job["knobs"][protocol.LR], test=0.5)
    jobs, complete = protocol.schedule(cell, runs, protocol.SEEDS, {})
    assert not complete and jobs[-1]["knobs"][protocol.LR] == pytest.approx(2 * max(lrs))
    assert jobs[-1]["seed"] == protocol.TUNING_SEED
    runs[protocol.run_key(jobs[-1])] = _record(jobs[-1], val=0.0, test=0.99)  # worse: the widening stops
    jobs, _ = protocol.schedule(cell, runs, protocol.SEEDS, {})
    assert [j["seed"] for j in jobs[4:]] == [1, 2, 3, 4, 5] and jobs[-1]["knobs"][protocol.LR] == max(lrs)
    for job in jobs[4:]:
        runs[protocol.run_key(job)] = _record(job, val=0.0, test=0.5)
    ever_better = {}  # a best that keeps sitting at the end widens at most LR_EXTENSIONS times
    jobs, _ = protocol.schedule(cell, ever_better, protocol.SEEDS, {})
    while True:
        for job in jobs:
            ever_better[protocol.run_key(job)] = _record(job, val=job["knobs"][protocol.LR], test=0.5)
        jobs, complete = protocol.schedule(cell, ever_better, protocol.SEEDS, {})
        if complete:
            break
    tuned = {r["knobs"][protocol.LR] for r in ever_better.values() if r["seed"] == 0}
    assert len(tuned) == len(protocol.LR_FACTORS) + protocol.LR_EXTENSIONS


def test_the_correlated_noise_study_tunes_eta_alone_and_judges_banded_against_independent_by_seed():
    """Each cell tunes η only (the clip bound is the config's for both noises), the 4× rows train 4× the epochs, and
    the page's verdict follows the paired interval: banded below independent on every seed is "worse"."""
    protocol, report, study = _load("reproduce_protocol"), _load("reproduce_report"), _load("correlated_noise")
    cells = study.plan(["digits"], [1.0])
    assert [c[2] for c in cells] == [m.name for m in protocol.CORRELATED_NOISE]
    runs: dict = {}
    for cell in cells:
        while True:
            jobs, complete = protocol.schedule(cell, runs, protocol.SEEDS, {})
            if complete:
                break
            for job in jobs:
                assert set(job["knobs"]) == {protocol.LR}
                lr, seed = job["knobs"][protocol.LR], job["seed"]
                banded = "banded" in job["method"]
                test = 0.8 - (0.05 if banded and "×" not in job["method"] else 0.0) + 0.01 * (seed % 2)
                runs[protocol.run_key(job)] = _record(job, val=0.9 - abs(lr - 0.5), test=test)
    long = protocol.BY_NAME[protocol.CORRELATED_NOISE[2].name]
    assert (
        protocol.budget_epochs(long, protocol.SETTINGS["digits"]) == 4 * protocol.SETTINGS["digits"].first_order_epochs
    )
    config = protocol.build_config(
        dict(
            dataset="digits",
            shift="mild",
            method=cells[1][2],
            epsilon=1.0,
            knobs={protocol.LR: 0.5},
            seed=1,
        )
    )
    assert config["model"]["init_args"]["noise"] == "banded" and config["model"]["init_args"]["bands"] == protocol.BANDS
    page = study.page(report.summarize(runs, {"seeds": list(protocol.SEEDS)}, cells), ["digits"], [1.0])
    assert "the family's epochs: banded better in 0, worse in 1" in page
    assert "4× epochs: banded better in 0, worse in 0, no difference detected in 1 of 1" in page
