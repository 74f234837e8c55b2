# The path-compressed prefix trie, module lifecycle._radix. Other Cython modules (the KV cache core)
# cimport it as ``from lifecycle._radix cimport RadixTrie``; everything here is guarded by the lock
# the trie is given (the owner's), and every cdef method is called with that lock held.

cimport cython
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t

from lifecycle._sync cimport lc_mutex_t


# Token ids, block ids and (optionally) content hashes of one run of whole blocks, shared by the
# sequence record that filled it and by every trie node that holds part of it. Its arrays never
# move while anyone but the filling record holds it (refs > 1), so a node's view stays valid.
cdef struct Chunk:
    int32_t refs
    int32_t block_capacity
    int32_t token_capacity
    int32_t num_hashed         # leading blocks whose content hash is in ``hashes``
    int32_t size_class         # its capacities are those of this size class, -1: other sizes
    int32_t *tokens
    int32_t *blocks            # one column of block_capacity ids per KV cache group (group 0 first)
    uint64_t *hashes           # NULL until a content hash is asked for
    Chunk *next_free           # in a ChunkCache's free list


cdef enum:
    CHUNK_CLASSES = 80         # 4 size classes per doubling, from 64 tokens up to ~2**24


# Released chunks kept for reuse, by size class: a request's chunk is as large as its prompt, and
# memory returned to the system would come back as fresh pages to be zeroed on the next request.
cdef struct ChunkCache:
    Chunk *free[80]
    int32_t count[80]
    Py_ssize_t bytes
    Py_ssize_t block_size
    Py_ssize_t num_groups      # block id columns per chunk (KV cache groups), 1 without groups
    Py_ssize_t fail_in         # (tests) the fail_in-th growth of a chunk from now fails (0: none)


# One node: a run of ``length`` whole blocks starting at block ``start`` of its chunk. A root
# (one per adapter key) has length 0 and no chunk. 64 bytes.
cdef struct RNode:
    Chunk *chunk
    uint64_t key               # child lookup key: (parent, first block); a root's: its adapter key
    int32_t start
    int32_t length
    int32_t depth              # blocks before the run (0 for a root's children)
    int32_t parent             # -1 for a root, -2 for an unused slot
    int32_t num_children
    int32_t pin_count          # pins whose end is this node's end
    int32_t lock_count         # pin_count + children with lock_count > 0 (0: on the LRU list)
    int32_t lru_prev
    int32_t lru_next
    int32_t hash_prev
    int32_t hash_next          # next node of the bucket (next unused slot when unused)
    int32_t tag                # a snapshot id kept at the run's end, -1 = none
    int32_t priority           # its eviction list: a retention priority 0..100
    uint8_t reuses             # (branch-lru) reuses while cached, up to BRANCH_REUSES - 1
    uint8_t band               # (branch-lru) the longest request path through it, as a half-octave band
    double expiry              # when that priority decays to the default (trie clock); INFINITY: never


# Where a walk down the trie ended.
cdef struct WalkEnd:
    int32_t node               # last node entered (its root if none)
    int32_t partial            # blocks of ``node`` matched when it was matched only in part, else 0
    int32_t tagged_node        # deepest fully matched node with a tag, -1 if none
    int32_t tagged_blocks      # blocks from the root to the end of tagged_node


# Group ``g``'s block ids of a chunk (-1: released in that group); group 0's is ``blocks``.
cdef inline int32_t *chunk_column(Chunk *chunk, Py_ssize_t g) noexcept nogil:
    return chunk.blocks + g * chunk.block_capacity


cdef enum:
    ROOT_PARENT = -1
    FREE_PARENT = -2


# Retention: one LRU list per priority, the lowest non-empty list evicted first. A node's priority
# is at least its children's, so the lowest list's head is a leaf (see radix.pyx, "the eviction lists").
cdef enum:
    DEFAULT_PRIORITY = 35      # TensorRT-LLM's default retention priority
    MAX_PRIORITY = 100
    NUM_LISTS = 101


# Eviction policies. ``branch-lru`` orders the default priority's nodes by last use plus a bonus
# for reuses and for the longest request path through them: one LRU list per (reuse class, length
# band), the victim the head with the smallest key (see radix.pyx, "branch-lru").
cdef enum:
    POLICY_LRU = 0
    POLICY_BRANCH_LRU = 1      # the victim's whole run goes (up to what is asked)
    POLICY_BRANCH_LRU_EXACT = 2  # block by block in key order: the block model's order (bench/policies.py)
    BRANCH_REUSES = 4          # reuse classes: 0, 1, 2, 3 or more
    BRANCH_BANDS = 64          # half-octave length bands of an int32 block count
    BRANCH_LISTS = 256         # BRANCH_REUSES * BRANCH_BANDS, a power of two (the tournament's leaves)
    BRANCH_LENGTH_WEIGHT = 100  # stamps per block of a band's length


# A node's priority expiring at ``at`` (a min-heap of them; an entry whose node's expiry changed is stale).
cdef struct Expiry:
    double at
    int32_t node


cdef Chunk *chunk_new(ChunkCache *cache, Py_ssize_t blocks, Py_ssize_t tokens) noexcept nogil
cdef void chunk_decref(ChunkCache *cache, Chunk *chunk) noexcept nogil
cdef int chunk_reserve(ChunkCache *cache, Chunk *chunk, Py_ssize_t blocks, Py_ssize_t tokens) noexcept nogil


@cython.final
cdef class RadixTrie:
    cdef RNode *_nodes
    cdef int32_t *_buckets
    cdef uint32_t *_keys            # block_size + 1 NH keys of the lookup hash
    cdef int32_t *_evicted_tags     # tags of nodes trimmed or dropped since the owner last drained them
    cdef Py_ssize_t _num_evicted_tags
    cdef Py_ssize_t _evicted_tags_capacity
    cdef Py_ssize_t _block_size
    cdef Py_ssize_t _capacity       # node slots (a power of two)
    cdef Py_ssize_t _high_water
    cdef Py_ssize_t _bucket_mask
    cdef int32_t _free_head
    cdef Py_ssize_t _num_free_slots
    cdef Py_ssize_t _num_nodes      # live non-root nodes
    cdef Py_ssize_t _num_roots
    cdef Py_ssize_t _num_blocks     # blocks held by all nodes
    cdef int32_t _heads[NUM_LISTS]  # one LRU list per priority (see the retention enum)
    cdef int32_t _tails[NUM_LISTS]
    cdef uint64_t _listed[2]        # bit q: list q is not empty
    cdef Py_ssize_t _lru_blocks     # blocks of the nodes on the lists (evictable)
    cdef Expiry *_heap              # expiries of finite priorities, earliest first
    cdef Py_ssize_t _heap_size
    cdef Py_ssize_t _heap_capacity
    cdef bint _manual_clock         # the retention clock is ``_time`` (set by the owner), not CLOCK_MONOTONIC
    cdef double _time
    cdef bint _branch               # eviction_policy "branch-lru" (the default priority's order)
    cdef bint _branch_exact         # "branch-lru-exact": a run is trimmed only while its blocks' keys come first
    cdef int64_t *_stamps           # (branch-lru) per node slot: the stamp of its run's last block
    cdef int64_t _tick              # (branch-lru) stamps handed out: one per block appended to a list
    cdef int32_t _bheads[BRANCH_LISTS]
    cdef int32_t _btails[BRANCH_LISTS]
    cdef int64_t _bconst[BRANCH_LISTS]   # a list's reuse bonus plus its band's length bonus
    cdef int64_t _bkey[BRANCH_LISTS]     # its head's key (stamp + constant); INT64_MAX: empty
    cdef int64_t _bstamp[BRANCH_LISTS]   # its head's stamp (ties go to the older)
    cdef int16_t _btree[2 * BRANCH_LISTS]  # a tournament over the lists: entry i the winner below i
    cdef Py_ssize_t _bnonempty      # lists holding a node
    cdef uint8_t _leaf_band         # (branch-lru) the band _add_leaf gives a new leaf (see _path_band)
    cdef lc_mutex_t *_lock          # the owner's lock (see _share_lock)
    cdef lc_mutex_t _own_lock       # used when no owner gave one
    cdef object _lock_owner         # what holds ``_lock``, kept alive
    cdef ChunkCache _chunks
    cdef int32_t **_owners          # (KV cache groups) per group, by block id, the node holding it (NULL: untracked)

    cdef void _share_lock(self, object owner, lc_mutex_t *lock) noexcept

    cdef inline Py_ssize_t _take_evicted_tags(self, const int32_t **tags) noexcept nogil:
        """The tags of the nodes trimmed or dropped since the last call (``tags`` points at them
        until the next trim); the owner frees the snapshots they name."""
        cdef Py_ssize_t n = self._num_evicted_tags
        tags[0] = self._evicted_tags
        self._num_evicted_tags = 0
        return n

    cdef inline void _set_tag(self, int32_t v, int32_t tag) noexcept nogil:
        """Keep snapshot ``tag`` at the end of node ``v``'s run (-1: none)."""
        self._nodes[v].tag = tag

    cdef inline void _set_groups(self, Py_ssize_t n) noexcept nogil:
        """Chunks made from now on hold ``n`` block id columns (KV cache groups; before any is made)."""
        self._chunks.num_groups = n

    cdef inline void _set_owners(self, int32_t **owners) noexcept nogil:
        """Per group, the node holding each block (NULL: untracked), kept through splits (KV cache groups)."""
        self._owners = owners

    cdef inline void _trim_one(self, int32_t v, int32_t *dest, uint64_t *hash_dest) noexcept nogil:
        """``_trim_leaf(v, 1, dest, NULL, hash_dest, 0)``: the last block of unprotected leaf
        ``v``, in line where the node keeps a block and has nothing else to update (no tag, the
        LRU policy), else by ``_trim_leaf``."""
        cdef RNode *node = &self._nodes[v]
        cdef Py_ssize_t last = <Py_ssize_t>node.start + node.length - 1
        if node.length <= 1 or node.tag >= 0 or self._branch:
            self._trim_leaf(v, 1, dest, NULL, hash_dest, 0)
            return
        dest[0] = node.chunk.blocks[last]
        if hash_dest != NULL:
            hash_dest[0] = node.chunk.hashes[last] if node.chunk.hashes != NULL else 0
        node.length -= 1
        self._lru_blocks -= 1
        self._num_blocks -= 1

    cdef inline ChunkCache *_chunk_cache(self) noexcept nogil:
        """The chunks' free lists, shared with the owner's records (whose chunks nodes take over)."""
        return &self._chunks

    cdef int _reserve(self, Py_ssize_t nodes) noexcept nogil
    cdef int32_t _find_root(self, int64_t adapter) noexcept nogil
    cdef int32_t _root(self, int64_t adapter) noexcept nogil
    cdef Py_ssize_t _walk(
        self, int32_t start, const int32_t *tokens, Py_ssize_t num_blocks, WalkEnd *end
    ) noexcept nogil
    cdef int32_t _split(self, int32_t v, int32_t blocks) noexcept nogil
    cdef int32_t _settle(self, WalkEnd *end) noexcept nogil
    cdef int32_t _add_leaf(self, int32_t parent, Chunk *chunk, int32_t start, int32_t length) noexcept nogil
    cdef void _extend(self, int32_t v, int32_t blocks) noexcept nogil
    cdef void _pin(self, int32_t v) noexcept nogil
    cdef void _unpin(self, int32_t v) noexcept nogil
    cdef void _touch(self, int32_t v) noexcept nogil
    cdef void _set_time(self, double now) noexcept nogil
    cdef double _now(self) noexcept nogil
    cdef int _set_policy(self, int policy, int64_t bonus1, int64_t bonus2, int64_t bonus3) except -1
    cdef void _hit(self, int32_t v) noexcept nogil
    cdef void _path_band(self, int32_t v, Py_ssize_t blocks) noexcept nogil
    cdef int32_t _victim(self) noexcept nogil
    cdef void _set_priority(self, int32_t v, int32_t priority, double expiry) noexcept nogil
    cdef void _decay(self, double now) noexcept nogil
    cdef Py_ssize_t _path_blocks(self, int32_t v, int32_t *dest) noexcept nogil
    cdef void _path_tokens(self, int32_t v, int32_t *dest, Py_ssize_t blocks) noexcept nogil
    cdef Py_ssize_t _trim(self, Py_ssize_t n, int32_t *dest, int32_t *token_dest, uint64_t *hash_dest,
                          int32_t split_below=*, bint *below=*) noexcept nogil
    cdef void _trim_leaf(self, int32_t v, Py_ssize_t take, int32_t *dest, int32_t *token_dest, uint64_t *hash_dest,
                         Py_ssize_t at) noexcept nogil
    cdef Py_ssize_t _drop_subtree(
        self, int32_t top, int32_t *dest, int32_t *token_dest, uint64_t *hash_dest
    ) noexcept nogil
    cdef void _clear(self) noexcept nogil
    cdef const uint64_t *_hash_tail(self, int32_t v, Py_ssize_t count, int64_t *key, uint64_t *parent,
                                    bint *has_parent, uint64_t *copy_hashes=*, int32_t *copy_tokens=*) noexcept nogil
    cdef dict _chunk_bytes(self)
    cdef list _marked_nodes(self, const uint8_t *mark)
    cdef int32_t _cut_at_mark(self, int32_t v, const uint8_t *mark) noexcept nogil
    cdef int _hash_all(self) except -1
    cdef str _hash_problem(self)
    cdef int32_t _tag_at(self, int32_t v, Py_ssize_t blocks) noexcept nogil
    cdef str _problem(self)
    cdef str _recount(self, Py_ssize_t *children, Py_ssize_t *protected_children, Py_ssize_t *lru_pos)
    cdef str _branch_problem(self, Py_ssize_t *lru_pos, Py_ssize_t *steps, Py_ssize_t *lru_blocks)
