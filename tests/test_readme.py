"""The README's API tour runs as written and is clean under ``mypy --strict``, its Quick start
matches what CI runs, and what it points to is in the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_api_tour_runs() -> None:
    match = re.search(r"## API tour\n\n```python\n(.*?)```", README, re.S)
    assert match is not None, "README has no API tour code block"
    exec(compile(match.group(1), "README.md (API tour)", "exec"), {"__name__": "readme_tour"})


def test_engine_integration_tour_runs() -> None:
    match = re.search(r"### Engine integration\n.*?```python\n(.*?)```", README, re.S)
    assert match is not None, "README has no engine integration code block"
    exec(compile(match.group(1), "README.md (engine integration)", "exec"), {"__name__": "readme_engine"})


def test_ci_runs_the_readme_test_command() -> None:
    quick = re.search(r"## Quick start\n\n```bash\n(.*?)```", README, re.S)
    assert quick is not None
    lines = [line.split("#")[0].strip() for line in quick.group(1).strip().splitlines()]
    assert len(lines) == 2, lines
    assert lines[1] in (ROOT / ".ci" / "run").read_text()


def test_api_tour_is_clean_under_mypy_strict(tmp_path: Path) -> None:
    match = re.search(r"## API tour\n\n```python\n(.*?)```", README, re.S)
    assert match is not None
    tour = tmp_path / "readme_tour.py"
    tour.write_text(match.group(1))
    env = {**os.environ, "MYPYPATH": str(ROOT)}  # the checkout's lifecycle, whatever is installed
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--config-file", str(ROOT / "pyproject.toml"),
         str(tour)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_repository_path_the_readme_names_exists() -> None:
    named = set(re.findall(r"`((?:bench|docs|tests|lifecycle|pyx|stubs)/[\w./-]*)`", README))
    assert named, "the pattern no longer finds the README's paths"
    assert not [path for path in named if not (ROOT / path).exists()]


def test_the_readme_cites_nothing_outside_the_repository() -> None:
    assert "SPEC" not in README and "§" not in README
    assert "../shared" not in README
