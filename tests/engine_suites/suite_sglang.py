"""SGLang's own radix-cache unit tests, ported, run against SGLang's ``RadixCache`` and
lifecycle's ``LifecycleRadixCache`` alike (each test is parametrized over both: a test that the
engine's own cache fails is a wrong port, not a finding).

Source: ``test/registered/radix_cache/test_radix_cache_unit.py`` of sgl-project/sglang (commit
341ffe19c346fd8dbf184b2e19e5d5c996a0496d; SGLang is Apache License 2.0, Copyright 2023-2024 SGLang
Team), re-expressed for the interface of the SGLang installed beside it (0.5.23: ``InsertParams``
/ ``MatchPrefixParams`` / ``EvictParams``, ``device_prefix_len`` and ``path_device_indices``,
``checkpoint`` in place of ``cache_finished_req``), plus the request path and the allocator that
those tests reach only through a server. ``docs/integrations.md`` lists each source test and what
became of it.

Run inside the SGLang peer environment by ``tests/test_integration_sglang.py`` (not collected by
the project's own run: its name does not start with ``test_``).
"""

from __future__ import annotations

import importlib
import random
import re
import sys
import unittest.mock
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
# sglang's config package imports torchvision (multimodal models), whose CUDA-linked wheels cannot
# load beside CPU-only torch; neither the radix cache nor the allocators use it (bench/peer_common.py).
importlib.import_module("peer_common").stub_torchvision()

import torch  # noqa: E402

from lifecycle.errors import DoubleFree, LifecycleError, SequenceStateError  # noqa: E402
from lifecycle.integrations.sglang import allocator_class, radix_cache_class  # noqa: E402
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402

LifecycleRadixCache = radix_cache_class()
LifecyclePagedAllocator = allocator_class()

IMPLEMENTATIONS = {"sglang": RadixCache, "lifecycle": LifecycleRadixCache}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> Iterator[type[Any]]:
    """The cache class under test; lifecycle's is checked for leaks and invariants afterwards."""
    made: list[Any] = []
    cls = IMPLEMENTATIONS[request.param]
    original = cls.__init__

    def tracking_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    with unittest.mock.patch.object(cls, "__init__", tracking_init):
        yield cls
    for cache in made:
        if hasattr(cache, "check_invariants"):
            cache.check_invariants()


def key(tokens: list[int], extra_key: str | None = None) -> Any:
    return RadixKey(array("q", tokens), extra_key)


def values(*items: int) -> torch.Tensor:
    return torch.tensor(items, dtype=torch.int64)


def insert(cache: Any, tokens: list[int], value: torch.Tensor | None = None, extra_key: str | None = None) -> Any:
    return cache.insert(InsertParams(key=key(tokens, extra_key), value=value))


def match(cache: Any, tokens: list[int], extra_key: str | None = None) -> tuple[int, list[int], Any]:
    """(matched tokens, their KV indices, the node) of a lookup."""
    result = cache.match_prefix(MatchPrefixParams(key=key(tokens, extra_key)))
    node = result.last_device_node
    return result.device_prefix_len, cache.path_device_indices(node).tolist(), node


def mock_allocator() -> Any:
    allocator = unittest.mock.Mock()
    allocator.device = torch.device("cpu")
    return allocator


def freed_by(allocator: Any) -> list[int]:
    """Every KV index the cache handed back to a mock allocator, in any free call."""
    out: list[int] = []
    for call in allocator.free_segment.call_args_list + allocator.free.call_args_list:
        out += call.args[0].tolist()
    return sorted(out)


# -- TestRadixCache ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("page_size", "disable", "events"), [(1, False, False), (4, False, True), (1, True, False)])
def test_init_variations(impl: type[Any], page_size: int, disable: bool, events: bool) -> None:
    cache = impl.create_simulated(disable=disable, page_size=page_size, enable_kv_cache_events=events)
    assert cache.page_size == page_size
    assert cache.disable == disable
    assert cache.device == torch.device("cpu")
    assert cache.root_node is not None
    assert cache.total_size() == 0


def test_reset(impl: type[Any]) -> None:
    cache = impl.create_simulated()
    insert(cache, [1, 2, 3], values(10, 20, 30))
    assert cache.total_size() > 0
    cache.reset()
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    assert match(cache, [1, 2, 3])[0] == 0


@pytest.mark.parametrize("disable", [False, True])
def test_insert_and_match_basic(impl: type[Any], disable: bool) -> None:
    cache = impl.create_simulated(disable=disable)
    assert insert(cache, [1, 2, 3], values(10, 20, 30)).prefix_len == 0
    if disable:
        assert cache.total_size() == 0
        assert match(cache, [1, 2, 3])[0] == 0
        return
    assert cache.total_size() == 3
    assert cache.evictable_size() == 3
    assert match(cache, [1, 2, 3])[:2] == (3, [10, 20, 30])
    assert match(cache, [1, 2])[:2] == (2, [10, 20])


def test_insert_with_none_value(impl: type[Any]) -> None:
    cache = impl.create_simulated()
    assert insert(cache, [1, 2, 3]).prefix_len == 0
    assert cache.total_size() == 3
    assert match(cache, [1, 2, 3])[:2] == (3, [1, 2, 3])  # the tokens themselves stand in for indices


def test_total_size(impl: type[Any]) -> None:
    cache = impl.create_simulated()
    assert cache.total_size() == 0
    insert(cache, [1, 2, 3], values(10, 20, 30))
    assert cache.total_size() == 3
    insert(cache, [4, 5], values(40, 50))
    assert cache.total_size() == 5


def test_insert_reports_the_cached_prefix_and_keeps_the_first_indices(impl: type[Any]) -> None:
    cache = impl.create_simulated()
    insert(cache, [1, 2, 3], values(10, 20, 30))
    assert insert(cache, [1, 2, 3, 4], values(11, 21, 31, 41)).prefix_len == 3
    assert match(cache, [1, 2, 3, 4])[:2] == (4, [10, 20, 30, 41])


@pytest.mark.parametrize(("page_size", "events"), [(1, True), (2, True), (1, False)])
def test_kv_cache_events(impl: type[Any], page_size: int, events: bool) -> None:
    cache = impl.create_simulated(page_size=page_size, enable_kv_cache_events=events)
    insert(cache, [1, 2, 3, 4, 5])
    taken = cache.take_events()
    if not events:
        assert taken == []
        return
    stored = [event for event in taken if isinstance(event, BlockStored)]
    assert stored
    assert all(event.block_size == page_size for event in stored)
    # The stored pages, in order, are the key's whole pages (SGLang coalesces a chain into one event).
    assert [token for event in stored for token in event.token_ids] == [1, 2, 3, 4, 5][: 5 // page_size * page_size]
    assert sum(len(event.block_hashes) for event in stored) == 5 // page_size


def test_kv_cache_events_with_eviction(impl: type[Any]) -> None:
    cache = impl.create_simulated(mock_allocator=mock_allocator(), enable_kv_cache_events=True)
    insert(cache, [1, 2, 3], values(10, 20, 30))
    cache.evict(EvictParams(num_tokens=3))
    taken = cache.take_events()
    stored = {h for event in taken if isinstance(event, BlockStored) for h in event.block_hashes}
    removed = {h for event in taken if isinstance(event, BlockRemoved) for h in event.block_hashes}
    assert stored and removed == stored


def test_kv_cache_events_on_reset(impl: type[Any]) -> None:
    cache = impl.create_simulated(enable_kv_cache_events=True)
    insert(cache, [1, 2, 3], values(10, 20, 30))
    cache.take_events()
    cache.reset()
    assert any(isinstance(event, AllBlocksCleared) for event in cache.take_events())


def test_extra_key_isolation(impl: type[Any]) -> None:
    cache = impl.create_simulated()
    insert(cache, [1, 2, 3], values(10, 20, 30), "key1")
    insert(cache, [1, 2, 3], values(40, 50, 60), "key2")
    insert(cache, [1, 2, 3], values(70, 80, 90))
    assert match(cache, [1, 2, 3], "key1")[:2] == (3, [10, 20, 30])
    assert match(cache, [1, 2, 3], "key2")[:2] == (3, [40, 50, 60])
    assert match(cache, [1, 2, 3])[:2] == (3, [70, 80, 90])
    assert match(cache, [1, 2, 3], "nonexistent")[0] == 0


def test_lock_ref_operations(impl: type[Any]) -> None:
    cache = impl.create_simulated()
    insert(cache, [1, 2, 3], values(10, 20, 30))
    node = match(cache, [1, 2, 3])[2]
    evictable, protected = cache.evictable_size(), cache.protected_size()
    assert cache.inc_lock_ref(node).delta == -3
    assert (cache.protected_size(), cache.evictable_size()) == (protected + 3, evictable - 3)
    assert cache.dec_lock_ref(node).delta == 3
    assert (cache.protected_size(), cache.evictable_size()) == (protected, evictable)


def test_a_locked_path_is_not_evicted(impl: type[Any]) -> None:
    allocator = mock_allocator()
    cache = impl.create_simulated(mock_allocator=allocator)
    insert(cache, [1, 2, 3], values(10, 20, 30))
    insert(cache, [7, 8], values(70, 80))
    node = match(cache, [1, 2, 3])[2]
    lock = cache.lock(node)
    cache.evict(EvictParams(num_tokens=100))
    assert freed_by(allocator) == [70, 80]
    assert match(cache, [1, 2, 3])[:2] == (3, [10, 20, 30])
    cache.unlock(lock)
    cache.evict(EvictParams(num_tokens=100))
    assert freed_by(allocator) == [10, 20, 30, 70, 80]
    assert cache.total_size() == 0


def test_lock_receipts_release_the_lock_they_took(impl: type[Any]) -> None:
    cache = impl.create_simulated()
    insert(cache, [1, 2, 3, 4], values(10, 20, 30, 40))
    short = match(cache, [1, 2])[2]
    long = match(cache, [1, 2, 3, 4])[2]
    first, second = cache.lock(long), cache.lock(short)
    assert cache.protected_size() == 4
    cache.unlock(first)
    assert (cache.protected_size(), cache.evictable_size()) == (2, 2)
    cache.unlock(second)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)


def test_evict_functionality(impl: type[Any]) -> None:
    allocator = mock_allocator()
    cache = impl.create_simulated(mock_allocator=allocator)
    insert(cache, [1, 2], values(10, 20))
    insert(cache, [3, 4], values(30, 40))
    initial = cache.total_size()
    evicted = cache.evict(EvictParams(num_tokens=2)).num_tokens_evicted
    assert evicted >= 2
    assert cache.total_size() == initial - evicted
    assert len(freed_by(allocator)) == evicted


def test_evicting_more_than_is_cached_empties_the_cache(impl: type[Any]) -> None:
    allocator = mock_allocator()
    cache = impl.create_simulated(mock_allocator=allocator)
    insert(cache, [1, 2, 3], values(10, 20, 30))
    insert(cache, [1, 2, 9], values(11, 21, 91))
    assert cache.evict(EvictParams(num_tokens=1000)).num_tokens_evicted == 4
    assert (cache.total_size(), cache.evictable_size()) == (0, 0)
    assert freed_by(allocator) == [10, 20, 30, 91]


def test_least_recently_used_goes_first(impl: type[Any]) -> None:
    allocator = mock_allocator()
    cache = impl.create_simulated(mock_allocator=allocator)
    insert(cache, [1, 1], values(10, 11))
    insert(cache, [2, 2], values(20, 21))
    insert(cache, [3, 3], values(30, 31))
    match(cache, [1, 1])  # now the most recently used
    cache.evict(EvictParams(num_tokens=4))
    assert match(cache, [1, 1])[0] == 2
    assert freed_by(allocator) == [20, 21, 30, 31]


@pytest.mark.parametrize(("page_size", "length"), [(1, 5), (2, 5), (4, 6)])
def test_page_alignment_boundary(impl: type[Any], page_size: int, length: int) -> None:
    cache = impl.create_simulated(page_size=page_size)
    tokens = list(range(length))
    insert(cache, tokens, torch.tensor(tokens, dtype=torch.int64))
    matched, indices, _ = match(cache, tokens)
    assert matched == length // page_size * page_size > 0
    assert indices == tokens[:matched]


def test_pretty_print_basic(impl: type[Any], capsys: pytest.CaptureFixture[str]) -> None:
    cache = impl.create_simulated()
    insert(cache, [1, 2, 3], values(10, 20, 30))
    cache.pretty_print()
    assert capsys.readouterr().out


def test_all_values_flatten(impl: type[Any]) -> None:
    cache = impl.create_simulated()
    insert(cache, [1, 2], values(10, 20))
    insert(cache, [3, 4], values(30, 40))
    assert sorted(cache.all_values_flatten().tolist()) == [10, 20, 30, 40]


@pytest.mark.parametrize("page_size", [1, 2])
def test_advanced_prefix_match_with_node_splits(impl: type[Any], page_size: int) -> None:
    cache = impl.create_simulated(page_size=page_size)
    seq1 = [1, 2, 3, 4, 5, 6, 7, 8]
    val1 = [x * 10 for x in seq1]
    insert(cache, seq1, values(*val1))
    seq2 = [1, 2, 9, 10]
    val2 = [x * 10 for x in seq2]
    insert(cache, seq2, values(*val2))
    assert cache.total_size() == 10
    assert match(cache, [1, 2, 3, 4, 999, 1000])[1] == val1[:4]
    assert cache.total_size() == 10  # a match that splits a node changes no data
    assert match(cache, seq1)[1] == val1
    assert match(cache, [1, 2, 3, 4, 5, 6, 777, 888])[1] == val1[:6]
    assert match(cache, seq2)[1] == val2


def test_hash_value_repeating_tokens(impl: type[Any]) -> None:
    cache = impl.create_simulated(page_size=4, enable_kv_cache_events=True)
    insert(cache, [1, 2, 3, 4, 1, 2, 3, 4])
    stored = [event for event in cache.take_events() if isinstance(event, BlockStored)]
    hashes = [h for event in stored for h in event.block_hashes]
    assert len(hashes) == 2 and hashes[0] != hashes[1]  # the hash covers the position, not only the page
    assert stored[0].parent_block_hash is None


def test_hash_value_split(impl: type[Any]) -> None:
    cache = impl.create_simulated(page_size=2, enable_kv_cache_events=True)
    insert(cache, [1, 2, 3, 4])
    first = [h for event in cache.take_events() if isinstance(event, BlockStored) for h in event.block_hashes]
    insert(cache, [1, 2, 5, 6])
    [event] = [event for event in cache.take_events() if isinstance(event, BlockStored)]
    assert event.token_ids == [5, 6]
    assert event.parent_block_hash == first[0]  # the split node's page keeps its hash


# -- a differential run: the same random traffic through both caches gives the same answers ----------


@pytest.mark.parametrize("page_size", [1, 3])
def test_random_traffic_matches_sglang_until_the_first_eviction(page_size: int) -> None:
    rng = random.Random(page_size)
    ours = LifecycleRadixCache.create_simulated(page_size=page_size)
    theirs = RadixCache.create_simulated(page_size=page_size)
    next_index = 1000
    locks: list[tuple[Any, Any]] = []
    for _ in range(400):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        action = rng.random()
        if action < 0.45:
            value = torch.arange(next_index, next_index + len(tokens), dtype=torch.int64)
            next_index += len(tokens)
            assert insert(ours, tokens, value).prefix_len == insert(theirs, tokens, value).prefix_len
        elif action < 0.8:
            mine, their = match(ours, tokens), match(theirs, tokens)
            assert mine[:2] == their[:2], tokens
            if mine[0] and rng.random() < 0.5:
                locks.append((ours.lock(mine[2]), theirs.lock(their[2])))
        elif locks:
            mine_lock, their_lock = locks.pop(rng.randrange(len(locks)))
            ours.unlock(mine_lock)
            theirs.unlock(their_lock)
        assert (ours.total_size(), ours.evictable_size(), ours.protected_size()) == (
            theirs.total_size(), theirs.evictable_size(), theirs.protected_size()
        )
        ours.check_invariants()


# -- the request path: checkpoint, then release ---------------------------------------------------------


class Kv:
    """What ``checkpoint`` and ``free_kv_row`` read of a request's KV record (SGLang's
    ``ReqKvInfo`` lives in the scheduler module, which needs the server's dependencies)."""

    def __init__(self, req_pool_idx: int) -> None:
        self.req_pool_idx = req_pool_idx
        self.cache_protected_len = 0
        self.cache_inserted_len = 0
        self.swa_evict_floor = 0

    def get_evicted_seqlen(self, component_type: ComponentType) -> int:
        return 0

    def swa_dead_lo(self, page_size: int) -> int:
        return self.cache_protected_len


class Request:
    """The fields of SGLang's ``Req`` that the cache reads."""

    def __init__(self, row: int, tokens: list[int]) -> None:
        self.kv = Kv(row)
        self.full_untruncated_fill_ids = array("q", tokens)
        self.origin_input_ids = array("q", tokens)
        self.extra_key: str | None = None
        self.cache_salt: str | None = None
        self.priority = 0
        self.lock: Any = None
        self.last_node: Any = None


ALLOCATORS: dict[str, Callable[[int, int], Any]] = {
    "sglang": lambda size, ps: (PagedTokenToKVPoolAllocator if ps > 1 else _token_allocator)(
        size, ps, torch.float16, "cpu", None, need_sort=False
    ),
    "lifecycle": lambda size, ps: LifecyclePagedAllocator(size, ps, torch.float16, "cpu", None, need_sort=False),
}


def _token_allocator(size: int, page_size: int, dtype: Any, device: str, kvcache: Any, need_sort: bool) -> Any:
    return TokenToKVPoolAllocator(size, dtype, device, kvcache, need_sort)


def serve(cache: Any, allocator: Any, pool: Any, row: int, tokens: list[int]) -> int:
    """One request as SGLang's scheduler runs it: match (all but the last token), lock, allocate
    the rest, write the row, then release it with a checkpoint. Returns the matched tokens."""
    ps = allocator.page_size
    req = Request(row, tokens)
    result = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), limit=len(tokens) - 1)))
    req.last_node = result.last_device_node
    req.lock = cache.lock(req.last_node)
    matched = result.device_prefix_len
    prefix = cache.path_device_indices(req.last_node)[:matched]
    need = len(tokens) - matched
    if allocator.available_size() < -(-need // ps) * ps:
        cache.evict(EvictParams(num_tokens=-(-need // ps) * ps - allocator.available_size()))
    new = allocator.alloc(-(-need // ps) * ps)
    assert new is not None
    pool.write((row, slice(0, len(tokens))), torch.cat([prefix, new])[: len(tokens)])
    req.kv.cache_protected_len = matched
    cache.checkpoint(req, up_to=len(tokens))
    # What release_kv_cache does after the checkpoint: free the row past the cache's part, unlock.
    # (The last page's unused slots go with it: nothing is over-allocated past that page.)
    cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, len(tokens))])
    cache.unlock(req.lock)
    return int(matched)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("allocator_kind", sorted(ALLOCATORS))
def test_requests_served_through_checkpoint_share_prefixes_and_leak_nothing(
    impl: type[Any], allocator_kind: str, page_size: int
) -> None:
    pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    allocator = ALLOCATORS[allocator_kind](64 * page_size, page_size)
    cache = impl(CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=page_size
    ))
    capacity = allocator.available_size()
    system = list(range(1, 21))
    assert serve(cache, allocator, pool, 1, system + [50, 51, 52]) == 0
    assert serve(cache, allocator, pool, 2, system + [60, 61]) == 20 // page_size * page_size
    assert serve(cache, allocator, pool, 1, system + [50, 51, 52, 53]) == 23 // page_size * page_size
    assert cache.protected_size() == 0
    # Every index is free or cached; evicting everything gives them all back.
    assert allocator.available_size() + cache.total_size() == capacity
    cache.evict(EvictParams(num_tokens=capacity))
    assert (allocator.available_size(), cache.total_size()) == (capacity, 0)


def test_requests_evict_under_pressure_and_still_leak_nothing(impl: type[Any]) -> None:
    page_size = 2
    pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    allocator = ALLOCATORS["lifecycle"](24 * page_size, page_size)
    cache = impl(CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=page_size
    ))
    capacity = allocator.available_size()
    rng = random.Random(5)
    for i in range(60):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(4, 30))]
        serve(cache, allocator, pool, 1 + i % 3, tokens)
        assert allocator.available_size() + cache.total_size() == capacity
        allocator.check_invariants()


# -- the allocator --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
def test_the_allocator_hands_out_whole_pages_never_page_zero_and_none_when_short(kind: str) -> None:
    allocator = ALLOCATORS[kind](8 * 4, 4)
    assert allocator.available_size() == 32
    first = allocator.alloc(12)
    assert first is not None and len(first) == 12
    pages = {index // 4 for index in first.tolist()}
    assert len(pages) == 3 and 0 not in pages
    assert all(first[i].item() % 4 == i % 4 for i in range(12))
    assert allocator.alloc(24) is None and allocator.available_size() == 20
    allocator.free(first)
    assert allocator.available_size() == 32


def test_the_allocator_refuses_a_double_free_and_changes_nothing() -> None:
    allocator = ALLOCATORS["lifecycle"](8 * 4, 4)
    held = allocator.alloc(8)
    allocator.free(held)
    with pytest.raises(DoubleFree):
        allocator.free(held)
    assert allocator.available_size() == 32
    allocator.check_invariants()


def test_the_allocator_refuses_to_free_the_padding_page_and_changes_nothing() -> None:
    allocator = ALLOCATORS["lifecycle"](4 * 4, 4)
    held = allocator.alloc(8)
    with pytest.raises(LifecycleError, match="padding page"):
        allocator.free_page_ids(torch.tensor([0, 2], dtype=torch.int64))
    with pytest.raises(LifecycleError, match="padding page"):
        allocator.free(torch.arange(6, dtype=torch.int64))  # page 0's slots and two of page 1's
    assert allocator.available_size() == 8
    allocator.free(held)
    assert allocator.available_size() == 16
    allocator.check_invariants()


def test_the_allocator_batches_frees_in_a_group() -> None:
    allocator = ALLOCATORS["lifecycle"](8 * 4, 4)
    a, b = allocator.alloc(4), allocator.alloc(8)
    allocator.free_group_begin()
    allocator.free(a)
    allocator.free_segment(b, start_pos=0)
    assert allocator.available_size() == 20
    allocator.free_group_end()
    assert allocator.available_size() == 32


@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
def test_a_page_freed_in_two_calls_of_one_group_is_freed_once(kind: str) -> None:
    allocator = ALLOCATORS[kind](8 * 4, 4)
    a = allocator.alloc(8)
    allocator.free_group_begin()
    allocator.free(a[:2])  # two slots of the first page
    allocator.free(a[2:])  # the rest of it, and the second page
    allocator.free_group_end()
    assert allocator.available_size() == 32


@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
def test_alloc_extend_continues_partial_pages_then_takes_new_ones(kind: str) -> None:
    allocator = ALLOCATORS[kind](16 * 4, 4)
    first = allocator.alloc(8)  # a page for each of two requests' prefixes
    assert first is not None
    last_loc = torch.tensor([first[2].item(), first[7].item()])  # prefixes of 3 and 4 tokens
    prefix_lens = torch.tensor([3, 4])
    seq_lens = torch.tensor([9, 6])
    out = allocator.alloc_extend(prefix_lens, prefix_lens, seq_lens, seq_lens, last_loc, 8)
    assert out is not None and len(out) == 8
    assert out[0].item() == first[3].item()  # fills the rest of the first request's page
    new_pages = {index // 4 for index in out.tolist()} - {index // 4 for index in first.tolist()}
    assert len(new_pages) == 3  # 5 more tokens of request 0 (2 pages), 2 of request 1 (1 page)
    assert allocator.available_size() == (16 - 2 - 3) * 4


def test_a_lock_on_an_evicted_path_is_refused_by_name() -> None:
    cache = LifecycleRadixCache.create_simulated(mock_allocator=mock_allocator())
    insert(cache, [1, 2, 3], values(10, 20, 30))
    node = match(cache, [1, 2, 3])[2]
    cache.evict(EvictParams(num_tokens=3))
    with pytest.raises(SequenceStateError, match="evicted"):
        cache.inc_lock_ref(node)
    cache.check_invariants()


def test_an_unlock_without_a_lock_is_refused_by_name() -> None:
    cache = LifecycleRadixCache.create_simulated()
    insert(cache, [1, 2, 3], values(10, 20, 30))
    node = match(cache, [1, 2, 3])[2]
    with pytest.raises(LifecycleError, match="no lock"):
        cache.dec_lock_ref(node)
    cache.check_invariants()


@pytest.mark.parametrize(
    ("option", "match_text"),
    [
        ({"sliding_window_size": 4096}, "sliding_window_size=4096"),
        ({"tree_components": (ComponentType.FULL, ComponentType.MAMBA)}, "tree_components"),
        ({"tree_components": (ComponentType.FULL, ComponentType.SWA)}, "tree_components"),
        ({"enable_mamba_extra_buffer": True}, "enable_mamba_extra_buffer"),
        ({"eviction_policy": "lfu"}, "eviction_policy='lfu'"),
        ({"is_eagle": True}, "EAGLE"),
    ],
)
def test_trees_it_cannot_hold_are_refused_at_construction_by_name(option: dict[str, Any], match_text: str) -> None:
    with pytest.raises(LifecycleError, match=re.escape(match_text)):
        LifecycleRadixCache.create_simulated(**option)


def test_a_full_attention_tree_component_is_accepted() -> None:
    cache = LifecycleRadixCache.create_simulated(tree_components=(ComponentType.FULL,))
    insert(cache, [1, 2, 3], values(10, 20, 30))
    assert match(cache, [1, 2, 3])[0] == 3
    cache.check_invariants()


@pytest.mark.parametrize(
    "make_value",
    [
        lambda v: torch.tensor(v, dtype=torch.int64),
        lambda v: torch.tensor(v, dtype=torch.int32),  # converted
        lambda v: torch.tensor([v, v], dtype=torch.int64).t()[:, 0],  # strided: converted
        lambda v: torch.tensor([0, *v], dtype=torch.int64)[1:],  # an offset view: read in place
    ],
)
def test_insert_takes_the_indices_in_any_tensor_layout(impl: type[Any], make_value: Any) -> None:
    cache = impl.create_simulated(mock_allocator=mock_allocator(), page_size=2)
    indices = [10, 11, 20, 21, 30, 31]
    insert(cache, [1, 2, 3, 4, 5, 6], make_value(indices))
    assert match(cache, [1, 2, 3, 4, 5, 6])[:2] == (6, indices)


@pytest.mark.parametrize("container", [list, lambda tokens: array("q", tokens), lambda tokens: array("l", tokens)])
def test_keys_of_lists_and_arrays_match_alike(impl: type[Any], container: Any) -> None:
    cache = impl.create_simulated(mock_allocator=mock_allocator(), page_size=2)
    # SGLang's keys are lists in its scheduler, arrays in its tests (one kind per cache).
    cache.insert(InsertParams(key=RadixKey(container([1, 2, 3, 4])), value=values(5, 6, 7, 8)))
    result = cache.match_prefix(MatchPrefixParams(key=RadixKey(container([1, 2, 3, 9]))))
    assert result.device_prefix_len == 2
    assert cache.path_device_indices(result.last_device_node).tolist() == [5, 6]


def test_the_allocator_frees_tensors_of_any_layout_each_page_once() -> None:
    allocator = ALLOCATORS["lifecycle"](8 * 4, 4)
    held = allocator.alloc(8)
    allocator.free(held.to(torch.int32)[:6])  # both pages (the second in part), converted
    assert allocator.available_size() == 32
    held = allocator.alloc(8)
    allocator.free(torch.stack([held, held]).t()[:, 0])  # strided
    assert allocator.available_size() == 32
    allocator.check_invariants()


# -- SGLang's schedule policy over the cache ---------------------------------------------------------
# Source: test/srt/test_schedule_policy.py of sgl-project/sglang (commit
# 00ae1bd37fde3c6535feaed96261b15e1d7f0125): its five tests, on both caches, plus the cache-aware
# orders (longest prefix, dfs-weight) compared between them.


@pytest.fixture
def server_config() -> Iterator[None]:
    """SGLang's process-wide config, as a server publishes it (its own tests' dummy one)."""
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args():
        yield


def policy(cache: Any, name: str) -> Any:
    from sglang.srt.managers.schedule_policy import SchedulePolicy

    return SchedulePolicy(policy=name, tree_cache=cache, enable_hierarchical_cache=True,
                          enable_priority_scheduling=False, schedule_low_priority_values_first=False)


def request(rid: int, tokens: list[int]) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("q", tokens), SamplingParams())


def test_init_with_cache_aware_policy(impl: type[Any]) -> None:
    from sglang.srt.managers.schedule_policy import CacheAwarePolicy

    assert policy(impl.create_simulated(), "lpm").policy == CacheAwarePolicy.LPM


def test_init_with_cache_agnostic_policy(impl: type[Any]) -> None:
    from sglang.srt.managers.schedule_policy import CacheAgnosticPolicy

    assert policy(impl.create_simulated(), "fcfs").policy == CacheAgnosticPolicy.FCFS


def test_init_with_unknown_policy(impl: type[Any]) -> None:
    with pytest.raises(ValueError):
        policy(impl.create_simulated(), "invalid")


def test_init_with_disabled_cache(impl: type[Any]) -> None:
    from sglang.srt.managers.schedule_policy import CacheAgnosticPolicy

    assert policy(impl.create_simulated(disable=True), "lpm").policy == CacheAgnosticPolicy.FCFS


@pytest.mark.usefixtures("server_config")
def test_calc_priority_fcfs(impl: type[Any]) -> None:
    waiting = [request(1, [1, 2]), request(3, [1, 2, 3]), request(2, [1])]
    policy(impl.create_simulated(), "fcfs").calc_priority(waiting)
    assert [r.rid for r in waiting] == [1, 3, 2]


def tree_and_queue(cache_class: type[Any], allocator_class_: type[Any], seed: int,
                   page_size: int) -> tuple[Any, list[Any]]:
    """A cache of pages of ``page_size`` (1 or 4) holding a small tree of prefixes (branches of distinct weights: each
    branch point's subtrees hold different numbers of the queue's requests), and a shuffled queue of
    requests ending at its nodes (and two that match nothing)."""
    allocator = ALLOCATORS["sglang" if allocator_class_ is PagedTokenToKVPoolAllocator else "lifecycle"](
        4096, page_size
    )
    cache = cache_class.create_simulated(mock_allocator=allocator, page_size=page_size)
    a, b, c = [10, 11, 12, 13] * 2, [20, 21, 22, 23] * 3, [30, 31, 32, 33]
    a1, a1a, a2 = a + [40, 41, 42, 43], a + [40, 41, 42, 43] + [50, 51, 52, 53] * 2, a + [60, 61, 62, 63]
    for path in (a1a, a2, b, c):
        cache.insert(InsertParams(key=key(path), value=allocator.alloc(len(path))))
    ends = {"a1a": (a1a, 2), "a1": (a1, 1), "a2": (a2, 1), "a": (a, 1), "b": (b, 3), "c": (c, 1), "none": ([], 2)}
    rng = random.Random(seed)
    queue = []
    for name, (path, count) in ends.items():
        for _ in range(count):
            tail = [900 + rng.randrange(50) for _ in range(rng.randrange(1, 9))]  # matches no cached page
            queue.append((name, path + tail))
    rng.shuffle(queue)
    return cache, [request(i, tokens) for i, (_, tokens) in enumerate(queue)]


@pytest.mark.usefixtures("server_config")
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_aware_orders_match_sglangs(name: str, seed: int, page_size: int) -> None:
    """The longest-prefix and dfs-weight orders of one queue over SGLang's cache and over
    lifecycle's: the same order and the same matched lengths (dfs-weight: the heaviest subtree
    first, a subtree's deeper requests before those ending at its top, unmatched requests last)."""
    orders = []
    for cache_class, allocator_class_ in ((RadixCache, PagedTokenToKVPoolAllocator),
                                          (LifecycleRadixCache, LifecyclePagedAllocator)):
        cache, waiting = tree_and_queue(cache_class, allocator_class_, seed, page_size)
        policy(cache, name).calc_priority(waiting)
        orders.append([(r.rid, r.prefix_len) for r in waiting])
        if cache_class is LifecycleRadixCache:
            cache.check_invariants()
    assert orders[0] == orders[1]
    matched = [length for _, length in orders[1]]
    if name == "lpm":
        assert matched == sorted(matched, reverse=True)
    else:  # a1a (20) x2, a1 (12), a2 (12), a (8), b (12) x3, c (4), unmatched x2
        assert matched == [20, 20, 12, 12, 8, 12, 12, 12, 4, 0, 0]


def admission_rounds(cache_class: type[Any], allocator_class_: type[Any], seed: int, pages: int) -> list[Any]:
    """Rounds of SGLang's prefill scheduling over one cache, as ``Scheduler._get_new_batch_prefill_raw``
    runs them: a ``PrefillAdder`` (a 512-token input cap, 256-token chunks), the carried chunked
    request first (``add_chunked_req``), then the waiting queue in the ``lpm`` policy's order until
    an answer other than CONTINUE. Each admitted request is then prefilled as the scheduler and the
    model runner would: its row (``ReqToTokenPool``) holds the cached prefix's indices and fresh
    pages for the rest; a chunked request is checkpointed and keeps its lock and row for the next
    round; any other is checkpointed, its row past the cache freed, its lock released (it finishes
    with its prefill). New requests arrive every round. The first time the allocator is short (the
    scheduler would evict) the log ends with the eviction asked for. The log: every answer with the
    request's match, what each round admitted and chunked, and the cache's and the allocator's
    sizes, locks held and after."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = ReqToTokenPool(size=64, max_context_len=512, device="cpu", enable_memory_saver=False)
    allocator = allocator_class_(pages * 4, 4, torch.float16, "cpu", None, need_sort=False)
    cache = cache_class(CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=4
    ))
    order = policy(cache, "lpm")
    rng = random.Random(seed)
    stems = [[rng.randrange(100) for _ in range(rng.randrange(8, 60))] for _ in range(4)]
    log: list[Any] = []
    waiting: list[Any] = []
    chunked: Any = None
    for round_ in range(6):
        for _ in range(6):
            prompt = stems[rng.randrange(4)][: rng.randrange(60)] + [
                200 + rng.randrange(50) for _ in range(rng.randrange(1, 300))
            ]
            waiting.append(Req(len(log), "", array("q", prompt), SamplingParams(max_new_tokens=rng.randrange(1, 512))))
            log.append(("arrived", waiting[-1].rid, len(prompt)))
        adder = PrefillAdder(4, cache, allocator, None, 0.5, 512, 256)
        if chunked is not None:
            chunked.init_next_round_input()
            chunked = adder.add_chunked_req(chunked)
        order.calc_priority(waiting)
        for req in waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            req.init_next_round_input(cache)
            answer = adder.add_one_req(req, has_chunked_req=chunked is not None, truncation_align_size=None)
            log.append((req.rid, req.prefix_len, answer.name))
            if answer != AddReqResult.CONTINUE:
                break
        admitted = adder.can_run_list
        waiting = [req for req in waiting if req not in admitted]
        chunked = adder.new_chunked_req
        log.append(("admitted", [req.rid for req in admitted], None if chunked is None else chunked.rid,
                    cache.evictable_size(), cache.protected_size(), allocator.available_size()))
        for req in admitted:
            kv = req.kv
            start = req.prefix_len
            if kv.req_pool_idx is None:  # a new request: a row, the cached prefix's indices in it
                pool.alloc([req])
                pool.write((kv.req_pool_idx, slice(0, start)), cache.path_device_indices(req.last_node)[:start])
                kv.cache_protected_len = start
            end = req.extend_end
            need = -(-(end - start) // 4) * 4
            if allocator.available_size() < need:
                # The scheduler evicts here; the two caches may evict different pages (SGLang whole
                # leaves), so the comparison ends with the eviction asked for.
                log.append(("evict", req.rid, need - allocator.available_size()))
                return log
            fresh = allocator.alloc(need)
            pool.write((kv.req_pool_idx, slice(start, end)), fresh[: end - start])
            cache.checkpoint(req, up_to=end)
            if req is not chunked:
                cache.free_kv_row(kv, [(kv.cache_protected_len, end)])
                cache.unlock(req.lock)
                pool.free(req)
        log.append(("prefilled", round_, cache.evictable_size(), cache.protected_size(), cache.total_size(),
                    allocator.available_size()))
    if cache_class is LifecycleRadixCache:
        cache.check_invariants()
        allocator.check_invariants()
    return log


@pytest.mark.usefixtures("server_config")
@pytest.mark.parametrize("pages", [4096, 240], ids=["roomy", "tight"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_prefill_admission_decides_alike_over_both_caches(seed: int, pages: int) -> None:
    """SGLang's own prefill scheduling (``SchedulePolicy`` and ``PrefillAdder``: a token budget from
    the allocator's free pages and the cache's evictable and protected sizes, locks on the admitted
    prefixes, chunked prefills carried across rounds) over six rounds: the same answers, admissions,
    chunks and sizes over SGLang's cache and lifecycle's. A roomy pool, and a tight one whose budget
    turns requests away (NO_TOKEN), compared up to the first eviction it needs, since the two caches
    may evict different pages."""
    theirs = admission_rounds(RadixCache, PagedTokenToKVPoolAllocator, seed, pages)
    ours = admission_rounds(LifecycleRadixCache, LifecyclePagedAllocator, seed, pages)
    assert ours == theirs
    answers = {entry[2] for entry in ours if isinstance(entry[0], int)}
    assert "CONTINUE" in answers and ("NO_TOKEN" in answers) == (pages < 1000)
    assert any(entry[2] is not None for entry in ours if entry[0] == "admitted")  # a chunked prefill
    assert any(entry[1] > 0 for entry in ours if isinstance(entry[0], int))  # cache hits
