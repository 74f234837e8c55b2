"""A sequence's SSM slot moved or given up: compaction (its state copied into another slot, which
it then owns, the old one released) and detaching (the slot kept for a survivor that owns or will
own it). ``HybridModel.compact_sequence`` and ``detach_slot_for_reuse`` call these under the
model's lock; the slots' guards (``lifecycle._slots``) say who owns what."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, final

from lifecycle.errors import SequenceStateError, SlotInUse, SlotOutOfRange

if TYPE_CHECKING:
    from lifecycle._kvcache import KVCacheCore, SequenceState
    from lifecycle._slots import SlotPool
    from lifecycle.device.base import Device
    from lifecycle.pools import SSMPool
    from lifecycle.stats import DeviceClock, ModelCounters

__all__ = ["SlotMoves"]

_ACTIVE: Final = 1
_RETIRED: Final = 2


@final
class SlotMoves:
    """The slot moves of one model: its ``core`` (a sequence's status), ``slots``, ``ssm`` pool
    (None without SSM layers: nothing to copy) on ``device``, counted in ``counters``."""

    __slots__ = ("_clock", "_core", "_counters", "_device", "_slots", "_ssm")

    def __init__(
        self, core: KVCacheCore, slots: SlotPool, ssm: SSMPool | None, device: Device, counters: ModelCounters,
        clock: DeviceClock,
    ) -> None:
        self._core, self._slots, self._ssm, self._device = core, slots, ssm, device
        self._counters, self._clock = counters, clock

    def compact(self, seq: SequenceState, handle: int, new_slot: int) -> None:
        """Move the active sequence ``seq`` (``handle``) into ``new_slot``: free, detached, or a
        retired sequence's (detached in the same step); an active sequence's raises ``SlotInUse``."""
        core, slots = self._core, self._slots
        if core.status(handle) != _ACTIVE:
            raise SequenceStateError(f"compact_sequence: sequence {seq.seq_id} is {seq.status.value}, not active")
        old_guard = seq.guard
        if old_guard is None or not old_guard.held:
            raise SequenceStateError(f"compact_sequence: sequence {seq.seq_id} is detached and owns no slot")
        if isinstance(new_slot, bool) or not isinstance(new_slot, int) or not 0 <= new_slot < slots.num_total:
            raise SlotOutOfRange(f"compact_sequence: slot {new_slot!r} out of range [0, {slots.num_total})")
        old_slot = old_guard.slot
        if new_slot == old_slot:
            return
        retired = slots.guard_of(new_slot)
        if retired is not None and core.status(retired.owner) != _RETIRED:
            raise SlotInUse(
                f"slot {new_slot} is owned by an active sequence; retire it (retire_sequence) "
                "or detach it before compacting another sequence into its slot"
            )
        if self._ssm is not None:
            with self._clock:
                self._ssm.copy_slot(old_slot, new_slot)
                self._device.synchronize()  # the old slot may be handed out as soon as it is released
        if retired is not None:
            new_guard = retired.move()  # the retired sequence's guard is empty now: it is detached
            self._counters.detaches += 1
        else:
            new_guard = slots.claim_specific(new_slot)
        new_guard.owner = handle
        seq.rebind_guard(new_guard)
        old_guard.release()
        self._counters.compactions += 1

    def detach(self, seq: SequenceState) -> None:
        """Give up the slot of ``seq`` without releasing it; a second call is a no-op."""
        guard = seq.detach_guard()
        if guard is not None and guard.held:
            guard.take()
            self._counters.detaches += 1
