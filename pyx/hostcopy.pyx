# cython: autotestdict=False
"""Batched copy kernels of the device layer: range checks and host memmoves over (n, 3) rows.

A batch is a C-contiguous int64 array of (dst, src, nbytes) rows. Both loops run without the GIL
and cost tens of nanoseconds per row, so a batch of block-sized copies runs at memcpy speed instead
of paying a Python call per block.
"""

cimport cython
from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memmove


cdef inline bint _inside(int64_t ptr, int64_t nbytes, const int64_t[::1] starts,
                         const int64_t[::1] ends) noexcept nogil:
    # the last range starting at or before ptr must also hold ptr + nbytes
    cdef Py_ssize_t lo = 0
    cdef Py_ssize_t hi = starts.shape[0]
    cdef Py_ssize_t mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if starts[mid] <= ptr:
            lo = mid + 1
        else:
            hi = mid
    return lo > 0 and ptr >= starts[lo - 1] and ptr + nbytes <= ends[lo - 1]


@cython.boundscheck(False)
@cython.wraparound(False)
def first_bad_row(const int64_t[:, ::1] rows, const int64_t[::1] starts, const int64_t[::1] ends):
    """Index of the first row with a negative size, or whose dst or src range is not inside one
    ``[starts[k], ends[k])`` (``starts`` sorted ascending); -1 when every row is fine. Zero-size
    rows always pass."""
    cdef Py_ssize_t i
    cdef Py_ssize_t n = rows.shape[0]
    cdef Py_ssize_t bad = -1
    cdef int64_t nbytes
    if rows.shape[1] != 3:
        raise ValueError(f"rows must have 3 columns, not {rows.shape[1]}")
    with nogil:
        for i in range(n):
            nbytes = rows[i, 2]
            if nbytes < 0:
                bad = i
                break
            if nbytes == 0:
                continue
            if not _inside(rows[i, 0], nbytes, starts, ends) or not _inside(rows[i, 1], nbytes, starts, ends):
                bad = i
                break
    return bad


@cython.boundscheck(False)
@cython.wraparound(False)
def memmove_rows(const int64_t[:, ::1] rows):
    """``memmove(dst, src, nbytes)`` for every row, in order. The caller has checked the ranges."""
    cdef Py_ssize_t i
    cdef Py_ssize_t n = rows.shape[0]
    if rows.shape[1] != 3:
        raise ValueError(f"rows must have 3 columns, not {rows.shape[1]}")
    with nogil:
        for i in range(n):
            if rows[i, 2] > 0:
                memmove(<void*><uintptr_t>rows[i, 0], <const void*><uintptr_t>rows[i, 1], <size_t>rows[i, 2])
