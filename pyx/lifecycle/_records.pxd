# The per-request records of a KV cache core, module lifecycle._records: one C record per request
# (tokens and block table in a Chunk, the pin on its cached path, adapter slot, status), found by
# a handle that carries its slot's generation, and the record's Python face, ``SequenceState``.
# Everything is guarded by the core's lock (``CoreLock``); the core owns the one ``Records``.

cimport cython
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t

from lifecycle._args cimport _ssize_arg_other

from lifecycle._blockpool cimport BatchResult, BlockPool
from lifecycle._radix cimport Chunk, ChunkCache, RadixTrie
from lifecycle._slots cimport SlotGuard
from lifecycle._sync cimport CoreLock


cdef struct SeqRec:
    Chunk *chunk               # tokens and block table (NULL when the slot is unused)
    int64_t adapter            # adapter key: the trie root its prefix lives under
    int64_t seq_id
    int32_t adapter_slot       # the caller's adapter slot index this request holds, -1 = none
    int32_t num_tokens
    int32_t prompt_len
    int32_t num_blocks
    int32_t cached_tokens      # prompt tokens whose KV came from the cache
    int32_t lazy_tokens        # leading tokens not written to the chunk: those of its pinned path
    int32_t pin_node           # end of the cached path it holds pinned, -1 = none
    int32_t pin_blocks         # blocks from the root to the end of pin_node
    int32_t ssm_tokens         # tokens the SSM state has consumed, -1 = as many as num_tokens
    int32_t kv_tokens          # (KV cache groups) tokens whose KV exists: windows released up to them
    int32_t rolling            # its rolling snapshot id, -1 = none
    uint32_t rolling_generation
    uint32_t generation        # bumped at every reuse of the slot: stale handles are refused
    int32_t next_free
    uint8_t status
    uint8_t failed
    uint32_t step_stamp        # the last step() that listed it (one listing per step)


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
    E_GROUPS = 14           # a call a core with several KV cache groups does not offer


# Why a locked step failed (raised once the lock is released: ``Records.raise_failure``).
cdef struct Failure:
    int code
    int64_t value
    int64_t limit
    int32_t group              # the KV cache group (E_OUT_OF_BLOCKS, E_REFUSED)
    int64_t pinned             # (E_OUT_OF_BLOCKS of a group) its cached blocks only pinned prefixes hold
    BatchResult batch


cdef inline void ok(Failure *f) noexcept nogil:
    f.code = OK
    f.group = 0
    f.batch.failed_at = -1


cdef inline Py_ssize_t blocks_for(Py_ssize_t tokens, Py_ssize_t block_size) noexcept nogil:
    return (tokens + block_size - 1) // block_size


# A handle is (generation << 32) | record index.
cdef inline Py_ssize_t record_index(int64_t handle) noexcept nogil:
    return <Py_ssize_t>(handle & 0xFFFFFFFFLL)


cdef inline int64_t handle_arg(object handle, str call) except? -1:
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


cdef class SequenceState


@cython.final
cdef class Records:
    cdef SeqRec *_recs
    cdef Py_ssize_t _capacity
    cdef Py_ssize_t _high_water     # record slots ever used: [0, _high_water) holds every record
    cdef int32_t _free              # first unused slot below _high_water, -1 = none
    cdef uint32_t _generation_base  # generations of these record slots start after it
    cdef Py_ssize_t _block_size
    cdef Py_ssize_t _max_blocks     # blocks a record may hold
    cdef Py_ssize_t _max_tokens     # tokens a record may hold
    cdef uint32_t _step_stamp       # the last decode step's (0: none; see SeqRec.step_stamp)
    cdef readonly Py_ssize_t num_live
    cdef readonly int64_t num_opened
    cdef readonly int64_t num_closed
    cdef readonly int64_t next_seq_id
    cdef readonly bint closed       # every call but the core's close is refused
    cdef readonly RadixTrie trie    # the chunk cache records take chunks from, the pinned paths' tokens
    cdef readonly BlockPool pool    # named in errors
    cdef readonly CoreLock lock

    # -- (lock held) --

    cdef inline SeqRec *get(self, int64_t handle, Failure *f) noexcept nogil:
        """The live record of ``handle``; NULL (``f`` says why) for a stale or foreign handle or a
        closed table."""
        cdef Py_ssize_t index = record_index(handle)
        cdef SeqRec *rec
        if self.closed:
            f.code = E_CLOSED
            return NULL
        if handle < 0 or index >= self._high_water:
            f.code = E_HANDLE
            f.value = handle
            return NULL
        rec = &self._recs[index]
        if rec.status == FREE or rec.generation != <uint32_t>(handle >> 32):
            f.code = E_HANDLE
            f.value = handle
            return NULL
        return rec

    cdef inline SeqRec *active(self, int64_t handle, Failure *f) noexcept nogil:
        """``get``, refusing a record that is not active."""
        cdef SeqRec *rec = self.get(handle, f)
        if rec != NULL and rec.status != ACTIVE:
            f.code = E_STATE
            f.value = rec.seq_id
            f.limit = rec.status
            return NULL
        return rec

    cdef inline SeqRec *of(self, int64_t handle) noexcept nogil:
        """The record of a handle checked by ``get`` under the same lock."""
        return &self._recs[record_index(handle)]

    cdef inline Py_ssize_t high_water(self) noexcept nogil:
        return self._high_water

    cdef inline SeqRec *slot(self, Py_ssize_t index) noexcept nogil:
        """Record slot ``index`` (below ``high_water``): its status says whether it is in use."""
        return &self._recs[index]

    cdef inline Py_ssize_t nbytes(self) noexcept nogil:
        """Bytes of the record table."""
        return self._capacity * sizeof(SeqRec)

    cdef inline void materialize(self, SeqRec *rec) noexcept nogil:
        """Write the record's leading tokens that only its pinned path held (attach copies just
        what the cache did not have)."""
        if rec.lazy_tokens:
            self.trie._path_tokens(rec.pin_node, rec.chunk.tokens, rec.lazy_tokens // self._block_size)
            rec.lazy_tokens = 0

    cdef int64_t open(self, int64_t adapter, int32_t adapter_slot, Py_ssize_t tokens, Failure *f) noexcept nogil
    cdef void close(self, SeqRec *rec) noexcept nogil
    cdef void withdraw(self) noexcept nogil
    cdef Py_ssize_t close_all(self) noexcept nogil
    cdef int reserve(self, SeqRec *rec, Py_ssize_t blocks, Py_ssize_t tokens) noexcept nogil
    cdef Chunk *unshared(self, SeqRec *rec, Failure *f) noexcept nogil
    cdef Py_ssize_t clear_record(self, SeqRec *rec, Chunk *fresh, Failure *f) noexcept nogil
    cdef void append_locked(self, int64_t handle, const int32_t *data, Py_ssize_t n, Failure *f) noexcept nogil
    cdef Py_ssize_t check_step(
        self, const int64_t *hs, Py_ssize_t n, const int32_t *tok, Py_ssize_t num_tok, const int32_t *cnt,
        const int32_t *row_of, Py_ssize_t nrows, Py_ssize_t ncols, Failure *f
    ) noexcept nogil

    # -- (GIL held, lock released) --

    cdef str problem(self, int64_t[::1] refs, dict pins, dict chunk_refs)
    cdef int raise_failure(self, Failure *f, str call, object tokens=*) except -1
    cdef SeqRec *read(self, int64_t handle, str call) except NULL
    cdef object tokens(self, int64_t handle)
    cdef object block_table(self, int64_t handle)
    cdef object block_hashes(self, int64_t handle)
    cdef tuple info(self, int64_t handle)
    cdef int32_t field(self, int64_t handle, int which) except? -2
    cdef int set_field(self, int64_t handle, int which, int64_t value, str call) except -1
    cdef int64_t open_record(self, int64_t key, int32_t slot, Py_ssize_t tokens, int64_t *seq_id) except -1
    cdef int bind(self, int64_t handle, str call, int32_t adapter_slot, int64_t key) except -1
    cdef int64_t cache_key(self, int64_t handle) except? -1
    cdef object adapter_slots(self)
    cdef tuple live_totals(self)
    cdef Py_ssize_t common_prefix(self, const int64_t *hs, Py_ssize_t n) except -1
    cdef Py_ssize_t write_table(self, int64_t handle, int32_t[::1] dest, int32_t pad_id) except -1
    cdef Py_ssize_t allocate(self, int64_t handle, Py_ssize_t wanted, str call) except -1
    cdef SequenceState face(self, object seq)
    cdef int64_t open_handle(self, object seq, str call) except -1
    cdef Py_ssize_t blocks_for_tokens(self, int64_t handle, object num_tokens, str call) except -1
    cdef int64_t seq_id_of(self, int64_t handle)
    cdef int append(self, int64_t handle, object tokens) except -1
    cdef bint is_live(self, int64_t handle) noexcept


cdef Records new_records(RadixTrie trie, BlockPool pool, CoreLock lock, Py_ssize_t block_size,
                         Py_ssize_t max_blocks, Py_ssize_t max_tokens)


@cython.final
cdef class SequenceState:
    cdef Records _records
    cdef object _core                  # the core it belongs to (kept alive with it)
    cdef int64_t _handle
    cdef readonly int64_t seq_id
    cdef object _guard                 # the guard of its SSM slot (None once detached)
    cdef bint _open                    # the model has not released it yet
    cdef bint _grouped                 # its core has KV cache groups: appends go through the core
    cdef public Py_ssize_t budget_tokens
    cdef object _addrs_by_slot
    cdef object _draft_tokens
    cdef object _drop_queue
    cdef object __weakref__

    cdef inline int64_t handle_in(self, Records records) noexcept:
        """Its handle if it is a record of ``records``, else -1."""
        return self._handle if self._records is records else -1

    cdef object close(self)


cdef SequenceState new_sequence(Records records, object core, int64_t handle, int64_t seq_id, SlotGuard guard,
                                object addrs_by_slot, Py_ssize_t budget_tokens, object drop_queue)
