"""lifecycle.integrations.sglang's SWA tree (``SWAPageTree``, engine-free, here) and SGLang's own
SWA radix-cache tests against ``LifecycleSWARadixCache`` (in SGLang's peer environment, skipped
without it: ``tests/engine_suites/suite_sglang_swa.py``).

The engine here is a stand-in of SGLang's ``SWATokenToKVPoolAllocator``: full indices, an SWA
index per full index (its ``full_to_swa_index_mapping``), and the three frees; every test ends
with the tree's ``check_invariants`` and a recount of which indices are held.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from engine_suites import run_suite
from lifecycle.errors import ConfigError, InvalidId, SequenceStateError
from lifecycle.integrations.sglang import SWAPageTree


class Engine:
    """Full and SWA indices handed out and freed, as SGLang's SWA allocator does."""

    def __init__(self) -> None:
        self.mapping = np.zeros(4096, np.int64)
        self.next_full = 1
        self.next_swa = 1
        self.live_full: set[int] = set()
        self.live_swa: set[int] = set()

    def alloc(self, n: int) -> npt.NDArray[np.int64]:
        full = np.arange(self.next_full, self.next_full + n, dtype=np.int64)
        self.next_full += n
        self.mapping[full] = np.arange(self.next_swa, self.next_swa + n)
        self.next_swa += n
        self.live_full.update(full.tolist())
        self.live_swa.update(self.mapping[full].tolist())
        return full

    def free(self, full: npt.NDArray[np.int64]) -> None:
        self.free_swa(full)
        self.free_full(full)

    def free_swa(self, full: npt.NDArray[np.int64]) -> None:
        assert (self.mapping[full] > 0).all(), f"SWA KV of {full} freed twice"
        self.live_swa.difference_update(self.mapping[full].tolist())
        self.mapping[full] = 0

    def free_full(self, full: npt.NDArray[np.int64]) -> None:
        assert (self.mapping[full] == 0).all(), f"full KV of {full} freed with its SWA KV live"
        assert set(full.tolist()) <= self.live_full, f"full KV of {full} freed twice"
        self.live_full.difference_update(full.tolist())

    def move_swa(self, source: npt.NDArray[np.int64], dest: npt.NDArray[np.int64]) -> None:
        self.mapping[dest] = self.mapping[source]
        self.mapping[source] = 0


def tree(
    num_pages: int = 64, num_swa_pages: int = 32, page_size: int = 1, window: int = 4
) -> tuple[SWAPageTree, Engine]:
    engine = Engine()
    return SWAPageTree(num_pages, num_swa_pages, page_size, window, engine), engine


def insert(t: SWAPageTree, e: Engine, tokens: list[int], swa_evicted: int = 0) -> tuple[int, list[int]]:
    values = e.alloc(len(tokens))
    if swa_evicted:
        e.free_swa(values[:swa_evicted])
    cached, node = t.insert(tokens, len(tokens), values, 0, swa_evicted)
    tail = values[len(tokens) // t.page_size * t.page_size:]
    if len(tail):  # a partial page is never cached: still the caller's
        e.free(tail)
    if cached:  # the caller's duplicates are its own to free
        head = values[: cached * t.page_size]
        below = min(swa_evicted, len(head))
        if below:
            e.free_full(head[:below])
        if len(head) > below:
            e.free(head[below:])
    return cached * t.page_size, t.values(node).tolist()


def matched(t: SWAPageTree, tokens: list[int]) -> list[int]:
    return [int(v) for v in t.values(t.match(tokens, len(tokens)))]


def settled(t: SWAPageTree, e: Engine) -> None:
    """The tree's recount; the engine's live KV is exactly what the tree caches."""
    t.check_invariants()
    assert len(e.live_full) == t.cached_pages * t.page_size
    assert len(e.live_swa) == t.cached_swa_pages * t.page_size


def test_a_match_ends_where_its_last_window_has_swa_kv() -> None:
    t, e = tree()
    _, path = insert(t, e, [1, 2, 3, 4, 5, 6, 7])
    assert matched(t, [1, 2, 3, 4, 5, 6, 7, 8]) == path
    assert matched(t, [1, 2, 3, 9]) == path[:3]
    settled(t, e)


def test_an_insert_reports_the_tokens_cached_before_it() -> None:
    t, e = tree()
    assert insert(t, e, [1, 2, 3])[0] == 0
    assert insert(t, e, [1, 2, 3, 4, 5, 6, 7])[0] == 3
    assert insert(t, e, [10, 11, 12])[0] == 0
    assert insert(t, e, [1, 2, 3, 4, 5, 60, 70])[0] == 5
    settled(t, e)


def test_swa_kv_freed_by_the_request_is_a_tombstone_and_cuts_matches_back() -> None:
    t, e = tree()
    _, path = insert(t, e, list(range(1, 13)), swa_evicted=6)
    assert matched(t, list(range(1, 13))) == path  # its last window (tokens 9..12) is there
    assert matched(t, list(range(1, 9))) == []  # the window before token 9 lost its SWA KV
    assert t.cached_swa_pages == 6
    settled(t, e)


def test_full_eviction_hands_full_and_swa_kv_back() -> None:
    t, e = tree()
    insert(t, e, [1, 2, 3, 4, 5])
    insert(t, e, [7, 8, 9])
    full, swa = t.evict(100, 100)
    assert (full, swa) == (8, 8)
    assert e.live_full == set() and e.live_swa == set()
    assert t.cached_pages == 0
    settled(t, e)


def test_a_lock_keeps_the_full_path_and_the_last_window() -> None:
    t, e = tree()
    insert(t, e, list(range(1, 11)))
    handle, full, swa = t.lock(t.match(list(range(1, 11)), 10))
    assert (full, swa) == (10, 4)
    t.evict(100, 100)
    assert len(matched(t, list(range(1, 11)))) == 10
    assert t.unlock(handle) == (10, 4)
    assert t.protected_pages == 0 and t.protected_swa_pages == 0
    settled(t, e)


def test_an_unlock_without_a_lock_is_refused_by_name() -> None:
    t, _ = tree()
    with pytest.raises(SequenceStateError, match="lock 7 is not held"):
        t.unlock(7)


def test_a_full_swa_pool_evicts_to_make_room_for_an_insert() -> None:
    t, e = tree(num_pages=64, num_swa_pages=8)
    insert(t, e, [1, 2, 3, 4, 5, 6])
    _, path = insert(t, e, [9, 9, 9, 9, 9, 9])
    assert matched(t, [9, 9, 9, 9, 9, 9, 0]) == path
    assert set(e.mapping[np.array(path)].tolist()) <= e.live_swa
    assert len(e.live_swa) == t.cached_swa_pages <= 8  # the rest of the first key's went
    settled(t, e)


def test_pages_hold_whole_pages_only() -> None:
    t, e = tree(page_size=4, window=4)
    _, path = insert(t, e, list(range(1, 11)))
    assert len(path) == 8
    assert matched(t, list(range(1, 11))) == path
    settled(t, e)


@pytest.mark.parametrize("bad", [{"window": 0}, {"page_size": 0}, {"num_swa_pages": 0}])
def test_bad_sizes_are_refused_by_name(bad: dict[str, int]) -> None:
    name = next(iter(bad))
    with pytest.raises(ConfigError, match=name):
        tree(**bad)


def test_a_negative_token_or_too_few_indices_are_refused() -> None:
    t, e = tree()
    with pytest.raises(InvalidId, match="token id -1"):
        t.insert([1, -1, 3], 3, e.alloc(3))
    with pytest.raises(InvalidId, match="2 KV indices"):
        t.insert([1, 2, 3], 3, e.alloc(2))
    assert t.cached_pages == 0
    t.check_invariants()


def test_random_traffic_hands_every_index_back_once() -> None:
    rng = np.random.default_rng(7)
    t, e = tree(num_pages=48, num_swa_pages=24, page_size=2, window=4)
    for _ in range(200):
        tokens = rng.integers(0, 3, size=int(rng.integers(2, 12))).tolist()
        if rng.random() < 0.6:
            insert(t, e, tokens, swa_evicted=int(rng.integers(0, 2)) * 2 * (len(tokens) >= 8))
        elif rng.random() < 0.5:
            t.evict(int(rng.integers(0, 4)), int(rng.integers(0, 4)))
        else:
            node = t.match(tokens, len(tokens))
            if node.num_pages:
                t.unlock(t.lock(node)[0])
        t.check_invariants()
    t.evict(1000, 1000)
    assert e.live_full == set() and e.live_swa == set()
    t.check_invariants()


def test_sglangs_own_swa_radix_cache_tests_pass_against_the_adapter() -> None:
    assert "passed" in run_suite("sglang", "suite_sglang_swa.py")


def test_swa_kv_freed_up_to_the_last_window_is_released_too() -> None:
    # 12 tokens, SWA KV freed below 8: the window of 4 before the end is all the key keeps.
    t, e = tree()
    _, path = insert(t, e, list(range(1, 13)), swa_evicted=8)
    assert matched(t, list(range(1, 13))) == path
    assert t.cached_swa_pages == 4
    settled(t, e)


def test_a_freed_length_inside_the_last_window_caches_nothing_past_the_cached_part() -> None:
    t, e = tree()
    insert(t, e, [1, 2, 3, 4, 5, 6])
    cached, path = insert(t, e, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], swa_evicted=8)
    assert (cached, path) == (6, matched(t, [1, 2, 3, 4, 5, 6, 0]))
    # Tokens 7..10 stay the caller's (it frees them); the tree kept the first key's six.
    assert (t.cached_pages, t.cached_swa_pages) == (6, 6)
    t.check_invariants()


def test_swa_eviction_tombstones_swa_kv_and_keeps_the_full_kv() -> None:
    t, e = tree()
    insert(t, e, list(range(1, 13)))
    full, swa = t.evict(0, 3)
    assert (full, swa) == (0, 3) and t.cached_pages == 12 and t.cached_swa_pages == 9
    assert len(matched(t, list(range(1, 13)))) == 12  # its last window kept its SWA KV
    settled(t, e)
