# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The KV cache core's lock (module lifecycle._sync): see ``pyx/lifecycle/_sync.pxd``.

A ``CoreLock`` is its core's pool's mutex with a clock: every part of one core (its records, its
trie, its event log) takes it through the one form declared there, and the time it is held is the
core's time in the library (``KVCacheCore.time_ns``).
"""

cimport cython
from libc.stdint cimport int64_t, uint64_t

cdef uint64_t _TICKS_AT_IMPORT = lc_ticks()
cdef uint64_t _NS_AT_IMPORT = lc_monotonic_ns()


cdef double _ns_per_tick():
    cdef uint64_t ticks = lc_ticks() - _TICKS_AT_IMPORT
    cdef uint64_t ns = lc_monotonic_ns() - _NS_AT_IMPORT
    return <double>ns / <double>ticks if ticks > 0 and ns > 0 else 1.0


@cython.final
@cython.auto_pickle(False)
cdef class CoreLock:
    """A KV cache core's lock: its block pool's mutex, timed. Made by the core."""

    def __init__(self, *args, **kwargs):
        """Not for callers: a ``KVCacheCore`` makes its own."""
        raise TypeError("CoreLock objects are made by KVCacheCore")

    cdef int64_t held_ns(self):
        return <int64_t>(self._held * _ns_per_tick())


cdef CoreLock core_lock(object owner, lc_mutex_t *mutex):
    """The lock over ``mutex``, which ``owner`` holds (kept alive with it)."""
    cdef CoreLock lock = CoreLock.__new__(CoreLock)
    lock._owner = owner
    lock._mutex = mutex
    return lock
