# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The KV cache core (module lifecycle._kvcache): the one owner of a request's KV state.

A ``KVCacheCore`` holds a ``BlockPool``, the prefix trie over it (``lifecycle._radix``), one record
per request and the SSM snapshot ids. A record owns the request's token ids and block table (one
``Chunk``), the pin on the cached path it uses or added, its content hashes once asked for, its
adapter slot reference and its status. Python holds a handle (an int, refused once stale) and
nothing else of that state.

What a scheduler does per request is one call here, the same for every model: ``attach`` (find,
pin and reference the cached prefix, then allocate the rest, evicting when short), ``append``,
``grow``, ``cache`` (into the trie, mid-life), ``snapshot_point`` (a hybrid model's SSM snapshot
at a block boundary), ``finish`` (cache the full blocks, release everything). When a finishing
request's new blocks go into the trie, its chunk is taken over instead of copied, unless most of
it would be waste.

Ownership (as SPEC §4 states it): the cache holds one pool reference per cached block; a record
holds one on every block of its table. References are acquired before any is released; a block the
cache takes from a finishing request changes owner without passing through zero.

Locking: every call works under the pool's lock (the trie and the records share it), with the GIL
released when the call is long or the lock is taken; nothing holding it waits for anything else.
"""

cimport cython
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.object cimport PyTypeObject
from cpython.ref cimport Py_INCREF
cimport numpy as cnp
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

from lifecycle._blockpool cimport BlockPool, lc_mutex_lock, lc_mutex_trylock, lc_mutex_unlock
from lifecycle._slots cimport SlotGuard, SlotPool
from lifecycle._hash cimport (
    LC_GOLDEN,
    lc_content_hashes,
    lc_copy_tokens_checked,
    lc_fmix64,
    lc_nh_block,
    lc_root_hash,
    lc_stream_tokens_checked,
)
from lifecycle._radix cimport (
    Chunk,
    RadixTrie,
    RNode,
    WalkEnd,
    chunk_decref,
    chunk_new,
    chunk_reserve,
)

import enum

import numpy as np

from lifecycle.errors import (
    ConfigError,
    ForeignSequence,
    InvalidId,
    InvariantViolation,
    OutOfBlocks,
    SequenceStateError,
    TornDown,
)

cnp.import_array()

from lifecycle._args cimport _ssize_arg_other, ssize_arg as _as_count
from lifecycle._int32 cimport (
    adapter_key as _adapter_key,
    int32_vector as _int32_vector_in,
    shrink as _shrink,
    empty_int32 as _empty_int32,
    first_negative as _first_negative,
    token_vector as _token_vector,
)

# Record status.
cdef enum:
    FREE = 0
    ACTIVE = 1
    RETIRED = 2

# Failure codes of a locked step.
cdef enum:
    OK = 0
    E_HANDLE = 1            # not a live record of this core
    E_STATE = 2             # the record is not in a state the call accepts
    E_OUT_OF_BLOCKS = 3     # value: blocks needed, limit: free after eviction
    E_NO_MEMORY = 4
    E_REFUSED = 5           # the pool refused a batch (batch holds why)
    E_INVARIANT = 6
    E_NEGATIVE_TOKEN = 7
    E_OTHER_TOKENS = 8      # attach on a record holding other tokens
    E_GROWN = 9             # attach after the block table grew past its prefix
    E_TOO_LONG = 10         # value: tokens or blocks asked for, limit: the per-sequence limit
    E_NOT_CACHED = 11       # value: blocks asked for, limit: full blocks the record has
    E_CLOSED = 12
    E_INVALID_ARG = 13      # value: the argument, limit: its bound

# Calls handling fewer tokens than this keep the GIL when the lock is free: handing it over and
# back costs more than such a call.
cdef enum:
    NOGIL_MIN_TOKENS = 4096

_STATUS_NAMES = ("freed", "active", "retired")


cdef extern from *:
    """
    #include <time.h>
    static inline uint64_t lc_monotonic_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
    }
    /* A cheap clock for timing calls: the time-stamp counter on x86-64 (converted to ns against
     * the monotonic clock over the process's life), the monotonic clock elsewhere. */
    #if defined(__x86_64__) || defined(_M_X64)
    #include <x86intrin.h>
    static inline uint64_t lc_ticks(void) { return __rdtsc(); }
    #else
    static inline uint64_t lc_ticks(void) { return lc_monotonic_ns(); }
    #endif
    """
    uint64_t lc_ticks() noexcept nogil
    uint64_t lc_monotonic_ns() noexcept nogil

cdef uint64_t _TICKS_AT_IMPORT = lc_ticks()
cdef uint64_t _NS_AT_IMPORT = lc_monotonic_ns()


cdef double _ns_per_tick():
    cdef uint64_t ticks = lc_ticks() - _TICKS_AT_IMPORT
    cdef uint64_t ns = lc_monotonic_ns() - _NS_AT_IMPORT
    return <double>ns / <double>ticks if ticks > 0 and ns > 0 else 1.0


# A handle is (generation << 32) | record index. Each core starts its generations elsewhere, so
# that another core's handle is refused too (short of 2**31 reuses of one record slot).
cdef int64_t INDEX_MASK = 0xFFFFFFFFLL
cdef uint32_t GENERATION_MASK = 0x7FFFFFFF
cdef uint32_t _last_generation_base = 0


cdef inline void _ok(Failure *f) noexcept nogil:
    f.code = OK
    f.batch.failed_at = -1


cdef inline Py_ssize_t _blocks_for(Py_ssize_t tokens, Py_ssize_t block_size) noexcept nogil:
    return (tokens + block_size - 1) // block_size


cdef Py_ssize_t _repeated_row(const int32_t *row_of, Py_ssize_t n, Py_ssize_t nrows, Failure *f) noexcept nogil:
    """The first entry whose table row (each already in ``[0, nrows)``) an earlier entry has, or
    -1: two requests must not write one row."""
    cdef Py_ssize_t i
    cdef unsigned char *seen = <unsigned char *>calloc(nrows, 1)
    if seen == NULL:
        f.code = E_NO_MEMORY
        return 0
    for i in range(n):
        if seen[row_of[i]]:
            free(seen)
            f.code = E_INVALID_ARG
            f.value = row_of[i]
            f.limit = -2  # a row given twice
            return i
        seen[row_of[i]] = 1
    free(seen)
    return -1


cdef inline int _grow_array(void **array, Py_ssize_t *capacity, Py_ssize_t needed, size_t item) noexcept nogil:
    """Make room for ``needed`` items (doubling); 1 when out of memory (nothing changed)."""
    cdef Py_ssize_t grown = capacity[0] if capacity[0] > 0 else 64
    cdef void *moved
    if needed <= capacity[0]:
        return 0
    while grown < needed:
        grown *= 2
    moved = realloc(array[0], grown * item)
    if moved == NULL:
        return 1
    array[0] = moved
    capacity[0] = grown
    return 0


cdef inline uint64_t *_chunk_hashes(Chunk *chunk) noexcept nogil:
    """The chunk's content-hash array (one slot per block position), made on first use; NULL when
    out of memory."""
    if chunk.hashes == NULL:
        chunk.hashes = <uint64_t *>calloc(max(<Py_ssize_t>chunk.block_capacity, <Py_ssize_t>1), sizeof(uint64_t))
    return chunk.hashes


cdef inline uint64_t _last_hash(RNode *node) noexcept nogil:
    """The content hash of a node's last block (0 if its chunk keeps none: out of memory)."""
    if node.chunk.hashes == NULL:
        return 0
    return node.chunk.hashes[node.start + node.length - 1]


cdef inline int64_t _handle_arg(object handle, str call) except? -1:
    """A record handle as given to ``call``: an exact int in [0, 2**63) costs one inline
    conversion; numpy integers pass through ``__index__``; anything else (a float, a string,
    None, a bool, an int out of range) is refused by name rather than truncated or converted.
    (Handles fit a Py_ssize_t: 64-bit platforms only, as the build requires.)"""
    cdef int overflow = 0
    cdef long long value
    if PyLong_CheckExact(handle):
        value = PyLong_AsLongLongAndOverflow(handle, &overflow)
        if not overflow and value >= 0:
            return <int64_t>value
    return _ssize_arg_other(handle, f"{call}: handle", 0, PY_SSIZE_T_MAX)  # names the value and the range


@cython.final
@cython.auto_pickle(False)
@cython.no_gc_clear  # __dealloc__ returns its records' chunks to the trie: a cycle's clear must leave it
cdef class KVCacheCore:
    """Block pool + prefix trie + per-request records, with one call per scheduler step.

    ``pool`` is the ``BlockPool`` whose references it keeps; ``block_size`` tokens per block;
    ``enable_prefix_cache=False`` makes it a plain allocator (nothing matches, nothing is cached);
    ``snapshot_cut=True`` (hybrid models) reuses a cached prefix only up to its deepest SSM
    snapshot, of which it keeps ids for ``num_snapshots``; ``max_blocks_per_seq`` caps a table.
    ``events`` / ``demote``: see ``set_events``; ``null_block=True`` holds block 0 of a fresh
    pool for good (engines pad their tables with it), so it is never handed out or cached.
    """

    def __init__(self, BlockPool pool not None, block_size, *, enable_prefix_cache=True, snapshot_cut=False,
                 num_snapshots=0, max_blocks_per_seq=None, max_tokens_per_seq=None, capacity=None,
                 events=False, demote=False, null_block=False):
        """An empty cache over ``pool`` with ``block_size`` tokens per block; the class says what
        each option does."""
        cdef Py_ssize_t i
        global _last_generation_base
        if self._pool is not None:
            raise ConfigError("this KVCacheCore is already initialized; make a new one")
        _last_generation_base = (_last_generation_base + 0x9E3779B9) & GENERATION_MASK
        self._generation_base = _last_generation_base
        total = pool.num_total
        self._block_size = _as_count(block_size, "block_size", 1, 1 << 16)
        self._max_blocks_per_seq = _as_count(
            total if max_blocks_per_seq is None else max_blocks_per_seq, "max_blocks_per_seq", 0,
            INT32_MAX // self._block_size - 1,
        )
        # A sequence may hold one block's worth of tokens past its blocks (the token being computed).
        self._max_tokens_per_seq = _as_count(
            (self._max_blocks_per_seq + 1) * self._block_size if max_tokens_per_seq is None else max_tokens_per_seq,
            "max_tokens_per_seq", 0, INT32_MAX,
        )
        self._num_snapshots = <int32_t>_as_count(num_snapshots, "num_snapshots", 0, INT32_MAX // 2)
        # Nodes hold runs of blocks, so far fewer nodes than blocks are needed; the table grows.
        self._trie = RadixTrie(
            self._block_size, capacity=_as_count(1024 if capacity is None else capacity, "capacity", 0, INT32_MAX // 4)
        )
        self._trie._lock = &pool._lock
        self._pool = pool
        self._enabled = bool(enable_prefix_cache)
        self._snapshot_cut = bool(snapshot_cut)
        self._recs_free = -1
        self._snap_head = -1
        self._snap_tail = -1
        self._snap_free = -1
        n = self._num_snapshots
        self._snap_node = <int32_t *>malloc((n + 1) * sizeof(int32_t))
        self._snap_generation = <uint32_t *>malloc((n + 1) * sizeof(uint32_t))
        self._snap_prev = <int32_t *>malloc((n + 1) * sizeof(int32_t))
        self._snap_next = <int32_t *>malloc((n + 1) * sizeof(int32_t))
        if (
            self._snap_node == NULL or self._snap_generation == NULL or self._snap_prev == NULL
            or self._snap_next == NULL
        ):
            raise MemoryError(f"KVCacheCore: cannot allocate tables for {n} snapshots")
        for i in range(n - 1, -1, -1):
            self._snap_node[i] = -1
            self._snap_generation[i] = 0
            self._snap_prev[i] = -1
            self._snap_next[i] = self._snap_free
            self._snap_free = <int32_t>i
        self._null_block = -1
        self._max_pending_tokens = 1 << 24
        if null_block:
            if self._pool.num_free != self._pool.num_total or self._pool.num_total == 0:
                raise ConfigError(
                    f"null_block needs a fresh pool with at least one block (free {self._pool.num_free} of "
                    f"{self._pool.num_total})"
                )
            with nogil:
                self._lock()
                self._pool._allocate_locked(&self._null_block, 1)
                self._unlock()
            if self._null_block != 0:
                raise InvariantViolation(f"a fresh pool handed out block {self._null_block} first, not block 0")
        if events or demote:
            self.set_events(events, demote)

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._recs != NULL and self._trie is not None:
            for i in range(self._recs_high_water):
                if self._recs[i].status != FREE:
                    chunk_decref(&self._trie._chunks, self._recs[i].chunk)
        free(self._recs)
        free(self._scratch)
        free(self._token_scratch)
        free(self._hash_scratch)
        _free_log(&self._log)
        _free_log(&self._spare)
        free(self._snap_node)
        free(self._snap_generation)
        free(self._snap_prev)
        free(self._snap_next)

    def __repr__(self):
        return (
            f"KVCacheCore(blocks={self._pool.num_total}, free={self._pool.num_free}, "
            f"cached={self._trie._num_blocks}, sequences={self._num_live})"
        )

    # -- properties --

    @property
    def pool(self):
        """The ``BlockPool`` this core keeps references in."""
        return self._pool

    @property
    def trie(self):
        """The prefix trie (inspection and ``check_invariants`` only)."""
        return self._trie

    @property
    def block_size(self):
        return self._block_size

    @property
    def enabled(self):
        """Whether the prefix cache is on."""
        return self._enabled

    @property
    def max_blocks_per_seq(self):
        return self._max_blocks_per_seq

    @property
    def num_snapshots(self):
        """SSM snapshot ids this core hands out (0: none)."""
        return self._num_snapshots

    @property
    def num_live_sequences(self):
        return self._num_live

    @property
    def num_cached_blocks(self):
        """Blocks the cache holds a reference on."""
        return self._trie._num_blocks

    @property
    def num_evictable_blocks(self):
        """Cached blocks eviction may drop: not pinned, not above a pinned node."""
        return self._trie._lru_blocks

    @property
    def num_snapshots_used(self):
        return self._snaps_used

    # -- locking ----------------------------------------------------------------------------------

    cdef bint _lock_with_gil(self, Py_ssize_t work):
        """Take the lock keeping the GIL when the work is short and the lock free; False means
        the caller must take it with the GIL released."""
        if work < NOGIL_MIN_TOKENS and lc_mutex_trylock(&self._pool._lock):
            self._entered = lc_ticks()
            return True
        return False

    cdef void _lock(self) noexcept nogil:
        lc_mutex_lock(&self._pool._lock)
        self._entered = lc_ticks()

    cdef void _unlock(self) noexcept nogil:
        # Time under the lock is the core's time in the library (the counter is the lock's too).
        self._counters.time_ticks += lc_ticks() - self._entered
        lc_mutex_unlock(&self._pool._lock)

    # -- records (lock held) ----------------------------------------------------------------------

    cdef SeqRec *_rec(self, int64_t handle, Failure *f) noexcept nogil:
        cdef int64_t index = handle & INDEX_MASK
        cdef SeqRec *rec
        if self._closed:
            f.code = E_CLOSED
            return NULL
        if handle < 0 or index >= self._recs_high_water:
            f.code = E_HANDLE
            f.value = handle
            return NULL
        rec = &self._recs[index]
        if rec.status == FREE or rec.generation != <uint32_t>(handle >> 32):
            f.code = E_HANDLE
            f.value = handle
            return NULL
        return rec

    cdef SeqRec *_active(self, int64_t handle, Failure *f) noexcept nogil:
        cdef SeqRec *rec = self._rec(handle, f)
        if rec != NULL and rec.status != ACTIVE:
            f.code = E_STATE
            f.value = rec.seq_id
            f.limit = rec.status
            return NULL
        return rec

    cdef int64_t _open_locked(
        self, int64_t adapter, int32_t adapter_slot, Py_ssize_t tokens, Failure *f
    ) noexcept nogil:
        cdef Py_ssize_t capacity, index
        cdef SeqRec *grown
        cdef SeqRec *rec
        cdef Chunk *chunk
        if self._closed:
            f.code = E_CLOSED
            return -1
        if self._recs_free < 0 and self._recs_high_water == self._recs_capacity:
            capacity = max(<Py_ssize_t>64, 2 * self._recs_capacity)
            if capacity > INT32_MAX:
                f.code = E_NO_MEMORY
                return -1
            grown = <SeqRec *>realloc(self._recs, capacity * sizeof(SeqRec))
            if grown == NULL:
                f.code = E_NO_MEMORY
                return -1
            self._recs = grown
            self._recs_capacity = capacity
        chunk = chunk_new(&self._trie._chunks, _blocks_for(tokens, self._block_size) + 1, tokens)
        if chunk == NULL:
            f.code = E_NO_MEMORY
            return -1
        if self._recs_free >= 0:
            index = self._recs_free
            self._recs_free = self._recs[index].next_free
        else:
            index = self._recs_high_water
            self._recs_high_water += 1
            self._recs[index].generation = self._generation_base
        rec = &self._recs[index]
        # 31 bits, so that a handle is never negative; never 0.
        rec.generation = (rec.generation + 1) & GENERATION_MASK
        if rec.generation == 0:
            rec.generation = 1
        rec.chunk = chunk
        rec.adapter = adapter
        rec.adapter_slot = adapter_slot
        rec.seq_id = self._next_seq_id
        self._next_seq_id += 1
        rec.num_tokens = 0
        rec.prompt_len = 0
        rec.num_blocks = 0
        rec.cached_tokens = 0
        rec.lazy_tokens = 0
        rec.pin_node = -1
        rec.pin_blocks = 0
        rec.ssm_tokens = -1
        rec.rolling = -1
        rec.rolling_generation = 0
        rec.status = ACTIVE
        rec.failed = 0
        rec.step_stamp = 0
        rec.next_free = -1
        self._num_live += 1
        self._counters.sequences_opened += 1
        return (<int64_t>rec.generation << 32) | index

    cdef int _reserve_rec(self, SeqRec *rec, Py_ssize_t blocks, Py_ssize_t tokens) noexcept nogil:
        """Room in the record's chunk; 1 when out of memory. A chunk trie nodes hold too never
        moves: the record moves to a bigger copy instead."""
        cdef Chunk *old = rec.chunk
        cdef Chunk *chunk
        if blocks <= old.block_capacity and tokens <= old.token_capacity:
            return 0
        if old.refs == 1:
            return chunk_reserve(&self._trie._chunks, old, blocks, tokens)
        chunk = chunk_new(
            &self._trie._chunks,
            max(blocks, 2 * <Py_ssize_t>old.block_capacity),
            max(tokens, 2 * <Py_ssize_t>old.token_capacity),
        )
        if chunk == NULL:
            return 1
        memcpy(
            chunk.tokens + rec.lazy_tokens, old.tokens + rec.lazy_tokens,
            (rec.num_tokens - rec.lazy_tokens) * sizeof(int32_t),
        )
        memcpy(chunk.blocks, old.blocks, rec.num_blocks * sizeof(int32_t))
        if old.num_hashed:
            chunk.hashes = <uint64_t *>malloc(chunk.block_capacity * sizeof(uint64_t))
            if chunk.hashes == NULL:
                chunk_decref(&self._trie._chunks, chunk)
                return 1
            memcpy(chunk.hashes, old.hashes, old.num_hashed * sizeof(uint64_t))
            chunk.num_hashed = old.num_hashed
        rec.chunk = chunk
        chunk_decref(&self._trie._chunks, old)
        return 0

    cdef void _materialize(self, SeqRec *rec) noexcept nogil:
        """Write the record's leading tokens that only its pinned path held (attach copies just
        what the cache did not have)."""
        if rec.lazy_tokens:
            self._trie._path_tokens(rec.pin_node, rec.chunk.tokens, rec.lazy_tokens // self._block_size)
            rec.lazy_tokens = 0

    cdef void _close_rec(self, SeqRec *rec) noexcept nogil:
        cdef Py_ssize_t index = rec - self._recs
        chunk_decref(&self._trie._chunks, rec.chunk)
        rec.chunk = NULL
        rec.status = FREE
        rec.next_free = self._recs_free
        self._recs_free = <int32_t>index
        self._num_live -= 1
        self._counters.sequences_closed += 1

    # -- snapshots (lock held) ----------------------------------------------------------------------

    cdef void _snap_unlink(self, int32_t sid) noexcept nogil:
        cdef int32_t prev = self._snap_prev[sid], after = self._snap_next[sid]
        if prev >= 0:
            self._snap_next[prev] = after
        else:
            self._snap_head = after
        if after >= 0:
            self._snap_prev[after] = prev
        else:
            self._snap_tail = prev

    cdef void _snap_append(self, int32_t sid) noexcept nogil:
        self._snap_prev[sid] = self._snap_tail
        self._snap_next[sid] = -1
        if self._snap_tail >= 0:
            self._snap_next[self._snap_tail] = sid
        else:
            self._snap_head = sid
        self._snap_tail = sid

    cdef void _snap_touch(self, int32_t sid) noexcept nogil:
        self._snap_unlink(sid)
        self._snap_append(sid)

    cdef void _snap_release(self, int32_t sid) noexcept nogil:
        """Free snapshot ``sid`` whose node lost its tag (already cleared there)."""
        self._snap_unlink(sid)
        self._snap_node[sid] = -1
        self._snap_next[sid] = self._snap_free
        self._snap_free = sid
        self._snaps_used -= 1
        self._counters.snapshots_evicted += 1

    cdef void _drain_tags(self) noexcept nogil:
        """Free the snapshots of nodes the trie trimmed or dropped."""
        cdef Py_ssize_t i
        for i in range(self._trie._num_evicted_tags):
            self._snap_release(self._trie._evicted_tags[i])
        self._trie._num_evicted_tags = 0

    cdef int32_t _snap_take(self) noexcept nogil:
        """A snapshot id for a new snapshot: a free one, else the least recently used one (its
        node keeps its KV and loses the snapshot). -1 when there are none at all."""
        cdef int32_t sid = self._snap_free
        if sid >= 0:
            self._snap_free = self._snap_next[sid]
        else:
            sid = self._snap_head
            if sid < 0:
                return -1
            self._trie._nodes[self._snap_node[sid]].tag = -1
            self._snap_unlink(sid)
            self._snaps_used -= 1
            self._counters.snapshots_evicted += 1
        self._snap_generation[sid] += 1
        self._snaps_used += 1
        self._snap_append(sid)
        return sid

    # -- eviction and allocation (lock held) ----------------------------------------------------------

    cdef int _reserve_scratch(self, Py_ssize_t n) noexcept nogil:
        cdef int32_t *grown
        if n <= self._scratch_capacity:
            return 0
        grown = <int32_t *>realloc(self._scratch, n * sizeof(int32_t))
        if grown == NULL:
            return 1
        self._scratch = grown
        self._scratch_capacity = n
        return 0

    cdef Py_ssize_t _evict_locked(self, Py_ssize_t n, Failure *f) noexcept nogil:
        """Trim least recently used cached blocks until ``n`` became free or nothing is evictable;
        returns how many became free. A block a request still holds loses the cache's reference
        but frees nothing, so the next round trims more."""
        cdef Py_ssize_t freed = 0, want, count
        cdef bint keep_tokens, logging
        while freed < n:
            want = min(n - freed, self._trie._lru_blocks)
            if want <= 0:
                break
            keep_tokens = self._demote and not self._quiet
            logging = (self._events or self._demote) and not self._quiet
            if self._reserve_scratch(want) or (logging and self._reserve_token_scratch(want, keep_tokens)):
                f.code = E_NO_MEMORY
                break
            count = self._trie._trim(
                want, self._scratch, self._token_scratch if keep_tokens else NULL,
                self._hash_scratch if logging else NULL,
            )
            if count < 0:
                f.code = E_INVARIANT
                f.value = self._trie._lru_head
                break
            self._counters.blocks_evicted += count
            if logging and count > 0:
                self._log_removed(
                    self._scratch, self._token_scratch if keep_tokens else NULL, self._hash_scratch, count
                )
            freed += self._pool._dec_ref_locked(self._scratch, count, &f.batch)
            if f.batch.failed_at >= 0:
                f.code = E_INVARIANT
                break
            if self._trie._num_evicted_tags:
                self._drain_tags()
            if count == 0:
                break
        self._counters.blocks_freed += freed
        return freed

    cdef int _reserve_token_scratch(self, Py_ssize_t blocks, bint tokens) noexcept nogil:
        """Room for the hashes (and, with ``tokens``, the tokens) of ``blocks`` removed blocks."""
        if _grow_array(<void **>&self._hash_scratch, &self._hash_scratch_capacity, blocks, sizeof(uint64_t)):
            return 1
        if tokens and _grow_array(
            <void **>&self._token_scratch, &self._token_scratch_capacity, blocks * self._block_size, sizeof(int32_t)
        ):
            return 1
        return 0

    # -- content hashes of cached blocks and the event log (lock held) -------------------------------

    cdef EvEntry *_log_entry(self, Py_ssize_t hashes, Py_ssize_t tokens, Py_ssize_t ids) noexcept nogil:
        """Room for one more entry with that many hashes, tokens and ids; NULL (the entry counted
        as dropped) past the pending limit or out of memory."""
        cdef EvLog *log = &self._log
        if log.num_tokens + tokens > self._max_pending_tokens:
            log.dropped += 1
            return NULL
        if (
            _grow_array(<void **>&log.entries, &log.entries_capacity, log.num_entries + 1, sizeof(EvEntry))
            or _grow_array(<void **>&log.hashes, &log.hashes_capacity, log.num_hashes + hashes, sizeof(uint64_t))
            or _grow_array(<void **>&log.tokens, &log.tokens_capacity, log.num_tokens + tokens, sizeof(int32_t))
            or _grow_array(<void **>&log.ids, &log.ids_capacity, log.num_ids + ids, sizeof(int32_t))
        ):
            log.dropped += 1
            return NULL
        log.num_entries += 1
        return &log.entries[log.num_entries - 1]

    cdef void _log_stored(self, int32_t v, Py_ssize_t count) noexcept nogil:
        """The last ``count`` blocks of node ``v`` were just cached: keep their content hashes in
        the node's chunk, at the blocks' positions (chained from the block before them), and, with
        events on, log them."""
        cdef RNode *node = &self._trie._nodes[v]
        cdef RNode *up
        cdef Py_ssize_t bs = self._block_size, first = node.start + node.length - count
        cdef uint64_t parent
        cdef int64_t key
        cdef bint has_parent = True
        cdef const int32_t *tokens = node.chunk.tokens + first * bs
        cdef uint64_t *hashes
        cdef EvEntry *entry
        if not self._track or count <= 0:
            return
        hashes = _chunk_hashes(node.chunk)
        if hashes == NULL:
            self._log.dropped += 1  # out of memory: these blocks' removals will name hash 0
            return
        up = node
        while up.parent >= 0:
            up = &self._trie._nodes[up.parent]
        key = <int64_t>up.key
        if count < node.length:
            parent = hashes[first - 1]
        else:
            up = &self._trie._nodes[node.parent]
            if up.parent < 0:
                parent = lc_root_hash(key)
                has_parent = False
            else:
                parent = _last_hash(up)
        lc_content_hashes(parent, tokens, count, bs, self._trie._keys, hashes + first)
        if not self._events:
            return
        entry = self._log_entry(count, count * bs, 0)
        if entry == NULL:
            return
        entry.kind = 1
        entry.adapter = key
        entry.parent = parent
        entry.has_parent = has_parent
        entry.has_ids = 0
        entry.count = <int32_t>count
        entry.num_tokens = <int32_t>(count * bs)
        memcpy(self._log.hashes + self._log.num_hashes, hashes + first, count * sizeof(uint64_t))
        self._log.num_hashes += count
        memcpy(self._log.tokens + self._log.num_tokens, tokens, count * bs * sizeof(int32_t))
        self._log.num_tokens += count * bs

    cdef void _log_removed(
        self, const int32_t *ids, const int32_t *tokens, const uint64_t *hashes, Py_ssize_t count
    ) noexcept nogil:
        """``count`` cached blocks left the cache: log their ``hashes`` (with demotion, their
        ids and tokens too)."""
        cdef Py_ssize_t bs = self._block_size
        cdef bint with_tokens = tokens != NULL
        cdef EvEntry *entry = self._log_entry(count, count * bs if with_tokens else 0, count if with_tokens else 0)
        if entry == NULL:
            return
        entry.kind = 2
        entry.adapter = 0
        entry.parent = 0
        entry.has_parent = 0
        entry.has_ids = with_tokens
        entry.count = <int32_t>count
        entry.num_tokens = <int32_t>(count * bs if with_tokens else 0)
        memcpy(self._log.hashes + self._log.num_hashes, hashes, count * sizeof(uint64_t))
        self._log.num_hashes += count
        if with_tokens:
            memcpy(self._log.ids + self._log.num_ids, ids, count * sizeof(int32_t))
            self._log.num_ids += count
            memcpy(self._log.tokens + self._log.num_tokens, tokens, count * bs * sizeof(int32_t))
            self._log.num_tokens += count * bs

    cdef int _grow_locked(self, SeqRec *rec, Py_ssize_t num_blocks, Failure *f) noexcept nogil:
        """Extend the record's table to ``num_blocks`` fresh blocks, evicting when short; all or
        nothing (blocks evicted stay evicted)."""
        cdef Py_ssize_t need = num_blocks - rec.num_blocks
        if need <= 0:
            return 0
        if self._reserve_rec(rec, num_blocks, 0):
            f.code = E_NO_MEMORY
            return -1
        if self._pool._num_free < need:
            self._evict_locked(need - self._pool._num_free, f)
            if f.code != OK:
                return -1
        if not self._pool._allocate_locked(rec.chunk.blocks + rec.num_blocks, need):
            f.code = E_OUT_OF_BLOCKS
            f.value = need
            f.limit = self._pool._num_free
            return -1
        rec.num_blocks = <int32_t>num_blocks
        self._counters.blocks_allocated += need
        return 0

    # -- prefix matching (lock held) ------------------------------------------------------------------

    cdef int32_t _match(self, int64_t adapter, const int32_t *tokens, Py_ssize_t limit, Py_ssize_t *matched,
                        Py_ssize_t *reuse, Failure *f) noexcept nogil:
        """Walk the cached prefix of ``tokens`` (at most ``limit`` blocks), make it the most
        recently used (cutting the node where the match ends) and return the node ending the part
        prefill may reuse (all of it, or with ``snapshot_cut`` up to its deepest snapshot), -1 if
        none; ``matched``/``reuse`` get their block counts. Pins nothing."""
        cdef WalkEnd end
        cdef int32_t root, last
        matched[0] = 0
        reuse[0] = 0
        if limit <= 0:
            return -1
        root = self._trie._find_root(adapter)
        if root < 0:
            return -1
        matched[0] = self._trie._walk(root, tokens, limit, &end)
        if matched[0] == 0:
            return -1
        if self._trie._reserve(1):
            f.code = E_NO_MEMORY
            matched[0] = 0
            return -1
        last = self._trie._settle(&end)
        self._trie._touch(last)
        if not self._snapshot_cut:
            reuse[0] = matched[0]
            return last
        reuse[0] = end.tagged_blocks
        return end.tagged_node

    cdef void _count_lookup(self, Py_ssize_t prompt_tokens, Py_ssize_t matched, Py_ssize_t reuse) noexcept nogil:
        cdef Counters *c = &self._counters
        c.prefix_lookups += 1
        c.prefix_lookup_tokens += prompt_tokens
        if reuse:
            c.prefix_hits += 1
            c.prefix_hit_tokens += reuse * self._block_size
        else:
            c.prefix_misses += 1
        if self._snapshot_cut and matched:
            if reuse:
                c.snapshot_hits += 1
            if reuse < matched:
                c.snapshot_hits_cut_short += 1

    # -- attach ---------------------------------------------------------------------------------------

    cdef Py_ssize_t _attach_locked(self, SeqRec *rec, const int32_t *tokens, Py_ssize_t n, Py_ssize_t max_prefix,
                                   Py_ssize_t grow_to, Failure *f) noexcept nogil:
        cdef Py_ssize_t bs = self._block_size, limit = 0, matched = 0, reuse = 0
        cdef int32_t end = -1, old_pin
        cdef Py_ssize_t old_blocks
        cdef bint retry = rec.num_tokens > 0
        cdef Chunk *chunk
        cdef Chunk *fresh = NULL
        cdef WalkEnd walk
        cdef int32_t root = -1
        if retry:
            self._materialize(rec)
            if rec.num_tokens != n or memcmp_tokens(rec.chunk.tokens, tokens, n):
                f.code = E_OTHER_TOKENS
                f.value = rec.seq_id
                f.limit = rec.num_tokens
                return -1
            if rec.num_blocks != rec.pin_blocks:
                f.code = E_GROWN
                f.value = rec.seq_id
                f.limit = rec.num_blocks
                return -1
        elif rec.num_blocks:
            # Blocks taken before any tokens (grow, allocate, an empty prompt's growth): the prefix
            # would be written over them and they would leak.
            f.code = E_GROWN
            f.value = rec.seq_id
            f.limit = rec.num_blocks
            return -1
        elif self._reserve_rec(rec, max(grow_to, _blocks_for(n, bs)), n):
            f.code = E_NO_MEMORY
            return -1
        # The walk only reads: a refused prompt (below) leaves the trie as it was.
        if self._enabled and n > 1:
            limit = (n - 1) // bs
            if 0 <= max_prefix < limit:
                limit = max_prefix
            root = self._trie._find_root(rec.adapter)
            if root >= 0 and limit > 0:
                matched = self._trie._walk(root, tokens, limit, &walk)
                reuse = matched if not self._snapshot_cut else walk.tagged_blocks
        chunk = rec.chunk
        if not retry:
            # Only what the cache does not hold is copied; the reused head is the pinned path's.
            if lc_stream_tokens_checked(chunk.tokens + reuse * bs, tokens + reuse * bs, n - reuse * bs):
                f.code = E_NEGATIVE_TOKEN
                return -1
        if matched:
            if self._trie._reserve(1):
                f.code = E_NO_MEMORY
                return -1
            end = self._trie._settle(&walk)
            self._trie._touch(end)
            if self._snapshot_cut:
                end = walk.tagged_node
        old_pin = rec.pin_node
        old_blocks = rec.pin_blocks
        if retry and end == old_pin:
            pass  # the same prefix is held already: no second set of references
        elif retry:
            if end >= 0 and self._reserve_scratch(reuse):
                f.code = E_NO_MEMORY
                return -1
            if reuse < old_blocks and chunk.refs > 1:
                # Trie nodes hold the table's tail in this chunk (it was cached mid-life): the
                # shorter table's growth must not write over it, so the record moves to a copy.
                fresh = chunk_new(&self._trie._chunks, chunk.block_capacity, chunk.token_capacity)
                if fresh == NULL:
                    f.code = E_NO_MEMORY
                    return -1
            # New references first (into scratch), then the old ones go.
            if end >= 0:
                self._trie._path_blocks(end, self._scratch)
                self._pool._inc_ref_locked(self._scratch, reuse, &f.batch)
                if f.batch.failed_at >= 0:
                    if fresh != NULL:
                        chunk_decref(&self._trie._chunks, fresh)
                    f.code = E_REFUSED
                    return -1
                self._trie._pin(end)
            if old_pin >= 0:
                self._trie._unpin(old_pin)
                self._counters.blocks_freed += self._pool._dec_ref_locked(chunk.blocks, old_blocks, &f.batch)
            if fresh != NULL:
                memcpy(fresh.tokens, chunk.tokens, rec.num_tokens * sizeof(int32_t))
                chunk_decref(&self._trie._chunks, chunk)
                rec.chunk = chunk = fresh
            if end >= 0:
                memcpy(chunk.blocks, self._scratch, reuse * sizeof(int32_t))
            rec.pin_node = end
            rec.pin_blocks = <int32_t>reuse
            rec.num_blocks = <int32_t>reuse
        else:
            if end >= 0:
                self._trie._path_blocks(end, chunk.blocks)
                self._pool._inc_ref_locked(chunk.blocks, reuse, &f.batch)
                if f.batch.failed_at >= 0:
                    f.code = E_REFUSED
                    return -1
                self._trie._pin(end)
                if self._snapshot_cut:
                    self._snap_touch(self._trie._nodes[end].tag)
            rec.pin_node = end
            rec.pin_blocks = <int32_t>reuse
            rec.num_blocks = <int32_t>reuse
            rec.num_tokens = <int32_t>n
            rec.prompt_len = <int32_t>n
            rec.lazy_tokens = <int32_t>(reuse * bs)
            self._count_lookup(n, matched, reuse)
        rec.cached_tokens = <int32_t>(reuse * bs)
        if grow_to > rec.num_blocks:
            self._grow_locked(rec, grow_to, f)
        return reuse

    # -- caching ----------------------------------------------------------------------------------------

    cdef int32_t _cache_locked(self, SeqRec *rec, Py_ssize_t full, Py_ssize_t *taken, Failure *f) noexcept nogil:
        """Insert the record's first ``full`` blocks (past what it holds pinned) into the trie,
        the cache taking a reference of its own on every new node's block, and move the record's
        pin to the path's end; returns that end (-1 for ``full == 0``)."""
        cdef Py_ssize_t bs = self._block_size, d = rec.pin_blocks, matched, pos
        cdef int32_t start, v, end
        cdef WalkEnd walk
        cdef RNode *node
        cdef Chunk *chunk = rec.chunk
        taken[0] = 0
        if full <= d:
            return rec.pin_node if full == d else self._node_at(rec, full, f)
        if self._trie._reserve(3):
            f.code = E_NO_MEMORY
            return -1
        start = rec.pin_node if rec.pin_node >= 0 else self._trie._root(rec.adapter)
        node = &self._trie._nodes[start]
        if (
            rec.pin_node >= 0 and node.num_children == 0 and node.chunk == chunk and node.tag < 0
            and node.pin_count == 1 and node.start + node.length == d
        ):
            # The record's own leaf, continued by its next blocks (a rolling snapshot's path):
            # lengthen it instead of adding a node per step.
            self._pool._inc_ref_locked(chunk.blocks + d, full - d, &f.batch)
            if f.batch.failed_at >= 0:
                f.code = E_REFUSED
                return -1
            self._trie._extend(start, <int32_t>(full - d))
            if self._track:
                self._log_stored(start, full - d)
            taken[0] = full - d
            self._counters.blocks_cached += full - d
            rec.pin_blocks = <int32_t>full
            return start
        matched = self._trie._walk(start, chunk.tokens + d * bs, full - d, &walk)
        v = self._trie._settle(&walk)
        pos = d + matched
        if pos < full:
            self._pool._inc_ref_locked(chunk.blocks + pos, full - pos, &f.batch)
            if f.batch.failed_at >= 0:
                f.code = E_REFUSED
                return -1
            end = self._trie._add_leaf(v, chunk, <int32_t>pos, <int32_t>(full - pos))
            if self._track:
                self._log_stored(end, full - pos)
            taken[0] = full - pos
            self._counters.blocks_cached += full - pos
        else:
            end = v
            self._trie._touch(v)
        self._trie._pin(end)
        if rec.pin_node >= 0:
            self._trie._unpin(rec.pin_node)
        rec.pin_node = end
        rec.pin_blocks = <int32_t>full
        return end

    cdef int32_t _node_at(self, SeqRec *rec, Py_ssize_t blocks, Failure *f) noexcept nogil:
        """The node ending exactly ``blocks`` blocks into the record's pinned path (cut there if
        needed); -1 for 0 blocks."""
        cdef WalkEnd walk
        cdef int32_t root
        if blocks <= 0:
            return -1
        self._materialize(rec)
        if self._trie._reserve(1):
            f.code = E_NO_MEMORY
            return -1
        root = self._trie._find_root(rec.adapter)
        if root < 0 or self._trie._walk(root, rec.chunk.tokens, blocks, &walk) != blocks:
            f.code = E_INVARIANT
            f.value = rec.seq_id
            return -1
        return self._trie._settle(&walk)

    cdef Py_ssize_t _finish_locked(self, SeqRec *rec, bint cache, Failure *f) noexcept nogil:
        """Cache the record's full blocks (its chunk taken over by the new leaf, or copied when
        most of it would be waste), unpin, release its block references and close it; returns
        how many blocks became free."""
        cdef Py_ssize_t bs = self._block_size, d = rec.pin_blocks, full = 0, pos = 0, matched, length
        cdef Py_ssize_t freed
        cdef int32_t start, v, leaf = -1
        cdef WalkEnd walk
        cdef Chunk *chunk = rec.chunk
        cdef Chunk *copy
        if cache and self._enabled and not rec.failed:
            full = min(<Py_ssize_t>rec.num_tokens // bs, <Py_ssize_t>rec.num_blocks)
            pos = full
            if full > d:
                if self._trie._reserve(3):
                    f.code = E_NO_MEMORY
                    return -1
                start = rec.pin_node if rec.pin_node >= 0 else self._trie._root(rec.adapter)
                matched = self._trie._walk(start, chunk.tokens + d * bs, full - d, &walk)
                v = self._trie._settle(&walk)
                pos = d + matched
                length = full - pos
                if length <= 0:
                    self._trie._touch(v)
                elif 2 * length * bs >= chunk.token_capacity:
                    leaf = self._trie._add_leaf(v, chunk, <int32_t>pos, <int32_t>length)
                else:
                    copy = chunk_new(&self._trie._chunks, length, length * bs)
                    if copy == NULL:
                        f.code = E_NO_MEMORY
                        return -1
                    memcpy(copy.tokens, chunk.tokens + pos * bs, length * bs * sizeof(int32_t))
                    memcpy(copy.blocks, chunk.blocks + pos, length * sizeof(int32_t))
                    if chunk.num_hashed >= full:
                        copy.hashes = <uint64_t *>malloc(length * sizeof(uint64_t))
                        if copy.hashes != NULL:
                            memcpy(copy.hashes, chunk.hashes + pos, length * sizeof(uint64_t))
                            copy.num_hashed = <int32_t>length
                    leaf = self._trie._add_leaf(v, copy, 0, <int32_t>length)
                    chunk_decref(&self._trie._chunks, copy)
                if length > 0:
                    self._counters.blocks_cached += length
                    if self._track:
                        self._log_stored(leaf, length)
        if rec.pin_node >= 0:
            self._trie._unpin(rec.pin_node)
        # The blocks [pos, full) now belong to the cache: the record's references changed owner.
        freed = self._pool._dec_ref_locked(chunk.blocks, pos, &f.batch)
        if f.batch.failed_at < 0:
            freed += self._pool._dec_ref_locked(chunk.blocks + full, rec.num_blocks - full, &f.batch)
        if f.batch.failed_at >= 0:
            f.code = E_INVARIANT
        self._counters.blocks_freed += freed
        self._close_rec(rec)
        return freed

    # -- errors (GIL held, lock released) ----------------------------------------------------------------

    cdef int _raise(self, Failure *f, str call, object tokens=None) except -1:
        cdef int code = f.code
        if code == OK:
            return 0
        if code == E_CLOSED:
            raise TornDown(f"{call}: the KV cache core was closed (torn down)")
        if code == E_HANDLE:
            raise SequenceStateError(
                f"{call}: {f.value} is not a live sequence of this cache (freed, or another model's)"
            )
        if code == E_STATE:
            raise SequenceStateError(f"{call}: sequence {f.value} is {_STATUS_NAMES[f.limit]}, not active")
        if code == E_OUT_OF_BLOCKS:
            raise OutOfBlocks(
                f"{call}: need {f.value} blocks, {f.limit} free of {self._pool._num_blocks} after evicting "
                "every evictable cached block"
            )
        if code == E_NO_MEMORY:
            raise MemoryError(f"{call}: out of host memory for the cache's tables")
        if code == E_REFUSED:
            self._pool._raise_refused(&f.batch, "inc_ref")
        if code == E_NEGATIVE_TOKEN:
            if tokens is not None:
                raise _first_negative(
                    <const int32_t *>cnp.PyArray_DATA(<cnp.ndarray>tokens), cnp.PyArray_DIM(<cnp.ndarray>tokens, 0)
                )
            raise InvalidId(f"{call}: token ids must lie in [0, 2147483647]")
        if code == E_OTHER_TOKENS:
            raise SequenceStateError(f"{call}: sequence {f.value} already holds {f.limit} other tokens")
        if code == E_GROWN:
            raise SequenceStateError(
                f"{call}: sequence {f.value} already grew to {f.limit} blocks; "
                "attach a prefix before allocating the rest"
            )
        if code == E_TOO_LONG:
            raise InvalidId(f"{call}: {f.value} is over the per-sequence limit of {f.limit}")
        if code == E_NOT_CACHED:
            raise SequenceStateError(f"{call}: {f.value} blocks asked for, but the sequence has {f.limit} full blocks")
        raise InvariantViolation(f"{call}: the KV cache core found an inconsistency (code {code}, value {f.value})")

    # -- the calls ------------------------------------------------------------------------------------

    def open(self, adapter=0, adapter_slot=-1, token_capacity=0):
        """A new request record under ``adapter`` (its prefix-cache key), holding adapter slot
        ``adapter_slot`` (-1: none; the caller's reference, handed back by ``finish``), with room
        for ``token_capacity`` tokens. Returns its handle."""
        cdef int64_t key = _adapter_key(adapter)
        cdef int32_t slot = <int32_t>_as_count(adapter_slot, "adapter_slot", -1, INT32_MAX)
        cdef int64_t seq_id
        return self._open(
            key, slot, _as_count(token_capacity, "token_capacity", 0, self._max_tokens_per_seq),
            &seq_id,
        )

    cdef int64_t _open(self, int64_t key, int32_t slot, Py_ssize_t tokens, int64_t *seq_id) except -1:
        cdef Failure f
        cdef int64_t handle
        _ok(&f)
        tokens = max(tokens, self._block_size)
        if self._lock_with_gil(0):
            handle = self._open_locked(key, slot, tokens, &f)
            if handle >= 0:
                seq_id[0] = self._recs[handle & INDEX_MASK].seq_id
            self._unlock()
        else:
            with nogil:
                self._lock()
                handle = self._open_locked(key, slot, tokens, &f)
                if handle >= 0:
                    seq_id[0] = self._recs[handle & INDEX_MASK].seq_id
                self._unlock()
        if handle < 0:
            self._raise(&f, "open")
        return handle

    def alloc(self, SlotPool slots not None, budget_tokens, addrs_by_slot, drop_queue):
        """A new request: a slot from ``slots`` (its guard records the request as the slot's
        owner), a record with room for ``budget_tokens`` tokens, and their Python face, which reads
        its SSM addresses from ``addrs_by_slot`` and puts its handle on ``drop_queue`` if it is
        dropped while open. One call for what a model's ``alloc_sequence_for`` does."""
        cdef Py_ssize_t budget = _as_count(
            budget_tokens, "budget_tokens", 0, self._max_tokens_per_seq
        )
        cdef int64_t seq_id, handle
        cdef SlotGuard guard = slots._acquire()
        try:
            handle = self._open(0, -1, budget, &seq_id)
        except BaseException:
            guard._let_go()
            raise
        slots._owners[guard._slot] = handle
        cdef SequenceState seq = SequenceState.__new__(SequenceState)
        seq._core = self
        seq._handle = handle
        seq.seq_id = seq_id
        seq._guard = guard
        seq._addrs_by_slot = addrs_by_slot
        seq.budget_tokens = budget
        seq._drop_queue = drop_queue
        seq._open = True
        return seq

    def release(self, seq, bint cache, on_adapter=None):
        """What a model's ``free_sequence`` (``cache=False``) or ``finish_sequence`` does: the SSM
        slot first (unless detached), then the record (``finish``), then ``on_adapter(slot)`` for
        the adapter slot the request held, if any, whatever failed before. A second call does
        nothing."""
        cdef SequenceState face = self._face(seq)
        cdef object guard
        cdef int32_t slot = -1
        if not face._open:
            return
        guard, face._guard = face._guard, None
        face._open = False
        try:
            if guard is not None:
                (<SlotGuard>guard)._let_go()
        finally:
            try:
                slot = self._finish(face._handle, cache)
            finally:
                if slot >= 0 and on_adapter is not None:
                    on_adapter(slot)

    def attach_seq(self, seq, prompt, grow_to=None):
        """``attach`` for a ``SequenceState`` (a model's ``attach_prefix``): ``grow_to`` counts
        tokens (None: no growth). Returns the reused token count."""
        cdef int64_t h = self._open_handle(seq, "attach_prefix")
        cdef Py_ssize_t wanted = -1
        if grow_to is not None:
            wanted = self._blocks_for_tokens(h, grow_to, "attach_prefix")
        return self.attach(h, prompt, wanted) * self._block_size

    def grow_seq(self, seq, num_tokens):
        """``grow`` for a ``SequenceState``, to cover ``num_tokens`` tokens; the blocks added."""
        cdef int64_t h = self._open_handle(seq, "grow")
        return self.grow(h, self._blocks_for_tokens(h, num_tokens, "grow"))

    cdef SequenceState _face(self, object seq):
        if type(seq) is not SequenceState:
            raise ForeignSequence(f"expected a SequenceState, got {type(seq).__name__}")
        if (<SequenceState>seq)._core is not self:
            raise ForeignSequence(f"sequence {(<SequenceState>seq).seq_id} belongs to another model")
        return <SequenceState>seq

    cdef int64_t _open_handle(self, object seq, str call) except -1:
        cdef SequenceState face = self._face(seq)
        if not face._open:
            raise SequenceStateError(f"{call}: sequence {face.seq_id} is freed, not active")
        return face._handle

    cdef Py_ssize_t _blocks_for_tokens(self, int64_t h, object num_tokens, str call) except -1:
        """Blocks covering ``num_tokens`` tokens (an int >= 0) within the per-sequence limit; a
        record that is not active is refused for that first."""
        cdef int overflow = 0
        cdef long long n = -1
        cdef Py_ssize_t limit = self._max_blocks_per_seq
        if PyLong_CheckExact(num_tokens):
            n = PyLong_AsLongLongAndOverflow(num_tokens, &overflow)
            if not overflow and 0 <= n <= <long long>limit * self._block_size:
                return <Py_ssize_t>((n + self._block_size - 1) // self._block_size)
        if self._field(h, 6) != ACTIVE:
            status = _STATUS_NAMES[self._field(h, 6)]
            raise SequenceStateError(f"{call}: sequence {self._field_seq_id(h)} is {status}, not active")
        if isinstance(num_tokens, int) and not isinstance(num_tokens, bool) and num_tokens >= 0:
            wanted = -(-num_tokens // self._block_size)
            raise InvalidId(f"{call}: {num_tokens} tokens need {wanted} blocks, over the per-sequence limit of {limit}")
        raise InvalidId(f"{call}: num_tokens={num_tokens!r} must be an int >= 0")

    cdef int64_t _field_seq_id(self, int64_t h):
        cdef Failure f
        cdef SeqRec *rec
        cdef int64_t seq_id = -1
        _ok(&f)
        with nogil:
            self._lock()
            rec = self._rec(h, &f)
            if rec != NULL:
                seq_id = rec.seq_id
            self._unlock()
        return seq_id

    def clear(self, handle):
        """Take a record back to how ``open`` left it (keeping its adapter): its pin, block
        references and tokens go. For undoing a step that failed after the core's part."""
        cdef int64_t h = _handle_arg(handle, "clear")
        cdef Failure f
        cdef SeqRec *rec
        cdef Chunk *fresh = NULL
        _ok(&f)
        with nogil:
            self._lock()
            rec = self._rec(h, &f)
            if rec != NULL and rec.chunk.refs > 1:
                # Trie nodes hold runs of this chunk: the record's next tokens and blocks must not
                # be written over them.
                fresh = chunk_new(&self._trie._chunks, rec.chunk.block_capacity, rec.chunk.token_capacity)
                if fresh == NULL:
                    f.code = E_NO_MEMORY
                    rec = NULL
            if rec != NULL:
                if rec.pin_node >= 0:
                    self._trie._unpin(rec.pin_node)
                self._counters.blocks_freed += self._pool._dec_ref_locked(rec.chunk.blocks, rec.num_blocks, &f.batch)
                if f.batch.failed_at >= 0:
                    f.code = E_INVARIANT
                rec.pin_node = -1
                rec.pin_blocks = 0
                rec.num_blocks = 0
                rec.num_tokens = 0
                rec.prompt_len = 0
                rec.cached_tokens = 0
                rec.lazy_tokens = 0
                rec.ssm_tokens = -1
                if fresh != NULL:
                    chunk_decref(&self._trie._chunks, rec.chunk)
                    rec.chunk = fresh
                else:
                    rec.chunk.num_hashed = 0  # the hashes were those of the old tokens
            self._unlock()
        self._raise(&f, "clear")

    def adapter_slots(self):
        """The adapter slot of every live record that holds one (int32), for recounts."""
        cdef Py_ssize_t i, count = 0
        cdef cnp.ndarray out
        cdef int32_t *dest
        with nogil:
            self._lock()
        try:
            for i in range(self._recs_high_water):
                if self._recs[i].status != FREE and self._recs[i].adapter_slot >= 0:
                    count += 1
            out = _empty_int32(count)
            dest = <int32_t *>cnp.PyArray_DATA(out)
            count = 0
            for i in range(self._recs_high_water):
                if self._recs[i].status != FREE and self._recs[i].adapter_slot >= 0:
                    dest[count] = self._recs[i].adapter_slot
                    count += 1
        finally:
            self._unlock()
        return out

    def attach(self, handle, tokens, grow_to=-1, max_prefix=-1):
        """Record ``tokens`` as the request's prompt, find its longest cached prefix (whole
        blocks, never the prompt's last token, at most ``max_prefix`` blocks), pin it and put its
        blocks at the head of the table, then grow the table to ``grow_to`` blocks (evicting when
        short). Returns the blocks reused.

        Calling it again with the same tokens (a retried lookup) takes no second set of
        references. When the growth cannot be met, ``OutOfBlocks`` is raised with the prefix
        attached (as ``attach`` then ``grow`` would end). Bad tokens change nothing.
        """
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, reuse
        cdef int64_t h = _handle_arg(handle, "attach")
        cdef Py_ssize_t limit = self._max_blocks_per_seq
        cdef Py_ssize_t wanted = _as_count(grow_to, "grow_to", -1, limit)
        cdef Py_ssize_t prefix = _as_count(max_prefix, "max_prefix", -1, INT32_MAX)
        cdef Failure f
        tokens = _token_vector(tokens, &data, &n)
        if n > self._max_tokens_per_seq:
            raise InvalidId(f"attach: {n} tokens are over the per-sequence limit of {self._max_tokens_per_seq}")
        _ok(&f)
        if self._lock_with_gil(n):
            reuse = self._attach_checked(h, data, n, prefix, wanted, &f)
            self._unlock()
        else:
            with nogil:
                self._lock()
                reuse = self._attach_checked(h, data, n, prefix, wanted, &f)
                self._unlock()
        if f.code != OK:
            self._raise(&f, "attach", tokens)
        return reuse

    cdef Py_ssize_t _attach_checked(self, int64_t handle, const int32_t *data, Py_ssize_t n, Py_ssize_t prefix,
                                    Py_ssize_t wanted, Failure *f) noexcept nogil:
        cdef SeqRec *rec = self._active(handle, f)
        if rec == NULL:
            return -1
        return self._attach_locked(rec, data, n, prefix, wanted, f)

    def admit(self, tokens, grow_to, max_prefix=-1, adapter=0):
        """``open`` + ``attach`` in one call (the trie-level replay's admission): a new record
        holding ``tokens``, its cached prefix and ``grow_to`` blocks in all; returns its handle.
        All or nothing: when the blocks cannot be had, nothing is left open."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0
        cdef int64_t key = _adapter_key(adapter)
        cdef Py_ssize_t limit = self._max_blocks_per_seq
        cdef Py_ssize_t wanted = _as_count(grow_to, "grow_to", 0, limit)
        cdef Py_ssize_t prefix = _as_count(max_prefix, "max_prefix", -1, INT32_MAX)
        cdef int64_t handle
        cdef Failure f
        tokens = _token_vector(tokens, &data, &n)
        if n > self._max_tokens_per_seq:
            raise InvalidId(f"admit: {n} tokens are over the per-sequence limit of {self._max_tokens_per_seq}")
        _ok(&f)
        if self._lock_with_gil(n):
            handle = self._admit_locked(key, data, n, prefix, wanted, &f)
            self._unlock()
        else:
            with nogil:
                self._lock()
                handle = self._admit_locked(key, data, n, prefix, wanted, &f)
                self._unlock()
        if f.code != OK:
            self._raise(&f, "admit", tokens)
        return handle

    cdef int64_t _admit_locked(self, int64_t key, const int32_t *data, Py_ssize_t n, Py_ssize_t prefix,
                               Py_ssize_t wanted, Failure *f) noexcept nogil:
        cdef int64_t handle = self._open_locked(key, -1, n, f)
        cdef SeqRec *rec
        cdef Failure ignored
        if handle < 0:
            return -1
        rec = &self._recs[handle & INDEX_MASK]
        self._attach_locked(rec, data, n, prefix, wanted, f)
        if f.code != OK:
            _ok(&ignored)
            self._finish_locked(rec, False, &ignored)
            # Nothing was admitted: the record opened and closed inside the call is not counted.
            self._counters.sequences_opened -= 1
            self._counters.sequences_closed -= 1
            self._next_seq_id -= 1
            return -1
        return handle

    def append(self, handle, tokens):
        """Record tokens whose KV the engine computed (prompt first, then generated ones)."""
        self._append(_handle_arg(handle, "append"), tokens)

    cdef int _append(self, int64_t h, object tokens) except -1:
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0
        cdef Failure f
        tokens = _token_vector(tokens, &data, &n)
        _ok(&f)
        if self._lock_with_gil(n):
            self._append_locked(h, data, n, &f)
            self._unlock()
        else:
            with nogil:
                self._lock()
                self._append_locked(h, data, n, &f)
                self._unlock()
        if f.code != OK:
            self._raise(&f, "append_tokens", tokens)
        return 0

    cdef void _append_locked(self, int64_t handle, const int32_t *data, Py_ssize_t n, Failure *f) noexcept nogil:
        cdef SeqRec *rec = self._rec(handle, f)
        cdef Py_ssize_t total
        if rec == NULL:
            return
        total = rec.num_tokens + n
        if total > self._max_tokens_per_seq:
            f.code = E_TOO_LONG
            f.value = total
            f.limit = self._max_tokens_per_seq
            return
        if self._reserve_rec(rec, 0, total):
            f.code = E_NO_MEMORY
            return
        if lc_copy_tokens_checked(rec.chunk.tokens + rec.num_tokens, data, n):
            f.code = E_NEGATIVE_TOKEN
            return
        rec.num_tokens = <int32_t>total

    def grow(self, handle, num_blocks):
        """Extend the table to ``num_blocks`` blocks, all or nothing, evicting cached blocks when
        the free list is short; returns how many were added."""
        cdef int64_t h = _handle_arg(handle, "grow")
        cdef Py_ssize_t wanted = _as_count(num_blocks, "num_blocks", 0, self._max_blocks_per_seq)
        cdef Py_ssize_t added = 0
        cdef Failure f
        _ok(&f)
        if self._lock_with_gil(wanted):
            added = self._grow_checked(h, wanted, &f)
            self._unlock()
        else:
            with nogil:
                self._lock()
                added = self._grow_checked(h, wanted, &f)
                self._unlock()
        if f.code != OK:
            self._raise(&f, "grow")
        return added

    cdef Py_ssize_t _grow_checked(self, int64_t handle, Py_ssize_t wanted, Failure *f) noexcept nogil:
        cdef SeqRec *rec = self._active(handle, f)
        cdef Py_ssize_t before
        if rec == NULL:
            return 0
        before = rec.num_blocks
        if self._grow_locked(rec, wanted, f):
            return 0
        return max(<Py_ssize_t>0, rec.num_blocks - before)

    def allocate(self, handle, num_blocks, str call="allocate"):
        """Give a fresh record (no blocks, no tokens) exactly ``num_blocks`` free blocks, never
        evicting (a restore must not drop cache it cannot give back); ``OutOfBlocks`` when too few
        are free. ``call`` names the caller in errors."""
        cdef int64_t h = _handle_arg(handle, "allocate")
        cdef Py_ssize_t wanted = _as_count(num_blocks, f"{call}: num_blocks", 0, self._max_blocks_per_seq)
        cdef Failure f
        cdef SeqRec *rec
        cdef int64_t seq_id = -1, held_blocks = 0, held_tokens = 0
        _ok(&f)
        with nogil:
            self._lock()
            rec = self._active(h, &f)
            if rec != NULL:
                if rec.num_blocks or rec.num_tokens:
                    seq_id, held_blocks, held_tokens = rec.seq_id, rec.num_blocks, rec.num_tokens
                elif self._reserve_rec(rec, wanted, 0):
                    f.code = E_NO_MEMORY
                elif not self._pool._allocate_locked(rec.chunk.blocks, wanted):
                    f.code = E_OUT_OF_BLOCKS
                    f.value = wanted
                    f.limit = self._pool._num_free
                else:
                    rec.num_blocks = <int32_t>wanted
                    self._counters.blocks_allocated += wanted
            self._unlock()
        if seq_id >= 0:
            raise SequenceStateError(
                f"{call}: sequence {seq_id} already holds {held_blocks} blocks and {held_tokens} tokens; "
                "it needs a freshly allocated sequence"
            )
        if f.code == E_OUT_OF_BLOCKS:
            raise OutOfBlocks(
                f"{call}: {f.value} blocks are needed, {f.limit} are free "
                "(this never evicts: reclaim_prefix_blocks first)"
            )
        self._raise(&f, call)

    def cache(self, handle, num_blocks):
        """Insert the record's first ``num_blocks`` full blocks into the prefix cache (nodes that
        exist keep their blocks; new ones take a cache reference of their own) and pin the path,
        so it is not evicted while the request lives. Returns the blocks newly cached."""
        cdef int64_t h = _handle_arg(handle, "cache")
        cdef Py_ssize_t full = _as_count(num_blocks, "num_blocks", 0, self._max_blocks_per_seq)
        cdef Py_ssize_t taken = 0
        cdef Failure f
        _ok(&f)
        with nogil:
            self._lock()
            self._cache_checked(h, full, &taken, &f)
            self._unlock()
        self._raise(&f, "cache_sequence")
        return taken

    def mark_computed(self, handle, num_blocks):
        """The record's first ``num_blocks`` blocks hold KV the library put there (promoted from
        a tier below the device): count their tokens as cached, so the engine skips them, and
        insert them into the prefix cache as ``cache`` does. They must be full blocks of its
        prompt. Returns the blocks newly cached."""
        cdef int64_t h = _handle_arg(handle, "mark_computed")
        cdef Py_ssize_t full = _as_count(num_blocks, "num_blocks", 0, self._max_blocks_per_seq)
        cdef Py_ssize_t taken = 0
        cdef SeqRec *rec
        cdef Failure f
        _ok(&f)
        with nogil:
            self._lock()
            rec = self._active(h, &f)
            if rec != NULL:
                if full * self._block_size > rec.prompt_len or full > rec.num_blocks:
                    f.code = E_NOT_CACHED
                    f.value = full
                    f.limit = min(<Py_ssize_t>rec.prompt_len // self._block_size, <Py_ssize_t>rec.num_blocks)
                else:
                    self._cache_checked(h, full, &taken, &f)
                    if f.code == OK and full * self._block_size > rec.cached_tokens:
                        rec.cached_tokens = <int32_t>(full * self._block_size)
            self._unlock()
        self._raise(&f, "mark_computed")
        return taken

    def content_hashes(self, tokens, adapter=0):
        """The content hashes of the whole blocks of ``tokens`` under prefix-cache key
        ``adapter`` (uint64, docs/content-hashes.md), without a record: what a tier below the
        device is asked for before admission."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, full
        cdef int64_t key = _adapter_key(adapter)
        cdef Py_ssize_t i
        tokens = _token_vector(tokens, &data, &n)
        for i in range(n):
            if data[i] < 0:
                raise _first_negative(data, n)
        full = n // self._block_size
        cdef cnp.ndarray out = np.empty(full, dtype=np.uint64)
        cdef uint64_t *dest = <uint64_t *>cnp.PyArray_DATA(out)
        if full:
            with nogil:
                lc_content_hashes(lc_root_hash(key), data, full, self._block_size, self._trie._keys, dest)
        return out

    def cache_key(self, handle):
        """The prefix-cache key (trie root) the record's blocks are matched and cached under."""
        cdef int64_t h = _handle_arg(handle, "cache_key")
        with nogil:
            self._lock()
        try:
            return self._read(h, "cache_key").adapter
        finally:
            self._unlock()

    def set_cache_key(self, handle, key):
        """Match and cache the record under ``key`` (an adapter's key mixed with a cache salt),
        before it has blocks or tokens."""
        cdef int64_t h = _handle_arg(handle, "set_cache_key")
        cdef int64_t value = _adapter_key(key)
        cdef SeqRec *rec
        with nogil:
            self._lock()
        try:
            rec = self._read(h, "set_cache_key")
            if rec.status != ACTIVE:
                raise SequenceStateError(
                    f"set_cache_key: sequence {rec.seq_id} is {_STATUS_NAMES[rec.status]}, not active"
                )
            if rec.num_blocks or rec.num_tokens:
                raise SequenceStateError(f"set_cache_key: sequence {rec.seq_id} already has KV blocks or tokens")
            rec.adapter = value
        finally:
            self._unlock()

    cdef int32_t _cache_checked(self, int64_t handle, Py_ssize_t full, Py_ssize_t *taken, Failure *f) noexcept nogil:
        cdef SeqRec *rec = self._rec(handle, f)
        if rec == NULL:
            return -1
        if full > rec.num_blocks or full * self._block_size > rec.num_tokens:
            f.code = E_NOT_CACHED
            f.value = full
            f.limit = min(<Py_ssize_t>rec.num_tokens // self._block_size, <Py_ssize_t>rec.num_blocks)
            return -1
        if not self._enabled or rec.failed or full <= rec.pin_blocks:
            taken[0] = 0
            return -1
        return self._cache_locked(rec, full, taken, f)

    def snapshot_point(self, handle, num_blocks, bint rolling=False):
        """Cache the record's first ``num_blocks`` blocks (as ``cache``) and give the node ending
        there an SSM snapshot id. Returns ``(snapshot_id, fresh)``: ``fresh`` when the id is new
        (the caller copies the SSM state into it, or calls ``drop_snapshot`` if it cannot);
        ``(-1, False)`` when snapshots are off. ``rolling`` first drops the record's previous
        rolling snapshot (if no one took it over since), then remembers this one."""
        cdef int64_t h = _handle_arg(handle, "snapshot_point")
        cdef Py_ssize_t full = _as_count(num_blocks, "num_blocks", 1, self._max_blocks_per_seq)
        cdef int32_t sid = -1
        cdef bint fresh = False
        cdef Failure f
        _ok(&f)
        with nogil:
            self._lock()
            sid = self._snapshot_locked(h, full, rolling, &fresh, &f)
            self._unlock()
        self._raise(&f, "save_snapshot")
        return sid, fresh

    cdef int32_t _snapshot_locked(
        self, int64_t handle, Py_ssize_t full, bint rolling, bint *fresh, Failure *f
    ) noexcept nogil:
        cdef SeqRec *rec = self._rec(handle, f)
        cdef Py_ssize_t taken
        cdef int32_t end, sid, previous
        cdef RNode *node
        if rec == NULL:
            return -1
        if full > rec.num_blocks or full * self._block_size > rec.num_tokens:
            f.code = E_NOT_CACHED
            f.value = full
            f.limit = min(<Py_ssize_t>rec.num_tokens // self._block_size, <Py_ssize_t>rec.num_blocks)
            return -1
        if not self._enabled or rec.failed or self._num_snapshots == 0:
            return -1
        previous = rec.rolling
        if previous >= 0 and (
            self._snap_generation[previous] != rec.rolling_generation or self._snap_node[previous] < 0
        ):
            previous = -1  # the pool reused it since: no longer this record's to drop
            rec.rolling = -1
        if rolling and previous >= 0:
            node = &self._trie._nodes[self._snap_node[previous]]
            if node.depth + node.length != full:
                node.tag = -1
                self._snap_release(previous)
                rec.rolling = -1
                previous = -1
        end = self._cache_locked(rec, full, &taken, f)
        if end < 0:
            return -1
        node = &self._trie._nodes[end]
        if node.tag >= 0:
            sid = node.tag
            self._snap_touch(sid)
            if not (rolling and previous == sid):
                rec.rolling = -1
            return sid
        sid = self._snap_take()
        if sid < 0:
            return -1
        self._trie._nodes[end].tag = sid
        self._snap_node[sid] = end
        self._counters.snapshots_saved += 1
        fresh[0] = True
        rec.rolling = sid if rolling else -1
        rec.rolling_generation = self._snap_generation[sid]
        return sid

    def drop_snapshot(self, snapshot_id):
        """Free a snapshot id whose SSM state could not be copied (its node keeps its KV)."""
        cdef int32_t sid = <int32_t>_as_count(snapshot_id, "snapshot_id", 0, max(self._num_snapshots - 1, 0))
        cdef Failure f
        _ok(&f)
        with nogil:
            self._lock()
            if self._closed:
                f.code = E_CLOSED
            elif sid < self._num_snapshots and self._snap_node[sid] >= 0:
                self._trie._nodes[self._snap_node[sid]].tag = -1
                self._snap_release(sid)
            self._unlock()
        self._raise(&f, "drop_snapshot")

    def prefix_snapshot(self, handle):
        """The snapshot id at the end of the prefix the record reuses (-1: none), whose SSM state
        prefill starts from."""
        cdef int64_t h = _handle_arg(handle, "prefix_snapshot")
        cdef int32_t sid = -1
        cdef Failure f
        cdef SeqRec *rec
        _ok(&f)
        with nogil:
            self._lock()
            rec = self._rec(h, &f)
            if rec != NULL and rec.pin_node >= 0 and rec.cached_tokens > 0:
                sid = self._tag_at(rec.pin_node, rec.cached_tokens // self._block_size)
            self._unlock()
        self._raise(&f, "prefix_snapshot")
        return sid

    cdef int32_t _tag_at(self, int32_t node, Py_ssize_t blocks) noexcept nogil:
        """The snapshot tag at exactly ``blocks`` blocks along the path ending at ``node`` (a
        record caching past its reused prefix moves its pin further down), -1 when none ends
        there."""
        cdef RNode *n
        while node >= 0:
            n = &self._trie._nodes[node]
            if n.parent < 0 or n.depth + n.length < blocks:
                return -1
            if n.depth + n.length == blocks:
                return n.tag
            node = n.parent
        return -1

    def finish(self, handle, bint cache=True):
        """What a finishing request does, in one call: cache its full blocks (unless ``cache`` is
        False, the cache is off or the request failed), unpin its prefix, drop its reference on
        every block and close the record. Returns the adapter slot it held (-1: none), for the
        caller to release; a second call raises ``SequenceStateError``."""
        return self._finish(_handle_arg(handle, "finish"), cache)

    cdef int32_t _finish(self, int64_t h, bint cache) except? -2:
        cdef Failure f
        cdef int32_t slot = -1
        cdef SeqRec *rec
        _ok(&f)
        if self._lock_with_gil(0):
            rec = self._rec(h, &f)
            if rec != NULL:
                slot = rec.adapter_slot
                self._finish_locked(rec, cache, &f)
            self._unlock()
        else:
            with nogil:
                self._lock()
                rec = self._rec(h, &f)
                if rec != NULL:
                    slot = rec.adapter_slot
                    self._finish_locked(rec, cache, &f)
                self._unlock()
        if f.code != OK:
            self._raise(&f, "finish")
        return slot

    def is_live(self, handle):
        """Whether ``handle`` is a record of this core not yet finished."""
        cdef Failure f
        cdef bint live
        cdef int64_t h = _handle_arg(handle, "is_live")
        _ok(&f)
        with nogil:
            self._lock()
            live = self._rec(h, &f) != NULL
            self._unlock()
        return live

    def step(self, handles, tokens, counts=None, table=None, rows=None, bint cache=False):
        """One decode step for a batch of running requests, in one call with the GIL released:
        append each request's new tokens (one per request, or ``counts[i]`` of the concatenated
        ``tokens`` for speculative decoding), grow every table whose last block filled (evicting
        least recently used cached blocks when short), write each request's new block ids into
        row ``rows[i]`` (default ``i``) of the engine's 2-D int32 ``table``, and with ``cache``
        insert blocks that filled into the prefix cache (pinned while the request lives).

        All or nothing per request: one that cannot grow even after eviction is left exactly as it
        was, and its position in ``handles`` is returned (int32, empty when every request
        stepped), for the scheduler to preempt. A bad argument (a stale handle, a retired request,
        a negative token, a table too small) raises before anything changes. Blocks evicted for a
        request that was refused all the same stay evicted, as for ``grow``."""
        cdef const int32_t *tok = NULL
        cdef Py_ssize_t n, num_tok = 0, ncols = -1, nrows = 0
        cdef const int64_t *hs
        cdef const int32_t *cnt = NULL
        cdef const int32_t *row_of = NULL
        cdef int32_t *tab = NULL
        cdef cnp.ndarray handle_array = _int64_vector(handles, "step: handles")
        cdef cnp.ndarray count_array, row_array, table_array, refused
        cdef Failure f
        cdef Py_ssize_t num_refused = 0, bad = -1
        n = cnp.PyArray_DIM(handle_array, 0)
        hs = <const int64_t *>cnp.PyArray_DATA(handle_array)
        tokens = _token_vector(tokens, &tok, &num_tok)
        if counts is not None:
            count_array = _int32_column(counts, n, "step: counts")
            cnt = <const int32_t *>cnp.PyArray_DATA(count_array)
            if int(count_array.sum()) != num_tok:
                raise InvalidId(f"step: {num_tok} tokens given, but the counts add up to {int(count_array.sum())}")
        elif num_tok != n:
            raise InvalidId(f"step: {num_tok} tokens for {n} requests; one each, or give counts")
        if table is not None:
            table_array = _table_2d(table)
            nrows, ncols = cnp.PyArray_DIM(table_array, 0), cnp.PyArray_DIM(table_array, 1)
            tab = <int32_t *>cnp.PyArray_DATA(table_array)
            if rows is not None:
                row_array = _int32_column(rows, n, "step: rows")
                row_of = <const int32_t *>cnp.PyArray_DATA(row_array)
            elif n > nrows:
                raise InvalidId(f"step: a table of {nrows} rows for {n} requests (give rows)")
        elif rows is not None:
            raise InvalidId("step: rows were given without a table to write them in")
        refused = _empty_int32(n)
        _ok(&f)
        with nogil:
            self._lock()
            self._step_stamp += 1
            if self._step_stamp == 0:
                self._step_stamp = 1  # 0 is a fresh record's
            bad = self._step_check(hs, n, tok, num_tok, cnt, row_of, nrows, ncols, &f)
            if bad < 0:
                num_refused = self._step_locked(
                    hs, n, tok, cnt, tab, row_of, ncols, cache, <int32_t *>cnp.PyArray_DATA(refused), &f
                )
            self._unlock()
        if bad >= 0 or f.code != OK:
            if f.code == E_NEGATIVE_TOKEN:
                self._raise(&f, "step", tokens)
            if f.code == E_TOO_LONG:
                raise InvalidId(
                    f"step: request {bad} would hold {f.value} blocks (or tokens), over what its table row or the "
                    f"per-sequence limit allows ({f.limit})"
                )
            if f.code == E_INVALID_ARG and f.limit == -1:
                raise InvalidId(f"step: handle {f.value} is listed more than once (entry {bad})")
            if f.code == E_INVALID_ARG and f.limit == -2:
                raise InvalidId(f"step: table row {f.value} is given to more than one request (entry {bad})")
            if f.code == E_INVALID_ARG:
                raise InvalidId(f"step: {f.value} is outside [0, {f.limit}] (entry {bad})")
            self._raise(&f, "step")
        return _shrink(refused, num_refused)

    cdef Py_ssize_t _step_check(
        self, const int64_t *hs, Py_ssize_t n, const int32_t *tok, Py_ssize_t num_tok, const int32_t *cnt,
        const int32_t *row_of, Py_ssize_t nrows, Py_ssize_t ncols, Failure *f
    ) noexcept nogil:
        """(Lock held) the index of the first request the step refuses as bad input, or -1."""
        cdef Py_ssize_t i, added, blocks
        cdef SeqRec *rec
        for i in range(n):
            rec = self._active(hs[i], f)
            if rec == NULL:
                return i
            added = cnt[i] if cnt != NULL else 1
            if added < 0:
                f.code = E_INVALID_ARG
                f.value = added
                f.limit = self._max_tokens_per_seq
                return i
            if rec.num_tokens + added > self._max_tokens_per_seq:
                f.code = E_TOO_LONG
                f.value = rec.num_tokens + added
                f.limit = self._max_tokens_per_seq
                return i
            blocks = _blocks_for(rec.num_tokens + added, self._block_size)
            if blocks > self._max_blocks_per_seq or (ncols >= 0 and blocks > ncols):
                f.code = E_TOO_LONG
                f.value = blocks
                f.limit = min(self._max_blocks_per_seq, ncols) if ncols >= 0 else self._max_blocks_per_seq
                return i
            if rec.step_stamp == self._step_stamp:
                f.code = E_INVALID_ARG
                f.value = hs[i]
                f.limit = -1  # listed twice
                return i
            rec.step_stamp = self._step_stamp
            if row_of != NULL and not 0 <= row_of[i] < nrows:
                f.code = E_INVALID_ARG
                f.value = row_of[i]
                f.limit = nrows - 1
                return i
        if row_of != NULL and n > 1:
            i = _repeated_row(row_of, n, nrows, f)
            if i >= 0:
                return i
        for i in range(num_tok):
            if tok[i] < 0:
                f.code = E_NEGATIVE_TOKEN
                return i
        return -1

    cdef Py_ssize_t _step_locked(
        self, const int64_t *hs, Py_ssize_t n, const int32_t *tok, const int32_t *cnt, int32_t *tab,
        const int32_t *row_of, Py_ssize_t ncols, bint cache, int32_t *refused, Failure *f
    ) noexcept nogil:
        """(Lock held, arguments checked) the step itself; returns how many requests it refused."""
        cdef Py_ssize_t i, added, need, num_refused = 0, offset = 0, j, full, taken
        cdef SeqRec *rec
        cdef int32_t *row
        for i in range(n):
            rec = &self._recs[hs[i] & INDEX_MASK]
            added = cnt[i] if cnt != NULL else 1
            need = _blocks_for(rec.num_tokens + added, self._block_size) - rec.num_blocks
            if self._reserve_rec(rec, rec.num_blocks + max(need, <Py_ssize_t>0), rec.num_tokens + added):
                f.code = E_NO_MEMORY
                return num_refused
            if need > 0:
                if self._pool._num_free < need:
                    self._evict_locked(need - self._pool._num_free, f)
                    if f.code != OK:
                        return num_refused
                if not self._pool._allocate_locked(rec.chunk.blocks + rec.num_blocks, need):
                    refused[num_refused] = <int32_t>i
                    num_refused += 1
                    offset += added
                    continue
                if tab != NULL:
                    row = tab + <Py_ssize_t>(row_of[i] if row_of != NULL else i) * ncols
                    for j in range(rec.num_blocks, rec.num_blocks + need):
                        row[j] = rec.chunk.blocks[j]
                rec.num_blocks += <int32_t>need
                self._counters.blocks_allocated += need
            memcpy(rec.chunk.tokens + rec.num_tokens, tok + offset, added * sizeof(int32_t))
            rec.num_tokens += <int32_t>added
            offset += added
            if cache and self._enabled and not rec.failed:
                full = min(<Py_ssize_t>rec.num_tokens // self._block_size, <Py_ssize_t>rec.num_blocks)
                if full > rec.pin_blocks:
                    self._cache_locked(rec, full, &taken, f)
                    if f.code != OK:
                        return num_refused
        return num_refused

    def evict(self, num_blocks):
        """Evict least recently used cached blocks until ``num_blocks`` became free or nothing is
        evictable; returns how many became free (0: nothing evictable)."""
        cdef Py_ssize_t n = _as_count(num_blocks, "num_blocks", 0, INT32_MAX)
        cdef Py_ssize_t freed = 0
        cdef Failure f
        _ok(&f)
        with nogil:
            self._lock()
            if self._closed:
                f.code = E_CLOSED
            else:
                freed = self._evict_locked(n, &f)
            self._unlock()
        self._raise(&f, "evict")
        return freed

    def reclaim_for(self, tokens, adapter, blocks_needed):
        """Make room for a prefill of ``tokens``: pin the prefix it will reuse, evict until the
        free blocks cover ``blocks_needed`` less that prefix or nothing is evictable, unpin.
        Returns ``(target, free)``."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, target = 0, free_after = 0
        cdef int64_t key = _adapter_key(adapter)
        cdef Py_ssize_t needed = _as_count(blocks_needed, "blocks_needed", 0, INT32_MAX)
        cdef Failure f
        tokens = _token_vector(tokens, &data, &n)
        _ok(&f)
        with nogil:
            self._lock()
            if self._closed:
                f.code = E_CLOSED
            else:
                target = self._reclaim_locked(key, data, n, needed, &f)
            free_after = self._pool._num_free
            self._unlock()
        if f.code != OK:
            self._raise(&f, "reclaim_prefix_blocks_for", tokens)
        return target, free_after

    cdef Py_ssize_t _reclaim_locked(self, int64_t key, const int32_t *data, Py_ssize_t n, Py_ssize_t needed,
                                    Failure *f) noexcept nogil:
        cdef Py_ssize_t matched = 0, reuse = 0, target, i
        cdef int32_t end = -1
        for i in range(n):
            if data[i] < 0:
                f.code = E_NEGATIVE_TOKEN
                return 0
        if self._enabled and n > 1:
            end = self._match(key, data, (n - 1) // self._block_size, &matched, &reuse, f)
            if f.code != OK:
                return 0
        target = max(<Py_ssize_t>0, needed - reuse)
        if end >= 0:
            self._trie._pin(end)
        if self._pool._num_free < target:
            self._evict_locked(target - self._pool._num_free, f)
        if end >= 0:
            self._trie._unpin(end)
        return target

    # -- reading a record -------------------------------------------------------------------------

    cdef SeqRec *_read(self, int64_t handle, str call) except NULL:
        """The record for a read with the GIL held (the lock is taken and released around the
        copy by the caller's ``_copy_out``); raises for a stale handle."""
        cdef Failure f
        cdef SeqRec *rec
        _ok(&f)
        rec = self._rec(handle, &f)
        if rec == NULL:
            self._raise(&f, call)
        return rec

    def tokens(self, handle):
        """A copy of the record's token ids."""
        cdef int64_t h = _handle_arg(handle, "tokens")
        cdef cnp.ndarray out
        cdef SeqRec *rec
        with nogil:
            self._lock()
        try:
            rec = self._read(h, "tokens")
            self._materialize(rec)
            out = _empty_int32(rec.num_tokens)
            memcpy(cnp.PyArray_DATA(out), rec.chunk.tokens, rec.num_tokens * sizeof(int32_t))
        finally:
            self._unlock()
        return out

    def block_table(self, handle):
        """A copy of the record's block table (int32, for kernels)."""
        cdef int64_t h = _handle_arg(handle, "block_table")
        cdef cnp.ndarray out
        cdef SeqRec *rec
        with nogil:
            self._lock()
        try:
            rec = self._read(h, "block_table")
            out = _empty_int32(rec.num_blocks)
            memcpy(cnp.PyArray_DATA(out), rec.chunk.blocks, rec.num_blocks * sizeof(int32_t))
        finally:
            self._unlock()
        return out

    def block_hashes(self, handle):
        """The content hashes of the record's full blocks (uint64; see docs/content-hashes.md),
        computed once per block and kept with the record."""
        cdef int64_t h = _handle_arg(handle, "block_hashes")
        cdef cnp.ndarray out
        cdef SeqRec *rec
        cdef Chunk *chunk
        cdef Py_ssize_t full, done
        cdef uint64_t parent
        cdef cnp.npy_intp dim
        with nogil:
            self._lock()
        try:
            rec = self._read(h, "block_hashes")
            self._materialize(rec)
            chunk = rec.chunk
            full = rec.num_tokens // self._block_size
            if full > chunk.block_capacity and self._reserve_rec(rec, full, 0):
                raise MemoryError("block_hashes: out of host memory")
            chunk = rec.chunk
            if chunk.hashes == NULL and full > 0:
                chunk.hashes = <uint64_t *>malloc(chunk.block_capacity * sizeof(uint64_t))
                if chunk.hashes == NULL:
                    raise MemoryError("block_hashes: out of host memory")
            done = chunk.num_hashed
            if full > done:
                parent = lc_root_hash(rec.adapter) if done == 0 else chunk.hashes[done - 1]
                with nogil:
                    lc_content_hashes(parent, chunk.tokens + done * self._block_size, full - done,
                                      self._block_size, self._trie._keys, chunk.hashes + done)
                chunk.num_hashed = <int32_t>full
            dim = full
            out = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT64, 0)
            if full:
                memcpy(cnp.PyArray_DATA(out), chunk.hashes, full * sizeof(uint64_t))
        finally:
            self._unlock()
        return out

    def info(self, handle):
        """``(seq_id, status, num_tokens, prompt_len, num_blocks, cached_tokens, ssm_tokens,
        failed, adapter_slot)`` of a record (status: 1 active, 2 retired)."""
        cdef int64_t h = _handle_arg(handle, "info")
        cdef SeqRec *rec
        with nogil:
            self._lock()
        try:
            rec = self._read(h, "info")
            return (rec.seq_id, rec.status, rec.num_tokens, rec.prompt_len, rec.num_blocks, rec.cached_tokens,
                    rec.ssm_tokens, bool(rec.failed), rec.adapter_slot)
        finally:
            self._unlock()

    cdef int32_t _field(self, int64_t handle, int which) except? -2:
        cdef Failure f
        cdef SeqRec *rec
        cdef int32_t value = -1
        _ok(&f)
        if lc_mutex_trylock(&self._pool._lock):
            self._entered = lc_ticks()
        else:
            with nogil:
                self._lock()
        rec = self._rec(handle, &f)
        if rec != NULL:
            if which == 0:
                value = rec.num_tokens
            elif which == 1:
                value = rec.num_blocks
            elif which == 2:
                value = rec.prompt_len
            elif which == 3:
                value = rec.cached_tokens
            elif which == 4:
                value = rec.ssm_tokens
            elif which == 5:
                value = rec.failed
            elif which == 6:
                value = rec.status
            elif which == 7:
                value = rec.adapter_slot
        self._unlock()
        if rec == NULL:
            if which == 6 and f.code == E_HANDLE:
                return FREE
            self._raise(&f, "sequence")
        return value

    def num_tokens(self, handle):
        return self._field(_handle_arg(handle, "num_tokens"), 0)

    def num_blocks(self, handle):
        return self._field(_handle_arg(handle, "num_blocks"), 1)

    def prompt_len(self, handle):
        return self._field(_handle_arg(handle, "prompt_len"), 2)

    def cached_tokens(self, handle):
        return self._field(_handle_arg(handle, "cached_tokens"), 3)

    def ssm_tokens(self, handle):
        """Tokens the SSM state consumed, -1 when as many as the record's tokens."""
        return self._field(_handle_arg(handle, "ssm_tokens"), 4)

    def failed(self, handle):
        return bool(self._field(_handle_arg(handle, "failed"), 5))

    def status(self, handle):
        """0 freed (or not of this core), 1 active, 2 retired."""
        return self._field(_handle_arg(handle, "status"), 6)

    def adapter_slot(self, handle):
        return self._field(_handle_arg(handle, "adapter_slot"), 7)

    cdef int _set(self, int64_t handle, int which, int64_t value, str call) except -1:
        cdef Failure f
        cdef SeqRec *rec
        _ok(&f)
        with nogil:
            self._lock()
        try:
            rec = self._read(handle, call)
            if which == 0:
                if not 0 <= value <= rec.num_tokens:
                    raise InvalidId(f"{call}: {value} is outside [0, {rec.num_tokens}] (the sequence's tokens)")
                rec.prompt_len = <int32_t>value
            elif which == 1:
                if not -1 <= value <= rec.num_tokens:
                    raise InvalidId(f"{call}: {value} is outside [0, {rec.num_tokens}] (the sequence's tokens)")
                rec.ssm_tokens = <int32_t>value
            elif which == 2:
                rec.failed = 1
            elif which == 3:
                if rec.status != ACTIVE:
                    raise SequenceStateError(
                        f"{call}: sequence {rec.seq_id} is {_STATUS_NAMES[rec.status]}, not active"
                    )
                rec.status = RETIRED
            elif which == 4:
                rec.adapter_slot = <int32_t>value
            elif which == 5:
                rec.adapter = value
        finally:
            self._unlock()
        return 0

    def set_prompt_len(self, handle, value):
        self._set(_handle_arg(handle, "prompt_len"), 0, _as_count(value, "prompt_len", 0, INT32_MAX), "prompt_len")

    def set_ssm_tokens(self, handle, value):
        """Set the tokens the SSM state consumed (None: as many as the record's tokens)."""
        cdef int64_t h = _handle_arg(handle, "ssm_tokens")
        self._set(h, 1, -1 if value is None else _as_count(value, "ssm_tokens", 0, INT32_MAX), "ssm_tokens")

    def mark_failed(self, handle):
        self._set(_handle_arg(handle, "mark_failed"), 2, 0, "mark_failed")

    def retire(self, handle):
        self._set(_handle_arg(handle, "retire_sequence"), 3, 0, "retire_sequence")

    def bind_adapter(self, handle, adapter_slot, adapter):
        """Record the adapter slot reference the request holds and its prefix-cache key (only
        before it has blocks)."""
        cdef int64_t h = _handle_arg(handle, "bind_adapter")
        cdef int64_t key = _adapter_key(adapter)
        cdef int32_t slot = <int32_t>_as_count(adapter_slot, "adapter_slot", 0, INT32_MAX)
        cdef SeqRec *rec
        with nogil:
            self._lock()
        try:
            rec = self._read(h, "bind_adapter")
            if rec.status != ACTIVE:
                raise SequenceStateError(
                    f"bind_adapter: sequence {rec.seq_id} is {_STATUS_NAMES[rec.status]}, not active"
                )
            if rec.adapter_slot >= 0:
                raise SequenceStateError(
                    f"bind_adapter: sequence {rec.seq_id} already holds adapter slot {rec.adapter_slot}"
                )
            if rec.num_blocks or rec.num_tokens:
                raise SequenceStateError(f"bind_adapter: sequence {rec.seq_id} already has KV blocks or tokens")
            rec.adapter_slot = slot
            rec.adapter = key
        finally:
            self._unlock()

    # -- the whole cache ----------------------------------------------------------------------------

    def counters(self):
        """The core's counters since it was made, as a dict."""
        cdef Counters c = self._counters
        return {
            "sequences_allocated": c.sequences_opened,
            "sequences_freed": c.sequences_closed,
            "blocks_allocated": c.blocks_allocated,
            "blocks_freed": c.blocks_freed,
            "blocks_cached": c.blocks_cached,
            "blocks_evicted": c.blocks_evicted,
            "prefix_lookups": c.prefix_lookups,
            "prefix_hits": c.prefix_hits,
            "prefix_misses": c.prefix_misses,
            "prefix_hit_tokens": c.prefix_hit_tokens,
            "prefix_lookup_tokens": c.prefix_lookup_tokens,
            "snapshots_saved": c.snapshots_saved,
            "snapshot_hits": c.snapshot_hits,
            "snapshot_hits_cut_short": c.snapshot_hits_cut_short,
            "snapshots_evicted": c.snapshots_evicted,
            "time_in_library_ns": int(c.time_ticks * _ns_per_tick()),
        }

    def time_ns(self):
        """Nanoseconds spent in the core's calls so far (under its lock)."""
        return int(self._counters.time_ticks * _ns_per_tick())

    def live_totals(self):
        """``(live records, blocks they hold)``."""
        cdef Py_ssize_t i, blocks = 0
        with nogil:
            self._lock()
            for i in range(self._recs_high_water):
                if self._recs[i].status != FREE:
                    blocks += self._recs[i].num_blocks
            self._unlock()
        return self._num_live, blocks

    def close(self):
        """Drop every record and cached block without touching the pool (whose memory goes with
        the model); every later call but ``close`` raises ``TornDown``. Returns ``(live records,
        blocks they held, cached blocks)``."""
        cdef Py_ssize_t i, blocks = 0, live, cached
        with nogil:
            self._lock()
        try:
            live = self._num_live
            cached = self._trie._num_blocks
            if not self._closed:
                for i in range(self._recs_high_water):
                    if self._recs[i].status != FREE:
                        blocks += self._recs[i].num_blocks
                        self._close_rec(&self._recs[i])
                self._trie._clear()
                self._trie._num_evicted_tags = 0
                self._closed = True
        finally:
            self._unlock()
        return live, blocks, cached

    def memory(self):
        """Bytes of host memory the cache's metadata holds: ``trie`` (node slots, buckets),
        ``chunks`` (chunk headers and block-id arrays of cached runs), ``tokens`` (token arrays of
        cached runs), ``hashes``, ``records`` (the record table), as a dict."""
        cdef Py_ssize_t i
        seen = set()
        cdef Py_ssize_t chunk_bytes = 0, token_bytes = 0, hash_bytes = 0
        cdef Chunk *chunk
        with nogil:
            self._lock()
        try:
            for i in range(self._trie._high_water):
                if self._trie._nodes[i].parent >= 0 and self._trie._nodes[i].chunk != NULL:
                    chunk = self._trie._nodes[i].chunk
                    if <size_t>chunk in seen:
                        continue
                    seen.add(<size_t>chunk)
                    chunk_bytes += sizeof(Chunk) + chunk.block_capacity * sizeof(int32_t)
                    token_bytes += chunk.token_capacity * sizeof(int32_t)
                    if chunk.hashes != NULL:
                        hash_bytes += chunk.block_capacity * sizeof(uint64_t)
            return {
                "trie": self._trie.nbytes,
                "chunks": chunk_bytes,
                "tokens": token_bytes,
                "hashes": hash_bytes,
                "records": self._recs_capacity * sizeof(SeqRec),
                "cached_blocks": self._trie._num_blocks,
            }
        finally:
            self._unlock()

    def reset(self):
        """Drop every cached block if none is in use by a request (pinned); returns whether it
        did. Snapshot ids of dropped nodes are freed."""
        cdef Failure f
        cdef bint done = False
        cdef EvEntry *entry
        _ok(&f)
        with nogil:
            self._lock()
            if self._closed:
                f.code = E_CLOSED
            elif self._trie._lru_blocks == self._trie._num_blocks:
                self._quiet = True
                self._evict_locked(self._trie._num_blocks + self._pool._num_blocks, &f)
                self._quiet = False
                done = self._trie._num_blocks == 0
                if done and self._events:
                    entry = self._log_entry(0, 0, 0)
                    if entry != NULL:
                        entry.kind = 3
                        entry.count = 0
                        entry.num_tokens = 0
                        entry.has_ids = 0
                        entry.has_parent = 0
                        entry.adapter = 0
                        entry.parent = 0
            self._unlock()
        self._raise(&f, "reset")
        return done

    # -- events, content hashes, engine tables ----------------------------------------------------

    def set_events(self, bint events, bint demote=False, max_pending_tokens=1 << 24):
        """Turn the event log on or off. ``events``: every block the cache takes is logged as
        stored (its content hash, the hash before it, its tokens and the trie root's key), every
        block it drops as removed (its hash), a ``reset`` as cleared. ``demote``: removed blocks
        are logged with their block ids and tokens, for a tier below to copy them before the block
        is reused (taken with ``take_events`` right after the call that evicted them).

        While either is on, the content hash of every cached block is kept beside its tokens (8
        bytes a block); turning one on hashes what is cached already. Off (the default) costs
        nothing.
        Turning both off drops pending entries. An entry that would take the tokens pending
        past ``max_pending_tokens`` (an engine that stopped draining) is dropped and counted
        (``RawEvents.dropped``)."""
        cdef bint track = events or demote
        cdef Py_ssize_t cap = _as_count(max_pending_tokens, "max_pending_tokens", 0, PY_SSIZE_T_MAX // 8)
        with nogil:
            self._lock()
        try:
            if track and not self._track:
                self._hash_all_cached()
            self._track = track
            self._events = events
            self._demote = demote
            self._max_pending_tokens = cap
            if not track:
                self._log.num_entries = self._log.num_hashes = self._log.num_tokens = self._log.num_ids = 0
        finally:
            self._unlock()

    @property
    def events_on(self):
        """``(events, demote)`` as set."""
        return bool(self._events), bool(self._demote)

    cdef void _hash_all_cached(self) except *:
        """(Lock held) the content hash of every cached block, parents before children."""
        cdef RadixTrie trie = self._trie
        cdef Py_ssize_t i, bs = self._block_size
        cdef RNode *node
        cdef RNode *up
        cdef uint64_t parent
        cdef uint64_t *hashes
        order = sorted(
            (trie._nodes[i].depth, i) for i in range(trie._high_water) if trie._nodes[i].parent >= 0
        )
        for _, i in order:
            node = &trie._nodes[i]
            hashes = _chunk_hashes(node.chunk)
            if hashes == NULL:
                raise MemoryError("set_events: out of host memory for the cached blocks' hashes")
            up = &trie._nodes[node.parent]
            parent = lc_root_hash(<int64_t>up.key) if up.parent < 0 else _last_hash(up)
            lc_content_hashes(parent, node.chunk.tokens + node.start * bs, node.length, bs, trie._keys,
                              hashes + node.start)

    def take_events(self):
        """Drain the event log into a ``RawEvents`` (entries in the order things happened: see
        there), handing over its buffers rather than copying them; they come back for reuse when
        the ``RawEvents`` goes. ``lifecycle.events`` turns one into typed events."""
        cdef RawEvents taken
        cdef EvLog log
        with nogil:
            self._lock()
            log = self._log
            if log.num_entries or log.dropped:
                self._log = self._spare
                _clear_log(&self._spare)
            self._unlock()
        if not (log.num_entries or log.dropped):
            return _NO_EVENTS
        taken = RawEvents.__new__(RawEvents)
        taken._log = log
        taken._core = self
        taken._block_size = self._block_size
        return taken

    cdef void _recycle(self, EvLog *log) noexcept:
        """Keep a drained log's buffers as the spare for the next drain (free them if one is
        kept already, or if the lock is busy: this runs with the GIL held, from a deallocator,
        and must not wait for a thread that may be waiting for the GIL)."""
        if lc_mutex_trylock(&self._pool._lock):
            if self._spare.entries == NULL and self._spare.hashes == NULL and self._spare.tokens == NULL:
                self._spare = log[0]
                self._spare.num_entries = self._spare.num_hashes = self._spare.num_tokens = self._spare.num_ids = 0
                self._spare.dropped = 0
                _clear_log(log)
            lc_mutex_unlock(&self._pool._lock)
        _free_log(log)

    @property
    def pending_events(self):
        """Entries waiting in the event log."""
        return self._log.num_entries

    @property
    def null_block(self):
        """The block held for padding tables (0), or -1 when there is none."""
        return self._null_block

    def evict_blocks(self, ids):
        """Drop the given cached blocks from the prefix cache, with every block cached after them
        on their paths (a prefix cache has no holes), as an engine does when their KV turned out
        invalid. Blocks on the path of a running request are left alone (it still reads them).
        Returns the ids of the blocks that left the cache (int32, the given ones and those after
        them); ids that are not cached are ignored. Costs one pass over the trie's nodes."""
        cdef cnp.ndarray wanted = _block_ids(ids, self._pool._num_blocks, "evict_blocks")
        cdef const int32_t *data = <const int32_t *>cnp.PyArray_DATA(wanted)
        cdef Py_ssize_t i, j, n = cnp.PyArray_DIM(wanted, 0), nb = self._pool._num_blocks, count, total = 0
        cdef RadixTrie trie = self._trie
        cdef RNode *node
        cdef int32_t top
        cdef Failure f
        _ok(&f)
        marked = np.zeros(nb + 1, dtype=np.bool_)
        cdef cnp.npy_bool *mark = <cnp.npy_bool *>cnp.PyArray_DATA(marked)
        for i in range(n):
            mark[data[i]] = True
        dropped = []
        with nogil:
            self._lock()
        try:
            if self._closed:
                raise TornDown("evict_blocks: the KV cache core was closed (torn down)")
            # The first marked block of each unprotected node, cut off as the top of a subtree to drop.
            tops = []
            for i in range(trie._high_water):
                node = &trie._nodes[i]
                if node.parent < 0 or node.lock_count > 0:
                    continue
                for j in range(node.length):
                    if mark[node.chunk.blocks[node.start + j]]:
                        tops.append((i, j))
                        break
            for i, _ in tops:
                # Looked at again: an earlier drop may have taken this node (and a cut reused its slot).
                node = &trie._nodes[i]
                if node.parent < 0 or node.lock_count > 0 or i >= trie._high_water:
                    continue
                j = 0
                while j < node.length and not mark[node.chunk.blocks[node.start + j]]:
                    j += 1
                if j == node.length:
                    continue
                top = <int32_t>i
                if j > 0:
                    if trie._reserve(1):
                        raise MemoryError("evict_blocks: out of host memory")
                    trie._split(top, <int32_t>j)  # the head keeps the blocks before the marked one
                # Their KV is invalid: logged as removed (hashes only), never demoted.
                if self._reserve_scratch(trie._lru_blocks) or self._reserve_token_scratch(trie._lru_blocks, False):
                    raise MemoryError("evict_blocks: out of host memory")
                count = trie._drop_subtree(top, self._scratch, NULL, self._hash_scratch if self._track else NULL)
                if count < 0:
                    raise MemoryError("evict_blocks: out of host memory")
                if trie._num_evicted_tags:
                    self._drain_tags()
                if self._track and count > 0:
                    self._log_removed(self._scratch, NULL, self._hash_scratch, count)
                self._counters.blocks_evicted += count
                dropped.append(np.asarray(<int32_t[:count]>self._scratch).copy() if count else np.empty(0, np.int32))
                self._counters.blocks_freed += self._pool._dec_ref_locked(self._scratch, count, &f.batch)
                total += count
                if f.batch.failed_at >= 0:
                    raise InvariantViolation(f"evict_blocks: the pool refused a cached block ({f.batch.failed_at})")
        finally:
            self._unlock()
        return np.concatenate(dropped).astype(np.int32) if dropped else np.empty(0, dtype=np.int32)

    def num_common_prefix_blocks(self, handles):
        """How many leading blocks every one of the given live records shares (the same block
        ids), as cascade attention wants; 0 for no records."""
        cdef cnp.ndarray handle_array = _int64_vector(handles, "num_common_prefix_blocks: handles")
        cdef const int64_t *hs = <const int64_t *>cnp.PyArray_DATA(handle_array)
        cdef Py_ssize_t i, j, n = cnp.PyArray_DIM(handle_array, 0), common = 0
        cdef SeqRec *first
        cdef SeqRec *rec
        cdef Failure f
        _ok(&f)
        if n == 0:
            return 0
        with nogil:
            self._lock()
            first = self._rec(hs[0], &f)
            if first != NULL:
                common = first.num_blocks
                for i in range(1, n):
                    rec = self._rec(hs[i], &f)
                    if rec == NULL:
                        break
                    common = min(common, <Py_ssize_t>rec.num_blocks)
                    j = 0
                    while j < common and rec.chunk.blocks[j] == first.chunk.blocks[j]:
                        j += 1
                    common = j
            self._unlock()
        self._raise(&f, "num_common_prefix_blocks")
        return common

    def write_table(self, handle, out, pad=None):
        """Write the record's block ids into ``out``, a writable 1-D int32 buffer the engine owns
        (a numpy array or row, anything with the buffer protocol, or a CPU tensor through DLPack);
        with ``pad``, fill the rest of ``out`` with that id (the null block). Returns how many ids
        it wrote before the padding. ``out`` shorter than the table is refused, nothing written."""
        cdef int64_t h = _handle_arg(handle, "write_table")
        cdef int32_t pad_id = -1
        cdef int32_t[::1] dest = _writable_int32(out, "write_table")
        cdef Py_ssize_t n = 0, size = dest.shape[0], i
        cdef SeqRec *rec
        cdef Failure f
        if pad is not None:
            pad_id = <int32_t>_as_count(pad, "write_table: pad", 0, max(self._pool._num_blocks - 1, 0))
        _ok(&f)
        with nogil:
            self._lock()
            rec = self._rec(h, &f)
            if rec != NULL:
                n = rec.num_blocks
                if n > size:
                    f.code = E_TOO_LONG
                    f.value = n
                    f.limit = size
                else:
                    if n:
                        memcpy(&dest[0], rec.chunk.blocks, n * sizeof(int32_t))
                    if pad is not None:
                        for i in range(n, size):
                            dest[i] = pad_id
            self._unlock()
        if f.code == E_TOO_LONG:
            raise InvalidId(f"write_table: the sequence holds {f.value} blocks, the buffer takes {f.limit}")
        self._raise(&f, "write_table")
        return n

    def check_invariants(self):
        """Recount everything from scratch under the lock and raise ``InvariantViolation`` on any
        mismatch: the pool's and the trie's own checks, every block's refcount against the records'
        tables plus the cache's nodes, every node's pins against the records, every chunk's
        references, and the snapshot ids against the nodes' tags."""
        with nogil:
            self._lock()
        try:
            if self._closed:
                # The pool keeps the references the closed core dropped: nothing left to recount.
                raise TornDown("check_invariants: the KV cache core was closed (torn down)")
            problem = self._pool._problem()
            if problem is None:
                problem = self._trie._problem()
                if problem is not None:
                    problem = f"RadixTrie: {problem}"
            else:
                problem = f"BlockPool: {problem}"
            if problem is None:
                problem = self._recount()
        finally:
            self._unlock()
        if problem is not None:
            raise InvariantViolation(problem)

    cdef str _recount(self):
        cdef Py_ssize_t i, j, nb = self._pool._num_blocks, live = 0
        cdef SeqRec *rec
        cdef RNode *node
        cdef RadixTrie trie = self._trie
        cdef int32_t sid
        expected = np.zeros(nb + 1, dtype=np.int64)
        cdef int64_t[::1] refs = expected
        pins = {}
        chunk_refs = {}
        for i in range(self._recs_high_water):
            rec = &self._recs[i]
            if rec.status == FREE:
                continue
            live += 1
            if (
                rec.chunk == NULL or rec.num_blocks > rec.chunk.block_capacity
                or rec.num_tokens > rec.chunk.token_capacity
            ):
                return f"sequence {rec.seq_id} holds {rec.num_blocks} blocks, {rec.num_tokens} tokens beyond its chunk"
            if rec.lazy_tokens > rec.pin_blocks * self._block_size or rec.lazy_tokens % self._block_size:
                return f"sequence {rec.seq_id} leaves {rec.lazy_tokens} tokens to its pinned {rec.pin_blocks} blocks"
            if rec.prompt_len > rec.num_tokens or rec.ssm_tokens > rec.num_tokens:
                return (
                    f"sequence {rec.seq_id} has prompt_len {rec.prompt_len} / ssm_tokens {rec.ssm_tokens} "
                    f"over its {rec.num_tokens} tokens"
                )
            chunk_refs[<size_t>rec.chunk] = chunk_refs.get(<size_t>rec.chunk, 0) + 1
            for j in range(rec.num_blocks):
                if not 0 <= rec.chunk.blocks[j] < nb:
                    return f"sequence {rec.seq_id} holds block id {rec.chunk.blocks[j]} out of range [0, {nb})"
                refs[rec.chunk.blocks[j]] += 1
            if rec.pin_node >= 0:
                if rec.pin_node >= trie._high_water or trie._nodes[rec.pin_node].parent < 0:
                    return f"sequence {rec.seq_id} pins node {rec.pin_node}, which is not a cached node"
                node = &trie._nodes[rec.pin_node]
                if node.depth + node.length != rec.pin_blocks:
                    return (
                        f"sequence {rec.seq_id} pins node {rec.pin_node} ending at block "
                        f"{node.depth + node.length}, not {rec.pin_blocks}"
                    )
                pins[rec.pin_node] = pins.get(rec.pin_node, 0) + 1
            elif rec.pin_blocks != 0:
                return f"sequence {rec.seq_id} pins {rec.pin_blocks} blocks without a node"
        if live != self._num_live:
            return f"{live} live sequences, the counter says {self._num_live}"
        if self._null_block >= 0:
            refs[self._null_block] += 1
        tags = 0
        for i in range(trie._high_water):
            node = &trie._nodes[i]
            if node.parent < 0:
                continue
            chunk_refs[<size_t>node.chunk] = chunk_refs.get(<size_t>node.chunk, 0) + 1
            for j in range(node.start, node.start + node.length):
                if not 0 <= node.chunk.blocks[j] < nb:
                    return f"node {i} holds block id {node.chunk.blocks[j]} out of range [0, {nb})"
                refs[node.chunk.blocks[j]] += 1
            if node.pin_count != pins.get(i, 0):
                return f"node {i} is pinned {node.pin_count} times, but sequences hold {pins.get(i, 0)} pins on it"
            if node.tag >= 0:
                tags += 1
                if node.tag >= self._num_snapshots or self._snap_node[node.tag] != i:
                    return f"node {i} is tagged with snapshot {node.tag}, which is not kept at it"
        for address, count in chunk_refs.items():
            if (<Chunk *><size_t>address).refs != count:
                return f"a chunk has {(<Chunk *><size_t>address).refs} references but {count} holders"
        for i in range(nb):
            if refs[i] != self._pool._refcounts[i]:
                return f"block {i}: refcount {self._pool._refcounts[i]} but sequences and cache hold {refs[i]}"
        used = 0
        sid = self._snap_head
        while sid >= 0:
            used += 1
            if used > self._num_snapshots:
                return "snapshot LRU list has a cycle"
            if self._snap_node[sid] < 0 or trie._nodes[self._snap_node[sid]].tag != sid:
                return f"snapshot {sid} is listed as used but no node is tagged with it"
            sid = self._snap_next[sid]
        if used != tags or used != self._snaps_used:
            return f"{used} snapshots listed, {tags} nodes tagged, the counter says {self._snaps_used}"
        return self._recount_hashes()

    cdef str _recount_hashes(self):
        """With hashes kept: every cached block's hash follows from the one before it on its path
        and its own tokens (so, by induction, every one is the content hash of its path)."""
        cdef RadixTrie trie = self._trie
        cdef Py_ssize_t i, j, bs = self._block_size
        cdef RNode *node
        cdef RNode *up
        cdef uint64_t parent
        if not self._track:
            return None
        for i in range(trie._high_water):
            node = &trie._nodes[i]
            if node.parent < 0:
                continue
            if node.chunk.hashes == NULL:
                return f"node {i} keeps no content hashes"
            up = &trie._nodes[node.parent]
            parent = lc_root_hash(<int64_t>up.key) if up.parent < 0 else _last_hash(up)
            for j in range(node.start, node.start + node.length):
                parent = lc_fmix64(lc_nh_block(node.chunk.tokens + j * bs, bs, trie._keys)) + parent * LC_GOLDEN
                if node.chunk.hashes[j] != parent:
                    return f"cached block {node.chunk.blocks[j]} (node {i}) has a stale content hash"
        return None
        for i in range(trie._high_water):
            node = &trie._nodes[i]
            if node.parent < 0:
                continue
            up = &trie._nodes[node.parent]
            if up.parent < 0:
                parent = lc_root_hash(<int64_t>up.key)
            else:
                parent = self._block_hash[up.chunk.blocks[up.start + up.length - 1]]
            for j in range(node.start, node.start + node.length):
                parent = lc_fmix64(lc_nh_block(node.chunk.tokens + j * bs, bs, trie._keys)) + parent * LC_GOLDEN
                if self._block_hash[node.chunk.blocks[j]] != parent:
                    return f"cached block {node.chunk.blocks[j]} (node {i}) has a stale content hash"
        return None


# -- the event log handed over (KVCacheCore.take_events) ---------------------------------------------

cdef inline void _clear_log(EvLog *log) noexcept nogil:
    memset(log, 0, sizeof(EvLog))


cdef inline void _free_log(EvLog *log) noexcept nogil:
    free(log.entries)
    free(log.hashes)
    free(log.tokens)
    free(log.ids)
    _clear_log(log)


#: The layout of one entry of ``RawEvents.entries``: the C struct, field for field.
EVENT_DTYPE = np.dtype({
    "names": ["adapter", "parent", "count", "num_tokens", "kind", "has_parent", "has_ids"],
    "formats": ["<i8", "<u8", "<i4", "<i4", "i1", "?", "?"],
    "offsets": [
        <Py_ssize_t>&(<EvEntry *>NULL).adapter, <Py_ssize_t>&(<EvEntry *>NULL).parent,
        <Py_ssize_t>&(<EvEntry *>NULL).count, <Py_ssize_t>&(<EvEntry *>NULL).num_tokens,
        <Py_ssize_t>&(<EvEntry *>NULL).kind, <Py_ssize_t>&(<EvEntry *>NULL).has_parent,
        <Py_ssize_t>&(<EvEntry *>NULL).has_ids,
    ],
    "itemsize": sizeof(EvEntry),
})
cdef object _EVENT_DESCR = EVENT_DTYPE

#: ``RawEvents.entries["kind"]`` values.
STORED = 1
REMOVED = 2
CLEARED = 3


cdef extern from "numpy/arrayobject.h":
    """
    #define lc_array_over(subtype, descr, nd, dims, strides, data, flags, obj) \\
        PyArray_NewFromDescr(subtype, (PyArray_Descr *)(descr), nd, dims, strides, data, flags, obj)
    """
    object _array_over "lc_array_over" (
        PyTypeObject *subtype, object descr, int nd, cnp.npy_intp *dims, cnp.npy_intp *strides, void *data,
        int flags, object obj
    )
    int NPY_ARRAY_CARRAY_RO


@cython.final
@cython.auto_pickle(False)
cdef class RawEvents:
    """What ``KVCacheCore.take_events`` drained: entries in the order things happened, each
    naming a run of blocks. Arrays (read-only views over the log's own memory, made when asked
    for):

    - ``entries`` (``EVENT_DTYPE``): ``kind`` (``STORED``, ``REMOVED``, ``CLEARED``), ``count``
      blocks, whose content hashes follow each other in ``hashes``; ``num_tokens``: the entry's
      tokens in ``tokens`` (a stored entry's always, a removed one's with demotion); ``has_ids``:
      a removed entry's block ids are in ``ids`` (demotion); ``adapter``: the trie root's key of a
      stored entry; ``parent``: the hash before its first block (``has_parent`` False when that is
      the root).
    - ``hashes`` (uint64), ``tokens`` (int32), ``ids`` (int32).

    ``dropped``: entries lost before this drain (over 16M pending tokens, or out of host memory).
    """
    def __init__(self, *args, **kwargs):
        """Not for callers: ``KVCacheCore.take_events`` makes them."""
        raise TypeError("RawEvents are made by KVCacheCore.take_events")

    def __dealloc__(self):
        if self._core is not None:
            self._core._recycle(&self._log)
        else:
            _free_log(&self._log)

    def __len__(self):
        return self._log.num_entries

    def __repr__(self):
        return (
            f"RawEvents(entries={self._log.num_entries}, hashes={self._log.num_hashes}, "
            f"tokens={self._log.num_tokens}, dropped={self._log.dropped})"
        )

    @property
    def block_size(self):
        """Tokens per block of the core that logged them."""
        return self._block_size

    @property
    def dropped(self):
        return int(self._log.dropped)

    cdef object _view(self, void *data, Py_ssize_t n, object descr):
        cdef cnp.npy_intp dim = n
        cdef cnp.ndarray array
        if n == 0:
            data = NULL
        Py_INCREF(descr)  # taken by the call
        array = _array_over(<PyTypeObject *>np.ndarray, descr, 1, &dim, NULL, data, NPY_ARRAY_CARRAY_RO, None)
        if data != NULL:
            cnp.set_array_base(array, self)
        return array

    @property
    def entries(self):
        return self._view(self._log.entries, self._log.num_entries, _EVENT_DESCR)

    @property
    def hashes(self):
        return self._view(self._log.hashes, self._log.num_hashes, _HASH_DESCR)

    @property
    def tokens(self):
        return self._view(self._log.tokens, self._log.num_tokens, _INT32_DESCR)

    @property
    def ids(self):
        return self._view(self._log.ids, self._log.num_ids, _INT32_DESCR)


cdef object _HASH_DESCR = np.dtype(np.uint64)
cdef object _INT32_DESCR = np.dtype(np.int32)
cdef RawEvents _NO_EVENTS = RawEvents.__new__(RawEvents)


# -- argument conversion for the batched calls (GIL held) -------------------------------------------

cdef int32_t[::1] _writable_int32(object out, str call):
    """``out`` as a writable contiguous 1-D int32 view: the buffer protocol first, then DLPack
    (a CPU tensor); a device tensor, another dtype or shape, or a read-only buffer is refused."""
    view = None
    try:
        view = memoryview(out)
    except TypeError:
        if hasattr(out, "__dlpack__"):
            device = out.__dlpack_device__()[0] if hasattr(out, "__dlpack_device__") else 1
            if device != 1:
                raise InvalidId(f"{call}: a tensor on DLPack device type {device} is not host memory; write it "
                                "through the model (write_block_tables), which batches the copy") from None
            view = memoryview(np.from_dlpack(out))
    if view is None:
        raise InvalidId(f"{call}: {type(out).__name__} has neither the buffer protocol nor __dlpack__")
    if view.readonly:
        raise InvalidId(f"{call}: the buffer is read-only")
    if view.ndim != 1 or view.format not in ("i", "=i", "<i", "@i") or view.itemsize != 4 or not view.c_contiguous:
        raise InvalidId(
            f"{call}: needs a contiguous 1-D int32 buffer, got format {view.format!r}, {view.ndim}-D, "
            f"itemsize {view.itemsize}"
        )
    return view


cdef cnp.ndarray _int64_vector(object values, str what):
    """A 1-D int64 array (handles) as given when it is one, else converted; ``InvalidId`` when not
    integers."""
    if isinstance(values, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray>values) == cnp.NPY_INT64 and \
            cnp.PyArray_NDIM(<cnp.ndarray>values) == 1 and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>values):
        return <cnp.ndarray>values
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidId(f"{what} must be a 1-D sequence of ints, got {values!r}") from error
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidId(f"{what} must be a 1-D sequence of ints, got {array.dtype} of shape {array.shape}")
    if array.size and array.dtype.kind == "u" and array.max() > 0x7FFFFFFFFFFFFFFF:
        # refused by its own value: the int64 copy below would name a negative one
        raise InvalidId(f"{what}: {int(array.max())} is past the int64 limit {0x7FFFFFFFFFFFFFFF}")
    return np.require(array, dtype=np.int64, requirements=["C", "A"])


cdef cnp.ndarray _block_ids(object values, Py_ssize_t num_blocks, str call):
    """Block ids as a fresh int32 array, each in [0, num_blocks)."""
    cdef cnp.ndarray wide = _int64_vector(values, f"{call}: ids")
    if wide.size and (wide.min() < 0 or wide.max() >= num_blocks):
        bad = wide[(wide < 0) | (wide >= num_blocks)][0]
        raise InvalidId(f"{call}: block id {int(bad)} is outside [0, {num_blocks - 1}]")
    return wide.astype(np.int32)


cdef cnp.ndarray _int32_column(object values, Py_ssize_t n, str what):
    """``n`` int32 values (a count or a row per request)."""
    cdef const int32_t *data = NULL
    cdef Py_ssize_t size = 0
    if not _int32_vector_in(values, &data, &size):
        try:
            array = np.asarray(values)
        except (TypeError, ValueError, OverflowError) as error:
            raise InvalidId(f"{what} must be {n} ints, got {values!r}") from error
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu") or (
            array.size and (array.min() < 0 or array.max() > INT32_MAX)
        ):
            raise InvalidId(f"{what} must be {n} ints in [0, {INT32_MAX}], got {array!r}")
        values = np.require(array, dtype=np.int32, requirements=["C", "A"])
        _int32_vector_in(values, &data, &size)
    if size != n:
        raise InvalidId(f"{what}: {size} values for {n} requests")
    return <cnp.ndarray>values


cdef cnp.ndarray _table_2d(object table):
    """The engine's block table: a writeable, C-contiguous 2-D int32 numpy array."""
    if not (
        isinstance(table, cnp.ndarray)
        and cnp.PyArray_TYPE(<cnp.ndarray>table) == cnp.NPY_INT32
        and cnp.PyArray_NDIM(<cnp.ndarray>table) == 2
        and cnp.PyArray_ISCARRAY(<cnp.ndarray>table)
    ):
        raise InvalidId(
            "step: table must be a writeable C-contiguous 2-D int32 numpy array (rows by request), got "
            f"{type(table).__name__} {getattr(table, 'dtype', '')} {getattr(table, 'shape', '')}"
        )
    return <cnp.ndarray>table


# -- the Python face of a record -------------------------------------------------------------------


class SeqStatus(enum.Enum):
    """Where a sequence is in its life. Transitions: ACTIVE -> RETIRED -> FREED, ACTIVE -> FREED."""

    ACTIVE = "active"
    RETIRED = "retired"
    FREED = "freed"


# Indexed by a record's status code.
_SEQ_STATUS = (SeqStatus.FREED, SeqStatus.ACTIVE, SeqStatus.RETIRED)
_NO_IDS = np.empty(0, dtype=np.int32)
_NO_HASHES = np.empty(0, dtype=np.uint64)


@cython.final
@cython.no_gc_clear  # a face collected in a cycle must still queue its handle
@cython.auto_pickle(False)
cdef class SequenceState:
    """One sequence's memory, as handed out by ``alloc_sequence``. Not constructed directly.

    Its state (tokens, block table, pinned prefix, content hashes, adapter reference, status)
    lives in the model's KV cache core, its SSM slot in the slot pool through ``_guard``: this
    object reads through them. A sequence the model freed answers as an empty one.
    """

    def __init__(self, *args, **kwargs):
        """Always raises TypeError: sequences come from a model's alloc_sequence()."""
        raise TypeError("SequenceState objects are created by alloc_sequence()")

    def __dealloc__(self):
        # Dropped without free_sequence (an exception path): the guard releases the slot by itself;
        # the model reaps the record at its next call.
        if self._open and self._drop_queue is not None:
            self._drop_queue.append(self._handle)

    def __repr__(self):
        if not self._open:
            return f"SequenceState(seq_id={self.seq_id}, status=freed)"
        return (
            f"SequenceState(seq_id={self.seq_id}, slot_idx={self.slot_idx}, blocks={self.num_blocks}, "
            f"tokens={self.num_tokens}, status={self.status.value}{', failed' if self.failed else ''})"
        )

    @property
    def handle(self):
        """The handle of the sequence's record in the core (for batched calls such as
        ``HybridModel.step``); refused by the core once the sequence is freed."""
        return self._handle

    @property
    def slot_idx(self):
        """The SSM pool slot holding this sequence's state, or ``DETACHED_SLOT`` (-1)."""
        guard = self._guard
        return guard.slot if guard is not None and guard.held else -1

    @property
    def ssm_addrs(self):
        """Per SSM layer, the (h_state, conv_state) device addresses of this sequence's slot."""
        slot = self.slot_idx
        return self._addrs_by_slot[slot] if slot >= 0 else ()

    @property
    def draft_tokens(self):
        """Per-sequence proposer state for speculative decoding: draft token ids, sized to the
        budget (allocated on first use, so sequences that never draft pay nothing)."""
        if self._draft_tokens is None:
            self._draft_tokens = np.zeros(self.budget_tokens, dtype=np.int32)
        return self._draft_tokens

    @property
    def block_table(self):
        """The sequence's block ids in order (int32, a copy safe to hand to a kernel)."""
        return self._core.block_table(self._handle) if self._open else _NO_IDS.copy()

    @property
    def num_blocks(self):
        return self._core._field(self._handle, 1) if self._open else 0

    @property
    def tokens(self):
        """Prompt and generated tokens so far (a copy; empty once freed)."""
        return self._core.tokens(self._handle) if self._open else _NO_IDS.copy()

    @property
    def num_tokens(self):
        return self._core._field(self._handle, 0) if self._open else 0

    def block_hashes(self):
        """Content hashes of the sequence's full blocks (docs/content-hashes.md): the same on every
        process and machine for the same tokens and adapter, computed once per block."""
        return self._core.block_hashes(self._handle) if self._open else _NO_HASHES.copy()

    @property
    def prompt_len(self):
        """Tokens of the prompt (the rest of ``tokens`` was generated)."""
        return self._core._field(self._handle, 2) if self._open else 0

    @prompt_len.setter
    def prompt_len(self, value):
        self._core.set_prompt_len(self._handle, value)

    @property
    def num_cached_tokens(self):
        """Prompt tokens whose KV came from the prefix cache."""
        return self._core._field(self._handle, 3) if self._open else 0

    @property
    def ssm_tokens(self):
        """How many tokens the SSM state in the slot has consumed (set by the engine; None means
        ``num_tokens``). A snapshot is only taken where this falls on a block boundary."""
        cdef int32_t value = self._core._field(self._handle, 4) if self._open else -1
        return None if value < 0 else value

    @ssm_tokens.setter
    def ssm_tokens(self, value):
        self._core.set_ssm_tokens(self._handle, value)

    @property
    def adapter_slot(self):
        """The LoRA adapter slot this sequence holds a reference on, or ``NO_ADAPTER`` (-1)."""
        return self._core._field(self._handle, 7) if self._open else -1

    @property
    def status(self):
        return _SEQ_STATUS[self._core._field(self._handle, 6)] if self._open else SeqStatus.FREED

    @property
    def is_detached(self):
        return self.slot_idx == -1

    @property
    def is_freed(self):
        return self.status is SeqStatus.FREED

    @property
    def failed(self):
        return bool(self._core._field(self._handle, 5)) if self._open else False

    def mark_failed(self):
        """Mark the sequence failed: its KV is not trusted, so it is never inserted in the cache."""
        self._core.mark_failed(self._handle)

    def append_tokens(self, tokens):
        """Record tokens whose KV the engine has computed (prompt first, then generated ones).
        Token ids are integers in [0, 2**31); anything else is refused with nothing recorded."""
        if not isinstance(tokens, (np.ndarray, list, tuple)):
            tokens = list(tokens)
        self._core._append(self._handle, tokens)


cdef inline bint memcmp_tokens(const int32_t *a, const int32_t *b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if a[i] != b[i]:
            return True
    return False
