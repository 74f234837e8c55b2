# Inline helpers the Cython modules share (no module of its own: cimport only).
cimport numpy as cnp
from cpython.list cimport PyList_CheckExact, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.tuple cimport PyTuple_CheckExact, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport INT32_MAX, int32_t, int64_t
from libc.stdlib cimport realloc


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


cdef inline cnp.ndarray writeable_int32(object values, int ndim, str what, str layout=""):
    """``values`` when it is a writeable, C-contiguous ``ndim``-D native int32 numpy array (a
    table the caller fills in place), else ``InvalidId`` naming ``what`` (``layout``: how its
    rows are read, for the message)."""
    if not (
        cnp.PyArray_Check(values)
        and cnp.PyArray_TYPE(<cnp.ndarray>values) == cnp.NPY_INT32
        and cnp.PyArray_NDIM(<cnp.ndarray>values) == ndim
        and cnp.PyArray_ISCARRAY(<cnp.ndarray>values)
    ):
        from lifecycle.errors import InvalidId
        raise InvalidId(
            f"{what} must be a writeable C-contiguous {ndim}-D int32 numpy array{layout}, got "
            f"{type(values).__name__} {getattr(values, 'dtype', '')} {getattr(values, 'shape', '')}"
        )
    return <cnp.ndarray>values


cdef inline int grow_array(void **array, Py_ssize_t *capacity, Py_ssize_t needed, size_t item) noexcept nogil:
    """Make room for ``needed`` items of ``item`` bytes (doubling); 1 when out of memory (nothing
    changed)."""
    cdef Py_ssize_t grown = capacity[0] if capacity[0] > 0 else 64
    cdef void *moved
    if needed <= capacity[0]:
        return 0
    while grown < needed:
        grown *= 2
    moved = realloc(array[0], grown * item)
    if moved == NULL:
        return 1
    array[0] = moved
    capacity[0] = grown
    return 0


cdef inline cnp.ndarray empty_int32(Py_ssize_t n):
    """A new uninitialised 1-D int32 array of ``n`` entries."""
    cdef cnp.npy_intp dim = n
    return cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)


cdef inline cnp.ndarray shrink(cnp.ndarray array, Py_ssize_t n):
    """``array`` cut to its first ``n`` entries, in place: only for a fresh 1-D array nobody else
    has seen (cheaper than a slice view, and the buffer is freed whole with the array)."""
    cnp.PyArray_DIMS(array)[0] = n
    return array


cdef inline int64_t adapter_key(object adapter) except? -1:
    """The trie's rule for an adapter key: an int (or numpy integer, not a bool) in the int64 range."""
    cdef int overflow = 0
    cdef long long key
    if PyLong_CheckExact(adapter):
        key = PyLong_AsLongLongAndOverflow(adapter, &overflow)
        if not overflow:
            return key
    return _adapter_key_other(adapter)


cdef inline int64_t _adapter_key_other(object adapter) except? -1:
    # Off the fast path (numpy integers, refusals): imports where it runs.
    import numpy as np
    from lifecycle.errors import InvalidId
    if isinstance(adapter, np.integer) and not isinstance(adapter, np.bool_):
        return adapter_key(int(adapter))
    if isinstance(adapter, int) and not isinstance(adapter, bool):
        if type(adapter) is not int and -(1 << 63) <= int(adapter) < (1 << 63):
            return adapter_key(int(adapter))  # an int subclass (an IntEnum member) in range
        raise InvalidId(f"adapter key {int(adapter)} is outside the int64 range")
    raise InvalidId(f"adapter key must be an int, got {adapter!r}")


cdef inline object token_vector(object tokens, const int32_t **data, Py_ssize_t *n):
    """``tokens`` as int32 values to read in place (``data``, ``n``); returns the array owning
    them. A native int32 vector is taken as it is (the caller rejects negative ids while it reads
    them); any other input must hold integers in [0, 2**31) and is converted, or ``InvalidId``
    names the first value that is not a token id."""
    if int32_vector(tokens, data, n):
        return tokens
    converted = _tokens_from_list(tokens)
    tokens = converted if converted is not None else _coerce_tokens(tokens)
    if not int32_vector(tokens, data, n):
        raise AssertionError("token conversion did not produce an aligned int32 vector")
    return tokens


cdef extern from *:
    """
    /* An exact int's value when it is small (one digit: below 2**30), read from the object
     * itself instead of through the general conversion; 0 when it is not (the caller converts). */
    static inline int lc_small_long(PyObject *o, long long *out) {
        if (!PyLong_CheckExact(o)) return 0;
    #if PY_VERSION_HEX >= 0x030C0000 && !defined(PYPY_VERSION) && !defined(Py_LIMITED_API)
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 1;
        }
        return 0;
    #elif PY_VERSION_HEX >= 0x030B0000 && !defined(PYPY_VERSION) && !defined(Py_LIMITED_API)
        Py_ssize_t size = Py_SIZE(o);
        if (size == 1) { *out = (long long)((PyLongObject *)o)->ob_digit[0]; return 1; }
        if (size == 0) { *out = 0; return 1; }
        return 0;
    #else
        (void)o; (void)out;
        return 0;
    #endif
    }
    """
    bint lc_small_long(PyObject *o, long long *out) noexcept


cdef inline bint ints_into(object tokens, int32_t *dest, Py_ssize_t n):
    """Copy the first ``n`` items of an exact list or tuple (at least ``n`` long) into ``dest``,
    one C loop (what an engine's token lists cost: small ints are read from the objects
    themselves); False when one is not an exact int in [0, 2**31) (the caller's general path then
    converts it or names the bad value)."""
    cdef Py_ssize_t i
    cdef long long value
    cdef int overflow = 0
    cdef PyObject *item
    cdef bint is_list = PyList_CheckExact(tokens)
    # Items are borrowed: nothing in the loop runs Python code, so the list cannot change under it.
    for i in range(n):
        item = PyList_GET_ITEM(tokens, i) if is_list else PyTuple_GET_ITEM(tokens, i)
        if not lc_small_long(item, &value):
            if not PyLong_CheckExact(<object>item):
                return False
            value = PyLong_AsLongLongAndOverflow(<object>item, &overflow)
            if overflow:
                return False
        if not 0 <= value <= 0x7FFFFFFF:
            return False
        dest[i] = <int32_t>value
    return True


cdef inline object _tokens_from_list(object tokens):
    """A list or tuple of exact ints in [0, 2**31) as a fresh int32 array (``ints_into``); None
    when it is neither or an item is something else."""
    cdef Py_ssize_t size
    cdef cnp.npy_intp dim
    cdef cnp.ndarray out
    if PyList_CheckExact(tokens):
        size = PyList_GET_SIZE(tokens)
    elif PyTuple_CheckExact(tokens):
        size = PyTuple_GET_SIZE(tokens)
    else:
        return None
    dim = size
    out = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)
    if not ints_into(tokens, <int32_t *>cnp.PyArray_DATA(out), size):
        return None
    return out


cdef inline object vector_1d(object values, str expected):
    """``values`` as a 1-D numpy array of any dtype, or ``InvalidId`` saying what was
    ``expected`` and what came."""
    import numpy as np
    from lifecycle.errors import InvalidId
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidId(f"{expected}, got {values!r}") from error
    if array.ndim != 1:
        raise InvalidId(f"{expected}, got shape {array.shape}")
    return array


cdef inline object _coerce_tokens(object tokens):
    import numpy as np
    from lifecycle.errors import InvalidId
    array = vector_1d(tokens, "token ids must be a 1-D sequence of ints in [0, 2147483647]")
    if array.size == 0:
        return np.empty(0, dtype=np.int32)
    kind = array.dtype.kind
    if kind == "O":
        for value in array:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidId(f"token id {value!r} is not an int in [0, 2147483647]")
            if not 0 <= value <= 0x7FFFFFFF:
                raise InvalidId(f"token id {value} is outside [0, 2147483647]")
        return array.astype(np.int32)
    if kind not in "iu":
        raise InvalidId(
            f"token ids must be integers in [0, 2147483647], got an array of dtype {array.dtype} "
            f"(first value {array[0]!r})"
        )
    outside = np.flatnonzero((array < 0) | (array > 0x7FFFFFFF))
    if outside.size:
        raise InvalidId(f"token id {int(array[outside[0]])} (at index {int(outside[0])}) is outside [0, 2147483647]")
    # A copy that is aligned and contiguous (a view into a byte buffer may be neither).
    return np.require(array, dtype=np.int32, requirements=["C", "A"])


cdef inline object first_negative(const int32_t *data, Py_ssize_t n):
    """The ``InvalidId`` for the first negative value among ``n`` int32 token ids."""
    from lifecycle.errors import InvalidId
    cdef Py_ssize_t i
    for i in range(n):
        if data[i] < 0:
            return InvalidId(f"token id {data[i]} (at index {i}) is outside [0, 2147483647]")
    return InvalidId("token ids must lie in [0, 2147483647]")


# -- the batched calls' arguments (GIL held; off the fast paths, imports where they run) --

cdef inline int32_t[::1] int32_buffer(object out, str call):
    """``out`` as a writable contiguous 1-D int32 view: the buffer protocol first, then DLPack
    (a CPU tensor); a device tensor, another dtype or shape, or a read-only buffer is refused."""
    view = None
    try:
        view = memoryview(out)
    except TypeError:
        if hasattr(out, "__dlpack__"):
            device = out.__dlpack_device__()[0] if hasattr(out, "__dlpack_device__") else 1
            if device != 1:
                from lifecycle.errors import InvalidId
                raise InvalidId(f"{call}: a tensor on DLPack device type {device} is not host memory; write it "
                                "through the model (write_block_tables), which batches the copy") from None
            import numpy as np
            view = memoryview(np.from_dlpack(out))
    if view is None or view.readonly or view.ndim != 1 or view.format not in ("i", "=i", "<i", "@i") or \
            view.itemsize != 4 or not view.c_contiguous:
        _refuse_buffer(view, out, call)
    return view


cdef inline int _refuse_buffer(object view, object out, str call) except -1:
    from lifecycle.errors import InvalidId
    if view is None:
        raise InvalidId(f"{call}: {type(out).__name__} has neither the buffer protocol nor __dlpack__")
    if view.readonly:
        raise InvalidId(f"{call}: the buffer is read-only")
    raise InvalidId(
        f"{call}: needs a contiguous 1-D int32 buffer, got format {view.format!r}, {view.ndim}-D, "
        f"itemsize {view.itemsize}"
    )


cdef inline cnp.ndarray int64_vector(object values, str what):
    """A 1-D int64 array (handles) as given when it is one, else converted; ``InvalidId`` when not
    integers."""
    if isinstance(values, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray>values) == cnp.NPY_INT64 and \
            cnp.PyArray_NDIM(<cnp.ndarray>values) == 1 and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>values):
        return <cnp.ndarray>values
    import numpy as np
    from lifecycle.errors import InvalidId
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidId(f"{what} must be a 1-D sequence of ints, got {values!r}") from error
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidId(f"{what} must be a 1-D sequence of ints, got {array.dtype} of shape {array.shape}")
    if array.size and array.dtype.kind == "u" and array.max() > 0x7FFFFFFFFFFFFFFF:
        # refused by its own value: the int64 copy below would name a negative one
        raise InvalidId(f"{what}: {int(array.max())} is past the int64 limit {0x7FFFFFFFFFFFFFFF}")
    return np.require(array, dtype=np.int64, requirements=["C", "A"])


cdef inline cnp.ndarray block_ids(object values, Py_ssize_t num_blocks, str call):
    """Block ids as a fresh int32 array, each in [0, num_blocks)."""
    import numpy as np
    from lifecycle.errors import InvalidId
    cdef cnp.ndarray wide = int64_vector(values, f"{call}: ids")
    if wide.size and (wide.min() < 0 or wide.max() >= num_blocks):
        bad = wide[(wide < 0) | (wide >= num_blocks)][0]
        raise InvalidId(f"{call}: block id {int(bad)} is outside [0, {num_blocks - 1}]")
    return wide.astype(np.int32)


cdef inline cnp.ndarray int32_column(object values, Py_ssize_t n, str what):
    """``n`` int32 values (a count or a row per request)."""
    cdef const int32_t *data = NULL
    cdef Py_ssize_t size = 0
    if not int32_vector(values, &data, &size):
        values = _int32_column_other(values, n, what)
        int32_vector(values, &data, &size)
    if size != n:
        from lifecycle.errors import InvalidId
        raise InvalidId(f"{what}: {size} values for {n} requests")
    return <cnp.ndarray>values


cdef inline object _int32_column_other(object values, Py_ssize_t n, str what):
    import numpy as np
    from lifecycle.errors import InvalidId
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidId(f"{what} must be {n} ints, got {values!r}") from error
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu") or (
        array.size and (array.min() < 0 or array.max() > INT32_MAX)
    ):
        raise InvalidId(f"{what} must be {n} ints in [0, {INT32_MAX}], got {array!r}")
    return np.require(array, dtype=np.int32, requirements=["C", "A"])
