# Argument conversion the Cython modules share (no module of its own: cimport only). A count, a
# start or an id arrives as any Python object; what is not an int that fits the C type is refused
# with a LifecycleError naming the value and the limit, never an OverflowError or a TypeError.
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact


cdef inline bint ssize_fits(object value, Py_ssize_t *out) noexcept:
    """True, with ``out`` set, when ``value`` is an exact int that fits a Py_ssize_t; raises
    nothing (the callers' fast path)."""
    cdef int overflow = 0
    cdef long long number
    if not PyLong_CheckExact(value):
        return False
    number = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow:
        return False
    out[0] = <Py_ssize_t>number
    return True


cdef inline Py_ssize_t ssize_arg(object value, str what, Py_ssize_t low, Py_ssize_t high) except? -1:
    """``value`` as a Py_ssize_t in ``[low, high]``, or ``InvalidId`` naming ``what``, the value
    and the range. An exact int in range costs one inline conversion (the hot paths' case);
    numpy integers and other ``__index__`` objects (never a bool) take the slower path."""
    cdef Py_ssize_t number
    if ssize_fits(value, &number) and low <= number <= high:
        return number
    return _ssize_arg_other(value, what, low, high)


cdef inline Py_ssize_t _ssize_arg_other(object value, str what, Py_ssize_t low, Py_ssize_t high) except? -1:
    # Off the fast path (numpy integers, refusals): imports where it runs.
    import operator
    from lifecycle.errors import InvalidId
    number = None
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            pass
    if number is None:
        raise InvalidId(f"{what} must be an int in [{low}, {high}], got {value!r}")
    if not low <= number <= high:
        raise InvalidId(f"{what}={number} is outside [{low}, {high}]")
    return number
