# The KV cache core, module lifecycle._kvcache: the one owner of every request's KV state (block
# table, tokens, pinned prefix, content hashes), of the prefix trie and of the SSM snapshot ids, over
# a BlockPool whose lock guards all of it.

cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t

from lifecycle._blockpool cimport BatchResult, BlockPool
from lifecycle._radix cimport Chunk, RadixTrie


cdef struct SeqRec:
    Chunk *chunk               # tokens and block table (NULL when the slot is unused)
    int64_t adapter            # adapter key: the trie root its prefix lives under
    int64_t seq_id
    int32_t adapter_slot       # the caller's adapter slot index this request holds, -1 = none
    int32_t num_tokens
    int32_t prompt_len
    int32_t num_blocks
    int32_t cached_tokens      # prompt tokens whose KV came from the cache
    int32_t lazy_tokens        # leading tokens not written to the chunk: those of its pinned path
    int32_t pin_node           # end of the cached path it holds pinned, -1 = none
    int32_t pin_blocks         # blocks from the root to the end of pin_node
    int32_t ssm_tokens         # tokens the SSM state has consumed, -1 = as many as num_tokens
    int32_t rolling            # its rolling snapshot id, -1 = none
    uint32_t rolling_generation
    uint32_t generation        # bumped at every reuse of the slot: stale handles are refused
    int32_t next_free
    uint8_t status
    uint8_t failed
    uint32_t step_stamp        # the last step() that listed it (one listing per step)


# Why a locked step failed (raised once the lock is released).
cdef struct Failure:
    int code
    int64_t value
    int64_t limit
    BatchResult batch


cdef struct Counters:
    int64_t sequences_opened
    int64_t sequences_closed
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
    int64_t snapshots_evicted
    uint64_t time_ticks


# The event log (kept only while events or demotion are on): entries in order, their hashes,
# tokens and (removed entries, with demotion) block ids in flat arrays.
cdef struct EvEntry:
    int64_t adapter            # stored: the trie root's key
    uint64_t parent            # stored: the hash of the block before the first (root hash if none)
    int32_t count              # blocks
    int32_t num_tokens         # tokens of the entry in the token array (0: none kept)
    int8_t kind                # 1 stored, 2 removed, 3 cleared
    int8_t has_parent          # stored: the first block follows a cached block (0: follows the root)
    int8_t has_ids             # removed: block ids kept


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


cdef class SequenceState


@cython.final
cdef class RawEvents:
    cdef EvLog _log
    cdef KVCacheCore _core
    cdef Py_ssize_t _block_size

    cdef object _view(self, void *data, Py_ssize_t n, object descr)


@cython.final
cdef class KVCacheCore:
    cdef BlockPool _pool
    cdef RadixTrie _trie
    cdef SeqRec *_recs
    cdef Py_ssize_t _recs_capacity
    cdef Py_ssize_t _recs_high_water
    cdef int32_t _recs_free
    cdef Py_ssize_t _num_live
    cdef int64_t _next_seq_id
    cdef uint32_t _generation_base  # generations of this core's record slots start after it
    cdef Py_ssize_t _block_size
    cdef Py_ssize_t _max_blocks_per_seq
    cdef Py_ssize_t _max_tokens_per_seq
    cdef bint _enabled
    cdef bint _snapshot_cut
    cdef bint _closed
    cdef int32_t *_scratch
    cdef Py_ssize_t _scratch_capacity
    # SSM snapshot ids: the node each one is kept at (-1 = free), its generation, an LRU list.
    cdef int32_t _num_snapshots
    cdef int32_t *_snap_node
    cdef uint32_t *_snap_generation
    cdef int32_t *_snap_prev
    cdef int32_t *_snap_next
    cdef int32_t _snap_head
    cdef int32_t _snap_tail
    cdef int32_t _snap_free
    cdef int32_t _snaps_used
    cdef Counters _counters
    cdef uint64_t _entered          # clock when the lock was last taken
    cdef bint _track                # content hashes of cached blocks kept (events or demotion on)
    cdef bint _events               # log stored / removed / cleared entries
    cdef bint _demote               # removed entries also carry block ids and tokens
    cdef bint _quiet                # (reset) evictions are not logged one by one
    cdef int32_t _null_block        # a block held for good, never handed out (-1: none)
    cdef int32_t *_token_scratch
    cdef Py_ssize_t _token_scratch_capacity
    cdef uint64_t *_hash_scratch
    cdef Py_ssize_t _hash_scratch_capacity
    cdef Py_ssize_t _max_pending_tokens
    cdef uint32_t _step_stamp
    cdef EvLog _log
    cdef EvLog _spare               # a drained log's buffers, for the next drain

    cdef bint _lock_with_gil(self, Py_ssize_t work)
    cdef void _lock(self) noexcept nogil
    cdef void _unlock(self) noexcept nogil
    cdef SeqRec *_rec(self, int64_t handle, Failure *f) noexcept nogil
    cdef SeqRec *_active(self, int64_t handle, Failure *f) noexcept nogil
    cdef int64_t _open_locked(self, int64_t adapter, int32_t adapter_slot, Py_ssize_t tokens, Failure *f) noexcept nogil
    cdef int _reserve_rec(self, SeqRec *rec, Py_ssize_t blocks, Py_ssize_t tokens) noexcept nogil
    cdef void _close_rec(self, SeqRec *rec) noexcept nogil
    cdef void _materialize(self, SeqRec *rec) noexcept nogil
    cdef void _snap_unlink(self, int32_t sid) noexcept nogil
    cdef void _snap_append(self, int32_t sid) noexcept nogil
    cdef void _snap_touch(self, int32_t sid) noexcept nogil
    cdef void _snap_release(self, int32_t sid) noexcept nogil
    cdef void _drain_tags(self) noexcept nogil
    cdef int32_t _snap_take(self) noexcept nogil
    cdef int _reserve_scratch(self, Py_ssize_t n) noexcept nogil
    cdef int _reserve_token_scratch(self, Py_ssize_t blocks, bint tokens) noexcept nogil
    cdef Py_ssize_t _evict_locked(self, Py_ssize_t n, Failure *f) noexcept nogil
    cdef int _grow_locked(self, SeqRec *rec, Py_ssize_t num_blocks, Failure *f) noexcept nogil
    cdef int32_t _match(self, int64_t adapter, const int32_t *tokens, Py_ssize_t limit, Py_ssize_t *matched,
                        Py_ssize_t *reuse, Failure *f) noexcept nogil
    cdef void _count_lookup(self, Py_ssize_t prompt_tokens, Py_ssize_t matched, Py_ssize_t reuse) noexcept nogil
    cdef Py_ssize_t _attach_locked(self, SeqRec *rec, const int32_t *tokens, Py_ssize_t n, Py_ssize_t max_prefix,
                                   Py_ssize_t grow_to, Failure *f) noexcept nogil
    cdef int32_t _cache_locked(self, SeqRec *rec, Py_ssize_t full, Py_ssize_t *taken, Failure *f) noexcept nogil
    cdef int32_t _node_at(self, SeqRec *rec, Py_ssize_t blocks, Failure *f) noexcept nogil
    cdef int32_t _tag_at(self, int32_t node, Py_ssize_t blocks) noexcept nogil
    cdef Py_ssize_t _finish_locked(self, SeqRec *rec, bint cache, Failure *f) noexcept nogil
    cdef int _raise(self, Failure *f, str call, object tokens=*) except -1
    cdef Py_ssize_t _attach_checked(self, int64_t handle, const int32_t *data, Py_ssize_t n, Py_ssize_t prefix,
                                    Py_ssize_t wanted, Failure *f) noexcept nogil
    cdef int64_t _admit_locked(self, int64_t key, const int32_t *data, Py_ssize_t n, Py_ssize_t prefix,
                               Py_ssize_t wanted, Failure *f) noexcept nogil
    cdef void _append_locked(self, int64_t handle, const int32_t *data, Py_ssize_t n, Failure *f) noexcept nogil
    cdef Py_ssize_t _grow_checked(self, int64_t handle, Py_ssize_t wanted, Failure *f) noexcept nogil
    cdef int32_t _cache_checked(self, int64_t handle, Py_ssize_t full, Py_ssize_t *taken, Failure *f) noexcept nogil
    cdef int32_t _snapshot_locked(
        self, int64_t handle, Py_ssize_t full, bint rolling, bint *fresh, Failure *f
    ) noexcept nogil
    cdef Py_ssize_t _reclaim_locked(self, int64_t key, const int32_t *data, Py_ssize_t n, Py_ssize_t needed,
                                    Failure *f) noexcept nogil
    cdef SeqRec *_read(self, int64_t handle, str call) except NULL
    cdef int32_t _field(self, int64_t handle, int which) except? -2
    cdef int _set(self, int64_t handle, int which, int64_t value, str call) except -1
    cdef str _recount(self)
    cdef str _recount_hashes(self)
    cdef void _log_stored(self, int32_t v, Py_ssize_t count) noexcept nogil
    cdef void _log_removed(
        self, const int32_t *ids, const int32_t *tokens, const uint64_t *hashes, Py_ssize_t count
    ) noexcept nogil
    cdef EvEntry *_log_entry(self, Py_ssize_t hashes, Py_ssize_t tokens, Py_ssize_t ids) noexcept nogil
    cdef void _hash_all_cached(self) except *
    cdef void _recycle(self, EvLog *log) noexcept
    cdef int _append(self, int64_t h, object tokens) except -1
    cdef Py_ssize_t _step_check(
        self, const int64_t *hs, Py_ssize_t n, const int32_t *tok, Py_ssize_t num_tok, const int32_t *cnt,
        const int32_t *row_of, Py_ssize_t nrows, Py_ssize_t ncols, Failure *f
    ) noexcept nogil
    cdef Py_ssize_t _step_locked(
        self, const int64_t *hs, Py_ssize_t n, const int32_t *tok, const int32_t *cnt, int32_t *tab,
        const int32_t *row_of, Py_ssize_t ncols, bint cache, int32_t *refused, Failure *f
    ) noexcept nogil
    cdef int32_t _finish(self, int64_t h, bint cache) except? -2
    cdef SequenceState _face(self, object seq)
    cdef int64_t _open_handle(self, object seq, str call) except -1
    cdef Py_ssize_t _blocks_for_tokens(self, int64_t h, object num_tokens, str call) except -1
    cdef int64_t _field_seq_id(self, int64_t h)
    cdef int64_t _open(self, int64_t key, int32_t slot, Py_ssize_t tokens, int64_t *seq_id) except -1


@cython.final
cdef class SequenceState:
    cdef readonly KVCacheCore _core
    cdef readonly int64_t _handle
    cdef readonly int64_t seq_id
    cdef public object _guard          # the guard of its SSM slot (empty once detached)
    cdef public bint _open             # the model has not released it yet
    cdef public Py_ssize_t budget_tokens
    cdef object _addrs_by_slot
    cdef object _draft_tokens
    cdef object _drop_queue
    cdef object __weakref__
