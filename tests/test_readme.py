"""The README's API tour runs as written, and its Quick start matches what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_api_tour_runs() -> None:
    match = re.search(r"## API tour\n\n```python\n(.*?)```", README, re.S)
    assert match is not None, "README has no API tour code block"
    exec(compile(match.group(1), "README.md (API tour)", "exec"), {"__name__": "readme_tour"})


def test_ci_runs_the_readme_test_command() -> None:
    quick = re.search(r"## Quick start\n\n```bash\n(.*?)```", README, re.S)
    assert quick is not None
    lines = [line.split("#")[0].strip() for line in quick.group(1).strip().splitlines()]
    assert len(lines) == 2, lines
    assert lines[1] in (ROOT / ".ci" / "run").read_text()
