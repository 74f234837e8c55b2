# The event log of a KV cache core, module lifecycle._evlog: an observer the core writes to where
# the cache changes (blocks stored, blocks removed, the cache cleared), and ``RawEvents``, a log
# drained from it. Written under the core's lock; the core owns the one ``EventLog``.

cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t, uint64_t

from lifecycle._sync cimport lc_mutex_t


# Entries in order, their hashes, tokens and (removed entries, with demotion) block ids in flat arrays.
cdef struct EvEntry:
    int64_t adapter            # stored: the trie root's key
    uint64_t parent            # stored: the hash of the block before the first (root hash if none)
    int32_t count              # blocks
    int32_t num_tokens         # tokens of the entry in the token array (0: none kept)
    int8_t kind                # 1 stored, 2 removed, 3 cleared
    int8_t has_parent          # stored: the first block follows a cached block (0: follows the root)
    int8_t has_ids             # removed: block ids kept
    int8_t group               # the KV cache group the blocks are of (0: the core's pool)


cdef struct EvLog:
    EvEntry *entries
    Py_ssize_t num_entries
    Py_ssize_t entries_capacity
    uint64_t *hashes
    Py_ssize_t num_hashes
    Py_ssize_t hashes_capacity
    int32_t *tokens
    Py_ssize_t num_tokens
    Py_ssize_t tokens_capacity
    int32_t *ids
    Py_ssize_t num_ids
    Py_ssize_t ids_capacity
    int64_t dropped            # entries lost (the pending limit, or out of memory)


@cython.final
cdef class EventLog:
    cdef EvLog _log
    cdef EvLog _spare               # a drained log's buffers, for the next drain
    cdef Py_ssize_t _block_size
    cdef lc_mutex_t *_mutex         # the core's (a drained log's buffers come back under it)
    cdef object _mutex_owner
    cdef readonly bint events       # log stored / removed / cleared entries
    cdef readonly bint demote       # removed entries also carry block ids and tokens
    cdef readonly Py_ssize_t max_pending_tokens
    cdef readonly int32_t demote_min  # evicted blocks below this retention priority are not demoted

    cdef inline void set_demote_min(self, int32_t priority) noexcept nogil:
        self.demote_min = priority

    cdef inline Py_ssize_t pending(self) noexcept nogil:
        return self._log.num_entries

    # (lock held)
    cdef EvEntry *_entry(self, Py_ssize_t hashes, Py_ssize_t tokens, Py_ssize_t ids) noexcept nogil
    cdef void configure(self, bint events, bint demote, Py_ssize_t max_pending_tokens) noexcept nogil
    cdef void stored(self, int64_t adapter, uint64_t parent, bint has_parent, const uint64_t *hashes,
                     const int32_t *tokens, Py_ssize_t count, int group=*) noexcept nogil
    cdef void removed(self, const int32_t *ids, const int32_t *tokens, const uint64_t *hashes,
                      Py_ssize_t count, int group=*) noexcept nogil
    cdef EvEntry *stored_room(self, Py_ssize_t count, int group, uint64_t **hashes, int32_t **tokens) noexcept nogil
    cdef void unstore(self, EvEntry *entry) noexcept nogil
    cdef void cleared(self) noexcept nogil
    cdef void lost(self) noexcept nogil
    cdef EvLog drain(self) noexcept nogil
    # (GIL held, lock released)
    cdef RawEvents wrap(self, EvLog *log)
    cdef void recycle(self, EvLog *log) noexcept


cdef EventLog new_event_log(Py_ssize_t block_size, object mutex_owner, lc_mutex_t *mutex)


@cython.final
cdef class RawEvents:
    cdef EvLog _log
    cdef EventLog _source
    cdef Py_ssize_t _block_size

    cdef object _view(self, void *data, Py_ssize_t n, object descr)
