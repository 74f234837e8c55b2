"""Build the Cython modules of ``pyx/`` into the ``lifecycle`` package.

Every ``pyx/NAME.pyx`` becomes the extension ``lifecycle._NAME``; its hand-written stub
``stubs/lifecycle/_NAME.pyi`` is copied beside it so that mypy, stubtest and users see the types.
``LIFECYCLE_BUILD_ONLY=blockpool,slots`` restricts a development build to some modules.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
PYX = ROOT / "pyx"
STUBS = ROOT / "stubs" / "lifecycle"
PACKAGE = ROOT / "lifecycle"


def _wanted(name: str) -> bool:
    only = os.environ.get("LIFECYCLE_BUILD_ONLY", "").strip()
    return not only or name in {part.strip() for part in only.split(",")}


def _copy_stubs() -> None:
    for stub in sorted(STUBS.glob("_*.pyi")):
        target = PACKAGE / stub.name
        if not target.exists() or target.read_bytes() != stub.read_bytes():
            shutil.copyfile(stub, target)


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
            "embedsignature": True,
        },
    )


_copy_stubs()
setup(ext_modules=_extensions())
