"""A grouped core's refusals leave everything as it was (issue 31's error paths).

Out of host memory cannot be arranged from outside, so these tests use the core's test hook
``_fail_growth``: the groups' scratch is dropped and its n-th growth from then fails, or a
record chunk's n-th growth fails, as a failed ``realloc`` would. A refused call raises
``MemoryError`` and leaves every pool, record and the trie as they were, and a later call
succeeds. Blocks of 4 tokens, a sliding window of 8 tokens, no checkpoints.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore

BS = 4


def make(blocks: int = 64, group_blocks: int = 64, **options: Any) -> KVCacheCore:
    return KVCacheCore(
        BlockPool(blocks), BS, groups=[("sliding_window", 8, 0, BlockPool(group_blocks))], retention_interval=0,
        **options,
    )


def state(core: KVCacheCore, *handles: int) -> tuple[Any, ...]:
    """Everything a refusal must leave as it was: each pool's free blocks, the cache, and each
    live record's tokens and every group's table."""
    records = tuple(
        (core.tokens(h).tolist(), *(core.block_table(h, g).tolist() for g in range(core.num_groups)))
        if core.is_live(h) else None
        for h in handles
    )
    return (
        tuple(p.num_free for p in core.group_pools), core.num_cached_blocks, core.num_live_sequences,
        tuple((row["num_free"], row["num_cached"]) for row in core.group_stats()), records,
    )


def cached_run(core: KVCacheCore, first: int, blocks: int) -> None:
    """A finished request of ``blocks`` full blocks left in the cache."""
    h = core.admit(list(range(first, first + blocks * BS)), blocks)
    core.finish(h)


def test_a_step_whose_group_0_eviction_fails_gives_back_the_other_groups_blocks() -> None:
    core = make(blocks=6)
    cached_run(core, 1000, 4)            # group 0: 4 cached, 2 free
    h = core.admit([1, 2, 3, 4, 5], 2)   # takes the 2 free blocks of group 0
    for token in (6, 7):
        assert core.step([h], [token]).size == 0
    before = state(core, h)
    core._fail_growth(groups=1)
    # Two tokens: a third block, which group 1 has free and group 0 must evict for (that fails).
    with pytest.raises(MemoryError, match="step: out of host memory"):
        core.step([h], [8, 9], counts=[2])
    assert state(core, h) == before
    core.check_invariants()
    assert core.step([h], [8, 9], counts=[2]).size == 0
    assert core.num_blocks(h) == 3
    core.check_invariants()


@pytest.mark.parametrize("cache", [True, False], ids=["finish", "free"])
def test_a_refused_finish_leaves_the_record_open_and_every_group_as_it_was(cache: bool) -> None:
    core = make()
    cached_run(core, 1000, 2)
    h = core.admit(list(range(18)), 5)
    before = state(core, h)
    core._fail_growth(groups=1)
    with pytest.raises(MemoryError, match="finish: out of host memory"):
        core.finish(h, cache)
    assert core.is_live(h)
    assert state(core, h) == before
    core.check_invariants()
    core.finish(h, cache)
    assert not core.is_live(h)
    assert [p.num_free for p in core.group_pools][0] == 64 - core.num_cached_blocks
    core.check_invariants()


def test_a_refused_clear_leaves_the_record_and_every_group_as_it_was() -> None:
    core = make()
    h = core.admit(list(range(18)), 5)
    before = state(core, h)
    core._fail_growth(groups=1)
    with pytest.raises(MemoryError, match="clear: out of host memory"):
        core.clear(h)
    assert state(core, h) == before
    core.check_invariants()
    core.clear(h)
    assert core.num_blocks(h) == 0 and core.block_table(h, 1).size == 0
    assert [p.num_free for p in core.group_pools] == [64, 64]
    core.check_invariants()


def test_a_step_refused_while_releasing_the_window_releases_it_when_retried() -> None:
    faulty, clean = make(), make()
    handles = [core.admit(list(range(12)), 3) for core in (faulty, clean)]
    before = state(faulty, handles[0])
    faulty._fail_growth(groups=1)
    with pytest.raises(MemoryError, match="step: out of host memory"):
        faulty.step([handles[0]], [12])
    assert state(faulty, handles[0]) == before
    faulty.check_invariants()
    for core, h in zip((faulty, clean), handles):
        assert core.step([h], [12]).size == 0
    # The retried step released what left the window, as the step that never failed did.
    assert faulty.block_table(handles[0], 1).tolist() == clean.block_table(handles[1], 1).tolist()
    assert faulty.block_table(handles[0], 1)[0] == -1
    assert faulty.group_pools[1].num_free == clean.group_pools[1].num_free
    faulty.check_invariants()


def test_an_append_refused_while_releasing_the_window_records_no_token() -> None:
    core = make()
    h = core.admit(list(range(12)), 4)
    before = state(core, h)
    core._fail_growth(groups=1)
    with pytest.raises(MemoryError, match="append: out of host memory"):
        core.append(h, [12, 13])
    assert state(core, h) == before
    core.append(h, [12, 13])
    assert core.num_tokens(h) == 14 and core.block_table(h, 1)[0] == -1
    core.check_invariants()


@pytest.mark.parametrize("failing", [1, 2], ids=["first-growth", "second-growth"])
def test_a_chunk_growth_refused_part_way_keeps_every_groups_column(failing: int) -> None:
    # Three columns: doubling moves group 1's column over where group 2's was.
    core = KVCacheCore(
        BlockPool(64), BS, retention_interval=0,
        groups=[("sliding_window", 8, 0, BlockPool(64)), ("chunked_local", 8, 0, BlockPool(64))],
    )
    other = core.admit(list(range(100, 112)), 3)
    core.append(other, [112])               # its window releases 1 block in group 1, 2 in group 2
    h = core.admit(list(range(8)), 2)
    assert core.block_table(h, 1).tolist() != core.block_table(h, 2).tolist()  # columns told apart
    assert core.block_hashes(h).size == 2   # the chunk keeps hashes: they grow with its block ids
    before = state(core, h)
    core._fail_growth(chunks=failing)
    with pytest.raises(MemoryError, match="grow: out of host memory"):
        core.grow(h, 36)                    # twice the room a new record's chunk has
    assert state(core, h) == before
    core.check_invariants()
    assert core.grow(h, 36) == 34
    for g in (1, 2):
        table = core.block_table(h, g)
        assert table.size == 36 and np.unique(table).size == 36 and (table >= 0).all()
    assert core.block_hashes(h).size == 2
    core.check_invariants()
