# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False
"""Refcounted prefix trie over KV blocks, on C arrays.

One node per full block of ``block_size`` tokens, under one root per adapter key (an int64 the
model derives from adapter name + generation; 0 = no adapter). A child is found through one hash
table keyed by (parent node, hash of the block's tokens) and accepted only after its stored tokens
compare equal to the query's, so a hash collision can never hand out another prefix's block.

The trie knows nothing of the block pool: block ids go in, block ids come out; the caller keeps
the refcounts (``lifecycle.prefix_cache.PrefixCache`` does).

Eviction order is kept incrementally. Every node that is neither pinned nor an ancestor of a
pinned node sits on one intrusive doubly-linked list ordered from least to most recently used, and
every node on it comes after all of its descendants (they are touched, inserted and released
deepest first). So the head is always an unpinned leaf and ``evict`` is O(1) per node, with no scan.

Every call runs its C part with the GIL released under the trie's own lock.
"""

cimport cython
cimport numpy as cnp
from cpython.pythread cimport (
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
)
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memmove, memset

import numpy as np

from lifecycle.errors import (
    BlockIdOutOfRange,
    ConfigError,
    DoubleFree,
    InvalidId,
    InvariantViolation,
)

cnp.import_array()

from lifecycle._int32 cimport (
    adapter_key as _adapter_key,
    empty_int32 as _empty_int32,
    int32_vector as _int32_fast,
    shrink as _shrink,
)

cdef enum:
    ROOT_PARENT = -1        # parent field of an adapter root
    FREE_PARENT = -2        # parent field of an unused slot
    MIN_CAPACITY = 64
    MAX_BLOCK_SIZE = 1 << 20


cdef extern from *:
    # GCC/Clang builtin: start loading a cache line now, without waiting for it.
    void __builtin_prefetch(const void *address) noexcept nogil


cdef enum:
    WALK_WINDOW = 16        # blocks hashed and prefetched ahead of the walk at a time


# -- hashing --------------------------------------------------------------------------------

cdef inline uint64_t _mix(uint64_t h) noexcept nogil:
    # The 64-bit finalizer of MurmurHash3: every input bit reaches every output bit.
    h ^= h >> 33
    h *= 0xFF51AFD7ED558CCDULL
    h ^= h >> 33
    h *= 0xC4CEB9FE1A85EC53ULL
    h ^= h >> 33
    return h


cdef extern from *:
    """
    /* NH (the UMAC inner hash) of one block: the sum of (t[2i] + k[2i]) * (t[2i+1] + k[2i+1]) over
     * the token pairs, as 32x32->64 products mod 2^64; an odd last token pairs with k[n]. With
     * SSE2 (every x86-64) four tokens go per step: one add of the keys, and one multiply that forms
     * both products of the step (pmuludq pairs lane 0 with 1 and lane 2 with 3). The sum does not
     * depend on the grouping, so the vector and the scalar paths give the same value. */
    #include <string.h>
    /* The vector paths need SSE2 and 64-bit lanes moved to general registers (x86-64 only). */
    #if defined(__SSE2__) && (defined(__x86_64__) || defined(_M_X64))
    #define LC_NH_SSE2 1
    #include <emmintrin.h>
    #else
    #define LC_NH_SSE2 0
    #endif
    #if LC_NH_SSE2
    static inline __m128i lc_nh_step(__m128i sum, const int32_t *t, const uint32_t *k) {
        __m128i x = _mm_add_epi32(_mm_loadu_si128((const __m128i *)t), _mm_loadu_si128((const __m128i *)k));
        return _mm_add_epi64(sum, _mm_mul_epu32(x, _mm_srli_epi64(x, 32)));
    }
    #endif
    static inline uint64_t lc_nh_block(const int32_t *t, Py_ssize_t n, const uint32_t *k) {
        uint64_t acc = 0;
        Py_ssize_t i = 0;
    #if LC_NH_SSE2
        __m128i sum = _mm_setzero_si128();
        if (n == 16) {  /* the usual block size, unrolled */
            sum = lc_nh_step(lc_nh_step(lc_nh_step(lc_nh_step(sum, t, k), t + 4, k + 4), t + 8, k + 8), t + 12, k + 12);
            i = 16;
        } else {
            for (; i + 4 <= n; i += 4)
                sum = lc_nh_step(sum, t + i, k + i);
        }
        acc = (uint64_t)_mm_cvtsi128_si64(sum) + (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(sum, sum));
    #endif
        for (; i + 2 <= n; i += 2)
            acc += (uint64_t)((uint32_t)t[i] + k[i]) * (uint64_t)((uint32_t)t[i + 1] + k[i + 1]);
        if (i < n)
            acc += (uint64_t)((uint32_t)t[i] + k[i]) * (uint64_t)k[n];
        return acc;
    }

    /* Whether two blocks of n tokens are equal; 16 tokens (the usual block size) as four vector
     * compares instead of a call to memcmp. */
    static inline int lc_tokens_equal(const int32_t *a, const int32_t *b, Py_ssize_t n) {
    #if LC_NH_SSE2
        if (n == 16) {
            __m128i e0 = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)a), _mm_loadu_si128((const __m128i *)b));
            __m128i e1 = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(a + 4)), _mm_loadu_si128((const __m128i *)(b + 4)));
            __m128i e2 = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(a + 8)), _mm_loadu_si128((const __m128i *)(b + 8)));
            __m128i e3 = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(a + 12)), _mm_loadu_si128((const __m128i *)(b + 12)));
            return _mm_movemask_epi8(_mm_and_si128(_mm_and_si128(e0, e1), _mm_and_si128(e2, e3))) == 0xFFFF;
        }
    #endif
        return memcmp(a, b, (size_t)n * sizeof(int32_t)) == 0;
    }

    /* Copy one block of n tokens; 16 tokens as a fixed-size copy the compiler inlines. */
    static inline void lc_copy_tokens(int32_t *dest, const int32_t *src, Py_ssize_t n) {
        if (n == 16)
            memcpy(dest, src, 16 * sizeof(int32_t));
        else
            memcpy(dest, src, (size_t)n * sizeof(int32_t));
    }
    """
    bint lc_tokens_equal(const int32_t *a, const int32_t *b, Py_ssize_t n) noexcept nogil
    void lc_copy_tokens(int32_t *dest, const int32_t *src, Py_ssize_t n) noexcept nogil
    uint64_t lc_nh_block(const int32_t *tokens, Py_ssize_t n, const uint32_t *keys) noexcept nogil


cdef inline uint64_t _block_hash(
    uint64_t parent_hash, const int32_t *tokens, Py_ssize_t block_size, const uint32_t *keys,
    uint64_t mask
) noexcept nogil:
    # The key of a node is chained from its parent's key, like a rolling prefix hash, so every
    # block hash of a query is known before the walk and the walk can prefetch ahead. Only the
    # block's own NH goes through the finalizer; the chain itself is one multiply-add, so hashing
    # the blocks of a window is not one long serial chain of finalizers. A collision costs only a
    # token compare: matches are decided by (parent, tokens), never by the hash.
    return (_mix(lc_nh_block(tokens, block_size, keys)) + parent_hash * 0x9E3779B97F4A7C15ULL) & mask


cdef void _fill_hash_keys(uint32_t *keys, Py_ssize_t n) noexcept nogil:
    # Fixed keys (splitmix64 of a constant seed): the same tokens hash alike in every process.
    cdef uint64_t state = 0x243F6A8885A308D3ULL
    cdef uint64_t z
    cdef Py_ssize_t i
    for i in range(n):
        state += 0x9E3779B97F4A7C15ULL
        z = state
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
        keys[i] = <uint32_t>((z ^ (z >> 31)) >> 32)


cdef inline Py_ssize_t _bucket_of(PrefixTrie t, int32_t v) noexcept nogil:
    cdef TrieNode *node = &t._nodes[v]
    if node.parent == ROOT_PARENT:
        return <Py_ssize_t>(_mix(node.key_hash) & <uint64_t>t._bucket_mask)
    return <Py_ssize_t>(node.key_hash & <uint64_t>t._bucket_mask)


# -- locking ---------------------------------------------------------------------------------

cdef inline void _acquire(PrefixTrie t) noexcept nogil:
    PyThread_acquire_lock(t._lock, WAIT_LOCK)


cdef inline void _release(PrefixTrie t) noexcept nogil:
    PyThread_release_lock(t._lock)


# -- argument coercion (GIL held) -------------------------------------------------------------



cdef object _coerce_int32(object values, str what, int64_t lowest):
    """Any 1-D sequence of ints in [lowest, INT32_MAX] -> a C-contiguous int32 array."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidId(f"{what} must be a 1-D sequence of ints, got {values!r}") from error
    if array.ndim != 1:
        raise InvalidId(f"{what} must be a 1-D sequence of ints, got shape {array.shape}")
    if array.size == 0:
        return np.empty(0, dtype=np.int32)
    if array.dtype.kind == "O":
        # Ints too large for any numpy integer type end up here.
        for value in array:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidId(f"{what} must be ints, got {value!r}")
            if not lowest <= value <= INT32_MAX:
                raise InvalidId(f"{what}: {value} is outside [{lowest}, {INT32_MAX}]")
        return array.astype(np.int32)
    if array.dtype.kind not in "iu":
        raise InvalidId(f"{what} must be ints, got an array of dtype {array.dtype}")
    outside = np.flatnonzero((array < lowest) | (array > INT32_MAX))
    if outside.size:
        raise InvalidId(f"{what}: {int(array[outside[0]])} is outside [{lowest}, {INT32_MAX}]")
    return np.ascontiguousarray(array, dtype=np.int32)






cdef inline cnp.ndarray _int32_array(const int32_t *source, Py_ssize_t n):
    cdef cnp.ndarray out = _empty_int32(n)
    if n:
        memcpy(cnp.PyArray_DATA(out), source, n * sizeof(int32_t))
    return out


cdef inline int32_t *_data(cnp.ndarray array) noexcept:
    return <int32_t *>cnp.PyArray_DATA(array)




# -- node slots, hash chains and the LRU list (lock held, GIL released) -------------------------

cdef inline bint _is_cached_node(PrefixTrie t, int64_t v) noexcept nogil:
    return 0 <= v < t._high_water and t._nodes[v].parent >= 0


cdef inline int32_t _take_slot(PrefixTrie t) noexcept nogil:
    # The caller reserved capacity beforehand, so a slot is always there. Unused slots are chained
    # through hash_next, most recently freed first (the warmest).
    cdef int32_t v = t._free_head
    if v >= 0:
        t._free_head = t._nodes[v].hash_next
        t._num_free_slots -= 1
        if t._free_head >= 0:
            __builtin_prefetch(&t._nodes[t._free_head])
        return v
    v = <int32_t>t._high_water
    t._high_water += 1
    return v


cdef inline void _return_slot(PrefixTrie t, int32_t v) noexcept nogil:
    cdef TrieNode *node = &t._nodes[v]
    node.parent = FREE_PARENT
    node.block_id = -1
    node.tag = -1
    node.hash_prev = -1
    node.hash_next = t._free_head
    t._free_head = v
    t._num_free_slots += 1


cdef inline void _chain_link(PrefixTrie t, int32_t v) noexcept nogil:
    cdef Py_ssize_t b = _bucket_of(t, v)
    cdef int32_t head = t._buckets[b]
    t._nodes[v].hash_next = head
    t._nodes[v].hash_prev = -1
    if head >= 0:
        t._nodes[head].hash_prev = v
    t._buckets[b] = v


cdef inline void _chain_unlink(PrefixTrie t, int32_t v) noexcept nogil:
    # Doubly linked: the LRU victim is usually behind newer nodes of its bucket, and walking to
    # it would cost a cache miss per node passed. Here the neighbours are only written.
    cdef int32_t prev = t._nodes[v].hash_prev
    cdef int32_t after = t._nodes[v].hash_next
    if prev >= 0:
        t._nodes[prev].hash_next = after
    else:
        t._buckets[_bucket_of(t, v)] = after
    if after >= 0:
        t._nodes[after].hash_prev = prev


cdef inline void _lru_append(PrefixTrie t, int32_t v) noexcept nogil:
    cdef TrieNode *node = &t._nodes[v]
    node.lru_prev = t._lru_tail
    node.lru_next = -1
    if t._lru_tail >= 0:
        t._nodes[t._lru_tail].lru_next = v
    else:
        t._lru_head = v
    t._lru_tail = v
    t._lru_count += 1


cdef inline void _lru_remove(PrefixTrie t, int32_t v) noexcept nogil:
    cdef TrieNode *node = &t._nodes[v]
    if node.lru_prev >= 0:
        t._nodes[node.lru_prev].lru_next = node.lru_next
    else:
        t._lru_head = node.lru_next
    if node.lru_next >= 0:
        t._nodes[node.lru_next].lru_prev = node.lru_prev
    else:
        t._lru_tail = node.lru_prev
    node.lru_prev = -1
    node.lru_next = -1
    t._lru_count -= 1


cdef inline void _protect(PrefixTrie t, int32_t v) noexcept nogil:
    # One more reason to keep v; a node that gains its first one leaves the LRU list and
    # becomes a reason for its parent. Stops at the first node that was already protected.
    cdef TrieNode *node
    while True:
        node = &t._nodes[v]
        node.lock_count += 1
        if node.lock_count != 1:
            return
        _lru_remove(t, v)
        v = node.parent
        if t._nodes[v].parent == ROOT_PARENT:
            return


cdef inline void _unprotect(PrefixTrie t, int32_t v) noexcept nogil:
    # Mirror of _protect: a node losing its last reason joins the MRU end, deepest first.
    cdef TrieNode *node
    while True:
        node = &t._nodes[v]
        node.lock_count -= 1
        if node.lock_count != 0:
            return
        _lru_append(t, v)
        v = node.parent
        if t._nodes[v].parent == ROOT_PARENT:
            return


cdef inline int32_t _find_root(PrefixTrie t, int64_t adapter) noexcept nogil:
    cdef uint64_t key = <uint64_t>adapter
    cdef int32_t v = t._buckets[<Py_ssize_t>(_mix(key) & <uint64_t>t._bucket_mask)]
    while v >= 0:
        if t._nodes[v].parent == ROOT_PARENT and t._nodes[v].key_hash == key:
            return v
        v = t._nodes[v].hash_next
    return -1


cdef inline int32_t _find_child(
    PrefixTrie t, int32_t parent, uint64_t h, const int32_t *tokens
) noexcept nogil:
    cdef int32_t v = t._buckets[<Py_ssize_t>(h & <uint64_t>t._bucket_mask)]
    cdef TrieNode *node
    while v >= 0:
        node = &t._nodes[v]
        # The exact token compare is what makes a match safe; the hash only narrows the search.
        if (
            node.key_hash == h
            and node.parent == parent
            and lc_tokens_equal(t._tokens + <Py_ssize_t>v * t._block_size, tokens, t._block_size)
        ):
            return v
        v = node.hash_next
    return -1


cdef inline Py_ssize_t _walk(
    PrefixTrie t, int32_t root, const int32_t *tokens, Py_ssize_t num_blocks, int32_t *path,
    uint64_t *hashes, Py_ssize_t *carried
) noexcept nogil:
    # Window by window: hash the blocks and prefetch their buckets, then prefetch the candidate
    # nodes and tokens, then walk. The cache misses of a window overlap instead of queueing.
    # ``hashes`` holds WALK_WINDOW entries; on return its first ``carried[0]`` entries are the
    # hashes of the blocks from the first unmatched one on (already computed, so that an insert
    # continuing from there need not hash them again).
    cdef Py_ssize_t bs = t._block_size
    cdef uint64_t h = t._nodes[root].key_hash
    cdef uint64_t bucket_mask = <uint64_t>t._bucket_mask
    cdef Py_ssize_t k = 0, j, width
    cdef int32_t node = root
    cdef int32_t v
    carried[0] = 0
    while k < num_blocks:
        width = min(<Py_ssize_t>WALK_WINDOW, num_blocks - k)
        for j in range(width):
            h = _block_hash(h, tokens + (k + j) * bs, bs, t._hash_keys, t._hash_mask)
            hashes[j] = h
            __builtin_prefetch(&t._buckets[h & bucket_mask])
        for j in range(width):
            v = t._buckets[hashes[j] & bucket_mask]
            if v >= 0:
                __builtin_prefetch(&t._nodes[v])
                __builtin_prefetch(t._tokens + <Py_ssize_t>v * bs)
                __builtin_prefetch(t._tokens + <Py_ssize_t>v * bs + bs - 1)
        for j in range(width):
            v = _find_child(t, node, hashes[j], tokens + (k + j) * bs)
            if v < 0:
                if j:
                    memmove(hashes, hashes + j, (width - j) * sizeof(uint64_t))
                carried[0] = width - j
                return k + j
            path[k + j] = v
            node = v
        k += width
    return k


cdef Py_ssize_t _check_known_prefix(
    PrefixTrie t, int32_t root, const int32_t *known, Py_ssize_t num_known, const int32_t *tokens
) noexcept nogil:
    # Index of the first entry that is not the node of its block on the path from root, or -1.
    cdef Py_ssize_t i
    cdef int32_t v, parent = root
    for i in range(num_known):
        v = known[i]
        if (
            root < 0
            or not _is_cached_node(t, v)
            or t._nodes[v].parent != parent
            or not lc_tokens_equal(t._tokens + <Py_ssize_t>v * t._block_size, tokens + i * t._block_size, t._block_size)
        ):
            return i
        parent = v
    return -1


cdef inline void _touch(PrefixTrie t, const int32_t *path, Py_ssize_t k) noexcept nogil:
    # Deepest first, so that each node lands after its descendants. Protected nodes form a prefix
    # of any path (a protected node's ancestors are protected), so the first one ends the walk.
    cdef Py_ssize_t i = k - 1
    cdef int32_t v
    while i >= 0:
        v = path[i]
        if t._nodes[v].lock_count != 0:
            return
        _lru_remove(t, v)
        _lru_append(t, v)
        i -= 1


cdef inline void _remove_leaf(PrefixTrie t, int32_t v) noexcept nogil:
    # v is off the LRU list already; drops it, and its root when that was the root's last child.
    cdef TrieNode *node = &t._nodes[v]
    cdef int32_t parent = node.parent
    if node.tag >= 0:
        t._evicted_tags[t._num_evicted_tags] = node.tag
        t._num_evicted_tags += 1
    _chain_unlink(t, v)
    _return_slot(t, v)
    t._num_cached -= 1
    t._nodes[parent].num_children -= 1
    if t._nodes[parent].parent == ROOT_PARENT and t._nodes[parent].num_children == 0:
        _chain_unlink(t, parent)
        _return_slot(t, parent)
        t._num_roots -= 1


cdef Outcome _pin_batch(PrefixTrie t, const int32_t *ids, Py_ssize_t n) noexcept nogil:
    # Validated in full before the first pin, so a refusal changes nothing.
    cdef Outcome out
    cdef Py_ssize_t i
    out.failure = FAIL_NONE
    out.index = 0
    out.value = 0
    for i in range(n):
        if not _is_cached_node(t, ids[i]):
            out.failure = FAIL_BAD_NODE
        elif t._nodes[ids[i]].pin_count > INT32_MAX - n:
            out.failure = FAIL_PIN_SATURATED
        if out.failure != FAIL_NONE:
            out.index = i
            out.value = ids[i]
            return out
    for i in range(n):
        t._nodes[ids[i]].pin_count += 1
        _protect(t, ids[i])
    return out


cdef Outcome _unpin_batch(PrefixTrie t, const int32_t *ids, Py_ssize_t n) noexcept nogil:
    # Applied as it goes (a batch may repeat a node) and undone in reverse on the first entry
    # that would go below zero; undoing in reverse restores the LRU list exactly.
    cdef Outcome out
    cdef Py_ssize_t i, j
    out.failure = FAIL_NONE
    out.index = 0
    out.value = 0
    for i in range(n):
        if not _is_cached_node(t, ids[i]):
            out.failure = FAIL_BAD_NODE
            out.index = i
            out.value = ids[i]
            return out
    for i in range(n):
        if t._nodes[ids[i]].pin_count == 0:
            out.failure = FAIL_UNPIN_ZERO
            out.index = i
            out.value = ids[i]
            j = i - 1
            while j >= 0:
                t._nodes[ids[j]].pin_count += 1
                _protect(t, ids[j])
                j -= 1
            return out
        t._nodes[ids[i]].pin_count -= 1
        _unprotect(t, ids[i])
    return out


@cython.final
@cython.auto_pickle(False)  # C tables: a pickled trie would be a second owner of the same blocks
cdef class PrefixTrie:
    """Cached whole-block token prefixes, one root per adapter key, LRU eviction of leaves."""

    def __cinit__(self, *args, **kwargs):
        # A usable empty trie (block size 1) even for an instance made by __new__ alone, so that
        # every method is memory-safe before __init__.
        self._block_size = 1
        self._hash_bits = 64
        self._hash_mask = 0xFFFFFFFFFFFFFFFFULL
        self._lru_head = -1
        self._lru_tail = -1
        self._free_head = -1
        self._lock = PyThread_allocate_lock()
        self._hash_keys = <uint32_t *>malloc(2 * sizeof(uint32_t))
        if self._hash_keys != NULL:
            _fill_hash_keys(self._hash_keys, 2)
        if self._lock == NULL or self._hash_keys == NULL or self._ensure_slots(MIN_CAPACITY):
            raise MemoryError("PrefixTrie: cannot allocate its lock and tables")

    def __init__(self, block_size, *, hash_bits=64, capacity=0):
        if self._initialized:
            raise ConfigError("this PrefixTrie is already initialized; make a new one")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")
        if isinstance(hash_bits, bool) or not isinstance(hash_bits, int) or not 0 <= hash_bits <= 64:
            raise ConfigError(f"hash_bits must be an int in [0, 64], got {hash_bits!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity <= INT32_MAX // 2:
            raise ConfigError(f"capacity must be an int in [0, {INT32_MAX // 2}], got {capacity!r}")
        cdef int32_t *tokens = <int32_t *>realloc(
            self._tokens, self._capacity * block_size * sizeof(int32_t)
        )
        if tokens == NULL:
            raise MemoryError(f"PrefixTrie: cannot allocate a token arena of block size {block_size}")
        self._tokens = tokens
        cdef uint32_t *keys = <uint32_t *>malloc((block_size + 1) * sizeof(uint32_t))
        if keys == NULL:
            raise MemoryError(f"PrefixTrie: cannot allocate hash keys for block size {block_size}")
        _fill_hash_keys(keys, block_size + 1)
        free(self._hash_keys)
        self._hash_keys = keys
        self._block_size = block_size
        self._hash_bits = hash_bits
        self._hash_mask = 0xFFFFFFFFFFFFFFFFULL if hash_bits == 64 else ((<uint64_t>1 << hash_bits) - 1)
        self._initialized = True
        if self._ensure_slots(capacity):
            raise MemoryError(f"PrefixTrie: cannot allocate tables for {capacity} nodes")

    def __dealloc__(self):
        free(self._nodes)
        free(self._tokens)
        free(self._buckets)
        free(self._evicted_tags)
        free(self._hash_keys)
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

    def __repr__(self):
        return (
            f"PrefixTrie(block_size={self._block_size}, cached={self._num_cached}, "
            f"evictable={self._lru_count}, adapters={self._num_roots})"
        )

    # -- growth (lock held; GIL may be held) --

    cdef int _ensure_slots(self, Py_ssize_t extra) noexcept nogil:
        """Room for ``extra`` more live nodes (and their evicted tags); 1 when out of memory."""
        cdef Py_ssize_t live = self._num_cached + self._num_roots
        cdef Py_ssize_t capacity = self._capacity
        cdef Py_ssize_t i
        cdef int32_t v
        cdef TrieNode *nodes
        cdef int32_t *tokens
        cdef int32_t *buckets
        cdef int32_t *tags
        # Every live node may add one tag before the next evicted_tags() call drains the buffer.
        cdef Py_ssize_t tags_needed = self._num_evicted_tags + live + extra
        if self._evicted_tags_capacity < tags_needed:
            tags = <int32_t *>realloc(self._evicted_tags, tags_needed * sizeof(int32_t))
            if tags == NULL:
                return 1
            self._evicted_tags = tags
            self._evicted_tags_capacity = tags_needed
        if live + extra <= capacity:
            return 0
        if capacity == 0:
            capacity = MIN_CAPACITY
        while capacity < live + extra:
            capacity *= 2
        if capacity > INT32_MAX:
            return 1
        nodes = <TrieNode *>realloc(self._nodes, capacity * sizeof(TrieNode))
        if nodes == NULL:
            return 1
        self._nodes = nodes
        tokens = <int32_t *>realloc(self._tokens, capacity * self._block_size * sizeof(int32_t))
        if tokens == NULL:
            return 1
        self._tokens = tokens
        # One bucket per node slot keeps chains short (load factor <= 1).
        buckets = <int32_t *>malloc(capacity * sizeof(int32_t))
        if buckets == NULL:
            return 1
        free(self._buckets)
        self._buckets = buckets
        self._capacity = capacity
        self._bucket_mask = capacity - 1
        memset(buckets, 0xFF, capacity * sizeof(int32_t))
        for i in range(self._high_water):
            v = <int32_t>i
            if self._nodes[v].parent != FREE_PARENT:
                _chain_link(self, v)
        return 0

    # -- queries --

    @property
    def block_size(self):
        """Tokens per block (and per node)."""
        return self._block_size

    @property
    def hash_bits(self):
        """Bits of the block hash kept (64 in production; fewer only to force collisions in tests)."""
        return self._hash_bits

    @property
    def num_cached_blocks(self):
        """Number of cached blocks (nodes, roots excluded)."""
        return self._num_cached

    @property
    def num_evictable_blocks(self):
        """Number of nodes that repeated ``evict`` calls could drop: neither pinned nor above a pin."""
        return self._lru_count

    @property
    def num_adapters(self):
        """Number of adapter roots with at least one cached block."""
        return self._num_roots

    @property
    def nbytes(self):
        """Bytes of C memory the trie holds now (nodes, token arena, buckets, evicted-tag buffer)."""
        return (
            self._capacity * (sizeof(TrieNode) + sizeof(int32_t) * (self._block_size + 1))
            + self._evicted_tags_capacity * sizeof(int32_t)
        )

    @staticmethod
    def metadata_bytes_per_block():
        """Bytes of metadata per node slot, tokens excluded: the node and its hash bucket."""
        return sizeof(TrieNode) + sizeof(int32_t)

    def reserve(self, Py_ssize_t num_blocks):
        """Grow the tables so that ``num_blocks`` blocks (plus one root each) fit without growing again."""
        cdef int failed
        if num_blocks < 0:
            raise InvalidId(f"reserve: the count {num_blocks} must be >= 0")
        with nogil:
            _acquire(self)
            failed = self._ensure_slots(max(0, num_blocks + 1 - self._num_cached - self._num_roots))
            _release(self)
        if failed:
            raise MemoryError(f"reserve: cannot grow the trie to {num_blocks} blocks")

    # -- the operations --

    def match(self, tokens, adapter=0, Py_ssize_t max_blocks=-1, *, bint pin=False):
        """The longest cached whole-block prefix of ``tokens`` under ``adapter``.

        Returns ``(block_ids, node_ids)``, one entry per matched block, root side first, at most
        ``max_blocks`` of them (-1 = no limit). Every block's tokens were compared exactly. The
        matched path becomes the most recently used; with ``pin=True`` each matched node is
        also pinned, atomically with the match (undo with ``unpin(node_ids)``).
        """
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0
        cdef Py_ssize_t num_blocks, k = 0
        cdef int64_t key = _adapter_key(adapter)
        cdef int32_t *path
        cdef int32_t *blocks
        cdef Outcome outcome
        outcome.failure = FAIL_NONE
        if max_blocks < -1:
            raise InvalidId(f"match: max_blocks {max_blocks} must be >= 0, or -1 for no limit")
        if not _int32_fast(tokens, &data, &n):
            tokens = _coerce_int32(tokens, "tokens", -(1 << 31))
            _int32_fast(tokens, &data, &n)
        num_blocks = n // self._block_size
        if 0 <= max_blocks < num_blocks:
            num_blocks = max_blocks
        node_ids = _empty_int32(num_blocks)
        block_ids = _empty_int32(num_blocks)
        path = _data(node_ids)
        blocks = _data(block_ids)
        with nogil:
            _acquire(self)
            k = self._match_locked(key, data, num_blocks, path, blocks, pin, &outcome)
            _release(self)
        if outcome.failure != FAIL_NONE:
            _raise_outcome(outcome, "match")
        if k < num_blocks:
            _shrink(node_ids, k)
            _shrink(block_ids, k)
        return block_ids, node_ids

    def pin(self, node_ids):
        """Pin each node once (a repeated id twice). A pinned node, and every ancestor of one,
        is never evicted. All or nothing: an id that is not a live cached node raises ``InvalidId``."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0
        cdef Outcome outcome
        if not _int32_fast(node_ids, &data, &n):
            node_ids = _coerce_int32(node_ids, "node ids", -(1 << 31))
            _int32_fast(node_ids, &data, &n)
        with nogil:
            _acquire(self)
            outcome = _pin_batch(self, data, n)
            _release(self)
        if outcome.failure != FAIL_NONE:
            _raise_outcome(outcome, "pin")

    def unpin(self, node_ids):
        """Remove one pin per entry. All or nothing: an unknown node raises ``InvalidId``, a pin count
        that would go below zero raises ``DoubleFree``, and the trie is left as it was."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0
        cdef Outcome outcome
        if not _int32_fast(node_ids, &data, &n):
            node_ids = _coerce_int32(node_ids, "node ids", -(1 << 31))
            _int32_fast(node_ids, &data, &n)
        with nogil:
            _acquire(self)
            outcome = _unpin_batch(self, data, n)
            _release(self)
        if outcome.failure != FAIL_NONE:
            _raise_outcome(outcome, "unpin")

    def pin_count(self, Py_ssize_t node_id):
        """Pins placed on ``node_id`` itself."""
        cdef int32_t count = -1
        with nogil:
            _acquire(self)
            if _is_cached_node(self, node_id):
                count = self._nodes[node_id].pin_count
            _release(self)
        if count < 0:
            raise InvalidId(f"node id {node_id} is not a cached node")
        return count

    def insert(self, tokens, block_ids, adapter=0, *, known_prefix=None):
        """Cache the ``len(block_ids)`` full blocks at the start of ``tokens`` under ``adapter``.

        Returns ``(taken, duplicates, node_ids)``: ``taken`` are the caller's block ids now held by
        new nodes (the caller's owner of refcounts gives the cache one reference on each);
        ``duplicates`` are the caller's block ids at positions whose node already existed — that
        node keeps its own block and the cache holds nothing of the caller's there; ``node_ids`` is
        the path, one node per block. ``taken`` is always a suffix of ``block_ids`` and
        ``duplicates`` the prefix before it. The path becomes the most recently used.

        ``known_prefix``: node ids of a path the caller already holds for these tokens (its pinned
        match). They are checked (live, linked from the adapter's root, same tokens) instead of
        looked up, and anything else raises ``InvalidId`` with the trie unchanged.
        """
        cdef const int32_t *token_data = NULL
        cdef const int32_t *block_data = NULL
        cdef Py_ssize_t num_tokens = 0, n = 0
        cdef int64_t key = _adapter_key(adapter)
        cdef Py_ssize_t k = 0, i
        cdef Py_ssize_t bs = self._block_size
        cdef int32_t *path
        cdef int failed = 0
        cdef const int32_t *known = NULL
        cdef Py_ssize_t num_known = 0
        cdef Py_ssize_t bad_known = -1
        if not _int32_fast(tokens, &token_data, &num_tokens):
            tokens = _coerce_int32(tokens, "tokens", -(1 << 31))
            _int32_fast(tokens, &token_data, &num_tokens)
        if not _int32_fast(block_ids, &block_data, &n):
            block_ids = _coerce_int32(block_ids, "block ids", 0)
            _int32_fast(block_ids, &block_data, &n)
        else:
            for i in range(n):
                if block_data[i] < 0:
                    raise BlockIdOutOfRange(f"insert: block id {block_data[i]} is negative")
        if n * bs > num_tokens:
            raise InvalidId(
                f"insert: {n} blocks need {n * bs} tokens but only {num_tokens} were given"
            )
        if known_prefix is not None:
            if not _int32_fast(known_prefix, &known, &num_known):
                known_prefix = _coerce_int32(known_prefix, "known prefix", -(1 << 31))
                _int32_fast(known_prefix, &known, &num_known)
            if num_known > n:
                raise InvalidId(f"insert: a known prefix of {num_known} nodes is longer than the {n} blocks")
        node_path = _empty_int32(n)
        path = _data(node_path)
        with nogil:
            _acquire(self)
            failed = self._insert_locked(key, token_data, block_data, n, known, num_known, path, &k, &bad_known)
            _release(self)
        if failed:
            raise MemoryError(f"insert: cannot grow the trie by {n} nodes")
        if bad_known >= 0:
            raise InvalidId(
                f"insert: known prefix entry {bad_known} (node id {known[bad_known]}) is not the cached "
                "node of that block on this path"
            )
        taken = _int32_array(block_data + k, n - k)
        duplicates = _int32_array(block_data, k)
        return taken, duplicates, node_path

    def evict(self, Py_ssize_t n):
        """Drop up to ``n`` cached blocks, least recently used first, and return their block ids.

        Only leaves go, and never a pinned node or an ancestor of one; a parent whose last child
        went becomes a leaf in its own place in the LRU order. Fewer than ``n`` come back when
        fewer are evictable. O(1) per dropped node.
        """
        cdef Py_ssize_t count = 0
        cdef int32_t v
        cdef int32_t *dest
        cdef Failure failure
        cdef Outcome outcome
        if n < 0:
            raise InvalidId(f"evict: the count {n} must be >= 0")
        if n > self._lru_count:
            n = self._lru_count
        out = _empty_int32(n)
        dest = _data(out)
        with nogil:
            _acquire(self)
            count = self._evict_locked(n, dest, &outcome)
            _release(self)
        failure = outcome.failure
        v = <int32_t>outcome.value
        if failure != FAIL_NONE:
            raise InvariantViolation(
                f"PrefixTrie: LRU head node {v} has {self._nodes[v].num_children} children "
                f"after {count} evictions"
            )
        return _shrink(out, count) if count < n else out

    def clear(self):
        """Drop every node, pinned or not, and return the block ids they held.

        Node ids handed out before become invalid; tags of dropped nodes go to ``evicted_tags``.
        """
        with nogil:
            _acquire(self)
        try:
            out = self._live_block_ids(True)
            with nogil:
                memset(self._buckets, 0xFF, self._capacity * sizeof(int32_t))
                self._high_water = 0
                self._num_free_slots = 0
                self._free_head = -1
                self._num_cached = 0
                self._num_roots = 0
                self._lru_head = -1
                self._lru_tail = -1
                self._lru_count = 0
        finally:
            _release(self)
        return out

    def cached_block_ids(self):
        """The block id of every cached node (a block cached at two nodes appears twice)."""
        with nogil:
            _acquire(self)
        try:
            return self._live_block_ids(False)
        finally:
            _release(self)

    cdef object _live_block_ids(self, bint take_tags):
        """(Lock held) the block id of every cached node, in slot order; with ``take_tags``, their
        tags also go to the evicted tags (the nodes are about to be dropped)."""
        cdef Py_ssize_t i, count = 0
        # Sized under the lock: another thread may have inserted since the call began.
        out = _empty_int32(self._num_cached)
        cdef int32_t *dest = _data(out)
        with nogil:
            for i in range(self._high_water):
                if self._nodes[i].parent >= 0:
                    dest[count] = self._nodes[i].block_id
                    count += 1
                    if take_tags and self._nodes[i].tag >= 0:
                        self._evicted_tags[self._num_evicted_tags] = self._nodes[i].tag
                        self._num_evicted_tags += 1
        return out

    def pin_counts(self):
        """``(node_ids, counts)`` of every node pinned at least once, for recounts from scratch."""
        cdef Py_ssize_t i, count = 0
        cdef int32_t *ids
        cdef int32_t *pins
        with nogil:
            _acquire(self)
        try:
            with nogil:
                for i in range(self._high_water):
                    if self._nodes[i].parent >= 0 and self._nodes[i].pin_count > 0:
                        count += 1
            node_ids = _empty_int32(count)
            pin_counts = _empty_int32(count)
            ids = _data(node_ids)
            pins = _data(pin_counts)
            count = 0
            with nogil:
                for i in range(self._high_water):
                    if self._nodes[i].parent >= 0 and self._nodes[i].pin_count > 0:
                        ids[count] = <int32_t>i
                        pins[count] = self._nodes[i].pin_count
                        count += 1
        finally:
            _release(self)
        return node_ids, pin_counts

    # -- tags (hybrid models: the SSM snapshot kept at a node) --

    def set_tag(self, Py_ssize_t node_id, Py_ssize_t tag):
        """Attach ``tag`` (>= 0) to a cached node, or clear it with -1."""
        cdef bint ok = False
        if not -1 <= tag <= INT32_MAX:
            raise InvalidId(f"set_tag: tag {tag} is outside [-1, {INT32_MAX}]")
        with nogil:
            _acquire(self)
            if _is_cached_node(self, node_id):
                self._nodes[node_id].tag = <int32_t>tag
                ok = True
            _release(self)
        if not ok:
            raise InvalidId(f"set_tag: node id {node_id} is not a cached node")

    def get_tag(self, Py_ssize_t node_id):
        """The node's tag, -1 when it has none."""
        cdef bint ok = False
        cdef int32_t tag = -1
        with nogil:
            _acquire(self)
            if _is_cached_node(self, node_id):
                tag = self._nodes[node_id].tag
                ok = True
            _release(self)
        if not ok:
            raise InvalidId(f"get_tag: node id {node_id} is not a cached node")
        return tag

    def evicted_tags(self):
        """Tags (>= 0) of the nodes evicted or cleared since the last call, oldest first; clears them."""
        with nogil:
            _acquire(self)
        try:
            out = _int32_array(self._evicted_tags, self._num_evicted_tags)
            self._num_evicted_tags = 0
        finally:
            with nogil:
                _release(self)
        return out

    def deepest_tagged(self, node_ids):
        """Index in ``node_ids`` of the deepest node that has a tag, or -1 if none has one."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, i, best = -1, bad = -1
        cdef int32_t best_depth = -1
        if not _int32_fast(node_ids, &data, &n):
            node_ids = _coerce_int32(node_ids, "node ids", -(1 << 31))
            _int32_fast(node_ids, &data, &n)
        with nogil:
            _acquire(self)
            for i in range(n):
                if not _is_cached_node(self, data[i]):
                    bad = i
                    break
                if self._nodes[data[i]].tag >= 0 and self._nodes[data[i]].depth > best_depth:
                    best = i
                    best_depth = self._nodes[data[i]].depth
            _release(self)
        if bad >= 0:
            raise InvalidId(f"deepest_tagged: node id {data[bad]} (entry {bad}) is not a cached node")
        return best

    cdef Py_ssize_t _match_locked(
        self, int64_t key, const int32_t *data, Py_ssize_t num_blocks, int32_t *path,
        int32_t *blocks, bint pin, Outcome *outcome
    ) noexcept nogil:
        # On a refused pin (saturated count) nothing is pinned, and 0 blocks are reported.
        cdef uint64_t hashes[WALK_WINDOW]
        cdef Py_ssize_t carried = 0
        cdef Py_ssize_t k = 0, i
        cdef int32_t root = _find_root(self, key)
        outcome.failure = FAIL_NONE
        if root < 0:
            return 0
        k = _walk(self, root, data, num_blocks, path, hashes, &carried)
        if pin:
            outcome[0] = _pin_batch(self, path, k)
            if outcome.failure != FAIL_NONE:
                return 0
        else:
            _touch(self, path, k)
        if blocks != NULL:
            for i in range(k):
                blocks[i] = self._nodes[path[i]].block_id
        return k

    cdef Outcome _pin_locked(self, const int32_t *ids, Py_ssize_t n) noexcept nogil:
        return _pin_batch(self, ids, n)

    cdef Outcome _unpin_locked(self, const int32_t *ids, Py_ssize_t n) noexcept nogil:
        return _unpin_batch(self, ids, n)

    cdef int _raise_failed(self, Outcome outcome, str call) except -1:
        _raise_outcome(outcome, call)
        return 0

    cdef int _insert_locked(
        self, int64_t key, const int32_t *token_data, const int32_t *block_data, Py_ssize_t n,
        const int32_t *known, Py_ssize_t num_known, int32_t *path, Py_ssize_t *matched,
        Py_ssize_t *bad_known_out
    ) noexcept nogil:
        cdef Py_ssize_t k = 0, i, width, j
        cdef Py_ssize_t bs = self._block_size
        cdef int32_t root = -1, parent, v
        cdef TrieNode *node
        cdef uint64_t h
        cdef int failed = 0
        cdef Py_ssize_t bad_known = -1
        cdef Py_ssize_t carried = 0
        cdef uint64_t hashes[WALK_WINDOW]
        failed = self._ensure_slots(n + 1)
        if self._free_head >= 0:
            __builtin_prefetch(&self._nodes[self._free_head])  # lands while the walk runs
        if not failed and num_known > 0:
            bad_known = _check_known_prefix(self, _find_root(self, key), known, num_known, token_data)
        if not failed and n > 0 and bad_known < 0:
            root = _find_root(self, key)
            if root < 0:
                root = _take_slot(self)
                node = &self._nodes[root]
                node.key_hash = <uint64_t>key
                node.parent = ROOT_PARENT
                node.block_id = -1
                node.pin_count = 0
                node.lock_count = 0
                node.num_children = 0
                node.lru_prev = -1
                node.lru_next = -1
                node.tag = -1
                node.depth = 0
                _chain_link(self, root)
                self._num_roots += 1
            if num_known > 0:
                memcpy(path, known, num_known * sizeof(int32_t))
                k = num_known + _walk(
                    self, known[num_known - 1], token_data + num_known * bs, n - num_known, path + num_known,
                    hashes, &carried
                )
            else:
                k = _walk(self, root, token_data, n, path, hashes, &carried)
            parent = path[k - 1] if k > 0 else root
            h = hashes[carried - 1] if carried else self._nodes[parent].key_hash
            i = k
            while i < n:
                # Hash a window ahead and prefetch its buckets: linking a node reads its
                # bucket's head, a likely cache miss otherwise. The walk's hashes past its last
                # match are reused (their buckets are prefetched already).
                width = min(<Py_ssize_t>WALK_WINDOW, n - i)
                for j in range(carried, width):
                    h = _block_hash(h, token_data + (i + j) * bs, bs, self._hash_keys, self._hash_mask)
                    hashes[j] = h
                    __builtin_prefetch(&self._buckets[h & <uint64_t>self._bucket_mask])
                carried = 0
                for j in range(width):
                    v = _take_slot(self)
                    node = &self._nodes[v]
                    node.key_hash = hashes[j]
                    node.parent = parent
                    node.block_id = block_data[i + j]
                    node.pin_count = 0
                    node.lock_count = 0
                    node.num_children = 0
                    node.lru_prev = -1
                    node.lru_next = -1
                    node.tag = -1
                    node.depth = self._nodes[parent].depth + 1
                    lc_copy_tokens(self._tokens + <Py_ssize_t>v * bs, token_data + (i + j) * bs, bs)
                    _chain_link(self, v)
                    self._nodes[parent].num_children += 1
                    self._num_cached += 1
                    path[i + j] = v
                    parent = v
                i += width
            # Deepest first: new nodes join the list, existing unprotected ones move to its end.
            i = n - 1
            while i >= k:
                _lru_append(self, path[i])
                i -= 1
            _touch(self, path, k)
        matched[0] = k
        bad_known_out[0] = bad_known
        return failed

    cdef Py_ssize_t _evict_locked(self, Py_ssize_t n, int32_t *dest, Outcome *outcome) noexcept nogil:
        cdef Py_ssize_t count = 0
        cdef int32_t v = -1, next_victim
        cdef Failure failure = FAIL_NONE
        while count < n and self._lru_head >= 0:
            v = self._lru_head
            if self._nodes[v].num_children != 0:
                failure = FAIL_NOT_A_LEAF
                break
            # Two steps ahead: the next victim's chain neighbours, and the node after it.
            next_victim = self._nodes[v].lru_next
            if next_victim >= 0 and count + 1 < n:
                if self._nodes[next_victim].hash_prev >= 0:
                    __builtin_prefetch(&self._nodes[self._nodes[next_victim].hash_prev])
                else:
                    __builtin_prefetch(&self._buckets[self._nodes[next_victim].key_hash & <uint64_t>self._bucket_mask])
                if self._nodes[next_victim].lru_next >= 0:
                    __builtin_prefetch(&self._nodes[self._nodes[next_victim].lru_next])
            _lru_remove(self, v)
            dest[count] = self._nodes[v].block_id
            count += 1
            _remove_leaf(self, v)
        outcome.failure = failure
        outcome.index = count
        outcome.value = v
        return count

    # -- checking --

    def check_invariants(self):
        """Recount the trie from scratch; raise ``InvariantViolation`` on any mismatch.

        Checked: free slots and live nodes partition the used slots; each node's parent is live,
        its depth is its parent's + 1, its child count and lock count match a recount, its hash
        matches its tokens and it can be found in its bucket; every root is found by its adapter
        key and has children; the LRU list is doubly linked, holds exactly the unprotected nodes,
        and lists every node after all of its children.
        """
        with nogil:
            _acquire(self)
        try:
            problem = self._find_problem()
        finally:
            with nogil:
                _release(self)
        if problem:
            raise InvariantViolation(f"PrefixTrie: {problem}")

    cdef str _find_problem(self):
        # Scratch per used slot: children recount, protected-children recount, LRU position,
        # and a mark for slots seen on the free stack.
        cdef Py_ssize_t hw = self._high_water
        cdef Py_ssize_t *scratch = <Py_ssize_t *>malloc((3 * hw + 1) * sizeof(Py_ssize_t))
        cdef unsigned char *on_free_stack = <unsigned char *>malloc(hw + 1)
        if scratch == NULL or on_free_stack == NULL:
            free(scratch)
            free(on_free_stack)
            raise MemoryError("check_invariants: cannot allocate its scratch tables")
        try:
            memset(scratch, 0, 2 * hw * sizeof(Py_ssize_t))
            memset(on_free_stack, 0, hw)
            for i in range(2 * hw, 3 * hw):
                scratch[i] = -1
            return self._recount(scratch, scratch + hw, scratch + 2 * hw, on_free_stack)
        finally:
            free(scratch)
            free(on_free_stack)

    cdef str _recount(
        self, Py_ssize_t *children, Py_ssize_t *protected_children, Py_ssize_t *lru_pos,
        unsigned char *on_free_stack,
    ):
        cdef Py_ssize_t hw = self._high_water, bs = self._block_size
        cdef Py_ssize_t i, steps, live = 0, cached = 0, roots = 0, chained = 0
        cdef int32_t v, p, prev
        cdef TrieNode *node
        if hw > self._capacity or self._num_free_slots > hw:
            return f"{hw} used slots and {self._num_free_slots} free ones for capacity {self._capacity}"
        v = self._free_head
        steps = 0
        while v >= 0:
            if v >= hw or self._nodes[v].parent != FREE_PARENT or on_free_stack[v]:
                return f"free list reaches slot {v}, which is not an unused slot (or twice)"
            on_free_stack[v] = 1
            steps += 1
            v = self._nodes[v].hash_next
        if steps != self._num_free_slots:
            return f"free list holds {steps} slots, its counter says {self._num_free_slots}"
        for i in range(hw):
            node = &self._nodes[i]
            if node.parent == FREE_PARENT:
                if not on_free_stack[i]:
                    return f"unused slot {i} is not on the free list"
                continue
            live += 1
            if node.parent == ROOT_PARENT:
                roots += 1
                if node.depth != 0 or node.block_id != -1:
                    return f"root {i} has depth {node.depth} and block {node.block_id}"
                if _find_root(self, <int64_t>node.key_hash) != i:
                    return f"root {i} is not found by its adapter key {<int64_t>node.key_hash}"
                continue
            cached += 1
            p = node.parent
            if p >= hw or self._nodes[p].parent == FREE_PARENT:
                return f"node {i} has parent {p}, which is not a live node"
            children[p] += 1
            if node.depth != self._nodes[p].depth + 1:
                return f"node {i} has depth {node.depth} but its parent {p} has {self._nodes[p].depth}"
            if node.block_id < 0:
                return f"node {i} holds block id {node.block_id}"
            if node.pin_count < 0 or node.lock_count < node.pin_count:
                return f"node {i} has pin count {node.pin_count} and lock count {node.lock_count}"
            if node.key_hash != _block_hash(
                self._nodes[p].key_hash, self._tokens + i * bs, bs, self._hash_keys, self._hash_mask
            ):
                return f"node {i} has a hash that does not match its parent's and its tokens"
            if _find_child(self, p, node.key_hash, self._tokens + i * bs) != i:
                return f"node {i} is not found under its parent {p} by its tokens"
            if node.lock_count > 0 and self._nodes[p].parent != ROOT_PARENT:
                protected_children[p] += 1
        if live + self._num_free_slots != hw:
            return f"{live} live nodes and {self._num_free_slots} free slots do not add up to {hw} used slots"
        if cached != self._num_cached or roots != self._num_roots:
            return (
                f"recount finds {cached} cached nodes and {roots} roots, "
                f"counters say {self._num_cached} and {self._num_roots}"
            )
        for i in range(self._bucket_mask + 1):
            v = self._buckets[i]
            prev = -1
            while v >= 0:
                chained += 1
                if chained > live:
                    return "hash chains hold more entries than live nodes (a cycle)"
                if self._nodes[v].hash_prev != prev:
                    return f"node {v} in bucket {i} points back to {self._nodes[v].hash_prev}, not {prev}"
                prev = v
                v = self._nodes[v].hash_next
        if chained != live:
            return f"hash chains hold {chained} entries for {live} live nodes"
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
        v = self._lru_head
        prev = -1
        steps = 0
        while v >= 0:
            if v >= hw or self._nodes[v].parent < 0 or lru_pos[v] >= 0:
                return f"LRU list reaches slot {v}, which is not a cached node (or twice)"
            if self._nodes[v].lru_prev != prev:
                return f"LRU node {v} points back to {self._nodes[v].lru_prev}, not {prev}"
            if self._nodes[v].lock_count != 0:
                return f"LRU node {v} is protected (lock count {self._nodes[v].lock_count})"
            lru_pos[v] = steps
            steps += 1
            prev = v
            v = self._nodes[v].lru_next
        if prev != self._lru_tail:
            return f"LRU tail is {self._lru_tail} but the list ends at {prev}"
        if steps != self._lru_count:
            return f"LRU list holds {steps} nodes, its counter says {self._lru_count}"
        for i in range(hw):
            node = &self._nodes[i]
            if node.parent < 0:
                continue
            if node.lock_count == 0 and lru_pos[i] < 0:
                return f"unprotected node {i} is missing from the LRU list"
            p = node.parent
            if self._nodes[p].parent >= 0 and lru_pos[p] >= 0 and lru_pos[p] < lru_pos[i]:
                return f"node {p} precedes its child {i} in the LRU list"
        return None


cdef void _raise_outcome(Outcome outcome, str call) except *:
    if outcome.failure == FAIL_BAD_NODE:
        raise InvalidId(
            f"{call}: node id {outcome.value} (entry {outcome.index}) is not a cached node"
        )
    if outcome.failure == FAIL_UNPIN_ZERO:
        raise DoubleFree(
            f"{call}: node id {outcome.value} (entry {outcome.index}) has pin count 0 "
            "(unpinned more often than pinned)"
        )
    if outcome.failure == FAIL_PIN_SATURATED:
        raise InvalidId(f"{call}: node id {outcome.value} already has the maximum pin count {INT32_MAX}")
    raise InvariantViolation(f"{call}: failure {<int>outcome.failure}")
