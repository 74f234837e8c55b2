"""The CUDA device over ``cuda.bindings.driver``: the primary context, one stream, raw allocations.

Every driver call goes through :func:`call`, which turns a failure into
:class:`~lifecycle.errors.CudaError` with the driver's own error name and text (a result code the
bindings do not know included). A missing driver or GPU raises
:class:`~lifecycle.errors.DriverNotFound` with one sentence, and so does a process forked after its
parent initialised CUDA (:class:`~lifecycle.errors.ForkedAfterCudaInit`). Addresses are checked
against the device's live allocations before the driver sees them (the same
:class:`~lifecycle.errors.InvalidId` as on the host device), so a bad range cannot turn into an
asynchronous illegal-address fault that poisons the context.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import numpy.typing as npt

from lifecycle.device.allocations import AllocationTable, BatchChecker, CopyArray
from lifecycle.device.allocations import check_nbytes, view_size
from lifecycle.device.base import CheckedDevice, DeviceKind, event_handle, stream_handle
from lifecycle.device.dlpack import KDL_CUDA, capsule, check_device, element_of
from lifecycle.device.host import _host_view
from lifecycle.errors import CudaError, DriverNotFound, ForkedAfterCudaInit, InvalidId, TornDown

if TYPE_CHECKING:
    from typing_extensions import CapsuleType

    from lifecycle.config import DType

_log = logging.getLogger("lifecycle.device")

_driver: ModuleType | None = None
_load_failure: DriverNotFound | None = None  # a driver that failed to load is not retried
_driver_lock = threading.Lock()
#: pid of the parent that initialised CUDA, in a process forked after that (None elsewhere)
_forked_from: int | None = None
_devices: weakref.WeakSet[CudaDevice] = weakref.WeakSet()

#: First driver version with ``cuMemcpyBatchAsync`` (CUDA 12.8).
BATCH_MIN_DRIVER_VERSION = 12080
CUDA_ERROR_INVALID_VALUE = 1
#: The handle of the legacy default stream, as DLPack names it.
CU_STREAM_LEGACY = 1
CUDA_ERROR_NOT_SUPPORTED = 801
#: ``CUmemorytype`` values ``cuPointerGetAttributes`` reports.
CU_MEMORYTYPE_HOST = 1
CU_MEMORYTYPE_DEVICE = 2
_UNKNOWN_RESULT = re.compile(r"^(-?\d+) is not a valid CUresult")


def _fork_message(call: str, parent: int) -> str:
    return (
        f"{call}: this process (pid {os.getpid()}) was forked after its parent (pid {parent}) initialised "
        "CUDA, and a forked child cannot use CUDA; start worker processes with the 'spawn' method, or "
        "initialise CUDA only after forking"
    )


def _after_fork_in_child() -> None:
    """The driver refuses every call of a process forked after CUDA was initialised: say so
    clearly instead, and never touch the parent's memory (devices inherited from the parent count
    as closed here)."""
    global _forked_from
    if _driver is None:
        return
    _forked_from = os.getppid()
    for device in list(_devices):
        device._disown(_forked_from)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _load_driver() -> ModuleType:
    """Import ``cuda.bindings.driver`` and run ``cuInit`` once, or raise DriverNotFound."""
    global _driver, _load_failure
    if _forked_from is not None:
        raise ForkedAfterCudaInit(_fork_message("CudaDevice", _forked_from))
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


def _describe(driver: ModuleType, err: Any) -> tuple[int, str, str]:
    """(code, name, text) of a result, from the driver's own cuGetErrorName/cuGetErrorString;
    ``err`` is a ``CUresult`` or a plain int, possibly one the bindings have no member for."""
    code = int(err)
    try:
        result = err if isinstance(err, driver.CUresult) else driver.CUresult(code)
    except ValueError:
        return code, f"CUDA_ERROR_{code}", "a result code this version of cuda-bindings does not know"
    name = getattr(result, "name", f"CUDA_ERROR_{code}")
    text = "unknown error code"
    try:
        rc, raw_name = driver.cuGetErrorName(result)
        if not rc and raw_name:
            name = raw_name.decode()
        rc, raw_text = driver.cuGetErrorString(result)
        if not rc and raw_text:
            text = raw_text.decode()
    except Exception:  # a broken error lookup must not hide the original failure
        pass
    return code, name, text


def _error(driver: ModuleType, call: str, err: Any) -> CudaError:
    """The CudaError for a failed call (every failure the device reports is built here)."""
    return CudaError(call, *_describe(driver, err))


def _fail(call: str, args: tuple[Any, ...], err: Any) -> NoReturn:
    assert _driver is not None
    shown = ", ".join(f"{a:#x}" if isinstance(a, int) and a > 0xFFFFFF else str(a) for a in args)
    raise _error(_driver, f"{call}({shown})", err)


def call(function: Callable[..., tuple[Any, ...]], name: str, *args: Any) -> Any:
    """The one way the device calls the driver: ``function(*args)``, raising CudaError unless it
    returned CUDA_SUCCESS. Returns the call's single output (or the tuple of outputs, or None when
    there are none); ``name`` and ``args`` also serve the error message."""
    try:
        result = function(*args)
    except ValueError as exc:  # the bindings could not map the driver's result code to a CUresult
        unknown = _UNKNOWN_RESULT.match(str(exc))
        if unknown is None:
            raise
        _fail(name, args, int(unknown.group(1)))
    if result[0]:
        _fail(name, args, result[0])
    n = len(result)
    if n == 1:
        return None
    if n == 2:
        return result[1]
    return result[1:]


def _quietly(function: Callable[..., Any], *args: Any) -> None:
    """A clean-up call whose failure must not replace the error being raised."""
    try:
        function(*args)
    except Exception:  # noqa: S110 - the error already propagating is the one to report
        pass


class CudaArrayView:
    """A typed, C-contiguous window on device memory exposing ``__cuda_array_interface__`` v3 and
    DLPack (``__dlpack__`` / ``__dlpack_device__``).

    The interface names the device's stream, so consumers (torch, CuPy, Numba) order their work
    after the copies issued on it. DLPack exports ``element``, the type the memory really holds
    (bfloat16 where the interface's numpy dtype says uint16; see :mod:`lifecycle.device.dlpack`),
    and makes the consumer's stream wait for the device's. A view of zero elements reports a null
    data pointer, as the interface asks for empty arrays.
    """

    __slots__ = ("ptr", "shape", "dtype", "element", "nbytes", "_stream", "_owner")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any], stream: int, owner: CudaDevice,
                 element: DType | None = None) -> None:
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.ptr = ptr if self.nbytes else 0
        self.shape = shape
        self.dtype = dtype
        self.element = element
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

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self._owner.ordinal)

    def __dlpack__(self, *, stream: int | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> CapsuleType:
        """A zero-copy DLPack capsule with the true element type. ``stream`` is the consumer's
        (None: the legacy default stream; -1: no ordering): it waits, on the GPU, for the copies
        issued on the device's stream. ``copy=True`` is refused (BufferError)."""
        if copy:
            raise BufferError("__dlpack__: copy=True: a CUDA view exports its memory only (copy it with the device)")
        check_device(dl_device, self.__dlpack_device__())
        if stream is None:
            stream = CU_STREAM_LEGACY
        if stream != -1:
            self._owner._order_consumer(stream, self._stream)
        count = len(self.shape)
        strides = tuple(int(np.prod(self.shape[dim + 1:], dtype=np.int64)) for dim in range(count))
        return capsule(self, data=self.ptr, shape=self.shape, strides=strides, storage=self.dtype,
                       element=self.element, device=self.__dlpack_device__(), max_version=max_version)

    def __repr__(self) -> str:
        shown = f", element={self.element}" if self.element is not None else ""
        return f"CudaArrayView(ptr={self.ptr:#x}, shape={self.shape}, dtype={self.dtype}{shown})"


class _InContext:
    """``with _InContext(device):`` the device's context is current on the calling thread, and
    whatever was current before is put back afterwards. Memory management (alloc, free, mem_info)
    runs so, which lets any thread free the model's memory (a teardown from another thread) without
    leaving its own context switched."""

    __slots__ = ("_device", "_previous")

    def __init__(self, device: CudaDevice) -> None:
        self._device = device
        self._previous: Any = None

    def __enter__(self) -> None:
        drv = self._device._drv
        current = call(drv.cuCtxGetCurrent, "cuCtxGetCurrent")
        if int(current) != self._device._ctx_handle:
            call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", self._device._ctx)
            self._previous = current

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        previous, self._previous = self._previous, None
        if previous is None:
            return
        drv = self._device._drv
        if exc_type is None:
            call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", previous)
        else:
            _quietly(drv.cuCtxSetCurrent, previous)


class _StreamScope:
    """One ``use_stream`` block of one thread: the engine's stream its copies go to, whether any
    work was issued there since the last synchronize, and the scope it is nested in."""

    __slots__ = ("handle", "pending", "outer")

    def __init__(self, handle: int, outer: _StreamScope | None) -> None:
        self.handle = handle
        self.pending = False
        self.outer = outer


class CudaDevice(CheckedDevice):
    """One GPU through the CUDA driver API: its primary context (retained once, released in
    :meth:`close`), one non-blocking stream that every copy and memset is issued on, and
    ``cuMemAlloc``/``cuMemHostAlloc`` allocations tracked by address.

    Contexts: construction leaves the primary context current on a thread that had none (so the
    constructing thread can use the device at once) and puts back any other context the caller had
    current. Memory management (alloc, free, mem_info) works from any thread and leaves the
    caller's context as it found it; copies, memsets, synchronize and wait_stream need a thread
    bound with :meth:`bind_to_thread`. ``close`` also puts back the caller's context.

    Copies go to the calling thread's copy stream: the device's stream, or inside
    ``use_stream(stream)`` the engine's stream (see :meth:`use_stream`).

    Every call holds the device's lock, so ``close`` waits for calls in flight on other threads.
    """

    def __init__(self, ordinal: int = 0) -> None:
        drv = _load_driver()
        self._drv = drv
        self._ordinal = ordinal
        self._closed = False
        self._fork_parent: int | None = None
        self._lock = threading.Lock()
        self._device = AllocationTable("device")
        self._pinned = AllocationTable("pinned")
        self._batch_checker = BatchChecker(self._device, self._pinned)
        self._ctx: Any = None
        self._ctx_handle = 0
        self._stream: Any = None
        self._event: Any = None  # created when first needed to order one stream after another
        self._events: dict[int, Any] = {}  # create_event's events by handle
        self._pointer_attrs: list[Any] | None = None  # what copy_htod_to asks cuPointerGetAttributes
        self._pending = False  # work issued on the device's stream since the last synchronize
        self._thread_scope = threading.local()  # .scope: the thread's innermost use_stream block
        self._scopes: set[_StreamScope] = set()  # the use_stream blocks open on any thread
        count = call(drv.cuDeviceGetCount, "cuDeviceGetCount")
        if count == 0:
            raise DriverNotFound("a CUDA driver is installed but no GPU is present (cuDeviceGetCount: 0)")
        if not 0 <= ordinal < count:
            raise InvalidId(f"CudaDevice: ordinal={ordinal} is out of range ({count} GPU(s) present)")
        self._dev = call(drv.cuDeviceGet, "cuDeviceGet", ordinal)
        raw_name = call(drv.cuDeviceGetName, "cuDeviceGetName", 256, self._dev)
        model = raw_name.split(b"\0", 1)[0].decode(errors="replace")
        self._name = f"cuda:{ordinal} ({model})"
        self._driver_version = int(call(drv.cuDriverGetVersion, "cuDriverGetVersion"))
        previous = call(drv.cuCtxGetCurrent, "cuCtxGetCurrent")
        self._ctx = call(drv.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", self._dev)
        self._ctx_handle = int(self._ctx)
        try:
            call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", self._ctx)
            flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
            self._stream = call(drv.cuStreamCreate, "cuStreamCreate", flags)
            if int(previous) not in (0, self._ctx_handle):
                call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", previous)
        except BaseException:
            if self._stream is not None:
                _quietly(drv.cuStreamDestroy, self._stream)
            if int(previous) != self._ctx_handle:
                _quietly(drv.cuCtxSetCurrent, previous)
            _quietly(drv.cuDevicePrimaryCtxRelease, self._dev)
            self._ctx = None
            raise
        self._stream_handle = int(self._stream)
        self._batch_v1 = False
        self._batch_fn: Any = self._resolve_batch()
        self._batch_attrs = self._copy_attributes()
        self._attrs_idx = np.zeros(1, dtype=np.uint64)  # the one attribute set applies from copy 0
        self._alloc_call = drv.cuMemAlloc
        self._dtod_call = drv.cuMemcpyDtoDAsync
        _devices.add(self)
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

    def _check_open(self, call: str) -> None:
        if self._closed:
            if self._fork_parent is not None:
                raise ForkedAfterCudaInit(_fork_message(call, self._fork_parent))
            raise TornDown(f"{call}: device {self.name!r} is closed")

    def _disown(self, parent: int) -> None:
        """In a child forked from ``parent``: the device, its memory and its lock (which a parent
        thread may have held at the fork) are the parent's; every call is refused."""
        self._lock = threading.Lock()
        self._fork_parent = parent
        self._closed = True

    def bind_to_thread(self) -> None:
        """Make the primary context current on the calling thread (``cuCtxSetCurrent``)."""
        with self._lock:
            self._check_open("bind_to_thread")
            call(self._drv.cuCtxSetCurrent, "cuCtxSetCurrent", self._ctx)

    # -- memory ---------------------------------------------------------------------------------
    def _issue_alloc(self, call_name: str, table: AllocationTable, nbytes: int) -> int:
        """``cuMemAlloc`` (device memory) or ``cuMemHostAlloc`` (page-locked host memory); CudaError
        on failure."""
        with _InContext(self):
            if table is self._device:
                ptr = int(call(self._alloc_call, "cuMemAlloc", nbytes))
            else:
                flags = self._drv.CU_MEMHOSTALLOC_PORTABLE
                ptr = int(call(self._drv.cuMemHostAlloc, "cuMemHostAlloc", nbytes, flags))
            table.add(ptr, nbytes)
        return ptr

    def _issue_free(self, call_name: str, table: AllocationTable, ptr: int) -> None:
        """``cuMemFree`` / ``cuMemFreeHost``, after the copies still queued on the device's stream
        (which may use the memory) are done; a driver failure keeps the allocation live."""
        table.size_of(call_name, ptr)
        with _InContext(self):
            self._settle()
            if table is self._device:
                call(self._drv.cuMemFree, "cuMemFree", ptr)
            else:
                call(self._drv.cuMemFreeHost, "cuMemFreeHost", ptr)
            table.remove(call_name, ptr)

    def mem_info(self) -> tuple[int, int]:
        """``cuMemGetInfo``: (free bytes, total bytes) of the GPU."""
        with self._lock:
            self._check_open("mem_info")
            with _InContext(self):
                free, total = call(self._drv.cuMemGetInfo, "cuMemGetInfo")
            return int(free), int(total)

    def _settle(self) -> None:
        """Wait for every stream with copies issued since the last synchronize: the device's, and
        those of the ``use_stream`` blocks open on any thread."""
        if self._pending:
            call(self._drv.cuStreamSynchronize, "cuStreamSynchronize", self._stream)
            self._pending = False
        for scope in self._scopes:
            if scope.pending:
                call(self._drv.cuStreamSynchronize, "cuStreamSynchronize", scope.handle)
                scope.pending = False

    # -- the calling thread's copy stream --------------------------------------------------------
    def _scope(self) -> _StreamScope | None:
        scope: _StreamScope | None = getattr(self._thread_scope, "scope", None)
        return scope

    def _target(self) -> Any:
        """The calling thread's copy stream, as the driver takes it."""
        scope = self._scope()
        return self._stream if scope is None else scope.handle

    def _target_handle(self) -> int:
        scope = self._scope()
        return self._stream_handle if scope is None else scope.handle

    def _issued(self) -> None:
        """Work was issued on the calling thread's copy stream."""
        scope = self._scope()
        if scope is None:
            self._pending = True
        else:
            scope.pending = True

    def _order(self, later: Any, earlier: Any) -> None:
        """Make stream ``later`` wait, on the GPU, for the work issued so far on ``earlier``."""
        drv = self._drv
        if self._event is None:
            flags = int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            self._event = call(drv.cuEventCreate, "cuEventCreate", flags)
        call(drv.cuEventRecord, "cuEventRecord", self._event, earlier)
        call(drv.cuStreamWaitEvent, "cuStreamWaitEvent", later, self._event, 0)

    # -- copies ---------------------------------------------------------------------------------
    # The checked copy path is CheckedDevice's; these issue its checked calls on the calling thread's
    # copy stream.
    def _issue_dtod(self, dst: int, src: int, nbytes: int) -> None:
        """``cuMemcpyDtoDAsync``."""
        call(self._dtod_call, "cuMemcpyDtoDAsync", dst, src, nbytes, self._target())
        self._issued()

    def _issue_htod(self, dst: int, src_host: int, nbytes: int) -> None:
        """``cuMemcpyHtoDAsync``: into an allocation of the device, or (``copy_htod_to``) into an
        engine's device memory that :meth:`_check_foreign` accepted."""
        call(self._drv.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync", dst, src_host, nbytes, self._target())
        self._issued()

    def _check_foreign(self, call_name: str, ptr: int, nbytes: int) -> None:
        """Refuse a range the driver does not know as device memory of this GPU, or that runs past
        the end of the allocation holding ``ptr``."""
        if self._pointer_attrs is None:
            kinds = self._drv.CUpointer_attribute
            self._pointer_attrs = [kinds.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, kinds.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   kinds.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, kinds.CU_POINTER_ATTRIBUTE_RANGE_SIZE]
        attrs = self._pointer_attrs
        memory_type, ordinal, start, size = call(self._drv.cuPointerGetAttributes, "cuPointerGetAttributes",
                                                 len(attrs), attrs, ptr)
        if int(memory_type) != CU_MEMORYTYPE_DEVICE:
            where = "host memory" if int(memory_type) == CU_MEMORYTYPE_HOST else "no memory the driver knows"
            raise InvalidId(f"{call_name}: address {ptr:#x} is {where}, not device memory (memory type "
                            f"{int(memory_type)}, device is {CU_MEMORYTYPE_DEVICE})")
        if int(ordinal) != self._ordinal:
            raise InvalidId(f"{call_name}: address {ptr:#x} lies on GPU {int(ordinal)}, this device is GPU "
                            f"{self._ordinal}")
        start, size = int(start), int(size)
        if size and ptr + nbytes > start + size:
            raise InvalidId(f"{call_name}: range [{ptr:#x}, {ptr:#x} + {nbytes}) runs past the end of its "
                            f"allocation [{start:#x}, {start:#x} + {size})")

    def _issue_dtoh(self, dst_host: int, src: int, nbytes: int) -> None:
        """``cuMemcpyDtoHAsync``."""
        call(self._drv.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync", dst_host, src, nbytes, self._target())
        self._issued()

    def _issue_copies(self, rows: CopyArray) -> None:
        """One ``cuMemcpyBatchAsync`` (unified addresses) where the driver has it, else one
        ``cuMemcpyAsync`` each; if the driver fails part way through that loop, the copies before
        it were issued."""
        if rows.shape[0] and not rows[:, 2].all():
            rows = rows[rows[:, 2] > 0]
        count = rows.shape[0]
        if count == 0:
            return
        self._issued()
        if count > 1 and self._batch_fn is not None and self._issue_batch(rows):
            return
        copy, stream = self._drv.cuMemcpyAsync, self._target()
        for dst, src, nbytes in rows.tolist():
            call(copy, "cuMemcpyAsync", dst, src, nbytes, stream)

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
        try:
            err, pfn, _status = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", version, flags)
        except ValueError:  # a result code the bindings do not know: treat as "not available"
            return None
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
        """One cuMemcpyBatchAsync of all rows. False, with batching turned off for good (logged
        once), when the driver refuses a batch the device has already checked: NOT_SUPPORTED, or
        INVALID_VALUE (e.g. a driver that does not accept these attributes for this memory)."""
        count = rows.shape[0]
        columns = np.ascontiguousarray(rows.T)  # dsts, srcs, sizes: three contiguous int64 rows
        base = columns.ctypes.data
        stride = count * 8
        attrs = self._batch_attrs.getPtr()
        if self._batch_v1:
            fail_idx = ctypes.c_size_t(0)
            rc = self._batch_fn(base, base + stride, base + 2 * stride, count, attrs, self._attrs_idx.ctypes.data,
                                1, ctypes.addressof(fail_idx), self._target_handle())
        else:
            rc = self._batch_fn(base, base + stride, base + 2 * stride, count, attrs, self._attrs_idx.ctypes.data,
                                1, self._target_handle())
        if rc in (CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_INVALID_VALUE):
            level = logging.INFO if rc == CUDA_ERROR_NOT_SUPPORTED else logging.WARNING
            _, name, text = _describe(self._drv, rc)
            _log.log(level, "%s: cuMemcpyBatchAsync refused a checked batch of %d copies (%s: %s); copying one by "
                     "one from now on", self._name, count, name, text)
            self._batch_fn = None
            return False
        if rc:
            raise _error(self._drv, f"cuMemcpyBatchAsync({count})", rc)
        return True

    def _issue_memset(self, ptr: int, value: int, nbytes: int) -> None:
        """``cuMemsetD8Async``."""
        call(self._drv.cuMemsetD8Async, "cuMemsetD8Async", ptr, value, nbytes, self._target())
        self._issued()

    def synchronize(self) -> None:
        """``cuStreamSynchronize`` of the device's stream, and of every ``use_stream`` block's
        stream with copies issued since the last synchronize: every copy and memset issued is
        done."""
        with self._lock:
            self._check_open("synchronize")
            call(self._drv.cuStreamSynchronize, "cuStreamSynchronize", self._stream)
            self._pending = False
            self._settle()

    def wait_stream(self, stream: object) -> None:
        """Make the calling thread's copy stream wait, on the GPU, for the work issued so far on
        ``stream`` (``cuEventRecord`` there, ``cuStreamWaitEvent`` here): copies issued after this
        call see what an engine's kernels on that stream write. The caller does not block.
        ``stream`` must belong to this device's context (the primary context, which torch and CuPy
        use)."""
        handle = stream_handle(stream)
        with self._lock:
            self._check_open("wait_stream")
            if handle == self._target_handle():
                return
            self._order(self._target(), handle)
            self._issued()

    @contextmanager
    def use_stream(self, stream: object) -> Iterator[None]:
        """Issue the calling thread's copies and memsets on ``stream`` inside the block (see
        :meth:`lifecycle.device.base.Device.use_stream`): on entry ``stream`` waits for the
        thread's earlier copies still in flight, on exit the stream outside waits for the
        block's. Only the joins at entry and exit touch both streams; nothing blocks."""
        handle = stream_handle(stream, "use_stream")
        with self._lock:
            self._check_open("use_stream")
            outer = self._scope()
            scope = _StreamScope(handle, outer)
            outer_pending = self._pending if outer is None else outer.pending
            if outer_pending and handle != self._target_handle():
                self._order(handle, self._target())
            self._scopes.add(scope)
            self._thread_scope.scope = scope
        try:
            yield
        finally:
            with self._lock:
                self._thread_scope.scope = outer
                self._scopes.discard(scope)
                if scope.pending and not self._closed:
                    if handle != self._target_handle():
                        self._order(self._target(), handle)
                    self._issued()

    def record_event(self, event: object) -> None:
        """``cuEventRecord`` of ``event`` on the calling thread's copy stream: it completes once
        the copies and memsets the thread issued so far are done."""
        handle = event_handle(event, "record_event")
        with self._lock:
            self._check_open("record_event")
            call(self._drv.cuEventRecord, "cuEventRecord", handle, self._target())

    def wait_event(self, event: object) -> None:
        """``cuStreamWaitEvent`` of the calling thread's copy stream on ``event``: later copies
        and memsets run after the work ``event`` was recorded after."""
        handle = event_handle(event, "wait_event")
        with self._lock:
            self._check_open("wait_event")
            call(self._drv.cuStreamWaitEvent, "cuStreamWaitEvent", self._target(), handle, 0)
            self._issued()

    def create_event(self) -> int:
        """``cuEventCreate`` (timing disabled): an event of the device's own; its raw handle."""
        with self._lock:
            self._check_open("create_event")
            flags = int(self._drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            with _InContext(self):
                event = call(self._drv.cuEventCreate, "cuEventCreate", flags)
            self._events[int(event)] = event
            return int(event)

    def destroy_event(self, event: int) -> None:
        """``cuEventDestroy`` of an event from :meth:`create_event` (InvalidId for any other)."""
        with self._lock:
            self._check_open("destroy_event")
            handle = self._own_event("destroy_event", event)
            with _InContext(self):
                call(self._drv.cuEventDestroy, "cuEventDestroy", handle)
            del self._events[event]

    def synchronize_event(self, event: int) -> None:
        """``cuEventSynchronize`` of an event from :meth:`create_event`: the caller blocks until
        the work recorded before it is done, not the work issued after it on the same stream."""
        with self._lock:
            self._check_open("synchronize_event")
            call(self._drv.cuEventSynchronize, "cuEventSynchronize", self._own_event("synchronize_event", event))

    def _own_event(self, call_name: str, event: int) -> Any:
        handle = self._events.get(event) if isinstance(event, int) else None
        if handle is None:
            raise InvalidId(f"{call_name}: event {event!r} is not a live event of this device "
                            f"({len(self._events)} live)")
        return handle

    # -- views ----------------------------------------------------------------------------------
    def host_array(self, ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """uint8 numpy view of host memory (pinned or not); valid while that memory is."""
        check_nbytes("host_array", nbytes)
        return _host_view(ptr, nbytes)

    def device_array(self, ptr: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> CudaArrayView:
        """A ``__cuda_array_interface__`` / DLPack view of ``shape``/``dtype`` at ``ptr``, inside
        one live allocation (InvalidId otherwise). ``dtype`` is a numpy dtype or a
        :data:`~lifecycle.config.DType` name (``"bfloat16"``: a uint16 interface, bfloat16 through
        DLPack). A view of zero elements touches no memory and reports a null pointer."""
        storage, element = element_of(dtype)
        with self._lock:
            self._check_open("device_array")
            dims, dt, nbytes = view_size("device_array", shape, storage)
            if nbytes:
                self._device.locate("device_array", ptr, nbytes)
            return CudaArrayView(ptr, dims, dt, self._stream_handle, self, element)

    def _order_consumer(self, consumer: object, producer: int) -> None:
        """A DLPack export: the consumer's stream waits for the work issued so far on the view's
        stream ``producer`` (nothing to do when they are the same stream)."""
        handle = stream_handle(consumer, "__dlpack__")
        with self._lock:
            self._check_open("__dlpack__")
            if handle != producer:
                self._order(handle, producer)

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the stream, free allocations still live (logged), destroy the stream and
        release the primary context, then put back the context the calling thread had. Waits for
        calls in flight on other threads. Idempotent. If a driver call fails, what succeeded stays
        done, the first error is raised and a later ``close()`` retries the rest."""
        with self._lock:
            if self._closed:
                return
            drv = self._drv
            first_error: CudaError | None = None

            def attempt(function: Callable[..., tuple[Any, ...]], name: str, *args: Any) -> tuple[bool, Any]:
                nonlocal first_error
                try:
                    return True, call(function, name, *args)
                except CudaError as exc:
                    first_error = first_error or exc
                    return False, None

            got_previous, previous = attempt(drv.cuCtxGetCurrent, "cuCtxGetCurrent")
            if self._ctx is not None:
                attempt(drv.cuCtxSetCurrent, "cuCtxSetCurrent", self._ctx)
            if self._stream is not None:
                attempt(drv.cuStreamSynchronize, "cuStreamSynchronize", self._stream)
            for scope in self._scopes:  # use_stream blocks still open: their copies may read the memory
                if scope.pending and attempt(drv.cuStreamSynchronize, "cuStreamSynchronize", scope.handle)[0]:
                    scope.pending = False
            leftovers = self.live_allocations
            if leftovers:
                _log.warning("%s: close() frees %d allocation(s) still live (%d bytes)", self._name, leftovers,
                             self.live_bytes)
            for ptr in self._device.addresses():
                if attempt(drv.cuMemFree, "cuMemFree", ptr)[0]:
                    self._device.remove("close", ptr)
            for ptr in self._pinned.addresses():
                if attempt(drv.cuMemFreeHost, "cuMemFreeHost", ptr)[0]:
                    self._pinned.remove("close", ptr)
            if self._event is not None and attempt(drv.cuEventDestroy, "cuEventDestroy", self._event)[0]:
                self._event = None
            for handle, event in list(self._events.items()):
                if attempt(drv.cuEventDestroy, "cuEventDestroy", event)[0]:
                    del self._events[handle]
            if self._stream is not None and attempt(drv.cuStreamDestroy, "cuStreamDestroy", self._stream)[0]:
                self._stream = None
            if first_error is None and self._ctx is not None:
                if attempt(drv.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", self._dev)[0]:
                    self._ctx = None
            if got_previous and int(previous) != self._ctx_handle:
                attempt(drv.cuCtxSetCurrent, "cuCtxSetCurrent", previous)
            if first_error is not None:
                raise first_error
            self._closed = True
            _devices.discard(self)

    def __enter__(self) -> CudaDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
