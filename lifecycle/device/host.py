"""The host-memory device: the embedded default where no GPU is present.

"Device" memory is numpy-owned host memory, aligned to 256 bytes like ``cuMemAlloc``. Copies run
at once by default (``synchronize`` is then trivial); ``HostDevice(deferred=True)`` queues them until
``synchronize`` the way a stream does, so that tests on host also catch a missing synchronize.
Addresses are checked against the live allocations before any byte moves.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from lifecycle._hostcopy import memmove_rows
from lifecycle.device.allocations import AllocationTable, BatchChecker, CopyArray
from lifecycle.device.allocations import check_nbytes, view_size
from lifecycle.device.base import CheckedDevice, DeviceKind, event_handle, stream_handle
from lifecycle.config import storage_dtype
from lifecycle.device.dlpack import KDL_CPU, capsule, check_device, element_of, element_strides
from lifecycle.errors import DeviceError, InvalidId

if TYPE_CHECKING:
    from typing_extensions import CapsuleType

    from lifecycle.config import DType

_ALIGN = 256
_PAGE = 4096
_memmove = ctypes.memmove
_memset = ctypes.memset


def physical_memory_bytes() -> int:
    """Physical memory of this machine (the default capacity of a HostDevice)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 34


def _host_view(ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """uint8 view of foreign host memory (the caller keeps it alive)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B"), dtype=np.uint8)


class HostArrayView(np.ndarray[Any, np.dtype[Any]]):
    """A numpy view of host device memory that also exports, through DLPack, the element type the
    memory holds (``torch.from_dlpack(view)`` is a ``bfloat16`` tensor over the same bytes where
    numpy sees ``uint16``). Slices, copies and reshapes keep the element type; a view as another
    numpy dtype than the element's storage dtype exports that dtype."""

    _element: DType | None = None

    def __array_finalize__(self, obj: npt.NDArray[Any] | None, /) -> None:
        self._element = getattr(obj, "_element", None)

    @property
    def element(self) -> DType | None:
        """The element type name the memory holds, or None where the numpy dtype says it (also
        for a view whose dtype is no longer that element's storage dtype)."""
        element = self._element
        return element if element is not None and self.dtype == storage_dtype(element) else None

    def __dlpack_device__(self, /) -> tuple[Literal[1], Literal[0]]:
        return (KDL_CPU, 0)

    def __dlpack__(self, /, *, stream: int | Any | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> CapsuleType:
        """A DLPack capsule of this view with its true element type (see
        :mod:`lifecycle.device.dlpack`); zero-copy unless ``copy=True``. Host memory has no
        stream: ``stream`` must be None."""
        if stream is not None:
            raise BufferError(f"__dlpack__: stream={stream!r}, but a host view has no stream (give None)")
        check_device(dl_device, (KDL_CPU, 0))
        source = self.copy() if copy else self
        return capsule(
            source, data=source.ctypes.data, shape=source.shape,
            strides=element_strides("__dlpack__", source.strides, source.itemsize), storage=source.dtype,
            element=source.element, device=(KDL_CPU, 0), max_version=max_version,
            read_only=not source.flags.writeable, copied=bool(copy),
        )


def _shaped_view(buf: npt.NDArray[np.uint8], offset: int, shape: tuple[int, ...], dtype: np.dtype[Any],
                 nbytes: int, element: DType | None) -> HostArrayView:
    """View ``shape``/``dtype`` (``nbytes`` in all) over ``buf[offset:]``, refusing a view that would
    not fit."""
    if offset + nbytes > buf.nbytes:
        raise InvalidId(
            f"device_array: shape {shape} of {dtype} needs {nbytes} bytes at offset {offset}, "
            f"allocation has {buf.nbytes}"
        )
    return _typed(buf[offset : offset + nbytes].view(dtype).reshape(shape), element)


def _typed(array: npt.NDArray[Any], element: DType | None) -> HostArrayView:
    view = array.view(HostArrayView)
    view._element = element
    return view


class HostDevice(CheckedDevice):
    """Host memory behind the :class:`~lifecycle.device.base.Device` interface.

    ``capacity`` bounds the bytes of live ``alloc`` allocations (default: physical memory); an
    allocation past it raises :class:`DeviceError` and changes nothing.
    """

    def __init__(self, capacity: int | None = None, *, deferred: bool = False) -> None:
        if capacity is not None and capacity < 1:
            raise InvalidId(f"HostDevice: capacity={capacity} must be >= 1 byte")
        self._capacity = physical_memory_bytes() if capacity is None else capacity
        self._deferred = deferred
        # (op, dst, src_or_value, nbytes, staged source kept alive): op 0 moves, op 1 sets
        self._pending: list[tuple[int, int, int, int, object]] = []
        self._device = AllocationTable("device")
        self._pinned = AllocationTable("pinned")
        self._batch_checker = BatchChecker(self._device, self._pinned)
        # Aligned uint8 views that own the memory, by address; views handed out keep it alive.
        self._buffers: dict[int, npt.NDArray[np.uint8]] = {}
        self._events: set[int] = set()
        self._last_event = 0
        self._closed = False
        self._lock = threading.Lock()

    # -- identity -------------------------------------------------------------------------------
    @property
    def kind(self) -> DeviceKind:
        return "host"

    @property
    def name(self) -> str:
        return "host (deferred copies)" if self._deferred else "host"

    @property
    def deferred(self) -> bool:
        """True when copies and memsets wait for :meth:`synchronize`."""
        return self._deferred




    def __repr__(self) -> str:
        return f"HostDevice(capacity={self._capacity}, deferred={self._deferred}, live={self.live_allocations})"


    def bind_to_thread(self) -> None:
        """No-op on host (there is no context), but refused after close like on CUDA."""
        with self._lock:
            self._check_open("bind_to_thread")

    # -- memory ---------------------------------------------------------------------------------
    def _new_buffer(self, call: str, nbytes: int) -> tuple[int, npt.NDArray[np.uint8]]:
        try:
            raw = np.empty(nbytes + _ALIGN - 1, dtype=np.uint8)
        except MemoryError:
            raise DeviceError(f"{call}: host allocation of nbytes={nbytes} failed (out of memory)") from None
        base = raw.ctypes.data
        offset = (-base) % _ALIGN
        buf = raw[offset : offset + nbytes]
        return base + offset, buf

    def _issue_alloc(self, call: str, table: AllocationTable, nbytes: int) -> int:
        """256-byte aligned, uninitialised; ``alloc`` within the capacity."""
        if table is self._device:
            used = self._device.nbytes
            if used + nbytes > self._capacity:
                raise DeviceError(
                    f"alloc: nbytes={nbytes} exceeds the free device memory "
                    f"({self._capacity - used} of capacity {self._capacity} bytes free)"
                )
        ptr, buf = self._new_buffer(call, nbytes)
        if table is self._pinned:
            buf[::_PAGE] = 0  # resident from the start, as page-locked memory is: no fault on a copy
        self._buffers[ptr] = buf
        table.add(ptr, nbytes)
        return ptr

    def _issue_free(self, call: str, table: AllocationTable, ptr: int) -> None:
        table.remove(call, ptr)
        del self._buffers[ptr]

    def mem_info(self) -> tuple[int, int]:
        """(capacity minus live ``alloc`` bytes, capacity)."""
        with self._lock:
            self._check_open("mem_info")
            return self._capacity - self._device.nbytes, self._capacity

    # -- copies ---------------------------------------------------------------------------------
    def _is_pinned(self, ptr: int, nbytes: int) -> bool:
        try:
            self._pinned.locate("", ptr, nbytes)
        except InvalidId:
            return False
        return True

    def _move(self, dst: int, src: int, nbytes: int) -> None:
        if self._deferred:
            self._pending.append((0, dst, src, nbytes, None))
        else:
            _memmove(dst, src, nbytes)

    # The checked copy path is CheckedDevice's; these run its checked calls.
    _issue_dtod = _issue_dtoh = _move

    def _check_foreign(self, call_name: str, ptr: int, nbytes: int) -> None:
        """An engine's host memory cannot be checked beyond refusing a null address."""
        if ptr == 0:
            raise InvalidId(f"copy_htod_to: dst is a null address ({nbytes} bytes)")

    def _issue_htod(self, dst: int, src_host: int, nbytes: int) -> None:
        if self._deferred and not self._is_pinned(src_host, nbytes):
            # pageable source: staged at the call like the CUDA driver does, so it may be reused
            staged = np.frombuffer(ctypes.string_at(src_host, nbytes), dtype=np.uint8)
            self._pending.append((0, dst, staged.ctypes.data, nbytes, staged))
        else:
            self._move(dst, src_host, nbytes)

    def _issue_copies(self, rows: CopyArray) -> None:
        if self._deferred:
            self._pending.extend((0, dst, src, nbytes, None) for dst, src, nbytes in rows.tolist())
        else:
            memmove_rows(rows)

    def _issue_memset(self, ptr: int, value: int, nbytes: int) -> None:
        if self._deferred:
            self._pending.append((1, ptr, value, nbytes, None))
        else:
            _memset(ptr, value, nbytes)

    def synchronize(self) -> None:
        """Run queued copies in issue order (deferred mode); immediate mode has nothing to wait for."""
        with self._lock:
            self._check_open("synchronize")
            if self._pending:
                pending, self._pending = self._pending, []
                for op, dst, src, nbytes, _ in pending:
                    if op == 0:
                        _memmove(dst, src, nbytes)
                    else:
                        _memset(dst, src, nbytes)

    def wait_stream(self, stream: object) -> None:
        """Nothing to wait for: host memory has no streams (an engine's writes are in place when
        they return). ``stream`` is still checked, as on CUDA."""
        stream_handle(stream)
        with self._lock:
            self._check_open("wait_stream")

    @contextmanager
    def use_stream(self, stream: object) -> Iterator[None]:
        """Nothing changes on host memory, which has no streams; ``stream`` is checked as on CUDA."""
        stream_handle(stream, "use_stream")
        with self._lock:
            self._check_open("use_stream")
        yield

    def record_event(self, event: object) -> None:
        """Nothing to record: the copies are in place once :meth:`synchronize` returned (at once
        in immediate mode). ``event`` is checked as on CUDA."""
        event_handle(event, "record_event")
        with self._lock:
            self._check_open("record_event")

    def wait_event(self, event: object) -> None:
        """Nothing to wait for (see :meth:`wait_stream`); ``event`` is checked as on CUDA."""
        event_handle(event, "wait_event")
        with self._lock:
            self._check_open("wait_event")

    def create_event(self) -> int:
        """A token standing for an event (host memory has no streams to record it on)."""
        with self._lock:
            self._check_open("create_event")
            self._last_event += 1
            self._events.add(self._last_event)
            return self._last_event

    def destroy_event(self, event: int) -> None:
        """Forget an event from :meth:`create_event`; any other value raises InvalidId."""
        with self._lock:
            self._check_open("destroy_event")
            self._own_event("destroy_event", event)
            self._events.discard(event)

    def synchronize_event(self, event: int) -> None:
        """Run the queued copies (deferred mode: the host device keeps no position per event)."""
        with self._lock:
            self._check_open("synchronize_event")
            self._own_event("synchronize_event", event)
        self.synchronize()

    def _own_event(self, call: str, event: int) -> None:
        if event not in self._events:
            raise InvalidId(f"{call}: event {event!r} is not a live event of this device ({len(self._events)} live)")

    # -- views ----------------------------------------------------------------------------------
    def host_array(self, ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """uint8 view of host memory; a view into this device's own memory keeps it alive."""
        with self._lock:
            check_nbytes("host_array", nbytes)
            for table in (self._pinned, self._device):
                try:
                    start, offset = table.locate("host_array", ptr, nbytes)
                except InvalidId:
                    continue
                buf: npt.NDArray[np.uint8] = self._buffers[start][offset : offset + nbytes]
                return buf
            return _host_view(ptr, nbytes)

    def device_array(self, ptr: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> HostArrayView:
        """numpy view of device memory at ``ptr`` (must lie in one live allocation); keeps it alive.
        ``dtype`` is a numpy dtype or a :data:`~lifecycle.config.DType` name (``"bfloat16"``: a
        ``uint16`` view that exports bfloat16 through DLPack). A view of zero elements touches no
        memory: it is an empty array tied to none."""
        storage, element = element_of(dtype)
        with self._lock:
            self._check_open("device_array")
            dims, dt, nbytes = view_size("device_array", shape, storage)
            if nbytes == 0:
                return _typed(np.empty(dims, dt), element)
            start, offset = self._device.locate("device_array", ptr, 1)
            return _shaped_view(self._buffers[start], offset, dims, dt, nbytes, element)

    def close(self) -> None:
        """Drop the queue and forget allocations still live (their memory goes with the last view)."""
        with self._lock:
            if self._closed:
                return
            self._pending.clear()
            for table in (self._device, self._pinned):
                for ptr in table.addresses():
                    table.remove("close", ptr)
            self._buffers.clear()
            self._events.clear()
            self._closed = True

    def __enter__(self) -> HostDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
