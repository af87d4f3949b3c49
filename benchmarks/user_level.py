"""Accuracy at user-level against example-level privacy, on VADER with synthetic authors (docs/who-is-protected.md).

    python benchmarks/user_level.py                 # 3 seeds, 300 steps each, a few minutes on 2 CPU cores
    python benchmarks/user_level.py --seeds 1 --steps 50

The private VADER entries get 1,000 synthetic authors with a Zipf-skewed number of entries each
(``VaderEmbeddingDataModule(authors=1000)``: 760 authors appear, the most prolific wrote 681). DP-SGD trains a small
head on the frozen MiniLM sentence embeddings at the same ε and the same number of steps, at example level (q =
batch / 4,897 entries, δ = 1/4,897) and at user level (q = batch / 760 authors, one entry of each sampled author,
δ = 1/760, and also at δ = 1/4,897), with automatic clipping (Auto-S), and without privacy. Prints a table and JSON
(``--json PATH``; the committed copy is ``benchmarks/results/user_level.json``, its table in
docs/who-is-protected.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pl_dp import PrivacySpec  # noqa: E402
from pl_dp.audit import quiet_trainer  # noqa: E402
from pl_dp.data import VaderEmbeddingDataModule  # noqa: E402
from pl_dp.methods import DPSGD  # noqa: E402
from pl_dp.nets import MLP  # noqa: E402

AUTHORS = 1000
LR = 0.5
#: the runs: without privacy, example level (δ = 1/n), user level (δ = 1/U), and user level at the example level's δ
LEVELS = ("non-private", "example", "user", "user, δ = 1/n")


def run(level: str, seed: int, steps: int, epsilon: float, batch_size: int) -> dict[str, float | str | int]:
    """Test accuracy and ε of one DP-SGD run at ``level`` (the same steps, batch and ε at every level)."""
    L.seed_everything(seed)
    data = VaderEmbeddingDataModule(batch_size=batch_size, authors=AUTHORS if level.startswith("user") else None)
    delta = 1 / len(data.private) if level == "user, δ = 1/n" else None  # None: 1/n, or 1/U at user level
    privacy = None if level == "non-private" else PrivacySpec(epsilon, delta=delta)
    model = DPSGD(MLP(384, [64], 2), lr=LR, clip=1.0, clip_fn="automatic", privacy=privacy)
    trainer = quiet_trainer(max_steps=steps, max_epochs=-1, limit_val_batches=0)
    trainer.fit(model, data)
    (metrics,) = trainer.test(model, data, verbose=False)
    unit = model.privacy_unit
    return {
        "level": level,
        "seed": seed,
        "test_accuracy": float(metrics["test/acc"]),
        "epsilon": float(model.epsilon),
        "delta": float(model.delta) if model.delta is not None else 0.0,
        "sample_rate": float(model.sample_rate or 0.0),
        "population": unit.population if unit is not None else 0,
        "steps": int(model.private_steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = [
        run(level, seed, args.steps, args.epsilon, args.batch_size) for seed in range(args.seeds) for level in LEVELS
    ]
    print(f"| level | ε per unit | δ | q | test accuracy (mean ± sd over {args.seeds} seeds) |")
    print("|---|---|---|---|---|")
    for level in LEVELS:
        mine = [row for row in rows if row["level"] == level]
        accuracy = [float(row["test_accuracy"]) for row in mine]
        spread = statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0
        first = mine[0]
        print(
            f"| {level} | {first['epsilon']:.3g} | {first['delta']:.3g} | {first['sample_rate']:.4g} | "
            f"{statistics.mean(accuracy):.3f} ± {spread:.3f} |"
        )
    result = {"settings": vars(args) | {"json": None, "authors": AUTHORS}, "runs": rows}
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
