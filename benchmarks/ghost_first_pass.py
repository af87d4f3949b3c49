"""Ghost clipping's first pass, norms only, against the full backward it replaced (issue 29 of [scale]).

    python benchmarks/ghost_first_pass.py            # ~6 minutes on 2 CPU cores
    python benchmarks/ghost_first_pass.py --quick    # small sizes, smoke test

Until this change the first pass was a backward of Σ_i ℓ_i with respect to every trainable parameter, whose
gradients were dropped: Opacus' hooks record the per-example norms from the layers' inputs and output gradients
only. It now asks autograd for the gradients with respect to the edges just below the hooked layers
(``pl_dp.per_sample.ghost._NormsOnly``), so the weight-gradient matmuls are pruned. The old pass is kept here
only (:class:`FullFirstPass`, the one line it was). For each case both engines run on the same batch, interleaved
round by round after a warm-up round, and the medians are reported with their ratios:

* ``norms``: the first pass alone (forward, backward for the norms): ``per_example_norms``;
* ``clipped sum``: both passes, what a DP-SGD step spends on clipping (``clipped_sum``);
* a non-private forward + backward of the summed loss, the reference for both;
* the peak resident-memory growth of ``clipped_sum`` (Linux), and the norms' largest relative difference.

Prints a table and JSON (``--json PATH`` to save; the committed copy is
``benchmarks/results/ghost_first_pass.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _measure import peak_rss_supported, reset_peak_rss, status_kb  # noqa: E402

from pl_dp.nets import MLP, TinyTransformerClassifier  # noqa: E402
from pl_dp.per_sample import GhostClipping  # noqa: E402
from pl_dp.privacy import ClipFunction  # noqa: E402
from pl_dp.step.losses import cross_entropy  # noqa: E402


class FullFirstPass(GhostClipping):
    """The first pass as it was: a backward of Σ_i ℓ_i with respect to every trainable parameter (then dropped)."""

    def _first_backward(self, losses):
        grads = torch.autograd.grad(losses.sum(), self.params, retain_graph=True, allow_unused=True)
        return [p for p, g in zip(self.params, grads) if g is not None]


def make_case(name: str, quick: bool):
    """(net, batch, description): the step-cost benchmark's MLP and transformer, and the packaged MiniLM."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        hidden, batch = ((128, 128), 64) if quick else ((2048, 2048), 256)
        net = MLP(64, hidden, 10)
        x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
        return net, (x, y), f"MLP 64-{'-'.join(map(str, hidden))}-10, B={batch}"
    if name == "transformer":
        width, depth, batch = (64, 1, 16) if quick else (256, 4, 64)
        net = TinyTransformerClassifier(width=width, depth=depth)
        tokens = torch.randint(1, 2000, (batch, 64), generator=g)
        return (
            net,
            (tokens, torch.randint(0, 2, (batch,), generator=g)),
            f"transformer w{width} d{depth}, B={batch}, T=64",
        )
    if name == "minilm":  # the packaged pretrained all-MiniLM-L6-v2, every parameter trainable
        from pl_dp.nets import MiniLMClassifier

        net = MiniLMClassifier(num_labels=2).eval()  # no dropout: both engines see the same function
        batch, length = (8, 16) if quick else (32, 32)
        tokens = torch.randint(1000, 30000, (batch, length), generator=g)
        return net, (tokens, torch.randint(0, 2, (batch,), generator=g)), f"MiniLM-L6 (all), B={batch}, T={length}"
    raise ValueError(name)


def _timed(op) -> float:
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def _peak_mb(op) -> float | None:
    if not peak_rss_supported():
        return None
    base = reset_peak_rss()
    op()
    return (status_kb("VmHWM") - base) / 1024


def measure(name: str, quick: bool, rounds: int) -> dict:
    net, batch, description = make_case(name, quick)
    params = sum(p.numel() for p in net.parameters() if p.requires_grad)
    fn = ClipFunction("constant", 1.0)
    engines = {"before": FullFirstPass(copy.deepcopy(net), cross_entropy), "after": GhostClipping(net, cross_entropy)}
    plain = copy.deepcopy(net)
    walk: list[float] = []  # the time the new pass spends walking the graph for its targets
    plan = engines["after"]._targets.plan

    def timed_plan(root):
        start = time.perf_counter()
        try:
            return plan(root)
        finally:
            walk.append(time.perf_counter() - start)

    engines["after"]._targets.plan = timed_plan  # type: ignore[method-assign]

    def non_private():
        plain.zero_grad(set_to_none=True)
        cross_entropy(plain, batch).sum().backward()

    ops = {"non_private": non_private}
    for label, engine in engines.items():
        ops[f"norms_{label}"] = lambda engine=engine: engine.per_example_norms(batch)
        ops[f"clipped_sum_{label}"] = lambda engine=engine: engine.clipped_sum(batch, fn)
    times: dict[str, list[float]] = {k: [] for k in ops}
    for r in range(rounds + 1):  # the first round warms up
        for key, op in ops.items():
            elapsed = _timed(op)
            if r:
                times[key].append(elapsed)
    norms = {label: engine.per_example_norms(batch) for label, engine in engines.items()}
    sums = {label: engine.clipped_sum(batch, fn)[0] for label, engine in engines.items()}
    peaks = {label: _peak_mb(lambda engine=engine: engine.clipped_sum(batch, fn)) for label, engine in engines.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    sum_error = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(sums["after"], sums["before"]))
    return {
        "case": name,
        "description": description,
        "trainable_parameters": params,
        "non_private_fwd_bwd_ms": 1e3 * med["non_private"],
        "norms_before_ms": 1e3 * med["norms_before"],
        "norms_after_ms": 1e3 * med["norms_after"],
        "clipped_sum_before_ms": 1e3 * med["clipped_sum_before"],
        "clipped_sum_after_ms": 1e3 * med["clipped_sum_after"],
        "norms_after_over_before": med["norms_after"] / med["norms_before"],
        "clipped_sum_after_over_before": med["clipped_sum_after"] / med["clipped_sum_before"],
        "clipped_sum_before_over_non_private": med["clipped_sum_before"] / med["non_private"],
        "clipped_sum_after_over_non_private": med["clipped_sum_after"] / med["non_private"],
        "graph_walk_ms": 1e3 * statistics.median(walk),
        "clipped_sum_peak_mb_before": peaks["before"],
        "clipped_sum_peak_mb_after": peaks["after"],
        "norms_max_relative_difference": float(((norms["after"] - norms["before"]).abs() / norms["before"]).max()),
        "clipped_sum_max_relative_difference": sum_error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", nargs="+", default=["mlp", "transformer", "minilm"])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    load_start = os.getloadavg()[0]
    rows = [measure(name, args.quick, rounds) for name in args.cases]
    load_end = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPU cores, medians of "
        f"{rounds} interleaved rounds; load average (1 min) {load_start:.1f} at the start, {load_end:.1f} at the end"
    )
    print(
        f"{'case':38} {'fwd+bwd':>8} {'norms old':>10} {'new':>7} {'ratio':>6} {'both passes old':>16} {'new':>7} "
        f"{'ratio':>6} {'÷ fwd+bwd old|new':>18} {'walk':>6} {'peak MB old|new':>16}"
    )
    for r in rows:
        peak = (
            f"{r['clipped_sum_peak_mb_before']:.0f}|{r['clipped_sum_peak_mb_after']:.0f}"
            if r["clipped_sum_peak_mb_before"] is not None
            else "-"
        )
        print(
            f"{r['description']:38} {r['non_private_fwd_bwd_ms']:>8.1f} {r['norms_before_ms']:>10.1f} "
            f"{r['norms_after_ms']:>7.1f} {r['norms_after_over_before']:>6.2f} {r['clipped_sum_before_ms']:>16.1f} "
            f"{r['clipped_sum_after_ms']:>7.1f} {r['clipped_sum_after_over_before']:>6.2f} "
            f"{r['clipped_sum_before_over_non_private']:>9.2f}|{r['clipped_sum_after_over_non_private']:<8.2f} "
            f"{r['graph_walk_ms']:>6.2f} {peak:>16}"
        )
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "rounds": rounds,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
