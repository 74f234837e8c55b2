# Inline helpers the Cython modules share (no module of its own: cimport only).
cimport numpy as cnp
from libc.stdint cimport int32_t


cdef inline bint int32_vector(object values, const int32_t **data, Py_ssize_t *n):
    """True when ``values`` is a 1-D, C-contiguous, aligned, native int32 array; then ``data`` and
    ``n`` describe it, to be read in place (the fast path for ids and tokens)."""
    cdef cnp.ndarray array
    if not cnp.PyArray_Check(values):
        return False
    array = <cnp.ndarray>values
    if (
        cnp.PyArray_TYPE(array) != cnp.NPY_INT32
        or cnp.PyArray_NDIM(array) != 1
        or not cnp.PyArray_ISCARRAY_RO(array)
    ):
        return False
    data[0] = <const int32_t *>cnp.PyArray_DATA(array)
    n[0] = cnp.PyArray_DIM(array, 0)
    return True
