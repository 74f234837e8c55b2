# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The prefix cache's composite operations, each one C call (module lifecycle._prefix_cache).

``PrefixCacheCore`` holds a ``BlockPool`` and a ``PrefixTrie`` and runs what a scheduler does per
request (match + pin + reference the cached prefix, allocate with eviction, insert taking the
cache's references, cache-and-release at finish, evict-until-free) on their C tables directly: no
intermediate arrays, one lock round trip. ``lifecycle.prefix_cache.PrefixCache`` wraps it.

Ownership is that of SPEC §4: the cache holds one pool reference per trie node, and references are
acquired before any is released, so no block changes hands through refcount 0.

Locking: a composite call takes the trie's lock, then the pool's, with the GIL released, and
holds both until it is done, so no other thread sees a half-applied operation. Nothing else takes
both (every other method takes one lock), and nothing holding the pool's lock waits for anything,
so this fixed order cannot deadlock.
"""

cimport cython
cimport numpy as cnp
from cpython.pythread cimport WAIT_LOCK, PyThread_acquire_lock, PyThread_release_lock
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, realloc

from lifecycle._blockpool cimport BatchResult, BlockPool, lc_mutex_lock, lc_mutex_unlock
from lifecycle._prefix_trie cimport FAIL_NONE, FAIL_NO_MEMORY, Outcome, PrefixTrie

import numpy as np

from lifecycle.errors import ConfigError, InvalidId

cnp.import_array()

from lifecycle._int32 cimport (
    adapter_key as _adapter_key,
    empty_int32 as _empty_int32,
    int32_vector as _int32_in,
    shrink as _shrink,
)


cdef inline void _lock_both(PrefixCacheCore c) noexcept nogil:
    PyThread_acquire_lock(c._trie._lock, WAIT_LOCK)
    lc_mutex_lock(&c._pool._lock)


cdef inline void _unlock_both(PrefixCacheCore c) noexcept nogil:
    lc_mutex_unlock(&c._pool._lock)
    PyThread_release_lock(c._trie._lock)




cdef inline int32_t *_table(object out, str call, Py_ssize_t *n) except NULL:
    """The data of a writeable, C-contiguous 1-D int32 array (a block table)."""
    if not (
        cnp.PyArray_Check(out)
        and cnp.PyArray_TYPE(<cnp.ndarray>out) == cnp.NPY_INT32
        and cnp.PyArray_NDIM(<cnp.ndarray>out) == 1
        and cnp.PyArray_ISCARRAY(<cnp.ndarray>out)
    ):
        raise InvalidId(
            f"{call}: the block table must be a writeable C-contiguous 1-D int32 numpy array, "
            f"got {type(out).__name__} {getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}"
        )
    n[0] = cnp.PyArray_DIM(<cnp.ndarray>out, 0)
    return <int32_t *>cnp.PyArray_DATA(<cnp.ndarray>out)








cdef inline void _undo_dec_ref(BlockPool pool, const int32_t *ids, Py_ssize_t n, Py_ssize_t freed) noexcept nogil:
    # Exact undo of a successful dec_ref batch under the same lock hold: the ids that reached 0
    # were pushed on top of the free stack, so dropping the top by ``freed`` takes them back.
    cdef Py_ssize_t i
    pool._num_free -= freed
    for i in range(n):
        pool._refcounts[ids[i]] += 1


@cython.final
@cython.auto_pickle(False)  # holds references in a pool: a pickled copy would be a second owner
cdef class PrefixCacheCore:
    """A prefix trie and the block pool whose references its nodes hold, with fused operations."""

    cdef BlockPool _pool
    cdef PrefixTrie _trie
    cdef bint _enabled
    cdef Py_ssize_t _block_size
    cdef Py_ssize_t _blocks_evicted
    cdef int32_t *_scratch          # evicted block ids of one eviction round (trie lock held)
    cdef Py_ssize_t _scratch_capacity

    def __init__(self, BlockPool pool not None, PrefixTrie trie not None, *, bint enabled=True):
        if self._pool is not None:
            raise ConfigError("this prefix cache is already initialized; make a new one")
        if trie.num_cached_blocks:
            raise ConfigError(
                f"trie: a PrefixCache needs an empty trie, this one caches {trie.num_cached_blocks} blocks"
            )
        self._pool = pool
        self._trie = trie
        self._enabled = enabled
        self._block_size = trie.block_size

    def __dealloc__(self):
        free(self._scratch)

    @property
    def pool(self):
        return self._pool

    @property
    def trie(self):
        return self._trie

    @property
    def enabled(self):
        return self._enabled

    @property
    def block_size(self):
        return self._block_size

    @property
    def num_cached_blocks(self):
        """Blocks the cache holds a reference on (one per trie node)."""
        return self._trie.num_cached_blocks

    @property
    def num_evictable_blocks(self):
        """Cached blocks that eviction may drop: not pinned, not above a pinned node."""
        return self._trie.num_evictable_blocks

    @property
    def blocks_evicted(self):
        """Trie nodes evicted so far (each dropped one cache reference, freed or not)."""
        return self._blocks_evicted

    # -- eviction (both locks held) --

    cdef Py_ssize_t _evict_locked(
        self, Py_ssize_t n, Outcome *outcome, BatchResult *result
    ) noexcept nogil:
        # Rounds of "evict what is still missing, release the cache's references": a node whose
        # block a live sequence holds frees nothing, so the next round evicts more. The same
        # rounds as evicting through the Python calls, so the same nodes go.
        cdef Py_ssize_t freed = 0, want, count
        cdef int32_t *scratch
        outcome.failure = FAIL_NONE
        result.failed_at = -1
        while freed < n:
            want = min(n - freed, self._trie._lru_count)
            if want <= 0:
                break
            if self._scratch_capacity < want:
                scratch = <int32_t *>realloc(self._scratch, want * sizeof(int32_t))
                if scratch == NULL:
                    outcome.failure = FAIL_NO_MEMORY
                    break
                self._scratch = scratch
                self._scratch_capacity = want
            count = self._trie._evict_locked(want, self._scratch, outcome)
            self._blocks_evicted += count
            if count:
                freed += self._pool._dec_ref_locked(self._scratch, count, result)
            if outcome.failure != FAIL_NONE or result.failed_at >= 0 or count == 0:
                break
        return freed

    cdef int _raise_evict_failure(self, Outcome *outcome, BatchResult *result) except -1:
        if outcome.failure == FAIL_NO_MEMORY:
            raise MemoryError("evict: cannot allocate room for the evicted block ids")
        if outcome.failure != FAIL_NONE:
            self._trie._raise_failed(outcome[0], "evict")
        if result.failed_at >= 0:
            self._pool._raise_refused(result, "dec_ref")
        return 0

    def evict(self, Py_ssize_t n):
        """Evict least recently used unpinned leaves until ``n`` blocks became free or nothing is
        evictable; return how many blocks became free (one C call, both locks held throughout).

        A node whose block a live sequence still references loses the cache's reference but frees
        nothing, and is not counted. So 0 means nothing evictable is left (for ``n > 0``).
        """
        cdef Outcome outcome
        cdef BatchResult result
        cdef Py_ssize_t freed
        if n < 0:
            raise InvalidId(f"evict: the count {n} must be >= 0")
        with nogil:
            _lock_both(self)
            freed = self._evict_locked(n, &outcome, &result)
            _unlock_both(self)
        self._raise_evict_failure(&outcome, &result)
        return freed

    def allocate(self, block_table, Py_ssize_t start, Py_ssize_t n):
        """Write ``n`` fresh block ids (refcount 1) into ``block_table[start:start + n]``, first
        evicting cached blocks (as ``evict``) when fewer than ``n`` are free. Returns how many
        blocks the eviction freed.

        Raises ``OutOfBlocks`` when even evicting every evictable block leaves fewer than ``n``
        free; then nothing is allocated, and the blocks evicted stay evicted (freeing cache is
        what the caller asked for, as a scheduler's reclaim would). Bad arguments change nothing.
        """
        cdef Py_ssize_t length, freed = 0
        cdef int32_t *dest = _table(block_table, "allocate", &length)
        cdef Outcome outcome
        cdef BatchResult result
        cdef bint short = False
        if n < 0:
            raise InvalidId(f"cannot allocate {n} blocks: the count must be >= 0")
        if start < 0 or start > length or n > length - start:
            raise InvalidId(
                f"allocate: cannot write {n} ids at start {start} into a block table of length {length}"
            )
        outcome.failure = FAIL_NONE
        result.failed_at = -1
        with nogil:
            _lock_both(self)
            if self._pool._num_free < n:
                freed = self._evict_locked(n - self._pool._num_free, &outcome, &result)
            if outcome.failure == FAIL_NONE and result.failed_at < 0:
                short = not self._pool._allocate_locked(dest + start, n)
            _unlock_both(self)
        self._raise_evict_failure(&outcome, &result)
        if short:
            self._pool._raise_short(n)
        return freed

    # -- prefix acquisition, shared by acquire_prefix and admit --

    cdef object _prefix_tokens(self, tokens, adapter, const int32_t **data, Py_ssize_t *n):
        """``tokens`` as an int32 vector to read in place (``data``, ``n``): other token sequences
        go through the trie's own conversion and errors. Returns the array that owns ``data``."""
        if not _int32_in(tokens, data, n):
            self._trie.match(tokens, adapter, 0)
            tokens = np.ascontiguousarray(tokens, dtype=np.int32)
            _int32_in(tokens, data, n)
        return tokens

    cdef inline Py_ssize_t _prefix_blocks(self, Py_ssize_t num_tokens, Py_ssize_t max_blocks, Py_ssize_t room):
        """Whole blocks of ``num_tokens`` to look up: at most ``max_blocks`` (-1: no limit) and ``room``."""
        cdef Py_ssize_t blocks = num_tokens // self._block_size
        if 0 <= max_blocks < blocks:
            blocks = max_blocks
        return room if blocks > room else blocks

    cdef inline Py_ssize_t _acquire_locked(
        self, int64_t key, const int32_t *data, Py_ssize_t num_blocks, int32_t *nodes, int32_t *dest,
        Outcome *outcome, BatchResult *result
    ) noexcept nogil:
        # Both locks held: match and pin the prefix (node ids into ``nodes``), one pool reference
        # on each of its blocks (ids into ``dest``); a refused reference drops the pins again.
        cdef Py_ssize_t k = self._trie._match_locked(key, data, num_blocks, nodes, dest, True, outcome)
        if k:
            self._pool._inc_ref_locked(dest, k, result)
            if result.failed_at >= 0:
                self._trie._unpin_locked(nodes, k)
        return k

    cdef int _raise_acquire_failure(self, Outcome *outcome, BatchResult *result, str call) except -1:
        if outcome.failure != FAIL_NONE:
            self._trie._raise_failed(outcome[0], call)
        if result.failed_at >= 0:
            self._pool._raise_refused(result, "inc_ref")
        return 0

    # -- lookups --

    def acquire_prefix(self, tokens, block_table, adapter=0, Py_ssize_t max_blocks=-1):
        """Match, pin and reference the longest cached whole-block prefix of ``tokens`` under
        ``adapter``, in one atomic step; return its node ids (pinned: ``unpin`` them later).

        At most ``max_blocks`` blocks (-1 = no limit) and at most ``len(block_table)``. The matched
        block ids are written to ``block_table[:k]``, each with one new pool reference owned by the
        caller; the path becomes the most recently used. With the cache disabled nothing matches.
        On an error nothing is pinned or referenced (``block_table[:k]`` may have been written).
        """
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, length, num_blocks, k = 0
        cdef int32_t *dest = _table(block_table, "acquire_prefix", &length)
        cdef int64_t key = _adapter_key(adapter)
        cdef Outcome outcome
        cdef BatchResult result
        cdef cnp.ndarray node_ids
        if max_blocks < -1:
            raise InvalidId(f"acquire_prefix: max_blocks {max_blocks} must be >= 0, or -1 for no limit")
        tokens = self._prefix_tokens(tokens, adapter, &data, &n)
        if not self._enabled:
            return _empty_int32(0)
        num_blocks = self._prefix_blocks(n, max_blocks, length)
        node_ids = _empty_int32(num_blocks)
        outcome.failure = FAIL_NONE
        result.failed_at = -1
        with nogil:
            _lock_both(self)
            k = self._acquire_locked(key, data, num_blocks, <int32_t *>cnp.PyArray_DATA(node_ids), dest, &outcome, &result)
            _unlock_both(self)
        self._raise_acquire_failure(&outcome, &result, "acquire_prefix")
        if k < num_blocks:
            _shrink(node_ids, k)
        return node_ids

    def admit(self, tokens, Py_ssize_t num_blocks, adapter=0, Py_ssize_t max_prefix=-1, block_table=None):
        """Admit a request in one atomic step: acquire its longest cached prefix (as
        ``acquire_prefix``, at most ``max_prefix`` blocks, -1 = no limit) and allocate the rest of
        its ``num_blocks`` blocks (as ``allocate``, evicting when short).

        Returns ``(block_table, node_ids, freed)``: the int32 table whose first ``num_blocks``
        ids each carry one pool reference owned by the caller (a new array, or the caller's
        ``block_table``, written in place, which must be a writeable C-contiguous 1-D int32 array
        of at least ``num_blocks``), the first ``len(node_ids)`` of them the cached prefix; that
        prefix's node ids (pinned: ``unpin`` them, or pass them to ``cache_and_release``); and how
        many blocks eviction freed. All or nothing: when even eviction leaves too few blocks it
        raises ``OutOfBlocks`` with nothing pinned or referenced (blocks evicted stay evicted, as
        for ``allocate``; a caller's ``block_table`` may have had its head written, as with
        ``acquire_prefix``).
        """
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0, length = 0, prefix_blocks, k = 0, need, freed = 0
        cdef int64_t key = _adapter_key(adapter)
        cdef Outcome outcome, evicted
        cdef BatchResult result, released
        cdef bint short = False
        cdef cnp.ndarray table, node_ids
        cdef int32_t *dest
        cdef int32_t *nodes
        if num_blocks < 0:
            raise InvalidId(f"admit: cannot allocate {num_blocks} blocks: the count must be >= 0")
        if max_prefix < -1:
            raise InvalidId(f"admit: max_prefix {max_prefix} must be >= 0, or -1 for no limit")
        tokens = self._prefix_tokens(tokens, adapter, &data, &n)
        prefix_blocks = self._prefix_blocks(n, max_prefix, num_blocks) if self._enabled else 0
        if block_table is None:
            table = _empty_int32(num_blocks)
        else:
            _table(block_table, "admit", &length)
            if length < num_blocks:
                raise InvalidId(f"admit: the block table holds {length} ids, {num_blocks} are needed")
            table = <cnp.ndarray>block_table
        node_ids = _empty_int32(prefix_blocks)
        dest = <int32_t *>cnp.PyArray_DATA(table)
        nodes = <int32_t *>cnp.PyArray_DATA(node_ids)
        outcome.failure = FAIL_NONE
        evicted.failure = FAIL_NONE
        result.failed_at = -1
        released.failed_at = -1
        with nogil:
            _lock_both(self)
            if prefix_blocks:
                k = self._acquire_locked(key, data, prefix_blocks, nodes, dest, &outcome, &result)
            if outcome.failure == FAIL_NONE and result.failed_at < 0:
                need = num_blocks - k
                if self._pool._num_free < need:
                    freed = self._evict_locked(need - self._pool._num_free, &evicted, &released)
                if evicted.failure == FAIL_NONE and released.failed_at < 0:
                    short = not self._pool._allocate_locked(dest + k, need)
                if (short or evicted.failure != FAIL_NONE or released.failed_at >= 0) and k:
                    # Give the prefix back exactly: the references just taken, then the pins.
                    self._pool._dec_ref_locked(dest, k, &result)
                    self._trie._unpin_locked(nodes, k)
            _unlock_both(self)
        self._raise_acquire_failure(&outcome, &result, "admit")
        self._raise_evict_failure(&evicted, &released)
        if short:
            self._pool._raise_short(num_blocks - k)
        if k < prefix_blocks:
            _shrink(node_ids, k)
        return table, node_ids, freed

    # -- inserting --

    def insert_path(self, tokens, block_ids, adapter=0, *, known_prefix=None):
        """Cache the ``len(block_ids)`` full blocks that start ``tokens`` under ``adapter``, taking
        the cache's references in the same call. Returns (blocks newly taken by the cache, the
        duplicates, the path's node ids); see ``PrefixCache.insert``. With the cache disabled
        nothing is taken and the path is empty.

        All or nothing: an invalid block id (out of range, or free in the pool), too few tokens or
        a wrong known prefix raise before the trie or any refcount changes.
        """
        cdef const int32_t *token_data = NULL
        cdef const int32_t *block_data = NULL
        cdef const int32_t *known = NULL
        cdef Py_ssize_t num_tokens = 0, n = 0, num_known = 0, k = 0, bad_known = -1
        cdef int failed = 0
        cdef BatchResult result, ignored
        cdef cnp.ndarray path
        if not self._enabled:
            return 0, np.array(block_ids, dtype=np.int32), _empty_int32(0)
        if not (
            _int32_in(tokens, &token_data, &num_tokens)
            and _int32_in(block_ids, &block_data, &n)
            and (known_prefix is None or _int32_in(known_prefix, &known, &num_known))
            and n * self._block_size <= num_tokens
            and num_known <= n
        ):
            return self._insert_path_checked(tokens, block_ids, adapter, known_prefix)
        cdef int64_t key = _adapter_key(adapter)
        path = _empty_int32(n)
        with nogil:
            _lock_both(self)
            # A temporary reference on every block validates the batch against the pool and is
            # acquired before anything is released.
            self._pool._inc_ref_locked(block_data, n, &result)
            if result.failed_at < 0:
                failed = self._trie._insert_locked(
                    key, token_data, block_data, n, known, num_known,
                    <int32_t *>cnp.PyArray_DATA(path), &k, &bad_known,
                )
                # What remains of the temporary references is exactly one per taken block.
                if failed or bad_known >= 0:
                    self._pool._dec_ref_locked(block_data, n, &ignored)
                else:
                    self._pool._dec_ref_locked(block_data, k, &ignored)
            _unlock_both(self)
        if result.failed_at >= 0:
            self._pool._raise_refused(&result, "inc_ref")
        if failed:
            raise MemoryError(f"insert: cannot grow the trie by {n} nodes")
        if bad_known >= 0:
            raise InvalidId(
                f"insert: known prefix entry {bad_known} (node id {known[bad_known]}) is not the cached "
                "node of that block on this path"
            )
        return n - k, np.array(block_ids[:k]), path

    def _insert_path_checked(self, tokens, block_ids, adapter, known_prefix):
        # Inputs that need conversion or are refused by the trie: the separate calls, whose
        # conversions and errors are the reference.
        self._pool.inc_ref(block_ids)
        try:
            taken, duplicates, path = self._trie.insert(tokens, block_ids, adapter, known_prefix=known_prefix)
        except BaseException:
            self._pool.dec_ref(block_ids)
            raise
        self._pool.dec_ref(duplicates)
        return len(taken), duplicates, path

    def cache_and_release(self, tokens, block_table, Py_ssize_t num_full, adapter, pinned):
        """What a finishing request does, as one atomic step: cache ``block_table[:num_full]``
        (the full blocks of ``tokens``) under ``adapter`` with ``pinned`` as the known prefix,
        unpin ``pinned``, and drop the caller's reference on every block of ``block_table``.
        Returns (blocks newly taken by the cache, blocks that became free).

        ``pinned`` must be the caller's pinned match for these tokens (``acquire_prefix``'s
        result). All or nothing: a bad node, pin, block id or token count raises and leaves the
        trie, the pins and every refcount as they were.
        """
        cdef const int32_t *token_data = NULL
        cdef const int32_t *known = NULL
        cdef Py_ssize_t num_tokens = 0, num_known = 0, length, k = 0, bad_known = -1
        cdef Py_ssize_t freed = 0, released = 0
        cdef int32_t *table = _table(block_table, "cache_and_release", &length)
        cdef int failed = 0
        cdef int step = 0
        cdef Outcome outcome
        cdef BatchResult result, ignored
        cdef int32_t *path
        cdef int64_t key = _adapter_key(adapter)
        if not _int32_in(tokens, &token_data, &num_tokens):
            raise InvalidId(
                f"cache_and_release: tokens must be a C-contiguous 1-D int32 numpy array, got {type(tokens).__name__}"
            )
        if not _int32_in(pinned, &known, &num_known):
            raise InvalidId(
                f"cache_and_release: pinned must be a C-contiguous 1-D int32 numpy array, got {type(pinned).__name__}"
            )
        if not self._enabled:
            num_full = 0
        if num_full < 0 or num_full > length:
            raise InvalidId(f"cache_and_release: num_full {num_full} is outside [0, {length}]")
        if num_full * self._block_size > num_tokens:
            raise InvalidId(
                f"insert: {num_full} blocks need {num_full * self._block_size} tokens but only {num_tokens} were given"
            )
        if num_known > num_full:
            raise InvalidId(f"insert: a known prefix of {num_known} nodes is longer than the {num_full} blocks")
        outcome.failure = FAIL_NONE
        result.failed_at = -1
        path = <int32_t *>realloc(NULL, (num_full + 1) * sizeof(int32_t))
        if path == NULL:
            raise MemoryError("cache_and_release: cannot allocate the path")
        with nogil:
            _lock_both(self)
            # Unpin first (nothing can evict while both locks are held); each later step that
            # fails undoes the earlier ones exactly, re-pinning last.
            outcome = self._trie._unpin_locked(known, num_known)
            if outcome.failure == FAIL_NONE:
                step = 1
                self._pool._inc_ref_locked(table, num_full, &result)
            if step == 1 and result.failed_at < 0:
                step = 2
                released = self._pool._dec_ref_locked(table, length, &result)
                if result.failed_at >= 0:
                    self._pool._dec_ref_locked(table, num_full, &ignored)
            if step == 2 and result.failed_at < 0:
                step = 3
                if num_full:
                    failed = self._trie._insert_locked(
                        key, token_data, table, num_full, known, num_known, path, &k, &bad_known
                    )
                if failed or bad_known >= 0:
                    _undo_dec_ref(self._pool, table, length, released)
                    self._pool._dec_ref_locked(table, num_full, &ignored)
                else:
                    step = 4
                    freed = released + self._pool._dec_ref_locked(table, k, &ignored)
            if 1 <= step < 4:
                self._trie._pin_locked(known, num_known)
            _unlock_both(self)
        free(path)
        if outcome.failure != FAIL_NONE:
            self._trie._raise_failed(outcome, "unpin")
        if result.failed_at >= 0:
            self._pool._raise_refused(&result, "inc_ref" if step == 1 else "dec_ref")
        if failed:
            raise MemoryError(f"insert: cannot grow the trie by {num_full} nodes")
        if bad_known >= 0:
            raise InvalidId(
                f"insert: known prefix entry {bad_known} (node id {known[bad_known]}) is not the cached "
                "node of that block on this path"
            )
        return num_full - k, freed

    def clear(self):
        """Drop every cached block (pinned ones too: teardown only); return how many became free."""
        dropped = self._trie.clear()
        self._blocks_evicted += len(dropped)
        return self._pool.dec_ref(dropped) if len(dropped) else 0
