"""benchmarks/gpu.py: the --tiny run (CPU) measures every case or records why it could not."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: cases known to fail, with the reason: Opacus' ghost clipping refuses GPT-2's tied input/output embeddings
EXPECTED_FAILURES = {("gpt2", "opacus_ghost"): "Parameter tying is not supported with Ghost Clipping"}


def _case_names() -> list[str]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    task = module.ClassifierTask(module.TINY)
    return list(module.cases(task, module.torch.device("cpu")))


@pytest.mark.slow
def test_tiny_run_has_every_case_with_a_time_or_an_error(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, "benchmarks/gpu.py", "--tiny", "--device", "cpu", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tiny"] and result["device"] == "cpu" and "not GPU memory" in result["memory_kind"]
    names = _case_names()
    assert {"torch_sgd", "opacus_hooks", "opacus_ghost", "pl_dp_ghost", "torch_dpzero"} <= set(names)
    assert [m["model"] for m in result["models"]] == ["bert", "gpt2"]
    for model in result["models"]:
        assert set(model["cases"]) == set(names), model["model"]
        for name, row in model["cases"].items():
            if (model["model"], name) in EXPECTED_FAILURES:  # recorded, not lost
                assert EXPECTED_FAILURES[model["model"], name] in row.get("error", ""), row
                continue
            assert "error" not in row, (model["model"], name, row.get("error"))
            assert row["step_s"] > 0 and len(row["step_s_all"]) == result["sizes"]["steps"]
            if name.startswith("pl_dp"):  # the fit-start cost, apart from the steps
                assert row["preflight_s"] > 0 and row["probe_s"] > 0 and row["probe"] == "passed"
        assert len(model["targets"]) == 8  # the issues' targets, book-keeping's included
        for target in model["targets"]:
            assert (target["value"] is None) == (target["met"] is None)
            assert target["value"] is None or target["value"] > 0
    assert "n/a" in done.stdout and "FAILED" in done.stdout  # the table says what was not measured
