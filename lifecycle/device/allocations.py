"""Bookkeeping of live allocations shared by every device: sizes by address and range checks.

Both devices check addresses here *before* touching memory or the driver, so that a wrong address
raises the same :class:`~lifecycle.errors.InvalidId` on host and on CUDA instead of a segfault or an
asynchronous illegal-address fault.
"""

from __future__ import annotations

import threading
from bisect import bisect_right, insort
from collections.abc import Sequence, Sized
from typing import Any

import numpy as np
import numpy.typing as npt

from lifecycle._hostcopy import first_bad_row, first_overlap
from lifecycle.errors import InvalidId, InvalidType, TornDown

#: A batch of copies as an (n, 3) int64 array of rows (dst, src, nbytes).
CopyArray = npt.NDArray[np.int64]


def as_copy_array(call: str, copies: Sequence[tuple[int, int, int]] | CopyArray) -> CopyArray:
    """The batch as a C-contiguous (n, 3) int64 array, refusing negative byte counts."""
    arr = np.ascontiguousarray(copies, dtype=np.int64)
    if arr.size == 0:
        return arr.reshape(0, 3)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise InvalidId(f"{call}: copies must be (dst, src, nbytes) rows, got an array of shape {arr.shape}")
    sizes = arr[:, 2]
    if sizes.min() < 0:
        bad = int(np.flatnonzero(sizes < 0)[0])
        raise InvalidId(f"{call}: nbytes={int(sizes[bad])} of copy {bad} must be >= 0")
    return arr


def check_int(call: str, name: str, value: object) -> None:
    """Refuse an argument that is not an int (a numpy integer is one; a bool, float or str is
    not): a float would reach the driver truncated or as a ctypes TypeError."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
        raise InvalidType(f"{call}: {name}={value!r} must be an int")


def check_nbytes(call: str, nbytes: int) -> None:
    """Refuse a byte count that is not an int, or negative (zero is a legal no-op for copies and
    memset)."""
    check_int(call, "nbytes", nbytes)
    if nbytes < 0:
        raise InvalidId(f"{call}: nbytes={nbytes} must be >= 0")


def view_size(call: str, shape: Sequence[int], dtype: npt.DTypeLike) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """``(shape, dtype, nbytes)`` of an array view, refusing a negative dimension."""
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise InvalidId(f"{call}: negative dimension in shape {dims}")
    dt = np.dtype(dtype)
    count = 1
    for d in dims:
        count *= d
    return dims, dt, count * dt.itemsize


def check_alloc_size(call: str, nbytes: int) -> None:
    """Refuse an allocation of fewer than one byte (the CUDA driver refuses it too)."""
    check_int(call, "nbytes", nbytes)
    if nbytes < 1:
        raise InvalidId(f"{call}: nbytes={nbytes} must be >= 1")


class AllocationTable:
    """Live allocations of one kind (device or pinned): address -> size, with range lookups.

    Writers take a lock; readers (range checks on the copy paths) do not: an entry is put in the
    size map before its address enters the sorted list, and leaves the list before the map.
    """

    __slots__ = ("_kind", "_sizes", "_starts", "_bytes", "_lock", "_arrays", "version")

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._sizes: dict[int, int] = {}
        self._starts: list[int] = []
        self._bytes = 0
        self._lock = threading.Lock()
        # (sorted starts, matching ends) as numpy arrays for batch checks; None when stale
        self._arrays: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None
        self.version = 0  # bumped by every add/remove, so that derived indexes know they are stale

    @property
    def count(self) -> int:
        """Number of live allocations."""
        return len(self._sizes)

    @property
    def nbytes(self) -> int:
        """Sum of the sizes of the live allocations."""
        return self._bytes

    def addresses(self) -> list[int]:
        """Live addresses, newest last."""
        return list(self._sizes)

    def add(self, ptr: int, nbytes: int) -> None:
        """Record a new allocation."""
        with self._lock:
            self._sizes[ptr] = nbytes
            insort(self._starts, ptr)
            self._bytes += nbytes
            self._arrays = None
            self.version += 1

    def size_of(self, call: str, ptr: int) -> int:
        """Size of the allocation that starts at ``ptr``; raises InvalidId for any other address."""
        size = self._sizes.get(ptr)
        if size is None:
            raise InvalidId(
                f"{call}: address {ptr:#x} is not a live {self._kind} allocation "
                f"(never allocated here, or already freed; {len(self._sizes)} live)"
            )
        return size

    def remove(self, call: str, ptr: int) -> int:
        """Forget the allocation at ``ptr`` and return its size; InvalidId if it is not live."""
        with self._lock:
            size = self.size_of(call, ptr)
            self._starts.pop(bisect_right(self._starts, ptr) - 1)
            del self._sizes[ptr]
            self._bytes -= size
            self._arrays = None
            self.version += 1
            return size

    def locate(self, call: str, ptr: int, nbytes: int) -> tuple[int, int]:
        """(start, offset) of the allocation holding ``[ptr, ptr + nbytes)``; InvalidId otherwise."""
        starts = self._starts
        i = bisect_right(starts, ptr) - 1
        if i >= 0:
            start = starts[i]
            size = self._sizes.get(start, -1)
            if ptr + nbytes <= start + size:
                return start, ptr - start
        raise InvalidId(
            f"{call}: range [{ptr:#x}, {ptr:#x} + {nbytes}) is not inside one live {self._kind} allocation"
        )

    def check(self, call: str, ptr: int, nbytes: int) -> None:
        """Raise InvalidId unless ``[ptr, ptr + nbytes)`` lies inside one live allocation."""
        if nbytes:
            self.locate(call, ptr, nbytes)

    def range_arrays(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        arrays = self._arrays
        if arrays is None:
            with self._lock:
                starts = np.array(self._starts, dtype=np.int64)
                ends = starts + np.array([self._sizes[p] for p in self._starts], dtype=np.int64)
                arrays = self._arrays = (starts, ends)
        return arrays

    def unchecked_rows(self, copies: CopyArray, column: int) -> npt.NDArray[np.bool_]:
        """Mask of the rows whose range in ``column`` (0: dst, 1: src) is not inside one live
        allocation of this table (zero-byte rows always pass)."""
        sizes = copies[:, 2]
        ptrs = copies[:, column]
        starts, ends = self.range_arrays()
        if starts.size == 0:
            nonempty: npt.NDArray[np.bool_] = sizes != 0
            return nonempty
        idx = np.searchsorted(starts, ptrs, side="right") - 1
        ok = (idx >= 0) & (ptrs + sizes <= ends[np.maximum(idx, 0)])
        ok |= sizes == 0
        bad: npt.NDArray[np.bool_] = ~ok
        return bad


def check_batch(call: str, copies: CopyArray, *tables: AllocationTable) -> None:
    """Raise InvalidId unless both ranges of every (dst, src, nbytes) row lie inside one live
    allocation of one of ``tables``; the message names the first offending row."""
    if copies.shape[0] == 0:
        return
    for column, role in ((0, "dst"), (1, "src")):
        bad = tables[0].unchecked_rows(copies, column)
        for table in tables[1:]:
            if bad.any():
                bad &= table.unchecked_rows(copies, column)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            kinds = " or ".join(t._kind for t in tables)
            raise InvalidId(
                f"{call} {role} (copy {row}): range [{int(copies[row, column]):#x}, +{int(copies[row, 2])}) "
                f"is not inside one live {kinds} allocation"
            )


def check_order_free(call: str, copies: CopyArray) -> None:
    """Raise InvalidId if the batch's result would depend on the order of its copies: a
    destination overlapping another copy's destination or any source. Copies of one batch run in
    no particular order (``cuMemcpyBatchAsync`` leaves it undefined), so such a batch is refused
    on every device instead of working on one and corrupting memory on another."""
    first, second = first_overlap(copies)
    if first < 0:
        return
    if first == second:
        raise InvalidId(
            f"{call} (copy {first}): dst [{int(copies[first, 0]):#x}, +{int(copies[first, 2])}) overlaps its own "
            f"src [{int(copies[first, 1]):#x}, +{int(copies[first, 2])})"
        )
    raise InvalidId(
        f"{call}: copies {min(first, second)} and {max(first, second)} overlap (copy {first}'s dst "
        f"[{int(copies[first, 0]):#x}, +{int(copies[first, 2])}) meets copy {second}'s range); copies in one "
        "batch run in no particular order"
    )


class BatchChecker:
    """Checks whole copy batches against the union of some tables in one compiled loop, and for
    overlapping copies (:func:`check_order_free`).

    The sorted (start, end) arrays of the union, led by a sentinel that no address can fall in,
    are rebuilt only when a table changed. A batch that fails the fast check is re-checked row by
    row by :func:`check_batch`, which names the first offending copy.
    """

    __slots__ = ("_tables", "_key", "_starts", "_ends")

    def __init__(self, *tables: AllocationTable) -> None:
        self._tables = tables
        self._key = -1
        self._starts = np.zeros(1, dtype=np.int64)
        self._ends = np.zeros(1, dtype=np.int64)

    def _index(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        key = 0  # versions only grow: their sum changes whenever a table did
        for table in self._tables:
            key += table.version
        if key != self._key:
            parts = [t.range_arrays() for t in self._tables]
            starts = np.concatenate([np.array([-1], dtype=np.int64)] + [p[0] for p in parts])
            ends = np.concatenate([np.array([-1], dtype=np.int64)] + [p[1] for p in parts])
            order = np.argsort(starts, kind="stable")
            self._starts, self._ends, self._key = starts[order], ends[order], key
        return self._starts, self._ends

    def check(self, call: str, copies: Sequence[tuple[int, int, int]] | CopyArray) -> CopyArray:
        """The batch as an (n, 3) int64 array, once every range is known to be live and no two
        copies overlap."""
        if (
            isinstance(copies, np.ndarray)
            and copies.dtype == np.int64
            and copies.ndim == 2
            and copies.shape[1] == 3
            and copies.flags.c_contiguous
        ):
            rows = copies
        else:
            rows = as_copy_array(call, copies)
        if rows.shape[0] == 0:
            return rows
        starts, ends = self._index()
        if first_bad_row(rows, starts, ends) >= 0:
            as_copy_array(call, rows)  # names a negative size
            check_batch(call, rows, *self._tables)
        check_order_free(call, rows)
        return rows


class TrackedDevice:
    """What both devices keep the same way: a table of device and one of pinned allocations
    (``live_allocations`` lets tests prove nothing leaked), refusal of every call after close, and
    one lock that each call holds, so that ``close`` never runs while another thread is inside a
    call (freeing memory a copy is reading, or destroying the stream it is issued on)."""

    _device: AllocationTable
    _pinned: AllocationTable
    _events: Sized
    _closed: bool
    _lock: threading.Lock

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """True once ``close`` completed."""
        return self._closed

    @property
    def live_allocations(self) -> int:
        """Live ``alloc`` plus ``alloc_pinned`` allocations (tests assert nothing leaked)."""
        return self._device.count + self._pinned.count

    @property
    def live_events(self) -> int:
        """Events from ``create_event`` not yet destroyed (tests assert none leaked)."""
        return len(self._events)

    @property
    def live_bytes(self) -> int:
        """Bytes of live ``alloc`` plus ``alloc_pinned`` allocations."""
        return self._device.nbytes + self._pinned.nbytes

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise TornDown(f"{call}: device {self.name!r} is closed")
