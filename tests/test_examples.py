"""Examples run and do what they claim."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attach_to_existing_module_learns_privately():
    result = _load("attach_to_existing_module").main(epochs=40)
    assert result["epsilon"] <= 3.0
    assert result["test_mse"] < 0.8 * result["predict_mean_mse"]  # from the user's own test_step and metric
    assert 0 < result["val_mae"] < 1  # the user's validation_step ran during fit
    assert result["predictions"].shape == (92,)  # trainer.predict on the test split


def test_audit_a_whole_run_flags_reproduction_seeds_and_passes_the_default():
    results = _load("audit_a_whole_run").main(canaries=100, steps=100, accountant="rdp")
    default, reproduction = results.values()
    assert not default.violated and reproduction.violated, results


@pytest.mark.slow
def test_finetune_your_csv_trains_a_prompt_privately_on_a_users_file(tmp_path):
    example = _load("finetune_your_csv")
    path = example.write_demo_csv(tmp_path / "reviews.csv", size=300)
    result = example.main(path, max_steps=3, epochs=1, batch_size=16)
    assert result["private_steps"] == 3 and 0 < result["epsilon"] <= 1.0
    assert result["zero_shot_acc"] > 0.6  # the packaged MiniLM with "terrible"/"great", before any training
    assert abs(result["test_acc"] - result["zero_shot_acc"]) < 0.2


def test_check_your_data_names_the_broken_records_then_trains_without_them():
    result = _load("check_your_data").main(max_steps=3)
    assert result["bad"] == [123, 456]
    assert result["private_steps"] == 3 and 0 < result["epsilon"] <= 2.0
