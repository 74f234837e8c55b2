# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The KV cache core (module lifecycle._kvcache): the one owner of a request's KV state.

A ``KVCacheCore`` holds a ``BlockPool``, the prefix trie over it (``lifecycle._radix``), one record
per request (``lifecycle._records``), the SSM snapshot ids (``lifecycle._snapids``) and an event
log (``lifecycle._evlog``) it writes to where the cache changes. A record owns the request's token
ids and block table (one ``Chunk``), the pin on the cached path it uses or added, its content
hashes once asked for, its adapter slot reference and its status. Python holds a handle (an int,
refused once stale) and nothing else of that state.

This module is the request path. What a scheduler does per request is one call here, the same for
every model: ``attach`` (find, pin and reference the cached prefix, then allocate the rest,
evicting when short), ``append``, ``grow``, ``cache`` (into the trie, mid-life),
``snapshot_point`` (a hybrid model's SSM snapshot at a block boundary), ``finish`` (cache the full
blocks, release everything), ``step`` (a decode step for a batch). When a finishing request's new
blocks go into the trie, its chunk is taken over instead of copied, unless most of it would be
waste. The SSM snapshot calls, the event log, ``evict_blocks``, the counters and
``check_invariants`` are done in ``lifecycle._coreviews`` (their methods stay here).

Ownership (as SPEC §4 states it): the cache holds one pool reference per cached block; a record
holds one on every block of its table. References are acquired before any is released; a block the
cache takes from a finishing request changes owner without passing through zero.

Locking: every call works under the pool's lock (the trie, the records, the snapshot ids and the
event log share it, as one ``CoreLock``), taken in the one form of ``_sync.pxd``.
"""

cimport cython
cimport numpy as cnp
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint64_t
from cpython.mem cimport PyMem_Free
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy

from lifecycle._args cimport ssize_arg as _as_count
from lifecycle._blockpool cimport BatchResult
from lifecycle._evlog cimport EvEntry, new_event_log
from lifecycle._groups cimport group_index, group_tables as _group_tables, new_groups
from lifecycle._hash cimport lc_stream_tokens_checked, lc_tokens_differ
from lifecycle._int32 cimport (
    adapter_key as _adapter_key, empty_int32 as _empty_int32, grow_array, int32_buffer, int32_column, int64_vector,
    shrink as _shrink, token_vector as _token_vector, writeable_int32,
)
from lifecycle._radix cimport (
    MAX_PRIORITY, POLICY_BRANCH_LRU, POLICY_BRANCH_LRU_EXACT, POLICY_LRU, Chunk, RNode, WalkEnd, chunk_decref,
    chunk_new,
)
from lifecycle._records cimport SequenceState as _Sequence
from lifecycle._retention cimport new_retention
from lifecycle._records cimport (
    E_CLOSED, E_GROUPS, E_GROWN, E_INVALID_ARG, E_INVARIANT, E_NEGATIVE_TOKEN, E_NO_MEMORY, E_NOT_CACHED,
    E_OTHER_TOKENS, E_OUT_OF_BLOCKS, E_REFUSED, E_TOO_LONG, OK, blocks_for, handle_arg as _handle_arg,
    new_records, new_sequence, ok,
)
from lifecycle._slots cimport SlotGuard, SlotPool
from lifecycle._saltmap cimport SaltMap
from lifecycle._snapids cimport new_snapshot_ids
from lifecycle._sync cimport PyThreadState, core_lock

cimport lifecycle._coreviews as _views

# The event log's and the records' names that callers import from this module.
from lifecycle._evlog import CLEARED, EVENT_DTYPE, REMOVED, STORED, RawEvents  # no-cython-lint
from lifecycle._records import SeqStatus, SequenceState  # no-cython-lint
from lifecycle.errors import ConfigError, InvalidId, InvariantViolation, RetentionError, Unsupported

cnp.import_array()

#: The eviction policies ``KVCacheCore(eviction_policy=...)`` takes.
EVICTION_POLICIES = ("lru", "branch-lru", "branch-lru-exact")


cdef int _policy_arg(object value) except -1:
    if value == "lru" and isinstance(value, str):
        return POLICY_LRU
    if value == "branch-lru" and isinstance(value, str):
        return POLICY_BRANCH_LRU
    if value == "branch-lru-exact" and isinstance(value, str):
        return POLICY_BRANCH_LRU_EXACT
    raise ConfigError(f"eviction_policy must be one of {', '.join(map(repr, EVICTION_POLICIES))}, got {value!r}")


@cython.final
@cython.auto_pickle(False)
@cython.no_gc_clear  # sequences in a cycle with it still read through it: a cycle's clear must leave its parts
cdef class KVCacheCore:
    """Block pool + prefix trie + per-request records, with one call per scheduler step.

    ``pool`` is the ``BlockPool`` whose references it keeps; ``block_size`` tokens per block;
    ``enable_prefix_cache=False`` makes it a plain allocator (nothing matches, nothing is cached);
    ``snapshot_cut=True`` (hybrid models) reuses a cached prefix only up to its deepest SSM
    snapshot, of which it keeps ids for ``num_snapshots``; ``max_blocks_per_seq`` caps a table.
    ``events`` / ``demote``: see ``set_events``; ``null_block=True`` holds block 0 of a fresh
    pool for good (engines pad their tables with it), so it is never handed out or cached.

    ``eviction_policy``: the order eviction takes cached runs in, within each retention priority's
    turn (lowest priority first): ``"lru"`` (the default, least recently used leaf first) or
    ``"branch-lru"`` (at the default priority, least recently used with a bonus for a run's
    reuses while cached and for the longest request path through it, the victim's whole run at a
    time; docs/retention.md) or ``"branch-lru-exact"`` (the same keys, block by block in key
    order: what bench/policies.py's block model evicts, at several times the eviction cost). Not
    offered with ``groups``.

    ``groups``: the KV cache groups past group 0 (``pool``, full attention), each
    ``(kind, window, sink_tokens, pool)`` with kind ``"full"``, ``"sliding_window"`` or
    ``"chunked_local"`` (``window``: its window or chunk in tokens) and a ``BlockPool`` of its own
    (the core's alone: it works on it under its own lock), with this block size. Admission reuses
    the longest prefix every group can serve; a windowed group's table holds -1 where it needs no
    block (before its window, or released since); ``cache`` and ``step(cache=True)`` cache every
    group's computed blocks; the decode step releases what left a window (a cached block stays
    cached, evictable by its group; an uncached one is freed unless it lies in the window before a
    checkpoint every ``retention_interval`` tokens, a multiple of the block size, 0: none; by
    default a power of two of blocks, at least 4096 tokens, from the pools' sizes: see
    ``lifecycle._groups.default_retention``). See ``lifecycle._groups``.
    """

    def __init__(self, BlockPool pool not None, block_size, *, enable_prefix_cache=True, snapshot_cut=False,
                 num_snapshots=0, max_blocks_per_seq=None, max_tokens_per_seq=None, capacity=None,
                 events=False, demote=False, null_block=False, groups=None, retention_interval=None,
                 eviction_policy="lru"):
        """An empty cache over ``pool`` with ``block_size`` tokens per block; the class says what
        each option does."""
        cdef PyThreadState *released
        cdef int32_t null_id
        cdef Py_ssize_t i
        if self._pool is not None:
            raise ConfigError("this KVCacheCore is already initialized; make a new one")
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
        num = <int32_t>_as_count(num_snapshots, "num_snapshots", 0, INT32_MAX // 2)
        # Nodes hold runs of blocks, so far fewer nodes than blocks are needed; the table grows.
        self._trie = RadixTrie(
            self._block_size, capacity=_as_count(1024 if capacity is None else capacity, "capacity", 0, INT32_MAX // 4)
        )
        policy = _policy_arg(eviction_policy)
        if groups is not None and len(groups):
            if policy != POLICY_LRU:
                raise ConfigError(
                    f"eviction_policy={eviction_policy!r} is not offered with KV cache groups (groups=): only 'lru'"
                )
            if snapshot_cut:
                raise ConfigError("snapshot_cut is not offered with KV cache groups (groups=): give one or the other")
            self._groups = new_groups(pool, self._block_size, groups, retention_interval, self._max_tokens_per_seq)
            self._grouped = True
            self._trie._set_groups(self._groups.n)
        if policy != POLICY_LRU and self._trie._set_policy(
            policy, round(total * 0.5), total, round(total * 1.5)
        ):
            raise MemoryError("KVCacheCore: cannot allocate the branch-lru stamps")
        self._lock = core_lock(pool, pool.mutex())
        self._trie._share_lock(pool, pool.mutex())
        self._records = new_records(
            self._trie, pool, self._lock, self._block_size, self._max_blocks_per_seq, self._max_tokens_per_seq
        )
        if self._grouped:
            self._groups.records = self._records
            self._trie._set_owners(self._groups._owners)  # its splits keep the groups' block owners
        self._snaps = new_snapshot_ids(num, self._trie)
        self._retention = new_retention(self._trie, self._records, self._lock, self._block_size, self._grouped)
        if self._grouped:
            self._groups.retention = self._retention
        self._evlog = new_event_log(self._block_size, pool, pool.mutex())
        self.salts = SaltMap()
        self._pool = pool
        self._enabled = bool(enable_prefix_cache)
        self._snapshot_cut = bool(snapshot_cut)
        self._null_block = -1
        if null_block:
            for group_pool in (self._groups.pools if self._grouped else (pool,)):
                if group_pool.num_free != group_pool.num_total or group_pool.num_total == 0:
                    raise ConfigError(
                        f"null_block needs a fresh pool with at least one block (free {group_pool.num_free} of "
                        f"{group_pool.num_total})"
                    )
            released = self._lock.enter(LONG_CALL)
            self._pool._allocate_locked(&self._null_block, 1)
            if self._grouped and not self._groups.shared:
                for i in range(1, self._groups.n):
                    self._groups.pool_of(i)._allocate_locked(&null_id, 1)  # block 0 of a fresh pool
            self._lock.leave(released)
            if self._null_block != 0:
                raise InvariantViolation(f"a fresh pool handed out block {self._null_block} first, not block 0")
            if self._grouped:
                self._groups.pad = self._null_block  # block 0 of every group's pool as well
        if events or demote:
            self.set_events(events, demote)

    def __dealloc__(self):
        free(self._scratch)
        free(self._token_scratch)
        free(self._hash_scratch)

    def __repr__(self):
        return (
            f"KVCacheCore(blocks={self._pool.num_total}, free={self._pool.num_free}, "
            f"cached={self._trie._num_blocks}, sequences={self._records.num_live})"
        )

    # -- properties --

    @property
    def pool(self):
        """The ``BlockPool`` this core keeps references in."""
        return self._pool

    @property
    def eviction_policy(self):
        """``"lru"``, ``"branch-lru"`` or ``"branch-lru-exact"`` (see the class)."""
        return self._trie.eviction_policy

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
        return self._snaps.num

    @property
    def num_live_sequences(self):
        return self._records.num_live

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
        return self._snaps.used

    # -- the C surface other modules use (the SGLang page tree): the lock, locked calls by handle --

    cdef int64_t admit_locked(self, int64_t key, const int32_t *data, Py_ssize_t n, Py_ssize_t prefix,
                              Py_ssize_t wanted, Failure *f) noexcept nogil:
        """``admit``: a new record holding ``data``, its cached prefix (at most ``prefix`` blocks)
        and ``wanted`` blocks in all; its handle, or -1 with nothing left open."""
        cdef int64_t handle = self._records.open(key, -1, n, f)
        cdef SeqRec *rec
        cdef Failure ignored
        if handle < 0:
            return -1
        rec = self._records.of(handle)
        self._attach_locked(rec, data, n, prefix, wanted, f)
        if f.code != OK:
            ok(&ignored)
            self._finish_locked(rec, False, &ignored)
            # Nothing was admitted: the record opened and closed inside the call is not counted.
            self._records.withdraw()
            return -1
        return handle

    cdef const int32_t *table_locked(self, int64_t handle, Py_ssize_t *num_blocks,
                                     Py_ssize_t *cached_tokens) noexcept nogil:
        """The block table of a live record (valid until the record changes) and, in
        ``num_blocks`` and ``cached_tokens``, its length and the prompt tokens the cache gave it;
        NULL for a stale handle."""
        cdef Failure f
        cdef SeqRec *rec = self._records.get(handle, &f)
        if rec == NULL:
            return NULL
        num_blocks[0] = rec.num_blocks
        cached_tokens[0] = rec.cached_tokens
        return rec.chunk.blocks

    cdef Py_ssize_t finish_locked(self, int64_t handle, bint cache, Failure *f) noexcept nogil:
        """``finish`` of a live record; how many blocks became free."""
        cdef SeqRec *rec = self._records.get(handle, f)
        if rec == NULL:
            return 0
        return self._finish_locked(rec, cache, f)

    cdef int raise_failure(self, Failure *f, str call, object tokens=None) except -1:
        """Raise what ``call`` raises for a locked step's failure ``f`` (lock released)."""
        return self._records.raise_failure(f, call, tokens)

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

    cdef Py_ssize_t evict_locked(self, Py_ssize_t n, Failure *f) noexcept nogil:
        """Trim least recently used cached blocks until ``n`` became free or nothing is evictable;
        returns how many became free. A block a request still holds loses the cache's reference
        but frees nothing, so the next round trims more."""
        cdef Py_ssize_t freed = 0, want, count
        cdef bint keep_tokens, logging, below = False
        if self._grouped:
            count = 0
            self._groups.evict(self._trie, 0, n, &freed, &count, f)  # counted in the groups' counters
            return freed
        while freed < n:
            want = min(n - freed, self._trie._lru_blocks)
            if want <= 0:
                break
            keep_tokens = self._evlog.demote and not self._quiet
            logging = (self._evlog.events or self._evlog.demote) and not self._quiet
            if self._reserve_scratch(want) or (logging and self._reserve_token_scratch(want, keep_tokens)):
                f.code = E_NO_MEMORY
                break
            count = self._trie._trim(
                want, self._scratch, self._token_scratch if keep_tokens else NULL,
                self._hash_scratch if logging else NULL, self._evlog.demote_min,
                &below if keep_tokens and self._evlog.demote_min > 0 else NULL,
            )
            if count < 0:
                f.code = E_INVARIANT
                f.value = self._trie._victim()
                break
            self._counters.blocks_evicted += count
            if logging and count > 0:
                self._evlog.removed(  # blocks below the demotion minimum go as plain removals
                    self._scratch, self._token_scratch if keep_tokens and not below else NULL, self._hash_scratch,
                    count,
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
        if grow_array(<void **>&self._hash_scratch, &self._hash_scratch_capacity, blocks, sizeof(uint64_t)):
            return 1
        if tokens and grow_array(
            <void **>&self._token_scratch, &self._token_scratch_capacity, blocks * self._block_size, sizeof(int32_t)
        ):
            return 1
        return 0

    cdef void _drain_tags(self) noexcept nogil:
        """Free the snapshots of nodes the trie trimmed or dropped."""
        cdef const int32_t *tags
        cdef Py_ssize_t i, n = self._trie._take_evicted_tags(&tags)
        for i in range(n):
            self._snaps.release(tags[i])

    # -- content hashes of cached blocks (lock held) -----------------------------------------------

    cdef void _log_stored(self, int32_t v, Py_ssize_t count) noexcept nogil:
        """The last ``count`` blocks of node ``v`` were just cached: keep their content hashes in
        the node's chunk and, with events on, log them."""
        cdef uint64_t parent
        cdef int64_t key
        cdef bint has_parent
        cdef const uint64_t *hashes
        cdef uint64_t *log_hashes = NULL
        cdef int32_t *log_tokens = NULL
        cdef EvEntry *entry = NULL
        if not self._track or count <= 0:
            return
        if self._evlog.events:
            # The entry first: the blocks are hashed straight into it (one pass over their tokens).
            entry = self._evlog.stored_room(count, 0, &log_hashes, &log_tokens)
        hashes = self._trie._hash_tail(v, count, &key, &parent, &has_parent, log_hashes, log_tokens)
        if hashes == NULL:
            if entry != NULL:
                self._evlog.unstore(entry)
                self._evlog.lost()  # out of memory: these blocks' removals will name hash 0
            elif not self._evlog.events:
                self._evlog.lost()
            # (events on and no entry: the log counted it as dropped already)
        elif entry != NULL:
            entry.adapter = key
            entry.parent = parent
            entry.has_parent = has_parent

    cdef int _grow_locked(self, SeqRec *rec, Py_ssize_t num_blocks, Failure *f) noexcept nogil:
        """Extend the record's table to ``num_blocks`` fresh blocks, evicting when short; all or
        nothing (blocks evicted stay evicted)."""
        cdef Py_ssize_t need = num_blocks - rec.num_blocks
        if need <= 0:
            return 0
        if self._records.reserve(rec, num_blocks, 0):
            f.code = E_NO_MEMORY
            return -1
        if self._grouped and self._groups.grow(self._trie, rec, num_blocks, f):
            return -1
        if self._pool._num_free < need:
            self.evict_locked(need - self._pool._num_free, f)
        if f.code == OK and not self._pool._allocate_locked(rec.chunk.blocks + rec.num_blocks, need):
            f.code = E_OUT_OF_BLOCKS
            f.value = need
            f.limit = self._pool._num_free
        if f.code != OK:
            if self._grouped:
                self._groups.ungrow(rec, rec.num_blocks, num_blocks, self._groups.n)
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
        cdef BatchResult undo
        if retry and self._grouped:
            f.code = E_GROUPS
            return -1
        if retry:
            self._records.materialize(rec)
            if rec.num_tokens != n or lc_tokens_differ(rec.chunk.tokens, tokens, n):
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
        elif self._records.reserve(rec, max(grow_to, blocks_for(n, bs)), n):
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
                if self._grouped and matched:
                    # The longest cut every group serves; the walk is redone to end there.
                    reuse = self._groups.best_cut(self._trie, walk.node, matched, 0)
                    if reuse < 0:
                        f.code = E_NO_MEMORY
                        return -1
                    if reuse < matched:
                        matched = self._trie._walk(root, tokens, reuse, &walk)
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
            if not self._trie._branch or self._snapshot_cut:
                # (branch-lru: the pin below takes the path off the lists at once, and a touch would
                # spend stamps the finish gives again.)
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
                fresh = chunk_new(self._trie._chunk_cache(), chunk.block_capacity, chunk.token_capacity)
                if fresh == NULL:
                    f.code = E_NO_MEMORY
                    return -1
            # New references first (into scratch), then the old ones go.
            if end >= 0:
                self._trie._path_blocks(end, self._scratch)
                self._pool._inc_ref_locked(self._scratch, reuse, &f.batch)
                if f.batch.failed_at >= 0:
                    if fresh != NULL:
                        chunk_decref(self._trie._chunk_cache(), fresh)
                    f.code = E_REFUSED
                    return -1
                self._trie._pin(end)
            if old_pin >= 0:
                self._trie._unpin(old_pin)
                self._counters.blocks_freed += self._pool._dec_ref_locked(chunk.blocks, old_blocks, &f.batch)
            if fresh != NULL:
                memcpy(fresh.tokens, chunk.tokens, rec.num_tokens * sizeof(int32_t))
                chunk_decref(self._trie._chunk_cache(), chunk)
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
                if self._grouped and self._groups.attach(self._trie, end, rec, reuse, f):
                    self._pool._dec_ref_locked(chunk.blocks, reuse, &undo)  # taken just above: none frees
                    return -1
                self._trie._pin(end)
                if self._trie._branch:
                    self._trie._hit(end)
                if self._snapshot_cut:
                    self._snaps.touch(self._trie._nodes[end].tag)
            rec.pin_node = end
            rec.pin_blocks = <int32_t>reuse
            rec.num_blocks = <int32_t>reuse
            rec.num_tokens = <int32_t>n
            rec.prompt_len = <int32_t>n
            rec.lazy_tokens = <int32_t>(reuse * bs)
            rec.kv_tokens = <int32_t>(reuse * bs)
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
        if self._trie._reserve(3) or (self._grouped and self._groups._reserve(full - d)):
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
            if self._grouped and self._groups.cache(self._trie, rec, d, start, d, full, start, f):
                return -1
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
        if self._grouped and self._groups.cache(self._trie, rec, d, v, pos, full, end if pos < full else -1, f):
            return -1
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
        self._records.materialize(rec)
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
        cdef Py_ssize_t freed, freed0 = 0, trimmed = 0
        cdef int32_t start, v = rec.pin_node, leaf = -1, tip
        cdef WalkEnd walk
        cdef Chunk *chunk = rec.chunk
        cdef Chunk *copy
        cdef bint cached = cache and self._enabled and not rec.failed
        if self._grouped and self._groups._reserve(rec.num_blocks):
            f.code = E_NO_MEMORY  # the groups' part below must not fail once group 0's is done
            return -1
        tip = rec.pin_node if self._enabled and not rec.failed else -1  # the request's cached path
        if cached:
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
                    if self._trie._branch:
                        self._trie._path_band(v, full)
                    self._trie._touch(v)
                elif 2 * length * bs >= chunk.token_capacity:
                    if self._trie._branch:
                        self._trie._path_band(v, full)
                    leaf = self._trie._add_leaf(v, chunk, <int32_t>pos, <int32_t>length)
                else:
                    copy = chunk_new(self._trie._chunk_cache(), length, length * bs)
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
                    if self._trie._branch:
                        self._trie._path_band(v, full)
                    leaf = self._trie._add_leaf(v, copy, 0, <int32_t>length)
                    chunk_decref(self._trie._chunk_cache(), copy)
                if length > 0:
                    self._counters.blocks_cached += length
                    if self._track:
                        self._log_stored(leaf, length)
                tip = leaf if length > 0 else v
        if self._grouped:
            if cached:
                self._groups.finish(self._trie, rec, v, pos, full, leaf, f)
            else:
                self._groups.release_all(rec, f)
        if self._trie._branch and cached and full <= d and tip >= 0:
            self._trie._path_band(tip, full)  # the pinned path alone (off the lists)
        # (After the groups' finish, which fills the new leaf's columns: a hint may cut its runs.)
        if self._retention._num_hints:
            self._retention.apply(rec, tip, rec.cached_tokens // bs)
        if rec.pin_node >= 0:
            self._trie._unpin(rec.pin_node)
        # The blocks [pos, full) now belong to the cache: the record's references changed owner.
        freed = self._pool._dec_ref_locked(chunk.blocks, pos, &f.batch)
        if f.batch.failed_at < 0:
            freed += self._pool._dec_ref_locked(chunk.blocks + full, rec.num_blocks - full, &f.batch)
        if f.batch.failed_at >= 0:
            f.code = E_INVARIANT
        self._counters.blocks_freed += freed
        self._records.close(rec)
        if self._grouped and f.code == OK and (cached or v >= 0):
            # The run left must end where every group can serve it (a pinned run may have given
            # up window blocks for a live sequence: KVGroups._drop_pinned).
            self._groups.settle_leaf(self._trie, leaf if leaf >= 0 else v, &freed0, &trimmed, f)
        return freed + freed0

    # -- the calls ------------------------------------------------------------------------------------

    def open(self, adapter=0, adapter_slot=-1, token_capacity=0):
        """A new request record under ``adapter`` (its prefix-cache key), holding adapter slot
        ``adapter_slot`` (-1: none; the caller's reference, handed back by ``finish``), with room
        for ``token_capacity`` tokens. Returns its handle."""
        cdef int64_t key = _adapter_key(adapter)
        cdef int32_t slot = <int32_t>_as_count(adapter_slot, "adapter_slot", -1, INT32_MAX)
        cdef int64_t seq_id
        return self._records.open_record(
            key, slot, _as_count(token_capacity, "token_capacity", 0, self._max_tokens_per_seq),
            &seq_id,
        )

    cpdef alloc(self, SlotPool slots, budget_tokens, addrs_by_slot, drop_queue):
        """A new request: a slot from ``slots`` (its guard records the request as the slot's
        owner), a record with room for ``budget_tokens`` tokens, and their Python face, which reads
        its SSM addresses from ``addrs_by_slot`` and puts its handle on ``drop_queue`` if it is
        dropped while open. One call for what a model's ``alloc_sequence_for`` does."""
        cdef Py_ssize_t budget = _as_count(
            budget_tokens, "budget_tokens", 0, self._max_tokens_per_seq
        )
        cdef int64_t seq_id, handle
        cdef _Sequence seq
        cdef SlotGuard guard
        if slots is None:
            raise TypeError("alloc: slots must be a SlotPool, got None")
        guard = slots._acquire()
        try:
            handle = self._records.open_record(0, -1, budget, &seq_id)
        except BaseException:
            guard._let_go()
            raise
        guard._record_owner(handle)
        seq = new_sequence(self._records, self, handle, seq_id, guard, addrs_by_slot, budget, drop_queue)
        seq._grouped = self._grouped
        return seq

    cpdef release(self, seq, bint cache, on_adapter=None):
        """What a model's ``free_sequence`` (``cache=False``) or ``finish_sequence`` does: the SSM
        slot first (unless detached), then the record (``finish``), then ``on_adapter(slot)`` for
        the adapter slot the request held, if any, whatever failed before. A second call does
        nothing."""
        cdef _Sequence face = self._records.face(seq)
        cdef object guard
        cdef int32_t slot = -1
        if not face._open:
            return
        guard = face.close()
        try:
            if guard is not None:
                (<SlotGuard>guard)._let_go()
        finally:
            try:
                slot = self.finish_record(face._handle, cache)
            finally:
                if slot >= 0 and on_adapter is not None:
                    on_adapter(slot)

    def handle_of(self, seq):
        """The handle of ``seq``'s record; ``ForeignSequence`` for anything but a sequence of
        this core."""
        return self._records.face(seq)._handle

    cpdef attach_seq(self, seq, prompt, grow_to=None):
        """``attach`` for a ``SequenceState`` (a model's ``attach_prefix``): ``grow_to`` counts
        tokens (None: no growth). Returns the reused token count."""
        cdef int64_t h = self._records.open_handle(seq, "attach_prefix")
        cdef Py_ssize_t wanted = -1
        if grow_to is not None:
            wanted = self._records.blocks_for_tokens(h, grow_to, "attach_prefix")
        return self._attach_call(h, prompt, wanted, -1) * self._block_size

    def grow_seq(self, seq, num_tokens):
        """``grow`` for a ``SequenceState``, to cover ``num_tokens`` tokens; the blocks added."""
        cdef int64_t h = self._records.open_handle(seq, "grow")
        return self.grow(h, self._records.blocks_for_tokens(h, num_tokens, "grow"))

    def clear(self, handle):
        """Take a record back to how ``open`` left it (keeping its adapter): its pin, block
        references and tokens go. For undoing a step that failed after the core's part."""
        cdef int64_t h = _handle_arg(handle, "clear")
        cdef Failure f
        cdef PyThreadState *released
        cdef SeqRec *rec
        cdef int32_t pin = -1
        cdef Py_ssize_t freed0 = 0, trimmed = 0
        cdef Chunk *fresh
        ok(&f)
        released = self._lock.enter(LONG_CALL)
        rec = self._records.get(h, &f)
        if rec != NULL:
            pin = rec.pin_node
            # What can be refused is asked for before any reference goes.
            fresh = self._records.unshared(rec, &f)
            if f.code == OK and self._grouped and self._groups.release_all(rec, &f):
                if fresh != NULL:
                    chunk_decref(self._trie._chunk_cache(), fresh)
            elif f.code == OK:
                self._counters.blocks_freed += self._records.clear_record(rec, fresh, &f)
        if self._grouped and pin >= 0 and f.code == OK:
            self._groups.settle_leaf(self._trie, pin, &freed0, &trimmed, &f)  # see _finish_locked
        self._lock.leave(released)
        self._records.raise_failure(&f, "clear")

    def adapter_slots(self):
        """The adapter slot of every live record that holds one (int32), for recounts."""
        return self._records.adapter_slots()

    def attach(self, handle, tokens, grow_to=-1, max_prefix=-1):
        """Record ``tokens`` as the request's prompt, find its longest cached prefix (whole
        blocks, never the prompt's last token, at most ``max_prefix`` blocks), pin it and put its
        blocks at the head of the table, then grow the table to ``grow_to`` blocks (evicting when
        short). Returns the blocks reused.

        Calling it again with the same tokens (a retried lookup) takes no second set of
        references. When the growth cannot be met, ``OutOfBlocks`` is raised with the prefix
        attached (as ``attach`` then ``grow`` would end). Bad tokens change nothing.
        """
        cdef int64_t h = _handle_arg(handle, "attach")
        cdef Py_ssize_t wanted = _as_count(grow_to, "grow_to", -1, self._max_blocks_per_seq)
        return self._attach_call(h, tokens, wanted, _as_count(max_prefix, "max_prefix", -1, INT32_MAX))

    cdef Py_ssize_t _attach_call(self, int64_t h, tokens, Py_ssize_t wanted, Py_ssize_t prefix) except? -1:
        """``attach`` with its counts checked (``attach_seq`` calls it with its own)."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, reuse
        cdef Failure f
        tokens = _token_vector(tokens, &data, &n)
        if n > self._max_tokens_per_seq:
            raise InvalidId(f"attach: {n} tokens are over the per-sequence limit of {self._max_tokens_per_seq}")
        ok(&f)
        cdef PyThreadState *released = self._lock.enter(n)
        reuse = self._attach_checked(h, data, n, prefix, wanted, &f)
        self._lock.leave(released)
        if f.code != OK:
            self._records.raise_failure(&f, "attach", tokens)
        return reuse

    cdef Py_ssize_t _attach_checked(self, int64_t handle, const int32_t *data, Py_ssize_t n, Py_ssize_t prefix,
                                    Py_ssize_t wanted, Failure *f) noexcept nogil:
        cdef SeqRec *rec = self._records.active(handle, f)
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
        ok(&f)
        cdef PyThreadState *released = self._lock.enter(n)
        handle = self.admit_locked(key, data, n, prefix, wanted, &f)
        self._lock.leave(released)
        if f.code != OK:
            self._records.raise_failure(&f, "admit", tokens)
        return handle

    def append(self, handle, tokens, kv_tokens=None):
        """Record tokens whose KV the engine computed (prompt first, then generated ones). With
        KV cache groups, the record's KV then covers the tokens it had before (or its first
        ``kv_tokens``, at most the tokens it then holds: the rest are in flight and stay in every
        window; a count at or below the last releases nothing): each windowed group releases
        what left the window."""
        cdef Py_ssize_t kv = -1 if kv_tokens is None else _as_count(kv_tokens, "append: kv_tokens", 0, INT32_MAX)
        if self._grouped:
            self._groups.append(self._records, _handle_arg(handle, "append"), tokens, kv)
        else:
            self._records.append(_handle_arg(handle, "append"), tokens)

    def grow(self, handle, num_blocks):
        """Extend the table to ``num_blocks`` blocks, all or nothing, evicting cached blocks when
        the free list is short; returns how many were added."""
        cdef int64_t h = _handle_arg(handle, "grow")
        cdef Py_ssize_t wanted = _as_count(num_blocks, "num_blocks", 0, self._max_blocks_per_seq)
        cdef Py_ssize_t added = 0
        cdef Failure f
        ok(&f)
        cdef PyThreadState *released = self._lock.enter(wanted)
        added = self._grow_checked(h, wanted, &f)
        self._lock.leave(released)
        if f.code != OK:
            self._records.raise_failure(&f, "grow")
        return added

    cdef Py_ssize_t _grow_checked(self, int64_t handle, Py_ssize_t wanted, Failure *f) noexcept nogil:
        cdef SeqRec *rec = self._records.active(handle, f)
        cdef Py_ssize_t before
        if rec == NULL:
            return 0
        before = rec.num_blocks
        if self._grow_locked(rec, wanted, f):
            return 0
        return max(<Py_ssize_t>0, rec.num_blocks - before)

    def allocate(self, handle, num_blocks, str call="allocate", held=None, kv_tokens=0):
        """Give a fresh record (no blocks, no tokens) exactly ``num_blocks`` free blocks, never
        evicting (a restore must not drop cache it cannot give back); ``OutOfBlocks`` when too few
        are free. ``call`` names the caller in errors. With KV cache groups (a swap record's
        restore): ``held[g - 1]`` lists the positions (ascending, < ``num_blocks``) where group
        ``g`` holds a block (None: every position; -1 at the others), ``kv_tokens`` the tokens
        up to which the windows were released; every group's blocks are taken, or none."""
        cdef int64_t h = _handle_arg(handle, "allocate")
        cdef Py_ssize_t wanted = _as_count(num_blocks, f"{call}: num_blocks", 0, self._max_blocks_per_seq)
        if self._grouped:
            _views.allocate_columns(self, h, wanted, held, kv_tokens, call)
            return
        if held is not None or kv_tokens != 0:
            raise InvalidId(f"{call}: held / kv_tokens are for a core of several KV cache groups; this one has one")
        self._counters.blocks_allocated += self._records.allocate(h, wanted, call)

    def kv_tokens(self, handle):
        """The tokens up to which the record's windowed groups released their blocks (0 with one group)."""
        cdef int64_t h = _handle_arg(handle, "kv_tokens")
        self._lock.enter_gil()
        try:
            return self._records.read(h, "kv_tokens").kv_tokens
        finally:
            self._lock.leave(NULL)

    def cache(self, handle, num_blocks):
        """Insert the record's first ``num_blocks`` full blocks into the prefix cache (nodes that
        exist keep their blocks; new ones take a cache reference of their own) and pin the path,
        so it is not evicted while the request lives. Returns the blocks newly cached."""
        cdef int64_t h = _handle_arg(handle, "cache")
        cdef Py_ssize_t full = _as_count(num_blocks, "num_blocks", 0, self._max_blocks_per_seq)
        cdef Py_ssize_t taken = 0
        cdef Failure f
        ok(&f)
        cdef PyThreadState *released = self._lock.enter(LONG_CALL)
        self._cache_checked(h, full, &taken, &f)
        self._lock.leave(released)
        self._records.raise_failure(&f, "cache_sequence")
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
        ok(&f)
        cdef PyThreadState *released = self._lock.enter(LONG_CALL)
        rec = self._records.active(h, &f)
        if rec != NULL:
            if full * self._block_size > rec.prompt_len or full > rec.num_blocks:
                f.code = E_NOT_CACHED
                f.value = full
                f.limit = min(<Py_ssize_t>rec.prompt_len // self._block_size, <Py_ssize_t>rec.num_blocks)
            else:
                self._cache_checked(h, full, &taken, &f)
                if f.code == OK and full * self._block_size > rec.cached_tokens:
                    rec.cached_tokens = <int32_t>(full * self._block_size)
        self._lock.leave(released)
        self._records.raise_failure(&f, "mark_computed")
        return taken

    def content_hashes(self, tokens, adapter=0):
        """The content hashes of the whole blocks of ``tokens`` under prefix-cache key
        ``adapter`` (uint64, docs/content-hashes.md), without a record: what a tier below the
        device is asked for before admission."""
        return _views.content_hashes(self, tokens, adapter)

    def cached_prefix_blocks(self, tokens, adapter=0):
        """How many leading whole blocks of ``tokens`` the prefix cache holds under key
        ``adapter``, by group 0's blocks alone (a windowed group's holes are not looked at, so
        this can be more than an admission would reuse), without a record: nothing is pinned or
        made recently used. 0 with caching off or on a closed core."""
        return _views.cached_prefix_blocks(self, tokens, adapter)

    def cache_key(self, handle):
        """The prefix-cache key (trie root) the record's blocks are matched and cached under."""
        return self._records.cache_key(_handle_arg(handle, "cache_key"))

    def set_cache_key(self, handle, key):
        """Match and cache the record under ``key`` (an adapter's key mixed with a cache salt),
        before it has blocks or tokens."""
        cdef int64_t h = _handle_arg(handle, "set_cache_key")
        self._records.bind(h, "set_cache_key", -1, _adapter_key(key))

    cdef int32_t _cache_checked(self, int64_t handle, Py_ssize_t full, Py_ssize_t *taken, Failure *f) noexcept nogil:
        cdef SeqRec *rec = self._records.get(handle, f)
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
        return _views.snapshot_point(self, handle, num_blocks, rolling)

    def drop_snapshot(self, snapshot_id):
        """Free a snapshot id whose SSM state could not be copied (its node keeps its KV)."""
        return _views.drop_snapshot(self, snapshot_id)

    def prefix_snapshot(self, handle):
        """The snapshot id at the end of the prefix the record reuses (-1: none), whose SSM state
        prefill starts from."""
        return _views.prefix_snapshot(self, handle)

    def finish(self, handle, bint cache=True):
        """What a finishing request does, in one call: cache its full blocks (unless ``cache`` is
        False, the cache is off or the request failed), unpin its prefix, drop its reference on
        every block and close the record. Returns the adapter slot it held (-1: none), for the
        caller to release; a second call raises ``SequenceStateError``."""
        return self.finish_record(_handle_arg(handle, "finish"), cache)

    cdef int32_t finish_record(self, int64_t handle, bint cache) except? -2:
        """``finish`` of a handle (the lock taken here); the adapter slot the record held."""
        cdef Failure f
        cdef int32_t slot = -1
        cdef SeqRec *rec
        cdef PyThreadState *released
        ok(&f)
        released = self._lock.enter(0)
        rec = self._records.get(handle, &f)
        if rec != NULL:
            slot = rec.adapter_slot
            self._finish_locked(rec, cache, &f)
        self._lock.leave(released)
        if f.code != OK:
            self._records.raise_failure(&f, "finish")
        return slot

    def is_live(self, handle):
        """Whether ``handle`` is a record of this core not yet finished."""
        return self._records.is_live(_handle_arg(handle, "is_live"))

    def step(self, handles, tokens, counts=None, table=None, rows=None, bint cache=False, group_tables=None):
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
        request that was refused all the same stay evicted, as for ``grow``.

        With KV cache groups every group grows at once (a request short in any group is refused),
        ``group_tables`` (one table per group past 0, shaped as ``table``) get each group's new
        ids, and each windowed group first releases the blocks that left the request's window or
        chunk (its KV covers the tokens it had before this step), a refused request's too, writing
        the null block (-1 without one) into those entries of its table."""
        cdef const int32_t *tok = NULL
        cdef Py_ssize_t n, num_tok = 0, ncols = -1, nrows = 0
        cdef const int64_t *hs
        cdef const int32_t *cnt = NULL
        cdef const int32_t *row_of = NULL
        cdef int32_t *tab = NULL
        cdef cnp.ndarray handle_array = int64_vector(handles, "step: handles")
        cdef cnp.ndarray count_array, row_array, table_array, refused
        cdef Failure f
        cdef Py_ssize_t num_refused = 0, bad = -1
        cdef int32_t **group_tabs = NULL
        n = cnp.PyArray_DIM(handle_array, 0)
        hs = <const int64_t *>cnp.PyArray_DATA(handle_array)
        tokens = _token_vector(tokens, &tok, &num_tok)
        if counts is not None:
            count_array = int32_column(counts, n, "step: counts")
            cnt = <const int32_t *>cnp.PyArray_DATA(count_array)
            if int(count_array.sum()) != num_tok:
                raise InvalidId(f"step: {num_tok} tokens given, but the counts add up to {int(count_array.sum())}")
        elif num_tok != n:
            raise InvalidId(f"step: {num_tok} tokens for {n} requests; one each, or give counts")
        if table is not None:
            table_array = writeable_int32(table, 2, "step: table", " (rows by request)")
            nrows, ncols = cnp.PyArray_DIM(table_array, 0), cnp.PyArray_DIM(table_array, 1)
            tab = <int32_t *>cnp.PyArray_DATA(table_array)
            if rows is not None:
                row_array = int32_column(rows, n, "step: rows")
                row_of = <const int32_t *>cnp.PyArray_DATA(row_array)
            elif n > nrows:
                raise InvalidId(f"step: a table of {nrows} rows for {n} requests (give rows)")
        elif rows is not None:
            raise InvalidId("step: rows were given without a table to write them in")
        if self._grouped and group_tables is not None:
            group_tables = tuple(group_tables)  # held while the step writes them
            group_tabs = _group_tables(group_tables, self._groups.n - 1, table)
        elif group_tables is not None:
            raise InvalidId("step: group_tables were given to a core with one KV cache group")
        refused = _empty_int32(n)
        ok(&f)
        cdef PyThreadState *released = self._lock.enter(LONG_CALL)
        bad = self._records.check_step(hs, n, tok, num_tok, cnt, row_of, nrows, ncols, &f)
        if bad < 0:
            num_refused = self._step_locked(
                hs, n, tok, cnt, tab, row_of, ncols, cache, <int32_t *>cnp.PyArray_DATA(refused), group_tabs, &f
            )
        self._lock.leave(released)
        PyMem_Free(group_tabs)
        if bad >= 0 or f.code != OK:
            if f.code == E_NEGATIVE_TOKEN:
                self._records.raise_failure(&f, "step", tokens)
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
            self._records.raise_failure(&f, "step")
        return _shrink(refused, num_refused)

    cdef Py_ssize_t _step_locked(
        self, const int64_t *hs, Py_ssize_t n, const int32_t *tok, const int32_t *cnt, int32_t *tab,
        const int32_t *row_of, Py_ssize_t ncols, bint cache, int32_t *refused, int32_t **group_tabs, Failure *f
    ) noexcept nogil:
        """(Lock held, arguments checked) the step itself; returns how many requests it refused."""
        cdef Py_ssize_t i, added, need, num_refused = 0, offset = 0, j, full, taken
        cdef SeqRec *rec
        cdef int32_t *row
        for i in range(n):
            rec = self._records.of(hs[i])
            added = cnt[i] if cnt != NULL else 1
            need = blocks_for(rec.num_tokens + added, self._block_size) - rec.num_blocks
            if self._records.reserve(rec, rec.num_blocks + max(need, <Py_ssize_t>0), rec.num_tokens + added):
                f.code = E_NO_MEMORY
                return num_refused
            if self._grouped and self._groups.release(
                rec, rec.num_tokens, group_tabs,
                <Py_ssize_t>(row_of[i] if row_of != NULL else i) * ncols if group_tabs != NULL else 0, f
            ):
                return num_refused
            if need > 0:
                if self._grouped and self._groups.grow(self._trie, rec, rec.num_blocks + need, f):
                    if f.code != E_OUT_OF_BLOCKS:
                        return num_refused
                    ok(f)
                    refused[num_refused] = <int32_t>i
                    num_refused += 1
                    offset += added
                    continue
                if self._pool._num_free < need:
                    self.evict_locked(need - self._pool._num_free, f)
                    if f.code != OK:
                        if self._grouped:
                            self._groups.ungrow(rec, rec.num_blocks, rec.num_blocks + need, self._groups.n)
                        return num_refused
                if not self._pool._allocate_locked(rec.chunk.blocks + rec.num_blocks, need):
                    if self._grouped:
                        self._groups.ungrow(rec, rec.num_blocks, rec.num_blocks + need, self._groups.n)
                    refused[num_refused] = <int32_t>i
                    num_refused += 1
                    offset += added
                    continue
                if tab != NULL:
                    row = tab + <Py_ssize_t>(row_of[i] if row_of != NULL else i) * ncols
                    for j in range(rec.num_blocks, rec.num_blocks + need):
                        row[j] = rec.chunk.blocks[j]
                    if group_tabs != NULL:
                        self._groups.write_rows(
                            rec, group_tabs, (row - tab), rec.num_blocks, rec.num_blocks + need
                        )
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
        ok(&f)
        cdef PyThreadState *released = self._lock.enter(LONG_CALL)
        if self._records.closed:
            f.code = E_CLOSED
        else:
            freed = self.evict_locked(n, &f)
        self._lock.leave(released)
        self._records.raise_failure(&f, "evict")
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
        ok(&f)
        cdef PyThreadState *released = self._lock.enter(LONG_CALL)
        if self._records.closed:
            f.code = E_CLOSED
        else:
            target = self.reclaim_locked(key, data, n, needed, &f)
        free_after = self._pool._num_free
        self._lock.leave(released)
        if f.code != OK:
            self._records.raise_failure(&f, "reclaim_prefix_blocks_for", tokens)
        return target, free_after

    cdef Py_ssize_t reclaim_locked(self, int64_t key, const int32_t *data, Py_ssize_t n, Py_ssize_t needed,
                                   Failure *f) noexcept nogil:
        cdef Py_ssize_t matched = 0, reuse = 0, target, i
        cdef int32_t end = -1
        for i in range(n):
            if data[i] < 0:
                f.code = E_NEGATIVE_TOKEN
                return 0
        # With several groups the walk's end need not be a cut every group serves: no reuse is
        # counted or protected (it evicts as if nothing were cached, never leaving an unservable leaf).
        if self._enabled and n > 1 and not self._grouped:
            end = self._match(key, data, (n - 1) // self._block_size, &matched, &reuse, f)
            if f.code != OK:
                return 0
        target = max(<Py_ssize_t>0, needed - reuse)
        if end >= 0:
            self._trie._pin(end)
        if self._pool._num_free < target:
            self.evict_locked(target - self._pool._num_free, f)
        if end >= 0:
            self._trie._unpin(end)
        return target

    # -- reading and setting a record (the records do it) ------------------------------------------

    def tokens(self, handle):
        """A copy of the record's token ids."""
        return self._records.tokens(_handle_arg(handle, "tokens"))

    def block_table(self, handle, group=0):
        """A copy of the record's block table (int32, for kernels) in KV cache group ``group``
        (a windowed group's holds -1 where it needs no block)."""
        cdef int64_t h = _handle_arg(handle, "block_table")
        cdef Py_ssize_t g = 0
        if not (type(group) is int and group == 0):
            g = group_index(group, self._ngroups(), "block_table")
        return self._records.block_table(h) if g == 0 else self._groups.table(self._records, h, g, "block_table")

    def block_hashes(self, handle):
        """The content hashes of the record's full blocks (uint64; see docs/content-hashes.md),
        computed once per block and kept with the record."""
        return self._records.block_hashes(_handle_arg(handle, "block_hashes"))

    def info(self, handle):
        """``(seq_id, status, num_tokens, prompt_len, num_blocks, cached_tokens, ssm_tokens,
        failed, adapter_slot)`` of a record (status: 1 active, 2 retired)."""
        return self._records.info(_handle_arg(handle, "info"))

    def num_tokens(self, handle):
        return self._records.field(_handle_arg(handle, "num_tokens"), 0)

    def num_blocks(self, handle):
        return self._records.field(_handle_arg(handle, "num_blocks"), 1)

    def prompt_len(self, handle):
        return self._records.field(_handle_arg(handle, "prompt_len"), 2)

    def cached_tokens(self, handle):
        return self._records.field(_handle_arg(handle, "cached_tokens"), 3)

    def ssm_tokens(self, handle):
        """Tokens the SSM state consumed, -1 when as many as the record's tokens."""
        return self._records.field(_handle_arg(handle, "ssm_tokens"), 4)

    def failed(self, handle):
        return bool(self._records.field(_handle_arg(handle, "failed"), 5))

    def status(self, handle):
        """0 freed (or not of this core), 1 active, 2 retired."""
        return self._records.field(_handle_arg(handle, "status"), 6)

    def adapter_slot(self, handle):
        return self._records.field(_handle_arg(handle, "adapter_slot"), 7)

    def set_prompt_len(self, handle, value):
        self._records.set_field(
            _handle_arg(handle, "prompt_len"), 0, _as_count(value, "prompt_len", 0, INT32_MAX), "prompt_len"
        )

    def set_ssm_tokens(self, handle, value):
        """Set the tokens the SSM state consumed (None: as many as the record's tokens)."""
        cdef int64_t h = _handle_arg(handle, "ssm_tokens")
        self._records.set_field(
            h, 1, -1 if value is None else _as_count(value, "ssm_tokens", 0, INT32_MAX), "ssm_tokens"
        )

    def mark_failed(self, handle):
        self._records.set_field(_handle_arg(handle, "mark_failed"), 2, 0, "mark_failed")

    def retire(self, handle):
        self._records.set_field(_handle_arg(handle, "retire_sequence"), 3, 0, "retire_sequence")

    def bind_adapter(self, handle, adapter_slot, adapter):
        """Record the adapter slot reference the request holds and its prefix-cache key (only
        before it has blocks)."""
        cdef int64_t h = _handle_arg(handle, "bind_adapter")
        cdef int64_t key = _adapter_key(adapter)
        self._records.bind(h, "bind_adapter", <int32_t>_as_count(adapter_slot, "adapter_slot", 0, INT32_MAX), key)

    # -- the whole cache ----------------------------------------------------------------------------

    def counters(self):
        """The core's counters since it was made, as a dict."""
        return _views.counters(self)

    # -- retention (lifecycle._retention) --

    @property
    def retention(self):
        """The retention state: hints per request, pinned prefixes, the pin budget, the clock."""
        return self._retention

    def set_retention(self, handle, ranges=(), *, decode_priority=None, decode_duration_s=None, ttl_s=None):
        """Retention hints for request ``handle``, applied at its finish (``Retention.set``)."""
        return self._retention.set(handle, ranges, decode_priority, decode_duration_s, ttl_s)

    def pin_prefix(self, tokens, adapter=0):
        """Pin the cached whole blocks of ``tokens`` within the pin budget (``Retention.pin``)."""
        return self._retention.pin(tokens, _adapter_key(adapter))

    def unpin_prefix(self, tokens, adapter=0):
        """Undo ``pin_prefix`` of the same prefix; returns its blocks (``Retention.unpin``)."""
        return _views.unpin_prefix(self, tokens, adapter)

    def time_ns(self):
        """Nanoseconds spent in the core's calls so far (under its lock)."""
        return self._lock.held_ns()

    def live_totals(self):
        """``(live records, blocks they hold)``."""
        return self._records.live_totals()

    def close(self):
        """Drop every record and cached block without touching the pool (whose memory goes with
        the model); every later call but ``close`` raises ``TornDown``. Returns ``(live records,
        blocks they held, cached blocks)``."""
        return _views.close(self)

    def memory(self):
        """Bytes of host memory the cache's metadata holds: ``trie`` (node slots, buckets),
        ``chunks`` (chunk headers and block-id arrays of cached runs), ``tokens`` (token arrays of
        cached runs), ``hashes``, ``records`` (the record table), as a dict."""
        return _views.memory(self)

    def reset(self):
        """Drop every cached block if none is in use by a request (pinned); returns whether it
        did. Snapshot ids of dropped nodes are freed."""
        return _views.reset(self)

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
        return _views.set_events(self, events, demote, max_pending_tokens)

    def set_demote_min_priority(self, priority):
        """With demotion on, only evicted blocks of retention priority ``priority`` or more are
        logged with their ids and tokens for a tier below (TensorRT-LLM's minimum priority for
        offload); lower ones are logged as plain removals and dropped. 0, the default: every one."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
            raise RetentionError(f"demote_min_priority must be an int in [0, {MAX_PRIORITY}], got {priority!r}")
        self._lock.enter_gil()
        self._evlog.set_demote_min(<int32_t>priority)
        self._lock.leave(NULL)

    @property
    def demote_min_priority(self):
        """The retention priority below which evicted blocks are not demoted (0: none)."""
        return self._evlog.demote_min

    @property
    def events_on(self):
        """``(events, demote)`` as set."""
        return bool(self._evlog.events), bool(self._evlog.demote)

    def take_events(self):
        """Drain the event log into a ``RawEvents`` (entries in the order things happened: see
        there), handing over its buffers rather than copying them; they come back for reuse when
        the ``RawEvents`` goes. ``lifecycle.events`` turns one into typed events."""
        return _views.take_events(self)

    @property
    def pending_events(self):
        """Entries waiting in the event log."""
        return self._evlog.pending()

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
        return _views.evict_blocks(self, ids)

    def evict_group(self, group, num_blocks):
        """Free at least ``num_blocks`` blocks of KV cache group ``group`` from the cache, or as
        many as it can; returns how many of that group's blocks became free. Group 0 (or a full
        group) evicts as ``evict`` does. A windowed group frees its cache-only blocks one by one,
        least recently left to the cache first (the same rule as when it is short of blocks): each
        leaves a hole in its run, the run's other groups keep their blocks, and a leaf whose last
        window lost a block is trimmed to a cut every group serves (freeing blocks of the others)."""
        return _views.evict_group(self, group, num_blocks)

    def num_common_prefix_blocks(self, handles):
        """How many leading blocks every one of the given live records shares (the same block
        ids), as cascade attention wants; 0 for no records."""
        cdef cnp.ndarray handle_array = int64_vector(handles, "num_common_prefix_blocks: handles")
        return self._records.common_prefix(
            <const int64_t *>cnp.PyArray_DATA(handle_array), cnp.PyArray_DIM(handle_array, 0)
        )

    def write_table(self, handle, out, pad=None, group=0):
        """Write the record's block ids into ``out``, a writable 1-D int32 buffer the engine owns
        (a numpy array or row, anything with the buffer protocol, or a CPU tensor through DLPack);
        with ``pad``, fill the rest of ``out`` with that id (the null block). Returns how many ids
        it wrote before the padding. ``out`` shorter than the table is refused, nothing written.
        ``group``: that KV cache group's table, whose -1 entries (no block needed) get ``pad``
        too when it is given."""
        cdef int64_t h = _handle_arg(handle, "write_table")
        cdef int32_t pad_id = -1
        cdef int32_t[::1] dest = int32_buffer(out, "write_table")
        cdef Py_ssize_t g = 0
        if not (type(group) is int and group == 0):
            g = group_index(group, self._ngroups(), "write_table")
        if g:
            return self._groups.write_table(self._records, h, dest, pad, g)
        if pad is not None:
            pad_id = <int32_t>_as_count(pad, "write_table: pad", 0, max(self._pool._num_blocks - 1, 0))
        return self._records.write_table(h, dest, pad_id)

    def check_invariants(self):
        """Recount everything from scratch under the lock and raise ``InvariantViolation`` on any
        mismatch: the pool's and the trie's own checks, every block's refcount against the records'
        tables plus the cache's nodes, every node's pins against the records, every chunk's
        references, and the snapshot ids against the nodes' tags."""
        return _views.check_invariants(self)

    # -- KV cache groups ------------------------------------------------------------------------------

    def _fail_growth(self, groups=0, chunks=0):
        """(Tests only) make the ``groups``-th growth of the groups' scratch from now fail (their
        scratch dropped first, so the next calls grow it again) and the ``chunks``-th growth of a
        record's chunk, as if the host were out of memory; 0: none."""
        return _views.fail_growth(self, groups, chunks)

    cdef Py_ssize_t _ngroups(self) noexcept:
        return self._groups.n if self._grouped else 1

    cdef int _refuse_grouped(self, str call) except -1:
        raise Unsupported(f"{call}: not offered by a KV cache core with several KV cache groups")

    @property
    def num_groups(self):
        """KV cache groups (1: the pool's alone)."""
        return self._ngroups()

    @property
    def groups(self):
        """``(kind, window, sink_tokens)`` of every KV cache group, group 0 first."""
        return self._groups.specs if self._grouped else (("full", 0, 0),)

    @property
    def group_pools(self):
        """The ``BlockPool`` of every KV cache group, group 0 (``pool``) first."""
        return self._groups.pools if self._grouped else (self._pool,)

    @property
    def retention_interval(self):
        """Tokens between the checkpoints windowed groups keep for later hits (0: none, or no groups)."""
        return self._groups.retention_blocks * self._block_size if self._grouped else 0

    def group_stats(self):
        """Per KV cache group, group 0 first, a dict: ``group``, ``kind``, ``window``,
        ``sink_tokens``, its pool's ``num_blocks`` and ``num_free``, ``num_cached`` (blocks the
        cache holds in it), ``blocks_allocated``, ``blocks_freed``, ``blocks_released`` (left a
        window), ``blocks_kept_at_checkpoints``, ``blocks_evicted``."""
        return _views.group_stats(self)
