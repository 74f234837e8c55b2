"""Device fixtures and helpers shared by every suite that runs on a device.

A test takes the ``device`` fixture and runs unchanged on every device:

- by default ``HostDevice()``;
- ``LIFECYCLE_TEST_DEVICE=host-deferred``: ``HostDevice(deferred=True)`` (copies wait for synchronize);
- ``LIFECYCLE_TEST_DEVICE=cuda``: ``CudaDevice(0)``: the real driver, or the emulated one when
  ``LD_LIBRARY_PATH`` points at it (``tests/test_device_emulated.py`` runs the suites listed in its
  ``EMULATED_SUITES`` that way).

Register the fixture in a module with ``from devices import device  # noqa: F401`` (or once for
all modules in ``tests/conftest.py``). The ``emu`` fixture gives the emulator's fault-injection
controls and skips the test on any other device; the ``engine`` fixture (emulator only) is a stream
of the engine's own, on which stand-ins for its kernels write the pools while still in flight.
``in_new_thread`` and ``in_forked_child`` run a check on a fresh thread or in a forked process.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import select
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt
import pytest

from lifecycle.device.base import Device
from lifecycle.device.host import HostDevice

TEST_DEVICE_ENV = "LIFECYCLE_TEST_DEVICE"
#: Set to 1 by the emulated run: a cuda device must then come from the emulated driver.
EXPECT_EMULATOR_ENV = "LIFECYCLE_EXPECT_EMULATOR"
#: Set by the emulated run to the driver version it emulates: a cuda device must report it.
EXPECT_DRIVER_VERSION_ENV = "LIFECYCLE_EXPECT_DRIVER_VERSION"
DeviceKindUnderTest = Literal["host", "host-deferred", "cuda"]
T = TypeVar("T")

# CUresult codes the tests inject
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_LAUNCH_FAILED = 719
CUDA_ERROR_NOT_SUPPORTED = 801


def device_kind_under_test() -> DeviceKindUnderTest:
    """The device kind the suites run on, from ``LIFECYCLE_TEST_DEVICE`` (default ``host``)."""
    kind = os.environ.get(TEST_DEVICE_ENV, "host") or "host"
    if kind not in ("host", "host-deferred", "cuda"):
        raise pytest.UsageError(f"{TEST_DEVICE_ENV}={kind!r}: expected host, host-deferred or cuda")
    return kind  # type: ignore[return-value]

_cuda_keepalive: Device | None = None


def _keep_primary_context() -> None:
    """Hold one CudaDevice for the whole session, so that the primary context is not destroyed and
    re-created between tests (expensive on a real GPU)."""
    global _cuda_keepalive
    if _cuda_keepalive is None:
        from lifecycle.device.cuda import CudaDevice

        _cuda_keepalive = CudaDevice(0)
        atexit.register(_cuda_keepalive.close)


def make_device(kind: DeviceKindUnderTest | None = None) -> Device:
    """A fresh device of ``kind`` (default: :func:`device_kind_under_test`)."""
    kind = kind or device_kind_under_test()
    if kind == "host":
        return HostDevice()
    if kind == "host-deferred":
        return HostDevice(deferred=True)
    if os.environ.get(EXPECT_EMULATOR_ENV) == "1" and loaded_emulator() is None:
        _keep_primary_context()  # loads the driver, so that the check below sees which one
        if loaded_emulator() is None:
            pytest.fail(f"{EXPECT_EMULATOR_ENV}=1 but libcuda.so.1 is not the emulated driver")
    _keep_primary_context()
    from lifecycle.device.cuda import CudaDevice

    dev = CudaDevice(0)
    expected = os.environ.get(EXPECT_DRIVER_VERSION_ENV)
    if expected and dev.driver_version != int(expected):
        dev.close()
        pytest.fail(f"{EXPECT_DRIVER_VERSION_ENV}={expected} but the driver reports {dev.driver_version}")
    return dev


@pytest.fixture
def device() -> Iterator[Device]:
    """A fresh device of the kind under test, closed after the test."""
    dev = make_device()
    yield dev
    dev.close()


def copies_are_deferred(dev: Device) -> bool:
    """True where copies provably wait for synchronize (host-deferred, the emulated driver): only
    there can a test show that a missing synchronize leaves stale data."""
    if isinstance(dev, HostDevice):
        return dev.deferred
    return dev.kind == "cuda" and loaded_emulator() is not None


def live_allocations(dev: Device) -> int:
    """The device's count of live ``alloc`` + ``alloc_pinned`` allocations."""
    count = getattr(dev, "live_allocations")
    assert isinstance(count, int)
    return count


def read_device(dev: Device, ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """Copy ``nbytes`` of device memory into a new numpy array (through pinned staging)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    staging = dev.alloc_pinned(nbytes)
    try:
        dev.copy_dtoh(staging, ptr, nbytes)
        dev.synchronize()
        return dev.host_array(staging, nbytes).copy()
    finally:
        dev.free_pinned(staging)


def write_device(dev: Device, ptr: int, data: npt.NDArray[np.generic]) -> None:
    """Copy a C-contiguous numpy array to device memory at ``ptr`` and wait for it."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    dev.copy_htod(ptr, raw.ctypes.data, raw.nbytes)
    dev.synchronize()


def in_new_thread(work: Callable[[], T]) -> T:
    """Run ``work`` on a fresh thread (no CUDA context current) and return what it returned,
    re-raising what it raised."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(work())
        except BaseException as exc:  # surfaced on the calling thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def in_forked_child(check: Callable[[], str], timeout_s: float = 120.0) -> str:
    """Run ``check`` in a child forked from this process and return the text it returned (or
    ``raised <type>: <message>``). The child never returns into pytest; one that does not answer
    within ``timeout_s`` is killed and the test fails."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() while other threads exist
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_fd)
            try:
                out = check()
            except BaseException as exc:
                out = f"raised {type(exc).__name__}: {exc}"
            os.write(write_fd, out.encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the forked child gave no answer within {timeout_s} s")
            chunk = pipe.read(65536)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


class Emulator:
    """Controls of the emulated driver loaded in this process (see ``tests/emu_cuda/emu_cuda.c``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.emu_set_alloc_budget.argtypes = [ctypes.c_longlong]
        lib.emu_fail_from_call.argtypes = [ctypes.c_ulonglong, ctypes.c_int]
        lib.emu_fail_call.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        lib.emu_set_device_count.argtypes = [ctypes.c_int]
        lib.emu_fail_at_sync.argtypes = [ctypes.c_int]
        lib.emu_engine_write.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t]
        lib.emu_hold_call.argtypes = [ctypes.c_char_p]
        lib.emu_count_calls.argtypes = [ctypes.c_char_p]
        lib.emu_counted_calls.restype = ctypes.c_longlong
        for name in ("emu_live_allocations", "emu_live_bytes", "emu_pending_ops", "emu_calls_during_hold"):
            getattr(lib, name).restype = ctypes.c_longlong
        lib.emu_call_count.restype = ctypes.c_ulonglong

    def reset(self) -> None:
        """Clear every injected fault and the allocation budget (allocations stay)."""
        self._lib.emu_reset()

    def set_alloc_budget(self, nbytes: int) -> None:
        """cuMemAlloc fails with CUDA_ERROR_OUT_OF_MEMORY past ``nbytes`` live device bytes."""
        self._lib.emu_set_alloc_budget(nbytes)

    def fail_from_call(self, n: int, code: int) -> None:
        """The n-th driver call from now (1 = the next) and every later one fail with ``code``."""
        self._lib.emu_fail_from_call(n, code)

    def fail_call(self, name: str, code: int, times: int = 1) -> None:
        """The next ``times`` calls (-1: all) of entry point ``name`` fail with ``code``."""
        self._lib.emu_fail_call(name.encode(), code, times)

    def set_device_count(self, n: int) -> None:
        """Pretend ``n`` GPUs are present (0: cuInit fails with CUDA_ERROR_NO_DEVICE)."""
        self._lib.emu_set_device_count(n)

    def fail_at_sync(self, code: int) -> None:
        """An asynchronous fault: the next call that waits for the device fails with ``code``, and
        so does every call after it."""
        self._lib.emu_fail_at_sync(code)

    def engine_write(self, stream: int, dst: int, data: npt.NDArray[np.uint8]) -> None:
        """Stand-in for an engine kernel on ``stream``: ``data`` (copied now) lands at device
        address ``dst`` when that stream's work runs."""
        raw = np.ascontiguousarray(data, dtype=np.uint8)
        rc = self._lib.emu_engine_write(stream, dst, raw.ctypes.data, raw.nbytes)
        assert rc == 0, f"emu_engine_write(stream={stream:#x}, dst={dst:#x}, {raw.nbytes}) failed with {rc}"

    def hold_call(self, name: str) -> None:
        """The next call of entry point ``name`` waits inside the driver until :meth:`release_hold`."""
        self._lib.emu_hold_call(name.encode())

    def count_calls(self, name: str) -> None:
        """Count the calls of entry point ``name`` from now on (read :attr:`counted_calls`)."""
        self._lib.emu_count_calls(name.encode())

    @property
    def counted_calls(self) -> int:
        """Calls of the entry point named by :meth:`count_calls` since then."""
        return int(self._lib.emu_counted_calls())

    def release_hold(self) -> None:
        self._lib.emu_release_hold()

    @property
    def holding(self) -> bool:
        """True while a held call waits."""
        return bool(self._lib.emu_holding())

    @property
    def calls_during_hold(self) -> int:
        """Driver calls made by other threads while the held call waited."""
        return int(self._lib.emu_calls_during_hold())

    @property
    def live_allocations(self) -> int:
        """Device plus pinned allocations the driver holds."""
        return int(self._lib.emu_live_allocations())

    @property
    def live_bytes(self) -> int:
        return int(self._lib.emu_live_bytes())

    @property
    def pending_ops(self) -> int:
        """Copies and memsets queued on streams, not yet run."""
        return int(self._lib.emu_pending_ops())

    @property
    def call_count(self) -> int:
        return int(self._lib.emu_call_count())


def loaded_emulator() -> Emulator | None:
    """The emulated driver if it is the ``libcuda.so.1`` loaded in this process, else None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    if not hasattr(lib, "emu_is_emulator"):
        return None
    return Emulator(lib)


@pytest.fixture
def emu(device: Device) -> Iterator[Emulator]:
    """The emulator's controls (the test is skipped on any other device); faults are cleared
    before and after the test."""
    if device.kind != "cuda":
        pytest.skip("needs the emulated CUDA driver (LIFECYCLE_TEST_DEVICE=cuda over emu_cuda)")
    emulator = loaded_emulator()
    if emulator is None:
        pytest.skip("needs the emulated CUDA driver, not a real one")
    emulator.reset()
    yield emulator
    emulator.reset()


class EngineStream:
    """A stream of the engine's own (created through the driver, like ``torch.cuda.Stream()``),
    on which :meth:`write` queues stand-ins for kernels still writing the pools. ``cuda_stream``
    is its raw handle, as torch names it."""

    def __init__(self, emulator: Emulator) -> None:
        from cuda.bindings import driver

        self._emulator = emulator
        err, stream = driver.cuStreamCreate(int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING))
        assert not err, f"cuStreamCreate failed: {err}"
        self._stream = stream
        self._events: list[object] = []
        self.cuda_stream = int(stream)

    def write(self, dst: int, data: npt.NDArray[np.uint8]) -> None:
        """A kernel writing ``data`` at ``dst``, still in flight when this returns."""
        self._emulator.engine_write(self.cuda_stream, dst, data)

    def new_event(self) -> int:
        """A CUevent of the engine's (as ``torch.cuda.Event`` holds one), destroyed with the stream;
        its raw handle."""
        from cuda.bindings import driver

        err, event = driver.cuEventCreate(int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        assert not err, f"cuEventCreate failed: {err}"
        self._events.append(event)
        return int(event)

    def record(self, event: int) -> None:
        """``event`` completes once the work issued on the stream so far has run."""
        from cuda.bindings import driver

        (err,) = driver.cuEventRecord(driver.CUevent(event), self._stream)
        assert not err, f"cuEventRecord failed: {err}"

    def wait(self, event: int) -> None:
        """Later work on the stream runs after ``event``."""
        from cuda.bindings import driver

        (err,) = driver.cuStreamWaitEvent(self._stream, driver.CUevent(event), 0)
        assert not err, f"cuStreamWaitEvent failed: {err}"

    def synchronize(self) -> None:
        """Run the work queued on this stream (and what it waits for), and nothing else."""
        from cuda.bindings import driver

        (err,) = driver.cuStreamSynchronize(self._stream)
        assert not err, f"cuStreamSynchronize failed: {err}"

    def close(self) -> None:
        from cuda.bindings import driver

        for event in self._events:
            (err,) = driver.cuEventDestroy(event)
            assert not err, f"cuEventDestroy failed: {err}"
        (err,) = driver.cuStreamDestroy(self._stream)
        assert not err, f"cuStreamDestroy failed: {err}"


@pytest.fixture
def engine(emu: Emulator) -> Iterator[EngineStream]:
    """An engine stream over the emulated driver (skipped elsewhere), destroyed after the test."""
    stream = EngineStream(emu)
    yield stream
    stream.close()
