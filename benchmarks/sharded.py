"""Sharded private fine-tuning: the pretrained MiniLM (22.7M parameters) on VADER, 1 process vs 2 CPU ranks under
Lightning's ``ModelParallelStrategy`` (FSDP2, each rank holding half of every parameter).

    python benchmarks/sharded.py                      # DPZero, PAZO-M, DP-SGD (ghost, book-keeping); 3 timed steps
    python benchmarks/sharded.py --steps 5 --json benchmarks/results/sharded.json

Each layout runs in its own subprocess (Lightning's launcher starts the second rank by re-running this file), with
the same seeds (``noise_seed`` and ``sampling_seed``: reproduction mode) and the same total number of CPU threads.
Measured per method: the parameter memory each rank holds (its shards, plus fp32 masters if any) against one
process; seconds per step (from the end of a warm-up step to the end of training); the bytes pl_dp sends a step
beyond FSDP's own all-gathers and reduce-scatters (``collective_bytes``: the released sums, the non-finite count and
the number of forwards every rank runs); and the largest
|Δθ| between the gathered sharded parameters and the one-process ones. Prints a table and JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from _measure import per_world_size, quiet_trainer, write_per_world_size  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from pl_dp import PrivacySpec  # noqa: E402
from pl_dp.data import VaderSentimentDataModule  # noqa: E402
from pl_dp.methods import DPSGD, PAZOM, DPZero  # noqa: E402
from pl_dp.nets import MiniLMClassifier  # noqa: E402
from pl_dp.step.shards import local  # noqa: E402

warnings.filterwarnings("ignore")
BATCH = 16


def _methods():
    spec = PrivacySpec(epsilon=2.0, accountant="prv")
    net = lambda: MiniLMClassifier(num_labels=2, trainable="all")  # noqa: E731
    return {
        "dpzero": lambda: DPZero(net=net(), lr=1e-4, clip=1.0, queries=2, privacy=spec, noise_seed=7),
        "pazo_m": lambda: PAZOM(net=net(), lr=1e-4, clip=1.0, queries=2, alpha=0.5, privacy=spec, noise_seed=7),
        **{
            f"dpsgd_{mode}": lambda mode=mode: DPSGD(
                net=net(), lr=0.1, clip=1.0, clip_fn="automatic", per_sample=mode, privacy=spec, noise_seed=7
            )
            for mode in ("ghost", "bk")
        },
    }


class _Meter(L.Callback):
    """Wall time from the end of the warm-up step to the end of training, and pl_dp's bytes over that span."""

    def __init__(self) -> None:
        self.start, self.steps, self.seconds, self.bytes_at_start = None, 0, 0.0, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.start is None:
            self.start, self.bytes_at_start = time.perf_counter(), pl_module.collective_bytes
        else:
            self.steps += 1

    def on_train_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.start


def _gathered(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten() for p in net.parameters()])


def worker(devices: int, steps: int, out: Path) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    results = {}
    for name, make in _methods().items():
        L.seed_everything(0)
        meter = _Meter()
        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1) if devices > 1 else "auto"
        trainer = quiet_trainer(devices=devices, strategy=strategy, max_steps=steps + 1, callbacks=[meter])
        model = make()
        trainer.fit(model, VaderSentimentDataModule(batch_size=BATCH, sampling_seed=11))
        masters = getattr(model, "masters", None)  # the methods that write their own update (OwnUpdateModule)
        held = sum(local(p).numel() * p.element_size() for p in model.net.parameters())
        held += masters.nbytes if masters is not None else 0
        theta = _gathered(model.net)
        results[name] = {
            "seconds_per_step": meter.seconds / max(meter.steps, 1),
            "parameter_bytes_per_rank": held,
            "pl_dp_bytes_per_step": (model.collective_bytes - meter.bytes_at_start) / max(meter.steps, 1),
            "parameters": theta.numel(),
            "epsilon": model.epsilon,
        }
        if trainer.global_rank == 0:
            torch.save(theta, out.with_suffix(f".{name}.pt"))
    if trainer.global_rank == 0:
        out.write_text(json.dumps(results))


def _read(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    results = json.loads(out.read_text())
    return results, {name: torch.load(out.with_suffix(f".{name}.pt")) for name in results}


def main() -> None:
    run = per_world_size(__file__, __doc__, 3, worker, _read)
    if run is None:
        return
    args, both = run
    table, thetas = {d: both[d][0] for d in both}, {d: both[d][1] for d in both}
    for name in table[2]:
        table[2][name]["max_abs_difference_vs_1_process"] = float((thetas[2][name] - thetas[1][name]).abs().max())
    print(
        f"MiniLM ({table[1]['dpzero']['parameters']:,} parameters) on VADER, expected batch {BATCH}, "
        f"{args.steps} timed steps, 1 process vs 2 FSDP2 ranks on {os.cpu_count()} CPU cores"
    )
    print(
        f"{'method':8} {'param MB/rank 1|2':>18} {'ratio':>6} {'s/step 1|2':>14} {'pl_dp B/step':>13} "
        f"{'max |Δθ|':>10} {'ε 1|2':>12}"
    )
    for name in table[1]:
        one, two = table[1][name], table[2][name]
        print(
            f"{name:8} {one['parameter_bytes_per_rank'] / 2**20:>8.1f}|{two['parameter_bytes_per_rank'] / 2**20:<9.1f}"
            f" {two['parameter_bytes_per_rank'] / one['parameter_bytes_per_rank']:>6.3f}"
            f" {one['seconds_per_step']:>6.2f}|{two['seconds_per_step']:<7.2f} {two['pl_dp_bytes_per_step']:>13.0f}"
            f" {two['max_abs_difference_vs_1_process']:>10.2e} {one['epsilon']:>5.3f}|{two['epsilon']:.3f}"
        )
    write_per_world_size(args, table)


if __name__ == "__main__":
    main()
