"""``--suite zo``: the DPZero step (engine, Lightning loop) over two forwards, over MeZO's step in plain torch and over
Opacus, the PAZO methods' steps, and peak memory in fresh processes; ``--suite logging``: a DPZero step when every
step logs."""

from __future__ import annotations

import statistics
import subprocess
import sys

import torch
from _measure import PeakMemory, StepTimer, reset_peak_rss, status_kb

from pl_dp.data import digits_splits
from pl_dp.nets import MLP
from pl_dp.zo import PerturbationEngine
from step_suites.common import (
    ENTRY,
    METHODS,
    dpzero_engine_op,
    fit_method,
    fixed_batch,
    forward_op,
    lightning_step_times,
    make_case,
    mezo_floor_op,
    opacus_op,
    timed,
)


def time_case(name, quick, repeats):
    net, dataset, public, batch_size = make_case(name, quick)
    batch = fixed_batch(dataset, batch_size)
    fwd, zo, opacus = forward_op(net, batch), dpzero_engine_op(net, batch), opacus_op(net, batch)
    mezo = mezo_floor_op(net, batch)
    for op in (fwd, zo, mezo, opacus):  # warm-up
        op()
    t_fwd, t_zo, t_mezo, t_opacus = [], [], [], []
    for _ in range(repeats):  # interleaved to cancel drift
        t_fwd.append(timed(fwd))
        t_zo.append(timed(zo))
        t_mezo.append(timed(mezo))
        t_opacus.append(timed(opacus))
    t_loop = {m: lightning_step_times(m, net, dataset, public, batch_size, steps=repeats + 2) for m in METHODS}
    t_light = t_loop["dpzero"]
    t_fwd += [timed(fwd) for _ in range(repeats)]
    med = statistics.median
    methods = {f"{m}_lightning_ms": 1e3 * med(t) for m, t in t_loop.items()}
    methods.update({f"{m}_over_dpzero": med(t) / med(t_light) for m, t in t_loop.items() if m != "dpzero"})
    methods.update({f"{m}_over_opacus": med(t) / med(t_opacus) for m, t in t_loop.items() if m != "dpzero"})
    return methods | {
        "case": name,
        "parameters": sum(p.numel() for p in net.parameters()),
        "batch_size": batch_size,
        "forward_ms": 1e3 * med(t_fwd),
        "dpzero_engine_ms": 1e3 * med(t_zo),
        "dpzero_lightning_ms": 1e3 * med(t_light),
        "mezo_floor_ms": 1e3 * med(t_mezo),
        "opacus_dpsgd_ms": 1e3 * med(t_opacus),
        "engine_over_two_forwards": med(t_zo) / (2 * med(t_fwd)),
        "lightning_over_two_forwards": med(t_light) / (2 * med(t_fwd)),
        "mezo_floor_over_two_forwards": med(t_mezo) / (2 * med(t_fwd)),
        "engine_over_mezo_floor": med(t_zo) / med(t_mezo),
        "dpzero_over_opacus": med(t_zo) / med(t_opacus),
    }


def memory_probe(name, mode, quick):
    """Run in a fresh process: peak RSS growth (MB) of ``mode`` over the memory live after setup.

    Linux-specific: free memory is returned to the OS (``malloc_trim``), then the peak-RSS mark is
    reset (``/proc/self/clear_refs``), so neither import-time transients nor allocator caches hide
    what the step itself allocates.
    """
    torch.set_num_threads(2)
    net, dataset, public, batch_size = make_case(name, quick)
    if mode in METHODS:  # the zeroth-order methods, inside Trainer.fit
        probe = PeakMemory()
        fit_method(mode, net, dataset, public, batch_size, steps=5, callback=probe)
        return probe.peak_mb
    batch = fixed_batch(dataset, batch_size)
    op = {"inference": forward_op, "dpzero": dpzero_engine_op, "opacus": opacus_op}[mode](net, batch)
    op()  # warm-up: lazily created buffers count as the step's memory below only if re-created
    base = reset_peak_rss()
    for _ in range(3):
        op()
    return (status_kb("VmHWM") - base) / 1024


def memory_case(name, quick, probes=3):
    """Median over ``probes`` fresh processes per mode (single probes vary by ±6 MB here)."""
    out = {}
    for mode in ("inference", "dpzero", "opacus", *[m for m in METHODS if m != "dpzero"]):
        args = [sys.executable, ENTRY, "--memory-probe", name, mode] + (["--quick"] if quick else [])
        runs = [subprocess.run(args, capture_output=True, text=True, check=True) for _ in range(probes)]
        out[f"{mode}_peak_mb"] = statistics.median(float(r.stdout.strip().splitlines()[-1]) for r in runs)
    net, *_ = make_case(name, quick)
    largest = max(p.numel() * p.element_size() for p in net.parameters()) / 2**20
    total = sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20
    out["zo_memory_budget_mb"] = out["inference_peak_mb"] + largest + 0.05 * total
    # kept directions (the default below 256 MiB) are allocated at the first step and kept: not in the peaks above
    out["kept_directions_mb"] = PerturbationEngine(net.parameters(), seed=0).cache_size * total
    # PAZO: inference + (k+1) parameter copies for PAZO-P (k = 3), + 2 copies for PAZO-M and PAZO-S
    out["pazo_p_memory_budget_mb"] = out["inference_peak_mb"] + 4 * total
    out["pazo_m_memory_budget_mb"] = out["pazo_s_memory_budget_mb"] = out["inference_peak_mb"] + 2 * total
    extra_opacus = max(out["opacus_peak_mb"] - out["inference_peak_mb"], 1e-9)
    out["dpzero_extra_over_opacus_extra"] = max(out["dpzero_peak_mb"] - out["inference_peak_mb"], 0) / extra_opacus
    return out


def table(rows):
    lines = [
        "| case | params | B | fwd ms | MeZO torch ms | DPZero engine ms | DPZero in Lightning ms | Opacus DP-SGD ms "
        "| MeZO/2fwd | engine/2fwd | Lightning/2fwd | engine/MeZO | DPZero/Opacus "
        "| peak MB inf / DPZero / Opacus (ZO budget) | kept MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['parameters'] / 1e6:.2f}M | {r['batch_size']} | {r['forward_ms']:.1f} "
            f"| {r['mezo_floor_ms']:.1f} | {r['dpzero_engine_ms']:.1f} | {r['dpzero_lightning_ms']:.1f} "
            f"| {r['opacus_dpsgd_ms']:.1f} | {r['mezo_floor_over_two_forwards']:.2f} "
            f"| {r['engine_over_two_forwards']:.2f} | {r['lightning_over_two_forwards']:.2f} "
            f"| {r['engine_over_mezo_floor']:.2f} | {r['dpzero_over_opacus']:.2f} "
            f"| {r['inference_peak_mb']:.1f} / {r['dpzero_peak_mb']:.1f} / "
            f"{r['opacus_peak_mb']:.1f} ({r['zo_memory_budget_mb']:.1f}) | {r['kept_directions_mb']:.1f} |"
        )
    lines += [
        "",
        "| case | method | step ms (Lightning loop) | ÷ DPZero | ÷ Opacus DP-SGD | peak MB (budget) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for m in METHODS:
            budget = r[f"{'zo' if m == 'dpzero' else m}_memory_budget_mb"]
            ratio = 1.0 if m == "dpzero" else r[f"{m}_over_dpzero"]
            versus = r["dpzero_lightning_ms"] / r["opacus_dpsgd_ms"] if m == "dpzero" else r[f"{m}_over_opacus"]
            lines.append(
                f"| {r['case']} | {m} | {r[f'{m}_lightning_ms']:.1f} | {ratio:.2f} | {versus:.2f} "
                f"| {r[f'{m}_peak_mb']:.1f} ({budget:.1f}) |"
            )
    return "\n".join(lines)


def time_logging(repeats, steps=120):
    """DPZero on the digits configs' MLP 64-64-10 at B = 64 inside ``Trainer.fit``: median step time
    when every step logs (``log_every_n_steps=1``, what every step cost before per-step metrics
    followed the loggers' cadence) and on Lightning's default cadence (50), interleaved fits."""
    private, public, *_ = digits_splits()
    torch.manual_seed(0)
    net = MLP(64, (64,), 10)
    times = {1: [], 50: []}
    for _ in range(repeats):
        for every in times:
            timer = StepTimer()
            fit_method("dpzero", net, private, public, 64, steps, timer, log_every_n_steps=every)
            times[every].append(statistics.median(timer.times[2:]))
    every_step, cadence = (1000 * statistics.median(times[k]) for k in (1, 50))
    return {
        "case": "digits MLP 64-64-10",
        "log_every_step_ms": every_step,
        "log_every_50_ms": cadence,
        "every_step_over_cadence": every_step / cadence,
    }
