# cython: autotestdict=False
"""Batched copy kernels of the device layer: range checks and host memmoves over (n, 3) rows.

A batch is a C-contiguous int64 array of (dst, src, nbytes) rows. Both loops run without the GIL
and cost tens of nanoseconds per row, so a batch of block-sized copies runs at memcpy speed instead
of paying a Python call per block.

An argument of the wrong kind (not a buffer, another dtype or shape, read-only where it is written,
sizes that disagree) raises ``InvalidId`` naming what was expected and what came.
"""

cimport cython
cimport numpy as cnp

import numpy as np
from libc.stdint cimport int64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memmove

from lifecycle._args cimport ssize_fits

cnp.import_array()

cdef extern from *:
    """
    #include <string.h>
    #include <stdint.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #define LC_HAVE_STREAM 1
    #else
    #define LC_HAVE_STREAM 0
    #endif
    /* Copy with non-temporal (streaming) stores: the destination is not read into the cache
       first, which is what makes one large memcpy faster than many block-sized ones. */
    static void lc_stream_copy(char *dst, const char *src, size_t n) {
    #if LC_HAVE_STREAM
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        if (head > n) head = n;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        size_t blocks = n / 64;
        for (size_t i = 0; i < blocks; i++) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
            dst += 64; src += 64;
        }
        memcpy(dst, src, n - blocks * 64);
    #else
        memcpy(dst, src, n);
    #endif
    }
    static void lc_stream_fence(void) {
    #if LC_HAVE_STREAM
        _mm_sfence();
    #endif
    }
    """
    void lc_stream_copy(char *dst, const char *src, size_t n) noexcept nogil
    void lc_stream_fence() noexcept nogil

# Batches moving more bytes than this (well past a last-level cache) use streaming stores.
DEF STREAM_BATCH_BYTES = 16 << 20
DEF STREAM_ROW_BYTES = 4096


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


cdef object _describe(object value):
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return type(value).__name__
    return f"{type(value).__name__} of dtype {dtype} and shape {shape}"


cdef object _refused(str message):
    from lifecycle.errors import InvalidId
    return InvalidId(message)


cdef object _bad_rows(str what, object rows, tuple bounds=()):
    """The ``InvalidId`` for arguments of ``first_bad_row`` (``bounds``: its starts and ends) or
    ``memmove_rows`` that are not what they must be (built only for a refusal: a batch is on the
    copy path)."""
    for name, value in zip(("starts", "ends"), bounds):
        if value is None or getattr(value, "dtype", None) != np.int64 or getattr(value, "ndim", None) != 1:
            return _refused(f"{what}: {name} must be a contiguous 1-D int64 array, got {_describe(value)}")
    return _refused(f"{what}: rows must be a C-contiguous (n, 3) int64 array, got {_describe(rows)}")


def first_bad_row(rows, starts, ends):
    """Index of the first row with a negative size, or whose dst or src range is not inside one
    ``[starts[k], ends[k])`` (``starts`` sorted ascending); -1 when every row is fine. Zero-size
    rows always pass."""
    cdef const int64_t[:, ::1] row_view
    cdef const int64_t[::1] start_view
    cdef const int64_t[::1] end_view
    if rows is None or starts is None or ends is None:
        raise _bad_rows("first_bad_row", rows, (starts, ends))
    try:
        row_view = rows
        start_view = starts
        end_view = ends
    except (TypeError, ValueError, BufferError) as error:
        raise _bad_rows("first_bad_row", rows, (starts, ends)) from error
    if row_view.shape[1] != 3:
        raise _refused(
            f"first_bad_row: rows must be a C-contiguous (n, 3) int64 array, got {row_view.shape[1]} columns"
        )
    if start_view.shape[0] != end_view.shape[0]:
        raise _refused(
            f"first_bad_row: {start_view.shape[0]} starts but {end_view.shape[0]} ends; they must pair up"
        )
    return _first_bad_row(row_view, start_view, end_view)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef Py_ssize_t _first_bad_row(const int64_t[:, ::1] rows, const int64_t[::1] starts, const int64_t[::1] ends):
    cdef Py_ssize_t i
    cdef Py_ssize_t n = rows.shape[0]
    cdef Py_ssize_t bad = -1
    cdef int64_t nbytes
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


def memmove_rows(rows):
    """``memmove(dst, src, nbytes)`` for every row, in order. The caller has checked the ranges."""
    cdef const int64_t[:, ::1] row_view
    if rows is None:
        raise _bad_rows("memmove_rows", rows)
    try:
        row_view = rows
    except (TypeError, ValueError, BufferError) as error:
        raise _bad_rows("memmove_rows", rows) from error
    if row_view.shape[1] != 3:
        raise _refused(f"memmove_rows: rows must be a C-contiguous (n, 3) int64 array, got {row_view.shape[1]} columns")
    _memmove_rows(row_view)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _memmove_rows(const int64_t[:, ::1] rows) noexcept:
    cdef Py_ssize_t i
    cdef Py_ssize_t n = rows.shape[0]
    cdef int64_t total = 0, dst, src, nbytes
    cdef bint stream
    with nogil:
        for i in range(n):
            if rows[i, 2] > 0:
                total += rows[i, 2]
        stream = total >= STREAM_BATCH_BYTES
        for i in range(n):
            dst, src, nbytes = rows[i, 0], rows[i, 1], rows[i, 2]
            if nbytes <= 0:
                continue
            if stream and nbytes >= STREAM_ROW_BYTES and (dst - src >= nbytes or src - dst >= nbytes):
                lc_stream_copy(<char*><uintptr_t>dst, <const char*><uintptr_t>src, <size_t>nbytes)
            else:
                memmove(<void*><uintptr_t>dst, <const void*><uintptr_t>src, <size_t>nbytes)
        if stream:
            lc_stream_fence()


def stream_copy(dst, src):
    """Copy ``src`` into ``dst`` (equal lengths, not overlapping) with streaming stores, the GIL
    released: the destination's lines are not read into the cache first, and ``src`` stays in
    the cache for whoever reads it next (the swap checksum)."""
    cdef unsigned char[::1] dst_view
    cdef const unsigned char[::1] src_view
    if dst is None or src is None:
        raise _refused(
            f"stream_copy: dst and src must be contiguous byte buffers, got {_describe(dst)} and {_describe(src)}"
        )
    try:
        dst_view = dst
    except (TypeError, ValueError, BufferError) as error:
        raise _refused(f"stream_copy: dst must be a writable contiguous byte buffer, got {_describe(dst)}") from error
    try:
        src_view = src
    except (TypeError, ValueError, BufferError) as error:
        raise _refused(f"stream_copy: src must be a contiguous byte buffer, got {_describe(src)}") from error
    cdef Py_ssize_t n = src_view.shape[0]
    if dst_view.shape[0] != n:
        raise _refused(f"stream_copy: destination holds {dst_view.shape[0]} bytes, source {n}; they must be equal")
    if n == 0:
        return
    cdef uintptr_t d = <uintptr_t>&dst_view[0]
    cdef uintptr_t s = <uintptr_t>&src_view[0]
    if d < s + <uintptr_t>n and s < d + <uintptr_t>n:
        raise _refused(f"stream_copy: source and destination ({n} bytes each) overlap")
    with nogil:
        lc_stream_copy(<char *>d, <const char *>s, <size_t>n)
        lc_stream_fence()


def put_int32(dst, start, src):
    """``dst[start:start + len(src)] = src`` for two 1-D C-contiguous int32 arrays (``dst``
    writeable and long enough), as one memcpy: a token buffer's append without numpy's slice
    machinery. Returns False, copying nothing, for any other kind of argument (``start`` not an
    int, too; the caller falls back to a numpy assignment) or a range outside ``dst``."""
    cdef cnp.ndarray d, s
    cdef Py_ssize_t n, first
    if not (cnp.PyArray_Check(dst) and cnp.PyArray_Check(src) and ssize_fits(start, &first)):
        return False
    d = <cnp.ndarray>dst
    s = <cnp.ndarray>src
    if (
        cnp.PyArray_TYPE(d) != cnp.NPY_INT32 or cnp.PyArray_TYPE(s) != cnp.NPY_INT32
        or cnp.PyArray_NDIM(d) != 1 or cnp.PyArray_NDIM(s) != 1
        or not cnp.PyArray_ISCARRAY(d) or not cnp.PyArray_ISCARRAY_RO(s)
    ):
        return False
    n = cnp.PyArray_DIM(s, 0)
    if first < 0 or first > cnp.PyArray_DIM(d, 0) - n:
        return False
    if n:
        memmove(<char *>cnp.PyArray_DATA(d) + first * 4, cnp.PyArray_DATA(s), n * 4)
    return True


cdef struct _Span:
    int64_t start
    int64_t end
    Py_ssize_t row
    bint is_dst


cdef _Span *_sort_by_start(_Span *spans, _Span *scratch, Py_ssize_t count) noexcept nogil:
    """``spans`` in start order (a bottom-up merge sort, its comparisons inlined: libc's qsort
    calls out per comparison and costs several times more); returns the buffer holding them."""
    cdef Py_ssize_t width = 1, low, middle, high, i, j, k
    cdef _Span *swap
    while width < count:
        low = 0
        while low < count:
            middle = min(low + width, count)
            high = min(low + 2 * width, count)
            i, j, k = low, middle, low
            while i < middle and j < high:
                if spans[j].start < spans[i].start:
                    scratch[k] = spans[j]
                    j += 1
                else:
                    scratch[k] = spans[i]
                    i += 1
                k += 1
            while i < middle:
                scratch[k] = spans[i]
                i += 1
                k += 1
            while j < high:
                scratch[k] = spans[j]
                j += 1
                k += 1
            low += 2 * width
        swap = spans
        spans = scratch
        scratch = swap
        width *= 2
    return spans


# Below this many rows the pairwise test is cheaper than sorting.
DEF PAIRWISE_ROWS = 8


cdef inline bint _meet(int64_t a, int64_t b, int64_t n, int64_t m) noexcept nogil:
    return a < b + m and b < a + n


@cython.boundscheck(False)
@cython.wraparound(False)
def first_overlap(const int64_t[:, ::1] rows):
    """``(i, j)`` for two copies of the batch whose order matters: copy ``i``'s destination
    overlaps copy ``j``'s destination or source (``i == j``: a copy onto its own source); ``(-1,
    -1)`` when the copies may run in any order. Sizes must be >= 0; zero-size rows never conflict."""
    cdef Py_ssize_t n = rows.shape[0]
    cdef Py_ssize_t i, j, k, count = 0
    cdef Py_ssize_t hit_i = -1, hit_j = -1, any_row = -1, dst_row = -1
    cdef int64_t any_end = 0, dst_end = 0
    cdef _Span *spans
    cdef _Span *sorted_spans
    if rows.shape[1] != 3:
        raise ValueError(f"rows must have 3 columns, not {rows.shape[1]}")
    with nogil:
        if n <= PAIRWISE_ROWS:
            for i in range(n):
                if rows[i, 2] <= 0:
                    continue
                for j in range(n):
                    if rows[j, 2] <= 0:
                        continue
                    if _meet(rows[i, 0], rows[j, 1], rows[i, 2], rows[j, 2]) or (
                        j != i and _meet(rows[i, 0], rows[j, 0], rows[i, 2], rows[j, 2])
                    ):
                        hit_i, hit_j = i, j
                        break
                if hit_i >= 0:
                    break
        else:
            spans = <_Span *>malloc(4 * n * sizeof(_Span))  # the spans, then the sort's scratch
            if spans == NULL:
                with gil:
                    raise MemoryError()
            for i in range(n):
                if rows[i, 2] <= 0:
                    continue
                spans[count] = _Span(rows[i, 0], rows[i, 0] + rows[i, 2], i, True)
                spans[count + 1] = _Span(rows[i, 1], rows[i, 1] + rows[i, 2], i, False)
                count += 2
            sorted_spans = _sort_by_start(spans, spans + 2 * n, count)
            # In start order, a range conflicts with an earlier one iff it starts before the
            # furthest end seen so far: of any range for a destination, of destinations for a source.
            for k in range(count):
                if sorted_spans[k].is_dst and any_row >= 0 and sorted_spans[k].start < any_end:
                    hit_i, hit_j = sorted_spans[k].row, any_row
                    break
                if not sorted_spans[k].is_dst and dst_row >= 0 and sorted_spans[k].start < dst_end:
                    hit_i, hit_j = dst_row, sorted_spans[k].row
                    break
                if any_row < 0 or sorted_spans[k].end > any_end:
                    any_end, any_row = sorted_spans[k].end, sorted_spans[k].row
                if sorted_spans[k].is_dst and (dst_row < 0 or sorted_spans[k].end > dst_end):
                    dst_end, dst_row = sorted_spans[k].end, sorted_spans[k].row
            free(spans)
    return hit_i, hit_j
