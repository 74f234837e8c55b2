# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The path-compressed prefix trie of the KV cache (module lifecycle._radix).

A node holds a run of whole blocks: their token ids and block ids, as a range of a ``Chunk``
shared with the sequence that computed them (so caching a finished sequence copies nothing). A
run ends where requests diverge, where a sequence pins its prefix, or at an SSM snapshot. Children
are found by their first block through one hash table keyed by (parent, first block) and accepted
only after that block's tokens compared equal; the rest of a run is compared token for token. So a
walk costs one lookup per branch, and a hash never decides a match.

Eviction follows least recent use per block, as a trie of single blocks would: every node that is
neither pinned nor above a pinned node is on an LRU list that lists every node after all of its
descendants, so the head is always an unpinned leaf; eviction trims leaf runs from their tail,
many blocks per step. There is one such list per retention priority (0 to 100, a node's at least
its children's), the lowest taken first; without hints every node has the default priority and
the one list in use is plain LRU. Under ``eviction_policy="branch-lru"`` the default priority's one
list becomes one per (reuse class, length band), the victim the head of smallest key (see
"branch-lru" below).

The trie owns no block references: the KV cache core (``lifecycle._kvcache``) keeps the pool's
refcounts and calls these methods with its lock held. Python sees introspection only.
"""

cimport cython
from libc.stdint cimport INT32_MAX, INT64_MAX, int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.math cimport INFINITY
from libc.string cimport memcpy, memmove, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from lifecycle._sync cimport lc_enter_gil, lc_leave, lc_mutex_init
from lifecycle._hash cimport (
    LC_GOLDEN,
    lc_block_equal,
    lc_content_hashes,
    lc_content_hashes_copy,
    lc_equal_blocks,
    lc_fill_keys,
    lc_fmix64,
    lc_nh_block,
    lc_root_hash,
)

from lifecycle.errors import ConfigError, InvariantViolation

cdef enum:
    MIN_CAPACITY = 64
    MAX_BLOCK_SIZE = 1 << 16


# -- chunks -------------------------------------------------------------------------------------

cdef enum:
    CACHED_PER_CLASS = 16
    CACHED_BYTES = 64 << 20


cdef inline Py_ssize_t _class_of(Py_ssize_t tokens) noexcept nogil:
    """The smallest size class holding ``tokens`` tokens: class k holds (4 + k % 4) << (k // 4)
    units of 16 tokens."""
    cdef Py_ssize_t units = (tokens + 15) // 16, e = 0, mantissa
    if units <= 4:
        return 0
    while (units - 1) >> (e + 3):
        e += 1
    mantissa = (units + (1 << e) - 1) >> e
    if mantissa >= 8:
        e += 1
        mantissa = 4
    return 4 * e + mantissa - 4


cdef inline Py_ssize_t _class_tokens(Py_ssize_t size_class) noexcept nogil:
    return ((4 + size_class % 4) << (size_class // 4)) * 16


cdef inline Py_ssize_t _chunk_nbytes(ChunkCache *cache, Chunk *chunk) noexcept nogil:
    return (chunk.token_capacity + chunk.block_capacity * cache.num_groups) * sizeof(int32_t)


cdef Chunk *chunk_new(ChunkCache *cache, Py_ssize_t blocks, Py_ssize_t tokens) noexcept nogil:
    """A chunk with room for at least ``blocks`` block ids and ``tokens`` token ids and one
    reference; a cached one of its size class when there is one."""
    cdef Py_ssize_t size_class = _class_of(tokens), class_blocks
    cdef Chunk *chunk
    if size_class < CHUNK_CLASSES:
        class_blocks = _class_tokens(size_class) // cache.block_size + 2
        if blocks <= class_blocks:
            chunk = cache.free[size_class]
            if chunk != NULL:
                cache.free[size_class] = chunk.next_free
                cache.count[size_class] -= 1
                cache.bytes -= _chunk_nbytes(cache, chunk)
                chunk.refs = 1
                chunk.num_hashed = 0
                chunk.next_free = NULL
                return chunk
            tokens = _class_tokens(size_class)
            blocks = class_blocks
        else:
            size_class = -1
    else:
        size_class = -1
    chunk = <Chunk *>malloc(sizeof(Chunk))
    if chunk == NULL:
        return NULL
    chunk.refs = 1
    chunk.block_capacity = <int32_t>blocks
    chunk.token_capacity = <int32_t>tokens
    chunk.num_hashed = 0
    chunk.size_class = <int32_t>size_class
    chunk.hashes = NULL
    chunk.next_free = NULL
    chunk.tokens = <int32_t *>malloc((tokens if tokens > 0 else 1) * sizeof(int32_t))
    chunk.blocks = <int32_t *>malloc((blocks if blocks > 0 else 1) * cache.num_groups * sizeof(int32_t))
    if chunk.tokens == NULL or chunk.blocks == NULL:
        free(chunk.tokens)
        free(chunk.blocks)
        free(chunk)
        return NULL
    return chunk


cdef void chunk_decref(ChunkCache *cache, Chunk *chunk) noexcept nogil:
    cdef Py_ssize_t size_class = chunk.size_class, nbytes
    chunk.refs -= 1
    if chunk.refs != 0:
        return
    free(chunk.hashes)
    chunk.hashes = NULL
    nbytes = _chunk_nbytes(cache, chunk)
    if size_class >= 0 and cache.count[size_class] < CACHED_PER_CLASS and cache.bytes + nbytes <= CACHED_BYTES:
        chunk.next_free = cache.free[size_class]
        cache.free[size_class] = chunk
        cache.count[size_class] += 1
        cache.bytes += nbytes
        return
    free(chunk.tokens)
    free(chunk.blocks)
    free(chunk)


cdef void _chunk_cache_clear(ChunkCache *cache) noexcept nogil:
    cdef Py_ssize_t i
    cdef Chunk *chunk
    for i in range(CHUNK_CLASSES):
        while cache.free[i] != NULL:
            chunk = cache.free[i]
            cache.free[i] = chunk.next_free
            free(chunk.tokens)
            free(chunk.blocks)
            free(chunk)
        cache.count[i] = 0
    cache.bytes = 0


cdef inline bint _growth_fails(ChunkCache *cache) noexcept nogil:
    """(Tests) whether this growth is the one ``KVCacheCore._fail_growth`` asked to fail."""
    if cache.fail_in <= 0:
        return False
    cache.fail_in -= 1
    return cache.fail_in == 0


cdef int chunk_reserve(ChunkCache *cache, Chunk *chunk, Py_ssize_t blocks, Py_ssize_t tokens) noexcept nogil:
    """Room for ``blocks`` block ids and ``tokens`` token ids, growing geometrically (to a size
    class where one fits); 1 when out of memory, the chunk then still whole (an array that grew
    keeps its room). Only for a chunk nobody but its record holds (refs == 1): its arrays may move."""
    cdef Py_ssize_t capacity, size_class
    cdef int32_t *grown
    cdef uint64_t *hashes
    cdef int failed = 0
    if tokens > chunk.token_capacity:
        capacity = max(tokens, 2 * <Py_ssize_t>chunk.token_capacity)
        size_class = _class_of(capacity)
        if size_class < CHUNK_CLASSES:
            capacity = _class_tokens(size_class)
        if capacity > INT32_MAX:
            return 1
        grown = NULL if _growth_fails(cache) else <int32_t *>realloc(chunk.tokens, capacity * sizeof(int32_t))
        if grown == NULL:
            return 1
        chunk.tokens = grown
        chunk.token_capacity = <int32_t>capacity
        blocks = max(blocks, capacity // cache.block_size + 2)
    elif blocks > chunk.block_capacity:
        blocks = max(blocks, 2 * <Py_ssize_t>chunk.block_capacity)
    if blocks > chunk.block_capacity:
        # The hashes first: the block columns move within their array once it grew, so nothing
        # may fail after that.
        if blocks > INT32_MAX:
            failed = 1
        elif chunk.hashes != NULL:
            hashes = NULL if _growth_fails(cache) else <uint64_t *>realloc(chunk.hashes, blocks * sizeof(uint64_t))
            if hashes == NULL:
                failed = 1
            else:
                chunk.hashes = hashes
        if not failed:
            grown = (
                NULL if _growth_fails(cache)
                else <int32_t *>realloc(chunk.blocks, blocks * cache.num_groups * sizeof(int32_t))
            )
            if grown == NULL:
                failed = 1
            else:
                chunk.blocks = grown
                if cache.num_groups > 1:
                    _spread_columns(grown, chunk.block_capacity, blocks, cache.num_groups)
                chunk.block_capacity = <int32_t>blocks
    size_class = _class_of(chunk.token_capacity)
    if (
        size_class < CHUNK_CLASSES
        and _class_tokens(size_class) == chunk.token_capacity
        and chunk.block_capacity == chunk.token_capacity // cache.block_size + 2
    ):
        chunk.size_class = <int32_t>size_class
    else:
        chunk.size_class = -1
    return failed


cdef inline void _spread_columns(int32_t *blocks, Py_ssize_t old, Py_ssize_t new, Py_ssize_t groups) noexcept nogil:
    """Move the group columns of a block array grown from ``old`` to ``new`` entries per column
    (the last column first, as they only move up)."""
    cdef Py_ssize_t g
    for g in range(groups - 1, 0, -1):
        memmove(blocks + g * new, blocks + g * old, old * sizeof(int32_t))


# -- node helpers (lock held) --------------------------------------------------------------------

cdef inline void _copy_hashes(uint64_t *dest, Chunk *chunk, Py_ssize_t start, Py_ssize_t count) noexcept nogil:
    if chunk.hashes != NULL:
        memcpy(dest, chunk.hashes + start, count * sizeof(uint64_t))
    else:
        memset(dest, 0, count * sizeof(uint64_t))


cdef inline const int32_t *_run_tokens(RadixTrie t, RNode *node) noexcept nogil:
    return node.chunk.tokens + <Py_ssize_t>node.start * t._block_size


cdef inline uint64_t _child_key(RadixTrie t, int32_t parent, const int32_t *tokens) noexcept nogil:
    return lc_fmix64(lc_nh_block(tokens, t._block_size, t._keys) + <uint64_t>parent * LC_GOLDEN)


cdef inline Py_ssize_t _bucket(RadixTrie t, int32_t v) noexcept nogil:
    cdef RNode *node = &t._nodes[v]
    if node.parent == ROOT_PARENT:
        return <Py_ssize_t>(lc_fmix64(node.key) & <uint64_t>t._bucket_mask)
    return <Py_ssize_t>(node.key & <uint64_t>t._bucket_mask)


cdef inline void _chain_link(RadixTrie t, int32_t v) noexcept nogil:
    cdef Py_ssize_t b = _bucket(t, v)
    cdef int32_t head = t._buckets[b]
    t._nodes[v].hash_next = head
    t._nodes[v].hash_prev = -1
    if head >= 0:
        t._nodes[head].hash_prev = v
    t._buckets[b] = v


cdef inline void _chain_unlink(RadixTrie t, int32_t v) noexcept nogil:
    cdef int32_t prev = t._nodes[v].hash_prev
    cdef int32_t after = t._nodes[v].hash_next
    if prev >= 0:
        t._nodes[prev].hash_next = after
    else:
        t._buckets[_bucket(t, v)] = after
    if after >= 0:
        t._nodes[after].hash_prev = prev


cdef inline int32_t _take_slot(RadixTrie t) noexcept nogil:
    # Capacity was reserved beforehand. Unused slots are chained through hash_next.
    cdef int32_t v = t._free_head
    if v >= 0:
        t._free_head = t._nodes[v].hash_next
        t._num_free_slots -= 1
        return v
    v = <int32_t>t._high_water
    t._high_water += 1
    return v


cdef inline void _return_slot(RadixTrie t, int32_t v) noexcept nogil:
    cdef RNode *node = &t._nodes[v]
    node.parent = FREE_PARENT
    node.chunk = NULL
    node.length = 0
    node.tag = -1
    node.hash_prev = -1
    node.hash_next = t._free_head
    t._free_head = v
    t._num_free_slots += 1


# -- the eviction lists (retention) ------------------------------------------------------------
#
# One LRU list per retention priority (0..100); the victim is the head of the lowest non-empty
# list. Every list lists a node after its descendants in it, and a node's priority is at least its
# children's (``_lift`` keeps both when a priority changes), so that head is an unpinned leaf, as
# the single list's head was. A priority above the default
# that expires decays to the default (``_decay``, from a heap of expiries); to keep a parent from
# decaying below its child, a parent that outranks a hinted child keeps its rank until the
# child's expiry.

cdef extern from *:
    """
    static inline int lc_lowest_bit(unsigned long long x) {
    #if defined(_MSC_VER)
        unsigned long i; _BitScanForward64(&i, x); return (int)i;
    #else
        return __builtin_ctzll(x);
    #endif
    }
    """
    int lc_lowest_bit(uint64_t x) noexcept nogil


# -- branch-lru: the default priority's lists ---------------------------------------------------
#
# With ``eviction_policy="branch-lru"`` the nodes at the default priority are not on one LRU list
# but on one per (reuse class, length band): a node's reuses while cached (0, 1, 2, 3 or more,
# counted at each admission that pins it) and the half-octave band of the longest request path
# through it (set at each finish on the request's cached path). A block's key is its stamp (its
# place in the LRU order: every block appended to a list takes the next one, a run's last block
# the lowest) plus its list's constant: a reuse bonus of 0, 1/2, 1, 3/2 pools' worth of stamps
# plus ``BRANCH_LENGTH_WEIGHT`` stamps per block of its band. Within a list the constant is one,
# so list order is stamp order; the victim is the head with the smallest key (ties: the older
# stamp), found by a tournament over the lists' head keys, updated only when a head changes.
# Stamps, reuses and bands only grow toward the root (a parent is appended after its children; a
# reuse or a path through a node is one through its parent), so the smallest head is a leaf. The
# other priorities keep their plain LRU lists, lowest non-empty priority first as before.

cdef inline int32_t _band_of(Py_ssize_t blocks) noexcept nogil:
    """The half-octave band of a length in blocks (1, 2, 3, 4, 6, 8, 12, ... are bands 1, 2, 3, ...)."""
    cdef int32_t e = 0
    if blocks <= 0:
        return 0
    while (blocks >> (e + 1)) != 0:
        e += 1
    return 2 * e + (1 if 2 * blocks >= 3 << e else 0)


cdef inline int64_t _band_blocks(int32_t band) noexcept nogil:
    """The length a band stands for (rounded down to the band): 0, 1, 2, 3, 4, 6, 8, 12, ..."""
    if band == 0:
        return 0
    if band & 1:
        return (<int64_t>3 << (band >> 1)) >> 1
    return <int64_t>1 << (band >> 1)


cdef inline int32_t _blist(RNode *node) noexcept nogil:
    return node.reuses * BRANCH_BANDS + node.band


cdef inline bint _in_branch(RadixTrie t, RNode *node) noexcept nogil:
    return t._branch and node.priority == DEFAULT_PRIORITY


cdef inline bint _bbefore(RadixTrie t, int32_t a, int32_t b) noexcept nogil:
    """Whether list ``a``'s head goes before list ``b``'s (the smaller key, then the older stamp)."""
    return t._bkey[a] < t._bkey[b] or (t._bkey[a] == t._bkey[b] and t._bstamp[a] <= t._bstamp[b])


cdef inline void _bset(RadixTrie t, int32_t li, int32_t head) noexcept nogil:
    """List ``li``'s head became ``head`` (-1: empty): its key, then the tournament above it."""
    cdef Py_ssize_t i
    cdef int16_t a, b
    if head >= 0:
        t._bstamp[li] = t._stamps[head]
        t._bkey[li] = t._stamps[head] + t._bconst[li]
    else:
        t._bstamp[li] = INT64_MAX
        t._bkey[li] = INT64_MAX
    i = (BRANCH_LISTS + li) >> 1
    while i >= 1:
        a = t._btree[2 * i]
        b = t._btree[2 * i + 1]
        t._btree[i] = a if _bbefore(t, a, b) else b
        i >>= 1


cdef inline void _blist_place(RadixTrie t, int32_t v) noexcept nogil:
    """Node ``v`` (its stamp set) joins its list's MRU end."""
    cdef RNode *node = &t._nodes[v]
    cdef int32_t li = _blist(node), tail = t._btails[li]
    node.lru_prev = tail
    node.lru_next = -1
    if tail >= 0:
        t._nodes[tail].lru_next = v
    else:
        t._bheads[li] = v
        if t._bnonempty == 0:
            t._listed[DEFAULT_PRIORITY >> 6] |= (<uint64_t>1) << (DEFAULT_PRIORITY & 63)
        t._bnonempty += 1
        _bset(t, li, v)
    t._btails[li] = v
    t._lru_blocks += node.length


cdef inline void _blist_remove(RadixTrie t, int32_t v) noexcept nogil:
    cdef RNode *node = &t._nodes[v]
    cdef int32_t li = _blist(node)
    if node.lru_prev >= 0:
        t._nodes[node.lru_prev].lru_next = node.lru_next
    else:
        t._bheads[li] = node.lru_next
        if node.lru_next < 0:
            t._bnonempty -= 1
            if t._bnonempty == 0:
                t._listed[DEFAULT_PRIORITY >> 6] &= ~((<uint64_t>1) << (DEFAULT_PRIORITY & 63))
        _bset(t, li, node.lru_next)
    if node.lru_next >= 0:
        t._nodes[node.lru_next].lru_prev = node.lru_prev
    else:
        t._btails[li] = node.lru_prev
    node.lru_prev = -1
    node.lru_next = -1
    t._lru_blocks -= node.length


cdef inline int32_t _bwinner(RadixTrie t) noexcept nogil:
    """The list whose head goes first (its key INT64_MAX when every list is empty)."""
    return t._btree[1]


cdef inline void _brunner_up(RadixTrie t, int32_t li, int64_t *key, int64_t *stamp) noexcept nogil:
    """The key and stamp of the first head of the lists other than ``li`` (INT64_MAX: none)."""
    cdef Py_ssize_t i = BRANCH_LISTS + li
    cdef int16_t best = -1, c
    while i > 1:
        c = t._btree[i ^ 1]
        if best < 0 or _bbefore(t, c, best):
            best = c
        i >>= 1
    key[0] = t._bkey[best]
    stamp[0] = t._bstamp[best]


cdef void _branch_reset(RadixTrie t) noexcept nogil:
    """Every branch-lru list empty."""
    cdef Py_ssize_t i
    for i in range(BRANCH_LISTS):
        t._bheads[i] = -1
        t._btails[i] = -1
        t._bkey[i] = INT64_MAX
        t._bstamp[i] = INT64_MAX
        t._btree[BRANCH_LISTS + i] = <int16_t>i
    for i in range(BRANCH_LISTS - 1, 0, -1):
        t._btree[i] = t._btree[2 * i]
    t._btree[0] = 0
    t._bnonempty = 0


cdef inline void _lru_append(RadixTrie t, int32_t v) noexcept nogil:
    cdef RNode *node = &t._nodes[v]
    cdef int32_t q = node.priority
    if t._branch and q == DEFAULT_PRIORITY:
        t._stamps[v] = t._tick
        t._tick += node.length
        _blist_place(t, v)
        return
    node.lru_prev = t._tails[q]
    node.lru_next = -1
    if t._tails[q] >= 0:
        t._nodes[t._tails[q]].lru_next = v
    else:
        t._heads[q] = v
        t._listed[q >> 6] |= (<uint64_t>1) << (q & 63)
    t._tails[q] = v
    t._lru_blocks += node.length


cdef inline void _lru_remove(RadixTrie t, int32_t v) noexcept nogil:
    cdef RNode *node = &t._nodes[v]
    cdef int32_t q = node.priority
    if t._branch and q == DEFAULT_PRIORITY:
        _blist_remove(t, v)
        return
    if node.lru_prev >= 0:
        t._nodes[node.lru_prev].lru_next = node.lru_next
    else:
        t._heads[q] = node.lru_next
        if node.lru_next < 0:
            t._listed[q >> 6] &= ~((<uint64_t>1) << (q & 63))
    if node.lru_next >= 0:
        t._nodes[node.lru_next].lru_prev = node.lru_prev
    else:
        t._tails[q] = node.lru_prev
    node.lru_prev = -1
    node.lru_next = -1
    t._lru_blocks -= node.length


cdef inline void _lru_insert_after(RadixTrie t, int32_t anchor, int32_t v) noexcept nogil:
    # ``v`` joins ``anchor``'s list (it has ``anchor``'s priority).
    cdef RNode *node = &t._nodes[v]
    cdef int32_t after = t._nodes[anchor].lru_next
    node.lru_prev = anchor
    node.lru_next = after
    t._nodes[anchor].lru_next = v
    if after >= 0:
        t._nodes[after].lru_prev = v
    elif _in_branch(t, node):
        t._btails[_blist(node)] = v
    else:
        t._tails[node.priority] = v
    t._lru_blocks += node.length


cdef inline int32_t _lowest_list(RadixTrie t, int32_t above) noexcept nogil:
    """The lowest non-empty list above ``above``, -1 if none."""
    cdef int32_t q = above + 1
    cdef uint64_t bits
    while q < NUM_LISTS:
        bits = t._listed[q >> 6] >> (q & 63)
        if bits:
            return q + lc_lowest_bit(bits)
        q = (q | 63) + 1
    return -1


cdef inline int32_t _lru_after(RadixTrie t, int32_t v) noexcept nogil:
    """The node after ``v`` in the lists taken lowest first (the first one for ``v = -1``): every
    node comes after its descendants."""
    cdef int32_t q = -1
    if v >= 0:
        if t._nodes[v].lru_next >= 0:
            return t._nodes[v].lru_next
        q = t._nodes[v].priority
    q += 1
    while q < NUM_LISTS:
        if t._heads[q] >= 0:
            return t._heads[q]
        q += 1
    return -1


cdef int _heap_push(RadixTrie t, double at, int32_t v) noexcept nogil:
    # 1 when out of memory (nothing pushed).
    cdef Py_ssize_t i, up, capacity
    cdef Expiry *grown
    if t._heap_size == t._heap_capacity:
        capacity = max(<Py_ssize_t>64, 2 * t._heap_capacity)
        grown = <Expiry *>realloc(t._heap, capacity * sizeof(Expiry))
        if grown == NULL:
            return 1
        t._heap = grown
        t._heap_capacity = capacity
    i = t._heap_size
    t._heap_size += 1
    while i > 0:
        up = (i - 1) >> 1
        if t._heap[up].at <= at:
            break
        t._heap[i] = t._heap[up]
        i = up
    t._heap[i].at = at
    t._heap[i].node = v
    return 0


cdef void _heap_pop(RadixTrie t) noexcept nogil:
    cdef Py_ssize_t i = 0, c, n
    cdef Expiry last
    t._heap_size -= 1
    n = t._heap_size
    if n == 0:
        return
    last = t._heap[n]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and t._heap[c + 1].at < t._heap[c].at:
            c += 1
        if t._heap[c].at >= last.at:
            break
        t._heap[i] = t._heap[c]
        i = c
    t._heap[i] = last


cdef inline void _set_expiry(RadixTrie t, int32_t v, double at) noexcept nogil:
    # A finite expiry has an entry in the heap at or before it (``_decay`` pushes a later expiry
    # again when that entry comes due), so pushing is needed only when it gets earlier. Out of
    # heap memory the priority stays without decaying: retention lasts longer than asked.
    cdef double old = t._nodes[v].expiry
    t._nodes[v].expiry = at
    if at < INFINITY and not (old < INFINITY and at >= old) and _heap_push(t, at, v):
        t._nodes[v].expiry = INFINITY


cdef inline void _move(RadixTrie t, int32_t v, int32_t q) noexcept nogil:
    # Node v to list q, at its MRU end when listed.
    cdef RNode *node = &t._nodes[v]
    cdef bint listed = node.lock_count == 0
    if listed:
        _lru_remove(t, v)
    node.priority = q
    if listed:
        _lru_append(t, v)


cdef void _lift(RadixTrie t, int32_t v) noexcept nogil:
    """Restore the lists' order above ``v`` after its priority changed: an ancestor below its
    priority rises to it, one equal to it moves after it, and (above the default) an ancestor's
    rank lasts at least as long as ``v``'s."""
    cdef int32_t q = t._nodes[v].priority, u = t._nodes[v].parent
    cdef double at = t._nodes[v].expiry
    cdef RNode *up
    while t._nodes[u].parent >= 0:
        up = &t._nodes[u]
        if up.priority > q:
            if q <= DEFAULT_PRIORITY or up.expiry >= at:
                return
            _set_expiry(t, u, at)
        elif up.priority < q:
            # Its other children may outlive ``at`` above the default: its old expiry bounds theirs.
            if up.priority > DEFAULT_PRIORITY and up.expiry > at:
                at = up.expiry
            _move(t, u, q)
            _set_expiry(t, u, at if q > DEFAULT_PRIORITY else INFINITY)
        else:
            if q > DEFAULT_PRIORITY and up.expiry < at:
                _set_expiry(t, u, at)
            elif up.lock_count != 0:
                return  # its ancestors are locked (off the lists) and at least as high already
            if up.lock_count == 0:
                _lru_remove(t, u)
                _lru_append(t, u)
        u = up.parent


cdef inline int32_t _find_child(RadixTrie t, int32_t parent, const int32_t *tokens) noexcept nogil:
    cdef uint64_t key = _child_key(t, parent, tokens)
    cdef int32_t v = t._buckets[key & <uint64_t>t._bucket_mask]
    cdef RNode *node
    while v >= 0:
        node = &t._nodes[v]
        # The exact compare of the first block decides; the key only narrows the search.
        if node.key == key and node.parent == parent and lc_block_equal(_run_tokens(t, node), tokens, t._block_size):
            return v
        v = node.hash_next
    return -1


cdef inline void _remove_leaf(RadixTrie t, int32_t v) noexcept nogil:
    # v is off the LRU list and has no children: drop it, and its root if that was the last child.
    cdef RNode *node = &t._nodes[v]
    cdef int32_t parent = node.parent
    if node.tag >= 0:
        t._evicted_tags[t._num_evicted_tags] = node.tag
        t._num_evicted_tags += 1
    t._num_blocks -= node.length
    _chain_unlink(t, v)
    chunk_decref(&t._chunks, node.chunk)
    _return_slot(t, v)
    t._num_nodes -= 1
    t._nodes[parent].num_children -= 1
    if t._nodes[parent].parent == ROOT_PARENT and t._nodes[parent].num_children == 0:
        _chain_unlink(t, parent)
        _return_slot(t, parent)
        t._num_roots -= 1


cdef void _own_head(RadixTrie t, int32_t h) noexcept nogil:
    """A split's head ``h`` took over the first blocks of its tail: it now owns their entries in
    the groups whose blocks are tracked by node (``_owners``)."""
    cdef Py_ssize_t g, q
    cdef RNode *head = &t._nodes[h]
    cdef int32_t *col
    cdef int32_t *owner
    for g in range(1, t._chunks.num_groups):
        owner = t._owners[g]
        if owner == NULL:
            continue
        col = head.chunk.blocks + g * head.chunk.block_capacity + head.start
        for q in range(head.length):
            if col[q] >= 0:
                owner[col[q]] = h


cdef inline uint64_t *_chunk_hashes(Chunk *chunk) noexcept nogil:
    """The chunk's content-hash array (one slot per block position), made on first use; NULL when
    out of memory."""
    if chunk.hashes == NULL:
        chunk.hashes = <uint64_t *>calloc(max(<Py_ssize_t>chunk.block_capacity, <Py_ssize_t>1), sizeof(uint64_t))
    return chunk.hashes


cdef inline uint64_t _last_hash(const RNode *node) noexcept nogil:
    """The content hash of a node's last block (0 if its chunk keeps none: out of memory)."""
    if node.chunk.hashes == NULL:
        return 0
    return node.chunk.hashes[node.start + node.length - 1]


cdef extern from "stdlib.h":
    void qsort(void *base, size_t n, size_t size, int (*compare)(const void *, const void *) noexcept nogil) nogil


cdef int _ascending(const void *a, const void *b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t *>a)[0], y = (<const uint64_t *>b)[0]
    return (x > y) - (x < y)


cdef inline uint8_t _inside(RadixTrie t, uint8_t *state, int32_t v) noexcept nogil:
    """1 if node ``v`` lies inside the subtree whose top ``state`` marks 1, 2 if not; ``v`` and
    its ancestors not yet known are marked on the way (0: not yet known)."""
    cdef int32_t u = v
    cdef uint8_t known
    while u >= 0 and state[u] == 0:
        u = t._nodes[u].parent
    known = state[u] if u >= 0 else 2
    u = v
    while u >= 0 and state[u] == 0:
        state[u] = known
        u = t._nodes[u].parent
    return known


cdef inline Py_ssize_t _take_leaf(RadixTrie t, int32_t v, int32_t *dest, int32_t *token_dest,
                                  uint64_t *hash_dest, Py_ssize_t count) noexcept nogil:
    """Remove leaf ``v`` from its list and the trie, after writing its block ids to ``dest`` at
    ``count`` (its tokens and hashes too, where those are not NULL); returns the new count."""
    cdef RNode *node = &t._nodes[v]
    cdef Py_ssize_t bs = t._block_size
    memcpy(dest + count, node.chunk.blocks + node.start, node.length * sizeof(int32_t))
    if token_dest != NULL:
        memcpy(token_dest + count * bs, _run_tokens(t, node), node.length * bs * sizeof(int32_t))
    if hash_dest != NULL:
        _copy_hashes(hash_dest + count, node.chunk, node.start, node.length)
    count += node.length
    _lru_remove(t, v)
    _remove_leaf(t, v)
    return count


cdef Py_ssize_t _drop_branch(RadixTrie t, int32_t top, int32_t *dest, int32_t *token_dest,
                             uint64_t *hash_dest) noexcept nogil:
    """``_drop_subtree`` with branch-lru's lists, whose concatenation does not list children before
    parents: the subtree's nodes (found on the lists, as there) are dropped deepest first."""
    cdef uint8_t *state = <uint8_t *>calloc(t._high_water + 1, sizeof(uint8_t))
    cdef uint64_t *order = <uint64_t *>malloc((t._num_nodes + 1) * sizeof(uint64_t))
    cdef Py_ssize_t count = 0, members = 0, i, li, lists
    cdef int32_t v, q
    if state == NULL or order == NULL:
        free(state)
        free(order)
        return -1
    state[top] = 1  # 1: inside the subtree, 2: outside, 0: not yet known
    for q in range(NUM_LISTS):
        lists = BRANCH_LISTS if q == DEFAULT_PRIORITY else 1
        for li in range(lists):
            v = t._bheads[li] if q == DEFAULT_PRIORITY else t._heads[q]
            while v >= 0:
                if _inside(t, state, v) == 1:
                    order[members] = ((<uint64_t>(INT32_MAX - t._nodes[v].depth)) << 32) | <uint32_t>v
                    members += 1
                v = t._nodes[v].lru_next
    qsort(order, members, sizeof(uint64_t), _ascending)
    for i in range(members):
        count = _take_leaf(t, <int32_t>(order[i] & <uint64_t>0xFFFFFFFF), dest, token_dest, hash_dest, count)
    free(state)
    free(order)
    return count


@cython.final
@cython.auto_pickle(False)
cdef class RadixTrie:
    """Cached whole-block token runs under one root per adapter key; LRU eviction of leaf tails.

    Made and driven by the KV cache core; from Python it can only be inspected and checked.
    """

    def __cinit__(self, *args, **kwargs):
        lc_mutex_init(&self._own_lock)
        self._lock = &self._own_lock
        self._block_size = 1
        self._free_head = -1
        memset(self._heads, 0xFF, sizeof(self._heads))
        memset(self._tails, 0xFF, sizeof(self._tails))
        _branch_reset(self)

    def __init__(self, block_size, *, capacity=0):
        """An empty trie for blocks of ``block_size`` tokens, with room for ``capacity`` nodes."""
        if self._keys != NULL:
            raise ConfigError("this RadixTrie is already initialized; make a new one")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity <= INT32_MAX // 4:
            raise ConfigError(f"capacity must be an int in [0, {INT32_MAX // 4}], got {capacity!r}")
        self._keys = <uint32_t *>malloc((block_size + 1) * sizeof(uint32_t))
        if self._keys == NULL:
            raise MemoryError(f"RadixTrie: cannot allocate hash keys for block size {block_size}")
        lc_fill_keys(self._keys, block_size + 1)
        self._block_size = block_size
        self._chunks.block_size = block_size
        self._chunks.num_groups = 1
        if self._reserve(max(<Py_ssize_t>capacity, <Py_ssize_t>MIN_CAPACITY)):
            raise MemoryError(f"RadixTrie: cannot allocate tables for {capacity} nodes")

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self._high_water):
            if self._nodes[i].parent >= 0:
                chunk_decref(&self._chunks, self._nodes[i].chunk)
        _chunk_cache_clear(&self._chunks)
        free(self._nodes)
        free(self._buckets)
        free(self._keys)
        free(self._evicted_tags)
        free(self._heap)
        free(self._stamps)

    def __repr__(self):
        return (
            f"RadixTrie(block_size={self._block_size}, blocks={self._num_blocks}, nodes={self._num_nodes}, "
            f"evictable={self._lru_blocks}, adapters={self._num_roots})"
        )

    # -- introspection --

    @property
    def block_size(self):
        """Tokens per block."""
        return self._block_size

    @property
    def num_cached_blocks(self):
        """Blocks held by all nodes."""
        return self._num_blocks

    @property
    def num_evictable_blocks(self):
        """Blocks that eviction may drop: in nodes neither pinned nor above a pinned node."""
        return self._lru_blocks

    @property
    def num_nodes(self):
        """Nodes (runs of blocks), roots excluded."""
        return self._num_nodes

    @property
    def num_adapters(self):
        """Adapter roots with at least one cached block."""
        return self._num_roots

    @property
    def nbytes(self):
        """Bytes of the trie's own tables (node slots, hash buckets, evicted-tag buffer); the
        chunks holding token and block ids are counted by the core."""
        return (
            self._capacity * (sizeof(RNode) + sizeof(int32_t))
            + self._evicted_tags_capacity * sizeof(int32_t)
        )

    @staticmethod
    def node_bytes():
        """Bytes of one node slot and its hash bucket."""
        return sizeof(RNode) + sizeof(int32_t)

    cdef void _share_lock(self, object owner, lc_mutex_t *lock) noexcept:
        """Guard the trie with ``lock``, which ``owner`` holds (the KV cache core's pool)."""
        self._lock_owner = owner
        self._lock = lock

    # -- growth --

    cdef int _reserve(self, Py_ssize_t extra) noexcept nogil:
        """Room for ``extra`` more live nodes plus a root; 1 when out of memory (nothing changed
        that matters: a grown table is only bigger)."""
        cdef Py_ssize_t live = self._num_nodes + self._num_roots
        cdef Py_ssize_t capacity = self._capacity
        cdef Py_ssize_t i
        cdef RNode *nodes
        cdef int32_t *buckets
        cdef int32_t *tags
        cdef int64_t *stamps
        if live + extra + 1 <= capacity:
            return 0
        if capacity == 0:
            capacity = MIN_CAPACITY
        while capacity < live + extra + 1:
            capacity *= 2
        if capacity > INT32_MAX // 2:
            return 1
        nodes = <RNode *>realloc(self._nodes, capacity * sizeof(RNode))
        if nodes == NULL:
            return 1
        self._nodes = nodes
        if self._branch:
            stamps = <int64_t *>realloc(self._stamps, capacity * sizeof(int64_t))
            if stamps == NULL:
                return 1
            self._stamps = stamps
        # Every node may lose its tag in one eviction before the owner drains the buffer.
        tags = <int32_t *>realloc(self._evicted_tags, capacity * sizeof(int32_t))
        if tags == NULL:
            return 1
        self._evicted_tags = tags
        self._evicted_tags_capacity = capacity
        buckets = <int32_t *>malloc(capacity * sizeof(int32_t))
        if buckets == NULL:
            return 1
        free(self._buckets)
        self._buckets = buckets
        self._capacity = capacity
        self._bucket_mask = capacity - 1
        memset(buckets, 0xFF, capacity * sizeof(int32_t))
        for i in range(self._high_water):
            if self._nodes[i].parent != FREE_PARENT:
                _chain_link(self, <int32_t>i)
        return 0

    # -- lookups --

    cdef int32_t _find_root(self, int64_t adapter) noexcept nogil:
        cdef uint64_t key = <uint64_t>adapter
        cdef int32_t v = self._buckets[lc_fmix64(key) & <uint64_t>self._bucket_mask]
        while v >= 0:
            if self._nodes[v].parent == ROOT_PARENT and self._nodes[v].key == key:
                return v
            v = self._nodes[v].hash_next
        return -1

    cdef int32_t _root(self, int64_t adapter) noexcept nogil:
        """The adapter's root, made if missing (one node of reserved room)."""
        cdef int32_t v = self._find_root(adapter)
        cdef RNode *node
        if v >= 0:
            return v
        v = _take_slot(self)
        node = &self._nodes[v]
        node.chunk = NULL
        node.key = <uint64_t>adapter
        node.start = 0
        node.length = 0
        node.depth = 0
        node.parent = ROOT_PARENT
        node.num_children = 0
        node.pin_count = 0
        node.lock_count = 0
        node.lru_prev = -1
        node.lru_next = -1
        node.tag = -1
        node.priority = MAX_PRIORITY
        node.reuses = BRANCH_REUSES - 1
        node.band = BRANCH_BANDS - 1
        node.expiry = INFINITY
        _chain_link(self, v)
        self._num_roots += 1
        return v

    cdef Py_ssize_t _walk(
        self, int32_t start, const int32_t *tokens, Py_ssize_t num_blocks, WalkEnd *end
    ) noexcept nogil:
        """Match the ``num_blocks`` blocks of ``tokens`` downwards from the end of node ``start``
        (a root, or a node the caller holds); returns how many matched. Changes nothing."""
        cdef Py_ssize_t bs = self._block_size
        cdef Py_ssize_t matched = 0, n, k
        cdef int32_t v = start, c
        cdef RNode *node
        end.node = start
        end.partial = 0
        end.tagged_node = -1
        end.tagged_blocks = 0
        while matched < num_blocks:
            c = _find_child(self, v, tokens + matched * bs)
            if c < 0:
                break
            node = &self._nodes[c]
            n = min(<Py_ssize_t>node.length, num_blocks - matched)
            k = 1
            if n > 1:
                k += lc_equal_blocks(_run_tokens(self, node) + bs, tokens + (matched + 1) * bs, n - 1, bs)
            matched += k
            end.node = c
            if k < node.length:
                end.partial = <int32_t>k
                break
            if node.tag >= 0:
                end.tagged_node = c
                end.tagged_blocks = node.depth + node.length
            v = c
        return matched

    # -- changes --

    cdef int32_t _split(self, int32_t v, int32_t blocks) noexcept nogil:
        """Cut node ``v`` after its first ``blocks`` blocks (0 < blocks < length): a new node takes
        the head and becomes ``v``'s parent; ``v`` keeps its end, pins and tag. One node of room
        must be reserved. Returns the head."""
        cdef int32_t h = _take_slot(self)
        cdef RNode *head = &self._nodes[h]
        cdef RNode *tail = &self._nodes[v]
        head.chunk = tail.chunk
        tail.chunk.refs += 1
        head.start = tail.start
        head.length = blocks
        head.depth = tail.depth
        head.parent = tail.parent
        head.num_children = 1
        head.pin_count = 0
        head.lock_count = 1 if tail.lock_count > 0 else 0
        head.tag = -1
        head.key = tail.key
        head.lru_prev = -1
        head.lru_next = -1
        head.priority = tail.priority
        head.reuses = tail.reuses
        head.band = tail.band
        if self._branch:
            # The tail keeps the deeper blocks' stamps, the head takes the ones after them.
            self._stamps[h] = self._stamps[v] + tail.length - blocks
        head.expiry = INFINITY
        _set_expiry(self, h, tail.expiry)
        if self._owners != NULL:
            _own_head(self, h)
        _chain_unlink(self, v)
        tail.start += blocks
        tail.length -= blocks
        tail.depth += blocks
        tail.parent = h
        tail.key = _child_key(self, h, _run_tokens(self, tail))
        _chain_link(self, h)
        _chain_link(self, v)
        if tail.lock_count == 0:
            # Same last use and list as the tail, and after it as every ancestor is.
            self._lru_blocks -= blocks
            _lru_insert_after(self, v, h)
        self._num_nodes += 1
        return h

    cdef int32_t _settle(self, WalkEnd *end) noexcept nogil:
        """The node ending where a walk ended: the walk's last node, cut at the partial match
        (one node of room must be reserved)."""
        if end.partial:
            return self._split(end.node, end.partial)
        return end.node

    cdef int32_t _add_leaf(self, int32_t parent, Chunk *chunk, int32_t start, int32_t length) noexcept nogil:
        """A new leaf under ``parent`` holding blocks [start, start + length) of ``chunk`` (which
        gains a reference); it and its path become the most recently used. One node of room must
        be reserved."""
        cdef int32_t v = _take_slot(self)
        cdef RNode *node = &self._nodes[v]
        cdef RNode *up = &self._nodes[parent]
        node.chunk = chunk
        chunk.refs += 1
        node.start = start
        node.length = length
        node.depth = up.depth + up.length
        node.parent = parent
        node.num_children = 0
        node.pin_count = 0
        node.lock_count = 0
        node.tag = -1
        node.priority = DEFAULT_PRIORITY
        node.reuses = 0
        node.band = self._leaf_band
        self._leaf_band = 0
        node.expiry = INFINITY
        node.key = _child_key(self, parent, chunk.tokens + <Py_ssize_t>start * self._block_size)
        _chain_link(self, v)
        up.num_children += 1
        self._num_nodes += 1
        self._num_blocks += length
        _lru_append(self, v)
        self._touch(parent)
        if up.parent >= 0 and up.priority < DEFAULT_PRIORITY:
            _lift(self, v)
        return v

    cdef void _extend(self, int32_t v, int32_t blocks) noexcept nogil:
        """Lengthen the run of ``v`` by ``blocks`` blocks already in its chunk. Only for a pinned,
        untagged leaf whose chunk holds the blocks right after its run."""
        self._nodes[v].length += blocks
        self._num_blocks += blocks

    cdef void _pin(self, int32_t v) noexcept nogil:
        """One pin on ``v``: it and its ancestors leave the LRU list until unpinned."""
        cdef RNode *node
        self._nodes[v].pin_count += 1
        while True:
            node = &self._nodes[v]
            node.lock_count += 1
            if node.lock_count != 1:
                return
            _lru_remove(self, v)
            v = node.parent
            if self._nodes[v].parent == ROOT_PARENT:
                return

    cdef void _unpin(self, int32_t v) noexcept nogil:
        """Undo one ``_pin``: nodes losing their last reason join the MRU end, deepest first."""
        cdef RNode *node
        self._nodes[v].pin_count -= 1
        while True:
            node = &self._nodes[v]
            node.lock_count -= 1
            if node.lock_count != 0:
                return
            _lru_append(self, v)
            v = node.parent
            if self._nodes[v].parent == ROOT_PARENT:
                return

    cdef void _touch(self, int32_t v) noexcept nogil:
        """Make the path ending at ``v`` the most recently used (deepest first). Protected nodes
        form a prefix of any path, so the first one ends the walk."""
        while self._nodes[v].parent >= 0 and self._nodes[v].lock_count == 0:
            _lru_remove(self, v)
            _lru_append(self, v)
            v = self._nodes[v].parent

    cdef void _set_time(self, double now) noexcept nogil:
        """Run the retention clock by the owner's time from now on (a replay's or a test's)."""
        self._manual_clock = True
        self._time = now

    cdef double _now(self) noexcept nogil:
        """The retention clock in seconds: CLOCK_MONOTONIC, or the owner's time once it set one."""
        cdef timespec ts
        if self._manual_clock:
            return self._time
        clock_gettime(CLOCK_MONOTONIC, &ts)
        return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9

    cdef int32_t _victim(self) noexcept nogil:
        """The next node eviction takes: the head of the lowest non-empty list (-1: nothing is
        evictable)."""
        cdef int32_t q = _lowest_list(self, -1)
        if q < 0:
            return -1
        if self._branch and q == DEFAULT_PRIORITY:
            return self._bheads[_bwinner(self)]
        return self._heads[q]

    cdef int _set_policy(self, int policy, int64_t bonus1, int64_t bonus2, int64_t bonus3) except -1:
        """Evict by ``policy`` (POLICY_LRU, POLICY_BRANCH_LRU or POLICY_BRANCH_LRU_EXACT, with
        its reuse bonuses for 1, 2 and 3+ reuses, in stamps); only while nothing is cached. 1 when
        out of memory."""
        cdef Py_ssize_t r, b
        cdef int64_t bonus[BRANCH_REUSES]
        if self._num_nodes or self._num_roots:
            raise ConfigError("the eviction policy is chosen before anything is cached")
        self._branch_exact = policy == POLICY_BRANCH_LRU_EXACT
        if policy == POLICY_LRU:
            self._branch = False
            return 0
        if self._stamps == NULL:
            self._stamps = <int64_t *>malloc(max(self._capacity, <Py_ssize_t>1) * sizeof(int64_t))
            if self._stamps == NULL:
                return 1
        bonus[0] = 0
        bonus[1] = bonus1
        bonus[2] = bonus2
        bonus[3] = bonus3
        for r in range(BRANCH_REUSES):
            for b in range(BRANCH_BANDS):
                self._bconst[r * BRANCH_BANDS + b] = bonus[r] + BRANCH_LENGTH_WEIGHT * _band_blocks(<int32_t>b)
        _branch_reset(self)
        self._branch = True
        return 0

    @property
    def eviction_policy(self):
        """The order eviction takes the default priority's nodes in: "lru", "branch-lru" or
        "branch-lru-exact"."""
        return ("branch-lru-exact" if self._branch_exact else "branch-lru") if self._branch else "lru"

    def branch_lists(self):
        """(branch-lru, inspection) Each non-empty list of the default priority, MRU end last: its
        index (reuse class * 64 + band) and its nodes as (node, stamp, blocks, parent)."""
        cdef Py_ssize_t li
        cdef int32_t v
        out = []
        if not self._branch:
            return out
        lc_enter_gil(self._lock)
        try:
            for li in range(BRANCH_LISTS):
                v = self._bheads[li]
                if v < 0:
                    continue
                nodes = []
                while v >= 0:
                    nodes.append((v, self._stamps[v], self._nodes[v].length, self._nodes[v].parent))
                    v = self._nodes[v].lru_next
                out.append((li, nodes))
        finally:
            lc_leave(self._lock, NULL)
        return out

    cdef void _hit(self, int32_t v) noexcept nogil:
        """(branch-lru) An admission reused the path ending at ``v``, which it pinned: one more
        reuse on each node of it (counts stop at the last class; a parent's is at least its
        child's, so the walk ends at the first node there)."""
        cdef RNode *node
        while self._nodes[v].parent >= 0:
            node = &self._nodes[v]
            if node.reuses >= BRANCH_REUSES - 1:
                return
            if node.lock_count == 0 and node.priority == DEFAULT_PRIORITY:
                _blist_remove(self, v)  # not expected: a pinned path is off the lists
                node.reuses += 1
                _blist_place(self, v)
            else:
                node.reuses += 1
            v = node.parent

    cdef void _path_band(self, int32_t v, Py_ssize_t blocks) noexcept nogil:
        """(branch-lru) A request finishing caches a path of ``blocks`` blocks through ``v``: every
        node from ``v`` up has a path at least that long through it, and so does the next leaf
        ``_add_leaf`` makes. Called before the finish makes the path the most
        recently used: a listed node changing lists keeps its stamp at its new list's MRU end until
        that touch appends it again (the path's unpinned nodes are exactly the ones it touches). A
        parent's band is at least its child's: the walk ends at the first node there."""
        cdef RNode *node
        cdef int32_t band = _band_of(blocks)
        self._leaf_band = <uint8_t>band
        while self._nodes[v].parent >= 0:
            node = &self._nodes[v]
            if node.band >= band:
                return
            if node.lock_count == 0 and node.priority == DEFAULT_PRIORITY:
                _blist_remove(self, v)
                node.band = <uint8_t>band
                _blist_place(self, v)
            else:
                node.band = <uint8_t>band
            v = node.parent

    cdef void _set_priority(self, int32_t v, int32_t priority, double expiry) noexcept nogil:
        """Give node ``v`` (not a root) ``priority`` until ``expiry`` (INFINITY: for good); it
        becomes the most recently used of its list, and its ancestors are kept above it."""
        _move(self, v, priority)
        _set_expiry(self, v, expiry)
        _lift(self, v)

    cdef void _decay(self, double now) noexcept nogil:
        """Priorities that expired by ``now`` go back to the default."""
        cdef Expiry top
        cdef RNode *node
        while self._heap_size and self._heap[0].at <= now:
            top = self._heap[0]
            _heap_pop(self)
            node = &self._nodes[top.node]
            if top.node >= self._high_water or node.parent < 0:
                continue
            if node.expiry == top.at:
                self._set_priority(top.node, DEFAULT_PRIORITY, INFINITY)
            elif top.at < node.expiry < INFINITY and _heap_push(self, node.expiry, top.node):
                node.expiry = INFINITY  # extended since: due later (out of memory: kept)

    cdef Py_ssize_t _path_blocks(self, int32_t v, int32_t *dest) noexcept nogil:
        """Write the block ids of the path ending at ``v`` to ``dest`` (root side first); returns
        how many."""
        cdef RNode *node = &self._nodes[v]
        cdef Py_ssize_t total = node.depth + node.length
        while node.parent >= 0:
            memcpy(dest + node.depth, node.chunk.blocks + node.start, node.length * sizeof(int32_t))
            node = &self._nodes[node.parent]
        return total

    cdef void _path_tokens(self, int32_t v, int32_t *dest, Py_ssize_t blocks) noexcept nogil:
        """Write the token ids of the first ``blocks`` blocks of the path ending at ``v`` to
        ``dest``."""
        cdef RNode *node = &self._nodes[v]
        cdef Py_ssize_t bs = self._block_size, end
        while node.parent >= 0:
            if node.depth < blocks:
                end = min(<Py_ssize_t>node.depth + node.length, blocks)
                memcpy(dest + node.depth * bs, _run_tokens(self, node), (end - node.depth) * bs * sizeof(int32_t))
            node = &self._nodes[node.parent]

    cdef Py_ssize_t _trim(self, Py_ssize_t n, int32_t *dest, int32_t *token_dest, uint64_t *hash_dest,
                          int32_t split_below=0, bint *below=NULL) noexcept nogil:
        """Drop up to ``n`` blocks, least recently used first, from the tails of leaf runs; write
        their ids to ``dest`` (and, unless NULL, their tokens to ``token_dest`` and the content
        hashes their chunk keeps to ``hash_dest``, 0 where it keeps none) and return how many (-1:
        the LRU head was not a leaf, an invariant broke). Tags at trimmed ends go to the evicted
        tags. With ``below``: the blocks dropped are all below priority ``split_below`` or all at
        or above it (the call stops where the next victim's side differs), ``below[0]`` says which."""
        cdef Py_ssize_t count = 0, take
        cdef int32_t v, q, li
        cdef int64_t key, stamp, limit
        cdef bint low
        cdef RNode *node
        if self._heap_size and self._heap[0].at <= self._now():
            self._decay(self._now())
        while count < n:
            v = self._victim()
            if v < 0:
                break
            node = &self._nodes[v]
            if node.num_children != 0:
                # A child outranks it (not expected: _lift keeps parents at least as high):
                # it takes the next rank up until it is a leaf.
                q = _lowest_list(self, node.priority)
                if q < 0:
                    return -1
                self._set_priority(v, q, INFINITY)
                continue
            if below != NULL:
                low = node.priority < split_below
                if count == 0:
                    below[0] = low
                elif low != below[0]:
                    break
            take = min(<Py_ssize_t>node.length, n - count)
            if self._branch_exact and _in_branch(self, node):
                # (branch-lru-exact) Its blocks' keys rise by one per block trimmed: it goes on while
                # they stay first. (branch-lru trims the whole run: the heads' runs overlap in key and
                # would otherwise go one block from each in turn.)
                li = _blist(node)
                _brunner_up(self, li, &key, &stamp)
                if key != INT64_MAX:
                    limit = key - self._bkey[li]
                    if self._stamps[v] + limit < stamp:
                        limit += 1
                    if limit < take:
                        take = <Py_ssize_t>limit
            self._trim_leaf(v, take, dest + count, token_dest, hash_dest, count)
            count += take
        return count

    # -- KV cache groups: a leaf trimmed to a chosen end (the groups' eviction picks the end) --

    cdef void _trim_leaf(self, int32_t v, Py_ssize_t take, int32_t *dest, int32_t *token_dest, uint64_t *hash_dest,
                         Py_ssize_t at) noexcept nogil:
        """Drop the last ``take`` blocks of leaf ``v`` (off the protected part of the trie; all of
        them: the node goes), writing their ids to ``dest`` and, unless NULL, their tokens to
        ``token_dest`` and hashes to ``hash_dest`` at entry ``at``. Its tag goes to the evicted tags."""
        cdef Py_ssize_t bs = self._block_size
        cdef RNode *node = &self._nodes[v]
        memcpy(dest, node.chunk.blocks + node.start + node.length - take, take * sizeof(int32_t))
        if token_dest != NULL:
            memcpy(
                token_dest + at * bs, node.chunk.tokens + (node.start + node.length - take) * bs,
                take * bs * sizeof(int32_t),
            )
        if hash_dest != NULL:
            _copy_hashes(hash_dest + at, node.chunk, node.start + node.length - take, take)
        if node.tag >= 0:
            self._evicted_tags[self._num_evicted_tags] = node.tag
            self._num_evicted_tags += 1
            node.tag = -1
        if take == node.length:
            _lru_remove(self, v)
            _remove_leaf(self, v)
        else:
            node.length -= <int32_t>take
            self._lru_blocks -= take
            self._num_blocks -= take
            if _in_branch(self, node):
                self._stamps[v] += take  # its last block now is the one after them
                if node.lru_prev < 0:
                    _bset(self, _blist(node), v)

    cdef Py_ssize_t _drop_subtree(
        self, int32_t top, int32_t *dest, int32_t *token_dest, uint64_t *hash_dest
    ) noexcept nogil:
        """Drop ``top`` and every node below it (none of them may be protected: ``top``'s lock
        count is 0), writing their block ids to ``dest`` (and tokens to ``token_dest`` unless NULL),
        deepest first; returns how many blocks (-1: out of memory, nothing dropped). The LRU lists
        hold exactly these nodes among others and, taken lowest first, list children before
        parents, so one pass over them removes each node once its children are gone. Tags go to the evicted tags."""
        cdef uint8_t *state
        cdef Py_ssize_t count = 0
        cdef int32_t v, after
        if self._branch:
            return _drop_branch(self, top, dest, token_dest, hash_dest)
        state = <uint8_t *>calloc(self._high_water + 1, sizeof(uint8_t))
        if state == NULL:
            return -1
        state[top] = 1  # 1: inside the subtree, 2: outside, 0: not yet known
        v = _lru_after(self, -1)
        while v >= 0:
            after = _lru_after(self, v)
            if _inside(self, state, v) == 1:
                count = _take_leaf(self, v, dest, token_dest, hash_dest, count)
            v = after
        free(state)
        return count

    cdef void _clear(self) noexcept nogil:
        """Drop every node (pinned ones too); their tags go to the evicted tags."""
        cdef Py_ssize_t i
        for i in range(self._high_water):
            if self._nodes[i].parent >= 0:
                if self._nodes[i].tag >= 0:
                    self._evicted_tags[self._num_evicted_tags] = self._nodes[i].tag
                    self._num_evicted_tags += 1
                chunk_decref(&self._chunks, self._nodes[i].chunk)
        memset(self._buckets, 0xFF, self._capacity * sizeof(int32_t))
        self._high_water = 0
        self._num_free_slots = 0
        self._free_head = -1
        self._num_nodes = 0
        self._num_roots = 0
        self._num_blocks = 0
        memset(self._heads, 0xFF, sizeof(self._heads))
        memset(self._tails, 0xFF, sizeof(self._tails))
        self._listed[0] = 0
        self._listed[1] = 0
        self._lru_blocks = 0
        self._heap_size = 0
        _branch_reset(self)

    cdef dict _chunk_bytes(self):
        """(Lock held) bytes of the chunks cached runs lie in: ``chunks`` (headers and block-id
        arrays), ``tokens`` (token arrays), ``hashes``; a chunk shared by runs counts once."""
        cdef Py_ssize_t i, chunk_bytes = 0, token_bytes = 0, hash_bytes = 0
        cdef Chunk *chunk
        seen = set()
        for i in range(self._high_water):
            if self._nodes[i].parent >= 0 and self._nodes[i].chunk != NULL:
                chunk = self._nodes[i].chunk
                if <size_t>chunk in seen:
                    continue
                seen.add(<size_t>chunk)
                chunk_bytes += sizeof(Chunk) + chunk.block_capacity * self._chunks.num_groups * sizeof(int32_t)
                token_bytes += chunk.token_capacity * sizeof(int32_t)
                if chunk.hashes != NULL:
                    hash_bytes += chunk.block_capacity * sizeof(uint64_t)
        return {"chunks": chunk_bytes, "tokens": token_bytes, "hashes": hash_bytes}

    cdef list _marked_nodes(self, const uint8_t *mark):
        """(Lock held) the nodes neither pinned nor above a pinned node that hold a block marked
        in ``mark`` (indexed by block id)."""
        cdef Py_ssize_t i, j
        cdef RNode *node
        found = []
        for i in range(self._high_water):
            node = &self._nodes[i]
            if node.parent < 0 or node.lock_count > 0:
                continue
            for j in range(node.length):
                if mark[node.chunk.blocks[node.start + j]]:
                    found.append(i)
                    break
        return found

    cdef int32_t _cut_at_mark(self, int32_t v, const uint8_t *mark) noexcept nogil:
        """The run of node ``v`` from its first marked block on, as a node of its own (``v``, its
        head cut off if it has unmarked blocks before it): the top of a subtree to drop. -1 when
        ``v`` is no longer an unprotected node with a marked block, -2 when out of memory."""
        cdef RNode *node
        cdef int32_t j = 0
        if v >= self._high_water:
            return -1
        node = &self._nodes[v]
        if node.parent < 0 or node.lock_count > 0:
            return -1
        while j < node.length and not mark[node.chunk.blocks[node.start + j]]:
            j += 1
        if j == node.length:
            return -1
        if j > 0:
            if self._reserve(1):
                return -2
            self._split(v, j)  # the head keeps the blocks before the marked one
        return v

    # -- content hashes of cached blocks (kept in their chunks while the owner asks for them) --

    cdef const uint64_t *_hash_tail(self, int32_t v, Py_ssize_t count, int64_t *key, uint64_t *parent,
                                    bint *has_parent, uint64_t *copy_hashes=NULL,
                                    int32_t *copy_tokens=NULL) noexcept nogil:
        """Hash the last ``count`` blocks of node ``v`` into its chunk, at the blocks' positions,
        chained from the block before them; returns their hashes (NULL when out of memory), with
        the root's key, the hash before them and whether a cached block precedes them. With
        ``copy_hashes`` and ``copy_tokens`` (an event log entry's room), the hashes and the
        blocks' tokens are also written there, in the same pass over the tokens."""
        cdef RNode *node = &self._nodes[v]
        cdef RNode *up = node
        cdef Py_ssize_t bs = self._block_size, first = node.start + node.length - count
        cdef uint64_t *hashes = _chunk_hashes(node.chunk)
        if hashes == NULL:
            return NULL
        while up.parent >= 0:
            up = &self._nodes[up.parent]
        key[0] = <int64_t>up.key
        has_parent[0] = True
        if count < node.length:
            parent[0] = hashes[first - 1]
        else:
            up = &self._nodes[node.parent]
            if up.parent < 0:
                parent[0] = lc_root_hash(key[0])
                has_parent[0] = False
            else:
                parent[0] = _last_hash(up)
        if copy_tokens != NULL:
            lc_content_hashes_copy(parent[0], node.chunk.tokens + first * bs, count, bs, self._keys, hashes + first,
                                   copy_hashes, copy_tokens)
        else:
            lc_content_hashes(parent[0], node.chunk.tokens + first * bs, count, bs, self._keys, hashes + first)
        return hashes + first

    cdef int _hash_all(self) except -1:
        """The content hash of every cached block, parents before children; 1 when out of memory."""
        cdef Py_ssize_t i, bs = self._block_size
        cdef RNode *node
        cdef RNode *up
        cdef uint64_t parent
        cdef uint64_t *hashes
        order = sorted(
            (self._nodes[i].depth, i) for i in range(self._high_water) if self._nodes[i].parent >= 0
        )
        for _, i in order:
            node = &self._nodes[i]
            hashes = _chunk_hashes(node.chunk)
            if hashes == NULL:
                return 1
            up = &self._nodes[node.parent]
            parent = lc_root_hash(<int64_t>up.key) if up.parent < 0 else _last_hash(up)
            lc_content_hashes(parent, node.chunk.tokens + node.start * bs, node.length, bs, self._keys,
                              hashes + node.start)
        return 0

    cdef str _hash_problem(self):
        """(Lock held, hashes kept) every cached block's hash follows from the one before it on
        its path and its own tokens (so, by induction, every one is the content hash of its
        path); the first that does not, or None."""
        cdef Py_ssize_t i, j, bs = self._block_size
        cdef RNode *node
        cdef RNode *up
        cdef uint64_t parent
        for i in range(self._high_water):
            node = &self._nodes[i]
            if node.parent < 0:
                continue
            if node.chunk.hashes == NULL:
                return f"node {i} keeps no content hashes"
            up = &self._nodes[node.parent]
            parent = lc_root_hash(<int64_t>up.key) if up.parent < 0 else _last_hash(up)
            for j in range(node.start, node.start + node.length):
                parent = lc_fmix64(lc_nh_block(node.chunk.tokens + j * bs, bs, self._keys)) + parent * LC_GOLDEN
                if node.chunk.hashes[j] != parent:
                    return f"cached block {node.chunk.blocks[j]} (node {i}) has a stale content hash"
        return None

    cdef int32_t _tag_at(self, int32_t v, Py_ssize_t blocks) noexcept nogil:
        """The tag at exactly ``blocks`` blocks along the path ending at node ``v`` (-1 when no
        node ends there, or it has none)."""
        cdef RNode *node
        while v >= 0:
            node = &self._nodes[v]
            if node.parent < 0 or node.depth + node.length < blocks:
                return -1
            if node.depth + node.length == blocks:
                return node.tag
            v = node.parent
        return -1

    # -- checking --

    def check_invariants(self):
        """Recount the trie from scratch; raise ``InvariantViolation`` on any mismatch.

        Checked: free slots and live nodes partition the used slots; every node's parent is live,
        its depth continues its parent's run, its run lies inside its chunk, it is found under its
        parent by its first block, and its lock count is its pins plus its protected children;
        roots are found by their adapter key and have children; the counters match a recount;
        the LRU list is doubly linked, holds exactly the unprotected nodes, lists every node after
        its children, and its block count matches.
        """
        lc_enter_gil(self._lock)
        try:
            problem = self._problem()
        finally:
            lc_leave(self._lock, NULL)
        if problem:
            raise InvariantViolation(f"RadixTrie: {problem}")

    cdef str _problem(self):
        """(Lock held) the first inconsistency found, or None."""
        cdef Py_ssize_t hw = self._high_water
        cdef Py_ssize_t *scratch = <Py_ssize_t *>malloc((3 * hw + 1) * sizeof(Py_ssize_t))
        cdef Py_ssize_t i
        if scratch == NULL:
            raise MemoryError("check_invariants: cannot allocate its scratch tables")
        try:
            memset(scratch, 0, 2 * hw * sizeof(Py_ssize_t))
            for i in range(2 * hw, 3 * hw):
                scratch[i] = -1
            return self._recount(scratch, scratch + hw, scratch + 2 * hw)
        finally:
            free(scratch)

    cdef str _recount(self, Py_ssize_t *children, Py_ssize_t *protected_children, Py_ssize_t *lru_pos):
        cdef Py_ssize_t hw = self._high_water, bs = self._block_size
        cdef Py_ssize_t i, steps, live = 0, nodes = 0, roots = 0, blocks = 0, lru_blocks = 0
        cdef int32_t v, p, prev, q
        cdef RNode *node
        cdef RNode *up
        if hw > self._capacity or self._num_free_slots > hw:
            return f"{hw} used slots and {self._num_free_slots} free ones for capacity {self._capacity}"
        v = self._free_head
        steps = 0
        while v >= 0:
            if v >= hw or self._nodes[v].parent != FREE_PARENT or steps > hw:
                return f"free list reaches slot {v}, which is not an unused slot"
            steps += 1
            v = self._nodes[v].hash_next
        if steps != self._num_free_slots:
            return f"free list holds {steps} slots, its counter says {self._num_free_slots}"
        for i in range(hw):
            node = &self._nodes[i]
            if node.parent == FREE_PARENT:
                continue
            live += 1
            if node.parent == ROOT_PARENT:
                roots += 1
                if node.length != 0 or node.chunk != NULL:
                    return f"root {i} holds a run of {node.length} blocks"
                if self._find_root(<int64_t>node.key) != i:
                    return f"root {i} is not found by its adapter key {<int64_t>node.key}"
                continue
            nodes += 1
            p = node.parent
            if p >= hw or self._nodes[p].parent == FREE_PARENT:
                return f"node {i} has parent {p}, which is not a live node"
            up = &self._nodes[p]
            children[p] += 1
            blocks += node.length
            if node.length < 1 or node.chunk == NULL:
                return f"node {i} holds {node.length} blocks"
            if node.start < 0 or node.start + node.length > node.chunk.block_capacity:
                return (
                    f"node {i} runs over blocks [{node.start}, {node.start + node.length}) "
                    f"of a chunk of {node.chunk.block_capacity}"
                )
            if (<Py_ssize_t>node.start + node.length) * bs > node.chunk.token_capacity:
                return f"node {i} runs past its chunk's {node.chunk.token_capacity} tokens"
            if node.chunk.refs < 1:
                return f"node {i} holds a chunk with {node.chunk.refs} references"
            if node.depth != up.depth + up.length:
                return f"node {i} starts at block {node.depth} but its parent {p} ends at {up.depth + up.length}"
            if node.key != _child_key(self, p, _run_tokens(self, node)):
                return f"node {i} has a key that does not match its parent and first block"
            if _find_child(self, p, _run_tokens(self, node)) != i:
                return f"node {i} is not found under its parent {p} by its first block"
            if node.pin_count < 0 or node.lock_count < node.pin_count:
                return f"node {i} has pin count {node.pin_count} and lock count {node.lock_count}"
            if node.lock_count > 0 and up.parent != ROOT_PARENT:
                protected_children[p] += 1
        if live + self._num_free_slots != hw:
            return f"{live} live nodes and {self._num_free_slots} free slots do not add up to {hw} used slots"
        if nodes != self._num_nodes or roots != self._num_roots or blocks != self._num_blocks:
            return (
                f"recount finds {nodes} nodes, {roots} roots and {blocks} blocks; counters say "
                f"{self._num_nodes}, {self._num_roots} and {self._num_blocks}"
            )
        steps = 0
        for i in range(self._bucket_mask + 1):
            v = self._buckets[i]
            prev = -1
            while v >= 0:
                steps += 1
                if steps > live:
                    return "hash chains hold more entries than live nodes (a cycle)"
                if self._nodes[v].hash_prev != prev:
                    return f"node {v} in bucket {i} points back to {self._nodes[v].hash_prev}, not {prev}"
                prev = v
                v = self._nodes[v].hash_next
        if steps != live:
            return f"hash chains hold {steps} entries for {live} live nodes"
        for i in range(hw):
            node = &self._nodes[i]
            if node.parent == FREE_PARENT:
                continue
            if node.num_children != children[i]:
                return f"node {i} counts {node.num_children} children, recount finds {children[i]}"
            if node.parent == ROOT_PARENT:
                if node.num_children == 0:
                    return f"root {i} has no children but was kept"
                continue
            if node.lock_count != node.pin_count + protected_children[i]:
                return (
                    f"node {i} has lock count {node.lock_count}, expected pins {node.pin_count} "
                    f"+ protected children {protected_children[i]}"
                )
        steps = 0
        for q in range(NUM_LISTS):
            if self._branch and q == DEFAULT_PRIORITY:
                problem = self._branch_problem(lru_pos, &steps, &lru_blocks)
                if problem is not None:
                    return problem
                continue
            v = self._heads[q]
            prev = -1
            if (v >= 0) != (((self._listed[q >> 6] >> (q & 63)) & 1) == 1):
                return f"list {q} has head {v} but its bit says otherwise"
            while v >= 0:
                if v >= hw or self._nodes[v].parent < 0 or lru_pos[v] >= 0:
                    return f"LRU list {q} reaches slot {v}, which is not a node (or twice)"
                if self._nodes[v].lru_prev != prev:
                    return f"LRU node {v} points back to {self._nodes[v].lru_prev}, not {prev}"
                if self._nodes[v].lock_count != 0:
                    return f"LRU node {v} is protected (lock count {self._nodes[v].lock_count})"
                if self._nodes[v].priority != q:
                    return f"node {v} of priority {self._nodes[v].priority} is on list {q}"
                lru_pos[v] = steps
                lru_blocks += self._nodes[v].length
                steps += 1
                prev = v
                v = self._nodes[v].lru_next
            if prev != self._tails[q]:
                return f"LRU list {q} has tail {self._tails[q]} but ends at {prev}"
        if lru_blocks != self._lru_blocks:
            return f"LRU lists hold {lru_blocks} evictable blocks, the counter says {self._lru_blocks}"
        for i in range(hw):
            node = &self._nodes[i]
            if node.parent < 0:
                continue
            if node.lock_count == 0 and lru_pos[i] < 0:
                return f"unprotected node {i} is missing from the LRU list"
            p = node.parent
            up = &self._nodes[p]
            if self._branch and up.parent >= 0 and (up.reuses < node.reuses or up.band < node.band):
                return (
                    f"node {p} has reuse class {up.reuses} and band {up.band}, below its child {i}'s "
                    f"{node.reuses} and {node.band}"
                )
            if (
                self._branch and up.parent >= 0 and lru_pos[p] >= 0 and up.priority == DEFAULT_PRIORITY
                and node.priority == DEFAULT_PRIORITY
            ):
                if self._stamps[p] < self._stamps[i] + node.length:
                    return f"node {p} has stamp {self._stamps[p]}, not after its child {i}'s last block"
                continue
            if self._nodes[p].parent >= 0 and lru_pos[p] >= 0 and lru_pos[p] < lru_pos[i]:
                return f"node {p} precedes its child {i} in the LRU list"
        return None

    cdef str _branch_problem(self, Py_ssize_t *lru_pos, Py_ssize_t *steps, Py_ssize_t *lru_blocks):
        """(branch-lru) The default priority's lists: linked, each node on its class's list in
        stamp order, heads' keys and the tournament right."""
        cdef Py_ssize_t hw = self._high_water, li, nonempty = 0, i
        cdef int32_t v, prev, best = -1
        cdef int16_t a, b
        cdef RNode *node
        for li in range(BRANCH_LISTS):
            v = self._bheads[li]
            prev = -1
            if v >= 0:
                nonempty += 1
                if best < 0 or _bbefore(self, <int32_t>li, best):
                    best = <int32_t>li
            if self._bkey[li] != (INT64_MAX if v < 0 else self._stamps[v] + self._bconst[li]):
                return f"branch-lru list {li} keeps head key {self._bkey[li]}, not its head {v}'s"
            while v >= 0:
                if v >= hw or self._nodes[v].parent < 0 or lru_pos[v] >= 0:
                    return f"branch-lru list {li} reaches slot {v}, which is not a node (or twice)"
                node = &self._nodes[v]
                if node.lru_prev != prev:
                    return f"LRU node {v} points back to {node.lru_prev}, not {prev}"
                if node.lock_count != 0:
                    return f"LRU node {v} is protected (lock count {node.lock_count})"
                if node.priority != DEFAULT_PRIORITY or _blist(node) != li:
                    return f"node {v} (priority {node.priority}, list {_blist(node)}) is on branch-lru list {li}"
                if prev >= 0 and self._stamps[v] < self._stamps[prev] + self._nodes[prev].length:
                    return f"branch-lru list {li}: node {v}'s stamp {self._stamps[v]} is not after node {prev}'s"
                if self._stamps[v] + node.length > self._tick:
                    return f"node {v}'s stamp {self._stamps[v]} is past the stamps handed out ({self._tick})"
                lru_pos[v] = steps[0]
                lru_blocks[0] += node.length
                steps[0] += 1
                prev = v
                v = node.lru_next
            if prev != self._btails[li]:
                return f"branch-lru list {li} has tail {self._btails[li]} but ends at {prev}"
        if nonempty != self._bnonempty:
            return f"{nonempty} branch-lru lists hold nodes, the counter says {self._bnonempty}"
        if (nonempty > 0) != (((self._listed[DEFAULT_PRIORITY >> 6] >> (DEFAULT_PRIORITY & 63)) & 1) == 1):
            return f"{nonempty} branch-lru lists hold nodes but the default priority's bit says otherwise"
        for i in range(BRANCH_LISTS - 1, 0, -1):
            a = self._btree[2 * i]
            b = self._btree[2 * i + 1]
            if self._btree[i] != (a if _bbefore(self, a, b) else b):
                return f"the branch-lru tournament's entry {i} is stale"
        if nonempty and self._bkey[self._btree[1]] != self._bkey[best]:
            return f"the branch-lru tournament picks list {self._btree[1]}, not {best}"
        return None
