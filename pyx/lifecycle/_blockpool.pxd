# The refcounted KV block pool, module lifecycle._blockpool: ids 0..num_blocks-1, a refcount
# each, free ids on a LIFO stack; every field is guarded by ``_lock``. It lives at
# pyx/lifecycle/_blockpool.pxd because Cython finds a module's .pxd by its qualified name; other
# Cython modules cimport it as ``from lifecycle._blockpool cimport BlockPool``.

cimport cython
from libc.stdint cimport int32_t
from cpython.pythread cimport PyThread_type_lock


@cython.final
cdef class BlockPool:
    cdef int32_t *_refcounts      # refcount per block id; 0 = on the free stack
    cdef int32_t *_free_stack     # free ids; the top is _free_stack[_num_free - 1]
    cdef Py_ssize_t _num_blocks
    cdef Py_ssize_t _num_free
    cdef PyThread_type_lock _lock
