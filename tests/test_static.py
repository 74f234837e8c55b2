"""The typing contract: ``mypy --strict`` is clean and the stubs match the compiled modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPILED = sorted(f"lifecycle._{p.stem}" for p in (ROOT / "pyx").glob("*.pyx"))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(sys.platform != "linux", reason="CI target only")
def test_mypy_strict_is_clean() -> None:
    result = _run("mypy", "--strict", "--no-error-summary")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_compiled_module_has_a_stub() -> None:
    stubs = {f"lifecycle.{p.stem}" for p in (ROOT / "stubs" / "lifecycle").glob("_*.pyi")}
    assert set(COMPILED) <= stubs, f"missing stubs for {sorted(set(COMPILED) - stubs)}"


def test_stubs_match_compiled_modules() -> None:
    allowlist = ROOT / "stubs" / "stubtest-allowlist.txt"
    args = ["mypy.stubtest", *COMPILED, "--mypy-config-file", str(ROOT / "pyproject.toml")]
    if allowlist.exists():
        args += ["--allowlist", str(allowlist)]
    result = _run(*args)
    assert result.returncode == 0, result.stdout + result.stderr
