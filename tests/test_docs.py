"""The documentation builds with Sphinx, warnings as errors, and its maps list the code as it is.

The build writes to a temporary folder only (``-d`` for the doctrees, the HTML beside it), so the
checkout stays clean. Build it by hand the same way: ``python -m sphinx -W -b html docs docs/_build``.
"""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import lifecycle

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_the_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
        "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html"),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for page in (
        "index", "install", "architecture", "engine-api", "integrations", "kv-events", "tiers", "content-hashes",
        "api", "swap-format", "reliability",
    ):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page


def source_files() -> set[str]:
    python = {path.relative_to(ROOT).as_posix() for path in (ROOT / "lifecycle").rglob("*.py")}
    cython = {path.relative_to(ROOT).as_posix() for path in (ROOT / "pyx").rglob("*.p[yx][xd]")}
    return python | cython


def test_the_module_map_has_one_row_per_source_file() -> None:
    page = (DOCS / "architecture.md").read_text()
    rows = set(re.findall(r"^\| `((?:lifecycle|pyx)/[^`]+)` \|", page, re.M))
    files = source_files()
    assert not files - rows, f"add rows to docs/architecture.md's module map for {sorted(files - rows)}"
    assert not rows - files, f"remove rows of docs/architecture.md's module map for {sorted(rows - files)}"


def documented_modules() -> set[str]:
    return set(re.findall(r"^\.\. automodule:: (\S+)", (DOCS / "api.rst").read_text(), re.M))


def test_the_api_reference_documents_every_module() -> None:
    public = {
        module.name
        for module in pkgutil.walk_packages(lifecycle.__path__, "lifecycle.")
        if not module.name.rsplit(".", 1)[-1].startswith("_")
    }
    compiled = {f"lifecycle.{stub.stem}" for stub in (ROOT / "stubs" / "lifecycle").glob("_*.pyi")}
    expected = public | compiled | {"lifecycle"}
    documented = documented_modules()
    assert not expected - documented, f"add to docs/api.rst: {sorted(expected - documented)}"
    assert not documented - expected, f"remove from docs/api.rst: {sorted(documented - expected)}"
