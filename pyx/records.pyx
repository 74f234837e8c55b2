# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The per-request records of a KV cache core (module lifecycle._records).

A record owns a request's token ids and block table (one ``Chunk``), the pin on the cached path it
uses or added, its content hashes once asked for, its adapter slot reference and its status. Python
holds a handle, ``(generation << 32) | record index``: each core starts its generations elsewhere
and every reuse of a record slot bumps its generation, so a stale handle, or another core's, is
refused (short of 2**31 reuses of one slot). ``SequenceState`` is a record's Python face: a
model's sequence reads its record through it.

The ``KVCacheCore`` owns one ``Records`` and changes the records on its request path; the calls
here that take the lock read a record or set one of its fields. Errors of any core call are built
here from its ``Failure`` (``raise_failure``), once the lock is released.
"""

cimport cython
cimport numpy as cnp
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy

from lifecycle._hash cimport lc_content_hashes, lc_copy_tokens_checked, lc_root_hash
from lifecycle._int32 cimport empty_int32 as _empty_int32, first_negative as _first_negative, token_vector
from lifecycle._radix cimport RNode, chunk_column, chunk_decref, chunk_new, chunk_reserve
from lifecycle._sync cimport NOGIL_MIN_WORK, PyThreadState

import enum

import numpy as np

from lifecycle.errors import (
    ForeignSequence, InvalidId, InvariantViolation, OutOfBlocks, SequenceStateError, TornDown, Unsupported,
)

cnp.import_array()

cdef uint32_t GENERATION_MASK = 0x7FFFFFFF
cdef uint32_t _last_generation_base = 0

_STATUS_NAMES = ("freed", "active", "retired")


cdef Records new_records(RadixTrie trie, BlockPool pool, CoreLock lock, Py_ssize_t block_size,
                         Py_ssize_t max_blocks, Py_ssize_t max_tokens):
    """An empty record table whose chunks come from ``trie``'s cache, under ``lock``; a record
    holds at most ``max_blocks`` blocks and ``max_tokens`` tokens."""
    global _last_generation_base
    cdef Records records = Records.__new__(Records)
    _last_generation_base = (_last_generation_base + 0x9E3779B9) & GENERATION_MASK
    records._generation_base = _last_generation_base
    records._free = -1
    records._block_size = block_size
    records._max_blocks = max_blocks
    records._max_tokens = max_tokens
    records.trie = trie
    records.pool = pool
    records.lock = lock
    return records


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


@cython.final
@cython.auto_pickle(False)
@cython.no_gc_clear  # __dealloc__ returns the records' chunks to the trie: a cycle's clear must leave it
cdef class Records:
    """A KV cache core's request records (made by the core; nothing to call from Python)."""

    def __init__(self, *args, **kwargs):
        """Not for callers: a ``KVCacheCore`` makes its own."""
        raise TypeError("Records are made by KVCacheCore")

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._recs != NULL and self.trie is not None:
            for i in range(self._high_water):
                if self._recs[i].status != FREE:
                    chunk_decref(self.trie._chunk_cache(), self._recs[i].chunk)
        free(self._recs)

    # -- (lock held) ----------------------------------------------------------------------------

    cdef int64_t open(self, int64_t adapter, int32_t adapter_slot, Py_ssize_t tokens, Failure *f) noexcept nogil:
        """A new active record under ``adapter`` with room for ``tokens`` tokens; its handle, or
        -1 (``f`` says why)."""
        cdef Py_ssize_t capacity, index
        cdef SeqRec *grown
        cdef SeqRec *rec
        cdef Chunk *chunk
        if self.closed:
            f.code = E_CLOSED
            return -1
        if self._free < 0 and self._high_water == self._capacity:
            capacity = max(<Py_ssize_t>64, 2 * self._capacity)
            if capacity > INT32_MAX:
                f.code = E_NO_MEMORY
                return -1
            grown = <SeqRec *>realloc(self._recs, capacity * sizeof(SeqRec))
            if grown == NULL:
                f.code = E_NO_MEMORY
                return -1
            self._recs = grown
            self._capacity = capacity
        chunk = chunk_new(self.trie._chunk_cache(), blocks_for(tokens, self._block_size) + 1, tokens)
        if chunk == NULL:
            f.code = E_NO_MEMORY
            return -1
        if self._free >= 0:
            index = self._free
            self._free = self._recs[index].next_free
        else:
            index = self._high_water
            self._high_water += 1
            self._recs[index].generation = self._generation_base
        rec = &self._recs[index]
        # 31 bits, so that a handle is never negative; never 0.
        rec.generation = (rec.generation + 1) & GENERATION_MASK
        if rec.generation == 0:
            rec.generation = 1
        rec.chunk = chunk
        rec.adapter = adapter
        rec.adapter_slot = adapter_slot
        rec.seq_id = self.next_seq_id
        self.next_seq_id += 1
        rec.num_tokens = 0
        rec.prompt_len = 0
        rec.num_blocks = 0
        rec.cached_tokens = 0
        rec.lazy_tokens = 0
        rec.pin_node = -1
        rec.pin_blocks = 0
        rec.ssm_tokens = -1
        rec.kv_tokens = 0
        rec.rolling = -1
        rec.rolling_generation = 0
        rec.status = ACTIVE
        rec.failed = 0
        rec.step_stamp = 0
        rec.next_free = -1
        self.num_live += 1
        self.num_opened += 1
        return (<int64_t>rec.generation << 32) | index

    cdef void close(self, SeqRec *rec) noexcept nogil:
        """Free the record's slot and its chunk (its pin and block references are released)."""
        cdef Py_ssize_t index = rec - self._recs
        chunk_decref(self.trie._chunk_cache(), rec.chunk)
        rec.chunk = NULL
        rec.status = FREE
        rec.next_free = self._free
        self._free = <int32_t>index
        self.num_live -= 1
        self.num_closed += 1

    cdef void withdraw(self) noexcept nogil:
        """Uncount the record just opened and closed within one refused call: nothing was admitted."""
        self.num_opened -= 1
        self.num_closed -= 1
        self.next_seq_id -= 1

    cdef Py_ssize_t close_all(self) noexcept nogil:
        """Close every record and refuse every later call (the core's close); the blocks they held."""
        cdef Py_ssize_t i, blocks = 0
        for i in range(self._high_water):
            if self._recs[i].status != FREE:
                blocks += self._recs[i].num_blocks
                self.close(&self._recs[i])
        self.closed = True
        return blocks

    cdef Chunk *unshared(self, SeqRec *rec, Failure *f) noexcept nogil:
        """The fresh chunk ``clear_record`` moves the record to when trie nodes hold runs of its
        chunk (its next tokens and blocks must not be written over them), else NULL; with
        ``f`` set when out of memory."""
        cdef Chunk *fresh = NULL
        if rec.chunk.refs > 1:
            fresh = chunk_new(self.trie._chunk_cache(), rec.chunk.block_capacity, rec.chunk.token_capacity)
            if fresh == NULL:
                f.code = E_NO_MEMORY
        return fresh

    cdef Py_ssize_t clear_record(self, SeqRec *rec, Chunk *fresh, Failure *f) noexcept nogil:
        """Take a record back to how ``open`` left it (keeping its adapter): its pin, group 0's
        block references and tokens go, its chunk becomes ``fresh`` (``unshared``) unless NULL;
        how many blocks became free."""
        cdef Py_ssize_t freed
        if rec.pin_node >= 0:
            self.trie._unpin(rec.pin_node)
        freed = self.pool._dec_ref_locked(rec.chunk.blocks, rec.num_blocks, &f.batch)
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
        rec.kv_tokens = 0
        if fresh != NULL:
            chunk_decref(self.trie._chunk_cache(), rec.chunk)
            rec.chunk = fresh
        else:
            rec.chunk.num_hashed = 0  # the hashes were those of the old tokens
        return freed

    cdef int reserve(self, SeqRec *rec, Py_ssize_t blocks, Py_ssize_t tokens) noexcept nogil:
        """Room in the record's chunk; 1 when out of memory. A chunk trie nodes hold too never
        moves: the record moves to a bigger copy instead."""
        cdef Chunk *old = rec.chunk
        cdef Chunk *chunk
        cdef ChunkCache *chunks = self.trie._chunk_cache()
        cdef Py_ssize_t g
        if blocks <= old.block_capacity and tokens <= old.token_capacity:
            return 0
        if old.refs == 1:
            return chunk_reserve(chunks, old, blocks, tokens)
        chunk = chunk_new(
            chunks,
            max(blocks, 2 * <Py_ssize_t>old.block_capacity),
            max(tokens, 2 * <Py_ssize_t>old.token_capacity),
        )
        if chunk == NULL:
            return 1
        memcpy(
            chunk.tokens + rec.lazy_tokens, old.tokens + rec.lazy_tokens,
            (rec.num_tokens - rec.lazy_tokens) * sizeof(int32_t),
        )
        for g in range(chunks.num_groups):  # every KV cache group's column
            memcpy(chunk_column(chunk, g), chunk_column(old, g), rec.num_blocks * sizeof(int32_t))
        if old.num_hashed:
            chunk.hashes = <uint64_t *>malloc(chunk.block_capacity * sizeof(uint64_t))
            if chunk.hashes == NULL:
                chunk_decref(chunks, chunk)
                return 1
            memcpy(chunk.hashes, old.hashes, old.num_hashed * sizeof(uint64_t))
            chunk.num_hashed = old.num_hashed
        rec.chunk = chunk
        chunk_decref(chunks, old)
        return 0

    cdef void append_locked(self, int64_t handle, const int32_t *data, Py_ssize_t n, Failure *f) noexcept nogil:
        """Record ``n`` tokens after the record's own (within the per-sequence limit)."""
        cdef SeqRec *rec = self.get(handle, f)
        cdef Py_ssize_t total
        if rec == NULL:
            return
        total = rec.num_tokens + n
        if total > self._max_tokens:
            f.code = E_TOO_LONG
            f.value = total
            f.limit = self._max_tokens
            return
        if self.reserve(rec, 0, total):
            f.code = E_NO_MEMORY
            return
        if lc_copy_tokens_checked(rec.chunk.tokens + rec.num_tokens, data, n):
            f.code = E_NEGATIVE_TOKEN
            return
        rec.num_tokens = <int32_t>total

    cdef Py_ssize_t check_step(
        self, const int64_t *hs, Py_ssize_t n, const int32_t *tok, Py_ssize_t num_tok, const int32_t *cnt,
        const int32_t *row_of, Py_ssize_t nrows, Py_ssize_t ncols, Failure *f
    ) noexcept nogil:
        """(Lock held) the index of the first request a decode step (``KVCacheCore.step``) refuses
        as bad input, or -1: every handle active and listed once, counts within the limits of its
        record and of a table of ``ncols`` columns (-1: none), rows in ``[0, nrows)``, tokens >= 0."""
        cdef Py_ssize_t i, added, blocks
        cdef SeqRec *rec
        self._step_stamp += 1
        if self._step_stamp == 0:
            self._step_stamp = 1  # 0 is a fresh record's
        for i in range(n):
            rec = self.active(hs[i], f)
            if rec == NULL:
                return i
            added = cnt[i] if cnt != NULL else 1
            if added < 0:
                f.code = E_INVALID_ARG
                f.value = added
                f.limit = self._max_tokens
                return i
            if rec.num_tokens + added > self._max_tokens:
                f.code = E_TOO_LONG
                f.value = rec.num_tokens + added
                f.limit = self._max_tokens
                return i
            blocks = blocks_for(rec.num_tokens + added, self._block_size)
            if blocks > self._max_blocks or (ncols >= 0 and blocks > ncols):
                f.code = E_TOO_LONG
                f.value = blocks
                f.limit = min(self._max_blocks, ncols) if ncols >= 0 else self._max_blocks
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

    cdef str problem(self, int64_t[::1] refs, dict pins, dict chunk_refs):
        """(Lock held) the first inconsistency of the records (their chunks, pins and counters),
        or None; adds one to ``refs[block]`` for every block a table holds, to ``pins[node]`` for
        every record pinning ``node`` and to ``chunk_refs[chunk address]`` per record."""
        cdef Py_ssize_t i, j, nb = self.pool._num_blocks, live = 0
        cdef SeqRec *rec
        cdef RNode *node
        for i in range(self._high_water):
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
                if rec.pin_node >= self.trie._high_water or self.trie._nodes[rec.pin_node].parent < 0:
                    return f"sequence {rec.seq_id} pins node {rec.pin_node}, which is not a cached node"
                node = &self.trie._nodes[rec.pin_node]
                if node.depth + node.length != rec.pin_blocks:
                    return (
                        f"sequence {rec.seq_id} pins node {rec.pin_node} ending at block "
                        f"{node.depth + node.length}, not {rec.pin_blocks}"
                    )
                pins[rec.pin_node] = pins.get(rec.pin_node, 0) + 1
            elif rec.pin_blocks != 0:
                return f"sequence {rec.seq_id} pins {rec.pin_blocks} blocks without a node"
        if live != self.num_live:
            return f"{live} live sequences, the counter says {self.num_live}"
        return None

    # -- errors (GIL held, lock released) ---------------------------------------------------------

    cdef int raise_failure(self, Failure *f, str call, object tokens=None) except -1:
        """Raise what ``call`` raises for ``f`` (nothing for OK); ``tokens``: the call's int32
        token array, to name a negative one."""
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
        if code == E_OUT_OF_BLOCKS and f.group > 0:
            raise OutOfBlocks(
                f"{call}: need {f.value} blocks of KV cache group {f.group}, {f.limit} free in that group's pool "
                "after evicting every evictable cached block"
                + (
                    f"; {f.pinned} of its blocks are held only by cached prefixes a retention pin protects "
                    "(pin_prefix; unpin_prefix lets them go)"
                    if f.pinned > 0 else ""
                )
            )
        if code == E_GROUPS:
            raise Unsupported(f"{call}: not offered by a KV cache core with several KV cache groups")
        if code == E_OUT_OF_BLOCKS:
            raise OutOfBlocks(
                f"{call}: need {f.value} blocks, {f.limit} free of {self.pool._num_blocks} after evicting "
                "every evictable cached block"
            )
        if code == E_NO_MEMORY:
            raise MemoryError(f"{call}: out of host memory for the cache's tables")
        if code == E_REFUSED:
            self.pool._raise_refused(&f.batch, "inc_ref")
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

    # -- reading and setting a record (GIL held; each takes the lock) ------------------------------

    cdef SeqRec *read(self, int64_t handle, str call) except NULL:
        """(Lock held, by ``enter_gil``) the record for a read with the GIL held; raises for a
        stale handle."""
        cdef Failure f
        cdef SeqRec *rec
        ok(&f)
        rec = self.get(handle, &f)
        if rec == NULL:
            self.raise_failure(&f, call)
        return rec

    cdef object tokens(self, int64_t handle):
        cdef cnp.ndarray out
        cdef SeqRec *rec
        self.lock.enter_gil()
        try:
            rec = self.read(handle, "tokens")
            self.materialize(rec)
            out = _empty_int32(rec.num_tokens)
            memcpy(cnp.PyArray_DATA(out), rec.chunk.tokens, rec.num_tokens * sizeof(int32_t))
        finally:
            self.lock.leave(NULL)
        return out

    cdef object block_table(self, int64_t handle):
        cdef cnp.ndarray out
        cdef SeqRec *rec
        self.lock.enter_gil()
        try:
            rec = self.read(handle, "block_table")
            out = _empty_int32(rec.num_blocks)
            memcpy(cnp.PyArray_DATA(out), rec.chunk.blocks, rec.num_blocks * sizeof(int32_t))
        finally:
            self.lock.leave(NULL)
        return out

    cdef object block_hashes(self, int64_t handle):
        cdef cnp.ndarray out
        cdef SeqRec *rec
        cdef Chunk *chunk
        cdef Py_ssize_t full, done
        cdef uint64_t parent
        cdef cnp.npy_intp dim
        self.lock.enter_gil()
        try:
            rec = self.read(handle, "block_hashes")
            self.materialize(rec)
            chunk = rec.chunk
            full = rec.num_tokens // self._block_size
            if full > chunk.block_capacity and self.reserve(rec, full, 0):
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
                                      self._block_size, self.trie._keys, chunk.hashes + done)
                chunk.num_hashed = <int32_t>full
            dim = full
            out = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT64, 0)
            if full:
                memcpy(cnp.PyArray_DATA(out), chunk.hashes, full * sizeof(uint64_t))
        finally:
            self.lock.leave(NULL)
        return out

    cdef tuple info(self, int64_t handle):
        cdef SeqRec *rec
        self.lock.enter_gil()
        try:
            rec = self.read(handle, "info")
            return (rec.seq_id, rec.status, rec.num_tokens, rec.prompt_len, rec.num_blocks, rec.cached_tokens,
                    rec.ssm_tokens, bool(rec.failed), rec.adapter_slot)
        finally:
            self.lock.leave(NULL)

    cdef int32_t field(self, int64_t handle, int which) except? -2:
        """Field ``which`` of the record: 0 num_tokens, 1 num_blocks, 2 prompt_len, 3
        cached_tokens, 4 ssm_tokens, 5 failed, 6 status (FREE for a stale handle), 7 adapter_slot."""
        cdef Failure f
        cdef SeqRec *rec
        cdef int32_t value = -1
        ok(&f)
        self.lock.enter_gil()
        rec = self.get(handle, &f)
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
        self.lock.leave(NULL)
        if rec == NULL:
            if which == 6 and f.code == E_HANDLE:
                return FREE
            self.raise_failure(&f, "sequence")
        return value

    cdef int set_field(self, int64_t handle, int which, int64_t value, str call) except -1:
        """Set field ``which``: 0 prompt_len, 1 ssm_tokens (-1: as many as its tokens), 2 failed,
        3 retired (status), 4 adapter_slot, 5 the adapter key."""
        cdef SeqRec *rec
        self.lock.enter_gil()
        try:
            rec = self.read(handle, call)
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
            self.lock.leave(NULL)
        return 0

    cdef int64_t open_record(self, int64_t key, int32_t slot, Py_ssize_t tokens, int64_t *seq_id) except -1:
        """``open`` (the lock taken here): a new record's handle, its sequence id in ``seq_id``."""
        cdef Failure f
        cdef int64_t handle
        cdef PyThreadState *released
        ok(&f)
        tokens = max(tokens, self._block_size)
        released = self.lock.enter(0)
        handle = self.open(key, slot, tokens, &f)
        if handle >= 0:
            seq_id[0] = self.of(handle).seq_id
        self.lock.leave(released)
        if handle < 0:
            self.raise_failure(&f, "open")
        return handle

    cdef int bind(self, int64_t handle, str call, int32_t adapter_slot, int64_t key) except -1:
        """Match and cache a record that has no blocks or tokens yet under ``key``, and, unless
        ``adapter_slot`` is -1, record the adapter slot reference it holds (it must hold none)."""
        cdef SeqRec *rec
        self.lock.enter_gil()
        try:
            rec = self.read(handle, call)
            if rec.status != ACTIVE:
                raise SequenceStateError(
                    f"{call}: sequence {rec.seq_id} is {_STATUS_NAMES[rec.status]}, not active"
                )
            if adapter_slot >= 0 and rec.adapter_slot >= 0:
                raise SequenceStateError(
                    f"{call}: sequence {rec.seq_id} already holds adapter slot {rec.adapter_slot}"
                )
            if rec.num_blocks or rec.num_tokens:
                raise SequenceStateError(f"{call}: sequence {rec.seq_id} already has KV blocks or tokens")
            if adapter_slot >= 0:
                rec.adapter_slot = adapter_slot
            rec.adapter = key
        finally:
            self.lock.leave(NULL)
        return 0

    cdef int64_t cache_key(self, int64_t handle) except? -1:
        self.lock.enter_gil()
        try:
            return self.read(handle, "cache_key").adapter
        finally:
            self.lock.leave(NULL)

    cdef object adapter_slots(self):
        cdef Py_ssize_t i, count = 0
        cdef cnp.ndarray out
        cdef int32_t *dest
        self.lock.enter_gil()
        try:
            for i in range(self._high_water):
                if self._recs[i].status != FREE and self._recs[i].adapter_slot >= 0:
                    count += 1
            out = _empty_int32(count)
            dest = <int32_t *>cnp.PyArray_DATA(out)
            count = 0
            for i in range(self._high_water):
                if self._recs[i].status != FREE and self._recs[i].adapter_slot >= 0:
                    dest[count] = self._recs[i].adapter_slot
                    count += 1
        finally:
            self.lock.leave(NULL)
        return out

    cdef tuple live_totals(self):
        cdef Py_ssize_t i, blocks = 0
        cdef PyThreadState *released = self.lock.enter(NOGIL_MIN_WORK)
        for i in range(self._high_water):
            if self._recs[i].status != FREE:
                blocks += self._recs[i].num_blocks
        self.lock.leave(released)
        return self.num_live, blocks

    cdef Py_ssize_t common_prefix(self, const int64_t *hs, Py_ssize_t n) except -1:
        """The leading blocks the ``n`` records of ``hs`` share (the same block ids)."""
        cdef Py_ssize_t i, j, common = 0
        cdef SeqRec *first
        cdef SeqRec *rec
        cdef Failure f
        cdef PyThreadState *released
        ok(&f)
        if n == 0:
            return 0
        released = self.lock.enter(NOGIL_MIN_WORK)
        first = self.get(hs[0], &f)
        if first != NULL:
            common = first.num_blocks
            for i in range(1, n):
                rec = self.get(hs[i], &f)
                if rec == NULL:
                    break
                common = min(common, <Py_ssize_t>rec.num_blocks)
                j = 0
                while j < common and rec.chunk.blocks[j] == first.chunk.blocks[j]:
                    j += 1
                common = j
        self.lock.leave(released)
        self.raise_failure(&f, "num_common_prefix_blocks")
        return common

    cdef Py_ssize_t write_table(self, int64_t handle, int32_t[::1] dest, int32_t pad_id) except -1:
        """The record's block ids into ``dest``, the rest of it filled with ``pad_id`` unless -1;
        how many ids it wrote before the padding."""
        cdef Py_ssize_t n = 0, size = dest.shape[0], i
        cdef SeqRec *rec
        cdef Failure f
        cdef PyThreadState *released
        ok(&f)
        released = self.lock.enter(NOGIL_MIN_WORK)
        rec = self.get(handle, &f)
        if rec != NULL:
            n = rec.num_blocks
            if n > size:
                f.code = E_TOO_LONG
                f.value = n
                f.limit = size
            else:
                if n:
                    memcpy(&dest[0], rec.chunk.blocks, n * sizeof(int32_t))
                if pad_id >= 0:
                    for i in range(n, size):
                        dest[i] = pad_id
        self.lock.leave(released)
        if f.code == E_TOO_LONG:
            raise InvalidId(f"write_table: the sequence holds {f.value} blocks, the buffer takes {f.limit}")
        self.raise_failure(&f, "write_table")
        return n

    cdef Py_ssize_t allocate(self, int64_t handle, Py_ssize_t wanted, str call) except -1:
        """Give a fresh record (no blocks, no tokens) exactly ``wanted`` free blocks, never
        evicting; ``OutOfBlocks`` when too few are free. Returns ``wanted``."""
        cdef Failure f
        cdef SeqRec *rec
        cdef int64_t seq_id = -1, held_blocks = 0, held_tokens = 0
        cdef PyThreadState *released
        ok(&f)
        released = self.lock.enter(NOGIL_MIN_WORK)
        rec = self.active(handle, &f)
        if rec != NULL:
            if rec.num_blocks or rec.num_tokens:
                seq_id, held_blocks, held_tokens = rec.seq_id, rec.num_blocks, rec.num_tokens
            elif self.reserve(rec, wanted, 0):
                f.code = E_NO_MEMORY
            elif not self.pool._allocate_locked(rec.chunk.blocks, wanted):
                f.code = E_OUT_OF_BLOCKS
                f.value = wanted
                f.limit = self.pool._num_free
            else:
                rec.num_blocks = <int32_t>wanted
        self.lock.leave(released)
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
        self.raise_failure(&f, call)
        return wanted

    cdef SequenceState face(self, object seq):
        """``seq`` as a sequence of these records; ``ForeignSequence`` for anything else."""
        if type(seq) is not SequenceState:
            raise ForeignSequence(f"expected a SequenceState, got {type(seq).__name__}")
        if (<SequenceState>seq).handle_in(self) < 0:
            raise ForeignSequence(f"sequence {(<SequenceState>seq).seq_id} belongs to another model")
        return <SequenceState>seq

    cdef int64_t open_handle(self, object seq, str call) except -1:
        """The handle of ``seq``, refused for a freed sequence as ``call``'s error."""
        cdef SequenceState face = self.face(seq)
        if not face._open:
            raise SequenceStateError(f"{call}: sequence {face.seq_id} is freed, not active")
        return face._handle

    cdef Py_ssize_t blocks_for_tokens(self, int64_t h, object num_tokens, str call) except -1:
        """Blocks covering ``num_tokens`` tokens (an int >= 0) within the per-sequence limit; a
        record that is not active is refused for that first."""
        cdef int overflow = 0
        cdef long long n = -1
        cdef Py_ssize_t limit = self._max_blocks
        if PyLong_CheckExact(num_tokens):
            n = PyLong_AsLongLongAndOverflow(num_tokens, &overflow)
            if not overflow and 0 <= n <= <long long>limit * self._block_size:
                return <Py_ssize_t>((n + self._block_size - 1) // self._block_size)
        if self.field(h, 6) != ACTIVE:
            status = _STATUS_NAMES[self.field(h, 6)]
            raise SequenceStateError(f"{call}: sequence {self.seq_id_of(h)} is {status}, not active")
        if isinstance(num_tokens, int) and not isinstance(num_tokens, bool) and num_tokens >= 0:
            wanted = -(-num_tokens // self._block_size)
            raise InvalidId(f"{call}: {num_tokens} tokens need {wanted} blocks, over the per-sequence limit of {limit}")
        raise InvalidId(f"{call}: num_tokens={num_tokens!r} must be an int >= 0")

    cdef int64_t seq_id_of(self, int64_t handle):
        """The record's sequence id, -1 for a stale handle."""
        cdef Failure f
        cdef SeqRec *rec
        cdef int64_t seq_id = -1
        cdef PyThreadState *released
        ok(&f)
        released = self.lock.enter(0)
        rec = self.get(handle, &f)
        if rec != NULL:
            seq_id = rec.seq_id
        self.lock.leave(released)
        return seq_id

    cdef int append(self, int64_t handle, object tokens) except -1:
        """Record tokens whose KV the engine computed (prompt first, then generated ones)."""
        cdef const int32_t *data = NULL
        cdef Py_ssize_t n = 0
        cdef Failure f
        cdef PyThreadState *released
        tokens = token_vector(tokens, &data, &n)
        ok(&f)
        released = self.lock.enter(n)
        self.append_locked(handle, data, n, &f)
        self.lock.leave(released)
        if f.code != OK:
            self.raise_failure(&f, "append_tokens", tokens)
        return 0

    cdef bint is_live(self, int64_t handle) noexcept:
        cdef Failure f
        cdef bint live
        cdef PyThreadState *released
        ok(&f)
        released = self.lock.enter(0)
        live = self.get(handle, &f) != NULL
        self.lock.leave(released)
        return live


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


cdef SequenceState new_sequence(Records records, object core, int64_t handle, int64_t seq_id, SlotGuard guard,
                                object addrs_by_slot, Py_ssize_t budget_tokens, object drop_queue):
    """The face of record ``handle`` of ``records`` (``core``'s), holding the guard of its SSM slot."""
    cdef SequenceState seq = SequenceState.__new__(SequenceState)
    seq._records = records
    seq._core = core
    seq._handle = handle
    seq.seq_id = seq_id
    seq._guard = guard
    seq._addrs_by_slot = addrs_by_slot
    seq.budget_tokens = budget_tokens
    seq._drop_queue = drop_queue
    seq._open = True
    return seq


@cython.final
@cython.no_gc_clear  # a face collected in a cycle must still queue its handle
@cython.auto_pickle(False)
cdef class SequenceState:
    """One sequence's memory, as handed out by ``alloc_sequence``. Not constructed directly.

    Its state (tokens, block table, pinned prefix, content hashes, adapter reference, status)
    lives in the model's KV cache core, its SSM slot in the slot pool through its guard: this
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

    cdef object close(self):
        """The model released the sequence: it answers as freed from here on. Returns the guard of
        its slot (None if detached), for the caller to let go."""
        guard, self._guard = self._guard, None
        self._open = False
        return guard

    @property
    def handle(self):
        """The handle of the sequence's record in the core (for batched calls such as
        ``HybridModel.step``); refused by the core once the sequence is freed."""
        return self._handle

    @property
    def is_open(self):
        """Whether the model has not released the sequence yet (cheaper than ``is_freed``: no
        call into the core)."""
        return self._open

    @property
    def guard(self):
        """The guard of the sequence's SSM slot, or None once detached or freed."""
        return self._guard

    def rebind_guard(self, SlotGuard guard not None):
        """Hold ``guard`` (of the slot the sequence's SSM state moved to) instead of its current
        guard, which is returned for the caller to release."""
        old, self._guard = self._guard, guard
        return old

    def detach_guard(self):
        """Give up the guard of the sequence's slot (the sequence is detached); returns it, or
        None if there was none."""
        guard, self._guard = self._guard, None
        return guard

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
        return self._records.block_table(self._handle) if self._open else _NO_IDS.copy()

    @property
    def num_blocks(self):
        return self._records.field(self._handle, 1) if self._open else 0

    @property
    def tokens(self):
        """Prompt and generated tokens so far (a copy; empty once freed)."""
        return self._records.tokens(self._handle) if self._open else _NO_IDS.copy()

    @property
    def num_tokens(self):
        return self._records.field(self._handle, 0) if self._open else 0

    def block_hashes(self):
        """Content hashes of the sequence's full blocks (docs/content-hashes.md): the same on every
        process and machine for the same tokens and adapter, computed once per block."""
        return self._records.block_hashes(self._handle) if self._open else _NO_HASHES.copy()

    @property
    def prompt_len(self):
        """Tokens of the prompt (the rest of ``tokens`` was generated)."""
        return self._records.field(self._handle, 2) if self._open else 0

    @prompt_len.setter
    def prompt_len(self, value):
        self._core.set_prompt_len(self._handle, value)

    @property
    def num_cached_tokens(self):
        """Prompt tokens whose KV came from the prefix cache."""
        return self._records.field(self._handle, 3) if self._open else 0

    @property
    def ssm_tokens(self):
        """How many tokens the SSM state in the slot has consumed (set by the engine; None means
        ``num_tokens``). A snapshot is only taken where this falls on a block boundary."""
        cdef int32_t value = self._records.field(self._handle, 4) if self._open else -1
        return None if value < 0 else value

    @ssm_tokens.setter
    def ssm_tokens(self, value):
        self._core.set_ssm_tokens(self._handle, value)

    @property
    def adapter_slot(self):
        """The LoRA adapter slot this sequence holds a reference on, or ``NO_ADAPTER`` (-1)."""
        return self._records.field(self._handle, 7) if self._open else -1

    @property
    def status(self):
        return _SEQ_STATUS[self._records.field(self._handle, 6)] if self._open else SeqStatus.FREED

    @property
    def is_detached(self):
        return self.slot_idx == -1

    @property
    def is_freed(self):
        return self.status is SeqStatus.FREED

    @property
    def failed(self):
        return bool(self._records.field(self._handle, 5)) if self._open else False

    def mark_failed(self):
        """Mark the sequence failed: its KV is not trusted, so it is never inserted in the cache."""
        self._core.mark_failed(self._handle)

    def append_tokens(self, tokens):
        """Record tokens whose KV the engine has computed (prompt first, then generated ones).
        Token ids are integers in [0, 2**31); anything else is refused with nothing recorded."""
        if not isinstance(tokens, (cnp.ndarray, list, tuple)):
            tokens = list(tokens)
        if self._grouped:
            self._core.append(self._handle, tokens)  # the windowed groups release what left the window
        else:
            self._records.append(self._handle, tokens)
