"""The KV cache core (``lifecycle._kvcache.KVCacheCore``), one behaviour per test.

Prompts are written as blocks of ``BS`` tokens. A prompt's prefix is "cached" by admitting it and
finishing it with its blocks; "reuse" is what a later admission of another prompt finds, in blocks.
Which blocks an eviction took is read from the pool's refcounts, never from timing or internals.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numpy.typing import ArrayLike

from lifecycle.errors import InvalidId, InvariantViolation, LifecycleError, OutOfBlocks, SequenceStateError, TornDown
from kvcache_support import Core, hash_keys, make_core, nh, reference_block_hashes

BS = 4
ROOT = Path(__file__).resolve().parents[1]


def blocks(*rows: int | list[int]) -> list[int]:
    """Tokens of whole blocks: an int ``t`` is a block of ``BS`` tokens ``t``; a list is taken as is."""
    tokens: list[int] = []
    for row in rows:
        tokens.extend([row] * BS if isinstance(row, int) else row)
    return tokens


def cache_prompt(core: Core, tokens: list[int], adapter: int = 0) -> list[int]:
    """Admit ``tokens`` with a block for each of them, finish with caching; returns its table."""
    handle = core.admit(tokens, -(-len(tokens) // core.block_size), adapter=adapter)
    table: list[int] = core.block_table(handle).tolist()
    core.finish(handle)
    core.check_invariants()
    return table


def reuse_of(core: Core, tokens: list[int], adapter: int = 0, max_prefix: int = -1) -> int:
    """Blocks a new request for ``tokens`` reuses (the lookup counts as a use of them)."""
    handle = core.admit(tokens, 0, max_prefix=max_prefix, adapter=adapter)
    reused = core.num_blocks(handle)
    core.finish(handle, cache=False)
    core.check_invariants()
    return reused


def freed(core: Core, block_ids: list[int]) -> list[int]:
    """Those of ``block_ids`` no one holds any more."""
    return [block for block in block_ids if core.pool.refcount(block) == 0]


@pytest.fixture
def core() -> Core:
    return make_core(32, BS)


# -- matching ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_blocks", "extra_tokens", "expected"),
    [(3, 0, 2), (3, 1, 3), (2, 3, 2), (1, 0, 0), (0, 1, 0), (4, 0, 3)],
)
def test_a_hit_is_whole_blocks_and_never_covers_the_prompts_last_token(
    core: Core, prompt_blocks: int, extra_tokens: int, expected: int
) -> None:
    cache_prompt(core, blocks(1, 2, 3, 4, 5))
    prompt = blocks(1, 2, 3, 4)[: prompt_blocks * BS] + [9] * extra_tokens
    assert reuse_of(core, prompt) == expected


def test_reuse_puts_the_cached_block_ids_at_the_head_of_the_table(core: Core) -> None:
    cached = cache_prompt(core, blocks(1, 2, 3))
    handle = core.admit(blocks(1, 2, 7), 3)
    table = core.block_table(handle).tolist()
    assert table[:2] == cached[:2]
    assert set(table[2:]).isdisjoint(cached)
    assert core.cached_tokens(handle) == 2 * BS


@pytest.mark.parametrize("position", [0, 1, BS - 1, BS, 2 * BS - 1])
def test_a_block_differing_in_one_token_never_matches(core: Core, position: int) -> None:
    # The four cached blocks are one run; a change in its first block or inside it ends the match.
    cached = blocks(1, 2, 3, 4)
    cache_prompt(core, cached)
    prompt = list(cached)
    prompt[position] = 9
    assert reuse_of(core, prompt) == position // BS


def test_adapters_have_separate_roots(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3), adapter=5)
    assert reuse_of(core, blocks(1, 2, 3), adapter=0) == 0
    assert reuse_of(core, blocks(1, 2, 3), adapter=6) == 0
    assert reuse_of(core, blocks(1, 2, 3), adapter=5) == 2


def test_a_run_splits_where_requests_diverge_and_both_branches_stay_reusable(core: Core) -> None:
    first = cache_prompt(core, blocks(1, 2, 3, 4))
    assert core.trie.num_nodes == 1
    second = cache_prompt(core, blocks(1, 2, 7, 8))
    assert core.trie.num_nodes == 3
    assert second[:2] == first[:2]
    assert reuse_of(core, blocks(1, 2, 3, 4, 0)) == 4
    assert reuse_of(core, blocks(1, 2, 7, 8, 0)) == 4
    assert reuse_of(core, blocks(1, 2, 5)) == 2


def test_a_match_ending_inside_a_run_cuts_it_there_and_later_requests_reuse_either_part(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3, 4))
    assert reuse_of(core, blocks(1, 2, 3)) == 2  # the last block is the prompt's last token's
    assert core.trie.num_nodes == 2
    assert core.num_cached_blocks == 4
    assert reuse_of(core, blocks(1, 2, 3, 4, 5)) == 4
    assert reuse_of(core, blocks(1, 9)) == 1


def test_a_request_extending_a_cached_run_adds_a_node_below_it(core: Core) -> None:
    cache_prompt(core, blocks(1, 2))
    cache_prompt(core, blocks(1, 2, 3, 4))
    assert core.num_cached_blocks == 4
    assert reuse_of(core, blocks(1, 2, 3, 4, 5)) == 4


def test_max_prefix_limits_the_reuse(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3, 4))
    assert reuse_of(core, blocks(1, 2, 3, 4, 5), max_prefix=2) == 2
    assert reuse_of(core, blocks(1, 2, 3, 4, 5), max_prefix=0) == 0
    assert core.trie.num_nodes == 2  # the limit cut the run like a divergence would


def _colliding_blocks() -> tuple[list[int], list[int]]:
    """Two different 2-token blocks with the same NH value, so the same child key under any parent:
    with a = t0 + k0 and b = t1 + k1 (mod 2**32), (2x, y) and (x, 2y) have equal products."""
    k0, k1 = hash_keys(3)[:2]

    def doubling_pair(key: int) -> tuple[int, int]:
        # z and 2z (both below 2**31) whose offsets by the key are token ids
        def token(value: int) -> int:
            return (value - key) % (1 << 32)

        z = next(z for z in range(1 << 16, 1 << 31, 1 << 16) if max(token(z), token(2 * z)) < 1 << 31)
        return token(z), token(2 * z)

    x, two_x = doubling_pair(k0)
    y, two_y = doubling_pair(k1)
    return [two_x, y], [x, two_y]


def test_a_hash_collision_never_decides_a_match() -> None:
    core = make_core(32, 2)
    first, second = _colliding_blocks()
    keys = hash_keys(3)
    assert first != second and nh(first, keys) == nh(second, keys)  # the lookup hash cannot tell them apart
    cached = cache_prompt(core, first + [5, 5])
    assert reuse_of(core, second + [5, 5, 1]) == 0
    other = cache_prompt(core, second + [6, 6])
    assert core.trie.num_nodes == 2
    assert set(other).isdisjoint(cached)
    handle = core.admit(first + [5, 5, 1], 0)
    assert core.block_table(handle).tolist() == cached
    core.finish(handle, cache=False)
    handle = core.admit(second + [6, 6, 1], 0)
    assert core.block_table(handle).tolist() == other
    core.finish(handle, cache=False)
    core.check_invariants()


def test_with_the_cache_disabled_nothing_matches_and_nothing_takes_a_reference() -> None:
    core = make_core(16, BS, enable_prefix_cache=False)
    for _ in range(3):
        handle = core.admit(blocks(1, 2, 3), 3)
        assert core.num_blocks(handle) == 3
        assert core.cache(handle, 3) == 0
        core.finish(handle)
        core.check_invariants()
    assert core.num_cached_blocks == 0
    assert core.pool.num_free == 16
    assert core.counters()["prefix_hits"] == 0


# -- attach --------------------------------------------------------------------------------------


def test_a_retried_attach_with_the_same_tokens_takes_no_second_references(core: Core) -> None:
    cached = cache_prompt(core, blocks(1, 2, 3))
    handle = core.open()
    assert core.attach(handle, blocks(1, 2, 9)) == 2
    refcounts = core.pool.refcounts().tolist()
    assert core.attach(handle, blocks(1, 2, 9)) == 2
    assert core.pool.refcounts().tolist() == refcounts
    assert core.block_table(handle).tolist() == cached[:2]
    core.check_invariants()
    core.finish(handle, cache=False)
    assert [core.pool.refcount(block) for block in cached] == [1, 1, 1]


def test_a_retried_attach_picks_up_a_prefix_cached_since(core: Core) -> None:
    handle = core.open()
    assert core.attach(handle, blocks(1, 2, 9)) == 0
    cached = cache_prompt(core, blocks(1, 2, 3))
    assert core.attach(handle, blocks(1, 2, 9)) == 2
    assert core.block_table(handle).tolist() == cached[:2]
    core.check_invariants()


def test_a_retried_attach_after_caching_mid_life_leaves_the_cached_run_intact() -> None:
    core = make_core(16, 2)
    handle = core.open()
    core.attach(handle, [1, 2, 3, 4], grow_to=2)
    cached = core.block_table(handle).tolist()
    core.cache(handle, 2)
    assert core.attach(handle, [1, 2, 3, 4]) == 1  # the prompt's last block is never reused
    core.grow(handle, 2)
    core.check_invariants()
    probe = core.admit([1, 2, 3, 4, 5], 0)
    assert core.block_table(probe).tolist() == cached


def test_an_attach_with_other_tokens_than_the_records_is_refused(core: Core) -> None:
    handle = core.open()
    core.attach(handle, blocks(1, 2, 9))
    with pytest.raises(SequenceStateError, match="other tokens"):
        core.attach(handle, blocks(1, 2, 8))
    assert core.tokens(handle).tolist() == blocks(1, 2, 9)


def test_an_attach_out_of_blocks_for_its_growth_leaves_the_prefix_attached() -> None:
    core = make_core(6, BS)
    cached = cache_prompt(core, blocks(1, 2, 3))
    hog = core.admit(blocks(8), 3)
    handle = core.open()
    with pytest.raises(OutOfBlocks):
        core.attach(handle, blocks(1, 2, 9), grow_to=5)
    core.check_invariants()
    assert core.block_table(handle).tolist() == cached[:2]
    assert core.cached_tokens(handle) == 2 * BS
    core.finish(hog, cache=False)
    assert core.attach(handle, blocks(1, 2, 9), grow_to=5) == 2
    assert core.num_blocks(handle) == 5
    core.check_invariants()


@pytest.mark.parametrize("take_blocks", ["grow", "allocate", "attach_empty"])
def test_an_attach_after_the_table_has_blocks_is_refused(core: Core, take_blocks: str) -> None:
    cache_prompt(core, blocks(1, 2, 3))
    handle = core.open()
    if take_blocks == "grow":
        core.grow(handle, 2)
    elif take_blocks == "allocate":
        core.allocate(handle, 2)
    else:
        core.attach(handle, [], grow_to=2)
    table = core.block_table(handle).tolist()
    with pytest.raises(SequenceStateError, match="grew"):
        core.attach(handle, blocks(1, 2, 9))
    assert core.block_table(handle).tolist() == table
    core.check_invariants()


def test_admit_out_of_blocks_leaves_nothing_open() -> None:
    core = make_core(6, BS)
    cached = cache_prompt(core, blocks(1, 2))
    hog = core.admit(blocks(8), 3)
    counters = core.counters()
    with pytest.raises(OutOfBlocks, match="need 3 blocks"):
        core.admit(blocks(1, 2, 9), 5)
    assert core.num_live_sequences == 1
    assert core.live_totals() == (1, 3)
    assert [core.pool.refcount(block) for block in cached] == [1, 1]
    assert core.counters()["sequences_allocated"] == counters["sequences_allocated"]
    core.check_invariants()
    core.finish(hog)


# -- grow and allocate -----------------------------------------------------------------------------


def test_grow_is_all_or_nothing(core: Core) -> None:
    handle = core.admit(blocks(1), 1)
    other = core.admit(blocks(2), 29)
    with pytest.raises(OutOfBlocks):
        core.grow(handle, 4)
    assert core.num_blocks(handle) == 1
    assert core.pool.num_free == 2
    assert core.grow(handle, 3) == 2
    assert core.grow(handle, 2) == 0
    core.check_invariants()
    core.finish(other)


def test_grow_evicts_least_recently_used_cached_blocks_when_short() -> None:
    core = make_core(8, BS)
    old = cache_prompt(core, blocks(1, 2))
    new = cache_prompt(core, blocks(3, 4))
    handle = core.admit(blocks(5), 1)
    assert core.pool.num_free == 3
    assert core.grow(handle, 5) == 4
    assert core.num_cached_blocks == 3
    assert old[1] in core.block_table(handle).tolist()  # the least recently used run's deepest block
    assert [core.pool.refcount(block) for block in new] == [1, 1]
    core.check_invariants()


def test_grow_never_evicts_a_prefix_a_request_holds() -> None:
    core = make_core(8, BS)
    cached = cache_prompt(core, blocks(1, 2, 3))
    core.admit(blocks(8), 2)
    handle = core.admit(blocks(1, 2, 9), 2)
    with pytest.raises(OutOfBlocks):
        core.grow(handle, 7)
    assert core.num_blocks(handle) == 2
    assert core.grow(handle, 6) == 4
    assert [core.pool.refcount(block) for block in cached[:2]] == [2, 2]
    assert core.num_cached_blocks == 2  # only the block no one held went
    core.check_invariants()


def test_allocate_never_evicts() -> None:
    core = make_core(6, BS)
    cache_prompt(core, blocks(1, 2, 3))
    handle = core.open()
    with pytest.raises(OutOfBlocks):
        core.allocate(handle, 4)
    assert core.num_cached_blocks == 3
    assert core.num_blocks(handle) == 0
    core.allocate(handle, 3)
    assert core.num_blocks(handle) == 3
    core.check_invariants()


def test_allocate_is_refused_for_a_record_that_has_blocks(core: Core) -> None:
    handle = core.admit(blocks(1), 1)
    with pytest.raises(SequenceStateError):
        core.allocate(handle, 2)
    assert core.num_blocks(handle) == 1


# -- eviction ------------------------------------------------------------------------------------


def test_eviction_order_is_a_per_block_lru_deepest_block_first() -> None:
    core = make_core(16, 1)
    first = cache_prompt(core, [1, 2, 3])
    second = cache_prompt(core, [1, 2, 4, 5])
    reuse_of(core, [1, 2, 3, 9])  # uses 1, 2, 3 after 4, 5
    cached = list(dict.fromkeys(first + second))
    order = []
    for _ in range(5):
        gone = set(freed(core, cached))
        assert core.evict(1) == 1
        core.check_invariants()
        [block] = set(freed(core, cached)) - gone
        order.append(block)
    assert order == [second[3], second[2], first[2], first[1], first[0]]


def test_eviction_trims_a_run_from_its_tail_and_the_rest_still_matches(core: Core) -> None:
    cached = cache_prompt(core, blocks(1, 2, 3, 4))
    assert core.evict(1) == 1
    assert freed(core, cached) == [cached[3]]
    assert reuse_of(core, blocks(1, 2, 3, 4, 5)) == 3
    core.check_invariants()


def test_eviction_takes_the_least_recently_used_branch_first(core: Core) -> None:
    first = cache_prompt(core, blocks(1, 2))
    second = cache_prompt(core, blocks(3, 4))
    reuse_of(core, blocks(1, 2, 0))
    assert core.evict(2) == 2
    assert freed(core, first + second) == second


def test_evicting_more_than_is_evictable_frees_what_there_is(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3))
    assert core.evict(10) == 3
    assert core.evict(10) == 0
    assert core.num_cached_blocks == 0
    core.check_invariants()


def test_a_prefix_a_request_holds_is_never_evicted(core: Core) -> None:
    cached = cache_prompt(core, blocks(1, 2, 3))
    handle = core.admit(blocks(1, 2, 9), 3)
    assert core.num_evictable_blocks == 1
    assert core.evict(10) == 1
    assert freed(core, cached) == [cached[2]]
    core.finish(handle, cache=False)
    assert core.num_evictable_blocks == 2
    assert core.evict(10) == 2
    core.check_invariants()


# -- finish ----------------------------------------------------------------------------------------


def test_finish_caches_the_full_blocks_it_has_tokens_and_blocks_for(core: Core) -> None:
    handle = core.admit(blocks(1, 2, 3) + [4, 4], 3)
    core.append(handle, [5])
    core.finish(handle)
    assert core.num_cached_blocks == 3
    handle = core.admit(blocks(1, 2, 3) + [4, 4], 5)
    assert core.num_blocks(handle) == 5
    core.finish(handle)
    assert core.num_cached_blocks == 3  # the fourth block had three tokens of four
    handle = core.admit(blocks(6, 7, 8), 1)
    core.finish(handle)
    assert core.num_cached_blocks == 4  # tokens of three blocks, a table of one
    core.check_invariants()


def test_finish_without_caching_releases_everything(core: Core) -> None:
    handle = core.admit(blocks(1, 2, 3), 3)
    core.finish(handle, cache=False)
    assert core.num_cached_blocks == 0
    assert core.pool.num_free == 32


def test_a_sequence_marked_failed_is_never_cached() -> None:
    core = make_core(32, BS, num_snapshots=2)
    handle = core.admit(blocks(1, 2, 3, 4), 4)
    core.mark_failed(handle)
    assert core.cache(handle, 2) == 0
    assert core.snapshot_point(handle, 2) == (-1, False)
    core.finish(handle)
    assert core.num_cached_blocks == 0
    assert core.pool.num_free == 32
    core.check_invariants()


def test_finish_over_cached_blocks_keeps_the_nodes_blocks_and_frees_the_duplicates(core: Core) -> None:
    late = core.admit(blocks(1, 2, 3), 3)
    early = cache_prompt(core, blocks(1, 2, 3))
    duplicates = core.block_table(late).tolist()
    core.finish(late)
    assert freed(core, duplicates) == duplicates
    assert [core.pool.refcount(block) for block in early] == [1, 1, 1]
    core.check_invariants()


def test_finish_returns_the_adapter_slot_the_record_held(core: Core) -> None:
    handle = core.open(adapter=3, adapter_slot=2)
    assert core.adapter_slots().tolist() == [2]
    assert core.finish(handle) == 2
    assert core.finish(core.open()) == -1


def test_a_second_finish_is_refused(core: Core) -> None:
    handle = core.admit(blocks(1, 2), 2)
    core.finish(handle)
    with pytest.raises(SequenceStateError, match="not a live sequence"):
        core.finish(handle)
    core.check_invariants()


def _finish_with_capacity(cached_blocks: int) -> int:
    """Token bytes the cache holds after finishing a record with room for 4096 tokens whose first
    ``cached_blocks`` blocks are cached."""
    core = make_core(1024, BS)
    handle = core.open(token_capacity=4096)
    core.attach(handle, blocks(*[[i] * BS for i in range(cached_blocks)]), grow_to=cached_blocks)
    core.finish(handle)
    assert core.num_cached_blocks == cached_blocks
    core.check_invariants()
    return core.memory()["tokens"]


def test_finish_hands_the_records_buffer_to_the_cache_when_at_least_half_of_it_is_cached() -> None:
    assert _finish_with_capacity(4096 // BS // 2) >= 4096 * 4


def test_finish_copies_the_cached_run_when_most_of_the_records_buffer_would_be_waste() -> None:
    held = _finish_with_capacity(4096 // BS // 2 - 1)
    assert (4096 // 2 - BS) * 4 <= held < 4096 * 4


# -- caching mid-life ------------------------------------------------------------------------------


def test_cache_mid_life_returns_the_blocks_newly_cached_and_makes_them_reusable(core: Core) -> None:
    cache_prompt(core, blocks(1))
    handle = core.admit(blocks(1, 2, 3), 3)
    assert core.cache(handle, 3) == 2
    assert core.cache(handle, 3) == 0
    assert reuse_of(core, blocks(1, 2, 3, 4)) == 3
    core.check_invariants()


def test_cache_mid_life_pins_the_path_until_finish(core: Core) -> None:
    handle = core.admit(blocks(1, 2, 3), 3)
    core.cache(handle, 2)
    assert core.num_cached_blocks == 2
    assert core.num_evictable_blocks == 0
    assert core.evict(10) == 0
    assert core.reset() is False
    core.finish(handle)
    assert core.num_evictable_blocks == 3
    core.check_invariants()


def test_cache_past_the_full_blocks_is_refused(core: Core) -> None:
    handle = core.admit(blocks(1, 2) + [3], 2)
    with pytest.raises(SequenceStateError, match="full blocks"):
        core.cache(handle, 3)
    handle = core.admit(blocks(1, 2, 3), 1)
    with pytest.raises(SequenceStateError, match="full blocks"):
        core.cache(handle, 2)
    assert core.num_cached_blocks == 0


def test_a_record_cached_step_by_step_keeps_one_run(core: Core) -> None:
    handle = core.admit(blocks(1), 1)
    assert core.cache(handle, 1) == 1
    for step in range(2, 6):
        core.append(handle, blocks(step))
        core.grow(handle, step)
        assert core.cache(handle, step) == 1
        core.check_invariants()
    assert core.trie.num_nodes == 1
    core.finish(handle)
    assert reuse_of(core, blocks(1, 2, 3, 4, 5, 6)) == 5


# -- snapshots -------------------------------------------------------------------------------------


def snapshot_core(num_snapshots: int, *, cut: bool = False) -> Core:
    return make_core(32, 1, num_snapshots=num_snapshots, snapshot_cut=cut)


def test_snapshot_ids_are_handed_out_fresh_then_reused_least_recently_used_first() -> None:
    core = snapshot_core(2)
    handle = core.admit([1, 2, 3, 4, 5, 6], 6)
    assert core.snapshot_point(handle, 2) == (0, True)
    assert core.snapshot_point(handle, 4) == (1, True)
    assert core.snapshot_point(handle, 2) == (0, False)  # a use: 1 is now the least recent
    assert core.snapshot_point(handle, 5) == (1, True)
    assert core.snapshot_point(handle, 4) == (0, True)
    assert core.num_snapshots_used == 2
    assert core.counters()["snapshots_evicted"] == 2
    core.check_invariants()


def test_a_rolling_snapshot_replaces_the_records_previous_one() -> None:
    core = snapshot_core(3)
    handle = core.admit([1, 2, 3, 4, 5, 6], 6)
    assert core.snapshot_point(handle, 2, rolling=True) == (0, True)
    assert core.snapshot_point(handle, 4, rolling=True) == (0, True)
    assert core.num_snapshots_used == 1
    assert core.snapshot_point(handle, 4, rolling=True) == (0, False)
    core.finish(handle)
    other = core.admit([1, 2, 3, 4, 9], 0)
    assert core.prefix_snapshot(other) == 0
    core.check_invariants()


def test_a_rolling_snapshot_another_request_uses_is_not_dropped() -> None:
    core = snapshot_core(3)
    first = core.admit([1, 2, 3, 4, 5, 6], 6)
    second = core.admit([1, 2, 3, 4, 5, 6], 6)
    assert core.snapshot_point(first, 2, rolling=True) == (0, True)
    assert core.snapshot_point(second, 2, rolling=True) == (0, False)
    assert core.snapshot_point(second, 4, rolling=True) == (1, True)
    assert core.num_snapshots_used == 2  # 0 stays: it is the first request's
    assert core.snapshot_point(first, 4, rolling=True) == (1, False)
    assert core.num_snapshots_used == 1
    core.check_invariants()


def test_a_non_rolling_snapshot_is_kept_when_the_record_rolls_on() -> None:
    core = snapshot_core(3)
    handle = core.admit([1, 2, 3, 4, 5, 6], 6)
    assert core.snapshot_point(handle, 2) == (0, True)
    assert core.snapshot_point(handle, 4, rolling=True) == (1, True)
    assert core.snapshot_point(handle, 5, rolling=True) == (1, True)
    assert core.num_snapshots_used == 2


def test_with_snapshot_cut_reuse_ends_at_the_deepest_snapshot_matched() -> None:
    core = snapshot_core(4, cut=True)
    handle = core.admit([1, 2, 3, 4, 5, 6], 6)
    core.snapshot_point(handle, 2)
    sid, _ = core.snapshot_point(handle, 4)
    core.finish(handle)
    other = core.admit([1, 2, 3, 4, 5, 6, 7], 0)
    assert core.num_blocks(other) == 4
    assert core.prefix_snapshot(other) == sid
    core.finish(other)
    assert reuse_of(core, [1, 2, 3, 9]) == 2
    assert reuse_of(core, [1, 9]) == 0
    counters = core.counters()
    assert (counters["snapshot_hits"], counters["snapshot_hits_cut_short"]) == (2, 3)
    core.check_invariants()


def test_evicting_a_snapshots_block_frees_its_id() -> None:
    core = snapshot_core(2)
    handle = core.admit([1, 2, 3], 3)
    assert core.snapshot_point(handle, 3) == (0, True)
    core.finish(handle)
    assert core.evict(1) == 1
    assert core.num_snapshots_used == 0
    assert core.counters()["snapshots_evicted"] == 1
    core.check_invariants()


def test_drop_snapshot_frees_the_id_and_keeps_the_blocks() -> None:
    core = snapshot_core(2)
    handle = core.admit([1, 2, 3], 3)
    sid, _ = core.snapshot_point(handle, 2)
    core.drop_snapshot(sid)
    assert core.num_snapshots_used == 0
    assert core.num_cached_blocks == 2
    core.drop_snapshot(sid)  # a second drop is a no-op
    core.check_invariants()


def test_snapshot_point_without_snapshot_ids_does_nothing() -> None:
    core = make_core(32, 1)
    handle = core.admit([1, 2, 3], 3)
    assert core.snapshot_point(handle, 2) == (-1, False)
    assert core.num_cached_blocks == 0


def test_prefix_snapshot_still_names_the_reused_prefixs_snapshot_after_caching_mid_life() -> None:
    core = snapshot_core(4, cut=True)
    handle = core.admit([1, 2, 3, 4, 5, 6], 6)
    sid, _ = core.snapshot_point(handle, 2)
    core.snapshot_point(handle, 4)
    core.finish(handle)
    other = core.admit([1, 2, 3, 9, 9, 9], 6)
    assert core.prefix_snapshot(other) == sid
    core.snapshot_point(other, 5)
    assert core.prefix_snapshot(other) == sid


# -- reset -----------------------------------------------------------------------------------------


def test_reset_drops_every_cached_block_and_snapshot() -> None:
    core = make_core(16, 1, num_snapshots=2)
    handle = core.admit([1, 2, 3, 4], 4)
    core.snapshot_point(handle, 2)
    core.finish(handle)
    assert core.reset() is True
    assert (core.num_cached_blocks, core.num_snapshots_used, core.pool.num_free) == (0, 0, 16)
    core.check_invariants()


def test_reset_refuses_while_a_cached_prefix_is_pinned(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3))
    handle = core.admit(blocks(1, 2), 2)
    assert core.reset() is False
    assert core.num_cached_blocks == 3
    core.finish(handle, cache=False)
    assert core.reset() is True


# -- reclaim_for -----------------------------------------------------------------------------------


def test_reclaim_for_never_evicts_the_prefix_it_makes_room_for() -> None:
    core = make_core(8, BS)
    wanted = cache_prompt(core, blocks(1, 2, 3))  # the least recently used: only the pin keeps it
    other = cache_prompt(core, blocks(5, 6))
    target, free = core.reclaim_for(blocks(1, 2, 3, 4), 0, 8)
    assert (target, free) == (5, 5)
    assert freed(core, wanted) == []
    assert freed(core, other) == other
    core.check_invariants()


def test_reclaim_for_an_empty_prompt_reuses_nothing(core: Core) -> None:
    cache_prompt(core, blocks(1, 2))
    assert core.reclaim_for([], 0, 3) == (3, 30)
    assert core.num_cached_blocks == 2


def test_reclaim_for_stops_when_nothing_is_evictable() -> None:
    core = make_core(8, BS)
    cache_prompt(core, blocks(1, 2, 3))
    assert core.reclaim_for(blocks(1, 2, 3, 4), 0, 20) == (17, 5)


# -- handles ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda core, h: core.finish(h),
        lambda core, h: core.append(h, [1]),
        lambda core, h: core.grow(h, 3),
        lambda core, h: core.attach(h, [1, 2]),
        lambda core, h: core.cache(h, 1),
        lambda core, h: core.tokens(h),
        lambda core, h: core.block_table(h),
        lambda core, h: core.block_hashes(h),
        lambda core, h: core.info(h),
        lambda core, h: core.num_tokens(h),
        lambda core, h: core.mark_failed(h),
        lambda core, h: core.clear(h),
        lambda core, h: core.snapshot_point(h, 1),
    ],
)
def test_a_finished_handle_is_refused(core: Core, call: Callable[[Core, int], object]) -> None:
    handle = core.admit(blocks(1, 2), 2)
    core.finish(handle)
    reopened = core.admit(blocks(3, 4), 2)  # the same record slot, a new generation
    with pytest.raises(SequenceStateError, match="not a live sequence"):
        call(core, handle)
    assert core.status(handle) == 0
    assert core.tokens(reopened).tolist() == blocks(3, 4)
    core.check_invariants()


def test_another_cores_handle_is_refused(core: Core) -> None:
    other = make_core(32, BS)
    handle = other.admit(blocks(1, 2), 2)
    mine = core.admit(blocks(3, 4), 2)
    with pytest.raises(SequenceStateError, match="not a live sequence"):
        core.finish(handle)
    assert core.is_live(mine) and other.is_live(handle)
    core.check_invariants()
    other.check_invariants()


@pytest.mark.parametrize("as_given", [float, str, lambda handle: handle + 2**64, lambda handle: None])
def test_a_handle_that_is_not_an_int_is_refused_and_finishes_nothing(
    core: Core, as_given: Callable[[int], object]
) -> None:
    handle = core.admit(blocks(1, 2), 2)
    finish = cast(Callable[[object], int], core.finish)
    with pytest.raises(LifecycleError, match="handle"):
        finish(as_given(handle))
    assert core.is_live(handle)


def test_a_retired_record_is_refused_for_growth_but_can_finish(core: Core) -> None:
    handle = core.admit(blocks(1, 2), 2)
    core.retire(handle)
    assert core.status(handle) == 2
    with pytest.raises(SequenceStateError, match="retired"):
        core.grow(handle, 3)
    with pytest.raises(SequenceStateError, match="retired"):
        core.retire(handle)
    core.finish(handle)
    assert core.num_cached_blocks == 2


def test_setters_refuse_values_past_the_records_tokens(core: Core) -> None:
    handle = core.admit([1, 2, 3], 1)
    with pytest.raises(InvalidId, match="outside"):
        core.set_prompt_len(handle, 4)
    with pytest.raises(InvalidId, match="outside"):
        core.set_ssm_tokens(handle, 4)
    core.set_ssm_tokens(handle, 2)
    core.set_prompt_len(handle, 1)
    assert core.info(handle)[1:] == (1, 3, 1, 1, 0, 2, False, -1)
    core.set_ssm_tokens(handle, None)
    assert core.ssm_tokens(handle) == -1


def test_bind_adapter_is_refused_once_the_record_has_tokens(core: Core) -> None:
    handle = core.open()
    core.bind_adapter(handle, 1, 7)
    assert core.adapter_slot(handle) == 1
    with pytest.raises(SequenceStateError, match="already holds adapter slot"):
        core.bind_adapter(handle, 2, 7)
    other = core.admit([1, 2], 1)
    with pytest.raises(SequenceStateError, match="already has"):
        core.bind_adapter(other, 2, 7)


def test_bind_adapter_keys_the_prefix_under_the_adapter(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3), adapter=7)
    handle = core.open()
    core.bind_adapter(handle, 0, 7)
    assert core.attach(handle, blocks(1, 2, 3)) == 2


# -- bad input ---------------------------------------------------------------------------------------

BAD_TOKENS: list[ArrayLike] = [
    np.array([1, 2, 3, 4, 5, -1], dtype=np.int32),
    [1, 2, -7],
    [1.0, 2.0],
    [1, 2.5],
    np.array([1, 2**31], dtype=np.uint32),
    [2**31],
    [2**70],
    np.array([[1, 2], [3, 4]], dtype=np.int32),
    np.array([1, None], dtype=object),
    [True, False],
    "1234",
]


def _state(core: Core) -> tuple[object, ...]:
    counters = {key: value for key, value in core.counters().items() if key != "time_in_library_ns"}
    return (core.pool.refcounts().tolist(), counters, core.num_cached_blocks, core.live_totals(), core.trie.num_nodes)


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=repr)
@pytest.mark.parametrize("call", ["admit", "attach", "append", "reclaim_for"])
def test_bad_token_ids_are_refused_and_change_nothing(core: Core, tokens: ArrayLike, call: str) -> None:
    cache_prompt(core, blocks(1, 2, 3))
    handle = core.open()
    before = _state(core)
    bad = cast(Any, tokens)  # what the stubs refuse, given all the same
    with pytest.raises(InvalidId):
        if call == "admit":
            core.admit(bad, 2)
        elif call == "attach":
            core.attach(handle, bad, grow_to=2)
        elif call == "append":
            core.append(handle, bad)
        else:
            core.reclaim_for(bad, 0, 2)
    assert _state(core) == before
    assert core.num_tokens(handle) == 0
    core.check_invariants()


def test_a_refused_attach_can_be_followed_by_a_good_one(core: Core) -> None:
    cached = cache_prompt(core, blocks(1, 2, 3))
    handle = core.open()
    with pytest.raises(InvalidId, match="-1"):
        core.attach(handle, blocks(1, 2, 3) + [-1])
    assert core.attach(handle, blocks(1, 2, 3) + [1]) == 3
    assert core.block_table(handle).tolist() == cached


# -- teardown ----------------------------------------------------------------------------------------


def test_close_reports_live_records_their_blocks_and_the_cache(core: Core) -> None:
    cache_prompt(core, blocks(1, 2))
    core.admit(blocks(1, 2, 3), 3)
    assert core.close() == (1, 3, 2)
    assert core.close() == (0, 0, 0)


@pytest.mark.parametrize(
    "call",
    [
        lambda core, h: core.open(),
        lambda core, h: core.admit([1, 2], 1),
        lambda core, h: core.attach(h, [1, 2]),
        lambda core, h: core.append(h, [1]),
        lambda core, h: core.grow(h, 3),
        lambda core, h: core.cache(h, 1),
        lambda core, h: core.snapshot_point(h, 1),
        lambda core, h: core.drop_snapshot(0),
        lambda core, h: core.finish(h),
        lambda core, h: core.clear(h),
        lambda core, h: core.evict(1),
        lambda core, h: core.reclaim_for([1, 2], 0, 1),
        lambda core, h: core.reset(),
        lambda core, h: core.tokens(h),
        lambda core, h: core.block_table(h),
        lambda core, h: core.status(h),
        lambda core, h: core.mark_failed(h),
        lambda core, h: core.check_invariants(),
    ],
)
def test_after_close_every_call_raises_torn_down(call: Callable[[Core, int], object]) -> None:
    core = make_core(32, BS, num_snapshots=2)
    handle = core.admit(blocks(1, 2, 3), 3)
    core.snapshot_point(handle, 2)
    core.close()
    with pytest.raises(TornDown):
        call(core, handle)


# -- counters and checks --------------------------------------------------------------------------------


def test_counters_count_lookups_hits_and_hit_tokens(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3))
    reuse_of(core, blocks(1, 2, 9))
    reuse_of(core, blocks(9))
    counters = core.counters()
    assert counters["prefix_lookups"] == 3
    assert counters["prefix_hits"] == 1
    assert counters["prefix_misses"] == 2
    assert counters["prefix_hit_tokens"] == 2 * BS
    assert counters["prefix_lookup_tokens"] == 3 * BS + 3 * BS + BS


def test_counters_count_blocks_allocated_cached_evicted_and_freed(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3))
    handle = core.admit(blocks(1, 2, 9), 4)
    core.finish(handle, cache=False)
    core.evict(2)
    counters = core.counters()
    assert counters["blocks_allocated"] == 3 + 2
    assert counters["blocks_cached"] == 3
    assert counters["blocks_evicted"] == 2
    assert counters["blocks_freed"] == 2 + 2
    assert (counters["sequences_allocated"], counters["sequences_freed"]) == (2, 2)


def test_check_invariants_catches_an_extra_reference_on_a_cached_block(core: Core) -> None:
    cached = cache_prompt(core, blocks(1, 2))
    core.pool.inc_ref([cached[1]])
    with pytest.raises(InvariantViolation, match=f"block {cached[1]}"):
        core.check_invariants()


def test_check_invariants_catches_a_reference_dropped_behind_the_cores_back(core: Core) -> None:
    handle = core.admit(blocks(1, 2), 2)
    core.pool.dec_ref([core.block_table(handle).tolist()[0]])
    with pytest.raises(InvariantViolation, match="refcount 0"):
        core.check_invariants()


def test_the_trie_checks_itself(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3))
    cache_prompt(core, blocks(1, 5))
    core.trie.check_invariants()
    assert (core.trie.num_nodes, core.trie.num_cached_blocks, core.trie.num_adapters) == (3, 4, 1)


# -- content hashes ------------------------------------------------------------------------------------


@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=40),
    block_size=st.sampled_from([1, 2, 3, 4, 5, 16]),
    adapter=st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63)]),
)
def test_block_hashes_follow_the_documented_algorithm(tokens: list[int], block_size: int, adapter: int) -> None:
    core = make_core(64, block_size)
    handle = core.open(adapter=adapter)
    core.append(handle, tokens)
    assert core.block_hashes(handle).tolist() == reference_block_hashes(tokens, block_size, adapter)


def test_block_hashes_are_the_same_in_another_process(core: Core) -> None:
    tokens = list(range(1000, 1000 + 5 * BS + 2))
    handle = core.admit(tokens, 6, adapter=3)
    script = (
        "from lifecycle._blockpool import BlockPool; from lifecycle._kvcache import KVCacheCore;"
        f"core = KVCacheCore(BlockPool(8), {BS}); h = core.open(adapter=3); core.append(h, {tokens!r});"
        "print(core.block_hashes(h).tolist())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == str(core.block_hashes(handle).tolist())


def test_block_hashes_of_a_reused_prefix_are_those_of_its_tokens(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3))
    handle = core.admit(blocks(1, 2, 3, 4), 4)
    assert core.cached_tokens(handle) == 3 * BS
    assert core.block_hashes(handle).tolist() == reference_block_hashes(blocks(1, 2, 3, 4), BS)
    core.append(handle, blocks(5)[:3])
    assert len(core.block_hashes(handle)) == 4
    core.append(handle, [5])
    assert core.block_hashes(handle).tolist() == reference_block_hashes(blocks(1, 2, 3, 4, 5), BS)


def test_block_hashes_after_clear_are_those_of_the_new_tokens(core: Core) -> None:
    handle = core.admit(blocks(1, 2, 3), 3)
    core.block_hashes(handle)
    core.clear(handle)
    core.attach(handle, blocks(4, 5, 6))
    assert core.block_hashes(handle).tolist() == reference_block_hashes(blocks(4, 5, 6), BS)


# -- clear -------------------------------------------------------------------------------------------


def test_clear_releases_the_prefix_and_the_blocks_and_keeps_the_record(core: Core) -> None:
    cache_prompt(core, blocks(1, 2, 3))
    handle = core.admit(blocks(1, 2, 9), 4)
    core.clear(handle)
    assert core.info(handle)[2:6] == (0, 0, 0, 0)
    assert core.num_evictable_blocks == 3
    assert core.pool.num_free == 32 - 3
    assert core.attach(handle, blocks(1, 2, 9), grow_to=3) == 2
    core.check_invariants()


def test_clear_after_caching_mid_life_leaves_the_cached_blocks_intact(core: Core) -> None:
    handle = core.admit(blocks(1, 2, 3), 3)
    cached = core.block_table(handle).tolist()
    core.cache(handle, 2)
    core.clear(handle)
    core.attach(handle, blocks(7, 8, 9), grow_to=3)
    core.append(handle, blocks(6))
    core.check_invariants()
    assert core.pool.refcount(cached[0]) == 1
    other = core.admit(blocks(1, 2, 3), 0)
    assert core.block_table(other).tolist() == cached[:2]


def test_a_core_collected_in_a_cycle_with_live_records_returns_their_chunks_to_its_trie() -> None:
    """The collector clears an object of a cycle before freeing it; the core must keep its trie
    through that, since freeing its records hands their token chunks back to the trie."""
    import gc

    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore

    pool = BlockPool(64)
    core = KVCacheCore(pool, 16)
    trie = core.trie
    for _ in range(3):
        core.attach(core.open(), list(range(40)), 3)
    cycle: list[object] = [core]
    cycle.append(cycle)
    assert pool.num_free < 64
    del core, cycle
    gc.collect()
    trie.check_invariants()
    assert not any(type(obj) is KVCacheCore for obj in gc.get_objects())


@pytest.mark.parametrize(
    "tokens",
    [
        [0, 1, (1 << 15) - 1, 1 << 15, (1 << 30) - 1, 1 << 30, (1 << 31) - 1, 7],  # one digit and two
        (5, 1 << 30, 0, (1 << 31) - 1),
        [1, 2, 3, -1],
        [1, 2, 1 << 31, 4],
        [1, 2, 1 << 70, 4],
        [1, 2, 3.0, 4],
    ],
)
def test_token_lists_convert_exactly_or_are_refused_by_name(tokens: list[int]) -> None:
    """The list fast path (small ints read from the objects) agrees with numpy's conversion, and
    whatever it cannot take is named by the general path, nothing admitted."""
    core = make_core(8, 4)
    valid = all(type(t) is int and 0 <= t < 1 << 31 for t in tokens)
    if valid:
        handle = core.admit(tokens, 1)
        assert core.tokens(handle).tolist() == list(tokens)
        core.finish(handle)
    else:
        with pytest.raises(InvalidId):
            core.admit(tokens, 1)
        assert core.num_live_sequences == 0 and core.pool.num_free == 8
    core.check_invariants()
