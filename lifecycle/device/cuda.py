"""The CUDA device over ``cuda.bindings.driver``: the primary context, one stream, raw allocations.

Every driver call goes through :func:`check`, which turns a failure into
:class:`~lifecycle.errors.CudaError` with the driver's own error name and text. A missing driver or
GPU raises :class:`~lifecycle.errors.DriverNotFound` with one sentence. Addresses are checked
against the device's live allocations before the driver sees them (the same
:class:`~lifecycle.errors.InvalidId` as on the host device), so a bad range cannot turn into an
asynchronous illegal-address fault that poisons the context.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from lifecycle.device.allocations import (
    AllocationTable,
    BatchChecker,
    CopyArray,
    TrackedDevice,
    check_alloc_size,
    check_nbytes,
)
from lifecycle.device.base import Copy, DeviceKind
from lifecycle.device.host import _host_view
from lifecycle.errors import CudaError, DriverNotFound, InvalidId

_log = logging.getLogger("lifecycle.device")

_driver: ModuleType | None = None
_load_failure: DriverNotFound | None = None  # a driver that failed to load is not retried
_driver_lock = threading.Lock()

#: First driver version with ``cuMemcpyBatchAsync`` (CUDA 12.8).
BATCH_MIN_DRIVER_VERSION = 12080
CUDA_ERROR_NOT_SUPPORTED = 801


def _load_driver() -> ModuleType:
    """Import ``cuda.bindings.driver`` and run ``cuInit`` once, or raise DriverNotFound."""
    global _driver, _load_failure
    if _driver is not None:
        return _driver
    with _driver_lock:
        if _driver is not None:
            return _driver
        if _load_failure is not None:
            raise DriverNotFound(str(_load_failure))
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise DriverNotFound(f"cuda-bindings is not installed ({exc})") from None
        try:
            (err,) = driver.cuInit(0)
        except Exception as exc:  # cuda-pathfinder / loader errors: reduce them to one sentence
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _load_failure = DriverNotFound(f"no CUDA driver could be loaded (libcuda.so.1): {first_line}")
            raise DriverNotFound(str(_load_failure)) from None
        if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
            raise DriverNotFound("a CUDA driver is installed but no GPU is present (cuInit: CUDA_ERROR_NO_DEVICE)")
        if err:
            raise _error(driver, "cuInit(0)", err)
        module: ModuleType = driver
        _driver = module
        return module


def _error(driver: ModuleType, call: str, err: Any) -> CudaError:
    """Build the CudaError for a failed call from the driver's own name and text for ``err``."""
    code = int(err)
    name = getattr(err, "name", f"CUDA_ERROR_{code}")
    text = "unknown error code"
    try:
        rc, raw_name = driver.cuGetErrorName(err)
        if not rc and raw_name:
            name = raw_name.decode()
        rc, raw_text = driver.cuGetErrorString(err)
        if not rc and raw_text:
            text = raw_text.decode()
    except Exception:  # a broken error lookup must not hide the original failure
        pass
    return CudaError(call, code, name, text)


def _fail(call: str, args: tuple[Any, ...], err: Any) -> NoReturn:
    assert _driver is not None
    shown = ", ".join(f"{a:#x}" if isinstance(a, int) and a > 0xFFFFFF else str(a) for a in args)
    raise _error(_driver, f"{call}({shown})", err)


def check(result: tuple[Any, ...], call: str, *args: Any) -> Any:
    """The one driver status check: raise CudaError unless ``result[0]`` is CUDA_SUCCESS.

    Returns the call's single output (or the tuple of outputs, or None when there are none);
    ``call`` and ``args`` only serve the error message.
    """
    if result[0]:
        _fail(call, args, result[0])
    n = len(result)
    if n == 1:
        return None
    if n == 2:
        return result[1]
    return result[1:]


class CudaArrayView:
    """A typed, C-contiguous window on device memory exposing ``__cuda_array_interface__`` v3.

    The interface names the device's stream, so consumers (torch, CuPy, Numba) order their work
    after the copies issued on it.
    """

    __slots__ = ("ptr", "shape", "dtype", "nbytes", "_stream", "_owner")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any], stream: int, owner: object) -> None:
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._stream = stream
        self._owner = owner  # keeps the device (and its context) referenced while the view lives

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "version": 3,
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
            "descr": [("", self.dtype.str)],
            "stream": self._stream,
        }

    def __repr__(self) -> str:
        return f"CudaArrayView(ptr={self.ptr:#x}, shape={self.shape}, dtype={self.dtype})"


class CudaDevice(TrackedDevice):
    """One GPU through the CUDA driver API: its primary context (retained once, released in
    :meth:`close`), one non-blocking stream that every copy and memset is issued on, and
    ``cuMemAlloc``/``cuMemHostAlloc`` allocations tracked by address.

    The constructing thread is bound to the context; other threads call :meth:`bind_to_thread`.
    """

    def __init__(self, ordinal: int = 0) -> None:
        drv = _load_driver()
        self._drv = drv
        self._ordinal = ordinal
        self._closed = False
        self._device = AllocationTable("device")
        self._pinned = AllocationTable("pinned")
        self._batch_checker = BatchChecker(self._device, self._pinned)
        self._ctx: Any = None
        self._stream: Any = None
        count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if count == 0:
            raise DriverNotFound("a CUDA driver is installed but no GPU is present (cuDeviceGetCount: 0)")
        if not 0 <= ordinal < count:
            raise InvalidId(f"CudaDevice: ordinal={ordinal} is out of range ({count} GPU(s) present)")
        self._dev = check(drv.cuDeviceGet(ordinal), "cuDeviceGet", ordinal)
        raw_name = check(drv.cuDeviceGetName(256, self._dev), "cuDeviceGetName", ordinal)
        model = raw_name.split(b"\0", 1)[0].decode(errors="replace")
        self._name = f"cuda:{ordinal} ({model})"
        self._driver_version = int(check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
        self._ctx = check(drv.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain", ordinal)
        try:
            check(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
            self._stream = check(drv.cuStreamCreate(flags), "cuStreamCreate")
        except BaseException:
            drv.cuDevicePrimaryCtxRelease(self._dev)
            self._ctx = None
            raise
        self._stream_handle = int(self._stream)
        self._batch_v1 = False
        self._batch_fn: Any = self._resolve_batch()
        self._batch_attrs = self._copy_attributes()
        self._attrs_idx = np.zeros(1, dtype=np.uint64)  # the one attribute set applies from copy 0
        self._alloc_call = drv.cuMemAlloc
        self._dtod_call = drv.cuMemcpyDtoDAsync
        _log.debug("opened %s, driver %d, batched copies: %s", self._name, self._driver_version, self.batch_copies)

    def _copy_attributes(self) -> Any:
        drv = self._drv
        attrs = drv.CUmemcpyAttributes()
        attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        for hint in (attrs.srcLocHint, attrs.dstLocHint):
            hint.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            hint.id = self._ordinal
        attrs.flags = drv.CUmemcpyFlags.CU_MEMCPY_FLAG_DEFAULT
        return attrs

    # -- identity -------------------------------------------------------------------------------
    @property
    def kind(self) -> DeviceKind:
        return "cuda"

    @property
    def name(self) -> str:
        return self._name

    @property
    def ordinal(self) -> int:
        """The GPU's index in the driver's enumeration."""
        return self._ordinal

    @property
    def driver_version(self) -> int:
        """``cuDriverGetVersion``, e.g. 13000 for CUDA 13.0."""
        return self._driver_version

    @property
    def batch_copies(self) -> bool:
        """True while :meth:`copy_batch` uses ``cuMemcpyBatchAsync`` (False: a loop of copies)."""
        return self._batch_fn is not None

    @property
    def stream_handle(self) -> int:
        """The raw ``CUstream`` of the device's stream (as ``__cuda_array_interface__`` gives it)."""
        return self._stream_handle




    def __repr__(self) -> str:
        return f"CudaDevice({self._name!r}, live={self.live_allocations}, closed={self._closed})"


    def bind_to_thread(self) -> None:
        """Make the primary context current on the calling thread (``cuCtxSetCurrent``)."""
        self._check_open("bind_to_thread")
        check(self._drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    # -- memory ---------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """``cuMemAlloc``: ``nbytes`` (>= 1) of uninitialised device memory; CudaError on failure."""
        self._check_open("alloc")
        check_alloc_size("alloc", nbytes)
        ptr = int(check(self._alloc_call(nbytes), "cuMemAlloc", nbytes))
        self._device.add(ptr, nbytes)
        return ptr

    def free(self, ptr: int) -> None:
        """``cuMemFree``; an unknown address raises InvalidId, a driver failure keeps it live."""
        self._check_open("free")
        self._device.size_of("free", ptr)
        check(self._drv.cuMemFree(ptr), "cuMemFree", ptr)
        self._device.remove("free", ptr)

    def alloc_pinned(self, nbytes: int) -> int:
        """``cuMemHostAlloc``: ``nbytes`` (>= 1) of page-locked host memory."""
        self._check_open("alloc_pinned")
        check_alloc_size("alloc_pinned", nbytes)
        flags = self._drv.CU_MEMHOSTALLOC_PORTABLE
        ptr = int(check(self._drv.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc", nbytes))
        self._pinned.add(ptr, nbytes)
        return ptr

    def free_pinned(self, ptr: int) -> None:
        """``cuMemFreeHost``; an unknown address raises InvalidId, a driver failure keeps it live."""
        self._check_open("free_pinned")
        self._pinned.size_of("free_pinned", ptr)
        check(self._drv.cuMemFreeHost(ptr), "cuMemFreeHost", ptr)
        self._pinned.remove("free_pinned", ptr)

    def mem_info(self) -> tuple[int, int]:
        """``cuMemGetInfo``: (free bytes, total bytes) of the GPU."""
        self._check_open("mem_info")
        free, total = check(self._drv.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    # -- copies ---------------------------------------------------------------------------------
    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        """``cuMemcpyDtoDAsync`` on the device's stream; both ranges must be live allocations."""
        self._check_open("copy_dtod")
        check_nbytes("copy_dtod", nbytes)
        if nbytes:
            self._device.locate("copy_dtod dst", dst, nbytes)
            self._device.locate("copy_dtod src", src, nbytes)
            check(self._dtod_call(dst, src, nbytes, self._stream), "cuMemcpyDtoDAsync", dst, src, nbytes)

    def copy_htod(self, dst: int, src_host: int, nbytes: int) -> None:
        """``cuMemcpyHtoDAsync``: the source must stay valid and unchanged until synchronize."""
        self._check_open("copy_htod")
        check_nbytes("copy_htod", nbytes)
        if nbytes:
            self._device.locate("copy_htod dst", dst, nbytes)
            result = self._drv.cuMemcpyHtoDAsync(dst, src_host, nbytes, self._stream)
            check(result, "cuMemcpyHtoDAsync", dst, src_host, nbytes)

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int) -> None:
        """``cuMemcpyDtoHAsync``: the destination holds the data only after synchronize."""
        self._check_open("copy_dtoh")
        check_nbytes("copy_dtoh", nbytes)
        if nbytes:
            self._device.locate("copy_dtoh src", src, nbytes)
            result = self._drv.cuMemcpyDtoHAsync(dst_host, src, nbytes, self._stream)
            check(result, "cuMemcpyDtoHAsync", dst_host, src, nbytes)

    def copy_batch(self, copies: Sequence[Copy] | CopyArray) -> None:
        """Copies between device and/or pinned memory (unified addresses), unordered among
        themselves: one ``cuMemcpyBatchAsync`` where the driver has it, else one
        ``cuMemcpyAsync`` each. Every range is checked first; if the driver fails part way through
        the fallback loop, the copies before it were issued."""
        self._check_open("copy_batch")
        rows = self._batch_checker.check("copy_batch", copies)
        if rows.shape[0] and not rows[:, 2].all():
            rows = rows[rows[:, 2] > 0]
        count = rows.shape[0]
        if count == 0:
            return
        if count > 1 and self._batch_fn is not None and self._issue_batch(rows):
            return
        copy, stream = self._drv.cuMemcpyAsync, self._stream
        for dst, src, nbytes in rows.tolist():
            check(copy(dst, src, nbytes, stream), "cuMemcpyAsync", dst, src, nbytes)

    def _resolve_batch(self) -> Any:
        """The driver's cuMemcpyBatchAsync as a ctypes function taking raw arrays (None if this
        driver lacks it). Called through ctypes so that a batch costs O(1) Python work, not a
        CUdeviceptr object per copy; the ABI is chosen by the version requested (12.8 had a
        ``failIdx`` argument, CUDA 13 dropped it)."""
        drv = self._drv
        if self._driver_version < BATCH_MIN_DRIVER_VERSION or not hasattr(drv, "cuGetProcAddress"):
            return None
        version = 13000 if self._driver_version >= 13000 else BATCH_MIN_DRIVER_VERSION
        flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        err, pfn, _status = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", version, flags)
        if err or not pfn:
            return None
        p, n = ctypes.c_void_p, ctypes.c_size_t
        if version >= 13000:
            proto = ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, n, p, p, n, p)
        else:
            proto = ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, n, p, p, n, p, p)
        self._batch_v1 = version < 13000
        return proto(pfn)

    def _issue_batch(self, rows: CopyArray) -> bool:
        """One cuMemcpyBatchAsync of all rows; False (and batching turned off) if unsupported."""
        count = rows.shape[0]
        columns = np.ascontiguousarray(rows.T)  # dsts, srcs, sizes: three contiguous int64 rows
        base = columns.ctypes.data
        stride = count * 8
        attrs = self._batch_attrs.getPtr()
        if self._batch_v1:
            fail_idx = ctypes.c_size_t(0)
            rc = self._batch_fn(base, base + stride, base + 2 * stride, count, attrs, self._attrs_idx.ctypes.data,
                                1, ctypes.addressof(fail_idx), self._stream_handle)
        else:
            rc = self._batch_fn(base, base + stride, base + 2 * stride, count, attrs, self._attrs_idx.ctypes.data,
                                1, self._stream_handle)
        if rc == CUDA_ERROR_NOT_SUPPORTED:
            _log.info("%s: cuMemcpyBatchAsync not supported; copying one by one", self._name)
            self._batch_fn = None
            return False
        if rc:
            raise _error(self._drv, f"cuMemcpyBatchAsync({count})", self._drv.CUresult(rc))
        return True

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        """``cuMemsetD8Async`` of ``value`` (0..255) on the device's stream."""
        self._check_open("memset")
        check_nbytes("memset", nbytes)
        if not 0 <= value <= 255:
            raise InvalidId(f"memset: value={value} must be in 0..255")
        if nbytes:
            self._device.locate("memset", ptr, nbytes)
            check(self._drv.cuMemsetD8Async(ptr, value, nbytes, self._stream), "cuMemsetD8Async", ptr, value, nbytes)

    def synchronize(self) -> None:
        """``cuStreamSynchronize`` of the device's stream: every copy and memset issued is done."""
        self._check_open("synchronize")
        check(self._drv.cuStreamSynchronize(self._stream), "cuStreamSynchronize")

    # -- views ----------------------------------------------------------------------------------
    def host_array(self, ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """uint8 numpy view of host memory (pinned or not); valid while that memory is."""
        check_nbytes("host_array", nbytes)
        return _host_view(ptr, nbytes)

    def device_array(self, ptr: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> CudaArrayView:
        """A ``__cuda_array_interface__`` view of ``shape``/``dtype`` at ``ptr``, inside one live
        allocation (InvalidId otherwise)."""
        self._check_open("device_array")
        dt = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InvalidId(f"device_array: negative dimension in shape {shape}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        self._device.locate("device_array", ptr, max(nbytes, 1))
        return CudaArrayView(ptr, shape, dt, self._stream_handle, self)

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the stream, free allocations still live (logged), destroy the stream and
        release the primary context. Idempotent. If a driver call fails, what succeeded stays
        done, the first error is raised and a later ``close()`` retries the rest."""
        if self._closed:
            return
        drv = self._drv
        first_error: CudaError | None = None

        def attempt(result: tuple[Any, ...], call: str, *args: Any) -> bool:
            nonlocal first_error
            try:
                check(result, call, *args)
                return True
            except CudaError as exc:
                first_error = first_error or exc
                return False

        if self._ctx is not None:
            attempt(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        if self._stream is not None:
            attempt(drv.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        leftovers = self.live_allocations
        if leftovers:
            _log.warning("%s: close() frees %d allocation(s) still live (%d bytes)", self._name, leftovers, self.live_bytes)
        for ptr in self._device.addresses():
            if attempt(drv.cuMemFree(ptr), "cuMemFree", ptr):
                self._device.remove("close", ptr)
        for ptr in self._pinned.addresses():
            if attempt(drv.cuMemFreeHost(ptr), "cuMemFreeHost", ptr):
                self._pinned.remove("close", ptr)
        if self._stream is not None and attempt(drv.cuStreamDestroy(self._stream), "cuStreamDestroy"):
            self._stream = None
        if first_error is None and self._ctx is not None:
            if attempt(drv.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease", self._ordinal):
                self._ctx = None
        if first_error is not None:
            raise first_error
        self._closed = True

    def __enter__(self) -> CudaDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
