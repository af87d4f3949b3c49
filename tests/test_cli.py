"""The pl-dp CLI: a real subprocess on a tiny config; every shipped config parses."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def _run(*args, timeout=300):
    env = dict(os.environ, WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "pl_dp.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_fit_tiny_config_prints_accuracy_epsilon_and_the_privacy_report(tmp_path):
    config = yaml.safe_load((ROOT / "configs/digits/dpzero.yaml").read_text())
    config["trainer"].update(max_epochs=2, enable_checkpointing=True, default_root_dir=str(tmp_path))
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    out = _run("fit", "--config", str(path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pl-dp: test accuracy" in out.stdout
    assert "epsilon" in out.stdout
    assert "pl_dp privacy report — DPZero" in out.stdout and "add/remove-one adjacency" in out.stdout
    assert "noise and sampling drawn from OS entropy" in out.stdout  # the shipped configs seed no secret
    (checkpoint,) = tmp_path.rglob("*.ckpt")
    report = _run("report", str(checkpoint))
    assert report.returncode == 0, report.stderr[-3000:]
    guarantee = report.stdout.splitlines()[1]
    assert guarantee in out.stdout  # the same guarantee line, recomputed from the checkpoint
    tested = _run("test", "--config", str(path), "--ckpt_path", str(checkpoint))
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert guarantee in tested.stdout  # pl-dp test prints the checkpoint's epsilon
    predicted = _run("predict", "--config", str(path), "--ckpt_path", str(checkpoint))
    assert predicted.returncode == 0, predicted.stderr[-3000:]


_PARSE_ALL = """
import contextlib, io, sys
from pl_dp.cli import main
for path in sys.argv[1:]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(["fit", "--config", path, "--print_config"])
    except SystemExit as exit:
        ok = exit.code in (0, None) and "class_path: pl_dp.methods" in out.getvalue()
    else:
        ok = False
    print(("PARSED " if ok else "FAILED ") + path)
"""


def test_shipped_configs_parse():
    """Every shipped config resolves (one interpreter for all of them: imports dominate the cost)."""
    env = dict(os.environ, WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    out = subprocess.run(
        [sys.executable, "-c", _PARSE_ALL, *map(str, CONFIGS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = [line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("PARSED ")]
    assert len(CONFIGS) >= 34  # the glob found the shipped configs
    assert sorted(parsed) == sorted(map(str, CONFIGS)), out.stdout + out.stderr[-3000:]


def test_help_lists_the_methods_arguments():
    out = _run("fit", "--help")
    assert out.returncode == 0
    assert "--model" in out.stdout and "--data" in out.stdout


def test_audit_subcommand_prints_the_bound_next_to_the_claim():
    out = _run("audit", "--config", "configs/digits/dpsgd.yaml", "--audit.trials", "60")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pl-dp audit: DPSGD, 60 trials" in out.stdout
    assert "claimed epsilon" in out.stdout and "consistent" in out.stdout


def test_the_wandb_sweep_example_resolves_for_every_value(capsys):
    import pytest

    from pl_dp.cli import main

    sweep = yaml.safe_load((ROOT / "examples/wandb_sweep.yaml").read_text())
    fixed = [arg for arg in sweep["command"] if not arg.startswith("${")]
    assert sweep["program"] == "pl-dp" and sweep["metric"]["name"] == "val/acc"
    for name, spec in sweep["parameters"].items():
        for value in spec["values"]:
            with pytest.raises(SystemExit) as exit:
                main([*fixed, f"--{name}={value}", "--print_config"])
            assert exit.value.code in (0, None)
            resolved = yaml.safe_load(capsys.readouterr().out)
            assert resolved["model"]["init_args"]["lr"] == value
            assert resolved["trainer"]["logger"]["class_path"].endswith("WandbLogger")
