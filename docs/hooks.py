"""MkDocs hooks: repository files that are pages of the site without being copied into docs/.

``CHANGELOG.md`` becomes ``changelog.md`` and ``benchmarks/RESULTS.md`` becomes ``results.md`` (with the
plots it shows, from ``benchmarks/results/``). The docs link to them by their repository paths
(``../CHANGELOG.md``, ``../benchmarks/RESULTS.md``), which work on GitHub; the links are pointed at the
site's pages here. In the API reference, the Sphinx roles of the docstrings (``:class:`~a.b.X```) are
dropped so that only the code name shows.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

#: repository file -> page of the site
PAGES = {"CHANGELOG.md": "changelog.md", "benchmarks/RESULTS.md": "results.md"}
PLOTS = "benchmarks/results"  # RESULTS.md links its plots as results/<name>.png
ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|obj|exc):<code>~?")


def on_files(files, config):
    root = Path(config.config_file_path).parent
    for source, page in PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(root / source)))
    for plot in sorted((root / PLOTS).glob("*.png")):
        files.append(File.generated(config, f"results/{plot.name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown, page, config, files):
    depth = page.file.src_uri.count("/")  # links are written relative to the page's folder in docs/
    up = "../" * (depth + 1)
    for source, target in PAGES.items():
        markdown = markdown.replace(f"]({up}{source}", f"]({'../' * depth}{target}")
    return markdown


def on_page_content(html, page, config, files):
    return ROLE.sub("<code>", html)
