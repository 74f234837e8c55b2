"""Build the Cython modules of ``pyx/`` into the ``lifecycle`` package.

Every ``pyx/NAME.pyx`` becomes the extension ``lifecycle._NAME``. Its hand-written stub
``stubs/lifecycle/_NAME.pyi`` goes beside it in the built package (the wheel), never into the
source tree: mypy and stubtest read ``stubs/`` itself (``mypy_path`` in pyproject.toml).
``LIFECYCLE_BUILD_ONLY=blockpool,slots`` restricts a development build to some modules.

An editable install (``pip install -e .``) imports the checkout through setuptools' import hook,
which mypy does not run: it finds packages only on path entries. The editable wheel therefore also
carries a ``.pth`` naming two folders under ``build/__editable_typing__/`` in the checkout:
``package/lifecycle`` links to the checkout's package, and ``stubs/lifecycle`` holds links to the
stubs of ``stubs/`` (and a ``py.typed``), so ``mypy --strict`` on a user's script sees the checkout
with its stubs. The stubs' folder has no ``__init__.pyi``, as ``stubs/lifecycle`` has none: mypy
takes a stub there only when no other folder has it, and the first such folder on its path when
several do, so a checkout's own ``mypy_path = "stubs"`` still wins over an installed checkout's.

Building needs a C compiler and the Python headers; without them the build stops with one line
naming what to install (``_BuildExt``). Cython translates and the compiler compiles the modules
side by side, one process per CPU unless ``build_ext -j N`` says otherwise.
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

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:  # compile the modules side by side unless -j says otherwise
            self.parallel = os.cpu_count() or 1

    def build_extensions(self) -> None:
        missing = missing_build_tools(list(getattr(self.compiler, "compiler_so", None) or ["cc"]))
        if missing is not None:
            raise SystemExit(NO_COMPILER.format(missing=missing))
        super().build_extensions()


def _link(target: Path, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent), target_is_directory=target.is_dir())


def make_typing_dir(root: Path = ROOT, typing_dir: Path = TYPING_DIR) -> list[Path]:
    """The path entries of an editable install for mypy (see the module docstring), made afresh:
    links, so edits to the checkout and to ``stubs/`` are what mypy reads."""
    if typing_dir.is_symlink() or typing_dir.is_file():
        typing_dir.unlink()
    elif typing_dir.exists():
        shutil.rmtree(typing_dir)
    package, stubs = typing_dir / "package", typing_dir / "stubs"
    _link(root / "lifecycle", package / "lifecycle")
    (stubs / "lifecycle").mkdir(parents=True)
    (stubs / "lifecycle" / "py.typed").write_text("")  # mypy reads an installed folder only with one
    for stub in sorted((root / "stubs" / "lifecycle").glob("_*.pyi")):
        _link(stub, stubs / "lifecycle" / stub.name)
    return [package, stubs]


class _TypingPath:
    """An editable-install strategy of setuptools, plus the ``.pth`` of :func:`make_typing_dir`."""

    def __init__(self, strategy: Any, name: str) -> None:
        self._strategy = strategy
        self._name = name

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> object:
        result = self._strategy(wheel, files, mapping)
        lines = "".join(f"{entry}\n" for entry in make_typing_dir())
        wheel.writestr(f"__editable__.{self._name}-typing.pth", lines)
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
        nthreads=os.cpu_count() or 1,
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
