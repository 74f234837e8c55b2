"""Bookkeeping of live allocations shared by every device: sizes by address and range checks.

Both devices check addresses here *before* touching memory or the driver, so that a wrong address
raises the same :class:`~lifecycle.errors.InvalidId` on host and on CUDA instead of a segfault or an
asynchronous illegal-address fault.
"""

from __future__ import annotations

import threading
from bisect import bisect_right, insort

from lifecycle.errors import InvalidId


def check_nbytes(call: str, nbytes: int) -> None:
    """Refuse a negative byte count (zero is a legal no-op for copies and memset)."""
    if nbytes < 0:
        raise InvalidId(f"{call}: nbytes={nbytes} must be >= 0")


def check_alloc_size(call: str, nbytes: int) -> None:
    """Refuse an allocation of fewer than one byte (the CUDA driver refuses it too)."""
    if nbytes < 1:
        raise InvalidId(f"{call}: nbytes={nbytes} must be >= 1")


class AllocationTable:
    """Live allocations of one kind (device or pinned): address -> size, with range lookups.

    Writers take a lock; readers (range checks on the copy paths) do not: an entry is put in the
    size map before its address enters the sorted list, and leaves the list before the map.
    """

    __slots__ = ("_kind", "_sizes", "_starts", "_bytes", "_lock")

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._sizes: dict[int, int] = {}
        self._starts: list[int] = []
        self._bytes = 0
        self._lock = threading.Lock()

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
