"""HostIndex (lifecycle._hosttier): the host tier's slots by key, their LRU order and free slots,
and the copy rows of a batch, checked against a plain Python model of the tier."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle._hosttier import COUNT_NAMES, HostIndex
from lifecycle.errors import BlockIdOutOfRange, InvalidId, LifecycleError

BLOCK_SIZE = 2
DEVICE_BLOCKS = 32
SLOT_BYTES = 8
HOST_BASE = 1 << 40
DEVICE_BASE = 1 << 41
LAYERS = np.array([[DEVICE_BASE, SLOT_BYTES, 0]], dtype=np.int64)


def make(capacity: int = 4) -> HostIndex:
    return HostIndex(capacity, BLOCK_SIZE, DEVICE_BLOCKS, LAYERS, HOST_BASE, SLOT_BYTES)


def batch(*highs: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.int32]]:
    """Keys (high, high + 1), each after the one before it (the first after key 0), tokens from the key."""
    keys = np.array([[h, h + 1] for h in highs], dtype=np.uint64).reshape(-1, 2)
    parents = np.zeros_like(keys)
    parents[1:] = keys[:-1]
    tokens = np.array([[h % 1000, h % 1000 + 1] for h in highs], dtype=np.int32).reshape(-1, BLOCK_SIZE)
    return keys, parents, tokens


def demote(index: HostIndex, *highs: int, ids: list[int] | None = None) -> tuple[list[int], list[int]]:
    keys, parents, tokens = batch(*highs)
    block_ids = np.array(ids if ids is not None else range(len(highs)), dtype=np.int64)
    positions, evicted, _ = index.demote(keys, parents, tokens, block_ids)
    return positions.tolist(), evicted.tolist()


def test_demoted_blocks_are_held_most_recent_last() -> None:
    index = make()
    assert demote(index, 10, 20, 30) == ([0, 1, 2], [])
    assert index.lru_order().tolist() == [10, 20, 30]
    assert index.num_blocks == 3
    index.check_invariants()


def test_a_full_tier_evicts_the_least_recently_used_first() -> None:
    index = make(capacity=3)
    demote(index, 10, 20, 30)
    assert demote(index, 40, 50) == ([0, 1], [10, 20])
    assert index.lru_order().tolist() == [30, 40, 50]
    assert not index.contains(10) and index.contains(50)


def test_a_held_key_demoted_again_is_not_stored_but_becomes_most_recent() -> None:
    index = make(capacity=3)
    demote(index, 10, 20, 30)
    assert demote(index, 10) == ([], [])
    assert index.lru_order().tolist() == [20, 30, 10]
    assert index.counts()["duplicates"] == 1


def test_of_more_new_blocks_than_slots_only_the_last_are_kept() -> None:
    index = make(capacity=2)
    assert demote(index, 1, 2, 3, 4)[0] == [2, 3]
    assert index.lru_order().tolist() == [3, 4]


def test_a_key_repeated_in_a_batch_is_stored_once() -> None:
    index = make()
    keys, parents, tokens = batch(7, 7)
    positions, _, _ = index.demote(keys, parents, tokens, np.array([0, 1], dtype=np.int64))
    assert positions.tolist() == [0] and index.num_blocks == 1


def test_copy_rows_move_each_block_into_its_slot_merging_contiguous_ones() -> None:
    index = make()
    keys, parents, tokens = batch(1, 2, 3)
    _, _, rows = index.demote(keys, parents, tokens, np.array([5, 6, 9], dtype=np.int64))
    # slots 0, 1, 2 in order: blocks 5 and 6 are contiguous on both sides, block 9 is not
    assert rows.tolist() == [
        [HOST_BASE, DEVICE_BASE + 5 * SLOT_BYTES, 2 * SLOT_BYTES],
        [HOST_BASE + 2 * SLOT_BYTES, DEVICE_BASE + 9 * SLOT_BYTES, SLOT_BYTES],
    ]


def test_a_run_of_blocks_given_in_descending_order_takes_contiguous_slots_in_one_copy() -> None:
    index = make()
    keys, parents, tokens = batch(1, 2, 3)
    _, _, rows = index.demote(keys, parents, tokens, np.array([9, 8, 7], dtype=np.int64))
    # slots go to the blocks in ascending device order (7 -> 0, 8 -> 1, 9 -> 2): one row
    assert rows.tolist() == [[HOST_BASE, DEVICE_BASE + 7 * SLOT_BYTES, 3 * SLOT_BYTES]]
    assert index.lru_order().tolist() == [1, 2, 3]  # recency is still the batch's order
    slots = index.find(np.array([1, 2, 3], dtype=np.uint64)).tolist()
    assert slots == [2, 1, 0]
    # promoting the chain into descending device blocks merges backwards too
    rows = index.promote(keys, tokens, np.array([12, 11, 10], dtype=np.int64), 0, 0)
    assert rows.tolist() == [[DEVICE_BASE + 10 * SLOT_BYTES, HOST_BASE, 3 * SLOT_BYTES]]


MANY = 160  # past the insertion sort's reach


@settings(max_examples=60, deadline=None)
@given(st.permutations(list(range(MANY))), st.integers(1, MANY))
def test_a_large_batch_copies_each_block_into_the_slot_its_key_finds(order: list[int], count: int) -> None:
    """Past the insertion sort (the radix path), with slots freed out of order by evictions."""
    index = HostIndex(MANY, BLOCK_SIZE, MANY, LAYERS, HOST_BASE, SLOT_BYTES)
    demote(index, *range(1000, 1000 + MANY), ids=list(range(MANY)))
    touched = [1000 + i for i in order[: MANY // 2]]  # recency scrambled: evictions free scattered slots
    keys, _, tokens = batch(*touched)
    index.lookup(keys, tokens, 0, 0, np.array([[t - 1, t] if t > 1000 else [0, 0] for t in touched], dtype=np.uint64))
    highs = list(range(1, 1 + MANY))[:count]
    ids = order[:count]
    keys, parents, tokens = batch(*highs)
    positions, _, rows = index.demote(keys, parents, tokens, np.array(ids, dtype=np.int64))
    assert positions.tolist() == list(range(count))
    copied = {}
    for dst, src, nbytes in rows.tolist():
        for k in range(0, nbytes, SLOT_BYTES):
            copied[(dst - HOST_BASE + k) // SLOT_BYTES] = (src - DEVICE_BASE + k) // SLOT_BYTES
    slots = index.find(np.array(highs, dtype=np.uint64)).tolist()
    assert copied == dict(zip(slots, ids))
    assert index.lru_order().tolist()[-count:] == highs
    index.check_invariants()


def test_lookup_counts_the_leading_run_of_blocks_that_match_key_parent_and_tokens() -> None:
    index = make()
    demote(index, 10, 20, 30)
    keys, _, tokens = batch(10, 20, 30)
    assert index.lookup(keys, tokens, 0, 0) == 3
    other = tokens.copy()
    other[1, 0] += 1
    assert index.lookup(keys, other, 0, 0) == 1
    assert index.lookup(keys, tokens, 5, 0) == 0  # another parent before the first
    counts = index.counts()
    assert (counts["lookups"], counts["hits"], counts["collisions"]) == (9, 4, 2)


def test_a_lookup_makes_the_run_most_recent_the_first_block_most() -> None:
    index = make()
    demote(index, 10, 20, 30, 40)
    keys, _, tokens = batch(10, 20)
    assert index.lookup(keys, tokens, 0, 0) == 2
    assert index.lru_order().tolist() == [30, 40, 20, 10]


def test_promote_refuses_a_missing_key_naming_it() -> None:
    index = make()
    demote(index, 10)
    keys, _, tokens = batch(10, 20)
    with pytest.raises(InvalidId, match=f"key {20:#018x} is not in the host tier"):
        index.promote(keys, tokens, np.array([0, 1], dtype=np.int64), 0, 0)


def test_promote_refuses_an_entry_that_is_another_block() -> None:
    index = make()
    demote(index, 10)
    keys, _, tokens = batch(10)
    keys[0, 1] += 1  # same high word, another low word
    with pytest.raises(InvalidId, match="as another block"):
        index.promote(keys, tokens, np.array([0], dtype=np.int64), 0, 0)


def test_promote_rows_copy_slots_to_the_device_blocks() -> None:
    index = make()
    demote(index, 10, 20)
    keys, _, tokens = batch(10, 20)
    rows = index.promote(keys, tokens, np.array([3, 7], dtype=np.int64), 0, 0)
    assert rows.tolist() == [
        [DEVICE_BASE + 3 * SLOT_BYTES, HOST_BASE, SLOT_BYTES],
        [DEVICE_BASE + 7 * SLOT_BYTES, HOST_BASE + SLOT_BYTES, SLOT_BYTES],
    ]


@pytest.mark.parametrize(("ids", "error", "named"), [
    ([0, -3], BlockIdOutOfRange, "block id -3 is out of range: valid values are 0..31"),
    ([0, 32], BlockIdOutOfRange, "block id 32 is out of range: valid values are 0..31"),
    ([4, 5, 4], InvalidId, "block id 4 is given more than once"),
])
def test_bad_block_ids_are_refused_naming_the_value(ids: list[int], error: type[LifecycleError], named: str) -> None:
    index = make()
    with pytest.raises(error, match=named):
        index.check_block_ids("demote", np.array(ids, dtype=np.int64))


def test_batches_of_the_wrong_shape_are_refused_and_change_nothing() -> None:
    index = make()
    demote(index, 10)
    before = index.counts()
    keys, parents, tokens = batch(20, 30)
    with pytest.raises(InvalidId, match=r"tokens must be \(2, 2\) int32"):
        index.demote(keys, parents, tokens[:1], np.array([0, 1], dtype=np.int64))
    with pytest.raises(InvalidId, match="keys must be"):
        index.lookup(keys.astype(np.int64), tokens, 0, 0)
    assert index.counts() == before and index.lru_order().tolist() == [10]


@pytest.mark.parametrize("capacity", [0, -1, 1 << 30])
def test_a_capacity_out_of_range_is_refused_naming_it(capacity: int) -> None:
    with pytest.raises(InvalidId, match=f"capacity={capacity}"):
        make(capacity)


def test_load_replaces_an_entry_of_the_same_high_word_and_another_identity() -> None:
    index = make(capacity=2)
    demote(index, 10, 20)
    keys, parents, tokens = batch(10, 30)
    tokens[0, 0] += 1
    slots, stored, removed = index.load(keys, parents, tokens)
    assert stored.tolist() == [0, 1] and removed.tolist() == [10, 20]
    assert slots[0] >= 0 and index.lru_order().tolist() == [10, 30]
    counts = index.counts()
    assert (counts["replaced"], counts["evicted"], counts["loaded"]) == (1, 1, 2)
    index.check_invariants()


def test_forget_drops_what_a_failed_copy_left_unusable() -> None:
    index = make()
    demote(index, 10, 20)
    index.forget(np.array([20], dtype=np.uint64))
    assert index.lru_order().tolist() == [10] and index.counts()["stored"] == 1
    index.check_invariants()


def test_clear_frees_every_slot_and_counts_the_entries() -> None:
    index = make()
    demote(index, 10, 20)
    assert index.clear() == 2
    assert index.num_blocks == 0 and index.counts()["cleared"] == 2
    demote(index, 1, 2, 3, 4)
    assert index.num_blocks == 4
    index.check_invariants()


# -- random operations against a model --------------------------------------------------------------


Row = tuple[tuple[int, int], tuple[int, int], tuple[int, ...]]


class Model:
    """The tier as OrderedDict of high word -> (key, parent, tokens), least recent first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, Row] = OrderedDict()
        self.counts = dict.fromkeys(COUNT_NAMES, 0)

    def demote(self, rows: list[Row]) -> tuple[list[int], list[int]]:
        fresh: list[int] = []
        seen: set[int] = set()
        for position, row in enumerate(rows):
            high = row[0][0]
            if high in self.entries:
                self.entries.move_to_end(high)
                self.counts["duplicates"] += 1
            elif high not in seen:
                seen.add(high)
                fresh.append(position)
        fresh = fresh[-self.capacity :]
        evicted: list[int] = []
        while len(self.entries) + len(fresh) > self.capacity:
            evicted.append(self.entries.popitem(last=False)[0])
            self.counts["evicted"] += 1
        for position in fresh:
            self.entries[rows[position][0][0]] = rows[position]
        self.counts["stored"] += len(fresh)
        self.counts["bytes_demoted"] += len(fresh) * SLOT_BYTES
        return fresh, evicted

    def lookup(self, rows: list[Row]) -> int:
        run = 0
        while run < len(rows) and rows[run][0][0] in self.entries:
            run += 1
        found = 0
        while found < run and self.entries[rows[found][0][0]] == rows[found]:
            found += 1
        if found < run:
            self.counts["collisions"] += 1
        for row in reversed(rows[:found]):
            self.entries.move_to_end(row[0][0])
        self.counts["lookups"] += len(rows)
        self.counts["hits"] += found
        return found


def arrays(rows: list[Row]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.int32]]:
    keys = np.array([r[0] for r in rows], dtype=np.uint64).reshape(-1, 2)
    parents = np.array([r[1] for r in rows], dtype=np.uint64).reshape(-1, 2)
    tokens = np.array([r[2] for r in rows], dtype=np.int32).reshape(-1, BLOCK_SIZE)
    return keys, parents, tokens


# few distinct high words, so that batches repeat, hit and collide; low words and tokens vary a little
entry = st.tuples(
    st.tuples(st.integers(0, 24), st.integers(0, 1)), st.tuples(st.integers(0, 1), st.just(0)),
    st.tuples(st.integers(0, 1), st.integers(0, 1)),
)
operation = st.tuples(st.sampled_from(["demote", "lookup"]), st.lists(entry, max_size=9))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.lists(operation, max_size=30))
def test_random_batches_match_the_model_after_every_call(
    capacity: int, operations: list[tuple[str, list[Row]]]
) -> None:
    index, model = make(capacity), Model(capacity)
    for kind, rows in operations:
        keys, parents, tokens = arrays(rows)
        if kind == "demote":
            positions, evicted, _ = index.demote(keys, parents, tokens, np.arange(len(rows), dtype=np.int64))
            assert (positions.tolist(), evicted.tolist()) == model.demote(rows)
        else:
            assert index.lookup(keys, tokens, 0, 0, parents) == model.lookup(rows)
        assert index.lru_order().tolist() == list(model.entries)
        assert index.counts() == model.counts
        assert index.num_blocks == len(model.entries)
        index.check_invariants()
    held = np.array(list(model.entries), dtype=np.uint64)
    slots = index.find(held)
    assert (slots >= 0).all() and len(set(slots.tolist())) == len(held)
    for high, slot in zip(held.tolist(), slots.tolist()):
        key, parent, held_tokens = model.entries[high]
        assert tuple(index.keys[slot].tolist()) == key and tuple(index.parents[slot].tolist()) == parent
        assert tuple(index.tokens[slot].tolist()) == held_tokens
