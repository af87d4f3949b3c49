"""The reproduction benchmark's report: ``RESULTS.md`` (tables, cost, the papers' claims) and two plots, from the JSON.

:func:`summarize` reduces the stored runs to one entry per table cell (the η chosen on validation
accuracy and its test accuracy over the seeds; runs outside the current plan are ignored); the table
functions format them; :func:`claims` checks each paper's claim on these numbers and says plainly when
it does not reproduce; :func:`report` writes the page. Nothing here trains: ``reproduce.py --report``
rebuilds the page from ``results/reproduce.json`` alone.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reproduce_protocol import BY_NAME, DATASETS, EPSILONS, PLOT_EPSILON, choose, protocol_lines

if TYPE_CHECKING:
    from reproduce_runner import Store


def summarize(runs: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """Per cell: the chosen η (by seed-0 validation accuracy) and its runs over the seeds.

    Only runs of the current plan count: runs left in the JSON by an earlier grid, base η or step
    cap are ignored, so they can never widen the documented grid.
    """
    by_cell: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs.values():
        method = BY_NAME.get(r["method"])
        if method is None or r.get("max_steps") != meta.get("max_steps"):
            continue
        if not any(math.isclose(r["lr"], method.lr[r["dataset"]] * m) for m in meta["lr_grid"]):
            continue
        by_cell.setdefault((r["dataset"], r["method"], r["epsilon"]), []).append(r)
    seeds = tuple(meta["seeds"])
    out = {}
    for cell, rs in by_cell.items():
        best = choose([r for r in rs if r["seed"] == 0])
        if best is None:
            out[cell] = {"failed": True, "errors": sorted({r["error"] for r in rs if "error" in r})}
            continue
        chosen = [r for r in rs if r["lr"] == best["lr"] and r["seed"] in seeds and "error" not in r]
        accs = [100 * r["test_acc"] for r in chosen]
        out[cell] = {
            "lr": best["lr"],
            "seeds": len(chosen),
            "mean": statistics.fmean(accs),
            "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "step_ms": statistics.median(r["step_ms"] for r in chosen if r.get("step_ms") is not None),
            "peak_mb": _median_or_none([r.get("peak_mb") for r in chosen]),
            "epsilon_spent": max(r["epsilon_spent"] for r in chosen),
            "steps": chosen[0]["steps"],
        }
    return out


def _median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _cell_text(s: dict[str, Any] | None, seeds: int) -> str:
    if s is None:
        return "—"
    if s.get("failed"):
        return "failed"
    if s["seeds"] < seeds:  # an interrupted run: say how many seeds the number rests on
        return f"{s['mean']:.1f} ({s['seeds']} of {seeds} seeds)"
    return f"{s['mean']:.1f} ± {s['std']:.1f}"


def level_label(eps: float | None) -> str:
    return "non-private" if eps is None else f"ε={eps:g}"


def accuracy_table(summary, dataset: str, methods, epsilons, seeds: int) -> list[str]:
    head = ["Family", "Method", *(level_label(e) for e in epsilons), "non-private"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in methods:
        method = BY_NAME[name]
        if method.private:
            cells_ = [_cell_text(summary.get((dataset, name, e)), seeds) for e in (*epsilons, None)]
        else:  # trained once: spends no ε on the private data (OnlyPub) or is not private at all
            value = _cell_text(summary.get((dataset, name, None)), seeds)
            cells_ = [f"*{value}*" if name == "OnlyPub" else "" for _ in epsilons] + [value]
        lines.append("| " + " | ".join([method.family, name, *cells_]) + " |")
    return lines


def lr_table(summary, dataset: str, methods, epsilons) -> list[str]:
    head = ["Method", "base η", *(level_label(e) for e in epsilons), "non-private"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in methods:
        levels = (*epsilons, None) if BY_NAME[name].private else (None,)
        chosen = {e: summary.get((dataset, name, e), {}).get("lr") for e in levels}
        row = [name, f"{BY_NAME[name].lr[dataset]:g}"]
        row += [f"{chosen[e]:g}" if chosen.get(e) else "" for e in (*epsilons, None)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def cost_table(summary, datasets, methods) -> list[str]:
    head = ["Method"]
    for d in datasets:
        head += [f"{d}: ms/step", f"{d}: peak MB", f"{d}: steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in methods:
        row = [name]
        for d in datasets:
            rows = [s for (ds, m, _), s in summary.items() if ds == d and m == name and not s.get("failed")]
            ms = _median_or_none([s["step_ms"] for s in rows])
            mb = _median_or_none([s["peak_mb"] for s in rows])
            steps = _median_or_none([s["steps"] for s in rows])
            row += [
                "" if ms is None else f"{ms:.2f}",
                "" if mb is None else f"{mb:.1f}",
                "" if steps is None else f"{steps:.0f}",
            ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


# ---- the papers' claims, checked on our numbers --------------------------------------------------
PAZO = ("PAZO-M", "PAZO-P (orthonormal)", "PAZO-P (normalized)", "PAZO-S")


def _acc(summary, dataset, method, eps):
    s = summary.get((dataset, method, eps))
    return None if s is None or s.get("failed") else s


def _compare(summary, datasets, winner, loser, epsilons, ties_win=False):
    """(cells where winner's mean > loser's (≥ with ``ties_win``), cells compared, cells where the
    gap exceeds one pooled std — counted only where both sides have at least two seeds)."""
    wins = compared = clear = 0
    for d in datasets:
        for e in epsilons:
            a, b = _acc(summary, d, winner, e), _acc(summary, d, loser, e)
            if a is None or b is None:
                continue
            compared += 1
            gap = round(a["mean"] - b["mean"], 6)
            wins += gap >= 0 if ties_win else gap > 0
            clear += min(a["seeds"], b["seeds"]) > 1 and abs(gap) > math.hypot(a["std"], b["std"])
    return wins, compared, clear


def _verdict(wins: int, compared: int) -> str:
    if compared == 0:
        return "not run"
    if wins == compared:
        return "**reproduces**"
    return "**does not reproduce**" if wins == 0 else f"**partly** ({wins}/{compared} cells)"


def claims(summary, datasets, epsilons) -> list[str]:
    rows = []

    def pairwise(claim, source, pairs, eps_set, ties_win=False):
        wins = compared = clear = 0
        evidence = []
        for winner, loser in pairs:
            w, c, cl = _compare(summary, datasets, winner, loser, eps_set, ties_win)
            wins, compared, clear = wins + w, compared + c, clear + cl
            if c:
                evidence.append(f"{winner} {'≥' if ties_win else '>'} {loser} in {w}/{c} cells")
        rows.append((claim, source, _verdict(wins, compared), "; ".join(evidence), clear, compared))

    def cellwise(claim, source, outcomes, evidence):
        """A claim judged on one outcome per compared cell (dataset, ε or variant); no seed-noise count."""
        rows.append((claim, source, _verdict(sum(outcomes), len(outcomes)), evidence, None, None))

    pairwise(
        "Every PAZO variant beats DPZero at every ε",
        "PAZO Tables 2–5",
        [(p, "DPZero") for p in PAZO],
        epsilons,
    )
    small = [e for e in epsilons if e <= 0.5]
    best_pazo_vs_fo = []
    for d in datasets:
        for e in small:
            pazo = [s for p in PAZO if (s := _acc(summary, d, p, e))]
            fo = [s for m in ("DPMD", "Coupling") if (s := _acc(summary, d, m, e))]
            if pazo and fo:
                best_pazo_vs_fo.append(max(s["mean"] for s in pazo) > max(s["mean"] for s in fo))
    cellwise(
        "At small ε (≤ 0.5) the best PAZO variant beats the best first-order method with public data (DPMD, Coupling)",
        "PAZO §5.2, Tables 2–5",
        best_pazo_vs_fo,
        f"best PAZO > best FO+PUB in {sum(best_pazo_vs_fo)}/{len(best_pazo_vs_fo)} (dataset, ε) cells",
    )
    drops = []
    lo, hi = EPSILONS[0], EPSILONS[-1]
    for d in datasets:
        fo = [(_acc(summary, d, "DP-SGD", hi), _acc(summary, d, "DP-SGD", lo))]
        pz = [(_acc(summary, d, p, hi), _acc(summary, d, p, lo)) for p in PAZO]
        fo_drop = [a["mean"] - b["mean"] for a, b in fo if a and b]
        pz_drop = [a["mean"] - b["mean"] for a, b in pz if a and b]
        if fo_drop and pz_drop:
            drops.append((d, fo_drop[0], statistics.fmean(pz_drop)))
    cellwise(
        f"First-order DP-SGD loses more accuracy than PAZO as ε shrinks from {hi:g} to {lo:g}",
        "PAZO §5.2",
        [f > p for _, f, p in drops],
        "; ".join(f"{d}: DP-SGD −{f:.1f} vs PAZO (mean of variants) −{p:.1f} points" for d, f, p in drops),
    )
    over_public = []
    for d in datasets:
        pub = _acc(summary, d, "OnlyPub", None)
        for e in epsilons:
            pazo = [s["mean"] for p in PAZO if (s := _acc(summary, d, p, e))]
            if pub and pazo:
                over_public.append((d, e, max(pazo) - pub["mean"]))
    cellwise(
        "The best PAZO variant improves on public-only training (OnlyPub) at every ε (by 4–9 points there)",
        "PAZO Table 6",
        [g > 0 for *_, g in over_public],
        "; ".join(f"{d} {level_label(e)}: {g:+.1f}" for d, e, g in over_public),
    )
    pairwise(
        "DP-ZOSO and DP-ZOPO beat DPZero",
        "DP-ZOPO Table II",
        [("DP-ZOSO", "DPZero"), ("DP-ZOPO", "DPZero")],
        epsilons,
    )
    pairwise(
        "Coupling beats FullPriv and DPMD at ε = 2",
        "Coupling Table 3",
        [("Coupling", "FullPriv"), ("Coupling", "DPMD")],
        [e for e in epsilons if e == 2.0] or epsilons[-1:],
    )
    only_pub = []
    for d in datasets:
        pub = _acc(summary, d, "OnlyPub", None)
        coupled = [(e, s) for e in epsilons if (s := _acc(summary, d, "Coupling", e))]
        if pub:
            only_pub += [(d, e, s["mean"], pub["mean"]) for e, s in coupled]
    at2 = [x for x in only_pub if x[1] == 2.0] or only_pub
    cellwise(
        "Coupling beats OnlyPub (ε = 2)",
        "Coupling Table 3",
        [c > p for _, _, c, p in at2],
        "; ".join(f"{d} {level_label(e)}: {c:.1f} vs {p:.1f}" for d, e, c, p in at2),
    )
    pairwise(
        "DP-PSAC ≥ Auto-S ≥ DP-SGD (constant clipping)",
        "DP-PSAC Table 2",
        [("DP-PSAC", "DP-SGD Auto-S"), ("DP-SGD Auto-S", "DP-SGD")],
        epsilons,
        ties_win=True,
    )
    speed = []
    for d in datasets:
        fo = [s["step_ms"] for e in epsilons if (s := _acc(summary, d, "DP-SGD", e))]
        for p in PAZO:
            zo = [s["step_ms"] for e in epsilons if (s := _acc(summary, d, p, e))]
            if fo and zo:
                speed.append((d, p, statistics.median(fo) / statistics.median(zo)))
    cellwise(
        "A PAZO step is faster than a DP-SGD step (2–16× on GPU)",
        "PAZO Table 8",
        [r > 1 for *_, r in speed],
        "; ".join(f"{d} {p}: {r:.2f}×" for d, p, r in speed),
    )
    lines = ["| Claim | Source | On our data | Evidence (test accuracy %, mean over seeds) | Gap > 1 pooled std |"]
    lines.append("|---|---|---|---|---|")
    for claim, source, verdict, evidence, clear, compared in rows:
        sig = "" if clear is None else f"{clear}/{compared}"
        lines.append(f"| {claim} | {source} | {verdict} | {evidence} | {sig} |")
    return lines


# ---- plots ---------------------------------------------------------------------------------------
STYLE = {"ZO": "o--", "ZO+PUB": "s-", "FO": "^:", "FO+PUB": "D-.", "PUB": "", "none": ""}


def _color(name: str):
    import matplotlib

    return matplotlib.colormaps["tab20"](list(BY_NAME).index(name) % 20)


def plot_accuracy_vs_epsilon(summary, datasets, methods, epsilons, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datasets), figsize=(7 * len(datasets), 5.8), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for name in methods:
            method = BY_NAME[name]
            if not method.private:
                s = _acc(summary, d, name, None)
                if s:
                    ax.axhline(s["mean"], ls=":" if name == "OnlyPub" else "--", color="gray", lw=1)
                    ax.annotate(name, (epsilons[0], s["mean"]), fontsize=7, color="gray", va="bottom")
                continue
            pts = [(e, s) for e in epsilons if (s := _acc(summary, d, name, e))]
            if pts:
                ax.errorbar(
                    [e for e, _ in pts],
                    [s["mean"] for _, s in pts],
                    yerr=[s["std"] for _, s in pts],
                    fmt=STYLE[method.family],
                    capsize=2,
                    label=name,
                    ms=4,
                    color=_color(name),
                )
        ax.set_xscale("log")
        ax.set_xticks(list(epsilons), [f"{e:g}" for e in epsilons])
        ax.set_xlabel("ε (δ = 1/n)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(DATASETS[d].title)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy_vs_time(summary, datasets, methods, eps: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(datasets), figsize=(7 * len(datasets), 5), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for name in methods:
            s = _acc(summary, d, name, eps if BY_NAME[name].private else None)
            if s and s.get("step_ms"):
                marker = STYLE[BY_NAME[name].family][:1] or "x"
                ax.errorbar(s["step_ms"], s["mean"], yerr=s["std"], fmt=marker, capsize=2, color=_color(name))
                ax.annotate(name, (s["step_ms"], s["mean"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("median wall time per training step (ms, 1 CPU thread)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{DATASETS[d].title}, ε = {eps:g}")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(store: Store, out: Path, results_md: Path) -> str:
    meta = store.data["meta"]
    datasets, methods, epsilons = meta["datasets"], meta["methods"], tuple(meta["epsilons"])
    summary = summarize(store.runs, meta)
    plots = {
        "eps": out / "accuracy_vs_epsilon.png",
        "time": out / "accuracy_vs_step_time.png",
    }
    plot_accuracy_vs_epsilon(summary, datasets, methods, epsilons, plots["eps"])
    plot_eps = PLOT_EPSILON if PLOT_EPSILON in epsilons else epsilons[-1]
    plot_accuracy_vs_time(summary, datasets, methods, plot_eps, plots["time"])
    rel = {k: os.path.relpath(p, results_md.parent) for k, p in plots.items()}
    errors = [r for r in store.runs.values() if "error" in r]
    spent = [r["epsilon_spent"] / r["epsilon"] for r in store.runs.values() if r["epsilon"] and "error" not in r]
    lines = [
        "# Reproduction: privacy–utility of every pl_dp method",
        "",
        f"Generated by `{meta['command']}` on {meta['machine']} ({meta['date']}); "
        f"{len(store.runs)} runs, {len(errors)} of them failed, "
        f"{sum(r['fit_s'] for r in store.runs.values()) / 60:.0f} worker-minutes.",
        "Regenerate: `python benchmarks/reproduce.py` (resumes from `benchmarks/results/reproduce.json`; "
        "delete it to start over), or `--report` to rebuild this page from the JSON.",
        "",
        f"Every private run stayed within its target: ε spent / target ≤ {max(spent, default=0):.4f} over "
        f"{len(spent)} private runs (the accountant's exact ε after the last step).",
        "",
        "## Protocol",
        "",
        *protocol_lines(meta),
        "",
    ]
    for d in datasets:
        lines += [
            f"## {DATASETS[d].title}",
            "",
            "Test accuracy (%), mean ± sample std over seeds "
            + ", ".join(map(str, meta["seeds"]))
            + ", of the step size chosen on the validation split. *Italics*: OnlyPub reads no private "
            "example and spends no ε, so the same runs fill every column.",
            "",
            *accuracy_table(summary, d, methods, epsilons, len(meta["seeds"])),
            "",
            "Chosen step size η per cell (grid: base η × " + ", ".join(f"{m:g}" for m in meta["lr_grid"]) + "):",
            "",
            *lr_table(summary, d, methods, epsilons),
            "",
        ]
    lines += [
        f"![accuracy vs epsilon]({rel['eps']})",
        "",
        "## Cost per step",
        "",
        "Median over the reported runs of each method's median step time (Lightning training batch, "
        "warm-up excluded) and peak RSS growth during training (Linux `VmHWM`, reset after two warm-up "
        f"steps), with {meta['jobs']} worker process(es) of one torch thread each running side by side.",
        "",
        *cost_table(summary, datasets, methods),
        "",
        f"![accuracy vs step time]({rel['time']})",
        "",
        "## The papers' claims on our data",
        "",
        "A claim *reproduces* when it holds for the mean test accuracy in every compared (dataset, ε) cell;"
        " the last column counts the cells where the gap is larger than one pooled seed std"
        " (√(s₁² + s₂²)) — the rest are within seed noise.",
        "",
        *claims(summary, datasets, epsilons),
        "",
    ]
    if errors:
        lines += ["## Failed runs", ""]
        lines += [f"* `{r['key']}`: {r['error']}" for r in sorted(errors, key=lambda r: r["key"])]
        lines.append("")
    text = "\n".join(lines)
    results_md.write_text(text)
    return text
