"""``--suite first_order``: DP-SGD variants and Coupling in the Lightning loop against an Opacus DP-SGD step."""

from __future__ import annotations

import copy
import statistics

import torch.nn.functional as F

from step_suites.common import (
    FIRST_ORDER,
    PUBLIC_BATCH,
    fixed_batch,
    lightning_step_times,
    make_case,
    opacus_op,
    timed,
)


def public_fwd_bwd_op(net, public):
    """One forward+backward of the mean loss on a public batch: what Coupling adds to DP-SGD."""
    model = copy.deepcopy(net)
    x, y = fixed_batch(public, PUBLIC_BATCH)

    def op():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    return op


def time_first_order(name, quick, repeats):
    """DP-SGD variants and Coupling in the Lightning loop vs an Opacus DP-SGD step on the same batch.

    Every first-order step is seconds on the wide MLP, so each loop runs ``repeats`` steps once; the
    Opacus and public forward/backward references are timed before and after the loops.
    """
    net, dataset, public, batch_size = make_case(name, quick)
    batch = fixed_batch(dataset, batch_size)
    opacus, pub = opacus_op(net, batch), public_fwd_bwd_op(net, public)
    opacus()
    pub()
    t_opacus = [timed(opacus) for _ in range(max(2, repeats // 3))]
    t_pub = [timed(pub) for _ in range(repeats)]
    steps = max(3, repeats // 2)
    loops = {m: lightning_step_times(m, net, dataset, public, batch_size, steps=steps + 2) for m in FIRST_ORDER}
    t_opacus += [timed(opacus) for _ in range(max(2, repeats // 3))]
    med = statistics.median
    row = {
        "case": name,
        "batch_size": batch_size,
        "opacus_dpsgd_ms": 1e3 * med(t_opacus),
        "public_fwd_bwd_ms": 1e3 * med(t_pub),
    }
    row.update({f"{m}_ms": 1e3 * med(t) for m, t in loops.items()})
    row["dpsgd_constant_over_opacus"] = med(loops["dpsgd_constant"]) / med(t_opacus)
    row["dpsgd_automatic_over_constant"] = med(loops["dpsgd_automatic"]) / med(loops["dpsgd_constant"])
    row["dpsgd_psac_over_constant"] = med(loops["dpsgd_psac"]) / med(loops["dpsgd_constant"])
    row["coupling_over_dpsgd_plus_public"] = med(loops["coupling"]) / (med(loops["dpsgd_automatic"]) + med(t_pub))
    return row


def first_order_table(rows):
    lines = [
        "| case | B | Opacus DP-SGD ms | public fwd+bwd ms | DPSGD constant / automatic / PSAC ms | Coupling ms "
        "| constant ÷ Opacus | automatic ÷ constant | PSAC ÷ constant | Coupling ÷ (DPSGD + public) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['batch_size']} | {r['opacus_dpsgd_ms']:.1f} | {r['public_fwd_bwd_ms']:.1f} "
            f"| {r['dpsgd_constant_ms']:.1f} / {r['dpsgd_automatic_ms']:.1f} / {r['dpsgd_psac_ms']:.1f} "
            f"| {r['coupling_ms']:.1f} | {r['dpsgd_constant_over_opacus']:.2f} "
            f"| {r['dpsgd_automatic_over_constant']:.2f} | {r['dpsgd_psac_over_constant']:.2f} "
            f"| {r['coupling_over_dpsgd_plus_public']:.2f} |"
        )
    return "\n".join(lines)
