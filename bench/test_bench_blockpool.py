"""pytest-benchmark suite of the block pool's hot calls, tracked over time.

    python bench/regress.py save -- bench/test_bench_blockpool.py    # a baseline under .benchmarks/
    python bench/regress.py check -- bench/test_bench_blockpool.py   # fail if a minimum is > 25% slower

See bench/regress.py for the calibration and why minimums are compared. CI runs one of these
benchmarks through that workflow (tests/test_bench_regress.py), not the suite.
"""

from __future__ import annotations

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from lifecycle._blockpool import BlockPool

NUM_BLOCKS = 65_536
BATCH_SIZES = [1, 16, 64]


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(NUM_BLOCKS)


def assert_whole(pool: BlockPool) -> None:
    pool.check_invariants()
    assert pool.num_free == NUM_BLOCKS


@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_allocate_then_free(benchmark: BenchmarkFixture, pool: BlockPool, batch: int) -> None:
    """A sequence's life in the W1 style: allocate(batch) returns its table, dec_ref frees it."""
    allocate, release = pool.allocate, pool.dec_ref

    def cycle() -> None:
        release(allocate(batch))

    benchmark(cycle)
    assert_whole(pool)


@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_allocate_into_then_free(benchmark: BenchmarkFixture, pool: BlockPool, batch: int) -> None:
    """Growing a preallocated block table in place, then freeing that slice."""
    table = np.zeros(batch, dtype=np.int32)
    allocate_into, release = pool.allocate_into, pool.dec_ref

    def cycle() -> None:
        allocate_into(table, 0, batch)
        release(table)

    benchmark(cycle)
    assert_whole(pool)


@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_table_row_fill_then_release(benchmark: BenchmarkFixture, pool: BlockPool, batch: int) -> None:
    """W1's table form: a row of a preallocated table filled in place and released in place."""
    table = np.zeros(4 * 64, dtype=np.int32)
    allocate_into, release = pool.allocate_into, pool.dec_ref_range

    def cycle() -> None:
        allocate_into(table, 128, batch)
        release(table, 128, batch)

    benchmark(cycle)
    assert_whole(pool)


@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_share_then_release(benchmark: BenchmarkFixture, pool: BlockPool, batch: int) -> None:
    """A second holder (a prefix cache) takes and drops a reference on held blocks."""
    blocks = pool.allocate(batch)

    def cycle() -> None:
        pool.inc_ref(blocks)
        pool.dec_ref(blocks)

    benchmark(cycle)
    assert pool.dec_ref(blocks) == batch
    assert_whole(pool)
