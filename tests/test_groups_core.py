"""KV cache groups in the C core (issue 31): ``KVCacheCore(pool, block_size, groups=...)``.

Blocks of 4 tokens throughout. A sliding window of 8 tokens reads, from a cut at token ``t``, the
blocks from ``(t - 7) // 4``; a chunk of 8 tokens the blocks from the chunk's start. Checkpoints
every ``retention_interval`` tokens keep the window before them.
"""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle.errors import ConfigError, InvalidId, InvariantViolation, OutOfBlocks, RetentionError, Unsupported

BS = 4


def make(kind: str = "sliding_window", window: int = 8, sink: int = 0, *, blocks: int = 64,
         group_blocks: int = 64, retention: int = 0, **options: Any) -> tuple[KVCacheCore, BlockPool, BlockPool]:
    pool, other = BlockPool(blocks), BlockPool(group_blocks)
    core = KVCacheCore(pool, BS, groups=[(kind, window, sink, other)], retention_interval=retention, **options)
    return core, pool, other


def run(core: KVCacheCore, prompt: list[int], grow_to: int, generated: list[int]) -> int:
    """Admit ``prompt`` and decode ``generated`` one token a step; the handle."""
    h = core.admit(prompt, grow_to)
    for token in generated:
        assert core.step([h], [token]).size == 0
    core.check_invariants()
    return h


PROMPT = list(range(40))          # 10 blocks
DECODED = [100, 101, 102, 103, 104]


# --- one group ------------------------------------------------------------------------------------


def test_a_core_without_groups_has_one_full_group() -> None:
    core = KVCacheCore(BlockPool(8), BS)
    assert (core.num_groups, core.groups, core.retention_interval) == (1, (("full", 0, 0),), 0)
    assert core.group_pools == (core.pool,)
    h = core.admit(list(range(8)), 2)
    assert core.block_table(h, 0).tolist() == core.block_table(h).tolist()
    with pytest.raises(InvalidId, match=r"group 1 does not exist; this core has 1 KV cache group\b"):
        core.block_table(h, 1)


# --- admission ------------------------------------------------------------------------------------


def test_a_finished_runs_end_is_a_hit_in_every_group() -> None:
    core, _, other = make(retention=16)
    a = run(core, PROMPT, 11, DECODED)
    window = core.block_table(a, 1)
    core.finish(a)
    b = core.admit(PROMPT + DECODED + [7, 7, 7], 12)
    assert core.cached_tokens(b) == 44
    # A query at token 44 reads blocks 9 and 10 of the window group, nothing before.
    table = core.block_table(b, 1)
    assert table[:9].tolist() == [-1] * 9
    assert table[9:11].tolist() == window[9:11].tolist()
    assert (table[11:] >= 0).all()
    core.check_invariants()


def test_a_window_hit_is_cut_to_the_last_cut_the_window_group_can_serve() -> None:
    core, _, _ = make(retention=16)
    a = run(core, PROMPT, 11, DECODED)
    window = core.block_table(a, 1)
    core.finish(a)
    # 7 blocks are cached in the full group, but the window group kept only the windows before
    # the checkpoints at blocks 4 and 8 and the run's end: the longest cut it serves is block 4.
    b = core.admit(PROMPT[:30] + [9] * 10, 10)
    assert core.cached_tokens(b) == 16
    assert core.block_table(b, 1)[:4].tolist() == [-1, -1, *window[2:4].tolist()]
    assert core.block_table(b)[:4].tolist() == list(range(4))
    core.check_invariants()


def test_without_checkpoints_a_later_turn_that_diverges_early_misses() -> None:
    core, _, _ = make(retention=0)
    core.finish(run(core, PROMPT, 11, DECODED))
    b = core.admit(PROMPT[:30] + [9] * 10, 10)
    assert core.cached_tokens(b) == 0
    core.check_invariants()



def test_cached_prefix_blocks_counts_the_full_kv_a_windowed_admission_cannot_reuse() -> None:
    core, pool, other = make(retention=0)
    core.finish(run(core, PROMPT, 11, DECODED))
    query = PROMPT[:30] + [9] * 10
    def state() -> tuple[int, int, dict[str, int]]:
        counters = core.counters()
        del counters["time_in_library_ns"]
        return pool.num_free, other.num_free, counters

    before = state()
    # Group 0 holds blocks 0..6 of the query; the window group kept none of the windows before
    # them, so admission reuses nothing (the test above) while the full KV is all there.
    assert core.cached_prefix_blocks(query) == 7
    assert core.cached_prefix_blocks(PROMPT + DECODED) == 11
    assert core.cached_prefix_blocks(query[:3]) == 0
    assert core.cached_prefix_blocks([5] * 40) == 0
    # Another cache key sees none of it.
    assert core.cached_prefix_blocks(query, 7) == 0
    # A read-only walk: nothing pinned, no pool or counter changed.
    assert state() == before
    b = core.admit(query, 10)
    assert core.cached_tokens(b) == 0
    core.finish(b, False)
    with pytest.raises(InvalidId, match=r"token id -3 \(at index 2\) is outside \[0, 2147483647\]"):
        core.cached_prefix_blocks([1, 2, -3, 4])
    core.check_invariants()
    core.close()
    assert core.cached_prefix_blocks(PROMPT) == 0


def test_cached_prefix_blocks_is_zero_with_caching_off() -> None:
    core = KVCacheCore(BlockPool(16), BS, enable_prefix_cache=False)
    core.finish(core.admit(list(range(12)), 0))
    assert core.cached_prefix_blocks(list(range(12))) == 0

def test_admission_takes_a_reference_only_on_the_window_it_reads() -> None:
    core, _, other = make(retention=0)
    core.finish(run(core, PROMPT, 11, DECODED))
    cached = core.group_stats()[1]["num_cached"]
    free = other.num_free
    b = core.admit(PROMPT + DECODED + [7, 7, 7], 12)
    # Two cached window blocks are shared, one fresh block is allocated per group.
    assert other.num_free == free - 1
    assert core.group_stats()[1]["num_cached"] == cached == 2
    core.finish(b, cache=False)
    assert other.num_free == free
    core.check_invariants()


def test_an_extra_full_group_serves_every_cached_block() -> None:
    core, _, other = make("full", 0)
    core.finish(run(core, PROMPT, 11, DECODED))
    b = core.admit(PROMPT[:30] + [9] * 10, 10)
    assert core.cached_tokens(b) == 28
    assert (core.block_table(b, 1) >= 0).all()
    assert other.num_free == 64 - 11 - 3
    core.check_invariants()


# --- decode ---------------------------------------------------------------------------------------


def test_decode_frees_the_blocks_that_left_the_window() -> None:
    core, pool, other = make(retention=0)
    h = core.admit(list(range(16)), 5)
    assert other.num_free == 59
    core.step([h], [1])
    # The query at token 16 reads tokens 9..16: blocks 0 and 1 left the window.
    assert other.num_free == 61
    table = core.block_table(h, 1)
    assert table[:2].tolist() == [-1, -1] and (table[2:] >= 0).all()
    for token in range(4):
        core.step([h], [token])
    # Token 20 reads from token 13 (block 3); the table grew one block in each group.
    assert core.block_table(h, 1)[:3].tolist() == [-1, -1, -1]
    assert (core.num_blocks(h), pool.num_free, other.num_free) == (6, 58, 61)
    core.check_invariants()


def test_decode_keeps_the_windows_before_checkpoints() -> None:
    core, _, other = make(retention=16)
    h = core.admit(list(range(32)), 9)
    core.step([h], [1])
    table = core.block_table(h, 1)
    # Blocks 0..5 left the window; 2, 3 (before the checkpoint at token 16) and 6, 7 (before 32) stay.
    assert [int(b) >= 0 for b in table] == [False, False, True, True, False, False, True, True, True]
    assert other.num_free == 64 - 9 + 4
    stats = core.group_stats()[1]
    assert (stats["blocks_released"], stats["blocks_kept_at_checkpoints"]) == (6, 2)
    core.check_invariants()


def test_appending_tokens_releases_what_left_the_window() -> None:
    core, _, other = make(retention=0)
    h = core.admit(list(range(16)), 5)
    core.append(h, [1, 2])
    assert core.block_table(h, 1)[:2].tolist() == [-1, -1]
    assert other.num_free == 61
    core.check_invariants()


def test_sink_blocks_stay_with_the_sequence() -> None:
    core, _, other = make(sink=4, retention=0)
    h = core.admit(list(range(32)), 9)
    core.step([h], [1])
    assert [int(b) >= 0 for b in core.block_table(h, 1)] == [True] + [False] * 5 + [True] * 3
    assert other.num_free == 64 - 9 + 5
    core.check_invariants()


def test_a_step_short_in_any_group_refuses_the_request_and_changes_it_not() -> None:
    core, pool, other = make("full", 0, group_blocks=4)
    h = core.admit(list(range(16)), 4)
    refused = core.step([h], [1])
    assert refused.tolist() == [0]
    assert (core.num_tokens(h), core.num_blocks(h), pool.num_free, other.num_free) == (16, 4, 60, 0)
    core.check_invariants()


def test_step_writes_each_groups_new_ids_into_its_table() -> None:
    core, _, _ = make(retention=0)
    h = core.admit(list(range(16)), 4)
    table = np.full((1, 8), -7, dtype=np.int32)
    window = np.full((1, 8), -7, dtype=np.int32)
    core.step([h], [1], table=table, group_tables=[window])
    assert table[0, 4] == core.block_table(h)[4]
    assert window[0, 4] == core.block_table(h, 1)[4]
    with pytest.raises(InvalidId, match="group_tables"):
        core.step([h], [1], table=table, group_tables=[])


# --- chunked local --------------------------------------------------------------------------------


def test_chunked_local_releases_past_chunks_and_caches_the_current_one() -> None:
    core, _, other = make("chunked_local", 8, retention=0)
    h = run(core, list(range(16)), 5, [1, 2, 3, 4])
    # The query at token 16 starts a chunk: blocks 0..3 (tokens 0..15) are gone.
    assert [int(b) >= 0 for b in core.block_table(h, 1)] == [False] * 4 + [True]
    core.finish(h)
    assert core.group_stats()[1]["num_cached"] == 1
    b = core.admit(list(range(16)) + [1, 2, 3, 4, 5, 6, 7, 8], 6)
    assert core.cached_tokens(b) == 20
    core.check_invariants()


@pytest.mark.parametrize("chunks", [(8,), (16, 24)])
def test_decode_steps_release_a_chunked_groups_blocks_only_as_its_chunk_boundary_passes(
    chunks: tuple[int, ...],
) -> None:
    # Chunks of 8 tokens (2 blocks), or of 16 and 24 in two groups (boundaries every 8 tokens):
    # a step that passes a block boundary inside every chunk releases nothing; one that passes a
    # chunk boundary releases the past chunk of that group, as the step's table row shows.
    pool = BlockPool(64)
    others = [BlockPool(64) for _ in chunks]
    core = KVCacheCore(pool, BS, groups=[("chunked_local", c, 0, o) for c, o in zip(chunks, others)],
                       retention_interval=0)
    h = core.admit([7], 1)
    width = 16
    tables = [np.full((1, width), -1, dtype=np.int32) for _ in range(1 + len(chunks))]
    for g in range(len(tables)):
        core.write_table(h, tables[g][0], None, g)
    for token in range(40):
        core.step(np.array([h], dtype=np.int64), np.array([token], dtype=np.int32), None, tables[0], None, False,
                  tables[1:])
        kv = core.kv_tokens(h)
        assert kv == token + 1  # the KV of every token before this step's
        for g, (chunk, other) in enumerate(zip(chunks, others), start=1):
            held = core.block_table(h, g)
            first = (kv // chunk) * chunk // BS
            assert [int(b) >= 0 for b in held[: first]] == [False] * first, (token, g)
            assert (held[first:] >= 0).all(), (token, g)
            assert other.num_free == 64 - (len(held) - first), (token, g)
            assert (tables[g][0][:first] == -1).all()  # released blocks are padded in the row
        core.check_invariants()
    core.finish(h, False)
    assert pool.num_free == 64 and all(other.num_free == 64 for other in others)


def test_a_cut_at_a_chunk_boundary_needs_no_block_of_the_chunked_group() -> None:
    core, _, _ = make("chunked_local", 8, retention=0)
    core.finish(run(core, list(range(16)), 5, [1, 2, 3, 4]))
    # 3 blocks match; block 2 (the chunk of tokens 8..15) is gone, so the cut falls back to token 8.
    b = core.admit(list(range(14)) + [9] * 6, 5)
    assert core.cached_tokens(b) == 8
    assert core.block_table(b, 1)[:2].tolist() == [-1, -1]
    core.check_invariants()


# --- eviction -------------------------------------------------------------------------------------


def test_eviction_trims_a_run_back_to_a_cut_every_group_serves() -> None:
    core, pool, other = make(retention=16)
    core.finish(run(core, PROMPT, 11, DECODED))
    assert [row["num_cached"] for row in core.group_stats()] == [11, 6]
    # One block asked for: cuts 10 and 9 lack window blocks, so the run ends at block 8, in
    # every group (the window blocks past it go too).
    assert core.evict(1) == 3
    assert [row["num_cached"] for row in core.group_stats()] == [8, 4]
    assert (pool.num_free, other.num_free) == (64 - 8, 64 - 4)
    b = core.admit(PROMPT, 11)
    assert core.cached_tokens(b) == 32
    core.check_invariants()


def test_a_window_groups_shortage_evicts_cached_runs() -> None:
    core, _, other = make(group_blocks=6, retention=0)
    core.finish(run(core, list(range(16)), 4, []))
    # The finished run leaves all its window blocks to the cache, evictable.
    assert (other.num_free, core.group_stats()[1]["num_cache_only"]) == (2, 4)
    b = core.admit([50 + i for i in range(20)], 6)
    assert core.num_blocks(b) == 6
    assert core.num_cached_blocks == 0
    core.check_invariants()


def test_out_of_blocks_in_a_group_names_it_and_changes_nothing() -> None:
    core, pool, other = make(group_blocks=3)
    with pytest.raises(OutOfBlocks, match="group 1"):
        core.admit(list(range(16)), 4)
    assert (pool.num_free, other.num_free, core.num_live_sequences) == (64, 3, 0)
    core.check_invariants()


def test_reset_drops_every_groups_cached_blocks() -> None:
    core, pool, other = make(retention=16)
    core.finish(run(core, PROMPT, 11, DECODED))
    assert core.reset()
    assert (pool.num_free, other.num_free) == (64, 64)
    core.check_invariants()


def test_clear_gives_back_every_groups_blocks() -> None:
    core, pool, other = make()
    h = core.admit(list(range(16)), 5)
    core.clear(h)
    assert (core.num_blocks(h), pool.num_free, other.num_free) == (0, 64, 64)
    core.check_invariants()


# --- tables ---------------------------------------------------------------------------------------


def test_write_table_of_a_group_pads_where_it_needs_no_block() -> None:
    core, _, _ = make(retention=0)
    h = core.admit(list(range(16)), 5)
    core.step([h], [1])
    out = np.full(8, 99, dtype=np.int32)
    assert core.write_table(h, out, pad=0, group=1) == 5
    assert out.tolist() == [0, 0, *core.block_table(h, 1)[2:].tolist(), 0, 0, 0]


@pytest.mark.parametrize("group", [2, -1])
def test_a_table_of_a_group_that_does_not_exist_is_refused_by_name(group: int) -> None:
    core, _, _ = make()
    h = core.admit(list(range(8)), 2)
    with pytest.raises(InvalidId, match=rf"group {group} does not exist; this core has 2 KV cache groups"):
        core.block_table(h, group)
    with pytest.raises(InvalidId, match=rf"group {group} does not exist"):
        core.write_table(h, np.zeros(4, dtype=np.int32), group=group)


def test_a_null_block_is_held_in_every_groups_pool() -> None:
    core, pool, other = make(null_block=True)
    assert (pool.num_free, other.num_free) == (63, 63)
    h = core.admit(list(range(8)), 2)
    assert 0 not in core.block_table(h, 1).tolist()
    core.check_invariants()


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([("sliding_window", 0, 0, None)], r"group 1: window"),
        ([("sliding_window", 65, 0, None)], r"group 1: window"),
        ([("chunked_local", 0, 0, None)], r"group 1: window"),
        ([("local", 8, 0, None)], r"kind 'local'"),
        ([("chunked_local", 8, 4, None)], r"sink_tokens"),
        ([("full", 8, 0, None)], r"window \(0 for full attention\)"),
        ([("sliding_window", 8, 0, "main"), ("full", 0, 0, None)], r"group 2: every group takes group 0's"),
        ([("full", 0, 0, None), ("full", 0, 0, "first")], r"group 2: its BlockPool is another group's"),
        ([("sliding_window", 8, 0, 3)], r"BlockPool of its own"),
        (["sliding_window"], r"groups\[0\] must be"),
    ],
)
def test_a_bad_group_is_refused_by_name_with_nothing_allocated(groups: list[Any], message: str) -> None:
    pool, other = BlockPool(8), BlockPool(8)
    pools: dict[Any, Any] = {None: other, "main": pool, "first": other}
    given_groups: list[Any] = []
    for entry in groups:
        if isinstance(entry, tuple):
            kind, window, sink, which = entry
            given_groups.append((kind, window, sink, pools.get(which, which)))
        else:
            given_groups.append(entry)
    with pytest.raises(ConfigError, match=message):
        KVCacheCore(pool, BS, groups=given_groups, max_tokens_per_seq=64, null_block=True)
    assert (pool.num_free, other.num_free) == (8, 8)


def test_a_retention_interval_off_the_block_grid_is_refused() -> None:
    with pytest.raises(ConfigError, match="retention_interval 6 is not a multiple of the block size 4"):
        make(retention=6)


@pytest.mark.parametrize(
    ("full_blocks", "window_blocks", "window", "sink", "expected_tokens"),
    [
        (4096, 4096, 8, 0, 4096),  # 4,096 * 3 / 8,192 blocks: under the least interval (1,024 blocks)
        (65536, 64, 8, 0, 8192),  # 65,536 * 3 / 128 = 1,536 blocks, rounded up to 2,048
        (65536, 16, 8, 0, 32768),  # 65,536 * 3 / 32 = 6,144 blocks, rounded up to 8,192
        (65536, 512, 400, 8, 32768),  # (100 + 2 sink + 1) blocks: 65,536 * 103 / 1,024 = 6,592 -> 8,192
    ],
)
def test_the_default_retention_interval_follows_the_pools(
    full_blocks: int, window_blocks: int, window: int, sink: int, expected_tokens: int
) -> None:
    """Checkpoint windows of as many cached tokens as group 0's pool holds fill at most half the
    windowed group's pool, in a power of two of blocks of at least 4,096 tokens."""
    core = KVCacheCore(BlockPool(full_blocks), BS, groups=[("sliding_window", window, sink, BlockPool(window_blocks))])
    assert core.retention_interval == expected_tokens
    # One pool for every group (vLLM's layout): the least interval, whatever the sizes.
    shared = BlockPool(full_blocks)
    assert KVCacheCore(shared, BS, groups=[("sliding_window", window, sink, shared)]).retention_interval == 4096
    # Given, it is kept as given.
    given = KVCacheCore(BlockPool(8), BS, groups=[("sliding_window", 8, 0, BlockPool(8))], retention_interval=8)
    assert given.retention_interval == 8


def test_the_default_retention_interval_on_the_presets() -> None:
    """At issue 31's budget, Gemma 3's 1,024-token window and Llama 4's 8,192-token chunks
    checkpoint every 16,384 tokens, gpt-oss's 128-token window every 4,096: the pools' sizes choose
    it (a checkpoint keeps 65 window blocks on Gemma, 9 on gpt-oss)."""
    from lifecycle.kv_groups import core_groups
    from lifecycle.presets import preset, reference_kv_budget

    found = {}
    for name in ("gpt-oss-120b", "gemma-3-27b", "llama-4-scout"):
        config = preset(name)
        config = config.replace(kv_budget_bytes=reference_kv_budget(config))
        core = KVCacheCore(BlockPool(config.kv_groups[0].num_blocks), 16, groups=core_groups(config))
        found[name] = core.retention_interval
    assert found == {"gpt-oss-120b": 4096, "gemma-3-27b": 16384, "llama-4-scout": 16384}


def test_snapshot_cut_is_refused_with_groups() -> None:
    with pytest.raises(ConfigError, match="snapshot_cut"):
        make(snapshot_cut=True)


def test_calls_a_grouped_core_does_not_offer_are_refused_by_name() -> None:
    core, _, _ = make()
    h = core.admit(list(range(8)), 2)
    with pytest.raises(Unsupported, match="attach"):
        core.attach(h, list(range(8)))
    core.check_invariants()


# --- caching mid-life: blocks enter the cache as they are computed -------------------------------------


def test_a_live_sequences_cached_blocks_are_a_hit_in_every_group() -> None:
    core, _, _ = make(retention=0)
    h = core.admit(PROMPT, 11)
    assert core.cache(h, 10) == 10
    core.append(h, [])  # the prompt's KV is computed: blocks 0..7 left the window, still cached
    stats = core.group_stats()[1]
    assert (stats["num_cached"], stats["num_cache_only"], stats["blocks_released_to_cache"]) == (10, 8, 8)
    assert core.block_table(h, 1)[:8].tolist() == [-1] * 8  # the sequence no longer holds them
    # A query at token 24 reads blocks 4 and 5 of the window group: the cache has them.
    probe = core.admit(PROMPT[:24] + [9] * 8, 8)
    assert core.cached_tokens(probe) == 24
    core.check_invariants()


def test_step_with_cache_caches_each_block_as_it_fills() -> None:
    core, _, _ = make(retention=0)
    h = core.admit(list(range(16)), 5)
    for token in range(5):
        assert core.step([h], [token], cache=True).size == 0
    # Blocks 0 and 1 left the window before they were cached (the first step); block 2 after.
    assert [row["num_cached"] for row in core.group_stats()] == [5, 3]
    assert core.group_stats()[1]["num_cache_only"] == 1
    probe = core.admit(list(range(16)) + [0, 1, 2, 3, 7], 6)
    assert core.cached_tokens(probe) == 20
    core.check_invariants()


def test_mark_computed_caches_the_blocks_in_every_group() -> None:
    core, _, _ = make(retention=0)
    h = core.admit(PROMPT, 10)
    assert core.mark_computed(h, 9) == 9
    assert core.cached_tokens(h) == 36
    assert [row["num_cached"] for row in core.group_stats()] == [9, 9]
    core.check_invariants()


def test_a_finished_sequence_cached_mid_life_hands_its_blocks_to_the_cache() -> None:
    core, pool, other = make(retention=0)
    h = core.admit(PROMPT, 11)
    core.cache(h, 10)
    core.append(h, [])
    core.finish(h)
    stats = core.group_stats()
    assert [row["num_cached"] for row in stats] == [10, 10]
    assert stats[1]["num_cache_only"] == 10
    assert (pool.num_free, other.num_free) == (54, 54)
    core.check_invariants()


def test_a_release_finding_a_reference_gone_raises_and_changes_no_reference_or_list() -> None:
    # Blocks 0..7 of the window group are on the record's cached path when the prompt's KV is
    # computed; one of them has lost both its references behind the core's back (a bug elsewhere).
    core, _, other = make(retention=0)
    h = core.admit(PROMPT, 11)
    core.cache(h, 10)
    table = core.block_table(h, 1)
    other.dec_ref(table[5:6])
    other.dec_ref(table[5:6])
    refs, free, stats = other.refcounts().copy(), other.num_free, core.group_stats()
    with pytest.raises(InvariantViolation, match=rf"append: .*value {table[5]}\)"):
        core.append(h, [])
    # Blocks 0..4 took their references back and left the list they had joined; nothing was freed.
    assert other.refcounts().tolist() == refs.tolist()
    assert other.num_free == free
    assert core.group_stats() == stats


def test_caching_a_block_whose_reference_is_gone_raises_and_takes_no_reference() -> None:
    core, _, other = make(retention=0)
    h = core.admit(PROMPT, 11)
    table = core.block_table(h, 1)
    other.dec_ref(table[8:9])  # the record's only reference: the block is free now
    refs = other.refcounts().copy()
    with pytest.raises(InvariantViolation, match=rf"cache_sequence: .*value {table[8]}\)"):
        core.cache(h, 10)
    # The cache's references on blocks 0..7, taken in the same pass, were given back.
    assert other.refcounts().tolist() == refs.tolist()


# --- a windowed group short of blocks evicts its own cache-only blocks ----------------------------------


def released_run(retention: int, group_blocks: int) -> tuple[KVCacheCore, BlockPool, Any, int]:
    """A live sequence of ``PROMPT`` cached mid-life whose window moved past blocks 0..7 (left to
    the cache in that order); the core, the window group's pool, those blocks' ids and the handle."""
    core, _, other = make(retention=retention, group_blocks=group_blocks)
    h = core.admit(PROMPT, 11)
    core.cache(h, 10)
    ids = core.block_table(h, 1)[:8]
    core.append(h, [])
    return core, other, ids, h


def test_a_window_group_short_of_blocks_evicts_the_least_recently_released_block_first() -> None:
    core, other, ids, h = released_run(retention=0, group_blocks=12)
    assert other.num_free == 1
    table = core.block_table(h, 1).tolist()
    b = core.admit(list(range(100, 108)), 2)
    # One block was free; the other is the first the window left, taken from the cache.
    assert int(ids[0]) in core.block_table(b, 1).tolist()
    assert core.group_stats()[1]["num_cache_only"] == 7
    assert (other.refcounts()[ids[1:]] == 1).all()
    assert core.block_table(h, 1).tolist() == table  # a live sequence loses no block it reads
    core.check_invariants()


def test_checkpoint_windows_are_evicted_after_the_other_cached_blocks() -> None:
    # Checkpoints every 16 tokens: the windows before them are blocks 2, 3 and 6, 7.
    core, other, ids, _ = released_run(retention=16, group_blocks=12)
    b = core.admit(list(range(100, 116)), 5)
    taken = set(core.block_table(b, 1).tolist())
    assert taken >= {int(i) for i in ids[[0, 1, 4, 5]]}
    assert not taken & {int(i) for i in ids[[2, 3, 6, 7]]}
    assert core.group_stats()[1]["num_cache_only"] == 4
    core.check_invariants()


def test_a_hole_in_a_leafs_last_window_trims_it_to_a_cut_every_group_serves() -> None:
    core, pool, other = make(retention=0, group_blocks=6)
    h = core.admit(list(range(16)), 4)
    core.append(h, [])
    core.finish(h)
    assert (core.num_cached_blocks, other.num_free) == (4, 4)
    # Taking one window block of the run leaves no cut of it servable: the run goes in every group.
    core.admit(list(range(100, 120)), 5)
    assert (core.num_cached_blocks, pool.num_free, other.num_free) == (0, 64 - 5, 1)
    core.check_invariants()


def test_evict_group_frees_a_window_groups_cache_only_blocks_and_keeps_the_full_kv() -> None:
    core, other, ids, h = released_run(retention=0, group_blocks=64)
    pool = core.pool
    table = core.block_table(h, 1).tolist()
    before = pool.num_free
    # The least recently released first; group 0 keeps every block.
    assert core.evict_group(1, 3) == 3
    assert (other.refcounts()[ids[:3]] == 0).all() and (other.refcounts()[ids[3:]] == 1).all()
    assert pool.num_free == before and core.group_stats()[1]["num_cache_only"] == 5
    # A live sequence loses no block it reads: only the cache-only ones go.
    assert core.evict_group(1, 100) == 5
    assert core.block_table(h, 1).tolist() == table and pool.num_free == before
    core.finish(h)
    # The run keeps its full KV and its last window: a query at its end still hits all of it.
    b = core.admit(PROMPT + [7], 0)
    assert core.cached_tokens(b) == 40
    core.finish(b, False)
    core.check_invariants()


def test_evict_group_of_a_leafs_last_window_trims_the_leaf_in_every_group() -> None:
    core, pool, other = make(retention=0)
    h = core.admit(list(range(16)), 4)
    core.append(h, [])
    core.finish(h)
    # Its window blocks are its last window: losing one leaves no cut of the run servable.
    assert core.evict_group(1, 1) >= 1
    assert (core.num_cached_blocks, pool.num_free, other.num_free) == (0, 64, 64)
    core.check_invariants()


def test_evict_group_zero_evicts_as_evict_does() -> None:
    core, pool, other = make(retention=16)
    core.finish(run(core, PROMPT, 11, DECODED))
    assert core.evict_group(0, 1) == 3
    assert [row["num_cached"] for row in core.group_stats()] == [8, 4]
    core.check_invariants()


@pytest.mark.parametrize(("group", "num_blocks", "match"), [
    (2, 1, "group 2 does not exist; this core has 2 KV cache groups"),
    (1, -1, "num_blocks=-1 is outside"),
    ("1", 1, "group must be an int"),
])
def test_evict_group_refuses_bad_arguments_by_name_and_changes_nothing(group: Any, num_blocks: int,
                                                                      match: str) -> None:
    core, other, _, _ = released_run(retention=0, group_blocks=64)
    before = (core.pool.num_free, other.num_free)
    with pytest.raises(InvalidId, match=match):
        core.evict_group(group, num_blocks)
    assert (core.pool.num_free, other.num_free) == before
    core.check_invariants()


def test_a_window_group_that_cannot_grow_names_it_and_the_sequence_keeps_its_blocks() -> None:
    core, other, _, h = released_run(retention=0, group_blocks=12)
    table = core.block_table(h, 1).tolist()
    with pytest.raises(OutOfBlocks, match="group 1"):
        core.grow(h, 21)  # 10 more blocks: 1 is free, 8 are cache-only
    assert core.block_table(h, 1).tolist() == table and core.num_blocks(h) == 11
    core.check_invariants()


# --- every step keeps every group consistent --------------------------------------------------------

VOCAB = st.integers(0, 2)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.lists(VOCAB, min_size=1, max_size=5), st.integers(1, 6)),
        st.tuples(st.just("step"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("finish"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("evict"), st.integers(1, 12), st.just(0)),
        st.tuples(st.just("cache"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("cached_step"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("hint"), st.integers(0, 7), st.sampled_from([0, 35, 90])),
        st.tuples(st.just("tick"), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    kind=st.sampled_from(["sliding_window", "chunked_local", "full"]),
    retention=st.sampled_from([0, 8, 16]),
    sink=st.sampled_from([0, 4]),
    events=st.booleans(),
)
def test_random_lives_keep_every_group_balanced_and_every_cached_run_servable(
    ops: list[tuple[str, Any, Any]], kind: str, retention: int, sink: int, events: bool
) -> None:
    """After every call (mid-life caching and window releases included): every group's refcounts
    balance against the records and the cache, its cached blocks are tracked and its cache-only ones
    listed, and every unpinned leaf's own run holds the window its end reads (``check_invariants``); a refused
    admission leaves every pool as it was. With events, each group's stored blocks less its
    removed ones are the blocks it has cached."""
    from lifecycle.events import BlockRemoved, BlockStored, KVEventTranslator

    window = 0 if kind == "full" else 8
    core, pool, other = make(kind, window, sink if kind == "sliding_window" else 0, blocks=24, group_blocks=14,
                             retention=retention, events=events)
    live: list[int] = []
    clock = 0.0
    core.retention.set_time(clock)
    for op, a, b in ops:
        if op == "hint" and live:
            # A priority for the first block, lasting two ticks; it reaches the cache at the finish.
            core.set_retention(live[int(a) % len(live)], [(0, BS, int(b), 2.0)], decode_priority=int(b))
        elif op == "tick":
            clock += 1.0
            core.retention.set_time(clock)
        elif op == "admit":
            # Prompts from a few shared stems, so that runs share prefixes and diverge.
            prompt = [t for stem in a for t in range(stem * 8, stem * 8 + 8)]
            grow = len(prompt) // BS + int(b)
            before = (pool.num_free, other.num_free, core.num_cached_blocks)
            try:
                live.append(core.admit(prompt, grow))
            except OutOfBlocks:
                assert (pool.num_free, other.num_free) >= before[:2]  # only evictions changed the pools
                assert core.num_live_sequences == len(live)
        elif op == "step" and live:
            h = live[int(a) % len(live)]
            for token in range(int(b)):
                if core.step([h], [token + 30]).size:
                    break
        elif op == "finish" and live:
            core.finish(live.pop(int(a) % len(live)), cache=bool(b))
        elif op == "evict":
            core.evict(int(a))
        elif op == "cache" and live:
            h = live[int(a) % len(live)]
            if b:
                core.append(h, [])  # its KV is computed: the window releases what it left
            core.cache(h, min(core.num_tokens(h) // BS, core.num_blocks(h)))
        elif op == "cached_step" and live:
            h = live[int(a) % len(live)]
            for token in range(int(b)):
                if core.step([h], [token + 30], cache=True).size:
                    break
        core.check_invariants()
        for group_pool in (pool, other):
            refs = group_pool.refcounts()
            assert group_pool.num_free == int((refs == 0).sum())  # every block free or held, none lost
    for h in live:
        core.finish(h)
    core.check_invariants()
    if events:
        held = {0: 0, 1: 0}
        for event in KVEventTranslator(BS).events(core.take_events()):
            if isinstance(event, (BlockStored, BlockRemoved)):
                sign = 1 if isinstance(event, BlockStored) else -1
                held[event.group_idx or 0] += sign * len(event.block_hashes)
        assert [held[0], held[1]] == [row["num_cached"] for row in core.group_stats()]
    core.reset()
    assert (pool.num_free, other.num_free) == (24, 14)


# --- events ---------------------------------------------------------------------------------------


def test_events_name_the_group_of_the_blocks_each_group_stores_and_removes() -> None:
    from lifecycle.events import BlockRemoved, BlockStored, KVEventTranslator

    core, _, _ = make(retention=0, events=True)
    h = run(core, list(range(16)), 4, [])
    core.append(h, [])  # the prompt's KV is computed: blocks 0 and 1 left the window, uncached
    core.finish(h)
    core.evict(4)
    events = KVEventTranslator(BS).events(core.take_events())
    stored = [(e.group_idx, len(e.block_hashes)) for e in events if isinstance(e, BlockStored)]
    removed = [(e.group_idx, len(e.block_hashes)) for e in events if isinstance(e, BlockRemoved)]
    # Group 0 stores its 4 blocks, the window group the 2 of its last window (blocks 2, 3).
    assert stored == [(None, 4), (1, 2)]
    assert sorted(removed, key=str) == sorted([(None, 4), (1, 2)], key=str)
    window_hashes = next(e.block_hashes for e in events if isinstance(e, BlockStored) and e.group_idx == 1)
    full_hashes = next(e.block_hashes for e in events if isinstance(e, BlockStored) and e.group_idx is None)
    assert window_hashes == full_hashes[2:]


def test_demotion_is_not_offered_with_groups() -> None:
    core, _, _ = make()
    with pytest.raises(Unsupported, match="demote"):
        core.set_events(True, demote=True)


def test_a_short_run_with_sink_blocks_stays_cached_whole() -> None:
    core, _, _ = make(sink=4, retention=0)
    core.finish(run(core, list(range(8)), 2, []))
    # Two blocks: the sink block and the last window, both kept; the run's end is servable.
    assert [row["num_cached"] for row in core.group_stats()] == [2, 2]
    b = core.admit(list(range(12)), 3)
    assert core.cached_tokens(b) == 8


# --- decode tables and refusals -------------------------------------------------------------------


@pytest.mark.parametrize("null_block", [False, True])
def test_step_writes_the_pad_where_the_window_released_a_block(null_block: bool) -> None:
    core, _, _ = make(retention=0, null_block=null_block)
    pad = 0 if null_block else -1
    h = core.admit(list(range(16)), 5)
    table = np.zeros((1, 8), dtype=np.int32)
    window = np.zeros((1, 8), dtype=np.int32)
    window[0, :5] = core.block_table(h, 1)
    core.step([h], [1], table=table, group_tables=[window])
    # The query at token 16 reads blocks 2..4: blocks 0 and 1 went back to the pool, and the row says so.
    assert window[0, :2].tolist() == [pad, pad]
    assert window[0, 2:5].tolist() == core.block_table(h, 1)[2:5].tolist()
    core.check_invariants()


TOKENS = list(range(640))


def long_window_core() -> tuple[KVCacheCore, BlockPool, BlockPool]:
    """Blocks of 16 tokens, a window of 8 blocks in an 11-block pool, the first 320 tokens of
    ``TOKENS`` cached (decoded a block at a time, so its last window is cached alone)."""
    pool, other = BlockPool(100), BlockPool(11)
    core = KVCacheCore(pool, 16, groups=[("sliding_window", 128, 0, other)], retention_interval=0)
    h = core.admit(TOKENS[:16], 1)
    for block in range(1, 20):
        core.grow(h, block + 1)
        core.append(h, TOKENS[block * 16 : block * 16 + 16])
    core.append(h, [])
    core.finish(h)
    assert core.group_stats()[1]["num_cached"] == 8
    return core, pool, other


def decode_blocks(core: KVCacheCore, h: int, start: int, stop: int) -> None:
    """Grow and append a block at a time, from block ``start`` to ``stop``."""
    for block in range(start, stop):
        core.grow(h, block + 1)
        core.append(h, TOKENS[block * 16 : block * 16 + 16])


def test_a_live_sequence_takes_window_blocks_its_pinned_prefix_no_longer_reads() -> None:
    core, _, other = long_window_core()
    # A longer request pins the 320 cached tokens; once its window moved past them, only the
    # cache holds their window blocks, and the pool has room for nothing else.
    h = core.admit(TOKENS[:336], 21)
    assert core.cached_tokens(h) == 320
    core.append(h, [])
    decode_blocks(core, h, 21, 40)
    assert core.num_blocks(h) == 40
    stats = core.group_stats()[1]
    assert stats["num_cached"] < 8 and stats["blocks_evicted"] == 8 - stats["num_cached"]
    core.check_invariants()
    # The pinned run no longer holds its last window: the same prompt again reuses nothing of it.
    probe = core.admit(TOKENS[:336], 0)
    assert core.cached_tokens(probe) == 0
    core.finish(probe, False)
    core.finish(h)
    core.check_invariants()


def test_a_pinned_run_that_gave_up_its_window_goes_when_its_last_pin_goes() -> None:
    core, pool, other = long_window_core()
    h = core.admit(TOKENS[:336], 21)
    core.append(h, [])
    decode_blocks(core, h, 21, 40)
    core.finish(h, False)
    # No cut of the 320-token run is servable any more: its full-group blocks went with it.
    assert (core.num_cached_blocks, pool.num_free, other.num_free) == (0, 100, 11)
    core.check_invariants()


def test_a_window_group_short_of_blocks_names_what_a_retention_pin_holds() -> None:
    core, _, other = long_window_core()
    core.retention.set_pin_budget(20)
    assert core.pin_prefix(TOKENS[:320]) > 0
    h = core.admit(TOKENS[:336], 21)
    core.append(h, [])
    with pytest.raises(
        OutOfBlocks,
        match=r"group 1, 0 free .*; \d+ of its blocks are held only by cached prefixes a retention pin protects",
    ) as refused:
        decode_blocks(core, h, 21, 40)
    mine = set(core.block_table(h, 1).tolist())
    cache_only = [b for b, refs in enumerate(other.refcounts().tolist()) if refs == 1 and b not in mine]
    named = re.search(r"; (\d+) of its blocks", str(refused.value))
    assert named is not None and int(named.group(1)) == len(cache_only) > 0
    core.check_invariants()
    # Once the pin goes, the run's window blocks are evictable again.
    core.unpin_prefix(TOKENS[:320])
    decode_blocks(core, h, core.num_blocks(h), 40)


# -- what a grouped core refuses or does differently (found in review) --------------------------------


def _grouped_after_a_finish() -> tuple[KVCacheCore, list[int]]:
    core = KVCacheCore(BlockPool(64), 4, groups=[("sliding_window", 8, 0, BlockPool(64))], retention_interval=0)
    prompt = list(range(40))
    handle = core.admit(prompt, 11)
    for token in (100, 101, 102, 103, 104):
        core.step([handle], [token])
    core.finish(handle)
    core.check_invariants()
    return core, prompt


def _window_core(group_blocks: int = 24) -> KVCacheCore:
    """A sliding window of 8 tokens whose pool, not group 0's, runs short under a flood."""
    core = KVCacheCore(BlockPool(400), BS, groups=[("sliding_window", 8, 0, BlockPool(group_blocks))],
                       retention_interval=0)
    core.retention.set_time(0.0)
    return core


def _serve_hinted(core: KVCacheCore, tokens: list[int], ranges: Any = None) -> None:
    handle = core.admit(tokens, len(tokens) // BS + 1)
    if ranges is not None:
        core.set_retention(handle, ranges)
    core.finish(handle)
    core.check_invariants()


def _hit_tokens(core: KVCacheCore, tokens: list[int]) -> int:
    before = core.counters()["prefix_hit_tokens"]
    core.finish(core.admit(tokens + [7], len(tokens) // BS + 1), False)
    return core.counters()["prefix_hit_tokens"] - before


def _one_offs(core: KVCacheCore, count: int, priority: int | None = None) -> None:
    for i in range(count):
        tokens = list(range(10_000 + 100 * i, 10_000 + 100 * i + 24))
        _serve_hinted(core, tokens, None if priority is None else [(0, 24, priority)])


SYSTEM = list(range(1000, 1020))  # five blocks: a hit at its end reads blocks 3 and 4 in the window group


@pytest.mark.parametrize("hinted", [False, True])
def test_a_high_priority_prefix_keeps_its_window_through_a_flood_on_a_grouped_core(hinted: bool) -> None:
    """The window group's pool is what runs short: its own eviction takes default-priority runs'
    window blocks before a high-priority run's (without the hint the flood takes the prefix's)."""
    core = _window_core()
    _serve_hinted(core, SYSTEM + [1, 2, 3, 4], [(0, len(SYSTEM), 90)] if hinted else None)
    _one_offs(core, 30)
    assert core.group_stats()[1]["blocks_evicted"] > 24  # the window group's pool turned over
    assert _hit_tokens(core, SYSTEM) == (len(SYSTEM) if hinted else 0)
    core.check_invariants()


def test_low_priority_one_offs_lose_their_windows_before_an_older_default_prefix() -> None:
    core = _window_core()
    _serve_hinted(core, SYSTEM + [1, 2, 3, 4])
    _one_offs(core, 30, priority=0)
    assert _hit_tokens(core, SYSTEM) == len(SYSTEM)
    core.check_invariants()


@pytest.mark.parametrize(("seconds", "kept"), [(4.0, True), (6.0, False)])
def test_a_window_priority_decays_after_its_duration_on_a_grouped_core(seconds: float, kept: bool) -> None:
    """Within its 5 s the prefix keeps its window through the flood; after them it is a default
    run again, and the flood takes its window (no hit was served in between: a window that served
    one goes last, whatever its priority)."""
    core = _window_core()
    _serve_hinted(core, SYSTEM + [1, 2, 3, 4], [(0, len(SYSTEM), 90, 5.0)])
    core.retention.set_time(seconds)
    _one_offs(core, 30)
    assert _hit_tokens(core, SYSTEM) == (len(SYSTEM) if kept else 0)
    core.check_invariants()


def test_prioritize_keeps_a_cached_prefix_on_a_grouped_core() -> None:
    core = _window_core()
    _serve_hinted(core, SYSTEM + [1, 2, 3, 4])
    assert core.retention.prioritize(SYSTEM, 0, 90) == len(SYSTEM) // BS
    _one_offs(core, 30)
    assert _hit_tokens(core, SYSTEM) == len(SYSTEM)
    core.check_invariants()


def test_a_high_priority_prefix_outlives_a_flood_of_group_0_on_a_grouped_core() -> None:
    """Group 0's pool runs short: its eviction takes runs by priority in every group at once."""
    core = KVCacheCore(BlockPool(48), BS, groups=[("sliding_window", 8, 0, BlockPool(400))], retention_interval=0)
    core.retention.set_time(0.0)
    _serve_hinted(core, SYSTEM + [1, 2, 3, 4], [(0, len(SYSTEM), 90)])
    _one_offs(core, 30)
    assert _hit_tokens(core, SYSTEM) == len(SYSTEM)
    core.check_invariants()


def test_reclaim_for_on_a_grouped_core_counts_no_reuse_and_leaves_only_servable_leaves() -> None:
    core, prompt = _grouped_after_a_finish()
    target, free = core.reclaim_for(prompt[:21], 0, 64)
    assert target == 64  # no cached prefix is counted: its end need not be a cut every group serves
    assert free == core.pool.num_free
    core.check_invariants()


def test_a_prefix_pinned_past_a_servable_cut_is_trimmed_to_one_when_unpinned() -> None:
    core, prompt = _grouped_after_a_finish()
    core.retention.set_pin_budget(100)
    assert core.pin_prefix(prompt[:20]) == 5
    core.evict(64)
    core.unpin_prefix(prompt[:20])
    core.check_invariants()  # every leaf ends where every group can serve it again



# --- a windowed group's eviction in one call and block by block -------------------------------------


def _eviction_twin(rnd: random.Random, window: int) -> tuple[KVCacheCore, list[BlockPool]]:
    """One of two cores built alike from ``rnd``'s set-up: the chunked group, perhaps a third group
    (full or a sliding window: punch's memo then trims through ``_trim_to``), perhaps one pool for
    both groups, perhaps KV events."""
    setup = rnd.choice(["plain", "plain", "events", "full", "window", "shared"])
    pool = BlockPool(40)
    pools = [pool] if setup == "shared" else [pool, BlockPool(12)]
    groups: list[tuple[str, int, int, BlockPool]] = [("chunked_local", window, 0, pools[-1])]
    if setup in ("full", "window"):
        pools.append(BlockPool(40 if setup == "full" else 12))
        groups.append(("full", 0, 0, pools[-1]) if setup == "full" else ("sliding_window", 8, 0, pools[-1]))
    core = KVCacheCore(pool, BS, groups=groups, retention_interval=0, events=setup == "events")
    core.retention.set_time(0.0)
    core.retention.set_pin_budget(16)
    return core, pools


def _eviction_state(core: KVCacheCore, live: list[int], pools: list[BlockPool]) -> Any:
    raw = core.take_events() if core.events_on[0] else None
    return (
        [[core.block_table(h, g).tolist() for g in range(core.num_groups)] + [core.cached_tokens(h)] for h in live],
        [p.refcounts().tolist() for p in pools],
        core.group_stats(),
        core.num_cached_blocks,
        [core.cached_prefix_blocks([t for stem in (3, 4, 5, 6, 7)[:k] for t in range(stem * 8, stem * 8 + 8)])
         for k in range(1, 6)],
        None if raw is None else (raw.entries.tolist(), raw.hashes.tolist(), raw.ids.tolist()),
    )


def _unpin_alike(cores: list[KVCacheCore], tokens: list[int]) -> None:
    """Unpin ``tokens`` in each core, which refuse it alike or not at all."""
    refused = []
    for core in cores:
        try:
            core.unpin_prefix(tokens)
            refused.append(False)
        except RetentionError:
            refused.append(True)
    assert len(set(refused)) == 1


@pytest.mark.parametrize("window", [16, 32])
def test_a_chunked_groups_eviction_in_one_call_is_the_same_as_block_by_block(window: int) -> None:
    """``evict_group(1, n)`` takes a windowed group's cache-only blocks in one pass and trims each
    leaf that loses a block of its last chunk from what that pass found before (a leaf whose last
    chunk starts in its ancestors included, until a block of theirs goes); ``evict_group(1, 1)``,
    called until as many blocks are free, searches every leaf's cut afresh. Two cores driven alike
    but for that end every call in the same state: block tables, hits, refcounts, counters and
    events; with a third group, one pool for both, retention pins and priorities too."""
    for seed in range(300):
        rnd = random.Random(seed)
        state = rnd.getstate()
        cores = []
        for _ in range(2):
            rnd.setstate(state)
            cores.append(_eviction_twin(rnd, window))
        lives: list[list[int]] = [[], []]
        pins: list[list[int]] = []
        clock = 0.0
        for _ in range(30):
            op = rnd.choices(["admit", "finish", "evict_group", "step", "pin", "unpin", "hint", "tick"],
                             [30, 15, 20, 15, 3, 2, 4, 2])[0]
            if op == "evict_group":
                cores[0][0].evict_group(1, rnd.randint(1, 12))
                target = cores[0][0].group_pools[1].num_free
                while cores[1][0].group_pools[1].num_free < target and cores[1][0].evict_group(1, 1):
                    pass
            # A common stem of up to 5 parts, then up to 3 of a few: long shared runs that diverge.
            stems = [3, 4, 5, 6, 7][: rnd.randint(0, 5)] + [rnd.randint(0, 2) for _ in range(rnd.randint(0, 3))]
            prompt = [t for stem in stems or [25] for t in range(stem * 8, stem * 8 + 8)]
            grow, which, cache, tokens = len(prompt) // BS + rnd.randint(0, 3), rnd.random(), rnd.random() < 0.8, \
                rnd.randint(1, 8)
            priority = rnd.choice([0, 35, 90])
            if op == "tick":
                clock += 1.0
            for (core, _), live in zip(cores, lives):
                if op == "admit":
                    try:
                        h = core.admit(prompt, grow)
                    except OutOfBlocks:
                        continue
                    core.cache(h, len(prompt) // BS)  # cached as computed; then what left the chunk goes
                    core.append(h, [])
                    live.append(h)
                elif op == "finish" and live:
                    core.finish(live.pop(int(which * len(live))), cache=cache)
                elif op == "step" and live:
                    stepped = live[int(which * len(live))]
                    for token in range(tokens):
                        if core.step([stepped], [token + 30]).size:
                            break
                elif op == "pin" and core is cores[0][0]:
                    pinned_blocks = []
                    for twin, _ in cores:
                        try:
                            pinned_blocks.append(twin.pin_prefix(prompt))
                        except RetentionError:  # over the budget: refused alike
                            pinned_blocks.append(-1)
                    assert pinned_blocks[0] == pinned_blocks[1]
                    if pinned_blocks[0] > 0:
                        pins.append(prompt[: pinned_blocks[0] * BS])  # (the cached prefix it pinned)
                elif op == "unpin" and pins and core is cores[0][0]:
                    _unpin_alike([twin for twin, _ in cores], pins.pop(int(which * len(pins))))
                elif op == "hint" and live:
                    core.set_retention(live[int(which * len(live))], [(0, BS, priority, 2.0)], decode_priority=priority)
                elif op == "tick":
                    core.retention.set_time(clock)
            states = [_eviction_state(core, live, pools) for (core, pools), live in zip(cores, lives)]
            assert states[0] == states[1], f"seed {seed}"
        for (core, pools), live in zip(cores, lives):
            for left in live:
                core.finish(left)
            core.check_invariants()
            for group_pool in pools:  # every block free or held, none lost
                assert group_pool.num_free == int((group_pool.refcounts() == 0).sum())
        assert [p.num_free for p in cores[0][1]] == [p.num_free for p in cores[1][1]]
