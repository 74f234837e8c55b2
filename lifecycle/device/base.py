"""The device interface: bytes and addresses, nothing about blocks, tries or sequences.

Two implementations behave identically: :class:`~lifecycle.device.host.HostDevice` (host memory,
the embedded default) and :class:`~lifecycle.device.cuda.CudaDevice` (``cuda.bindings.driver``).
Addresses are plain ``int``. Copies are asynchronous on the device's own stream: their data is only
guaranteed to be in place after :meth:`Device.synchronize`. ``host`` addresses passed to copies are
host pointers (pinned ones from :meth:`Device.alloc_pinned` give full speed on CUDA).

The device's stream is its own: work an engine issues on other streams is not ordered with it
until :meth:`Device.wait_stream` or :meth:`Device.wait_event` says so. The other way round,
:meth:`Device.record_event` marks the device's copies for an engine's stream to wait on, and
``with device.use_stream(stream):`` issues the calling thread's copies on the engine's stream itself,
in order with its kernels. Every such call acts on the calling thread's *copy stream*: the device's
own stream, or the stream of the innermost ``use_stream`` block of that thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, SupportsInt, runtime_checkable

import numpy as np
import numpy.typing as npt

from lifecycle.device.allocations import AllocationTable, BatchChecker, CopyArray, TrackedDevice
from lifecycle.device.allocations import check_alloc_size, check_int, check_nbytes
from lifecycle.errors import InvalidId

DeviceKind = Literal["host", "cuda"]

#: A raw CUstream handle is a pointer (0: the legacy default stream; 1 and 2: the special handles
#: CU_STREAM_LEGACY and CU_STREAM_PER_THREAD), so it fits in 64 bits.
_MAX_HANDLE = 1 << 64

#: One copy of a batch: (destination address, source address, byte count).
Copy = tuple[int, int, int]


@runtime_checkable
class Device(Protocol):
    """Raw memory and copies on one device; see the module docstring for the rules."""

    @property
    def kind(self) -> DeviceKind:
        """``"host"`` or ``"cuda"``."""
        ...

    @property
    def name(self) -> str:
        """Human-readable name, e.g. ``"host"`` or ``"cuda:0 (NVIDIA H200)"``."""
        ...

    def bind_to_thread(self) -> None:
        """Make the device's context current on the calling thread (no-op on host)."""
        ...

    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of device memory; returns its address. Raises on failure."""
        ...

    def free(self, ptr: int) -> None:
        """Free memory returned by :meth:`alloc`. Freeing an unknown address raises."""
        ...

    def alloc_pinned(self, nbytes: int) -> int:
        """Allocate page-locked host memory (plain host memory on the host device)."""
        ...

    def free_pinned(self, ptr: int) -> None:
        """Free memory returned by :meth:`alloc_pinned`."""
        ...

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        """Device to device copy, asynchronous on the device's stream."""
        ...

    def copy_htod(self, dst: int, src_host: int, nbytes: int) -> None:
        """Host to device copy, asynchronous on the device's stream."""
        ...

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int) -> None:
        """Device to host copy, asynchronous on the device's stream."""
        ...

    def copy_htod_to(self, dst: int, src_host: int, nbytes: int) -> None:
        """Host to device copy into memory the device did not allocate (an engine's tensor),
        asynchronous like :meth:`copy_htod`. ``dst`` is checked as far as the memory allows: on
        CUDA the driver must know it as device memory of this GPU with ``nbytes`` inside its
        allocation; on the host device it is host memory, which cannot be checked (a null address
        is refused)."""
        ...

    def copy_batch(self, copies: Sequence[Copy] | npt.NDArray[np.int64]) -> None:
        """Copies in one call; copies within one batch are unordered.

        ``copies`` is a sequence of (dst, src, nbytes) or, cheapest for large batches, an (n, 3)
        int64 array of such rows. Each range lies in device memory from :meth:`alloc` or in pinned
        memory from :meth:`alloc_pinned` (so a swap can gather blocks into a staging buffer in one
        call). Every range is checked before any copy is issued, and so is the order-independence
        of the batch: a destination overlapping another copy's destination or any source (its own
        included) is refused, since the copies may run in any order."""
        ...

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        """Set ``nbytes`` bytes at ``ptr`` to ``value`` (0..255), asynchronously."""
        ...

    def synchronize(self) -> None:
        """Wait until every copy and memset issued so far on the device's stream is done."""
        ...

    def wait_stream(self, stream: object) -> None:
        """Order the device's later copies and memsets after all work issued so far on another
        stream (an engine's, whose kernels may still be writing the pools), without blocking the
        caller. ``stream`` is a raw ``CUstream`` handle (int) or a stream object: see
        :func:`stream_handle`. A no-op on the host device, whose memory has no streams."""
        ...

    def use_stream(self, stream: object) -> AbstractContextManager[None]:
        """``with device.use_stream(stream):`` the copies and memsets the calling thread issues on
        the device run on ``stream`` (an engine's: a handle or a stream object, see
        :func:`stream_handle`) instead of the device's own, in order with the kernels issued there,
        without a wait. On entry ``stream`` waits for the thread's earlier copies; on exit the
        stream outside the block waits for the copies issued inside it, so the order of the
        thread's copies never changes and :meth:`synchronize` after the block covers them. Blocks
        nest; the device keeps no reference to ``stream`` after the block. On the host device the
        stream is checked and nothing else changes."""
        ...

    def record_event(self, event: object) -> None:
        """Record ``event`` (an engine's: a ``CUevent`` handle or an event object, see
        :func:`event_handle`) on the calling thread's copy stream: it completes once every copy
        and memset the thread issued so far is done, so an engine's stream that waits for it
        (``cuStreamWaitEvent``, ``torch.cuda.Stream.wait_event``) runs its kernels after them.
        The caller does not block. On the host device the event is checked and nothing else
        happens (its copies are in place when :meth:`synchronize` returns)."""
        ...

    def wait_event(self, event: object) -> None:
        """Order the calling thread's later copies and memsets after ``event`` (recorded by an
        engine on its stream), on the GPU, without blocking the caller. A no-op on the host
        device, once ``event`` is checked."""
        ...

    def create_event(self) -> int:
        """A new event of the device's own, for :meth:`record_event` and
        :meth:`synchronize_event`: a ``CUevent`` handle on CUDA, a token on the host device.
        Destroy it with :meth:`destroy_event`; ``close`` destroys those left."""
        ...

    def destroy_event(self, event: int) -> None:
        """Destroy an event from :meth:`create_event`; any other value raises InvalidId."""
        ...

    def synchronize_event(self, event: int) -> None:
        """Block the caller until the copies and memsets ``event`` (from :meth:`create_event`)
        was last recorded after are done; at once if it was never recorded. Unlike
        :meth:`synchronize`, work issued after the record (an engine's kernels on the same
        stream) is not waited for."""
        ...

    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""
        ...

    def host_array(self, ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """A uint8 numpy view of ``nbytes`` of *host* memory at ``ptr`` (pinned or plain)."""
        ...

    def device_array(self, ptr: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> Any:
        """A zero-copy array view of device memory: numpy on host; on CUDA an object with
        ``__cuda_array_interface__`` (version 3) that torch, CuPy and Numba accept."""
        ...

    def close(self) -> None:
        """Release what the device itself holds (stream, context reference). Idempotent."""
        ...


class CheckedDevice(TrackedDevice):
    """The one checked path of both devices' allocations and copies. Each call holds the device's
    lock and refuses a closed device. An allocation refuses fewer than one byte; a copy or memset
    refuses a negative byte count and checks every range the device allocated against its live
    allocations (``InvalidId`` naming the call and the range); only then is the call handed to the
    device's ``_issue_*`` method, and a copy of zero bytes issues nothing. What the driver does
    with a checked call is the subclass's: its ``_issue_*`` methods, and :meth:`_check_foreign` for
    memory the device did not allocate."""

    _batch_checker: BatchChecker

    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (>= 1) of uninitialised device memory; returns its address."""
        return self._allocate("alloc", self._device, nbytes)

    def alloc_pinned(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (>= 1) of page-locked host memory (plain host memory on the host
        device); returns its address."""
        return self._allocate("alloc_pinned", self._pinned, nbytes)

    def free(self, ptr: int) -> None:
        """Free an ``alloc`` address; an unknown or already freed address raises InvalidId."""
        self._release("free", self._device, ptr)

    def free_pinned(self, ptr: int) -> None:
        """Free an ``alloc_pinned`` address; an unknown or already freed address raises InvalidId."""
        self._release("free_pinned", self._pinned, ptr)

    def _allocate(self, call: str, table: AllocationTable, nbytes: int) -> int:
        with self._lock:
            self._check_open(call)
            check_alloc_size(call, nbytes)
            return self._issue_alloc(call, table, nbytes)

    def _release(self, call: str, table: AllocationTable, ptr: int) -> None:
        with self._lock:
            self._check_open(call)
            self._issue_free(call, table, ptr)

    def _checked(self, call: str, nbytes: int) -> bool:
        """With the lock held: refuse a closed device or a negative ``nbytes``; False when there is
        nothing to copy."""
        self._check_open(call)
        check_nbytes(call, nbytes)
        return nbytes != 0

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        """Copy device to device; both ranges must lie in live allocations (InvalidId otherwise)."""
        with self._lock:
            if self._checked("copy_dtod", nbytes):
                self._device.locate("copy_dtod dst", dst, nbytes)
                self._device.locate("copy_dtod src", src, nbytes)
                self._issue_dtod(dst, src, nbytes)

    def copy_htod(self, dst: int, src_host: int, nbytes: int) -> None:
        """Copy host to device; the device range must lie in a live allocation. The source must
        stay valid and unchanged until :meth:`synchronize` (pinned memory from
        :meth:`alloc_pinned` is copied at full speed on CUDA)."""
        with self._lock:
            if self._checked("copy_htod", nbytes):
                self._device.locate("copy_htod dst", dst, nbytes)
                self._issue_htod(dst, src_host, nbytes)

    def copy_htod_to(self, dst: int, src_host: int, nbytes: int) -> None:
        """Copy host memory into memory the device did not allocate (an engine's tensor at
        ``dst``), checked by :meth:`_check_foreign` before any copy."""
        with self._lock:
            if self._checked("copy_htod_to", nbytes):
                self._check_foreign("copy_htod_to dst", dst, nbytes)
                self._issue_htod(dst, src_host, nbytes)

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int) -> None:
        """Copy device to host; the device range must lie in a live allocation. The destination
        holds the data only after :meth:`synchronize`."""
        with self._lock:
            if self._checked("copy_dtoh", nbytes):
                self._device.locate("copy_dtoh src", src, nbytes)
                self._issue_dtoh(dst_host, src, nbytes)

    def copy_batch(self, copies: Sequence[Copy] | CopyArray) -> None:
        """Copies between device memory and/or pinned memory, unordered among themselves; every
        range, and that no two copies overlap, is checked before any copy is issued."""
        with self._lock:
            self._check_open("copy_batch")
            self._issue_copies(self._batch_checker.check("copy_batch", copies))

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        """Set ``nbytes`` device bytes at ``ptr`` to ``value`` (0..255)."""
        with self._lock:
            self._check_open("memset")
            check_nbytes("memset", nbytes)
            check_int("memset", "value", value)
            if not 0 <= value <= 255:
                raise InvalidId(f"memset: value={value} must be in 0..255")
            if nbytes:
                self._device.locate("memset", ptr, nbytes)
                self._issue_memset(ptr, value, nbytes)

    # What each device does with a checked call, the lock held. _issue_alloc / _issue_free (call,
    # table, nbytes or ptr): allocate and record in the device's or the pinned table / free and
    # forget (InvalidId if the table does not hold it). _check_foreign (call, ptr, nbytes): refuse
    # what the device can tell is no memory to copy into. The copies (nbytes > 0) and memset take
    # their public call's arguments; _issue_copies takes the checked (n, 3) rows, zero-byte rows
    # included.
    _issue_alloc: Callable[[str, AllocationTable, int], int]
    _issue_free: Callable[[str, AllocationTable, int], None]
    _check_foreign: Callable[[str, int, int], None]
    _issue_dtod: Callable[[int, int, int], None]
    _issue_htod: Callable[[int, int, int], None]
    _issue_dtoh: Callable[[int, int, int], None]
    _issue_copies: Callable[[CopyArray], None]
    _issue_memset: Callable[[int, int, int], None]


def _raw_handle(what: str, call: str, value: object, attributes: tuple[str, ...]) -> int:
    """The int behind ``value``: an int, the first of ``attributes`` it has (read, or called when
    it is the ``__cuda_stream__`` protocol method), or what ``int()`` makes of it."""
    handle: object = None
    if isinstance(value, int) and not isinstance(value, bool):
        handle = value
    else:
        for attribute in attributes:
            if hasattr(value, attribute):
                handle = getattr(value, attribute)
                if attribute == "__cuda_stream__":
                    protocol = handle() if callable(handle) else handle
                    handle = protocol[1] if isinstance(protocol, tuple) and len(protocol) == 2 else protocol
                if not isinstance(handle, int) and isinstance(handle, SupportsInt) and not isinstance(handle, float):
                    handle = int(handle)  # a cuda.bindings handle object
                break
        else:
            if isinstance(value, SupportsInt) and not isinstance(value, (bool, float)):
                handle = int(value)
            else:
                names = " or ".join(attributes)
                raise InvalidId(f"{call}: {value!r} is not a {what} (give a {what} handle as an int, or an object with "
                                f"{names})")
    if not isinstance(handle, int) or isinstance(handle, bool) or not 0 <= handle < _MAX_HANDLE:
        raise InvalidId(f"{call}: {what} handle {handle!r} of {value!r} must be an int in [0, 2**64)")
    return handle


def stream_handle(stream: object, call: str = "wait_stream") -> int:
    """The raw ``CUstream`` handle of ``stream``: an int, an object implementing the CUDA stream
    protocol (``__cuda_stream__()``, e.g. ``cuda.core``), an object with a ``cuda_stream``
    attribute (``torch.cuda.Stream``), or one ``int()`` converts (``cuda.bindings``' ``CUstream``).
    Anything else raises :class:`~lifecycle.errors.InvalidId` naming it and ``call``."""
    return _raw_handle("stream", call, stream, ("__cuda_stream__", "cuda_stream"))


def event_handle(event: object, call: str = "wait_event") -> int:
    """The raw ``CUevent`` handle of ``event``: a non-zero int, an object with a ``cuda_event``
    attribute (``torch.cuda.Event``, whose ``CUevent`` exists once it was first recorded), one
    with a ``handle`` attribute (``cuda.core``'s ``Event``), or one ``int()`` converts
    (``cuda.bindings``' ``CUevent``). Anything else, handle 0 included (no event), raises
    :class:`~lifecycle.errors.InvalidId` naming it and ``call``."""
    handle = _raw_handle("event", call, event, ("cuda_event", "handle"))
    if handle == 0:
        raise InvalidId(
            f"{call}: event handle 0 of {event!r} names no event (a torch.cuda.Event has a CUevent only once it "
            "was recorded: record it once before handing it over)"
        )
    return handle
