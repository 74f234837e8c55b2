# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""SGLang's page tree over the KV cache core (module lifecycle._sglang_pagetree).

An engine whose prefix cache maps keys to KV indices of its own (SGLang's ``RadixCache``: a
``match`` returns the indices of the cached prefix, an ``insert`` hands the tree a request's
indices) needs a table beside the core: the core's trie matches keys by their tokens and hands
out its own block ids (*tree slots* here), and the table gives each slot the engine's indices of
that page: its first index alone when the page's indices run (first, first + 1, ..., as a paged
allocator hands them out: one int64 a page to write, read and free instead of a row), else its
whole row. :class:`PageTree` is that pair, with each engine call one C call: the key is converted
straight from the engine's token container (``array('q')``, a list, a numpy array), the match
opens, pins and reads a core record under one lock, the indices of a path are gathered in one
loop, eviction hands the evicted pages' indices back in one array.

Module functions do the same for an engine's allocator of pages over a ``BlockPool``:
:func:`page_indices` hands out the KV indices of fresh pages, :func:`release_indices` frees the
pages a list of KV indices names (each page once).

Threads: every call takes the core's lock; a tree serves one scheduler (the engine's own caches
are not thread-safe either), so its probe and lock tables are not shared state to race on.
"""

cimport cython
cimport numpy as cnp
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_CheckBuffer, PyObject_GetBuffer
from cpython.list cimport PyList_CheckExact
from cpython.tuple cimport PyTuple_CheckExact
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcmp, memcpy, memset

from lifecycle._blockpool cimport BlockPool
from lifecycle._kvcache cimport KVCacheCore
from lifecycle._records cimport Failure, ok
from lifecycle._args cimport ssize_arg as _as_count
from lifecycle._hash cimport lc_copy_tokens_checked
from lifecycle._int32 cimport adapter_key as _adapter_key, ints_into, shrink as _shrink

import sys

import numpy as np

from lifecycle._blockpool import BlockPool as _BlockPool
from lifecycle._kvcache import KVCacheCore as _KVCacheCore
from lifecycle.errors import ConfigError, InvalidId, InvariantViolation, SequenceStateError

cnp.import_array()


cdef inline cnp.ndarray _empty(Py_ssize_t n, int typenum):
    cdef cnp.npy_intp dim = n
    return cnp.PyArray_EMPTY(1, &dim, typenum, 0)


# -- token keys -----------------------------------------------------------------------------------

cdef int _bad_token(object value, Py_ssize_t index) except -1:
    raise InvalidId(f"token id {value} (at index {index}) is outside [0, {INT32_MAX}]")


cdef extern from *:
    """
    /* Token ids from 8- or 4-byte integers into int32, in one pass the compiler vectorises;
     * nonzero when any value is outside [0, 2**31) (the caller then names it). */
    static inline int lc_narrow64(const int64_t *src, int32_t *dst, Py_ssize_t n) {
        uint64_t bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            bad |= (uint64_t)src[i] >> 31;
            dst[i] = (int32_t)src[i];
        }
        return bad != 0;
    }
    static inline int lc_any_negative(const int64_t *src, Py_ssize_t n) {
        uint64_t bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) bad |= (uint64_t)src[i];
        return (bad >> 63) != 0;
    }
    /* A row of ``width`` int64s: a page of 16 is two cache lines, so an inline loop (unrolled for
     * the common page sizes) beats a memcpy call per row. */
    static inline void lc_copy_row(int64_t *dest, const int64_t *src, Py_ssize_t width) {
        if (width == 16) { for (int j = 0; j < 16; j++) dest[j] = src[j]; return; }
        if (width == 1) { dest[0] = src[0]; return; }
        for (Py_ssize_t j = 0; j < width; j++) dest[j] = src[j];
    }
    /* A page's KV indices are kept as its first index alone when they run first, first + 1, ...
     * (as a paged allocator hands them out): one int64 a page to write, read and evict instead
     * of a row of the table. In unsigned arithmetic, so that first + j gives each index back
     * bit for bit whatever the values. */
    static inline int lc_row_is_run(const int64_t *row, Py_ssize_t width) {
        uint64_t off = 0, first = (uint64_t)row[0];
        for (Py_ssize_t j = 1; j < width; j++) off |= ((uint64_t)row[j] - first) ^ (uint64_t)j;
        return off == 0;
    }
    static inline void lc_expand_run(int64_t *out, int64_t first, Py_ssize_t width) {
        uint64_t f = (uint64_t)first;
        if (width == 16) { for (int j = 0; j < 16; j++) out[j] = (int64_t)(f + (uint64_t)j); return; }
        for (Py_ssize_t j = 0; j < width; j++) out[j] = (int64_t)(f + (uint64_t)j);
    }
    static inline void lc_gather_pages(int64_t *dest, const int64_t *table, const int64_t *first,
                                       const uint8_t *rowed, const int32_t *ids, Py_ssize_t n, Py_ssize_t width) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t id = ids[i];
            int64_t *out = dest + i * width;
            if (rowed[id]) lc_copy_row(out, table + id * width, width);
            else lc_expand_run(out, first[id], width);
        }
    }
    static inline int lc_any_slot_outside(const int32_t *ids, Py_ssize_t n, Py_ssize_t limit) {
        int bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) bad |= (uint32_t)ids[i] >= (uint64_t)limit;
        return bad;
    }
    """
    bint _narrow64 "lc_narrow64" (const int64_t *src, int32_t *dst, Py_ssize_t n) noexcept nogil
    bint _any_negative "lc_any_negative" (const int64_t *src, Py_ssize_t n) noexcept nogil
    bint _any_slot_outside "lc_any_slot_outside" (const int32_t *ids, Py_ssize_t n, Py_ssize_t limit) noexcept nogil
    void _copy_row "lc_copy_row" (int64_t *dest, const int64_t *src, Py_ssize_t width) noexcept nogil
    bint _row_is_run "lc_row_is_run" (const int64_t *row, Py_ssize_t width) noexcept nogil
    void _expand_run "lc_expand_run" (int64_t *out, int64_t first, Py_ssize_t width) noexcept nogil
    void _gather_pages "lc_gather_pages" (
        int64_t *dest, const int64_t *table, const int64_t *first, const uint8_t *rowed, const int32_t *ids,
        Py_ssize_t n, Py_ssize_t width) noexcept nogil


cdef int _copy_buffer(object tokens, int32_t *dest, Py_ssize_t n) except -1:
    """Copy the first ``n`` items of a C-contiguous, native-order integer buffer of 4 or 8 bytes an
    item into ``dest``, each checked to be a token id; 1 when ``tokens`` is no such buffer."""
    cdef Py_buffer view
    cdef Py_ssize_t i
    cdef const int64_t *wide
    cdef const int32_t *narrow
    cdef const char *fmt
    cdef char kind
    cdef bint signed
    try:
        PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
    except (BufferError, ValueError, TypeError):
        return 1  # strided, or no such buffer: the general path
    try:
        fmt = view.format
        if view.ndim != 1 or fmt == NULL:
            return 1
        if fmt[0] == b'@' or fmt[0] == b'=' or fmt[0] == b'<':  # native order (little-endian hosts only build)
            fmt += 1
        kind = fmt[0]
        if kind == 0 or fmt[1] != 0:
            return 1
        if kind == b'q' or kind == b'l' or kind == b'i':
            signed = True
        elif kind == b'Q' or kind == b'L' or kind == b'I':
            signed = False
        else:
            return 1
        if view.shape[0] < n:
            raise InvalidId(f"a key of {n} tokens is longer than its {view.shape[0]} token ids")
        # Convert first (a loop the compiler vectorises), look for the offender only if any.
        if view.itemsize == 8:
            wide = <const int64_t *>view.buf
            if _narrow64(wide, dest, n):
                for i in range(n):
                    if <uint64_t>wide[i] > <uint64_t>INT32_MAX:
                        if signed:
                            _bad_token(wide[i], i)
                        raise InvalidId(f"token id {<uint64_t>wide[i]} (at index {i}) is outside [0, {INT32_MAX}]")
            return 0
        if view.itemsize == 4:
            narrow = <const int32_t *>view.buf
            if lc_copy_tokens_checked(dest, narrow, n):  # (the core's checked copy of recorded tokens)
                for i in range(n):
                    if narrow[i] < 0:
                        if signed:
                            _bad_token(narrow[i], i)
                        raise InvalidId(f"token id {<uint32_t>narrow[i]} (at index {i}) is outside [0, {INT32_MAX}]")
            return 0
        return 1
    finally:
        PyBuffer_Release(&view)


cdef cnp.ndarray _key(object tokens, Py_ssize_t aligned):
    """The core's key for the first ``aligned`` (whole pages) of ``tokens``: those token ids as a
    fresh int32 array and one token more (the core never reuses a key's last token)."""
    cdef cnp.ndarray key = _empty(aligned + 1, cnp.NPY_INT32)
    cdef int32_t *dest = <int32_t *>cnp.PyArray_DATA(key)
    dest[aligned] = 0
    if aligned == 0:
        return key
    if PyList_CheckExact(tokens) or PyTuple_CheckExact(tokens):
        if len(tokens) < aligned:
            raise InvalidId(f"a key of {aligned} tokens is longer than its {len(tokens)} token ids")
        if ints_into(tokens, dest, aligned):
            return key
    elif PyObject_CheckBuffer(tokens):
        if _copy_buffer(tokens, dest, aligned) == 0:
            return key
    # Anything else (a tensor, a strided or other-typed array, a list of other items): through numpy,
    # which names what is not a token id.
    try:
        array = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidId(f"token ids must be a 1-D sequence of ints, got {type(tokens).__name__}") from error
    if array.ndim == 1 and array.dtype.kind == "O":  # Python ints past int64, or other objects
        for i, value in enumerate(array[:aligned]):
            if type(value) is not int:
                raise InvalidId(f"token id {value!r} (at index {i}) is not an int")
            if not 0 <= value <= INT32_MAX:
                _bad_token(value, i)
        array = array.astype(np.int64)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidId(f"token ids must be a 1-D sequence of ints, got {array.dtype} of shape {array.shape}")
    if len(array) < aligned:
        raise InvalidId(f"a key of {aligned} tokens is longer than its {len(array)} token ids")
    head = array[:aligned]
    outside = np.flatnonzero((head < 0) | (head > INT32_MAX))
    if outside.size:
        _bad_token(int(head[outside[0]]), int(outside[0]))
    key[:aligned] = head
    return key


cdef int _raise_negative(const int64_t *source, Py_ssize_t start, Py_ssize_t stop) except -1:
    cdef Py_ssize_t i
    for i in range(start, stop):
        if source[i] < 0:
            raise InvalidId(f"insert: KV index {source[i]} (at index {i}) is negative")
    return 0


cdef Py_ssize_t _pages_arg(object length, Py_ssize_t page_size, str call) except -1:
    return _as_count(length, f"{call}: length", 0, INT32_MAX) // page_size


cdef object _TORCH_TENSOR = None
cdef object _TORCH_INT64 = None


cdef object _int64_values(object values, const int64_t **data, Py_ssize_t *n):
    """``values`` (KV indices) as ``n`` int64s at ``data``; returns the object owning them. A
    C-contiguous int64 numpy array or CPU torch tensor is read in place (a tensor through its data
    pointer: no numpy view to build); anything else is converted (a device tensor copied to the
    host first), or refused with ``InvalidId``."""
    global _TORCH_TENSOR, _TORCH_INT64
    cdef cnp.ndarray array
    if not cnp.PyArray_Check(values):
        if _TORCH_TENSOR is None:  # torch is never imported here: only recognised once loaded
            torch = sys.modules.get("torch")
            tensor_type = getattr(torch, "Tensor", None)
            if isinstance(tensor_type, type):
                _TORCH_TENSOR, _TORCH_INT64 = tensor_type, getattr(torch, "int64", None)
        if _TORCH_TENSOR is not None and isinstance(values, _TORCH_TENSOR):
            if (
                values.is_cpu and values.dtype is _TORCH_INT64 and values.dim() == 1 and values.is_contiguous()
                and not values.is_neg()
            ):
                n[0] = values.numel()
                data[0] = <const int64_t *><size_t>values.data_ptr()
                return values
            try:
                values = values.detach().resolve_neg().cpu()
            except Exception as error:
                raise InvalidId(f"KV indices: a {values.dtype} tensor on {values.device} cannot be read") from error
    if not (
        cnp.PyArray_Check(values)
        and cnp.PyArray_TYPE(<cnp.ndarray>values) == cnp.NPY_INT64
        and cnp.PyArray_NDIM(<cnp.ndarray>values) == 1
        and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>values)
    ):
        try:
            converted = np.asarray(values)
        except (TypeError, ValueError, OverflowError, RuntimeError) as error:
            raise InvalidId(f"KV indices must be a 1-D integer array, got {type(values).__name__}") from error
        if converted.ndim != 1 or (converted.size and converted.dtype.kind not in "iu"):
            raise InvalidId(
                f"KV indices must be a 1-D integer array, got {converted.dtype} of shape {converted.shape}"
            )
        if converted.size and converted.dtype.kind == "u" and converted.dtype.itemsize == 8 \
                and int(converted.max()) > 0x7FFFFFFFFFFFFFFF:
            raise InvalidId(f"KV index {int(converted.max())} is outside the int64 range")
        values = np.ascontiguousarray(converted, dtype=np.int64)
    array = <cnp.ndarray>values
    data[0] = <const int64_t *>cnp.PyArray_DATA(array)
    n[0] = cnp.PyArray_DIM(array, 0)
    return array


# -- the tree -------------------------------------------------------------------------------------

@cython.final
@cython.auto_pickle(False)
cdef class PageNode:
    """The end of a cached path: what a match or an insert returns. ``tokens`` is the path's key
    (whole pages) and one token more; ``slots`` the tree slots of its pages. Nodes are views: two
    matches of one path give two nodes, and locks count per path, whichever node took them."""

    cdef readonly int64_t generation
    cdef readonly int64_t namespace
    cdef readonly object tokens
    cdef readonly object slots
    cdef readonly Py_ssize_t num_pages
    cdef int64_t _tree               # the id of the tree that made it (0: none; no tree takes it)

    def __init__(self, generation, namespace, tokens, slots):
        """A node of ``slots`` (int32 tree slots) ending the key ``tokens`` (int32, one token more
        than its whole pages) in ``namespace``, taken at the tree's ``generation``. A node made
        (or re-made) here belongs to no tree: trees refuse it."""
        self._tree = 0
        self.generation = generation
        self.namespace = namespace
        self.tokens = tokens
        self.slots = slots
        self.num_pages = len(slots)

    @property
    def evicted(self):
        """Always False: a node is a view of the path when it was returned (see ``PageTree.lock``)."""
        return False

    def __repr__(self):
        return f"PageNode(pages={self.num_pages}, namespace={self.namespace})"


cdef int64_t _last_tree_id = 0


cdef inline PageNode _node(int64_t tree, int64_t generation, int64_t namespace, cnp.ndarray tokens,
                           cnp.ndarray slots):
    """A node of tree ``tree``; its arrays are made read-only (the tree reads them as they were)."""
    cdef PageNode node = PageNode.__new__(PageNode)
    cnp.PyArray_CLEARFLAGS(tokens, cnp.NPY_ARRAY_WRITEABLE)
    cnp.PyArray_CLEARFLAGS(slots, cnp.NPY_ARRAY_WRITEABLE)
    node._tree = tree
    node.generation = generation
    node.namespace = namespace
    node.tokens = tokens
    node.slots = slots
    node.num_pages = cnp.PyArray_DIM(slots, 0)
    return node


@cython.final
cdef class PageTree:
    """A prefix tree of an engine's KV indices in whole pages over lifecycle's core: ``insert``
    stores indices under a key, ``match`` finds the longest stored prefix of a key, ``lock`` keeps
    a path from eviction, ``evict`` drops least recently used unlocked pages and hands their
    indices to ``on_evict`` (also called when an ``insert`` into a full tree evicts).

    ``num_pages`` tree slots (at most that many pages are cached), ``page_size`` tokens a page;
    ``events``: log KV events for :meth:`take_events`. Keys are any container of token ids
    (``array('q')``, a list, a numpy array) with a length in tokens (whole pages of it are used);
    namespaces are ints (``CacheNamespaces`` keys), and keys of two namespaces never share pages.

    A match holds its path with a core record (a *probe*) until the next call: the lock that
    usually follows takes the probe over instead of walking the path again; any other call first
    drops it, so the path is as evictable as if the match had held nothing.
    """

    cdef KVCacheCore _core
    cdef BlockPool _pool
    cdef Py_ssize_t _page_size
    cdef Py_ssize_t _num_pages
    cdef bint _events
    cdef object _on_evict
    cdef cnp.ndarray _values         # (num_pages, page_size) int64: a slot's KV indices, if not a run
    cdef int64_t *_values_data
    cdef int64_t *_first             # each slot's first KV index
    cdef uint8_t *_rowed             # 1 where the slot's indices are a row of _values, 0: _first + 0, 1, ...
    cdef uint8_t *_in_tree           # 1 where the slot is a cached page
    cdef dict _locks                 # end slot -> handles of the locks held on paths ending there
    cdef Py_ssize_t _num_locks
    cdef int64_t _generation
    cdef list _pending
    cdef int64_t _probe
    cdef PageNode _probe_node
    cdef Py_ssize_t _probe_delta
    cdef readonly PageNode root
    cdef int64_t _id

    def __cinit__(self):
        self._in_tree = NULL
        self._rowed = NULL
        self._first = NULL
        self._probe = -1

    def __init__(self, num_pages, page_size, *, events=False, on_evict=None):
        """A tree of ``num_pages`` slots of ``page_size`` tokens (see the class docstring)."""
        if type(page_size) is not int or not 1 <= page_size <= 1 << 16:
            raise ConfigError(f"PageTree: page_size={page_size!r} must be an int in [1, 65536]")
        if type(num_pages) is not int or not 1 <= num_pages <= INT32_MAX // page_size - 1:
            raise ConfigError(
                f"PageTree: num_pages={num_pages!r} must be an int in [1, {INT32_MAX // page_size - 1}]"
            )
        if on_evict is not None and not callable(on_evict):
            raise ConfigError(f"PageTree: on_evict={on_evict!r} is not callable")
        if self._in_tree != NULL or self._rowed != NULL or self._first != NULL:
            raise ConfigError("PageTree: already initialised")
        self._page_size = page_size
        self._num_pages = num_pages
        self._events = bool(events)
        self._on_evict = on_evict
        self._values = np.zeros((num_pages, page_size), dtype=np.int64)
        self._values_data = <int64_t *>cnp.PyArray_DATA(self._values)
        self._in_tree = <uint8_t *>calloc(num_pages, 1)
        self._rowed = <uint8_t *>calloc(num_pages, 1)
        self._first = <int64_t *>calloc(num_pages, sizeof(int64_t))
        if self._in_tree == NULL or self._rowed == NULL or self._first == NULL:
            raise MemoryError("PageTree: out of memory for the slot table")
        self._pool = _BlockPool(num_pages)
        self._core = _KVCacheCore(self._pool, page_size, events=self._events)
        self._locks = {}
        self._num_locks = 0
        self._generation = 0
        self._pending = []
        self._probe = -1
        self._probe_node = None
        self._probe_delta = 0
        global _last_tree_id
        _last_tree_id += 1
        self._id = _last_tree_id
        self.root = _node(self._id, 0, 0, np.zeros(1, dtype=np.int32), _empty(0, cnp.NPY_INT32))

    def __dealloc__(self):
        free(self._in_tree)
        free(self._rowed)
        free(self._first)

    # -- sizes, in pages --------------------------------------------------------------------------

    @property
    def core(self):
        """The KV cache core (for inspection and ``check_invariants``)."""
        self._settle()
        return self._core

    @property
    def page_size(self):
        return self._page_size

    @property
    def num_pages(self):
        return self._num_pages

    @property
    def cached_pages(self):
        return self._core.num_cached()

    @property
    def evictable_pages(self):
        """Cached pages no lock holds (eviction may drop them)."""
        self._settle()
        return self._core.num_evictable()

    @property
    def protected_pages(self):
        """Cached pages on a locked path."""
        self._settle()
        return self._core.num_cached() - self._core.num_evictable()

    @property
    def run_pages(self):
        """Cached pages whose KV indices run (first, first + 1, ...), kept as their first index
        alone; the others keep a row of the table."""
        cdef Py_ssize_t i, count = 0
        for i in range(self._num_pages):
            count += self._in_tree[i] and not self._rowed[i]
        return count

    @property
    def num_locks(self):
        return self._num_locks

    @property
    def generation(self):
        """Bumped by :meth:`reset`: nodes from before it are void."""
        return self._generation

    # -- the calls --------------------------------------------------------------------------------

    def match(self, tokens, length, namespace=0):
        """The node ending the longest cached prefix of the first ``length`` of ``tokens`` (whole
        pages), made the most recently used; the root when nothing matches."""
        cdef Py_ssize_t pages = _pages_arg(length, self._page_size, "match")
        cdef int64_t ns = _adapter_key(namespace)
        cdef cnp.ndarray key, slots
        cdef Failure f
        cdef int64_t handle
        cdef const int32_t *blocks
        cdef Py_ssize_t matched = 0, evictable, cached_tokens
        cdef KVCacheCore core = self._core
        if self._probe >= 0:
            self._settle()
        pages = min(pages, self._num_pages)  # no longer path can be cached
        if pages == 0:
            return self.root
        key = _key(tokens, pages * self._page_size)
        slots = _empty(pages, cnp.NPY_INT32)
        ok(&f)
        core.lock().enter_gil()
        evictable = core.num_evictable()
        handle = core.admit_locked(ns, <const int32_t *>cnp.PyArray_DATA(key), pages * self._page_size + 1,
                                   pages, 0, &f)
        if handle >= 0:
            blocks = core.table_locked(handle, &matched, &cached_tokens)
            memcpy(cnp.PyArray_DATA(slots), blocks, matched * sizeof(int32_t))
            if matched == 0:
                core.finish_locked(handle, False, &f)
            evictable -= core.num_evictable()
        core.lock().leave(NULL)
        if f.code:
            core.raise_failure(&f, "match", key)
        if matched == 0:
            return self.root
        node = _node(self._id, self._generation, ns, _shrink(key, matched * self._page_size + 1),
                     _shrink(slots, matched))
        self._probe, self._probe_node, self._probe_delta = handle, node, evictable
        return node

    def insert(self, tokens, length, values, namespace=0):
        """Store ``values`` (KV indices, one per token of the key's whole pages) under the first
        ``length`` of ``tokens``; returns the pages that were cached already (the caller's
        duplicates there stay the caller's) and the node ending the key. The tree owns the new
        pages' indices from here on."""
        cdef Py_ssize_t ps = self._page_size
        cdef Py_ssize_t pages = _pages_arg(length, ps, "insert")
        cdef int64_t ns = _adapter_key(namespace)
        cdef bint negative = False
        cdef cnp.ndarray key, slots
        cdef Failure f
        cdef int64_t handle
        cdef const int32_t *blocks
        cdef Py_ssize_t cached = 0, i, short, num_values = 0, held, cached_tokens
        cdef const int64_t *source = NULL
        cdef KVCacheCore core = self._core
        if self._probe >= 0:
            self._settle()
        if pages == 0:
            return 0, self.root
        if pages > self._num_pages:
            raise InvalidId(f"insert: a key of {pages} pages is longer than the tree's {self._num_pages} pages")
        _owner = _int64_values(values, &source, &num_values)  # holds what ``source`` points into
        if num_values < pages * ps:
            raise InvalidId(f"insert: {num_values} KV indices for a key of {pages} pages of {ps}")
        key = _key(tokens, pages * ps)
        short = pages - self._pool.free_count()
        if short > 0:
            # A full tree: room first (for the key's new pages only, its cached prefix kept), so no
            # slot is reused unseen; a refused insert must not have evicted anything, so every
            # index is checked before (else only the new pages' are).
            if _any_negative(source, pages * ps):
                _raise_negative(source, 0, pages * ps)
            self._evict(pages, None, key, ns)
        slots = _empty(pages, cnp.NPY_INT32)
        ok(&f)
        core.lock().enter_gil()
        handle = core.admit_locked(ns, <const int32_t *>cnp.PyArray_DATA(key), pages * ps + 1, pages, pages, &f)
        if handle >= 0:
            blocks = core.table_locked(handle, &held, &cached_tokens)
            memcpy(cnp.PyArray_DATA(slots), blocks, pages * sizeof(int32_t))
            if held:
                cached = cached_tokens // ps
            # The new pages' indices must be KV indices; else nothing is cached.
            negative = _any_negative(source + cached * ps, (pages - cached) * ps)
            if negative:
                core.finish_locked(handle, False, &f)
            else:
                for i in range(cached, pages):
                    self._store(blocks[i], source + i * ps)
                core.finish_locked(handle, True, &f)
        core.lock().leave(NULL)
        if negative:
            _raise_negative(source, cached * ps, pages * ps)
        if f.code:
            core.raise_failure(&f, "insert", key)
        if self._events:
            self._drain()
        return cached, _node(self._id, self._generation, ns, key, slots)

    cdef inline void _store(self, int32_t slot, const int64_t *row) noexcept nogil:
        """Keep ``row`` (``page_size`` KV indices) as slot ``slot``'s, a cached page from here on."""
        cdef Py_ssize_t ps = self._page_size
        self._first[slot] = row[0]
        if _row_is_run(row, ps):
            self._rowed[slot] = 0
        else:
            self._rowed[slot] = 1
            _copy_row(self._values_data + <Py_ssize_t>slot * ps, row, ps)
        self._in_tree[slot] = 1

    def values(self, PageNode node not None):
        """The KV indices of ``node``'s path (a copy, int64)."""
        if node._tree != self._id:
            self._foreign(node, "values")
        return self._gather(node.slots)

    cdef int _foreign(self, PageNode node, str call) except -1:
        raise SequenceStateError(f"{call}: {node!r} is not a node of this tree (another tree's, or made by hand)")

    cdef cnp.ndarray _gather(self, object slots):
        cdef Py_ssize_t n, ps = self._page_size
        cdef cnp.ndarray out
        cdef const int32_t *ids
        if not (
            cnp.PyArray_Check(slots)
            and cnp.PyArray_TYPE(<cnp.ndarray>slots) == cnp.NPY_INT32
            and cnp.PyArray_NDIM(<cnp.ndarray>slots) == 1
            and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>slots)
        ):
            raise InvalidId(f"values: tree slots must be a 1-D int32 array, got {type(slots).__name__}")
        n = cnp.PyArray_DIM(<cnp.ndarray>slots, 0)
        ids = <const int32_t *>cnp.PyArray_DATA(<cnp.ndarray>slots)
        if _any_slot_outside(ids, n, self._num_pages):  # (a node's arrays can be made writeable)
            raise InvalidId(f"values: a tree slot is outside [0, {self._num_pages})")
        out = _empty(n * ps, cnp.NPY_INT64)
        _gather_pages(<int64_t *>cnp.PyArray_DATA(out), self._values_data, self._first, self._rowed, ids, n, ps)
        return out

    def all_values(self):
        """The KV indices of every cached page, in no particular order."""
        cdef Py_ssize_t i, count = 0
        cdef cnp.ndarray slots = _empty(self._num_pages, cnp.NPY_INT32)
        cdef int32_t *dest = <int32_t *>cnp.PyArray_DATA(slots)
        for i in range(self._num_pages):
            if self._in_tree[i]:
                dest[count] = <int32_t>i
                count += 1
        return self._gather(_shrink(slots, count))

    def lock(self, PageNode node not None):
        """Keep ``node``'s path from eviction until :meth:`unlock`; returns the lock's handle and
        how many pages it took from the evictable ones. A node whose path was evicted since it
        was returned raises ``SequenceStateError``."""
        cdef int64_t handle
        cdef Py_ssize_t delta, held = 0, evictable, cached_tokens
        cdef Failure f
        cdef const int32_t *blocks
        cdef bint same = False
        cdef KVCacheCore core = self._core
        cdef cnp.ndarray key, slots
        if node._tree != self._id:
            self._foreign(node, "lock")
        if node.num_pages == 0:
            return -1, 0
        if node is self._probe_node:
            handle, delta = self._probe, self._probe_delta
            self._probe, self._probe_node = -1, None
        else:
            self._settle()
            if node.generation != self._generation:
                raise SequenceStateError(f"lock: the node is from before a reset (generation {node.generation}, "
                                         f"now {self._generation})")
            key, slots = node.tokens, node.slots
            ok(&f)
            core.lock().enter_gil()
            evictable = core.num_evictable()
            handle = core.admit_locked(node.namespace, <const int32_t *>cnp.PyArray_DATA(key),
                                       cnp.PyArray_DIM(key, 0), node.num_pages, 0, &f)
            if handle >= 0:
                blocks = core.table_locked(handle, &held, &cached_tokens)
                same = held == node.num_pages and not memcmp(
                    blocks, cnp.PyArray_DATA(slots), held * sizeof(int32_t))
                if not same:
                    core.finish_locked(handle, False, &f)
            delta = evictable - core.num_evictable()
            core.lock().leave(NULL)
            if f.code:
                core.raise_failure(&f, "lock", key)
            if not same:
                raise SequenceStateError(
                    f"lock: the node's path of {node.num_pages} pages was evicted ({held} of them are cached now)"
                )
        end = int((<cnp.ndarray>node.slots)[node.num_pages - 1])
        handles = self._locks.get(end)
        if handles is None:
            self._locks[end] = [handle]
        else:
            handles.append(handle)
        self._num_locks += 1
        return handle, delta

    def unlock(self, PageNode node not None, handle=None):
        """Release a lock on ``node``'s path: ``handle`` (from :meth:`lock`), or the latest one;
        returns how many pages became evictable."""
        cdef Py_ssize_t evictable
        cdef KVCacheCore core = self._core
        if node._tree != self._id:
            self._foreign(node, "unlock")
        if node.num_pages == 0:
            return 0
        if self._probe >= 0:
            self._settle()
        end = int((<cnp.ndarray>node.slots)[node.num_pages - 1])
        handles = self._locks.get(end)
        if node.generation != self._generation or not handles or (handle is not None and handle not in handles):
            raise SequenceStateError(
                f"unlock: {'lock ' + str(handle) if handle is not None else 'no lock'} is held on the node ending at "
                f"slot {end} (generation {node.generation}, now {self._generation}; {len(handles or ())} locks held)"
            )
        if handle is None:
            handle = handles.pop()
        else:
            handles.remove(handle)
        if not handles:
            del self._locks[end]
        self._num_locks -= 1
        evictable = core.num_evictable()
        core.finish_record(handle, False)
        return core.num_evictable() - evictable

    def evict(self, pages, BlockPool release=None):
        """Drop up to ``pages`` least recently used unlocked pages; returns how many were dropped.
        Their KV indices go to ``on_evict`` (one int64 array), or, given ``release`` (the engine
        allocator's pool of pages of ``page_size`` slots), their pages are freed to it directly
        (page = first index // page_size), with no array in between."""
        if self._probe >= 0:
            self._settle()
        return self._evict(_as_count(pages, "evict: pages", 0, INT32_MAX), release, None, 0)

    cdef Py_ssize_t _evict(self, Py_ssize_t n, BlockPool release, cnp.ndarray key, int64_t ns) except -1:
        """``evict(n)``; with ``key`` (an insert's, of ``n`` pages, into a full tree) only as many
        as the key's new pages need, the pages of its cached prefix kept (the core's reclaim)."""
        cdef Py_ssize_t freed = 0, i, ps = self._page_size, bad = -1, before
        cdef Failure f
        cdef KVCacheCore core = self._core
        cdef const int32_t *slots
        cdef cnp.ndarray out = None
        cdef int64_t *dest
        cdef int32_t *page_ids
        cdef int64_t first
        cdef Py_ssize_t needed = n
        if key is not None:
            n = needed - self._pool.free_count()  # the most a reclaim for ``needed`` pages frees
        # At most the evictable pages go: the output is made for them before the lock is taken
        # (nothing is allocated under it). The tree serves one scheduler, so they stay as many.
        n = min(n, core.num_evictable())
        if n <= 0:
            return 0
        out = _empty(n * ps, cnp.NPY_INT64) if release is None else _empty(n, cnp.NPY_INT32)
        ok(&f)
        core.lock().enter_gil()
        if key is None:
            freed = core.evict_locked(n, &f)  # (at most n: it trims min(n - freed, evictable) a round)
        else:
            before = self._pool.free_count()
            core.reclaim_locked(ns, <const int32_t *>cnp.PyArray_DATA(key), cnp.PyArray_DIM(key, 0), needed, &f)
            freed = self._pool.free_count() - before
        if freed:
            # The slots the core just freed are the top of its pool's free stack; each must have
            # been a page of the tree, or this is not what happened and nothing is handed on.
            slots = self._pool.last_freed(freed)
            for i in range(freed):
                if not self._in_tree[slots[i]]:
                    bad = slots[i]
                    break
            if bad < 0:
                if release is None:
                    dest = <int64_t *>cnp.PyArray_DATA(out)
                    _gather_pages(dest, self._values_data, self._first, self._rowed, slots, freed, ps)
                else:
                    page_ids = <int32_t *>cnp.PyArray_DATA(out)
                    for i in range(freed):
                        first = self._first[slots[i]]
                        # (indices are checked at insert; an out-of-range page is refused by the pool)
                        page_ids[i] = <int32_t>(first // ps) if 0 <= first and first // ps <= INT32_MAX else -1
                for i in range(freed):
                    self._in_tree[slots[i]] = 0
        core.lock().leave(NULL)
        if bad >= 0:
            raise InvariantViolation(f"evict: slot {bad}, freed by the core, was not a page of the tree")
        if freed:
            out = _shrink(out, freed * ps if release is None else freed)
            # Before any failure of the core is raised: the freed pages are not lost.
            if release is not None:
                release._release_ids(<const int32_t *>cnp.PyArray_DATA(out), freed, "evict")
            elif self._on_evict is not None:
                self._on_evict(out)
            if self._events:
                self._drain()
        if f.code:
            core.raise_failure(&f, "evict")
        return freed

    def reset(self):
        """Drop every page and lock (the engine clears its allocator itself, as SGLang's flush
        does, so the dropped indices are not handed to ``on_evict``); nodes taken before are void."""
        self._settle()
        core = self._core
        for handles in self._locks.values():
            for handle in handles:
                core.finish(handle, False)
        self._locks.clear()
        self._num_locks = 0
        self._drain()
        if not core.reset():
            raise InvariantViolation(f"reset: the core kept {core.num_cached_blocks} cached pages with no lock held")
        memset(self._in_tree, 0, self._num_pages)
        self._drain()
        self._generation += 1
        self.root = _node(self._id, self._generation, 0, np.zeros(1, dtype=np.int32), _empty(0, cnp.NPY_INT32))

    def take_events(self):
        """The raw logs (``RawEvents``) drained since the last call, oldest first."""
        self._settle()
        self._drain()
        taken, self._pending = self._pending, []
        return taken

    def check_invariants(self):
        """The core's recount, one live core record per lock held, one slot marked in the tree
        per cached page."""
        cdef Py_ssize_t i, marked = 0
        cdef const int64_t *row
        self._settle()
        self._core.check_invariants()
        if self._core.num_live() != self._num_locks:
            raise InvariantViolation(
                f"{self._core.num_live()} core records are live but {self._num_locks} locks are held"
            )
        if self._num_locks != sum(len(handles) for handles in self._locks.values()):
            raise InvariantViolation(f"{self._num_locks} locks are counted but the lock table holds others")
        for i in range(self._num_pages):
            marked += self._in_tree[i]
            row = self._values_data + i * self._page_size
            if self._in_tree[i] and self._rowed[i] and _row_is_run(row, self._page_size):
                raise InvariantViolation(f"slot {i} keeps a row of KV indices that run: it should keep its first")
        if marked != self._core.num_cached():
            raise InvariantViolation(f"{marked} slots are marked as pages but the core caches "
                                     f"{self._core.num_cached()}")

    cdef void _settle(self) except *:
        """Drop the last match's probe (unless a lock took it over)."""
        cdef int64_t handle
        if self._probe >= 0:
            handle, self._probe, self._probe_node = self._probe, -1, None
            self._core.finish_record(handle, False)

    cdef void _drain(self) except *:
        raw = self._core.take_events()
        if len(raw):
            self._pending.append(raw)


# -- an engine's page allocator over a BlockPool ----------------------------------------------------

def page_indices(BlockPool pool not None, need_size, page_size):
    """KV indices (int64) for ``need_size`` tokens on fresh pages of ``pool``: the pages' slots in
    order (page ``p`` holds ``p * page_size`` to ``p * page_size + page_size - 1``), the last page
    possibly in part; None, taking nothing, when too few pages are free."""
    cdef Py_ssize_t need = _as_count(need_size, "page_indices: need_size", 0, INT32_MAX)
    cdef Py_ssize_t ps = _as_count(page_size, "page_indices: page_size", 1, 1 << 16)
    cdef Py_ssize_t pages = (need + ps - 1) // ps, i
    cdef cnp.ndarray out
    cdef int64_t *dest
    cdef int32_t *ids
    if pages > pool.free_count():
        return None
    out = _empty(pages * ps, cnp.NPY_INT64)
    dest = <int64_t *>cnp.PyArray_DATA(out)
    # The page ids go into the tail of the output (int32 in the space of int64s), expanded from
    # the front: slot k's ids are read before any write reaches them.
    ids = <int32_t *>(dest + pages * ps) - pages
    if not pool._allocate_ids(ids, pages):
        return None
    for i in range(pages):
        _expand_run(dest + i * ps, <int64_t>ids[i] * ps, ps)  # (reads ids[i] before writing over it)
    return _shrink(out, need)


def release_indices(BlockPool pool not None, indices, page_size, bint first_of_page=False):
    """Free the pages that the KV indices ``indices`` (int64) lie on, each page once when its
    slots are listed together (every ``page_size``-th index only, with ``first_of_page``);
    returns how many became free. A page listed twice apart is refused by the pool
    (``DoubleFree``), changing nothing: :func:`pages_of` with ``unique`` is then the caller's."""
    cdef cnp.ndarray pages = pages_of(indices, page_size, first_of_page, False)
    return pool._release_ids(<const int32_t *>cnp.PyArray_DATA(pages), cnp.PyArray_DIM(pages, 0), "free")


def pages_of(indices, page_size, bint first_of_page=False, bint unique=False):
    """The pages (int32) that the KV indices ``indices`` lie on, in order; a run of one page's
    indices gives it once when pages hold more than one slot (``unique``: each page once, sorted).
    With ``first_of_page`` every ``page_size``-th index only is read (a segment that starts on a
    page boundary)."""
    cdef const int64_t *data = NULL
    cdef Py_ssize_t n = 0
    _owner = _int64_values(indices, &data, &n)  # holds what ``data`` points into
    cdef Py_ssize_t ps = _as_count(page_size, "pages_of: page_size", 1, 1 << 16)
    cdef Py_ssize_t step = ps if first_of_page else 1, i, count = 0
    cdef cnp.ndarray out = _empty((n + step - 1) // step, cnp.NPY_INT32)
    cdef int32_t *dest = <int32_t *>cnp.PyArray_DATA(out)
    cdef int64_t page
    cdef int64_t low = 0, high = 0, value
    i = 0
    while i < n:  # (a range with a variable step would run as Python)
        value = data[i]
        i += step
        if low <= value < high:
            continue  # the page of the index before (a division saved)
        if value < 0 or value // ps > INT32_MAX:
            raise InvalidId(f"KV index {value} (at index {i - step}) is outside [0, {INT32_MAX * ps}]")
        page = value // ps
        dest[count] = <int32_t>page
        count += 1
        if ps > 1:  # one slot a page: a repeat is that page freed twice, never merged
            low = page * ps
            high = low + ps
    out = _shrink(out, count)
    if unique and count > 1:
        return np.unique(out)
    return out
