"""``--suite directions``: what the random directions cost — a sweep per parameter against the ``add_`` floor,
and DPZero steps with directions redrawn, kept, Rademacher and low-rank."""

from __future__ import annotations

import statistics

import torch

from step_suites.common import fixed_batch, forward_op, lightning_step_times, make_case, sweep_op, timed


def add_floor_op(net):
    """One ``add_`` over every parameter: what any sweep must cost at least (read and write them once)."""
    params = list(net.parameters())
    others = [torch.randn_like(p) for p in params]

    @torch.no_grad()
    def op():
        for p, o in zip(params, others):
            p.add_(o, alpha=1e-9)

    return op


def on_threads(op, threads):
    """``op`` run under ``torch.set_num_threads(threads)`` (restored afterwards)."""

    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            op()
        finally:
            torch.set_num_threads(before)

    return run


#: one sweep (draw + add, nothing kept) per direction kind; the first on one thread: torch's generator alone
DIRECTION_SWEEPS = {
    "gaussian_1_thread": ("gaussian", 1),
    "gaussian": ("gaussian", None),
    "rademacher": ("rademacher", None),
    "lowrank": ("lowrank", None),
}

#: DPZero in the Lightning loop: redrawn three times a query, kept (the default here), and the cheaper kinds
DIRECTION_STEPS = {
    "gaussian_redrawn": {"cache_directions": False},
    "gaussian_kept": {},
    "rademacher": {"direction": "rademacher"},
    "lowrank": {"direction": "lowrank"},
}


def time_directions(name, quick, repeats, rounds=3):
    """Sweep cost per parameter against the ``add_`` floor, and DPZero steps over two forwards, interleaved."""
    net, dataset, public, batch_size = make_case(name, quick)
    batch = fixed_batch(dataset, batch_size)
    d = sum(p.numel() for p in net.parameters())
    ops = {"add_floor": add_floor_op(net)}
    for label, (kind, threads) in DIRECTION_SWEEPS.items():
        sweep = sweep_op(net, direction=kind, cache_directions=False)
        ops[label] = sweep if threads is None else on_threads(sweep, threads)
    for op in ops.values():
        op()
    times = {label: [] for label in ops}
    for _ in range(repeats):
        for label, op in ops.items():
            times[label].append(timed(op))
    fwd = forward_op(net, batch)
    t_fwd, t_step = [timed(fwd)], {label: [] for label in DIRECTION_STEPS}
    for _ in range(rounds):  # whole fits in turn, forwards between them
        for label, options in DIRECTION_STEPS.items():
            t_step[label] += lightning_step_times("dpzero", net, dataset, public, batch_size, repeats + 2, options)
            t_fwd += [timed(fwd) for _ in range(3)]
    med = statistics.median
    floor = med(times["add_floor"])
    row = {"case": name, "parameters": d, "batch_size": batch_size, "threads": torch.get_num_threads()}
    row["add_floor_ns_per_parameter"] = 1e9 * floor / d
    for label in DIRECTION_SWEEPS:
        row[f"sweep_{label}_ns_per_parameter"] = 1e9 * med(times[label]) / d
        row[f"sweep_{label}_over_add"] = med(times[label]) / floor
    row["forward_ms"] = 1e3 * med(t_fwd)
    for label, t in t_step.items():
        row[f"step_{label}_ms"] = 1e3 * med(t)
        row[f"step_{label}_over_two_forwards"] = med(t) / (2 * med(t_fwd))
    return row


def directions_table(rows):
    lines = [
        "| case | params | add_ floor ns/param | sweep ns/param (÷ floor): Gaussian 1 thread / Gaussian / Rademacher "
        "/ low-rank | 2 fwd ms | DPZero step ÷ 2 fwd: redrawn / kept / Rademacher / low-rank |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        sweeps = " / ".join(
            f"{r[f'sweep_{k}_ns_per_parameter']:.2f} ({r[f'sweep_{k}_over_add']:.1f})" for k in DIRECTION_SWEEPS
        )
        steps = " / ".join(f"{r[f'step_{k}_over_two_forwards']:.2f}" for k in DIRECTION_STEPS)
        lines.append(
            f"| {r['case']} | {r['parameters'] / 1e6:.2f}M | {r['add_floor_ns_per_parameter']:.2f} | {sweeps} "
            f"| {2 * r['forward_ms']:.1f} | {steps} |"
        )
    return "\n".join(lines)
