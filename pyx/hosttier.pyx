# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, autotestdict=False, binding=False
"""The host tier's index (module lifecycle._hosttier): which slot of the tier's host memory holds
which block, the slots' LRU order and free list, and the copies a demotion or promotion needs.

``HostIndex`` keeps, per slot, the block's key (two 64-bit words), its parent's key and its tokens,
and finds a slot by the key's high word (an open-addressing table with linear probing). Each call
takes a whole batch of blocks and runs its loops without the GIL under the index's own mutex; the
copies are returned as (dst, src, nbytes) rows for one batched device copy. An entry is served
(``lookup``, ``promote``) only when its whole key, its parent's key and its tokens are the ones
asked for: the high word finds it, the rest proves it. ``lifecycle.tiers.host.HostTier`` owns one,
with the host memory the rows point into, and makes the copies.
"""

cimport cython
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memmove, memset

import numpy as np

cimport numpy as cnp
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsLongLong, PyLong_AsUnsignedLongLong

cdef extern from "Python.h":
    bint PyLong_CheckExact(object o)
    bint PyTuple_CheckExact(object o)

cnp.import_array()

from cpython.pystate cimport PyThreadState
from lifecycle._evlog cimport EvEntry, RawEvents
from lifecycle._sync cimport NOGIL_MIN_WORK, lc_enter, lc_enter_gil, lc_leave, lc_mutex_destroy, lc_mutex_init

from lifecycle.errors import BlockIdOutOfRange, InvalidId, InvariantViolation

#: The names of ``HostIndex.counts()``, in order.
COUNT_NAMES = (
    "lookups", "hits", "collisions", "stored", "loaded", "duplicates", "evicted", "replaced", "cleared",
    "promoted", "bytes_demoted", "bytes_promoted",
)

cdef uint64_t _SPREAD = 0x9E3779B97F4A7C15ULL


cdef inline Py_ssize_t _home(uint64_t key, int shift) noexcept nogil:
    return <Py_ssize_t>((key * _SPREAD) >> shift)


cdef extern from *:
    void _prefetch "__builtin_prefetch"(const void *address) noexcept nogil

#: How many keys ahead a batch loop asks for the table entries it will probe (their misses overlap).
DEF AHEAD = 24


cdef inline int _log2(Py_ssize_t size) noexcept nogil:
    cdef int bits = 0
    while (<Py_ssize_t>1 << bits) < size:
        bits += 1
    return bits


cdef inline bint _put_seen(Entry *seen, uint64_t mask, int shift, uint64_t key) noexcept nogil:
    """Add ``key`` to the scratch set; False when it was there already."""
    cdef Py_ssize_t i = _home(key, shift)
    while seen[i].slot >= 0:
        if seen[i].key == key:
            return False
        i = (i + 1) & mask
    seen[i].key = key
    seen[i].slot = 0
    return True


cdef inline Py_ssize_t _add_row(int64_t *rows, Py_ssize_t count, int64_t dst, int64_t src,
                                int64_t nbytes) noexcept nogil:
    """Append a copy row, merged into the previous one where both ranges continue it, or both
    end where it starts (a run of blocks descending on both sides)."""
    cdef int64_t *last
    if count:
        last = rows + 3 * (count - 1)
        if last[0] + last[2] == dst and last[1] + last[2] == src:
            last[2] += nbytes
            return count
        if dst + nbytes == last[0] and src + nbytes == last[1]:
            last[0] = dst
            last[1] = src
            last[2] += nbytes
            return count
    rows[3 * count] = dst
    rows[3 * count + 1] = src
    rows[3 * count + 2] = nbytes
    return count + 1


cdef void _sort_high(uint64_t *words, uint64_t *spare, Py_ssize_t count, uint64_t most) noexcept nogil:
    """Sort ``words`` by their high 32 bits (at most ``most``), stably: insertion for a few, else an
    LSD radix sort of 11-bit digits through ``spare`` (``count`` words)."""
    cdef Py_ssize_t i, j, total, counts[2048]
    cdef uint64_t word, *source = words, *target = spare, *swap
    cdef int shift = 32
    if count < 48:
        for i in range(1, count):
            word = words[i]
            j = i
            while j > 0 and (words[j - 1] >> 32) > (word >> 32):
                words[j] = words[j - 1]
                j -= 1
            words[j] = word
        return
    while shift < 64 and (most >> (shift - 32)) != 0:
        memset(counts, 0, sizeof(counts))
        for i in range(count):
            counts[(source[i] >> shift) & 2047] += 1
        total = 0
        for i in range(2048):
            j = counts[i]
            counts[i] = total
            total += j
        for i in range(count):
            j = (source[i] >> shift) & 2047
            target[counts[j]] = source[i]
            counts[j] += 1
        swap = source
        source = target
        target = swap
        shift += 11
    if source != words:
        memcpy(words, source, count * sizeof(uint64_t))


# -- the calls' fast path: arguments already in the shapes the checks would make them --------------
# HostTier.demote / promote hand their arguments here first. Where every argument is of a form these
# read directly (lists of ints, C-contiguous uint64 / int64 / int32 arrays) and valid, the call runs
# in one pass; anything else (another form, a value out of range, an error to name) returns None
# and the caller's checks run as before, naming what is wrong. Nothing changes before that answer.

cdef Py_ssize_t _num_keys(object keys) noexcept:
    """How many keys ``keys`` holds in a form the fast path reads, -1 for any other."""
    cdef cnp.ndarray array
    if type(keys) is list:
        return PyList_GET_SIZE(keys)
    if type(keys) is np.ndarray:
        array = <cnp.ndarray>keys
        if cnp.PyArray_TYPE(array) == cnp.NPY_UINT64 and cnp.PyArray_ISCARRAY_RO(array):
            if cnp.PyArray_NDIM(array) == 1:
                return cnp.PyArray_DIM(array, 0)
            if cnp.PyArray_NDIM(array) == 2 and cnp.PyArray_DIM(array, 1) == 2:
                return cnp.PyArray_DIM(array, 0)
    return -1


cdef bint _read_word(object item, uint64_t *out) noexcept:
    """An int in [0, 2**64) into ``out``; False for anything else (a bool or a float included)."""
    if not PyLong_CheckExact(item):
        return False
    try:
        out[0] = PyLong_AsUnsignedLongLong(item)
    except OverflowError:
        return False
    return True


cdef bint _read_keys(object keys, Py_ssize_t count, uint64_t *out) noexcept:
    """``count`` keys of ``keys`` (``_num_keys`` said count) as (high, low) rows into ``out``;
    False where one is not an int in [0, 2**64)."""
    cdef Py_ssize_t i
    cdef cnp.ndarray array
    cdef const uint64_t *words
    if type(keys) is list:
        for i in range(count):
            if not _read_word(<object>PyList_GET_ITEM(keys, i), out + 2 * i):
                return False
            out[2 * i + 1] = 0
        return True
    array = <cnp.ndarray>keys
    words = <const uint64_t *>cnp.PyArray_DATA(array)
    if cnp.PyArray_NDIM(array) == 2:
        memcpy(out, words, 2 * count * sizeof(uint64_t))
    else:
        for i in range(count):
            out[2 * i] = words[i]
            out[2 * i + 1] = 0
    return True


cdef bint _read_ids(object ids, Py_ssize_t count, Py_ssize_t limit, int64_t *out) noexcept:
    """``count`` device block ids in [0, ``limit``) into ``out`` from a list of ints or a
    C-contiguous 1-D int64 / int32 array; False for any other form, count or value."""
    cdef Py_ssize_t i
    cdef cnp.ndarray array
    cdef object item
    cdef int64_t value
    if type(ids) is list:
        if PyList_GET_SIZE(ids) != count:
            return False
        for i in range(count):
            item = <object>PyList_GET_ITEM(ids, i)
            if not PyLong_CheckExact(item):
                return False
            try:
                value = PyLong_AsLongLong(item)
            except OverflowError:
                return False
            if not 0 <= value < limit:
                return False
            out[i] = value
        return True
    if type(ids) is not np.ndarray:
        return False
    array = <cnp.ndarray>ids
    if cnp.PyArray_NDIM(array) != 1 or cnp.PyArray_DIM(array, 0) != count or not cnp.PyArray_ISCARRAY_RO(array):
        return False
    if cnp.PyArray_TYPE(array) == cnp.NPY_INT64:
        memcpy(out, cnp.PyArray_DATA(array), count * sizeof(int64_t))
    elif cnp.PyArray_TYPE(array) == cnp.NPY_INT32:
        for i in range(count):
            out[i] = (<const int32_t *>cnp.PyArray_DATA(array))[i]
    else:
        return False
    for i in range(count):
        if not 0 <= out[i] < limit:
            return False
    return True


cdef const int32_t *_read_tokens(object tokens, Py_ssize_t count) noexcept:
    """The token ids of a C-contiguous int32 array of ``count`` ids, each in [0, 2**31); NULL
    for any other form, size or value."""
    cdef cnp.ndarray array
    cdef const int32_t *ids
    cdef Py_ssize_t i
    cdef int32_t low = 0
    if type(tokens) is not np.ndarray:
        return NULL
    array = <cnp.ndarray>tokens
    if (cnp.PyArray_TYPE(array) != cnp.NPY_INT32 or not cnp.PyArray_ISCARRAY_RO(array)
            or cnp.PyArray_SIZE(array) != count):
        return NULL
    ids = <const int32_t *>cnp.PyArray_DATA(array)
    for i in range(count):
        low = low if low < ids[i] else ids[i]
    return NULL if low < 0 else ids


cdef bint _read_parent(object parent, uint64_t *out) noexcept:
    """One key (an int, or a (high, low) tuple of ints, each in [0, 2**64)) into ``out[0:2]``."""
    if type(parent) is tuple:
        return (len(parent) == 2 and _read_word((<tuple>parent)[0], out)
                and _read_word((<tuple>parent)[1], out + 1))
    out[1] = 0
    return _read_word(parent, out)


@cython.final
@cython.auto_pickle(False)
cdef class HostIndex:
    """The bookkeeping of a host tier of ``capacity`` slots of ``slot_bytes`` bytes at
    ``host_base``, for blocks of ``block_size`` tokens of a device pool of ``num_device_blocks``
    blocks whose attention layers are the rows of ``layers``: (device base address, bytes of one
    block of the layer, offset of the layer in a slot)."""

    def __init__(self, Py_ssize_t capacity, Py_ssize_t block_size, Py_ssize_t num_device_blocks,
                 const int64_t[:, ::1] layers, int64_t host_base, Py_ssize_t slot_bytes):
        """Every slot free; ``InvalidId`` for a size out of range."""
        cdef Py_ssize_t size = 16, i
        cdef int bits = 4
        if self._table != NULL:
            raise InvalidId("HostIndex: already initialized")
        if capacity < 1 or capacity >= (1 << 30):
            raise InvalidId(f"HostIndex: capacity={capacity} must be in 1..{(1 << 30) - 1}")
        if block_size < 1 or num_device_blocks < 1 or slot_bytes < 1:
            raise InvalidId(
                f"HostIndex: block_size={block_size}, num_device_blocks={num_device_blocks} and "
                f"slot_bytes={slot_bytes} must be >= 1"
            )
        if layers.shape[0] < 1 or layers.shape[1] != 3:
            raise InvalidId(f"HostIndex: layers must be (n >= 1, 3) rows, got shape {tuple(layers.shape)[:2]}")
        lc_mutex_init(&self._mutex)
        self.capacity = capacity
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.slot_bytes = slot_bytes
        while size < 2 * capacity:
            size *= 2
            bits += 1
        self._mask = size - 1
        self._shift = 64 - bits
        self._key_array = np.zeros((capacity, 2), dtype=np.uint64)
        self._parent_array = np.zeros((capacity, 2), dtype=np.uint64)
        self._token_array = np.zeros((capacity, block_size), dtype=np.int32)
        cdef uint64_t[:, ::1] key_view = self._key_array
        cdef uint64_t[:, ::1] parent_view = self._parent_array
        cdef int32_t[:, ::1] token_view = self._token_array
        self._keys = &key_view[0, 0]
        self._parents = &parent_view[0, 0]
        self._tokens = &token_view[0, 0]
        self._table = <Entry *>malloc(size * sizeof(Entry))
        self._prev = <int32_t *>malloc(capacity * sizeof(int32_t))
        self._next = <int32_t *>malloc(capacity * sizeof(int32_t))
        self._free = <int32_t *>malloc(capacity * sizeof(int32_t))
        self._slot_marks = <uint32_t *>malloc(capacity * sizeof(uint32_t))
        self._block_marks = <uint32_t *>malloc(num_device_blocks * sizeof(uint32_t))
        self._num_layers = layers.shape[0]
        self._layers = <int64_t *>malloc(3 * self._num_layers * sizeof(int64_t))
        if (self._table == NULL or self._prev == NULL or self._next == NULL or self._free == NULL
                or self._slot_marks == NULL or self._block_marks == NULL or self._layers == NULL):
            raise MemoryError(f"HostIndex: cannot allocate the tables of {capacity} slots")
        for i in range(3 * self._num_layers):
            self._layers[i] = layers[i // 3, i % 3]
        memset(self._slot_marks, 0, capacity * sizeof(uint32_t))
        memset(self._block_marks, 0, num_device_blocks * sizeof(uint32_t))
        memset(self._counts, 0, sizeof(self._counts))
        self._host_base = host_base
        self._reset()

    def __dealloc__(self):
        free(self._table)
        free(self._prev)
        free(self._next)
        free(self._free)
        free(self._slot_marks)
        free(self._block_marks)
        free(self._layers)
        free(self._seen)
        free(self._sort)
        free(self._gkeys)
        free(self._gparents)
        free(self._gtokens)
        free(self._gids)
        lc_mutex_destroy(&self._mutex)

    cdef void _reset(self) noexcept nogil:
        cdef Py_ssize_t i
        for i in range(<Py_ssize_t>self._mask + 1):
            self._table[i].key = 0
            self._table[i].slot = -1
        self._head = -1
        self._tail = -1
        self.num_blocks = 0
        # slot 0 on top of the stack: the first blocks stored fill the memory from its start
        for i in range(self.capacity):
            self._free[i] = <int32_t>(self.capacity - 1 - i)
        self._num_free = self.capacity

    # -- the table, the LRU list, the free stack --------------------------------------------------

    cdef Py_ssize_t _find(self, uint64_t key) noexcept nogil:
        """The table position holding ``key``, -1 when none does."""
        cdef Py_ssize_t i = _home(key, self._shift)
        while self._table[i].slot >= 0:
            if self._table[i].key == key:
                return i
            i = (i + 1) & self._mask
        return -1

    cdef void _table_put(self, uint64_t key, int32_t slot) noexcept nogil:
        cdef Py_ssize_t i = _home(key, self._shift)
        while self._table[i].slot >= 0:
            i = (i + 1) & self._mask
        self._table[i].key = key
        self._table[i].slot = slot

    cdef void _table_remove(self, uint64_t key) noexcept nogil:
        """Remove ``key`` (which the table holds), shifting later entries of its probe run back so
        that every entry stays reachable from its home position."""
        cdef Py_ssize_t hole = self._find(key), j, home
        cdef Py_ssize_t mask = <Py_ssize_t>self._mask
        if hole < 0:
            return
        j = hole
        while True:
            j = (j + 1) & mask
            if self._table[j].slot < 0:
                break
            home = _home(self._table[j].key, self._shift)
            # the entry at j may fill the hole unless its home lies cyclically in (hole, j]
            if ((j - home) & mask) >= ((j - hole) & mask):
                self._table[hole] = self._table[j]
                hole = j
        self._table[hole].slot = -1
        self._table[hole].key = 0

    cdef void _unlink(self, int32_t slot) noexcept nogil:
        cdef int32_t before = self._prev[slot], after = self._next[slot]
        if before >= 0:
            self._next[before] = after
        else:
            self._head = after
        if after >= 0:
            self._prev[after] = before
        else:
            self._tail = before

    cdef void _append(self, int32_t slot) noexcept nogil:
        """``slot`` becomes the most recently used."""
        self._prev[slot] = self._tail
        self._next[slot] = -1
        if self._tail >= 0:
            self._next[self._tail] = slot
        else:
            self._head = slot
        self._tail = slot

    cdef int32_t _evict_one(self) noexcept nogil:
        """Drop the least recently used entry (one is held); its slot goes on the free stack."""
        cdef int32_t slot = self._head
        self._unlink(slot)
        self._table_remove(self._keys[2 * slot])
        self._free[self._num_free] = slot
        self._num_free += 1
        self.num_blocks -= 1
        self._counts[C_EVICTED] += 1
        return slot

    cdef void _write_entry(self, int32_t slot, const uint64_t *key, const uint64_t *parent,
                           const int32_t *tokens) noexcept nogil:
        cdef Py_ssize_t i
        self._keys[2 * slot] = key[0]
        self._keys[2 * slot + 1] = key[1]
        self._parents[2 * slot] = parent[0]
        self._parents[2 * slot + 1] = parent[1]
        cdef int32_t *row = self._tokens + slot * self.block_size
        for i in range(self.block_size):
            row[i] = tokens[i]

    cdef bint _is_block(self, int32_t slot, const uint64_t *key, uint64_t parent_high, uint64_t parent_low,
                        const int32_t *tokens) noexcept nogil:
        """Whether ``slot`` holds exactly this key, after this parent, with these tokens."""
        return (
            self._keys[2 * slot] == key[0] and self._keys[2 * slot + 1] == key[1]
            and self._parents[2 * slot] == parent_high and self._parents[2 * slot + 1] == parent_low
            and memcmp(self._tokens + slot * self.block_size, tokens, self.block_size * sizeof(int32_t)) == 0
        )

    cdef uint32_t _next_epoch(self) noexcept nogil:
        """A mark no slot or block carries (the marks are cleared when the counter wraps)."""
        self._epoch += 1
        if self._epoch == 0:
            memset(self._slot_marks, 0, self.capacity * sizeof(uint32_t))
            memset(self._block_marks, 0, self.num_device_blocks * sizeof(uint32_t))
            self._epoch = 1
        return self._epoch

    cdef bint _reserve_seen(self, Py_ssize_t count) noexcept nogil:
        """An empty scratch set for ``count`` keys (at most half full), its first ``_seen_used``
        entries; False without memory."""
        cdef Py_ssize_t size = 16, i
        while size < 2 * count:
            size *= 2
        if size > self._seen_size:
            free(self._seen)
            self._seen = <Entry *>malloc(size * sizeof(Entry))
            if self._seen == NULL:
                self._seen_size = 0
                return False
            self._seen_size = size
        self._seen_used = size
        for i in range(size):
            self._seen[i].slot = -1
        return True

    cdef bint _reserve_sort(self, Py_ssize_t count) noexcept nogil:
        """Scratch room for three arrays of ``count`` words (``_sort``); False without memory."""
        if 3 * count > self._sort_size:
            free(self._sort)
            self._sort = <uint64_t *>malloc(3 * count * sizeof(uint64_t))
            if self._sort == NULL:
                self._sort_size = 0
                return False
            self._sort_size = 3 * count
        return True

    # -- the batch loops ----------------------------------------------------------------------------

    cdef Py_ssize_t _first_bad_id(self, const int64_t *ids, Py_ssize_t count) noexcept nogil:
        """The position of the lowest id when it is negative, else of the highest when it is out of
        range; -1 when every id names a device block."""
        cdef Py_ssize_t i, low = 0, high = 0
        if count == 0:
            return -1
        for i in range(1, count):
            if ids[i] < ids[low]:
                low = i
            if ids[i] > ids[high]:
                high = i
        if ids[low] < 0:
            return low
        if ids[high] >= self.num_device_blocks:
            return high
        return -1

    cdef Py_ssize_t _first_repeated_id(self, const int64_t *ids, Py_ssize_t count) noexcept nogil:
        """The first position whose id came before it (ids in range), -1 when none did."""
        cdef uint32_t mark = self._next_epoch()
        cdef Py_ssize_t i
        for i in range(count):
            if self._block_marks[ids[i]] == mark:
                return i
            self._block_marks[ids[i]] = mark
        return -1

    cdef Py_ssize_t _demote(self, const uint64_t *keys, const uint64_t *parents, const int32_t *tokens,
                            const int64_t *ids, Py_ssize_t count, int64_t *rows, Py_ssize_t *num_rows,
                            int64_t *stored, uint64_t *evicted, Py_ssize_t *num_evicted) noexcept nogil:
        """Store the new blocks of a batch (see ``demote``): their positions into ``stored``, the
        high words of the entries evicted for them into ``evicted``, their copies into ``rows``.
        Returns how many were stored, -1 without scratch memory (nothing changed then)."""
        cdef Py_ssize_t position, found, fresh = 0, j, layer
        cdef int32_t slot
        cdef int64_t host, block
        cdef int seen_shift
        cdef uint64_t *by_block
        cdef uint64_t *by_slot
        cdef uint64_t *spare
        cdef uint64_t most_block, most_slot
        if not self._reserve_seen(count) or not self._reserve_sort(count):
            return -1
        seen_shift = 64 - _log2(self._seen_used)
        for position in range(count):
            if position + AHEAD < count:
                _prefetch(&self._table[_home(keys[2 * (position + AHEAD)], self._shift)])
            found = self._find(keys[2 * position])
            if found >= 0:  # held: not copied again, most recently used now
                slot = self._table[found].slot
                self._unlink(slot)
                self._append(slot)
                self._counts[C_DUPLICATES] += 1
            elif _put_seen(self._seen, self._seen_used - 1, seen_shift, keys[2 * position]):
                stored[fresh] = position
                fresh += 1
        if fresh > self.capacity:  # only the last ``capacity`` fit
            memmove(stored, stored + fresh - self.capacity, self.capacity * sizeof(int64_t))
            fresh = self.capacity
        num_evicted[0] = 0
        num_rows[0] = 0
        # Room first: evicted entries leave before slots are written. The victims are the
        # least recently used, named first (their table entries fetched meanwhile), then dropped.
        slot = self._head
        while self._num_free + num_evicted[0] < fresh:
            evicted[num_evicted[0]] = self._keys[2 * slot]
            if num_evicted[0] < AHEAD:
                _prefetch(&self._table[_home(self._keys[2 * slot], self._shift)])
            num_evicted[0] += 1
            slot = self._next[slot]
        for j in range(num_evicted[0]):
            if j + AHEAD < num_evicted[0]:
                _prefetch(&self._table[_home(evicted[j + AHEAD], self._shift)])
            self._evict_one()
        # Slots for the run: the ``fresh`` on top of the free stack, handed out in ascending order to
        # the blocks in ascending device order, so that device blocks contiguous in the pool land in
        # contiguous slots and their copies merge (the LRU order stays the batch's order).
        by_block = self._sort
        by_slot = self._sort + fresh
        spare = self._sort + 2 * fresh
        most_block = most_slot = 0
        self._num_free -= fresh
        for j in range(fresh):
            block = ids[stored[j]]
            by_block[j] = (<uint64_t>block << 32) | <uint64_t>j
            most_block = max(most_block, <uint64_t>block)
            slot = self._free[self._num_free + j]
            by_slot[j] = <uint64_t>slot << 32
            most_slot = max(most_slot, <uint64_t>slot)
        _sort_high(by_block, spare, fresh, most_block)
        _sort_high(by_slot, spare, fresh, most_slot)
        for j in range(fresh):  # spare[batch index] = its slot
            spare[by_block[j] & 0xFFFFFFFFULL] = by_slot[j] >> 32
        for j in range(fresh):
            position = stored[j]
            if j + AHEAD < fresh:
                _prefetch(&self._table[_home(keys[2 * stored[j + AHEAD]], self._shift)])
            slot = <int32_t>spare[j]
            self._write_entry(slot, keys + 2 * position, parents + 2 * position, tokens + position * self.block_size)
            self._table_put(keys[2 * position], slot)
            self._append(slot)
        for layer in range(self._num_layers):  # layer-major: a layer's contiguous blocks merge
            for j in range(fresh):
                host = self._host_base + <int64_t>(by_slot[j] >> 32) * self.slot_bytes
                block = <int64_t>(by_block[j] >> 32)
                num_rows[0] = _add_row(
                    rows, num_rows[0], host + self._layers[3 * layer + 2],
                    self._layers[3 * layer] + block * self._layers[3 * layer + 1], self._layers[3 * layer + 1],
                )
        self.num_blocks += fresh
        self._counts[C_STORED] += fresh
        self._counts[C_BYTES_DEMOTED] += fresh * self.slot_bytes
        return fresh

    cdef Py_ssize_t _held_run(self, const uint64_t *keys, Py_ssize_t count, int32_t *slots) noexcept nogil:
        """The length of the leading run of ``keys`` (high words at even positions) the table
        holds, their slots into ``slots``."""
        cdef Py_ssize_t i, found
        for i in range(count):
            found = self._find(keys[2 * i])
            if found < 0:
                return i
            slots[i] = self._table[found].slot
        return count

    cdef Py_ssize_t _verified_run(self, const int32_t *slots, Py_ssize_t count, const uint64_t *keys,
                                  const uint64_t *parents, uint64_t first_high, uint64_t first_low,
                                  const int32_t *tokens) noexcept nogil:
        """How many of ``slots`` lead with entries holding exactly ``keys`` and ``tokens``, each
        after its row of ``parents`` (NULL: each after the key before it, the first after
        ``first_high``, ``first_low``)."""
        cdef Py_ssize_t i
        cdef uint64_t parent_high = first_high, parent_low = first_low
        for i in range(count):
            if parents != NULL:
                parent_high, parent_low = parents[2 * i], parents[2 * i + 1]
            elif i:
                parent_high, parent_low = keys[2 * i - 2], keys[2 * i - 1]
            if not self._is_block(slots[i], keys + 2 * i, parent_high, parent_low, tokens + i * self.block_size):
                return i
        return count

    cdef Py_ssize_t _rows(self, const int32_t *slots, const int64_t *ids, Py_ssize_t count, bint to_host,
                          int64_t *rows) noexcept nogil:
        """(dst, src, nbytes) rows moving every layer of each block between its slot and its
        device block, block-major; returns their number."""
        cdef Py_ssize_t i, layer, num_rows = 0
        cdef int64_t host, device, nbytes
        for i in range(count):
            for layer in range(self._num_layers):
                nbytes = self._layers[3 * layer + 1]
                host = self._host_base + <int64_t>slots[i] * self.slot_bytes + self._layers[3 * layer + 2]
                device = self._layers[3 * layer] + ids[i] * nbytes
                if to_host:
                    num_rows = _add_row(rows, num_rows, host, device, nbytes)
                else:
                    num_rows = _add_row(rows, num_rows, device, host, nbytes)
        return num_rows

    cdef Py_ssize_t _load(self, const uint64_t *keys, const uint64_t *parents, const int32_t *tokens,
                          Py_ssize_t count, int64_t *slots, int64_t *stored, Py_ssize_t *num_stored,
                          uint64_t *removed, Py_ssize_t *num_removed) noexcept nogil:
        """Put records into the tier (see ``load``); returns how many were stored."""
        cdef uint32_t mark = self._next_epoch()
        cdef Py_ssize_t position, found, j
        cdef int32_t slot, victim
        cdef uint64_t victim_key
        num_stored[0] = 0
        num_removed[0] = 0
        for position in range(count):
            found = self._find(keys[2 * position])
            if found >= 0:
                slot = self._table[found].slot
                self._unlink(slot)
                self._append(slot)
                if self._is_block(slot, keys + 2 * position, parents[2 * position], parents[2 * position + 1],
                                  tokens + position * self.block_size):
                    self._counts[C_DUPLICATES] += 1
                    slots[position] = -1
                    continue
                self._counts[C_REPLACED] += 1
                removed[num_removed[0]] = keys[2 * position]
                num_removed[0] += 1
            else:
                if self._num_free == 0:
                    victim = self._head
                    victim_key = self._keys[2 * victim]
                    self._evict_one()
                    if self._slot_marks[victim] == mark:  # stored by this call: it leaves that list
                        for j in range(num_stored[0]):
                            if keys[2 * stored[j]] == victim_key:
                                memmove(stored + j, stored + j + 1, (num_stored[0] - j - 1) * sizeof(int64_t))
                                num_stored[0] -= 1
                                break
                    else:
                        removed[num_removed[0]] = victim_key
                        num_removed[0] += 1
                self._num_free -= 1
                slot = self._free[self._num_free]
                self._table_put(keys[2 * position], slot)
                self._append(slot)
                self.num_blocks += 1
            self._write_entry(slot, keys + 2 * position, parents + 2 * position, tokens + position * self.block_size)
            self._slot_marks[slot] = mark
            slots[position] = slot
            stored[num_stored[0]] = position
            num_stored[0] += 1
            self._counts[C_LOADED] += 1
        return num_stored[0]

    # -- the calls -------------------------------------------------------------------------------------

    def check_block_ids(self, str call, const int64_t[::1] ids):
        """Raise ``BlockIdOutOfRange`` naming the first id outside the device pool (the lowest when
        one is negative, else the highest), ``InvalidId`` naming an id given twice."""
        cdef Py_ssize_t count = ids.shape[0], bad
        cdef PyThreadState *released
        if count == 0:
            return
        released = lc_enter(&self._mutex, count < NOGIL_MIN_WORK)
        bad = self._first_bad_id(&ids[0], count)
        if bad < 0:
            bad = self._first_repeated_id(&ids[0], count)
            lc_leave(&self._mutex, released)
            if bad >= 0:
                raise InvalidId(f"{call}: block id {ids[bad]} is given more than once")
            return
        lc_leave(&self._mutex, released)
        raise BlockIdOutOfRange(
            f"{call}: block id {ids[bad]} is out of range: valid values are 0..{self.num_device_blocks - 1}"
        )

    cdef void _check_batch(self, str call, object keys, object parents, object tokens, Py_ssize_t count) except *:
        if keys.shape != (count, 2) or keys.dtype != np.uint64:
            raise InvalidId(f"{call}: keys must be ({count}, 2) uint64 rows, got {keys.shape} of {keys.dtype}")
        if parents is not None and (parents.shape != (count, 2) or parents.dtype != np.uint64):
            raise InvalidId(
                f"{call}: parents must be ({count}, 2) uint64 rows, got {parents.shape} of {parents.dtype}"
            )
        if tokens.shape != (count, self.block_size) or tokens.dtype != np.int32:
            raise InvalidId(
                f"{call}: tokens must be ({count}, {self.block_size}) int32, got {tokens.shape} of {tokens.dtype}"
            )

    cdef uint64_t *_read_batch(self, object hashes, object block_ids, object tokens, object parents,
                               Py_ssize_t count, const int32_t **token_ids, size_t extra) noexcept:
        """The fast path's reading of a batch of ``count`` keys (``_num_keys(hashes)``): one
        allocation holding the keys' (high, low) rows, then the parents' (each after the key
        before it, the first after key 0, where ``parents`` is None), then the block ids (int64),
        then ``extra`` bytes per block for the caller; the tokens' address into ``token_ids``.
        NULL where the batch is not one the fast path takes (the caller frees what it gets)."""
        if count <= 0 or (parents is not None and _num_keys(parents) != count):
            return NULL
        token_ids[0] = _read_tokens(tokens, count * self.block_size)
        if token_ids[0] == NULL:
            return NULL
        cdef uint64_t *words = <uint64_t *>malloc(count * (4 * sizeof(uint64_t) + sizeof(int64_t) + extra))
        if words == NULL:
            return NULL
        cdef uint64_t *parent_words = words + 2 * count
        if not _read_keys(hashes, count, words) or not _read_ids(
            block_ids, count, self.num_device_blocks, <int64_t *>(words + 4 * count)
        ) or (parents is not None and not _read_keys(parents, count, parent_words)):
            free(words)
            return NULL
        if parents is None:  # one chain after key 0
            parent_words[0] = parent_words[1] = 0
            memcpy(parent_words + 2, words, 2 * (count - 1) * sizeof(uint64_t))
        return words

    def demote_fast(self, hashes, block_ids, tokens, parents):
        """``HostTier.demote``'s arguments as given, read directly where each is in a form this
        takes (see above) and valid: the batch is stored as ``demote`` stores it, and the answer
        is (the high words of the keys stored, of the entries evicted, the copy rows). None, with
        nothing changed, for anything else: the caller's checks then run."""
        cdef Py_ssize_t count = _num_keys(hashes), i
        cdef const int32_t *token_ids = NULL
        cdef uint64_t *words = self._read_batch(hashes, block_ids, tokens, parents, count, &token_ids, 0)
        if words == NULL:
            return None
        cdef uint64_t *parent_words = words + 2 * count
        cdef int64_t *ids = <int64_t *>(words + 4 * count)
        stored = np.empty(count, dtype=np.int64)
        evicted = np.empty(min(count, self.capacity), dtype=np.uint64)
        rows = np.empty((count * self._num_layers, 3), dtype=np.int64)
        cdef int64_t *stored_at = <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>stored)
        cdef Py_ssize_t fresh = 0, num_rows = 0, num_evicted = 0, repeated
        cdef PyThreadState *released = lc_enter(&self._mutex, count < NOGIL_MIN_WORK)
        repeated = self._first_repeated_id(ids, count)
        if repeated < 0:
            fresh = self._demote(words, parent_words, token_ids, ids, count,
                                 <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>rows), &num_rows, stored_at,
                                 <uint64_t *>cnp.PyArray_DATA(<cnp.ndarray>evicted), &num_evicted)
            for i in range(fresh):  # positions -> the high words stored
                stored_at[i] = <int64_t>words[2 * stored_at[i]]
        lc_leave(&self._mutex, released)
        free(words)
        if repeated >= 0:
            return None
        if fresh < 0:
            raise MemoryError(f"HostIndex.demote: no scratch memory for a batch of {count} blocks")
        return stored[:fresh].view(np.uint64), evicted[:num_evicted], rows[:num_rows]

    def promote_fast(self, hashes, block_ids, tokens, parent, parents):
        """``HostTier.promote``'s arguments as given: the copy rows, as ``promote`` makes them,
        where each argument is in a form this reads and valid and every entry is the block asked
        for; None, with nothing changed, for anything else (the caller's checks then name it)."""
        cdef uint64_t first[2]
        if not _read_parent(parent, first):
            return None
        cdef Py_ssize_t count = _num_keys(hashes)
        cdef const int32_t *token_ids = NULL
        cdef uint64_t *words = self._read_batch(hashes, block_ids, tokens, parents, count, &token_ids,
                                                sizeof(int32_t))
        if words == NULL:
            return None
        cdef uint64_t *parent_words = words + 2 * count
        cdef int64_t *ids = <int64_t *>(words + 4 * count)
        cdef int32_t *slots = <int32_t *>(ids + count)
        rows = np.empty((count * self._num_layers, 3), dtype=np.int64)
        cdef Py_ssize_t num_rows = -1
        cdef PyThreadState *released = lc_enter(&self._mutex, count < NOGIL_MIN_WORK)
        if (self._first_repeated_id(ids, count) < 0 and self._held_run(words, count, slots) == count
                and self._verified_run(slots, count, words, parent_words if parents is not None else NULL,
                                       first[0], first[1], token_ids) == count):
            num_rows = self._rows(slots, ids, count, False, <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>rows))
        lc_leave(&self._mutex, released)
        free(words)
        return None if num_rows < 0 else rows[:num_rows]

    def demote(self, keys, parents, tokens, block_ids):
        """Store the blocks of a batch: ``keys`` and ``parents`` (n, 2) uint64, ``tokens`` (n,
        block_size) int32, ``block_ids`` (n,) int64 (checked by ``check_block_ids``). A key the
        table holds is not stored again and becomes the most recently used (a duplicate); a key
        repeated in the batch counts once; of more new blocks than the tier holds only the last
        ``capacity`` are kept; least recently used entries make room, then the new blocks are
        stored in batch order, each the most recently used so far. Returns (the batch positions
        stored, the high words of the entries evicted, the (dst, src, nbytes) rows copying the
        stored blocks from the device to their slots)."""
        cdef Py_ssize_t count = block_ids.shape[0]
        self._check_batch("demote", keys, parents, tokens, count)
        cdef const uint64_t[:, ::1] key_view = keys
        cdef const uint64_t[:, ::1] parent_view = parents
        cdef const int32_t[:, ::1] token_view = tokens
        cdef const int64_t[::1] id_view = block_ids
        stored = np.empty(count, dtype=np.int64)
        evicted = np.empty(min(count, self.capacity), dtype=np.uint64)
        rows = np.empty((count * self._num_layers, 3), dtype=np.int64)
        if count == 0:
            return stored, evicted, rows
        cdef int64_t[::1] stored_view = stored
        cdef uint64_t[::1] evicted_view = evicted
        cdef int64_t[:, ::1] row_view = rows
        cdef Py_ssize_t fresh, num_rows = 0, num_evicted = 0
        cdef PyThreadState *released = lc_enter(&self._mutex, count < NOGIL_MIN_WORK)
        fresh = self._demote(&key_view[0, 0], &parent_view[0, 0], &token_view[0, 0], &id_view[0], count,
                             &row_view[0, 0], &num_rows, &stored_view[0], &evicted_view[0], &num_evicted)
        lc_leave(&self._mutex, released)
        if fresh < 0:
            raise MemoryError(f"HostIndex.demote: no scratch memory for a batch of {count} blocks")
        return stored[:fresh], evicted[:num_evicted], rows[:num_rows]

    # -- the model's demotion: what each device block holds, and a drained log's removals ---------

    def bind_blocks(self, keys, parents, hashes, valid, reused):
        """Use the model's arrays of what each device block holds: ``keys`` and ``parents``
        ((num_device_blocks, 2) uint64), ``hashes`` (uint64), ``valid`` and ``reused`` (bool), read
        and written by ``note_blocks`` and ``demote_removed``."""
        n = self.num_device_blocks
        if keys.shape != (n, 2) or parents.shape != (n, 2) or hashes.shape != (n,) or valid.shape != (n,) \
                or reused.shape != (n,):
            raise InvalidId(f"bind_blocks: the arrays must cover the {n} device blocks")
        cdef uint64_t[:, ::1] key_view = keys
        cdef uint64_t[:, ::1] parent_view = parents
        cdef uint64_t[::1] hash_view = hashes
        cdef uint8_t[::1] valid_view = valid.view(np.uint8)
        cdef uint8_t[::1] reused_view = reused.view(np.uint8)
        self._bound = (keys, parents, hashes, valid, reused)
        self._bkeys = &key_view[0, 0]
        self._bparents = &parent_view[0, 0]
        self._bhashes = &hash_view[0]
        self._bvalid = &valid_view[0]
        self._breused = &reused_view[0]

    def note_blocks(self, const int32_t[::1] ids, const uint64_t[:, ::1] chain, uint64_t root_high,
                    uint64_t root_low, const uint64_t[::1] hashes):
        """Device blocks ``ids`` hold the chain ``chain`` (each block's key; its parent's is the key
        before it, the first's (``root_high``, ``root_low``)) with content ``hashes``: they are
        noted (valid) until they leave the cache."""
        cdef Py_ssize_t count = ids.shape[0], i
        cdef int32_t block
        if self._bound is None:
            raise InvalidId("note_blocks: no arrays bound (bind_blocks)")
        if chain.shape[0] != count or chain.shape[1] != 2 or hashes.shape[0] != count:
            raise InvalidId(
                f"note_blocks: {count} ids need ({count}, 2) keys and {count} hashes, got "
                f"{tuple(chain.shape)[:2]} and {hashes.shape[0]}"
            )
        for i in range(count):
            if not 0 <= ids[i] < self.num_device_blocks:
                raise BlockIdOutOfRange(
                    f"note_blocks: block id {ids[i]} is out of range: valid values are 0..{self.num_device_blocks - 1}"
                )
        cdef uint64_t parent_high = root_high, parent_low = root_low
        for i in range(count):
            block = ids[i]
            self._bkeys[2 * block] = chain[i, 0]
            self._bkeys[2 * block + 1] = chain[i, 1]
            self._bparents[2 * block] = parent_high
            self._bparents[2 * block + 1] = parent_low
            self._bhashes[block] = hashes[i]
            self._bvalid[block] = 1
            parent_high, parent_low = chain[i, 0], chain[i, 1]

    cdef bint _reserve_gather(self, Py_ssize_t count) noexcept nogil:
        if count <= self._gsize:
            return True
        free(self._gkeys)
        free(self._gparents)
        free(self._gtokens)
        free(self._gids)
        self._gkeys = <uint64_t *>malloc(2 * count * sizeof(uint64_t))
        self._gparents = <uint64_t *>malloc(2 * count * sizeof(uint64_t))
        self._gtokens = <int32_t *>malloc(count * self.block_size * sizeof(int32_t))
        self._gids = <int64_t *>malloc(count * sizeof(int64_t))
        if self._gkeys == NULL or self._gparents == NULL or self._gtokens == NULL or self._gids == NULL:
            self._gsize = 0
            return False
        self._gsize = count
        return True

    def demote_removed(self, RawEvents raw):
        """Store what the removals of a drained log demote (those with block ids): each block
        whose last holder noted it as the block the log says left (same content hash), under the
        key and parent noted, with the log's tokens, as ``demote`` stores a batch; every removed
        block is un-noted. Returns (the blocks the log demoted and were noted, the high words of
        the keys stored, the high words of the entries evicted, the copy rows)."""
        cdef EvEntry *entry
        cdef Py_ssize_t e, i, hash_at = 0, token_at = 0, id_at = 0, count, known = 0, fresh = 0
        cdef Py_ssize_t bs = self.block_size, num_rows = 0, num_evicted = 0, repeated = -1
        cdef int32_t block
        cdef uint64_t hash_value
        cdef const int32_t *ids = raw._log.ids
        if self._bound is None:
            raise InvalidId("demote_removed: no arrays bound (bind_blocks)")
        for e in range(raw._log.num_entries):  # bounds first: a block id the pool does not have
            entry = raw._log.entries + e
            if entry.kind == 2 and entry.has_ids:
                if entry.num_tokens != entry.count * bs:
                    raise InvalidId(
                        f"demote_removed: a removal of {entry.count} blocks carries {entry.num_tokens} tokens"
                    )
                for i in range(id_at, id_at + entry.count):
                    if not 0 <= ids[i] < self.num_device_blocks:
                        raise BlockIdOutOfRange(
                            f"demote_removed: block id {ids[i]} is out of range: valid values are "
                            f"0..{self.num_device_blocks - 1}"
                        )
                id_at += entry.count
        if id_at > raw._log.num_ids:
            raise InvalidId(f"demote_removed: the log names {id_at} ids and holds {raw._log.num_ids}")
        cdef PyThreadState *released = lc_enter(&self._mutex, id_at < NOGIL_MIN_WORK)
        if not self._reserve_gather(id_at) or not self._reserve_seen(id_at) or not self._reserve_sort(id_at):
            lc_leave(&self._mutex, released)
            raise MemoryError(f"HostIndex.demote_removed: no scratch memory for {id_at} blocks")
        id_at = 0
        # What is demoted is read before any block is un-noted (a block id may be removed twice).
        for e in range(raw._log.num_entries):
            entry = raw._log.entries + e
            count = entry.count
            if entry.kind == 2 and entry.has_ids:
                for i in range(count):
                    block = ids[id_at + i]
                    hash_value = raw._log.hashes[hash_at + i]
                    if self._bvalid[block] and self._bhashes[block] == hash_value:
                        self._gkeys[2 * known] = self._bkeys[2 * block]
                        self._gkeys[2 * known + 1] = self._bkeys[2 * block + 1]
                        self._gparents[2 * known] = self._bparents[2 * block]
                        self._gparents[2 * known + 1] = self._bparents[2 * block + 1]
                        memcpy(self._gtokens + known * bs, raw._log.tokens + token_at + i * bs, bs * sizeof(int32_t))
                        self._gids[known] = block
                        known += 1
                id_at += count
            hash_at += count
            token_at += entry.num_tokens
        for i in range(id_at):
            self._bvalid[ids[i]] = 0
            self._breused[ids[i]] = 0
        repeated = self._first_repeated_id(self._gids, known) if known else -1
        lc_leave(&self._mutex, released)
        if repeated >= 0:
            raise InvalidId(f"demote_removed: block id {self._gids[repeated]} is demoted twice in one log")
        stored = np.empty(known, dtype=np.int64)
        evicted = np.empty(min(known, self.capacity), dtype=np.uint64)
        rows = np.empty((known * self._num_layers, 3), dtype=np.int64)
        if known == 0:
            return 0, stored.view(np.uint64), evicted, rows
        cdef int64_t[::1] stored_view = stored
        cdef uint64_t[::1] evicted_view = evicted
        cdef int64_t[:, ::1] row_view = rows
        released = lc_enter(&self._mutex, known < NOGIL_MIN_WORK)
        fresh = self._demote(self._gkeys, self._gparents, self._gtokens, self._gids, known,
                             &row_view[0, 0], &num_rows, &stored_view[0], &evicted_view[0], &num_evicted)
        for i in range(fresh):  # positions -> the high words stored
            stored_view[i] = <int64_t>self._gkeys[2 * stored_view[i]]
        lc_leave(&self._mutex, released)
        if fresh < 0:
            raise MemoryError(f"HostIndex.demote_removed: no scratch memory for a batch of {known} blocks")
        return known, stored[:fresh].view(np.uint64), evicted[:num_evicted], rows[:num_rows]

    def forget(self, keys):
        """Drop the entries of the high words ``keys`` (uint64) that the last ``demote`` stored and
        whose copy failed: their slots hold nothing usable. They count as never stored."""
        cdef const uint64_t[::1] key_view = keys
        cdef Py_ssize_t i, found
        cdef int32_t slot
        cdef PyThreadState *released = lc_enter(&self._mutex, True)
        for i in range(key_view.shape[0]):
            found = self._find(key_view[i])
            if found < 0:
                continue
            slot = self._table[found].slot
            self._unlink(slot)
            self._table_remove(key_view[i])
            self._free[self._num_free] = slot
            self._num_free += 1
            self.num_blocks -= 1
            self._counts[C_STORED] -= 1
            self._counts[C_BYTES_DEMOTED] -= self.slot_bytes
        lc_leave(&self._mutex, released)

    def lookup(self, keys, tokens, uint64_t first_high, uint64_t first_low, parents=None):
        """The length of the leading run of ``keys`` ((n, 2) uint64) held as the blocks asked for:
        key, ``tokens`` ((n, block_size) int32) and parent (each after the key before it, the first
        after (``first_high``, ``first_low``); or each after its row of ``parents``). Those entries
        become the most recently used, the first most; a run cut short by an entry that is another
        block counts one collision."""
        cdef Py_ssize_t count = keys.shape[0]
        self._check_batch("lookup", keys, parents, tokens, count)
        if count == 0:
            return 0
        cdef const uint64_t[:, ::1] key_view = keys
        cdef const int32_t[:, ::1] token_view = tokens
        cdef const uint64_t[:, ::1] parent_view
        cdef const uint64_t *parent_rows = NULL
        if parents is not None:
            parent_view = parents
            parent_rows = &parent_view[0, 0]
        cdef int32_t *slots = <int32_t *>malloc(count * sizeof(int32_t))
        if slots == NULL:
            raise MemoryError(f"HostIndex.lookup: no scratch memory for {count} blocks")
        cdef Py_ssize_t run, found, i
        cdef PyThreadState *released = lc_enter(&self._mutex, count < NOGIL_MIN_WORK)
        run = self._held_run(&key_view[0, 0], count, slots)
        found = self._verified_run(slots, run, &key_view[0, 0], parent_rows, first_high, first_low,
                                   &token_view[0, 0])
        if found < run:
            self._counts[C_COLLISIONS] += 1
        for i in range(found - 1, -1, -1):
            self._unlink(slots[i])
            self._append(slots[i])
        self._counts[C_LOOKUPS] += count
        self._counts[C_HITS] += found
        lc_leave(&self._mutex, released)
        free(slots)
        return found

    def promote(self, keys, tokens, block_ids, uint64_t first_high, uint64_t first_low, parents=None):
        """The (dst, src, nbytes) rows copying the entries of ``keys`` into the device blocks
        ``block_ids``, once each entry is found to be the block asked for (as ``lookup`` checks).
        ``InvalidId`` names a key the tier does not hold, or holds as another block. Recency and
        counters are unchanged (``promoted`` counts a copy made)."""
        cdef Py_ssize_t count = block_ids.shape[0]
        self._check_batch("promote", keys, parents, tokens, count)
        rows = np.empty((count * self._num_layers, 3), dtype=np.int64)
        if count == 0:
            return rows
        cdef const uint64_t[:, ::1] key_view = keys
        cdef const int32_t[:, ::1] token_view = tokens
        cdef const int64_t[::1] id_view = block_ids
        cdef int64_t[:, ::1] row_view = rows
        cdef const uint64_t[:, ::1] parent_view
        cdef const uint64_t *parent_rows = NULL
        if parents is not None:
            parent_view = parents
            parent_rows = &parent_view[0, 0]
        cdef int32_t *slots = <int32_t *>malloc(count * sizeof(int32_t))
        if slots == NULL:
            raise MemoryError(f"HostIndex.promote: no scratch memory for {count} blocks")
        cdef Py_ssize_t run, verified = 0, num_rows = 0
        cdef PyThreadState *released = lc_enter(&self._mutex, count < NOGIL_MIN_WORK)
        run = self._held_run(&key_view[0, 0], count, slots)
        if run == count:
            verified = self._verified_run(slots, run, &key_view[0, 0], parent_rows, first_high, first_low,
                                          &token_view[0, 0])
            if verified == count:
                num_rows = self._rows(slots, &id_view[0], count, False, &row_view[0, 0])
        lc_leave(&self._mutex, released)
        free(slots)
        if run < count:
            raise InvalidId(
                f"promote: key {key_view[run, 0]:#018x} is not in the host tier ({self.num_blocks} blocks held); "
                "promote what lookup found, before anything else is demoted"
            )
        if verified < count:
            raise InvalidId(
                f"promote: the host tier holds key {key_view[verified, 0]:#018x} as another block than asked for "
                "(its key, parent or tokens differ); promote only what lookup found"
            )
        return rows[:num_rows]

    def promoted(self, Py_ssize_t count):
        """Count ``count`` blocks copied to the device."""
        self._counts[C_PROMOTED] += count
        self._counts[C_BYTES_PROMOTED] += count * self.slot_bytes

    def load(self, keys, parents, tokens):
        """Put blocks read from the store into the tier, as ``demote`` stores (same recency and room
        rules), one record after another: a key held as the same block is a duplicate, one held as
        another block is replaced by the record. Returns (the slot of each record, -1 for a
        duplicate; the positions of the records stored and still held; the high words of the
        entries removed, evicted or replaced). The caller writes each stored record's KV into its
        slot, in record order."""
        cdef Py_ssize_t count = keys.shape[0]
        self._check_batch("load", keys, parents, tokens, count)
        slots = np.empty(count, dtype=np.int64)
        stored = np.empty(count, dtype=np.int64)
        removed = np.empty(count, dtype=np.uint64)
        if count == 0:
            return slots, stored, removed
        cdef const uint64_t[:, ::1] key_view = keys
        cdef const uint64_t[:, ::1] parent_view = parents
        cdef const int32_t[:, ::1] token_view = tokens
        cdef int64_t[::1] slot_view = slots
        cdef int64_t[::1] stored_view = stored
        cdef uint64_t[::1] removed_view = removed
        cdef Py_ssize_t num_stored = 0, num_removed = 0
        cdef PyThreadState *released = lc_enter(&self._mutex, count < NOGIL_MIN_WORK)
        self._load(&key_view[0, 0], &parent_view[0, 0], &token_view[0, 0], count, &slot_view[0], &stored_view[0],
                   &num_stored, &removed_view[0], &num_removed)
        lc_leave(&self._mutex, released)
        return slots, stored[:num_stored], removed[:num_removed]

    def find(self, const uint64_t[::1] keys):
        """The slot holding each high word of ``keys``, -1 where none does; recency unchanged."""
        cdef Py_ssize_t count = keys.shape[0], i, found
        out = np.empty(count, dtype=np.int64)
        cdef int64_t[::1] out_view = out
        cdef PyThreadState *released = lc_enter(&self._mutex, count < NOGIL_MIN_WORK)
        for i in range(count):
            found = self._find(keys[i])
            out_view[i] = self._table[found].slot if found >= 0 else -1
        lc_leave(&self._mutex, released)
        return out

    def contains(self, uint64_t key):
        """Whether an entry's key has the high word ``key``."""
        return self._find(key) >= 0

    def lru_order(self):
        """The high words of the held keys, least recently used first."""
        out = np.empty(self.num_blocks, dtype=np.uint64)
        cdef uint64_t[::1] view = out
        cdef Py_ssize_t i = 0
        cdef int32_t slot = self._head
        while slot >= 0 and i < self.num_blocks:
            view[i] = self._keys[2 * slot]
            i += 1
            slot = self._next[slot]
        return out

    @property
    def keys(self):
        """Each slot's key, (capacity, 2) uint64 (high, low); meaningful for held slots only."""
        return self._key_array

    @property
    def parents(self):
        """Each slot's parent's key, as ``keys``."""
        return self._parent_array

    @property
    def tokens(self):
        """Each slot's tokens, (capacity, block_size) int32."""
        return self._token_array

    def clear(self):
        """Drop every entry, counted as ``cleared``; returns how many."""
        cdef Py_ssize_t held = self.num_blocks
        cdef PyThreadState *released = lc_enter(&self._mutex, self.capacity < NOGIL_MIN_WORK)
        self._counts[C_CLEARED] += held
        self._reset()
        lc_leave(&self._mutex, released)
        return held

    def counts(self):
        """The counters, by the names of ``COUNT_NAMES``."""
        return {name: self._counts[i] for i, name in enumerate(COUNT_NAMES)}

    def check_invariants(self):
        """Recount from scratch; ``InvariantViolation`` names the first mismatch."""
        lc_enter_gil(&self._mutex)
        try:
            problem = self._problem()
        finally:
            lc_leave(&self._mutex, NULL)
        if problem is not None:
            raise InvariantViolation(problem)

    cdef object _problem(self):
        """(Mutex held) the first mismatch of a recount, None when there is none."""
        cdef Py_ssize_t walked = 0, in_table = 0, i, found
        cdef int32_t slot = self._head, before = -1
        cdef int64_t added, dropped
        cdef uint32_t mark = self._next_epoch()
        problem = None
        while slot >= 0 and problem is None:
            if not 0 <= slot < self.capacity:
                problem = f"HostIndex: slot {slot} is outside 0..{self.capacity - 1}"
            elif self._slot_marks[slot] == mark:
                problem = f"HostIndex: slot {slot} is twice on the LRU list"
            elif self._prev[slot] != before:
                problem = f"HostIndex: slot {slot}'s previous entry is {self._prev[slot]}, not {before}"
            else:
                self._slot_marks[slot] = mark
                found = self._find(self._keys[2 * slot])
                if found < 0 or self._table[found].slot != slot:
                    problem = f"HostIndex: slot {slot}'s key {self._keys[2 * slot]:#018x} does not find it"
                walked += 1
                before = slot
                slot = self._next[slot]
        if problem is None and before != self._tail:
            problem = f"HostIndex: the LRU list ends at slot {before}, its tail is {self._tail}"
        for i in range(<Py_ssize_t>self._mask + 1):
            if problem is None and self._table[i].slot >= 0:
                in_table += 1
        if problem is None and (walked != self.num_blocks or in_table != self.num_blocks):
            problem = (
                f"HostIndex: {walked} slots on the LRU list, {in_table} in the table, {self.num_blocks} held"
            )
        for i in range(self._num_free):
            if problem is not None:
                break
            slot = self._free[i]
            if not 0 <= slot < self.capacity:
                problem = f"HostIndex: free slot {slot} is outside 0..{self.capacity - 1}"
            elif self._slot_marks[slot] == mark:
                problem = f"HostIndex: slot {slot} is both held and free"
            else:
                self._slot_marks[slot] = mark
        if problem is None and self.num_blocks + self._num_free != self.capacity:
            problem = f"HostIndex: {self.num_blocks} held + {self._num_free} free slots != capacity {self.capacity}"
        added = self._counts[C_STORED] + self._counts[C_LOADED]
        dropped = self._counts[C_EVICTED] + self._counts[C_REPLACED] + self._counts[C_CLEARED]
        if problem is None and added - dropped != self.num_blocks:
            problem = (
                f"HostIndex: {added} blocks added - {dropped} evicted, replaced or cleared != {self.num_blocks} held"
            )
        return problem
