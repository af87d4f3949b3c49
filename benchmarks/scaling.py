"""Steps per second and bytes per step on 1 vs 2 CPU processes (Lightning DDP over gloo).

    python benchmarks/scaling.py              # DPZero, PAZO-M, DP-SGD on digits (MLP 64-512-512-10)
    python benchmarks/scaling.py --steps 10   # shorter
    python benchmarks/scaling.py --json out.json

Each world size runs in its own subprocess (Lightning's DDP launcher starts the other ranks by
re-running this file); both use the same total number of CPU threads (``os.cpu_count()`` split
across the processes). Timed from the first training batch to the end of training, after one
warm-up step; bytes are everything passed to ``torch.distributed`` collectives during training.
Prints a table and JSON.
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
import torch.distributed as dist  # noqa: E402
from _measure import per_world_size, quiet_trainer, write_per_world_size  # noqa: E402

from pl_dp import PrivacySpec  # noqa: E402
from pl_dp.data import DigitsDataModule  # noqa: E402
from pl_dp.methods import DPSGD, PAZOM, DPZero  # noqa: E402
from pl_dp.nets import MLP  # noqa: E402

warnings.filterwarnings("ignore")
HIDDEN = [512, 512]
BATCH = 256


def _methods():
    spec = PrivacySpec(epsilon=2.0, accountant="rdp")
    net = lambda: MLP(64, HIDDEN, 10)  # noqa: E731
    return {
        "dpzero": lambda: DPZero(net(), lr=0.02, clip=2.0, queries=4, privacy=spec),
        "pazo_m": lambda: PAZOM(net(), lr=0.02, clip=2.0, queries=4, alpha=0.5, privacy=spec),
        "dpsgd": lambda: DPSGD(net(), lr=0.5, clip=1.0, privacy=spec),
    }


class _Meter(L.Callback):
    """Wall time and collective bytes from the end of the warm-up step to the end of training."""

    def __init__(self) -> None:
        self.bytes, self.counting, self.start, self.steps, self.seconds = 0, False, 0.0, 0, 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.counting:  # the first step warms up (allocations, process-group buffers)
            self.counting, self.start = True, time.perf_counter()
        else:
            self.steps += 1

    def on_train_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.start
        self.counting = False


_METER: list[_Meter] = []


def _instrument() -> None:
    for name in ("all_reduce", "broadcast", "all_gather", "reduce"):
        original = getattr(dist, name)

        def counted(tensor, *args, _original=original, **kwargs):
            if _METER and _METER[0].counting and isinstance(tensor, torch.Tensor):
                _METER[0].bytes += tensor.numel() * tensor.element_size()
            return _original(tensor, *args, **kwargs)

        setattr(dist, name, counted)


def worker(devices: int, steps: int, out: Path) -> None:
    _instrument()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    results = {}
    for name, make in _methods().items():
        L.seed_everything(0)
        meter = _Meter()
        _METER[:] = [meter]
        trainer = quiet_trainer(
            devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=steps + 1, callbacks=[meter]
        )
        model = make()
        trainer.fit(model, DigitsDataModule(batch_size=BATCH))
        results[name] = {
            "steps_per_second": meter.steps / meter.seconds,
            "bytes_per_step": meter.bytes / max(meter.steps, 1),
            "parameters": sum(p.numel() for p in model.net.parameters()),
            "epsilon": model.epsilon,
        }
    if trainer.global_rank == 0:
        out.write_text(json.dumps(results))


def main() -> None:
    run = per_world_size(__file__, __doc__, 20, worker, lambda out: json.loads(out.read_text()))
    if run is None:
        return
    args, table = run
    print(f"digits MLP 64-{'-'.join(map(str, HIDDEN))}-10, expected batch {BATCH}, {args.steps} timed steps")
    header = ["method".ljust(8), "d".rjust(8), "steps/s 1 proc".rjust(15), "steps/s 2 proc".rjust(15)]
    print(" ".join(header + ["bytes/step 2 proc".rjust(18), "epsilon 1|2".rjust(14)]))
    for name in table[1]:
        one, two = table[1][name], table[2][name]
        print(
            f"{name:8} {one['parameters']:>8} {one['steps_per_second']:>15.1f} {two['steps_per_second']:>15.1f} "
            f"{two['bytes_per_step']:>18.0f} {one['epsilon']:>6.3f}|{two['epsilon']:.3f}"
        )
    write_per_world_size(args, table)


if __name__ == "__main__":
    main()
