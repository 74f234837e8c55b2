"""The fused calls of ``PrefixCacheCore``: each equals its separate calls, and a refused call
changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from lifecycle._blockpool import BlockPool
from lifecycle._prefix_cache import PrefixCacheCore
from lifecycle._prefix_trie import PrefixTrie
from lifecycle.errors import DoubleFree, InvalidId, OutOfBlocks

BS = 4


def _core(num_blocks: int = 16) -> PrefixCacheCore:
    return PrefixCacheCore(BlockPool(num_blocks), PrefixTrie(BS))


def _check(core: PrefixCacheCore) -> None:
    core.trie.check_invariants()
    core.pool.check_invariants()


def _cache_one(core: PrefixCacheCore, tokens: np.ndarray, blocks: int) -> np.ndarray:
    """Admit and finish a request of ``tokens`` that holds ``blocks`` blocks; return its table."""
    table = np.empty(blocks, np.int32)
    pinned = core.acquire_prefix(tokens, table, 0, (len(tokens) - 1) // BS)
    core.allocate(table, len(pinned), blocks - len(pinned))
    core.cache_and_release(tokens, table, len(tokens) // BS, 0, pinned)
    _check(core)
    return table


def test_acquire_prefix_pins_and_references_the_match_into_the_table() -> None:
    core = _core()
    tokens = np.arange(12, dtype=np.int32)
    cached = _cache_one(core, tokens, 3)
    table = np.full(3, -1, np.int32)
    pinned = core.acquire_prefix(tokens, table, 0, 2)
    assert list(table[:2]) == list(cached[:2]) and len(pinned) == 2
    assert [core.pool.refcount(int(b)) for b in cached[:2]] == [2, 2]
    assert core.trie.pin_count(int(pinned[1])) == 1
    _check(core)


def test_cache_and_release_frees_duplicates_and_keeps_cached_blocks() -> None:
    core = _core()
    tokens = np.arange(12, dtype=np.int32)
    _cache_one(core, tokens, 3)
    assert core.num_cached_blocks == 3 and core.pool.num_free == 13
    _cache_one(core, tokens, 3)  # reuses 2 blocks; the third is a duplicate and goes free
    assert core.num_cached_blocks == 3 and core.pool.num_free == 13
    assert core.num_evictable_blocks == 3


def test_cache_and_release_with_a_bad_pin_changes_nothing() -> None:
    core = _core()
    tokens = np.arange(12, dtype=np.int32)
    _cache_one(core, tokens, 3)
    table = np.empty(3, np.int32)
    pinned = core.acquire_prefix(tokens, table, 0, 2)
    core.allocate(table, 2, 1)
    core.trie.unpin(pinned)  # the caller loses track of its pins
    before = core.pool.refcounts()
    with pytest.raises(DoubleFree):
        core.cache_and_release(tokens, table, 3, 0, pinned)
    assert np.array_equal(core.pool.refcounts(), before)
    assert core.num_cached_blocks == 3
    _check(core)


def test_cache_and_release_with_a_free_block_changes_nothing() -> None:
    core = _core()
    tokens = np.arange(12, dtype=np.int32)
    table = np.empty(3, np.int32)
    pinned = core.acquire_prefix(tokens, table, 0, 2)
    core.allocate(table, 0, 3)
    table[2] = 15  # never allocated
    before = core.pool.refcounts()
    with pytest.raises(DoubleFree):
        core.cache_and_release(tokens, table, 2, 0, pinned)
    assert np.array_equal(core.pool.refcounts(), before) and core.num_cached_blocks == 0
    _check(core)


def test_allocate_evicts_least_recently_used_blocks_when_short() -> None:
    core = _core(8)
    _cache_one(core, np.arange(16, dtype=np.int32), 4)
    _cache_one(core, np.arange(100, 116, dtype=np.int32), 4)
    assert core.pool.num_free == 0
    table = np.empty(2, np.int32)
    assert core.allocate(table, 0, 2) == 2
    assert core.blocks_evicted == 2
    # The older request's deepest blocks went first.
    pinned = core.acquire_prefix(np.arange(16, dtype=np.int32), np.empty(4, np.int32))
    assert len(pinned) == 2
    _check(core)


def test_allocate_raises_out_of_blocks_when_eviction_cannot_make_room() -> None:
    core = _core(4)
    table = np.empty(5, np.int32)
    with pytest.raises(OutOfBlocks):
        core.allocate(table, 0, 5)
    assert core.pool.num_free == 4
    with pytest.raises(InvalidId):
        core.allocate(table, 4, 2)


def test_insert_path_with_a_free_block_changes_nothing() -> None:
    core = _core()
    with pytest.raises(InvalidId):
        core.insert_path(np.arange(8, dtype=np.int32), np.array([0, 1], np.int32))
    assert core.num_cached_blocks == 0 and core.pool.num_free == 16
    _check(core)


def test_evict_counts_only_blocks_that_became_free() -> None:
    core = _core()
    tokens = np.arange(8, dtype=np.int32)
    table = np.empty(2, np.int32)
    core.allocate(table, 0, 2)
    core.insert_path(tokens, table)
    assert core.evict(2) == 0  # the sequence still holds both
    assert core.blocks_evicted == 2 and core.num_cached_blocks == 0
    _check(core)


# -- admit: acquire_prefix + allocate in one call ------------------------------------------


def _admit_separately(
    core: PrefixCacheCore, tokens: np.ndarray, blocks: int, max_prefix: int
) -> tuple[np.ndarray, np.ndarray]:
    table = np.empty(blocks, np.int32)
    pinned = core.acquire_prefix(tokens, table, 0, max_prefix)
    core.allocate(table, len(pinned), blocks - len(pinned))
    return table, pinned


def test_admit_equals_acquire_prefix_then_allocate() -> None:
    # Two caches driven by the same random requests (small alphabet: prefixes are shared often,
    # small pool: eviction runs often), one through admit, one through the two calls.
    rng = np.random.default_rng(7)
    fused, separate = _core(24), _core(24)
    live: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for _ in range(300):
        if len(live) == 3:
            tokens, table_a, pinned_a, table_b, pinned_b = live.pop(0)
            full = len(tokens) // BS
            assert fused.cache_and_release(tokens, table_a, full, 0, pinned_a) == separate.cache_and_release(
                tokens, table_b, full, 0, pinned_b
            )
        tokens = rng.integers(0, 2, size=int(rng.integers(1, 20)), dtype=np.int32)
        blocks = -(-(len(tokens) + 2) // BS)
        max_prefix = (len(tokens) - 1) // BS
        table_a, pinned_a, _ = fused.admit(tokens, blocks, 0, max_prefix)
        table_b, pinned_b = _admit_separately(separate, tokens, blocks, max_prefix)
        assert np.array_equal(pinned_a, pinned_b) and np.array_equal(table_a, table_b)
        assert np.array_equal(fused.pool.refcounts(), separate.pool.refcounts())
        assert fused.blocks_evicted == separate.blocks_evicted
        live.append((tokens, table_a, pinned_a, table_b, pinned_b))
        _check(fused)
    assert fused.num_cached_blocks == separate.num_cached_blocks


def test_admit_returns_the_prefix_then_fresh_blocks() -> None:
    core = _core()
    tokens = np.arange(12, dtype=np.int32)
    cached = _cache_one(core, tokens, 3)
    table, pinned, freed = core.admit(tokens, 5, 0, 2)
    assert freed == 0
    assert table.dtype == np.int32 and len(table) == 5 and len(pinned) == 2
    assert list(table[:2]) == list(cached[:2])
    assert [core.pool.refcount(int(b)) for b in table] == [2, 2, 1, 1, 1]
    assert core.trie.pin_count(int(pinned[1])) == 1
    # The prefix is capped by max_prefix and by the table length; -1 means no cap.
    assert len(core.admit(tokens, 5, 0, 0)[1]) == 0
    assert len(core.admit(tokens, 1, 0, -1)[1]) == 1
    assert len(core.admit(tokens, 4)[1]) == 3
    _check(core)


def test_admit_short_of_blocks_gives_the_prefix_back() -> None:
    core = _core(6)
    tokens = np.arange(12, dtype=np.int32)
    _cache_one(core, tokens, 3)
    holder = np.empty(3, np.int32)
    core.allocate(holder, 0, 3)  # 3 cached, 3 held by another sequence, none free
    before = core.pool.refcounts()
    with pytest.raises(OutOfBlocks):
        core.admit(tokens, 5, 0, 2)  # 2 from the cache, 3 more: only the third cached one can go
    # Nothing pinned or referenced; the one evictable block that was not the prefix is evicted.
    assert core.blocks_evicted == 1 and core.num_cached_blocks == 2
    after = core.pool.refcounts()
    assert np.count_nonzero(after != before) == 1 and core.pool.num_free == 1
    assert core.trie.num_evictable_blocks == 2
    _check(core)


def test_admit_refuses_bad_arguments_and_changes_nothing() -> None:
    core = _core()
    tokens = np.arange(12, dtype=np.int32)
    _cache_one(core, tokens, 3)
    before = core.pool.refcounts()
    with pytest.raises(InvalidId, match="-1 blocks"):
        core.admit(tokens, -1)
    with pytest.raises(InvalidId, match="max_prefix -2"):
        core.admit(tokens, 2, 0, -2)
    with pytest.raises(InvalidId):
        core.admit(tokens, 2, "lora")  # type: ignore[arg-type]
    with pytest.raises(InvalidId):
        core.admit(np.zeros((2, 4), np.int32), 2)
    assert np.array_equal(core.pool.refcounts(), before) and core.trie.num_evictable_blocks == 3
    # Other int sequences take the trie's conversion.
    table, pinned, _ = core.admit(list(range(12)), 3, 0, 2)
    assert len(pinned) == 2
    _check(core)


def test_admit_with_the_cache_disabled_matches_nothing() -> None:
    pool = BlockPool(8)
    core = PrefixCacheCore(pool, PrefixTrie(BS), enabled=False)
    table, pinned, _ = core.admit(np.arange(12, dtype=np.int32), 3)
    assert len(pinned) == 0 and len(table) == 3 and pool.num_free == 5


def test_admit_writes_into_a_given_block_table() -> None:
    core = _core(5)
    tokens = np.arange(12, dtype=np.int32)
    cached = _cache_one(core, tokens, 3)
    table = np.full(8, -1, np.int32)
    out, pinned, freed = core.admit(tokens, 5, 0, 2, table)
    assert out is table and list(table[:2]) == list(cached[:2]) and table[5:].tolist() == [-1, -1, -1]
    assert freed == 1 and core.blocks_evicted == 1  # 3 fresh blocks: the third cached one had to go
    with pytest.raises(InvalidId, match="holds 2 ids, 3 are needed"):
        core.admit(tokens, 3, 0, 2, np.empty(2, np.int32))
    with pytest.raises(InvalidId):
        core.admit(tokens, 1, 0, 0, np.empty(4, np.int64))
    core.trie.unpin(pinned)
    core.pool.dec_ref(table[:5])
    _check(core)
