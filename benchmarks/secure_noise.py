"""Cost of drawing one step's DP noise from the cryptographic generator, against torch's generator.

    python benchmarks/secure_noise.py            # ~1 minute on 2 CPU cores
    python benchmarks/secure_noise.py --quick    # small sizes, smoke test

pl_dp's ``NoiseSource(secure=True)`` (SHAKE-256 stream, Box–Muller in float64, the sum of four draws
halved as in Holohan & Braghin 2021) is the default for the zeroth-order methods, which release a
few noisy scalars a step, and opt-in (``secure_rng=True``) for first-order methods, which add noise
to every coordinate of the gradient. For each size — q scalars of a zeroth-order step, the digits MLP
of ``step_cost.py`` (4.35M parameters) and the packaged MiniLM (22.7M) — both generators draw the
same shape, interleaved, and the medians are reported with their ratio. Prints a table and JSON
(``--json PATH`` to save; the committed copy is ``benchmarks/results/secure_noise.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pl_dp.privacy import NoiseSource  # noqa: E402

CASES = {
    "zo step, q=1": 1,
    "zo step, q=16": 16,
    "digits MLP gradient (4.35M)": 4_353_034,
    "MiniLM gradient (22.7M)": 22_713_216,
}
QUICK = {"zo step, q=1": 1, "zo step, q=16": 16, "gradient (100k)": 100_000}


def _time(source: NoiseSource, numel: int, step: int) -> float:
    source.start_step(step)
    start = time.perf_counter()
    source.normal((numel,), 1.0)
    return time.perf_counter() - start


def measure(cases: dict[str, int], repeats: int) -> list[dict]:
    fast, secure = NoiseSource(), NoiseSource(secure=True)
    rows = []
    for name, numel in cases.items():
        times = {"torch": [], "secure": []}
        for r in range(repeats + 1):  # the first round warms up
            for label, source in (("torch", fast), ("secure", secure)):
                elapsed = _time(source, numel, r)
                if r:
                    times[label].append(elapsed)
        torch_s, secure_s = statistics.median(times["torch"]), statistics.median(times["secure"])
        rows.append(
            {
                "case": name,
                "values": numel,
                "torch_ms": torch_s * 1e3,
                "secure_ms": secure_s * 1e3,
                "secure_over_torch": secure_s / torch_s,
                "secure_ns_per_value": secure_s / numel * 1e9,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cases = QUICK if args.quick else CASES
    repeats = args.repeats or (3 if args.quick else 7)
    rows = measure(cases, repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {repeats} interleaved draws")
    print(f"{'case':32} {'values':>11} {'torch ms':>10} {'secure ms':>10} {'ratio':>7} {'ns/value':>9}")
    for row in rows:
        print(
            f"{row['case']:32} {row['values']:>11,} {row['torch_ms']:>10.3f} {row['secure_ms']:>10.3f} "
            f"{row['secure_over_torch']:>7.1f} {row['secure_ns_per_value']:>9.1f}"
        )
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": repeats, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
