"""Hazards of the CUDA path that a real driver exposes: threads and contexts, forked processes,
result codes the bindings do not know, batches the driver refuses, faults that surface late.

Runs on CudaDevice: over the emulated driver in CI (tests/test_device_emulated.py) and on a real GPU
(tests/test_device_gpu.py); skipped on the host device. Tests that inject faults need the emulator.
The teardown test runs on every device.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from devices import (  # noqa: F401  (fixtures)
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_LAUNCH_FAILED,
    Emulator,
    device,
    emu,
    in_forked_child,
    in_new_thread,
    live_allocations,
    read_device,
    write_device,
)
from lifecycle.device import open_device
from lifecycle.device.base import Device
from lifecycle.device.cuda import CudaDevice
from lifecycle.errors import CudaError, ForkedAfterCudaInit
from lifecycle.model import HybridModel
from reliability_driver import CONFIGS, FAULT_PROMPT

KiB = 1024


@pytest.fixture
def cuda(device: Device) -> Iterator[CudaDevice]:
    """The device under test when it is a CudaDevice (the test is skipped on the host device)."""
    if not isinstance(device, CudaDevice):
        pytest.skip("needs a CUDA device (LIFECYCLE_TEST_DEVICE=cuda)")
    yield device


def current_context() -> int:
    """The raw CUcontext current on the calling thread (0: none)."""
    from cuda.bindings import driver

    err, ctx = driver.cuCtxGetCurrent()
    assert not err, f"cuCtxGetCurrent failed: {err}"
    return int(ctx)


# ----------------------------------------------------------------------------- threads and contexts


def test_memory_management_works_from_a_thread_without_a_context_and_leaves_it_so(cuda: CudaDevice) -> None:
    def manage() -> int:
        assert current_context() == 0
        ptr = cuda.alloc(4 * KiB)
        pinned = cuda.alloc_pinned(KiB)
        free, total = cuda.mem_info()
        assert 0 <= free <= total
        cuda.free(ptr)
        cuda.free_pinned(pinned)
        return current_context()

    assert in_new_thread(manage) == 0
    assert live_allocations(cuda) == 0


def test_a_model_torn_down_from_another_thread_frees_everything(device: Device) -> None:
    before = live_allocations(device)
    m = HybridModel(CONFIGS["hybrid"], device)
    a = m.alloc_sequence()
    m.attach_prefix(a, FAULT_PROMPT)
    m.grow(a, 16)
    m.save_sequence_state(a, io.BytesIO())  # allocates the pinned staging buffer on CUDA
    assert live_allocations(device) > before
    in_new_thread(m.teardown)
    assert live_allocations(device) == before
    assert m.teardown_report is not None and m.teardown_report.live_sequences == 1


def test_construction_leaves_a_thread_without_a_context_able_to_copy(cuda: CudaDevice) -> None:
    def construct_and_copy() -> bool:
        dev = CudaDevice(cuda.ordinal)
        try:
            data = np.arange(256, dtype=np.uint8)
            ptr = dev.alloc(256)
            write_device(dev, ptr, data)  # stream work, without bind_to_thread
            same = bool(np.array_equal(read_device(dev, ptr, 256), data))
            dev.free(ptr)
            return same
        finally:
            dev.close()

    assert in_new_thread(construct_and_copy)


def test_close_from_a_thread_without_a_context_leaves_it_without_one(cuda: CudaDevice) -> None:
    dev = CudaDevice(cuda.ordinal)
    dev.alloc(KiB)

    def close() -> int:
        dev.close()
        return current_context()

    assert in_new_thread(close) == 0
    assert dev.closed and live_allocations(dev) == 0


def test_construction_and_close_put_back_another_context_the_caller_had(cuda: CudaDevice, emu: Emulator) -> None:
    from cuda.bindings import driver

    ours = current_context()
    emu.set_device_count(2)
    err, other_device = driver.cuDeviceGet(1)
    assert not err
    err, other = driver.cuDevicePrimaryCtxRetain(other_device)
    assert not err
    try:
        (err,) = driver.cuCtxSetCurrent(other)
        assert not err
        dev = CudaDevice(0)
        after_construction = current_context()
        dev.close()
        assert (after_construction, current_context()) == (int(other), int(other))
    finally:
        driver.cuCtxSetCurrent(ours)
        driver.cuDevicePrimaryCtxRelease(other_device)
        emu.set_device_count(1)


def test_close_waits_for_a_call_in_flight_on_another_thread(cuda: CudaDevice, emu: Emulator) -> None:
    data = np.arange(KiB, dtype=np.int64).astype(np.uint8)
    src = cuda.alloc(KiB)
    write_device(cuda, src, data)
    dst = cuda.alloc(KiB)
    emu.hold_call("cuMemcpyDtoDAsync")

    def copy() -> None:
        cuda.bind_to_thread()
        cuda.copy_dtod(dst, src, KiB)

    copier = threading.Thread(target=copy)
    copier.start()
    deadline = time.monotonic() + 60  # the copy is inside the driver within milliseconds
    while not emu.holding and time.monotonic() < deadline:
        time.sleep(0.001)
    assert emu.holding
    closer = threading.Thread(target=cuda.close)
    closer.start()
    closer.join(timeout=0.3)
    still_waiting = closer.is_alive()
    calls_meanwhile = emu.calls_during_hold
    emu.release_hold()
    copier.join()
    closer.join()
    assert still_waiting and calls_meanwhile == 0  # close made no driver call while the copy was in flight
    assert cuda.closed and live_allocations(cuda) == 0


# ----------------------------------------------------------------------------- forked processes


def test_a_forked_child_cannot_open_a_cuda_device_and_is_told_why(cuda: CudaDevice) -> None:
    def open_cuda() -> str:
        CudaDevice(cuda.ordinal)
        return "opened"

    out = in_forked_child(open_cuda)
    assert out.startswith("raised ForkedAfterCudaInit") and f"parent (pid {os.getpid()})" in out, out


def test_open_device_auto_in_a_forked_child_falls_back_to_the_host_with_a_warning(cuda: CudaDevice) -> None:
    def open_auto() -> str:
        records: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record)

        logging.getLogger("lifecycle.device").addHandler(Keep())
        dev = open_device("auto")
        warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        return f"{dev.kind}|{warned}"

    kind, warned = in_forked_child(open_auto).split("|", 1)
    assert kind == "host" and "forked" in warned


def test_a_device_inherited_by_a_forked_child_refuses_calls_and_frees_nothing(cuda: CudaDevice) -> None:
    data = np.arange(KiB, dtype=np.int64).astype(np.uint8)
    ptr = cuda.alloc(KiB)
    write_device(cuda, ptr, data)

    def use_inherited() -> str:
        outcomes = []
        for call in (lambda: cuda.alloc(64), lambda: cuda.synchronize()):
            try:
                call()
                outcomes.append("ran")
            except ForkedAfterCudaInit:
                outcomes.append("refused")
        cuda.close()  # must not free the parent's memory
        return ",".join(outcomes)

    assert in_forked_child(use_inherited) == "refused,refused"
    assert live_allocations(cuda) == 1 and np.array_equal(read_device(cuda, ptr, KiB), data)
    cuda.free(ptr)


# ----------------------------------------------------------------------------- driver results (emulator)

UNKNOWN_CODE = 12345


@pytest.mark.parametrize("entry_point", ["cuMemAlloc", "cuStreamSynchronize", "cuMemcpyBatchAsync"])
def test_a_result_code_the_bindings_do_not_know_is_still_a_cuda_error(
    cuda: CudaDevice, emu: Emulator, entry_point: str
) -> None:
    if entry_point == "cuMemcpyBatchAsync" and not cuda.batch_copies:
        pytest.skip("this driver has no cuMemcpyBatchAsync")
    ptr = cuda.alloc(4 * KiB)
    calls: dict[str, Callable[[], Any]] = {
        "cuMemAlloc": lambda: cuda.alloc(64),
        "cuStreamSynchronize": cuda.synchronize,
        "cuMemcpyBatchAsync": lambda: cuda.copy_batch([(ptr, ptr + 2 * KiB, KiB), (ptr + KiB, ptr + 3 * KiB, KiB)]),
    }
    emu.fail_call(entry_point, UNKNOWN_CODE)
    with pytest.raises(CudaError) as info:
        calls[entry_point]()
    assert (info.value.code, info.value.name) == (UNKNOWN_CODE, f"CUDA_ERROR_{UNKNOWN_CODE}")
    assert info.value.call.startswith(entry_point + "(")
    cuda.free(ptr)


def test_a_batch_the_driver_calls_invalid_is_copied_one_by_one_and_logged_once(
    cuda: CudaDevice, emu: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    if not cuda.batch_copies:
        pytest.skip("this driver has no cuMemcpyBatchAsync")
    data = np.random.default_rng(20).integers(0, 256, 4 * KiB, dtype=np.uint8)
    src = cuda.alloc(4 * KiB)
    write_device(cuda, src, data)
    dst = cuda.alloc(4 * KiB)
    emu.fail_call("cuMemcpyBatchAsync", CUDA_ERROR_INVALID_VALUE, -1)
    with caplog.at_level(logging.INFO, logger="lifecycle.device"):
        cuda.copy_batch([(dst + i * KiB, src + (3 - i) * KiB, KiB) for i in range(2)])
        cuda.copy_batch([(dst + i * KiB, src + (3 - i) * KiB, KiB) for i in range(2, 4)])
    assert read_device(cuda, dst, 4 * KiB).tobytes() == data.reshape(4, KiB)[::-1].tobytes()
    refusals = [r for r in caplog.records if "cuMemcpyBatchAsync refused" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING
    assert "CUDA_ERROR_INVALID_VALUE" in refusals[0].getMessage()
    assert not cuda.batch_copies
    cuda.free(src)
    cuda.free(dst)


def test_a_fault_deferred_to_the_next_synchronize_surfaces_there_and_sticks(cuda: CudaDevice, emu: Emulator) -> None:
    ptr = cuda.alloc(2 * KiB)
    emu.fail_at_sync(CUDA_ERROR_ILLEGAL_ADDRESS)
    cuda.copy_dtod(ptr, ptr + KiB, KiB)  # the asynchronous work is accepted...
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS") as info:
        cuda.synchronize()  # ...and its fault reported when someone waits for it
    assert info.value.call.startswith("cuStreamSynchronize(")
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        cuda.memset(ptr, 0, KiB)
    emu.reset()
    cuda.free(ptr)


def test_a_free_whose_wait_for_the_stream_fails_frees_nothing(cuda: CudaDevice, emu: Emulator) -> None:
    src = cuda.alloc(KiB)
    staging = cuda.alloc_pinned(KiB)
    cuda.copy_dtoh(staging, src, KiB)  # still queued: the memory is in use
    emu.fail_call("cuStreamSynchronize", CUDA_ERROR_LAUNCH_FAILED)
    with pytest.raises(CudaError, match="cuStreamSynchronize"):
        cuda.free(src)
    assert live_allocations(cuda) == 2
    cuda.free(src)
    cuda.free_pinned(staging)
    assert live_allocations(cuda) == 0
