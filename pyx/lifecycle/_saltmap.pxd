# The cache salts of a KV cache core, module lifecycle._saltmap: salted cache key -> (the key it
# was salted from, the salt), bounded (the least recently used goes). The core owns the one
# ``SaltMap`` (``core.salts``); the model records a record's salted key there and KV events read it.
# GIL held.

cimport cython
from libc.stdint cimport int64_t


@cython.final
cdef class SaltMap:
    cdef object _entries            # OrderedDict: salted key -> (base key, salt), least recently used first
    cdef readonly Py_ssize_t capacity

    cdef object _used(self, int64_t key)
    cpdef int64_t salted(self, int64_t base, object salt) except? -1
    cpdef add(self, int64_t key, int64_t base, object salt)
    cpdef int64_t base_of(self, int64_t key) except? -1
    cpdef object salt_of(self, int64_t key)
    cpdef frozenset derived(self, int64_t base)
