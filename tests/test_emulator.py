"""The emulated driver (tests/emu_cuda) is at least as strict as a real one where the library could
go wrong: these tests call it directly, below the device layer, to pin down the rules it enforces.

They need the emulator (the ``emu`` fixture skips them elsewhere) and run in CI through
tests/test_device_emulated.py, once per emulated driver version.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from devices import (  # noqa: F401  (fixtures)
    CUDA_ERROR_INVALID_VALUE,
    Emulator,
    device,
    emu,
    in_forked_child,
    read_device,
    write_device,
)
from lifecycle.device.base import Device

KiB = 1024
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_HANDLE = 400
SYMBOL_NOT_FOUND = 1
VERSION_NOT_SUFFICIENT = 2
ORDER_STREAM = 1
BATCH_MIN_VERSION = 12080


@pytest.fixture
def driver(device: Device, emu: Emulator) -> Iterator[Any]:
    """``cuda.bindings.driver`` over the emulator, the calling thread bound to the device's context."""
    from cuda.bindings import driver as module

    device.bind_to_thread()
    yield module


def driver_version(driver: Any) -> int:
    err, version = driver.cuDriverGetVersion()
    assert not err
    return int(version)


# ----------------------------------------------------------------------------- cuGetProcAddress


def test_an_entry_point_asked_for_a_version_newer_than_the_driver_is_invalid_value(driver: Any) -> None:
    flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    err, pfn, _ = driver.cuGetProcAddress(b"cuMemAlloc", driver_version(driver) + 10, flags)
    assert err == driver.CUresult.CUDA_ERROR_INVALID_VALUE and not pfn


def test_an_unknown_entry_point_is_success_with_a_null_pointer(driver: Any) -> None:
    flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    err, pfn, status = driver.cuGetProcAddress(b"cuNoSuchFunction", 12000, flags)
    assert (err, pfn, int(status)) == (driver.CUresult.CUDA_SUCCESS, 0, SYMBOL_NOT_FOUND)


def test_an_entry_point_asked_for_an_older_version_than_it_has_is_a_null_pointer(driver: Any) -> None:
    flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    err, pfn, status = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12000, flags)
    expected = VERSION_NOT_SUFFICIENT if driver_version(driver) >= BATCH_MIN_VERSION else SYMBOL_NOT_FOUND
    assert (err, pfn, int(status)) == (driver.CUresult.CUDA_SUCCESS, 0, expected)


# ----------------------------------------------------------------------------- cuMemcpyBatchAsync


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """CUmemcpyAttributes, laid out as in cuda.h."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_hint", _Location), ("dst_hint", _Location),
                ("flags", ctypes.c_uint)]


def raw_batch(driver: Any, stream: int, rows: list[tuple[int, int, int]], attrs: list[tuple[int, int]],
              indices: list[int]) -> int:
    """cuMemcpyBatchAsync of ``rows`` with ``(srcAccessOrder, flags)`` attributes applying from
    ``indices``, called through the pointer cuGetProcAddress gives (as CudaDevice does)."""
    version = 13000 if driver_version(driver) >= 13000 else BATCH_MIN_VERSION
    flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    err, pfn, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", version, flags)
    assert not err and pfn
    p, n = ctypes.c_void_p, ctypes.c_size_t
    columns = np.ascontiguousarray(np.array(rows, dtype=np.uint64).reshape(-1, 3).T)
    count = len(rows)
    table = (_Attributes * len(attrs))(*[_Attributes(order, _Location(1, 0), _Location(1, 0), f) for order, f in attrs])
    idx = np.array(indices, dtype=np.uint64)
    args: list[Any] = [columns[0].ctypes.data, columns[1].ctypes.data, columns[2].ctypes.data, count,
                       ctypes.addressof(table), idx.ctypes.data, len(attrs)]
    if version >= 13000:
        proto = ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, n, p, p, n, p)
    else:
        proto = ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, n, p, p, n, p, p)
        args.append(ctypes.addressof(ctypes.c_size_t(0)))
    return int(proto(pfn)(*args, stream))


@pytest.fixture
def batch_device(device: Device, driver: Any) -> Device:
    if driver_version(driver) < BATCH_MIN_VERSION:
        pytest.skip("this driver has no cuMemcpyBatchAsync")
    return device


def _two_copies(ptr: int) -> list[tuple[int, int, int]]:
    return [(ptr, ptr + 2 * KiB, KiB), (ptr + KiB, ptr + 3 * KiB, KiB)]


def test_a_well_formed_batch_is_accepted(batch_device: Device, driver: Any) -> None:
    data = np.arange(4 * KiB, dtype=np.int64).astype(np.uint8)
    ptr = batch_device.alloc(4 * KiB)
    write_device(batch_device, ptr, data)
    stream = getattr(batch_device, "stream_handle")
    attrs = [(ORDER_STREAM, 0), (ORDER_STREAM, 1)]
    assert raw_batch(driver, stream, _two_copies(ptr), attrs, [0, 1]) == CUDA_SUCCESS
    out = read_device(batch_device, ptr, 4 * KiB)
    assert np.array_equal(out[: 2 * KiB], data[2 * KiB :])
    batch_device.free(ptr)


BAD_ATTRIBUTES = {
    "srcAccessOrder INVALID": ([(0, 0)], [0]),
    "srcAccessOrder past ANY": ([(4, 0)], [0]),
    "unknown flag": ([(ORDER_STREAM, 2)], [0]),
    "first index not 0": ([(ORDER_STREAM, 0)], [1]),
    "indices not increasing": ([(ORDER_STREAM, 0), (ORDER_STREAM, 0)], [0, 0]),
    "index past the batch": ([(ORDER_STREAM, 0), (ORDER_STREAM, 0)], [0, 2]),
    "more attributes than copies": ([(ORDER_STREAM, 0)] * 3, [0, 1, 2]),
}


@pytest.mark.parametrize("attrs, indices", BAD_ATTRIBUTES.values(), ids=BAD_ATTRIBUTES.keys())
def test_a_batch_with_invalid_attributes_is_refused_and_queues_nothing(
    batch_device: Device, driver: Any, emu: Emulator, attrs: list[tuple[int, int]], indices: list[int]
) -> None:
    ptr = batch_device.alloc(4 * KiB)
    stream = getattr(batch_device, "stream_handle")
    assert raw_batch(driver, stream, _two_copies(ptr), attrs, indices) == CUDA_ERROR_INVALID_VALUE
    assert emu.pending_ops == 0
    batch_device.free(ptr)


def test_a_batch_with_overlapping_copies_is_refused_and_queues_nothing(
    batch_device: Device, driver: Any, emu: Emulator
) -> None:
    ptr = batch_device.alloc(4 * KiB)
    stream = getattr(batch_device, "stream_handle")
    chained = [(ptr + KiB, ptr, KiB), (ptr + 2 * KiB, ptr + KiB, KiB)]  # the second reads what the first writes
    assert raw_batch(driver, stream, chained, [(ORDER_STREAM, 0)], [0]) == CUDA_ERROR_INVALID_VALUE
    assert emu.pending_ops == 0
    batch_device.free(ptr)


# ----------------------------------------------------------------------------- handles and processes


def test_a_destroyed_stream_handle_stays_invalid_after_new_streams_are_made(driver: Any) -> None:
    flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
    err, old = driver.cuStreamCreate(flags)
    assert not err
    (err,) = driver.cuStreamDestroy(old)
    assert not err
    fresh = [driver.cuStreamCreate(flags)[1] for _ in range(8)]
    assert int(old) not in {int(s) for s in fresh}
    (err,) = driver.cuStreamSynchronize(old)
    assert int(err) == CUDA_ERROR_INVALID_HANDLE
    for stream in fresh:
        driver.cuStreamDestroy(stream)


def test_a_destroyed_event_handle_stays_invalid(driver: Any) -> None:
    err, event = driver.cuEventCreate(0)
    assert not err
    (err,) = driver.cuEventDestroy(event)
    assert not err
    (err,) = driver.cuEventRecord(event, 0)
    assert int(err) == CUDA_ERROR_INVALID_HANDLE


def test_every_driver_call_of_a_forked_child_fails_with_not_initialized(driver: Any) -> None:
    def call_driver() -> str:
        (init,) = driver.cuInit(0)
        err, _ = driver.cuDeviceGetCount()
        return f"{int(init)},{int(err)}"

    assert in_forked_child(call_driver) == f"{CUDA_ERROR_NOT_INITIALIZED},{CUDA_ERROR_NOT_INITIALIZED}"
