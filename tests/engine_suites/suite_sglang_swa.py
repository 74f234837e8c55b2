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

import functools
import importlib
import sys
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
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
          window: int = 4, context: int = 256) -> tuple[Any, Any]:
    """A cache of ``impl`` over SGLang's SWA pool and allocator (12 layers, one full in four)."""
    full_ids = list(range(0, 12, 4))
    swa_ids = [i for i in range(12) if i not in full_ids]
    pool = SWAKVPool(size=kv_size, size_swa=kv_size_swa, page_size=page_size, dtype=torch.bfloat16, head_num=1,
                     head_dim=8, swa_attention_layer_ids=swa_ids, full_attention_layer_ids=full_ids,
                     device="cpu")
    allocator = SWATokenToKVPoolAllocator(size=kv_size, size_swa=kv_size_swa, page_size=page_size,
                                          dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False)
    params = CacheInitParams(
        req_to_token_pool=ReqToTokenPool(size=10, max_context_len=context, device="cpu", enable_memory_saver=False),
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


def test_the_adapter_frees_whole_pages_by_segment_and_other_indices_one_by_one() -> None:
    """The tree hands SGLang's allocator whole pages; those go through its segment frees (one
    index a page read, no ``torch.unique``), anything else through ``free`` / ``free_swa`` /
    ``free_full``; both hand back exactly what was taken."""
    from lifecycle.integrations.sglang import _SWARelease

    ps = 4
    _, allocator = build("lifecycle", kv_size=64, kv_size_swa=64, page_size=ps)
    calls: list[str] = []

    def spy(name: str) -> None:
        method = getattr(allocator, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return method(*args, **kwargs)

        setattr(allocator, name, call)

    for name in ("free", "free_segment", "free_swa", "free_swa_segment", "free_full", "free_full_segment"):
        spy(name)
    release = _SWARelease(allocator, torch.device("cpu"), ps)
    before = (allocator.full_available_size(), allocator.swa_available_size())

    def take() -> npt.NDArray[np.int64]:
        full = allocator.full_attn_allocator.alloc(8)
        allocator.full_to_swa_index_mapping[full] = allocator.swa_attn_allocator.alloc(8)
        return np.asarray(full.numpy(), dtype=np.int64)

    for order, expected in ((slice(None), "free_segment"), (slice(None, None, -1), "free")):
        calls.clear()
        release.free(take()[order])
        assert calls[0] == expected
        assert (allocator.full_available_size(), allocator.swa_available_size()) == before
    for order, pair in ((slice(None), ("free_swa_segment", "free_full_segment")),
                        (slice(None, None, -1), ("free_swa", "free_full"))):
        calls.clear()
        full = take()[order]
        release.free_swa(full)
        release.free_full(full)
        assert (calls[0], calls[-1]) == pair
        assert (allocator.full_available_size(), allocator.swa_available_size()) == before


# -- the request path: SGLang's own scheduler functions over the cache ---------------------------------
# What the scheduler runs for a request on an SWA model, by SGLang's own functions in
# mem_cache/common.py and ScheduleBatch: ``match_kv_cache`` (the hit), ``tree.lock(last_node)``,
# ``evict_from_tree_cache`` when short, pages from both pools (full, SWA, the full-to-SWA
# mapping), the row written, ``checkpoint_kv_cache`` after each chunk of a chunked prefill
# (``cache_unfinished_req``'s place: the cache's ``checkpoint``), ``evict_sliding_windows`` as
# ``maybe_evict_swa`` calls it in decode, and at finish ``release_kv_cache(req, tree,
# checkpoint=True)``.


@pytest.fixture
def server_config() -> Iterator[None]:
    """SGLang's process-wide config, as a server publishes it (its own tests' dummy one)."""
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args():
        yield


def swa_alloc(allocator: Any, need: int, page_size: int) -> Any:
    """``need`` slots in whole pages of both pools, mapped full to SWA (what ``alloc_extend``
    does for a request starting on a page boundary), or None when a pool is short."""
    aligned = -(-need // page_size) * page_size
    full_free = allocator.full_attn_allocator.available_size()
    swa_free = allocator.swa_attn_allocator.available_size()
    if aligned > full_free or aligned > swa_free:
        return None
    full = allocator.full_attn_allocator.alloc(aligned)
    allocator.full_to_swa_index_mapping[full] = allocator.swa_attn_allocator.alloc(aligned)
    return full[:need]


def place_request(cache: Any, allocator: Any, req: Any, prompt: Any, total: int, page_size: int,
                  after_evict: Callable[[], None] | None = None) -> tuple[int, bool]:
    """After ``match_kv_cache``: the scheduler's placement of a request of ``total`` tokens (its
    hit protected and locked, ``evict_from_tree_cache`` for the rest, pages from both pools, its
    row written). Returns the hit and whether the pools had room (if not, its lock is let go)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    hit = int(req.prefix_len)
    req.kv.cache_protected_len = hit  # as Req.init_next_round_input does after its match
    req.lock = cache.lock(req.last_node)
    evict_from_tree_cache(cache, -(-(total - hit) // page_size) * page_size)
    if after_evict is not None:
        after_evict()
    new = swa_alloc(allocator, total - hit, page_size)
    if new is None:
        cache.unlock(req.lock)
        req.lock = None
        return hit, False
    prefix = cache.prefix_device_indices(req) if hit else new[:0]
    pool = cache.req_to_token_pool
    pool.alloc([req])
    pool.write((req.kv.req_pool_idx, slice(0, total)), torch.cat([prefix.to(torch.int64), new]).to(torch.int32))
    req.full_untruncated_fill_ids = prompt
    return hit, True


def serve_requests(impl: str, seed: int, *, page_size: int, window: int, kv_size: int, kv_size_swa: int,
                   chunk: int, requests: int = 24, log: list[Any] | None = None,
                   swa_branching: bool = True) -> tuple[list[Any], Any, Any]:
    """Requests of a few shared stems served one after another, two live at a time, as the
    scheduler serves them: a chunked prefill checkpointed after every chunk but the last, the
    decode sliding the window, the finish releasing into the tree. Returns the log (hits,
    refusals, the cache's sizes; into ``log`` when given), the cache and its allocator.
    ``swa_branching=False`` drops the SWA branch point the match reports (where the full KV
    goes on past the hit, which stopped short for want of SWA KV); with it, the next checkpoint
    of a chunked prefill inserts only up to there, keeping the window before it."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, match_kv_cache, release_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    cache, allocator = build(impl, kv_size=kv_size, kv_size_swa=kv_size_swa, page_size=page_size, window=window)
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 50, size=int(rng.integers(10, 40))).tolist() for _ in range(3)]
    log = [] if log is None else log
    live: list[Any] = []

    def finish(req: Any) -> None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, cache, checkpoint=True)
        log.append(("finished", req.rid, cache.total_size(), cache.full_protected_size()))

    for number in range(requests):
        if len(live) == 2:
            finish(live.pop(0))
        stem = stems[int(rng.integers(0, 3))]
        prompt = array("q", stem[: int(rng.integers(len(stem) // 2, len(stem) + 1))]
                       + rng.integers(100, 150, size=int(rng.integers(1, 20))).tolist())
        output = array("q", rng.integers(200, 250, size=int(rng.integers(1, 12))).tolist())
        req = Req(rid=str(number), origin_input_text="", origin_input_ids=prompt,
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=len(output)))
        match_kv_cache(req, cache, prompt)
        if not swa_branching:  # SGLang's SWA branch point (its next insert stops there): off
            req.swa_branching_seqlen = None
        elif req.swa_branching_seqlen is not None:
            log.append(("branch", number, req.swa_branching_seqlen))
        total = len(prompt) + len(output)
        hit, placed = place_request(cache, allocator, req, prompt, total, page_size)
        if not placed:
            log.append(("refused", number, hit))
            continue
        # The chunks of a chunked prefill: each but the last is checkpointed into the tree.
        end = hit
        while len(prompt) - end > chunk:
            end += chunk
            req.extend_end = end
            req.kv.kv_allocated_len = req.kv.kv_committed_len = end
            checkpoint_kv_cache(req, cache)
            log.append(("chunk", number, end, req.kv.cache_protected_len, req.kv.get_evicted_seqlen(ComponentType.SWA)))
        req.extend_end = len(prompt)
        req.output_ids = output
        req.kv.kv_allocated_len = req.kv.kv_committed_len = total
        cache.evict_sliding_windows(req, total - 1)  # the decode slid the window
        log.append(("served", number, hit, req.kv.get_evicted_seqlen(ComponentType.SWA)))
        live.append(req)
        if impl == "lifecycle":
            cache.check_invariants()
    while live:
        finish(live.pop(0))
    return log, cache, allocator


SERVING = [
    pytest.param(dict(page_size=1, window=4, kv_size=2048, kv_size_swa=1024, chunk=8), id="page1-roomy"),
    pytest.param(dict(page_size=4, window=8, kv_size=2048, kv_size_swa=1024, chunk=16), id="page4-roomy"),
    pytest.param(dict(page_size=1, window=4, kv_size=96, kv_size_swa=64, chunk=8), id="page1-tight"),
    pytest.param(dict(page_size=4, window=8, kv_size=128, kv_size_swa=96, chunk=16), id="page4-tight"),
    # A window that is not a multiple of the page (gpt-oss: SGLang's sliding_window_size is 127).
    pytest.param(dict(page_size=4, window=7, kv_size=2048, kv_size_swa=1024, chunk=16), id="page4-window7-roomy"),
    pytest.param(dict(page_size=4, window=7, kv_size=128, kv_size_swa=96, chunk=16), id="page4-window7-tight"),
]


@pytest.mark.usefixtures("server_config")
@pytest.mark.parametrize("sizes", SERVING)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_requests_served_by_sglangs_scheduler_functions_leak_nothing(impl: str, seed: int,
                                                                    sizes: dict[str, Any]) -> None:
    """Chunked prefills checkpointed chunk by chunk, decodes sliding the window, finishes
    releasing into the tree: every index of both pools is free or cached, no lock is left, and
    evicting everything hands every index back."""
    log, cache, allocator = serve_requests(impl, seed, **sizes)
    full, swa = allocator.size_full, allocator.size_swa
    assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0
    cached_full, cached_swa = cache.total_size()
    assert allocator.full_available_size() + cached_full == full
    assert allocator.swa_available_size() + cached_swa == swa
    assert any(entry[0] == "chunk" for entry in log)  # chunked prefills were checkpointed
    assert any(entry[0] == "served" and entry[2] > 0 for entry in log)  # and hit
    cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (full, swa)
    assert cache.total_size() == (0, 0)
    for pool in (allocator.full_attn_allocator, allocator.swa_attn_allocator):  # each page once, never the padding page
        pages = pool.free_pages.tolist()
        assert 0 not in pages and len(pages) == len(set(pages))
    cache.sanity_check()


@pytest.mark.usefixtures("server_config")
@pytest.mark.parametrize("swa_branching", [True, False], ids=["branch-points", "no-branch-points"])
@pytest.mark.parametrize("sizes", SERVING[:2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_requests_served_by_sglangs_scheduler_functions_hit_alike_over_both_caches(
    seed: int, sizes: dict[str, Any], swa_branching: bool
) -> None:
    """In a pool that never evicts, SGLang's SWA cache and lifecycle's give every request the
    same hit, the chunks the same protected and SWA-evicted lengths, with SGLang's SWA branch
    points as its match reports them and with them dropped (see ``serve_requests``); without
    them both hold the same tokens throughout."""
    theirs = serve_requests("sglang", seed, swa_branching=swa_branching, **sizes)[0]
    ours = serve_requests("lifecycle", seed, swa_branching=swa_branching, **sizes)[0]
    if not swa_branching:
        assert ours == theirs
        return
    # A request that finishes with its branch point unused (no chunk went in up to it) is cached
    # whole by lifecycle; SGLang's finish inserts it only up to the branch point, whose window's
    # SWA KV the decode had freed: lifecycle's cache holds more after such a finish, and every
    # hit, branch point and chunk is the same.
    assert [entry for entry in ours if entry[0] != "finished"] == [entry for entry in theirs if entry[0] != "finished"]
    finished = [(mine, other) for mine, other in zip(ours, theirs) if mine[0] == "finished"]
    assert len(finished) == sum(entry[0] == "finished" for entry in theirs)
    assert all(mine[1] == other[1] and mine[2][0] >= other[2][0] for mine, other in finished)
    assert any(entry[0] == "branch" for entry in ours)  # some match stopped short of the full KV


# -- SGLang's prefill scheduling over the cache ------------------------------------------------------


def admission_rounds(impl: str, seed: int, kv_size: int, kv_size_swa: int) -> list[Any]:
    """Rounds of SGLang's prefill scheduling over an SWA cache, as ``Scheduler._get_new_batch_prefill_raw``
    runs them (``suite_sglang.admission_rounds``'s rounds over SWA pools): a ``PrefillAdder``
    (its SWA budget: the allocator's free full and SWA tokens and the cache's evictable sizes;
    a 512-token input cap, 64-token chunks), the carried chunked request first, then the waiting
    queue in the ``lpm`` policy's order until an answer other than CONTINUE. Each admitted
    request is prefilled: its row holds the cached prefix's indices and fresh pages of both pools
    for the rest; a chunked request is checkpointed (``checkpoint_kv_cache``: the cache's
    ``checkpoint``, which frees the SWA KV that left the window) and keeps its lock and row for
    the next round; any other finishes with its prefill (``release_kv_cache``). The first time
    a pool is short (the scheduler would evict) the log ends with the eviction asked for. The
    log: every answer with the request's match, what each round admitted and chunked, and the
    cache's and the pools' sizes."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    ps = 4
    cache, allocator = build(impl, kv_size=kv_size, kv_size_swa=kv_size_swa, page_size=ps, window=16)
    pool = cache.req_to_token_pool
    order = SchedulePolicy(policy="lpm", tree_cache=cache, enable_hierarchical_cache=False,
                           enable_priority_scheduling=False, schedule_low_priority_values_first=False)
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 100, size=int(rng.integers(8, 60))).tolist() for _ in range(4)]
    log: list[Any] = []
    waiting: list[Any] = []
    chunked: Any = None

    def sizes() -> tuple[int, ...]:
        # Not the SWA evictable size: SGLang's lock takes whole tree nodes until they cover the
        # window (more than the window where a node is longer), lifecycle's the window's pages.
        return (cache.full_evictable_size(), cache.full_protected_size(), allocator.full_available_size(),
                allocator.swa_available_size())

    for round_ in range(10):
        for _ in range(4):
            stem = stems[int(rng.integers(0, 4))]
            tail = rng.integers(200, 250, size=int(rng.integers(1, 120))).tolist()
            prompt = stem[: int(rng.integers(0, len(stem) + 1))] + tail
            waiting.append(Req(str(len(log)), "", array("q", prompt),
                               SamplingParams(max_new_tokens=int(rng.integers(1, 64)))))
            log.append(("arrived", waiting[-1].rid, len(prompt)))
        adder = PrefillAdder(ps, cache, allocator, None, 0.5, 512, 64)
        if chunked is not None:
            chunked.init_next_round_input()
            chunked.swa_branching_seqlen = None
            chunked = adder.add_chunked_req(chunked)
        order.calc_priority(waiting)
        for req in waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            req.init_next_round_input(cache)
            req.swa_branching_seqlen = None  # SGLang's SWA branch point off (see serve_requests)
            answer = adder.add_one_req(req, has_chunked_req=chunked is not None, truncation_align_size=None)
            log.append((req.rid, req.prefix_len, answer.name))
            if answer != AddReqResult.CONTINUE:
                break
        admitted = adder.can_run_list
        waiting = [req for req in waiting if req not in admitted]
        chunked = adder.new_chunked_req
        log.append(("admitted", [req.rid for req in admitted], None if chunked is None else chunked.rid, sizes()))
        for req in admitted:
            kv = req.kv
            start = req.prefix_len
            if kv.req_pool_idx is None:  # a new request: a row, the cached prefix's indices in it
                pool.alloc([req])
                pool.write((kv.req_pool_idx, slice(0, start)), cache.prefix_device_indices(req).to(torch.int32))
            end = req.extend_end
            fresh = swa_alloc(allocator, end - start, ps)
            if fresh is None:
                # The scheduler evicts here; the two caches may evict different pages.
                log.append(("evict", req.rid, end - start))
                return log
            pool.write((kv.req_pool_idx, slice(start, end)), fresh.to(torch.int32))
            kv.kv_allocated_len = kv.kv_committed_len = end
            if req is chunked:
                checkpoint_kv_cache(req, cache)
            else:
                req.finished_reason = FINISH_LENGTH(length=0)
                release_kv_cache(req, cache, checkpoint=True)
        log.append(("prefilled", round_, cache.total_size(), sizes()))
        if impl == "lifecycle":
            cache.check_invariants()
    return log


@pytest.mark.usefixtures("server_config")
@pytest.mark.parametrize(("kv_size", "kv_size_swa"), [(8192, 4096), (512, 256)], ids=["roomy", "tight"])
@pytest.mark.parametrize("seed", [0, 1, 3, 4])
def test_prefill_admission_decides_alike_over_both_caches(seed: int, kv_size: int, kv_size_swa: int) -> None:
    """SGLang's own prefill scheduling (``SchedulePolicy`` and ``PrefillAdder`` with its SWA
    budget, locks on the admitted prefixes, chunked prefills checkpointed and carried across
    rounds) over ten rounds: the same answers, admissions, chunks and sizes over SGLang's SWA
    cache and lifecycle's, up to the first eviction a tight pool needs."""
    theirs = admission_rounds("sglang", seed, kv_size, kv_size_swa)
    ours = admission_rounds("lifecycle", seed, kv_size, kv_size_swa)
    assert ours == theirs
    assert any(entry[2] is not None for entry in ours if entry[0] == "admitted")  # a chunked prefill
    assert any(entry[1] > 0 for entry in ours if isinstance(entry[0], str) and entry[0].isdigit())  # hits
    assert (ours[-1][0] == "evict") == (kv_size < 1000)  # the tight pool runs short


def _check_tree(cache: Any, allocator: Any, where: str) -> None:
    """Every SWA slot the tree keeps names SWA KV that is mapped and not free, every full one a
    full page that is not free; neither free list holds a page twice or the padding page 0."""
    tree = cache.tree
    mapping = allocator.full_to_swa_index_mapping
    ps = cache.page_size
    held1 = np.flatnonzero(tree._held[1])
    rows1 = tree._rows[1][held1]
    if len(rows1):
        m = mapping[torch.from_numpy(rows1.reshape(-1))].reshape(len(rows1), ps)
        unmapped = rows1[(m[:, 0] == 0).numpy()][:, 0].tolist()
        assert not unmapped, f"{where}: SWA slots of the tree with no SWA KV mapped (full indices {unmapped})"
        swa_free = set(allocator.swa_attn_allocator.free_pages.tolist())
        used = set((m[:, 0] // ps).tolist()) if ps > 1 else set(m[:, 0].tolist())
        assert not (used & swa_free), f"{where}: cached SWA page on the free list {sorted(used & swa_free)[:5]}"
    rows0 = tree._rows[0][np.flatnonzero(tree._held[0])]
    if len(rows0):
        assert bool((rows0[:, 0] != 0).all()), f"{where}: group-0 slot holding full index 0"
        full_free = set(allocator.full_attn_allocator.free_pages.tolist())
        used = set((rows0[:, 0] // ps).tolist()) if ps > 1 else set(rows0[:, 0].tolist())
        assert not (used & full_free), f"{where}: cached full page on the free list {sorted(used & full_free)[:5]}"
    for pool in (allocator.full_attn_allocator, allocator.swa_attn_allocator):
        pages = pool.free_pages.tolist()
        assert 0 not in pages and len(pages) == len(set(pages)), f"{where}: free list has page 0 or a duplicate"
    tree.check_invariants()


def serve_random(seed: int, *, page_size: int, window: int, kv_size: int, kv_size_swa: int, stem: tuple[int, int],
                 requests: int = 30) -> dict[str, int]:
    """Random requests through SGLang's scheduler functions (matches, locks, chunked
    checkpoints with and without sliding the window first, SWA-only evictions that tombstone
    cached pages, finishes), the tree checked after every step; everything handed back at the end."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, match_kv_cache, release_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    ctx = stem[1] + 3 * window + 64
    cache, allocator = build("lifecycle", kv_size=kv_size, kv_size_swa=kv_size_swa, page_size=page_size,
                             window=window, context=ctx)
    stems = [rng.integers(0, 50, size=int(rng.integers(*stem))).tolist() for _ in range(3)]
    live: list[Any] = []
    stats = dict(hits=0, chunks=0, refused=0, evicted_swa=0, branch=0)
    branching = bool(rng.integers(0, 2))
    nlive = int(rng.integers(1, 4))

    def finish(req: Any) -> None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, cache, checkpoint=True)
        _check_tree(cache, allocator, f"finish {req.rid}")

    for number in range(requests):
        if len(live) >= nlive:
            finish(live.pop(int(rng.integers(0, len(live)))))
        if rng.random() < 0.3:
            cache.evict(EvictParams(num_tokens=int(rng.integers(0, 2)) * page_size,
                                    swa_num_tokens=int(rng.integers(1, 4)) * page_size))
            stats["evicted_swa"] += 1
            _check_tree(cache, allocator, f"evict before {number}")
        s = stems[int(rng.integers(0, 3))]
        prompt = array("q", s[: int(rng.integers(len(s) // 2, len(s) + 1))]
                       + rng.integers(100, 150, size=int(rng.integers(1, 2 * window + 8))).tolist())
        output = array("q", rng.integers(200, 250, size=int(rng.integers(1, window + 6))).tolist())
        req = Req(rid=str(number), origin_input_text="", origin_input_ids=prompt,
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=len(output)))
        match_kv_cache(req, cache, prompt)
        if not branching:
            req.swa_branching_seqlen = None
        elif req.swa_branching_seqlen is not None:
            stats["branch"] += 1
        total = len(prompt) + len(output)
        hit, placed = place_request(cache, allocator, req, prompt, total, page_size,
                                    after_evict=functools.partial(_check_tree, cache, allocator,
                                                                  f"evict_from_tree {number}"))
        stats["hits"] += hit > 0
        if not placed:
            stats["refused"] += 1
            continue
        chunk = int(rng.integers(1, 5)) * page_size + int(rng.integers(0, page_size))
        end = hit
        while len(prompt) - end > chunk:
            end += chunk
            req.extend_end = end
            req.kv.kv_allocated_len = req.kv.kv_committed_len = end
            if rng.random() < 0.5:
                cache.evict_sliding_windows(req, end - 1)
            checkpoint_kv_cache(req, cache)
            stats["chunks"] += 1
            _check_tree(cache, allocator, f"chunk {number} at {end}")
        req.extend_end = len(prompt)
        req.output_ids = output
        req.kv.kv_allocated_len = req.kv.kv_committed_len = total
        cache.evict_sliding_windows(req, total - 1)
        _check_tree(cache, allocator, f"served {number}")
        live.append(req)
    while live:
        finish(live.pop(0))
    full, swa = allocator.size_full, allocator.size_swa
    cached_full, cached_swa = cache.total_size()
    assert allocator.full_available_size() + cached_full == full
    assert allocator.swa_available_size() + cached_swa == swa
    cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (full, swa)
    assert cache.total_size() == (0, 0)
    _check_tree(cache, allocator, "end")
    return stats


RANDOM = [dict(page_size=4, window=w, kv_size=ks, kv_size_swa=kss, stem=(10, 40))
          for w in (1, 3, 5, 6, 7, 9) for ks, kss in ((2048, 1024), (160, 96))]
RANDOM += [dict(page_size=16, window=127, kv_size=ks, kv_size_swa=kss, stem=(100, 300))
           for ks, kss in ((16384, 8192), (2048, 1024))]
RANDOM += [dict(page_size=64, window=127, kv_size=ks, kv_size_swa=kss, stem=(100, 400))
           for ks, kss in ((16384, 8192), (4096, 1536))]
RANDOM += [dict(page_size=8, window=w, kv_size=320, kv_size_swa=160, stem=(10, 60)) for w in (5, 12, 17)]
RANDOM += [dict(page_size=2, window=3, kv_size=ks, kv_size_swa=kss, stem=(10, 40))
           for ks, kss in ((1024, 512), (80, 48))]


@pytest.mark.usefixtures("server_config")
@pytest.mark.parametrize("sizes", RANDOM, ids=[f"ps{d['page_size']}-w{d['window']}-{d['kv_size']}" for d in RANDOM])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_keeps_every_swa_slot_mapped(seed: int, sizes: dict[str, Any]) -> None:
    stats = serve_random(seed, **sizes)
    assert stats["chunks"] > 0


@pytest.mark.usefixtures("server_config")
def test_a_request_longer_than_the_swa_pool_is_cached_with_tombstones(impl: str) -> None:
    """Its SWA KV below 48 tokens freed as it went (never more than the pool at once), a request
    of 64 tokens in pages of 4 goes in whole over an SWA pool of 32 tokens, as SGLang's cache
    takes it: its full KV cached, SWA KV only from the freed length on."""
    ps, n, freed = 4, 64, 48
    cache, allocator = build(impl, kv_size=256, kv_size_swa=32, page_size=ps, window=7)
    full = allocator.full_attn_allocator.alloc(n)
    for start in range(0, n, 16):
        allocator.full_to_swa_index_mapping[full[start:start + 16]] = allocator.swa_attn_allocator.alloc(16)
        if start + 16 <= freed:
            allocator.free_swa_segment(full[start:start + 16], start_pos=start)
    result = cache.insert(InsertParams(key=key(list(range(1, n + 1))), value=full.clone(),
                                       component_evicted_seqlens={ComponentType.SWA: freed}))
    assert result.prefix_len == 0
    assert cache.total_size() == (n, n - freed)
    assert indices(cache, list(range(1, n + 1))) == full.tolist()
    cache.evict(EvictParams(num_tokens=10**6, swa_num_tokens=10**6))
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (allocator.size_full,
                                                                                 allocator.size_swa)
