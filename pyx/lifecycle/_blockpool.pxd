# The refcounted KV block pool, module lifecycle._blockpool: ids 0..num_blocks-1, a refcount
# each, free ids on a LIFO stack; every field is guarded by ``_lock``. It lives at
# pyx/lifecycle/_blockpool.pxd because Cython finds a module's .pxd by its qualified name; other
# Cython modules cimport it as ``from lifecycle._blockpool cimport BlockPool``.

cimport cython
from libc.stdint cimport int32_t

from lifecycle._sync cimport lc_mutex_t

# Why a batch was refused (reported with the index of the offending entry).
cdef enum Refusal:
    REFUSAL_NONE = 0
    REFUSAL_OUT_OF_RANGE = 1
    REFUSAL_ZERO = 2        # dec_ref below zero, or inc_ref of a free block
    REFUSAL_SATURATED = 3   # inc_ref past INT32_MAX


cdef struct BatchResult:
    Py_ssize_t failed_at   # index of the first refused entry, -1 when the batch was applied
    Refusal refusal
    int32_t block_id       # the refused id
    int32_t refcount       # its refcount before the batch (pool restored)
    Py_ssize_t repeats     # how often it occurs in the batch up to and including failed_at


@cython.final
cdef class BlockPool:
    cdef int32_t *_refcounts      # refcount per block id; 0 = on the free stack
    cdef int32_t *_free_stack     # free ids; the top is _free_stack[_num_free - 1]
    cdef Py_ssize_t _num_blocks
    cdef Py_ssize_t _num_free
    cdef lc_mutex_t _lock         # taken in the one form of _sync.pxd (the GIL kept for short batches)

    cdef inline lc_mutex_t *mutex(self) noexcept nogil:
        """The pool's mutex, which a KV cache core over the pool shares (``_sync.CoreLock``)."""
        return &self._lock

    cdef inline Py_ssize_t free_count(self) noexcept nogil:
        return self._num_free

    cdef inline const int32_t *last_freed(self, Py_ssize_t n) noexcept nogil:
        """(Lock held) the ``n`` ids freed last, before any was taken again: the top of the free stack."""
        return self._free_stack + self._num_free - n

    # Whole calls for other Cython modules (an engine's page allocator): each takes the lock.
    cdef bint _allocate_ids(self, int32_t *dest, Py_ssize_t n) noexcept
    cdef Py_ssize_t _release_ids(self, const int32_t *ids, Py_ssize_t n, str call) except -1

    # C-level batch operations for other Cython modules (the prefix cache's fused calls). The
    # caller holds ``_lock``; each has the all-or-nothing semantics of its Python counterpart.
    cdef bint _allocate_locked(self, int32_t *dest, Py_ssize_t n) noexcept nogil
    cdef void _inc_ref_locked(self, const int32_t *ids, Py_ssize_t n, BatchResult *result) noexcept nogil
    cdef Py_ssize_t _dec_ref_locked(self, const int32_t *ids, Py_ssize_t n, BatchResult *result) noexcept nogil
    # Raise what the Python call ``call`` raises for a refused batch or a short pool (lock released).
    cdef int _raise_refused(self, BatchResult *result, str call) except -1
    cdef int _raise_short(self, Py_ssize_t n) except -1
    # (Lock held) the first inconsistency of the pool's tables, or None.
    cdef str _problem(self)
