"""Per-step time and peak memory of pl_dp's zeroth-order step, against two forwards and Opacus.

    python benchmarks/step_cost.py            # full run (~2-3 minutes on 2 CPU cores)
    python benchmarks/step_cost.py --quick    # tiny models, smoke test

For each case (digits MLP 64-2048-2048-10 at batch 256; a 3.7M-parameter transformer at batch
64; opt-in ``--cases minilm``: the packaged pretrained MiniLM, 22.7M, at batch 32), measured side
by side in one process with interleaved repeats and medians:

* ``engine / 2 fwd``   — one DPZero step (q=1, clip + noise) on the bare engine, over two
  inference forwards of the same batch;
* ``lightning / 2 fwd`` — one DPZero ``training_step`` inside ``Trainer.fit`` (Poisson batches of
  the same expected size), over two forwards;
* ``dpzero / opacus``   — engine step over an Opacus DP-SGD step (GradSampleModule + DPOptimizer)
  on the same model and batch;

``--suite fine_tune`` (what ``--cases minilm`` runs by default) fine-tunes every parameter with DPZero,
PAZO-M, DP-SGD on per-example gradients (Opacus hooks), DP-SGD with ghost clipping and non-private SGD,
side by side: each method in its own fresh process (``--rounds`` round-robin), the same Poisson batches for
all (fixed sampling seed), the median step time of the steps after two warm-up steps, and resident memory
(RSS) over what was resident before ``Trainer.fit``: kept between steps, a step's transient peak, and the
fit's peak. The machine's load average is recorded at the start and end. For MiniLM:

    python benchmarks/step_cost.py --cases minilm --json benchmarks/results/step_cost_minilm.json

``--suite logging`` times a DPZero step on the small digits MLP when every step logs its metrics
(``log_every_n_steps=1``) over logging on Lightning's default cadence, interleaved fits.

``--suite directions`` prices the random directions: one perturbation sweep (draw + add) per parameter, in
ns, for each direction kind on all threads and for Gaussians on one thread (torch's generator without
pl_dp's chunked parallel draw), against one ``add_`` over the same parameters (the floor: a sweep
cannot cost less than reading and writing them once); and the DPZero step in the Lightning loop over
two forwards with the directions redrawn three times a query (``cache_directions=False``), kept
(the default below 256 MiB), Rademacher and low-rank.

``--suite queries`` compares q = 4 two-sided queries (8 forwards) with the one-sided estimator at
q = 4 (5 forwards) and q = 7 (8 forwards): step time on the bare engine and the mean squared error
of the non-private estimate Σ_j Δ_j u_j / q against the batch gradient, relative to ‖∇f‖², over
repeated draws.

``--suite pruning`` times DP-ZOPO's masked step (a :class:`DirectionMask` training 1 %, 10 % or
100 % of the coordinates) and the perturbation sweep alone, over the unmasked step, interleaved.

And, each in a fresh subprocess, the peak RSS growth of inference, a DPZero step and an Opacus
step over the memory live after setup (parameters, batch, persistent buffers), to check ZO
memory ≤ inference + largest tensor + 5 % of parameters, and DPZero's extra memory over
inference ≤ 0.15 × Opacus'. Prints a table and JSON (``--json PATH`` to save).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _measure import FitMemory, PeakMemory, StepTimer, quiet_trainer, reset_peak_rss, status_kb  # noqa: E402

from pl_dp import PrivacySpec  # noqa: E402
from pl_dp.data import PrivatePublicDataModule, digits_splits  # noqa: E402
from pl_dp.methods import DPSGD, PAZOM, PAZOP, PAZOS, Coupling, DPZero  # noqa: E402
from pl_dp.nets import MLP, TinyTransformerClassifier  # noqa: E402
from pl_dp.privacy import NoiseSource, SubsampledGaussian  # noqa: E402
from pl_dp.privacy.losses import cross_entropy  # noqa: E402
from pl_dp.zo import PerturbationEngine, PrivateTwoPointEstimator, per_sample_evaluator  # noqa: E402
from pl_dp.zo.pruning import importance_matrix  # noqa: E402

warnings.filterwarnings("ignore")


# ---- cases -----------------------------------------------------------------------------------
def make_case(name: str, quick: bool):
    """(net, private set, public set, batch_size); the sets hold a few batches worth of examples."""
    torch.manual_seed(0)
    if name == "digits-mlp":
        hidden = (128, 128) if quick else (2048, 2048)
        private, public, *_ = digits_splits()
        return MLP(64, hidden, 10), private, public, 64 if quick else 256
    if name == "transformer":
        width, depth = (64, 1) if quick else (256, 4)
        net = TinyTransformerClassifier(width=width, depth=depth)
        n, batch = (128, 16) if quick else (640, 64)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 2000, (n + 64, 64), generator=g)
        labels = torch.randint(0, 2, (n + 64,), generator=g)
        return net, TensorDataset(tokens[:n], labels[:n]), TensorDataset(tokens[n:], labels[n:]), batch
    if name == "minilm":  # the packaged pretrained all-MiniLM-L6-v2 (22.7M), 32 tokens per example
        from pl_dp.nets import MiniLMClassifier

        net = MiniLMClassifier(num_labels=2)
        n, batch = (64, 8) if quick else (256, 32)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(1000, 30000, (n + 64, 32), generator=g)
        labels = torch.randint(0, 2, (n + 64,), generator=g)
        return net, TensorDataset(tokens[:n], labels[:n]), TensorDataset(tokens[n:], labels[n:]), batch
    raise ValueError(name)


PUBLIC_BATCH = 16
METHODS = {
    "dpzero": lambda net, **options: DPZero(
        net, lr=1e-4, clip=1.0, smoothing=1e-3, privacy=PrivacySpec(8.0, accountant="rdp"), **options
    ),
    "pazo_m": lambda net: PAZOM(net, lr=1e-4, clip=1.0, smoothing=1e-3, privacy=PrivacySpec(8.0, accountant="rdp")),
    "pazo_p": lambda net: PAZOP(net, lr=1e-4, clip=1.0, k=3, privacy=PrivacySpec(8.0, accountant="rdp")),
    "pazo_s": lambda net: PAZOS(net, lr=1e-4, clip=1.0, k=3, privacy=PrivacySpec(8.0, accountant="rdp")),
}
FIRST_ORDER = {
    "dpsgd_constant": lambda net: DPSGD(
        net, lr=1e-4, clip=1.0, clip_fn="constant", privacy=PrivacySpec(8.0, accountant="rdp")
    ),
    "dpsgd_automatic": lambda net: DPSGD(
        net, lr=1e-4, clip=1.0, clip_fn="automatic", privacy=PrivacySpec(8.0, accountant="rdp")
    ),
    "dpsgd_psac": lambda net: DPSGD(net, lr=1e-4, clip=1.0, clip_fn="psac", privacy=PrivacySpec(8.0, accountant="rdp")),
    "coupling": lambda net: Coupling(net, lr=1e-4, alpha=0.5, privacy=PrivacySpec(8.0, accountant="rdp")),
}


#: full fine-tuning side by side (``--suite fine_tune``; what ``--cases minilm`` measures): every parameter trainable
FINE_TUNE = {
    "dpzero": ("DPZero (q = 1)", METHODS["dpzero"]),
    "pazo_m": ("PAZO-M", METHODS["pazo_m"]),
    "dpsgd_hooks": (
        "DP-SGD, per-example gradients (Opacus hooks)",
        lambda net: DPSGD(net, lr=1e-4, clip=1.0, per_sample="hooks", privacy=PrivacySpec(8.0, accountant="rdp")),
    ),
    "dpsgd_ghost": (
        "DP-SGD, ghost clipping",
        lambda net: DPSGD(net, lr=1e-4, clip=1.0, per_sample="ghost", privacy=PrivacySpec(8.0, accountant="rdp")),
    ),
    "sgd": ("non-private SGD (same loop, clip=None)", lambda net: DPSGD(net, lr=1e-4, clip=None)),
}


def fixed_batch(dataset, size):
    return tuple(t[:size] for t in dataset.tensors)


# ---- one-op closures ----------------------------------------------------------------------------
def forward_op(net, batch):
    evaluate = per_sample_evaluator(net, cross_entropy, batch, len(batch[1]))
    return evaluate


def dpzero_engine_op(net, batch, mask=None, queries=1, one_sided=False, **engine_options):
    engine = PerturbationEngine(net.parameters(), seed=1, mask=mask, cache_size=queries, **engine_options)
    estimator = PrivateTwoPointEstimator(engine, smoothing=1e-3, queries=queries, one_sided=one_sided)
    mechanism = SubsampledGaussian(1.0, 0.1, 1.0, expected_batch_size=len(batch[1]))
    noise = NoiseSource(seed=0)
    evaluate = forward_op(net, batch)
    step = [0]

    def op():
        est = estimator.estimate(step[0], evaluate, mechanism, noise)
        estimator.apply(est, 1e-4)
        step[0] += 1

    return op


def opacus_op(net, batch):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = GradSampleModule(copy.deepcopy(net))
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=len(batch[1]),
    )
    x, y = batch

    def op():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return op


def timed(op):
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def fit_method(method, net, private, public, batch_size, steps, callback, options=None, **trainer_kwargs):
    """``steps`` steps of ``method`` (built with ``options``) inside ``Trainer.fit`` with ``callback`` attached."""
    trainer = quiet_trainer(max_steps=steps, callbacks=[callback], **trainer_kwargs)
    data = PrivatePublicDataModule(private, public=public, batch_size=batch_size, public_batch_size=PUBLIC_BATCH)
    trainer.fit({**METHODS, **FIRST_ORDER}[method](copy.deepcopy(net), **(options or {})), data)


def lightning_step_times(method, net, private, public, batch_size, steps, options=None):
    timer = StepTimer()
    fit_method(method, net, private, public, batch_size, steps, timer, options)
    return timer.times[2:]  # drop warm-up


# ---- measurements -------------------------------------------------------------------------------
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


def time_case(name, quick, repeats):
    net, dataset, public, batch_size = make_case(name, quick)
    batch = fixed_batch(dataset, batch_size)
    fwd, zo, opacus = forward_op(net, batch), dpzero_engine_op(net, batch), opacus_op(net, batch)
    for op in (fwd, zo, opacus):  # warm-up
        op()
    t_fwd, t_zo, t_opacus = [], [], []
    for _ in range(repeats):  # interleaved to cancel drift
        t_fwd.append(timed(fwd))
        t_zo.append(timed(zo))
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
        "opacus_dpsgd_ms": 1e3 * med(t_opacus),
        "engine_over_two_forwards": med(t_zo) / (2 * med(t_fwd)),
        "lightning_over_two_forwards": med(t_light) / (2 * med(t_fwd)),
        "dpzero_over_opacus": med(t_zo) / med(t_opacus),
    }


PRUNING_RATES = (0.01, 0.1, 1.0)


def sweep_op(net, mask=None, **engine_options):
    """One perturbation sweep θ ← θ + λu along a new direction (the RNG-bound part of a ZO step)."""
    engine = PerturbationEngine(net.parameters(), seed=1, mask=mask, **engine_options)
    step = [0]

    def op():
        engine.perturb((step[0], 0), 1e-3)
        step[0] += 1

    return op


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
    ops = {k: dpzero_engine_op(net, batch, queries=q, one_sided=o) for k, (q, o) in QUERY_SETTINGS.items()}
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
    for k, (q, one_sided) in QUERY_SETTINGS.items():
        row[f"{k}_forwards"] = q + 1 if one_sided else 2 * q
        row[f"{k}_ms"] = 1e3 * med(times[k])
        row[f"{k}_over_two_sided_q4"] = med(times[k]) / med(times["two_sided_q4"])
        row[f"{k}_relative_error"] = estimate_error(net, batch, q, one_sided, draws)
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
        args = [sys.executable, __file__, "--memory-probe", name, mode] + (["--quick"] if quick else [])
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


class _BatchSizes(L.Callback):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sizes.append(int(batch[1].shape[0]))


def fine_tune_probe(name, method, quick, steps):
    """Run in a fresh process: ``steps`` steps of ``method`` in ``Trainer.fit``; step times and resident memory.

    Every method sees the same Poisson batches (a fixed sampling seed), so the same realized batch sizes.
    """
    torch.set_num_threads(2)
    net, dataset, public, batch_size = make_case(name, quick)
    timer, memory, sizes = StepTimer(), FitMemory(warmup=2), _BatchSizes()
    trainer = quiet_trainer(max_steps=steps, callbacks=[timer, memory, sizes])
    data = PrivatePublicDataModule(
        dataset, public=public, batch_size=batch_size, public_batch_size=PUBLIC_BATCH, sampling_seed=0
    )
    model = FINE_TUNE[method][1](net)
    memory.start()
    trainer.fit(model, data)
    return {
        "step_ms": [1e3 * t for t in timer.times[2:]],
        "batch_sizes": sizes.sizes,
        "trainable_parameters": sum(p.numel() for p in net.parameters() if p.requires_grad),
        "live_mb": memory.live_mb,
        "step_peak_mb": memory.step_peak_mb,
        "fit_peak_mb": memory.fit_peak_mb,
    }


def fine_tune_case(name, quick, rounds, steps=6):
    """Each method in its own fresh process, ``rounds`` times round-robin; medians over rounds.

    A method that fails (out of memory, unsupported) is reported with its error instead of numbers.
    """
    import os

    net, _, _, batch_size = make_case(name, quick)
    weights_mb = sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20
    row = {
        "case": name,
        "parameters": sum(p.numel() for p in net.parameters()),
        "batch_size": batch_size,
        "steps_per_fit": steps,
        "measured_steps_per_fit": steps - 2,
        "rounds": rounds,
        "weights_mb": weights_mb,
        "load_average_at_start": list(os.getloadavg()),
        "memory": "RSS (Linux /proc/self/status), MB over the RSS just before Trainer.fit (model and data loaded)",
    }
    runs = {m: [] for m in FINE_TUNE}
    for _ in range(rounds):
        for m in FINE_TUNE:
            args = [sys.executable, __file__, "--fine-tune-probe", name, m, str(steps)] + (["--quick"] if quick else [])
            done = subprocess.run(args, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                runs[m].append({"error": f"exit {done.returncode}: {tail}"})
            else:
                runs[m].append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = statistics.median
    for m, results in runs.items():
        ok = [r for r in results if "error" not in r]
        row[f"{m}_label"] = FINE_TUNE[m][0]
        if not ok:
            row[f"{m}_error"] = results[-1]["error"]
            continue
        row[f"{m}_trainable_parameters"] = ok[0]["trainable_parameters"]
        row[f"{m}_batch_sizes"] = ok[0]["batch_sizes"]
        row[f"{m}_step_ms"] = med(med(r["step_ms"]) for r in ok)
        for k in ("live_mb", "step_peak_mb", "fit_peak_mb"):
            row[f"{m}_{k}"] = med(r[k] for r in ok)
    if "dpsgd_ghost_step_ms" in row and "sgd_step_ms" in row:
        row["ghost_over_sgd_step_time"] = row["dpsgd_ghost_step_ms"] / row["sgd_step_ms"]
        row["ghost_over_sgd_fit_peak"] = row["dpsgd_ghost_fit_peak_mb"] / row["sgd_fit_peak_mb"]
        row["ghost_over_sgd_step_peak"] = row["dpsgd_ghost_step_peak_mb"] / row["sgd_step_peak_mb"]
        row["ghost_over_sgd_peak_with_weights"] = (row["dpsgd_ghost_fit_peak_mb"] + weights_mb) / (
            row["sgd_fit_peak_mb"] + weights_mb
        )
    if "dpsgd_ghost_step_ms" in row and "dpsgd_hooks_step_ms" in row:
        row["hooks_over_ghost_step_time"] = row["dpsgd_hooks_step_ms"] / row["dpsgd_ghost_step_ms"]
        row["hooks_over_ghost_fit_peak"] = row["dpsgd_hooks_fit_peak_mb"] / row["dpsgd_ghost_fit_peak_mb"]
    row["load_average_at_end"] = list(os.getloadavg())
    return row


def fine_tune_table(rows):
    lines = [
        "| case | method | trainable | step ms | live MB | step peak MB | fit peak MB | fit peak ÷ non-private |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for m in FINE_TUNE:
            if f"{m}_error" in r:
                lines.append(f"| {r['case']} | {r[f'{m}_label']} | — | failed: {r[f'{m}_error']} | | | | |")
                continue
            ratio = r[f"{m}_fit_peak_mb"] / r["sgd_fit_peak_mb"] if "sgd_fit_peak_mb" in r else float("nan")
            lines.append(
                f"| {r['case']} | {r[f'{m}_label']} | {r[f'{m}_trainable_parameters'] / 1e6:.2f}M "
                f"| {r[f'{m}_step_ms']:.0f} | {r[f'{m}_live_mb']:.0f} | {r[f'{m}_step_peak_mb']:.0f} "
                f"| {r[f'{m}_fit_peak_mb']:.0f} | {ratio:.2f} |"
            )
    return "\n".join(lines)


TARGETS = [  # (metric, case or None for every case, bound)
    ("pazo_m_over_dpzero", None, 1.3),
    ("engine_over_two_forwards", "transformer", 1.15),
    ("lightning_over_two_forwards", "digits-mlp", 2.0),
    ("lightning_over_two_forwards", "transformer", 1.10),
    ("dpzero_over_opacus", None, 0.30),
    ("dpzero_extra_over_opacus_extra", None, 0.15),
    ("dpsgd_constant_over_opacus", None, 1.05),
    ("dpsgd_automatic_over_constant", None, 1.05),
    ("dpsgd_psac_over_constant", None, 1.05),
    ("coupling_over_dpsgd_plus_public", None, 1.0),
    ("masked_step_1_over_unmasked", None, 1.10),
    ("ghost_over_sgd_fit_peak", None, 2.0),
]


def table(rows):
    lines = [
        "| case | params | B | fwd ms | DPZero engine ms | DPZero in Lightning ms | Opacus DP-SGD ms "
        "| engine/2fwd | Lightning/2fwd | DPZero/Opacus | peak MB inf / DPZero / Opacus (ZO budget) | kept MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['parameters'] / 1e6:.2f}M | {r['batch_size']} | {r['forward_ms']:.1f} "
            f"| {r['dpzero_engine_ms']:.1f} | {r['dpzero_lightning_ms']:.1f} | {r['opacus_dpsgd_ms']:.1f} "
            f"| {r['engine_over_two_forwards']:.2f} | {r['lightning_over_two_forwards']:.2f} "
            f"| {r['dpzero_over_opacus']:.2f} | {r['inference_peak_mb']:.1f} / {r['dpzero_peak_mb']:.1f} / "
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


def machine_load() -> dict:
    """CPU count and load averages when the run ended (timings on a shared machine are only as good as this)."""
    import os

    return {"cpus": os.cpu_count(), "load_average_1_5_15_min": list(os.getloadavg())}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models and few repeats (smoke test)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--suite",
        choices=["all", "zo", "directions", "queries", "first_order", "pruning", "logging", "fine_tune"],
        default="all",
        help="all: every suite but fine_tune on digits-mlp and transformer; on minilm, fine_tune only",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=["digits-mlp", "transformer", "minilm"],
        default=["digits-mlp", "transformer"],
        help="minilm (the packaged pretrained MiniLM at batch 32) is opt-in: per-example gradients need ~3 GB",
    )
    parser.add_argument("--rounds", type=int, default=2, help="fine_tune: fresh processes per method (round-robin)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--memory-probe", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--fine-tune-probe", nargs=3, metavar=("CASE", "METHOD", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        print(memory_probe(*args.memory_probe, args.quick))
        return
    if args.fine_tune_probe:
        name, method, steps = args.fine_tune_probe
        print(json.dumps(fine_tune_probe(name, method, args.quick, int(steps))))
        return
    torch.set_num_threads(2)
    repeats = args.repeats or (3 if args.quick else 9)
    rows, directions, queries, first_order, pruning, fine_tune = [], [], [], [], [], []
    for name in args.cases:
        if args.suite == "fine_tune" or (args.suite == "all" and name == "minilm"):
            fine_tune.append(fine_tune_case(name, args.quick, args.rounds))
            continue
        if args.suite in ("all", "zo"):
            row = time_case(name, args.quick, repeats)
            row.update(memory_case(name, args.quick, probes=1 if args.quick else 3))
            rows.append(row)
        if args.suite in ("all", "directions"):
            directions.append(time_directions(name, args.quick, repeats))
        if args.suite in ("all", "queries"):
            queries.append(time_queries(name, args.quick, repeats))
        if args.suite in ("all", "first_order"):
            first_order.append(time_first_order(name, args.quick, repeats))
        if args.suite in ("all", "pruning"):
            pruning.append(time_pruning(name, args.quick, repeats))
    small_cases = any(name != "minilm" for name in args.cases)
    logging_row = time_logging(repeats) if args.suite == "logging" or (args.suite == "all" and small_cases) else None
    checks = []
    for metric, case, bound in TARGETS:
        for r in rows + first_order + pruning + fine_tune:
            if metric not in r:
                continue
            if case in (None, r["case"]):
                checks.append(
                    {
                        "case": r["case"],
                        "metric": metric,
                        "value": r[metric],
                        "target": bound,
                        "met": r[metric] <= bound,
                    }
                )
    budgets = {"dpzero": "zo", "pazo_m": "pazo_m", "pazo_p": "pazo_p", "pazo_s": "pazo_s"}
    checks += [
        {
            "case": r["case"],
            "metric": f"{m}_peak_mb",
            "value": r[f"{m}_peak_mb"],
            "target": r[f"{b}_memory_budget_mb"],
            "met": r[f"{m}_peak_mb"] <= r[f"{b}_memory_budget_mb"],
        }
        for r in rows
        for m, b in budgets.items()
    ]
    result = {
        "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
        "repeats": repeats,
        "machine": machine_load(),
        "rows": rows,
        "directions": directions,
        "queries": queries,
        "first_order": first_order,
        "pruning": pruning,
        "fine_tune": fine_tune,
        "logging": logging_row,
        "targets": checks,
    }
    if rows:
        print(table(rows))
    for part, render in ((directions, directions_table), (queries, queries_table)):
        if part:
            print()
            print(render(part))
    if first_order:
        print()
        print(first_order_table(first_order))
    if pruning:
        print()
        print(pruning_table(pruning))
    if fine_tune:
        print()
        print(fine_tune_table(fine_tune))
    if logging_row:
        print()
        row = logging_row
        print(
            f"logging ({row['case']}, DPZero B=64): every step {row['log_every_step_ms']:.2f} ms, "
            f"every 50 steps {row['log_every_50_ms']:.2f} ms, ratio {row['every_step_over_cadence']:.2f}"
        )
    print()
    for c in checks:
        print(
            f"{'MET ' if c['met'] else 'MISS'} {c['case']:<12} {c['metric']:<32} {c['value']:.3f} <= {c['target']:.3f}"
        )
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
