# The refcounted KV block pool, module lifecycle._blockpool: ids 0..num_blocks-1, a refcount
# each, free ids on a LIFO stack; every field is guarded by ``_lock``. It lives at
# pyx/lifecycle/_blockpool.pxd because Cython finds a module's .pxd by its qualified name; other
# Cython modules cimport it as ``from lifecycle._blockpool cimport BlockPool``.

cimport cython
from libc.stdint cimport int32_t

cdef extern from *:
    """
    /* The pool's own lock. Critical sections are short batches, so: one compare-and-swap to take
     * it, one release store to drop it (several times cheaper than an uncontended pthread mutex,
     * which matters at one call per scheduled sequence); a waiter spins briefly, then yields its
     * core until the holder is done. Waiters never hold the GIL (see _locked_with_gil). */
    #ifdef _WIN32
    #include <windows.h>
    typedef SRWLOCK lc_mutex_t;
    static inline void lc_mutex_init(lc_mutex_t *m) { InitializeSRWLock(m); }
    static inline int lc_mutex_trylock(lc_mutex_t *m) { return TryAcquireSRWLockExclusive(m) != 0; }
    static inline void lc_mutex_lock(lc_mutex_t *m) { AcquireSRWLockExclusive(m); }
    static inline void lc_mutex_unlock(lc_mutex_t *m) { ReleaseSRWLockExclusive(m); }
    static inline void lc_mutex_destroy(lc_mutex_t *m) { (void)m; }
    #else
    #include <sched.h>
    typedef struct { int held; } lc_mutex_t;
    static inline void lc_mutex_init(lc_mutex_t *m) { __atomic_store_n(&m->held, 0, __ATOMIC_RELEASE); }
    static inline int lc_mutex_trylock(lc_mutex_t *m) {
        int expected = 0;
        return __atomic_compare_exchange_n(&m->held, &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
    }
    static inline void lc_mutex_lock(lc_mutex_t *m) {
        for (unsigned spins = 0; !lc_mutex_trylock(m); spins++) {
            /* Wait on a plain load (no cache-line ping-pong), then retry the CAS. */
            while (__atomic_load_n(&m->held, __ATOMIC_RELAXED)) {
                if (spins++ < 128) {
    #if defined(__x86_64__) || defined(__i386__)
                    __builtin_ia32_pause();
    #endif
                } else {
                    sched_yield();
                }
            }
        }
    }
    static inline void lc_mutex_unlock(lc_mutex_t *m) { __atomic_store_n(&m->held, 0, __ATOMIC_RELEASE); }
    static inline void lc_mutex_destroy(lc_mutex_t *m) { (void)m; }
    #endif
    """
    ctypedef struct lc_mutex_t:
        pass
    void lc_mutex_init(lc_mutex_t *mutex) noexcept nogil
    bint lc_mutex_trylock(lc_mutex_t *mutex) noexcept nogil
    void lc_mutex_lock(lc_mutex_t *mutex) noexcept nogil
    void lc_mutex_unlock(lc_mutex_t *mutex) noexcept nogil
    void lc_mutex_destroy(lc_mutex_t *mutex) noexcept nogil


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
    cdef lc_mutex_t _lock         # taken with the GIL released, except by short batches (see .pyx)

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
