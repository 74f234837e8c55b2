"""lifecycle.integrations.vllm: the ``KVCacheManager``-shaped facade, driven here with stand-in
requests (engine-free), and vLLM's own prefix-caching tests against it (in vLLM's peer environment,
skipped without it: ``tests/engine_suites/suite_vllm.py``).

Every test ends with the manager's ``check_invariants`` and the pool's counts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from engine_suites import assert_import_loads_none_of, run_suite
from lifecycle.errors import ConfigError, InvalidId, SequenceStateError, Unsupported
from lifecycle.integrations.vllm import Block, BlockList, KVCacheBlocks, LifecycleKVCacheManager

BS = 4


@dataclass
class FakeRequest:
    """The fields of vLLM's ``Request`` the manager reads."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    lora_request: Any = None
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)
    skip_reading_prefix_cache: bool = False
    num_preemptions: int = 0
    status: Any = field(default_factory=lambda: SimpleNamespace(name="WAITING"))
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def make(num_blocks: int = 11, **options: Any) -> LifecycleKVCacheManager:
    return LifecycleKVCacheManager.from_blocks(num_blocks, BS, 1024, **options)


def ids(blocks: Any) -> list[int] | None:
    return None if blocks is None else blocks.get_block_ids()[0]


def prefill(manager: LifecycleKVCacheManager, request: FakeRequest) -> tuple[list[int], int, list[int] | None]:
    computed, num_computed, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, computed)
    request.num_computed_tokens = request.num_tokens if new is not None else 0
    return computed.get_block_ids()[0], num_computed, ids(new)


def settled(manager: LifecycleKVCacheManager) -> None:
    manager.check_invariants()  # which also drops the last lookup's probe
    core = manager.core
    if core.live_totals() == (0, 0):  # every block is free, cached, or the null block
        cached = sum(row["num_cached"] for row in core.group_stats())  # every group's, all from the one pool
        assert core.pool.num_free + cached + 1 == core.pool.num_total


def test_a_prompt_hits_the_whole_blocks_of_a_cached_prefix_but_never_its_last_token() -> None:
    manager = make()
    first = FakeRequest("a", list(range(12)))
    assert prefill(manager, first) == ([], 0, [1, 2, 3])
    # Three full blocks are cached; the same prompt reuses only two (its last token is recomputed).
    again = FakeRequest("b", list(range(12)))
    hit, num_computed, new = prefill(manager, again)
    assert (hit, num_computed) == ([1, 2], 8) and new is not None and len(new) == 1
    longer = FakeRequest("c", list(range(13)))
    assert prefill(manager, longer)[:2] == ([1, 2, 3], 12)
    for request in (first, again, longer):
        manager.free(request)
    settled(manager)


def test_a_lookup_takes_nothing_until_allocate_slots() -> None:
    manager = make()
    prefill(manager, FakeRequest("a", list(range(9))))
    manager.free(FakeRequest("a", []))
    before = manager.usage
    computed, num_computed, _ = manager.get_computed_blocks(FakeRequest("b", list(range(9))))
    assert num_computed == 8 and manager.usage == before
    settled(manager)


def test_allocate_slots_returns_none_and_takes_nothing_when_blocks_are_short() -> None:
    manager = make(5)
    held = FakeRequest("a", list(range(12)))
    prefill(manager, held)
    assert manager.usage == 0.75
    assert prefill(manager, FakeRequest("b", list(range(100, 108)))) == ([], 0, None)
    assert manager.usage == 0.75
    manager.free(held)
    settled(manager)


def test_the_watermark_holds_blocks_back_from_waiting_requests_only() -> None:
    manager = make(11, watermark=0.3)
    first = FakeRequest("a", list(range(24)))
    assert prefill(manager, first)[2] is not None  # 6 blocks and 3 of watermark fit in 10
    waiting = FakeRequest("b", list(range(100, 116)))
    assert manager.allocate_slots(waiting, 16) is None  # 4 needed + 3 of watermark > 4 free
    waiting.status = SimpleNamespace(name="RUNNING")
    assert ids(manager.allocate_slots(waiting, 16)) is not None
    manager.free(first)
    manager.free(waiting)
    settled(manager)


def test_the_watermark_also_holds_when_the_whole_sequence_must_fit() -> None:
    manager = make(20, watermark=0.25)  # 5 blocks of watermark, 19 free
    waiting = FakeRequest("a", list(range(60)))  # 15 blocks for the whole sequence
    assert manager.allocate_slots(waiting, 4, full_sequence_must_fit=True) is None  # 15 + 5 > 19
    assert manager.usage == 0.0
    waiting.status = SimpleNamespace(name="RUNNING")
    assert manager.allocate_slots(waiting, 4, full_sequence_must_fit=True) is not None  # 15 <= 19
    manager.free(waiting)
    settled(manager)


def test_decoding_grows_the_table_and_caches_blocks_as_they_fill() -> None:
    manager = make()
    request = FakeRequest("a", list(range(6)))
    assert prefill(manager, request) == ([], 0, [1, 2])
    request.output_token_ids += [50, 51]
    new = manager.allocate_slots(request, 2)
    assert new is not None and ids(new) == []
    request.num_computed_tokens = 8
    request.output_token_ids += [52]
    assert len(ids(manager.allocate_slots(request, 1)) or []) == 1
    request.num_computed_tokens = 9
    # The block holding tokens 4..7 (two prompt tokens and two outputs) is cached.
    assert prefill(manager, FakeRequest("b", [*range(6), 50, 51, 52]))[:2] == ([1, 2], 8)
    settled(manager)


def test_only_computed_tokens_are_cached() -> None:
    manager = make()
    request = FakeRequest("a", list(range(16)))
    assert manager.allocate_slots(request, 5) is not None  # a chunk of 5 of the 16 prompt tokens
    assert manager.get_computed_blocks(FakeRequest("b", list(range(16))))[1] == 4
    request.num_computed_tokens = 5
    manager.allocate_slots(request, 11)
    assert manager.get_computed_blocks(FakeRequest("c", list(range(17))))[1] == 16
    manager.free(request)
    settled(manager)


def test_a_request_freed_before_its_prompt_was_computed_caches_only_what_was() -> None:
    manager = make()
    request = FakeRequest("a", list(range(16)))
    manager.allocate_slots(request, 6)
    manager.free(request)
    assert manager.get_computed_blocks(FakeRequest("b", list(range(16))))[1] == 4
    settled(manager)


def test_lookahead_tokens_get_blocks_but_are_not_cached() -> None:
    manager = make()
    request = FakeRequest("a", list(range(8)))
    new = manager.allocate_slots(request, 8, num_lookahead_tokens=6)
    assert new is not None and len(ids(new) or []) == 4
    assert manager.get_block_ids("a") == (ids(new),)
    manager.free(request)
    settled(manager)


def test_a_prompt_logprobs_request_does_not_read_the_cache() -> None:
    manager = make()
    prefill(manager, FakeRequest("a", list(range(9))))
    skip = FakeRequest("b", list(range(9)), skip_reading_prefix_cache=True)
    assert prefill(manager, skip)[:2] == ([], 0)
    settled(manager)


def test_requests_share_only_within_their_lora_and_salt() -> None:
    manager = make(20)
    lora = SimpleNamespace(lora_int_id=3, lora_name="a")
    prefill(manager, FakeRequest("a", list(range(9)), lora_request=lora))
    prefill(manager, FakeRequest("b", list(range(9)), cache_salt="s"))
    assert prefill(manager, FakeRequest("c", list(range(9)), lora_request=lora))[1] == 8
    assert prefill(manager, FakeRequest("d", list(range(9)), cache_salt="s"))[1] == 8
    assert prefill(manager, FakeRequest("e", list(range(9))))[1] == 0
    settled(manager)


def test_a_multimodal_request_stops_reuse_and_caching_at_its_first_placeholder() -> None:
    manager = make(20)
    image = SimpleNamespace(mm_position=SimpleNamespace(offset=6, length=3))
    prefill(manager, FakeRequest("a", list(range(16)), mm_features=[image]))
    assert manager.get_computed_blocks(FakeRequest("b", list(range(16))))[1] == 4
    assert manager.get_computed_blocks(FakeRequest("c", list(range(16)), mm_features=[image]))[1] == 4
    settled(manager)


def test_reset_refuses_while_a_request_holds_blocks() -> None:
    manager = make(log_stats=False)
    request = FakeRequest("a", list(range(9)))
    prefill(manager, request)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(FakeRequest("b", list(range(9))))[1] == 0
    settled(manager)


def test_evict_blocks_drops_them_and_what_follows() -> None:
    manager = make()
    prefill(manager, FakeRequest("a", list(range(13))))
    manager.free(FakeRequest("a", []))
    manager.evict_blocks({2})
    assert manager.get_computed_blocks(FakeRequest("b", list(range(13))))[1] == 4
    settled(manager)


@pytest.mark.parametrize(
    "block_ids", [[2**40], ["x"], [None], [1.5], 7], ids=["past the pool", "str", "None", "float", "not iterable"]
)
def test_evict_blocks_refuses_what_is_not_a_block_id_and_evicts_nothing(block_ids: Any) -> None:
    manager = make()
    prefill(manager, FakeRequest("a", list(range(17))))
    manager.free(FakeRequest("a", []))
    assert manager.core.num_cached_blocks == 4
    with pytest.raises(InvalidId):
        manager.evict_blocks(block_ids)
    assert manager.core.num_cached_blocks == 4
    assert manager.get_computed_blocks(FakeRequest("b", list(range(17))))[1] == 16
    settled(manager)


def test_common_prefix_blocks_count_what_every_live_request_shares() -> None:
    manager = make(20)
    for name, tail in (("a", 90), ("b", 91), ("c", 92)):
        prefill(manager, FakeRequest(name, [*range(8), tail, tail]))
    assert manager.get_num_common_prefix_blocks() == [2]
    manager.free(FakeRequest("b", []))
    assert manager.get_num_common_prefix_blocks("a") == [2]
    settled(manager)


def test_a_retried_lookup_and_a_skipped_request_hold_nothing() -> None:
    manager = make()
    prefill(manager, FakeRequest("a", list(range(9))))
    manager.free(FakeRequest("a", []))
    waiting = FakeRequest("b", list(range(9)))
    for _ in range(3):
        manager.get_computed_blocks(waiting)
    manager.get_computed_blocks(FakeRequest("c", list(range(5))))  # the scheduler moved on
    assert manager.core.num_live_sequences == 1  # the last lookup's probe, until the next call
    settled(manager)
    assert manager.core.num_live_sequences == 0


def test_allocate_slots_with_stale_computed_blocks_is_refused_by_name() -> None:
    manager = make()
    prefill(manager, FakeRequest("a", list(range(9))))
    manager.free(FakeRequest("a", []))
    request = FakeRequest("b", list(range(9)))
    computed, num_computed, _ = manager.get_computed_blocks(request)
    manager.evict_blocks({1})
    with pytest.raises(SequenceStateError, match="2 cached blocks"):
        manager.allocate_slots(request, 1, num_computed, computed)
    settled(manager)


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"num_new_tokens": 0}, InvalidId),
        ({"num_new_tokens": 4, "num_new_computed_tokens": 3}, InvalidId),
        ({"num_new_tokens": 4, "num_external_computed_tokens": 4}, Unsupported),
        ({"num_new_tokens": 4, "num_encoder_tokens": 4}, Unsupported),
    ],
)
def test_bad_allocations_are_refused_and_take_nothing(arguments: dict[str, Any], error: type[Exception]) -> None:
    manager = make()
    with pytest.raises(error):
        manager.allocate_slots(FakeRequest("a", list(range(9))), **arguments)
    assert manager.usage == 0.0
    settled(manager)


@pytest.mark.parametrize(
    "options", [{"num_blocks": 1}, {"max_model_len": 0}, {"watermark": 1.5}, {"watermark": "x"}]
)
def test_bad_sizes_are_refused_by_name(options: dict[str, Any]) -> None:
    arguments: dict[str, Any] = {"num_blocks": 8, "max_model_len": 64, **options}
    with pytest.raises(ConfigError, match=next(iter(options))):
        LifecycleKVCacheManager.from_blocks(arguments.pop("num_blocks"), BS, arguments.pop("max_model_len"),
                                            **arguments)


def test_a_group_of_an_unknown_spec_is_refused_by_name() -> None:
    spec = SimpleNamespace(block_size=16)
    config = SimpleNamespace(num_blocks=8, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)] * 2)
    with pytest.raises(Unsupported, match="a SimpleNamespace group"):
        LifecycleKVCacheManager(config, max_model_len=64)


# -- several KV cache groups over one id space ----------------------------------------------------------


WINDOW = 8  # tokens: a query reads the last two blocks


def hybrid(num_blocks: int = 40, rules: Any = (("sliding_window", WINDOW), ("full", 0)),
           **options: Any) -> LifecycleKVCacheManager:
    return LifecycleKVCacheManager.from_groups(list(rules), num_blocks, BS, 1024, **options)


def group_ids(blocks: Any) -> tuple[list[int], ...]:
    ids: tuple[list[int], ...] = blocks.get_block_ids()
    return ids


def hybrid_prefill(manager: LifecycleKVCacheManager, request: FakeRequest) -> tuple[tuple[list[int], ...], int, Any]:
    computed, num_computed, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, computed)
    request.num_computed_tokens = request.num_tokens if new is not None else 0
    return group_ids(computed), num_computed, None if new is None else group_ids(new)


def test_every_group_gets_its_own_ids_from_the_one_pool() -> None:
    manager = hybrid()
    _, _, new = hybrid_prefill(manager, FakeRequest("a", list(range(20))))
    window, full = new
    assert len(window) == len(full) == 5 and not set(window) & set(full) and 0 not in window + full
    assert manager.usage == 10 / 39
    settled(manager)


def test_a_window_gives_back_its_blocks_as_the_request_decodes_and_the_table_names_the_null_block() -> None:
    manager = hybrid()
    request = FakeRequest("a", list(range(20)))
    hybrid_prefill(manager, request)
    request.output_token_ids.append(7)
    assert manager.allocate_slots(request, 1) is not None  # 20 tokens computed: blocks 0-2 left the window
    window, full = manager.get_block_ids("a")
    assert window[:3] == [0, 0, 0] and 0 not in window[3:] and 0 not in full
    assert manager.usage == (6 + 3) / 39
    settled(manager)


def test_a_hit_is_the_longest_prefix_every_group_serves() -> None:
    manager = hybrid()
    first = FakeRequest("a", list(range(20)))
    hybrid_prefill(manager, first)
    manager.free(first)
    (window, full), num_computed, _ = hybrid_prefill(manager, FakeRequest("b", [*range(20), 7, 8]))
    assert num_computed == 20 and window[:3] == [0, 0, 0] and 0 not in window[3:] and len(full) == 5
    settled(manager)


def test_a_second_request_hits_a_first_one_still_running() -> None:
    manager = hybrid()
    first = FakeRequest("a", list(range(20)))
    _, _, (first_window, first_full) = hybrid_prefill(manager, first)
    (window, full), num_computed, _ = hybrid_prefill(manager, FakeRequest("b", [*range(20), 7, 8]))
    assert num_computed == 20 and full == first_full and window == [0, 0, 0, *first_window[3:]]
    settled(manager)


def test_window_blocks_cached_as_they_filled_stay_cached_when_they_leave_the_window() -> None:
    manager = hybrid()
    first = FakeRequest("a", list(range(40)))
    hybrid_prefill(manager, first)
    manager.free(first)  # every block of both groups was cached at allocate_slots
    window = manager.core.group_stats()[1]
    assert window["num_cached"] == window["num_cache_only"] == 10
    assert manager.usage == 0.0  # cached blocks no request holds count as free, as in vLLM
    assert manager.get_computed_blocks(FakeRequest("b", [*range(20), 99, 98]))[1] == 20
    assert manager.get_computed_blocks(FakeRequest("c", [*range(40), 5]))[1] == 40
    settled(manager)


def test_in_flight_tokens_stay_in_the_window_until_they_are_committed() -> None:
    manager = hybrid()
    request = FakeRequest("a", list(range(24)))
    hybrid_prefill(manager, request)
    request.num_in_flight_tokens = 24  # type: ignore[attr-defined]  # (async scheduling: not computed yet)
    assert manager.allocate_slots(request, 4) is not None
    assert 0 not in manager.get_block_ids("a")[0]  # the window still reads every block
    request.num_in_flight_tokens = 4  # type: ignore[attr-defined]
    request.num_computed_tokens = 28
    assert manager.allocate_slots(request, 4) is not None  # 24 committed: blocks 0-3 left the window
    assert manager.get_block_ids("a")[0][:4] == [0, 0, 0, 0]
    settled(manager)


def test_chunked_local_groups_need_no_block_before_the_current_chunk() -> None:
    manager = hybrid(rules=[("full", 0), ("chunked_local", 8)])
    first = FakeRequest("a", list(range(24)))
    hybrid_prefill(manager, first)
    manager.free(first)
    (full, chunk), num_computed, _ = hybrid_prefill(manager, FakeRequest("b", [*range(24), 1]))
    assert num_computed == 24 and chunk == [0] * 6 and len(full) == 6
    settled(manager)


def test_a_hybrid_allocation_that_does_not_fit_returns_none_and_takes_nothing() -> None:
    manager = hybrid(11)
    held = FakeRequest("a", list(range(16)))
    hybrid_prefill(manager, held)  # 8 of the 10 blocks
    before = manager.usage
    assert hybrid_prefill(manager, FakeRequest("b", list(range(100, 108))))[2] is None
    assert manager.usage == before
    settled(manager)


def test_hybrid_eviction_frees_the_blocks_of_every_group() -> None:
    manager = hybrid(13)
    for stem in range(3):
        request = FakeRequest(str(stem), [stem * 100 + t for t in range(16)])
        assert hybrid_prefill(manager, request)[2] is not None
        manager.free(request)
        settled(manager)
    assert manager.usage == 0.0


def test_hybrid_events_name_each_groups_index() -> None:
    manager = hybrid(enable_kv_cache_events=True)
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM's event types need vLLM")
    request = FakeRequest("a", list(range(20)))
    hybrid_prefill(manager, request)
    manager.free(request)
    stored = {event.group_idx for event in manager.take_events() if type(event).__name__ == "BlockStored"}
    assert stored == {0, 1}


def test_hybrid_reset_and_common_prefix_blocks() -> None:
    manager = hybrid()
    first = FakeRequest("a", [*range(8), 90, 90])
    hybrid_prefill(manager, first)
    manager.free(first)
    for name, tail in (("b", 91), ("c", 92)):
        hybrid_prefill(manager, FakeRequest(name, [*range(8), tail, tail]))
    assert manager.get_num_common_prefix_blocks() == [0, 2]  # (the window group: none, as vLLM's)
    assert not manager.reset_prefix_cache()
    manager.free(FakeRequest("b", []))
    manager.free(FakeRequest("c", []))
    assert manager.reset_prefix_cache() and manager.core.pool.num_free == 39
    settled(manager)


@pytest.mark.parametrize("rules", [[("sliding_window", 8), ("sliding_window", 8)], [("mamba", 0), ("full", 0)]],
                         ids=["no full group", "unknown kind"])
def test_group_layouts_the_core_cannot_serve_are_refused(rules: list[tuple[str, int]]) -> None:
    with pytest.raises((Unsupported, ConfigError)):
        hybrid(rules=rules)


def test_random_hybrid_traffic_leaks_nothing() -> None:
    rng = np.random.default_rng(5)
    manager = hybrid(30)
    live: dict[str, FakeRequest] = {}
    prefixes = [rng.integers(0, 20, 12).tolist() for _ in range(3)]
    for number in range(300):
        if live and (len(live) > 3 or rng.random() < 0.3):
            manager.free(live.pop(rng.choice(sorted(live))))
        elif live and rng.random() < 0.4:
            request = live[rng.choice(sorted(live))]
            request.output_token_ids.append(int(rng.integers(0, 20)))
            if manager.allocate_slots(request, 1) is None:
                manager.free(live.pop(request.request_id))
            else:
                request.num_computed_tokens = request.num_tokens - 1
        else:
            tokens = prefixes[int(rng.integers(3))] + rng.integers(0, 20, int(rng.integers(1, 12))).tolist()
            request = FakeRequest(str(number), tokens)
            if hybrid_prefill(manager, request)[2] is not None:
                live[request.request_id] = request
            else:
                manager.free(request)
        settled(manager)
    for request in live.values():
        manager.free(request)
    settled(manager)
    assert manager.usage == 0.0


def test_kv_cache_blocks_read_like_vllms() -> None:
    blocks = KVCacheBlocks(np.array([3, 4], dtype=np.int32))
    assert blocks.get_block_ids() == ([3, 4],)
    assert [block.block_id for block in blocks.blocks[0]] == [3, 4]
    assert blocks.blocks[0][1] == Block(4) and blocks.blocks[0][:1] == BlockList(np.array([3], dtype=np.int32))
    assert (blocks + KVCacheBlocks(np.array([5], dtype=np.int32))).get_block_ids() == ([3, 4, 5],)
    assert KVCacheBlocks().get_block_ids(allow_none=True) is None
    with pytest.raises(InvalidId, match="group_ids"):
        blocks.get_block_ids(group_ids=[1])


def test_random_traffic_leaks_nothing() -> None:
    rng = np.random.default_rng(3)
    manager = make(24)
    live: dict[str, FakeRequest] = {}
    prefixes = [rng.integers(0, 20, 9).tolist() for _ in range(3)]
    for number in range(300):
        if live and (len(live) > 4 or rng.random() < 0.35):
            manager.free(live.pop(rng.choice(sorted(live))))
        else:
            tokens = prefixes[int(rng.integers(3))] + rng.integers(0, 20, int(rng.integers(1, 12))).tolist()
            request = FakeRequest(str(number), tokens)
            if prefill(manager, request)[2] is not None:
                live[request.request_id] = request
            else:
                manager.free(request)
        settled(manager)
    for request in live.values():
        manager.free(request)
    settled(manager)


def test_importing_the_facade_loads_neither_vllm_nor_torch() -> None:
    assert_import_loads_none_of("lifecycle.integrations.vllm", "vllm", "torch")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_statistics_without_vllm_name_the_extra() -> None:
    with pytest.raises(ImportError, match=r"kv-lifecycle\[vllm\]"):
        make(log_stats=True)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("name", ["LifecycleScheduler", "LifecycleAsyncScheduler"])
def test_the_scheduler_classes_without_vllm_name_the_extra(name: str) -> None:
    import lifecycle.integrations.vllm as facade

    with pytest.raises(ImportError, match=r"kv-lifecycle\[vllm\]"):
        getattr(facade, name)
    with pytest.raises(AttributeError, match="LifecycleNothing"):
        facade.LifecycleNothing  # noqa: B018


def test_vllms_own_prefix_caching_tests_pass_against_the_facade() -> None:
    summary = run_suite("vllm", "suite_vllm.py")
    assert "failed" not in summary and "error" not in summary


def test_request_priority_maps_to_retention_around_the_default() -> None:
    from lifecycle.integrations.vllm import retention_priority

    assert [retention_priority(p) for p in (0, -10, 10, -1000, 1000)] == [35, 45, 25, 100, 0]


def test_a_high_priority_request_keeps_its_blocks_through_a_flood_of_default_ones() -> None:
    """vLLM #47802: a request's priority reaches the cache. Its 4 blocks outlive 10 later
    default-priority prompts in a pool of 10 usable blocks."""
    manager = make()
    kept = FakeRequest("kept", list(range(100, 117)))
    kept.priority = -50  # type: ignore[attr-defined]
    prefill(manager, kept)
    manager.free(kept)
    for i in range(10):
        one_off = FakeRequest(f"r{i}", [1000 * (i + 1) + t for t in range(17)])
        prefill(manager, one_off)
        manager.free(one_off)
    _, hit, _ = manager.get_computed_blocks(FakeRequest("again", list(range(100, 117))))
    assert hit == 16
    settled(manager)
