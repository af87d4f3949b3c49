"""docs/architecture.md and docs/layout.md agree with the code: every test an invariant cites exists, every invariant
cites one, the layer table is the one tests/test_layers.py enforces, every public name imports, and the layout
names every module of the package."""

import ast
import importlib
import re
from pathlib import Path

import pytest

from tests.test_layers import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pl_dp"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LAYOUT = ROOT / "docs" / "layout.md"
INVARIANTS = range(1, 13)

#: a cited test: ``tests/<path>.py::test_name``, optionally with a parameter id ``[...]``
NODE = re.compile(r"(tests/[\w/]+\.py)::(test_\w+)(?:\[[^\]\s`]*\])?")
#: an invariant's heading in the Invariants section: ``### 10. The boundary is sealed``
INVARIANT = re.compile(r"^### (\d+)\. ", flags=re.M)
TICKED = re.compile(r"`([^`]+)`")


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a page, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"no '## {title}' section"
    return match.group(1)


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the markdown tables in ``text`` (header and separator rows included)."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.strip().startswith("|")
    ]


def _test_functions(path: Path) -> set[str]:
    """The names of the test functions ``path`` defines, at module level or in a class."""
    return {
        node.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    }


def _cited(text: str) -> list[tuple[str, str]]:
    return NODE.findall(text)


# ---- (a) every cited test exists ----------------------------------------------------------------------------------
def test_every_cited_test_names_an_existing_file_and_function():
    cited = _cited(ARCHITECTURE.read_text())
    assert len(cited) >= len(INVARIANTS), "the architecture page cites (almost) no test"
    missing = []
    for file, name in cited:
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{file}::{name}: no such file")
        elif name not in _test_functions(path):
            missing.append(f"{file}::{name}: no function {name} in {file}")
    assert not missing, "docs/architecture.md cites tests that do not exist:\n" + "\n".join(missing)


def test_the_citation_check_sees_a_renamed_test(tmp_path):
    """The check above can fail: a test function that is not defined is not found."""
    path = tmp_path / "test_x.py"
    path.write_text("import pytest\n\n@pytest.mark.parametrize('a', [1])\ndef test_kept(a):\n    pass\n")
    assert _test_functions(path) == {"test_kept"}
    assert _cited("`tests/x/test_x.py::test_renamed[a-1]`") == [("tests/x/test_x.py", "test_renamed")]


# ---- (b) every invariant is numbered 1..12 and cites a test ------------------------------------------------------
def _invariants() -> dict[int, str]:
    """Invariant number -> the text of its block, from the page's Invariants section."""
    section = _section(ARCHITECTURE.read_text(), "Invariants")
    headings = list(INVARIANT.finditer(section))
    return {
        int(heading.group(1)): section[heading.end() : (headings[i + 1].start() if i + 1 < len(headings) else None)]
        for i, heading in enumerate(headings)
    }


def test_the_invariants_are_numbered_1_to_12_in_order_and_each_cites_a_test():
    section = _section(ARCHITECTURE.read_text(), "Invariants")
    numbers = [int(n) for n in INVARIANT.findall(section)]
    assert numbers == list(INVARIANTS), f"the invariants are numbered {numbers}"
    for number, block in _invariants().items():
        assert "Tested by:" in block, f"invariant {number} says nothing about its tests"
        cited = _cited(block.split("Tested by:", 1)[1])
        assert 1 <= len(cited) <= 3, f"invariant {number} cites {len(cited)} tests (one to three)"


def test_every_invariant_the_code_cites_is_on_the_page():
    """Docstrings, comments and pages cite invariants by number: each number must be one the page defines."""
    defined = set(_invariants())
    wrong = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "docs").rglob("*.md")]:
        for number in re.findall(r"\binvariants? (\d+)\b", path.read_text(), flags=re.I):
            if int(number) not in defined:
                wrong.append(f"{path.relative_to(ROOT)} cites invariant {number}")
    assert not wrong, wrong


# ---- (c) the layer table is the one tests/test_layers.py enforces ------------------------------------------------
def _documented_layers() -> dict[str, set[str]]:
    """Layer -> the pl_dp layers it may import, from the rows of the Layers table that name one package."""
    packages = {path.name for path in PACKAGE.iterdir() if path.is_dir() and any(path.glob("*.py"))}
    layers = {}
    for row in _table_rows(_section(ARCHITECTURE.read_text(), "Layers")):
        names = TICKED.findall(row[0])
        if len(row) < 3 or len(names) != 1 or not names[0].startswith("pl_dp."):
            continue
        layer = names[0].removeprefix("pl_dp.")
        if layer not in packages:  # a top-level module (audit, audit_run, cli): above every layer
            continue
        imports = {name.removeprefix("pl_dp.") for name in TICKED.findall(row[-1])}
        assert imports or row[-1].lower() == "none", f"the row of {layer} names no layer and does not say none"
        layers[layer] = imports
    return layers


def test_the_layer_table_is_the_one_the_layering_test_enforces():
    documented = _documented_layers()
    assert documented, "no layer table in the Layers section of docs/architecture.md"
    assert set(documented) == set(LAYERS), (
        f"layers on the page {sorted(documented)}, in tests/test_layers.py {sorted(LAYERS)}"
    )
    differ = {
        layer: {"page": sorted(documented[layer]), "test_layers": sorted(LAYERS[layer])}
        for layer in documented
        if documented[layer] != set(LAYERS[layer])
    }
    assert not differ, differ


def test_every_package_of_pl_dp_is_a_row_of_the_layer_table():
    packages = {path.name for path in PACKAGE.iterdir() if path.is_dir() and any(path.glob("*.py"))}
    assert packages == set(_documented_layers())


# ---- (d) the layout names every module ---------------------------------------------------------------------------
def _package_modules() -> dict[str, set[str]]:
    """``pl_dp/<package>`` -> its module files, and ``pl_dp`` -> the top-level modules (``__init__`` left out)."""
    modules = {"pl_dp": {path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"}}
    for directory in sorted(path for path in PACKAGE.iterdir() if path.is_dir() and any(path.glob("*.py"))):
        modules[f"pl_dp/{directory.name}"] = {path.stem for path in directory.glob("*.py") if path.stem != "__init__"}
    return modules


def _layout_modules() -> dict[str, set[str]]:
    """The package map of docs/layout.md: ``pl_dp/<package>`` (or ``pl_dp``) -> the modules its row names."""
    rows = {}
    for row in _table_rows(LAYOUT.read_text()):
        names = TICKED.findall(row[0])
        if len(row) < 2 or len(names) != 1 or not names[0].startswith("pl_dp"):
            continue
        rows[names[0].rstrip("/")] = {name.removesuffix(".py") for name in TICKED.findall(row[1])}
    return rows


@pytest.mark.parametrize("package", sorted(_package_modules()))
def test_the_layout_names_every_module_of_each_package(package):
    layout = _layout_modules()
    assert package in layout, f"docs/layout.md has no row for {package}"
    files, named = _package_modules()[package], layout[package]
    assert not files - named, f"{package}: modules missing from docs/layout.md: {sorted(files - named)}"
    assert not named - files, f"{package}: docs/layout.md names modules that are gone: {sorted(named - files)}"


def test_the_layout_has_no_row_for_a_package_that_is_gone():
    assert set(_layout_modules()) <= set(_package_modules())


# ---- (e) the public names import ---------------------------------------------------------------------------------
def test_every_public_name_on_the_page_imports():
    section = _section(ARCHITECTURE.read_text(), "Public names")
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "no import block in the Public names section"
    imports = [
        (node.module, alias.name)
        for block in blocks
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]
    assert len(imports) >= 20
    missing = [
        f"from {module} import {name}" for module, name in imports if not hasattr(importlib.import_module(module), name)
    ]
    assert not missing, missing
    exported = {
        f"from {module} import {name}"
        for module, name in imports
        if module.count(".") <= 1 and name not in getattr(importlib.import_module(module), "__all__", [name])
    }
    assert not exported, f"public names missing from their package's __all__: {sorted(exported)}"
