"""The pl-dp CLI: a real subprocess on a tiny config; every shipped config parses."""

import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.strategies import FSDPStrategy

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods import PrivateModule
from pl_dp.methods.parallel import check_strategy
from tests import background, catalog

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def _run(*args, timeout=300):
    env = dict(os.environ, WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "pl_dp.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
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
import contextlib, io, sys, yaml
from pl_dp.cli import main
MODEL = {"loss", "lr", "privacy", "noise_seed", "secure_rng", "max_physical_batch_size", "preflight"}
DATA = {"batch_size", "seed", "sampling_seed", "merge_public", "num_workers", "pin_memory", "collate_fn"}
for path in sys.argv[1:]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(["fit", "--config", path, "--print_config"])
    except SystemExit as exit:
        config = yaml.safe_load(out.getvalue()) if exit.code in (0, None) else None
        ok = config is not None and config["model"]["class_path"].startswith("pl_dp.methods")
        ok = ok and MODEL <= set(config["model"]["init_args"]) and DATA <= set(config["data"]["init_args"])
    else:
        ok = False
    print(("PARSED " if ok else "FAILED ") + path)
"""


#: the two runs of the CLI in a fresh interpreter below, started in the background when the session starts
#: (tests/background.py): every shipped config parsed, and ``fit --help``
PARSE_ALL = background.job(
    "cli_configs",
    lambda out: [
        background.Command(
            [sys.executable, "-c", _PARSE_ALL, *map(str, CONFIGS)],
            env=dict(WANDB_MODE="offline", PYTHONWARNINGS="ignore"),
            cwd=ROOT,
            timeout=600,
        )
    ],
    needed_by=background.for_test("test_shipped_configs_parse"),
)
FIT_HELP = background.job(
    "cli_help",
    lambda out: [
        background.Command(
            [sys.executable, "-m", "pl_dp.cli", "fit", "--help"],
            env=dict(WANDB_MODE="offline", PYTHONWARNINGS="ignore"),
            cwd=ROOT,
            timeout=300,
        )
    ],
    needed_by=background.for_test("test_help_lists_the_methods_arguments"),
)


def test_shipped_configs_parse():
    """Every shipped config resolves, with every argument a method or data module inherits by keyword (``**kwargs``
    forwarded to ``super().__init__``) resolved to its default (one interpreter for all configs: imports dominate)."""
    _, (out,) = PARSE_ALL.result()
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = [line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("PARSED ")]
    assert len(CONFIGS) >= 35  # the glob found the shipped configs
    assert sorted(parsed) == sorted(map(str, CONFIGS)), out.stdout + out.stderr[-3000:]


def test_help_lists_the_methods_arguments():
    _, (out,) = FIT_HELP.result()
    assert out.returncode == 0
    assert "--model" in out.stdout and "--data" in out.stdout


@pytest.mark.parametrize("method", [entry.name for entry in catalog.METHODS])
def test_method_help_lists_inherited_arguments(method, capsys):
    """Each method states only the arguments it adds; ``--model.help`` still lists those of every class above it."""
    from pl_dp.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--model.help", f"pl_dp.methods.{method}"])
    listed = set(re.findall(r"--model\.(\w+)", capsys.readouterr().out))
    inherited = {"net", "loss", "lr", "privacy", "noise_seed", "secure_rng", "max_physical_batch_size", "preflight"}
    assert inherited <= listed
    assert {"clip"} <= listed and ("radius" in listed) == (method in ("DPZero", "PAZOM"))


@pytest.mark.parametrize(
    "data",
    [
        "DigitsDataModule",
        "SyntheticClassificationDataModule",
        "TextDataModule",
        "VaderSentimentDataModule",
        "VaderEmbeddingDataModule",
    ],
)
def test_data_help_lists_the_loader_options_of_every_data_module(data, capsys):
    """docs/lightning.md: ``num_workers`` and ``pin_memory`` apply to every loader of every data module."""
    from pl_dp.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--data.help", f"pl_dp.data.{data}"])
    listed = set(re.findall(r"--data\.(\w+)", capsys.readouterr().out))
    assert {"batch_size", "public_batch_size", "seed", "sampling_seed", "num_workers", "pin_memory"} <= listed


@pytest.mark.slow
def test_audit_subcommand_prints_the_bound_next_to_the_claim():
    out = _run("audit", "--config", "configs/digits/dpsgd.yaml", "--audit.trials", "60")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pl-dp audit: DPSGD, 60 trials" in out.stdout
    assert "claimed epsilon" in out.stdout and "consistent" in out.stdout


def test_the_wandb_sweep_example_resolves_for_every_value(capsys):
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


_SMALL_RUN_AUDIT = ("--canaries", "100", "--steps", "100", "--real_examples", "100", "--inclusion_seed", "0")
_SMALL_RUN_PRIVACY = ("--privacy.epsilon", "2", "--privacy.delta", "1e-5", "--privacy.accountant", "rdp")


@pytest.mark.slow
def test_audit_run_mode_passes_an_honest_run_and_exits_1_on_a_leak():
    honest = _run("audit", "--run", *_SMALL_RUN_AUDIT, *_SMALL_RUN_PRIVACY)
    assert honest.returncode == 0, honest.stderr[-3000:]
    assert "pl-dp run audit: DPSGD, example-level, 100 canaries" in honest.stdout and "consistent" in honest.stdout
    leaky = _run("audit", "--run", *_SMALL_RUN_AUDIT, *_SMALL_RUN_PRIVACY, "--noise_seed", "7")
    assert leaky.returncode == 1, leaky.stderr[-3000:]
    assert "the replay reproduced the noise of 100 steps" in leaky.stdout and "VIOLATION" in leaky.stdout


@pytest.mark.slow
def test_output_is_quiet_by_default_and_verbose_on_request(tmp_path):
    """A newcomer sees the progress bar and the report, not Lightning's info lines nor Opacus' order warning;
    ``pl-dp --verbose`` / ``PL_DP_VERBOSE=1`` bring Lightning's lines back."""
    config = yaml.safe_load((ROOT / "configs/digits/dpzero.yaml").read_text())
    config["trainer"].update(max_epochs=1, default_root_dir=str(tmp_path))
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PL_DP_VERBOSE")}
    command = [sys.executable, "-m", "pl_dp.cli"]
    quiet = subprocess.run(
        [*command, "fit", "--config", str(path)],
        cwd=ROOT,
        env=dict(env, WANDB_MODE="offline"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "pl-dp: test accuracy" in quiet.stdout and "pl_dp privacy report" in quiet.stdout
    output = quiet.stdout + quiet.stderr
    for line in ("GPU available", "TPU available", "Seed set to", "Optimal order is the largest alpha", "LeafSpec"):
        assert line not in output, output[-3000:]
    verbose = subprocess.run(
        [*command, "--verbose", "fit", "--config", str(path), "--trainer.max_steps", "1", "--test_after_fit", "false"],
        cwd=ROOT,
        env=dict(env, WANDB_MODE="offline"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "GPU available" in verbose.stdout + verbose.stderr


def test_verbose_is_a_flag_before_the_subcommand_or_an_environment_variable(monkeypatch):
    import logging

    from pl_dp.cli import quiet_lightning, verbose_requested

    monkeypatch.delenv("PL_DP_VERBOSE", raising=False)
    argv = ["--verbose", "fit", "--config", "c.yaml"]
    assert verbose_requested(argv) and argv == ["fit", "--config", "c.yaml"]  # LightningCLI never sees it
    assert not verbose_requested(["test", "--verbose", "false"])  # Trainer.test's own --verbose is left alone
    monkeypatch.setenv("PL_DP_VERBOSE", "1")
    assert verbose_requested(["fit"])
    monkeypatch.setenv("PL_DP_VERBOSE", "0")
    assert not verbose_requested(["fit"])
    logger = logging.getLogger("lightning.pytorch")
    before = logger.level
    with quiet_lightning():
        assert logger.getEffectiveLevel() == logging.WARNING
    assert logger.level == before  # main() called from Python leaves the caller's logging as it was


def _refused_fit(tmp_path):
    """A fit of the shipped DP-SGD config that pl_dp refuses at fit start (no finite plan), in 1-2 s."""
    config = str(ROOT / "configs/digits/dpsgd.yaml")
    options = ["--trainer.max_epochs=-1", "--trainer.max_steps=-1", "--trainer.enable_progress_bar", "false"]
    return ["fit", "--config", config, *options, "--trainer.default_root_dir", str(tmp_path)]


def test_a_refusal_prints_one_error_line_and_exits_2_without_a_traceback(tmp_path, capsys, monkeypatch):
    from pl_dp.cli import REFUSED, main

    monkeypatch.delenv("PL_DP_VERBOSE", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(_refused_fit(tmp_path))
    assert exited.value.code == REFUSED == 2
    err = capsys.readouterr().err
    assert "pl-dp: error: private training needs a finite plan: set trainer max_steps or max_epochs." in err
    assert "(ConfigError; 'pl-dp --verbose SUBCOMMAND ...' or PL_DP_VERBOSE=1 shows the traceback)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_verbose_raises_the_refusal_with_its_traceback(tmp_path, monkeypatch, how):
    from pl_dp.cli import main

    monkeypatch.setenv("PL_DP_VERBOSE", "1" if how == "environment" else "0")
    with pytest.raises(ConfigError, match="private training needs a finite plan"):
        main((["--verbose"] if how == "flag" else []) + _refused_fit(tmp_path))


def test_pl_dps_not_implemented_refusals_are_refusals_and_other_errors_are_not():
    from pl_dp.cli import is_refusal, refusal_message

    with pytest.raises(NotImplementedError) as unsupported:
        check_strategy(FSDPStrategy(), "DPZero", shardable=True)  # raised in pl_dp, with a message
    assert is_refusal(unsupported.value)
    assert refusal_message(unsupported.value).startswith("pl-dp: error: pl_dp supports the single-device and DDP")
    with pytest.raises(NotImplementedError) as abstract:
        PrivateModule.mechanism(None, 8)  # a bare one: a method left unimplemented, a bug
    assert not is_refusal(abstract.value)
    with pytest.raises(NotImplementedError) as elsewhere:
        raise NotImplementedError("not pl_dp's")
    assert not is_refusal(elsewhere.value)
    assert not is_refusal(ValueError("a plain ValueError")) and is_refusal(PrivacyConfigError("refused"))


@pytest.mark.slow
def test_the_documented_resume_under_a_larger_budget_trains_under_it(tmp_path):
    """docs/callbacks.md's command. On main LightningCLI put the checkpoint's hyperparameters over the command line:
    the resume exited 0, trained nothing and reported target epsilon 2."""
    config = yaml.safe_load((ROOT / "configs/digits/dpsgd.yaml").read_text())
    config["trainer"].update(
        max_epochs=1, enable_checkpointing=True, default_root_dir=str(tmp_path), enable_progress_bar=False
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    first = _run("fit", "--config", str(path), "--test_after_fit", "false")
    assert first.returncode == 0, first.stderr[-3000:]
    (checkpoint,) = tmp_path.rglob("*.ckpt")
    change = ["--trainer.callbacks+=pl_dp.callbacks.AllowPrivacySpecChange", "--model.init_args.privacy.epsilon", "4"]
    resumed = _run("fit", "--config", str(path), "--ckpt_path", str(checkpoint), "--trainer.max_epochs", "2", *change)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "target epsilon 4" in resumed.stdout and "36 private steps (planned 36)" in resumed.stdout
    more = ["--trainer.max_epochs", "2", *change[1:]]  # a changed spec, not allowed: refused, loudly
    refused = _run("fit", "--config", str(path), "--ckpt_path", str(checkpoint), *more)
    assert refused.returncode == 2 and "AllowPrivacySpecChange" in refused.stderr
    # one readable error, not a 40-line traceback (issue [record]); --verbose brings the traceback back
    assert "pl-dp: error: the checkpoint was trained with privacy=" in refused.stderr
    assert "Traceback" not in refused.stderr and "(PrivacyConfigError; 'pl-dp --verbose" in refused.stderr


@pytest.mark.slow
def test_generate_samples_from_a_checkpoint_of_a_private_causal_lm(tmp_path):
    from tests.tiny_hf import CORPUS, tiny_model

    model_dir = tiny_model(tmp_path / "gpt2", "gpt2")
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(f'{{"text": "{text} number {i}"}}\n' for i, text in enumerate(CORPUS)))
    config = {
        "seed_everything": 0,
        "trainer": dict(
            max_epochs=1,
            limit_train_batches=2,
            accelerator="cpu",
            devices=1,
            logger=False,
            default_root_dir=str(tmp_path),
            enable_checkpointing=True,
            enable_progress_bar=False,
        ),
        "model": {
            "class_path": "pl_dp.methods.DPSGD",
            "init_args": {
                "net": {"class_path": "pl_dp.nets.CausalLM", "init_args": {"model_path": str(model_dir)}},
                "loss": "causal_lm",
                "per_sample": "ghost",
                "lr": 0.5,
                "privacy": {"epsilon": 8.0},
            },
        },
        "data": {
            "class_path": "pl_dp.data.TextGenerationDataModule",
            "init_args": {"data": str(texts), "tokenizer": str(model_dir), "batch_size": 8, "max_length": 24},
        },
    }
    path = tmp_path / "gpt2.yaml"
    path.write_text(yaml.safe_dump(config))
    fitted = _run("fit", "--config", str(path))
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert re.search(r"pl-dp: test loss \d+\.\d{4}, test perplexity \d+\.\d{2} \| epsilon", fitted.stdout)
    (checkpoint,) = tmp_path.rglob("*.ckpt")
    args = ("generate", "--config", str(path), "--ckpt_path", str(checkpoint), "--max_new_tokens", "5")
    out = _run(*args, "--prompt", "the movie", "--prompt", "the plot")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("the movie") and lines[1].startswith("the plot")
    assert "no further privacy cost" in out.stdout and "pl_dp privacy report — DPSGD" in out.stdout
    texts.unlink()  # sampling reads the released weights only, never the private texts the config names
    again = _run(*args, "--prompt", "the movie", "--generation_seed", "0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[0] == lines[0]


@pytest.mark.parametrize(("subcommand", "option"), [("generate", "--max_new_tokens"), ("audit", "--audit.trials")])
def test_subcommands_run_from_the_command_line_raise_no_lightning_args_warning(subcommand, option, monkeypatch, capsys):
    """Issue [record] 41 item 4: ``pl-dp generate --help`` warned "LightningCLI's args parameter is intended to run
    from within Python" at every call: the command line's options were handed to LightningCLI as ``args`` while
    ``sys.argv`` held them too. A subcommand's own options now reach LightningCLI through ``sys.argv`` alone."""
    from pl_dp.cli import main

    monkeypatch.setattr(sys, "argv", ["pl-dp", subcommand, "--help"])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exit:
        warnings.simplefilter("always")
        main()
    assert exit.value.code == 0 and option in capsys.readouterr().out
    assert not [str(w.message) for w in caught if "args parameter is intended" in str(w.message)]


class TerminateAt(Callback):
    """Sends this process SIGTERM after training step ``step``, as a scheduler pre-empting the job would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpointed", "no-checkpoint"])
def test_sigterm_says_where_the_last_checkpoint_is(tmp_path, checkpoints):
    """Issue [record] 41 item 5: killed by a scheduler, ``pl-dp fit`` stopped without a word on where to resume
    from. It now names the last checkpoint written (step 4 of checkpoints every 2 steps, SIGTERM after step 5), or
    says that none was."""
    config = yaml.safe_load((ROOT / "configs/digits/dpzero.yaml").read_text())
    callbacks = [{"class_path": "tests.test_cli.TerminateAt", "init_args": {"step": 5}}]
    if checkpoints:
        every = {"dirpath": str(tmp_path / "checkpoints"), "every_n_train_steps": 2}
        callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": every})
    config["trainer"].update(
        max_steps=20, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=checkpoints
    )
    config["trainer"]["callbacks"] = callbacks
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    out = _run("fit", "--config", str(path))
    if checkpoints:
        written = tmp_path / "checkpoints" / "epoch=0-step=4.ckpt"
        assert written.is_file(), sorted(tmp_path.rglob("*.ckpt"))
        expected = f"pl-dp: stopped by SIGTERM; the last checkpoint is {written} (resume with --ckpt_path {written})."
    else:
        assert not list(tmp_path.rglob("*.ckpt"))
        expected = "pl-dp: stopped by SIGTERM; no checkpoint was written"
    assert expected in out.stderr, out.stderr[-3000:]
    assert out.returncode == 128 + signal.SIGTERM  # stopped by the signal, not a success
    assert "pl-dp: test accuracy" not in out.stdout  # an interrupted fit is not tested
