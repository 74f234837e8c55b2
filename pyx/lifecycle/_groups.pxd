# KV cache groups of a KV cache core, module lifecycle._groups: the attention rule of each group
# (full, sliding window, chunked local), its own BlockPool, and the locked steps the core runs for
# every group in its own calls. Everything here is guarded by the core's lock; the core owns the
# one ``KVGroups`` (None when it has one group).

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

from lifecycle._blockpool cimport REFUSAL_NONE, BatchResult, BlockPool
from lifecycle._evlog cimport EventLog
from lifecycle._radix cimport RadixTrie
from lifecycle._records cimport Failure, Records, SeqRec
from lifecycle._retention cimport Retention


cdef enum:
    KIND_FULL = 0
    KIND_SLIDING = 1
    KIND_CHUNKED = 2


cdef struct GroupRule:
    int32_t kind
    int32_t window             # sliding window or chunk, tokens (0: full)
    int32_t sink_blocks        # leading blocks a sliding window always keeps


# Per group counters (group 0's: what the groups' own eviction did to it; the core counts the rest).
cdef struct GroupCounts:
    int64_t allocated
    int64_t freed
    int64_t released           # blocks that left a window or chunk (freed or kept at a checkpoint)
    int64_t kept               # of those, kept by their record for a checkpoint
    int64_t to_cache           # of those, left to the cache (on the record's cached path): evictable now
    int64_t evicted


# A windowed group's cached blocks, by block id: where the trie holds each, and the blocks only
# the cache holds (cache-only: evictable one by one) on two LRU lists by when they became so:
# ordinary ones, then the kept ones (sink blocks, the windows before checkpoints, windows that
# served a hit), which go last.
cdef struct GroupCache:
    int32_t **where            # the trie entry holding the block (NULL: not cached)
    int32_t *owner             # the node of that entry (RadixTrie._split keeps it: _owners)
    int32_t *prev
    int32_t *next
    uint8_t *listed            # 0: on no list, 1: the ordinary list, 2: the kept list
    uint8_t *kept              # which list it joins once cache-only
    int32_t head[2]
    int32_t tail[2]
    Py_ssize_t count[2]


@cython.final
cdef class KVGroups:
    cdef Py_ssize_t n               # groups, group 0 (the core's pool) included
    cdef GroupRule *_rules
    cdef PyObject **_pools          # borrowed from _keep
    cdef tuple _keep
    cdef tuple _specs               # (kind, window, sink_tokens) per group
    cdef GroupCounts *_counts
    cdef Py_ssize_t _block_size
    cdef Py_ssize_t _retention      # checkpoint every this many blocks (0: none)
    cdef int32_t *_ids              # scratch: one column of block ids
    cdef Py_ssize_t _ids_capacity
    cdef int32_t *_trimmed          # scratch: group 0's ids of trimmed blocks
    cdef Py_ssize_t _trimmed_capacity
    cdef uint64_t *_hashes          # scratch: content hashes of removed blocks
    cdef Py_ssize_t _hashes_capacity
    cdef EventLog _evlog            # the core's, once its events are on (None: off)
    cdef Records records            # the core's (whose pins are live sequences')
    cdef readonly bint windowed     # some group releases blocks (sliding window or chunked local)
    cdef Py_ssize_t _release_unit   # tokens: a group releases blocks only when kv_tokens // this moves
    cdef readonly bint shared       # every group takes its ids from group 0's pool (one id space, vLLM's)
    cdef bint quiet                 # (the core's reset) evictions are not logged one by one
    cdef int32_t _settled           # the leaf the last _settle_below left at a cut every group serves (-1: none)
    cdef Py_ssize_t fail_in         # (tests) the fail_in-th growth of the scratch from now fails (0: none)
    cdef int32_t pad                # what a decode step writes where a window released a block (the null block, or -1)
    cdef GroupCache *_cache         # per group (windowed ones track their cached blocks; others: where NULL)
    cdef int32_t **_owners          # per group, its GroupCache.owner (NULL: untracked), for the trie's splits
    cdef Retention retention        # the core's (whose pins keep their runs whole)

    cdef inline BlockPool pool_of(self, Py_ssize_t g):
        return <BlockPool>self._pools[g]

    cdef inline Py_ssize_t num_free(self, Py_ssize_t g) noexcept nogil:
        return (<BlockPool>self._pools[g])._num_free

    cdef inline Py_ssize_t first_needed(self, Py_ssize_t g, Py_ssize_t tokens) noexcept nogil:
        """The first block (past the sink blocks) a query at token ``tokens`` reads in group ``g``."""
        cdef GroupRule *r = &self._rules[g]
        cdef Py_ssize_t t
        if r.kind == KIND_SLIDING:
            t = tokens - r.window + 1
            return t // self._block_size if t > 0 else 0
        if r.kind == KIND_CHUNKED:
            return (tokens // r.window) * r.window // self._block_size
        return 0

    cdef inline bint at_checkpoint(self, Py_ssize_t g, Py_ssize_t p) noexcept nogil:
        """Whether block ``p`` lies in the window before the first checkpoint above it."""
        cdef Py_ssize_t c
        if self._retention <= 0:
            return False
        c = (p // self._retention + 1) * self._retention
        return self.first_needed(g, c * self._block_size) <= p

    cdef inline Py_ssize_t released_to(self, Py_ssize_t g, SeqRec *rec) noexcept nogil:
        """Blocks below this one (past the sink blocks) left the record's window or chunk in group ``g``."""
        if self._rules[g].kind == KIND_FULL:
            return 0
        return self.first_needed(g, (rec.kv_tokens // self._block_size) * self._block_size)

    cdef inline bint holds(self, SeqRec *rec, Py_ssize_t g, Py_ssize_t p, Py_ssize_t released) noexcept nogil:
        """Whether the record holds a reference on its entry ``p`` of group ``g`` (when it is >= 0;
        ``released``: ``released_to``). Past its cached path an entry is its own; on the path it
        may be the trie's too (a chunk the record shares with its cached run), and the record
        holds only what its window still reads: the entries it released stay as the cache's."""
        return p >= rec.pin_blocks or p < self._rules[g].sink_blocks or p >= released

    # (lock held)
    cdef void log_to(self, EventLog log) noexcept
    cdef int _reserve(self, Py_ssize_t blocks) noexcept nogil
    cdef void fail_growth(self, Py_ssize_t n) noexcept
    cdef void _track(self, Py_ssize_t g, int32_t *entry, Py_ssize_t p, int32_t node) noexcept nogil
    cdef void _untrack(self, Py_ssize_t g, int32_t b) noexcept nogil
    cdef void _offer(self, Py_ssize_t g, int32_t b) noexcept nogil
    cdef Py_ssize_t punch(self, RadixTrie t, Py_ssize_t g, Py_ssize_t n, Py_ssize_t *freed0, Py_ssize_t *trimmed,
                          Failure *f) noexcept nogil
    cdef int cache(self, RadixTrie t, SeqRec *rec, Py_ssize_t d, int32_t v, Py_ssize_t pos, Py_ssize_t full,
                   int32_t leaf, Failure *f) noexcept nogil
    cdef void _log_kept(self, RadixTrie t, int32_t v, Py_ssize_t g, Py_ssize_t start, Py_ssize_t stop,
                        Py_ssize_t end) noexcept nogil
    cdef Py_ssize_t best_cut(self, RadixTrie t, int32_t v, Py_ssize_t limit, Py_ssize_t low,
                             bint settled=*) noexcept nogil
    cdef Py_ssize_t _group_cut(self, RadixTrie t, int32_t v, Py_ssize_t g, Py_ssize_t cut,
                               Py_ssize_t low, bint settled) noexcept nogil
    cdef Py_ssize_t _first_missing(self, RadixTrie t, int32_t v, Py_ssize_t g, Py_ssize_t stop) noexcept nogil
    cdef int attach(self, RadixTrie t, int32_t end, SeqRec *rec, Py_ssize_t cut, Failure *f) noexcept nogil
    cdef int grow(self, RadixTrie t, SeqRec *rec, Py_ssize_t num_blocks, Failure *f) noexcept nogil
    cdef void ungrow(self, SeqRec *rec, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t groups) noexcept nogil
    cdef int _release_moved(self, SeqRec *rec, Py_ssize_t tokens, int32_t **tables, Py_ssize_t row,
                            Failure *f) noexcept nogil

    cdef inline int release(self, SeqRec *rec, Py_ssize_t tokens, int32_t **tables, Py_ssize_t row,
                            Failure *f) noexcept nogil:
        """The record's KV now covers ``tokens`` tokens (``_release_moved``'s full rule). Inline
        for the call of nearly every decode step, in which no group can release a block (no
        whole block moved; with chunked groups alone, no chunk boundary passed): it only sets
        ``kv_tokens``."""
        if tokens <= rec.kv_tokens:
            return 0
        if not self.windowed or tokens // self._release_unit <= rec.kv_tokens // self._release_unit:
            rec.kv_tokens = <int32_t>tokens
            return 0
        return self._release_moved(rec, tokens, tables, row, f)
    cdef Py_ssize_t _pinned_only(self, RadixTrie t, Py_ssize_t g) noexcept nogil
    cdef char *_retention_pinned(self, RadixTrie t) noexcept nogil
    cdef void _flush0(self, Py_ssize_t count, Py_ssize_t *freed0, Py_ssize_t *trimmed, Failure *f) noexcept nogil
    cdef void settle_all(self, RadixTrie t, Failure *f) noexcept nogil
    cdef int release_all(self, SeqRec *rec, Failure *f) noexcept nogil
    cdef int finish(self, RadixTrie t, SeqRec *rec, int32_t v, Py_ssize_t pos, Py_ssize_t full, int32_t leaf,
                    Failure *f) noexcept nogil
    cdef Py_ssize_t _drop_column(self, SeqRec *rec, Py_ssize_t g, Py_ssize_t start, Py_ssize_t stop,
                                 Failure *f) noexcept nogil
    cdef Py_ssize_t _unref(self, Py_ssize_t g, Py_ssize_t count, Failure *f) noexcept nogil
    cdef Py_ssize_t _release_cached(self, Py_ssize_t g, const int32_t *col, Py_ssize_t low, Py_ssize_t stop,
                                    int32_t *row_ids, Py_ssize_t *to_cache, Failure *f) noexcept nogil
    cdef Py_ssize_t _free_listed(self, Py_ssize_t g, Py_ssize_t count, Failure *f) noexcept nogil
    cdef int _trim_to(self, RadixTrie t, int32_t v, Py_ssize_t cut, Py_ssize_t *freed0, Py_ssize_t *trimmed,
                      Failure *f) noexcept nogil
    cdef int settle_leaf(self, RadixTrie t, int32_t v, Py_ssize_t *freed0, Py_ssize_t *trimmed,
                         Failure *f) noexcept nogil
    cdef int _settle_below(self, RadixTrie t, int32_t v, Py_ssize_t limit, Py_ssize_t *freed0,
                           Py_ssize_t *trimmed, Failure *f) noexcept nogil
    cdef Py_ssize_t evict(self, RadixTrie t, Py_ssize_t g, Py_ssize_t n, Py_ssize_t *freed0, Py_ssize_t *trimmed,
                          Failure *f) noexcept nogil
    cdef void write_rows(self, SeqRec *rec, int32_t **tables, Py_ssize_t row, Py_ssize_t start,
                         Py_ssize_t stop) noexcept nogil
    # (GIL held, lock held)
    cdef str problem(self, RadixTrie t, Records records, int32_t null_block)
    cdef str count_refs(self, RadixTrie t, Records records, Py_ssize_t g, int64_t[::1] expected, Py_ssize_t nb)
    cdef str _cache_problem(self, RadixTrie t, Py_ssize_t g)
    cdef list stats(self, RadixTrie t)
    cdef object column(self, SeqRec *rec, Py_ssize_t g)
    # (GIL held, lock released: each takes it)
    cdef int append(self, Records records, int64_t handle, object tokens, Py_ssize_t kv_tokens=*) except -1
    cdef object table(self, Records records, int64_t handle, Py_ssize_t g, str call)
    cdef Py_ssize_t write_table(self, Records records, int64_t handle, int32_t[::1] dest, object pad,
                                Py_ssize_t g) except -1


cdef int32_t **group_tables(object tables, Py_ssize_t count, object table) except NULL
cdef Py_ssize_t group_index(object group, Py_ssize_t n, str call) except -1
cdef list one_group_stats(BlockPool pool, RadixTrie t)
cdef KVGroups new_groups(BlockPool pool, Py_ssize_t block_size, object groups, object retention_interval,
                         Py_ssize_t max_tokens)
