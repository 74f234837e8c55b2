# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The KV cache core's calls off the request path (module lifecycle._coreviews).

``KVCacheCore`` keeps these methods (their signatures and docstrings are there) and hands each
one to the function of the same name here: its SSM snapshot points, content hashes without a
record, its counters, memory and per-group figures, unpinning a prefix, close and reset, the event
log switched and drained, eviction by block id and by group, and the invariant check. They work on the core
through ``lifecycle/_kvcache.pxd``: its ``readonly`` parts and settings, the request path's own
locked steps, and its inline setters and counts for what they change in it.
"""

cimport numpy as cnp
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint8_t, uint64_t

from lifecycle._args cimport ssize_arg as _as_count
from lifecycle._evlog cimport EvLog
from lifecycle._groups cimport KIND_FULL, KVGroups, group_index, one_group_stats
from lifecycle._hash cimport lc_content_hashes, lc_root_hash
from lifecycle._int32 cimport (
    adapter_key as _adapter_key, block_ids, first_negative as _first_negative, token_vector as _token_vector,
)
from lifecycle._kvcache cimport LONG_CALL, Counters
from lifecycle._radix cimport Chunk, RNode, RadixTrie, WalkEnd, chunk_column
from lifecycle._records cimport E_CLOSED, E_NO_MEMORY, E_NOT_CACHED, Failure, SeqRec, handle_arg as _handle_arg, ok
from lifecycle._sync cimport PyThreadState

import numpy as np

from lifecycle.errors import InvalidId, InvariantViolation, OutOfBlocks, SequenceStateError, TornDown

cnp.import_array()


cdef snapshot_point(KVCacheCore core, handle, num_blocks, bint rolling):
    cdef int64_t h = _handle_arg(handle, "snapshot_point")
    cdef Py_ssize_t full = _as_count(num_blocks, "num_blocks", 1, core._max_blocks_per_seq)
    cdef int32_t sid = -1
    cdef bint fresh = False
    cdef Failure f
    if core._grouped:
        core._refuse_grouped("save_snapshot")
    ok(&f)
    cdef PyThreadState *released = core._lock.enter(LONG_CALL)
    sid = snapshot_locked(core, h, full, rolling, &fresh, &f)
    core._lock.leave(released)
    core._records.raise_failure(&f, "save_snapshot")
    return sid, fresh


cdef int32_t snapshot_locked(
    KVCacheCore core, int64_t handle, Py_ssize_t full, bint rolling, bint *fresh, Failure *f
) noexcept nogil:
    cdef SeqRec *rec = core._records.get(handle, f)
    cdef Py_ssize_t taken
    cdef int32_t end, sid, previous
    cdef RNode *node
    if rec == NULL:
        return -1
    if full > rec.num_blocks or full * core._block_size > rec.num_tokens:
        f.code = E_NOT_CACHED
        f.value = full
        f.limit = min(<Py_ssize_t>rec.num_tokens // core._block_size, <Py_ssize_t>rec.num_blocks)
        return -1
    if not core._enabled or rec.failed or core._snaps.num == 0:
        return -1
    previous = core._snaps.rolling_of(rec)
    if rolling and previous >= 0:
        node = &core._trie._nodes[core._snaps.node_of(previous)]
        if node.depth + node.length != full:
            core._snaps.drop(previous)
            rec.rolling = -1
            previous = -1
    end = core._cache_locked(rec, full, &taken, f)
    if end < 0:
        return -1
    sid = core._snaps.tag(end, fresh)
    if sid < 0 or not fresh[0]:
        if sid >= 0 and not (rolling and previous == sid):
            rec.rolling = -1
        return sid
    core.count_snapshot_saved()
    rec.rolling = sid if rolling else -1
    rec.rolling_generation = core._snaps.generation_of(sid)
    return sid


cdef drop_snapshot(KVCacheCore core, snapshot_id):
    cdef int32_t sid = <int32_t>_as_count(snapshot_id, "snapshot_id", 0, max(core._snaps.num - 1, 0))
    cdef Failure f
    ok(&f)
    cdef PyThreadState *released = core._lock.enter(LONG_CALL)
    if core._records.closed:
        f.code = E_CLOSED
    elif sid < core._snaps.num and core._snaps.node_of(sid) >= 0:
        core._snaps.drop(sid)
    core._lock.leave(released)
    core._records.raise_failure(&f, "drop_snapshot")


cdef prefix_snapshot(KVCacheCore core, handle):
    cdef int64_t h = _handle_arg(handle, "prefix_snapshot")
    cdef int32_t sid = -1
    cdef Failure f
    cdef SeqRec *rec
    ok(&f)
    cdef PyThreadState *released = core._lock.enter(LONG_CALL)
    rec = core._records.get(h, &f)
    if rec != NULL and rec.pin_node >= 0 and rec.cached_tokens > 0:
        # (a record caching past its reused prefix moved its pin further down)
        sid = core._trie._tag_at(rec.pin_node, rec.cached_tokens // core._block_size)
    core._lock.leave(released)
    core._records.raise_failure(&f, "prefix_snapshot")
    return sid


cdef content_hashes(KVCacheCore core, tokens, adapter):
    cdef const int32_t *data = NULL
    cdef Py_ssize_t n = 0, full
    cdef int64_t key = _adapter_key(adapter)
    cdef Py_ssize_t i
    tokens = _token_vector(tokens, &data, &n)
    for i in range(n):
        if data[i] < 0:
            raise _first_negative(data, n)
    full = n // core._block_size
    cdef cnp.ndarray out = np.empty(full, dtype=np.uint64)
    cdef uint64_t *dest = <uint64_t *>cnp.PyArray_DATA(out)
    if full:
        with nogil:
            lc_content_hashes(lc_root_hash(key), data, full, core._block_size, core._trie._keys, dest)
    return out


cdef cached_prefix_blocks(KVCacheCore core, tokens, adapter):
    cdef const int32_t *data = NULL
    cdef Py_ssize_t n = 0, i, matched = 0
    cdef int64_t key = _adapter_key(adapter)
    cdef int32_t root
    cdef WalkEnd walk
    cdef PyThreadState *released
    tokens = _token_vector(tokens, &data, &n)
    for i in range(n):
        if data[i] < 0:
            raise _first_negative(data, n)
    if not core._enabled or n < core._block_size:
        return 0
    released = core._lock.enter(n)
    if not core._records.closed:
        root = core._trie._find_root(key)
        if root >= 0:
            matched = core._trie._walk(root, data, n // core._block_size, &walk)
    core._lock.leave(released)
    return matched


cdef counters(KVCacheCore core):
    cdef Counters c = core._counters
    if core._grouped:
        # The groups' eviction frees and trims group 0's blocks too.
        c.blocks_freed += core._groups._counts[0].freed
        c.blocks_evicted += core._groups._counts[0].evicted
    return {
        "sequences_allocated": core._records.num_opened,
        "sequences_freed": core._records.num_closed,
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
        "snapshots_evicted": core._snaps.evicted,
        "cache_read_tokens": c.prefix_hit_tokens,
        "cache_write_tokens": c.blocks_cached * core._block_size,
        "time_in_library_ns": core._lock.held_ns(),
    }


cdef unpin_prefix(KVCacheCore core, tokens, adapter):
    cdef Failure f
    cdef PyThreadState *released
    blocks = core._retention.unpin(tokens, _adapter_key(adapter))
    if core._grouped:
        ok(&f)
        released = core._lock.enter(LONG_CALL)
        core._groups.settle_all(core._trie, &f)  # its runs may end where a window group lent blocks
        core._lock.leave(released)
        core._records.raise_failure(&f, "unpin_prefix")
    return blocks


cdef close(KVCacheCore core):
    cdef Py_ssize_t blocks = 0, live, cached
    cdef const int32_t *tags
    core._lock.enter_gil()
    try:
        live = core._records.num_live
        cached = core._trie._num_blocks
        if not core._records.closed:
            blocks = core._records.close_all()
            core._trie._clear()
            core._trie._take_evicted_tags(&tags)  # a closed core hands out no snapshots
    finally:
        core._lock.leave(NULL)
    return live, blocks, cached


cdef memory(KVCacheCore core):
    core._lock.enter_gil()
    try:
        return {"trie": core._trie.nbytes, **core._trie._chunk_bytes(), "records": core._records.nbytes(),
                "cached_blocks": core._trie._num_blocks}
    finally:
        core._lock.leave(NULL)


cdef reset(KVCacheCore core):
    cdef Failure f
    cdef bint done = False
    ok(&f)
    cdef PyThreadState *released = core._lock.enter(LONG_CALL)
    if core._records.closed:
        f.code = E_CLOSED
    elif core._trie._lru_blocks == core._trie._num_blocks:
        core.set_quiet(True)
        if core._grouped:
            core._groups.quiet = True
        core.evict_locked(core._trie._num_blocks + core._pool._num_blocks, &f)
        core.set_quiet(False)
        if core._grouped:
            core._groups.quiet = False
        done = core._trie._num_blocks == 0
        if done and core._evlog.events:
            core._evlog.cleared()
    core._lock.leave(released)
    core._records.raise_failure(&f, "reset")
    return done


cdef set_events(KVCacheCore core, bint events, bint demote, max_pending_tokens):
    cdef bint track = events or demote
    cdef Py_ssize_t cap = _as_count(max_pending_tokens, "max_pending_tokens", 0, PY_SSIZE_T_MAX // 8)
    if core._grouped and demote:
        core._refuse_grouped("set_events(demote=True)")
    core._lock.enter_gil()
    try:
        if track and not core._track and core._trie._hash_all():
            raise MemoryError("set_events: out of host memory for the cached blocks' hashes")
        core.set_track(track)
        core._evlog.configure(events, demote, cap)
        if core._grouped:
            core._groups.log_to(core._evlog if events else None)
    finally:
        core._lock.leave(NULL)


cdef take_events(KVCacheCore core):
    cdef EvLog log
    cdef PyThreadState *released = core._lock.enter(LONG_CALL)
    log = core._evlog.drain()
    core._lock.leave(released)
    return core._evlog.wrap(&log)


cdef evict_blocks(KVCacheCore core, ids):
    if core._grouped:
        core._refuse_grouped("evict_blocks")
    cdef cnp.ndarray wanted = block_ids(ids, core._pool._num_blocks, "evict_blocks")
    cdef const int32_t *data = <const int32_t *>cnp.PyArray_DATA(wanted)
    cdef Py_ssize_t i, n = cnp.PyArray_DIM(wanted, 0), nb = core._pool._num_blocks, count, total = 0
    cdef RadixTrie trie = core._trie
    cdef int32_t top
    cdef Failure f
    ok(&f)
    marked = np.zeros(nb + 1, dtype=np.bool_)
    cdef uint8_t *mark = <uint8_t *>cnp.PyArray_DATA(marked)
    for i in range(n):
        mark[data[i]] = True
    dropped = []
    core._lock.enter_gil()
    try:
        if core._records.closed:
            raise TornDown("evict_blocks: the KV cache core was closed (torn down)")
        for i in trie._marked_nodes(mark):
            # Looked at again: an earlier drop may have taken this node (and a cut reused its slot).
            top = trie._cut_at_mark(<int32_t>i, mark)
            if top == -2:
                raise MemoryError("evict_blocks: out of host memory")
            if top < 0:
                continue
            # Their KV is invalid: logged as removed (hashes only), never demoted.
            if core._reserve_scratch(trie._lru_blocks) or core._reserve_token_scratch(trie._lru_blocks, False):
                raise MemoryError("evict_blocks: out of host memory")
            count = trie._drop_subtree(top, core.scratch(), NULL, core.hash_scratch() if core._track else NULL)
            if count < 0:
                raise MemoryError("evict_blocks: out of host memory")
            if trie._num_evicted_tags:
                core._drain_tags()
            if core._track and count > 0:
                core._evlog.removed(core.scratch(), NULL, core.hash_scratch(), count)
            core.count_evicted(count)
            dropped.append(np.asarray(<int32_t[:count]>core.scratch()).copy() if count else np.empty(0, np.int32))
            core.count_freed(core._pool._dec_ref_locked(core.scratch(), count, &f.batch))
            total += count
            if f.batch.failed_at >= 0:
                raise InvariantViolation(f"evict_blocks: the pool refused a cached block ({f.batch.failed_at})")
    finally:
        core._lock.leave(NULL)
    return np.concatenate(dropped).astype(np.int32) if dropped else np.empty(0, dtype=np.int32)


cdef evict_group(KVCacheCore core, group, num_blocks):
    cdef Py_ssize_t g = group_index(group, core._ngroups(), "evict_group")
    cdef Py_ssize_t n = _as_count(num_blocks, "num_blocks", 0, INT32_MAX)
    cdef Py_ssize_t freed = 0, freed0 = 0, trimmed = 0
    cdef KVGroups groups = core._groups
    cdef Failure f
    ok(&f)
    cdef PyThreadState *released = core._lock.enter(LONG_CALL)
    if core._records.closed:
        f.code = E_CLOSED
    elif g == 0:
        freed = core.evict_locked(n, &f)
    elif groups._rules[g].kind == KIND_FULL:
        freed = groups.evict(core._trie, g, n, &freed0, &trimmed, &f)
    else:
        freed = groups.punch(core._trie, g, n, &freed0, &trimmed, &f)
    core._lock.leave(released)
    core._records.raise_failure(&f, "evict_group")
    return freed


cdef check_invariants(KVCacheCore core):
    core._lock.enter_gil()
    try:
        if core._records.closed:
            # The pool keeps the references the closed core dropped: nothing left to recount.
            raise TornDown("check_invariants: the KV cache core was closed (torn down)")
        problem = core._pool._problem()
        if problem is None:
            problem = core._trie._problem()
            if problem is not None:
                problem = f"RadixTrie: {problem}"
        else:
            problem = f"BlockPool: {problem}"
        if problem is None:
            problem = recount(core)
        if problem is None and core._grouped:
            problem = core._groups.problem(core._trie, core._records, core._null_block)
    finally:
        core._lock.leave(NULL)
    if problem is not None:
        raise InvariantViolation(problem)


cdef str recount(KVCacheCore core):
    cdef Py_ssize_t i, j, nb = core._pool._num_blocks
    cdef RNode *node
    cdef RadixTrie trie = core._trie
    expected = np.zeros(nb + 1, dtype=np.int64)
    cdef int64_t[::1] refs = expected
    pins = {}
    chunk_refs = {}
    problem = core._records.problem(refs, pins, chunk_refs)
    if problem is not None:
        return problem
    core._retention.count_pins(pins)
    if core._null_block >= 0:
        refs[core._null_block] += 1
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
            if node.tag >= core._snaps.num or core._snaps.node_of(node.tag) != i:
                return f"node {i} is tagged with snapshot {node.tag}, which is not kept at it"
    for address, count in chunk_refs.items():
        if (<Chunk *><size_t>address).refs != count:
            return f"a chunk has {(<Chunk *><size_t>address).refs} references but {count} holders"
    if core._grouped and core._groups.shared:
        for i in range(1, core._groups.n):  # every group's ids are this pool's
            problem = core._groups.count_refs(trie, core._records, i, refs, nb)
            if problem is not None:
                return problem
    for i in range(nb):
        if refs[i] != core._pool._refcounts[i]:
            return f"block {i}: refcount {core._pool._refcounts[i]} but sequences and cache hold {refs[i]}"
    problem = core._snaps.problem(tags)
    if problem is not None:
        return problem
    return core._trie._hash_problem() if core._track else None


cdef fail_growth(KVCacheCore core, groups, chunks):
    if core._grouped:
        core._groups.fail_growth(_as_count(groups, "groups", 0, INT32_MAX))
    core._trie._chunk_cache().fail_in = _as_count(chunks, "chunks", 0, INT32_MAX)


cdef group_stats(KVCacheCore core):
    counters = core.counters()
    core._lock.enter_gil()
    try:
        rows = core._groups.stats(core._trie) if core._grouped else one_group_stats(core._pool, core._trie)
    finally:
        core._lock.leave(NULL)
    rows[0].update({key: counters[key] for key in ("blocks_allocated", "blocks_freed", "blocks_evicted")})
    return rows


cdef int allocate_columns(KVCacheCore core, int64_t h, Py_ssize_t wanted, object held, object kv_tokens,
                          str call) except -1:
    """``KVCacheCore.allocate`` of a core of several groups: the positions checked, then every
    group's blocks taken under the lock, all or nothing (each group's free count is checked first)."""
    cdef KVGroups groups = core._groups
    cdef Py_ssize_t n = groups.n, g, i, p, need, short = -1, have = 0, sink, low
    cdef Py_ssize_t kv = _as_count(kv_tokens, f"{call}: kv_tokens", 0, INT32_MAX)
    cdef int32_t *col
    cdef int32_t *ids
    cdef Failure f
    cdef SeqRec *rec
    cdef int64_t seq_id = -1, held_blocks = 0, held_tokens = 0
    if held is None:
        held = [None] * (n - 1)
    if isinstance(held, (str, bytes)) or not hasattr(held, "__len__") or len(held) != n - 1:
        raise InvalidId(f"{call}: held must list the positions of each of the {n - 1} KV cache groups past group 0")
    columns = []
    for g in range(1, n):
        entry = held[g - 1]
        positions = np.arange(wanted, dtype=np.int32) if entry is None else np.asarray(entry)
        if positions.ndim != 1 or (positions.size and positions.dtype.kind not in "iu"):
            raise InvalidId(f"{call}: held[{g - 1}] must be a 1-D array of block positions, got {entry!r}")
        if positions.size and (
            positions[0] < 0 or positions[-1] >= wanted or (positions.size > 1 and (np.diff(positions) <= 0).any())
        ):
            raise InvalidId(
                f"{call}: held[{g - 1}] must hold ascending positions in [0, {wanted}), got {positions.tolist()}"
            )
        # What the group still reads at kv_tokens (its sink blocks and its window or chunk) must be held.
        sink = min(<Py_ssize_t>groups._rules[g].sink_blocks, wanted)
        low = sink
        if groups._rules[g].kind != KIND_FULL:
            low = max(low, groups.first_needed(g, (kv // core._block_size) * core._block_size))
        if np.count_nonzero((positions < sink) | (positions >= low)) != sink + max(wanted - low, 0):
            raise InvalidId(
                f"{call}: held[{g - 1}] lacks blocks KV cache group {g} still reads at kv_tokens={kv}: it needs "
                f"positions [0, {sink}) and [{low}, {wanted}), got {positions.tolist()}"
            )
        columns.append(np.ascontiguousarray(positions, dtype=np.int32))
    ok(&f)
    core._lock.enter_gil()
    rec = core._records.active(h, &f)
    if rec != NULL:
        if rec.num_blocks or rec.num_tokens:
            seq_id, held_blocks, held_tokens = rec.seq_id, rec.num_blocks, rec.num_tokens
        elif core._records.reserve(rec, wanted, 0) or groups._reserve(wanted):
            f.code = E_NO_MEMORY
        else:
            if core._pool._num_free < wanted:
                short, need, have = 0, wanted, core._pool._num_free
            for g in range(1, n):
                need = (<cnp.ndarray>columns[g - 1]).shape[0]
                if short < 0 and groups.num_free(g) < need:
                    short, have = g, groups.num_free(g)
            if short >= 0:
                need = wanted if short == 0 else (<cnp.ndarray>columns[short - 1]).shape[0]
            else:
                # Every pool has room: none of these can fail.
                core._pool._allocate_locked(rec.chunk.blocks, wanted)
                core.count_allocated(wanted)
                for g in range(1, n):
                    ids = <int32_t *>cnp.PyArray_DATA(<cnp.ndarray>columns[g - 1])
                    need = (<cnp.ndarray>columns[g - 1]).shape[0]
                    col = chunk_column(rec.chunk, g)
                    for p in range(wanted):
                        col[p] = -1
                    groups.pool_of(g)._allocate_locked(groups._ids, need)
                    for i in range(need):
                        col[ids[i]] = groups._ids[i]
                    groups._counts[g].allocated += need
                rec.num_blocks = <int32_t>wanted
                rec.kv_tokens = <int32_t>kv
    core._lock.leave(NULL)
    if seq_id >= 0:
        raise SequenceStateError(
            f"{call}: sequence {seq_id} already holds {held_blocks} blocks and {held_tokens} tokens; "
            "it needs a freshly allocated sequence"
        )
    if short >= 0:
        raise OutOfBlocks(
            f"{call}: {need} blocks of KV cache group {short} are needed, {have} are free in that group's pool "
            "(this never evicts: reclaim_prefix_blocks first)"
        )
    core._records.raise_failure(&f, call)
    return 0
