# Retention hints of a KV cache core, module lifecycle._retention: per request, a priority per
# block span of its path (token ranges, generated tokens, a session TTL), applied when the request's
# blocks enter the trie; pinned prefixes within a budget. Guarded by the core's lock; the core owns
# the one ``Retention`` and calls ``apply`` from its finish.

cimport cython
from libc.stdint cimport int32_t, int64_t

from lifecycle._radix cimport RadixTrie
from lifecycle._records cimport Records, SeqRec
from lifecycle._sync cimport CoreLock


# Blocks [start, next span's start) of a request's path keep ``priority`` for ``duration`` seconds
# from the request's finish (< 0: for good). A hint's spans cover every block, in order.
cdef struct Span:
    int32_t start
    int32_t priority
    double duration


cdef struct Hint:
    int64_t seq_id
    int64_t handle
    int32_t num_spans
    Span *spans


@cython.final
cdef class Retention:
    cdef RadixTrie _trie
    cdef Records _records
    cdef CoreLock _lock
    cdef Py_ssize_t _block_size
    cdef Hint *_hints               # one per hinted live request, in no order
    cdef Py_ssize_t _num_hints      # read by the core's finish: 0 means nothing to look up
    cdef Py_ssize_t _hints_capacity
    cdef bint _grouped              # the core has several KV cache groups
    cdef readonly bint hinted       # a priority was ever given (a windowed group's eviction then reads them)
    cdef list _pins                 # (adapter key, token bytes, node, blocks) per pinned prefix
    cdef readonly Py_ssize_t pin_budget
    cdef readonly Py_ssize_t pinned_blocks

    cdef void apply(self, SeqRec *rec, int32_t end, Py_ssize_t first_new) noexcept nogil
    cdef void _drop(self, Py_ssize_t i) noexcept nogil
    cdef void _purge(self)
    cdef int count_pins(self, dict pins) except -1


cdef Retention new_retention(RadixTrie trie, Records records, CoreLock lock, Py_ssize_t block_size, bint grouped)
