"""Lint: ruff over the Python code and cython-lint over ``pyx/``, configured in pyproject.toml.

Run them by hand the same way: ``ruff check .`` and ``cython-lint pyx``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # cython-lint runs pycodestyle by name: the scripts folder of this interpreter comes first.
    env = {**os.environ, "PATH": os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing() -> None:
    result = _run("-m", "ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_cython_lint_finds_nothing() -> None:
    result = _run("-c", "from cython_lint.cython_lint import main; raise SystemExit(main())", "pyx")
    assert result.returncode == 0, result.stdout + result.stderr
