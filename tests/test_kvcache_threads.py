"""Several threads serving requests on one KVCacheCore while another recounts it.

The workers admit prompts that share long prefixes (some long enough that the core releases the GIL
while it works), append, grow, cache mid-life, finish with or without caching, evict and reclaim; a
block handed to one request as its own is never held by another request at the same time. A checker
thread runs ``check_invariants()`` throughout: it must never raise (no inconsistency, and no false
alarm from looking at a step half done). At the end nothing is live and every block comes back.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from numpy.typing import NDArray

from lifecycle.errors import OutOfBlocks
from kvcache_support import Core, make_core

BLOCK_SIZE = 16
NUM_BLOCKS = 2048
NUM_WORKERS = 4
ROUNDS = 150
NOBODY = -1


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    # Switch the GIL often so that the threads really interleave on a small machine.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def serve(core: Core, documents: list[NDArray[np.int32]], owner: list[int], worker: int, seed: int) -> None:
    rng = random.Random(seed)
    live: list[tuple[int, int]] = []  # (handle, blocks it reused)

    def claim(handle: int, start: int) -> None:
        for block in core.block_table(handle).tolist()[start:]:
            assert owner[block] == NOBODY, f"block {block} handed to worker {worker} while {owner[block]} holds it"
            owner[block] = worker

    def release(handle: int, reused: int) -> None:
        for block in core.block_table(handle).tolist()[reused:]:
            owner[block] = NOBODY  # before the core lets go of it
        core.finish(handle, cache=rng.random() < 0.8)

    for _ in range(ROUNDS):
        action = rng.random()
        if live and (action < 0.35 or len(live) > 3):
            release(*live.pop(rng.randrange(len(live))))
        elif action < 0.45:
            core.evict(rng.choice([1, 8, 64]))
        elif action < 0.5:
            document = rng.choice(documents)
            core.reclaim_for(document[: rng.randrange(1, len(document))], 0, rng.randrange(300))
        elif live and action < 0.6:
            handle, reused = live[rng.randrange(len(live))]
            core.append(handle, np.full(rng.randrange(1, 40), worker, dtype=np.int32))
            blocks = -(-core.num_tokens(handle) // BLOCK_SIZE)
            try:
                before = core.num_blocks(handle)
                core.grow(handle, blocks)
                claim(handle, before)
            except OutOfBlocks:
                continue
            core.cache(handle, min(core.num_tokens(handle) // BLOCK_SIZE, core.num_blocks(handle)))
        else:
            document = rng.choice(documents)
            prompt = np.concatenate(
                [document[: rng.randrange(len(document))], np.full(rng.randrange(1, 200), worker, dtype=np.int32)]
            )
            try:
                handle = core.admit(prompt, -(-len(prompt) // BLOCK_SIZE))
            except OutOfBlocks:
                continue
            reused = core.cached_tokens(handle) // BLOCK_SIZE
            claim(handle, reused)
            live.append((handle, reused))
    for handle, reused in live:
        release(handle, reused)


def test_threads_serving_one_core_keep_it_consistent_and_lose_nothing() -> None:
    core = make_core(NUM_BLOCKS, BLOCK_SIZE)
    rng = np.random.default_rng(7)
    # Long shared prefixes: admissions of more than 4096 tokens run without the GIL.
    documents = [rng.integers(100, 200, size=size, dtype=np.int32) for size in (600, 3000, 6000)]
    owner = [NOBODY] * NUM_BLOCKS
    errors: list[BaseException] = []
    done = threading.Event()
    checks = 0

    def run(target: Callable[..., None], *args: object) -> None:
        try:
            target(*args)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    def check() -> None:
        nonlocal checks
        while not done.is_set():
            core.check_invariants()
            checks += 1

    checker = threading.Thread(target=run, args=(check,))
    workers = [
        threading.Thread(target=run, args=(serve, core, documents, owner, worker, 1000 + worker))
        for worker in range(NUM_WORKERS)
    ]
    checker.start()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    done.set()
    checker.join()
    assert errors == []
    assert checks > 0
    core.check_invariants()
    assert core.live_totals() == (0, 0)
    assert core.counters()["prefix_hits"] > 0
    assert core.reset() is True
    assert core.pool.num_free == NUM_BLOCKS
    assert owner == [NOBODY] * NUM_BLOCKS
