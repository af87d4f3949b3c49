"""``--suite pruning``: DP-ZOPO's masked step and sweep at pruning rates 1 %, 10 % and 100 % over the unmasked ones."""

from __future__ import annotations

import statistics

import torch

from pl_dp.zo.pruning import importance_matrix
from step_suites.common import dpzero_engine_op, fixed_batch, make_case, sweep_op, timed

PRUNING_RATES = (0.01, 0.1, 1.0)


def time_pruning(name, quick, repeats):
    """DP-ZOPO's masked DPZero step and sweep at each rate over the unmasked ones (interleaved)."""
    net, dataset, _, batch_size = make_case(name, quick)
    batch = fixed_batch(dataset, batch_size)
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(p.shape, generator=g) for p in net.parameters()]
    masks = {"none": None} | {f"{r:g}": importance_matrix(scores, r) for r in PRUNING_RATES}
    steps = {k: dpzero_engine_op(net, batch, m) for k, m in masks.items()}
    sweeps = {k: sweep_op(net, m) for k, m in masks.items()}
    times = {f"{kind}_{k}": [] for kind in ("step", "sweep") for k in masks}
    for op in [*steps.values(), *sweeps.values()]:
        op()
    for _ in range(repeats):
        for k in masks:
            times[f"step_{k}"].append(timed(steps[k]))
            times[f"sweep_{k}"].append(timed(sweeps[k]))
    med = statistics.median
    row = {"case": name, "batch_size": batch_size, "parameters": sum(p.numel() for p in net.parameters())}
    row.update({f"{k}_ms": 1e3 * med(t) for k, t in times.items()})
    for r in PRUNING_RATES:
        row[f"masked_step_{r:g}_over_unmasked"] = med(times[f"step_{r:g}"]) / med(times["step_none"])
        row[f"masked_sweep_{r:g}_over_unmasked"] = med(times[f"sweep_{r:g}"]) / med(times["sweep_none"])
    return row


def pruning_table(rows):
    lines = [
        "| case | params | B | unmasked step ms | step ÷ unmasked at r = 1 % / 10 % / 100 % "
        "| sweep ÷ unmasked at r = 1 % / 10 % / 100 % |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        step = " / ".join(f"{r[f'masked_step_{x:g}_over_unmasked']:.2f}" for x in PRUNING_RATES)
        sweep = " / ".join(f"{r[f'masked_sweep_{x:g}_over_unmasked']:.2f}" for x in PRUNING_RATES)
        lines.append(
            f"| {r['case']} | {r['parameters'] / 1e6:.2f}M | {r['batch_size']} | {r['step_none_ms']:.1f} "
            f"| {step} | {sweep} |"
        )
    return "\n".join(lines)
