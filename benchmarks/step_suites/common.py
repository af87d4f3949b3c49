"""What every suite of ``benchmarks/step_cost.py`` shares: the cases, the methods, one-op closures, fits."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _measure import StepTimer, quiet_trainer
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule, digits_splits
from pl_dp.methods import DPSGD, PAZOM, PAZOP, PAZOS, Coupling, DPZero
from pl_dp.nets import MLP, TinyTransformerClassifier
from pl_dp.privacy import NoiseSource, SubsampledGaussian
from pl_dp.step.losses import cross_entropy
from pl_dp.zo import PerturbationEngine, PrivateTwoPointEstimator, per_sample_evaluator

#: the entry point, which the suites that measure in fresh processes run with a probe option
ENTRY = str(Path(__file__).resolve().parents[1] / "step_cost.py")


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


def mezo_floor_op(net, batch, smoothing=1e-3, lr=1e-4):
    """MeZO's step in a few lines of torch (Malladi et al. 2023, Alg. 1; ``benchmarks/gpu.py``'s floor): u redrawn by
    ``torch.randn`` from one seed, tensor by tensor on torch's one generator, in each of four in-place sweeps
    (+λ, −2λ, +λ, −η·g), around the same two forwards as :func:`forward_op`. Not private: no clipping, no noise."""
    params = [p for p in net.parameters() if p.requires_grad]
    evaluate = forward_op(net, batch)
    step = [0]

    def sweep(seed, scale):
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype), alpha=scale)

    @torch.no_grad()
    def op():
        seed = 1000 + step[0]
        sweep(seed, smoothing)
        plus = evaluate()
        sweep(seed, -2 * smoothing)
        minus = evaluate()
        sweep(seed, smoothing)
        sweep(seed, -lr * float(((plus - minus) / (2 * smoothing)).mean()))
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


def sweep_op(net, mask=None, **engine_options):
    """One perturbation sweep θ ← θ + λu along a new direction (the RNG-bound part of a ZO step)."""
    engine = PerturbationEngine(net.parameters(), seed=1, mask=mask, **engine_options)
    step = [0]

    def op():
        engine.perturb((step[0], 0), 1e-3)
        step[0] += 1

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
