"""``--suite queries``: q two-sided queries against the one-sided estimator — step time and estimator error."""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from pl_dp.zo import PerturbationEngine
from step_suites.common import dpzero_engine_op, fixed_batch, forward_op, make_case, timed

#: (queries, one_sided): 8 forwards two-sided, 5 one-sided at the same q, 8 one-sided
QUERY_SETTINGS = {"two_sided_q4": (4, False), "one_sided_q4": (4, True), "one_sided_q7": (7, True)}


def estimate_error(net, batch, queries, one_sided, draws, smoothing=1e-3):
    """Mean of ‖ĝ − ∇f‖² / ‖∇f‖² over ``draws`` non-private estimates ĝ = Σ_j Δ_j u_j / q of the batch gradient."""
    params = list(net.parameters())
    with torch.enable_grad():
        gradient = torch.autograd.grad(F.cross_entropy(net(batch[0]), batch[1]), params)
    norm = sum(float(g.square().sum()) for g in gradient)
    engine = PerturbationEngine(params, seed=2, cache_size=queries)
    losses = forward_op(net, batch)

    def evaluate():
        return losses().mean()

    errors = []
    for draw in range(draws):
        baseline = evaluate() if one_sided else None
        coefficients = []
        for j in range(queries):
            key = (draw, j)
            if one_sided:
                engine.perturb(key, smoothing)
                delta = (evaluate() - baseline) / smoothing
                engine.perturb(key, -smoothing)
            else:
                delta = engine.two_point(key, smoothing, evaluate)
                engine.perturb(key, smoothing)
            coefficients.append((key, float(delta) / queries * engine.scale(key)))
        error = 0.0
        for i, g in enumerate(gradient):
            estimate = torch.zeros_like(g)
            for key, c in coefficients:
                engine.accumulate(estimate, key, i, c)
            error += float((estimate - g).square().sum())
        errors.append(error / norm)
    return statistics.mean(errors)


def time_queries(name, quick, repeats):
    """Two-sided against one-sided queries: engine step time and estimator error, same batch."""
    net, dataset, _, batch_size = make_case(name, quick)
    batch = fixed_batch(dataset, batch_size)
    ops = {k: dpzero_engine_op(net, batch, queries=queries, one_sided=o) for k, (queries, o) in QUERY_SETTINGS.items()}
    fwd = forward_op(net, batch)
    for op in (fwd, *ops.values()):
        op()
    times = {k: [] for k in ["forward", *ops]}
    for _ in range(repeats):
        times["forward"].append(timed(fwd))
        for k, op in ops.items():
            times[k].append(timed(op))
    med = statistics.median
    row = {"case": name, "batch_size": batch_size, "forward_ms": 1e3 * med(times["forward"])}
    draws = 3 if quick else 10
    for k, (queries, one_sided) in QUERY_SETTINGS.items():
        row[f"{k}_forwards"] = queries + 1 if one_sided else 2 * queries
        row[f"{k}_ms"] = 1e3 * med(times[k])
        row[f"{k}_over_two_sided_q4"] = med(times[k]) / med(times["two_sided_q4"])
        row[f"{k}_relative_error"] = estimate_error(net, batch, queries, one_sided, draws)
    return row


def queries_table(rows):
    lines = [
        "| case | B | fwd ms | setting | forwards | step ms | ÷ two-sided q = 4 | E‖ĝ − ∇f‖² / ‖∇f‖² |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for k in QUERY_SETTINGS:
            lines.append(
                f"| {r['case']} | {r['batch_size']} | {r['forward_ms']:.1f} | {k} | {r[f'{k}_forwards']} "
                f"| {r[f'{k}_ms']:.1f} | {r[f'{k}_over_two_sided_q4']:.2f} | {r[f'{k}_relative_error']:.4g} |"
            )
    return "\n".join(lines)
