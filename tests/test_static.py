"""The typing contract: ``mypy --strict`` is clean and the stubs match the compiled modules.

mypy and stubtest read the stubs in ``stubs/`` (``mypy_path``); the build copies them into the
wheel only. Cython embeds every compiled signature as ``__text_signature__`` (the "clinic" format),
so stubtest compares each method and constructor with its stub instead of skipping it.
"""

from __future__ import annotations

import importlib
import inspect
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "stubs"
ALLOWLIST = STUBS / "stubtest-allowlist.txt"
COMPILED = sorted(f"lifecycle._{p.stem}" for p in (ROOT / "pyx").glob("*.pyx"))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def _stubtest(*modules: str, config: Path = ROOT / "pyproject.toml") -> subprocess.CompletedProcess[str]:
    return _run("mypy.stubtest", *modules, "--mypy-config-file", str(config), "--allowlist", str(ALLOWLIST))


def _compiled_callables() -> Iterator[tuple[str, object]]:
    """Every public function, class constructor and method the compiled modules define."""
    for module_name in COMPILED:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module_name:
                continue
            if not isinstance(value, type):
                yield f"{module_name}.{name}", value
                continue
            for attr, member in vars(value).items():
                if attr == "__init__" or (not attr.startswith("_") and callable(member)):
                    yield f"{module_name}.{name}.{attr}", member


CALLABLES = dict(_compiled_callables())


@pytest.mark.skipif(sys.platform != "linux", reason="CI target only")
def test_mypy_strict_is_clean() -> None:
    result = _run("mypy", "--strict", "--no-error-summary")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_compiled_module_has_a_stub() -> None:
    stubs = {f"lifecycle.{p.stem}" for p in (STUBS / "lifecycle").glob("_*.pyi")}
    assert set(COMPILED) <= stubs, f"missing stubs for {sorted(set(COMPILED) - stubs)}"


def test_no_copy_of_a_stub_shadows_stubs_dir() -> None:
    # mypy prefers a .pyi inside the real package over one in mypy_path's namespace directory.
    copies = sorted(p.name for p in (ROOT / "lifecycle").rglob("*.pyi"))
    assert not copies, f"lifecycle/ holds {copies} (an old build's copies?): mypy would read them instead of stubs/"


@pytest.mark.parametrize("name", sorted(CALLABLES))
def test_every_compiled_signature_is_visible_to_stubtest(name: str) -> None:
    runtime = CALLABLES[name]
    if name.endswith(".__init__"):
        # Cython embeds a constructor's signature only in a docstring of its own, in a binding=False module.
        assert runtime.__doc__ != object.__init__.__doc__, f"{name} needs a docstring"
    try:
        inspect.signature(runtime)  # type: ignore[arg-type]
    except ValueError as error:
        pytest.fail(f"{name} has no signature stubtest can read ({error}); is embedsignature.format 'clinic'?")


def test_stubs_match_compiled_modules() -> None:
    result = _stubtest(*COMPILED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubtest_reports_a_stub_that_drifted_from_its_compiled_signature(tmp_path: Path) -> None:
    shutil.copytree(STUBS, tmp_path / "stubs")
    drifts = {
        "_kvcache.pyi": ("def grow(self, handle: int, num_blocks: _Int)", "def grow(self, handle: int, blocks: _Int)"),
        "_radix.pyi": ("*, capacity: int = 0", "*, capacity: int = 1"),
    }
    for stub, (now, drifted) in drifts.items():
        path = tmp_path / "stubs" / "lifecycle" / stub
        assert now in path.read_text(), f"{stub} no longer holds {now!r}: pick another signature to drift"
        path.write_text(path.read_text().replace(now, drifted))
    config = tmp_path / "pyproject.toml"  # the project's mypy settings, reading the drifted copy
    settings = (ROOT / "pyproject.toml").read_text()
    assert 'mypy_path = "stubs"' in settings
    config.write_text(settings.replace('mypy_path = "stubs"', f'mypy_path = "{tmp_path / "stubs"}"'))
    result = _stubtest("lifecycle._kvcache", "lifecycle._radix", config=config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "lifecycle._kvcache.KVCacheCore.grow is inconsistent" in result.stdout, result.stdout
    assert "lifecycle._radix.RadixTrie.__init__ is inconsistent" in result.stdout, result.stdout
