# The SSM state slot pool and its owning guards, module lifecycle._slots. It lives under
# pyx/lifecycle/ because Cython finds the .pxd of module lifecycle._slots by its package path on the
# include path; other Cython modules cimport it as ``from lifecycle._slots cimport SlotPool``.
cimport cython

from lifecycle._sync cimport lc_mutex_t
from libc.stdint cimport int32_t, int64_t, uint8_t


@cython.final
cdef class SlotPool:
    cdef int32_t _num_slots
    cdef int32_t _num_free
    cdef int32_t _num_guarded
    cdef int32_t _num_detached
    # _free_stack[0:_num_free] are the free slots, top last; _stack_pos[slot] is its index there
    # (-1 when not free), so claim_specific removes an arbitrary free slot in O(1).
    cdef int32_t* _free_stack
    cdef int32_t* _stack_pos
    cdef uint8_t* _state
    # Per slot, the owner the holder of its guard recorded (-1: none) and that guard (a borrowed
    # reference, cleared when the guard lets go), so the slot's owner is found from the slot.
    cdef int64_t* _owners
    cdef void** _guards
    cdef lc_mutex_t _lock           # the one lock form (lifecycle._sync), taken without the GIL

    cdef SlotGuard _guard_for(self, int32_t slot)
    cdef SlotGuard _acquire(self)
    cdef void _forget(self, int32_t slot)
    cdef int32_t _pop_free(self) noexcept nogil
    cdef int _claim(self, int32_t slot) noexcept nogil
    cdef int _release(self, int32_t slot) noexcept nogil
    cdef int _detach(self, int32_t slot) noexcept nogil
    cdef uint8_t _state_of(self, int32_t slot) noexcept nogil
    cdef int32_t _slot_arg(self, object slot) except -1


@cython.final
cdef class SlotGuard:
    cdef SlotPool _pool
    cdef int32_t _slot

    cdef bint _let_go(self) except -1
    cdef void _record_owner(self, int64_t owner) noexcept
