"""benchmarks/reproduce.py: the quick run end to end (table, plots, resume) and validation-only tuning."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _reproduce():
    if "reproduce" not in sys.modules:  # dataclasses need the module registered while it executes
        spec = importlib.util.spec_from_file_location("reproduce", ROOT / "benchmarks" / "reproduce.py")
        sys.modules["reproduce"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["reproduce"])
    return sys.modules["reproduce"]


def _run(lr, seed, val, test, epsilon=1.0):
    return {
        "dataset": "digits",
        "method": "DP-SGD",
        "epsilon": epsilon,
        "lr": lr,
        "seed": seed,
        "val_acc": val,
        "test_acc": test,
        "step_ms": 1.0,
        "peak_mb": 1.0,
        "epsilon_spent": 0.9,
        "private_steps": 10,
        "steps": 10,
        "fit_s": 1.0,
    }


def test_the_step_size_is_chosen_on_validation_accuracy_only():
    reproduce = _reproduce()
    base = reproduce.BY_NAME["DP-SGD"].lr["digits"]
    runs = [
        _run(0.5 * base, 0, val=0.70, test=0.99),  # best test accuracy, never chosen
        _run(1.0 * base, 0, val=0.75, test=0.80),
        _run(2.0 * base, 0, val=0.80, test=0.60),  # best validation accuracy: chosen
        _run(2.0 * base, 1, val=0.10, test=0.70),
        _run(2.0 * base, 2, val=0.10, test=0.80),
        _run(0.5 * base, 1, val=0.99, test=0.99),  # other seeds never enter the choice
        _run(8.0 * base, 0, val=0.99, test=0.99),  # a stale run outside the grid is ignored
    ]
    meta = {"lr_grid": [0.5, 1.0, 2.0], "seeds": [0, 1, 2], "max_steps": None}
    summary = reproduce.summarize({str(i): r for i, r in enumerate(runs)}, meta)
    cell = summary[("digits", "DP-SGD", 1.0)]
    assert cell["lr"] == 2.0 * base and cell["seeds"] == 3
    assert abs(cell["mean"] - 70.0) < 1e-9 and abs(cell["std"] - 10.0) < 1e-9


def test_claims_say_plainly_when_they_do_not_reproduce():
    reproduce = _reproduce()
    dpzero = {"mean": 80.0, "std": 1.0, "seeds": 3, "step_ms": 1.0}
    pazo = {"mean": 70.0, "std": 1.0, "seeds": 3, "step_ms": 2.0}
    summary = {("digits", "DPZero", e): dpzero for e in reproduce.EPSILONS} | {
        ("digits", p, e): pazo for p in reproduce.PAZO for e in reproduce.EPSILONS
    }
    row = next(line for line in reproduce.claims(summary, ["digits"], reproduce.EPSILONS) if "beats DPZero at" in line)
    assert "**does not reproduce**" in row and "PAZO-M > DPZero in 0/5 cells" in row
    assert row.rstrip(" |").endswith("20/20")  # a 10-point gap is more than one pooled std (√2) everywhere


def test_quick_run_writes_a_table_plots_and_resumes(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, "benchmarks/reproduce.py", "--quick", "--jobs", "2", "--out", str(tmp_path)]
    first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]

    runs = list(json.loads((tmp_path / "reproduce.json").read_text())["runs"].values())
    reproduce = _reproduce()
    assert {r["method"] for r in runs} == set(reproduce.BY_NAME)
    assert not [r["error"] for r in runs if "error" in r]
    for r in runs:
        assert r["steps"] == 24 and r["step_ms"] > 0
        if r["epsilon"] is not None:  # every private run stays within its target
            assert 0 < r["epsilon_spent"] <= r["epsilon"] + 1e-9 and r["private_steps"] > 0

    text = (tmp_path / "RESULTS.md").read_text()
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| ") and " | " in line}
    number = re.compile(r"\d+\.\d ± \d+\.\d")
    for name, method in reproduce.BY_NAME.items():
        cells = rows[name].strip("| ").split(" | ")[2:]
        assert len(cells) == 2 and number.fullmatch(cells[-1].strip("*")), rows[name]  # ε=1, non-private
        assert number.fullmatch(cells[0].strip("*")) if method.private or name == "OnlyPub" else cells[0] == ""
    assert "## The papers' claims on our data" in text and "**" in text.split("claims on our data")[1]
    for png in ("accuracy_vs_epsilon.png", "accuracy_vs_step_time.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert f"]({png})" in text

    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not re.search(r"^\[\d+/", again.stdout, re.M), "a finished run was trained again"
