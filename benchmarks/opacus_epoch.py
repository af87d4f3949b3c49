"""Per-epoch time of DP-SGD in pl_dp against Opacus' ``make_private``, same model, data, noise and accountant.

    python benchmarks/opacus_epoch.py            # ~2 minutes on 2 CPU cores
    python benchmarks/opacus_epoch.py --quick    # one repetition, the MLP only
    python benchmarks/opacus_epoch.py --whole-run --json benchmarks/results/opacus_whole_run.json   # ~1 minute

Both train on the private split of the digits (1,208 examples, expected batch 64, ε = 2 at δ = 1/n, clip 1, SGD
at lr 0.5) for 5 epochs, σ calibrated by each library from the target, with each accountant both offer (RDP, PRV;
pl_dp's default is PRV). Opacus: ``PrivacyEngine(accountant=...)``, ``make_private_with_epsilon`` with Poisson
sampling, a plain loop, and ``get_epsilon`` at the end of each epoch, as its tutorials do. pl_dp: ``DPSGD`` under a
``Trainer`` (no logger or progress bar), which also runs the fit-start checks and logs ε on Lightning's cadence.
Per-epoch time = the whole fit, set-up and calibration included, over the epochs; runs are interleaved
(pl_dp, Opacus, pl_dp, …) and the medians reported. Prints a table and JSON (``--json PATH``; the committed copy is
``benchmarks/results/opacus_epoch.json``).

``--whole-run``: the small run of issue [fast] 39 item 3, with σ given (not calibrated, so calibration is not in the
comparison): the digits MLP, expected batch 48 (25 steps an epoch), 10 epochs (250 steps), σ = 1, PRV. Each run is
timed whole — set-up (``make_private`` / ``Trainer.fit``'s start, with pl_dp's fit-start checks), the loop and the
final ε (Opacus: one ``get_epsilon`` at the end; pl_dp: ``model.epsilon``) — the two libraries alternating in one
process, medians of ``--repeats`` (default 7; ``--quick``: 3), and the ratio of the fastest runs of each (on a shared
machine the least disturbed ones). Beside them, in the same rotation, Lightning's floor: the same model trained
without privacy by a ``LightningModule`` that takes one plain SGD step per batch (manual optimization, as pl_dp's
methods), the same ``Trainer`` and batches of the expected size — what any ``Trainer.fit`` of this model costs before
a private step adds its per-example gradients, noise, checks and accounting — and the torch floor: the same
non-private steps in a plain loop, Opacus' loop without Opacus. What each library adds for privacy is then its run
less its floor (``pl_dp_private_s``, ``opacus_private_s``): a pl_dp run cannot cost less than Lightning's floor plus
what it adds, so ``(lightning floor + Opacus' addition) ÷ Opacus`` is the whole-run ratio of a pl_dp whose private
work cost exactly Opacus' (``ratio_at_opacus_cost``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _measure import quiet_trainer  # noqa: E402

from pl_dp import PrivacySpec  # noqa: E402
from pl_dp.data import DigitsDataModule  # noqa: E402
from pl_dp.methods import DPSGD  # noqa: E402
from pl_dp.nets import MLP  # noqa: E402

EPOCHS, BATCH, EPSILON, CLIP, LR = 5, 64, 2.0, 1.0, 0.5


def mlp() -> nn.Module:
    return MLP(64, [64], 10)


def cnn() -> nn.Module:
    """A small CNN on the 8×8 digit images (two 3×3 convolutions, 5.5k parameters)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def pl_dp_epoch(build, accountant: str) -> tuple[float, float]:
    L.seed_everything(0, verbose=False)
    data = DigitsDataModule(batch_size=BATCH)
    model = DPSGD(build(), lr=LR, clip=CLIP, privacy=PrivacySpec(epsilon=EPSILON, accountant=accountant))
    trainer = quiet_trainer(max_epochs=EPOCHS)
    start = time.perf_counter()
    trainer.fit(model, data)
    return (time.perf_counter() - start) / EPOCHS, model.epsilon


def opacus_epoch(build, accountant: str) -> tuple[float, float]:
    from opacus import PrivacyEngine

    L.seed_everything(0, verbose=False)
    data = DigitsDataModule(batch_size=BATCH)
    data.setup("fit")
    private = data.private
    delta = 1.0 / len(private)
    start = time.perf_counter()
    model = build()
    engine = PrivacyEngine(accountant=accountant)
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(private, batch_size=BATCH),
        target_epsilon=EPSILON,
        target_delta=delta,
        epochs=EPOCHS,
        max_grad_norm=CLIP,
        poisson_sampling=True,
    )
    epsilon = 0.0
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        epsilon = engine.get_epsilon(delta)
    return (time.perf_counter() - start) / EPOCHS, epsilon


WHOLE_BATCH, WHOLE_EPOCHS, WHOLE_SIGMA = 48, 10, 1.0


def pl_dp_whole_run() -> tuple[float, float, int]:
    """Seconds of a whole pl_dp fit with σ given, its final ε and its private steps."""
    L.seed_everything(0, verbose=False)
    start = time.perf_counter()
    data = DigitsDataModule(batch_size=WHOLE_BATCH)
    spec = PrivacySpec(epsilon=10.0, noise_multiplier=WHOLE_SIGMA, accountant="prv")
    model = DPSGD(mlp(), lr=LR, clip=CLIP, privacy=spec)
    quiet_trainer(max_epochs=WHOLE_EPOCHS).fit(model, data)
    epsilon = model.epsilon
    return time.perf_counter() - start, epsilon, model.private_steps


def opacus_whole_run() -> tuple[float, float, int]:
    """Seconds of a whole Opacus run (``make_private`` with Poisson sampling, the loop, one final ``get_epsilon``),
    its ε and its steps."""
    from opacus import PrivacyEngine

    L.seed_everything(0, verbose=False)
    start = time.perf_counter()
    data = DigitsDataModule(batch_size=WHOLE_BATCH)
    data.setup("fit")
    private = data.private
    delta = 1.0 / len(private)
    steps_per_epoch = len(private) // WHOLE_BATCH  # pl_dp's epoch; Opacus samples at q = 1 / len(loader)
    model = mlp()
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(private, batch_size=math.ceil(len(private) / steps_per_epoch)),
        noise_multiplier=WHOLE_SIGMA,
        max_grad_norm=CLIP,
        poisson_sampling=True,
    )
    steps = _train(model, optimizer, loader)
    epsilon = engine.get_epsilon(delta)
    return time.perf_counter() - start, epsilon, steps


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader) -> int:
    """``WHOLE_EPOCHS`` epochs of a plain loop, one optimizer step per batch; the steps taken."""
    steps = 0
    for _ in range(WHOLE_EPOCHS):
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
    return steps


class _PlainSteps(L.LightningModule):
    """One plain SGD step per batch, in manual optimization as pl_dp's methods step: Lightning's floor."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = batch
        self.manual_backward(F.cross_entropy(self.net(inputs), targets))
        optimizer.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def lightning_floor_run() -> tuple[float, float, int]:
    """Seconds of the same model's non-private ``Trainer.fit`` (:class:`_PlainSteps`), shuffled batches of the expected
    size, the same epochs; ε is 0 (nothing private is released) and its steps."""
    L.seed_everything(0, verbose=False)
    start = time.perf_counter()
    data = DigitsDataModule(batch_size=WHOLE_BATCH)
    data.setup("fit")
    trainer = quiet_trainer(max_epochs=WHOLE_EPOCHS)
    trainer.fit(_PlainSteps(), DataLoader(data.private, batch_size=WHOLE_BATCH, shuffle=True, drop_last=True))
    return time.perf_counter() - start, 0.0, trainer.global_step


def torch_floor_run() -> tuple[float, float, int]:
    """Seconds of the same non-private steps in a plain torch loop (shuffled batches of the expected size), ε 0, and
    its steps."""
    L.seed_everything(0, verbose=False)
    start = time.perf_counter()
    data = DigitsDataModule(batch_size=WHOLE_BATCH)
    data.setup("fit")
    model = mlp()
    loader = DataLoader(data.private, batch_size=WHOLE_BATCH, shuffle=True, drop_last=True)
    steps = _train(model, torch.optim.SGD(model.parameters(), lr=LR), loader)
    return time.perf_counter() - start, 0.0, steps


def measure_whole_run(repeats: int) -> dict:
    """The whole runs alternating (a warm-up round first, not counted), medians and their ratios to Opacus'."""
    runs = (
        ("pl_dp", pl_dp_whole_run),
        ("opacus", opacus_whole_run),
        ("lightning_floor", lightning_floor_run),
        ("torch_floor", torch_floor_run),
    )
    times: dict[str, list[float]] = {library: [] for library, _ in runs}
    result: dict[str, tuple[float, int]] = {}
    for repeat in range(repeats + 1):
        for library, run in runs:
            seconds, epsilon, steps = run()
            result[library] = (epsilon, steps)
            if repeat:
                times[library].append(seconds)
    pl, op = statistics.median(times["pl_dp"]), statistics.median(times["opacus"])
    floor, torch_floor = statistics.median(times["lightning_floor"]), statistics.median(times["torch_floor"])
    return {
        "case": f"digits MLP 64-64-10, b = {WHOLE_BATCH}, {WHOLE_EPOCHS} epochs, sigma = {WHOLE_SIGMA}, PRV",
        "repeats": repeats,
        "pl_dp_s": pl,
        "opacus_s": op,
        "ratio": pl / op,
        "ratio_of_fastest": min(times["pl_dp"]) / min(times["opacus"]),
        "lightning_floor_s": floor,
        "lightning_floor_ratio": floor / op,
        "lightning_floor_steps": result["lightning_floor"][1],
        "torch_floor_s": torch_floor,
        "pl_dp_private_s": pl - floor,
        "opacus_private_s": op - torch_floor,
        "private_ratio": (pl - floor) / (op - torch_floor),
        "ratio_at_opacus_cost": (floor + op - torch_floor) / op,
        "pl_dp_runs_s": times["pl_dp"],
        "opacus_runs_s": times["opacus"],
        "lightning_floor_runs_s": times["lightning_floor"],
        "torch_floor_runs_s": times["torch_floor"],
        "pl_dp_epsilon": result["pl_dp"][0],
        "opacus_epsilon": result["opacus"][0],
        "pl_dp_steps": result["pl_dp"][1],
        "opacus_steps": result["opacus"][1],
        "load_average": list(os.getloadavg()),
        "torch_threads": torch.get_num_threads(),
    }


def measure(models: dict, repeats: int) -> list[dict]:
    rows = []
    for name, build in models.items():
        for accountant in ("prv", "rdp"):
            times: dict[str, list[float]] = {"pl_dp": [], "opacus": []}
            eps: dict[str, float] = {}
            for _ in range(repeats):
                for library, run in (("pl_dp", pl_dp_epoch), ("opacus", opacus_epoch)):
                    seconds, eps[library] = run(build, accountant)
                    times[library].append(seconds)
            pl, op = statistics.median(times["pl_dp"]), statistics.median(times["opacus"])
            rows.append(
                {
                    "model": name,
                    "accountant": accountant,
                    "pl_dp_s_per_epoch": pl,
                    "opacus_s_per_epoch": op,
                    "ratio": pl / op,
                    "pl_dp_epsilon": eps["pl_dp"],
                    "opacus_epsilon": eps["opacus"],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--whole-run", action="store_true", help="the small whole run with sigma given (see above)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.whole_run:
        row = measure_whole_run(3 if args.quick else (args.repeats if args.repeats != 3 else 7))
        print(
            f"{row['case']}: pl_dp {row['pl_dp_s']:.3f} s, Opacus {row['opacus_s']:.3f} s, ratio {row['ratio']:.2f} "
            f"(fastest runs: {row['ratio_of_fastest']:.2f}); Lightning's floor {row['lightning_floor_s']:.3f} s "
            f"({row['lightning_floor_ratio']:.2f}x Opacus), torch's {row['torch_floor_s']:.3f} s; added for privacy: "
            f"pl_dp {row['pl_dp_private_s']:.3f} s, Opacus {row['opacus_private_s']:.3f} s "
            f"({row['private_ratio']:.2f}x); the ratio at Opacus' cost {row['ratio_at_opacus_cost']:.2f}; "
            f"eps {row['pl_dp_epsilon']:.3f} / {row['opacus_epsilon']:.3f}; steps {row['pl_dp_steps']} / "
            f"{row['opacus_steps']}; load {row['load_average'][0]:.1f}"
        )
        print(json.dumps(row, indent=1))
        if args.json:
            args.json.write_text(json.dumps(row, indent=1) + "\n")
        return
    models = {"digits MLP 64-64-10": mlp} if args.quick else {"digits MLP 64-64-10": mlp, "digits CNN": cnn}
    rows = measure(models, 1 if args.quick else args.repeats)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {EPOCHS} epochs, medians; ratio = pl_dp/Opacus"
    )
    print(f"{'model':22s} {'accountant':10s} {'pl_dp s/epoch':>14s} {'Opacus s/epoch':>15s} {'ratio':>6s} {'eps':>14s}")
    for r in rows:
        print(
            f"{r['model']:22s} {r['accountant']:10s} {r['pl_dp_s_per_epoch']:14.3f} {r['opacus_s_per_epoch']:15.3f} "
            f"{r['ratio']:6.2f} {r['pl_dp_epsilon']:6.3f}/{r['opacus_epsilon']:.3f}"
        )
    print(json.dumps(rows, indent=1))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
