"""pytest-benchmark suite of device copies (``python -m pytest bench/test_bench_device.py``).

Each size is measured as a plain copy and as the block-wise batched copy of the same bytes, so the
runs can be tracked over time (``python bench/regress.py save`` / ``check``). The CUDA
cases run only where a GPU is present; the ratio table itself comes from ``device_bench.py``.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lifecycle.device import open_device  # noqa: E402
from lifecycle.device.base import Device  # noqa: E402
from lifecycle.errors import DriverNotFound  # noqa: E402

KiB = 1024
MiB = 1024 * KiB
BLOCK = 64 * KiB


def _open(kind: str) -> Device:
    if kind == "host":
        return open_device("host")
    try:
        return open_device("cuda")
    except DriverNotFound as exc:
        pytest.skip(f"no GPU: {exc}")


@pytest.fixture(params=["host", "cuda"])
def bench_device(request: pytest.FixtureRequest) -> Iterator[Device]:
    dev = _open(str(request.param))
    yield dev
    dev.close()


@pytest.fixture(params=[MiB, 16 * MiB], ids=["1MiB", "16MiB"])
def buffers(request: pytest.FixtureRequest, bench_device: Device) -> Iterator[tuple[Device, int, int, int, int]]:
    nbytes = int(request.param)
    dev = bench_device
    src, dst, staging = dev.alloc(nbytes), dev.alloc(nbytes), dev.alloc_pinned(nbytes)
    dev.memset(src, 1, nbytes)
    dev.memset(dst, 0, nbytes)
    dev.synchronize()
    yield dev, src, dst, staging, nbytes
    dev.free_pinned(staging)
    dev.free(dst)
    dev.free(src)


def _rows(dst: int, src: int, nbytes: int) -> np.ndarray:
    n = nbytes // BLOCK
    rng = np.random.default_rng(0)
    offsets = np.arange(n, dtype=np.int64) * BLOCK
    return np.stack([dst + rng.permutation(offsets), src + rng.permutation(offsets),
                     np.full(n, BLOCK, dtype=np.int64)], axis=1)


def test_plain_copy(benchmark: BenchmarkFixture, buffers: tuple[Device, int, int, int, int]) -> None:
    dev, src, dst, _, nbytes = buffers

    def plain() -> None:
        if dev.kind == "host":
            ctypes.memmove(dst, src, nbytes)
        else:
            dev.copy_dtod(dst, src, nbytes)
            dev.synchronize()

    benchmark(plain)


def test_compaction_batch(benchmark: BenchmarkFixture, buffers: tuple[Device, int, int, int, int]) -> None:
    dev, src, dst, _, nbytes = buffers
    rows = _rows(dst, src, nbytes)

    def compaction() -> None:
        dev.copy_batch(rows)
        dev.synchronize()

    benchmark(compaction)


def test_swap_out_batch(benchmark: BenchmarkFixture, buffers: tuple[Device, int, int, int, int]) -> None:
    dev, src, _, staging, nbytes = buffers
    rows = _rows(staging, src, nbytes)
    rows[:, 0] = staging + np.arange(rows.shape[0], dtype=np.int64) * BLOCK

    def swap_out() -> None:
        dev.copy_batch(rows)
        dev.synchronize()

    benchmark(swap_out)
