"""Build the emulated CUDA driver (``emu_cuda.c``) into a directory holding ``libcuda.so.1``.

Point ``LD_LIBRARY_PATH`` at that directory before a process starts and cuda-bindings loads the
emulator instead of a real driver (cuda-pathfinder finds driver libraries by a plain
``dlopen("libcuda.so.1")``, which honours ``LD_LIBRARY_PATH``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "emu_cuda.c"
LIBNAME = "libcuda.so.1"


class EmulatorBuildError(RuntimeError):
    """The C compiler is missing or failed; the message carries its output."""


def compiler() -> str | None:
    """The C compiler to use (``$CC``, else cc/gcc/clang on PATH), or None."""
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def build_emulator(out_dir: Path | None = None) -> Path:
    """Compile the emulator (once per source version) and return the directory holding it.

    The default directory is keyed by a hash of the source under the system temp dir, so
    concurrent test runs share one build; the library is written to a temp name and renamed.
    """
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    target_dir = out_dir if out_dir is not None else Path(tempfile.gettempdir()) / f"lifecycle-emu-cuda-{digest}"
    target = target_dir / LIBNAME
    if target.exists():
        return target_dir
    cc = compiler()
    if cc is None:
        raise EmulatorBuildError("no C compiler found (set CC, or install cc/gcc/clang)")
    target_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".libcuda-", suffix=".so", dir=target_dir)
    os.close(fd)
    cmd = [cc, "-O2", "-g", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
           "-fvisibility=hidden", f"-Wl,-soname,{LIBNAME}", "-o", tmp_name, str(SOURCE), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        os.unlink(tmp_name)
        raise EmulatorBuildError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    os.replace(tmp_name, target)
    return target_dir


if __name__ == "__main__":
    print(build_emulator())
