"""The KV cache core's engine surface: the event log (stored / removed / cleared, with demotion's
block ids and tokens), content hashes kept by block id, ``evict_blocks``, common prefix blocks,
engine-owned tables (``write_table``) and the null block.

Every event hash is checked against the pure-Python reference of the documented content hash,
and every test ends with the pool's counts and ``check_invariants``.
"""

from __future__ import annotations

import array
import random
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from kvcache_support import reference_block_hashes
from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import CLEARED, EVENT_DTYPE, REMOVED, STORED, KVCacheCore, RawEvents
from lifecycle.errors import ConfigError, InvalidId, SequenceStateError

BS = 4


def blocks(*rows: int) -> list[int]:
    """Whole blocks of tokens: block ``r`` is ``[r*10, r*10+1, ...]``."""
    return [row * 10 + i for row in rows for i in range(BS)]


def make(num_blocks: int = 32, **options: object) -> KVCacheCore:
    return KVCacheCore(BlockPool(num_blocks), BS, **options)  # type: ignore[arg-type]


def entries(events: RawEvents) -> list[tuple[int, list[int], list[int], int | None, list[int]]]:
    """(kind, hashes, tokens, parent or None, ids) per entry, sliced out of the flat arrays."""
    out = []
    h = t = i = 0
    hashes, tokens, ids = events.hashes.tolist(), events.tokens.tolist(), events.ids.tolist()
    for row in events.entries:
        count, num_tokens = int(row["count"]), int(row["num_tokens"])
        taken_ids = ids[i : i + count] if row["has_ids"] else []
        i += len(taken_ids)
        parent = int(row["parent"]) if row["has_parent"] else None
        out.append((int(row["kind"]), hashes[h : h + count], tokens[t : t + num_tokens], parent, taken_ids))
        h += count
        t += num_tokens
    assert (h, t, i) == (len(hashes), len(tokens), len(ids))
    return out


def settled(core: KVCacheCore) -> None:
    """Invariants hold, and with no request live every block is free, cached or the null block."""
    core.check_invariants()
    if core.live_totals() == (0, 0):
        null = 1 if core.null_block >= 0 else 0
        assert core.pool.num_free + core.num_cached_blocks + null == core.pool.num_total


# -- off by default -------------------------------------------------------------------------------


def test_events_are_off_by_default_and_log_nothing() -> None:
    core = make()
    core.finish(core.admit(blocks(1, 2, 3), 3))
    core.evict(10)
    assert core.events_on == (False, False)
    taken = core.take_events()
    assert len(taken) == 0 and taken.dropped == 0 and taken.entries.dtype == EVENT_DTYPE
    settled(core)


# -- stored ---------------------------------------------------------------------------------------


def test_a_finished_request_logs_its_new_blocks_with_the_documented_hashes() -> None:
    core = make(events=True)
    prompt = blocks(1, 2, 3) + [99]
    handle = core.admit(prompt, 4)
    expected = reference_block_hashes(prompt, BS)
    assert core.block_hashes(handle).tolist() == expected
    core.finish(handle)
    [(kind, hashes, tokens, parent, ids)] = entries(core.take_events())
    assert (kind, hashes, tokens, parent, ids) == (STORED, expected, blocks(1, 2, 3), None, [])
    settled(core)


def test_a_request_reusing_a_prefix_logs_only_the_blocks_it_added_with_the_parent_hash() -> None:
    core = make(events=True)
    core.finish(core.admit(blocks(1, 2, 3), 3))
    core.take_events()
    prompt = blocks(1, 2, 7, 8)
    handle = core.admit(prompt, 4)
    assert core.cached_tokens(handle) == 2 * BS
    core.finish(handle)
    expected = reference_block_hashes(prompt, BS)
    [(kind, hashes, tokens, parent, _)] = entries(core.take_events())
    assert (kind, hashes, tokens, parent) == (STORED, expected[2:], blocks(7, 8), expected[1])
    settled(core)


def test_an_identical_request_logs_nothing() -> None:
    core = make(events=True)
    core.finish(core.admit(blocks(1, 2), 2))
    core.take_events()
    core.finish(core.admit(blocks(1, 2), 2))
    assert len(core.take_events()) == 0


def test_a_copied_leaf_is_logged_like_a_taken_over_one() -> None:
    # A long prompt whose tail alone is new: the finish copies the short run into a chunk of its own.
    core = make(64, events=True)
    long_prompt = blocks(*range(1, 13))
    core.finish(core.admit(long_prompt, 12))
    core.take_events()
    prompt = long_prompt[: 11 * BS] + blocks(50)
    handle = core.admit(prompt, 12)
    core.finish(handle)
    expected = reference_block_hashes(prompt, BS)
    [(kind, hashes, _, parent, _)] = entries(core.take_events())
    assert (kind, hashes, parent) == (STORED, expected[11:], expected[10])
    settled(core)


def test_caching_mid_life_and_extending_the_leaf_log_each_new_run_once() -> None:
    core = make(events=True)
    handle = core.admit(blocks(1, 2), 3)
    core.cache(handle, 2)
    core.append(handle, blocks(3))
    core.cache(handle, 3)  # lengthens the request's own leaf
    core.finish(handle)
    expected = reference_block_hashes(blocks(1, 2, 3), BS)
    logged = entries(core.take_events())
    assert [(kind, hashes) for kind, hashes, *_ in logged] == [(STORED, expected[:2]), (STORED, expected[2:])]
    assert logged[1][3] == expected[1]
    settled(core)


def test_adapters_start_their_chains_from_their_own_root() -> None:
    core = make(events=True)
    core.finish(core.admit(blocks(1, 2), 2, adapter=7))
    [(kind, hashes, _, parent, _)] = entries(core.take_events())
    assert hashes == reference_block_hashes(blocks(1, 2), BS, adapter=7) and parent is None
    assert core.take_events().entries.size == 0


# -- removed, demotion, cleared -------------------------------------------------------------------


def test_evicted_blocks_are_logged_with_the_hashes_they_were_stored_with() -> None:
    core = make(8, events=True)
    core.finish(core.admit(blocks(1, 2, 3), 3))
    stored = entries(core.take_events())[0][1]
    assert core.evict(2) == 2
    [(kind, hashes, tokens, parent, ids)] = entries(core.take_events())
    assert kind == REMOVED and sorted(hashes) == sorted(stored[1:]) and tokens == [] and ids == []
    settled(core)


def test_demotion_logs_the_block_ids_and_tokens_of_what_it_evicts() -> None:
    core = make(8, demote=True)
    assert core.events_on == (False, True)
    handle = core.admit(blocks(1, 2, 3), 3)
    table = core.block_table(handle).tolist()
    core.finish(handle)
    assert len(core.take_events()) == 0  # demotion alone logs only what leaves
    core.finish(core.admit(blocks(4, 5, 6, 7, 8, 9, 1), 7))  # needs 7 of 8 blocks: evicts
    logged = [entry for entry in entries(core.take_events()) if entry[0] == REMOVED]
    evicted = {block: (h, tok) for _, hashes, tokens, _, ids in logged for block, h, tok in
               zip(ids, hashes, [tokens[i : i + BS] for i in range(0, len(tokens), BS)], strict=True)}
    expected = dict(zip(table, zip(reference_block_hashes(blocks(1, 2, 3), BS),
                                   [blocks(1), blocks(2), blocks(3)], strict=True), strict=True))
    assert evicted and all(expected[block] == (h, tok) for block, (h, tok) in evicted.items())
    settled(core)


def test_a_reset_logs_one_cleared_entry_and_no_removals() -> None:
    core = make(events=True, demote=True)
    core.finish(core.admit(blocks(1, 2, 3), 3))
    core.take_events()
    assert core.reset() is True
    assert [kind for kind, *_ in entries(core.take_events())] == [CLEARED]
    settled(core)


def test_a_refused_reset_logs_nothing() -> None:
    core = make(events=True)
    core.finish(core.admit(blocks(1, 2, 3), 3))
    core.take_events()
    handle = core.admit(blocks(1, 2), 2)
    assert core.reset() is False
    assert len(core.take_events()) == 0
    core.finish(handle)
    settled(core)


def test_turning_events_on_hashes_what_is_cached_already() -> None:
    core = make(8)
    core.finish(core.admit(blocks(1, 2, 3), 3))
    core.set_events(True)
    core.check_invariants()  # recomputes every cached block's hash from its path
    assert core.evict(8) == 3
    [(kind, hashes, *_)] = entries(core.take_events())
    assert kind == REMOVED and sorted(hashes) == sorted(reference_block_hashes(blocks(1, 2, 3), BS))
    core.set_events(False)
    assert core.events_on == (False, False) and core.pending_events == 0
    settled(core)


def test_an_engine_that_stops_draining_loses_entries_counted_not_memory() -> None:
    core = make(64, events=True)
    core.set_events(True, max_pending_tokens=3 * BS)
    core.finish(core.admit(blocks(1, 2), 2))
    core.finish(core.admit(blocks(3, 4), 2))  # would take 4 blocks of tokens pending: dropped
    taken = core.take_events()
    assert len(taken) == 1 and taken.dropped == 1
    core.check_invariants()  # hashes are kept even for a dropped entry
    core.finish(core.admit(blocks(5), 1))
    assert len(core.take_events()) == 1


def test_raw_events_are_read_only_views_that_outlive_the_next_drain() -> None:
    core = make(events=True)
    core.finish(core.admit(blocks(1, 2), 2))
    first = core.take_events()
    hashes = first.hashes
    del first  # its buffers go back to the core for reuse; the view keeps them alive
    core.finish(core.admit(blocks(3, 4), 2))
    second = core.take_events()
    assert hashes.tolist() == reference_block_hashes(blocks(1, 2), BS)
    assert second.hashes.tolist() == reference_block_hashes(blocks(3, 4), BS)
    with pytest.raises(ValueError):
        hashes[0] = 1
    with pytest.raises(TypeError):
        RawEvents()


def test_events_mirror_the_cache_through_random_traffic() -> None:
    """A multiset of hashes kept from the events alone equals the cache's content at every step."""
    rng = random.Random(7)
    core = make(40, events=True, demote=True)
    mirror: Counter[int] = Counter()
    live: list[int] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.45 and len(live) < 6:
            prompt = blocks(*[rng.randrange(6) for _ in range(rng.randrange(1, 6))]) + [1]
            try:
                live.append(core.admit(prompt, len(prompt) // BS + 1, adapter=rng.choice([0, 3])))
            except Exception as error:  # out of blocks with everything pinned
                assert type(error).__name__ == "OutOfBlocks"
        elif action < 0.85 and live:
            core.finish(live.pop(rng.randrange(len(live))), cache=rng.random() < 0.9)
        elif action < 0.95:
            core.evict(rng.randrange(1, 6))
        else:
            table = core.block_table(live[0]).tolist() if live else []
            core.evict_blocks(rng.sample(range(40), 3) + table[:1])
        for kind, hashes, tokens, _, ids in entries(core.take_events()):
            if kind == STORED:
                assert len(tokens) == len(hashes) * BS
                mirror.update(hashes)
            elif kind == REMOVED:
                # Evictions are demoted (ids and tokens); evict_blocks' invalid KV never is.
                assert (len(ids), len(tokens)) in ((len(hashes), len(hashes) * BS), (0, 0))
                mirror.subtract(hashes)
                assert all(count >= 0 for count in mirror.values())
        assert sum(mirror.values()) == core.num_cached_blocks
        core.check_invariants()
    for handle in live:
        core.finish(handle)
    core.evict(40)
    for kind, hashes, *_ in entries(core.take_events()):
        mirror.update(hashes) if kind == STORED else mirror.subtract(hashes)
    assert +mirror == Counter() and core.num_cached_blocks == 0
    settled(core)


# -- evict_blocks ---------------------------------------------------------------------------------


def test_evict_blocks_drops_a_block_and_everything_cached_after_it() -> None:
    core = make(events=True, demote=True)
    handle = core.admit(blocks(1, 2, 3, 4), 4)
    table = core.block_table(handle).tolist()
    core.finish(handle)
    other = core.admit(blocks(1, 2, 9), 3)
    side = core.block_table(other).tolist()[2]
    core.finish(other)
    core.take_events()
    dropped = core.evict_blocks([table[1]])
    # Block 2 of the shared path and all below it (both branches) leave; block 1 stays.
    assert sorted(dropped.tolist()) == sorted(table[1:] + [side])
    assert core.num_cached_blocks == 1
    [(kind, hashes, tokens, _, ids)] = entries(core.take_events())
    assert kind == REMOVED and len(hashes) == 4 and (tokens, ids) == ([], [])  # invalid KV: never demoted
    handle = core.admit(blocks(1, 2, 3, 4), 4)
    assert core.cached_tokens(handle) == BS
    core.finish(handle)
    settled(core)


def test_evict_blocks_leaves_a_running_requests_path_alone() -> None:
    core = make()
    core.finish(core.admit(blocks(1, 2, 3), 3))
    handle = core.admit(blocks(1, 2, 3, 4), 4)
    table = core.block_table(handle).tolist()
    assert core.evict_blocks(table[:3]).size == 0
    assert core.num_cached_blocks == 3
    core.finish(handle)
    assert sorted(core.evict_blocks([table[2]]).tolist()) == sorted([table[2], table[3]])
    settled(core)


def test_evict_blocks_ignores_free_and_uncached_ids_and_refuses_bad_ones_first() -> None:
    core = make(8)
    core.finish(core.admit(blocks(1, 2), 2))
    before = (core.pool.num_free, core.num_cached_blocks)
    assert core.evict_blocks([7, 6]).size == 0
    evict_blocks: Callable[[object], object] = core.evict_blocks  # type: ignore[assignment]
    for bad in ([8], [-1], [0, 2**40], [[0]], ["x"]):
        with pytest.raises(InvalidId):
            evict_blocks(bad)
    assert (core.pool.num_free, core.num_cached_blocks) == before
    settled(core)


# -- common prefix, tables, the null block --------------------------------------------------------


def test_common_prefix_blocks_counts_the_leading_blocks_all_share() -> None:
    core = make()
    core.finish(core.admit(blocks(1, 2, 3), 3))
    a = core.admit(blocks(1, 2, 3, 4), 4)
    b = core.admit(blocks(1, 2, 5, 6), 4)
    c = core.admit(blocks(7), 1)
    assert core.num_common_prefix_blocks([a]) == 4
    assert core.num_common_prefix_blocks([a, b]) == 2
    assert core.num_common_prefix_blocks(np.array([a, b, c])) == 0
    assert core.num_common_prefix_blocks([]) == 0
    core.finish(c)
    with pytest.raises(SequenceStateError):
        core.num_common_prefix_blocks([a, c])
    core.finish(a)
    core.finish(b)
    settled(core)


class _DLPackOnly:
    """A tensor seen only through DLPack (as a torch CPU tensor would be)."""

    def __init__(self, array: np.ndarray, device: tuple[int, int] = (1, 0)) -> None:
        self._array, self._device = array, device

    def __dlpack__(self, **kwargs: object) -> object:
        return self._array.__dlpack__(**kwargs)  # type: ignore[arg-type]

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def test_write_table_fills_any_writable_int32_buffer_and_pads() -> None:
    core = make(null_block=True)
    handle = core.admit(blocks(1, 2, 3), 3)
    table = core.block_table(handle).tolist()
    assert 0 not in table
    row = np.full((2, 6), -5, dtype=np.int32)
    assert core.write_table(handle, row[1], pad=core.null_block) == 3
    assert row[1].tolist() == table + [0, 0, 0] and row[0].tolist() == [-5] * 6
    buffer = array.array("i", [9] * 4)
    assert core.write_table(handle, buffer) == 3
    assert buffer.tolist() == table + [9]
    target = np.zeros(3, dtype=np.int32)
    assert core.write_table(handle, _DLPackOnly(target)) == 3
    assert target.tolist() == table
    core.finish(handle)
    settled(core)


@pytest.mark.parametrize(
    "out",
    [
        np.zeros(2, dtype=np.int32),  # shorter than the table
        np.zeros(4, dtype=np.int64),
        np.zeros((2, 4), dtype=np.int32),
        np.zeros(8, dtype=np.int32)[::2],
        bytearray(16),
        "abcd",
        _DLPackOnly(np.zeros(4, dtype=np.int32), device=(2, 0)),
    ],
)
def test_write_table_refuses_what_it_cannot_write_and_writes_nothing(out: object) -> None:
    core = make()
    handle = core.admit(blocks(1, 2, 3), 3)
    before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
    with pytest.raises(InvalidId):
        core.write_table(handle, out)
    if before is not None:
        assert isinstance(out, np.ndarray) and np.array_equal(out, before)
    readonly = np.zeros(4, dtype=np.int32)
    readonly.flags.writeable = False
    with pytest.raises(InvalidId, match="read-only"):
        core.write_table(handle, readonly)
    core.finish(handle)
    settled(core)


def test_the_null_block_is_never_handed_out_cached_or_evicted() -> None:
    core = make(5, null_block=True)
    assert core.null_block == 0 and core.pool.num_free == 4
    handle = core.admit(blocks(1, 2, 3, 4), 4)
    assert 0 not in core.block_table(handle).tolist()
    core.finish(handle)
    assert core.evict_blocks([0]).size == 0
    core.evict(10)
    assert core.pool.num_free == 4 and core.num_cached_blocks == 0
    settled(core)
    pool = BlockPool(4)
    KVCacheCore(pool, BS).admit([1, 2], 1)
    with pytest.raises(ConfigError, match="fresh pool"):
        KVCacheCore(pool, BS, null_block=True)
    assert make(1, null_block=True).pool.num_free == 0
