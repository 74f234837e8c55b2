"""``bench/gpu_check.sh`` fits the device tool and names the modules this tree compiles.

A lent GPU gives one short try: a script that imports a module no longer built, or whose step
timeouts add up past the tool's limit, wastes it. The dry run itself (the emulated driver playing
the GPU) needs Python 3.12 with the device machine's packages and runs by hand:
``bash bench/gpu_check.sh --dry-run``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (ROOT / "bench" / "gpu_check.sh").read_text()


def test_the_install_check_imports_exactly_the_compiled_modules() -> None:
    compiled = {"_" + path.stem for path in (ROOT / "pyx").glob("*.pyx")}  # setup.py builds each as lifecycle._<name>
    stubs = {path.stem for path in (ROOT / "stubs" / "lifecycle").glob("_*.pyi")}
    assert compiled and compiled == stubs
    imports = re.findall(r"import (lifecycle\._\w+(?:, lifecycle\._\w+)*)", SCRIPT)
    assert len(imports) == 1, imports
    named = {name.split(".")[1] for name in imports[0].split(", ")}
    assert named == compiled


def test_the_step_timeouts_leave_room_under_the_device_tools_limit() -> None:
    line = re.search(r"^T_VERSIONS=.*$", SCRIPT, re.MULTILINE)
    assert line is not None
    timeouts = [int(value) for value in re.findall(r"T_\w+=(\d+)", line.group(0))]
    assert len(timeouts) >= 5 and sum(timeouts) < 540


def test_it_runs_python3_and_installs_without_build_isolation_or_deps() -> None:
    assert re.search(r'^PY="?\$\{PYTHON:-python3\}"?', SCRIPT, re.MULTILINE) or "PY=python3" in SCRIPT
    assert "--no-build-isolation" in SCRIPT and "--no-deps" in SCRIPT
