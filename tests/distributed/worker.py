"""The same private fits on 1 process or on N CPU processes (Lightning DDP over gloo).

``python tests/distributed/worker.py DEVICES OUT_DIR`` writes ``OUT_DIR/rank{r}.json`` per rank;
tests/distributed/test_ddp.py compares them with the single-process results of :func:`run_all`.
Lightning's DDP launcher re-runs this file for ranks 1..N−1.

``python tests/distributed/worker.py sharded OUT_DIR`` runs :data:`SHARDED_METHODS` on 2 CPU processes under
``ModelParallelStrategy`` (FSDP2: each rank holds half of every parameter), for tests/distributed/test_fsdp.py.

``python tests/distributed/worker.py nodes OUT_DIR`` is one node of a multi-node run as a cluster launches it
(``torchrun`` or SLURM set ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK`` and ``LOCAL_RANK``; the
caller starts one such process per node): ``Trainer(num_nodes=WORLD_SIZE, devices=1)``, :data:`NODE_METHODS` only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.callbacks import PruningSchedule, StagewiseSchedule
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import PrivacyConfigError
from pl_dp.methods import DPSGD, PAZOM, PAZOP, PAZOS, Coupling, DPZero
from tests.background import Command

STEPS = 4
SIGMA = 1.3
CLIP = 1.0
BATCH = 16
N_PRIVATE = 96


def _blobs(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    centers = torch.randn(4, 12, generator=torch.Generator().manual_seed(1)) * 2
    return TensorDataset(centers[y] + torch.randn(n, 12, generator=g), y)


def _root_loss(net, batch):
    x, y = batch
    out = net(x)
    return nn.functional.cross_entropy(out, y, reduction="none") + out[:, 0].abs().sqrt()


_ARMED = {"on": False}


class Arm(L.Callback):
    """Arms :func:`_touchy_loss` for the training steps only: the fit-start checks see a well-behaved loss."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _ARMED["on"] = True

    def on_train_end(self, trainer, pl_module):
        _ARMED["on"] = False


def _touchy_loss(net, batch):
    """Raises, after the net's forward, for a batch holding a marked record (first feature 99) once armed: a loss
    that passes the pre-flight pass and fails inside a step, for the record sampled only."""
    x, y = batch
    out = net(x)
    if _ARMED["on"] and bool((x[:, 0] == 99.0).any()):
        raise ValueError("a touchy record")
    return nn.functional.cross_entropy(out, y, reduction="none")


class TouchyBetween(nn.Module):
    """Raises *between* its two layers for a batch holding a marked record (first feature 99), once armed: under
    FSDP2 the rank that sampled it has gathered the first layer, the others go on to gather the second."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(12, 16), nn.Linear(16, 4)

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        if _ARMED["on"] and bool((x[:, 0] == 99.0).any()):
            raise ValueError("a touchy record, between two layers")
        return self.second(hidden)


class TouchyLayer(nn.Linear):
    """A layer that raises inside its own forward — after FSDP2 gathered it — for a marked record, once armed."""

    def forward(self, x):
        out = super().forward(x)
        if _ARMED["on"] and bool((x[:, 0] == 99.0).any()):
            raise ValueError("a touchy record, inside a layer")
        return out


class TouchyReused(nn.Module):
    """Runs its layer ``shared`` twice in a forward, and raises inside the first call: the rank that raised holds
    ``shared`` gathered, and must still gather it again, as the others do for its second call."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.shared, self.last = nn.Linear(12, 16), TouchyLayer(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        hidden = torch.cat([x[:, :1], torch.tanh(self.first(x))[:, 1:]], dim=1)  # the marker reaches ``shared``
        return self.last(torch.tanh(self.shared(torch.tanh(self.shared(hidden)))))


class TouchyAuxiliary(TouchyBetween):
    """:class:`TouchyBetween` with an auxiliary head run in training mode only (deep supervision): the zeroth-order
    passes (eval mode) gather other layers than the public gradient's forward (training mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.auxiliary = nn.Linear(16, 4)

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        if _ARMED["on"] and bool((x[:, 0] == 99.0).any()):
            raise ValueError("a touchy record, between two layers")
        out = self.second(hidden)
        return out + 0.1 * self.auxiliary(hidden) if self.training else out


class TouchyCheckpointed(nn.Module):
    """Raises between its first two layers for a marked record, once armed; its middle layer runs under activation
    checkpointing in training mode, so the backward runs (and gathers) it a second time."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        if _ARMED["on"] and bool((x[:, 0] == 99.0).any()):
            raise ValueError("a touchy record, between two layers")
        if self.training and torch.is_grad_enabled():
            hidden = torch.utils.checkpoint.checkpoint(self.middle, hidden, use_reentrant=False)
        else:
            hidden = self.middle(hidden)
        return self.last(torch.tanh(hidden))


class ScaledBlock(nn.Module):
    """A layer inside a module that holds a parameter of its own (a layer-scale gain): both are sharded, the layer
    first (FSDP2 shards children before their parents)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.gain = nn.Linear(16, 16), nn.Parameter(torch.full((16,), 0.5))

    def forward(self, x):
        return torch.tanh(self.layer(x)) * self.gain


def _layer_scale() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), ScaledBlock(), nn.Linear(16, 4))


def _touchy(method, net: nn.Module, **kwargs):
    """A sharded fit of ``method`` on ``net`` in which the marked records raise inside a step once armed (:class:`Arm`),
    in micro-batches of 4 (so that failures are retried example by example in passes every rank runs)."""
    return method(net, clip=CLIP, privacy=_spec(), noise_seed=7, max_physical_batch_size=4, **kwargs)


def _zero_gradient_loss(net, batch):
    x, _ = batch
    return (net(x) * 0.0).sum(dim=1)


def _spec() -> PrivacySpec:
    return PrivacySpec(epsilon=50.0, accountant="rdp", noise_multiplier=SIGMA)


class OwnConfigureModel(DPSGD):
    """A method whose ``configure_model`` (Lightning's place to build a net) does not call pl_dp's: the layout of its
    steps over the ranks must still be DDP's (found by an independent review: it ran as one process per rank)."""

    def configure_model(self) -> None:
        pass


METHODS = {
    "dpzero": lambda: DPZero(nn.Linear(12, 4), lr=0.05, clip=CLIP, queries=3, privacy=_spec(), noise_seed=7),
    "pazo_m": lambda: PAZOM(nn.Linear(12, 4), lr=0.05, clip=CLIP, queries=2, alpha=0.5, privacy=_spec(), noise_seed=7),
    "pazo_s": lambda: PAZOS(nn.Linear(12, 4), lr=0.1, clip=2.0, k=2, privacy=_spec(), noise_seed=7),
    "dpsgd": lambda: DPSGD(nn.Linear(12, 4), lr=0.5, clip=CLIP, privacy=_spec(), noise_seed=7),
    "coupling": lambda: Coupling(nn.Linear(12, 4), lr=0.5, clip=CLIP, alpha=0.3, privacy=_spec(), noise_seed=7),
    "own_configure_model": lambda: OwnConfigureModel(
        nn.Linear(12, 4), lr=0.5, clip=CLIP, privacy=_spec(), noise_seed=7
    ),
    # entropy-drawn secrets (noise key, sampling seed) and a different global seed on every rank: rank 0's
    # secrets and direction seed must be shared, in memory, for the replicas to stay identical
    "dpzero_rank_seeded": lambda: DPZero(nn.Linear(12, 4), lr=0.05, clip=CLIP, queries=3, privacy=_spec()),
    "dpsgd_zero_grad": lambda: DPSGD(
        nn.Linear(64, 16), loss=_zero_gradient_loss, lr=1.0, clip=CLIP, privacy=_spec(), noise_seed=7
    ),
    # banded correlated noise over cyclic Poisson sampling: every rank keeps the same past noise and the same groups
    "dpsgd_banded": lambda: DPSGD(
        nn.Linear(12, 4), lr=0.5, clip=CLIP, privacy=_spec(), noise_seed=7, noise="banded", bands=3
    ),
}


class NoEmptyBatches(nn.Sequential):
    """A net that refuses an empty batch (as Hugging Face attention does): a sharded rank with fewer examples than
    another must not run it on one."""

    def forward(self, x):
        if x.shape[0] == 0:
            raise RuntimeError("an empty batch")
        return super().forward(x)


def _no_empty() -> nn.Module:
    return NoEmptyBatches(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


#: micro-batches of 3: ranks with fewer of them pad their passes (with a fixed non-private example)
_NO_EMPTY = dict(
    clip=CLIP,
    privacy=PrivacySpec(epsilon=50.0, accountant="rdp", noise_multiplier=SIGMA),
    noise_seed=7,
    max_physical_batch_size=3,
)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


class _Bfloat16Inputs(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)


def _bf16_mlp() -> nn.Module:
    return nn.Sequential(_Bfloat16Inputs(), *_mlp()).to(torch.bfloat16)


class PreshardedDPSGD(DPSGD, shardable=True):
    """A user's subclass that shards the net itself, with FSDP2's defaults (which average the ranks' gradients)."""

    def configure_model(self) -> None:
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
        super().configure_model()


#: the fits of the FSDP2 test: the same seeds as their DDP and single-process runs
SHARDED_METHODS = {
    **{name: METHODS[name] for name in ("dpzero", "dpzero_rank_seeded", "pazo_m", "pazo_s")},
    "pazo_p": lambda: PAZOP(_mlp(), lr=0.05, clip=CLIP, queries=2, k=2, privacy=_spec(), noise_seed=7),
    # book-keeping (the default) adds each rank's clipped sums from its book over the ranks; ghost clipping has FSDP
    # reduce-scatter its second backward
    **{
        f"dpsgd_{mode}_mlp": lambda mode=mode: DPSGD(
            _mlp(), lr=0.5, clip=CLIP, per_sample=mode, privacy=_spec(), noise_seed=7, max_physical_batch_size=3
        )
        for mode in ("ghost", "bk")
    },
    # rows of zeros in the private set give a NaN gradient (√|0| of a bias-free layer) with a finite loss: the
    # rank that samples one must make every rank run the micro-batch again without it
    # one example per pass: a rank pads a round while another reruns it without a non-finite example — the padding
    # must stay at weight 0 then too (found by an independent review: it joined the sum, sensitivity 2C)
    **{
        f"dpsgd_{mode}_nonfinite": lambda mode=mode: DPSGD(
            nn.Linear(12, 4, bias=False),
            loss=_root_loss,
            lr=0.5,
            clip=CLIP,
            per_sample=mode,
            privacy=_spec(),
            noise_seed=7,
            max_physical_batch_size=1,
        )
        for mode in ("ghost", "bk")
    },
    "dpsgd_bk_touchy": lambda: _touchy(DPSGD, _mlp(), loss=_touchy_loss, lr=0.5, per_sample="bk"),
    "dpzero_touchy": lambda: _touchy(DPZero, nn.Linear(12, 4), loss=_touchy_loss, lr=0.05, queries=2),
    "dpsgd_ghost_touchy": lambda: _touchy(DPSGD, _mlp(), loss=_touchy_loss, lr=0.5, per_sample="ghost"),
    "dpzero_touchy_net": lambda: _touchy(DPZero, TouchyBetween(), lr=0.05, queries=2),
    "dpsgd_ghost_touchy_net": lambda: _touchy(DPSGD, TouchyBetween(), lr=0.5, per_sample="ghost"),
    # a public gradient (a backward outside the guarded passes) after a step whose last pass failed on one rank only
    "pazo_m_touchy_net": lambda: _touchy(PAZOM, TouchyBetween(), lr=0.05, queries=2, alpha=0.5),
    "pazo_m_touchy_auxiliary": lambda: _touchy(PAZOM, TouchyAuxiliary(), lr=0.05, queries=2, alpha=0.5),
    # its head for training runs in no eval-mode pass of ghost clipping (the fit-start checks)
    "dpsgd_ghost_touchy_auxiliary": lambda: _touchy(DPSGD, TouchyAuxiliary(), lr=0.5, per_sample="ghost"),
    "dpzero_touchy_reused": lambda: _touchy(DPZero, TouchyReused(), lr=0.05, queries=2),
    "dpsgd_ghost_touchy_checkpointed": lambda: _touchy(DPSGD, TouchyCheckpointed(), lr=0.5, per_sample="ghost"),
    "dpzero_layer_scale": lambda: DPZero(_layer_scale(), lr=0.05, clip=CLIP, queries=2, privacy=_spec(), noise_seed=7),
    "dpzero_no_empty": lambda: DPZero(_no_empty(), lr=0.05, **_NO_EMPTY),
    "dpsgd_ghost_no_empty": lambda: DPSGD(_no_empty(), lr=0.5, per_sample="ghost", **_NO_EMPTY),
    "dpsgd_ghost_presharded": lambda: PreshardedDPSGD(
        _mlp(), lr=0.5, clip=CLIP, per_sample="ghost", privacy=_spec(), noise_seed=7
    ),
    "coupling_ghost": lambda: Coupling(
        nn.Linear(12, 4), lr=0.5, clip=CLIP, alpha=0.3, per_sample="ghost", privacy=_spec(), noise_seed=7
    ),
    # banded noise on sharded parameters: each rank runs the recursion on its block of every draw
    "dpsgd_ghost_banded": lambda: DPSGD(
        _mlp(), lr=0.5, clip=CLIP, per_sample="ghost", privacy=_spec(), noise_seed=7, noise="banded", bands=3
    ),
    "dpzoso": lambda: DPZero(_mlp(), lr=0.05, clip=CLIP, queries=2, privacy=_spec(), noise_seed=7),
    "dpzopo": lambda: DPZero(_mlp(), lr=0.05, clip=CLIP, queries=2, privacy=_spec(), noise_seed=7),
    "dpzero_sphere_mlp": lambda: DPZero(
        _mlp(), lr=0.05, clip=CLIP, queries=2, direction="sphere", privacy=_spec(), noise_seed=7
    ),
    # bf16 weights trained through fp32 masters, which a sharded checkpoint must hold by shard
    "dpzero_bf16_mlp": lambda: DPZero(_bf16_mlp(), lr=0.05, clip=CLIP, queries=2, privacy=_spec(), noise_seed=7),
    "dpzero_lowrank_mlp": lambda: DPZero(
        _mlp(),
        lr=0.05,
        clip=CLIP,
        queries=2,
        direction="lowrank",
        privacy=_spec(),
        noise_seed=7,
        max_physical_batch_size=3,
    ),
}


#: the sharded fits killed and resumed from their distributed checkpoint (a folder of shards), by result key
RESUMED = {"resumed": "dpzero_sphere_mlp", "resumed_bf16": "dpzero_bf16_mlp"}

#: callbacks of a fit beside the byte counter: DP-ZOSO is DPZero with a stagewise schedule (and its proximal term)
CALLBACKS = {
    "dpzoso": lambda: [StagewiseSchedule(stages=2, proximal=0.05)],
    # DP-ZOPO: the score of each stage runs the whole parameters through the net's structure, on every rank
    "dpzopo": lambda: [
        StagewiseSchedule(stages=2, proximal=0.05),
        PruningSchedule(rates=[0.3, 0.6], strategy="incremental", importance="rank", input_shape=(1, 12)),
    ],
    **{name: lambda: [Arm()] for name in SHARDED_METHODS if "touchy" in name},
}


class CollectiveBytes(L.Callback):
    """Bytes passed to torch.distributed collectives between the first and the last training step."""

    def __init__(self) -> None:
        self.bytes = 0
        self.counting = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counting = True

    def on_train_end(self, trainer, pl_module):
        self.counting = False


_COUNTERS: list[CollectiveBytes] = []


def _instrument() -> None:
    for name in ("all_reduce", "broadcast", "all_gather", "reduce", "all_gather_into_tensor", "reduce_scatter"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(tensor, *args, _original=original, **kwargs):
            for counter in _COUNTERS:
                if counter.counting and isinstance(tensor, torch.Tensor):
                    counter.bytes += tensor.numel() * tensor.element_size()
            return _original(tensor, *args, **kwargs)

        setattr(dist, name, counted)


def _data(name: str) -> PrivatePublicDataModule:
    if name == "dpsgd_zero_grad":
        private = TensorDataset(torch.randn(N_PRIVATE, 64), torch.zeros(N_PRIVATE, dtype=torch.long))
    else:
        private = _blobs(N_PRIVATE, 0)
    if name.endswith("_nonfinite"):
        private.tensors[0][::5] = 0.0
    if "touchy" in name:
        private.tensors[0][::9, 0] = 99.0
    # seeded: 1 and 2 processes draw the same batches
    sampling_seed = None if name in ("dpzero_rank_seeded", "dpsgd_banded_workers") else 11
    return PrivatePublicDataModule(
        private,
        public=_blobs(40, 3),
        batch_size=BATCH,
        public_batch_size=8,
        seed=11,
        sampling_seed=sampling_seed,
        num_workers=1 if name == "dpsgd_banded_workers" else 0,
    )


#: the fits of the multi-node test (one of each family, and entropy-drawn secrets)
NODE_METHODS = ("dpzero", "dpsgd", "dpzero_rank_seeded")


def _flat(net: nn.Module) -> torch.Tensor:
    """The whole parameters, gathered from their shards when sharded (a collective: every rank calls it)."""
    whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in net.parameters()]
    return torch.cat([p.detach().flatten() for p in whole])


def run_one(
    name: str,
    devices: int,
    num_nodes: int = 1,
    sharded: bool = False,
    steps: int = STEPS,
    checkpoints: str | None = None,
    ckpt_path: str | None = None,
) -> dict:
    """One fit of ``name``; with ``checkpoints``, a checkpoint every 2 steps there, and ``ckpt_path`` resumes one."""
    if name == "dpzero_rank_seeded":
        torch.manual_seed(1000 + int(os.environ.get("LOCAL_RANK", 0)))
    else:
        L.seed_everything(0)
    model = {**METHODS, **SHARDED_METHODS, **REFUSED}[name]()
    start = _flat(model.net)
    if sharded:
        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    else:
        strategy = "ddp" if devices * num_nodes > 1 else "auto"
    counter = CollectiveBytes()
    _COUNTERS[:] = [counter]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=checkpoints is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[counter, *CALLBACKS.get(name, list)()]
        + ([ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_top_k=-1)] if checkpoints else []),
    )
    trainer.fit(model, _data(name), ckpt_path=ckpt_path)
    end = _flat(model.net)
    sampler = model._sampler
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "parameters": end.tolist(),
        "update": (end - start).tolist(),
        "epsilon": model.epsilon,
        "private_steps": model.private_steps,
        "direction_seed": model.direction_seed,
        "nonfinite_total": model.nonfinite_total,
        "expected_batch_size": model.expected_batch_size,
        "sample_rate": model.sample_rate,
        "pl_dp_bytes_per_step": model.collective_bytes / STEPS,
        "dist_bytes_per_step": counter.bytes / STEPS,
        "dimension": int(end.numel()),
        "sampler": {"num_replicas": sampler.num_replicas, "rank": sampler.rank},
    }


def run_lora(name: str, devices: int, directory: Path) -> dict:
    """DPZero or ghost DP-SGD on LoRA adapters of a tiny BERT (peft), sharded on ``devices`` > 1 processes."""
    from pl_dp.data import TextDataModule
    from pl_dp.nets import HFClassifier
    from tests.nets.test_prompt import LABELS, TEXTS
    from tests.tiny_hf import tiny_model

    path = directory / "bert-cls"
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        tiny_model(path, "bert-cls")
    L.seed_everything(0)
    net = HFClassifier(path, trainable="lora", lora_rank=4, lora_targets=["query", "value"])
    net.eval()  # dropout off: the same parameters as one process, not only the same law
    kwargs = dict(lr=0.5, clip=CLIP, privacy=_spec(), noise_seed=7)
    model = DPZero(net, smoothing=1e-2, **kwargs) if name == "dpzero" else DPSGD(net, per_sample="ghost", **kwargs)
    data = TextDataModule(
        (TEXTS * 4, LABELS * 4), val=(TEXTS, LABELS), test_fraction=0, tokenizer=path, batch_size=8, sampling_seed=11
    )
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1) if devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, data)
    trained = [n for n, p in model.net.named_parameters() if p.requires_grad]
    return {"rank": trainer.global_rank, "parameters": _flat(model.net).tolist(), "trained": trained}


def launch_command(mode: str, out: Path) -> Command:
    """``worker.py mode out``, run as 2 processes (Lightning's launcher starts rank 1)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(PYTHONPATH=str(root), PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    return Command([sys.executable, __file__, mode, str(out)], env=env, cwd=root, timeout=400)


def launch_results(out: Path, proc: subprocess.CompletedProcess) -> list[dict]:
    """Each rank's results of a :func:`launch_command` run that ended as ``proc``."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def launch(mode: str, out: Path) -> list[dict]:
    """Run ``worker.py mode out`` as 2 processes (Lightning's launcher starts rank 1); each rank's results."""
    command = launch_command(mode, out)
    proc = subprocess.run(
        command.args,
        cwd=command.cwd,
        env=dict(os.environ, **command.env),
        capture_output=True,
        text=True,
        timeout=command.timeout,
    )
    return launch_results(out, proc)


#: fits every rank must refuse at fit start, before any release: their refusals' messages are the results
REFUSED = {
    # banded noise whose loader's workers drew with each rank's own (unseeded) sampling seed before the ranks share one
    "dpsgd_banded_workers": METHODS["dpsgd_banded"],
}


def run_all(devices: int) -> dict:
    results: dict = {name: run_one(name, devices) for name in METHODS}
    for name in REFUSED:
        try:
            run_one(name, devices)
            results[name] = None
        except PrivacyConfigError as err:
            results[name] = str(err)
    return results


if __name__ == "__main__":
    _instrument()
    out = Path(sys.argv[2])
    if sys.argv[1] == "lora":
        results = {name: run_lora(name, 2, out) for name in ("dpzero", "ghost")}
    elif sys.argv[1] == "sharded":
        results = {name: run_one(name, 2, sharded=True) for name in SHARDED_METHODS}
        for key, name in RESUMED.items():  # killed after 2 steps and resumed
            run_one(name, 2, sharded=True, steps=2, checkpoints=str(out / key))
            results[key] = run_one(name, 2, sharded=True, ckpt_path=str(out / key / "epoch=0-step=2.ckpt"))
    elif sys.argv[1] == "nodes":
        nodes = int(os.environ["WORLD_SIZE"])
        results = {name: run_one(name, 1, num_nodes=nodes) for name in NODE_METHODS}
    else:
        results = run_all(int(sys.argv[1]))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{results['dpzero']['rank']}.json").write_text(json.dumps(results))
