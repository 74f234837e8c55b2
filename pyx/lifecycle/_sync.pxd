# The C core's mutex and the one way to take it, module lifecycle._sync. A block pool owns a mutex
# (``lc_mutex_t``); the KV cache core and every part of it (records, trie, event log) work under the
# mutex of the core's pool, through one ``CoreLock`` they share.
#
# The lock form, for every entry point: ``released = enter(...)``, nogil work, ``leave(released)``.
# ``enter`` keeps the GIL for a short call on a free mutex (handing the GIL over and back costs more
# than such a call) and otherwise releases it before waiting, so the work runs without it. Work that
# needs Python under the mutex takes it with ``enter_gil`` (the GIL released only while waiting, so
# that a holder that needs the GIL can finish) and leaves with ``leave(NULL)``. Nothing holding the
# mutex waits for anything else.
#
# Cython compiles the code between ``enter`` and ``leave`` as code that holds the GIL, so nothing
# there checks it: only C statements and calls of nogil functions with C arguments belong there
# (passing ``self._part`` to a function takes a reference, which must not happen without the GIL;
# a part that needs another holds it itself).

cimport cython
from cpython.pystate cimport PyThreadState
from libc.stdint cimport int64_t, uint64_t

cdef extern from *:
    """
    /* Critical sections are short batches, so: one compare-and-swap to take the mutex, one release
     * store to drop it (several times cheaper than an uncontended pthread mutex, which matters at
     * one call per scheduled sequence); a waiter spins briefly, then yields its core until the
     * holder is done. Waiters never hold the GIL (see lc_enter). */
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

    #include <time.h>
    static inline uint64_t lc_monotonic_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
    }
    /* A cheap clock for timing calls: the time-stamp counter on x86-64 (converted to ns against
     * the monotonic clock over the process's life), the monotonic clock elsewhere. */
    #if defined(__x86_64__) || defined(_M_X64)
    #include <x86intrin.h>
    static inline uint64_t lc_ticks(void) { return __rdtsc(); }
    #else
    static inline uint64_t lc_ticks(void) { return lc_monotonic_ns(); }
    #endif
    """
    ctypedef struct lc_mutex_t:
        pass
    void lc_mutex_init(lc_mutex_t *mutex) noexcept nogil
    bint lc_mutex_trylock(lc_mutex_t *mutex) noexcept nogil
    void lc_mutex_lock(lc_mutex_t *mutex) noexcept nogil
    void lc_mutex_unlock(lc_mutex_t *mutex) noexcept nogil
    void lc_mutex_destroy(lc_mutex_t *mutex) noexcept nogil
    uint64_t lc_ticks() noexcept nogil
    uint64_t lc_monotonic_ns() noexcept nogil

cdef extern from "Python.h":
    PyThreadState *PyEval_SaveThread() noexcept
    void PyEval_RestoreThread(PyThreadState *state) noexcept nogil


cdef inline PyThreadState *lc_enter(lc_mutex_t *mutex, bint short) noexcept:
    """Take ``mutex`` for nogil work: a ``short`` call on a free mutex keeps the GIL (NULL is
    returned); otherwise the GIL is released first and the returned state takes it back in
    ``lc_leave``. Between the two only nogil code runs."""
    cdef PyThreadState *released
    if short and lc_mutex_trylock(mutex):
        return NULL
    released = PyEval_SaveThread()
    lc_mutex_lock(mutex)
    return released


cdef inline void lc_enter_gil(lc_mutex_t *mutex) noexcept:
    """Take ``mutex`` for work that needs the GIL, released only while waiting; leave with
    ``lc_leave(mutex, NULL)``."""
    if not lc_mutex_trylock(mutex):
        with nogil:
            lc_mutex_lock(mutex)


cdef inline void lc_leave(lc_mutex_t *mutex, PyThreadState *released) noexcept nogil:
    """Drop ``mutex`` and take the GIL back if ``lc_enter`` released it."""
    lc_mutex_unlock(mutex)
    if released != NULL:
        PyEval_RestoreThread(released)


# Calls handling fewer tokens (or blocks) than this keep the GIL when the core's lock is free.
cdef enum:
    NOGIL_MIN_WORK = 4096


@cython.final
cdef class CoreLock:
    """The KV cache core's lock (its pool's mutex), timed: time under it is the core's time in
    the library. Every part of one core holds the same one."""
    cdef lc_mutex_t *_mutex
    cdef object _owner              # the mutex's owner (its block pool), kept alive
    cdef uint64_t _entered          # clock when last taken
    cdef uint64_t _held             # clock ticks held in all

    cdef inline lc_mutex_t *mutex(self) noexcept nogil:
        return self._mutex

    cdef inline PyThreadState *enter(self, Py_ssize_t work) noexcept:
        """``lc_enter`` for a call handling ``work`` tokens or blocks."""
        cdef PyThreadState *released = lc_enter(self._mutex, work < NOGIL_MIN_WORK)
        self._entered = lc_ticks()
        return released

    cdef inline void enter_gil(self) noexcept:
        lc_enter_gil(self._mutex)
        self._entered = lc_ticks()

    cdef inline void leave(self, PyThreadState *released) noexcept nogil:
        self._held += lc_ticks() - self._entered
        lc_leave(self._mutex, released)

    cdef int64_t held_ns(self)


cdef CoreLock core_lock(object owner, lc_mutex_t *mutex)
