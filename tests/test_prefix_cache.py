"""PrefixCache: the trie's references in the block pool (SPEC §4), SPEC §8 scenarios 9-14."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from numpy.typing import NDArray

from lifecycle._blockpool import BlockPool
from lifecycle._prefix_trie import PrefixTrie
from lifecycle.errors import ConfigError, DoubleFree, InvalidId, InvariantViolation
from lifecycle.prefix_cache import PrefixCache, PrefixReclaim, reusable_blocks

BS = 4


def seq(*block_values: int) -> NDArray[np.int32]:
    """Tokens made of whole blocks, block i filled with block_values[i]."""
    return np.repeat(np.array(block_values, dtype=np.int32), BS)


def make_cache(num_blocks: int = 16, *, enabled: bool = True) -> PrefixCache:
    return PrefixCache(BlockPool(num_blocks), PrefixTrie(BS), enabled=enabled)


def cache_blocks(cache: PrefixCache, tokens: NDArray[np.int32]) -> NDArray[np.int32]:
    """A sequence computes ``tokens``, caches its full blocks and is freed; returns its blocks."""
    block_table = cache.pool.allocate(len(tokens) // BS)
    cache.insert(tokens, block_table)
    cache.pool.dec_ref(block_table)
    cache.check_invariants()
    return block_table


@pytest.fixture
def cache() -> PrefixCache:
    return make_cache()


# -- construction and plain behaviour --------------------------------------------------------


def test_a_cache_needs_an_empty_trie() -> None:
    trie = PrefixTrie(BS)
    trie.insert(seq(1), [0])
    with pytest.raises(ConfigError, match="caches 1 blocks"):
        PrefixCache(BlockPool(4), trie)


def test_insert_takes_one_cache_reference_per_new_node(cache: PrefixCache) -> None:
    block_table = cache.pool.allocate(2)
    assert cache.insert(seq(1, 2), block_table).size == 0
    assert [cache.pool.refcount(int(b)) for b in block_table] == [2, 2]
    cache.check_invariants()


def test_cached_blocks_are_not_free_until_evicted(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2))
    assert cache.pool.num_free == 14
    assert cache.evict(2) == 2
    assert cache.pool.num_free == 16
    cache.check_invariants()


def test_lookup_reports_blocks_nodes_and_token_count(cache: PrefixCache) -> None:
    block_table = cache_blocks(cache, seq(1, 2, 3))
    match = cache.lookup(seq(1, 2, 9))
    assert match.block_ids.tolist() == block_table[:2].tolist()
    assert (match.num_blocks, match.num_tokens, len(match.node_ids)) == (2, 8, 2)


def test_lookup_takes_no_reference(cache: PrefixCache) -> None:
    block_table = cache_blocks(cache, seq(1))
    cache.lookup(seq(1), pin=True)
    assert cache.pool.refcount(int(block_table[0])) == 1


def test_lookup_prompt_never_covers_the_last_prompt_token(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2, 3))
    match = cache.lookup_prompt(seq(1, 2, 3))
    assert match.num_blocks == 2
    assert cache.lookup_prompt(np.concatenate([seq(1, 2, 3), [7]]).astype(np.int32)).num_blocks == 3
    cache.unpin(match.node_ids)
    cache.check_invariants()


@pytest.mark.parametrize(("prompt_len", "expected"), [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2)])
def test_reusable_blocks_leaves_the_last_token_uncached(prompt_len: int, expected: int) -> None:
    assert reusable_blocks(prompt_len, BS) == expected


def test_evict_refuses_a_negative_count(cache: PrefixCache) -> None:
    with pytest.raises(InvalidId, match="-1"):
        cache.evict(-1)


def test_reclaim_prefix_blocks_is_evict(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2))
    assert cache.reclaim_prefix_blocks(1) == 1
    assert cache.num_cached_blocks == 1


def test_clear_releases_every_cache_reference(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2))
    cache_blocks(cache, seq(3))
    assert cache.clear() == 3
    assert cache.pool.num_free == 16
    cache.check_invariants()


def test_insert_counts_duplicates_and_new_nodes_under_each_adapter(cache: PrefixCache) -> None:
    block_table = cache.pool.allocate(2)
    cache.insert(seq(1, 2), block_table, adapter=5)
    assert cache.lookup(seq(1, 2), 0).num_blocks == 0
    assert cache.lookup(seq(1, 2), 5).num_blocks == 2
    cache.pool.dec_ref(block_table)
    cache.check_invariants()


def test_insert_after_an_attached_prefix_reuses_the_pinned_path(cache: PrefixCache) -> None:
    kept = cache_blocks(cache, seq(1, 2))
    match = cache.lookup(seq(1, 2, 3), pin=True)
    cache.pool.inc_ref(match.block_ids)
    block_table = np.concatenate([match.block_ids, cache.pool.allocate(1)])
    duplicates = cache.insert(seq(1, 2, 3), block_table, known_prefix=match.node_ids)
    assert duplicates.tolist() == kept.tolist()
    cache.unpin(match.node_ids)
    cache.pool.dec_ref(block_table)
    assert cache.num_cached_blocks == 3
    cache.check_invariants()


# -- scenario 9: cache_sequence over existing nodes ---------------------------------------------


def test_existing_nodes_keep_their_blocks_and_the_duplicates_free_with_the_sequence(cache: PrefixCache) -> None:
    kept = cache_blocks(cache, seq(1, 2))
    second = cache.pool.allocate(3)
    duplicates = cache.insert(seq(1, 2, 3), second)
    assert duplicates.tolist() == second[:2].tolist()
    assert cache.lookup(seq(1, 2, 3)).block_ids.tolist() == [*kept.tolist(), int(second[2])]
    assert cache.pool.dec_ref(second) == 2  # its two duplicates: nobody else holds them
    assert cache.num_cached_blocks == 3
    assert cache.pool.num_free == 16 - 3
    cache.check_invariants()


def test_eviction_frees_no_block_a_live_sequence_holds(cache: PrefixCache) -> None:
    block_table = cache.pool.allocate(2)
    cache.insert(seq(1, 2), block_table)  # the sequence is still live
    assert cache.evict(2) == 0
    assert cache.num_cached_blocks == 0
    assert [cache.pool.refcount(int(b)) for b in block_table] == [1, 1]
    assert cache.pool.dec_ref(block_table) == 2
    cache.check_invariants()


def test_eviction_never_touches_a_prefix_pinned_by_a_live_sequence(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2))
    match = cache.lookup(seq(1, 2), pin=True)
    cache.pool.inc_ref(match.block_ids)
    assert cache.evict(2) == 0
    assert cache.lookup(seq(1, 2)).num_blocks == 2
    cache.unpin(match.node_ids)
    cache.pool.dec_ref(match.block_ids)
    assert cache.evict(2) == 2
    cache.check_invariants()


# -- scenario 10: acquired and released in one step ------------------------------------------------


def test_a_block_cached_and_released_in_one_step_never_reaches_the_free_list(cache: PrefixCache) -> None:
    block_table = cache.pool.allocate(1)
    free_before = cache.pool.num_free
    cache.insert(seq(1), block_table)  # acquire first...
    cache.pool.dec_ref(block_table)  # ...then release
    assert cache.pool.num_free == free_before
    everything_free = cache.pool.allocate(cache.pool.num_free)
    assert int(block_table[0]) not in everything_free.tolist()
    cache.check_invariants()


def test_a_duplicate_insert_keeps_the_callers_block_above_zero(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1))
    block_table = cache.pool.allocate(1)
    free_before = cache.pool.num_free
    assert cache.insert(seq(1), block_table).tolist() == block_table.tolist()
    assert cache.pool.refcount(int(block_table[0])) == 1
    assert cache.pool.num_free == free_before


def test_inserting_a_block_nobody_holds_is_refused_and_changes_nothing(cache: PrefixCache) -> None:
    block_table = cache.pool.allocate(2)
    cache.pool.dec_ref(block_table)  # released before caching: the wrong order
    with pytest.raises(InvalidId, match="free"):
        cache.insert(seq(1, 2), block_table)
    assert cache.num_cached_blocks == 0
    assert cache.pool.num_free == 16
    cache.check_invariants()


def test_insert_with_too_few_tokens_changes_no_refcount(cache: PrefixCache) -> None:
    block_table = cache.pool.allocate(2)
    with pytest.raises(InvalidId, match="tokens"):
        cache.insert(seq(1), block_table)
    assert [cache.pool.refcount(int(b)) for b in block_table] == [1, 1]
    assert cache.num_cached_blocks == 0
    cache.check_invariants()


# -- scenario 11: disabled cache ------------------------------------------------------------------


def test_a_disabled_cache_takes_no_reference() -> None:
    cache = make_cache(enabled=False)
    block_table = cache.pool.allocate(2)
    assert cache.insert(seq(1, 2), block_table).tolist() == block_table.tolist()
    assert cache.pool.dec_ref(block_table) == 2
    assert cache.lookup(seq(1, 2)).num_blocks == 0
    assert cache.evict(4) == 0
    assert cache.reclaim_prefix_blocks_for(seq(1, 2), 0, 3) == PrefixReclaim(target=3, free=16)
    assert cache.pool.num_free == 16
    cache.check_invariants()


# -- scenario 12: refcounts never below zero ------------------------------------------------------


def test_releasing_an_evicted_blocks_cache_reference_twice_is_refused(cache: PrefixCache) -> None:
    block_table = cache_blocks(cache, seq(1))
    cache.evict(1)
    with pytest.raises(DoubleFree):
        cache.pool.dec_ref(block_table)
    assert cache.pool.num_free == 16
    cache.check_invariants()


def test_unpinning_a_match_twice_is_refused_before_anything_changes(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2))
    match = cache.lookup(seq(1, 2), pin=True)
    cache.unpin(match.node_ids)
    with pytest.raises(DoubleFree):
        cache.unpin(match.node_ids)
    assert cache.num_evictable_blocks == 2
    cache.check_invariants()


def test_check_invariants_catches_a_stolen_cache_reference(cache: PrefixCache) -> None:
    block_table = cache_blocks(cache, seq(1))
    cache.pool.dec_ref(block_table)  # someone released the cache's own reference
    with pytest.raises(InvariantViolation, match=f"block {int(block_table[0])}"):
        cache.check_invariants()


# -- scenario 13: pressure ------------------------------------------------------------------------


def test_evict_keeps_going_past_nodes_whose_blocks_are_still_held() -> None:
    cache = make_cache(8)
    held = cache.pool.allocate(2)
    cache.insert(seq(1, 2), held)  # oldest: evicting it frees nothing, a sequence holds it
    cache_blocks(cache, seq(3, 4))
    cache_blocks(cache, seq(5, 6))
    assert cache.evict(3) == 3
    assert cache.blocks_evicted == 5
    assert cache.lookup(seq(5, 6)).num_blocks == 1
    cache.check_invariants()


def test_evict_stops_when_nothing_is_evictable(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2))
    match = cache.lookup(seq(1), pin=True)
    assert cache.evict(10) == 1
    assert cache.evict(10) == 0
    cache.unpin(match.node_ids)
    cache.check_invariants()


# -- scenario 14: reclaim for a prompt -------------------------------------------------------------


def test_reclaim_for_a_prompt_never_evicts_the_prefix_it_reuses() -> None:
    cache = make_cache(6)
    prefix = cache_blocks(cache, seq(1, 2, 3))  # least recently used of all
    cache_blocks(cache, seq(7, 8))
    prompt = np.concatenate([seq(1, 2, 3), [9]]).astype(np.int32)
    reclaim = cache.reclaim_prefix_blocks_for(prompt, 0, 6)
    assert reclaim == PrefixReclaim(target=3, free=3)
    assert reclaim.fits
    assert cache.lookup(prompt).block_ids.tolist() == prefix.tolist()
    assert cache.num_evictable_blocks == 3  # unpinned again
    cache.check_invariants()


def test_reclaim_for_a_prompt_reports_a_shortfall_when_only_the_prefix_is_left() -> None:
    cache = make_cache(4)
    cache_blocks(cache, seq(1, 2, 3))
    prompt = np.concatenate([seq(1, 2, 3), [9]]).astype(np.int32)
    reclaim = cache.reclaim_prefix_blocks_for(prompt, 0, 6)
    assert reclaim == PrefixReclaim(target=3, free=1)
    assert not reclaim.fits
    assert cache.num_cached_blocks == 3
    cache.check_invariants()


def test_reclaim_for_a_prompt_leaves_the_last_prompt_block_to_prefill() -> None:
    cache = make_cache(3)
    cache_blocks(cache, seq(1, 2))
    reclaim = cache.reclaim_prefix_blocks_for(seq(1, 2), 0, 3)  # reuses block 1 only
    assert reclaim == PrefixReclaim(target=2, free=2)
    assert cache.lookup(seq(1)).num_blocks == 1
    assert cache.lookup(seq(1, 2)).num_blocks == 1


def test_reclaim_for_an_empty_prompt_reuses_nothing(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2))
    reclaim = cache.reclaim_prefix_blocks_for(np.empty(0, dtype=np.int32), 0, 16)
    assert reclaim == PrefixReclaim(target=16, free=16)


def test_reclaim_for_a_prompt_with_room_evicts_nothing(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2))
    assert cache.reclaim_prefix_blocks_for(seq(5), 0, 4) == PrefixReclaim(target=4, free=14)
    assert cache.num_cached_blocks == 2


def test_reclaim_for_a_prompt_target_never_goes_below_zero(cache: PrefixCache) -> None:
    cache_blocks(cache, seq(1, 2, 3))
    prompt = np.concatenate([seq(1, 2, 3), [9]]).astype(np.int32)
    assert cache.reclaim_prefix_blocks_for(prompt, 0, 1).target == 0


def test_reclaim_for_a_prompt_refuses_a_negative_need(cache: PrefixCache) -> None:
    with pytest.raises(InvalidId, match="-1"):
        cache.reclaim_prefix_blocks_for(seq(1), 0, -1)


# -- stateful: every refcount accounted for ---------------------------------------------------------


@dataclass
class LiveSequence:
    tokens: NDArray[np.int32]
    block_table: NDArray[np.int32]
    node_ids: NDArray[np.int32]


class CacheMachine(RuleBasedStateMachine):
    """Sequences attach, compute, cache and free under memory pressure. After every step each
    block's refcount must equal the trie nodes caching it plus the live sequences holding it."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(12)
        self.live: list[LiveSequence] = []

    @initialize(num_blocks=st.integers(4, 24), enabled=st.booleans())
    def setup(self, num_blocks: int, enabled: bool) -> None:
        self.cache = make_cache(num_blocks, enabled=enabled)

    @rule(
        prompt=st.lists(st.integers(0, 1), min_size=0, max_size=4 * BS),
        generated=st.integers(0, 2 * BS),
        adapter=st.sampled_from([0, 1]),
    )
    def start(self, prompt: list[int], generated: int, adapter: int) -> None:
        tokens = np.array(prompt + [2] * generated, dtype=np.int32)
        needed = -(-len(tokens) // BS)
        match = self.cache.lookup_prompt(tokens[: len(prompt)], adapter, pin=True)
        reclaim = self.cache.reclaim_prefix_blocks_for(tokens[: len(prompt)], adapter, needed)
        assert reclaim.target == max(0, needed - match.num_blocks)
        if not reclaim.fits:
            self.cache.unpin(match.node_ids)
            return
        block_table = np.empty(needed, dtype=np.int32)
        block_table[: match.num_blocks] = match.block_ids
        self.cache.pool.inc_ref(match.block_ids)
        self.cache.pool.allocate_into(block_table, match.num_blocks, needed - match.num_blocks)
        self.live.append(LiveSequence(tokens, block_table, match.node_ids))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), cache_it=st.booleans())
    def finish(self, data: st.DataObject, cache_it: bool) -> None:
        sequence = self.live.pop(data.draw(st.integers(0, len(self.live) - 1), label="which"))
        if cache_it:
            self.cache.insert(sequence.tokens, sequence.block_table[: len(sequence.tokens) // BS])
        self.cache.unpin(sequence.node_ids)
        self.cache.pool.dec_ref(sequence.block_table)

    @rule(n=st.integers(0, 5))
    def evict(self, n: int) -> None:
        free_before = self.cache.pool.num_free
        freed = self.cache.evict(n)
        assert self.cache.pool.num_free == free_before + freed
        assert freed == n or self.cache.num_evictable_blocks == 0

    @invariant()
    def every_reference_is_accounted_for(self) -> None:
        self.cache.check_invariants()
        pool = self.cache.pool
        expected = np.bincount(self.cache.trie.cached_block_ids(), minlength=pool.num_total)
        for sequence in self.live:
            expected += np.bincount(sequence.block_table, minlength=pool.num_total)
        assert pool.refcounts().tolist() == expected.tolist()


TestPrefixCacheAccounting = CacheMachine.TestCase
