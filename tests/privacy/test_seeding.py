"""Named seed domains: every stream of data-independent randomness derives its seeds under its own tag."""

import ast
from pathlib import Path

from pl_dp.privacy.seeding import SeedDomain, derive_seed

PACKAGE = Path(__file__).resolve().parents[2] / "pl_dp"


def test_the_domains_keep_the_values_seeded_runs_were_drawn_with():
    assert {domain.name: domain.value for domain in SeedDomain} == {
        "DIRECTIONS": 0xD1EC,
        "SUBSPACE_COEFFICIENTS": 0xC0EF,
        "PRUNING_SCORES": 0x5C0E,
        "PRUNING_STAGE": 0x9A0E,
        "O2NC_ROUNDS": 0x0A2C,
        "PROBE_DIRECTIONS": 0x9B0E,
    }
    assert derive_seed(7, SeedDomain.DIRECTIONS) == derive_seed(7, 0xD1EC)


def test_no_stream_tags_its_seeds_with_a_literal():
    """A literal tag in a ``derive_seed`` call is a stream that may collide with another: name it in SeedDomain."""
    literals = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            called = getattr(node, "func", None)
            if isinstance(node, ast.Call) and getattr(called, "id", getattr(called, "attr", None)) == "derive_seed":
                literals += [
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    for arg in node.args[1:]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, int)
                ]
    assert not literals, literals
