"""lifecycle.integrations.sglang: the page tree under ``LifecycleRadixCache`` (engine-free, here),
and SGLang's own radix-cache tests against the adapter (in SGLang's peer environment, skipped
without it: ``tests/engine_suites/suite_sglang.py``).

Every stateful test ends with the tree's ``check_invariants`` and a recount of who holds which KV
index: each index given to the tree is either still cached or was handed back exactly once.
"""

from __future__ import annotations

import copy
import enum
import importlib.util
import pickle
import sys
import types
from array import array
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from engine_suites import assert_import_loads_none_of, run_suite
from lifecycle._blockpool import BlockPool
from lifecycle._sglang_pagetree import page_indices, pages_of, release_indices
from lifecycle.errors import ConfigError, DoubleFree, InvalidId, LifecycleError, SequenceStateError
from lifecycle.integrations.sglang import PageNode, PageTree, dfs_weight_order

PS = 4


class Tree:
    """A page tree with the indices it evicted collected, as an allocator would receive them."""

    def __init__(self, num_pages: int = 16, page_size: int = PS, events: bool = False) -> None:
        self.freed: list[int] = []
        self.tree = PageTree(num_pages, page_size, events=events, on_evict=self._freed)

    def _freed(self, values: npt.NDArray[np.int64]) -> None:
        self.freed.extend(values.tolist())

    def insert(self, tokens: list[int], first_index: int, namespace: int = 0) -> tuple[int, PageNode]:
        pages = len(tokens) // self.tree.page_size
        values = np.arange(first_index, first_index + pages * self.tree.page_size, dtype=np.int64)
        return self.tree.insert(tokens, len(tokens), values, namespace)

    def match(self, tokens: list[int], namespace: int = 0) -> tuple[list[int], PageNode]:
        node = self.tree.match(tokens, len(tokens), namespace)
        return self.tree.values(node).tolist(), node

    def settled(self) -> None:
        self.tree.check_invariants()
        cached = sorted(self.tree.all_values().tolist())
        assert len(cached) == self.tree.cached_pages * self.tree.page_size
        assert not set(cached) & set(self.freed) and len(set(self.freed)) == len(self.freed)


def run(*values: int) -> list[int]:
    return [v for value in values for v in range(value, value + PS)]


def test_an_inserted_key_matches_with_its_indices_in_whole_pages() -> None:
    t = Tree()
    assert t.insert(list(range(10)), 100)[0] == 0  # two whole pages; the last 2 tokens are not a page
    assert t.match(list(range(10)))[0] == run(100, 104)
    assert t.match(list(range(6)))[0] == run(100)
    assert t.match([0, 1, 2, 9])[0] == []
    t.settled()


def test_the_first_indices_stay_cached_and_the_duplicates_are_reported() -> None:
    t = Tree()
    t.insert(list(range(8)), 100)
    cached, _ = t.insert(list(range(12)), 200)
    assert cached == 2  # pages 200.. and 204.. duplicate what is cached: the caller frees them
    assert t.match(list(range(12)))[0] == run(100, 104, 208)
    t.settled()


def test_namespaces_never_share_pages() -> None:
    t = Tree()
    t.insert(list(range(8)), 100, namespace=1)
    assert t.match(list(range(8)), namespace=2)[0] == []
    assert t.match(list(range(8)), namespace=1)[0] == run(100, 104)
    t.settled()


def test_a_lock_keeps_its_path_from_eviction_until_unlocked() -> None:
    t = Tree()
    t.insert(list(range(8)), 100)
    t.insert([9] * 8, 200)
    _, node = t.match(list(range(8)))
    handle, taken = t.tree.lock(node)
    assert taken == 2 and t.tree.protected_pages == 2 and t.tree.evictable_pages == 2
    assert t.tree.evict(10) == 2
    assert sorted(t.freed) == run(200, 204)
    assert t.tree.unlock(node, handle) == 2
    assert t.tree.evict(10) == 2
    assert sorted(t.freed) == run(100, 104, 200, 204)
    t.settled()


def test_locks_count_per_path_whichever_node_took_them() -> None:
    t = Tree()
    t.insert(list(range(8)), 100)
    first = t.match(list(range(8)))[1]
    second = t.match(list(range(8)))[1]
    t.tree.lock(first)
    t.tree.unlock(second)
    assert t.tree.protected_pages == 0
    t.settled()


def test_a_match_that_nobody_locks_holds_nothing() -> None:
    t = Tree()
    t.insert(list(range(8)), 100)
    t.match(list(range(8)))
    assert t.tree.evictable_pages == 2
    assert t.tree.evict(2) == 2
    t.settled()


def test_a_lock_on_an_evicted_path_is_refused_and_holds_nothing() -> None:
    t = Tree()
    t.insert(list(range(8)), 100)
    _, node = t.match(list(range(8)))
    t.tree.evict(2)
    t.insert([5] * 8, 200)  # takes the freed slots
    t.insert(list(range(8)), 300)  # the same key again, in other slots
    with pytest.raises(SequenceStateError, match="evicted"):
        t.tree.lock(node)
    t.settled()


def test_an_unlock_without_a_lock_is_refused_by_name() -> None:
    t = Tree()
    t.insert(list(range(8)), 100)
    _, node = t.match(list(range(8)))
    with pytest.raises(SequenceStateError, match="no lock"):
        t.tree.unlock(node)
    handle, _ = t.tree.lock(node)
    with pytest.raises(SequenceStateError, match=f"lock {handle + 1}"):
        t.tree.unlock(node, handle + 1)
    t.tree.unlock(node, handle)
    t.settled()


def test_least_recently_used_pages_are_evicted_first_leaves_first() -> None:
    t = Tree()
    t.insert(list(range(8)), 100)
    t.insert([7] * 8, 200)
    t.match(list(range(8)))
    assert t.tree.evict(3) == 3
    assert sorted(t.freed) == run(104, 200, 204)  # the other key, then the matched key's leaf
    assert t.match(list(range(8)))[0] == run(100)
    t.settled()


def test_a_full_tree_evicts_to_make_room_for_an_insert() -> None:
    t = Tree(num_pages=4)
    t.insert(list(range(8)), 100)
    t.insert([7] * 8, 200)
    t.insert([8] * 8, 300)
    assert len(t.freed) == 2 * PS and t.tree.cached_pages == 4
    assert t.match([8] * 8)[0] == run(300, 304)
    t.settled()


def test_reset_drops_every_page_and_lock_without_handing_indices_back() -> None:
    t = Tree()
    t.insert(list(range(8)), 100)
    _, node = t.match(list(range(8)))
    t.tree.lock(node)
    t.tree.reset()
    assert (t.tree.cached_pages, t.tree.num_locks, t.freed) == (0, 0, [])
    with pytest.raises(SequenceStateError, match="reset"):
        t.tree.lock(node)
    assert t.match(list(range(8)))[0] == []
    t.settled()


def test_events_log_what_was_stored_evicted_and_cleared() -> None:
    t = Tree(events=True)
    t.insert(list(range(8)), 100)
    t.tree.evict(1)
    t.tree.reset()
    kinds = [int(kind) for raw in t.tree.take_events() for kind in raw.entries["kind"]]
    assert kinds == [1, 2, 3]
    assert t.tree.take_events() == []
    t.settled()


@pytest.mark.parametrize(
    "container",
    [
        list,
        tuple,
        lambda tokens: array("q", tokens),
        lambda tokens: array("i", tokens),
        lambda tokens: array("L", tokens),
        lambda tokens: np.array(tokens, dtype=np.int64),
        lambda tokens: np.array(tokens, dtype=np.int32),
        lambda tokens: np.array(tokens, dtype=np.uint16),
        lambda tokens: np.array([tokens, tokens], dtype=np.int64).T[:, 0],  # strided
    ],
)
def test_keys_come_in_any_container_of_token_ids_and_match_alike(container: Any) -> None:
    t = Tree()
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    t.insert(tokens, 100)
    key = container(tokens)
    node = t.tree.match(key, len(key))
    assert node.num_pages == len(key) // PS
    assert t.tree.values(node).tolist() == run(100, 104)[: node.num_pages * PS]
    head = node.num_pages * PS
    assert node.tokens.dtype == np.int32 and node.tokens[:head].tolist() == tokens[:head]
    t.settled()


def test_a_key_on_a_strided_view_matches_like_its_copy() -> None:
    t = Tree()
    t.insert(list(range(8)), 100)
    strided = np.repeat(np.arange(8, dtype=np.int64), 2)[::2]  # 0, 1, ..., 7 with a stride of 2
    assert not strided.flags.c_contiguous
    assert t.tree.match(strided, 8).num_pages == 2
    assert t.tree.match(np.arange(16, dtype=np.int64)[::2], 8).num_pages == 0  # 0, 2, 4, ...
    t.settled()


@pytest.mark.parametrize(
    "tokens",
    [
        np.array([1, 2, 1 << 32, 4], dtype=np.int64),
        array("q", [1, 2, 1 << 32, 4]),
        array("Q", [1, 2, 1 << 63, 4]),
        [1, 2, 1 << 32, 4],
        [1, 2, 1 << 70, 4],
        (1, 2, 1 << 70, 4),
    ],
)
def test_a_token_id_past_int32_is_refused_by_name_and_nothing_changes(tokens: Any) -> None:
    t = Tree()
    with pytest.raises(InvalidId, match=f"token id {tokens[2]} \\(at index 2\\)"):
        t.tree.insert(tokens, 4, np.arange(4, dtype=np.int64))
    with pytest.raises(InvalidId, match="index 2"):
        t.tree.match(tokens, 4)
    assert t.tree.cached_pages == 0
    t.settled()


@pytest.mark.parametrize("tokens", [[1, 2, -3, 4], np.array([1, 2, -3, 4]), array("i", [1, 2, -3, 4])])
def test_a_negative_token_id_is_refused_and_nothing_changes(tokens: Any) -> None:
    t = Tree()
    with pytest.raises(InvalidId, match="-3"):
        t.tree.insert(tokens, 4, np.arange(4, dtype=np.int64))
    assert t.tree.cached_pages == 0
    t.settled()


@pytest.mark.parametrize("tokens", [["a", "b", "c", "d"], [1.5, 2, 3, 4], np.ones((2, 4), dtype=np.int64), None])
def test_what_is_not_a_sequence_of_token_ids_is_refused(tokens: Any) -> None:
    t = Tree()
    with pytest.raises((InvalidId, TypeError)):
        t.tree.match(tokens, 4)
    t.settled()


def test_a_length_past_the_tokens_is_refused_and_nothing_changes() -> None:
    t = Tree()
    with pytest.raises(InvalidId, match="longer than its 4 token ids"):
        t.tree.insert([1, 2, 3, 4], 8, np.arange(8, dtype=np.int64))
    with pytest.raises(InvalidId, match="longer than its 4 token ids"):
        t.tree.match(array("q", [1, 2, 3, 4]), 8)
    with pytest.raises(InvalidId):
        t.tree.match([1, 2, 3, 4], -4)
    assert t.tree.cached_pages == 0
    t.settled()


def test_too_few_indices_for_the_key_are_refused() -> None:
    t = Tree()
    with pytest.raises(InvalidId, match="7 KV indices for a key of 2 pages"):
        t.tree.insert(list(range(8)), 8, np.arange(7, dtype=np.int64), 0)
    t.settled()


def test_a_key_longer_than_the_tree_is_refused_on_insert_and_matched_in_part() -> None:
    t = Tree(num_pages=2)
    t.insert(list(range(8)), 100)
    with pytest.raises(InvalidId, match="3 pages is longer than the tree's 2 pages"):
        t.tree.insert(list(range(12)), 12, np.arange(12, dtype=np.int64))
    assert t.match(list(range(12)))[0] == run(100, 104)
    t.settled()


def test_eviction_can_free_the_pages_to_the_allocators_pool_directly() -> None:
    pool = BlockPool(8)
    handed: list[int] = []
    tree = PageTree(8, PS, on_evict=lambda values: handed.extend(values.tolist()))
    first = page_indices(pool, 2 * PS, PS)
    second = page_indices(pool, 2 * PS, PS)
    assert first is not None and second is not None
    tree.insert(list(range(8)), 8, first)
    tree.insert([9] * 8, 8, second)
    assert pool.num_free == 4
    assert tree.evict(3, pool) == 3  # straight to the pool, not through on_evict
    assert pool.num_free == 7 and handed == [] and tree.cached_pages == 1
    assert tree.evict(1) == 1 and len(handed) == PS  # without a pool: on_evict, as before
    pool.check_invariants()
    tree.check_invariants()


def test_an_eviction_into_a_pool_that_refuses_the_pages_is_reported() -> None:
    pool = BlockPool(8)
    tree = PageTree(8, PS)
    tree.insert(list(range(8)), 8, np.arange(8 * PS, 10 * PS, dtype=np.int64))  # pages 8, 9: not the pool's
    with pytest.raises(LifecycleError):
        tree.evict(2, pool)
    assert pool.num_free == 8
    pool.check_invariants()


def test_nodes_of_another_tree_or_made_by_hand_are_refused_by_name() -> None:
    t, other = Tree(), Tree(num_pages=1000)
    other.insert(list(range(8)), 100)
    t.insert(list(range(8)), 100)
    foreign = other.tree.match(list(range(8)), 8)
    made = PageNode(0, 0, np.zeros(1, dtype=np.int32), np.array([1, 2], dtype=np.int32))
    for node in (foreign, made):
        with pytest.raises(SequenceStateError, match="not a node of this tree"):
            t.tree.values(node)
        with pytest.raises(SequenceStateError, match="not a node of this tree"):
            t.tree.lock(node)
        with pytest.raises(SequenceStateError, match="not a node of this tree"):
            t.tree.unlock(node)
    node = t.tree.match(list(range(8)), 8)
    assert not node.slots.flags.writeable and not node.tokens.flags.writeable
    t.settled()
    other.settled()


def test_a_node_re_made_copied_or_written_to_is_refused_not_read() -> None:
    t = Tree()
    _, node = t.insert(list(range(8)), 100)
    node.__init__(node.generation, node.namespace, node.tokens, np.array([100_000_000], dtype=np.int32))
    with pytest.raises(SequenceStateError, match="not a node of this tree"):
        t.tree.values(node)  # re-made: no tree's any more
    _, node = t.insert(list(range(8)), 100)
    with pytest.raises(TypeError):
        copy.deepcopy(node)
    with pytest.raises(TypeError):
        pickle.dumps(node)
    node.slots.setflags(write=True)  # possible for an array that owns its memory
    node.slots[0] = 100_000_000
    with pytest.raises(InvalidId, match="outside"):
        t.tree.values(node)
    t.settled()


def test_an_insert_into_a_full_tree_evicts_only_for_its_new_pages_and_keeps_its_prefix() -> None:
    t = Tree(num_pages=4)
    t.insert(list(range(4)), 100)  # the prefix, least recently used
    t.insert([7] * 12, 200)  # the tree is full
    cached, node = t.insert([0, 1, 2, 3, 9, 9, 9, 9], 300)
    assert cached == 1 and node.num_pages == 2  # the prefix was kept and reused
    assert sorted(t.freed) == run(208)  # one page evicted, the other key's leaf
    assert t.match([0, 1, 2, 3, 9, 9, 9, 9])[0] == run(100, 304)
    t.freed.extend(run(300))  # the caller's duplicate of the cached prefix
    t.settled()


def test_a_refused_insert_into_a_full_tree_evicts_nothing() -> None:
    t = Tree(num_pages=2)
    t.insert(list(range(8)), 100)
    with pytest.raises(InvalidId, match="KV index -1"):
        t.tree.insert([9] * 8, 8, np.array([0, 1, 2, 3, 4, 5, 6, -1], dtype=np.int64))
    assert t.tree.cached_pages == 2 and t.freed == []
    t.settled()


def test_an_int_enum_namespace_is_its_value() -> None:
    class Tenant(enum.IntEnum):
        A = 7

    t = Tree()
    t.insert(list(range(8)), 100, namespace=Tenant.A)
    assert t.match(list(range(8)), namespace=7)[0] == run(100, 104)
    t.settled()


def test_with_torch_blocked_lists_of_indices_still_convert(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # what blocking an import looks like
    pool = BlockPool(8)
    assert release_indices(pool, page_indices(pool, 8, PS).tolist(), PS) == 2  # type: ignore[union-attr]
    t = Tree()
    t.tree.insert(list(range(8)), 8, list(range(8)))
    t.settled()


def test_negative_kv_indices_are_refused_and_nothing_is_cached() -> None:
    t = Tree()
    t.insert(list(range(4)), 100)
    with pytest.raises(InvalidId, match="KV index -1 \\(at index 5\\)"):
        t.tree.insert(list(range(8)), 8, np.array([7, 7, 7, 7, 0, -1, 2, 3], dtype=np.int64))
    assert t.tree.cached_pages == 1 and t.tree.evictable_pages == 1
    t.settled()


@pytest.mark.parametrize("namespace", [1 << 63, -(1 << 63) - 1, "salt", 1.5])
def test_a_namespace_that_is_not_an_int64_is_refused(namespace: Any) -> None:
    t = Tree()
    with pytest.raises(InvalidId):
        t.tree.match([1, 2, 3, 4], 4, namespace)
    with pytest.raises(InvalidId):
        t.tree.insert([1, 2, 3, 4], 4, np.arange(4, dtype=np.int64), namespace)
    t.settled()


@pytest.mark.parametrize(
    "values",
    [
        [[1, 2], [3]],  # ragged
        np.ones(8, dtype=np.float64),
        np.arange(8, dtype=np.uint64) + np.uint64(1 << 63),
        "12345678",
    ],
)
def test_what_is_not_an_array_of_kv_indices_is_refused(values: Any) -> None:
    t = Tree()
    with pytest.raises(InvalidId):
        t.tree.insert(list(range(8)), 8, values)
    assert t.tree.cached_pages == 0
    t.settled()


def test_a_strided_uint64_key_past_int32_is_refused_by_name() -> None:
    t = Tree()
    with pytest.raises(InvalidId, match=str((1 << 64) - 1)):
        t.tree.match(np.array([(1 << 64) - 1, 1, 2, 3], dtype=np.uint64)[::-1], 4)
    t.settled()


# -- the allocator helpers -------------------------------------------------------------------------


def test_page_indices_hand_out_whole_pages_in_order_or_nothing() -> None:
    pool = BlockPool(4)
    indices = page_indices(pool, 6, PS)
    assert indices is not None and indices.dtype == np.int64 and len(indices) == 6
    first, second = int(indices[0]), int(indices[4])
    assert first % PS == 0 and second % PS == 0 and first != second
    assert indices.tolist() == [*run(first), second, second + 1]  # each page's slots in order, the last in part
    pages = [first // PS, second // PS]
    assert pool.num_free == 2 and all(pool.refcounts()[pages] == 1)
    assert page_indices(pool, 3 * PS, PS) is None and pool.num_free == 2  # too few: nothing taken
    ones = page_indices(pool, 2, 1)
    assert ones is not None and sorted(ones.tolist()) == sorted(set(range(4)) - set(pages))
    assert page_indices(pool, 0, PS) is not None and pool.num_free == 0
    pool.check_invariants()


def test_release_indices_frees_each_listed_page_once() -> None:
    pool = BlockPool(8)
    indices = page_indices(pool, 3 * PS, PS)
    assert indices is not None
    assert release_indices(pool, indices, PS) == 3
    assert pool.num_free == 8
    indices = page_indices(pool, 2 * PS, PS)
    assert indices is not None
    assert release_indices(pool, indices[::PS].copy(), PS, first_of_page=False) == 2
    pool.check_invariants()


def test_release_indices_refuses_a_page_freed_twice_and_changes_nothing() -> None:
    pool = BlockPool(8)
    indices = page_indices(pool, 2 * PS, PS)
    assert indices is not None
    apart = np.concatenate([indices, indices[:1]])  # page of the first index listed again, apart
    with pytest.raises(DoubleFree):
        release_indices(pool, apart, PS)
    assert pool.num_free == 6
    assert pages_of(apart, PS, unique=True).tolist() == sorted({int(i) // PS for i in indices})
    with pytest.raises(DoubleFree):
        release_indices(pool, np.array([5, 5], dtype=np.int64), 1)  # one slot a page: a real double free
    with pytest.raises(InvalidId, match="-1"):
        release_indices(pool, np.array([-1], dtype=np.int64), PS)
    assert pool.num_free == 6
    pool.check_invariants()


@pytest.mark.parametrize(("num_pages", "page_size"), [(0, 4), (4, 0), (4, 1 << 17)])
def test_bad_sizes_are_refused_by_name(num_pages: int, page_size: int) -> None:
    with pytest.raises(ConfigError):
        PageTree(num_pages, page_size)


@pytest.mark.parametrize("page_size", [1, 4, 16, 17])
def test_indices_in_runs_or_in_any_order_read_back_as_stored(page_size: int) -> None:
    """A page whose indices run (first, first + 1, ...) is kept as its first index, any other as
    its row: both read back, evict and free alike, side by side in one path."""
    ps = page_size
    handed: list[int] = []
    tree = PageTree(16, ps, on_evict=lambda values: handed.extend(values.tolist()))
    run_page = np.arange(2 * ps, 3 * ps, dtype=np.int64)
    reversed_page = np.arange(3 * ps, 4 * ps, dtype=np.int64)[::-1]
    gap = np.arange(4 * ps, 5 * ps, dtype=np.int64)
    gap[-1] += 1  # one index skipped: not a run
    top = np.iinfo(np.int64).max
    last = np.arange(top - ps + 1, top + 1, dtype=np.int64) if ps > 1 else np.array([top], dtype=np.int64)
    values = np.concatenate([run_page, reversed_page, gap, last])
    assert tree.insert(list(range(4 * ps)), 4 * ps, values)[0] == 0
    # The first page and the last (ending at the int64 limit) run; with one token a page, every page.
    assert tree.run_pages == (4 if ps == 1 else 2)
    node = tree.match(list(range(4 * ps)), 4 * ps)
    assert tree.values(node).tolist() == values.tolist()
    assert tree.values(tree.match(list(range(2 * ps)), 2 * ps)).tolist() == values[: 2 * ps].tolist()
    assert sorted(tree.all_values().tolist()) == sorted(values.tolist())
    assert tree.evict(4) == 4 and sorted(handed) == sorted(values.tolist())  # every page, as stored
    assert tree.run_pages == 0
    tree.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4, 16, 17])
def test_eviction_into_a_pool_frees_the_first_indexs_page_in_either_form(page_size: int) -> None:
    ps = page_size
    pool = BlockPool(8)
    tree = PageTree(8, ps)
    assert pool.allocate(8).tolist() == list(range(8))
    backwards = np.arange(6 * ps, 7 * ps, dtype=np.int64)[::-1]  # first index on page 6 (or 7 when ps > 1)
    tree.insert([7] * (2 * ps), 2 * ps, np.concatenate([np.arange(4 * ps, 5 * ps), backwards]))
    assert tree.evict(2, pool) == 2
    freed = {int(p) for p in np.flatnonzero(pool.refcounts() == 0)}
    assert freed == {4, int(backwards[0]) // ps}
    pool.check_invariants()
    tree.check_invariants()


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("scattered", [False, True], ids=["runs", "scattered"])
def test_random_traffic_keeps_every_index_cached_or_freed_once(scattered: bool, page_size: int) -> None:
    """Random inserts, matches, locks and evictions: every match reads back the indices its pages
    were cached with, and every index is cached or handed back exactly once."""
    ps = page_size
    rng = np.random.default_rng(7)
    t = Tree(num_pages=12, page_size=ps)
    stored: dict[tuple[int, ...], list[int]] = {}  # a cached page's key prefix -> its indices
    locks: list[tuple[PageNode, int]] = []
    next_index = 0
    runs_seen = 0
    for _ in range(300):
        tokens = rng.integers(0, 3, int(rng.integers(1, 6)) * ps + int(rng.integers(ps))).tolist()
        pages = len(tokens) // ps
        roll = rng.random()
        if roll < 0.4:
            values = np.arange(next_index, next_index + pages * ps, dtype=np.int64)
            if scattered and rng.random() < 0.7:
                values = values[rng.permutation(len(values))]
            cached, _ = t.tree.insert(tokens, len(tokens), values)
            t.freed.extend(values[: cached * ps].tolist())  # the caller's duplicates
            for page in range(cached, pages):
                stored[tuple(tokens[: (page + 1) * ps])] = values[page * ps : (page + 1) * ps].tolist()
            next_index += pages * ps
        elif roll < 0.7:
            read, node = t.match(tokens)
            expected = [i for page in range(node.num_pages) for i in stored[tuple(tokens[: (page + 1) * ps])]]
            assert read == expected
            if node.num_pages and rng.random() < 0.5:
                locks.append((node, t.tree.lock(node)[0]))
        elif roll < 0.85 and locks:
            node, handle = locks.pop(int(rng.integers(len(locks))))
            t.tree.unlock(node, handle)
        else:
            t.tree.evict(int(rng.integers(1, 4)))
        runs_seen = max(runs_seen, t.tree.run_pages)
        t.settled()
    assert runs_seen > 0
    assert sorted(t.freed + t.tree.all_values().tolist()) == list(range(next_index))


def reference_dfs_weight_order(keys: list[tuple[int, tuple[int, ...]]], page_size: int) -> list[int]:
    """SGLang's dfs-weight rule over a plain trie of whole pages (one node per page): subtrees by
    requests held, most first (ties: the earlier request first), each subtree's deeper requests
    before the ones ending at its top."""
    trie: dict[Any, Any] = {"requests": [], "children": {}}
    for index, (namespace, tokens) in enumerate(keys):
        node = trie
        for page in range(len(tokens) // page_size):
            edge = (namespace, tokens[page * page_size : (page + 1) * page_size])
            node = node["children"].setdefault(edge, {"requests": [], "children": {}})
        node["requests"].append(index)

    def weigh(node: dict[str, Any]) -> tuple[int, int]:
        held = [weigh(child) for child in node["children"].values()]
        node["weight"] = len(node["requests"]) + sum(w for w, _ in held)
        node["first"] = min([*node["requests"], *(f for _, f in held)], default=len(keys))
        return node["weight"], node["first"]

    def emit(node: dict[str, Any], out: list[int]) -> None:
        for child in sorted(node["children"].values(), key=lambda c: (-c["weight"], c["first"])):
            emit(child, out)
        out.extend(node["requests"])

    weigh(trie)
    order: list[int] = []
    emit(trie, order)
    return order


def test_dfs_weight_order_goes_heaviest_subtree_first_and_deepest_first() -> None:
    tree = PageTree(64, PS)
    a, b = [1] * 8, [2] * 4
    for key in (a + [3] * 8, a + [4] * 4, b + [5] * 4):
        tree.insert(key, len(key), np.arange(len(key), dtype=np.int64) + 1000 * key[-1])
    queries = [b + [9], a + [3] * 8, a + [4] * 4 + [9], [7] * 4, a + [3] * 4, b + [5] * 4, a + [3] * 8, b + [9]]
    nodes = [tree.match(q, len(q)) for q in queries]
    # a's subtree holds 4 requests (a+3+3 twice, a+3, a+4), b's 3 (b twice, b+5); [7]* matches nothing.
    assert dfs_weight_order(nodes) == [1, 6, 4, 2, 5, 0, 7, 3]
    assert dfs_weight_order([]) == []
    tree.check_invariants()


@pytest.mark.parametrize("seed", range(5))
def test_dfs_weight_order_matches_a_plain_page_trie(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tree = PageTree(512, PS)
    alphabet = [0, 1, 255, 256, 65536, 2**31 - 1]  # ids that differ in their high bytes only, too
    stems = [rng.choice(alphabet, int(rng.integers(1, 6)) * PS).tolist() for _ in range(6)]
    for stem in stems:
        for _ in range(3):
            key = stem + rng.choice(alphabet, int(rng.integers(0, 4)) * PS).tolist()
            namespace = int(rng.integers(0, 2))
            if key and tree.cached_pages + len(key) // PS < 500:
                tree.insert(key, len(key), np.arange(len(key), dtype=np.int64), namespace)
    nodes, keys = [], []
    for _ in range(40):
        query = stems[int(rng.integers(len(stems)))] + rng.choice(alphabet, int(rng.integers(0, 12))).tolist()
        node = tree.match(query, len(query), int(rng.integers(0, 2)))
        nodes.append(node)
        keys.append((node.namespace, tuple(query[: node.num_pages * PS])))
    assert dfs_weight_order(nodes) == reference_dfs_weight_order(keys, PS)
    tree.check_invariants()


# -- the engine boundary ---------------------------------------------------------------------------


def test_importing_the_adapter_loads_neither_sglang_nor_torch() -> None:
    assert_import_loads_none_of("lifecycle.integrations.sglang", "sglang", "torch")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_asking_for_the_cache_without_sglang_names_the_extra() -> None:
    import lifecycle.integrations.sglang as adapter

    with pytest.raises(ImportError, match=r"kv-lifecycle\[sglang\]"):
        adapter.radix_cache_class()
    with pytest.raises(ImportError, match=r"kv-lifecycle\[sglang\]"):
        adapter.LifecyclePagedAllocator  # noqa: B018
    with pytest.raises(AttributeError):
        adapter.Nothing  # noqa: B018


class _Tensor(np.ndarray):
    """What the allocator reads of a CPU torch tensor: ``numel``, ``cpu`` and ``numpy``."""

    def numel(self) -> int:
        return int(self.size)

    def cpu(self) -> _Tensor:
        return self

    def numpy(self) -> npt.NDArray[Any]:
        return np.asarray(self)


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ``LifecyclePagedAllocator`` of 4 pages of 4 slots, over stand-ins for the little of torch
    and of SGLang's allocator module it uses (neither is installed here; the SGLang suite runs the
    real ones)."""

    class BaseTokenToKVPoolAllocator:
        def __init__(self, size: int, page_size: int, dtype: Any, device: Any, kvcache: Any, need_sort: bool) -> None:
            self.size, self.device = size, device

    torch = types.ModuleType("torch")
    torch.device = lambda device: SimpleNamespace(type=str(device))  # type: ignore[attr-defined]
    torch.from_numpy = lambda values: np.asarray(values).view(_Tensor)  # type: ignore[attr-defined]
    modules = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.allocator",
        "sglang.srt.mem_cache.allocator.base", "sglang.srt.mem_cache.allocator.paged", "sglang.srt.utils",
    )}
    modules["sglang.srt.mem_cache.allocator.base"].BaseTokenToKVPoolAllocator = (  # type: ignore[attr-defined]
        BaseTokenToKVPoolAllocator
    )
    modules["sglang.srt.mem_cache.allocator.paged"].alloc_extend_naive = None  # type: ignore[attr-defined]
    modules["sglang.srt.mem_cache.allocator.paged"].alloc_decode_naive = None  # type: ignore[attr-defined]
    modules["sglang.srt.utils"].get_num_new_pages = None  # type: ignore[attr-defined]
    for name, module in {"torch": torch, **modules}.items():
        monkeypatch.setitem(sys.modules, name, module)
    import lifecycle.integrations.sglang as adapter

    return adapter.allocator_class.__wrapped__()(4 * PS, PS, None, "cpu", None)


PADDING: dict[str, Any] = {
    "free_page_ids": lambda a: a.free_page_ids(np.array([0, 2], dtype=np.int64).view(_Tensor)),
    "free": lambda a: a.free(np.arange(PS + 2, dtype=np.int64).view(_Tensor)),
    "free_segment": lambda a: a.free_segment(np.arange(PS, dtype=np.int64).view(_Tensor), start_pos=0),
}


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "in a group"])
@pytest.mark.parametrize("call", sorted(PADDING))
def test_the_allocator_refuses_to_free_the_padding_page_and_changes_nothing(
    allocator: Any, call: str, grouped: bool
) -> None:
    held = allocator.alloc(2 * PS)
    assert allocator.available_size() == 2 * PS
    if grouped:
        allocator.free_group_begin()
    with pytest.raises(InvalidId, match="page 0 is the padding page"):
        PADDING[call](allocator)
    if grouped:
        allocator.free_group_end()
    allocator.check_invariants()
    assert allocator.available_size() == 2 * PS
    allocator.free(held)
    assert allocator.available_size() == allocator.size == 4 * PS
    pages = {index // PS for index in allocator.alloc(4 * PS).tolist()}
    assert pages == {1, 2, 3, 4}  # page 0 is never handed out


def test_errors_are_lifecycle_errors() -> None:
    assert issubclass(SequenceStateError, LifecycleError) and issubclass(InvalidId, LifecycleError)


def test_sglangs_own_radix_cache_tests_pass_against_the_adapter() -> None:
    summary = run_suite("sglang", "suite_sglang.py")
    assert "failed" not in summary and "error" not in summary


def test_a_prioritized_path_outlives_later_inserts_in_a_full_tree() -> None:
    """SGLang's ``priority`` eviction policy: the cache raises an inserted key's pages to the
    request's priority (``retention_priority``), so later default inserts evict around them."""
    from lifecycle.integrations.sglang import retention_priority

    t = Tree(num_pages=8)
    kept = list(range(100, 100 + 3 * PS))
    t.insert(kept, 0)
    assert t.tree.core.retention.prioritize(kept, 0, retention_priority(10)) == 3
    for i in range(6):
        t.insert([1000 * (i + 1) + j for j in range(2 * PS)], 100 + 10 * PS * i)
    assert len(t.match(kept)[0]) == 3 * PS
    t.settled()


def test_sglang_priorities_map_to_retention_around_the_default() -> None:
    from lifecycle.integrations.sglang import retention_priority

    assert [retention_priority(p) for p in (0, 10, -10, 1000, -1000)] == [35, 45, 25, 100, 0]
