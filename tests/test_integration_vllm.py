"""lifecycle.integrations.vllm: the ``KVCacheManager``-shaped facade, driven here with stand-in
requests (engine-free), and vLLM's own prefix-caching tests against it (in vLLM's peer environment,
skipped without it: ``tests/engine_suites/suite_vllm.py``).

Every test ends with the manager's ``check_invariants`` and the pool's counts.
"""

from __future__ import annotations

import importlib.util
import re
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


@pytest.mark.parametrize("priority", [0, -50])
def test_a_high_priority_request_keeps_its_hit_through_a_flood_on_a_hybrid_manager(priority: int) -> None:
    """vLLM #47802 on several groups: a request's priority reaches the cache, in every group (its
    full blocks and the window a hit at its end reads), through 12 later default-priority prompts
    that turn the one pool over; at the default priority the flood takes it."""
    manager = hybrid(num_blocks=30)
    kept = FakeRequest("kept", list(range(100, 117)))
    kept.priority = priority  # type: ignore[attr-defined]
    hybrid_prefill(manager, kept)
    manager.free(kept)
    for i in range(12):
        one_off = FakeRequest(f"r{i}", [1000 * (i + 1) + t for t in range(17)])
        hybrid_prefill(manager, one_off)
        manager.free(one_off)
    _, hit, _ = manager.get_computed_blocks(FakeRequest("again", list(range(100, 117))))
    assert hit == (16 if priority else 0)
    settled(manager)


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


# -- full attention + Mamba groups ------------------------------------------------------------------


class FullAttentionSpec(SimpleNamespace):
    """Stands in for vLLM's spec of that name (the facade reads a spec's class name and fields)."""


class MambaSpec(SimpleNamespace):
    """Stands in for vLLM's ``MambaSpec``."""


class SlidingWindowSpec(SimpleNamespace):
    """Stands in for vLLM's ``SlidingWindowSpec``."""


def mamba_spec(**fields: Any) -> MambaSpec:
    return MambaSpec(**{"block_size": BS, "mamba_cache_mode": "align", "num_speculative_blocks": 0,
                        "num_prefill_checkpoint_blocks": 0, **fields})


def mamba_config(num_blocks: int, *specs: Any, **fields: Any) -> SimpleNamespace:
    groups = [SimpleNamespace(kv_cache_spec=spec) for spec in specs]
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=groups, **fields)


def mamba(num_blocks: int = 40, mamba_groups: int = 2, mode: str = "align", first: bool = True,
          **options: Any) -> Any:
    """A manager of a full-attention group (vLLM's group 0, or last with ``first=False``) and
    ``mamba_groups`` Mamba groups."""
    size = BS if mode == "align" else 1024
    specs = [mamba_spec(block_size=size, mamba_cache_mode=mode) for _ in range(mamba_groups)]
    full = FullAttentionSpec(block_size=BS)
    ordered = [full, *specs] if first else [*specs, full]
    options.setdefault("enable_caching", mode == "align")
    return LifecycleKVCacheManager(mamba_config(num_blocks, *ordered), max_model_len=1024, **options)


def run_chunk(manager: Any, request: FakeRequest, tokens: int, *, step: bool = True) -> Any:
    """``allocate_slots`` for the request's next ``tokens`` (a lookup first for a new one), as the
    scheduler does; the tokens are computed and the step ends (``new_step_starts``)."""
    hit = 0
    computed = None
    if request.num_computed_tokens == 0 and request.request_id not in manager._live:
        computed, hit, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, tokens - hit if computed is not None else tokens, hit, computed)
    if new is not None:
        request.num_computed_tokens += hit + (tokens - hit if computed is not None else tokens)
    if step:
        manager.new_step_starts()
    return new


def mamba_settled(manager: Any) -> None:
    manager.check_invariants()
    core = manager.core
    if not manager._live:  # every block is free, cached, a cached state's, or the null block
        states = len(manager._mamba_groups) * len(manager._refs)
        assert core.pool.num_free + core.num_cached_blocks + states + 1 == core.pool.num_total


def test_a_mamba_config_gets_vllms_align_tables_null_blocks_but_the_running_state() -> None:
    """vLLM's MambaManager in align mode: one block a group at the position of the block the
    chunk ends in, null blocks before it; each group's ids its own, all from one pool."""
    from lifecycle.integrations.vllm import LifecycleMambaKVCacheManager

    manager = mamba()
    assert isinstance(manager, LifecycleMambaKVCacheManager) and manager.num_kv_cache_groups == 3
    request = FakeRequest("a", list(range(14)))
    full, first, second = group_ids(run_chunk(manager, request, 12))
    assert len(full) == 3 and first[:2] == second[:2] == [0, 0] and first[2] != second[2]
    assert 0 not in full and len({*full, first[2], second[2]}) == 5
    assert manager.usage == 5 / 39
    full2, first2, second2 = group_ids(run_chunk(manager, request, 2))  # 12 + 2 tokens: block 3
    assert len(full2) == 1 and first2 == [first2[0]] and second2 == [second2[0]]
    assert group_ids(manager.get_blocks("a"))[1] == [0, 0, first[2], first2[0]]
    manager.free(request)
    assert manager.usage == 0.0
    mamba_settled(manager)


def test_a_hit_needs_a_mamba_state_at_the_cut_and_names_the_longer_attention_hit() -> None:
    """A state is cached where a chunk ended on a block boundary: one 11-token chunk caches none
    (a later prompt misses, the attention hit of 8 tokens its shared-prefix boundary); an 8-token
    chunk caches the state after 8 tokens, which a later prompt hits: its Mamba tables name the
    null block but at the cut, the state's blocks."""
    manager = mamba()
    first = FakeRequest("a", [*range(8), 50, 51, 52])
    run_chunk(manager, first, 11)
    blocks, hit, boundary = manager.get_computed_blocks(FakeRequest("b", [*range(8), 60, 61, 62]))
    assert (hit, boundary) == (0, 8) and group_ids(blocks) == ([], [], [])
    second = FakeRequest("c", [*range(8), 70, 71, 72])
    run_chunk(manager, second, 8)
    state = [group_ids(manager.get_blocks("c"))[g][1] for g in (1, 2)]
    third = FakeRequest("d", [*range(8), 80, 81, 82])
    blocks, hit, boundary = manager.get_computed_blocks(third)
    assert (hit, boundary) == (8, 0)
    full, first_group, second_group = group_ids(blocks)
    assert full == group_ids(manager.get_blocks("a"))[0][:2]  # the attention blocks cached first
    assert (first_group, second_group) == ([0, state[0]], [0, state[1]])
    new = manager.allocate_slots(third, 3, 8, blocks)
    assert new is not None and [len(g) for g in group_ids(new)] == [1, 1, 1]
    for request in (first, second, third):
        manager.free(request)
    mamba_settled(manager)


def test_a_state_cached_in_this_step_is_no_hit_until_the_next() -> None:
    """vLLM: a request cannot rely on a state another one computes in the same step;
    ``allocate_slots`` answers None (taking nothing) until ``new_step_starts``."""
    manager = mamba()
    run_chunk(manager, FakeRequest("a", [*range(8), 9, 9]), 8, step=False)
    later = FakeRequest("b", [*range(8), 7, 7])
    blocks, hit, _ = manager.get_computed_blocks(later)
    assert hit == 8
    free = manager.core.pool.num_free
    assert manager.allocate_slots(later, 2, 8, blocks) is None
    assert manager.core.pool.num_free == free
    mamba_settled(manager)
    manager.new_step_starts()
    blocks, hit, _ = manager.get_computed_blocks(later)
    assert hit == 8 and manager.allocate_slots(later, 2, 8, blocks) is not None
    mamba_settled(manager)


def test_decoding_keeps_two_states_and_caches_one_at_every_block_boundary() -> None:
    """While decoding, a request holds the state it copies from and the running one; the one
    before goes at ``remove_skipped_blocks`` (cached, so still a hit); every block boundary
    passed caches the state there."""
    manager = mamba(mamba_groups=1)
    request = FakeRequest("a", list(range(8)))
    run_chunk(manager, request, 8)  # the prompt: a state after 8 tokens (block 1)
    for token in range(9):  # decode to 17 tokens: blocks 2, 3 and 4 get states
        request.output_token_ids.append(100 + token)
        assert run_chunk(manager, request, 1) is not None
        table = group_ids(manager.get_blocks("a"))[1]
        assert sum(1 for block in table if block) <= 2
    assert sorted(manager._mamba["a"].held) == [3, 4]
    manager.free(request)
    for length, hit in ((9, 8), (13, 12), (17, 16)):
        assert manager.get_computed_blocks(FakeRequest("b", request.all_token_ids[:length]))[1] == hit
    mamba_settled(manager)


def test_cached_states_are_evicted_when_the_attention_cache_has_nothing_left() -> None:
    """Cached states no request holds count as free; once the pool and the core's evictable
    attention blocks are short, the least recently used states go, so a request fits; the one
    that does not fit takes nothing."""
    manager = mamba(num_blocks=14, mamba_groups=1)
    for name in "abcd":
        request = FakeRequest(name, [ord(name) * 10 + t for t in range(5)])
        run_chunk(manager, request, 4)  # a state after 4 tokens
        manager.free(request)
    assert len(manager._evictable) == 4 and manager.usage == 0.0
    big = FakeRequest("big", list(range(200, 248)))
    assert run_chunk(manager, big, 40) is not None  # 10 attention blocks and a state: 11 of 13
    assert len(manager._evictable) <= 2
    mamba_settled(manager)
    free = manager.core.pool.num_free
    too_big = FakeRequest("too big", list(range(300, 348)))
    assert run_chunk(manager, too_big, 40) is None
    assert manager.core.pool.num_free == free and "too big" not in manager._live
    manager.free(big)
    manager.free(too_big)
    mamba_settled(manager)


def test_none_mode_holds_one_block_a_group_for_each_request_and_caches_nothing() -> None:
    manager = mamba(mode="none")
    request = FakeRequest("a", list(range(30)))
    full, first, second = group_ids(run_chunk(manager, request, 30))
    assert len(full) == 8 and len(first) == len(second) == 1 and first != second
    request.output_token_ids.append(5)
    assert [len(g) for g in group_ids(run_chunk(manager, request, 1))] == [0, 0, 0]
    assert manager.get_computed_blocks(FakeRequest("b", list(range(30))))[1] == 0
    manager.free(request)
    assert manager.usage == 0.0 and manager.core.pool.num_free == 39
    mamba_settled(manager)


def test_the_mamba_groups_take_any_place_in_vllms_group_order() -> None:
    manager = mamba(first=False)
    request = FakeRequest("a", list(range(9)))
    first, second, full = group_ids(run_chunk(manager, request, 8))
    assert len(full) == 2 and first[0] == second[0] == 0 and first[1] and second[1]
    assert manager.get_num_common_prefix_blocks() == [0, 0, 2]
    manager.free(request)
    mamba_settled(manager)


def test_estimate_cached_tokens_is_the_least_over_the_groups() -> None:
    """vLLM's rule: the attention group's cached tokens, but no more than the deepest cached
    state the request holds."""
    manager = mamba()
    request = FakeRequest("a", list(range(14)))
    run_chunk(manager, request, 11)  # one chunk: 2 attention blocks cached, no state
    assert manager.estimate_cached_tokens(request) == 0
    other = FakeRequest("b", list(range(100, 114)))
    run_chunk(manager, other, 8)
    assert manager.estimate_cached_tokens(other) == 8
    run_chunk(manager, other, 4)  # the state after 12 tokens is cached; the one after 8 still held
    assert manager.estimate_cached_tokens(other) == 12
    manager.free(request)
    manager.free(other)
    mamba_settled(manager)


def test_take_new_block_ids_names_the_attention_groups_new_blocks() -> None:
    """For the worker to zero them, as vLLM's manager does for a config with Mamba layers."""
    manager = mamba()
    request = FakeRequest("a", list(range(10)))
    full, _, _ = group_ids(run_chunk(manager, request, 10))
    assert manager.take_new_block_ids() == full and manager.take_new_block_ids() == []
    manager.free(request)
    mamba_settled(manager)


def test_reset_and_evict_blocks_drop_cached_states() -> None:
    manager = mamba()
    request = FakeRequest("a", [*range(8), 1])
    run_chunk(manager, request, 8)
    state = group_ids(manager.get_blocks("a"))[1][1]
    assert not manager.reset_prefix_cache()
    manager.free(request)
    again = FakeRequest("b", [*range(8), 2])
    assert manager.get_computed_blocks(again)[1] == 8
    manager.evict_blocks([state])  # the state goes; the attention blocks stay: a miss, their length the boundary
    blocks, hit, boundary = manager.get_computed_blocks(again)
    assert (group_ids(blocks), hit, boundary) == (([], [], []), 0, 8)
    run_chunk(manager, again, 8)
    manager.free(again)
    assert manager._states and manager.reset_prefix_cache()
    assert not manager._states and manager.core.pool.num_free == 39
    mamba_settled(manager)


@pytest.mark.parametrize("block_ids", [[1.0], ["2"], [None], [-1], [40]])
def test_evict_blocks_with_mamba_groups_refuses_what_is_not_a_block_id(block_ids: Any) -> None:
    manager = mamba()
    request = FakeRequest("a", [*range(8), 1])
    run_chunk(manager, request, 8)
    manager.free(request)
    cached = manager.core.num_cached_blocks, len(manager._states)
    with pytest.raises(InvalidId):
        manager.evict_blocks([*group_ids(manager.get_computed_blocks(request)[0])[1], *block_ids])
    assert (manager.core.num_cached_blocks, len(manager._states)) == cached
    mamba_settled(manager)


def test_a_hit_whose_state_went_before_allocate_slots_is_refused_by_name() -> None:
    manager = mamba()
    run_chunk(manager, FakeRequest("a", [*range(8), 1]), 8)
    manager.free(FakeRequest("a", []))
    later = FakeRequest("b", [*range(8), 2])
    blocks, hit, _ = manager.get_computed_blocks(later)
    manager.evict_blocks([group_ids(blocks)[1][1]])
    free = manager.core.pool.num_free
    with pytest.raises(SequenceStateError, match="Mamba state after 2 blocks"):
        manager.allocate_slots(later, 1, hit, blocks)
    assert manager.core.pool.num_free == free and "b" not in manager._live
    mamba_settled(manager)


@pytest.mark.parametrize(("change", "error", "named"), [
    ({"num_speculative_blocks": 1}, Unsupported, "num_speculative_blocks=1"),
    ({"num_prefill_checkpoint_blocks": 2}, Unsupported, "num_prefill_checkpoint_blocks=2"),
    ({"mamba_cache_mode": "all"}, Unsupported, "mamba_cache_mode='all'"),
    ({"block_size": 8}, Unsupported, "Mamba block size of 8"),
    ({"mamba_cache_mode": "none", "block_size": 1024}, ConfigError, "mamba_cache_mode='none' with enable_caching"),
    ({"mamba_cache_mode": "none", "block_size": 64}, Unsupported, "below max_model_len"),
])
def test_mamba_specs_the_facade_does_not_build_are_refused_by_name(change: dict[str, Any], error: type[Exception],
                                                                   named: str) -> None:
    caching = not (change.get("mamba_cache_mode") == "none" and change.get("block_size") == 64)
    config = mamba_config(20, FullAttentionSpec(block_size=BS), mamba_spec(**change))
    with pytest.raises(error, match=re.escape(named)):
        LifecycleKVCacheManager(config, max_model_len=1024, enable_caching=caching)


@pytest.mark.parametrize(("specs", "fields", "options", "named"), [
    ([FullAttentionSpec(block_size=BS), FullAttentionSpec(block_size=BS), mamba_spec()], {}, {},
     "beside FullAttentionSpec, FullAttentionSpec"),
    ([FullAttentionSpec(block_size=BS), SlidingWindowSpec(block_size=BS, sliding_window=8), mamba_spec()], {}, {},
     "beside FullAttentionSpec, SlidingWindowSpec"),
    ([mamba_spec(), mamba_spec()], {}, {}, "beside none"),
    ([FullAttentionSpec(block_size=BS), mamba_spec(), mamba_spec(block_size=8)], {}, {}, "one Mamba spec"),
    ([FullAttentionSpec(block_size=BS), mamba_spec()], {"prefix_cache_retention_interval": 0}, {},
     "prefix_cache_retention_interval=0"),
    ([FullAttentionSpec(block_size=BS), mamba_spec()], {}, {"enable_kv_cache_events": True}, "enable_kv_cache_events"),
], ids=["two attention groups", "a sliding window", "no attention group", "two Mamba specs", "sparse retention",
        "events"])
def test_mamba_layouts_the_facade_does_not_build_are_refused_by_name(specs: list[Any], fields: dict[str, Any],
                                                                     options: dict[str, Any], named: str) -> None:
    with pytest.raises(Unsupported, match=re.escape(named)):
        LifecycleKVCacheManager(mamba_config(20, *specs, **fields), max_model_len=1024, **options)


def test_bad_mamba_allocations_are_refused_and_take_nothing() -> None:
    manager = mamba()
    request = FakeRequest("a", list(range(9)))
    with pytest.raises(InvalidId, match="num_new_tokens must be greater than 0"):
        manager.allocate_slots(request, 0)
    with pytest.raises(InvalidId, match="6 computed tokens"):
        manager.allocate_slots(request, 3, 6)
    with pytest.raises(SequenceStateError, match="told of 2 cached blocks"):
        manager.allocate_slots(request, 1, 8)
    assert manager.core.pool.num_free == 39 and not manager._live
    mamba_settled(manager)


def test_random_mamba_traffic_leaks_nothing() -> None:
    """Random prompts over shared prefixes, prefilled in block-aligned chunks as vLLM's scheduler
    splits them, decoded and freed, in a pool that evicts: every step recounts the states and
    blocks, and everything comes back."""
    rng = np.random.default_rng(7)
    manager = mamba(36)
    live: dict[str, FakeRequest] = {}
    prefixes = [rng.integers(0, 20, 12).tolist() for _ in range(3)]
    for number in range(400):
        if live and (len(live) > 3 or rng.random() < 0.25):
            manager.free(live.pop(rng.choice(sorted(live))))
        elif live and rng.random() < 0.5:
            request = live[rng.choice(sorted(live))]
            left = len(request.prompt_token_ids) - request.num_computed_tokens
            if left > 0:
                chunk = left if left < BS else left // BS * BS
            else:
                request.output_token_ids.append(int(rng.integers(0, 20)))
                chunk = 1
            if run_chunk(manager, request, chunk) is None:
                manager.free(live.pop(request.request_id))
        else:
            tokens = prefixes[int(rng.integers(3))] + rng.integers(0, 20, int(rng.integers(1, 12))).tolist()
            request = FakeRequest(str(number), tokens)
            _, hit, boundary = manager.get_computed_blocks(request)
            end = boundary or len(tokens) // BS * BS or len(tokens)
            if manager.allocate_slots(request, max(end - hit, 1), hit, manager.get_computed_blocks(request)[0]) is None:
                manager.free(request)
            else:
                request.num_computed_tokens = hit + max(end - hit, 1)
                live[request.request_id] = request
            manager.new_step_starts()
        mamba_settled(manager)
    for request in live.values():
        manager.free(request)
    mamba_settled(manager)
    assert manager.usage == 0.0 and manager._states
