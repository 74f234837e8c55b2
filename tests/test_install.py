"""Installing lifecycle as a user would: ``mypy --strict`` on a user's script against the README's
editable install, the build's one-line refusal without a compiler, and the packaging metadata.

mypy runs no import hooks: it finds packages only on path entries (site-packages and the path lines
of its ``.pth`` files). setuptools' editable install imports the checkout through a hook, so
setup.py adds a ``.pth`` naming ``build/__editable_typing__/`` (the checkout's package and a partial
stub package linking ``stubs/``). CI (.ci/run) installs this checkout with the README's command and
runs the first test below against that install; elsewhere it runs where the checkout is the
editable install, and the mechanism itself is tested on a fresh virtual environment.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lifecycle._packaging import editable_checkout, installed_version

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def load_setup() -> ModuleType:
    """setup.py as a module (its ``setup()`` call runs only as a script)."""
    spec = importlib.util.spec_from_file_location("lifecycle_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def user_script(folder: Path) -> Path:
    """The README's API tour as a user's own script, in a folder of its own."""
    match = re.search(r"## API tour\n\n```python\n(.*?)```", README, re.S)
    assert match is not None
    script = folder / "user_script.py"
    script.write_text(match.group(1))
    return script


def mypy_strict(script: Path, python: str) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` as a user runs it: from the script's folder, no config, no MYPYPATH, the
    packages of ``python``'s environment."""
    env = {key: value for key, value in os.environ.items() if key not in ("MYPYPATH", "PYTHONPATH")}
    command = [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--python-executable", python,
               "--cache-dir", str(script.parent / ".mypy_cache"), script.name]
    return subprocess.run(command, cwd=script.parent, env=env, capture_output=True, text=True, timeout=600)


def test_mypy_strict_passes_on_a_user_script_against_the_editable_install(tmp_path: Path) -> None:
    checkout = editable_checkout()
    if checkout is None or checkout.resolve() != ROOT:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs the README's `pip install -e '.[test]'` of {ROOT}; the install found is {checkout}")
        pytest.skip(f"lifecycle is not installed editable from {ROOT} here (from: {checkout})")
    result = mypy_strict(user_script(tmp_path), sys.executable)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_typing_path_gives_mypy_the_checkout_and_its_stubs(tmp_path: Path) -> None:
    setup = load_setup()
    typing_dir = setup.make_typing_dir(ROOT, tmp_path / "typing")
    assert (typing_dir / "lifecycle").resolve() == ROOT / "lifecycle"
    stubs = typing_dir / "lifecycle-stubs"
    assert (stubs / "py.typed").read_text() == "partial\n"
    linked = {path.name: path.resolve() for path in stubs.glob("*.pyi")}
    assert linked == {path.name: path for path in (ROOT / "stubs" / "lifecycle").glob("_*.pyi")}
    # A fresh environment whose only way to lifecycle is that path entry, as the editable wheel's .pth gives it.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "__editable__.kv_lifecycle-typing.pth").write_text(f"{typing_dir}\n")
    result = mypy_strict(user_script(tmp_path), str(python))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_typing_dir_is_made_afresh(tmp_path: Path) -> None:
    setup = load_setup()
    typing_dir = tmp_path / "typing"
    (typing_dir / "lifecycle-stubs").mkdir(parents=True)
    (typing_dir / "lifecycle-stubs" / "_gone.pyi").write_text("")  # a stub since removed from stubs/
    setup.make_typing_dir(ROOT, typing_dir)
    assert not (typing_dir / "lifecycle-stubs" / "_gone.pyi").exists()


class RecordingStrategy:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
        self.calls.append("call")

    def __enter__(self) -> RecordingStrategy:
        self.calls.append("enter")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.calls.append("exit")


class RecordingWheel:
    def __init__(self) -> None:
        self.files: dict[str, str] = {}

    def writestr(self, name: str, content: str) -> None:
        self.files[name] = content


def test_the_editable_wheel_gets_the_typing_pth_beside_setuptools_own_files(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    setup = load_setup()
    monkeypatch.setattr(setup, "make_typing_dir", lambda: tmp_path / "typing")
    strategy, wheel = RecordingStrategy(), RecordingWheel()
    with setup._TypingPath(strategy, "kv_lifecycle-0.1.0") as wrapped:
        wrapped(wheel, [], {})
    assert strategy.calls == ["enter", "call", "exit"]
    assert wheel.files == {"__editable__.kv_lifecycle-0.1.0-typing.pth": f"{tmp_path / 'typing'}\n"}


def test_a_missing_compiler_is_named_in_one_line() -> None:
    setup = load_setup()
    missing = setup.missing_build_tools(["no-such-cc", "-pthread"])
    assert missing is not None and "a C compiler (no-such-cc is not on PATH)" in missing
    message = setup.NO_COMPILER.format(missing=missing)
    assert "\n" not in message and "apt-get install gcc python3-dev" in message


def test_the_build_stops_with_that_line_without_a_compiler(tmp_path: Path) -> None:
    version = installed_version("setuptools") or "0"
    if int(version.split(".")[0]) < 77:
        pytest.skip(f"setuptools {version} cannot read pyproject.toml's license (>= 77; pip install -e '.[test]')")
    env = {**os.environ, "CC": "no-such-cc", "LIFECYCLE_BUILD_ONLY": "slots"}
    command = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
               "--build-temp", str(tmp_path / "temp")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("kv-lifecycle: building from source needs a C compiler (no-such-cc is not on PATH)")
    assert "apt-get install gcc python3-dev" in lines[-1] and "Traceback" not in result.stderr


def test_the_license_is_an_spdx_expression_with_its_text() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_setuptools_is_bounded_above_and_new_enough_for_the_license() -> None:
    (setuptools,) = [req for req in PYPROJECT["build-system"]["requires"] if req.startswith("setuptools")]
    lower = re.search(r">=\s*(\d+)", setuptools)
    assert lower is not None and int(lower.group(1)) >= 77 and "<" in setuptools


def test_the_cuda_extras_pin_one_major_each() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert extras["cuda12"] == ["cuda-bindings>=12.9,<13"] and extras["cuda13"] == ["cuda-bindings>=13,<14"]
    assert "cuda-bindings>=12.9,<14" in PYPROJECT["project"]["dependencies"]
