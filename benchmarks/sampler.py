"""Cost of one Poisson-sampled batch as the private set grows: pl_dp's sampler against Opacus', side by side.

    python benchmarks/sampler.py            # n = 1e4 … 1e8, ~1 minute on 2 CPU cores
    python benchmarks/sampler.py --quick    # n = 1e4 … 1e6

Both samplers include each of n examples independently with probability q = b/n (expected batch b = 64).
Opacus' ``UniformWithReplacementSampler`` (behind its ``DPDataLoader``) draws a uniform per example and keeps
those below q: O(n) time and memory per step. pl_dp's :class:`~pl_dp.privacy.sampling.PoissonBatchSampler` draws
the batch size K ~ Binomial(n, q), then K distinct indices: O(b). For each n, the samplers are timed in turns
(median per step) and each one's peak resident-memory growth during its steps is measured after a reset of the
peak mark (Linux). Prints a table and JSON (``--json PATH``; the committed copy is
``benchmarks/results/sampler.json``).
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

from _measure import peak_rss_supported, reset_peak_rss, status_kb  # noqa: E402
from opacus.utils.uniform_sampler import UniformWithReplacementSampler  # noqa: E402

from pl_dp.privacy.sampling import PoissonBatchSampler  # noqa: E402

BATCH = 64


def _opacus(n: int, steps: int):
    sampler = UniformWithReplacementSampler(
        num_samples=n, sample_rate=BATCH / n, generator=torch.Generator().manual_seed(0), steps=steps
    )
    batches = iter(sampler)
    return lambda i: next(batches)


def _pl_dp(n: int, steps: int):
    sampler = PoissonBatchSampler(n, BATCH / n, steps_per_epoch=steps, seed=0)
    return sampler.batch


def _measure(draw, steps: int) -> tuple[float, float | None]:
    """(median seconds per batch, peak RSS growth in MB over the steps)."""
    base = reset_peak_rss() if peak_rss_supported() else None
    times, sizes = [], 0
    for i in range(steps):
        start = time.perf_counter()
        sizes += len(draw(i))
        times.append(time.perf_counter() - start)
    grown = (status_kb("VmHWM") - base) / 1024 if base is not None else None
    return statistics.median(times), grown


def measure(sizes: list[int], steps: int) -> list[dict]:
    rows = []
    for n in sizes:
        count = steps if n <= 10**7 else 3  # Opacus takes seconds a step at 1e8
        opacus_s, opacus_mb = _measure(_opacus(n, count), count)
        pl_dp_s, pl_dp_mb = _measure(_pl_dp(n, 10 * steps), 10 * steps)  # tens of microseconds: more steps
        rows.append(
            {
                "n": n,
                "expected_batch": BATCH,
                "opacus_steps": count,
                "pl_dp_steps": 10 * steps,
                "pl_dp_ms": pl_dp_s * 1e3,
                "opacus_ms": opacus_s * 1e3,
                "opacus_over_pl_dp": opacus_s / pl_dp_s,
                "pl_dp_peak_mb": pl_dp_mb,
                "opacus_peak_mb": opacus_mb,
            }
        )
    first = rows[0]["pl_dp_ms"]
    for row in rows:
        row["pl_dp_vs_smallest_n"] = row["pl_dp_ms"] / first
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sizes = [10**k for k in range(4, 7 if args.quick else 9)]
    rows = measure(sizes, args.steps)
    print(f"torch {torch.__version__}; expected batch {BATCH}; median per step")
    print(f"{'n':>12s} {'pl_dp':>10s} {'Opacus':>10s} {'ratio':>8s} {'pl_dp MB':>9s} {'Opacus MB':>10s} {'vs 1e4':>7s}")
    for r in rows:
        mb = [f"{v:9.1f}" if v is not None else f"{'-':>9s}" for v in (r["pl_dp_peak_mb"], r["opacus_peak_mb"])]
        print(
            f"{r['n']:12.0e} {r['pl_dp_ms']:8.3f}ms {r['opacus_ms']:8.2f}ms {r['opacus_over_pl_dp']:8.0f} "
            f"{mb[0]} {mb[1]:>10s} {r['pl_dp_vs_smallest_n']:7.2f}"
        )
    print(json.dumps(rows, indent=1))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
