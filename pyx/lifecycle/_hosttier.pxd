# The host tier's bookkeeping, module lifecycle._hosttier: ``capacity`` slots, each free or holding
# one block (its key, its parent's key, its tokens), found by the key's high word through an
# open-addressing table, on an LRU list (head least recently used), the free ones on a stack. Every
# call takes a batch of blocks and runs its loops without the GIL under the index's own mutex; the
# copies it plans are rows the caller hands to the device layer in one batched copy.

cimport cython
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

from lifecycle._sync cimport lc_mutex_t


cdef struct Entry:
    uint64_t key                    # high word of the key
    int32_t slot                    # -1: empty


# Counters, in the order ``HostIndex.counts`` names them.
cdef enum:
    C_LOOKUPS = 0
    C_HITS
    C_COLLISIONS
    C_STORED
    C_LOADED
    C_DUPLICATES
    C_EVICTED
    C_REPLACED
    C_CLEARED
    C_PROMOTED
    C_BYTES_DEMOTED
    C_BYTES_PROMOTED
    NUM_COUNTS


@cython.final
cdef class HostIndex:
    cdef lc_mutex_t _mutex
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t block_size
    cdef readonly Py_ssize_t num_device_blocks
    cdef readonly Py_ssize_t slot_bytes
    cdef readonly Py_ssize_t num_blocks     # slots held now
    cdef object _key_array                  # (capacity, 2) uint64: each slot's key (high, low)
    cdef object _parent_array               # and its parent's
    cdef object _token_array                # (capacity, block_size) int32
    cdef uint64_t *_keys
    cdef uint64_t *_parents
    cdef int32_t *_tokens
    cdef Entry *_table                      # key high word -> slot, linear probing
    cdef uint64_t _mask
    cdef int _shift
    cdef int32_t *_prev                     # the LRU list over held slots
    cdef int32_t *_next
    cdef int32_t _head
    cdef int32_t _tail
    cdef int32_t *_free                     # free slots, a stack
    cdef Py_ssize_t _num_free
    cdef uint32_t *_block_marks             # per device block: the call that last named it
    cdef uint32_t *_slot_marks              # per slot: the call that last stored it
    cdef uint32_t _epoch
    cdef Entry *_seen                       # scratch: a batch's new keys
    cdef Py_ssize_t _seen_size              # entries allocated
    cdef Py_ssize_t _seen_used              # entries the running call uses (a power of two)
    cdef uint64_t *_sort                    # scratch: a demotion's slot assignment (3 arrays)
    cdef Py_ssize_t _sort_size              # words allocated
    # What each device block holds, as its last holder noted it (``bind_blocks``: the model's arrays)
    cdef object _bound                      # the arrays, kept alive
    cdef uint64_t *_bkeys                   # (num_device_blocks, 2): its key
    cdef uint64_t *_bparents                # (num_device_blocks, 2): its parent's key
    cdef uint64_t *_bhashes                 # its content hash
    cdef uint8_t *_bvalid                   # noted since it was cached
    cdef uint8_t *_breused                  # hit on the device since it was cached
    # scratch: a drained log's demoted blocks, gathered
    cdef uint64_t *_gkeys
    cdef uint64_t *_gparents
    cdef int32_t *_gtokens
    cdef int64_t *_gids
    cdef Py_ssize_t _gsize
    cdef int64_t *_layers                   # per layer: device base, block bytes, offset in a slot
    cdef Py_ssize_t _num_layers
    cdef int64_t _host_base
    cdef int64_t _counts[NUM_COUNTS]

    cdef void _reset(self) noexcept nogil
    cdef Py_ssize_t _find(self, uint64_t key) noexcept nogil
    cdef void _table_put(self, uint64_t key, int32_t slot) noexcept nogil
    cdef void _table_remove(self, uint64_t key) noexcept nogil
    cdef void _unlink(self, int32_t slot) noexcept nogil
    cdef uint64_t *_read_batch(self, object hashes, object block_ids, object tokens, object parents,
                               Py_ssize_t count, const int32_t **token_ids, size_t extra) noexcept
    cdef void _append(self, int32_t slot) noexcept nogil
    cdef int32_t _evict_one(self) noexcept nogil
    cdef void _write_entry(self, int32_t slot, const uint64_t *key, const uint64_t *parent,
                           const int32_t *tokens) noexcept nogil
    cdef bint _is_block(self, int32_t slot, const uint64_t *key, uint64_t parent_high, uint64_t parent_low,
                        const int32_t *tokens) noexcept nogil
    cdef uint32_t _next_epoch(self) noexcept nogil
    cdef bint _reserve_seen(self, Py_ssize_t count) noexcept nogil
    cdef bint _reserve_sort(self, Py_ssize_t count) noexcept nogil
    cdef bint _reserve_gather(self, Py_ssize_t count) noexcept nogil
    cdef Py_ssize_t _first_bad_id(self, const int64_t *ids, Py_ssize_t count) noexcept nogil
    cdef Py_ssize_t _first_repeated_id(self, const int64_t *ids, Py_ssize_t count) noexcept nogil
    cdef Py_ssize_t _demote(self, const uint64_t *keys, const uint64_t *parents, const int32_t *tokens,
                            const int64_t *ids, Py_ssize_t count, int64_t *rows, Py_ssize_t *num_rows,
                            int64_t *stored, uint64_t *evicted, Py_ssize_t *num_evicted) noexcept nogil
    cdef Py_ssize_t _held_run(self, const uint64_t *keys, Py_ssize_t count, int32_t *slots) noexcept nogil
    cdef Py_ssize_t _verified_run(self, const int32_t *slots, Py_ssize_t count, const uint64_t *keys,
                                  const uint64_t *parents, uint64_t first_high, uint64_t first_low,
                                  const int32_t *tokens) noexcept nogil
    cdef Py_ssize_t _rows(self, const int32_t *slots, const int64_t *ids, Py_ssize_t count, bint to_host,
                          int64_t *rows) noexcept nogil
    cdef Py_ssize_t _load(self, const uint64_t *keys, const uint64_t *parents, const int32_t *tokens,
                          Py_ssize_t count, int64_t *slots, int64_t *stored, Py_ssize_t *num_stored,
                          uint64_t *removed, Py_ssize_t *num_removed) noexcept nogil
    cdef void _check_batch(self, str call, object keys, object parents, object tokens, Py_ssize_t count) except *
    cdef object _problem(self)
