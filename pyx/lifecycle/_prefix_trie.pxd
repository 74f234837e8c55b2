# The refcounted prefix trie, module lifecycle._prefix_trie: one node per full KV block, children
# found through one hash table keyed by (parent node, the block's tokens) and confirmed by an exact
# token compare. Every field is guarded by ``_lock``. Named with its dotted module name so that
# Cython finds it for a source that lives outside the package directory (see the block pool's .pxd).

cimport cython
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from cpython.pythread cimport PyThread_type_lock


# 52 bytes, 56 with alignment; with its hash bucket (4 bytes) a cached block costs 60 bytes of
# metadata plus its tokens.
cdef struct TrieNode:
    uint64_t key_hash      # chained hash of (parent's key_hash, tokens), masked; a root stores its adapter key
    int32_t parent         # parent node; -1 for an adapter root, -2 for an unused slot
    int32_t hash_next      # next node in the same hash bucket (next unused slot when unused)
    int32_t hash_prev      # previous node in the same hash bucket, -1 at the head
    int32_t block_id       # the KV block the node holds; -1 for a root
    int32_t pin_count      # pins placed on this node itself
    int32_t lock_count     # pin_count + number of children with lock_count > 0 (0 = evictable)
    int32_t num_children
    int32_t lru_prev       # neighbours in the LRU list while lock_count == 0
    int32_t lru_next
    int32_t tag            # caller's tag (SSM snapshot id), -1 = none
    int32_t depth          # blocks from the root; 0 for a root


cdef enum Failure:
    FAIL_NONE = 0
    FAIL_NO_MEMORY = 1
    FAIL_BAD_NODE = 2        # not a live cached node (out of range, evicted, or a root)
    FAIL_UNPIN_ZERO = 3      # unpin of a node whose pin count is 0
    FAIL_PIN_SATURATED = 4   # pin count at INT32_MAX
    FAIL_NOT_A_LEAF = 5      # LRU head has children: the ordering invariant broke


cdef struct Outcome:
    Failure failure
    Py_ssize_t index         # position in the caller's batch of the refused entry
    int64_t value            # the refused node id


@cython.final
cdef class PrefixTrie:
    cdef TrieNode *_nodes
    cdef int32_t *_tokens          # token arena: block_size tokens per node slot
    cdef int32_t *_buckets         # hash bucket heads, _bucket_mask + 1 of them
    cdef int32_t *_evicted_tags    # tags of nodes evicted since the last evicted_tags()
    cdef uint32_t *_hash_keys      # block_size + 1 keys of the block hash
    cdef Py_ssize_t _block_size
    cdef Py_ssize_t _capacity      # node slots allocated (a power of two)
    cdef Py_ssize_t _high_water    # slots ever used; slots beyond it are untouched
    cdef Py_ssize_t _bucket_mask
    cdef Py_ssize_t _num_evicted_tags
    cdef Py_ssize_t _evicted_tags_capacity
    cdef int32_t _free_head        # most recently freed unused slot below _high_water, -1 if none
    cdef Py_ssize_t _num_free_slots
    cdef Py_ssize_t _num_cached    # live non-root nodes
    cdef Py_ssize_t _num_roots
    cdef int32_t _lru_head         # least recently used evictable node
    cdef int32_t _lru_tail         # most recently used evictable node
    cdef Py_ssize_t _lru_count
    cdef uint64_t _hash_mask
    cdef int _hash_bits
    cdef bint _initialized
    cdef PyThread_type_lock _lock

    cdef int _ensure_slots(self, Py_ssize_t extra) noexcept nogil
    cdef str _find_problem(self)
    cdef object _live_block_ids(self, bint take_tags)
    cdef str _recount(self, Py_ssize_t *children, Py_ssize_t *protected_children, Py_ssize_t *lru_pos, unsigned char *on_free_stack)

    # C-level operations for other Cython modules (the prefix cache's fused calls). The caller
    # holds ``_lock`` (GIL released or not); each has the semantics of its Python counterpart.
    cdef Py_ssize_t _match_locked(
        self, int64_t key, const int32_t *tokens, Py_ssize_t num_blocks, int32_t *path,
        int32_t *blocks, bint pin, Outcome *outcome
    ) noexcept nogil
    cdef int _insert_locked(
        self, int64_t key, const int32_t *tokens, const int32_t *blocks, Py_ssize_t n,
        const int32_t *known, Py_ssize_t num_known, int32_t *path, Py_ssize_t *matched,
        Py_ssize_t *bad_known
    ) noexcept nogil
    cdef Py_ssize_t _evict_locked(self, Py_ssize_t n, int32_t *dest, Outcome *outcome) noexcept nogil
    cdef Outcome _pin_locked(self, const int32_t *ids, Py_ssize_t n) noexcept nogil
    cdef Outcome _unpin_locked(self, const int32_t *ids, Py_ssize_t n) noexcept nogil
    # Raise what the Python call ``call`` raises for a failed outcome (lock released).
    cdef int _raise_failed(self, Outcome outcome, str call) except -1
