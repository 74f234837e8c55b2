"""The Device contract, on whichever device ``LIFECYCLE_TEST_DEVICE`` selects (see tests/devices.py).

The same tests run on HostDevice (default), HostDevice(deferred=True), CudaDevice over the emulated
driver (tests/test_device_emulated.py) and CudaDevice on a real GPU (tests/test_device_gpu.py). The
fault-injection tests at the end need the emulated driver and are skipped elsewhere.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from devices import (
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    Emulator,
    copies_are_deferred,
    device,  # noqa: F401  (the fixture)
    emu,  # noqa: F401  (the fixture)
    live_allocations,
    read_device,
    write_device,
)
from lifecycle.device import open_device
from lifecycle.device.base import Device
from lifecycle.device.host import HostDevice
from lifecycle.errors import ConfigError, CudaError, DeviceError, DriverNotFound, InvalidId, InvalidType, TornDown

KiB = 1024
MiB = 1024 * KiB


def random_bytes(nbytes: int, seed: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def filled(dev: Device, data: npt.NDArray[np.uint8]) -> int:
    """A new allocation holding ``data``."""
    ptr = dev.alloc(data.nbytes)
    write_device(dev, ptr, data)
    return ptr


# -- identity and allocation ----------------------------------------------------------------------


def test_device_satisfies_the_protocol_and_names_itself(device: Device) -> None:
    assert isinstance(device, Device)
    assert device.kind in ("host", "cuda")
    assert device.name


def test_alloc_returns_distinct_256_byte_aligned_addresses(device: Device) -> None:
    ptrs = [device.alloc(n) for n in (1, 100, 4096, 3 * MiB + 5)]
    assert len(set(ptrs)) == 4
    assert all(p % 256 == 0 for p in ptrs)
    assert live_allocations(device) == 4
    for p in ptrs:
        device.free(p)
    assert live_allocations(device) == 0


@pytest.mark.parametrize("nbytes", [0, -1])
def test_alloc_refuses_a_size_below_one_byte(device: Device, nbytes: int) -> None:
    with pytest.raises(InvalidId, match=f"nbytes={nbytes}"):
        device.alloc(nbytes)
    with pytest.raises(InvalidId, match=f"nbytes={nbytes}"):
        device.alloc_pinned(nbytes)
    assert live_allocations(device) == 0


def test_second_free_of_an_address_is_refused(device: Device) -> None:
    ptr = device.alloc(1024)
    device.free(ptr)
    with pytest.raises(InvalidId, match=f"{ptr:#x}"):
        device.free(ptr)
    assert live_allocations(device) == 0


def test_free_of_an_interior_or_foreign_address_is_refused(device: Device) -> None:
    ptr = device.alloc(1024)
    with pytest.raises(InvalidId):
        device.free(ptr + 256)
    pinned = device.alloc_pinned(1024)
    with pytest.raises(InvalidId):
        device.free(pinned)
    with pytest.raises(InvalidId):
        device.free_pinned(ptr)
    assert live_allocations(device) == 2
    device.free(ptr)
    device.free_pinned(pinned)


def test_mem_info_free_bytes_drop_by_at_least_an_allocation(device: Device) -> None:
    free_before, total = device.mem_info()
    assert 0 <= free_before <= total
    ptr = device.alloc(64 * MiB)
    free_after, total_after = device.mem_info()
    assert total_after == total
    assert free_after <= free_before - 64 * MiB
    device.free(ptr)


def test_host_device_refuses_an_allocation_past_its_capacity() -> None:
    dev = HostDevice(capacity=4 * MiB)
    ptr = dev.alloc(3 * MiB)
    with pytest.raises(DeviceError, match=f"nbytes={2 * MiB}.*{MiB} of capacity {4 * MiB}"):
        dev.alloc(2 * MiB)
    assert dev.mem_info() == (MiB, 4 * MiB)
    assert dev.live_allocations == 1
    dev.free(ptr)
    dev.close()


# -- copies ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 255, 4096, MiB + 3])
def test_host_to_device_to_host_roundtrip_is_bit_exact(device: Device, nbytes: int) -> None:
    data = random_bytes(nbytes, seed=nbytes)
    ptr = filled(device, data)
    assert np.array_equal(read_device(device, ptr, nbytes), data)
    device.free(ptr)


def test_device_to_device_copy_at_offsets_is_bit_exact(device: Device) -> None:
    data = random_bytes(64 * KiB, seed=1)
    src = filled(device, data)
    dst = filled(device, np.zeros(64 * KiB, dtype=np.uint8))
    device.copy_dtod(dst + 1000, src + 7, 30_000)
    device.synchronize()
    out = read_device(device, dst, 64 * KiB)
    assert np.array_equal(out[1000:31_000], data[7:30_007])
    assert not out[:1000].any() and not out[31_000:].any()
    device.free(src)
    device.free(dst)


def test_copy_batch_copies_every_range(device: Device) -> None:
    block = 4 * KiB
    nblocks = 64
    data = random_bytes(block * nblocks, seed=2)
    src = filled(device, data)
    dst = filled(device, np.zeros(block * nblocks, dtype=np.uint8))
    order = np.random.default_rng(3).permutation(nblocks)
    device.copy_batch([(dst + int(j) * block, src + i * block, block) for i, j in enumerate(order)])
    device.synchronize()
    out = read_device(device, dst, block * nblocks).reshape(nblocks, block)
    expected = np.empty_like(out)
    expected[order] = data.reshape(nblocks, block)
    assert np.array_equal(out, expected)
    device.free(src)
    device.free(dst)


def test_copy_batch_gathers_into_pinned_memory_and_scatters_back(device: Device) -> None:
    block = 2 * KiB
    data = random_bytes(16 * block, seed=14)
    src = filled(device, data)
    dst = filled(device, np.zeros(16 * block, dtype=np.uint8))
    staging = device.alloc_pinned(4 * block)
    picked = [13, 2, 7, 9]
    device.copy_batch([(staging + i * block, src + b * block, block) for i, b in enumerate(picked)])
    device.synchronize()
    expected = data.reshape(16, block)[picked].reshape(-1)
    assert np.array_equal(device.host_array(staging, 4 * block), expected)
    device.copy_batch([(dst + b * block, staging + i * block, block) for i, b in enumerate(picked)])
    device.synchronize()
    out = read_device(device, dst, 16 * block).reshape(16, block)
    assert np.array_equal(out[picked].reshape(-1), expected)
    assert not np.delete(out, picked, axis=0).any()
    device.free_pinned(staging)
    device.free(src)
    device.free(dst)


def test_copy_batch_refuses_pageable_host_memory(device: Device) -> None:
    ptr = device.alloc(1024)
    host = np.zeros(1024, dtype=np.uint8)
    with pytest.raises(InvalidId, match="copy_batch dst"):
        device.copy_batch([(host.ctypes.data, ptr, 1024)])
    device.free(ptr)


def test_copy_batch_takes_an_int64_array_of_rows(device: Device) -> None:
    data = random_bytes(8 * KiB, seed=13)
    src = filled(device, data)
    dst = filled(device, np.zeros(8 * KiB, dtype=np.uint8))
    rows = np.array([[dst + i * KiB, src + (7 - i) * KiB, KiB] for i in range(8)], dtype=np.int64)
    device.copy_batch(rows)
    device.synchronize()
    assert np.array_equal(read_device(device, dst, 8 * KiB), data.reshape(8, KiB)[::-1].reshape(-1))
    with pytest.raises(InvalidId, match="shape"):
        device.copy_batch(rows[:, :2])
    device.free(src)
    device.free(dst)


def test_copy_batch_refuses_a_range_spanning_two_allocations(device: Device) -> None:
    ptrs = sorted(device.alloc(256) for _ in range(4))
    other = device.alloc(4096)
    for left, right in zip(ptrs, ptrs[1:]):
        if left + 256 == right:  # adjacent: a range across the seam touches two allocations
            with pytest.raises(InvalidId, match="copy_batch src"):
                device.copy_batch([(other, left + 128, 256)])
    with pytest.raises(InvalidId, match="copy_batch src"):
        device.copy_batch([(other, min(ptrs + [other]) - 64, 64)])  # just below every allocation
    for p in ptrs + [other]:
        device.free(p)


def test_copy_batch_names_the_first_bad_copy(device: Device) -> None:
    ptr = device.alloc(4096)
    rows = [(ptr, ptr + 2048, 1024)] * 5 + [(ptr + 4000, ptr, 200)]
    with pytest.raises(InvalidId, match=r"copy_batch dst \(copy 5\)"):
        device.copy_batch(rows)
    with pytest.raises(InvalidId, match="nbytes=-3 of copy 1"):
        device.copy_batch([(ptr, ptr + 2048, 8), (ptr, ptr + 2048, -3)])
    device.free(ptr)


def test_copy_batch_accepts_an_empty_batch_and_zero_byte_entries(device: Device) -> None:
    data = random_bytes(512, seed=4)
    src = filled(device, data)
    dst = filled(device, np.zeros(512, dtype=np.uint8))
    device.copy_batch([])
    device.copy_batch([(dst, src, 0), (dst, src, 512), (0, 0, 0)])
    device.synchronize()
    assert np.array_equal(read_device(device, dst, 512), data)
    device.free(src)
    device.free(dst)


def test_copy_batch_checks_every_range_before_issuing_any(device: Device) -> None:
    data = random_bytes(1024, seed=5)
    src = filled(device, data)
    dst = filled(device, np.zeros(1024, dtype=np.uint8))
    with pytest.raises(InvalidId, match="copy_batch dst"):
        device.copy_batch([(dst, src, 512), (dst + 1000, src, 512)])
    device.synchronize()
    assert not read_device(device, dst, 1024).any()
    device.free(src)
    device.free(dst)


# Offsets (in KiB) into one 16 KiB allocation for two 1 KiB copies whose order would matter.
OVERLAPPING_BATCHES = {
    "two copies write one range": [(0, 4), (0, 8)],
    "a copy reads what another writes": [(0, 4), (8, 0)],
    "ranges overlap part way": [(0, 4), (8, 0.5)],
    "a copy onto its own source": [(0, 0.5)],
}


@pytest.mark.parametrize("offsets", OVERLAPPING_BATCHES.values(), ids=OVERLAPPING_BATCHES.keys())
def test_copy_batch_refuses_copies_whose_order_would_matter(device: Device, offsets: list[tuple[float, float]]) -> None:
    data = random_bytes(16 * KiB, seed=15)
    ptr = filled(device, data)
    rows = [(ptr + int(dst * KiB), ptr + int(src * KiB), KiB) for dst, src in offsets]
    with pytest.raises(InvalidId, match="overlap"):
        device.copy_batch(rows)
    device.synchronize()
    assert np.array_equal(read_device(device, ptr, 16 * KiB), data)  # nothing was issued
    device.free(ptr)


def test_copy_batch_names_the_two_overlapping_copies(device: Device) -> None:
    ptr = device.alloc(64 * KiB)
    rows = [(ptr + i * KiB, ptr + (32 + i) * KiB, KiB) for i in range(12)] + [(ptr + 5 * KiB + 8, ptr + 60 * KiB, 64)]
    with pytest.raises(InvalidId, match="copies 5 and 12 overlap"):
        device.copy_batch(rows)
    device.free(ptr)


def test_copies_reading_one_source_twice_are_a_valid_batch(device: Device) -> None:
    data = random_bytes(KiB, seed=16)
    src = filled(device, data)
    dst = device.alloc(2 * KiB)
    device.copy_batch([(dst, src, KiB), (dst + KiB, src, KiB)])
    device.synchronize()
    assert np.array_equal(read_device(device, dst, 2 * KiB), np.concatenate([data, data]))
    device.free(src)
    device.free(dst)


def test_copies_outside_live_allocations_are_refused(device: Device) -> None:
    a = device.alloc(1024)
    b = device.alloc(1024)
    host = np.zeros(2048, dtype=np.uint8)
    with pytest.raises(InvalidId, match="copy_dtod dst"):
        device.copy_dtod(a + 512, b, 513)
    with pytest.raises(InvalidId, match="copy_dtod src"):
        device.copy_dtod(a, b + 1, 1024)
    with pytest.raises(InvalidId, match="copy_htod dst"):
        device.copy_htod(b, host.ctypes.data, 2048)
    with pytest.raises(InvalidId, match="copy_dtoh src"):
        device.copy_dtoh(host.ctypes.data, a, 2048)
    device.free(b)
    with pytest.raises(InvalidId, match="copy_dtod src"):
        device.copy_dtod(a, b, 16)
    device.free(a)


def test_negative_byte_counts_are_refused(device: Device) -> None:
    ptr = device.alloc(64)
    for call in (device.copy_dtod, device.copy_htod, device.copy_dtoh):
        with pytest.raises(InvalidId, match="nbytes=-1"):
            call(ptr, ptr, -1)
    with pytest.raises(InvalidId, match="nbytes=-1"):
        device.copy_batch([(ptr, ptr, -1)])
    with pytest.raises(InvalidId, match="nbytes=-1"):
        device.memset(ptr, 0, -1)
    device.free(ptr)


def test_memset_sets_exactly_the_range(device: Device) -> None:
    ptr = filled(device, np.zeros(4096, dtype=np.uint8))
    device.memset(ptr + 100, 0xAB, 1000)
    device.synchronize()
    out = read_device(device, ptr, 4096)
    assert (out[100:1100] == 0xAB).all()
    assert not out[:100].any() and not out[1100:].any()
    device.free(ptr)


@pytest.mark.parametrize("value", [-1, 256])
def test_memset_refuses_a_value_outside_a_byte(device: Device, value: int) -> None:
    ptr = device.alloc(16)
    with pytest.raises(InvalidId, match=f"value={value}"):
        device.memset(ptr, value, 16)
    device.free(ptr)


@pytest.mark.parametrize("nbytes", [8.5, "8", None, True])
def test_a_byte_count_that_is_not_an_int_is_refused_by_name(device: Device, nbytes: object) -> None:
    src, dst = device.alloc(16), device.alloc(16)
    with pytest.raises(InvalidType, match="nbytes"):
        device.alloc(nbytes)  # type: ignore[arg-type]
    with pytest.raises(InvalidType, match="nbytes"):
        device.copy_dtod(dst, src, nbytes)  # type: ignore[arg-type]
    with pytest.raises(InvalidType, match="nbytes"):
        device.memset(dst, 0, nbytes)  # type: ignore[arg-type]
    assert live_allocations(device) == 2
    device.free(src)
    device.free(dst)


@pytest.mark.parametrize("value", [1.5, "1", None, True])
def test_memset_refuses_a_value_that_is_not_an_int(device: Device, value: object) -> None:
    ptr = device.alloc(16)
    with pytest.raises(InvalidType, match="value"):
        device.memset(ptr, value, 16)  # type: ignore[arg-type]
    device.free(ptr)


def test_work_issued_before_one_synchronize_runs_in_issue_order(device: Device) -> None:
    data = random_bytes(8192, seed=6)
    a = device.alloc(8192)
    b = device.alloc(8192)
    staging = device.alloc_pinned(8192)
    device.host_array(staging, 8192)[:] = data
    device.copy_htod(a, staging, 8192)
    device.memset(a, 0, 100)
    device.copy_dtod(b, a, 8192)
    device.copy_batch([(a, b + 4096, 4096)])
    device.copy_dtoh(staging, a, 8192)
    device.synchronize()
    expected = data.copy()
    expected[:100] = 0
    expected[:4096] = expected[4096:].copy()
    assert np.array_equal(device.host_array(staging, 8192), expected)
    device.free_pinned(staging)
    device.free(a)
    device.free(b)


def test_pageable_host_source_may_be_reused_once_copy_htod_returns(device: Device) -> None:
    ptr = device.alloc(256)
    host = random_bytes(256, seed=7)
    expected = host.copy()
    device.copy_htod(ptr, host.ctypes.data, 256)
    host[:] = 0
    device.synchronize()
    assert np.array_equal(read_device(device, ptr, 256), expected)
    device.free(ptr)


def test_missing_synchronize_leaves_stale_data_where_copies_are_deferred(device: Device) -> None:
    if not copies_are_deferred(device):
        pytest.skip("copies complete at once on this device: a missing synchronize is not observable")
    data = random_bytes(4096, seed=8)
    src = filled(device, data)
    staging = device.alloc_pinned(4096)
    view = device.host_array(staging, 4096)
    view[:] = 0
    device.copy_dtoh(staging, src, 4096)
    assert not view.any()  # not synchronized yet: the copy has not happened
    device.synchronize()
    assert np.array_equal(view, data)
    device.free_pinned(staging)
    device.free(src)


# -- views ----------------------------------------------------------------------------------------


def test_pinned_memory_is_a_writable_host_view(device: Device) -> None:
    ptr = device.alloc_pinned(1000)
    view = device.host_array(ptr, 1000)
    assert view.dtype == np.uint8 and view.shape == (1000,)
    view[:] = 7
    assert (device.host_array(ptr, 1000) == 7).all()
    device.free_pinned(ptr)


def test_host_array_views_foreign_host_memory_without_copying(device: Device) -> None:
    host = np.arange(64, dtype=np.uint8)
    view = device.host_array(host.ctypes.data, 64)
    host[3] = 200
    assert view[3] == 200
    assert device.host_array(host.ctypes.data, 0).shape == (0,)


def _array_interface(view: object) -> dict[str, object]:
    iface = getattr(view, "__cuda_array_interface__", None) or getattr(view, "__array_interface__")
    assert isinstance(iface, dict)
    return iface


def test_device_array_describes_the_memory_at_the_address(device: Device) -> None:
    ptr = device.alloc(4096)
    view = device.device_array(ptr + 256, (4, 8, 16), np.float16)
    iface = _array_interface(view)
    assert iface["shape"] == (4, 8, 16)
    assert iface["typestr"] == np.dtype(np.float16).str
    data = iface["data"]
    assert isinstance(data, tuple) and data[0] == ptr + 256 and data[1] is False
    assert iface.get("strides") is None
    device.free(ptr)


def test_device_array_of_cuda_names_the_device_stream(device: Device) -> None:
    if device.kind != "cuda":
        pytest.skip("__cuda_array_interface__ exists on CUDA only")
    ptr = device.alloc(64)
    iface = _array_interface(device.device_array(ptr, (16,), np.int32))
    assert iface["version"] == 3
    assert iface["stream"] == getattr(device, "stream_handle") != 0
    device.free(ptr)


def test_host_device_array_writes_reach_device_memory() -> None:
    dev = HostDevice()
    ptr = dev.alloc(1024)
    view = dev.device_array(ptr, (2, 128), np.float32)
    view[1, 5] = 3.5
    out = read_device(dev, ptr, 1024).view(np.float32).reshape(2, 128)
    assert out[1, 5] == 3.5
    dev.free(ptr)
    dev.close()


@pytest.mark.parametrize("shape", [(0,), (4, 0, 8)])
def test_a_zero_size_view_touches_no_memory(device: Device, shape: tuple[int, ...]) -> None:
    ptr = device.alloc(256)
    view = device.device_array(ptr + 256, shape, np.float32)  # at the end: no byte of it is read
    iface = _array_interface(view)
    assert iface["shape"] == shape
    device.free(ptr)


def test_a_zero_size_cuda_view_reports_a_null_pointer(device: Device) -> None:
    if device.kind != "cuda":
        pytest.skip("__cuda_array_interface__ exists on CUDA only")
    ptr = device.alloc(256)
    iface = _array_interface(device.device_array(ptr, (0, 16), np.float16))
    assert iface["data"] == (0, False)
    device.free(ptr)


def test_device_array_refuses_a_negative_dimension(device: Device) -> None:
    ptr = device.alloc(256)
    with pytest.raises(InvalidId, match=r"negative dimension in shape \(2, -1\)"):
        device.device_array(ptr, (2, -1), np.uint8)
    device.free(ptr)


def test_device_array_outside_a_live_allocation_is_refused(device: Device) -> None:
    ptr = device.alloc(1024)
    with pytest.raises(InvalidId):
        device.device_array(ptr, (257,), np.float32)
    with pytest.raises(InvalidId):
        device.device_array(ptr + 4096, (1,), np.uint8)
    device.free(ptr)


# -- other streams --------------------------------------------------------------------------------


class _TorchLikeStream:
    """What torch.cuda.Stream shows: the raw handle as ``cuda_stream``."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class _ProtocolStream:
    """What the CUDA stream protocol (cuda.core) shows: ``__cuda_stream__() -> (version, handle)``."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


# 0 is the legacy default stream, 1 CU_STREAM_LEGACY, 2 CU_STREAM_PER_THREAD: valid on every driver
STREAMS: dict[str, object] = {
    "raw handle 0": 0,
    "CU_STREAM_LEGACY": 1,
    "CU_STREAM_PER_THREAD": 2,
    "cuda_stream attribute": _TorchLikeStream(0),
    "__cuda_stream__ protocol": _ProtocolStream(0),
}


@pytest.mark.parametrize("stream", STREAMS.values(), ids=STREAMS.keys())
def test_wait_stream_accepts_a_handle_or_a_stream_object(device: Device, stream: object) -> None:
    data = random_bytes(KiB, seed=17)
    src = filled(device, data)
    device.wait_stream(stream)
    staging = device.alloc_pinned(KiB)
    device.copy_dtoh(staging, src, KiB)  # work after the wait still runs and lands
    device.synchronize()
    assert np.array_equal(device.host_array(staging, KiB), data)
    device.free_pinned(staging)
    device.free(src)


@pytest.mark.parametrize("stream", ["0", -1, 1 << 64, True, 1.5, None, _TorchLikeStream(-5)],
                         ids=["str", "negative", "too large", "bool", "float", "None", "negative attribute"])
def test_wait_stream_refuses_what_is_not_a_stream(device: Device, stream: object) -> None:
    with pytest.raises(InvalidId, match="wait_stream"):
        device.wait_stream(stream)


def test_wait_stream_on_the_devices_own_stream_changes_nothing(device: Device) -> None:
    if device.kind != "cuda":
        pytest.skip("only a CUDA device has a stream")
    data = random_bytes(KiB, seed=18)
    ptr = filled(device, data)
    device.wait_stream(getattr(device, "stream_handle"))
    assert np.array_equal(read_device(device, ptr, KiB), data)
    device.free(ptr)


# -- threads and teardown -------------------------------------------------------------------------


def test_a_bound_thread_can_copy(device: Device) -> None:
    data = random_bytes(2048, seed=9)
    src = filled(device, data)
    dst = device.alloc(2048)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            device.bind_to_thread()
            device.copy_dtod(dst, src, 2048)
            device.synchronize()
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert errors == []
    assert np.array_equal(read_device(device, dst, 2048), data)
    device.free(src)
    device.free(dst)


def test_close_frees_what_is_live_and_is_idempotent(device: Device) -> None:
    device.alloc(1024)
    device.alloc_pinned(1024)
    device.close()
    assert live_allocations(device) == 0
    device.close()


def test_calls_after_close_raise_torn_down(device: Device) -> None:
    ptr = device.alloc(64)
    device.close()
    calls: list[Callable[[], object]] = [
        lambda: device.alloc(64),
        lambda: device.alloc_pinned(64),
        lambda: device.free(ptr),
        lambda: device.copy_dtod(ptr, ptr, 1),
        lambda: device.copy_batch([]),
        lambda: device.memset(ptr, 0, 1),
        lambda: device.synchronize(),
        lambda: device.mem_info(),
        lambda: device.bind_to_thread(),
        lambda: device.wait_stream(0),
        lambda: device.device_array(ptr, (1,), np.uint8),
    ]
    for call in calls:
        with pytest.raises(TornDown, match="closed"):
            call()


# -- open_device ----------------------------------------------------------------------------------


def test_open_device_host_gives_a_host_device() -> None:
    dev = open_device("host")
    assert isinstance(dev, HostDevice)
    dev.close()


def test_open_device_refuses_an_unknown_kind() -> None:
    with pytest.raises(ConfigError, match="'tpu'"):
        open_device("tpu")  # type: ignore[arg-type]


def test_open_device_auto_logs_the_device_it_picked(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lifecycle.device"):
        dev = open_device("auto")
    assert dev.name in caplog.text
    dev.close()


def test_open_device_cuda_without_a_driver_raises_one_sentence() -> None:
    try:
        dev = open_device("cuda")
    except DriverNotFound as exc:
        assert "\n" not in str(exc)
        # no chained loader traceback under it
        assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)
    else:
        dev.close()
        pytest.skip("a CUDA driver is present")


# -- fault injection (emulated driver only) -------------------------------------------------------


def test_allocation_past_the_budget_raises_out_of_memory_and_leaks_nothing(device: Device, emu: Emulator) -> None:
    baseline = emu.live_allocations
    emu.set_alloc_budget(emu.live_bytes + 3 * MiB)
    ptr = device.alloc(2 * MiB)
    with pytest.raises(CudaError) as info:
        device.alloc(2 * MiB)
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert info.value.code == CUDA_ERROR_OUT_OF_MEMORY
    assert info.value.text == "out of memory"
    assert info.value.call.startswith("cuMemAlloc(")
    assert live_allocations(device) == 1
    device.free(ptr)
    assert emu.live_allocations == baseline


def test_sticky_error_fails_every_later_call_cleanly(device: Device, emu: Emulator) -> None:
    baseline = emu.live_allocations
    a = device.alloc(1024)
    b = device.alloc(1024)
    emu.fail_from_call(1, CUDA_ERROR_ILLEGAL_ADDRESS)
    # memory management starts by asking which context is current, and fails there
    steps: list[tuple[Callable[[], object], str]] = [
        (lambda: device.copy_dtod(a, b, 1024), "cuMemcpyDtoDAsync"),
        (lambda: device.synchronize(), "cuStreamSynchronize"),
        (lambda: device.alloc(64), "cuCtxGetCurrent"),
        (lambda: device.free(a), "cuCtxGetCurrent"),
        (lambda: device.mem_info(), "cuCtxGetCurrent"),
    ]
    for call, name in steps:
        with pytest.raises(CudaError) as info:
            call()
        assert info.value.call.startswith(name + "(")
        assert info.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert info.value.text == "an illegal memory access was encountered"
        assert f"{name}(" in str(info.value) and "CUDA_ERROR_ILLEGAL_ADDRESS" in str(info.value)
    assert live_allocations(device) == 2  # the failed free kept its allocation
    emu.reset()
    device.free(a)
    device.free(b)
    assert emu.live_allocations == baseline


def test_a_failing_copy_raises_and_queues_nothing(device: Device, emu: Emulator) -> None:
    data = random_bytes(1024, seed=10)
    src = filled(device, data)
    dst = filled(device, np.zeros(1024, dtype=np.uint8))
    emu.fail_call("cuMemcpyDtoDAsync", CUDA_ERROR_LAUNCH_FAILED)
    with pytest.raises(CudaError, match="CUDA_ERROR_LAUNCH_FAILED") as info:
        device.copy_dtod(dst, src, 1024)
    assert info.value.call.startswith("cuMemcpyDtoDAsync(")
    assert emu.pending_ops == 0
    device.synchronize()
    assert not read_device(device, dst, 1024).any()
    device.copy_dtod(dst, src, 1024)  # the fault was for one call only
    device.synchronize()
    assert np.array_equal(read_device(device, dst, 1024), data)
    device.free(src)
    device.free(dst)


def test_a_failing_batched_copy_raises_a_clean_error(device: Device, emu: Emulator) -> None:
    if not getattr(device, "batch_copies"):
        pytest.skip("this driver has no cuMemcpyBatchAsync")
    ptr = device.alloc(4096)
    emu.fail_call("cuMemcpyBatchAsync", CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS") as info:
        device.copy_batch([(ptr, ptr + 2048, 1024), (ptr + 1024, ptr + 3072, 1024)])
    assert info.value.call == "cuMemcpyBatchAsync(2)"
    assert emu.pending_ops == 0
    device.free(ptr)


def test_batched_copies_fall_back_to_a_loop_where_unsupported(device: Device, emu: Emulator) -> None:
    if not getattr(device, "batch_copies"):
        pytest.skip("this driver has no cuMemcpyBatchAsync")
    data = random_bytes(4096, seed=11)
    src = filled(device, data)
    dst = filled(device, np.zeros(4096, dtype=np.uint8))
    emu.fail_call("cuMemcpyBatchAsync", CUDA_ERROR_NOT_SUPPORTED)
    device.copy_batch([(dst + i * 1024, src + (3 - i) * 1024, 1024) for i in range(4)])
    device.synchronize()
    assert getattr(device, "batch_copies") is False
    expected = data.reshape(4, 1024)[::-1].reshape(-1)
    assert np.array_equal(read_device(device, dst, 4096), expected)
    device.free(src)
    device.free(dst)


# Every driver entry point the device calls after construction, with a call that reaches it.
def _faultable_calls(dev: Device, ptr: int, pinned: int) -> dict[str, Callable[[], object]]:
    return dict([
        ("cuMemAlloc", lambda: dev.alloc(64)),
        ("cuMemFree", lambda: dev.free(ptr)),
        ("cuMemHostAlloc", lambda: dev.alloc_pinned(64)),
        ("cuMemFreeHost", lambda: dev.free_pinned(pinned)),
        ("cuMemcpyDtoDAsync", lambda: dev.copy_dtod(ptr, ptr + 512, 256)),
        ("cuMemcpyHtoDAsync", lambda: dev.copy_htod(ptr, pinned, 256)),
        ("cuMemcpyDtoHAsync", lambda: dev.copy_dtoh(pinned, ptr, 256)),
        ("cuMemsetD8Async", lambda: dev.memset(ptr, 1, 256)),
        ("cuStreamSynchronize", lambda: dev.synchronize()),
        ("cuMemGetInfo", lambda: dev.mem_info()),
        ("cuCtxSetCurrent", lambda: dev.bind_to_thread()),
        ("cuCtxGetCurrent", lambda: dev.alloc(64)),
        ("cuEventCreate", lambda: dev.wait_stream(0)),
        ("cuEventRecord", lambda: dev.wait_stream(0)),
        ("cuStreamWaitEvent", lambda: dev.wait_stream(0)),
    ])


FAULTABLE = list(_faultable_calls(HostDevice.__new__(HostDevice), 0, 0))


@pytest.mark.parametrize("entry_point", FAULTABLE)
def test_every_injected_fault_is_a_clean_cuda_error_and_leaks_nothing(
    device: Device, emu: Emulator, entry_point: str
) -> None:
    baseline = emu.live_allocations
    ptr = device.alloc(1024)
    pinned = device.alloc_pinned(1024)
    call = _faultable_calls(device, ptr, pinned)[entry_point]
    emu.fail_call(entry_point, CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(CudaError) as info:
        call()
    err = info.value
    assert (err.call.split("(")[0], err.code, err.name) == (entry_point, 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    assert err.text == "an illegal memory access was encountered"
    assert live_allocations(device) == 2  # a failed alloc added nothing, a failed free kept its entry
    device.free(ptr)
    device.free_pinned(pinned)
    assert emu.live_allocations == baseline


def test_close_under_a_sticky_error_raises_and_can_be_retried(device: Device, emu: Emulator) -> None:
    baseline = emu.live_allocations
    device.alloc(1024)
    emu.fail_from_call(1, CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        device.close()
    assert live_allocations(device) == 1
    emu.reset()
    device.close()
    assert live_allocations(device) == 0
    assert emu.live_allocations == baseline


def test_emulated_copies_wait_for_synchronize(device: Device, emu: Emulator) -> None:
    data = random_bytes(512, seed=12)
    src = filled(device, data)
    dst = filled(device, np.zeros(512, dtype=np.uint8))
    device.copy_dtod(dst, src, 512)
    # emulated device memory is host memory: peek at it without going through the stream
    peek = np.ctypeslib.as_array((ctypes.c_uint8 * 512).from_address(dst))
    assert emu.pending_ops == 1 and not peek.any()
    device.synchronize()
    assert emu.pending_ops == 0 and np.array_equal(peek, data)
    device.free(src)
    device.free(dst)


def test_stream_work_from_an_unbound_thread_gets_invalid_context(device: Device, emu: Emulator) -> None:
    ptr = device.alloc(64)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _record(errors, lambda: device.memset(ptr, 0, 64)))
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], CudaError)
    assert errors[0].name == "CUDA_ERROR_INVALID_CONTEXT"
    assert emu.pending_ops == 0
    device.free(ptr)


def _record(errors: list[BaseException], call: Callable[[], object]) -> None:
    try:
        call()
    except BaseException as exc:
        errors.append(exc)


def test_no_gpu_present_gives_driver_not_found(device: Device, emu: Emulator) -> None:
    from lifecycle.device.cuda import CudaDevice

    emu.set_device_count(0)
    try:
        with pytest.raises(DriverNotFound, match="no GPU"):
            CudaDevice(0)
        assert isinstance(open_device("auto"), HostDevice)
    finally:
        emu.set_device_count(1)


def test_an_ordinal_past_the_gpu_count_is_refused(device: Device, emu: Emulator) -> None:
    from lifecycle.device.cuda import CudaDevice

    with pytest.raises(InvalidId, match="ordinal=5.*1 GPU"):
        CudaDevice(5)

