"""O2NC: private zeroth-order online-to-nonconvex conversion with the tree mechanism.

Zhang, Tran & Cutkosky (ICLR 2024): Algorithm 3 (online-to-nonconvex conversion with projected
online subgradient descent), Algorithm 4 (variance-reduced oracle: GRAD at the start of each
epoch, DIFF increments after), Algorithm 5 (tree-aggregated noise), and Algorithm 6 (the naive
baseline: a fresh GRAD and fresh noise every round).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods.base import StepResult
from pl_dp.methods.own_update import OwnUpdateModule
from pl_dp.privacy.clip_functions import clip_per_example
from pl_dp.privacy.sampling import PartitionBatchSampler, partition_loader
from pl_dp.privacy.seeding import SeedDomain, derive_seed
from pl_dp.privacy.tree import TreeAggregatedGaussian, TreeLeaf, tree_multiplicity
from pl_dp.step.validation import check_positive, positive_integer
from pl_dp.zo.engine import Direction, PerturbationEngine

_OUTPUTS = ("random_average", "last_average", "last_iterate")


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


class O2NC(OwnUpdateModule[TreeAggregatedGaussian]):
    """Private zeroth-order online-to-nonconvex conversion (Algorithms 3–6).

    One ``training_step`` is one round (k, t). With D = δ/T (the ``smoothing`` δ over ``inner_steps`` T):

    * Δ_t = Π_D(Δ_{t−1} − η_{t−1}·g̃_{t−1}) (Δ_1 = 0; the learner restarts every epoch k),
      x_{t+1} = x_t + Δ_t and the query point w_t = x_t + s_t·Δ_t, s_t ~ U[0, 1];
    * ``variant="tree"``: g_1 = GRAD(w_1; B₁ examples), g_t = g_{t−1} + DIFF(w_t, w_{t−1}; B₂ examples),
      released as g̃_t = g_t + TREE(t); ``variant="naive"``: g̃_t = GRAD(w_t; B₂ examples) + N(0, σ²I);
    * after T rounds, w̄^k = mean of the w_t; the output is one w̄^k chosen uniformly (``output``).

    GRAD = (d/(2δ))·mean_{i,j} clip(f(w+δu_j; z_i) − f(w−δu_j; z_i), ±2δΛ)·u_j and
    DIFF = (d/δ)·mean_{i,j} clip(f(x+δu_j; z_i) − f(y+δu_j; z_i), ±Λ·‖x − y‖)·u_j with u_j uniform on
    the unit sphere of all d trainable coordinates. The clips make Λ (``clip``) the per-example
    Lipschitz bound the sensitivities need (a pl_dp choice: the paper assumes every f(·, z) is
    L-Lipschitz, which deep nets are not): s₁ = 2dΛ/B₁ (Lemma 3.1) and s_t ≤ 4dΛ/(B₂T) (Lemma 3.2)
    since ‖w_t − w_{t−1}‖ ≤ 2D (Remark 4.1; the projection is exact). Every node of the tree gets
    noise std z·max(s₁, s_t) per coordinate; each release is recorded as a leaf (pass, tree, leaf) in the
    :class:`~pl_dp.privacy.tree.TreeAccountant`'s ledger, which turns z into ε (replace-one adjacency).

    Deviations from the paper, all privacy-neutral (the sensitivity bounds hold for every draw):
    ``directions_per_sample`` m directions instead of d (``"d"`` restores the paper; variance grows
    by d/m); the m directions are shared by the examples of a batch (identical to the paper at the
    default B₂ = 1); the OSD step is AdaGrad-norm η_t = lr·D/√(Σ_{s≤t}‖g̃_s‖²) by default
    (the paper leaves η "tuned by OSD"; ``step_rule="constant"`` uses η = lr).

    **Scale warning.** The noise per coordinate is ∝ d·Λ/(B₂T ρ) against a gradient of norm ≤ Λ: the
    method is practical only for small d (hundreds to a few thousand parameters) and large n.

    Args:
        clip: Λ, the per-example Lipschitz bound enforced by clipping.
        smoothing: δ, the smoothing (Goldstein) radius; the guarantee is (2δ, ε)-stationarity.
        inner_steps: T, rounds per epoch (tree length).
        first_batch_size: B₁ (``None``: T·B₂/2 rounded up, the least with s₁ ≤ s_t; the paper uses T+1).
        batch_size: B₂, examples per DIFF round (and per round of the naive variant).
        output: ``"random_average"`` (the paper), ``"last_average"`` or ``"last_iterate"``; loaded into
            the net when training ends (post-processing: free).

    The private set is partitioned (not Poisson-sampled): each example is used in one round per pass.
    The datamodule's ``batch_size`` is not used. Mid-epoch checkpoints resume at the next epoch: the
    noise-free running sum and the tree's node noises are never saved (only g̃_t = g_t + TREE(t) is
    private, Algorithm 4), and the cut tree
    stays in the ledger with the leaves it released. A resume must find the same partition (private
    set size, B₁, B₂, T, variant and partition seed; the seed is not a secret, see
    :class:`~pl_dp.privacy.sampling.PartitionBatchSampler`) or it is refused. One process only: the
    partition sampler does not shard yet, so multi-process runs are refused.
    """

    supports_data_parallel = False
    default_accountant = "tree"
    release = TreeAggregatedGaussian
    #: the update is the online learner's projected step, which a StagewiseSchedule's proximal term does not enter
    applies_proximal_term = False

    def __init__(
        self,
        net: nn.Module,
        *,
        clip: float = 1.0,
        smoothing: float = 0.1,
        inner_steps: int = 8,
        directions_per_sample: int | str = 8,
        variant: str = "tree",
        first_batch_size: int | None = None,
        batch_size: int = 1,
        step_rule: str = "adagrad",
        output: str = "random_average",
        lr: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(net, lr=lr, **kwargs)
        check_positive("clip", clip)
        check_positive("smoothing", smoothing)
        if variant not in ("tree", "naive"):
            raise ConfigError(f"variant must be 'tree' or 'naive', got {variant!r}.")
        if step_rule not in ("adagrad", "constant"):
            raise ConfigError(f"step_rule must be 'adagrad' or 'constant', got {step_rule!r}.")
        if output not in _OUTPUTS:
            raise ConfigError(f"output must be one of {_OUTPUTS}, got {output!r}.")
        if directions_per_sample != "d":
            positive_integer("directions_per_sample", directions_per_sample)
        self.clip = float(clip)
        self.smoothing = float(smoothing)
        self.inner_steps = positive_integer("inner_steps", inner_steps)
        self.directions_per_sample = directions_per_sample
        self.variant = variant
        self.batch_size = positive_integer("batch_size", batch_size)
        default_first = math.ceil(self.inner_steps * self.batch_size / 2)
        self.first_batch_size = (
            self.batch_size
            if variant == "naive"
            else positive_integer("first_batch_size", default_first if first_batch_size is None else first_batch_size)
        )
        self.step_rule = step_rule
        self.output = output
        self._tree: TreeAggregatedGaussian | None = None
        self._engine: PerturbationEngine | None = None
        self._state: dict[str, Any] = {}

    # ---- plan and mechanism ------------------------------------------------------------------
    @property
    def radius(self) -> float:
        """D = δ/T, the online learner's domain radius (Remark 4.1: the privacy-critical bound)."""
        return self.smoothing / self.inner_steps

    @property
    def dim(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters())

    @property
    def directions(self) -> int:
        return self.dim if self.directions_per_sample == "d" else int(self.directions_per_sample)

    def sensitivity(self) -> float:
        """max over rounds of the L2 sensitivity of a leaf (replace-one; Lemmas 3.1–3.2 with Λ)."""
        d, lam = self.dim, self.clip
        grad = 2 * d * lam / self.first_batch_size
        if self.variant == "naive" or self.inner_steps == 1:
            return grad
        return max(grad, 4 * d * lam / (self.batch_size * self.inner_steps))

    def private_loader(self, dataset: Any, seed: int, collate_fn: Callable[[list], Any] = default_collate) -> Any:
        return partition_loader(
            dataset, self.first_batch_size, self.batch_size, self.inner_steps, seed, collate_fn=collate_fn
        )

    @property
    def tree_length(self) -> int:
        """Leaves per tree: T, or 1 for the naive variant (fresh noise every round)."""
        return 1 if self.variant == "naive" else self.inner_steps

    def private_sampler_of(self, loader: Any) -> PartitionBatchSampler | None:
        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, PartitionBatchSampler) or (
            (sampler.first_batch_size, sampler.batch_size, sampler.block_steps)
            != (self.first_batch_size, self.batch_size, self.inner_steps)
        ):
            raise PrivacyConfigError(
                "O2NC's accounting needs its own disjoint partition of the private set: train with a "
                "PrivatePublicDataModule (which asks the method for its loader) or O2NC.private_loader(dataset, seed)."
            )
        return sampler

    def _layout(self, sampler: PartitionBatchSampler) -> dict[str, int]:
        return sampler.layout | {"tree_length": self.tree_length}

    def prepare_accounting(self, sampler: PartitionBatchSampler, restored: dict[str, Any] | None) -> None:
        """Refuse a resume over another partition; plan the tree accountant's leaves from the next round on."""
        saved = (restored or {}).get("partition")
        layout = self._layout(sampler)
        if saved is not None and saved != layout:
            changes = ", ".join(
                f"{key} {saved.get(key)} -> {layout.get(key)}"
                for key in sorted(saved.keys() | layout.keys())
                if saved.get(key) != layout.get(key)
            )
            raise PrivacyConfigError(
                f"O2NC cannot resume over another partition of the private set ({changes}): the checkpoint's "
                "ledger counts released nodes per block of its own partition, and a new partition in the middle "
                "of a pass would reuse examples. Resume with the checkpoint's data, batch sizes, inner_steps, "
                "variant and datamodule seed, or start a new run."
            )
        self.accountant.plan(sampler.name, sampler.steps_per_epoch, self.tree_length, self._position)

    def mechanism(self, batch_size: int) -> TreeAggregatedGaussian:
        """The tree (or, for the naive variant, a length-1 tree: fresh noise every round)."""
        if self._tree is None or self._tree.noise_multiplier != self.noise_multiplier:
            self._tree = TreeAggregatedGaussian(self.noise_multiplier, self.sensitivity())
        return self._tree

    def on_train_start(self) -> None:
        super().on_train_start()
        self._engine = None  # rebuilt on the parameters as they are now
        if self.privacy is not None:
            self.log_noise_scale()

    def log_noise_scale(self) -> None:
        """Expected ‖TREE(t)‖ at its worst next to the clip Λ (a pl_dp diagnostic): is the run noise-dominated?"""
        nodes = tree_multiplicity(self.tree_length)
        expected = math.sqrt(nodes * self.dim) * self.noise_multiplier * self.sensitivity()
        if expected > 100 * self.clip:
            warnings.warn(
                f"O2NC noise: expected norm up to {expected:.3g} per release against gradients of norm "
                f"<= {self.clip:g} "
                f"(d={self.dim}, T={self.inner_steps}, B2={self.batch_size}); the run is noise-dominated — "
                "use a smaller model, more data per round, or a larger epsilon.",
                stacklevel=2,
            )

    @property
    def engine(self) -> PerturbationEngine:
        """The engine of the sphere directions, on the parameters as they are now (rebuilt after a move)."""
        if self._engine is None or self._engine.moved():
            self._engine = PerturbationEngine(
                self.trainable_parameters(), self.direction_seed, Direction("sphere", 1.0), masters=self.masters
            )
        return self._engine

    def master_parameters(self) -> list[torch.Tensor]:
        return self.trainable_parameters() if self._engine is None else self.engine.weights

    # ---- oracles ----------------------------------------------------------------------------
    @torch.no_grad()
    def _set(self, base: list[torch.Tensor], key: tuple[int, ...] | None = None, alpha: float = 0.0) -> None:
        """θ ← base + alpha·u(key), from the exact copy (no perturb/restore drift: D = δ/T is tiny).

        Written into the engine's weights (fp32 masters of half-precision parameters), then rounded into
        the parameters: the iterates x, w, Δ and the averages are kept at the weights' precision.
        """
        engine = self.engine
        scale = 0.0 if key is None else alpha * engine.scale(key)
        for i, (w, b) in enumerate(zip(engine.weights, base)):
            w.copy_(b)
            if key is not None:
                engine.accumulate(w, key, i, scale)
        engine.sync()

    def _oracle(
        self,
        evaluate: Any,
        batch_size: int,
        key_base: int,
        first: list[torch.Tensor],
        second: list[torch.Tensor] | None,
        bound: float,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """GRAD (``second=None``: f(w+δu) − f(w−δu), factor d/(2δ)) or DIFF (f(x+δu) − f(y+δu), factor d/δ).

        Each per-example difference is clamped to ±``bound``; non-finite ones count as 0.
        """
        engine, delta, m = self.engine, self.smoothing, self.directions
        factor = self.dim / (2 * delta if second is None else delta)
        out = [torch.zeros_like(w) for w in engine.weights]
        nonfinite = torch.zeros(())
        for j in range(m):
            key = (key_base, j)
            self._set(first, key, delta)
            upper = evaluate()
            self._set(first if second is None else second, key, -delta if second is None else delta)
            clipped, bad = clip_per_example(upper - evaluate(), bound)
            nonfinite = nonfinite + bad.sum()
            coeff = factor * float(clipped.sum()) / (batch_size * m)
            scale = coeff * engine.scale(key)
            for i, t in enumerate(out):
                engine.accumulate(t, key, i, scale)
        return out, nonfinite

    # ---- one round --------------------------------------------------------------------------
    @property
    def _position(self) -> int:
        """The sampler position of this round (the loader may have drawn batches ahead of it)."""
        return self._sampler_start + self._batches_consumed

    def _round(self) -> tuple[int, int, int]:
        return self._sampler.locate(self._position) if self._sampler is not None else (0, 0, 0)

    def _leaf(self, passes: int, block: int, t: int) -> TreeLeaf:
        """The leaf released in round t of block k: leaf t+1 of tree k, or (naive) a one-leaf tree per round."""
        name = self._sampler.name if self._sampler is not None else ""
        if self.variant == "naive":
            return TreeLeaf(name, passes, block * self.inner_steps + t, 1, 1)
        return TreeLeaf(name, passes, block, self.inner_steps, t + 1)

    def private_step(self, batch: Any, batch_size: int, mechanism: TreeAggregatedGaussian) -> StepResult:
        passes, block, t = self._round()
        st = self._state
        params = self.engine.weights
        x = [p.detach().clone() for p in params]
        if t == 0 or "displacement" not in st:  # Δ_t, the learner's move of the iterate (not the δ of (ε, δ)-DP)
            zeros = [torch.zeros_like(p) for p in params]
            st.update(displacement=zeros, grad_sq=0.0, w_sum=[torch.zeros_like(p) for p in params])
        g = torch.Generator().manual_seed(derive_seed(self.direction_seed, SeedDomain.O2NC_ROUNDS, passes, block, t))
        s = float(torch.rand((), generator=g))
        w = [xi + s * di for xi, di in zip(x, st["displacement"])]
        expected = self.first_batch_size if t == 0 else self.batch_size
        if batch_size > expected:  # fewer: examples the loader left out (unreadable), which contribute 0
            raise ValueError(f"O2NC round {t} got {batch_size} examples, its partition promises {expected}.")
        evaluate = self.private_losses(batch, batch_size)
        key = self.private_steps
        if t == 0 or self.variant == "naive":
            increment, nonfinite = self._oracle(evaluate, expected, key, w, None, 2 * self.smoothing * self.clip)
            st["running"] = increment
        else:
            gap = min(_norm([a - b for a, b in zip(w, st["w_prev"])]), 2 * self.radius)
            increment, nonfinite = self._oracle(evaluate, expected, key, w, st["w_prev"], self.clip * gap)
            st["running"] = [r + inc for r, inc in zip(st["running"], increment)]
        noisy = mechanism.release(self._leaf(passes, block, t), st["running"], self.noise)
        # x_{t+1} = x_t + Δ_t; then the learner's Δ_{t+1} = Π_D(Δ_t − η g̃_t)
        self._set([xi + di for xi, di in zip(x, st["displacement"])])
        noisy_norm = _norm(noisy)
        st["grad_sq"] += noisy_norm**2
        eta = self.lr if self.step_rule == "constant" else self.lr * self.radius / max(math.sqrt(st["grad_sq"]), 1e-30)
        moved = [d - eta * n for d, n in zip(st["displacement"], noisy)]
        norm = _norm(moved)
        shrink = min(1.0, self.radius / norm) if norm > 0 else 1.0
        st["displacement"] = [m_ * shrink for m_ in moved]
        st["w_prev"] = w
        st["w_sum"] = [a + wi for a, wi in zip(st["w_sum"], w)]
        if t == self.inner_steps - 1:
            self._close_epoch(passes, block)
        return StepResult({"train/noisy_gradient_norm": torch.tensor(noisy_norm)}, nonfinite)

    def _close_epoch(self, passes: int, block: int) -> None:
        """w̄^k, and the uniformly chosen output kept by reservoir sampling (one copy, exact uniform)."""
        st = self._state
        average = [a / self.inner_steps for a in st["w_sum"]]
        st["averages"] = st.get("averages", 0) + 1
        st["last_average"] = average
        g = torch.Generator().manual_seed(derive_seed(self.direction_seed, SeedDomain.O2NC_ROUNDS, passes, block, -1))
        if float(torch.rand((), generator=g)) * st["averages"] < 1.0:
            st["output_average"] = average

    # ---- outputs ------------------------------------------------------------------------------
    @property
    def output_average(self) -> list[torch.Tensor] | None:
        """w̄ ~ Uniform{w̄¹..w̄ᴷ} (Algorithm 3's output), or None before the first epoch ends."""
        return self._state.get("output_average")

    @property
    def last_average(self) -> list[torch.Tensor] | None:
        """w̄ᴷ, the average of the last complete epoch."""
        return self._state.get("last_average")

    def on_train_end(self) -> None:
        chosen = {"random_average": self.output_average, "last_average": self.last_average}.get(self.output)
        if self.output != "last_iterate":
            if chosen is None:
                warnings.warn("O2NC ended before its first epoch of T rounds: keeping the last iterate.", stacklevel=2)
            else:
                self._set(chosen)

    # ---- checkpointing ------------------------------------------------------------------------
    _SAVED = ("displacement", "grad_sq", "w_sum", "w_prev", "averages", "last_average", "output_average")

    def __getstate__(self) -> dict[str, Any]:
        """As a checkpoint: the noise-free running sum and the tree's node noises are left out of copies too."""
        state = super().__getstate__()
        state["_state"] = {k: v for k, v in self._state.items() if k in self._SAVED}
        return state

    def privacy_state_dict(self) -> dict[str, Any]:
        state = super().privacy_state_dict()
        # only post-processing of released values: never the noise-free running sum or the node noises
        state["o2nc"] = {k: v for k, v in self._state.items() if k in self._SAVED}
        if isinstance(self._sampler, PartitionBatchSampler):
            state["partition"] = self._layout(self._sampler)
        return state

    def load_privacy_state_dict(self, state: dict[str, Any]) -> None:
        saved = dict(state.get("o2nc", {}))
        if "delta" in saved:  # pl_dp 0.2 and earlier saved the displacement Δ_t as "delta"
            saved["displacement"] = saved.pop("delta")
        sampler = state.get("sampler")
        if sampler is not None and sampler["position"] % self.inner_steps:
            # mid-epoch: the running sum is gone, so start the next epoch from the saved iterate
            sampler = dict(sampler, position=-(-sampler["position"] // self.inner_steps) * self.inner_steps)
            state = dict(state, sampler=sampler)
            for k in ("displacement", "grad_sq", "w_sum", "w_prev"):
                saved.pop(k, None)
            warnings.warn(
                "O2NC resumes at the start of the next epoch: a mid-epoch checkpoint holds no private running sum.",
                stacklevel=2,
            )
        super().load_privacy_state_dict(state)
        self._state = saved
