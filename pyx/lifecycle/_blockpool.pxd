# The refcounted KV block pool, module lifecycle._blockpool: ids 0..num_blocks-1, a refcount
# each, free ids on a LIFO stack; every field is guarded by ``_lock``. It lives at
# pyx/lifecycle/_blockpool.pxd because Cython finds a module's .pxd by its qualified name; other
# Cython modules cimport it as ``from lifecycle._blockpool cimport BlockPool``.

cimport cython
from libc.stdint cimport int32_t

cdef extern from *:
    """
    /* The pool's own mutex: an OS mutex, several times cheaper uncontended than a PyThread lock. */
    #ifdef _WIN32
    #include <windows.h>
    typedef SRWLOCK lc_mutex_t;
    static inline void lc_mutex_init(lc_mutex_t *m) { InitializeSRWLock(m); }
    static inline int lc_mutex_trylock(lc_mutex_t *m) { return TryAcquireSRWLockExclusive(m) != 0; }
    static inline void lc_mutex_lock(lc_mutex_t *m) { AcquireSRWLockExclusive(m); }
    static inline void lc_mutex_unlock(lc_mutex_t *m) { ReleaseSRWLockExclusive(m); }
    static inline void lc_mutex_destroy(lc_mutex_t *m) { (void)m; }
    #else
    #include <pthread.h>
    typedef pthread_mutex_t lc_mutex_t;
    static inline void lc_mutex_init(lc_mutex_t *m) { pthread_mutex_init(m, NULL); }
    static inline int lc_mutex_trylock(lc_mutex_t *m) { return pthread_mutex_trylock(m) == 0; }
    static inline void lc_mutex_lock(lc_mutex_t *m) { pthread_mutex_lock(m); }
    static inline void lc_mutex_unlock(lc_mutex_t *m) { pthread_mutex_unlock(m); }
    static inline void lc_mutex_destroy(lc_mutex_t *m) { pthread_mutex_destroy(m); }
    #endif
    """
    ctypedef struct lc_mutex_t:
        pass
    void lc_mutex_init(lc_mutex_t *mutex) noexcept nogil
    bint lc_mutex_trylock(lc_mutex_t *mutex) noexcept nogil
    void lc_mutex_lock(lc_mutex_t *mutex) noexcept nogil
    void lc_mutex_unlock(lc_mutex_t *mutex) noexcept nogil
    void lc_mutex_destroy(lc_mutex_t *mutex) noexcept nogil



@cython.final
cdef class BlockPool:
    cdef int32_t *_refcounts      # refcount per block id; 0 = on the free stack
    cdef int32_t *_free_stack     # free ids; the top is _free_stack[_num_free - 1]
    cdef Py_ssize_t _num_blocks
    cdef Py_ssize_t _num_free
    cdef lc_mutex_t _lock         # taken with the GIL released, except by short batches (see .pyx)
