"""``pl-dp``: the LightningCLI entry point.

Any pl_dp method (or any user LightningModule / LightningDataModule) is selectable by class
path, e.g. ``pl-dp fit --config configs/digits/dpzero.yaml``. After ``fit`` the CLI tests the
final model and prints the test accuracy (a causal language model's: the test loss and token-level perplexity)
next to the ε spent (disable with ``--test_after_fit false``).

After ``fit`` it also prints the run's privacy report (:meth:`PrivateModule.privacy_report`:
ε, δ, σ, q, steps, accountant, adjacency, whether the secrets were user-seeded, and what is and is
not protected); ``pl-dp validate`` and ``pl-dp test`` print it for the model they evaluate (with
``--ckpt_path``: the checkpoint's), and ``pl-dp report PATH.ckpt`` for a checkpoint alone.
``--optimizer`` and ``--lr_scheduler`` configure the optimizer and LR schedule (first-order methods
take any optimizer; methods that write their own update accept plain SGD only).

``pl-dp audit --config ...`` builds the same model, data and Trainer from a config and runs
:func:`pl_dp.audit.audit` on the method's private step instead of training (options under
``--audit.*``, e.g. ``--audit.trials 2000``); it prints the empirical lower bound on ε next to the
accountant's claim and exits with status 1 when the bound exceeds the claim.

``pl-dp generate --config C --ckpt_path PATH.ckpt --prompt "..." [--prompt "..."]`` builds the config's model,
loads the checkpoint's weights and prints one sampled continuation per prompt (:func:`generate_from_checkpoint`;
the net must have a ``generate`` method, as :class:`~pl_dp.nets.CausalLM` has). Sampling is post-processing of
the released model: it costs no privacy, and the ε printed with it is the checkpoint's.

``pl-dp tune --config C --tune.space "model.init_args.lr=[0.01,0.1]" --tune.mean 4 --tune.directory D`` runs a
private hyperparameter search (:mod:`pl_dp.tuning`): a random number of trials, the best released with the privacy
report of the whole search (Papernot & Steinke 2022).

``pl-dp audit --run [--canaries 1000 --steps 1000 --sampling_seed ... ...]`` audits a whole run
instead (:func:`pl_dp.audit_run.audit_run`: one real training run with canaries, a checkpoint and
a kill-and-resume, and an adversary that replays the public config); the options are the
function's arguments, the output and exit status as for ``audit``.

Output is kept to what a user acts on: the progress bar (with ε and the budget left), pl_dp's own
warnings and the final report. Lightning's info lines (accelerators available, seeds, tips, why fit
stopped) and two FutureWarnings of one library about another's internals (:data:`FOREIGN_DEPRECATIONS`) are
hidden; ``pl-dp --verbose <subcommand> ...`` or ``PL_DP_VERBOSE=1`` shows them again. This is the command line's
choice only: the library itself filters no warning but Opacus' "Optimal order is the largest alpha" (see
:func:`pl_dp.privacy.accountants.opacus_rdp_conversion`).

On SIGTERM Lightning stops a fit at the next batch and exits; ``pl-dp`` first prints, on stderr, the last checkpoint
written (:func:`last_checkpoint`), to resume from with ``--ckpt_path``, or that none was written, and exits with
status 143 (128 + SIGTERM).

A refusal of pl_dp's — a :class:`~pl_dp.errors.PlDpError` (a bad config, a privacy request that cannot be met,
unusable private data, a net that mixes examples), or a ``NotImplementedError`` with a message raised in pl_dp's own
code — is printed as ``pl-dp: error: <message>`` on stderr, without a traceback, and ``pl-dp`` exits with status 2
(:data:`REFUSED`, as ``argparse`` does for a command line it cannot run; 1 stays an audit's violation). ``pl-dp
--verbose ...`` or ``PL_DP_VERBOSE=1`` raises it with its traceback instead. Any other exception (a bug, in pl_dp or
elsewhere) keeps its traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from jsonargparse import ArgumentParser
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from pl_dp.audit import audit
from pl_dp.audit_run import audit_run
from pl_dp.errors import PlDpError
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.spec import PrivacySpec
from pl_dp.tuning import PAUSED, TUNE_USAGE, tune_command


class PlDpCLI(LightningCLI):
    def _parse_ckpt_path(self) -> None:
        """With ``--ckpt_path``, the model is built from the command line when it names one (a ``--config`` or
        ``--model``), else from the checkpoint's hyperparameters. LightningCLI applies the checkpoint's over the
        command line, so a resume asked to run under a new ε (``--model.init_args.privacy.epsilon 4`` with
        ``AllowPrivacySpecChange``) ran silently under the old one. The checkpoint still supplies the weights and
        the privacy state, which every fit checks against the model it resumes (a changed spec is refused unless
        allowed)."""
        subcommand = self.config.get("subcommand")
        model = self.config[subcommand].get("model") if subcommand else None
        if model is None or not model.get("class_path"):
            super()._parse_ckpt_path()

    def _run_subcommand(self, subcommand: str) -> None:
        """Run ``subcommand``; on SIGTERM (a scheduler's pre-emption, ``kill``), which Lightning answers by stopping
        at the next batch and exiting (``SIGTERMException``), first say where the last checkpoint is, then exit with
        status 128 + SIGTERM (143), as a process the signal ended: a scheduler must not read the stop as success
        (Lightning's exception would exit with 0)."""
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException:
            if self.trainer.is_global_zero:
                print(terminated_message(last_checkpoint(self.trainer)), file=sys.stderr, flush=True)
            raise SystemExit(128 + signal.SIGTERM) from None

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--test_after_fit", type=bool, default=True, help="test the model after fit and print a report"
        )

    def after_validate(self) -> None:
        self._print_privacy_report()

    def after_test(self) -> None:
        self._print_privacy_report()

    def _print_privacy_report(self) -> None:
        """The ε of the model evaluated (restored from ``--ckpt_path`` when one is given)."""
        if self.trainer.is_global_zero and hasattr(self.model, "privacy_report"):
            print(self.model.privacy_report())

    def after_fit(self) -> None:
        if not self.config[self.subcommand].get("test_after_fit", True) or self.trainer.interrupted:
            return
        results = self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        if self.trainer.is_global_zero:
            print(report(self.model, results[0] if results else {}))
        self._print_privacy_report()


class AuditCLI(PlDpCLI):
    """The ``audit`` subcommand: a config's model, data and Trainer, plus the audit's options."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_function_arguments(audit, "audit", skip={"model", "datamodule", "trainer", "canary"})


class GenerateCLI(PlDpCLI):
    """The ``generate`` subcommand: a config's model, a checkpoint's weights, and the sampling options."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--ckpt_path", type=str, required=True, help="the checkpoint whose weights to sample from")
        parser.add_argument("--prompt", type=str, default="", help="a prompt (repeat the option for several)")
        parser.add_argument("--max_new_tokens", type=int, default=32, help="tokens to sample per prompt")
        parser.add_argument("--do_sample", type=bool, default=True, help="sample (false: greedy decoding)")
        parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature when sampling")
        parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling: the top-p probability mass")
        parser.add_argument("--generation_seed", type=int, default=0, help="seed of the sampling (no secret)")

    def before_instantiate_classes(self) -> None:
        """Build the model only: the config's data section names the private set, which sampling never reads (what
        it prints and whether it succeeds must not depend on the records)."""
        self.config["data"] = None


def generate_from_checkpoint(model: Any, ckpt_path: str, prompts: list[str], **sampling: Any) -> list[str]:
    """Load ``ckpt_path``'s weights into ``model`` (a pl_dp method built like the one that trained) and sample one
    continuation per prompt from its net (``net.generate(prompts, **sampling)``, e.g. :meth:`CausalLM.generate
    <pl_dp.nets.CausalLM.generate>`).

    Post-processing: only the released weights are read, so no privacy is spent; the checkpoint's ε covers the text.
    """
    net = getattr(model, "net", model)
    if not callable(getattr(net, "generate", None)):
        raise TypeError(f"the model's net ({type(net).__name__}) has no generate method: use pl_dp.nets.CausalLM.")
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    model.load_state_dict(checkpoint["state_dict"])
    return net.generate(prompts, **sampling)


def last_checkpoint(trainer: Trainer) -> str | None:
    """The newest checkpoint file on disk among those the trainer's ``ModelCheckpoint`` callbacks know of (the last,
    the best, the top k; a resumed fit's included), or None."""
    paths = {
        path
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint)
        for path in (callback.last_model_path, callback.best_model_path, *callback.best_k_models)
        if path and os.path.isfile(path)
    }
    return max(paths, key=os.path.getmtime, default=None)


def terminated_message(checkpoint: str | None) -> str:
    """The line ``pl-dp`` prints when SIGTERM stops it: where to resume from, or that there is nothing to resume."""
    if checkpoint is None:
        return (
            "pl-dp: stopped by SIGTERM; no checkpoint was written (--trainer.enable_checkpointing true, or a "
            "ModelCheckpoint callback with every_n_train_steps, saves some)."
        )
    return f"pl-dp: stopped by SIGTERM; the last checkpoint is {checkpoint} (resume with --ckpt_path {checkpoint})."


def take_repeated(argv: list[str], option: str) -> tuple[list[str], list[str]]:
    """``argv`` without every ``option VALUE`` (or ``option=VALUE``), and the values in order."""
    rest, values, i = [], [], 0
    while i < len(argv):
        if argv[i] == option and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith(option + "="):
            values.append(argv[i][len(option) + 1 :])
        else:
            rest.append(argv[i])
        i += 1
    return rest, values


def report(model: Any, test_metrics: Mapping[str, float]) -> str:
    """One line: the test accuracy (classifiers) or the test loss and perplexity (causal language models), and the
    privacy spent."""
    parts = []
    if "test/acc" in test_metrics:
        parts.append(f"test accuracy {test_metrics['test/acc']:.4f}")
    if "test/perplexity" in test_metrics:
        parts.append(
            f"test loss {test_metrics['test/loss']:.4f}, test perplexity {test_metrics['test/perplexity']:.2f}"
        )
    if getattr(model, "privacy", None) is not None and getattr(model, "delta", None) is not None:
        parts.append(
            f"epsilon {model.epsilon:.3f} (delta {model.delta:.2e}, {model.accountant_name} accountant, "
            f"noise multiplier {model.noise_multiplier:.4f}, {model.private_steps} private steps)"
        )
    elif hasattr(model, "privacy"):
        parts.append("non-private run (no privacy guarantee)")
    return "pl-dp: " + " | ".join(parts)


def run_audit(args: list[str]) -> int:
    """``pl-dp audit --run ...``: :func:`~pl_dp.audit_run.audit_run` with its arguments as options; 1 on a violation."""
    parser = ArgumentParser(prog="pl-dp audit --run", description="Audit a whole private training run (one run).")
    parser.add_function_arguments(audit_run)
    options = parser.parse_args(args).as_dict()
    if options["privacy"] is not None:
        options["privacy"] = PrivacySpec(**options["privacy"])
    result = audit_run(**options)
    print(result)
    return 1 if result.violated else 0


#: Lightning's loggers, whose info lines ``pl-dp`` hides unless verbose
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


#: FutureWarnings that ``pl-dp`` hides: one library's deprecation hit by another's internals (torch's by Lightning,
#: transformers' by peft's ``get_peft_model``)
FOREIGN_DEPRECATIONS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"`is_gradient_checkpointing` is deprecated",
)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """While ``pl-dp`` runs: Lightning's info lines hidden (its warnings and errors still show), and two
    FutureWarnings about the internals of two other libraries, which nothing a user (or pl_dp) does can avoid: torch's
    about Lightning's use of ``LeafSpec``, and transformers' about peft reading ``is_gradient_checkpointing`` as it
    wraps every model in LoRA adapters.

    Every other warning shows, pl_dp's own included. Levels and filters are restored on exit, so calling
    :func:`main` from Python leaves the caller's logging and warnings as they were.
    """
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        with warnings.catch_warnings():
            for message in FOREIGN_DEPRECATIONS:
                warnings.filterwarnings("ignore", message=message, category=FutureWarning)
            for logger in loggers:
                logger.setLevel(logging.WARNING)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def verbose_requested(argv: list[str]) -> bool:
    """``--verbose`` before the subcommand (removed from ``argv``), or ``PL_DP_VERBOSE`` set and not 0."""
    flag = bool(argv) and argv[0] == "--verbose"
    if flag:
        del argv[0]
    return flag or os.environ.get("PL_DP_VERBOSE", "0") not in ("", "0")


#: ``pl-dp``'s exit status when pl_dp refuses to run what it was asked (1 is an audit's violation)
REFUSED = 2


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is one of pl_dp's refusals, printed without a traceback: a :class:`~pl_dp.errors.PlDpError`,
    or a ``NotImplementedError`` with a message raised in pl_dp's own code (an unsupported strategy, layout or model;
    a bare one, an abstract method left unimplemented, is a bug and keeps its traceback)."""
    if isinstance(error, PlDpError):
        return True
    if not isinstance(error, NotImplementedError) or not str(error).strip():
        return False
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and frame.tb_frame.f_globals.get("__name__", "").split(".")[0] == "pl_dp"


def refusal_message(error: BaseException) -> str:
    """``pl-dp: error: <message>`` with the error's notes, its type and how to see the traceback."""
    lines = [str(error).strip(), *getattr(error, "__notes__", ())]
    return (
        "pl-dp: error: "
        + "\n".join(lines)
        + f"\n({type(error).__name__}; 'pl-dp --verbose SUBCOMMAND ...' or PL_DP_VERBOSE=1 shows the traceback)"
    )


def main(args: list[str] | None = None) -> None:
    """``pl-dp [--verbose] SUBCOMMAND ...`` (``args``: the command line without the program name).

    A refusal of pl_dp's (:func:`is_refusal`) is printed to stderr as ``pl-dp: error: <message>`` and ends the
    command with ``SystemExit(2)`` (:data:`REFUSED`); verbose, it is raised as it is, with its traceback."""
    argv = sys.argv[1:] if args is None else list(args)
    verbose = verbose_requested(argv)
    if args is None:  # LightningCLI reads sys.argv itself
        sys.argv = sys.argv[:1] + argv
        if verbose:  # Lightning's DDP launcher re-runs this command line, without the flag, on the other ranks
            os.environ["PL_DP_VERBOSE"] = "1"
    try:
        with contextlib.nullcontext() if verbose else quiet_lightning():
            _run(argv, None if args is None else argv)
    except Exception as error:
        if verbose or not is_refusal(error):
            raise
        print(refusal_message(error), file=sys.stderr)
        raise SystemExit(REFUSED) from None


#: what ``pl-dp --help`` says beside LightningCLI's subcommands
DESCRIPTION = (
    "pl_dp's command line: differentially private training with PyTorch Lightning. fit, validate, test and predict "
    "take a config (pl-dp fit --config configs/digits/dpzero.yaml) and any option over it."
)
EPILOG = (
    "More subcommands: 'pl-dp report PATH.ckpt' prints a checkpoint's privacy report; 'pl-dp generate --config C "
    "--ckpt_path PATH.ckpt --prompt TEXT' samples text from a checkpoint's language model (post-processing, no "
    "privacy cost); 'pl-dp tune --config C --tune.space KEY=[...] --tune.mean M --tune.directory D' searches "
    "hyperparameters on private data and releases the best model with the whole search's epsilon ('pl-dp tune "
    "--help'); 'pl-dp audit --config C' "
    "audits one private step of a config's method (an empirical lower bound on epsilon next to the claim; "
    "--audit.* options); 'pl-dp audit --run' audits a whole training run with canaries (its options: 'pl-dp audit "
    "--run --help'). 'pl-dp --verbose SUBCOMMAND ...' (or PL_DP_VERBOSE=1) shows Lightning's info lines, which are "
    "hidden by default, and the traceback of a refusal: without it a refusal prints 'pl-dp: error: ...' and exits "
    "with status 2."
)
REPORT_USAGE = (
    "usage: pl-dp report PATH.ckpt\n\nPrint the privacy report of a pl_dp checkpoint: epsilon, delta, sigma, q, steps, "
    "accountant, adjacency, secrets, and what is and is not protected."
)


def subcommand_args(options: list[str], args: list[str] | None) -> list[str] | None:
    """What a subcommand's LightningCLI is given to parse its ``options``: from the command line (``args`` None)
    they go in ``sys.argv``, which LightningCLI reads itself (given ``args`` too, it warns that both were given at
    every call); from Python, as ``args``."""
    if args is None:
        sys.argv = sys.argv[:1] + options
        return None
    return options


def _run(argv: list[str], args: list[str] | None) -> None:
    if argv[:1] == ["report"]:
        if argv[1:] in (["-h"], ["--help"]):
            print(REPORT_USAGE)
            return
        if len(argv) != 2:
            raise SystemExit(REPORT_USAGE)
        print(PrivacyReport.from_checkpoint(argv[1]))
        return
    if argv[:1] == ["generate"]:
        rest, prompts = take_repeated(argv[1:], "--prompt")
        cli = GenerateCLI(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=subcommand_args(rest, args),
            run=False,
            save_config_callback=None,
            auto_configure_optimizers=False,
        )
        options = cli.config
        continuations = generate_from_checkpoint(
            cli.model,
            options["ckpt_path"],
            prompts or [""],
            max_new_tokens=options["max_new_tokens"],
            do_sample=options["do_sample"],
            temperature=options["temperature"],
            top_p=options["top_p"],
            seed=options["generation_seed"],
        )
        for prompt, text in zip(prompts or [""], continuations):
            print(f"{prompt}{text}")
        print(
            f"pl-dp: sampled from the checkpoint, post-processing of the released model: no further privacy cost.\n"
            f"{PrivacyReport.from_checkpoint(options['ckpt_path'])}"
        )
        return
    if argv[:1] == ["tune"]:
        if argv[1:] in (["-h"], ["--help"]):
            print(TUNE_USAGE)
            return
        released = tune_command(argv[1:])
        print(PAUSED if released is None else released)
        return
    if argv[:2] == ["audit", "--run"]:
        raise SystemExit(run_audit(argv[2:]))
    if argv[:1] == ["audit"]:
        cli = AuditCLI(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=subcommand_args(argv[1:], args),
            run=False,
            save_config_callback=None,
            auto_configure_optimizers=False,
        )
        result = audit(cli.model, cli.datamodule, cli.trainer, **cli.config["audit"])
        print(result)
        raise SystemExit(1 if result.violated else 0)
    PlDpCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "pl-dp", "description": DESCRIPTION, "epilog": EPILOG},
    )


if __name__ == "__main__":
    main()
