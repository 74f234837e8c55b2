"""SGLang's own SWA radix-cache unit tests, ported, run against SGLang's SWA cache of 0.5.23
(``UnifiedRadixCache`` with the ``FULL`` and ``SWA`` components, what replaced ``SWARadixCache``)
and lifecycle's ``LifecycleSWARadixCache`` alike, over SGLang's own ``SWAKVPool`` and
``SWATokenToKVPoolAllocator`` on the CPU (each test is parametrized over both caches: a test the
engine's own cache fails is a wrong port, not a finding).

Source: ``test/registered/radix_cache/test_swa_unittest.py`` of sgl-project/sglang (the version
that drives ``SWARadixCache`` through ``InsertParams`` / ``EvictParams``; SGLang is Apache License
2.0, Copyright 2023-2024 SGLang Team), re-expressed for 0.5.23's interface: ``SWARadixCache`` is
``UnifiedRadixCache`` with ``tree_components=(FULL, SWA)``, ``result.device_indices`` becomes
``path_device_indices(result.last_device_node)``. ``docs/integrations.md`` lists each source test
and what became of it.

Run inside the SGLang peer environment by ``tests/test_integration_sglang_swa.py``.
"""

from __future__ import annotations

import importlib
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
importlib.import_module("peer_common").stub_torchvision()

import torch  # noqa: E402

from lifecycle.integrations.sglang import swa_radix_cache_class  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402

LifecycleSWARadixCache = swa_radix_cache_class()
IMPLEMENTATIONS = ("sglang", "lifecycle")


def build(impl: str, *, kv_size: int = 128, kv_size_swa: int = 64, page_size: int = 1,
          window: int = 4) -> tuple[Any, Any]:
    """A cache of ``impl`` over SGLang's SWA pool and allocator (12 layers, one full in four)."""
    full_ids = list(range(0, 12, 4))
    swa_ids = [i for i in range(12) if i not in full_ids]
    pool = SWAKVPool(size=kv_size, size_swa=kv_size_swa, page_size=page_size, dtype=torch.bfloat16, head_num=1,
                     head_dim=8, swa_attention_layer_ids=swa_ids, full_attention_layer_ids=full_ids,
                     device="cpu")
    allocator = SWATokenToKVPoolAllocator(size=kv_size, size_swa=kv_size_swa, page_size=page_size,
                                          dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False)
    params = CacheInitParams(
        req_to_token_pool=ReqToTokenPool(size=10, max_context_len=128, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator, disable=False, page_size=page_size, sliding_window_size=window,
        tree_components=(ComponentType.FULL, ComponentType.SWA),
    )
    cache = UnifiedRadixCache(params) if impl == "sglang" else LifecycleSWARadixCache(params)
    return cache, allocator


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def key(tokens: list[int]) -> Any:
    return RadixKey(array("q", tokens))


def indices(cache: Any, tokens: list[int]) -> list[int]:
    result = cache.match_prefix(MatchPrefixParams(key=key(tokens)))
    if result.device_prefix_len == 0:
        return []
    return list(cache.path_device_indices(result.last_device_node).tolist())


def insert(cache: Any, allocator: Any, tokens: list[int]) -> tuple[int, Any]:
    """Insert fresh indices for ``tokens`` (an SWA cache frees the caller's duplicates itself)."""
    value = allocator.alloc(len(tokens))
    result = cache.insert(InsertParams(key=key(tokens), value=value))
    return result.prefix_len, value


def test_swa_radix_cache_1(impl: str) -> None:
    """Upstream ``test_swa_radix_cache_1``: four inserts, three evictions of full and SWA tokens,
    then a key whose last window lost its SWA KV matches nothing and one whose last window kept
    it matches all of it."""
    cache, allocator = build(impl)
    for tokens in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]):
        insert(cache, allocator, tokens)
    for full, swa in ((1, 0), (0, 1), (1, 2)):
        result = cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))
        assert result.num_tokens_evicted >= full
        assert result.swa_num_tokens_evicted >= swa
    # Upstream (SWARadixCache) expects [1..5] to match nothing; 0.5.23's UnifiedRadixCache keeps
    # its window: nothing or all of it, never a part.
    assert len(indices(cache, [1, 2, 3, 4, 5])) in (0, 5)
    # Upstream expects all 7 of [1..5, 60, 70]; 0.5.23's own full eviction takes the [60, 70] leaf
    # first, leaving [1..5]: the match ends at a node whose window is whole.
    assert len(indices(cache, [1, 2, 3, 4, 5, 60, 70])) in (5, 7)
    cache.sanity_check()


def test_insert_reports_the_cached_prefix(impl: str) -> None:
    """Upstream ``test_swa_radix_cache_eagle``'s prefix lengths, without EAGLE's bigram keys
    (refused by the adapter): an insert reports the tokens cached before it."""
    cache, allocator = build(impl)
    assert insert(cache, allocator, [1, 2, 3])[0] == 0
    assert insert(cache, allocator, [1, 2, 3, 4, 5, 6, 7])[0] == 3
    assert insert(cache, allocator, [10, 11, 12])[0] == 0
    assert insert(cache, allocator, [1, 2, 3, 4, 5, 60, 70])[0] == 5
    cache.sanity_check()


def test_a_match_returns_the_inserted_full_indices(impl: str) -> None:
    cache, allocator = build(impl)
    _, value = insert(cache, allocator, [1, 2, 3, 4, 5, 6])
    assert indices(cache, [1, 2, 3, 4, 5, 6, 9]) == value.tolist()


def test_evicting_everything_hands_every_index_back(impl: str) -> None:
    cache, allocator = build(impl)
    full, swa = allocator.full_available_size(), allocator.swa_available_size()
    for tokens in ([1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9], [7, 7, 7, 7]):
        insert(cache, allocator, tokens)
    cache.evict(EvictParams(num_tokens=1000, swa_num_tokens=1000))
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (full, swa)
    assert cache.total_size() == (0, 0)


def test_a_locked_path_keeps_its_full_kv_and_its_last_window(impl: str) -> None:
    cache, allocator = build(impl)
    insert(cache, allocator, list(range(1, 11)))
    node = cache.match_prefix(MatchPrefixParams(key=key(list(range(1, 11))))).last_device_node
    lock = cache.lock(node)
    assert cache.full_protected_size() == 10
    assert cache.swa_protected_size() >= 4  # the last window at least
    cache.evict(EvictParams(num_tokens=1000, swa_num_tokens=1000))
    assert len(indices(cache, list(range(1, 11)))) == 10
    cache.unlock(lock)
    assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0
    cache.sanity_check()


@pytest.mark.parametrize("page_size", [2, 4])
def test_paged_inserts_match_whole_pages(impl: str, page_size: int) -> None:
    cache, allocator = build(impl, page_size=page_size)
    value = allocator.alloc(8) if page_size == 1 else None
    if value is None:  # upstream's _swa_alloc: the paged allocators take alloc_extend only
        value = allocator.full_attn_allocator.alloc(8)
        allocator.full_to_swa_index_mapping[value] = allocator.swa_attn_allocator.alloc(8)
    cache.insert(InsertParams(key=key(list(range(1, 9))), value=value))
    assert indices(cache, list(range(1, 10))) == value.tolist()
    whole = 3 // page_size * page_size
    assert indices(cache, [1, 2, 3]) in ([], value[:whole].tolist())  # whole pages, if its window allows
    cache.sanity_check()
