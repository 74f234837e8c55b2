# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The SSM snapshot ids of a KV cache core (module lifecycle._snapids).

A hybrid model keeps SSM state snapshots at block boundaries of cached prefixes; the core hands out
ids for them, ``num`` at most. An id is kept at the trie node ending its prefix (the node's tag
names it) until the node is trimmed or dropped, the caller drops it, or it is the least recently
used one when a new snapshot needs an id: its node then keeps its KV and loses the snapshot.
"""

cimport cython
from libc.stdlib cimport free, malloc


cdef SnapshotIds new_snapshot_ids(int32_t num, RadixTrie trie):
    """``num`` free ids, to be kept at nodes of ``trie``."""
    cdef SnapshotIds ids = SnapshotIds.__new__(SnapshotIds)
    cdef Py_ssize_t i
    ids.num = num
    ids._trie = trie
    ids._head = -1
    ids._tail = -1
    ids._free = -1
    ids._node = <int32_t *>malloc((num + 1) * sizeof(int32_t))
    ids._generation = <uint32_t *>malloc((num + 1) * sizeof(uint32_t))
    ids._prev = <int32_t *>malloc((num + 1) * sizeof(int32_t))
    ids._next = <int32_t *>malloc((num + 1) * sizeof(int32_t))
    if ids._node == NULL or ids._generation == NULL or ids._prev == NULL or ids._next == NULL:
        raise MemoryError(f"KVCacheCore: cannot allocate tables for {num} snapshots")
    for i in range(num - 1, -1, -1):
        ids._node[i] = -1
        ids._generation[i] = 0
        ids._prev[i] = -1
        ids._next[i] = ids._free
        ids._free = <int32_t>i
    return ids


@cython.final
@cython.auto_pickle(False)
cdef class SnapshotIds:
    """A KV cache core's SSM snapshot ids (made by the core; nothing to call from Python)."""

    def __init__(self, *args, **kwargs):
        """Not for callers: a ``KVCacheCore`` makes its own."""
        raise TypeError("SnapshotIds are made by KVCacheCore")

    def __dealloc__(self):
        free(self._node)
        free(self._generation)
        free(self._prev)
        free(self._next)

    # -- (lock held) --

    cdef void _unlink(self, int32_t sid) noexcept nogil:
        cdef int32_t prev = self._prev[sid], after = self._next[sid]
        if prev >= 0:
            self._next[prev] = after
        else:
            self._head = after
        if after >= 0:
            self._prev[after] = prev
        else:
            self._tail = prev

    cdef void _append(self, int32_t sid) noexcept nogil:
        self._prev[sid] = self._tail
        self._next[sid] = -1
        if self._tail >= 0:
            self._next[self._tail] = sid
        else:
            self._head = sid
        self._tail = sid

    cdef void touch(self, int32_t sid) noexcept nogil:
        """``sid`` was used: the most recently used now."""
        self._unlink(sid)
        self._append(sid)

    cdef void release(self, int32_t sid) noexcept nogil:
        """Free ``sid``, whose node lost its tag (already cleared there)."""
        self._unlink(sid)
        self._node[sid] = -1
        self._next[sid] = self._free
        self._free = sid
        self.used -= 1
        self.evicted += 1

    cdef int32_t take(self, int32_t *victim) noexcept nogil:
        """An id for a new snapshot: a free one, else the least recently used one, whose node
        ``victim`` gets (-1 otherwise): the caller clears its tag. -1 when there are none at all."""
        cdef int32_t sid = self._free
        victim[0] = -1
        if sid >= 0:
            self._free = self._next[sid]
        else:
            sid = self._head
            if sid < 0:
                return -1
            victim[0] = self._node[sid]
            self._unlink(sid)
            self.used -= 1
            self.evicted += 1
        self._generation[sid] += 1
        self.used += 1
        self._append(sid)
        return sid

    cdef int32_t rolling_of(self, SeqRec *rec) noexcept nogil:
        """The record's rolling snapshot id; -1 (and forgotten there) when the id was reused
        since, so it is no longer the record's to drop."""
        cdef int32_t sid = rec.rolling
        if sid >= 0 and (self._generation[sid] != rec.rolling_generation or self._node[sid] < 0):
            rec.rolling = -1
            return -1
        return sid

    cdef void drop(self, int32_t sid) noexcept nogil:
        """Free kept id ``sid``; its node loses the tag and keeps its KV."""
        self._trie._set_tag(self._node[sid], -1)
        self.release(sid)

    cdef int32_t tag(self, int32_t node, bint *fresh) noexcept nogil:
        """The snapshot id at the end of ``node``'s run: the one there (made the most recently
        used), else a new one (``fresh``), the least recently used one's node losing it when
        none is free; -1 when there are no ids."""
        cdef int32_t sid = self._trie._nodes[node].tag, victim
        if sid >= 0:
            self.touch(sid)
            return sid
        sid = self.take(&victim)
        if sid < 0:
            return -1
        if victim >= 0:
            self._trie._set_tag(victim, -1)
        self._trie._set_tag(node, sid)
        self._node[sid] = node
        fresh[0] = True
        return sid

    cdef str problem(self, Py_ssize_t tags):
        """(Lock held) the first inconsistency of the LRU list against the trie's tags (``tags``
        nodes are tagged), or None."""
        cdef Py_ssize_t count = 0
        cdef int32_t sid = self._head
        while sid >= 0:
            count += 1
            if count > self.num:
                return "snapshot LRU list has a cycle"
            if self._node[sid] < 0 or self._trie._nodes[self._node[sid]].tag != sid:
                return f"snapshot {sid} is listed as used but no node is tagged with it"
            sid = self._next[sid]
        if count != tags or count != self.used:
            return f"{count} snapshots listed, {tags} nodes tagged, the counter says {self.used}"
        return None
