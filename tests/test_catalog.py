"""tests/catalog.py: every method pl_dp exports is registered once, so none escapes the lists drawn from it."""

import pytest

from pl_dp import PrivacySpec
from tests import catalog


def test_every_exported_method_has_one_entry():
    """A concrete PrivateModule added to ``pl_dp.methods.__all__`` fails here until tests/catalog.py registers it."""
    registered = [entry.cls for entry in catalog.METHODS]
    missing = catalog.exported_methods() - set(registered)
    assert not missing, f"register {sorted(cls.__name__ for cls in missing)} in tests/catalog.py's METHODS"
    assert len(registered) == len(set(registered)) and set(registered) == catalog.exported_methods()


def test_ids_are_unique_and_variants_say_what_they_change():
    entries = [*catalog.METHODS, *catalog.VARIANTS]
    assert len({entry.id for entry in entries}) == len(entries)
    assert all(entry.aspect is None for entry in catalog.METHODS)
    assert all(entry.aspect is not None for entry in catalog.VARIANTS)
    assert {entry.cls for entry in catalog.VARIANTS} <= {entry.cls for entry in catalog.METHODS}


@pytest.mark.parametrize("entry", [*catalog.METHODS, *catalog.VARIANTS], ids=repr)
def test_every_entry_builds_its_small_run(entry):
    model = entry.build(privacy=PrivacySpec(epsilon=5.0), noise_seed=0)
    assert type(model) is entry.cls
    assert not {"net", "privacy", "noise_seed"} & set(entry.small())  # each test chooses those
    for name, value in entry.small().items():
        assert model.hparams[name] == value, name


def test_capabilities_are_read_from_the_classes():
    assert {entry.id for entry in catalog.select(public_data=True)} == {"pazo-m", "pazo-p", "pazo-s", "coupling"}
    assert {entry.id for entry in catalog.select(data_parallel=False)} == {"o2nc"}
    assert {entry.id for entry in catalog.select(accountable="rdp")} == {entry.id for entry in catalog.METHODS} - {
        "o2nc"
    }
    sharded = {entry.id for entry in catalog.select([*catalog.METHODS, *catalog.VARIANTS], shardable=True)}
    assert {"dpsgd", "dpsgd-ghost"} <= sharded  # book-keeping (the default) and ghost clipping
    assert "dpsgd-hooks" not in sharded and "o2nc" not in sharded
    assert [entry.cls for entry in catalog.REPRESENTATIVES] == [
        *catalog.classes(zeroth_order=True)[:1],
        *catalog.classes(first_order=True)[:1],
    ]
