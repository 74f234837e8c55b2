# The SSM snapshot ids of a KV cache core, module lifecycle._snapids: ``num`` ids, each free or kept
# at a trie node (whose tag names it), the kept ones on an LRU list; a generation per id tells a
# record whether the id it remembers was reused since. Guarded by the core's lock; the core owns
# the one ``SnapshotIds`` and keeps the nodes' tags in step with it.

cimport cython
from libc.stdint cimport int32_t, int64_t, uint32_t

from lifecycle._radix cimport RadixTrie
from lifecycle._records cimport SeqRec


@cython.final
cdef class SnapshotIds:
    cdef int32_t *_node             # the node each id is kept at, -1 = free
    cdef uint32_t *_generation
    cdef int32_t *_prev             # the LRU list: head least recently used
    cdef int32_t *_next             # (free ids: the next free one)
    cdef int32_t _head
    cdef int32_t _tail
    cdef int32_t _free
    cdef RadixTrie _trie            # whose nodes the ids are kept at (their tags name them)
    cdef readonly int32_t num       # ids handed out, at most
    cdef readonly int32_t used      # ids kept at a node now
    cdef readonly int64_t evicted   # ids freed since (dropped, evicted or reused)

    cdef inline int32_t node_of(self, int32_t sid) noexcept nogil:
        """The node ``sid`` is kept at, -1 when it is free."""
        return self._node[sid]

    cdef inline uint32_t generation_of(self, int32_t sid) noexcept nogil:
        return self._generation[sid]

    cdef void _unlink(self, int32_t sid) noexcept nogil
    cdef void _append(self, int32_t sid) noexcept nogil
    cdef void touch(self, int32_t sid) noexcept nogil
    cdef void release(self, int32_t sid) noexcept nogil
    cdef int32_t take(self, int32_t *victim) noexcept nogil
    cdef int32_t rolling_of(self, SeqRec *rec) noexcept nogil
    cdef void drop(self, int32_t sid) noexcept nogil
    cdef int32_t tag(self, int32_t node, bint *fresh) noexcept nogil
    cdef str problem(self, Py_ssize_t tags)


cdef SnapshotIds new_snapshot_ids(int32_t num, RadixTrie trie)
