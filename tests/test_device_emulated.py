"""Runs the device-parametrized suites on CudaDevice over the emulated driver (tests/emu_cuda/),
once per driver version the library must work with: CUDA 13.0 (``cuMemcpyBatchAsync`` without
``failIdx``), 12.8 (the first with batched copies, with ``failIdx``) and 12.6 (none: a loop of
copies).

The emulator is built with the C compiler into a cache directory, and the suites run in a child
pytest with ``LD_LIBRARY_PATH`` pointing there and ``LIFECYCLE_TEST_DEVICE=cuda``: cuda-bindings
finds the driver through cuda-pathfinder, which does a plain ``dlopen("libcuda.so.1")`` and so
honours ``LD_LIBRARY_PATH`` (read by the dynamic loader at process start, hence the child process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from devices import EXPECT_DRIVER_VERSION_ENV, EXPECT_EMULATOR_ENV, TEST_DEVICE_ENV
from emu_cuda.build import build_emulator

REPO = Path(__file__).resolve().parent.parent

#: Suites that take the ``device`` fixture and must pass on the emulated driver too (paths from
#: the repository root). Add yours here.
EMULATED_SUITES: list[str] = [
    "tests/test_device.py",
    "tests/test_device_cuda.py",
    "tests/test_device_streams.py",
    "tests/test_dlpack.py",
    "tests/test_emulator.py",
    "tests/test_foreign_streams.py",
    "tests/test_pools.py",
    "tests/test_model.py",
    "tests/test_swap_format.py",
    "tests/test_swap_model.py",
    "tests/test_swap_tier.py",
    "tests/test_snapshots.py",
    "tests/test_faults.py",
    "tests/test_fuzz_restore.py",
    "tests/test_threads.py",
    "tests/test_bad_input.py",
    "tests/test_device_tables.py",
]

#: Driver versions (cuDriverGetVersion) the suites run at.
DRIVER_VERSIONS = [13000, 12080, 12060]

TIMEOUT_S = 600


def emulated_env(emu_dir: Path, driver_version: int = DRIVER_VERSIONS[0]) -> dict[str, str]:
    """The environment of a child process that loads the emulator as its CUDA driver, reporting
    ``driver_version``."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(emu_dir), env.get("LD_LIBRARY_PATH", "")) if p)
    env[TEST_DEVICE_ENV] = "cuda"
    env[EXPECT_EMULATOR_ENV] = "1"
    env["EMU_CUDA_DRIVER_VERSION"] = str(driver_version)
    env[EXPECT_DRIVER_VERSION_ENV] = str(driver_version)
    return env


@pytest.mark.skipif(os.environ.get(TEST_DEVICE_ENV) == "cuda", reason="already running on a CUDA device")
@pytest.mark.parametrize("driver_version", DRIVER_VERSIONS)
def test_device_suites_pass_on_the_emulated_cuda_driver(driver_version: int) -> None:
    emu_dir = build_emulator()
    missing = [s for s in EMULATED_SUITES if not (REPO / s).exists()]
    assert not missing, f"EMULATED_SUITES names files that do not exist: {missing}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu and not slow", "-rfEs",
           *EMULATED_SUITES]
    proc = subprocess.run(cmd, cwd=REPO, env=emulated_env(emu_dir, driver_version), capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    output = proc.stdout + proc.stderr
    summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
    print(f"emulated CUDA driver {driver_version} ({emu_dir}): {summary}")
    assert proc.returncode == 0, f"suites failed on the emulated CUDA driver {driver_version}:\n{output[-8000:]}"
