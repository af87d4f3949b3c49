"""The pl-dp CLI: a real subprocess on a tiny config; every shipped config parses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def _run(*args, timeout=300):
    env = dict(os.environ, WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "pl_dp.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_fit_tiny_config_prints_accuracy_and_epsilon(tmp_path):
    config = yaml.safe_load((ROOT / "configs/digits/dpzero.yaml").read_text())
    config["trainer"]["max_epochs"] = 2
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    out = _run("fit", "--config", str(path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pl-dp: test accuracy" in out.stdout
    assert "epsilon" in out.stdout


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c.relative_to(ROOT)) for c in CONFIGS])
def test_shipped_configs_parse(config):
    out = _run("fit", "--config", str(config), "--print_config")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "class_path: pl_dp.methods" in out.stdout


def test_help_lists_the_methods_arguments():
    out = _run("fit", "--help")
    assert out.returncode == 0
    assert "--model" in out.stdout and "--data" in out.stdout


def test_audit_subcommand_prints_the_bound_next_to_the_claim():
    out = _run("audit", "--config", "configs/digits/dpsgd.yaml", "--audit.trials", "60")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pl-dp audit: DPSGD, 60 trials" in out.stdout
    assert "claimed epsilon" in out.stdout and "consistent" in out.stdout
