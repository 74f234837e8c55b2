"""KV cache groups over one id space: every group takes its block ids from group 0's pool (vLLM's
layout, where one id names a page in every group's tensors and so may serve one group at a time).

Every test ends with ``check_invariants`` (which recounts the one pool against every group's
references) and the pool's counts.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle.errors import ConfigError, InvalidId, InvariantViolation, OutOfBlocks

BS = 4


def shared(kind: str = "sliding_window", window: int = 8, *, blocks: int = 40, groups: int = 1,
           **options: Any) -> tuple[KVCacheCore, BlockPool]:
    pool = BlockPool(blocks)
    options.setdefault("retention_interval", 0)
    core = KVCacheCore(pool, BS, groups=[(kind, window, 0, pool)] * groups, **options)
    return core, pool


def ids_in_use(core: KVCacheCore, handle: int) -> list[int]:
    return [int(i) for g in range(core.num_groups) for i in core.block_table(handle, g) if i >= 0]


def test_the_groups_of_a_record_hold_distinct_ids_of_the_one_pool() -> None:
    core, pool = shared(groups=2)
    h = core.admit(list(range(20)), 5)
    held = ids_in_use(core, h)
    assert len(held) == 15 and len(set(held)) == 15
    assert pool.num_free == 40 - 15
    core.check_invariants()


def test_the_null_block_is_held_once_in_a_shared_pool() -> None:
    core, pool = shared(null_block=True, groups=2)
    assert pool.num_free == 39 and core.null_block == 0
    h = core.admit(list(range(8)), 2)
    assert 0 not in ids_in_use(core, h)
    core.check_invariants()


def test_released_window_blocks_go_back_to_the_one_pool() -> None:
    core, pool = shared()
    h = core.admit(list(range(20)), 6)
    core.append(h, [100, 101, 102, 103, 104])  # the KV now covers 20 tokens: blocks 0-2 left the window
    assert core.block_table(h, 1).tolist()[:3] == [-1, -1, -1]
    assert pool.num_free == 40 - 12 + 3
    core.finish(h, True)
    core.check_invariants()
    assert pool.num_free + core.num_cached_blocks + sum(row["num_cached"] for row in core.group_stats()[1:]) == 40


def test_a_hit_takes_the_window_blocks_from_the_one_pool_and_reset_returns_everything() -> None:
    core, pool = shared()
    h = core.admit(list(range(24)), 6)
    core.finish(h, True)
    again = core.admit([*range(24), 7], 7)
    assert core.num_blocks(again) == 7 and core.block_table(again, 1).tolist()[:4] == [-1] * 4
    core.finish(again, False)
    core.check_invariants()
    assert core.reset() and pool.num_free == 40


def test_a_shortage_in_the_window_group_evicts_runs_the_full_group_holds_too() -> None:
    core, pool = shared(blocks=24)
    for stem in range(2):
        h = core.admit([stem * 1000 + t for t in range(24)], 6)
        core.finish(h, True)
    assert pool.num_free < 12
    h = core.admit([5000 + t for t in range(24)], 6)  # 12 blocks: eviction must free both groups' blocks
    assert len(set(ids_in_use(core, h))) == 12
    core.check_invariants()


def test_out_of_blocks_in_a_shared_pool_changes_nothing() -> None:
    core, pool = shared(blocks=10)
    with pytest.raises(OutOfBlocks):
        core.admit(list(range(24)), 6)  # 12 blocks of 10
    assert pool.num_free == 10 and core.num_live_sequences == 0
    core.check_invariants()


def test_a_pool_shared_by_some_groups_only_is_refused_by_name() -> None:
    pool, other = BlockPool(8), BlockPool(8)
    with pytest.raises(ConfigError, match="group 2: every group takes group 0's BlockPool"):
        KVCacheCore(pool, BS, groups=[("sliding_window", 8, 0, pool), ("full", 0, 0, other)], max_tokens_per_seq=64)
    assert (pool.num_free, other.num_free) == (8, 8)


def test_a_reference_missing_in_a_shared_pool_is_caught() -> None:
    core, pool = shared()
    h = core.admit(list(range(8)), 2)
    pool.inc_ref(core.block_table(h, 1)[:1])
    with pytest.raises(InvariantViolation, match="refcount"):
        core.check_invariants()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.tuples(st.sampled_from(["admit", "step", "finish", "evict"]),
                           st.lists(st.integers(0, 3), min_size=1, max_size=4), st.integers(0, 6)), max_size=40),
    kind=st.sampled_from(["sliding_window", "chunked_local", "full"]),
)
def test_random_lives_over_one_pool_keep_every_reference_counted(ops: list[tuple[str, Any, int]], kind: str) -> None:
    core, pool = shared(kind, 0 if kind == "full" else 8, blocks=30, groups=2)
    live: list[int] = []
    for op, stems, n in ops:
        if op == "admit":
            prompt = [t for stem in stems for t in range(stem * 8, stem * 8 + 8)]
            try:
                live.append(core.admit(prompt, len(prompt) // BS + n % 3))
            except OutOfBlocks:
                assert core.num_live_sequences == len(live)
        elif op == "step" and live:
            h = live[n % len(live)]
            for token in range(n):
                if core.step([h], [token + 40]).size:
                    break
        elif op == "finish" and live:
            core.finish(live.pop(n % len(live)), cache=bool(stems[0] % 2))
        elif op == "evict":
            core.evict(n)
        core.check_invariants()
    for h in live:
        core.finish(h)
    core.check_invariants()
    core.reset()
    assert pool.num_free == 30


def test_append_with_kv_tokens_keeps_the_tokens_in_flight_in_the_window() -> None:
    core, pool = shared()
    h = core.admit(list(range(20)), 6)
    core.append(h, [100, 101, 102, 103], kv_tokens=0)  # recorded, none computed yet
    assert -1 not in core.block_table(h, 1).tolist()
    core.append(h, [], kv_tokens=20)  # 20 computed: blocks 0-2 left the window of 8
    assert core.block_table(h, 1).tolist()[:3] == [-1, -1, -1]
    assert pool.num_free == 40 - 12 + 3
    core.append(h, [], kv_tokens=8)  # a count below the last releases nothing
    assert pool.num_free == 40 - 12 + 3
    core.finish(h, False)
    core.check_invariants()
    assert pool.num_free == 40


def test_append_with_kv_tokens_past_the_record_is_refused_and_changes_nothing() -> None:
    core, pool = shared()
    h = core.admit(list(range(20)), 6)
    with pytest.raises(InvalidId, match="kv_tokens=25 is over the 24 tokens"):
        core.append(h, [1, 2, 3, 4], kv_tokens=25)
    assert core.num_tokens(h) == 20 and -1 not in core.block_table(h, 1).tolist()
    core.finish(h, False)
    core.check_invariants()
