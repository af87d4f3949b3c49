"""User-level privacy through real fits: ε at the user sample rate, and one user — however many examples they wrote —
moves a release by at most C (black box: two runs, D and D′ without all of one user's examples)."""

import lightning as L
import numpy as np
import pytest
import torch
from dp_accounting import NeighboringRelation
from dp_accounting.dp_event import GaussianDpEvent, PoissonSampledDpEvent
from dp_accounting.pld import PLDAccountant
from torch import nn
from torch.utils.data import ConcatDataset, Subset, TensorDataset

from pl_dp import PrivacySpec
from pl_dp.audit import _RecordingMechanism
from pl_dp.callbacks.wandb import privacy_config
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import PrivacyConfigError
from pl_dp.methods import DPSGD, O2NC, DPZero
from tests import catalog
from tests.conftest import blobs, make_trainer

CLIP, LR = 1.0, 0.1
HEAVY = 20  # examples of the one heavy user


def test_a_user_level_run_spends_the_epsilon_of_its_user_sample_rate():
    """ε equals dp-accounting's own composition of Poisson-subsampled Gaussian steps at q = users per batch / U and
    δ = 1/U, computed here from the user ids, not read from the run."""
    data = blobs(120)
    user_ids = [i // 4 if i < 100 else 25 for i in range(120)]  # 25 users of 4 examples, one of 20: U = 26
    users = len(set(user_ids))
    dm = PrivatePublicDataModule(data, batch_size=5, user_of=user_ids)
    model = DPZero(nn.Linear(4, 3), lr=0.05, clip=1.0, queries=2, privacy=PrivacySpec(4.0, accountant="pld"))
    make_trainer(max_steps=12).fit(model, dm)
    rate, delta = 5 / users, 1 / users
    independent = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=5e-4)
    independent.compose(PoissonSampledDpEvent(rate, GaussianDpEvent(model.noise_multiplier)), model.private_steps)
    assert model.private_steps == 12 and model.delta == delta and model.sample_rate == rate
    assert model.epsilon == pytest.approx(independent.get_epsilon(delta), rel=1e-9)
    report = model.privacy_report()
    assert report.unit == "user" and report.population == users and "-DP per user" in str(report)
    assert "user_of" not in dm.hparams and "user_of" not in model.hparams  # the user ids are private data
    config = privacy_config(model)  # what WandbPrivacyLogger writes to the run's config
    assert config["privacy/unit"] == "user" and config["privacy/population"] == users


def _released_sum(private, *, user_of, batch_size, method=DPSGD):
    """The noised clipped sum one step releases (with plain SGD, θ moves by −lr·sum/E): one step on ``private``
    with every unit sampled (q = 1), the noise and sampling seeded alike in every call, so the noise cancels between
    two calls and what is left is what the data changed."""
    net = nn.Linear(4, 3)
    with torch.no_grad():
        net.weight.zero_(), net.bias.zero_()
    model = method(net, lr=LR, clip=CLIP, privacy=PrivacySpec(50.0, noise_multiplier=1.0), noise_seed=3)
    dm = PrivatePublicDataModule(private, batch_size=batch_size, user_of=user_of, sampling_seed=4)
    before = torch.cat([p.detach().flatten().clone() for p in net.parameters()])
    make_trainer(max_steps=1).fit(model, dm)
    after = torch.cat([p.detach().flatten() for p in net.parameters()])
    return (before - after) * model.expected_batch_size / LR


def _tensor_pairs(ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A composite id of 0-d tensors per example ((organisation, user), read from a column in torch format)."""
    return [(torch.tensor(0), torch.tensor(i)) for i in ids]


@pytest.mark.parametrize(
    "ids_as", [list, torch.tensor, np.array, _tensor_pairs], ids=["list", "tensor", "ndarray", "tensor-pairs"]
)
def test_removing_all_of_one_users_examples_moves_the_release_by_at_most_c_and_example_level_by_many(ids_as):
    """D: 30 users with one example each and one user with 20 (all with a gradient far above C); D′: D without the
    heavy user. User-level sampling: the heavy user is one row, so the release moves by C (not more). Example-level
    sampling of the same data: all 20 of their examples are in the batch, and the release moves by about 20·C —
    what per-user bounding prevents (the test fails when it is removed). The user ids as a list, a tensor or an array
    (a column read as tensors, whose elements hash by identity, made each example a user: 20·C, found by review) or
    as pairs of tensors (the same, one level down: 20·C, a second review)."""
    others = blobs(30)
    heavy = TensorDataset(torch.full((HEAVY, 4), 50.0), torch.zeros(HEAVY, dtype=torch.long))  # ‖g‖ ≫ C, aligned
    with_user = ConcatDataset([others, heavy])
    ids = ids_as(list(range(30)) + [30] * HEAVY)
    without = _released_sum(others, user_of=list(range(30)), batch_size=30)
    user_level = _released_sum(with_user, user_of=ids, batch_size=31)
    moved = (user_level - without).norm().item()
    assert CLIP * 0.99 <= moved <= CLIP * 1.01  # one row, saturated at C
    example_level = _released_sum(with_user, user_of=None, batch_size=50)
    assert (example_level - without).norm().item() > 0.9 * HEAVY * CLIP  # the bound broken 20-fold


#: every Poisson-sampled method, and DP-SGD's other per-sample modes (O2NC refuses user-level privacy)
USER_LEVEL = [entry for entry in catalog.METHODS if entry.cls is not O2NC] + catalog.by_id(
    "dpsgd-ghost", "dpsgd-functorch"
)


def _one_step(entry, private, user_of):
    """What one private step of ``entry`` on ``private`` releases — the noised sums its mechanism privatizes (recorded
    as the audit records them) and θ after it — with every unit sampled (q = 1) and every seed fixed."""
    L.seed_everything(0)  # the direction seed (zeroth-order methods) derives from it
    model = entry.build(privacy=PrivacySpec(50.0, noise_multiplier=1.0), noise_seed=3)
    recorded, build = [], model.mechanism

    def recording(batch_size):
        recorded.append(_RecordingMechanism(build(batch_size)))
        return recorded[-1]

    model.mechanism = recording
    public = blobs(24, seed=5) if entry.public_data else None
    units = len(set(user_of)) if user_of is not None else len(private)
    dm = PrivatePublicDataModule(
        private, public=public, batch_size=units, public_batch_size=8, user_of=user_of, sampling_seed=4
    )
    make_trainer(max_steps=1).fit(model, dm)
    (mechanism,) = recorded
    return mechanism.vector(), torch.cat([p.detach().flatten() for p in model.net.parameters()])


@pytest.mark.parametrize("entry", USER_LEVEL, ids=repr)
def test_every_method_sees_a_user_with_many_examples_as_one_example(entry):
    """For every method: a user-level step on D (30 users of one example and one user of 20) releases exactly what an
    example-level step releases on the 30 examples plus one example of the heavy user — the same noised sums, the
    same θ — so the user moves the release as one example does, which each method bounds by C. Without per-user
    bounding all 20 would be in the batch and the two would differ (each case fails then: checked)."""
    others = blobs(30)
    heavy = TensorDataset(torch.full((HEAVY, 4), 50.0), torch.zeros(HEAVY, dtype=torch.long))
    user_level = _one_step(entry, ConcatDataset([others, heavy]), list(range(30)) + [30] * HEAVY)
    one_example = _one_step(entry, ConcatDataset([others, Subset(heavy, [0])]), None)
    torch.testing.assert_close(user_level, one_example, rtol=1e-5, atol=1e-7)


def test_o2nc_refuses_user_level_privacy():
    dm = PrivatePublicDataModule(blobs(64), batch_size=4, user_of=[i // 2 for i in range(64)])
    model = O2NC(nn.Linear(4, 3), clip=1.0, inner_steps=4, batch_size=4, privacy=PrivacySpec(2.0))
    with pytest.raises(PrivacyConfigError, match="user-level privacy \\(user_of\\) needs Poisson sampling over users"):
        make_trainer(max_steps=2).fit(model, dm)


def test_a_module_that_trained_at_example_level_refuses_a_user_level_fit():
    """ε composes across fits: a second fit at user level would claim a user-level ε for example-level steps."""
    model = DPZero(nn.Linear(4, 3), lr=0.05, clip=1.0, queries=2, privacy=PrivacySpec(4.0, accountant="rdp"))
    make_trainer(max_steps=2).fit(model, PrivatePublicDataModule(blobs(40), batch_size=5))
    users = PrivatePublicDataModule(blobs(40), batch_size=5, user_of=[i // 4 for i in range(40)])
    with pytest.raises(PrivacyConfigError, match="released 2 private steps at example-level privacy"):
        make_trainer(max_steps=4).fit(model, users)
