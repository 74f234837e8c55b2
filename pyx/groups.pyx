# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""KV cache groups of a KV cache core (module lifecycle._groups).

A group is the layers that share one attention rule: ``full`` (every block of the context),
``sliding_window`` (the blocks covering the last ``window`` tokens, plus ``sink_tokens`` at the
start) or ``chunked_local`` (the blocks from the start of the current chunk of ``window`` tokens).
Group 0 is the core's own pool (full attention); each further group has a ``BlockPool`` of its
own, with the core's block size, so a trie position means the same tokens in every group.

The trie stays one trie over tokens. Each chunk (record or cached run) holds one column of block
ids per group (``chunk_column``); -1 marks a block a windowed group released or never needed.
Ownership per group is as for group 0: a record holds one reference on every id of its own
columns past its cached path, a cached run one on every id of its range. On its cached path a
record's column may be the trie's own entries (a chunk shared with the run it cached mid-life),
so there it holds only what its window still reads (``holds``): the entries it released stay as
the cache's.

The rules the core runs here, in its own calls and under its lock:

- a cut (a number of blocks admission reuses) is valid when every group has the blocks a query at
  the cut reads (``best_cut``);
- caching a live record (``cache``) inserts its computed blocks in every group's column;
- a record releases a windowed block once its tokens left the window or chunk: one on its cached
  path becomes a cache-only block, evictable; one off it is freed, unless it lies in the window
  before a checkpoint (every ``retention_interval`` tokens), which the record keeps for its finish;
- a finishing record leaves in the cache every block it has past its cached path, filling holes
  of the path it extends;
- a windowed group's cache-only blocks (``GroupCache``) are taken one by one when it is short,
  least recently left to the cache first, sink blocks, checkpoint windows and windows that served
  a hit last, never one a live sequence reads or a retention pin protects (``punch``);
- every unpinned leaf's own run holds the blocks a query at its end reads in every group: a leaf
  whose last window lost a block is trimmed to a valid cut in every group at once (a pinned one
  once its last pin goes); a hole an ancestor's run got can leave a short leaf's end unservable,
  and admission cuts such a hit back (``best_cut``) until eviction trims the leaf. Group 0's
  eviction trims a leaf to a valid cut in every group at once.
"""

cimport cython
cimport numpy as cnp
from cpython.mem cimport PyMem_Malloc
from cpython.object cimport PyObject
from libc.stdint cimport INT32_MAX, int32_t, uint8_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from lifecycle._args cimport ssize_arg as _as_count
from lifecycle._int32 cimport grow_array, token_vector, writeable_int32
from lifecycle._sync cimport PyThreadState
from lifecycle._radix cimport DEFAULT_PRIORITY, MAX_PRIORITY, RNode, chunk_column
from lifecycle._records cimport E_INVALID_ARG, E_INVARIANT, E_NO_MEMORY, E_OUT_OF_BLOCKS, E_REFUSED, FREE, OK, ok

import math

import numpy as np

from lifecycle.errors import ConfigError, InvalidId

cnp.import_array()

KINDS = ("full", "sliding_window", "chunked_local")
#: The least default retention interval, in tokens (and the default where the groups share one pool).
DEFAULT_RETENTION_TOKENS = 4096


cdef Py_ssize_t default_retention(list specs, Py_ssize_t block_size, bint shared):
    """The default checkpoint interval, in blocks, of groups ``specs`` over pools of their own: the
    least power of two of blocks, at least :data:`DEFAULT_RETENTION_TOKENS` tokens, at which the
    windows kept at checkpoints of as many cached tokens as group 0's pool holds fill at most half
    of each windowed group's pool (the other half holds the live windows and the last window of
    each finished run). A window of ``w`` blocks (sinks and one block more included) in a pool of
    ``c`` blocks beside group 0's ``f`` gives ``f * w / (2 * c)`` blocks: with pools sized for
    what sequences hold at once (:meth:`lifecycle.config.ModelConfig.memory_plan`), a wide window
    (Gemma 3's 1,024 tokens) checkpoints more rarely than a narrow one (gpt-oss's 128). Groups
    sharing one pool keep the least interval."""
    cdef Py_ssize_t least = max(DEFAULT_RETENTION_TOKENS // block_size, 1), need = least, blocks, interval, room
    cdef Py_ssize_t full = (<BlockPool>specs[0][3])._num_blocks
    if shared:
        return least
    for kind, window, sink, pool in specs[1:]:
        if kind == "full":
            continue
        blocks = (window + block_size - 1) // block_size + (sink + block_size - 1) // block_size + 1
        room = 2 * (<BlockPool>pool)._num_blocks
        need = max(need, (full * blocks + room - 1) // max(room, 1))
    interval = least
    while interval < need:
        interval *= 2
    return interval


cdef inline void _unlink_block(GroupCache *c, int32_t b) noexcept nogil:
    """Take block ``b`` off the eviction list it is on (if any)."""
    cdef Py_ssize_t q = c.listed[b] - 1
    if q < 0:
        return
    if c.prev[b] >= 0:
        c.next[c.prev[b]] = c.next[b]
    else:
        c.head[q] = c.next[b]
    if c.next[b] >= 0:
        c.prev[c.next[b]] = c.prev[b]
    else:
        c.tail[q] = c.prev[b]
    c.listed[b] = 0
    c.count[q] -= 1


cdef inline Py_ssize_t _first_needed(GroupRule *r, Py_ssize_t bs, Py_ssize_t tokens) noexcept nogil:
    """``KVGroups.first_needed`` of rule ``r`` at block size ``bs``."""
    cdef Py_ssize_t t
    if r.kind == KIND_SLIDING:
        t = tokens - r.window + 1
        return t // bs if t > 0 else 0
    if r.kind == KIND_CHUNKED:
        return (tokens // r.window) * r.window // bs
    return 0


cdef inline uint8_t _kept(GroupRule *r, Py_ssize_t bs, Py_ssize_t retention, Py_ssize_t p,
                          Py_ssize_t *seg) noexcept nogil:
    """Whether block ``p`` of a group of rule ``r`` is a kept one (``KVGroups._track``: a sink
    block, or one in the window before the first checkpoint above it). ``seg`` remembers the
    last checkpoint's interval (its end ``seg[0]``, its window's first block ``seg[1]``; start
    with ``seg[0] = 0``), so that a run of blocks computes it once per interval."""
    if p < r.sink_blocks:
        return 1
    if retention <= 0:
        return 0
    if p >= seg[0] or p < seg[0] - retention:
        seg[0] = (p // retention + 1) * retention
        seg[1] = _first_needed(r, bs, seg[0] * bs)
    return seg[1] <= p


cdef inline void _offer_run(GroupCache *c, const int32_t *refs, const int32_t *ids, Py_ssize_t count) noexcept nogil:
    """``KVGroups._offer`` of each of ``ids`` in turn (``refs``: the group's refcounts). The two
    lists' tails and counts live in locals for the run (with strict aliasing off, every int32
    store would reload them through ``c``) and go back to ``c`` around the rare unlink."""
    cdef int32_t **where = c.where
    cdef int32_t *nxt = c.next
    cdef int32_t *prv = c.prev
    cdef uint8_t *listed = c.listed
    cdef const uint8_t *kept = c.kept
    cdef Py_ssize_t i, q
    cdef Py_ssize_t added[2]
    cdef int32_t tails[2]
    cdef int32_t b, tail
    tails[0] = c.tail[0]
    tails[1] = c.tail[1]
    added[0] = added[1] = 0
    for i in range(count):
        b = ids[i]
        if where[b] == NULL or refs[b] != 1:
            continue
        if listed[b]:
            c.tail[0] = tails[0]
            c.tail[1] = tails[1]
            _unlink_block(c, b)
            tails[0] = c.tail[0]
            tails[1] = c.tail[1]
        q = kept[b] != 0
        tail = tails[q]
        prv[b] = tail
        nxt[b] = -1
        if tail >= 0:
            nxt[tail] = b
        else:
            c.head[q] = b
        tails[q] = b
        listed[b] = <uint8_t>(q + 1)
        added[q] += 1
    c.tail[0] = tails[0]
    c.tail[1] = tails[1]
    c.count[0] += added[0]
    c.count[1] += added[1]


cdef enum:
    _SPAN = 16  # ids _last_missing tests at once


cdef inline Py_ssize_t _last_missing(RadixTrie t, RNode **at, Py_ssize_t g, Py_ssize_t first,
                                     Py_ssize_t stop) noexcept nogil:
    """The last block in ``[first, stop)`` group ``g`` lacks on the path through ``at[0]`` (which
    covers ``stop``; left at the node holding the block found, or the last one looked at), else
    ``first - 1``. Within a node, downwards: ``_SPAN`` ids one by one, then runs of ``_SPAN``
    tested at once (their OR is negative when one is -1: a loop of fixed length the compiler
    vectorizes), the rest one by one."""
    cdef RNode *node = at[0]
    cdef Py_ssize_t lo, hi, p, k
    cdef int32_t acc
    cdef const int32_t *col
    hi = stop
    while hi > first:
        while hi <= node.depth:
            node = &t._nodes[node.parent]
        lo = max(first, <Py_ssize_t>node.depth)
        col = chunk_column(node.chunk, g) + node.start - node.depth
        # The first few one by one (holes often lie close together), then by runs.
        p = hi - 1
        while p >= max(lo, hi - _SPAN) and col[p] >= 0:
            p -= 1
        if p >= max(lo, hi - _SPAN):
            at[0] = node
            return p
        hi = p + 1
        while hi - lo >= _SPAN:
            acc = 0
            for k in range(_SPAN):
                acc |= col[hi - _SPAN + k]
            if acc < 0:
                break
            hi -= _SPAN
        p = hi - 1
        while p >= lo and col[p] >= 0:
            p -= 1
        if p >= lo:
            at[0] = node
            return p
        hi = lo
    at[0] = node
    return first - 1


cdef inline Py_ssize_t _missing_down(RadixTrie t, RNode **at, Py_ssize_t g, Py_ssize_t floor,
                                     Py_ssize_t stop) noexcept nogil:
    """The least ``c`` in ``[floor, stop]`` with every block of ``[c, stop)`` missing in group
    ``g`` on the path through ``at[0]`` (which covers ``stop - 1`` or lies below it; left at the
    node holding block ``c - 1`` when it was looked at). Downwards: ids one by one until a run of
    ``_SPAN`` fits, then runs of ``_SPAN`` tested at once (their AND is negative when all are -1)."""
    cdef RNode *node = at[0]
    cdef Py_ssize_t lo, c = stop, k
    cdef int32_t acc
    cdef const int32_t *col
    while c > floor:
        while c <= node.depth:
            node = &t._nodes[node.parent]
        lo = max(floor, <Py_ssize_t>node.depth)
        col = chunk_column(node.chunk, g) + node.start - node.depth
        while c - lo >= _SPAN:
            acc = -1
            for k in range(_SPAN):
                acc &= col[c - _SPAN + k]
            if acc >= 0:
                break
            c -= _SPAN
        while c > lo and col[c - 1] < 0:
            c -= 1
        if c > lo:
            break  # block c - 1 is there
    at[0] = node
    return c


cdef KVGroups new_groups(BlockPool pool, Py_ssize_t block_size, object groups, object retention_interval,
                         Py_ssize_t max_tokens):
    """The groups of a core over ``pool`` (group 0) and ``groups``: a sequence of
    ``(kind, window, sink_tokens, pool)``; refused with ``ConfigError`` naming the bad entry
    before anything is allocated."""
    cdef KVGroups self
    cdef Py_ssize_t i, n, retention
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__len__"):
        raise ConfigError(f"groups must be a sequence of (kind, window, sink_tokens, pool), got {groups!r}")
    specs = [("full", 0, 0, pool)]
    for i, entry in enumerate(groups, start=1):
        specs.append(_checked_spec(i, entry, block_size, max_tokens, [s[3] for s in specs]))
    shared = [s[3] is pool for s in specs[1:]]
    if any(shared) and not all(shared):
        raise ConfigError(
            f"group {shared.index(not shared[0]) + 1}: every group takes group 0's BlockPool (one id space) or every "
            "group has a pool of its own"
        )
    if retention_interval is None:
        retention = default_retention(specs, block_size, bool(shared) and all(shared))
    else:
        retention = _as_count(retention_interval, "retention_interval", 0, max(max_tokens, 0))
        if retention % block_size:
            raise ConfigError(
                f"retention_interval {retention} is not a multiple of the block size {block_size} (0: no checkpoints)"
            )
        retention //= block_size
    n = len(specs)
    self = KVGroups.__new__(KVGroups)
    self._rules = <GroupRule *>malloc(n * sizeof(GroupRule))
    self._pools = <PyObject **>malloc(n * sizeof(PyObject *))
    self._counts = <GroupCounts *>malloc(n * sizeof(GroupCounts))
    if self._rules == NULL or self._pools == NULL or self._counts == NULL:
        raise MemoryError("KVCacheCore: out of host memory for its KV cache groups")
    memset(self._counts, 0, n * sizeof(GroupCounts))
    self.n = n
    self._cache = <GroupCache *>calloc(n, sizeof(GroupCache))
    self._owners = <int32_t **>calloc(n, sizeof(int32_t *))
    if self._cache == NULL or self._owners == NULL:
        raise MemoryError("KVCacheCore: out of host memory for its KV cache groups")
    self._keep = tuple(s[3] for s in specs)
    for i in range(n):
        kind, window, sink, _ = specs[i]
        self._rules[i].kind = KINDS.index(kind)
        self._rules[i].window = <int32_t>window
        self._rules[i].sink_blocks = <int32_t>((sink + block_size - 1) // block_size)
        self._pools[i] = <PyObject *>self._keep[i]
        if self._rules[i].kind != KIND_FULL:
            self.windowed = True
            _new_cache(&self._cache[i], (<BlockPool>self._pools[i])._num_blocks)
            self._owners[i] = self._cache[i].owner
    self.n = n
    self.shared = all(shared)
    self._block_size = block_size
    # A sliding window releases a block whenever a whole block moves; a chunked group (its chunk
    # a multiple of the block) only when a chunk boundary passes, so with chunked groups alone
    # nothing can leave before kv_tokens passes a multiple of their chunks' greatest common divisor.
    unit = 0
    for i in range(1, n):
        if self._rules[i].kind == KIND_SLIDING or (
            self._rules[i].kind == KIND_CHUNKED and self._rules[i].window % block_size
        ):
            unit = block_size
            break
        if self._rules[i].kind == KIND_CHUNKED:
            unit = math.gcd(unit, self._rules[i].window)
    self._release_unit = unit if unit > 0 else block_size
    self._retention = retention
    self.pad = -1
    self._specs = tuple((s[0], s[1], s[2]) for s in specs)
    return self


cdef int _new_cache(GroupCache *c, Py_ssize_t nb) except -1:
    """The empty tracking of a windowed group of ``nb`` blocks."""
    cdef Py_ssize_t size = max(nb, <Py_ssize_t>1)
    c.where = <int32_t **>calloc(size, sizeof(int32_t *))
    c.owner = <int32_t *>calloc(size, sizeof(int32_t))
    c.prev = <int32_t *>calloc(size, sizeof(int32_t))
    c.next = <int32_t *>calloc(size, sizeof(int32_t))
    c.listed = <uint8_t *>calloc(size, sizeof(uint8_t))
    c.kept = <uint8_t *>calloc(size, sizeof(uint8_t))
    c.head[0] = c.head[1] = c.tail[0] = c.tail[1] = -1
    if c.where == NULL or c.owner == NULL or c.prev == NULL or c.next == NULL or c.listed == NULL or c.kept == NULL:
        raise MemoryError("KVCacheCore: out of host memory for its KV cache groups")
    return 0


cdef void _free_cache(GroupCache *c) noexcept:
    free(c.where)
    free(c.owner)
    free(c.prev)
    free(c.next)
    free(c.listed)
    free(c.kept)


cdef Py_ssize_t group_index(object group, Py_ssize_t n, str call) except -1:
    """A KV cache group index of a core with ``n`` groups, refused by name when it has no such group."""
    cdef Py_ssize_t g
    if isinstance(group, bool) or not hasattr(group, "__index__"):
        raise InvalidId(f"{call}: group must be an int, got {type(group).__name__}")
    g = group.__index__()
    if not 0 <= g < n:
        raise InvalidId(f"{call}: group {g} does not exist; this core has {n} KV cache group{'s' if n > 1 else ''}")
    return g


cdef list one_group_stats(BlockPool pool, RadixTrie t):
    """``KVCacheCore.group_stats`` of a core with one group (lock held; the core adds its counters)."""
    return [{
        "group": 0, "kind": "full", "window": 0, "sink_tokens": 0, "num_blocks": pool._num_blocks,
        "num_free": pool._num_free, "num_cached": t._num_blocks, "blocks_released": 0, "blocks_kept_at_checkpoints": 0,
        "blocks_released_to_cache": 0, "num_cache_only": 0,
    }]


cdef int32_t **group_tables(object tables, Py_ssize_t count, object table) except NULL:
    """The rows of a decode step's tables of the groups past 0 (PyMem_Malloc'd; the caller frees
    them): ``count`` writeable int32 arrays shaped as ``table`` (which must be given), which the
    caller holds while it writes."""
    cdef int32_t **rows
    cdef Py_ssize_t i
    if table is None:
        raise InvalidId("step: group_tables were given without a table for group 0")
    if len(tables) != count:
        raise InvalidId(f"step: {len(tables)} group_tables for the {count} KV cache groups past group 0")
    for i in range(count):
        writeable_int32(tables[i], 2, f"step: group_tables[{i}]", " (rows by request)")
        if tables[i].shape != table.shape:
            raise InvalidId(f"step: group_tables[{i}] is shaped {tables[i].shape}, the table {table.shape}")
    rows = <int32_t **>PyMem_Malloc(max(count, <Py_ssize_t>1) * sizeof(int32_t *))
    if rows == NULL:
        raise MemoryError("step: out of host memory")
    for i in range(count):
        rows[i] = <int32_t *>cnp.PyArray_DATA(<cnp.ndarray>tables[i])
    return rows


def _spec_count(object value, str what, Py_ssize_t low, Py_ssize_t high):
    """A count of a group's spec, refused with ``ConfigError`` naming it and its range."""
    try:
        return _as_count(value, what, low, high)
    except InvalidId as refused:
        raise ConfigError(str(refused)) from None


def _checked_spec(Py_ssize_t index, object entry, Py_ssize_t block_size, Py_ssize_t max_tokens, list pools):
    """One group's ``(kind, window, sink_tokens, pool)``, checked."""
    if not isinstance(entry, tuple) or len(entry) != 4:
        raise ConfigError(f"groups[{index - 1}] must be (kind, window, sink_tokens, pool), got {entry!r}")
    kind, window, sink, group_pool = entry
    if kind not in KINDS:
        raise ConfigError(f"group {index}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(group_pool, BlockPool):
        raise ConfigError(f"group {index}: a BlockPool of its own is needed, got {type(group_pool).__name__}")
    if group_pool is not pools[0] and any(group_pool is p for p in pools[1:]):
        raise ConfigError(f"group {index}: its BlockPool is another group's; only group 0's pool may be shared")
    if kind == "full":
        window = _spec_count(window, f"group {index}: window (0 for full attention)", 0, 0)
        sink = _spec_count(sink, f"group {index}: sink_tokens (0 for full attention)", 0, 0)
    else:
        window = _spec_count(window, f"group {index}: window (tokens, at most max_tokens_per_seq)", 1, max_tokens)
        if kind == "chunked_local":
            sink = _spec_count(sink, f"group {index}: sink_tokens (0 for chunked local attention)", 0, 0)
        else:
            sink = _spec_count(sink, f"group {index}: sink_tokens", 0, max_tokens)
    return kind, window, sink, group_pool


@cython.final
@cython.auto_pickle(False)
cdef class KVGroups:
    """The KV cache groups of a ``KVCacheCore`` (made by the core; read ``KVCacheCore.group_stats``)."""

    def __init__(self, *args, **kwargs):
        """Not for callers: a ``KVCacheCore`` given ``groups=`` makes its own."""
        raise TypeError("KVGroups are made by KVCacheCore(groups=...)")

    def __dealloc__(self):
        cdef Py_ssize_t g
        if self._cache != NULL:
            for g in range(self.n):
                _free_cache(&self._cache[g])
        free(self._cache)
        free(self._owners)
        free(self._rules)
        free(self._pools)
        free(self._counts)
        free(self._ids)
        free(self._trimmed)
        free(self._hashes)

    @property
    def specs(self):
        """``(kind, window, sink_tokens)`` of every group, group 0 first."""
        return self._specs

    @property
    def pools(self):
        """The ``BlockPool`` of every group, group 0 (the core's) first."""
        return self._keep

    @property
    def retention_blocks(self):
        """Blocks between checkpoints (0: none)."""
        return self._retention

    # -- (lock held) ------------------------------------------------------------------------------

    cdef void log_to(self, EventLog log) noexcept:
        """Log stored and removed blocks of every group to ``log`` (None: stop)."""
        self._evlog = log

    cdef int _reserve(self, Py_ssize_t blocks) noexcept nogil:
        """Scratch for ``blocks`` ids (and hashes, and trimmed ids); 1 when out of memory. A call
        reserves, before its first change, what every step after it needs, so only that first
        reserve can fail."""
        if self.fail_in > 0 and blocks + 1 > self._ids_capacity:
            self.fail_in -= 1
            if self.fail_in == 0:
                return 1  # the growth a test asked to fail (fail_growth)
        if grow_array(<void **>&self._ids, &self._ids_capacity, blocks + 1, sizeof(int32_t)):
            return 1
        if self._evlog is not None and grow_array(
            <void **>&self._hashes, &self._hashes_capacity, blocks + 1, sizeof(uint64_t)
        ):
            return 1
        return grow_array(<void **>&self._trimmed, &self._trimmed_capacity, blocks + 1, sizeof(int32_t))

    cdef void fail_growth(self, Py_ssize_t n) noexcept:
        """(Tests) drop the scratch, so that the next calls grow it again, and make the ``n``-th of
        those growths fail as if out of memory (0: none)."""
        free(self._ids)
        free(self._trimmed)
        free(self._hashes)
        self._ids = self._trimmed = NULL
        self._hashes = NULL
        self._ids_capacity = self._trimmed_capacity = self._hashes_capacity = 0
        self.fail_in = n

    cdef Py_ssize_t best_cut(self, RadixTrie t, int32_t v, Py_ssize_t limit, Py_ssize_t low,
                             bint settled=False) noexcept nogil:
        """The largest cut in ``(low, limit]`` every group can serve from the path ending at node
        ``v`` (which covers the first ``limit`` blocks), else ``low``. A full group serves every
        cut of a cached path; each windowed one is asked in turn until they agree. ``settled``:
        ``v`` is a leaf no pin holds, so (``problem``'s rule) its own run has every block a query
        at its end reads, and those are not looked at again."""
        cdef Py_ssize_t g = 0, cut = limit, found, windowed = 0, agree = 0
        for g in range(1, self.n):
            windowed += self._rules[g].kind != KIND_FULL
        # Each group's answer is a cut it serves: once every windowed group agreed on the same
        # cut, none is asked again (a group is asked twice only after another moved the cut).
        g = 0
        while cut > low and agree < windowed:
            g = g + 1 if g + 1 < self.n else 1
            if self._rules[g].kind == KIND_FULL:
                continue
            found = self._group_cut(t, v, g, cut, low, settled)
            if found < cut:
                cut = found
                agree = 1
            else:
                agree += 1
        return cut if cut > low else low

    cdef Py_ssize_t _group_cut(self, RadixTrie t, int32_t v, Py_ssize_t g, Py_ssize_t cut,
                               Py_ssize_t low, bint settled) noexcept nogil:
        """The largest cut in ``(low, cut]`` windowed group ``g`` serves, else ``low``: scanning
        down from the cut, a missing block at ``p`` rules out every cut above it. ``settled``
        (``best_cut``'s): blocks ``[known, end)`` of ``v``'s own run are there (``end`` its end,
        ``known`` the later of its start and the first block a query at ``end`` reads), so a
        cut at or below ``end`` is searched below ``known`` only."""
        cdef Py_ssize_t sink = self._rules[g].sink_blocks, p, first, floor, hi
        cdef RNode *node = &t._nodes[v]
        cdef Py_ssize_t end = node.depth + node.length, known = cut
        if settled and cut <= end:
            known = max(self.first_needed(g, end * self._block_size), sink, <Py_ssize_t>node.depth)
        if sink and cut > low:
            p = self._first_missing(t, v, g, min(sink, cut))
            if p < min(sink, cut):
                cut = p  # a cut past a missing sink block reads it
        while cut > low:
            first = max(self.first_needed(g, cut * self._block_size), sink)
            hi = min(cut, known)
            if hi <= first:
                return cut
            p = _last_missing(t, &node, g, first, hi)
            if p < first:
                return cut
            cut = p
            # Below a missing block, a cut c whose block c - 1 is missing too is ruled out while
            # it reads that block: above a chunk's start (chunked), above the sink blocks
            # (a sliding window of more than one token); the run of missing blocks is skipped.
            if self._rules[g].kind == KIND_CHUNKED:
                floor = max(self.first_needed(g, cut * self._block_size), sink, low)
            elif self._rules[g].window > 1:
                floor = max(sink, low)
            else:
                floor = cut
            if cut > floor:
                cut = _missing_down(t, &node, g, floor, cut)
        return low

    cdef Py_ssize_t _first_missing(self, RadixTrie t, int32_t v, Py_ssize_t g, Py_ssize_t stop) noexcept nogil:
        """The first block below ``stop`` group ``g`` lacks on the path ending at ``v`` (``stop``: none)."""
        cdef RNode *node = &t._nodes[v]
        cdef Py_ssize_t p, found = stop
        while node.parent >= 0:
            if node.depth < stop:
                for p in range(min(<Py_ssize_t>node.depth + node.length, stop) - 1, node.depth - 1, -1):
                    if chunk_column(node.chunk, g)[node.start + p - node.depth] < 0:
                        found = p
            node = &t._nodes[node.parent]
        return found

    cdef int attach(self, RadixTrie t, int32_t end, SeqRec *rec, Py_ssize_t cut, Failure *f) noexcept nogil:
        """Give a fresh record (its table empty, its chunk reserved) every group's blocks a query
        at ``cut`` reads from the path ending at ``end`` (a valid cut), with a reference each;
        -1 elsewhere. Nothing changes when refused."""
        cdef Py_ssize_t g, h, p, sink, first, count, d, e
        cdef int32_t *col
        cdef const int32_t *src
        cdef RNode *node
        cdef Failure ignored
        if self._reserve(cut):
            f.code = E_NO_MEMORY
            return -1
        for g in range(1, self.n):
            col = chunk_column(rec.chunk, g)
            sink = min(<Py_ssize_t>self._rules[g].sink_blocks, cut)
            first = max(self.first_needed(g, cut * self._block_size), sink)
            # Only what the query reads is copied: the sink blocks and [first, cut).
            node = &t._nodes[end] if cut > 0 else NULL
            while node != NULL and node.parent >= 0:
                d = node.depth
                e = d + node.length
                src = chunk_column(node.chunk, g) + node.start - d
                if e > max(d, first):
                    memcpy(col + max(d, first), src + max(d, first), (e - max(d, first)) * sizeof(int32_t))
                if d < sink:
                    memcpy(col + d, src + d, (min(e, sink) - d) * sizeof(int32_t))
                if d <= first and sink == 0:
                    break
                node = &t._nodes[node.parent]
            for p in range(sink, first):
                col[p] = -1
            memcpy(self._ids, col, sink * sizeof(int32_t))
            memcpy(self._ids + sink, col + first, (cut - first) * sizeof(int32_t))
            count = sink + cut - first
            if count:
                (<BlockPool>self._pools[g])._inc_ref_locked(self._ids, count, &f.batch)
            if f.batch.failed_at >= 0:
                f.code = E_REFUSED
                f.group = <int32_t>g
                ok(&ignored)
                for h in range(1, g):
                    self._drop_column(rec, h, 0, cut, &ignored)
                return -1
            if self._cache[g].where != NULL:
                for p in range(count):
                    _unlink_block(&self._cache[g], self._ids[p])  # a sequence reads it: not evictable
                    self._cache[g].kept[self._ids[p]] = 1  # a window that served a hit goes last
        return 0

    cdef int grow(self, RadixTrie t, SeqRec *rec, Py_ssize_t num_blocks, Failure *f) noexcept nogil:
        """Fresh blocks for positions ``[rec.num_blocks, num_blocks)`` in every group but 0,
        evicting when a group is short; all or nothing (blocks evicted stay evicted)."""
        cdef Py_ssize_t g, need = num_blocks - rec.num_blocks, freed0 = 0, trimmed = 0, free_now
        if need <= 0:
            return 0
        for g in range(1, self.n):
            free_now = self.num_free(g)
            if free_now < need:
                if self._rules[g].kind == KIND_FULL:
                    self.evict(t, g, need - free_now, &freed0, &trimmed, f)
                else:
                    self.punch(t, g, need - free_now, &freed0, &trimmed, f)
                if f.code != OK:
                    self.ungrow(rec, rec.num_blocks, num_blocks, g)
                    return -1
            if not (<BlockPool>self._pools[g])._allocate_locked(chunk_column(rec.chunk, g) + rec.num_blocks, need):
                self.ungrow(rec, rec.num_blocks, num_blocks, g)
                f.code = E_OUT_OF_BLOCKS
                f.value = need
                f.limit = self.num_free(g)
                f.group = <int32_t>g
                f.pinned = self._pinned_only(t, g)
                return -1
            self._counts[g].allocated += need
        return 0

    cdef char *_retention_pinned(self, RadixTrie t) noexcept nogil:
        """Per node (malloc'd, the caller frees it; NULL: out of memory): whether it lies on the
        path of a pin that is not a live sequence's (a retention pin, ``pin_prefix``)."""
        cdef Py_ssize_t i, nodes = t._high_water
        cdef int32_t v
        cdef SeqRec *rec
        cdef int32_t *own = <int32_t *>calloc(nodes + 1, sizeof(int32_t))  # live sequences' pins ending there
        cdef char *protected = <char *>calloc(nodes + 1, sizeof(char))
        if own == NULL or protected == NULL:
            free(own)
            free(protected)
            return NULL
        for i in range(self.records.high_water()):
            rec = self.records.slot(i)
            if rec.status != FREE and rec.pin_node >= 0:
                own[rec.pin_node] += 1
        for i in range(nodes):
            if t._nodes[i].parent >= 0 and t._nodes[i].pin_count > own[i]:
                v = <int32_t>i
                while v >= 0 and t._nodes[v].parent >= 0 and not protected[v]:
                    protected[v] = 1
                    v = t._nodes[v].parent
        free(own)
        return protected

    cdef Py_ssize_t punch(self, RadixTrie t, Py_ssize_t g, Py_ssize_t n, Py_ssize_t *freed0, Py_ssize_t *trimmed,
                          Failure *f) noexcept nogil:
        """Free up to ``n`` blocks of windowed group ``g`` from the cache: its cache-only blocks,
        least recently left to the cache first, ordinary ones before kept ones, none on a run a
        retention pin protects (it keeps its runs whole). Once a retention priority was given,
        the blocks of runs below the default priority go first, then those at it, then the
        higher ones (each pass by the same order), as group 0's eviction takes the lowest
        priority's runs first. Each leaves a hole (-1) in its run; a
        leaf whose last window lost a block is trimmed to a cut every group serves
        (``settle_leaf``; a pinned one once its last pin goes). A live sequence holds its own
        reference on every block it reads, so none loses one. Returns how many it freed."""
        cdef GroupCache *c = &self._cache[g]
        cdef Py_ssize_t before = self.num_free(g), q, idx, p, pending = 0, evicted = 0, end, first, k
        cdef Py_ssize_t sink = self._rules[g].sink_blocks, h
        cdef int32_t b, u, nb, pb
        cdef const int32_t *col
        # What the last settle of a leaf found (memo_u: the leaf, -1: none): every block of
        # [memo_from, memo_end) there, memo_end its end, memo_depth its start (below it, the part
        # of its last chunk its ancestors hold: a chunk is longer than most leaves). Kept only
        # where g is the one windowed group and has no sink blocks (settle_below asks g alone,
        # from p down).
        cdef int32_t memo_u = -1
        cdef Py_ssize_t memo_from = 0, memo_end = 0, memo_depth = 0
        cdef Py_ssize_t pending0 = 0  # group 0's blocks of one-block trims, to free (_flush0)
        cdef bint alone = sink == 0, two = self.n == 2 and not self.shared  # (shared: one free order)
        cdef Py_ssize_t goal = before + n, free_now, taken, room
        cdef int32_t *ids = NULL
        cdef RNode *nodes = t._nodes
        cdef int32_t *entry
        cdef RNode *node
        cdef uint64_t hashed
        cdef char *protected = NULL
        cdef bint logging = self._evlog is not None and not self.quiet, settle, by_priority, screen
        cdef int32_t limit
        cdef Py_ssize_t lst, start_pass = 4  # (pass, list) pairs q // 2, q % 2: without priorities, pass 2 alone
        cdef int32_t limits[3]
        # (locals: with strict aliasing off, each int32 store would reload them through ``c``)
        cdef int32_t **where = c.where
        cdef int32_t *owner = c.owner
        cdef int32_t *nxt = c.next
        cdef int32_t *prv = c.prev
        cdef uint8_t *listed = c.listed
        limits[0] = DEFAULT_PRIORITY - 1
        limits[1] = DEFAULT_PRIORITY
        limits[2] = MAX_PRIORITY
        if where == NULL or n <= 0 or self._reserve(n):
            return 0
        ids = self._ids
        if self.retention is not None and self.retention.pinned_blocks > 0:
            protected = self._retention_pinned(t)
            if protected == NULL:
                f.code = E_NO_MEMORY
                return 0
        for h in range(1, self.n):
            if h != g and self._rules[h].kind != KIND_FULL:
                alone = False
        if self.retention is not None and self.retention.hinted:
            start_pass = 0
            if t._heap_size and t._heap[0].at <= t._now():
                t._decay(t._now())  # priorities whose duration ran out go back to the default first
        free_now = before
        for q in range(start_pass, 6):
            lst = q % 2
            limit = limits[q // 2]
            by_priority = limit < MAX_PRIORITY  # (no run's priority is above MAX_PRIORITY)
            screen = protected != NULL or by_priority  # whether a block may be passed over
            b = c.head[lst]
            taken = 0
            # (free_now, ids and nodes change only where the leaf's settle runs: refreshed there)
            if f.code != OK:
                break
            room = goal - free_now
            while b >= 0 and pending < room:
                u = owner[b]
                if screen and ((protected != NULL and protected[u]) or (by_priority and nodes[u].priority > limit)):
                    b = nxt[b]
                    continue
                node = &nodes[u]
                entry = where[b]
                entry[0] = -1
                # Off its list (_untrack, _unlink_block), untracked. (Where no block is passed
                # over, b is the list's head.)
                nb = nxt[b]
                pb = prv[b] if screen else -1
                if pb >= 0:
                    nxt[pb] = nb
                else:
                    c.head[lst] = nb
                if nb >= 0:
                    prv[nb] = pb
                else:
                    c.tail[lst] = pb
                listed[b] = 0
                taken += 1
                where[b] = NULL
                if logging:
                    idx = entry - chunk_column(node.chunk, g)
                    hashed = node.chunk.hashes[idx] if node.chunk.hashes != NULL else 0
                    self._evlog.removed(&b, NULL, &hashed, 1, <int>g)
                # Only the cache held it: its one reference goes with the others in one batch
                # (the same order of frees), before anything else uses the scratch.
                ids[pending] = b
                pending += 1
                # (its position p on the path: only where a leaf's settle or the memo needs it)
                settle = False
                if node.num_children == 0 and node.lock_count == 0:
                    p = node.depth + (entry - chunk_column(node.chunk, g)) - node.start
                    end = node.depth + node.length
                    settle = p < sink or p >= self.first_needed(g, end * self._block_size)
                elif u == memo_u:
                    p = node.depth + (entry - chunk_column(node.chunk, g)) - node.start
                else:
                    p = -1
                if settle:
                    if u == memo_u and p == memo_end - 1 and end == memo_end and p > node.depth:
                        # The leaf's last block went, and [memo_from, p) is there (checked when the
                        # leaf was last settled, nothing of it taken since): the cut a query at p
                        # reads is p's when [first, memo_from) is there too (settle_below's answer,
                        # the one windowed group asked).
                        first = self.first_needed(g, p * self._block_size)
                        if first >= memo_from or first >= node.depth:
                            col = chunk_column(node.chunk, g) + node.start - node.depth
                            k = first
                            while k < memo_from and col[k] >= 0:
                                k += 1
                            if k >= memo_from:
                                memo_end = p
                                memo_from = min(memo_from, first)
                                if two:
                                    # With groups 0 and g alone on pools of their own, trimming the
                                    # one block (_trim_to) frees nothing in g (its entry went) and
                                    # leaves the scratch alone, so g's pending references wait; group
                                    # 0's block joins the run freed in one batch, in the same order,
                                    # before anything else frees or trims (_flush0).
                                    t._trim_one(u, self._trimmed + pending0,
                                                self._hashes + pending0 if logging else NULL)
                                    if logging:
                                        self._evlog.removed(self._trimmed + pending0, NULL,
                                                            self._hashes + pending0, 1, 0)
                                    pending0 += 1
                                    b = c.head[lst]
                                    continue  # (g's pool, the scratch and the nodes are as they were)
                                self._free_listed(g, pending, f)
                                pending = 0
                                self._trim_to(t, u, p, freed0, trimmed, f)
                                free_now = self.num_free(g)
                                room = goal - free_now
                                ids = self._ids
                                nodes = t._nodes
                                b = c.head[lst]
                                if f.code != OK:
                                    break
                                continue
                    if pending0:
                        self._flush0(pending0, freed0, trimmed, f)
                        pending0 = 0
                    self._free_listed(g, pending, f)
                    pending = 0
                    # Every cut of the leaf above p reads block p: its cut is p's or below.
                    self._settle_below(t, u, p, freed0, trimmed, f)
                    memo_u = -1
                    if alone and f.code == OK and self._settled >= 0:
                        # The leaf it trimmed (u, or the parent it went on to once u went) ends
                        # where best_cut found every block a query there reads.
                        u = self._settled
                        node = &t._nodes[u]
                        end = node.depth + node.length
                        first = self.first_needed(g, end * self._block_size)
                        if end > node.depth:
                            memo_u = u
                            memo_from = first
                            memo_end = end
                            memo_depth = node.depth
                    free_now = self.num_free(g)
                    room = goal - free_now
                    ids = self._ids
                    nodes = t._nodes
                    if f.code != OK:
                        b = c.head[lst]
                        break
                elif u == memo_u:
                    if memo_from <= p < memo_end:
                        memo_u = -1  # a block the memo counts on went
                elif memo_from < memo_depth and node.num_children != 0 and node.depth < memo_depth \
                        and node.depth + node.length > memo_from:
                    # A block of a node that may be one of the memo leaf's ancestors, in the part of
                    # its last chunk they hold: the memo may count on it. (Only a node with children
                    # can be an ancestor; the test is by depths alone, so it may drop a memo it could keep.)
                    memo_u = -1
                b = c.head[lst]
            c.count[lst] -= taken
            evicted += taken
        self._counts[g].evicted += evicted
        if pending0:
            self._flush0(pending0, freed0, trimmed, f)
        self._free_listed(g, pending, f)
        free(protected)
        return self.num_free(g) - before

    cdef void _flush0(self, Py_ssize_t count, Py_ssize_t *freed0, Py_ssize_t *trimmed, Failure *f) noexcept nogil:
        """Free group 0's blocks of ``count`` trims, in ``self._trimmed``, in one batch and count
        them (``_trim_to``'s, and ``punch``'s one-block trims gathered in the same order)."""
        cdef Py_ssize_t freed = (<BlockPool>self._pools[0])._dec_ref_locked(self._trimmed, count, &f.batch)
        freed0[0] += freed
        trimmed[0] += count
        self._counts[0].freed += freed
        self._counts[0].evicted += count
        if f.batch.failed_at >= 0:
            f.code = E_INVARIANT

    cdef void settle_all(self, RadixTrie t, Failure *f) noexcept nogil:
        """``settle_leaf`` on every leaf (after pins went that the core does not track one by one)."""
        cdef Py_ssize_t i, freed0 = 0, trimmed = 0
        for i in range(t._high_water):
            if t._nodes[i].parent >= 0 and t._nodes[i].num_children == 0 and t._nodes[i].lock_count == 0:
                if self.settle_leaf(t, <int32_t>i, &freed0, &trimmed, f):
                    return

    cdef Py_ssize_t _pinned_only(self, RadixTrie t, Py_ssize_t g) noexcept nogil:
        """Blocks of group ``g`` that only the cache holds, on runs a retention pin protects from
        eviction (what a refusal for want of them names; -1: out of memory to count them)."""
        cdef Py_ssize_t i, p, count = 0
        cdef RNode *node
        cdef int32_t *col
        cdef int32_t *refs = (<BlockPool>self._pools[g])._refcounts
        cdef char *protected = self._retention_pinned(t)
        if protected == NULL:
            return -1
        for i in range(t._high_water):
            node = &t._nodes[i]
            if node.parent < 0 or not protected[i]:
                continue
            col = chunk_column(node.chunk, g) + node.start
            for p in range(node.length):
                count += col[p] >= 0 and refs[col[p]] == 1
        free(protected)
        return count

    cdef void ungrow(self, SeqRec *rec, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t groups) noexcept nogil:
        """Give back the blocks ``grow`` just took at ``[start, stop)`` in groups 1 .. groups - 1."""
        cdef Py_ssize_t g
        cdef BatchResult ignored
        for g in range(1, groups):
            (<BlockPool>self._pools[g])._dec_ref_locked(chunk_column(rec.chunk, g) + start, stop - start, &ignored)
            self._counts[g].allocated -= stop - start

    cdef void _track(self, Py_ssize_t g, int32_t *entry, Py_ssize_t p, int32_t node) noexcept nogil:
        """The trie's entry ``entry`` (block ``p`` of its path, in ``node``) holds its block in group ``g``."""
        cdef GroupCache *c = &self._cache[g]
        cdef int32_t b = entry[0]
        if c.where == NULL:
            return
        c.where[b] = entry
        c.owner[b] = node
        c.kept[b] = p < self._rules[g].sink_blocks or self.at_checkpoint(g, p)

    cdef void _untrack(self, Py_ssize_t g, int32_t b) noexcept nogil:
        """Block ``b`` of group ``g`` leaves the trie (its entry is dropped by the caller)."""
        cdef GroupCache *c = &self._cache[g]
        if c.where == NULL:
            return
        _unlink_block(c, b)
        c.where[b] = NULL

    cdef void _offer(self, Py_ssize_t g, int32_t b) noexcept nogil:
        """After a reference on block ``b`` of group ``g`` went: if only the cache holds it now,
        it joins the most recently used end of its list."""
        cdef GroupCache *c = &self._cache[g]
        cdef Py_ssize_t q
        if c.where == NULL or c.where[b] == NULL or (<BlockPool>self._pools[g])._refcounts[b] != 1:
            return
        _unlink_block(c, b)
        q = 1 if c.kept[b] else 0
        c.prev[b] = c.tail[q]
        c.next[b] = -1
        if c.tail[q] >= 0:
            c.next[c.tail[q]] = b
        else:
            c.head[q] = b
        c.tail[q] = b
        c.listed[b] = <uint8_t>(q + 1)
        c.count[q] += 1

    cdef int _release_moved(self, SeqRec *rec, Py_ssize_t tokens, int32_t **tables, Py_ssize_t row,
                            Failure *f) noexcept nogil:
        """The record's KV now covers ``tokens`` tokens: release, per windowed group, the blocks
        that left its window or chunk, except those before a checkpoint (the record keeps them
        for the cache). Only whole-block cuts count, so the last window of the record's full
        blocks stays whole for ``finish``. With ``tables`` (a decode step's, group g's at
        ``tables[g - 1]``), entry ``row + p`` of each released block ``p`` becomes ``self.pad``,
        so the engine's rows never name a block that went back to its pool. Called by ``release``
        once ``tokens`` passed a boundary where some group may release a block."""
        cdef Py_ssize_t g, p, low, high, count, bs = self._block_size
        cdef Py_ssize_t done = (rec.kv_tokens // bs) * bs, now = (tokens // bs) * bs
        cdef Py_ssize_t released, to_cache, kept, pin = rec.pin_blocks, retention = self._retention
        cdef Py_ssize_t seg[2]
        cdef int32_t *col
        cdef int32_t *ids
        cdef int32_t *row_ids
        cdef int32_t b, pad = self.pad
        cdef GroupRule rule
        if self._reserve(rec.num_blocks):
            f.code = E_NO_MEMORY  # before anything moved: kv_tokens too
            return -1
        rec.kv_tokens = <int32_t>tokens
        for g in range(1, self.n):
            if self._rules[g].kind == KIND_FULL:
                continue
            rule = self._rules[g]
            low = max(self.first_needed(g, done), <Py_ssize_t>self._rules[g].sink_blocks)
            high = min(self.first_needed(g, now), <Py_ssize_t>rec.num_blocks)
            if high <= low:
                continue
            col = chunk_column(rec.chunk, g)
            ids = self._ids
            row_ids = tables[g - 1] + row if tables != NULL else NULL
            count = to_cache = kept = 0
            seg[0] = seg[1] = 0
            # On its cached path (below pin): the entry stays (it may be the trie's), the block the
            # cache's (a windowed group always tracks its cached blocks).
            released = self._release_cached(g, col, low, min(high, pin), row_ids, &to_cache, f)
            if released < 0:
                return -1
            for p in range(max(low, pin), high):
                b = col[p]
                if b < 0:
                    continue
                released += 1
                if retention > 0 and _kept(&rule, bs, retention, p, seg):  # (at_checkpoint)
                    kept += 1
                    continue
                col[p] = -1
                ids[count] = b
                count += 1
                if row_ids != NULL:
                    row_ids[p] = pad
            self._counts[g].released += released
            self._counts[g].to_cache += to_cache
            self._counts[g].kept += kept
            self._unref(g, count, f)
        return 0 if f.code == OK else -1

    cdef Py_ssize_t _unref(self, Py_ssize_t g, Py_ssize_t count, Failure *f) noexcept nogil:
        """Drop one reference on each of the first ``count`` ids of the scratch in group ``g``."""
        cdef Py_ssize_t freed
        if count <= 0:
            return 0
        freed = (<BlockPool>self._pools[g])._dec_ref_locked(self._ids, count, &f.batch)
        if f.batch.failed_at >= 0:
            f.code = E_INVARIANT
            f.value = self._ids[f.batch.failed_at]  # the id whose reference was not there
            f.group = <int32_t>g
        self._counts[g].freed += freed
        if self._cache[g].where != NULL and freed < count:
            _offer_run(&self._cache[g], (<BlockPool>self._pools[g])._refcounts, self._ids, count)
        return freed

    cdef Py_ssize_t _release_cached(self, Py_ssize_t g, const int32_t *col, Py_ssize_t low, Py_ssize_t stop,
                                    int32_t *row_ids, Py_ssize_t *to_cache, Failure *f) noexcept nogil:
        """``release``'s blocks ``[low, stop)`` of column ``col`` (on the record's cached path, in
        a group the cache tracks) in one pass: the record's reference on each goes (the block is
        pushed on the free stack when it was the last), a block only the cache then holds joins
        its list (``_offer``), and row entry ``p`` of ``row_ids`` (when given) becomes the pad.
        The result is ``_unref``'s of the same ids, in the same order; a column holds each block
        once. Returns how many blocks it released and adds the cached ones to ``to_cache``; where
        a reference was not there (``E_INVARIANT``, -1), no count or list has changed."""
        cdef GroupCache *c = &self._cache[g]
        cdef PyObject *pool = self._pools[g]
        cdef int32_t *refs = (<BlockPool>pool)._refcounts
        cdef int32_t *stack = (<BlockPool>pool)._free_stack
        cdef int32_t **where = c.where
        cdef int32_t *nxt = c.next
        cdef int32_t *prv = c.prev
        cdef uint8_t *listed = c.listed
        cdef const uint8_t *kept = c.kept
        cdef Py_ssize_t top0 = (<BlockPool>pool)._num_free, top = top0, p, released = 0, cached = 0, q, bad = -1
        cdef Py_ssize_t added[2]
        cdef int32_t tails[2]
        cdef int32_t b, r, tail, pad = self.pad
        # (locals: with strict aliasing off, every int32 store would reload them through ``c``)
        tails[0] = c.tail[0]
        tails[1] = c.tail[1]
        added[0] = added[1] = 0
        for p in range(low, stop):
            b = col[p]
            if b < 0:
                continue
            r = refs[b] - 1
            if r < 0:
                bad = p
                break
            refs[b] = r
            released += 1
            if r == 0:
                stack[top] = b
                top += 1
            if where[b] == NULL:
                continue
            cached += 1
            if r != 1:
                continue
            # (_offer_run's link, written out: one inline helper for both cost about 3,000
            # instructions per W3 request on gpt-oss, measured)
            if listed[b]:
                c.tail[0] = tails[0]
                c.tail[1] = tails[1]
                _unlink_block(c, b)
                tails[0] = c.tail[0]
                tails[1] = c.tail[1]
            q = kept[b] != 0
            tail = tails[q]
            prv[b] = tail
            nxt[b] = -1
            if tail >= 0:
                nxt[tail] = b
            else:
                c.head[q] = b
            tails[q] = b
            listed[b] = <uint8_t>(q + 1)
            added[q] += 1
        c.tail[0] = tails[0]
        c.tail[1] = tails[1]
        c.count[0] += added[0]
        c.count[1] += added[1]
        if bad >= 0:
            # Undo: the blocks before ``bad`` take their reference back (off the list they joined),
            # and the pushes are discarded with the top left where it was.
            for p in range(low, bad):
                b = col[p]
                if b < 0:
                    continue
                if refs[b] == 1 and where[b] != NULL and listed[b]:
                    _unlink_block(c, b)
                refs[b] += 1
            f.code = E_INVARIANT
            f.value = col[bad]  # the id whose reference was not there
            f.group = <int32_t>g
            return -1
        (<BlockPool>pool)._num_free = top
        self._counts[g].freed += top - top0
        to_cache[0] += cached
        if row_ids != NULL:  # (a pass of its own: the one above is short of registers)
            for p in range(low, stop):
                if col[p] >= 0:
                    row_ids[p] = pad
        return released

    cdef Py_ssize_t _free_listed(self, Py_ssize_t g, Py_ssize_t count, Failure *f) noexcept nogil:
        """``_unref`` of the first ``count`` ids of the scratch where each is a block only the
        cache held (``punch``'s: refcount 1, each once): every one is freed, pushed on its pool's
        free stack in order as ``_dec_ref_locked`` pushes them, without its general batch (which
        takes over should a refcount not be 1)."""
        cdef int32_t *refs = (<BlockPool>self._pools[g])._refcounts
        cdef int32_t *stack = (<BlockPool>self._pools[g])._free_stack
        cdef const int32_t *ids = self._ids
        cdef Py_ssize_t i, j, top = (<BlockPool>self._pools[g])._num_free
        cdef int32_t b
        if count <= 0:
            return 0
        for i in range(count):
            b = ids[i]
            if refs[b] != 1:
                for j in range(i):  # (each was 1: the general batch starts from what was)
                    refs[ids[j]] = 1
                return self._unref(g, count, f)
            refs[b] = 0
            stack[top + i] = b
        (<BlockPool>self._pools[g])._num_free = top + count
        f.batch.failed_at = -1
        f.batch.refusal = REFUSAL_NONE
        self._counts[g].freed += count
        return count

    cdef Py_ssize_t _drop_column(self, SeqRec *rec, Py_ssize_t g, Py_ssize_t start, Py_ssize_t stop,
                                 Failure *f) noexcept nogil:
        """Drop the record's references at ``[start, stop)`` of group ``g``'s column (-1 after);
        the caller reserved the scratch for ``stop - start`` ids."""
        cdef Py_ssize_t p, count = 0, released = self.released_to(g, rec), pin = rec.pin_blocks
        cdef Py_ssize_t skip_from = self._rules[g].sink_blocks, skip_to = min(released, pin)
        cdef int32_t *col = chunk_column(rec.chunk, g)
        cdef int32_t *ids = self._ids
        if stop <= start:
            return 0
        # (holds: every entry but those at [sink, min(released, pin_blocks)), which are skipped)
        for p in range(start, min(stop, skip_from)):
            if col[p] >= 0:
                ids[count] = col[p]
                count += 1
                if p >= pin:
                    col[p] = -1  # its own entry (on its cached path the entry may be the trie's)
        for p in range(max(start, skip_to if skip_to > skip_from else skip_from), stop):
            if col[p] >= 0:
                ids[count] = col[p]
                count += 1
                if p >= pin:
                    col[p] = -1
        return self._unref(g, count, f)

    cdef int release_all(self, SeqRec *rec, Failure *f) noexcept nogil:
        """Drop every reference the record holds in groups 1 .. n - 1 (group 0's: the caller);
        refused before any goes when out of memory."""
        cdef Py_ssize_t g
        if self._reserve(rec.num_blocks):
            f.code = E_NO_MEMORY
            return -1
        for g in range(1, self.n):
            self._drop_column(rec, g, 0, rec.num_blocks, f)
        return 0 if f.code == OK else -1

    cdef int cache(self, RadixTrie t, SeqRec *rec, Py_ssize_t d, int32_t v, Py_ssize_t pos, Py_ssize_t full,
                   int32_t leaf, Failure *f) noexcept nogil:
        """A live record's blocks ``[d, full)`` were just cached in group 0 (its cached path held
        ``[0, d)``): the path ending at node ``v`` holds ``[d, pos)`` (other runs'), node ``leaf``
        (-1: none) holds ``[pos, full)`` in the record's own chunk. Per group: the leaf's entries
        are the record's, the cache taking a reference on each the record's window still reads
        and the record's own on each it released (kept at a checkpoint); holes of the path are
        filled from the record's blocks likewise; released blocks the path already has go. The
        scratch was reserved for ``full - d`` blocks by the caller."""
        cdef Py_ssize_t g, p, released, count, taken, sink, seg_end, seg_first, bad
        cdef int32_t *col
        cdef int32_t *node_col
        cdef int32_t *refs
        cdef int32_t b, r
        cdef RNode *node
        cdef bint tracked
        cdef Py_ssize_t bs = self._block_size, retention = self._retention
        cdef GroupRule rule
        cdef int32_t **where
        cdef int32_t *owner
        cdef uint8_t *kept
        for g in range(1, self.n):
            col = chunk_column(rec.chunk, g)
            released = self.released_to(g, rec)
            rule = self._rules[g]  # (a copy: the stores below would reload it through a pointer)
            sink = rule.sink_blocks
            where = self._cache[g].where
            owner = self._cache[g].owner
            kept = self._cache[g].kept
            refs = (<BlockPool>self._pools[g])._refcounts
            tracked = where != NULL
            bad = -1
            count = 0  # references the record gives up (scratch)
            taken = 0  # references the cache takes (second scratch)
            seg_end = seg_first = 0  # (_kept's interval: its end, its checkpoint window's first block)
            for p in range(pos, full):
                b = col[p]
                if b < 0:
                    continue
                if tracked:  # (_track)
                    where[b] = col + p
                    owner[b] = leaf
                    if p < sink:
                        kept[b] = 1
                    elif retention <= 0:
                        kept[b] = 0
                    else:
                        if p >= seg_end:  # (p grows: never below the interval)
                            seg_end = (p // retention + 1) * retention
                            seg_first = _first_needed(&rule, bs, seg_end * bs)
                        kept[b] = seg_first <= p
                if p < sink or p >= released:
                    # The cache's reference, taken here (as _inc_ref_locked would; undone below
                    # should the record's block have none).
                    r = refs[b]
                    if r <= 0 or r == INT32_MAX:
                        bad = p
                        break
                    refs[b] = r + 1
                elif tracked:
                    self._offer(g, b)  # the record's reference became the cache's
            if bad >= 0:
                for p in range(pos, bad):
                    b = col[p]
                    if b >= 0 and (p < sink or p >= released):
                        refs[b] -= 1
                f.code = E_INVARIANT
                f.value = col[bad]
                f.group = <int32_t>g
                return -1
            if leaf >= 0 and self._evlog is not None:
                self._log_kept(t, leaf, g, pos, full, full)
            node = &t._nodes[v]
            for p in range(pos - 1, d - 1, -1):
                b = col[p]
                if b < 0:
                    continue
                while p < node.depth:
                    node = &t._nodes[node.parent]
                node_col = chunk_column(node.chunk, g) + node.start - node.depth
                if p < sink or p >= released:
                    if node_col[p] < 0:
                        node_col[p] = b
                        self._track(g, node_col + p, p, <int32_t>(node - t._nodes))
                        self._trimmed[taken] = b
                        taken += 1
                        if self._evlog is not None:
                            self._log_kept(t, <int32_t>(node - t._nodes), g, p, p + 1, node.depth + node.length)
                    continue  # the record keeps its own block while its window reads it
                col[p] = -1  # released, off its cached path so far: its own entry
                if node_col[p] < 0:
                    node_col[p] = b  # the record's reference becomes the cache's
                    self._track(g, node_col + p, p, <int32_t>(node - t._nodes))
                    if tracked:
                        self._offer(g, b)
                    if self._evlog is not None:
                        self._log_kept(t, <int32_t>(node - t._nodes), g, p, p + 1, node.depth + node.length)
                else:
                    self._ids[count] = b
                    count += 1
            if taken:
                (<BlockPool>self._pools[g])._inc_ref_locked(self._trimmed, taken, &f.batch)
                if f.batch.failed_at >= 0:
                    f.code = E_INVARIANT
                    f.value = self._trimmed[f.batch.failed_at]
                    f.group = <int32_t>g
                    return -1
            self._unref(g, count, f)
        return 0 if f.code == OK else -1

    cdef int finish(self, RadixTrie t, SeqRec *rec, int32_t v, Py_ssize_t pos, Py_ssize_t full, int32_t leaf,
                    Failure *f) noexcept nogil:
        """A finishing record's groups 1 .. n - 1, once group 0 cached its first ``full`` blocks:
        the path ending at node ``v`` held ``[0, pos)``, the new ``leaf`` (-1: none) holds
        ``[pos, full)``. Per group the leaf takes every block the record has there and the
        holes of the path it extends are filled from the record's blocks (the record's
        references become the cache's); the record's other references go. The caller reserved
        the scratch for ``rec.num_blocks`` ids before it changed anything (group 0's part cannot
        be undone)."""
        cdef Py_ssize_t g, p, count, moved, released, sink, skip_to
        cdef Py_ssize_t seg[2]
        cdef int32_t b
        cdef int32_t *col
        cdef int32_t *leaf_col
        cdef int32_t *node_col
        cdef RNode *node
        cdef GroupCache *c
        for g in range(1, self.n):
            col = chunk_column(rec.chunk, g)
            c = &self._cache[g]
            released = self.released_to(g, rec)
            sink = self._rules[g].sink_blocks
            skip_to = min(released, <Py_ssize_t>rec.pin_blocks)
            count = 0
            moved = 0  # the references that became the cache's (in the second scratch)
            if leaf >= 0:
                node = &t._nodes[leaf]
                leaf_col = chunk_column(node.chunk, g) + node.start - pos
                if node.chunk != rec.chunk:
                    memcpy(leaf_col + pos, col + pos, (full - pos) * sizeof(int32_t))
                if c.where != NULL:
                    seg[0] = seg[1] = 0
                    for p in range(pos, full):
                        b = leaf_col[p]
                        if b >= 0:  # (_track)
                            c.where[b] = leaf_col + p
                            c.owner[b] = leaf
                            c.kept[b] = _kept(&self._rules[g], self._block_size, self._retention, p, seg)
                            self._trimmed[moved] = b
                            moved += 1
                if self._evlog is not None:
                    self._log_kept(t, leaf, g, pos, full, full)
            node = &t._nodes[v] if v >= 0 else NULL
            p = pos - 1
            while node != NULL and p >= 0:
                if sink <= p < skip_to:
                    p = sink - 1  # (holds: none of [sink, min(released, pin_blocks)))
                    continue
                if col[p] < 0:
                    p -= 1
                    continue
                while p < node.depth:
                    node = &t._nodes[node.parent]
                node_col = chunk_column(node.chunk, g) + node.start - node.depth
                if node_col[p] < 0:
                    node_col[p] = col[p]  # the record's reference becomes the cache's
                    self._track(g, node_col + p, p, <int32_t>(node - t._nodes))
                    if c.where != NULL:
                        self._trimmed[moved] = col[p]
                        moved += 1
                    if self._evlog is not None:
                        self._log_kept(t, <int32_t>(node - t._nodes), g, p, p + 1, node.depth + node.length)
                else:
                    self._ids[count] = col[p]
                    count += 1
                p -= 1
            for p in range(full, rec.num_blocks):
                if col[p] >= 0:
                    self._ids[count] = col[p]
                    count += 1
            self._unref(g, count, f)
            if c.where != NULL:
                _offer_run(c, (<BlockPool>self._pools[g])._refcounts, self._trimmed, moved)
        return 0 if f.code == OK else -1

    cdef void _log_kept(self, RadixTrie t, int32_t v, Py_ssize_t g, Py_ssize_t start, Py_ssize_t stop,
                        Py_ssize_t end) noexcept nogil:
        """Log as stored, in group ``g``, the runs of blocks node ``v`` (ending at block ``end``)
        holds in that group at ``[start, stop)``."""
        cdef RNode *node = &t._nodes[v]
        cdef int32_t *col = chunk_column(node.chunk, g) + node.start - node.depth
        cdef Py_ssize_t a = start, b
        cdef const uint64_t *hashes
        cdef uint64_t parent
        cdef int64_t key
        cdef bint has_parent
        while a < stop:
            if col[a] < 0:
                a += 1
                continue
            b = a
            while b < stop and col[b] >= 0:
                b += 1
            hashes = t._hash_tail(v, end - a, &key, &parent, &has_parent)
            if hashes == NULL:
                self._evlog.lost()
            else:
                self._evlog.stored(
                    key, parent, has_parent, hashes,
                    node.chunk.tokens + (node.start + a - node.depth) * self._block_size, b - a, <int>g,
                )
            a = b

    cdef int _trim_to(self, RadixTrie t, int32_t v, Py_ssize_t cut, Py_ssize_t *freed0, Py_ssize_t *trimmed,
                      Failure *f) noexcept nogil:
        """Trim leaf ``v`` (unprotected) to end at block ``cut`` in every group (``cut`` at its
        start: the node goes)."""
        cdef RNode *node = &t._nodes[v]
        cdef Py_ssize_t g, p, count, end = node.depth + node.length, take = end - cut
        cdef int32_t *col
        if take <= 0:
            return 0
        if self._reserve(take):
            f.code = E_NO_MEMORY
            return -1
        cdef bint logging = self._evlog is not None and not self.quiet
        cdef uint64_t *chunk_hashes = node.chunk.hashes
        for g in range(1, self.n):
            col = chunk_column(node.chunk, g) + node.start + node.length - take
            count = 0
            for p in range(take):
                if col[p] >= 0:
                    self._untrack(g, col[p])
                    self._ids[count] = col[p]
                    if logging:
                        self._hashes[count] = (
                            chunk_hashes[node.start + node.length - take + p] if chunk_hashes != NULL else 0
                        )
                    count += 1
            if logging and count:
                self._evlog.removed(self._ids, NULL, self._hashes, count, <int>g)
            self._counts[g].evicted += count
            self._unref(g, count, f)
        t._trim_leaf(v, take, self._trimmed, NULL, self._hashes if logging else NULL, 0)
        if logging:
            self._evlog.removed(self._trimmed, NULL, self._hashes, take, 0)
        self._flush0(take, freed0, trimmed, f)
        return 0 if f.code == OK else -1

    cdef int settle_leaf(self, RadixTrie t, int32_t v, Py_ssize_t *freed0, Py_ssize_t *trimmed,
                         Failure *f) noexcept nogil:
        """Trim node ``v``, if it is an unprotected leaf, back to the last cut every group can
        serve, and its parent likewise when it goes."""
        return self._settle_below(t, v, -1, freed0, trimmed, f)

    cdef int _settle_below(self, RadixTrie t, int32_t v, Py_ssize_t limit, Py_ssize_t *freed0,
                           Py_ssize_t *trimmed, Failure *f) noexcept nogil:
        """``settle_leaf``, knowing that no cut of ``v`` above ``limit`` is served (a block every
        such cut reads is missing; -1: nothing known), so the search for its cut starts there."""
        cdef RNode *node
        cdef Py_ssize_t end, cut
        cdef int32_t parent
        self._settled = -1
        while v >= 0 and t._nodes[v].parent >= 0:
            node = &t._nodes[v]
            if node.num_children != 0 or node.lock_count != 0:
                return 0
            end = node.depth + node.length
            cut = self.best_cut(t, v, end if limit < 0 else max(min(limit, end), <Py_ssize_t>node.depth), node.depth)
            limit = -1  # (a parent: nothing known)
            if cut < 0:
                f.code = E_NO_MEMORY
                return -1
            if cut == end:
                self._settled = v
                return 0
            parent = node.parent
            if self._trim_to(t, v, cut, freed0, trimmed, f):
                return -1
            if cut > node.depth:
                self._settled = v
                return 0
            v = parent
        return 0

    cdef Py_ssize_t evict(self, RadixTrie t, Py_ssize_t g, Py_ssize_t n, Py_ssize_t *freed0, Py_ssize_t *trimmed,
                          Failure *f) noexcept nogil:
        """Trim least recently used leaves, each to a cut every group can serve, until group
        ``g``'s pool gained ``n`` free blocks or nothing is evictable; returns what it gained."""
        cdef Py_ssize_t before = self.num_free(g), end, cut
        cdef int32_t v, parent
        cdef RNode *node
        if t._heap_size and t._heap[0].at <= t._now():
            t._decay(t._now())  # priorities whose duration ran out go back to the default first
        while self.num_free(g) - before < n:
            v = t._victim()
            if v < 0:
                break
            node = &t._nodes[v]
            if node.num_children != 0:
                f.code = E_INVARIANT
                f.value = v
                break
            end = node.depth + node.length
            cut = self.best_cut(t, v, max(<Py_ssize_t>node.depth, end - (n - (self.num_free(g) - before))),
                                node.depth, node.lock_count == 0)
            if cut < 0:
                f.code = E_NO_MEMORY
                break
            parent = node.parent
            if self._trim_to(t, v, cut, freed0, trimmed, f):
                break
            if cut == node.depth and self.settle_leaf(t, parent, freed0, trimmed, f):
                break
        return self.num_free(g) - before

    cdef void write_rows(self, SeqRec *rec, int32_t **tables, Py_ssize_t row, Py_ssize_t start,
                         Py_ssize_t stop) noexcept nogil:
        """Write the record's ids at ``[start, stop)`` of every group past 0 into entry ``row`` on
        of that group's table (``tables[g - 1]``)."""
        cdef Py_ssize_t g
        for g in range(1, self.n):
            memcpy(tables[g - 1] + row + start, chunk_column(rec.chunk, g) + start, (stop - start) * sizeof(int32_t))

    # -- (GIL held, lock held) -------------------------------------------------------------------------

    cdef str problem(self, RadixTrie t, Records records, int32_t null_block):
        """The first inconsistency of groups 1 .. n - 1 (refcounts against the records' columns
        and the cached runs', each pool's own tables) or of the rule that every leaf ends at a
        cut every group can serve; None when there is none."""
        cdef Py_ssize_t g, i, p, nb, end, last
        cdef RNode *node
        cdef BlockPool pool
        cdef int64_t[::1] expected
        for g in range(1, self.n):
            if not self.shared:  # (shared: the core recounts the one pool, every group's references added)
                pool = self.pool_of(g)
                problem = pool._problem()
                if problem is not None:
                    return f"BlockPool of group {g}: {problem}"
                nb = pool._num_blocks
                counted = np.zeros(nb + 1, dtype=np.int64)
                expected = counted
                if null_block >= 0:
                    expected[null_block] += 1
                problem = self.count_refs(t, records, g, expected, nb)
                if problem is not None:
                    return problem
                for i in range(nb):
                    if expected[i] != pool._refcounts[i]:
                        return (
                            f"group {g}: block {i}: refcount {pool._refcounts[i]} but sequences and cache hold "
                            f"{expected[i]}"
                        )
            if self._cache[g].where != NULL:
                problem = self._cache_problem(t, g)
                if problem is not None:
                    return problem
        for i in range(t._high_water):
            node = &t._nodes[i]
            if node.parent < 0 or node.num_children != 0 or node.lock_count != 0:
                continue  # a pinned run may have lost blocks to eviction: it is trimmed once unpinned
            end = node.depth + node.length
            for g in range(1, self.n):
                if self._rules[g].kind == KIND_FULL:
                    continue
                col = chunk_column(node.chunk, g) + node.start - node.depth
                last = self.first_needed(g, end * self._block_size)
                for p in range(node.depth, end):
                    if col[p] < 0 and (p < self._rules[g].sink_blocks or p >= last):
                        return (
                            f"leaf node {i} ends at block {end}, but its own run lacks block {p} of group {g}, "
                            "which a query at its end reads"
                        )
        return None

    cdef str _cache_problem(self, RadixTrie t, Py_ssize_t g):
        """The first inconsistency of windowed group ``g``'s cached blocks: every block an entry
        of the trie holds is tracked at that entry and node, and no other; the lists hold
        exactly the blocks only the cache holds, each on the list its kind says, linked both ways."""
        cdef GroupCache *c = &self._cache[g]
        cdef Py_ssize_t i, p, q, nb = self.pool_of(g)._num_blocks, entries = 0, tracked = 0, steps
        cdef int32_t b, prev
        cdef int32_t *col
        cdef RNode *node
        cdef int32_t *refs = self.pool_of(g)._refcounts
        for i in range(t._high_water):
            node = &t._nodes[i]
            if node.parent < 0:
                continue
            col = chunk_column(node.chunk, g) + node.start
            for p in range(node.length):
                b = col[p]
                if b < 0:
                    continue
                entries += 1
                if c.where[b] != col + p or c.owner[b] != i:
                    return f"group {g}: cached block {b} (node {i}) is not tracked at its entry"
        for b in range(nb):
            if c.where[b] == NULL:
                if c.listed[b]:
                    return f"group {g}: block {b} is on an eviction list but not cached"
                continue
            tracked += 1
            if (refs[b] == 1) != (c.listed[b] != 0):
                state = "listed" if c.listed[b] else "not listed"
                return f"group {g}: cached block {b} has refcount {refs[b]} but is {state}"
            if c.listed[b] and c.listed[b] != 1 + c.kept[b]:
                return f"group {g}: cached block {b} is on list {c.listed[b] - 1}, its kind says {c.kept[b]}"
        if tracked != entries:
            return f"group {g}: {tracked} blocks are tracked as cached, the trie's entries hold {entries}"
        for q in range(2):
            b = c.head[q]
            prev = -1
            steps = 0
            while b >= 0:
                if steps > nb or c.listed[b] != q + 1 or c.prev[b] != prev:
                    return f"group {g}: eviction list {q} is broken at block {b}"
                prev = b
                b = c.next[b]
                steps += 1
            if prev != c.tail[q] or steps != c.count[q]:
                return f"group {g}: eviction list {q} holds {steps} blocks, its count says {c.count[q]}"
        return None

    cdef str count_refs(self, RadixTrie t, Records records, Py_ssize_t g, int64_t[::1] expected, Py_ssize_t nb):
        """Add to ``expected`` the references group ``g``'s columns hold (records' and cached
        runs'); a message naming an id outside ``[0, nb)``, else None."""
        cdef Py_ssize_t i, p, released
        cdef SeqRec *rec
        cdef RNode *node
        cdef int32_t *col
        for i in range(records.high_water()):
            rec = records.slot(i)
            if rec.status == FREE:
                continue
            col = chunk_column(rec.chunk, g)
            released = self.released_to(g, rec)
            for p in range(rec.num_blocks):
                if col[p] >= nb or col[p] < -1:
                    return f"group {g}: sequence {rec.seq_id} holds block id {col[p]} out of range [0, {nb})"
                if col[p] >= 0 and self.holds(rec, g, p, released):
                    expected[col[p]] += 1
        for i in range(t._high_water):
            node = &t._nodes[i]
            if node.parent < 0:
                continue
            col = chunk_column(node.chunk, g) + node.start
            for p in range(node.length):
                if col[p] >= nb or col[p] < -1:
                    return f"group {g}: node {i} holds block id {col[p]} out of range [0, {nb})"
                if col[p] >= 0:
                    expected[col[p]] += 1
        return None

    cdef list stats(self, RadixTrie t):
        """Per group: its rule, its pool's counts, the blocks the cache holds in it, its counters."""
        cdef Py_ssize_t g, i, p, cached
        cdef RNode *node
        cdef int32_t *col
        cdef BlockPool pool
        out = []
        for g in range(self.n):
            pool = self.pool_of(g)
            if g == 0:
                cached = t._num_blocks
            else:
                cached = 0
                for i in range(t._high_water):
                    node = &t._nodes[i]
                    if node.parent < 0:
                        continue
                    col = chunk_column(node.chunk, g) + node.start
                    for p in range(node.length):
                        cached += col[p] >= 0
            kind, window, sink = self._specs[g]
            out.append({
                "group": g, "kind": kind, "window": window, "sink_tokens": sink,
                "num_blocks": pool._num_blocks, "num_free": pool._num_free, "num_cached": cached,
                "blocks_allocated": self._counts[g].allocated, "blocks_freed": self._counts[g].freed,
                "blocks_released": self._counts[g].released, "blocks_kept_at_checkpoints": self._counts[g].kept,
                "blocks_released_to_cache": self._counts[g].to_cache,
                "num_cache_only": self._cache[g].count[0] + self._cache[g].count[1],
                "blocks_evicted": self._counts[g].evicted,
            })
        return out

    cdef int append(self, Records records, int64_t handle, object tokens, Py_ssize_t kv_tokens=-1) except -1:
        """``KVCacheCore.append``: the tokens recorded, then what left a window released (the
        record's KV covers the tokens it had before, or ``kv_tokens`` of them when that is not -1)."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, before
        cdef SeqRec *rec
        cdef Failure f
        tokens = token_vector(tokens, &data, &n)
        ok(&f)
        cdef PyThreadState *released = records.lock.enter(n)
        rec = records.get(handle, &f)
        if rec != NULL and kv_tokens > rec.num_tokens + n:
            f.code = E_INVALID_ARG
            f.value = kv_tokens
            f.limit = rec.num_tokens + n
        elif rec != NULL and self._reserve(rec.num_blocks):
            f.code = E_NO_MEMORY  # before the tokens are recorded: release cannot fail after them
        elif rec != NULL:
            before = rec.num_tokens
            records.append_locked(handle, data, n, &f)
            if f.code == OK:
                self.release(rec, before if kv_tokens < 0 else kv_tokens, NULL, 0, &f)
        records.lock.leave(released)
        if f.code == E_INVALID_ARG:
            raise InvalidId(f"append: kv_tokens={f.value} is over the {f.limit} tokens the sequence would hold")
        return records.raise_failure(&f, "append", tokens)

    cdef object table(self, Records records, int64_t handle, Py_ssize_t g, str call):
        """A copy of the record's ids in group ``g`` (1 .. n - 1)."""
        records.lock.enter_gil()
        try:
            return self.column(records.read(handle, call), g)
        finally:
            records.lock.leave(NULL)

    cdef Py_ssize_t write_table(self, Records records, int64_t handle, int32_t[::1] dest, object pad,
                                Py_ssize_t g) except -1:
        """``KVCacheCore.write_table`` for group ``g`` (1 .. n - 1): ``pad`` also where it needs no block."""
        cdef int32_t pad_id = -1
        if pad is not None:
            pad_id = <int32_t>_as_count(pad, "write_table: pad", 0, max(self.pool_of(g)._num_blocks - 1, 0))
        ids = self.table(records, handle, g, "write_table")
        if ids.shape[0] > dest.shape[0]:
            raise InvalidId(f"write_table: the sequence holds {ids.shape[0]} blocks, the buffer takes {dest.shape[0]}")
        view = np.asarray(dest)
        view[: ids.shape[0]] = ids
        if pad is not None:
            view[: ids.shape[0]][ids < 0] = pad_id
            view[ids.shape[0]:] = pad_id
        return ids.shape[0]

    cdef object column(self, SeqRec *rec, Py_ssize_t g):
        """A copy of the record's block ids in group ``g`` (-1: released or never needed)."""
        cdef cnp.ndarray out = np.empty(rec.num_blocks, dtype=np.int32)
        cdef int32_t *ids = <int32_t *>cnp.PyArray_DATA(out)
        cdef Py_ssize_t p, released = self.released_to(g, rec)
        if rec.num_blocks:
            memcpy(ids, chunk_column(rec.chunk, g), rec.num_blocks * sizeof(int32_t))
        for p in range(self._rules[g].sink_blocks, min(released, <Py_ssize_t>rec.pin_blocks)):
            ids[p] = -1  # released on its cached path: the entry is the cache's
        return out
