"""Several threads hammering one BlockPool never corrupt it nor hand one block to two owners."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from numpy.typing import NDArray

from lifecycle._blockpool import BlockPool
from lifecycle.errors import OutOfBlocks

NUM_BLOCKS = 4096
NUM_THREADS = 4
ROUNDS = 300
NOBODY = -1


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    # Switch the GIL often so that the threads really interleave on a small machine.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def hammer(pool: BlockPool, owner: list[int], worker: int, seed: int, errors: list[BaseException]) -> None:
    """Allocate, share and release batches; short ones run under the GIL, long ones without it."""
    rng = random.Random(seed)
    held: list[NDArray[np.int32]] = []
    try:
        for _ in range(ROUNDS):
            if held and (rng.random() < 0.45 or len(held) > 6):
                blocks = held.pop(rng.randrange(len(held)))
                pool.inc_ref(blocks)  # a second holder (a prefix cache, say) ...
                assert pool.dec_ref(blocks) == 0  # ... lets go: still held by us
                for block in blocks.tolist():
                    owner[block] = NOBODY
                if rng.random() < 0.5:
                    assert pool.dec_ref(blocks) == len(blocks)
                else:  # the in-place form, on a row inside a larger table
                    table = np.full(len(blocks) + 4, -1, dtype=np.int32)
                    table[2 : 2 + len(blocks)] = blocks
                    assert pool.dec_ref_range(table, 2, len(blocks)) == len(blocks)
                continue
            n = rng.choice([1, 3, 16, 64, 600, 1000])
            try:
                blocks = pool.allocate(n) if rng.random() < 0.5 else _allocate_into(pool, n)
            except OutOfBlocks:
                continue
            for block in blocks.tolist():
                assert owner[block] == NOBODY, f"block {block} handed to worker {worker} while {owner[block]} holds it"
                owner[block] = worker
            held.append(blocks)
        for blocks in held:
            for block in blocks.tolist():
                owner[block] = NOBODY
            pool.dec_ref(blocks)
    except BaseException as error:  # reported by the test thread
        errors.append(error)


def _allocate_into(pool: BlockPool, n: int) -> NDArray[np.int32]:
    table = np.empty(n + 2, dtype=np.int32)
    pool.allocate_into(table, 2, n)
    return table[2:].copy()


def check_while_running(pool: BlockPool, stop: threading.Event, errors: list[BaseException]) -> None:
    try:
        while not stop.is_set():
            pool.check_invariants()
            assert 0 <= pool.num_free <= NUM_BLOCKS
    except BaseException as error:
        errors.append(error)


def test_threads_hammering_one_pool_leave_it_whole() -> None:
    pool = BlockPool(NUM_BLOCKS)
    owner = [NOBODY] * NUM_BLOCKS
    errors: list[BaseException] = []
    stop = threading.Event()
    checker = threading.Thread(target=check_while_running, args=(pool, stop, errors))
    workers = [
        threading.Thread(target=hammer, args=(pool, owner, worker, 1000 + worker, errors))
        for worker in range(NUM_THREADS)
    ]
    checker.start()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    stop.set()
    checker.join()

    assert not errors, errors
    pool.check_invariants()
    assert pool.num_free == NUM_BLOCKS
    assert not pool.refcounts().any()


def test_threads_releasing_shared_blocks_free_each_exactly_once() -> None:
    pool = BlockPool(NUM_BLOCKS)
    blocks = pool.allocate(NUM_BLOCKS)
    pool.inc_ref(np.repeat(blocks, NUM_THREADS - 1))  # one reference per thread
    freed: list[int] = []

    def release(batch_size: int) -> None:
        total = 0
        for start in range(0, NUM_BLOCKS, batch_size):
            total += pool.dec_ref(blocks[start : start + batch_size])
        freed.append(total)

    threads = [threading.Thread(target=release, args=(size,)) for size in (7, 64, 600, 4096)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sum(freed) == NUM_BLOCKS
    assert pool.num_free == NUM_BLOCKS
    pool.check_invariants()
