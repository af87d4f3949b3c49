"""The package's layering (docs/architecture.md, "Layers"): each layer imports only the layers below it, and the
privacy core (step, privacy, zo, per_sample) is plain torch — no Lightning, so it can be tested and reused alone."""

import ast
import sys
from pathlib import Path

import pytest

from tests import background

PACKAGE = Path(__file__).resolve().parents[1] / "pl_dp"
#: the pl_dp layers each layer may import (besides itself)
LAYERS = {
    "step": set(),
    "privacy": {"step"},
    "zo": {"privacy", "step"},
    "per_sample": {"privacy", "step"},
    "methods": {"privacy", "step", "zo", "per_sample"},
    # PruningSchedule computes the data-free pruning scores and holds the mask it checkpoints (zo.pruning, zo.mask)
    "callbacks": {"privacy", "step", "zo"},  # step.losses: how a batch splits into inputs and targets
    # text: prompt templates (nets.prompt); vader: the MiniLM embeddings of VaderEmbeddingDataModule (nets.hf)
    "data": {"privacy", "step", "nets"},
    "nets": {"step"},  # a causal LM's perplexity is its causal-LM loss per token (step.losses, torch only)
}
#: top-level modules every layer may import: they import no pl_dp module themselves
LEAVES = {"errors"}
LIGHTNING_FREE = ("step", "privacy", "zo", "per_sample")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_layer_imports_only_the_layers_below_it(layer):
    allowed = LAYERS[layer] | {layer} | LEAVES
    wrong = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for name in _imports(path)
        if name.startswith("pl_dp.") and name.split(".")[1] not in allowed
    }
    assert not wrong, sorted(wrong)


@pytest.mark.parametrize("layer", LIGHTNING_FREE)
def test_the_privacy_core_never_imports_lightning(layer):
    wrong = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] in LIGHTNING
    }
    assert not wrong, sorted(wrong)


_FRESH_IMPORT = (
    "import sys\n"
    f"import {', '.join('pl_dp.' + layer for layer in LIGHTNING_FREE)}\n"
    f"print(sorted(m for m in sys.modules if m.split('.')[0] in {LIGHTNING!r}))\n"
)
#: the fresh interpreter below, started in the background when the session starts (tests/background.py)
FRESH_IMPORT = background.job(
    "fresh_import",
    lambda out: [background.Command([sys.executable, "-c", _FRESH_IMPORT], cwd=Path.cwd(), timeout=300)],
    needed_by=background.for_test("test_importing_the_privacy_core_loads_no_lightning"),
)


def test_importing_the_privacy_core_loads_no_lightning():
    """Also through third-party imports: a fresh interpreter that imports the three packages has no Lightning."""
    _, (out,) = FRESH_IMPORT.result()
    out.check_returncode()
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_a_leaf_module_imports_no_pl_dp_module(leaf):
    wrong = sorted(name for name in _imports(PACKAGE / f"{leaf}.py") if name.split(".")[0] == "pl_dp")
    assert not wrong, wrong
