"""SlotPool and SlotGuard: a slot is free, guarded by exactly one guard, or detached."""

from __future__ import annotations

import copy
import gc
import pickle
import threading

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lifecycle._slots import SlotGuard, SlotPool
from lifecycle.errors import ConfigError, LifecycleError, OutOfSlots, SlotInUse, SlotOutOfRange


def counts(pool: SlotPool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_guarded, pool.num_detached


# --- construction ---------------------------------------------------------------------------


def test_fresh_pool_has_every_slot_free() -> None:
    pool = SlotPool(5)
    assert pool.num_total == 5
    assert counts(pool) == (5, 0, 0)
    assert all(pool.is_free(slot) for slot in range(5))
    pool.check_invariants()


def test_fresh_pool_hands_out_slots_in_ascending_order() -> None:
    pool = SlotPool(3)
    guards = [pool.acquire() for _ in range(3)]
    assert [guard.slot for guard in guards] == [0, 1, 2]
    pool.check_invariants()


@pytest.mark.parametrize("bad", [-1, 2**31, True, 2.0, "4", None])
def test_invalid_slot_count_is_refused_naming_the_value(bad: object) -> None:
    with pytest.raises(ConfigError, match="num_slots") as info:
        SlotPool(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


def test_pool_of_zero_slots_is_valid_and_always_exhausted() -> None:
    pool = SlotPool(0)
    with pytest.raises(OutOfSlots):
        pool.acquire()
    with pytest.raises(SlotOutOfRange, match="no slots"):
        pool.claim_specific(0)
    pool.check_invariants()


def test_reinitialising_a_pool_is_refused() -> None:
    pool = SlotPool(2)
    guard = pool.acquire()
    with pytest.raises(ConfigError, match="already holds 2 slots"):
        pool.__init__(4)
    assert guard.slot == 0 and counts(pool) == (1, 1, 0)
    pool.check_invariants()


def test_guards_cannot_be_constructed_directly() -> None:
    with pytest.raises(TypeError, match="acquire"):
        SlotGuard()


# --- acquire and release --------------------------------------------------------------------


def test_acquire_marks_the_slot_guarded() -> None:
    pool = SlotPool(2)
    guard = pool.acquire()
    assert guard.held and guard.slot == 0
    assert not pool.is_free(0)
    assert counts(pool) == (1, 1, 0)
    pool.check_invariants()


def test_exhausted_pool_raises_out_of_slots_and_changes_nothing() -> None:
    pool = SlotPool(2)
    guards = [pool.acquire(), pool.acquire()]
    with pytest.raises(OutOfSlots, match=r"all 2 slots are taken \(2 guarded, 0 detached\)"):
        pool.acquire()
    assert counts(pool) == (0, 2, 0)
    assert [guard.slot for guard in guards] == [0, 1]
    pool.check_invariants()


def test_out_of_slots_is_a_lifecycle_error() -> None:
    with pytest.raises(LifecycleError):
        SlotPool(0).acquire()


def test_release_frees_the_slot_and_empties_the_guard() -> None:
    pool = SlotPool(2)
    guard = pool.acquire()
    assert guard.release() is True
    assert not guard.held and guard.slot == -1
    assert pool.is_free(0) and counts(pool) == (2, 0, 0)
    pool.check_invariants()


def test_second_release_is_refused_and_frees_nothing() -> None:
    pool = SlotPool(2)
    guard = pool.acquire()
    guard.release()
    other = pool.acquire()  # reuses slot 0
    assert guard.release() is False
    assert other.slot == 0 and not pool.is_free(0)
    assert counts(pool) == (1, 1, 0)
    pool.check_invariants()


def test_released_slot_is_reused_first() -> None:
    pool = SlotPool(4)
    guards = [pool.acquire() for _ in range(3)]
    guards[1].release()
    assert pool.acquire().slot == 1


def test_with_block_releases_on_exit() -> None:
    pool = SlotPool(1)
    with pool.acquire() as guard:
        assert guard.slot == 0 and not pool.is_free(0)
    assert pool.is_free(0) and not guard.held
    pool.check_invariants()


def test_with_block_releases_on_exception() -> None:
    pool = SlotPool(1)
    with pytest.raises(RuntimeError):
        with pool.acquire():
            raise RuntimeError("prefill failed")
    assert pool.is_free(0)


def test_with_block_after_explicit_release_releases_nothing_more() -> None:
    pool = SlotPool(2)
    with pool.acquire() as guard:
        guard.release()
        other = pool.acquire()
    assert other.held and not pool.is_free(other.slot)
    assert counts(pool) == (1, 1, 0)


def test_repr_shows_slot_or_empty() -> None:
    pool = SlotPool(1)
    guard = pool.acquire()
    assert repr(guard) == "SlotGuard(slot=0)"
    guard.release()
    assert repr(guard) == "SlotGuard(empty)"
    assert repr(pool) == "SlotPool(num_total=1, num_free=1, num_guarded=0, num_detached=0)"


# --- Drop semantics ---------------------------------------------------------------------------


def test_dropping_a_held_guard_releases_its_slot() -> None:
    pool = SlotPool(2)
    guard = pool.acquire()
    del guard
    assert pool.is_free(0) and counts(pool) == (2, 0, 0)
    pool.check_invariants()


def test_guard_in_a_reference_cycle_releases_when_collected() -> None:
    pool = SlotPool(2)
    cycle: list[object] = [pool.acquire()]
    cycle.append(cycle)
    del cycle
    assert not pool.is_free(0)  # only the cycle collector can reach it
    gc.collect()
    assert pool.is_free(0) and counts(pool) == (2, 0, 0)
    pool.check_invariants()


def test_dropping_a_released_guard_releases_nothing_more() -> None:
    pool = SlotPool(2)
    guard = pool.acquire()
    guard.release()
    other = pool.acquire()
    del guard
    gc.collect()
    assert other.slot == 0 and not pool.is_free(0)
    pool.check_invariants()


def test_guard_keeps_its_pool_alive() -> None:
    pool = SlotPool(2)
    guard = pool.acquire()
    del pool
    gc.collect()
    assert guard.pool.num_guarded == 1
    assert guard.release() is True
    assert guard.pool.num_free == 2


def test_last_guard_dropped_after_the_pool_name_is_gone() -> None:
    guard = SlotPool(1).acquire()
    pool = guard.pool
    del guard
    assert pool.is_free(0)


# --- take and detached slots -------------------------------------------------------------------


def test_take_empties_the_guard_without_releasing() -> None:
    pool = SlotPool(2)
    guard = pool.acquire()
    assert guard.take() == 0
    assert not guard.held and guard.slot == -1
    assert not pool.is_free(0) and pool.is_detached(0)
    assert counts(pool) == (1, 0, 1)
    pool.check_invariants()


def test_take_on_an_empty_guard_returns_minus_one() -> None:
    pool = SlotPool(1)
    guard = pool.acquire()
    guard.release()
    assert guard.take() == -1
    assert counts(pool) == (1, 0, 0)


def test_take_then_drop_releases_nothing() -> None:
    pool = SlotPool(2)
    guard = pool.acquire()
    guard.take()
    del guard
    gc.collect()
    assert pool.is_detached(0) and counts(pool) == (1, 0, 1)
    pool.check_invariants()


def test_take_then_release_releases_nothing() -> None:
    pool = SlotPool(1)
    guard = pool.acquire()
    guard.take()
    assert guard.release() is False
    assert pool.is_detached(0)


def test_detached_slot_is_never_handed_out_by_acquire() -> None:
    pool = SlotPool(2)
    pool.acquire().take()
    guard = pool.acquire()
    assert guard.slot == 1
    with pytest.raises(OutOfSlots, match=r"1 guarded, 1 detached"):
        pool.acquire()


# --- claim_specific ------------------------------------------------------------------------------


def test_claim_specific_of_a_free_slot_removes_it_from_the_free_list() -> None:
    pool = SlotPool(4)
    claimed = pool.claim_specific(2)
    assert claimed.slot == 2 and not pool.is_free(2)
    pool.check_invariants()
    handed_out = [pool.acquire() for _ in range(3)]
    assert sorted(guard.slot for guard in handed_out) == [0, 1, 3]
    with pytest.raises(OutOfSlots):
        pool.acquire()
    pool.check_invariants()


def test_claim_specific_of_a_guarded_slot_is_refused_and_changes_nothing() -> None:
    pool = SlotPool(3)
    owner = pool.acquire()
    with pytest.raises(SlotInUse, match=r"slot 0 is owned by a live guard.*3 slots"):
        pool.claim_specific(0)
    assert owner.held and counts(pool) == (2, 1, 0)
    pool.check_invariants()


def test_claim_specific_of_a_detached_slot_gives_it_a_new_owner() -> None:
    pool = SlotPool(2)
    retired = pool.acquire()
    slot = retired.take()
    survivor = pool.claim_specific(slot)
    assert survivor.slot == slot and not pool.is_detached(slot)
    assert counts(pool) == (1, 1, 0)
    pool.check_invariants()
    del retired
    assert survivor.release() is True
    assert counts(pool) == (2, 0, 0)


@pytest.mark.parametrize("bad", [-1, 4, 2**40, -(2**40)])
def test_claim_specific_out_of_range_names_slot_and_range(bad: int) -> None:
    pool = SlotPool(4)
    with pytest.raises(SlotOutOfRange, match=rf"slot {bad} is out of range: valid slots are 0\.\.3"):
        pool.claim_specific(bad)
    assert counts(pool) == (4, 0, 0)
    pool.check_invariants()


@pytest.mark.parametrize("bad", [True, 1.0, "1", None])
def test_non_integer_slot_is_refused(bad: object) -> None:
    pool = SlotPool(4)
    with pytest.raises(SlotOutOfRange, match="slot must be an int"):
        pool.claim_specific(bad)  # type: ignore[arg-type]
    assert counts(pool) == (4, 0, 0)


def test_numpy_integer_slots_are_accepted() -> None:
    pool = SlotPool(4)
    assert pool.claim_specific(np.int32(3)).slot == 3  # type: ignore[arg-type]
    assert pool.is_free(np.int64(2))  # type: ignore[arg-type]


@pytest.mark.parametrize("query", ["is_free", "is_detached"])
def test_state_queries_validate_the_slot(query: str) -> None:
    pool = SlotPool(2)
    with pytest.raises(SlotOutOfRange, match=r"slot 2 is out of range: valid slots are 0\.\.1"):
        getattr(pool, query)(2)


# --- move ------------------------------------------------------------------------------------------


def test_move_transfers_ownership_to_a_new_guard() -> None:
    pool = SlotPool(2)
    original = pool.acquire()
    moved = original.move()
    assert moved.slot == 0 and not original.held
    assert counts(pool) == (1, 1, 0)
    del original
    assert not pool.is_free(0)
    del moved
    assert pool.is_free(0)
    pool.check_invariants()


def test_moving_an_empty_guard_gives_an_empty_guard() -> None:
    pool = SlotPool(1)
    guard = pool.acquire()
    guard.release()
    moved = guard.move()
    assert not moved.held and moved.release() is False


# --- no second owner through copying --------------------------------------------------------------


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy, lambda g: pickle.loads(pickle.dumps(g))])
def test_guards_cannot_be_copied(duplicate: object) -> None:
    pool = SlotPool(1)
    guard = pool.acquire()
    with pytest.raises(TypeError):
        duplicate(guard)  # type: ignore[operator]
    assert counts(pool) == (0, 1, 0)


def test_pools_cannot_be_pickled() -> None:
    with pytest.raises(TypeError):
        pickle.dumps(SlotPool(1))


# --- threads ----------------------------------------------------------------------------------------


def test_threads_hammering_acquire_and_release_never_share_a_slot() -> None:
    pool = SlotPool(16)
    owned: set[int] = set()
    bookkeeping = threading.Lock()
    conflicts: list[str] = []
    start = threading.Barrier(6)

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine: list[SlotGuard] = []
        start.wait()
        for _ in range(3000):
            action = rng.integers(4)
            try:
                if action == 0:
                    guard = pool.acquire()
                elif action == 1:
                    guard = pool.claim_specific(int(rng.integers(16)))
                else:
                    guard = None
            except (OutOfSlots, SlotInUse):
                guard = None
            if guard is not None:
                with bookkeeping:
                    if guard.slot in owned:
                        conflicts.append(f"slot {guard.slot} handed out twice")
                    owned.add(guard.slot)
                mine.append(guard)
            elif mine and action >= 2:
                victim = mine.pop(int(rng.integers(len(mine))))
                with bookkeeping:
                    owned.discard(victim.slot)
                if action == 2:
                    victim.release()
                else:
                    del victim  # dropped: released by the guard's destructor
        with bookkeeping:
            for guard in mine:
                owned.discard(guard.slot)
        mine.clear()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert conflicts == []
    assert counts(pool) == (16, 0, 0)
    pool.check_invariants()


# --- stateful model --------------------------------------------------------------------------------

NUM_SLOTS = 6


class SlotPoolMachine(RuleBasedStateMachine):
    """The pool against a plain-Python model: slot -> "free" | "guarded" | "detached"."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(NUM_SLOTS)
        self.model: dict[int, str] = {slot: "free" for slot in range(NUM_SLOTS)}
        self.guards: list[SlotGuard] = []

    @initialize()
    def start(self) -> None:
        self.pool.check_invariants()

    def _draw_guard(self, data: st.DataObject) -> SlotGuard:
        # An index, not sampled_from: a cached strategy would keep guards alive after "drop".
        return self.guards[data.draw(st.integers(0, len(self.guards) - 1))]

    def _held(self) -> list[SlotGuard]:
        return [guard for guard in self.guards if guard.held]

    @rule()
    def acquire(self) -> None:
        if "free" not in self.model.values():
            with pytest.raises(OutOfSlots):
                self.pool.acquire()
            return
        guard = self.pool.acquire()
        assert self.model[guard.slot] == "free"
        self.model[guard.slot] = "guarded"
        self.guards.append(guard)

    @rule(slot=st.integers(-2, NUM_SLOTS + 1))
    def claim_specific(self, slot: int) -> None:
        if not 0 <= slot < NUM_SLOTS:
            with pytest.raises(SlotOutOfRange):
                self.pool.claim_specific(slot)
        elif self.model[slot] == "guarded":
            with pytest.raises(SlotInUse):
                self.pool.claim_specific(slot)
        else:
            self.guards.append(self.pool.claim_specific(slot))
            self.model[slot] = "guarded"

    @precondition(lambda self: bool(self.guards))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        guard = self._draw_guard(data)
        slot = guard.slot
        assert guard.release() is (slot >= 0)
        if slot >= 0:
            self.model[slot] = "free"

    @precondition(lambda self: bool(self.guards))
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        guard = self._draw_guard(data)
        slot = guard.slot
        assert guard.take() == slot
        if slot >= 0:
            self.model[slot] = "detached"

    @precondition(lambda self: bool(self.guards))
    @rule(data=st.data())
    def move(self, data: st.DataObject) -> None:
        guard = self._draw_guard(data)
        slot = guard.slot
        moved = guard.move()
        assert moved.slot == slot and not guard.held
        self.guards.append(moved)

    @precondition(lambda self: bool(self.guards))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.guards) - 1))
        guard = self.guards.pop(index)
        if guard.held:
            self.model[guard.slot] = "free"
        del guard

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_invariants()
        for slot, state in self.model.items():
            assert self.pool.is_free(slot) == (state == "free")
            assert self.pool.is_detached(slot) == (state == "detached")
        states = list(self.model.values())
        assert counts(self.pool) == (states.count("free"), states.count("guarded"), states.count("detached"))
        held = sorted(guard.slot for guard in self._held())
        assert held == sorted(slot for slot, state in self.model.items() if state == "guarded")


TestSlotPoolStateful = SlotPoolMachine.TestCase
