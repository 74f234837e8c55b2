# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""Refcounted pool of KV block ids on C arrays.

Block ids are ``0 .. num_blocks - 1``. A block with refcount 0 sits on a LIFO free stack; every
other block is held by someone. Every batch call validates the whole batch before the pool changes,
so a bad id, a double free or an exhausted pool raises and leaves the pool exactly as it was.

Threads may share one pool: every call works under the pool's own mutex, and long batches (or a
caller that has to wait for the mutex) release the GIL. A caller must not change an ids array
while a call on it is running, as with any numpy array handed to a C routine.
"""

cimport cython
cimport numpy as cnp
from libc.stdint cimport INT32_MAX, int32_t, uint32_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy
from cpython.pyport cimport PY_SSIZE_T_MAX, PY_SSIZE_T_MIN
from cpython.ref cimport Py_INCREF

import operator

import numpy as np

from lifecycle.errors import (
    BlockIdOutOfRange,
    ConfigError,
    DoubleFree,
    InvalidId,
    InvariantViolation,
    OutOfBlocks,
)

cdef extern from "numpy/arrayobject.h":
    # Declared here with the descr as a borrowed pointer: numpy steals a reference to it.
    object PyArray_NewFromDescr(void *subtype, void *descr, int nd, cnp.npy_intp *dims,
                                cnp.npy_intp *strides, void *data, int flags, void *obj)

cnp.import_array()

from lifecycle._args cimport ssize_arg
from lifecycle._int32 cimport int32_vector as _ids_fast, vector_1d, writeable_int32
from lifecycle._sync cimport PyThreadState, lc_enter, lc_enter_gil, lc_leave, lc_mutex_destroy, lc_mutex_init


# The dtype of every id array this module creates, looked up once: allocate() is on the hot path.
cdef cnp.dtype _ID_DTYPE = np.dtype(np.int32)


cdef inline object _new_ids(cnp.npy_intp n):
    """A new uninitialised 1-D int32 array of ``n`` ids."""
    Py_INCREF(_ID_DTYPE)
    return PyArray_NewFromDescr(<void *>cnp.ndarray, <void *>_ID_DTYPE, 1, &n, NULL, NULL, 0, NULL)

cdef inline bint _out_of_range(int32_t block_id, Py_ssize_t num_blocks) noexcept nogil:
    # One unsigned compare covers both negative ids and ids >= num_blocks (num_blocks <= INT32_MAX).
    return <uint32_t>block_id >= <uint32_t>num_blocks


cdef inline void _describe_refusal(
    BatchResult *result, const int32_t *refcounts, const int32_t *ids, Py_ssize_t i
) noexcept nogil:
    cdef Py_ssize_t j
    cdef int32_t block_id = ids[i]
    result.failed_at = i
    result.block_id = block_id
    result.repeats = 0
    if result.refusal != REFUSAL_OUT_OF_RANGE:
        result.refcount = refcounts[block_id]
        for j in range(i + 1):
            if ids[j] == block_id:
                result.repeats += 1


# Batches shorter than this run with the GIL held when the pool's lock is free: handing the GIL
# over and back costs more than such a loop (numpy draws the same line at 500 elements), and under
# contention a released GIL can take a whole switch interval to come back. Longer batches, and any
# caller that finds the lock taken, release the GIL before waiting on the lock and working.
cdef enum:
    NOGIL_MIN_BATCH = 512


cdef inline PyThreadState *_enter(BlockPool pool, Py_ssize_t batch) noexcept:
    return lc_enter(&pool._lock, batch < NOGIL_MIN_BATCH)


cdef object _id_vector(object ids):
    """Any sequence -> a 1-D numpy array of it (any dtype), or ``InvalidId``."""
    return vector_1d(ids, "block ids must be a 1-D sequence of ints")


cdef object _coerce_ids(object ids, Py_ssize_t num_blocks):
    """Any 1-D sequence of ints -> a C-contiguous int32 array whose ids are all in range."""
    array = _id_vector(ids)
    if array.size == 0:
        return np.empty(0, dtype=np.int32)
    kind = array.dtype.kind
    if kind == "O":
        # Ints too large for any numpy integer type end up here; name the first bad one.
        checked = []
        for value in array:
            try:
                block_id = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
            except TypeError:
                block_id = None
            if block_id is None:
                raise InvalidId(f"block ids must be ints, got {value!r}")
            if not 0 <= block_id < num_blocks:
                raise BlockIdOutOfRange(f"block id {block_id} out of range [0, {num_blocks})")
            checked.append(block_id)
        return np.array(checked, dtype=np.int32)
    if kind not in "iu":
        raise InvalidId(f"block ids must be ints, got an array of dtype {array.dtype}")
    # Range-check before narrowing to int32 so that e.g. 2**40 is reported, not wrapped.
    outside = np.flatnonzero((array < 0) | (array >= num_blocks))
    if outside.size:
        raise BlockIdOutOfRange(
            f"block id {int(array[outside[0]])} out of range [0, {num_blocks})"
        )
    return np.ascontiguousarray(array, dtype=np.int32)


@cython.final
@cython.auto_pickle(False)  # C tables: a pickled pool would be a second owner of the same blocks
cdef class BlockPool:
    """``num_blocks`` KV block ids with a refcount each; refcount-0 ids are free."""

    def __cinit__(self, *args, **kwargs):
        # The lock exists even for an instance made by __new__ alone, so every method is safe.
        lc_mutex_init(&self._lock)

    def __init__(self, num_blocks):
        """A pool of ``num_blocks`` free blocks, ids ``0 .. num_blocks-1``."""
        if self._refcounts != NULL:
            raise ConfigError(f"this BlockPool already holds {self._num_blocks} blocks; make a new one")
        try:
            as_int = None if isinstance(num_blocks, bool) else operator.index(num_blocks)
        except TypeError:
            as_int = None
        if as_int is None or not 0 <= as_int <= INT32_MAX:
            raise ConfigError(f"num_blocks must be an int in [0, {INT32_MAX}], got {num_blocks!r}")
        cdef Py_ssize_t count = as_int
        cdef Py_ssize_t i
        # One element more than there are blocks: a zero-block pool still has valid pointers; the
        # spare refcount (0, like a free block) is where release batches charge out-of-range ids,
        # and the spare stack slot takes the write after a release's last push (_dec_ref_batch).
        self._refcounts = <int32_t *>calloc(count + 1, sizeof(int32_t))
        self._free_stack = <int32_t *>malloc((count + 1) * sizeof(int32_t))
        if self._refcounts == NULL or self._free_stack == NULL:
            free(self._refcounts)
            free(self._free_stack)
            self._refcounts = NULL
            self._free_stack = NULL
            raise MemoryError(f"BlockPool({count}): cannot allocate its tables")
        # Reversed so that a fresh pool hands out 0, 1, 2, ...
        for i in range(count):
            self._free_stack[i] = <int32_t>(count - 1 - i)
        self._num_blocks = count
        self._num_free = count

    def __dealloc__(self):
        free(self._refcounts)
        free(self._free_stack)
        lc_mutex_destroy(&self._lock)

    def __repr__(self):
        return f"BlockPool(num_total={self._num_blocks}, num_free={self._num_free})"

    @property
    def num_total(self):
        """Number of block ids the pool owns."""
        return self._num_blocks

    @property
    def num_free(self):
        """Number of blocks with refcount 0 (on the free stack)."""
        return self._num_free

    def allocate(self, n):
        """Return ``n`` fresh block ids (int32 array), each now with refcount 1.

        All or nothing: with fewer than ``n`` free blocks it raises ``OutOfBlocks`` and takes none
        (a count over the pool's size is refused before any memory is set aside for the ids).
        """
        cdef Py_ssize_t count = ssize_arg(n, "allocate: n", PY_SSIZE_T_MIN, PY_SSIZE_T_MAX)
        cdef cnp.npy_intp dim = count
        if count <= 0:
            if count == 0:
                return _new_ids(dim)
            raise InvalidId(f"cannot allocate {count} blocks: the count must be >= 0")
        if count > self._num_blocks:
            _raise_out_of_blocks(self, count)
        out = _new_ids(dim)
        cdef int32_t *dest = <int32_t *>cnp.PyArray_DATA(<cnp.ndarray>out)
        _take(self, dest, count)
        return out

    def allocate_into(self, out, start, n):
        """Write ``n`` fresh block ids (refcount 1) into ``out[start:start + n]``.

        ``out`` must be a writeable, C-contiguous 1-D int32 array long enough; nothing else is
        created. All or nothing, like ``allocate``.
        """
        cdef cnp.ndarray table
        cdef Py_ssize_t length
        cdef Py_ssize_t first = ssize_arg(start, "allocate_into: start", PY_SSIZE_T_MIN, PY_SSIZE_T_MAX)
        cdef Py_ssize_t count = ssize_arg(n, "allocate_into: n", PY_SSIZE_T_MIN, PY_SSIZE_T_MAX)
        table = writeable_int32(out, 1, "allocate_into: out")
        length = cnp.PyArray_DIM(table, 0)
        if count < 0:
            raise InvalidId(f"cannot allocate {count} blocks: the count must be >= 0")
        if first < 0 or first > length or count > length - first:
            raise InvalidId(
                f"allocate_into: cannot write {count} ids at start {first} into an array of length {length}"
            )
        if count == 0:
            return
        cdef int32_t *dest = <int32_t *>cnp.PyArray_DATA(table) + first
        _take(self, dest, count)

    def inc_ref(self, ids):
        """Add one reference to every id in ``ids`` (a repeated id gains one per occurrence).

        Refused before anything changes for an id out of range (``BlockIdOutOfRange``) or a free
        block (``InvalidId``: free blocks are handed out only by ``allocate``).
        """
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0
        cdef BatchResult result
        cdef PyThreadState *released
        if not _ids_fast(ids, &data, &n):
            ids = _coerce_ids(ids, self._num_blocks)
            _ids_fast(ids, &data, &n)
        released = _enter(self, n)
        _inc_ref_batch(self, data, n, &result)
        lc_leave(&self._lock, released)
        if result.failed_at >= 0:
            _raise_refusal(self, &result, "inc_ref")

    def dec_ref(self, ids):
        """Drop one reference from every id in ``ids``; return how many blocks became free.

        Refused before anything changes for an id out of range (``BlockIdOutOfRange``) or a
        release below zero (``DoubleFree``), including a batch that repeats an id more often than
        its refcount. A block that reaches 0 goes back on the free stack exactly once.
        """
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0
        if not _ids_fast(ids, &data, &n):
            ids = _coerce_ids(ids, self._num_blocks)
            _ids_fast(ids, &data, &n)
        return _release(self, data, n, "dec_ref")

    def dec_ref_range(self, ids, start, n):
        """``dec_ref(ids[start:start + n])`` without making the slice: release part of a block
        table in place (a finished sequence's row of a preallocated table, or the tail a
        rolled-back step no longer needs). Returns how many blocks became free; refused before
        anything changes exactly like ``dec_ref``, and for a range outside ``ids``."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t length = 0
        cdef Py_ssize_t first = ssize_arg(start, "dec_ref_range: start", PY_SSIZE_T_MIN, PY_SSIZE_T_MAX)
        cdef Py_ssize_t count = ssize_arg(n, "dec_ref_range: n", PY_SSIZE_T_MIN, PY_SSIZE_T_MAX)
        cdef bint fast = _ids_fast(ids, &data, &length)
        if not fast:
            ids = _id_vector(ids)  # any other sequence: an array first, so its length and slice agree
            length = ids.shape[0]
        if count < 0 or first < 0 or first > length or count > length - first:
            raise InvalidId(
                f"dec_ref_range: cannot release {count} ids at start {first} of an array of length {length}"
            )
        if fast:
            data += first
        else:
            # Only the range is converted (and checked): the rest of the table is not ours to judge.
            ids = _coerce_ids(ids[first : first + count], self._num_blocks)
            _ids_fast(ids, &data, &length)
            if length != count:  # cannot happen for an array; never read past what was converted
                raise InvalidId(f"dec_ref_range: {count} ids expected, {length} converted")
        return _release(self, data, count, "dec_ref_range")

    def refcount(self, block_id):
        """The current refcount of ``block_id`` (0 = free)."""
        cdef Py_ssize_t index = ssize_arg(block_id, "refcount: block id", PY_SSIZE_T_MIN, PY_SSIZE_T_MAX)
        if index < 0 or index >= self._num_blocks:
            raise BlockIdOutOfRange(f"block id {index} out of range [0, {self._num_blocks})")
        return self._refcounts[index]

    def refcounts(self):
        """A copy of every block's refcount, indexed by block id."""
        cdef cnp.npy_intp dim = self._num_blocks
        out = _new_ids(dim)
        cdef int32_t *dest = <int32_t *>cnp.PyArray_DATA(<cnp.ndarray>out)
        cdef PyThreadState *released = lc_enter(&self._lock, False)
        if self._num_blocks:
            memcpy(dest, self._refcounts, self._num_blocks * sizeof(int32_t))
        lc_leave(&self._lock, released)
        return out

    def check_invariants(self):
        """Recount the pool from scratch; raise ``InvariantViolation`` on any mismatch.

        Checked: the free stack holds only in-range ids with refcount 0, each once; no refcount is
        negative; the number of refcount-0 blocks equals ``num_free``.
        """
        lc_enter_gil(&self._lock)
        try:
            problem = self._problem()
        finally:
            lc_leave(&self._lock, NULL)
        if problem is not None:
            raise InvariantViolation(f"BlockPool: {problem}")

    cdef str _problem(self):
        """(Lock held) the first inconsistency of the pool's tables, or None."""
        cdef unsigned char *seen = <unsigned char *>calloc(self._num_blocks + 1, 1)
        if seen == NULL:
            raise MemoryError("check_invariants: cannot allocate its scratch table")
        cdef Py_ssize_t i
        cdef Py_ssize_t zeros = 0
        cdef Py_ssize_t bad_index = -1
        cdef int32_t bad_value = 0
        cdef int problem = 0
        with nogil:
            if self._num_free < 0 or self._num_free > self._num_blocks:
                problem = 1
            if problem == 0:
                for i in range(self._num_free):
                    bad_value = self._free_stack[i]
                    if _out_of_range(bad_value, self._num_blocks):
                        problem = 2
                    elif seen[bad_value]:
                        problem = 3
                    elif self._refcounts[bad_value] != 0:
                        problem = 4
                    if problem:
                        bad_index = i
                        break
                    seen[bad_value] = 1
            if problem == 0:
                for i in range(self._num_blocks):
                    if self._refcounts[i] < 0:
                        problem = 5
                        bad_index = i
                        bad_value = self._refcounts[i]
                        break
                    if self._refcounts[i] == 0:
                        zeros += 1
                if problem == 0 and zeros != self._num_free:
                    problem = 6
        free(seen)
        if problem == 0:
            return None
        messages = {
            1: f"num_free {self._num_free} outside [0, {self._num_blocks}]",
            2: f"free stack entry {bad_index} holds block id {bad_value} out of range [0, {self._num_blocks})",
            3: f"block id {bad_value} is on the free stack twice (again at entry {bad_index})",
            4: f"block id {bad_value} is on the free stack with refcount "
               f"{self._refcounts[bad_value] if problem == 4 else 0}",
            5: f"block id {bad_index} has negative refcount {bad_value}",
            6: f"{zeros} blocks have refcount 0 but num_free is {self._num_free}",
        }
        return messages[problem]

    cdef bint _allocate_ids(self, int32_t *dest, Py_ssize_t n) noexcept:
        """``n`` fresh ids into ``dest`` under the lock; False, nothing taken, when too few are free."""
        cdef PyThreadState *released = _enter(self, n)
        cdef bint ok = _pop_free(self, dest, n)
        lc_leave(&self._lock, released)
        return ok

    cdef Py_ssize_t _release_ids(self, const int32_t *ids, Py_ssize_t n, str call) except -1:
        """``dec_ref`` of ``n`` ids under the lock, refused as ``call``'s error; how many became free."""
        return _release(self, ids, n, call)

    cdef bint _allocate_locked(self, int32_t *dest, Py_ssize_t n) noexcept nogil:
        return _pop_free(self, dest, n)

    cdef void _inc_ref_locked(self, const int32_t *ids, Py_ssize_t n, BatchResult *result) noexcept nogil:
        _inc_ref_batch(self, ids, n, result)

    cdef Py_ssize_t _dec_ref_locked(self, const int32_t *ids, Py_ssize_t n, BatchResult *result) noexcept nogil:
        return _dec_ref_batch(self, ids, n, result)

    cdef int _raise_refused(self, BatchResult *result, str call) except -1:
        _raise_refusal(self, result, call)
        return 0

    cdef int _raise_short(self, Py_ssize_t n) except -1:
        _raise_out_of_blocks(self, n)
        return 0


# -- cores: called with the lock held and the GIL released ------------------------------

# The cores copy the pool's pointers and sizes into locals: the build disables strict aliasing,
# so through ``self`` the compiler would reload them after every int32 store.

cdef inline bint _pop_free(BlockPool self, int32_t *dest, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t j
    cdef Py_ssize_t top = self._num_free
    cdef const int32_t *stack = self._free_stack
    cdef int32_t *refcounts = self._refcounts
    cdef int32_t block_id
    if n > top:
        return False
    for j in range(n):
        block_id = stack[top - 1 - j]
        refcounts[block_id] = 1
        dest[j] = block_id
    self._num_free = top - n
    return True

cdef inline void _inc_ref_batch(
    BlockPool self, const int32_t *ids, Py_ssize_t n, BatchResult *result
) noexcept nogil:
    # Apply as we go and undo on the first refusal: a free id is refused at its first
    # occurrence, so a repeat can never smuggle a free block in.
    cdef Py_ssize_t i, j
    cdef int32_t block_id, count
    cdef int32_t *refcounts = self._refcounts
    cdef Py_ssize_t num_blocks = self._num_blocks
    result.failed_at = -1
    result.refusal = REFUSAL_NONE
    for i in range(n):
        block_id = ids[i]
        if _out_of_range(block_id, num_blocks):
            result.refusal = REFUSAL_OUT_OF_RANGE
            break
        count = refcounts[block_id]
        if count == 0:
            result.refusal = REFUSAL_ZERO
            break
        if count == INT32_MAX:
            result.refusal = REFUSAL_SATURATED
            break
        refcounts[block_id] = count + 1
    if result.refusal == REFUSAL_NONE:
        return
    for j in range(i):
        refcounts[ids[j]] -= 1
    _describe_refusal(result, refcounts, ids, i)

cdef inline Py_ssize_t _dec_ref_batch(
    BlockPool self, const int32_t *ids, Py_ssize_t n, BatchResult *result
) noexcept nogil:
    # Optimistic and branch-free: every id is applied as it comes, an out-of-range one charged to
    # the spare entry past the last id (refcount 0, so it goes negative like a double free), and
    # ids reaching 0 are pushed above the free stack's top (the slot is written every time, the
    # top moves only on a push). Whether any count went negative is looked at once, after the
    # loop: then every decrement is undone, the top is left where it was (which discards the
    # pushes), and a careful pass finds the first offending entry. A block reaches 0 at most
    # once per batch, so pushes never pass the end of the stack, whose one spare slot takes the
    # write after its last push.
    cdef Py_ssize_t i, j, index, n_applied
    cdef int32_t block_id, count
    cdef int32_t *refcounts = self._refcounts
    cdef int32_t *stack = self._free_stack
    cdef Py_ssize_t top = self._num_free
    cdef Py_ssize_t num_blocks = self._num_blocks
    cdef int32_t bad = 0
    result.failed_at = -1
    result.refusal = REFUSAL_NONE
    if n >= INT32_MAX:
        bad = -1  # a batch that could wrap the spare entry around: the careful pass only
        n_applied = 0
    else:
        n_applied = n
    for i in range(n_applied):
        block_id = ids[i]
        index = num_blocks if _out_of_range(block_id, num_blocks) else block_id
        count = refcounts[index] - 1
        bad |= count
        refcounts[index] = count
        stack[top] = block_id
        top += count == 0
    if bad >= 0:
        i = top - self._num_free
        self._num_free = top
        return i
    for i in range(n_applied):
        block_id = ids[i]
        refcounts[num_blocks if _out_of_range(block_id, num_blocks) else block_id] += 1
    # The careful pass: apply with pushes, stop at the first refusal and undo up to it.
    top = self._num_free
    for i in range(n):
        block_id = ids[i]
        if _out_of_range(block_id, num_blocks):
            result.refusal = REFUSAL_OUT_OF_RANGE
            break
        count = refcounts[block_id] - 1
        if count < 0:
            result.refusal = REFUSAL_ZERO
            break
        refcounts[block_id] = count
        if count == 0:
            stack[top] = block_id
            top += 1
    if result.refusal == REFUSAL_NONE:
        i = top - self._num_free
        self._num_free = top
        return i
    for j in range(i):
        refcounts[ids[j]] += 1
    _describe_refusal(result, refcounts, ids, i)
    return 0

cdef inline int _take(BlockPool self, int32_t *dest, Py_ssize_t n) except -1:
    """``n`` fresh ids into ``dest`` under the lock (the GIL kept for a short batch on a free
    lock), or ``OutOfBlocks`` with nothing taken."""
    if not self._allocate_ids(dest, n):
        _raise_out_of_blocks(self, n)
    return 0

cdef inline Py_ssize_t _release(BlockPool self, const int32_t *data, Py_ssize_t n, str call) except -1:
    """One release batch under the lock (the GIL kept for a short batch on a free lock), raising
    the refusal as ``call``'s; how many blocks became free."""
    cdef BatchResult result
    cdef PyThreadState *released = _enter(self, n)
    cdef Py_ssize_t freed = _dec_ref_batch(self, data, n, &result)
    lc_leave(&self._lock, released)
    if result.failed_at >= 0:
        _raise_refusal(self, &result, call)
    return freed

# -- errors (GIL held, lock released) ------------------------------------------------------

cdef void _raise_out_of_blocks(BlockPool self, Py_ssize_t n) except *:
    raise OutOfBlocks(
        f"cannot allocate {n} blocks: only {self._num_free} of {self._num_blocks} are free"
    )

cdef void _raise_refusal(BlockPool self, BatchResult *result, str call) except *:
    cdef int32_t block_id = result.block_id
    if result.refusal == REFUSAL_OUT_OF_RANGE:
        raise BlockIdOutOfRange(
            f"{call}: block id {block_id} out of range [0, {self._num_blocks})"
        )
    if result.refusal == REFUSAL_SATURATED:
        raise InvalidId(f"inc_ref: block id {block_id} already has the maximum refcount {INT32_MAX}")
    if call == "inc_ref":
        raise InvalidId(
            f"inc_ref: block id {block_id} is free (refcount 0); only allocate hands out free blocks"
        )
    if result.repeats > 1:
        raise DoubleFree(
            f"{call}: block id {block_id} is released {result.repeats} times in one batch "
            f"but its refcount is {result.refcount} (double free)"
        )
    raise DoubleFree(f"{call}: block id {block_id} has refcount 0 (double free)")
