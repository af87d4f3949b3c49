"""The fit-start checks as one ordered list (:mod:`pl_dp.step.fit_start`): what each method runs before its first
step, in which order, and a refusal that names the check that raised."""

from __future__ import annotations

import pytest
from torch import nn

from pl_dp import PrivacySpec
from pl_dp.data import PrivatePublicDataModule
from pl_dp.errors import IndependenceError
from pl_dp.methods import DPSGD, DPZero
from pl_dp.step.fit_start import FitStartChecks
from tests.conftest import blobs, make_trainer

SPEC = PrivacySpec(epsilon=5.0, accountant="rdp")


def test_the_checks_run_in_order_and_return_their_results_by_name():
    ran: list[str] = []
    checks = FitStartChecks().then("first", lambda: ran.append("first") or 1).then("second", lambda: ran.append("2"))
    assert checks.names == ["first", "second"]
    assert checks.run() == {"first": 1, "second": None}
    assert ran == ["first", "2"]


def test_a_check_is_named_once():
    with pytest.raises(ValueError, match="named once"):
        FitStartChecks().then("probe", lambda: None).then("probe", lambda: None)


def test_the_first_refusal_ends_the_checks_and_names_its_check():
    def refuse() -> None:
        raise IndependenceError("mixes examples")

    checks = FitStartChecks().then("independence", refuse).then("never", lambda: pytest.fail("ran after a refusal"))
    with pytest.raises(IndependenceError) as refused:
        checks.run()
    assert "(refused by pl_dp's fit-start check 'independence')" in refused.value.__notes__


@pytest.mark.parametrize(
    ("cls", "names"),
    [
        (DPZero, ["private data", "independence", "precision"]),
        (DPSGD, ["private data", "independence", "precision", "per-example gradients"]),
    ],
)
def test_each_method_states_its_checks_in_one_list(cls, names):
    assert cls(nn.Linear(4, 3), clip=1.0, privacy=SPEC).fit_start_checks().names == names


def test_a_private_fit_runs_every_check_before_its_first_step():
    """DP-SGD's own check (each clipped row one example's gradient) runs at fit start, after the base's."""
    model = DPSGD(nn.Linear(4, 3), clip=1.0, privacy=SPEC)
    checks = model.fit_start_checks
    ran: list[str] = []

    def recorded() -> FitStartChecks:
        listed = FitStartChecks()
        for check in checks():
            listed = listed.then(check.name, lambda check=check: ran.append(check.name) or check.run())
        return listed

    object.__setattr__(model, "fit_start_checks", recorded)
    make_trainer(max_steps=2).fit(model, PrivatePublicDataModule(blobs(100), batch_size=20))
    assert ran == ["private data", "independence", "precision", "per-example gradients"]
    assert model.private_steps == 2
