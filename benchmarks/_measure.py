"""What the benchmark scripts share: a training-only Trainer, callbacks for step wall time and peak-RSS growth, and a
driver that runs a script once per world size."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L


def quiet_trainer(**kwargs) -> L.Trainer:
    """A CPU ``Trainer`` that only trains: no logger, checkpoints, progress bar, summary or validation, none of
    which a timing should include. ``kwargs`` add to or override these."""
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def status_kb(field: str) -> int:
    """A field of ``/proc/self/status`` in kB (Linux), e.g. ``VmRSS`` or ``VmHWM`` (peak RSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak_rss() -> int:
    """Return freed memory to the OS, reset the peak-RSS mark and return the RSS now (kB).

    Linux-specific (``malloc_trim`` and ``/proc/self/clear_refs``): afterwards ``VmHWM`` − the
    returned value is what the code that runs next allocates at its peak, not import-time
    transients or allocator caches.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kb("VmRSS")


def peak_rss_supported() -> bool:
    return sys.platform.startswith("linux")


class StepTimer(L.Callback):
    """Wall time of every training batch (``training_step`` plus Lightning's per-batch hooks)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._t)


class PeakMemory(L.Callback):
    """Peak RSS growth (MB) during training over the RSS live after ``warmup`` training batches.

    The mark is reset once (see :func:`reset_peak_rss`), after the warm-up batches, so lazily
    built buffers that persist count as setup, and what each step allocates and frees counts.
    ``peak_mb`` stays ``None`` off Linux or when training ran no more than ``warmup`` batches.
    """

    def __init__(self, warmup: int = 2) -> None:
        self.warmup, self.batches, self.base, self.peak_mb = warmup, 0, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.batches == self.warmup and peak_rss_supported():
            self.base = reset_peak_rss()
        self.batches += 1

    def on_train_end(self, trainer, pl_module):
        if self.base is not None:
            self.peak_mb = (status_kb("VmHWM") - self.base) / 1024


class FitMemory(L.Callback):
    """Resident memory of a fit, in MB over the RSS just before ``Trainer.fit`` (model and data loaded).

    * ``live_mb``: RSS after ``warmup`` training batches — what the method keeps between steps (optimizer
      state, hooks' buffers, kept directions, …) plus allocator caches;
    * ``step_peak_mb``: the peak-RSS growth of the later steps over that (what one step allocates and frees:
      activations, gradients, per-example gradients);
    * ``fit_peak_mb``: the peak RSS of the whole fit, warm-up steps included.

    Linux only (``/proc/self``); :meth:`start` must be called right before ``fit``.
    """

    def __init__(self, warmup: int = 2) -> None:
        self.warmup, self.batches = warmup, 0
        self.base = self.live = self.warmup_peak = None
        self.live_mb = self.step_peak_mb = self.fit_peak_mb = None

    def start(self) -> None:
        self.base = reset_peak_rss()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.batches == self.warmup:
            self.warmup_peak = status_kb("VmHWM")
            self.live = reset_peak_rss()
        self.batches += 1

    def on_train_end(self, trainer, pl_module):
        if self.live is None:
            return
        peak = status_kb("VmHWM")
        self.live_mb = (self.live - self.base) / 1024
        self.step_peak_mb = (peak - self.live) / 1024
        self.fit_peak_mb = (max(peak, self.warmup_peak) - self.base) / 1024


def per_world_size(
    script: str, doc: str, steps: int, worker: Callable[[int, int, Path], None], read: Callable[[Path], Any]
) -> tuple[argparse.Namespace, dict[int, Any]] | None:
    """The command line of a script measured on 1 and 2 processes (``--steps``, ``--json``).

    Run as a worker (``--worker W --out FILE``, how it re-runs itself), it calls ``worker(W, steps, FILE)`` and
    returns None. Otherwise it runs itself once per world size, each in its own subprocess (a multi-process
    launcher re-runs the script for the other ranks), and returns the arguments and ``read(FILE)`` per world size.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for devices in (1, 2):
            out = Path(tmp) / f"world{devices}.json"
            cmd = [sys.executable, script, "--worker", str(devices), "--out", str(out), "--steps", str(args.steps)]
            subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
            results[devices] = read(out)
    return args, results


def write_per_world_size(args: argparse.Namespace, table: dict[int, dict]) -> None:
    """Print the results of :func:`per_world_size` as JSON, and write them to ``--json`` if given."""
    result = {"world_1": table[1], "world_2": table[2], "steps": args.steps, "cpu_count": os.cpu_count()}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
