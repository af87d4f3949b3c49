"""Subprocess runs started in the background when the session starts, for the tests that check them.

The test process runs on one core of a 2-core machine most of the time. A few tests check what fresh interpreters
do — 2-process training runs (tests/distributed), plain torch processes over gloo
(:func:`tests.distributed.on_two_ranks`), the CLI, the docs build — and leave a core idle while they wait (the test
process waits; one rank imports while the other waits at the rendezvous). A module declares such a run with
:func:`job` (commands) or :func:`call` (a function of the module, in a fresh interpreter). When the session starts,
the runs its selected tests need start one after the other in a background thread, at the lowest priority, in the
order of the tests, while the other tests run (tests/conftest.py runs the modules that wait for one last); a test, or
its fixture, collects its run with :meth:`Job.result` or :func:`returned`.

Only runs that spend their time waiting or importing belong here: a run that computes for seconds competes with the
tests in the foreground, and pays an interpreter's imports (~6 s) besides (moved here, the whole-run audits of
tests/test_audit_run.py and the examples of tests/test_examples.py did not make a session faster).

The commands, their environment (the session's as it was when it started: no test's monkeypatching or seeds), their
timeouts, the functions called and every check on what they gave are the tests' own; only where and when they run
changes. A run the session did not start runs when its test asks for it — every run, under pytest-xdist (``make
test``), where the other worker keeps the second core busy while one waits.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Command:
    """One process of a run: ``args`` in ``cwd``, the session's environment updated with ``env``."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT
    timeout: float = 600


class Job:
    """A run of one or more processes started together (:func:`job`); :meth:`result` waits for all of them."""

    def __init__(self, name: str, module: str, make: Callable[[Path], list[Command]], needed_by) -> None:
        self.name, self.module, self.make, self.needed_by = name, module, make, needed_by
        self.out: Path | None = None
        self._env: dict[str, str] = {}
        self._done = threading.Event()
        self._started = False
        self._lock = threading.Lock()
        self._results: list[subprocess.CompletedProcess] | None = None
        self._error: BaseException | None = None
        self._processes: list[subprocess.Popen] = []

    def wanted(self, item) -> bool:
        module = getattr(item, "module", None)
        return getattr(module, "__name__", None) == self.module and (self.needed_by is None or self.needed_by(item))

    def _claim(self) -> bool:
        """Whether the caller is the one to run it (once: the background thread, or the test that needs it first)."""
        with self._lock:
            if self._started:
                return False
            self._started = True
            return True

    def _run(self, base_env: dict[str, str], niceness: int = 0) -> None:
        try:
            commands = self.make(self.out)
            nice = ["nice", "-n", str(niceness)] if niceness and shutil.which("nice") else []
            self._processes = [
                subprocess.Popen(
                    [*nice, *command.args],
                    cwd=command.cwd,
                    env={**base_env, **command.env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,  # its own process group: a run cut short is ended with its children
                )
                for command in commands
            ]
            results = []
            for command, process in zip(commands, self._processes):
                try:
                    stdout, stderr = process.communicate(timeout=command.timeout)
                except subprocess.TimeoutExpired:
                    _end(process)
                    stdout, stderr = process.communicate()
                    raise subprocess.TimeoutExpired(command.args, command.timeout, stdout, stderr) from None
                results.append(subprocess.CompletedProcess(command.args, process.returncode, stdout, stderr))
            self._results = results
        except BaseException as error:  # re-raised in the test that collects the run
            self._error = error
            for process in self._processes:
                _end(process)
        finally:
            self._done.set()

    def result(self) -> tuple[Path, list[subprocess.CompletedProcess]]:
        """The run's output folder and each process's result (in the order :func:`job`'s commands gave them);
        runs it here and now if the session did not start it."""
        if self._claim():  # not started yet: the session did not plan it, or has not reached it
            if self.out is None:
                self.out, self._env = Path(tempfile.mkdtemp(prefix=f"pl_dp_{self.name}_")), dict(os.environ)
            self._run(self._env)
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._results is not None
        return self.out, self._results

    def cancel(self) -> None:
        _STOP.set()  # the background thread starts no other run
        for process in self._processes:
            _end(process)


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


JOBS: list[Job] = []
#: the background runs yield the CPU to the tests running meanwhile (what they compute does not depend on it); a
#: run a test waits for runs at the test's own priority
BACKGROUND_NICENESS = 19
_STOP = threading.Event()


def for_test(name: str) -> Callable:
    """``needed_by`` for a run that one test needs (its function's ``name``, whatever its parameters)."""
    return lambda item: item.originalname == name


def job(name: str, make: Callable[[Path], list[Command]], needed_by: Callable | None = None) -> Job:
    """Declare a background run of the calling test module: ``make(out)`` gives its commands (``out``: an empty
    folder of the session's). It starts when the session starts if a selected test of the module needs it
    (``needed_by(item)``; by default, every test of the module)."""
    declared = Job(name, sys._getframe(1).f_globals["__name__"], make, needed_by)
    JOBS.append(declared)
    return declared


def call(name: str, function: Callable[[], Any], needed_by: Callable | None = None, through: str = "") -> Job:
    """Declare a background run of ``function()``, a module-level function of the calling test module, in a fresh
    interpreter that imports the module as pytest does (:func:`import_test_module`; not tests/conftest.py, whose
    settings it does not have); :func:`returned` gives what it returned. With ``through``, ``"module:name"`` of a
    function of one argument, the run calls that on ``function`` instead (:func:`tests.distributed.on_two_ranks`)."""
    path = Path(sys.modules[function.__module__].__file__).resolve()

    def make(out: Path) -> list[Command]:
        args = [sys.executable, "-m", __name__, str(path), function.__name__, str(out / "returned.pt"), through]
        return [Command(args, timeout=600)]

    declared = Job(name, function.__module__, make, needed_by)
    JOBS.append(declared)
    return declared


def returned(declared: Job) -> Any:
    """What the function of ``declared`` (:func:`call`) returned; the run's error if it raised."""
    import torch

    out, (proc,) = declared.result()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return torch.load(out / "returned.pt", weights_only=False)


def import_test_module(file: str) -> ModuleType:
    """The test module at ``file`` imported as pytest imports it (rootdir-relative, no ``__init__.py``): its folder
    on ``sys.path`` and its file name as its name, so that what it defines pickles by the same names."""
    folder = Path(file).parent
    assert not (folder / "__init__.py").exists(), f"{file} is in a package: pytest names it otherwise"
    sys.path.insert(0, str(folder))
    return importlib.import_module(Path(file).stem)


def start(items, tmp_path_factory) -> list[Job]:
    """Start, in one background thread and one at a time, the runs of the selected ``items`` in their order."""
    order = []
    for item in items:
        for declared in JOBS:
            if declared not in order and declared.wanted(item):
                order.append(declared)
    base_env = dict(os.environ)
    for declared in order:
        if declared.out is None:
            declared.out, declared._env = tmp_path_factory.mktemp(declared.name), base_env

    def run_all() -> None:
        for declared in order:
            if not _STOP.is_set() and declared._claim():
                declared._run(declared._env, niceness=BACKGROUND_NICENESS)

    if order:
        threading.Thread(target=run_all, name="background runs", daemon=True).start()
    return order


if __name__ == "__main__":  # python -m tests.background FILE FUNCTION OUT [THROUGH] (see call)
    import torch

    file, function, out, through = (sys.argv[1:] + [""])[:4]
    target = getattr(import_test_module(file), function)
    if through:
        module, name = through.split(":")
        value = getattr(importlib.import_module(module), name)(target)
    else:
        value = target()
    torch.save(value, out)
