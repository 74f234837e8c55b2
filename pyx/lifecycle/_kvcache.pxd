# The KV cache core, module lifecycle._kvcache: the request path over a BlockPool, its prefix trie,
# the per-request records, the SSM snapshot ids and the event log (each a part with its own .pxd),
# all guarded by the pool's lock.
#
# Other Cython modules (the SGLang page tree, the model's calls) use the core only through what is
# declared here without a leading underscore: its lock, the locked calls by handle, the counts read
# inline. The core's calls off the request path (lifecycle._coreviews) also read its ``readonly``
# fields and call the request path's own steps; what they change in the core they change through
# the inline setters and counts below. No other module writes a field of the core.

cimport cython
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from lifecycle._blockpool cimport BlockPool
from lifecycle._evlog cimport EventLog
from lifecycle._groups cimport KVGroups
from lifecycle._radix cimport RadixTrie
from lifecycle._records cimport Failure, Records, SeqRec
from lifecycle._retention cimport Retention
from lifecycle._saltmap cimport SaltMap
from lifecycle._slots cimport SlotPool
from lifecycle._snapids cimport SnapshotIds
from lifecycle._sync cimport NOGIL_MIN_WORK, CoreLock


cdef enum:
    LONG_CALL = NOGIL_MIN_WORK   # ``CoreLock.enter`` work that always releases the GIL


cdef struct Counters:
    int64_t blocks_allocated
    int64_t blocks_freed
    int64_t blocks_cached
    int64_t blocks_evicted
    int64_t prefix_lookups
    int64_t prefix_hits
    int64_t prefix_misses
    int64_t prefix_hit_tokens
    int64_t prefix_lookup_tokens
    int64_t snapshots_saved
    int64_t snapshot_hits
    int64_t snapshot_hits_cut_short


@cython.final
cdef class KVCacheCore:
    cdef readonly BlockPool _pool
    cdef readonly RadixTrie _trie
    cdef readonly Records _records
    cdef readonly SnapshotIds _snaps
    cdef readonly EventLog _evlog
    cdef readonly SaltMap salts     # the cache salts of the records' keys (GIL held)
    cdef readonly CoreLock _lock
    cdef readonly Py_ssize_t _block_size
    cdef readonly Py_ssize_t _max_blocks_per_seq
    cdef Py_ssize_t _max_tokens_per_seq
    cdef readonly bint _enabled
    cdef bint _snapshot_cut
    cdef int32_t *_scratch
    cdef Py_ssize_t _scratch_capacity
    cdef readonly Counters _counters
    cdef readonly bint _track                # content hashes of cached blocks kept (events or demotion on)
    cdef bint _quiet                # (reset) evictions are not logged one by one
    cdef readonly int32_t _null_block        # a block held for good, never handed out (-1: none)
    cdef int32_t *_token_scratch
    cdef Py_ssize_t _token_scratch_capacity
    cdef uint64_t *_hash_scratch
    cdef Py_ssize_t _hash_scratch_capacity
    cdef readonly Retention _retention       # retention hints and pinned prefixes
    cdef readonly KVGroups _groups           # groups past group 0 (None: one group, the pool's)
    cdef readonly bint _grouped              # _groups is not None

    # -- the surface: the lock (``lock().enter_gil()`` ... ``lock().leave(NULL)``), then locked calls --
    cdef inline CoreLock lock(self):
        return self._lock

    cdef inline Py_ssize_t num_cached(self) noexcept nogil:
        """(Lock held) blocks the cache holds a reference on."""
        return self._trie._num_blocks

    cdef inline Py_ssize_t num_evictable(self) noexcept nogil:
        """(Lock held) cached blocks eviction may drop."""
        return self._trie._lru_blocks

    cdef inline Py_ssize_t num_live(self) noexcept nogil:
        return self._records.num_live

    # -- (lock held) the scratch and the counts and settings the calls off the request path change --
    cdef inline int32_t *scratch(self) noexcept nogil:
        """Block ids of the last eviction (``_reserve_scratch`` makes room)."""
        return self._scratch

    cdef inline uint64_t *hash_scratch(self) noexcept nogil:
        """Their hashes (``_reserve_token_scratch`` makes room)."""
        return self._hash_scratch

    cdef inline void count_allocated(self, Py_ssize_t blocks) noexcept nogil:
        self._counters.blocks_allocated += blocks

    cdef inline void count_evicted(self, Py_ssize_t blocks) noexcept nogil:
        self._counters.blocks_evicted += blocks

    cdef inline void count_freed(self, Py_ssize_t blocks) noexcept nogil:
        self._counters.blocks_freed += blocks

    cdef inline void count_snapshot_saved(self) noexcept nogil:
        self._counters.snapshots_saved += 1

    cdef inline void set_track(self, bint track) noexcept nogil:
        self._track = track

    cdef inline void set_quiet(self, bint quiet) noexcept nogil:
        self._quiet = quiet

    cdef int64_t admit_locked(self, int64_t key, const int32_t *data, Py_ssize_t n, Py_ssize_t prefix,
                              Py_ssize_t wanted, Failure *f) noexcept nogil
    cdef const int32_t *table_locked(self, int64_t handle, Py_ssize_t *num_blocks,
                                     Py_ssize_t *cached_tokens) noexcept nogil
    cdef Py_ssize_t finish_locked(self, int64_t handle, bint cache, Failure *f) noexcept nogil
    cdef Py_ssize_t evict_locked(self, Py_ssize_t n, Failure *f) noexcept nogil
    cdef Py_ssize_t reclaim_locked(self, int64_t key, const int32_t *data, Py_ssize_t n, Py_ssize_t needed,
                                   Failure *f) noexcept nogil
    # (GIL held, lock released) the calls a model makes per request, callable from C (lifecycle._modelcalls)
    cpdef alloc(self, SlotPool slots, budget_tokens, addrs_by_slot, drop_queue)
    cpdef attach_seq(self, seq, prompt, grow_to=*)
    cpdef release(self, seq, bint cache, on_adapter=*)
    cdef int raise_failure(self, Failure *f, str call, object tokens=*) except -1
    cdef int32_t finish_record(self, int64_t handle, bint cache) except? -2

    # -- the request path's own steps (lock held unless they take a Python object) --
    cdef int _reserve_scratch(self, Py_ssize_t n) noexcept nogil
    cdef int _reserve_token_scratch(self, Py_ssize_t blocks, bint tokens) noexcept nogil
    cdef void _drain_tags(self) noexcept nogil
    cdef void _log_stored(self, int32_t v, Py_ssize_t count) noexcept nogil
    cdef int _grow_locked(self, SeqRec *rec, Py_ssize_t num_blocks, Failure *f) noexcept nogil
    cdef int32_t _match(self, int64_t adapter, const int32_t *tokens, Py_ssize_t limit, Py_ssize_t *matched,
                        Py_ssize_t *reuse, Failure *f) noexcept nogil
    cdef void _count_lookup(self, Py_ssize_t prompt_tokens, Py_ssize_t matched, Py_ssize_t reuse) noexcept nogil
    cdef Py_ssize_t _attach_locked(self, SeqRec *rec, const int32_t *tokens, Py_ssize_t n, Py_ssize_t max_prefix,
                                   Py_ssize_t grow_to, Failure *f) noexcept nogil
    cdef int32_t _cache_locked(self, SeqRec *rec, Py_ssize_t full, Py_ssize_t *taken, Failure *f) noexcept nogil
    cdef int32_t _node_at(self, SeqRec *rec, Py_ssize_t blocks, Failure *f) noexcept nogil
    cdef Py_ssize_t _finish_locked(self, SeqRec *rec, bint cache, Failure *f) noexcept nogil
    cdef Py_ssize_t _attach_call(self, int64_t h, object tokens, Py_ssize_t wanted, Py_ssize_t prefix) except? -1
    cdef Py_ssize_t _attach_checked(self, int64_t handle, const int32_t *data, Py_ssize_t n, Py_ssize_t prefix,
                                    Py_ssize_t wanted, Failure *f) noexcept nogil
    cdef Py_ssize_t _grow_checked(self, int64_t handle, Py_ssize_t wanted, Failure *f) noexcept nogil
    cdef int32_t _cache_checked(self, int64_t handle, Py_ssize_t full, Py_ssize_t *taken, Failure *f) noexcept nogil
    cdef Py_ssize_t _step_locked(
        self, const int64_t *hs, Py_ssize_t n, const int32_t *tok, const int32_t *cnt, int32_t *tab,
        const int32_t *row_of, Py_ssize_t ncols, bint cache, int32_t *refused, int32_t **group_tabs, Failure *f
    ) noexcept nogil
    cdef int _refuse_grouped(self, str call) except -1
    cdef Py_ssize_t _ngroups(self) noexcept
