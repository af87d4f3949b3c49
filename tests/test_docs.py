"""The documentation site: every page is in the nav, links resolve on GitHub too, the strict build passes."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import background

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")  # [text](target) or [text](target#anchor)


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    generated = set(_hooks().PAGES.values())  # repository files the hooks publish (CHANGELOG.md, RESULTS.md)
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert len(nav) == len(set(nav)), "a page is twice in the nav"
    assert pages - set(nav) == set(), "docs pages missing from the nav in mkdocs.yml"
    assert set(nav) - pages - generated == set(), "nav entries without a page"


def test_relative_links_resolve_in_the_repository():
    """README and docs link by relative path, so the links also work when browsing the repository."""
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to a missing {target}"


def test_readme_links_every_docs_section():
    readme = (ROOT / "README.md").read_text()
    for page in ("getting-started", "privacy-model", "methods/index", "performance", "scaling-out", "fine-tuning"):
        assert f"](docs/{page}.md)" in readme, page


@pytest.mark.slow
def test_the_readme_example_runs(tmp_path):
    """The README's Python example, shortened to one epoch, trains privately and prints the privacy report."""
    readme = (ROOT / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "max_epochs=60" in code
    code = code.replace("max_epochs=60", "max_epochs=1, logger=False, enable_checkpointing=False")
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pl_dp privacy report — DPZero" in run.stdout and "add/remove-one adjacency" in run.stdout


def _has_mkdocs() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("mkdocs", "mkdocstrings_handlers"))


#: the strict build below, started in the background when the session starts (tests/background.py)
STRICT_BUILD = background.job(
    "docs_build",
    lambda out: [
        background.Command(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out / "site")],
            cwd=ROOT,
            timeout=300,
        )
    ],
    needed_by=lambda item: _has_mkdocs() and background.for_test("test_strict_build_passes")(item),
)


def test_strict_build_passes():
    if not _has_mkdocs():
        pytest.skip("mkdocs and mkdocstrings-python are not installed (pip install -e '.[docs]')")
    out, (build,) = STRICT_BUILD.result()
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    site = out / "site"
    api = (site / "api" / "methods.html").read_text()
    assert 'id="pl_dp.methods.DPZero"' in api and 'id="pl_dp.methods.PAZOM"' in api  # generated from docstrings
    assert (site / "results.html").exists() and (site / "results" / "accuracy_vs_epsilon.png").exists()
    config = re.sub(r"<[^>]+>", "", (site / "methods" / "dpzero.html").read_text())
    assert "class_path: pl_dp.methods.DPZero" in config  # the shipped config is included, not copied


def test_the_privacy_model_states_how_often_logged_epsilon_is_exact():
    """The page and the code once disagreed (1/32 against 8 evaluations per plan)."""
    import inspect

    from pl_dp.privacy.calibration import EpsilonTracker

    evaluations = inspect.signature(EpsilonTracker).parameters["evaluations"].default
    text = " ".join((DOCS / "privacy-model.md").read_text().split())
    assert f"every 1/{evaluations} of it" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("page", "index"),
    [
        ("getting-started.md", 0),
        ("your-module.md", 0),
        ("your-module.md", 1),
        ("your-module.md", 2),
        ("who-is-protected.md", 0),
    ],
)
def test_the_python_snippets_of_the_docs_run_as_written(page, index, tmp_path):
    """Each snippet is a whole program; the test runs it with its epochs cut to one (and 4 batches a stage)."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    code = re.sub(r"max_epochs=\d+", "max_epochs=1, limit_train_batches=4, limit_val_batches=2", blocks[index])
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
