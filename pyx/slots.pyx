# cython: autotestdict=False, binding=False
"""SSM state slots: a fixed pool of slot indices and the guards that own them.

A slot is in exactly one of three states:

* **free** - on the free list; :meth:`SlotPool.acquire` may hand it out;
* **guarded** - owned by exactly one :class:`SlotGuard`, which releases it exactly once
  (explicitly, on ``with`` exit, or when the guard is garbage-collected, like a Rust ``Drop``);
* **detached** - its guard gave it up with :meth:`SlotGuard.take` without releasing it (a retired
  sequence whose slot a survivor is compacted into). Nobody releases a detached slot;
  :meth:`SlotPool.claim_specific` hands it to its next owner.

Every transition is checked against the pool's own per-slot state, so no sequence of calls can
put a slot on the free list twice or hand one slot to two guards.
"""

cimport cython
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint8_t
from libc.stdlib cimport free, malloc

from lifecycle._sync cimport lc_mutex_init, lc_mutex_lock, lc_mutex_unlock

from operator import index as _as_index

from lifecycle.errors import (
    ConfigError,
    DoubleFree,
    InvariantViolation,
    OutOfSlots,
    SlotInUse,
    SlotOutOfRange,
)


cdef enum:
    FREE = 0
    GUARDED = 1
    DETACHED = 2

cdef const char* _STATE_NAMES[3]
_STATE_NAMES[0] = b"free"
_STATE_NAMES[1] = b"guarded"
_STATE_NAMES[2] = b"detached"


cdef str _state_name(uint8_t state):
    return _STATE_NAMES[state].decode("ascii") if state <= DETACHED else f"corrupt({state})"


@cython.final
@cython.auto_pickle(False)
cdef class SlotPool:
    """A fixed set of slots ``0 .. num_slots-1``, handed out through :class:`SlotGuard` objects.

    Thread-safe: every state change happens under the pool's own lock with the GIL released.
    """

    def __init__(self, num_slots):
        """A pool of ``num_slots`` free slots."""
        if self._state != NULL:
            raise ConfigError(f"this SlotPool already holds {self._num_slots} slots; make a new one")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 0 <= num_slots <= INT32_MAX:
            raise ConfigError(f"num_slots must be an int in [0, {INT32_MAX}], got {num_slots!r}")
        cdef int32_t n = num_slots
        # At least one element each, so that a pool of 0 slots still has valid pointers.
        cdef size_t alloc_count = n + 1
        cdef int32_t* free_stack = <int32_t*>malloc(alloc_count * sizeof(int32_t))
        cdef int32_t* stack_pos = <int32_t*>malloc(alloc_count * sizeof(int32_t))
        cdef uint8_t* state = <uint8_t*>malloc(alloc_count * sizeof(uint8_t))
        cdef int64_t* owners = <int64_t*>malloc(alloc_count * sizeof(int64_t))
        cdef void** guards = <void**>malloc(alloc_count * sizeof(void*))
        if free_stack == NULL or stack_pos == NULL or state == NULL or owners == NULL or guards == NULL:
            free(free_stack)
            free(stack_pos)
            free(state)
            free(owners)
            free(guards)
            raise MemoryError(f"SlotPool({n}): cannot allocate its tables")
        cdef int32_t i
        # Slot 0 on top, so a fresh pool hands out 0, 1, 2, ... in order.
        for i in range(n):
            free_stack[i] = n - 1 - i
            stack_pos[n - 1 - i] = i
            state[i] = FREE
            owners[i] = -1
            guards[i] = NULL
        self._owners = owners
        self._guards = guards
        lc_mutex_init(&self._lock)
        self._free_stack = free_stack
        self._stack_pos = stack_pos
        self._state = state
        self._num_slots = n
        self._num_free = n
        self._num_guarded = 0
        self._num_detached = 0

    def __dealloc__(self):
        # Guards keep their pool alive, so no guard can outlive these arrays.
        free(self._free_stack)
        free(self._stack_pos)
        free(self._state)
        free(self._owners)
        free(self._guards)

    # --- C-level state transitions: O(1), under the lock, no GIL ------------------------------

    cdef int32_t _pop_free(self) noexcept nogil:
        cdef int32_t slot = -1
        lc_mutex_lock(&self._lock)
        if self._num_free > 0:
            self._num_free -= 1
            slot = self._free_stack[self._num_free]
            self._stack_pos[slot] = -1
            self._state[slot] = GUARDED
            self._num_guarded += 1
        lc_mutex_unlock(&self._lock)
        return slot

    cdef int _claim(self, int32_t slot) noexcept nogil:
        """Free or detached -> guarded; returns the previous state (nothing changes if guarded)."""
        cdef int32_t pos, last
        cdef uint8_t previous
        lc_mutex_lock(&self._lock)
        previous = self._state[slot]
        if previous == FREE:
            # Remove from the middle of the free stack: move the top entry into its place.
            pos = self._stack_pos[slot]
            self._num_free -= 1
            last = self._free_stack[self._num_free]
            self._free_stack[pos] = last
            self._stack_pos[last] = pos
            self._stack_pos[slot] = -1
        elif previous == DETACHED:
            self._num_detached -= 1
        if previous == FREE or previous == DETACHED:
            self._state[slot] = GUARDED
            self._num_guarded += 1
        lc_mutex_unlock(&self._lock)
        return previous

    cdef int _release(self, int32_t slot) noexcept nogil:
        """Guarded -> free; returns the previous state (nothing changes unless it was guarded)."""
        cdef uint8_t previous
        lc_mutex_lock(&self._lock)
        previous = self._state[slot]
        if previous == GUARDED:
            self._state[slot] = FREE
            self._stack_pos[slot] = self._num_free
            self._free_stack[self._num_free] = slot
            self._num_free += 1
            self._num_guarded -= 1
        lc_mutex_unlock(&self._lock)
        return previous

    cdef int _detach(self, int32_t slot) noexcept nogil:
        """Guarded -> detached; returns the previous state (nothing changes unless it was guarded)."""
        cdef uint8_t previous
        lc_mutex_lock(&self._lock)
        previous = self._state[slot]
        if previous == GUARDED:
            self._state[slot] = DETACHED
            self._num_guarded -= 1
            self._num_detached += 1
        lc_mutex_unlock(&self._lock)
        return previous

    cdef uint8_t _state_of(self, int32_t slot) noexcept nogil:
        cdef uint8_t state
        lc_mutex_lock(&self._lock)
        state = self._state[slot]
        lc_mutex_unlock(&self._lock)
        return state

    cdef int32_t _slot_arg(self, object slot) except -1:
        """Validate a slot argument: an int (numpy integers too, bool not) in 0..num_slots-1."""
        if isinstance(slot, bool) or not hasattr(type(slot), "__index__"):
            raise SlotOutOfRange(f"slot must be an int, got {slot!r}")
        cdef object value = _as_index(slot)
        if value < 0 or value >= self._num_slots:
            if self._num_slots == 0:
                raise SlotOutOfRange(f"slot {value} is out of range: the pool has no slots")
            raise SlotOutOfRange(
                f"slot {value} is out of range: valid slots are 0..{self._num_slots - 1}"
            )
        return <int32_t>value

    cdef SlotGuard _guard_for(self, int32_t slot):
        cdef SlotGuard guard = SlotGuard.__new__(SlotGuard)
        guard._pool = self
        guard._slot = slot
        self._guards[slot] = <void*>guard
        self._owners[slot] = -1
        return guard

    cdef void _forget(self, int32_t slot):
        """(GIL held) the guard of ``slot`` let go of it."""
        self._guards[slot] = NULL
        self._owners[slot] = -1

    # --- Python API ---------------------------------------------------------------------------

    @property
    def num_total(self):
        """Number of slots the pool manages."""
        return self._num_slots

    @property
    def num_free(self):
        """Slots on the free list (neither guarded nor detached)."""
        return self._num_free

    @property
    def num_guarded(self):
        """Slots currently owned by a guard."""
        return self._num_guarded

    @property
    def num_detached(self):
        """Slots given up with :meth:`SlotGuard.take` and not claimed again yet."""
        return self._num_detached

    def acquire(self):
        """Take a free slot; the returned guard owns it. Raises :class:`OutOfSlots` when none is free."""
        return self._acquire()

    cdef SlotGuard _acquire(self):
        cdef int32_t slot = self._pop_free()  # O(1) under the pool's lock: not worth handing the GIL over
        if slot < 0:
            raise OutOfSlots(
                f"no free slot: all {self._num_slots} slots are taken "
                f"({self._num_guarded} guarded, {self._num_detached} detached)"
            )
        return self._guard_for(slot)

    def claim_specific(self, slot):
        """Take the given slot, which must be free (it leaves the free list, so it is never handed
        out twice) or detached. Raises :class:`SlotOutOfRange`, or :class:`SlotInUse` if a guard
        owns it; nothing changes on error."""
        cdef int32_t wanted = self._slot_arg(slot)
        cdef int previous
        previous = self._claim(wanted)
        if previous == GUARDED:
            raise SlotInUse(
                f"slot {wanted} is owned by a live guard; only a free or detached slot can be "
                f"claimed (pool of {self._num_slots} slots)"
            )
        return self._guard_for(wanted)

    def owner_of(self, slot):
        """The owner recorded on the guard of ``slot`` (``SlotGuard.owner``), -1 when the slot is
        not guarded or its guard recorded none. Raises :class:`SlotOutOfRange`."""
        cdef int32_t wanted = self._slot_arg(slot)
        return self._owners[wanted] if self._guards[wanted] != NULL else -1

    def guard_of(self, slot):
        """The guard that owns ``slot``, or None when it is free or detached. Raises
        :class:`SlotOutOfRange`."""
        cdef int32_t wanted = self._slot_arg(slot)
        if self._guards[wanted] == NULL:
            return None
        return <SlotGuard>self._guards[wanted]

    def is_free(self, slot):
        """Whether ``slot`` is on the free list. Raises :class:`SlotOutOfRange`."""
        cdef int32_t wanted = self._slot_arg(slot)
        return self._state_of(wanted) == FREE

    def is_detached(self, slot):
        """Whether ``slot`` was given up by its guard without being released. Raises
        :class:`SlotOutOfRange`."""
        cdef int32_t wanted = self._slot_arg(slot)
        return self._state_of(wanted) == DETACHED

    def check_invariants(self):
        """Recount every slot's state from scratch; raise :class:`InvariantViolation` on any
        mismatch with the counters or the free list."""
        cdef int32_t n = self._num_slots
        cdef int32_t i, slot, bad_slot = -1, bad_index = -1
        cdef int32_t counts[3]
        cdef int32_t num_free, num_guarded, num_detached
        cdef int problem = 0
        counts[0] = 0
        counts[1] = 0
        counts[2] = 0
        with nogil:
            lc_mutex_lock(&self._lock)
            num_free = self._num_free
            num_guarded = self._num_guarded
            num_detached = self._num_detached
            for slot in range(n):
                if self._state[slot] > DETACHED:
                    problem = 1
                    bad_slot = slot
                    break
                counts[self._state[slot]] += 1
                if (self._state[slot] == FREE) != (self._stack_pos[slot] >= 0):
                    problem = 2
                    bad_slot = slot
                    break
            if problem == 0 and (num_free < 0 or num_free > n):
                problem = 3
            if problem == 0:
                for i in range(num_free):
                    slot = self._free_stack[i]
                    if slot < 0 or slot >= n or self._state[slot] != FREE or self._stack_pos[slot] != i:
                        problem = 4
                        bad_slot = slot
                        bad_index = i
                        break
            lc_mutex_unlock(&self._lock)
        if problem == 1:
            raise InvariantViolation(f"slot {bad_slot} has a corrupt state byte")
        if problem == 2:
            raise InvariantViolation(
                f"slot {bad_slot} is {_state_name(self._state[bad_slot])} but its free-list "
                f"position is {self._stack_pos[bad_slot]}"
            )
        if problem == 3:
            raise InvariantViolation(f"free count {num_free} is outside 0..{n}")
        if problem == 4:
            raise InvariantViolation(
                f"free-list entry {bad_index} holds slot {bad_slot}, which is not a free slot "
                f"pointing back at it"
            )
        if (counts[FREE], counts[GUARDED], counts[DETACHED]) != (num_free, num_guarded, num_detached):
            raise InvariantViolation(
                f"recount (free, guarded, detached) = {(counts[FREE], counts[GUARDED], counts[DETACHED])} "
                f"but the counters say {(num_free, num_guarded, num_detached)}"
            )

    def __repr__(self):
        return (
            f"SlotPool(num_total={self._num_slots}, num_free={self._num_free}, "
            f"num_guarded={self._num_guarded}, num_detached={self._num_detached})"
        )


# Guards must be able to release in __dealloc__ even when collected as part of a reference cycle,
# so the GC must never clear their pool reference first.
@cython.final
@cython.auto_pickle(False)
@cython.no_gc_clear
cdef class SlotGuard:
    """Sole owner of one slot of a :class:`SlotPool`, or empty.

    The slot is released exactly once: by :meth:`release`, by leaving a ``with`` block, or when the
    guard is garbage-collected while still holding it. :meth:`take` empties the guard without
    releasing (the slot becomes detached). The guard keeps its pool alive.
    """

    def __init__(self, *args, **kwargs):
        """Always raises TypeError: guards come from SlotPool.acquire() or claim_specific()."""
        raise TypeError("SlotGuard objects are created by SlotPool.acquire() or SlotPool.claim_specific()")

    def __dealloc__(self):
        # Must never raise: _release is noexcept, and a slot that is not guarded is left alone.
        if self._slot >= 0 and self._pool is not None:
            self._pool._forget(self._slot)
            self._pool._release(self._slot)
            self._slot = -1

    @property
    def slot(self):
        """The owned slot, or -1 when the guard is empty."""
        return self._slot

    @property
    def held(self):
        """Whether the guard still owns a slot."""
        return self._slot >= 0

    @property
    def pool(self):
        """The pool the slot belongs to."""
        return self._pool

    @property
    def owner(self):
        """Who owns the slot through this guard, as its holder recorded it (-1: not recorded,
        or the guard is empty); the pool answers ``owner_of(slot)`` with it."""
        return self._pool._owners[self._slot] if self._slot >= 0 else -1

    @owner.setter
    def owner(self, int64_t value):
        if self._slot < 0:
            raise InvariantViolation("an empty guard has no slot to record an owner on")
        self._record_owner(value)

    cdef void _record_owner(self, int64_t owner) noexcept:
        """Record ``owner`` as the owner of the (held) slot, for ``SlotPool.owner_of``."""
        self._pool._owners[self._slot] = owner

    def release(self):
        """Put the slot back on the free list and empty the guard. Returns False (and does nothing)
        when the guard is already empty. Raises :class:`DoubleFree` if the pool does not see the
        slot as guarded; the guard is then left unchanged."""
        return self._let_go()

    cdef bint _let_go(self) except -1:
        cdef int32_t slot = self._slot
        if slot < 0:
            return False
        cdef int previous = self._pool._release(slot)
        if previous != GUARDED:
            raise DoubleFree(
                f"slot {slot} is {_state_name(previous)} in its pool of {self._pool._num_slots} "
                f"slots; a guard can only release a guarded slot"
            )
        self._pool._forget(slot)
        self._slot = -1
        return True

    def take(self):
        """Empty the guard WITHOUT releasing the slot, which becomes detached (nobody releases it;
        ``claim_specific`` gives it a new owner). Returns the slot, or -1 if the guard was empty."""
        cdef int32_t slot = self._slot
        if slot < 0:
            return -1
        cdef int previous
        previous = self._pool._detach(slot)
        if previous != GUARDED:
            raise InvariantViolation(
                f"guard holds slot {slot} but the pool sees it as {_state_name(previous)}"
            )
        self._pool._forget(slot)
        self._slot = -1
        return slot

    def move(self):
        """Transfer ownership to a new guard and empty this one (the slot stays guarded throughout).
        Moving an empty guard returns an empty guard."""
        if self._slot < 0:
            moved = SlotGuard.__new__(SlotGuard)
            (<SlotGuard>moved)._pool = self._pool
            (<SlotGuard>moved)._slot = -1
            return moved
        cdef int64_t owner = self._pool._owners[self._slot]
        cdef SlotGuard moved_guard = self._pool._guard_for(self._slot)
        self._pool._owners[self._slot] = owner
        self._slot = -1
        return moved_guard

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.release()

    def __repr__(self):
        return f"SlotGuard(slot={self._slot})" if self._slot >= 0 else "SlotGuard(empty)"
