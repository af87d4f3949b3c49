"""O2NC: the learner stays in its ball, the toy problem is solved, resume never leaks the running sum."""

import dp_accounting
import dp_accounting.rdp
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.methods import O2NC
from tests.conftest import make_trainer
from tests.methods.test_checkpoint import Crash


class Point(nn.Module):
    def __init__(self, start):
        super().__init__()
        self.x = nn.Parameter(torch.full((4,), float(start)))


def l1_loss(net, batch):
    """f(x; z) = ‖x − z‖₁: convex, nonsmooth, 2-Lipschitz in x (d = 4)."""
    return (net.x - batch[0]).abs().sum(dim=1)


def _data(n=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g) * 0.3, torch.zeros(n, dtype=torch.long))


def _objective(x, data):
    return float((x.detach() - data.tensors[0]).abs().sum(dim=1).mean())


def _model(privacy=None, **kw):
    L.seed_everything(0)
    args = dict(loss=l1_loss, lr=1.0, clip=2.0, smoothing=0.5, inner_steps=8, batch_size=2, directions_per_sample=4)
    args.update(kw)
    return O2NC(Point(3.0), privacy=privacy, noise_seed=11, **args)


class Moves(L.Callback):
    def __init__(self):
        self.displacement, self.w_gap = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        st = pl_module._state
        moved = torch.cat([d.reshape(-1) for d in st["displacement"]])
        self.displacement.append(float(torch.linalg.vector_norm(moved)))
        if hasattr(self, "w"):
            self.w_gap.append(float((st["w_prev"][0] - self.w).norm()))
        self.w = st["w_prev"][0].clone()


def test_learner_never_leaves_its_ball_and_query_points_move_at_most_2D():
    model, moves = _model(PrivacySpec(50.0, accountant="tree")), Moves()
    make_trainer(max_epochs=1, callbacks=[moves]).fit(model, PrivatePublicDataModule(_data(400), batch_size=1))
    D = model.radius
    assert max(moves.displacement) <= D * (1 + 1e-6) and max(moves.displacement) > 0.5 * D  # the projection binds
    assert max(moves.w_gap) <= 2 * D * (1 + 1e-6)


def test_nonsmooth_toy_nonprivate_reaches_the_optimum_and_private_makes_progress():
    data = _data()
    start = _objective(torch.full((4,), 3.0), data)
    optimum = _objective(torch.zeros(4), data)
    model = _model()
    make_trainer(max_epochs=3).fit(model, PrivatePublicDataModule(data, batch_size=1))
    reached = _objective(model.net.x, data)
    assert reached - optimum < 0.05 * (start - optimum)
    private = _model(PrivacySpec(epsilon=50.0, accountant="tree"))
    make_trainer(max_epochs=3).fit(private, PrivatePublicDataModule(data, batch_size=1))
    assert _objective(private.net.x, data) < start - 0.3 * (start - optimum)
    assert private.epsilon <= 50.0 and private.accountant.steps == private.private_steps
    assert private.epsilon == pytest.approx(50.0, rel=0.01)  # the calibration's plan is what the ledger recorded


def test_naive_variant_runs_and_is_accounted_per_step():
    model = _model(PrivacySpec(epsilon=50.0, accountant="tree"), variant="naive")
    make_trainer(max_epochs=1).fit(model, PrivatePublicDataModule(_data(400), batch_size=1))
    assert model.first_batch_size == model.batch_size == 2
    assert {run.tree_length for run in model.accountant.history} == {1} and model.epsilon <= 50.0
    assert model.accountant.steps == model.private_steps


def test_sensitivity_and_clear_errors():
    model = _model(inner_steps=8, batch_size=2)
    d, lam = 4, 2.0
    assert model.first_batch_size == 8  # ceil(T * B2 / 2): the least B1 with s1 <= s_t
    assert model.sensitivity() == pytest.approx(max(2 * d * lam / 8, 4 * d * lam / (2 * 8)))
    assert _model(PrivacySpec(epsilon=1.0)).accountant_name == "tree"  # the method's own accountant by default
    with pytest.raises(PrivacyConfigError, match=r"accountant=None\) \(its own, 'tree'\)"):
        _model(PrivacySpec(epsilon=1.0, accountant="prv"))
    with pytest.raises(ConfigError, match="too few for one block"):
        make_trainer(max_epochs=1).fit(_model(), PrivatePublicDataModule(_data(10), batch_size=1))


def test_reading_the_private_sampler_changes_no_state():
    model = _model(PrivacySpec(epsilon=5.0, accountant="tree"))
    loader = model.private_loader(_data(400), seed=0)
    before = dict(vars(model.accountant))
    assert model.private_sampler_of(loader) is loader.batch_sampler
    assert vars(model.accountant) == before


def test_resume_at_an_epoch_boundary_is_exact_and_mid_epoch_skips_to_the_next(tmp_path):
    spec = PrivacySpec(epsilon=50.0, accountant="tree")
    reference = _model(spec)
    make_trainer(max_epochs=1).fit(reference, PrivatePublicDataModule(_data(400), batch_size=1))
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_epochs=1, callbacks=[ckpt, Crash(20)], enable_checkpointing=True).fit(
            _model(spec), PrivatePublicDataModule(_data(400), batch_size=1)
        )
    saved = torch.load(tmp_path / "step=16.ckpt", weights_only=False)["pl_dp"]
    assert "running" not in saved["o2nc"]  # the noise-free running sum never reaches a checkpoint
    resumed = _model(spec)
    make_trainer(max_epochs=1).fit(
        resumed, PrivatePublicDataModule(_data(400), batch_size=1), ckpt_path=str(tmp_path / "step=16.ckpt")
    )
    assert resumed.epsilon == reference.epsilon
    assert torch.equal(resumed.net.x, reference.net.x)
    old = dict(saved, o2nc=dict(saved["o2nc"]))  # as pl_dp 0.2 wrote it: the displacement Δ_t saved as "delta"
    old["o2nc"]["delta"] = old["o2nc"].pop("displacement")
    from_old = _model(spec)
    from_old.load_privacy_state_dict(old)
    assert "delta" not in from_old._state and from_old._state["displacement"] is saved["o2nc"]["displacement"]
    skipped = _model(spec)
    with pytest.warns(UserWarning, match="next epoch"):
        make_trainer(max_epochs=1).fit(
            skipped, PrivatePublicDataModule(_data(400), batch_size=1), ckpt_path=str(tmp_path / "step=19.ckpt")
        )
    assert skipped.private_steps == reference.private_steps - 5  # rounds 20-24 of epoch 3 are never run


def test_oracles_stay_within_their_sensitivity_on_adversarial_losses():
    """Replace one example's losses by huge values: GRAD and DIFF move by at most s1 and s_t (clipping)."""
    from pl_dp.zo.engine import Direction, PerturbationEngine

    model = _model(inner_steps=8, batch_size=2, first_batch_size=8)
    model._engine = PerturbationEngine(model.trainable_parameters(), 0, Direction("sphere", 1.0))
    w = [p.detach().clone() for p in model._engine.params]
    y = [t + model.radius * 0.9 for t in w]

    def evaluator(batch_size, hostile):
        calls = iter(range(10_000))

        def evaluate():  # only example 0 differs between the two runs
            call = next(calls)
            values = torch.full((batch_size,), float(call % 2))
            if hostile:
                values[0] = 1e6 * (-1) ** call
            return values

        return evaluate

    lam, delta, d = model.clip, model.smoothing, model.dim
    gap = float(torch.cat([(a - b).reshape(-1) for a, b in zip(y, w)]).norm())
    for batch, second, bound, limit in [
        (8, None, 2 * delta * lam, 2 * d * lam / 8),
        (2, w, lam * gap, 2 * d * lam * gap / (2 * delta)),
    ]:
        outs = [
            model._oracle(evaluator(batch, hostile), batch, 5, y if second is not None else w, second, bound)[0]
            for hostile in (False, True)
        ]
        change = float(torch.cat([(a - b).reshape(-1) for a, b in zip(*outs)]).norm())
        assert 0 < change <= limit * (1 + 1e-5)


# ---- accounting across resumes: what was released, never re-derived from today's config ----------------------------


def _indexed_data(n=400):
    """The toy data with each example's index as its target, so a callback can see which examples a round used."""
    data = _data(n)
    return TensorDataset(data.tensors[0], torch.arange(n))


class Releases(L.Callback):
    """Records (private step, example indices) of every round and the epsilon after it."""

    def __init__(self):
        self.rounds, self.epsilons = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rounds.append((pl_module.private_steps, batch[1].tolist()))
        self.epsilons.append(pl_module.epsilon)


def _worst_example_nodes(rounds, first_batch_size):
    """The most released tree nodes that contain one example, counted from the rounds that ran.

    A round of B1 examples starts a tree (GRAD); the B2-rounds after it are its next leaves. After n leaves of a
    tree the released nodes are the dyadic intervals (b - lowbit(b) + 1, b) for b = 1..n (Zhang et al. 2024, Alg. 5).
    """
    trees = []
    for examples in rounds:
        if len(examples) == first_batch_size:
            trees.append([])
        trees[-1].append(examples)
    count = {}
    for leaves in trees:
        nodes = [(b - (b & -b) + 1, b) for b in range(1, len(leaves) + 1)]
        for leaf, examples in enumerate(leaves, start=1):
            for example in examples:
                count[example] = count.get(example, 0) + sum(a <= leaf <= b for a, b in nodes)
    return max(count.values())


def _epsilon_of_nodes(nodes, z, delta):
    """ε of ``nodes`` Gaussian releases with multiplier z (dp-accounting's RDP accountant, independent of pl_dp)."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), nodes))
    return accountant.get_epsilon(delta)


def test_a_mid_epoch_resume_accounts_every_node_the_worst_example_is_in(tmp_path):
    """The audit's first case: kill inside a tree, resume (the rest of that tree is skipped), and run 3 rounds into
    the second pass. The worst example then sits in 4 + 2 released nodes; counting passes from the number of steps
    (which lags the sampler by the skipped rounds) said 4."""
    spec = PrivacySpec(epsilon=50.0, accountant="tree", noise_multiplier=2.0)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    crashed = Releases()
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(max_steps=142, callbacks=[crashed, ckpt, Crash(20)], enable_checkpointing=True).fit(
            _model(spec), PrivatePublicDataModule(_indexed_data(), batch_size=1)
        )
    saved = torch.load(tmp_path / "step=19.ckpt", weights_only=False)["pl_dp"]
    resumed, after = _model(spec), Releases()
    with pytest.warns(UserWarning, match="next epoch"):
        make_trainer(max_steps=142, callbacks=[after]).fit(
            resumed, PrivatePublicDataModule(_indexed_data(), batch_size=1), ckpt_path=str(tmp_path / "step=19.ckpt")
        )
    assert resumed.private_steps == 142  # 19 before the crash, then rounds 24..146 of the partition (144 per pass)
    released = [examples for step, examples in crashed.rounds if step <= saved["private_steps"]]
    released += [examples for _, examples in after.rounds]
    worst = _worst_example_nodes(released, resumed.first_batch_size)
    assert worst > 4  # the run is the audit's case
    assert resumed.epsilon >= _epsilon_of_nodes(worst, 2.0, resumed.delta)
    before = crashed.epsilons[saved["private_steps"] - 1]
    assert all(b >= a for a, b in zip([before, *after.epsilons], after.epsilons))  # epsilon never decreases


def test_a_resume_with_another_inner_steps_is_refused_and_epsilon_never_decreases(tmp_path):
    """The audit's second case: resuming a T = 8 run with T = 2 re-counted the whole history with 2 nodes per tree
    instead of 4, and epsilon went down. The released trees are in the ledger; another partition is refused."""
    spec = PrivacySpec(epsilon=50.0, accountant="tree", noise_multiplier=2.0)
    first, releases = _model(spec), Releases()
    trainer = make_trainer(max_epochs=1, callbacks=[releases])
    trainer.fit(first, PrivatePublicDataModule(_indexed_data(), batch_size=1))
    trainer.save_checkpoint(tmp_path / "pass1.ckpt")
    spent = first.epsilon
    assert spent >= _epsilon_of_nodes(_worst_example_nodes([r for _, r in releases.rounds], 8), 2.0, first.delta)
    resumed = _model(spec, inner_steps=2)
    with pytest.raises(PrivacyConfigError, match="another partition.*block_steps 8 -> 2"):
        make_trainer(max_epochs=2).fit(
            resumed, PrivatePublicDataModule(_indexed_data(), batch_size=1), ckpt_path=str(tmp_path / "pass1.ckpt")
        )
    assert resumed.private_steps == first.private_steps  # refused before any private step
    assert resumed.epsilon >= spent


def test_its_partition_loader_batches_with_the_data_modules_collate_padded_to_one_length():
    """O2NC built its partition loader with default_collate, ignoring the data module's: variable-length text could
    not batch at all (its pre-flight pass refused 51 of 64 examples — an independent review). It now gets the data
    module's private collate, padded one past max_length as every private zeroth-order step's is."""
    from tests.methods.test_half_precision_release import _MaskedMean, _MaxLength48, _padded_length_loss, _token_record

    private = [_token_record(i, 4 + i % 5) for i in range(64)]
    model = O2NC(_MaskedMean(), loss=_padded_length_loss, clip=10.0, privacy=PrivacySpec(epsilon=5.0), noise_seed=0)
    data = _MaxLength48(private, batch_size=8)
    make_trainer(max_steps=3, limit_val_batches=0).fit(model, data)
    assert model.private_steps == 3
    assert {tuple(batch["input_ids"].shape[1:]) for batch in data.train_dataloader()} == {(49,)}
