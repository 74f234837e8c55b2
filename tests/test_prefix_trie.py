"""PrefixTrie: exact whole-block matching, adapter roots, pins, LRU eviction of leaves, tags."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from numpy.typing import NDArray

from lifecycle._prefix_trie import PrefixTrie
from lifecycle.errors import BlockIdOutOfRange, ConfigError, DoubleFree, InvalidId, LifecycleError

BS = 4


def toks(*values: int) -> NDArray[np.int32]:
    return np.array(values, dtype=np.int32)


def blocks(*ids: int) -> NDArray[np.int32]:
    return np.array(ids, dtype=np.int32)


def seq(*block_values: int, block_size: int = BS) -> NDArray[np.int32]:
    """Tokens made of whole blocks, block i filled with block_values[i]."""
    return np.repeat(np.array(block_values, dtype=np.int32), block_size)


@pytest.fixture
def trie() -> PrefixTrie:
    return PrefixTrie(BS)


# -- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -1, True, 1.5, 1 << 21])
def test_invalid_block_size_is_a_config_error(block_size: object) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        PrefixTrie(block_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("hash_bits", [-1, 65])
def test_invalid_hash_bits_is_a_config_error(hash_bits: int) -> None:
    with pytest.raises(ConfigError, match="hash_bits"):
        PrefixTrie(4, hash_bits=hash_bits)


def test_second_init_is_refused(trie: PrefixTrie) -> None:
    with pytest.raises(ConfigError, match="already initialized"):
        trie.__init__(8)


def test_uninitialized_instance_is_a_safe_empty_trie() -> None:
    bare = PrefixTrie.__new__(PrefixTrie)
    assert bare.match(toks(1, 2, 3))[0].size == 0
    bare.check_invariants()


def test_empty_trie_counts_nothing(trie: PrefixTrie) -> None:
    assert (trie.num_cached_blocks, trie.num_evictable_blocks, trie.num_adapters) == (0, 0, 0)
    trie.check_invariants()


# -- insert and match -------------------------------------------------------------------------


def test_insert_into_empty_trie_takes_every_block(trie: PrefixTrie) -> None:
    taken, duplicates, node_ids = trie.insert(seq(1, 2, 3), blocks(10, 11, 12))
    assert taken.tolist() == [10, 11, 12]
    assert duplicates.size == 0
    assert len(set(node_ids.tolist())) == 3
    assert trie.num_cached_blocks == 3
    trie.check_invariants()


def test_match_returns_the_longest_cached_whole_block_prefix(trie: PrefixTrie) -> None:
    _, _, node_ids = trie.insert(seq(1, 2, 3), blocks(10, 11, 12))
    block_ids, matched_nodes = trie.match(seq(1, 2, 9, 3))
    assert block_ids.tolist() == [10, 11]
    assert matched_nodes.tolist() == node_ids[:2].tolist()


def test_match_ignores_a_trailing_partial_block(trie: PrefixTrie) -> None:
    trie.insert(seq(1, 2), blocks(10, 11))
    block_ids, _ = trie.match(np.concatenate([seq(1), toks(2, 2, 2)]))
    assert block_ids.tolist() == [10]


def test_match_respects_max_blocks(trie: PrefixTrie) -> None:
    trie.insert(seq(1, 2, 3), blocks(10, 11, 12))
    assert trie.match(seq(1, 2, 3), 0, 2)[0].tolist() == [10, 11]
    assert trie.match(seq(1, 2, 3), 0, 0)[0].size == 0


def test_match_refuses_max_blocks_below_minus_one(trie: PrefixTrie) -> None:
    with pytest.raises(InvalidId, match="max_blocks -2"):
        trie.match(seq(1), 0, -2)


def test_a_block_differing_in_one_token_does_not_match(trie: PrefixTrie) -> None:
    trie.insert(toks(1, 2, 3, 4), blocks(10))
    assert trie.match(toks(1, 2, 3, 5))[0].size == 0


def test_match_accepts_token_lists(trie: PrefixTrie) -> None:
    trie.insert([1, 2, 3, 4], [10])
    assert trie.match([1, 2, 3, 4])[0].tolist() == [10]


def test_insert_over_existing_nodes_reports_duplicates(trie: PrefixTrie) -> None:
    _, _, first_path = trie.insert(seq(1, 2), blocks(10, 11))
    taken, duplicates, path = trie.insert(seq(1, 2, 3), blocks(20, 21, 22))
    assert taken.tolist() == [22]
    assert duplicates.tolist() == [20, 21]
    assert path[:2].tolist() == first_path.tolist()
    assert trie.match(seq(1, 2, 3))[0].tolist() == [10, 11, 22]
    trie.check_invariants()


def test_reinserting_the_cached_blocks_takes_nothing(trie: PrefixTrie) -> None:
    trie.insert(seq(1, 2), blocks(10, 11))
    taken, duplicates, _ = trie.insert(seq(1, 2), blocks(10, 11))
    assert taken.size == 0
    assert duplicates.tolist() == [10, 11]
    assert trie.num_cached_blocks == 2


def test_insert_with_a_known_prefix_extends_that_path(trie: PrefixTrie) -> None:
    trie.insert(seq(1, 2), blocks(10, 11))
    _, known = trie.match(seq(1, 2), pin=True)
    taken, duplicates, path = trie.insert(seq(1, 2, 3), blocks(20, 21, 22), known_prefix=known)
    assert (taken.tolist(), duplicates.tolist()) == ([22], [20, 21])
    assert path[:2].tolist() == known.tolist()
    assert trie.match(seq(1, 2, 3))[0].tolist() == [10, 11, 22]
    trie.check_invariants()


@pytest.mark.parametrize("case", ["other tokens", "not linked", "other adapter", "too long"])
def test_insert_refuses_a_wrong_known_prefix_unchanged(trie: PrefixTrie, case: str) -> None:
    _, _, path = trie.insert(seq(1, 2), blocks(10, 11))
    tokens, known, adapter = seq(1, 2, 3), path, 0
    if case == "other tokens":
        tokens = seq(1, 5, 3)
    elif case == "not linked":
        known = path[1:]
    elif case == "other adapter":
        adapter = 4
    else:
        known = np.concatenate([path, path])
    with pytest.raises(InvalidId, match="known prefix"):
        trie.insert(tokens, blocks(20, 21, 22), adapter, known_prefix=known)
    assert trie.num_cached_blocks == 2
    trie.check_invariants()


def test_insert_of_zero_blocks_changes_nothing(trie: PrefixTrie) -> None:
    taken, duplicates, path = trie.insert(seq(1), blocks())
    assert taken.size == duplicates.size == path.size == 0
    assert trie.num_cached_blocks == 0
    trie.check_invariants()


def test_insert_with_too_few_tokens_is_refused_unchanged(trie: PrefixTrie) -> None:
    with pytest.raises(InvalidId, match="2 blocks need 8 tokens but only 7"):
        trie.insert(toks(1, 2, 3, 4, 5, 6, 7), blocks(10, 11))
    assert trie.num_cached_blocks == 0
    trie.check_invariants()


def test_insert_of_a_negative_block_id_is_refused_unchanged(trie: PrefixTrie) -> None:
    with pytest.raises(BlockIdOutOfRange, match="-3"):
        trie.insert(seq(1, 2), blocks(10, -3))
    assert trie.num_cached_blocks == 0


@pytest.mark.parametrize("bad", [[1.5, 2.0], [[1, 2]], ["a"], [2**40]])
def test_non_int32_input_is_an_invalid_id_error(trie: PrefixTrie, bad: object) -> None:
    with pytest.raises(InvalidId):
        trie.match(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("adapter", [1.0, "a", True, 2**64])
def test_bad_adapter_key_is_an_invalid_id_error(trie: PrefixTrie, adapter: object) -> None:
    with pytest.raises(InvalidId, match="adapter"):
        trie.match(seq(1), adapter)  # type: ignore[arg-type]


def test_adapters_have_separate_roots(trie: PrefixTrie) -> None:
    trie.insert(seq(1, 2), blocks(10, 11), adapter=0)
    trie.insert(seq(1, 2), blocks(20, 21), adapter=7)
    assert trie.match(seq(1, 2), 0)[0].tolist() == [10, 11]
    assert trie.match(seq(1, 2), 7)[0].tolist() == [20, 21]
    assert trie.match(seq(1, 2), -(2**63))[0].size == 0
    assert trie.num_adapters == 2
    trie.check_invariants()


def test_numpy_integer_adapter_keys_are_accepted(trie: PrefixTrie) -> None:
    trie.insert(seq(1), blocks(10), adapter=np.int64(2**62))
    assert trie.match(seq(1), 2**62)[0].tolist() == [10]


def test_same_block_under_different_parents_are_different_nodes(trie: PrefixTrie) -> None:
    trie.insert(seq(1, 5), blocks(10, 11))
    trie.insert(seq(2, 5), blocks(20, 21))
    assert trie.match(seq(2, 5))[0].tolist() == [20, 21]
    assert trie.num_cached_blocks == 4


# -- hash collisions ----------------------------------------------------------------------------


@pytest.mark.parametrize("hash_bits", [0, 1])
def test_colliding_hashes_never_match_different_tokens(hash_bits: int) -> None:
    # With 0 or 1 hash bits every block collides: only the token compare can tell them apart.
    trie = PrefixTrie(BS, hash_bits=hash_bits)
    for value in range(50):
        trie.insert(seq(value, value + 1), blocks(2 * value, 2 * value + 1))
    for value in range(50):
        assert trie.match(seq(value, value + 1))[0].tolist() == [2 * value, 2 * value + 1]
    assert trie.match(seq(50, 51))[0].size == 0
    assert trie.match(seq(3, 5))[0].tolist() == [6]
    trie.check_invariants()


def test_near_identical_blocks_do_not_collide_into_a_match() -> None:
    trie = PrefixTrie(16)
    base = np.arange(16, dtype=np.int32)
    for position in range(16):
        variant = base.copy()
        variant[position] += 1
        trie.insert(variant, blocks(position))
    trie.insert(base, blocks(99))
    for position in range(16):
        variant = base.copy()
        variant[position] += 1
        assert trie.match(variant)[0].tolist() == [position]
    assert trie.match(base)[0].tolist() == [99]
    swapped = base.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert trie.match(swapped)[0].size == 0


def test_eviction_under_full_collisions_keeps_chains_intact() -> None:
    trie = PrefixTrie(2, hash_bits=0)
    for value in range(20):
        trie.insert(seq(value, block_size=2), blocks(value))
    assert sorted(trie.evict(10).tolist()) == list(range(10))
    for value in range(10, 20):
        assert trie.match(seq(value, block_size=2))[0].tolist() == [value]
    trie.check_invariants()


# -- eviction ------------------------------------------------------------------------------------


def test_evict_takes_least_recently_inserted_first(trie: PrefixTrie) -> None:
    trie.insert(seq(1), blocks(10))
    trie.insert(seq(2), blocks(20))
    trie.insert(seq(3), blocks(30))
    assert trie.evict(2).tolist() == [10, 20]
    trie.check_invariants()


def test_match_refreshes_recency(trie: PrefixTrie) -> None:
    trie.insert(seq(1), blocks(10))
    trie.insert(seq(2), blocks(20))
    trie.match(seq(1))
    assert trie.evict(1).tolist() == [20]


def test_match_with_no_room_left_in_max_blocks_does_not_refresh(trie: PrefixTrie) -> None:
    trie.insert(seq(1), blocks(10))
    trie.insert(seq(2), blocks(20))
    trie.match(seq(1), 0, 0)
    assert trie.evict(1).tolist() == [10]


def test_evict_takes_leaves_before_their_parents(trie: PrefixTrie) -> None:
    trie.insert(seq(1, 2, 3), blocks(10, 11, 12))
    assert trie.evict(3).tolist() == [12, 11, 10]
    assert trie.num_cached_blocks == 0
    trie.check_invariants()


def test_a_parent_whose_children_went_keeps_its_own_recency(trie: PrefixTrie) -> None:
    trie.insert(seq(1, 2), blocks(10, 11))  # 11 is a leaf under 10
    trie.insert(seq(5), blocks(50))
    trie.match(seq(1))  # 10 is now more recent than 50, 11 less
    assert trie.evict(1).tolist() == [11]
    assert trie.evict(2).tolist() == [50, 10]


def test_evict_never_takes_a_pinned_node_or_its_ancestors(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1, 2, 3), blocks(10, 11, 12))
    trie.insert(seq(7), blocks(70))
    trie.pin(path[1:2])
    assert trie.num_evictable_blocks == 2
    assert trie.evict(10).tolist() == [12, 70]
    assert trie.match(seq(1, 2))[0].tolist() == [10, 11]
    trie.check_invariants()


def test_unpinned_nodes_become_evictable_again_deepest_first(trie: PrefixTrie) -> None:
    _, node_ids = trie.insert(seq(1, 2), blocks(10, 11))[1:]
    trie.pin(node_ids)
    trie.insert(seq(3), blocks(30))
    trie.unpin(node_ids)
    assert trie.evict(3).tolist() == [30, 11, 10]


def test_evict_more_than_evictable_returns_what_there_is(trie: PrefixTrie) -> None:
    trie.insert(seq(1), blocks(10))
    assert trie.evict(5).tolist() == [10]
    assert trie.evict(5).size == 0


def test_evict_of_a_negative_count_is_refused(trie: PrefixTrie) -> None:
    with pytest.raises(InvalidId, match="-1"):
        trie.evict(-1)


def test_adapter_root_goes_with_its_last_block(trie: PrefixTrie) -> None:
    trie.insert(seq(1), blocks(10), adapter=3)
    trie.evict(1)
    assert trie.num_adapters == 0
    trie.check_invariants()


def test_evict_is_one_pass_over_many_nodes() -> None:
    trie = PrefixTrie(2)
    for value in range(2000):
        trie.insert(seq(value, value, block_size=2), blocks(2 * value, 2 * value + 1))
    evicted = trie.evict(4000)
    assert evicted[:4].tolist() == [1, 0, 3, 2]
    assert trie.num_cached_blocks == 0
    trie.check_invariants()


# -- pins -------------------------------------------------------------------------------------------


def test_match_with_pin_pins_every_matched_node(trie: PrefixTrie) -> None:
    trie.insert(seq(1, 2), blocks(10, 11))
    _, node_ids = trie.match(seq(1, 2), pin=True)
    assert [trie.pin_count(int(node)) for node in node_ids] == [1, 1]
    assert trie.num_evictable_blocks == 0
    trie.check_invariants()


def test_pins_are_counted(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1), blocks(10))
    trie.pin(path)
    trie.pin(path)
    trie.unpin(path)
    assert trie.evict(1).size == 0
    trie.unpin(path)
    assert trie.evict(1).tolist() == [10]


def test_unpin_below_zero_is_a_double_free_and_changes_nothing(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1, 2), blocks(10, 11))
    trie.pin(path[:1])
    with pytest.raises(DoubleFree, match=f"node id {int(path[1])}"):
        trie.unpin(path)
    assert trie.pin_count(int(path[0])) == 1
    trie.check_invariants()


def test_unpin_of_a_node_repeated_beyond_its_pins_is_refused(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1), blocks(10))
    trie.pin(path)
    with pytest.raises(DoubleFree):
        trie.unpin(np.concatenate([path, path]))
    assert trie.pin_count(int(path[0])) == 1
    trie.check_invariants()


def test_failed_unpin_restores_the_eviction_order(trie: PrefixTrie) -> None:
    _, _, first = trie.insert(seq(1), blocks(10))
    _, _, second = trie.insert(seq(2), blocks(20))
    trie.insert(seq(3), blocks(30))
    trie.pin(first)
    with pytest.raises(DoubleFree):
        trie.unpin(np.concatenate([first, second]))
    assert trie.evict(3).tolist() == [20, 30]


@pytest.mark.parametrize("bad_node", [-1, 10_000, 2**31 - 1])
def test_pin_of_an_unknown_node_is_refused_unchanged(trie: PrefixTrie, bad_node: int) -> None:
    _, _, path = trie.insert(seq(1), blocks(10))
    with pytest.raises(InvalidId, match=f"node id {bad_node}"):
        trie.pin([int(path[0]), bad_node])
    assert trie.pin_count(int(path[0])) == 0
    trie.check_invariants()


def test_pin_of_an_evicted_node_is_refused(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1), blocks(10))
    trie.evict(1)
    with pytest.raises(InvalidId):
        trie.pin(path)


# -- tags --------------------------------------------------------------------------------------------


def test_tags_round_trip_and_default_to_minus_one(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1, 2), blocks(10, 11))
    trie.set_tag(int(path[1]), 5)
    assert [trie.get_tag(int(node)) for node in path] == [-1, 5]
    trie.set_tag(int(path[1]), -1)
    assert trie.get_tag(int(path[1])) == -1


def test_set_tag_refuses_tags_below_minus_one(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1), blocks(10))
    with pytest.raises(InvalidId, match="-2"):
        trie.set_tag(int(path[0]), -2)


def test_tag_of_an_unknown_node_is_refused(trie: PrefixTrie) -> None:
    with pytest.raises(InvalidId):
        trie.get_tag(0)
    with pytest.raises(InvalidId):
        trie.set_tag(0, 1)


def test_evicted_tags_reports_and_clears_tags_of_evicted_nodes(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1, 2, 3), blocks(10, 11, 12))
    trie.set_tag(int(path[2]), 7)
    trie.set_tag(int(path[0]), 3)
    trie.evict(2)
    assert trie.evicted_tags().tolist() == [7]
    trie.evict(1)
    assert trie.evicted_tags().tolist() == [3]
    assert trie.evicted_tags().size == 0


def test_deepest_tagged_finds_the_deepest_node_with_a_tag(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1, 2, 3, 4), blocks(10, 11, 12, 13))
    assert trie.deepest_tagged(path) == -1
    trie.set_tag(int(path[0]), 0)
    trie.set_tag(int(path[2]), 1)
    assert trie.deepest_tagged(path) == 2
    assert trie.deepest_tagged(path[::-1].copy()) == 1


def test_deepest_tagged_refuses_unknown_nodes(trie: PrefixTrie) -> None:
    with pytest.raises(InvalidId, match="node id 3"):
        trie.deepest_tagged([3])


# -- clear, capacity, memory ---------------------------------------------------------------------


def test_clear_drops_every_node_and_returns_its_blocks(trie: PrefixTrie) -> None:
    _, _, path = trie.insert(seq(1, 2), blocks(10, 11))
    trie.insert(seq(3), blocks(30), adapter=1)
    trie.pin(path)
    trie.set_tag(int(path[1]), 4)
    assert sorted(trie.clear().tolist()) == [10, 11, 30]
    assert (trie.num_cached_blocks, trie.num_evictable_blocks, trie.num_adapters) == (0, 0, 0)
    assert trie.evicted_tags().tolist() == [4]
    assert trie.match(seq(1, 2))[0].size == 0
    trie.check_invariants()


def test_growth_keeps_every_node_findable() -> None:
    trie = PrefixTrie(2)
    for value in range(3000):
        trie.insert(toks(value, value + 1, 7, 7), blocks(2 * value, 2 * value + 1))
    assert trie.num_cached_blocks == 6000
    for value in range(0, 3000, 97):
        assert trie.match(toks(value, value + 1, 7, 7))[0].tolist() == [2 * value, 2 * value + 1]
    trie.check_invariants()


def test_reserve_refuses_negative_counts(trie: PrefixTrie) -> None:
    with pytest.raises(InvalidId):
        trie.reserve(-1)


def test_metadata_is_at_most_64_bytes_per_block() -> None:
    assert PrefixTrie.metadata_bytes_per_block() <= 64


def test_memory_per_cached_block_is_metadata_plus_tokens() -> None:
    trie = PrefixTrie(16, capacity=4096)
    tokens = np.arange(16 * 4096, dtype=np.int32)
    for start in range(0, 4096, 64):
        trie.insert(tokens[start * 16 :], np.arange(start, start + 63, dtype=np.int32))
    per_block = trie.nbytes / trie.num_cached_blocks
    # Full tables (63 of every 64 slots in use) plus the tag buffer, one int32 per node.
    assert per_block <= (PrefixTrie.metadata_bytes_per_block() + 4 + 16 * 4) * 64 / 63 + 1


# -- errors are library errors, threads ---------------------------------------------------------------


def test_every_refusal_is_a_lifecycle_error(trie: PrefixTrie) -> None:
    for call in (lambda: trie.unpin([0]), lambda: trie.evict(-5), lambda: trie.insert([1], [1])):
        with pytest.raises(LifecycleError):
            call()


def test_concurrent_inserts_matches_and_evictions_keep_the_trie_consistent() -> None:
    trie = PrefixTrie(2)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for step in range(400):
                tokens = rng.integers(0, 3, size=8).astype(np.int32)
                trie.insert(tokens, np.arange(4, dtype=np.int32) + 4 * step)
                _, node_ids = trie.match(tokens, pin=True)
                trie.unpin(node_ids)
                trie.evict(int(rng.integers(0, 3)))
        except BaseException as error:  # surfaced in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    trie.check_invariants()
