"""BlockPool: refcounted block ids, all-or-nothing batches, errors that change nothing."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from lifecycle._blockpool import BlockPool
from lifecycle.errors import (
    BlockIdOutOfRange,
    ConfigError,
    DoubleFree,
    InvalidId,
    LifecycleError,
    OutOfBlocks,
)

NUM_BLOCKS = 16


def ids(*values: int) -> NDArray[np.int32]:
    return np.array(values, dtype=np.int32)


@contextmanager
def unchanged(pool: BlockPool) -> Iterator[None]:
    """Assert that the block inside leaves refcounts, free count and invariants as they were."""
    refcounts, num_free = pool.refcounts(), pool.num_free
    yield
    assert pool.num_free == num_free
    np.testing.assert_array_equal(pool.refcounts(), refcounts)
    pool.check_invariants()


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(NUM_BLOCKS)


# -- construction -------------------------------------------------------------------------------


def test_fresh_pool_has_every_block_free(pool: BlockPool) -> None:
    assert pool.num_total == NUM_BLOCKS
    assert pool.num_free == NUM_BLOCKS
    np.testing.assert_array_equal(pool.refcounts(), np.zeros(NUM_BLOCKS, dtype=np.int32))
    pool.check_invariants()


def test_fresh_pool_hands_out_ids_in_ascending_order(pool: BlockPool) -> None:
    np.testing.assert_array_equal(pool.allocate(4), ids(0, 1, 2, 3))


@pytest.mark.parametrize("num_blocks", [-1, 2**31, 2.0, "16", True, None])
def test_invalid_num_blocks_is_a_config_error(num_blocks: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(repr(num_blocks))):
        BlockPool(num_blocks)


def test_num_blocks_may_be_a_numpy_integer() -> None:
    assert BlockPool(np.int64(5)).num_total == 5


def test_empty_pool_allocates_nothing() -> None:
    pool = BlockPool(0)
    assert pool.allocate(0).shape == (0,)
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.check_invariants()


def test_init_twice_is_refused(pool: BlockPool) -> None:
    with unchanged(pool), pytest.raises(ConfigError, match="already holds 16 blocks"):
        pool.__init__(4)


def test_pool_is_not_picklable(pool: BlockPool) -> None:
    import pickle

    with pytest.raises(TypeError):
        pickle.dumps(pool)


# -- allocate -----------------------------------------------------------------------------------


def test_allocate_returns_distinct_int32_ids_with_refcount_one(pool: BlockPool) -> None:
    blocks = pool.allocate(5)
    assert blocks.dtype == np.int32 and blocks.shape == (5,) and blocks.flags.c_contiguous
    assert len(set(blocks.tolist())) == 5
    assert all(pool.refcount(b) == 1 for b in blocks.tolist())
    assert pool.num_free == NUM_BLOCKS - 5
    pool.check_invariants()


def test_allocate_zero_returns_an_empty_array_and_takes_nothing(pool: BlockPool) -> None:
    with unchanged(pool):
        blocks = pool.allocate(0)
    assert blocks.dtype == np.int32 and blocks.shape == (0,)


def test_allocate_every_block_empties_the_free_list(pool: BlockPool) -> None:
    blocks = pool.allocate(NUM_BLOCKS)
    assert sorted(blocks.tolist()) == list(range(NUM_BLOCKS))
    assert pool.num_free == 0
    pool.check_invariants()


def test_allocate_more_than_free_raises_and_takes_nothing(pool: BlockPool) -> None:
    pool.allocate(10)
    with unchanged(pool), pytest.raises(OutOfBlocks, match="cannot allocate 7 blocks: only 6 of 16"):
        pool.allocate(7)


def test_allocate_negative_count_is_refused(pool: BlockPool) -> None:
    with unchanged(pool), pytest.raises(InvalidId, match="-3"):
        pool.allocate(-3)


def test_allocated_array_is_the_callers_own(pool: BlockPool) -> None:
    blocks = pool.allocate(3)
    blocks[:] = 99
    np.testing.assert_array_equal(pool.allocate(3), ids(3, 4, 5))
    pool.check_invariants()


def test_freed_blocks_are_reused_most_recent_first(pool: BlockPool) -> None:
    pool.allocate(4)
    pool.dec_ref(ids(1, 2))
    np.testing.assert_array_equal(pool.allocate(3), ids(2, 1, 4))


# -- allocate_into ------------------------------------------------------------------------------


def test_allocate_into_writes_only_the_requested_slice(pool: BlockPool) -> None:
    table = np.full(8, -7, dtype=np.int32)
    assert pool.allocate_into(table, 2, 3) is None  # type: ignore[func-returns-value]
    np.testing.assert_array_equal(table, ids(-7, -7, 0, 1, 2, -7, -7, -7))
    assert [pool.refcount(b) for b in range(3)] == [1, 1, 1]
    assert pool.num_free == NUM_BLOCKS - 3
    pool.check_invariants()


def test_allocate_into_can_fill_to_the_end(pool: BlockPool) -> None:
    table = np.zeros(4, dtype=np.int32)
    pool.allocate_into(table, 1, 3)
    np.testing.assert_array_equal(table, ids(0, 0, 1, 2))


def test_allocate_into_zero_blocks_changes_nothing(pool: BlockPool) -> None:
    table = np.full(2, 5, dtype=np.int32)
    with unchanged(pool):
        pool.allocate_into(table, 2, 0)
    np.testing.assert_array_equal(table, ids(5, 5))


def test_allocate_into_short_of_blocks_writes_and_takes_nothing(pool: BlockPool) -> None:
    pool.allocate(14)
    table = np.full(4, -1, dtype=np.int32)
    with unchanged(pool), pytest.raises(OutOfBlocks, match="cannot allocate 3 blocks: only 2 of 16"):
        pool.allocate_into(table, 0, 3)
    np.testing.assert_array_equal(table, ids(-1, -1, -1, -1))


@pytest.mark.parametrize(
    ("start", "n", "fragment"),
    [(3, 2, "cannot write 2 ids at start 3 into an array of length 4"), (-1, 1, "start -1"), (5, 0, "start 5")],
)
def test_allocate_into_outside_the_array_is_refused(pool: BlockPool, start: int, n: int, fragment: str) -> None:
    table = np.zeros(4, dtype=np.int32)
    with unchanged(pool), pytest.raises(InvalidId, match=fragment):
        pool.allocate_into(table, start, n)


def test_allocate_into_negative_count_is_refused(pool: BlockPool) -> None:
    with unchanged(pool), pytest.raises(InvalidId, match="-2"):
        pool.allocate_into(np.zeros(4, dtype=np.int32), 0, -2)


def _read_only() -> NDArray[np.int32]:
    table = np.zeros(4, dtype=np.int32)
    table.flags.writeable = False
    return table


@pytest.mark.parametrize(
    "make_out",
    [
        lambda: np.zeros(4, dtype=np.int64),
        lambda: np.zeros((2, 2), dtype=np.int32),
        lambda: np.zeros(8, dtype=np.int32)[::2],
        lambda: np.zeros(4, dtype=">i4"),
        _read_only,
        lambda: [0, 0, 0, 0],
    ],
    ids=["int64", "2-D", "strided", "big-endian", "read-only", "list"],
)
def test_allocate_into_needs_a_writeable_contiguous_int32_array(pool: BlockPool, make_out: Callable[[], Any]) -> None:
    with unchanged(pool), pytest.raises(InvalidId, match="int32"):
        pool.allocate_into(make_out(), 0, 1)


# -- inc_ref ------------------------------------------------------------------------------------


def test_inc_ref_adds_one_reference_per_occurrence(pool: BlockPool) -> None:
    pool.allocate(3)
    pool.inc_ref(ids(0, 2, 2))
    assert [pool.refcount(b) for b in range(3)] == [2, 1, 3]
    assert pool.num_free == NUM_BLOCKS - 3
    pool.check_invariants()


@pytest.mark.parametrize(
    "batch",
    [
        [0, 2], (0, 2), np.array([0, 2], dtype=np.int64), np.array([0, 9, 2], dtype=np.int32)[::2],
        np.array([0, 2], dtype=np.uint16),
    ],
    ids=["list", "tuple", "int64", "strided-int32", "uint16"],
)
def test_inc_ref_accepts_any_sequence_of_ints(pool: BlockPool, batch: Any) -> None:
    pool.allocate(3)
    pool.inc_ref(batch)
    assert [pool.refcount(b) for b in range(3)] == [2, 1, 2]
    pool.check_invariants()


def test_inc_ref_of_a_free_block_is_refused(pool: BlockPool) -> None:
    pool.allocate(2)
    with unchanged(pool), pytest.raises(InvalidId, match="block id 5 is free"):
        pool.inc_ref(ids(0, 1, 5, 0))


def test_inc_ref_of_a_free_block_repeated_is_refused(pool: BlockPool) -> None:
    with unchanged(pool), pytest.raises(InvalidId, match="block id 3 is free"):
        pool.inc_ref(ids(3, 3))


@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS, 70000])
def test_inc_ref_out_of_range_is_refused(pool: BlockPool, bad: int) -> None:
    pool.allocate(2)
    with unchanged(pool), pytest.raises(BlockIdOutOfRange, match=re.escape(f"block id {bad} out of range [0, 16)")):
        pool.inc_ref(ids(0, 1, bad))


def test_out_of_range_id_too_large_for_int32_is_named(pool: BlockPool) -> None:
    pool.allocate(1)
    with unchanged(pool), pytest.raises(BlockIdOutOfRange, match=re.escape(f"block id {2**40} out of range [0, 16)")):
        pool.inc_ref([0, 2**40])


def test_out_of_range_id_beyond_every_numpy_integer_is_named(pool: BlockPool) -> None:
    pool.allocate(1)
    with unchanged(pool), pytest.raises(BlockIdOutOfRange, match=re.escape(f"block id {2**70} out of range")):
        pool.inc_ref([0, 2**70])


# -- dec_ref ------------------------------------------------------------------------------------


def test_dec_ref_returns_how_many_blocks_became_free(pool: BlockPool) -> None:
    blocks = pool.allocate(3)
    pool.inc_ref(ids(1))
    assert pool.dec_ref(blocks) == 2
    assert [pool.refcount(b) for b in range(3)] == [0, 1, 0]
    assert pool.num_free == NUM_BLOCKS - 1
    pool.check_invariants()


def test_dec_ref_of_a_repeated_id_reaching_zero_frees_it_once(pool: BlockPool) -> None:
    pool.allocate(2)
    pool.inc_ref(ids(1))
    assert pool.dec_ref(ids(1, 0, 1)) == 2
    assert pool.num_free == NUM_BLOCKS
    pool.check_invariants()
    assert sorted(pool.allocate(NUM_BLOCKS).tolist()) == list(range(NUM_BLOCKS))


def test_dec_ref_of_an_empty_batch_frees_nothing(pool: BlockPool) -> None:
    with unchanged(pool):
        assert pool.dec_ref([]) == 0
        assert pool.dec_ref(ids()) == 0


def test_dec_ref_range_releases_only_the_range(pool: BlockPool) -> None:
    table = np.full(8, -1, np.int32)
    pool.allocate_into(table, 2, 4)  # a row of a preallocated table: junk around the ids
    assert pool.dec_ref_range(table, 4, 2) == 2  # the tail of the row
    assert pool.num_free == NUM_BLOCKS - 2
    assert pool.dec_ref_range(table, 2, 2) == 2
    assert pool.dec_ref_range(table, 8, 0) == 0
    assert pool.num_free == NUM_BLOCKS
    pool.check_invariants()


@pytest.mark.parametrize("start, n", [(-1, 1), (0, -1), (7, 2), (9, 0)])
def test_dec_ref_range_outside_the_array_is_refused(pool: BlockPool, start: int, n: int) -> None:
    table = pool.allocate(8)
    message = f"cannot release {n} ids at start {start} of an array of length 8"
    with unchanged(pool), pytest.raises(InvalidId, match=message):
        pool.dec_ref_range(table, start, n)
    with unchanged(pool), pytest.raises(InvalidId):
        pool.dec_ref_range(table.tolist(), start, n)


def test_dec_ref_range_refuses_a_double_free_inside_the_range(pool: BlockPool) -> None:
    table = pool.allocate(4)
    pool.dec_ref(table[2:3])
    with unchanged(pool), pytest.raises(DoubleFree, match="dec_ref_range: block id 2 has refcount 0"):
        pool.dec_ref_range(table, 1, 3)
    with unchanged(pool), pytest.raises(BlockIdOutOfRange, match="block id 99 "):
        pool.dec_ref_range([0, 1, 99], 0, 3)
    assert pool.dec_ref_range(table, 0, 2) == 2  # what is around the freed block is fine
    assert pool.dec_ref_range([7, 3, -5], 1, 1) == 1  # other sequences: only the range is read


def test_double_free_is_refused(pool: BlockPool) -> None:
    blocks = pool.allocate(3)
    pool.dec_ref(blocks[1:2])
    with unchanged(pool), pytest.raises(DoubleFree, match="block id 1 has refcount 0"):
        pool.dec_ref(blocks)


def test_dec_ref_repeating_an_id_past_its_refcount_is_refused(pool: BlockPool) -> None:
    pool.allocate(3)
    pool.inc_ref(ids(2))
    message = "block id 2 is released 3 times in one batch but its refcount is 2"
    with unchanged(pool), pytest.raises(DoubleFree, match=message):
        pool.dec_ref(ids(0, 2, 1, 2, 2))


def test_refused_dec_ref_keeps_the_free_order(pool: BlockPool) -> None:
    twin = BlockPool(NUM_BLOCKS)
    for each in (pool, twin):
        each.allocate(6)
        each.dec_ref(ids(4, 1))
    with pytest.raises(DoubleFree):
        pool.dec_ref(ids(0, 2, 3, 1))
    np.testing.assert_array_equal(pool.allocate(pool.num_free), twin.allocate(twin.num_free))


@pytest.mark.parametrize("bad", [-5, NUM_BLOCKS, 70000])
def test_dec_ref_out_of_range_is_refused(pool: BlockPool, bad: int) -> None:
    pool.allocate(2)
    with unchanged(pool), pytest.raises(BlockIdOutOfRange, match=re.escape(f"block id {bad} out of range [0, 16)")):
        pool.dec_ref(ids(0, 1, bad))


def test_block_id_message_names_the_limit() -> None:
    pool = BlockPool(65536)
    with pytest.raises(BlockIdOutOfRange, match=re.escape("block id 70000 out of range [0, 65536)")):
        pool.dec_ref([70000])


@pytest.mark.parametrize(
    "batch",
    [[1.0], ["1"], [True], np.array([1.5]), np.zeros((1, 1), dtype=np.int32), 3, [[1], [2, 3]], object()],
    ids=["float", "str", "bool", "float-array", "2-D", "scalar", "ragged", "object"],
)
def test_ids_that_are_not_a_flat_sequence_of_ints_are_refused(pool: BlockPool, batch: Any) -> None:
    pool.allocate(4)
    with unchanged(pool), pytest.raises(InvalidId):
        pool.dec_ref(batch)
    with unchanged(pool), pytest.raises(InvalidId):
        pool.inc_ref(batch)


def test_every_error_is_a_lifecycle_error() -> None:
    for error in (BlockIdOutOfRange, DoubleFree, InvalidId, OutOfBlocks, ConfigError):
        assert issubclass(error, LifecycleError)


# -- batches long enough to run without the GIL -----------------------------------------------------


def test_long_batches_apply_in_full() -> None:
    pool = BlockPool(4096)
    blocks = pool.allocate(3000)
    pool.inc_ref(blocks)
    assert pool.dec_ref(blocks) == 0
    assert pool.dec_ref(blocks) == 3000
    assert pool.num_free == 4096
    pool.check_invariants()


def test_long_batch_refused_at_its_last_id_changes_nothing() -> None:
    pool = BlockPool(4096)
    blocks = pool.allocate(3000)
    batch = np.concatenate([blocks, ids(blocks[0])])
    pool.dec_ref(blocks[:1])
    with unchanged(pool), pytest.raises(DoubleFree, match=f"block id {blocks[0]}"):
        pool.dec_ref(batch[1:].copy())
    with unchanged(pool), pytest.raises(InvalidId, match=f"block id {blocks[0]} is free"):
        pool.inc_ref(batch[1:].copy())


# -- reading ------------------------------------------------------------------------------------


def test_refcount_out_of_range_is_refused(pool: BlockPool) -> None:
    with pytest.raises(BlockIdOutOfRange, match=re.escape("block id 16 out of range [0, 16)")):
        pool.refcount(NUM_BLOCKS)
    with pytest.raises(BlockIdOutOfRange, match=re.escape("block id -1 out of range")):
        pool.refcount(-1)


def test_refcounts_is_a_copy(pool: BlockPool) -> None:
    pool.allocate(2)
    snapshot = pool.refcounts()
    snapshot[:] = 7
    assert pool.refcount(0) == 1 and pool.refcount(5) == 0
    pool.check_invariants()


def test_repr_shows_the_counts(pool: BlockPool) -> None:
    pool.allocate(3)
    assert repr(pool) == "BlockPool(num_total=16, num_free=13)"


class _LyingTable(list):  # type: ignore[type-arg]
    """A sequence whose length and slices disagree."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: Any) -> Any:
        return [7]


@pytest.mark.parametrize("table", [_LyingTable(), {0: 1, 1: 2}, "abc", [[1, 2], [3, 4]], [1, None, 2]])
def test_dec_ref_range_of_odd_sequences_reads_only_what_it_converted(pool: BlockPool, table: Any) -> None:
    ids_ = pool.allocate(NUM_BLOCKS)
    pool.inc_ref(ids_)
    with unchanged(pool), pytest.raises(LifecycleError):
        pool.dec_ref_range(table, 0, 2)
