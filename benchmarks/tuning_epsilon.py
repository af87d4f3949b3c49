"""The ε of a private hyperparameter search (``pl-dp tune``) against the ε of one of its trials.

    python benchmarks/tuning_epsilon.py               # ~1 minute on 2 CPU cores
    python benchmarks/tuning_epsilon.py --json PATH   # also save the numbers

One trial is the plan of ``configs/digits/tune_dpsgd.yaml``: n = 1208 private digits, expected batch 64 (q = 64/n),
10 epochs of 18 steps, σ calibrated by the PRV accountant for ε₀ = 1 at δ = 1/n. The search runs a random number K of
such trials and releases the best (Papernot & Steinke 2022); its ε is dp-accounting's RDP accountant of
``RepeatAndSelectDpEvent(trial, mean, shape)`` (:func:`pl_dp.privacy.selection.search_epsilon`), for means 2, 4 and
10 of K and the logarithmic (shape 0), geometric (shape 1) and Poisson (shape inf) distributions. "one trial, RDP" is
the same RDP accountant's ε for one trial, the bound the search's ε grows from. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pl_dp.privacy.accountants import create_accountant, rdp_epsilon  # noqa: E402
from pl_dp.privacy.calibration import calibrate_noise_multiplier  # noqa: E402
from pl_dp.privacy.selection import POISSON, TrialCount, search_epsilon  # noqa: E402

PRIVATE, BATCH, EPOCHS, TRIAL_EPSILON = 1208, 64, 10, 1.0
MEANS = (2.0, 4.0, 10.0)
SHAPES = {"logarithmic (0)": 0.0, "geometric (1)": 1.0, "Poisson (inf)": POISSON}


def table() -> dict[str, object]:
    delta, rate, steps = 1 / PRIVATE, BATCH / PRIVATE, EPOCHS * (PRIVATE // BATCH)
    sigma = calibrate_noise_multiplier(TRIAL_EPSILON, delta, rate, steps, create_accountant("prv"))
    history = [[sigma, rate, steps]]
    rows = {
        f"{mean:g}": {
            name: search_epsilon(history, TrialCount(mean=mean, shape=shape), delta) for name, shape in SHAPES.items()
        }
        for mean in MEANS
    }
    return {
        "trial": {"noise_multiplier": sigma, "sample_rate": rate, "steps": steps, "delta": delta},
        "trial_epsilon_prv": TRIAL_EPSILON,
        "trial_epsilon_rdp": rdp_epsilon(history, delta),
        "search_epsilon": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    arguments = parser.parse_args()
    result = table()
    trial = result["trial"]
    print(
        f"one trial: sigma {trial['noise_multiplier']:.4f}, q {trial['sample_rate']:.4f}, {trial['steps']} steps, "
        f"delta {trial['delta']:.3g}: epsilon {TRIAL_EPSILON:g} (PRV), {result['trial_epsilon_rdp']:.3f} (RDP)"
    )
    print(f"| mean of K | {' | '.join(SHAPES)} |")
    print("|---|" + "---|" * len(SHAPES))
    for mean, row in result["search_epsilon"].items():
        print(f"| {mean} | " + " | ".join(f"{row[name]:.2f}" for name in SHAPES) + " |")
    print(json.dumps(result))
    if arguments.json:
        arguments.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
