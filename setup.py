"""Build the Cython modules of ``pyx/`` into the ``lifecycle`` package.

Every ``pyx/NAME.pyx`` becomes the extension ``lifecycle._NAME``. Its hand-written stub
``stubs/lifecycle/_NAME.pyi`` goes beside it in the built package (the wheel), never into the
source tree: mypy and stubtest read ``stubs/`` itself (``mypy_path`` in pyproject.toml).
``LIFECYCLE_BUILD_ONLY=blockpool,slots`` restricts a development build to some modules.

An editable install (``pip install -e .``) imports the checkout through setuptools' import hook,
which mypy does not run: it finds packages only on path entries. The editable wheel therefore also
carries a ``.pth`` naming ``build/__editable_typing__/`` in the checkout, where ``lifecycle`` links
to the checkout's package and ``lifecycle-stubs`` (a partial PEP 561 stub package) links to the
stubs of ``stubs/``, so ``mypy --strict`` on a user's script sees the checkout with its stubs.

Building needs a C compiler and the Python headers; without them the build stops with one line
naming what to install (``_BuildExt``).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).resolve().parent
PYX = ROOT / "pyx"
STUBS = ROOT / "stubs" / "lifecycle"
TYPING_DIR = ROOT / "build" / "__editable_typing__"
NO_COMPILER = (
    "kv-lifecycle: building from source needs {missing}: install gcc and the Python headers "
    "(Debian/Ubuntu: apt-get install gcc python3-dev; Fedora/RHEL: dnf install gcc python3-devel), "
    "or install a prebuilt wheel (tools/build_wheel.sh makes one)"
)


def _wanted(name: str) -> bool:
    only = os.environ.get("LIFECYCLE_BUILD_ONLY", "").strip()
    return not only or name in {part.strip() for part in only.split(",")}


class _BuildPyWithStubs(build_py):
    """``build_py`` that also puts the compiled modules' stubs into the built ``lifecycle``."""

    def _stub_targets(self) -> list[tuple[Path, Path]]:
        if self.editable_mode:  # an editable install runs from the checkout, whose mypy reads stubs/
            return []
        package = Path(self.build_lib) / "lifecycle"
        return [(stub, package / stub.name) for stub in sorted(STUBS.glob("_*.pyi"))]

    def run(self) -> None:
        super().run()
        for stub, target in self._stub_targets():
            self.mkpath(str(target.parent))
            self.copy_file(str(stub), str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *(str(target) for _, target in self._stub_targets())]


def missing_build_tools(compiler_command: list[str]) -> str | None:
    """What of a C compiler and the Python headers is missing here, in words, or None."""
    missing = []
    if not compiler_command or shutil.which(compiler_command[0]) is None:
        missing.append(f"a C compiler ({compiler_command[0] if compiler_command else 'cc'} is not on PATH)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        missing.append(f"the Python headers ({include}/Python.h is missing)")
    return " and ".join(missing) or None


class _BuildExt(build_ext):
    """``build_ext`` that refuses in one line, naming what to install, where no compiler or no
    Python headers are (instead of a compiler's traceback under pip's "Failed building wheel")."""

    def build_extensions(self) -> None:
        missing = missing_build_tools(list(getattr(self.compiler, "compiler_so", None) or ["cc"]))
        if missing is not None:
            raise SystemExit(NO_COMPILER.format(missing=missing))
        super().build_extensions()


def _link(target: Path, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent), target_is_directory=target.is_dir())


def make_typing_dir(root: Path = ROOT, typing_dir: Path = TYPING_DIR) -> Path:
    """The path entry of an editable install for mypy (see the module docstring), made afresh:
    links, so edits to the checkout and to ``stubs/`` are what mypy reads."""
    if typing_dir.is_symlink() or typing_dir.is_file():
        typing_dir.unlink()
    elif typing_dir.exists():
        shutil.rmtree(typing_dir)
    _link(root / "lifecycle", typing_dir / "lifecycle")
    stubs = typing_dir / "lifecycle-stubs"
    stubs.mkdir(parents=True)
    (stubs / "py.typed").write_text("partial\n")  # what is not stubbed here comes from the package
    for stub in sorted((root / "stubs" / "lifecycle").glob("_*.pyi")):
        _link(stub, stubs / stub.name)
    return typing_dir


class _TypingPath:
    """An editable-install strategy of setuptools, plus the ``.pth`` of :func:`make_typing_dir`."""

    def __init__(self, strategy: Any, name: str) -> None:
        self._strategy = strategy
        self._name = name

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> object:
        result = self._strategy(wheel, files, mapping)
        wheel.writestr(f"__editable__.{self._name}-typing.pth", f"{make_typing_dir()}\n")
        return result

    def __enter__(self) -> _TypingPath:
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> object:
        return self._strategy.__exit__(*exc_info)


class _EditableWheel(editable_wheel):
    # _select_strategy is setuptools' private hook (hence the upper bound on setuptools in
    # pyproject.toml); tests/test_install.py checks mypy against a real editable install.
    def _select_strategy(self, name: str, tag: str, build_lib: Any) -> Any:
        return _TypingPath(super()._select_strategy(name, tag, build_lib), name)


def _extensions() -> list[Extension]:
    extensions = []
    for source in sorted(PYX.glob("*.pyx")):
        name = source.stem
        if not _wanted(name):
            continue
        extensions.append(
            Extension(
                f"lifecycle._{name}",
                [os.path.relpath(source, ROOT)],
                include_dirs=[numpy.get_include(), str(PYX)],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                extra_compile_args=["-O3", "-fno-strict-aliasing"],
            )
        )
    return cythonize(
        extensions,
        include_path=[str(PYX)],
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            # Signatures as __text_signature__ (what inspect and stubtest read), for binding=False
            # classes too, whose methods are otherwise opaque builtins to them.
            "embedsignature": True,
            "embedsignature.format": "clinic",
        },
    )


if __name__ == "__main__":  # tests import the helpers above without building
    setup(
        ext_modules=_extensions(),
        cmdclass={"build_py": _BuildPyWithStubs, "build_ext": _BuildExt, "editable_wheel": _EditableWheel},
    )
