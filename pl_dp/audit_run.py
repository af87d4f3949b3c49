"""Whole-run privacy audit: one real training run, many canaries (Steinke, Nasr & Jagielski, NeurIPS 2023).

:func:`pl_dp.audit.audit` checks one step. The guarantee also rests on what no single step shows:
that the Poisson sample is secret (amplification), that the noise of every step is fresh and
secret (composition), and that a checkpoint and a resume neither reveal nor replay a secret.
:func:`audit_run` checks all of it at once, end to end, with the adversary of the threat model
(docs/privacy-model.md: the code, the config, every released model, every checkpoint, all the data
but membership), following "Privacy Auditing with One (1) Training Run" (Steinke, Nasr & Jagielski,
NeurIPS 2023):

1. **Canaries.** m canaries, each put in the private set independently with probability ½ by
   the auditor. The model is linear, bias-free, with one input coordinate per canary beside the
   real features; canary j's input is C·e_{d+j} and the loss is linear (−logit of the label), so
   its per-example gradient is the same vector of norm C at every step and lives only in weight
   column d+j. A canary left out keeps its slot as a *blank* (input 0, gradient 0): the private
   set keeps n = real + m examples and every canary keeps its index. A blank changes nothing a
   run releases, so blank versus canary is add/remove-one adjacency at the sample rate b/n the
   accountant uses.
2. **One real run** of the method through ``Trainer.fit``: the real Poisson loader, noise source
   and accountant, a checkpoint written at ``checkpoint_at`` and, with ``resume=True``, the run
   killed there and resumed from that checkpoint by a new module and Trainer. The parameters
   after every step are recorded (every released model).
3. **The adversary replays the pipeline.** It runs the same code with the same public inputs —
   the config with every seed in it, the same global ``seed_everything``, the same data with
   *every* canary in — to the checkpoint step, then resumes, as the target did, from the
   target's own checkpoint. The replay is instrumented: it records which steps sampled each
   canary and the noise it drew. If the secrets are secret, the replay's batches and noise are
   independent of the target's; if they can be derived from the config or a checkpoint, the
   replay reproduces them. The adversary does not need to know which: it checks on coordinates
   that carry pure noise (canary columns' non-label rows) whether the replay's noise matches
   the target's at each step, and whether the replay's batches match the target's in each
   process (before and after the checkpoint), and scores every canary with the exact
   likelihood ratio of "in" against "out" under what it found (:func:`canary_scores`).
4. **Guesses → a lower bound.** The adversary guesses "in" or "out" for the canaries it is most
   confident about; how many it guesses is chosen from the scores alone (never from the true
   membership). The number of correct guesses v out of r gives, with confidence 1 − β, the
   lower bound on ε of Steinke et al. (their Theorem 3.1 / Corollary 5.4, with δ; Appendix D's
   ``get_eps_audit``, :func:`one_run_epsilon_lower_bound`). Every step of the adversary is a
   post-processing of the run's outputs and public inputs, so the bound is valid whatever it
   finds. A lower bound above the run's claimed ε (its accountant's, at its δ) is a violation.

What it caught, in ``tests/test_audit_run.py`` (m = 1000 canaries, T = 1000 steps, claimed ε = 2 at
δ = 1e-5 with σ calibrated by RDP, the kill-and-resume at step 500 or 550, nine runs each): a sampling
seed in the config (the adversary knows which steps included each canary: no amplification) gives a
lower bound of 4.3–4.9; a noise seed in the config (the noise is removed exactly) 5.3–5.8; noise
state written to a checkpoint and restored on resume (the noise after the checkpoint is removed
exactly) 4.8–5.2. The honest run gives 0.1–1.0 (σ calibrated by PRV: 0.5–0.85 in four runs; 150
simulated runs of the same adversary: mean 0.53, 99th percentile 1.0, maximum 1.1). With m canaries
no audit can show more than the bound for m right guesses out of m (5.8 here), whatever the leak.

What it does not check: the audit drives first-order methods with plain SGD (the step's release
is read off the parameter change), on its own linear canary model and loss, on one CPU process;
zeroth-order methods, other optimizers, data parallelism and the user's own net are not
exercised (they share the sampler, noise source, accountant and checkpoint code it does
exercise). The replay finds a secret only if the code itself re-derives it from public inputs;
a secret merely *written* to a checkpoint or log but never read back is caught by inspecting
the artifacts (``tests/methods/test_checkpoint.py``), not here. It is a lower bound: one run with
m canaries does not reach the claimed ε of a correct implementation (about 0.5 of 2 here), so
passing is evidence against large leaks, not a proof of the claim. Floating-point attacks on the
Gaussian sampler (Mironov 2012) are out of its reach.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import secrets
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from scipy.stats import binom
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp.audit import quiet_trainer
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError
from pl_dp.methods import DPSGD
from pl_dp.methods.first_order import FirstOrderModule
from pl_dp.privacy.spec import PrivacySpec

#: real input features and classes of the audit's linear model (two classes: one label row and one
#: pure-noise row per canary column)
FEATURES = 4
CLASSES = 2
#: noise variance floor (in units of σ²) when the replay's noise cancels the target's exactly
_MATCHED_VARIANCE_FLOOR = 1e-6


# ---- Steinke, Nasr & Jagielski (2023): correct guesses → a lower bound on ε ----------------------
def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P[≥ ``correct`` right out of ``guesses``] under (ε, δ)-DP with ``canaries`` canaries (Corollary 5.4).

    β = P[Binomial(r, q) ≥ v] with q = e^ε/(1 + e^ε), plus the δ term 2·m·δ·α with
    α = max_{1≤i≤v} P[v − i ≤ Binomial(r, q) < v]/i (Steinke et al. 2023, Appendix D).
    """
    m, r, v = canaries, guesses, correct
    if not 0 <= v <= r <= m:
        raise ConfigError(f"need 0 <= correct <= guesses <= canaries, got {v}, {r}, {m}.")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    beta = float(binom.sf(v - 1, r, q))
    if delta == 0 or v == 0:
        return min(beta, 1.0)
    i = np.arange(1, v + 1)
    alpha = float(np.max((binom.sf(v - i - 1, r, q) - beta) / i, initial=0.0))
    return min(beta + alpha * delta * 2 * m, 1.0)


def one_run_epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest ε that ``correct`` right guesses out of ``guesses`` reject at level 1 − ``confidence``.

    With probability ≥ ``confidence`` over the canaries' coin flips and the run, an (ε, δ)-DP
    pipeline gives a bound ≤ ε (Steinke et al. 2023, Theorem 3.1; ``get_eps_audit``). 0 when
    nothing is rejected. Bisection to 1e-6.
    """
    significance = 1.0 - confidence
    if guesses == 0 or one_run_p_value(canaries, guesses, correct, 0.0, delta) >= significance:
        return 0.0
    low, high = 0.0, 1.0
    while one_run_p_value(canaries, guesses, correct, high, delta) < significance:
        low, high = high, 2 * high
    while high - low > 1e-6:
        middle = (low + high) / 2
        if one_run_p_value(canaries, guesses, correct, middle, delta) < significance:
            low = middle
        else:
            high = middle
    return low


# ---- the adversary's scores ------------------------------------------------------------------------
def canary_scores(
    releases: np.ndarray,
    replay_noise: np.ndarray,
    replay_sampled: np.ndarray,
    labels: np.ndarray,
    segments: list[range],
    noise_multiplier: float,
    sample_rate: float,
    signal: float,
) -> tuple[np.ndarray, np.ndarray, list[bool]]:
    """Log-likelihood ratio of "in" against "out" for every canary, from the run and the replay.

    Args:
        releases: ``[T, classes, m]``, the target's release at each step on the canary columns, in
            units of the sensitivity: (clipped sum + noise)/C, read off the parameter change.
        replay_noise: ``[T, classes, m]``, the noise the replay drew for those coordinates, /C.
        replay_sampled: ``[T, m]``, whether the replay's batch held each canary.
        labels: ``[m]``, each canary's label (its gradient is −signal·C on that row).
        segments: the steps of each process of the run (before and after the checkpoint).
        noise_multiplier, sample_rate: σ and q of the run.
        signal: a sampled canary's contribution in units of C (1 for constant clipping).

    Returns:
        (scores ``[m]``, which steps' noise the replay reproduced ``[T]``, whether the replay's
        batches matched the target's in each segment). The adversary subtracts the replay's noise
        at a step when that leaves less variance on the pure-noise rows than σ², and trusts the
        replay's batches in a segment when the canaries it sampled moved by at least half the
        expected amount more than the others; each score is then the exact log-likelihood ratio
        of a sampled Gaussian signal under those findings.
    """
    _, classes, m = releases.shape
    label_rows = np.zeros((classes, m), dtype=bool)
    label_rows[labels, np.arange(m)] = True
    residual = releases - replay_noise
    probe_variance = (residual[:, ~label_rows] ** 2).mean(axis=1)  # non-label rows: pure noise
    variance_free = noise_multiplier**2
    reproduced = probe_variance < variance_free
    variance = np.where(reproduced, np.maximum(probe_variance, _MATCHED_VARIANCE_FLOOR * variance_free), variance_free)
    canary = np.arange(m)
    observed = np.where(reproduced[:, None], residual[:, labels, canary], releases[:, labels, canary])  # [T, m]
    evidence = -observed  # = signal·1[sampled and in] + noise
    log_ratio = (signal * evidence - signal**2 / 2) / variance[:, None]  # sampled-in against out, per step
    scores = np.zeros(m)
    matched_segments = []
    for segment in segments:
        index = np.arange(segment.start, segment.stop)
        sampled = replay_sampled[index]
        matched = bool(  # the sampled canaries moved by ≈ signal/2 more than the others when matched, ≈ 0 when not
            sampled.any()
            and (~sampled).any()
            and evidence[index][sampled].mean() - evidence[index][~sampled].mean() > signal / 4
        )
        matched_segments.append(matched)
        if matched:  # the target's batches are known: only the steps that sampled a canary speak
            scores += np.where(sampled, log_ratio[index], 0.0).sum(axis=0)
        else:  # each step held the canary with probability q, unknown which
            scores += np.logaddexp(math.log1p(-sample_rate), math.log(sample_rate) + log_ratio[index]).sum(axis=0)
    return scores, reproduced, matched_segments


def choose_guesses(scores: np.ndarray, delta: float, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """(indices guessed, guesses "in") — the most confident canaries, how many chosen from the scores only.

    Reading the scores as log-likelihood ratios (prior ½), the expected number of correct
    guesses among the r most confident is the sum of their posteriors; r is the one (on a grid)
    whose expected count gives the largest bound. The true membership is never looked at, so the
    choice costs no correction.
    """
    m = len(scores)
    posterior_in = 1.0 / (1.0 + np.exp(-np.clip(scores, -700, 700)))
    certainty = np.maximum(posterior_in, 1 - posterior_in)
    order = np.argsort(-certainty, kind="stable")
    best, best_count = -1.0, 0
    for count in sorted({int(c) for c in np.geomspace(1, m, 64).round()} | {m}):
        expected = int(round(float(certainty[order[:count]].sum())))
        bound = one_run_epsilon_lower_bound(m, count, expected, delta, confidence)
        if bound > best:
            best, best_count = bound, count
    chosen = order[:best_count]
    return chosen, scores[chosen] > 0


# ---- the runs ----------------------------------------------------------------------------------------
def _linear_loss(net: nn.Module, batch: Any) -> torch.Tensor:
    """−(label logit) per example: the gradient −e_y·xᵀ does not depend on the weights."""
    inputs, targets = batch
    return -net(inputs).gather(1, targets.unsqueeze(1)).squeeze(1)


class _Killed(RuntimeError):
    """The simulated crash of a run at its checkpoint step."""


class _CheckpointAt(Callback):
    """Writes a real Lightning checkpoint after private step ``step``; optionally kills the run there."""

    def __init__(self, step: int, path: Path | None, kill: bool) -> None:
        self.step, self.path, self.kill = step, path, kill

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if pl_module.private_steps != self.step:
            return
        if self.path is not None:
            trainer.save_checkpoint(self.path)
        if self.kill:
            raise _Killed(f"killed after step {self.step}")


class _ReleaseRecorder(Callback):
    """Records the canary columns of the weight after every step (every released model)."""

    def __init__(self, first_canary_column: int) -> None:
        self.column = first_canary_column
        self.weights: dict[int, torch.Tensor] = {}

    def _record(self, pl_module: L.LightningModule) -> None:
        self.weights[pl_module.private_steps] = pl_module.net.weight.detach()[:, self.column :].double().clone()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._record(pl_module)


class _ReplayRecorder(Callback):
    """The replay's instrumentation: which canaries each step's Poisson batch held, and the noise it drew.

    The noise is read by wrapping ``normal_like`` of the noise source the module uses at its first batch (on that
    instance only: the one draw a step lays over the parameters); the source still draws. Kept: the canary columns of
    the weight's piece of the draw.
    """

    def __init__(self, first_canary_column: int) -> None:
        self.column = first_canary_column
        self.sampled: dict[int, torch.Tensor] = {}
        self.noise: dict[int, torch.Tensor] = {}
        self._tapped: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        self.sampled[pl_module.private_steps] = (batch[0][:, self.column :] != 0).any(dim=0).cpu()
        if pl_module.noise is not self._tapped:
            self._tap(pl_module)

    def _tap(self, pl_module: L.LightningModule) -> None:
        source = self._tapped = pl_module.noise
        draw, shape = source.normal_like, tuple(pl_module.net.weight.shape)

        def recorded(pieces: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
            found = 0
            for piece in pieces:
                if tuple(piece.shape) == shape:
                    found += 1
                    if found > 1:
                        raise RuntimeError("two released tensors have the weight's shape: the replay cannot tell them.")
                    self.noise[pl_module.private_steps] = piece.detach()[:, self.column :].double().clone()
                yield piece

        def normal_like(*args: Any, **kwargs: Any) -> Iterator[torch.Tensor]:
            return recorded(draw(*args, **kwargs))  # the draw is taken now, as the source's own

        source.normal_like = normal_like


@dataclass(frozen=True)
class _RunConfig:
    """Everything public about the run: what the adversary's replay is built from."""

    method: type[FirstOrderModule]
    method_kwargs: dict[str, Any]
    privacy: PrivacySpec
    noise_seed: int | None
    sampling_seed: int | None
    batch_size: int
    steps: int
    seed: int
    root_dir: str = "."
    #: each example's user when the run is user-level (:func:`canary_users`), else None
    users: list[int] | None = None

    def module(self, canaries: int) -> FirstOrderModule:
        L.seed_everything(self.seed, verbose=False)  # what a restarted job does first
        net = nn.Linear(FEATURES + canaries, CLASSES, bias=False)
        module = self.method(
            net, loss=_linear_loss, privacy=self.privacy, noise_seed=self.noise_seed, **self.method_kwargs
        )
        if module.bands > 1:  # a method whose own default is banded noise (the request's is refused up front)
            raise ConfigError(
                f"the run audit scores independent noise and cannot audit {type(module).__name__}'s banded noise "
                f"(bands={module.bands}): pass noise='independent' in method_kwargs."
            )
        return module

    def datamodule(self, private: TensorDataset) -> PrivatePublicDataModule:
        return PrivatePublicDataModule(
            private, batch_size=self.batch_size, sampling_seed=self.sampling_seed, user_of=self.users
        )

    def trainer(self, callbacks: list[Callback]) -> L.Trainer:
        return quiet_trainer(
            max_steps=self.steps,
            default_root_dir=self.root_dir,  # the privacy journal of the audited lineage goes here
            callbacks=callbacks,
        )


def _fit(
    config: _RunConfig, private: TensorDataset, canaries: int, callbacks: list[Callback], ckpt_path: Path | None = None
) -> FirstOrderModule:
    """One process of a run: a fresh module and Trainer, from scratch or from ``ckpt_path``."""
    module = config.module(canaries)
    with contextlib.suppress(_Killed), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no privacy journal of this run")  # the replay's copy
        config.trainer(callbacks).fit(
            module, config.datamodule(private), ckpt_path=None if ckpt_path is None else str(ckpt_path)
        )
    return module


@dataclass(frozen=True)
class RunAuditResult:
    """What the whole-run audit measured, next to the run's claimed ε."""

    method: str
    canaries: int  # m
    included: int  # canaries in the private set (the auditor's coin flips)
    steps: int
    checkpoint_step: int
    resumed: bool
    sample_rate: float
    noise_multiplier: float
    delta: float
    claimed_epsilon: float  # the target run's accountant, all steps, at delta
    epsilon_lower_bound: float
    confidence: float
    guesses: int  # r
    correct: int  # v
    guessed_in: int  # k₊
    noise_reproduced_steps: int  # steps at which the replay's noise cancelled the target's
    batches_reproduced: tuple[bool, ...]  # per process of the run: the replay's batches were the target's
    seconds: float
    canary_examples: int = 1  # examples of each canary (a canary is one user)
    unit: str = "example"  # the run's unit of privacy: "example", or "user" (user_of: a canary is one user)

    @property
    def violated(self) -> bool:
        """True when the lower bound exceeds the claimed ε: the run leaks more than it accounts for."""
        return self.epsilon_lower_bound > self.claimed_epsilon

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"violated": self.violated}

    def __str__(self) -> str:
        verdict = "VIOLATION: the run leaks more than it accounts for" if self.violated else "consistent"
        leaks = []
        if self.noise_reproduced_steps:
            leaks.append(f"the replay reproduced the noise of {self.noise_reproduced_steps} steps")
        if any(self.batches_reproduced):
            leaks.append(f"the replay reproduced the batches (per process: {list(self.batches_reproduced)})")
        return (
            f"pl-dp run audit: {self.method}, {self.unit}-level, {self.canaries} canaries ({self.included} in"
            + (f"; each a user of {self.canary_examples} examples" if self.canary_examples > 1 else "")
            + f"), {self.steps} steps"
            f"{' with a kill-and-resume' if self.resumed else ''} at step {self.checkpoint_step}, q "
            f"{self.sample_rate:.4g}, sigma {self.noise_multiplier:.4g}, delta {self.delta:.2e} | claimed epsilon "
            f"{self.claimed_epsilon:.3f} | lower bound {self.epsilon_lower_bound:.3f} ({self.confidence:.0%} "
            f"confidence; {self.correct}/{self.guesses} guesses right, {self.guessed_in} guessed in)"
            + (f" | {'; '.join(leaks)}" if leaks else "")
            + f" | {verdict}"
        )


def _canary_data(
    canaries: int, included: np.ndarray, real_examples: int, scale: float, seed: int, copies: int = 1
) -> TensorDataset:
    """Real blobs (public) then ``copies`` slots per canary: ``scale``·e_{d+j} when included, a blank (zeros) when
    not — a canary of ``copies`` examples is one user who wrote them all."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=generator) * 3
    real_labels = torch.randint(0, CLASSES, (real_examples,), generator=generator)
    real = torch.zeros(real_examples, FEATURES + canaries)
    real[:, :FEATURES] = centers[real_labels] + torch.randn(real_examples, FEATURES, generator=generator)
    slots = torch.zeros(canaries, FEATURES + canaries)
    slots[:, FEATURES:] = torch.diag(torch.as_tensor(included, dtype=torch.float32) * scale)
    labels = torch.cat([real_labels, canary_labels(canaries).repeat_interleave(copies)])
    return TensorDataset(torch.cat([real, slots.repeat_interleave(copies, dim=0)]), labels)


def canary_users(canaries: int, real_examples: int, copies: int) -> list[int]:
    """Each example's user in the audit's private set: every real example its own user, and canary j (all of its
    ``copies`` examples, a blank's too) user ``real_examples + j``."""
    return list(range(real_examples)) + [real_examples + j for j in range(canaries) for _ in range(copies)]


def canary_labels(canaries: int) -> torch.Tensor:
    """Canary j's label, j mod the number of classes (public)."""
    return torch.arange(canaries) % CLASSES


def audit_run(
    method: type[FirstOrderModule] = DPSGD,
    privacy: PrivacySpec | None = None,
    canaries: int = 1000,
    steps: int = 1000,
    batch_size: int = 20,
    real_examples: int = 1000,
    checkpoint_at: int | None = None,
    resume: bool = True,
    noise_seed: int | None = None,
    sampling_seed: int | None = None,
    seed: int = 0,
    inclusion_seed: int | None = None,
    confidence: float = 0.95,
    method_kwargs: Mapping[str, Any] | None = None,
    workdir: str | Path | None = None,
    canary_examples: int = 1,
    user_level: bool = False,
) -> RunAuditResult:
    """Audit a whole private training run with one run and many canaries (see the module docstring).

    Args:
        method: a first-order pl_dp method (:class:`~pl_dp.methods.DPSGD` or a subclass), trained with
            plain SGD on the audit's linear canary model.
        privacy: the run's privacy request; default ε = 2 at δ = 1e-5 (δ should be well below
            1/``canaries``: the bound pays 2·m·δ).
        canaries: m, canaries each included with probability ½.
        steps: planned private steps T of the run.
        batch_size: expected Poisson batch size b (sample rate b/(``real_examples`` + m)).
        real_examples: real (public-to-the-adversary) examples beside the canaries.
        checkpoint_at: the step at which the run writes its checkpoint (default T/2).
        resume: kill the run at the checkpoint and resume it from the checkpoint (a new module and
            Trainer), as a crashed job would be.
        noise_seed: the method's ``noise_seed=`` in the run's config; ``None`` (default) leaves the noise
            key to OS entropy. The adversary's replay uses the same config, seeds included.
        sampling_seed: :class:`~pl_dp.data.PrivatePublicDataModule`'s ``sampling_seed=`` in the config;
            ``None`` (default) leaves the Poisson sampling seed to OS entropy.
        seed: the run's global ``seed_everything`` (public, like everything in a config).
        inclusion_seed: seed of the auditor's coin flips (secret from the run; ``None``: OS entropy).
        confidence: 1 − β, the confidence of the lower bound.
        method_kwargs: further arguments of ``method`` (``lr``, ``clip``, ``clip_fn``, ``per_sample``,
            ``secure_rng``, …). Momentum, weight decay, optimizers other than SGD and adaptive clipping
            are refused: the audit reads each step's release off the parameter change.
        workdir: where the checkpoint is written (default: a temporary directory).
        canary_examples: how many (identical) examples each canary has: a canary is one user who wrote them all,
            and its inclusion adds or removes all of them.
        user_level: audit user-level privacy: the run samples users (``PrivatePublicDataModule(user_of=...)``, each
            real example its own user, each canary one user), so q = b/(``real_examples`` + m) users and a canary
            of many examples is audited as the one user it is. Without it, a canary of several examples is audited
            against the run's example-level claim, which group privacy does not meet: the audit should find the
            violation.
    """
    kwargs = dict(method_kwargs or {})
    checkpoint_at = _check_request(method, kwargs, confidence, canaries, steps, real_examples, checkpoint_at)
    if isinstance(canary_examples, bool) or not isinstance(canary_examples, int) or canary_examples < 1:
        raise ConfigError(f"canary_examples must be an integer >= 1, got {canary_examples!r}.")
    privacy = privacy or PrivacySpec(epsilon=2.0, delta=1e-5)
    users = canary_users(canaries, real_examples, canary_examples) if user_level else None
    config = _RunConfig(method, kwargs, privacy, noise_seed, sampling_seed, batch_size, steps, seed, users=users)
    coins = np.random.default_rng(secrets.randbits(64) if inclusion_seed is None else inclusion_seed)
    included = coins.random(canaries) < 0.5
    canary_scale = float(kwargs.get("clip", 1.0))  # ‖canary gradient‖ = C: saturates constant clipping exactly
    start = time.perf_counter()
    seen = _run_and_replay(
        config, included, real_examples, canary_scale, checkpoint_at, resume, workdir, canary_examples
    )
    module = seen.module
    clip_function = module.clip_function
    if clip_function is None:  # a private first-order run always has one
        raise RuntimeError(f"the audited {type(module).__name__} run has no clip function.")
    sensitivity = clip_function.sensitivity
    releases = -np.diff(seen.weights, axis=0) * module.expected_batch_size / (module.lr * sensitivity)
    canary_norm = torch.tensor([canary_scale])
    scores, reproduced, matched = canary_scores(
        releases,
        seen.noise / sensitivity,
        seen.sampled,
        canary_labels(canaries).numpy(),
        [range(0, checkpoint_at), range(checkpoint_at, steps)],
        module.noise_multiplier,
        module.sample_rate,
        signal=float(clip_function.weights(canary_norm) * canary_norm) / sensitivity,
    )
    delta = module.delta
    chosen, guess_in = choose_guesses(scores, delta, confidence)
    correct = int((guess_in == included[chosen]).sum())
    return RunAuditResult(
        method=method.__name__,
        canaries=canaries,
        canary_examples=canary_examples,
        unit=module.privacy_unit.kind if module.privacy_unit is not None else "example",
        included=int(included.sum()),
        steps=steps,
        checkpoint_step=checkpoint_at,
        resumed=resume,
        sample_rate=module.sample_rate,
        noise_multiplier=module.noise_multiplier,
        delta=delta,
        claimed_epsilon=module.epsilon,
        epsilon_lower_bound=one_run_epsilon_lower_bound(canaries, len(chosen), correct, delta, confidence),
        confidence=confidence,
        guesses=len(chosen),
        correct=correct,
        guessed_in=int(guess_in.sum()),
        noise_reproduced_steps=int(reproduced.sum()),
        batches_reproduced=tuple(matched),
        seconds=time.perf_counter() - start,
    )


@dataclass(frozen=True)
class _Observations:
    """What the adversary holds after the run and its replay."""

    module: FirstOrderModule  # the target's last process (its accountant makes the claim)
    weights: np.ndarray  # [T + 1, classes, m]: the canary columns of every released model
    noise: np.ndarray  # [T, classes, m]: the replay's noise on those coordinates
    sampled: np.ndarray  # [T, m]: which canaries the replay's batches held


def _run_and_replay(
    config: _RunConfig,
    included: np.ndarray,
    real_examples: int,
    canary_scale: float,
    checkpoint_at: int,
    resume: bool,
    workdir: str | Path | None,
    copies: int = 1,
) -> _Observations:
    """The target run (checkpoint, optional kill-and-resume), then the adversary's instrumented replay."""
    canaries, steps = len(included), config.steps
    with tempfile.TemporaryDirectory() as scratch:
        config = dataclasses.replace(config, root_dir=str(workdir or scratch))
        checkpoint = Path(workdir or scratch) / "audit-run.ckpt"
        target = _ReleaseRecorder(FEATURES)
        data = _canary_data(canaries, included, real_examples, canary_scale, config.seed, copies)
        module = _fit(config, data, canaries, [target, _CheckpointAt(checkpoint_at, checkpoint, kill=resume)])
        if resume:
            module = _fit(config, data, canaries, [target], ckpt_path=checkpoint)
        # the adversary: the same config on every canary, to the checkpoint, then from the target's checkpoint
        everything = _canary_data(
            canaries, np.ones(canaries, dtype=bool), real_examples, canary_scale, config.seed, copies
        )
        replay = _ReplayRecorder(FEATURES)
        _fit(config, everything, canaries, [replay, _CheckpointAt(checkpoint_at, None, kill=True)])
        _fit(config, everything, canaries, [replay], ckpt_path=_without_journal(checkpoint, Path(scratch)))
    if module.private_steps != steps or len(target.weights) != steps + 1:
        raise RuntimeError(f"the audited run made {module.private_steps} of its {steps} planned private steps.")
    return _Observations(
        module=module,
        weights=torch.stack([target.weights[t] for t in range(steps + 1)]).numpy(),
        noise=torch.stack([replay.noise[t] for t in range(steps)]).numpy(),
        sampled=torch.stack([replay.sampled[t] for t in range(steps)]).numpy(),
    )


def _without_journal(checkpoint: Path, scratch: Path) -> Path:
    """A copy of ``checkpoint`` that does not point at its lineage's privacy journal.

    The replay is the adversary's own computation, not a release of the audited run: resuming the
    original would add it to the run's journal (as a second continuation) and budget it.
    """
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    state["pl_dp"]["journal"] = None
    copy = scratch / "replay.ckpt"
    torch.save(state, copy)
    return copy


def _check_request(
    method: type,
    kwargs: dict[str, Any],
    confidence: float,
    canaries: int,
    steps: int,
    real_examples: int,
    checkpoint_at: int | None,
) -> int:
    """Refuse what the audit cannot read; returns the checkpoint step."""
    if not (isinstance(method, type) and issubclass(method, FirstOrderModule)) or method.requires_public_data:
        raise ConfigError(
            f"the run audit drives first-order methods without public data (DPSGD and subclasses); got {method!r}."
        )
    for name, plain in (("optimizer", "sgd"), ("momentum", 0.0), ("weight_decay", 0.0), ("clip_quantile", None)):
        if kwargs.get(name, plain) != plain:
            raise ConfigError(
                f"the run audit reads each step's release off the parameter change, which needs plain SGD with a "
                f"fixed clip: {name}={kwargs[name]!r} is not supported (leave it at {plain!r})."
            )
    bands = kwargs.get("bands", 1)
    if kwargs.get("noise", "independent") != "independent" and bands != 1:
        raise ConfigError(
            f"the run audit scores each step's release against independent Gaussian noise, and cannot audit banded "
            f"noise (noise={kwargs['noise']!r}, bands={bands!r}): there the noise of step t is "
            "σζC·(z_t − Σ_j c_j·w_(t−j)), correlated across steps, and each canary takes part once in b steps (cyclic "
            "groups). Auditing it needs the replay's noise run through the same recursion (and the canaries' groups) "
            "before scoring, which this audit does not do; a banded run it passed would say nothing. Audit "
            "noise='independent' (bands=1), or use the one-step audit (pl-dp audit), which draws each trial as a "
            "band's first step."
        )
    for name in ("net", "loss", "privacy", "noise_seed"):
        if name in kwargs:
            raise ConfigError(f"{name} is set by the run audit (pass privacy= and noise_seed= to audit_run itself).")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must lie in (0, 1), got {confidence!r}.")
    for name, value, minimum in (("canaries", canaries, 1), ("steps", steps, 2), ("real_examples", real_examples, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    checkpoint_at = steps // 2 if checkpoint_at is None else checkpoint_at
    if isinstance(checkpoint_at, bool) or not isinstance(checkpoint_at, int) or not 1 <= checkpoint_at < steps:
        raise ConfigError(f"checkpoint_at must be an integer in [1, steps), got {checkpoint_at!r} for {steps} steps.")
    return checkpoint_at
