"""``--suite fine_tune``: full fine-tuning side by side, each method in its own fresh process."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import lightning as L
import torch
from _measure import FitMemory, StepTimer, quiet_trainer

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.methods import DPSGD
from step_suites.common import ENTRY, METHODS, PUBLIC_BATCH, make_case

#: full fine-tuning side by side (``--suite fine_tune``; what ``--cases minilm`` measures): every parameter trainable
FINE_TUNE = {
    "dpzero": ("DPZero (q = 1)", METHODS["dpzero"]),
    "pazo_m": ("PAZO-M", METHODS["pazo_m"]),
    "dpsgd_hooks": (
        "DP-SGD, per-example gradients (Opacus hooks)",
        lambda net: DPSGD(net, lr=1e-4, clip=1.0, per_sample="hooks", privacy=PrivacySpec(8.0, accountant="rdp")),
    ),
    "dpsgd_ghost": (
        "DP-SGD, ghost clipping",
        lambda net: DPSGD(net, lr=1e-4, clip=1.0, per_sample="ghost", privacy=PrivacySpec(8.0, accountant="rdp")),
    ),
    "sgd": ("non-private SGD (same loop, clip=None)", lambda net: DPSGD(net, lr=1e-4, clip=None)),
}


class _BatchSizes(L.Callback):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sizes.append(int(batch[1].shape[0]))


def fine_tune_probe(name, method, quick, steps):
    """Run in a fresh process: ``steps`` steps of ``method`` in ``Trainer.fit``; step times and resident memory.

    Every method sees the same Poisson batches (a fixed sampling seed), so the same realized batch sizes.
    """
    torch.set_num_threads(2)
    net, dataset, public, batch_size = make_case(name, quick)
    timer, memory, sizes = StepTimer(), FitMemory(warmup=2), _BatchSizes()
    trainer = quiet_trainer(max_steps=steps, callbacks=[timer, memory, sizes])
    data = PrivatePublicDataModule(
        dataset, public=public, batch_size=batch_size, public_batch_size=PUBLIC_BATCH, sampling_seed=0
    )
    model = FINE_TUNE[method][1](net)
    memory.start()
    trainer.fit(model, data)
    return {
        "step_ms": [1e3 * t for t in timer.times[2:]],
        "batch_sizes": sizes.sizes,
        "trainable_parameters": sum(p.numel() for p in net.parameters() if p.requires_grad),
        "live_mb": memory.live_mb,
        "step_peak_mb": memory.step_peak_mb,
        "fit_peak_mb": memory.fit_peak_mb,
    }


def fine_tune_case(name, quick, rounds, steps=6):
    """Each method in its own fresh process, ``rounds`` times round-robin; medians over rounds.

    A method that fails (out of memory, unsupported) is reported with its error instead of numbers.
    """
    net, _, _, batch_size = make_case(name, quick)
    weights_mb = sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20
    row = {
        "case": name,
        "parameters": sum(p.numel() for p in net.parameters()),
        "batch_size": batch_size,
        "steps_per_fit": steps,
        "measured_steps_per_fit": steps - 2,
        "rounds": rounds,
        "weights_mb": weights_mb,
        "load_average_at_start": list(os.getloadavg()),
        "memory": "RSS (Linux /proc/self/status), MB over the RSS just before Trainer.fit (model and data loaded)",
    }
    runs = {m: [] for m in FINE_TUNE}
    for _ in range(rounds):
        for m in FINE_TUNE:
            args = [sys.executable, ENTRY, "--fine-tune-probe", name, m, str(steps)] + (["--quick"] if quick else [])
            done = subprocess.run(args, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                runs[m].append({"error": f"exit {done.returncode}: {tail}"})
            else:
                runs[m].append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = statistics.median
    for m, results in runs.items():
        ok = [r for r in results if "error" not in r]
        row[f"{m}_label"] = FINE_TUNE[m][0]
        if not ok:
            row[f"{m}_error"] = results[-1]["error"]
            continue
        row[f"{m}_trainable_parameters"] = ok[0]["trainable_parameters"]
        row[f"{m}_batch_sizes"] = ok[0]["batch_sizes"]
        row[f"{m}_step_ms"] = med(med(r["step_ms"]) for r in ok)
        for k in ("live_mb", "step_peak_mb", "fit_peak_mb"):
            row[f"{m}_{k}"] = med(r[k] for r in ok)
    if "dpsgd_ghost_step_ms" in row and "sgd_step_ms" in row:
        row["ghost_over_sgd_step_time"] = row["dpsgd_ghost_step_ms"] / row["sgd_step_ms"]
        row["ghost_over_sgd_fit_peak"] = row["dpsgd_ghost_fit_peak_mb"] / row["sgd_fit_peak_mb"]
        row["ghost_over_sgd_step_peak"] = row["dpsgd_ghost_step_peak_mb"] / row["sgd_step_peak_mb"]
        row["ghost_over_sgd_peak_with_weights"] = (row["dpsgd_ghost_fit_peak_mb"] + weights_mb) / (
            row["sgd_fit_peak_mb"] + weights_mb
        )
    if "dpsgd_ghost_step_ms" in row and "dpsgd_hooks_step_ms" in row:
        row["hooks_over_ghost_step_time"] = row["dpsgd_hooks_step_ms"] / row["dpsgd_ghost_step_ms"]
        row["hooks_over_ghost_fit_peak"] = row["dpsgd_hooks_fit_peak_mb"] / row["dpsgd_ghost_fit_peak_mb"]
    row["load_average_at_end"] = list(os.getloadavg())
    return row


def fine_tune_table(rows):
    lines = [
        "| case | method | trainable | step ms | live MB | step peak MB | fit peak MB | fit peak ÷ non-private |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for m in FINE_TUNE:
            if f"{m}_error" in r:
                lines.append(f"| {r['case']} | {r[f'{m}_label']} | — | failed: {r[f'{m}_error']} | | | | |")
                continue
            ratio = r[f"{m}_fit_peak_mb"] / r["sgd_fit_peak_mb"] if "sgd_fit_peak_mb" in r else float("nan")
            lines.append(
                f"| {r['case']} | {r[f'{m}_label']} | {r[f'{m}_trainable_parameters'] / 1e6:.2f}M "
                f"| {r[f'{m}_step_ms']:.0f} | {r[f'{m}_live_mb']:.0f} | {r[f'{m}_step_peak_mb']:.0f} "
                f"| {r[f'{m}_fit_peak_mb']:.0f} | {ratio:.2f} |"
            )
    return "\n".join(lines)
