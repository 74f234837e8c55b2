"""Build the Cython modules of ``pyx/`` into the ``lifecycle`` package.

Every ``pyx/NAME.pyx`` becomes the extension ``lifecycle._NAME``. Its hand-written stub
``stubs/lifecycle/_NAME.pyi`` goes beside it in the built package (the wheel), never into the
source tree: mypy and stubtest read ``stubs/`` itself (``mypy_path`` in pyproject.toml).
``LIFECYCLE_BUILD_ONLY=blockpool,slots`` restricts a development build to some modules.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PYX = ROOT / "pyx"
STUBS = ROOT / "stubs" / "lifecycle"


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


setup(ext_modules=_extensions(), cmdclass={"build_py": _BuildPyWithStubs})
