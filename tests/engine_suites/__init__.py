"""The engines' own tests, ported to run against lifecycle's adapters (and the engines' own classes).

Each ``suite_*.py`` imports its engine, so it runs inside that engine's peer environment
(``bench/.venv-peers/<engine>``, made by ``bench/peers.py``: CPU torch, the engine installed without
its GPU dependencies), never in the project's own environment. :func:`run_suite` runs one there with
the checkout first on the path and this interpreter's site-packages last (for lifecycle's own
dependencies; the engine's environment wins every name it has), and skips when the environment is
absent, as it is in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITES = Path(__file__).resolve().parent
#: Where the peer environments are (``LIFECYCLE_PEER_VENVS`` names another folder holding them).
VENVS = Path(os.environ.get("LIFECYCLE_PEER_VENVS", ROOT / "bench" / ".venv-peers"))
TIMEOUT_S = 900

_BOOT = """
import sys
sys.path.insert(0, {root!r})
sys.path.extend({site!r})
import pytest
sys.exit(pytest.main({args!r}))
"""


def engine_python(engine: str) -> Path:
    """The peer environment's interpreter, or a skip naming what is missing."""
    python = VENVS / engine / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no {engine} peer environment at {python.parent.parent} (python bench/peers.py makes it)")
    found = subprocess.run(
        [str(python), "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True, timeout=60
    )
    if found.stdout.strip() != str(sys.version_info[:2]):
        built = sys.version_info[:2]
        pytest.skip(f"the {engine} environment runs Python {found.stdout.strip()}; lifecycle is built for {built}")
    return python


def host_site_packages() -> list[str]:
    """This interpreter's site-packages (lifecycle's dependencies: numpy, xxhash, pytest ...)."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def run_suite(engine: str, suite: str, *pytest_args: str) -> str:
    """Run ``suite`` (a file of this folder) under ``engine``'s environment; returns pytest's
    summary line, failing the calling test with pytest's output when any test failed."""
    python = engine_python(engine)
    args = [
        str(SUITES / suite), "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
        # The engines warn at import (deprecations, CPU-only builds): not this project's warnings.
        "-o", "filterwarnings=ignore", *pytest_args,
    ]
    boot = _BOOT.format(root=str(ROOT), site=host_site_packages(), args=args)
    done = subprocess.run(
        [str(python), "-c", boot], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    if done.returncode != 0 or " passed" not in summary:
        pytest.fail(f"{suite} under {engine} failed ({summary or done.returncode}):\n{done.stdout[-8000:]}\n"
                    f"{done.stderr[-4000:]}", pytrace=False)
    return summary


def assert_import_loads_none_of(module: str, *absent: str) -> None:
    """Importing ``module`` in a fresh interpreter loads none of the modules ``absent``."""
    code = f"import sys, {module}\nloaded = [m for m in {absent!r} if m in sys.modules]\nassert not loaded, loaded\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
