# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The event log of a KV cache core (module lifecycle._evlog).

While events are on, the core writes an entry here where its cache changes: blocks stored (their
content hashes, the hash before them, their tokens and the trie root's key), blocks removed (their
hashes; with demotion their block ids and tokens too, for a tier below to copy them before the
blocks are reused), the cache cleared. ``KVCacheCore.take_events`` drains the log into a
``RawEvents``, handing its buffers over instead of copying them; they come back for the next drain
when the ``RawEvents`` goes. ``lifecycle.events`` turns one into typed events.
"""

cimport cython
cimport numpy as cnp
from cpython.object cimport PyTypeObject
from cpython.ref cimport Py_INCREF
from libc.stdlib cimport free
from libc.string cimport memcpy, memset

from lifecycle._int32 cimport grow_array
from lifecycle._sync cimport lc_mutex_trylock, lc_mutex_unlock

import numpy as np

cnp.import_array()


cdef inline void _clear_log(EvLog *log) noexcept nogil:
    memset(log, 0, sizeof(EvLog))


cdef inline void _free_log(EvLog *log) noexcept nogil:
    free(log.entries)
    free(log.hashes)
    free(log.tokens)
    free(log.ids)
    _clear_log(log)


cdef EventLog new_event_log(Py_ssize_t block_size, object mutex_owner, lc_mutex_t *mutex):
    """An empty log, off, for blocks of ``block_size`` tokens, drained under ``mutex``."""
    cdef EventLog log = EventLog.__new__(EventLog)
    log._block_size = block_size
    log._mutex = mutex
    log._mutex_owner = mutex_owner
    log.max_pending_tokens = 1 << 24
    return log


@cython.final
@cython.auto_pickle(False)
cdef class EventLog:
    """A KV cache core's event log (made by the core; nothing to call from Python)."""

    def __init__(self, *args, **kwargs):
        """Not for callers: a ``KVCacheCore`` makes its own."""
        raise TypeError("EventLog objects are made by KVCacheCore")

    def __dealloc__(self):
        _free_log(&self._log)
        _free_log(&self._spare)

    # -- (lock held) ----------------------------------------------------------------------------

    cdef void configure(self, bint events, bint demote, Py_ssize_t max_pending_tokens) noexcept nogil:
        """Turn logging on or off (``KVCacheCore.set_events``); with both off the pending entries go."""
        self.events = events
        self.demote = demote
        self.max_pending_tokens = max_pending_tokens
        if not (events or demote):
            self._log.num_entries = self._log.num_hashes = self._log.num_tokens = self._log.num_ids = 0

    cdef EvEntry *_entry(self, Py_ssize_t hashes, Py_ssize_t tokens, Py_ssize_t ids) noexcept nogil:
        """Room for one more entry with that many hashes, tokens and ids; NULL (the entry counted
        as dropped) past the pending limit or out of memory."""
        cdef EvLog *log = &self._log
        if log.num_tokens + tokens > self.max_pending_tokens:
            log.dropped += 1
            return NULL
        if (
            grow_array(<void **>&log.entries, &log.entries_capacity, log.num_entries + 1, sizeof(EvEntry))
            or grow_array(<void **>&log.hashes, &log.hashes_capacity, log.num_hashes + hashes, sizeof(uint64_t))
            or grow_array(<void **>&log.tokens, &log.tokens_capacity, log.num_tokens + tokens, sizeof(int32_t))
            or grow_array(<void **>&log.ids, &log.ids_capacity, log.num_ids + ids, sizeof(int32_t))
        ):
            log.dropped += 1
            return NULL
        log.num_entries += 1
        return &log.entries[log.num_entries - 1]

    cdef void stored(self, int64_t adapter, uint64_t parent, bint has_parent, const uint64_t *hashes,
                     const int32_t *tokens, Py_ssize_t count, int group=0) noexcept nogil:
        """``count`` blocks of KV cache group ``group`` were cached under root key ``adapter``,
        after the block hashed ``parent`` (the root's hash when not ``has_parent``): their hashes
        and tokens."""
        cdef Py_ssize_t bs = self._block_size
        cdef EvEntry *entry = self._entry(count, count * bs, 0)
        if entry == NULL:
            return
        entry.kind = 1
        entry.group = <int8_t>group
        entry.adapter = adapter
        entry.parent = parent
        entry.has_parent = has_parent
        entry.has_ids = 0
        entry.count = <int32_t>count
        entry.num_tokens = <int32_t>(count * bs)
        memcpy(self._log.hashes + self._log.num_hashes, hashes, count * sizeof(uint64_t))
        self._log.num_hashes += count
        memcpy(self._log.tokens + self._log.num_tokens, tokens, count * bs * sizeof(int32_t))
        self._log.num_tokens += count * bs

    cdef EvEntry *stored_room(self, Py_ssize_t count, int group, uint64_t **hashes, int32_t **tokens) noexcept nogil:
        """A stored entry of ``count`` blocks of group ``group`` whose hashes and tokens the caller
        writes at ``hashes[0]`` / ``tokens[0]`` and whose ``adapter``, ``parent`` and
        ``has_parent`` it sets (what ``stored`` logs, without copying: the core hashes the blocks
        straight into the log); NULL (the entry counted as dropped) as ``stored`` drops one."""
        cdef Py_ssize_t bs = self._block_size
        cdef EvEntry *entry = self._entry(count, count * bs, 0)
        if entry == NULL:
            return NULL
        entry.kind = 1
        entry.group = <int8_t>group
        entry.adapter = 0
        entry.parent = 0
        entry.has_parent = 0
        entry.has_ids = 0
        entry.count = <int32_t>count
        entry.num_tokens = <int32_t>(count * bs)
        hashes[0] = self._log.hashes + self._log.num_hashes
        self._log.num_hashes += count
        tokens[0] = self._log.tokens + self._log.num_tokens
        self._log.num_tokens += count * bs
        return entry

    cdef void unstore(self, EvEntry *entry) noexcept nogil:
        """Take back the last entry, just made by ``stored_room`` (its blocks could not be hashed)."""
        self._log.num_entries -= 1
        self._log.num_hashes -= entry.count
        self._log.num_tokens -= entry.num_tokens

    cdef void removed(self, const int32_t *ids, const int32_t *tokens, const uint64_t *hashes,
                      Py_ssize_t count, int group=0) noexcept nogil:
        """``count`` cached blocks of KV cache group ``group`` left the cache: their ``hashes``
        (with ``tokens``, as demotion keeps them, their ids and tokens too)."""
        cdef Py_ssize_t bs = self._block_size
        cdef bint with_tokens = tokens != NULL
        cdef EvEntry *entry = self._entry(count, count * bs if with_tokens else 0, count if with_tokens else 0)
        if entry == NULL:
            return
        entry.kind = 2
        entry.group = <int8_t>group
        entry.adapter = 0
        entry.parent = 0
        entry.has_parent = 0
        entry.has_ids = with_tokens
        entry.count = <int32_t>count
        entry.num_tokens = <int32_t>(count * bs if with_tokens else 0)
        memcpy(self._log.hashes + self._log.num_hashes, hashes, count * sizeof(uint64_t))
        self._log.num_hashes += count
        if with_tokens:
            memcpy(self._log.ids + self._log.num_ids, ids, count * sizeof(int32_t))
            self._log.num_ids += count
            memcpy(self._log.tokens + self._log.num_tokens, tokens, count * bs * sizeof(int32_t))
            self._log.num_tokens += count * bs

    cdef void cleared(self) noexcept nogil:
        """The whole cache was dropped (``reset``)."""
        cdef EvEntry *entry = self._entry(0, 0, 0)
        if entry != NULL:
            entry.kind = 3
            entry.count = 0
            entry.num_tokens = 0
            entry.has_ids = 0
            entry.has_parent = 0
            entry.group = 0
            entry.adapter = 0
            entry.parent = 0

    cdef void lost(self) noexcept nogil:
        """An entry could not be made (out of memory): counted as dropped."""
        self._log.dropped += 1

    cdef EvLog drain(self) noexcept nogil:
        """The pending entries, handed over (the log continues in the spare buffers); the caller
        wraps them once the lock is released. Nothing is handed over when nothing is pending."""
        cdef EvLog log = self._log
        if log.num_entries or log.dropped:
            self._log = self._spare
            _clear_log(&self._spare)
        return log

    # -- (GIL held, lock released) ----------------------------------------------------------------

    cdef RawEvents wrap(self, EvLog *log):
        """A drained log as ``RawEvents`` (one shared empty one when nothing was pending)."""
        cdef RawEvents taken
        if not (log.num_entries or log.dropped):
            return _NO_EVENTS
        taken = RawEvents.__new__(RawEvents)
        taken._log = log[0]
        taken._source = self
        taken._block_size = self._block_size
        return taken

    cdef void recycle(self, EvLog *log) noexcept:
        """Keep a drained log's buffers as the spare for the next drain (free them if one is
        kept already, or if the lock is busy: this runs with the GIL held, from a deallocator,
        and must not wait for a thread that may be waiting for the GIL)."""
        if lc_mutex_trylock(self._mutex):
            if self._spare.entries == NULL and self._spare.hashes == NULL and self._spare.tokens == NULL:
                self._spare = log[0]
                self._spare.num_entries = self._spare.num_hashes = self._spare.num_tokens = self._spare.num_ids = 0
                self._spare.dropped = 0
                _clear_log(log)
            lc_mutex_unlock(self._mutex)
        _free_log(log)


# -- the event log handed over (KVCacheCore.take_events) ---------------------------------------------

#: The layout of one entry of ``RawEvents.entries``: the C struct, field for field.
EVENT_DTYPE = np.dtype({
    "names": ["adapter", "parent", "count", "num_tokens", "kind", "has_parent", "has_ids", "group"],
    "formats": ["<i8", "<u8", "<i4", "<i4", "i1", "?", "?", "i1"],
    "offsets": [
        <Py_ssize_t>&(<EvEntry *>NULL).adapter, <Py_ssize_t>&(<EvEntry *>NULL).parent,
        <Py_ssize_t>&(<EvEntry *>NULL).count, <Py_ssize_t>&(<EvEntry *>NULL).num_tokens,
        <Py_ssize_t>&(<EvEntry *>NULL).kind, <Py_ssize_t>&(<EvEntry *>NULL).has_parent,
        <Py_ssize_t>&(<EvEntry *>NULL).has_ids, <Py_ssize_t>&(<EvEntry *>NULL).group,
    ],
    "itemsize": sizeof(EvEntry),
})
cdef object _EVENT_DESCR = EVENT_DTYPE

#: ``RawEvents.entries["kind"]`` values.
STORED = 1
REMOVED = 2
CLEARED = 3


cdef extern from "numpy/arrayobject.h":
    """
    #define lc_array_over(subtype, descr, nd, dims, strides, data, flags, obj) \\
        PyArray_NewFromDescr(subtype, (PyArray_Descr *)(descr), nd, dims, strides, data, flags, obj)
    """
    object _array_over "lc_array_over" (
        PyTypeObject *subtype, object descr, int nd, cnp.npy_intp *dims, cnp.npy_intp *strides, void *data,
        int flags, object obj
    )
    int NPY_ARRAY_CARRAY_RO


@cython.final
@cython.auto_pickle(False)
cdef class RawEvents:
    """What ``KVCacheCore.take_events`` drained: entries in the order things happened, each
    naming a run of blocks. Arrays (read-only views over the log's own memory, made when asked
    for):

    - ``entries`` (``EVENT_DTYPE``): ``kind`` (``STORED``, ``REMOVED``, ``CLEARED``), ``count``
      blocks, whose content hashes follow each other in ``hashes``; ``num_tokens``: the entry's
      tokens in ``tokens`` (a stored entry's always, a removed one's with demotion); ``has_ids``:
      a removed entry's block ids are in ``ids`` (demotion); ``adapter``: the trie root's key of a
      stored entry; ``parent``: the hash before its first block (``has_parent`` False when that is
      the root); ``group``: the KV cache group of the entry's blocks (0 without groups).
    - ``hashes`` (uint64), ``tokens`` (int32), ``ids`` (int32).

    ``dropped``: entries lost before this drain (over 16M pending tokens, or out of host memory).
    """
    def __init__(self, *args, **kwargs):
        """Not for callers: ``KVCacheCore.take_events`` makes them."""
        raise TypeError("RawEvents are made by KVCacheCore.take_events")

    def __dealloc__(self):
        if self._source is not None:
            self._source.recycle(&self._log)
        else:
            _free_log(&self._log)

    def __len__(self):
        return self._log.num_entries

    def __repr__(self):
        return (
            f"RawEvents(entries={self._log.num_entries}, hashes={self._log.num_hashes}, "
            f"tokens={self._log.num_tokens}, dropped={self._log.dropped})"
        )

    @property
    def block_size(self):
        """Tokens per block of the core that logged them."""
        return self._block_size

    @property
    def dropped(self):
        return int(self._log.dropped)

    cdef object _view(self, void *data, Py_ssize_t n, object descr):
        cdef cnp.npy_intp dim = n
        cdef cnp.ndarray array
        if n == 0:
            data = NULL
        Py_INCREF(descr)  # taken by the call
        array = _array_over(<PyTypeObject *>np.ndarray, descr, 1, &dim, NULL, data, NPY_ARRAY_CARRAY_RO, None)
        if data != NULL:
            cnp.set_array_base(array, self)
        return array

    @property
    def entries(self):
        return self._view(self._log.entries, self._log.num_entries, _EVENT_DESCR)

    @property
    def hashes(self):
        return self._view(self._log.hashes, self._log.num_hashes, _HASH_DESCR)

    @property
    def tokens(self):
        return self._view(self._log.tokens, self._log.num_tokens, _INT32_DESCR)

    @property
    def ids(self):
        return self._view(self._log.ids, self._log.num_ids, _INT32_DESCR)


cdef object _HASH_DESCR = np.dtype(np.uint64)
cdef object _INT32_DESCR = np.dtype(np.int32)
cdef RawEvents _NO_EVENTS = RawEvents.__new__(RawEvents)
