"""vLLM's own prefix-caching tests of the KV cache manager, ported, run against vLLM's
``KVCacheManager`` and lifecycle's ``LifecycleKVCacheManager`` alike (each parametrized test runs
on both: one that vLLM's own manager fails is a wrong port, not a finding).

Source: ``tests/v1/core/test_prefix_caching.py`` of vllm-project/vllm (commit
003df2961dd8830c317a61f9745ccd557da9fa06; vLLM is Apache License 2.0, Copyright contributors to the
vLLM project), the tests that drive the manager through its interface with one full-attention
group, re-expressed for the vLLM installed beside it (0.33.0). Assertions on vLLM's internals
(``block_pool.free_block_queue`` order, ``ref_cnt``, ``block_hash`` of a block, the hash functions)
become assertions on what the scheduler sees: hit lengths, which block ids are reused, free
capacity (``usage``), events. ``docs/integrations.md`` lists each source test and what became of
it.

Run inside the vLLM peer environment by ``tests/test_integration_vllm.py`` (not collected by the
project's own run: its name does not start with ``test_``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lifecycle.integrations.vllm import LifecycleKVCacheManager
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

IMPLEMENTATIONS = {"vllm": KVCacheManager, "lifecycle": LifecycleKVCacheManager}


@pytest.fixture(autouse=True)
def _hash_seed() -> None:
    init_none_hash(sha256)


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def config(block_size: int, num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer"], spec)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


class Managers:
    """Builds managers of one implementation and checks lifecycle's after every test."""

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.made: list[Any] = []

    def __call__(self, block_size: int, num_blocks: int, **kwargs: Any) -> Any:
        manager = IMPLEMENTATIONS[self.impl](
            config(block_size, num_blocks), max_model_len=8192, scheduler_block_size=block_size,
            hash_block_size=block_size, **{"enable_caching": True, **kwargs},
        )
        self.made.append(manager)
        return manager

    def request(self, request_id: str, tokens: list[int], block_size: int, **kwargs: Any) -> Request:
        """vLLM's test requests; lifecycle's manager needs no block hasher (it matches tokens)."""
        params = SamplingParams(max_tokens=17, prompt_logprobs=kwargs.pop("prompt_logprobs", None))
        params.update_from_generation_config({}, eos_token_id=100)
        hasher = get_request_block_hasher(block_size, sha256) if self.impl == "vllm" else None
        return Request(request_id=request_id, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                       block_hasher=hasher, **kwargs)


@pytest.fixture
def make(impl: str) -> Iterator[Managers]:
    managers = Managers(impl)
    yield managers
    for manager in managers.made:
        if isinstance(manager, LifecycleKVCacheManager):
            manager.check_invariants()


def ids(blocks: Any) -> list[int]:
    [group] = blocks.get_block_ids()
    return list(group)


def free_blocks(manager: Any, total: int) -> int:
    """Blocks a new request could take (free or cached and unused), from ``usage``."""
    return int(round((1.0 - manager.usage) * (total - 1)))


def prefill(manager: Any, request: Request) -> tuple[list[int], int, list[int] | None]:
    """What the scheduler does for a waiting request: lookup, then allocate the rest of its prompt."""
    computed, num_computed, _ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, computed)
    return ids(computed), num_computed, None if blocks is None else ids(blocks)


# -- ported tests ------------------------------------------------------------------------------------


def test_prefill(make: Managers) -> None:
    manager = make(16, 11)
    common = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", common + [3] * 7, 16)
    assert prefill(manager, req0) == ([], 0, [1, 2, 3, 4])
    # A hit on the common prefix while the first request still holds it.
    req1 = make.request("1", common + [3] * 5, 16)
    hit, num_computed, new = prefill(manager, req1)
    assert (hit, num_computed) == ([1, 2, 3], 48)
    assert new is not None and len(new) == 1 and new[0] not in (1, 2, 3, 4)
    assert free_blocks(manager, 11) == 5
    manager.free(req0)
    manager.free(req1)
    assert free_blocks(manager, 11) == 10
    # A hit on the common prefix once nobody holds it.
    req2 = make.request("2", common + [3] * 6, 16)
    hit, num_computed, new = prefill(manager, req2)
    assert (hit, num_computed) == ([1, 2, 3], 48) and new is not None and len(new) == 1
    manager.free(req2)
    # A miss that needs every block evicts the cached ones.
    req3 = make.request("3", [99] * 160, 16)
    hit, num_computed, new = prefill(manager, req3)
    assert (hit, num_computed) == ([], 0)
    assert new is not None and sorted(new) == list(range(1, 11))
    assert free_blocks(manager, 11) == 0
    manager.free(req3)
    assert prefill(manager, make.request("4", common + [3], 16))[1] == 0


def test_prefill_plp(make: Managers) -> None:
    manager = make(16, 11)
    common = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", common + [3] * 7, 16, prompt_logprobs=5)
    assert prefill(manager, req0) == ([], 0, [1, 2, 3, 4])
    req1 = make.request("1", common + [3] * 5, 16)
    hit, num_computed, _ = prefill(manager, req1)
    assert (hit, num_computed) == ([1, 2, 3], 48)  # a prompt-logprobs request still caches its blocks
    manager.free(req0)
    manager.free(req1)
    req2 = make.request("2", common + [3] * 6, 16, prompt_logprobs=5)
    hit, num_computed, new = prefill(manager, req2)
    assert (hit, num_computed) == ([], 0)  # ... but never reads the cache
    assert new is not None and len(new) == 4 and new != [1, 2, 3, 4]
    manager.free(req2)


def test_decode(make: Managers) -> None:
    manager = make(16, 11)
    common = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", common + [3] * 7, 16)
    assert prefill(manager, req0) == ([], 0, [1, 2, 3, 4])
    req0.num_computed_tokens = 55
    for _ in range(4):
        req0.append_output_token_ids(8)
    new = manager.allocate_slots(req0, 4)
    assert new is not None and ids(new) == []  # the partial block has room
    req0.num_computed_tokens = 59
    for _ in range(9 + 10):
        req0.append_output_token_ids(7)
    new = manager.allocate_slots(req0, 19)
    assert new is not None and len(ids(new)) == 1
    # The block the decode filled was cached: a request sharing those 64 tokens hits 4 blocks.
    tokens = list(req0.all_token_ids[:64]) + [1]
    hit, num_computed, _ = prefill(manager, make.request("1", tokens, 16))
    assert (hit, num_computed) == ([1, 2, 3, 4], 64)


def test_evict(make: Managers) -> None:
    manager = make(16, 11)
    last = 5 * 16 + 7
    req0 = make.request("0", list(range(last)), 16)
    assert prefill(manager, req0) == ([], 0, [1, 2, 3, 4, 5, 6])
    req1 = make.request("1", list(range(last, last + 3 * 16)), 16)
    _, _, new = prefill(manager, req1)
    assert new is not None and len(new) == 3
    assert free_blocks(manager, 11) == 1
    manager.free(req0)
    manager.free(req1)
    assert free_blocks(manager, 11) == 10
    req2 = make.request("2", list(range(2 * 16 + 3)), 16)
    hit, num_computed, new = prefill(manager, req2)
    assert (hit, num_computed) == ([1, 2], 32)
    assert new is not None and len(new) == 1 and new[0] not in (1, 2)
    assert free_blocks(manager, 11) == 7


def test_hash_block_correct_reuse(make: Managers) -> None:
    manager = make(16, 2)
    req = make.request("0", list(range(16)), 16)
    assert prefill(manager, req) == ([], 0, [1])
    manager.free(req)
    # The only block is cached; a 15-token request takes it over (evicting it) ...
    req = make.request("1", list(range(15)), 16)
    assert prefill(manager, req) == ([], 0, [1])
    manager.free(req)
    # ... so the first prompt no longer hits.
    assert prefill(manager, make.request("2", list(range(17)), 16))[1] == 0


def test_computed_blocks_not_evicted(make: Managers) -> None:
    manager = make(16, 3)
    req0 = make.request("0", list(range(16)), 16)
    assert prefill(manager, req0) == ([], 0, [1])
    req1 = make.request("1", list(range(16, 32)), 16)
    assert prefill(manager, req1) == ([], 0, [2])
    manager.free(req0)
    manager.free(req1)
    # A hit on the first block evicts the other cached block, never the one it hit.
    assert prefill(manager, make.request("2", list(range(32)), 16)) == ([1], 16, [2])


def test_basic_prefix_caching_disabled(make: Managers) -> None:
    manager = make(4, 5, enable_caching=False)
    req1 = make.request("1", list(range(10)), 4)
    assert prefill(manager, req1)[1:] == (0, [1, 2, 3])
    manager.free(req1)
    req2 = make.request("2", list(range(16)), 4)
    _, num_computed, new = prefill(manager, req2)
    assert num_computed == 0 and new is not None and len(new) == 4
    assert prefill(manager, make.request("3", list(range(4)), 4)) == ([], 0, None)


def test_cache_key_salting(make: Managers) -> None:
    manager = make(16, 11)
    common = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", common + [3] * 11, 16, cache_salt="salt1")
    assert prefill(manager, req0) == ([], 0, [1, 2, 3, 4])
    assert prefill(manager, make.request("1", common + [4] * 11, 16, cache_salt="salt1"))[1] == 48
    assert prefill(manager, make.request("2", common + [4] * 11, 16, cache_salt="salt2"))[1] == 0
    assert prefill(manager, make.request("3", common + [4] * 11, 16))[1] == 0


def test_lora_requests_share_only_with_the_same_adapter(make: Managers) -> None:
    manager = make(16, 20)
    common = [i for i in range(3) for _ in range(16)]
    lora = LoRARequest(lora_name="a", lora_int_id=1, lora_path="/a")
    other = LoRARequest(lora_name="b", lora_int_id=2, lora_path="/b")
    prefill(manager, make.request("0", common + [5], 16, lora_request=lora))
    assert prefill(manager, make.request("1", common + [6], 16, lora_request=lora))[1] == 48
    assert prefill(manager, make.request("2", common + [7], 16, lora_request=other))[1] == 0
    assert prefill(manager, make.request("3", common + [8], 16))[1] == 0


def test_prefill_not_enough_free_blocks_with_computed_blocks(make: Managers) -> None:
    manager = make(16, 11)
    common = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", common, 16)
    _, _, part0 = prefill(manager, req0)
    req1 = make.request("1", common * 2, 16)
    hit, num_computed, new = prefill(manager, req1)
    assert (hit, num_computed) == (part0, 48) and new is not None
    part1 = hit + new
    manager.free(req1)
    req2 = make.request("2", [7] * 32, 16)
    prefill(manager, req2)
    assert free_blocks(manager, 11) == 5
    # Req3 hits all 6 blocks of req1 but cannot get 3 more: nothing it hit is taken.
    req3 = make.request("3", common * 3, 16)
    computed, num_computed, _ = manager.get_computed_blocks(req3)
    assert (ids(computed), num_computed) == (part1, 96)
    assert manager.allocate_slots(req3, 48, num_computed, computed) is None
    assert free_blocks(manager, 11) == 5
    assert manager.get_computed_blocks(make.request("4", common * 3, 16))[1] == 96


def test_reset_prefix_cache(make: Managers) -> None:
    manager = make(16, 11)
    full = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", full + [3] * 7, 16)
    blocks = manager.allocate_slots(req0, 55)
    assert blocks is not None and ids(blocks) == [1, 2, 3, 4]
    req1 = make.request("1", full + [4] * 7, 16)
    hit, _, new = prefill(manager, req1)
    assert hit == [1, 2, 3] and new is not None and len(new) == 1
    assert not manager.reset_prefix_cache()  # blocks in use
    manager.free(req0)
    manager.free(req1)
    assert manager.reset_prefix_cache()
    assert prefill(manager, make.request("2", full + [3] * 7, 16))[1] == 0


def test_prefix_cache_stats_disabled(make: Managers) -> None:
    manager = make(16, 11, log_stats=False)
    assert manager.prefix_cache_stats is None
    prefill(manager, make.request("0", list(range(16)), 16))
    manager.reset_prefix_cache()
    assert manager.prefix_cache_stats is None
    assert manager.make_prefix_cache_stats() is None


def test_prefix_cache_stats_count_requests_queries_and_hits(make: Managers) -> None:
    manager = make(16, 11, log_stats=True)
    common = [i for i in range(3) for _ in range(16)]
    for number, tokens in enumerate((common + [1], common + [2])):
        request = make.request(str(number), tokens, 16)
        computed, num_computed, _ = manager.get_computed_blocks(request)
        manager.record_prefix_cache_stats(request, num_computed)
        manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, computed)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 98, 48)
    assert manager.make_prefix_cache_stats().requests == 0


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_kv_cache_events(make: Managers, blocks_to_cache: int) -> None:
    manager = make(16, blocks_to_cache + 1, enable_kv_cache_events=True)
    num_tokens = 16 * blocks_to_cache
    req0 = make.request("0", list(range(num_tokens)), 16)
    manager.allocate_slots(req0, num_tokens)
    events = manager.take_events()
    stored = events[-1]
    assert isinstance(stored, BlockStored)
    assert len(stored.block_hashes) == blocks_to_cache
    assert stored.token_ids == list(range(num_tokens)) and stored.block_size == 16
    assert manager.take_events() == []
    # The same tokens without a lookup: every cached block is evicted (removed), then stored again.
    manager.free(req0)
    req1 = make.request("1", list(range(num_tokens)), 16)
    manager.allocate_slots(req1, num_tokens)
    events = manager.take_events()
    removed = {h for event in events if isinstance(event, BlockRemoved) for h in event.block_hashes}
    assert removed == set(stored.block_hashes)
    assert isinstance(events[-1], BlockStored) and len(events[-1].block_hashes) == blocks_to_cache
    manager.free(req1)
    assert manager.reset_prefix_cache()
    assert isinstance(manager.take_events()[-1], AllBlocksCleared)


def test_kv_cache_events_name_the_cache_salt_in_the_first_blocks_extra_keys(make: Managers) -> None:
    manager = make(16, 4, enable_kv_cache_events=True)
    salted = make.request("salted", list(range(48)), 16, cache_salt="salt1")
    manager.allocate_slots(salted, 48)
    stored = manager.take_events()[-1]
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.extra_keys is not None and "salt1" in stored.extra_keys[0]


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_kv_cache_events_with_lora(make: Managers, blocks_to_cache: int) -> None:
    manager = make(16, blocks_to_cache + 1, enable_kv_cache_events=True)
    num_tokens = 16 * blocks_to_cache
    lora = LoRARequest(lora_name="test_lora", lora_int_id=42, lora_path="/test/path")
    with_lora = make.request("lora_req", list(range(num_tokens)), 16, lora_request=lora)
    manager.allocate_slots(with_lora, num_tokens)
    event = manager.take_events()[-1]
    assert isinstance(event, BlockStored)
    assert (event.lora_id, len(event.block_hashes), event.block_size) == (42, blocks_to_cache, 16)
    manager.free(with_lora)
    without = make.request("no_lora_req", list(range(num_tokens)), 16)
    manager.allocate_slots(without, num_tokens)
    event = manager.take_events()[-1]
    assert isinstance(event, BlockStored) and event.lora_id is None and len(event.block_hashes) == blocks_to_cache


def test_allocate_slots_with_lookahead_reserves_the_speculative_blocks(make: Managers) -> None:
    manager = make(16, 11)
    req = make.request("0", list(range(20)), 16)
    computed, num_computed, _ = manager.get_computed_blocks(req)
    blocks = manager.allocate_slots(req, 20, num_computed, computed, num_lookahead_tokens=30)
    assert blocks is not None and len(ids(blocks)) == 4  # ceil(50 / 16)
    assert manager.get_block_ids("0") == (ids(blocks),)


def test_a_request_that_does_not_fit_takes_nothing(make: Managers) -> None:
    manager = make(16, 5)
    held = make.request("0", list(range(40)), 16)
    assert prefill(manager, held)[2] is not None  # 3 of the 4 blocks
    assert prefill(manager, make.request("1", list(range(100, 140)), 16)) == ([], 0, None)
    assert free_blocks(manager, 5) == 1
    manager.free(held)
    assert free_blocks(manager, 5) == 4


@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_hits_the_same_tokens_as_vllm(seed: int) -> None:
    """Both managers, the same requests, a pool that never evicts: the same hit lengths."""
    init_none_hash(sha256)
    made = {impl: Managers(impl) for impl in IMPLEMENTATIONS}
    managers = {impl: managers(16, 400) for impl, managers in made.items()}
    rng = random.Random(seed)
    live: list[str] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(16, 64))] for _ in range(4)]
    for number in range(120):
        if len(live) > 6 or (live and rng.random() < 0.3):
            request_id = live.pop(rng.randrange(len(live)))
            for manager in managers.values():
                manager.free(_Lookup(request_id))
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        hits = set()
        for impl, manager in managers.items():
            _, num_computed, new = prefill(manager, made[impl].request(str(number), tokens, 16))
            assert new is not None
            hits.add(num_computed)
        assert len(hits) == 1, hits
        live.append(str(number))
    managers["lifecycle"].check_invariants()


class _Lookup:
    """What ``free`` reads of a request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


# -- lifecycle's own behaviour where it differs from vLLM's by design ------------------------------------


def test_common_prefix_blocks_are_counted_for_cascade_attention() -> None:
    manager = Managers("lifecycle")(16, 20)
    make = Managers("lifecycle")
    common = [i for i in range(3) for _ in range(16)]
    for number in range(3):
        prefill(manager, make.request(str(number), common + [number] * 20, 16))
    assert manager.get_num_common_prefix_blocks("0") == [3]
    manager.check_invariants()


def test_a_multimodal_request_reuses_and_caches_only_the_blocks_before_its_first_image() -> None:
    manager = Managers("lifecycle")(16, 20)
    make = Managers("lifecycle")
    tokens = list(range(64))
    feature = MultiModalFeatureSpec(
        data=MultiModalKwargsItem.dummy(), mm_position=PlaceholderRange(offset=40, length=10),
        identifier="image-a", modality="image",
    )
    first = make.request("0", tokens, 16, mm_features=[feature])
    prefill(manager, first)
    # Blocks 0 and 1 end before the image (token 40); block 2 holds image tokens and is not cached.
    assert manager.get_computed_blocks(make.request("1", tokens, 16))[1] == 32
    other = MultiModalFeatureSpec(
        data=MultiModalKwargsItem.dummy(), mm_position=PlaceholderRange(offset=40, length=10),
        identifier="image-b", modality="image",
    )
    assert manager.get_computed_blocks(make.request("2", tokens, 16, mm_features=[other]))[1] == 32
    manager.check_invariants()


def test_a_sliding_window_group_alone_and_the_mamba_layouts_not_built_are_refused_by_name() -> None:
    spec = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=32)
    window = KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    with pytest.raises(NotImplementedError, match="SlidingWindowSpec"):
        LifecycleKVCacheManager(window, max_model_len=8192, hash_block_size=16)
    # mamba_cache_mode "none" (MambaSpec's default) with prefix caching: vLLM's MambaManager asserts
    none = mamba_groups_config(10, ["full", "mamba"])
    with pytest.raises(AssertionError, match="align"):
        KVCacheManager(none, max_model_len=8192, hash_block_size=16, scheduler_block_size=16, enable_caching=True)
    with pytest.raises(ValueError, match="mamba_cache_mode='none' with enable_caching=True"):
        LifecycleKVCacheManager(none, max_model_len=8192, hash_block_size=16, enable_caching=True)
    speculative = MambaSpec(block_size=16, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align",
                            num_speculative_blocks=1)
    groups = [KVCacheGroupSpec(["f"], spec_of("full")), KVCacheGroupSpec(["m"], speculative)]
    with pytest.raises(NotImplementedError, match="num_speculative_blocks=1"):
        LifecycleKVCacheManager(KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups),
                                max_model_len=8192, hash_block_size=16)
    with pytest.raises(NotImplementedError, match="EAGLE"):
        LifecycleKVCacheManager(config(16, 10), max_model_len=8192, use_eagle=True)


def test_the_schedulers_per_step_calls_answer_as_vllms_do_for_full_attention(make: Managers) -> None:
    """Scheduler.schedule() drains copy-on-write copies and boundary-state offloads every step and
    asks for the cached tokens of a prefill: for full attention, no copies, no offloads, and the
    tokens of the request's cached blocks."""
    manager = make(16, 11)
    common = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", common + [3] * 7, 16)
    prefill(manager, req0)
    manager.cache_blocks(req0, req0.num_tokens)
    req1 = make.request("1", common + [3] * 5, 16)
    prefill(manager, req1)
    assert manager.estimate_cached_tokens(req1) == 48
    assert manager.estimate_cached_tokens(req0) == 48
    assert manager.estimate_cached_tokens(make.request("9", [7] * 20, 16)) == 0
    copies, retained = manager.take_kv_cache_block_copies()
    assert (list(copies), list(retained)) == ([], [])
    assert manager.take_boundary_state_offloads() == {}
    manager.free(req0)
    manager.free(req1)


# -- vLLM's own scheduler over the facade ------------------------------------------------------------


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A model config without weights or a tokenizer (a 2-layer OPT's ``config.json``): all the
    scheduler reads of a model."""
    import json

    from vllm.config import ModelConfig

    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "ffn_dim": 128, "vocab_size": 1000, "max_position_embeddings": 2048,
        "word_embed_proj_dim": 64, "torch_dtype": "float16", "do_layer_norm_before": True,
    }))
    return ModelConfig(model=str(folder), skip_tokenizer_init=True, max_model_len=1024, dtype="float16", seed=0)


def scheduler(scheduler_cls: type[Any], model_config: Any, num_blocks: int, async_scheduling: bool,
              caching: bool = True, kv_cache_config: KVCacheConfig | None = None) -> Any:
    """A vLLM scheduler of ``num_blocks`` blocks of 16 (one full-attention group, or the groups of
    ``kv_cache_config``), 8 sequences and 256 tokens a step."""
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                                       is_encoder_decoder=False, async_scheduling=async_scheduling)
    cache_config = CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=caching)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config,
                             device_config=DeviceConfig("cpu"))
    kv_cache_config = config(16, num_blocks) if kv_cache_config is None else kv_cache_config
    return scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                         structured_output_manager=StructuredOutputManager(vllm_config), block_size=16)


def drive(scheduler: Any, seed: int, depth: int, abort_every: int = 0, tables: bool = False) -> list[tuple[Any, ...]]:
    """24 requests (most opening with one 48-token system prompt) arriving over 30 steps, run to
    the end with tokens sampled from ``seed``, as vLLM's engine core steps: with ``depth`` 2 the
    next step is scheduled before the last one's output is processed (``step_with_batch_queue``,
    async scheduling). Every ``abort_every`` steps the lowest-numbered request is aborted. The
    log: each schedule's tokens per request, the new requests' cache hits and the preempted; each
    output's finished requests; every 7 steps the scheduler's stats (KV cache usage, prefix cache
    requests, queries and hits). With ``tables``, each schedule also logs the shape of the block
    ids it hands the model runner: per request and group, how many and where the null block is,
    and how many attention blocks are to be zeroed."""
    from collections import deque

    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    hasher = get_request_block_hasher(16, sha256)
    system = list(range(1000, 1048))
    arrivals: dict[int, list[Request]] = {}
    for i in range(24):
        prompt = (system if rng.random() < 0.6 else []) + [rng.randrange(500) for _ in range(rng.randrange(5, 120))]
        params = SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True)
        arrivals.setdefault(rng.randrange(30), []).append(Request(str(i), prompt, params, None, block_hasher=hasher))
    log: list[tuple[Any, ...]] = []
    batches: deque[Any] = deque()
    for step in range(3000):
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
        if abort_every and step % abort_every == 0 and scheduler.requests:
            scheduler.finish_requests([min(scheduler.requests, key=int)], RequestStatus.FINISHED_ABORTED)
        if scheduler.has_requests() and len(batches) < depth:
            out = scheduler.schedule()
            batches.append(out)
            log.append((
                "scheduled", sorted(out.num_scheduled_tokens.items()),
                sorted((r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs),
                sorted(out.preempted_req_ids or ()),
            ))
            if tables:
                cached = out.scheduled_cached_reqs
                news = [(r.req_id, r.block_ids) for r in out.scheduled_new_reqs]
                news += [(r, b) for r, b in zip(cached.req_ids, cached.new_block_ids) if b is not None]
                log.append(("tables", sorted((r, [(len(g), [i for i, b in enumerate(g) if b == 0]) for g in groups])
                                             for r, groups in news), len(out.new_block_ids_to_zero or ())))
            if len(batches) < depth and out.total_num_scheduled_tokens > 0:
                continue  # a free slot in the queue: schedule the next step first
        if batches:
            out = batches.popleft()
            ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
            runner = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[rng.randrange(500)] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                pooler_output=[],
            )
            finished = scheduler.update_from_output(out, runner)
            done = sorted(r.request_id for outputs in finished.values() for r in outputs.outputs if r.finish_reason)
            log.append(("finished", done))
        if step % 7 == 0:
            stats = scheduler.make_stats()
            prefix = stats.prefix_cache_stats
            log.append(("stats", round(stats.kv_cache_usage, 9), prefix.requests, prefix.queries, prefix.hits))
        if not arrivals and not batches and not scheduler.has_unfinished_requests():
            return log
    raise AssertionError("the requests did not finish in 3000 steps")


@pytest.mark.parametrize("abort_every", [0, 5], ids=["", "aborts"])
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("num_blocks", [20, 40, 200])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_vllms_scheduler_decides_alike_over_the_facade(model_config: Any, async_scheduling: bool, num_blocks: int,
                                                       caching: bool, abort_every: int) -> None:
    """vLLM's own scheduler, stepped the same way once over its KVCacheManager and once over the
    facade (``scheduler_class``): the same tokens scheduled each step, the same cache hits and
    preemptions (a pool of 20 or 40 blocks forces some), the same requests finished, the same
    usage and prefix-cache statistics; aborts and ``reset_prefix_cache`` included."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from lifecycle.integrations.vllm import scheduler_class

    own_class = AsyncScheduler if async_scheduling else Scheduler
    depth = 2 if async_scheduling else 1
    for seed in (1, 2):
        theirs_scheduler = scheduler(own_class, model_config, num_blocks, async_scheduling, caching)
        theirs = drive(theirs_scheduler, seed, depth, abort_every)
        lifecycle = scheduler(scheduler_class(async_scheduling), model_config, num_blocks, async_scheduling, caching)
        assert isinstance(lifecycle.kv_cache_manager, LifecycleKVCacheManager)
        ours = drive(lifecycle, seed, depth, abort_every)
        assert ours == theirs
        scheduled = [entry for entry in ours if entry[0] == "scheduled"]
        preemptions = sum(len(entry[3]) for entry in scheduled)
        if not abort_every:  # (aborts can leave too few requests running to need preemption)
            assert (preemptions > 0) == (num_blocks <= 40)
        hits = sum(n for entry in scheduled for _, n in entry[2])
        assert (hits > 0) == caching
        finished = sum(len(entry[1]) for entry in ours if entry[0] == "finished")
        assert finished == 24 if not abort_every else 0 < finished < 24  # (an aborted request is not reported)
        manager = lifecycle.kv_cache_manager
        manager.check_invariants()
        assert manager.usage == 0.0 and manager.core.num_live_sequences == 0
        assert lifecycle.reset_prefix_cache() and theirs_scheduler.reset_prefix_cache()
        assert manager.core.num_cached_blocks == 0


def without_usage(log: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [entry[:1] + entry[2:] if entry[0] == "stats" else entry for entry in log]


def usages(log: list[tuple[Any, ...]]) -> list[float]:
    return [entry[1] for entry in log if entry[0] == "stats"]


@pytest.mark.parametrize("abort_every", [0, 5], ids=["", "aborts"])
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("num_blocks", [40, 80, 400])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_vllms_scheduler_over_a_hybrid_config(model_config: Any, async_scheduling: bool, num_blocks: int,
                                              caching: bool, abort_every: int) -> None:
    """The scheduler comparison on a full + sliding-window (32 tokens) config, vLLM's hybrid
    manager against the facade's. With room to spare (400 blocks: nothing evicted or preempted)
    every step's decisions and prefix-cache statistics are the same, and the facade's usage is
    vLLM's or above by at most one block a running request (the core releases a window's block
    when the committed tokens pass a whole block, vLLM at each token). With 40 or 80 blocks that
    extra block and the eviction order (vLLM's one free queue against the core's per-group
    rules) change preemptions and hits, so the schedules part: then both finish the same
    requests, and the facade leaks nothing."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from lifecycle.integrations.vllm import LifecycleHybridKVCacheManager, scheduler_class

    def groups() -> KVCacheConfig:
        specs = [KVCacheGroupSpec(["full"], spec_of("full")), KVCacheGroupSpec(["window"], spec_of("sliding_window"))]
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)

    own_class = AsyncScheduler if async_scheduling else Scheduler
    depth = 2 if async_scheduling else 1
    for seed in (1, 2):
        theirs = drive(scheduler(own_class, model_config, num_blocks, async_scheduling, caching, groups()), seed,
                       depth, abort_every)
        lifecycle = scheduler(scheduler_class(async_scheduling), model_config, num_blocks, async_scheduling, caching,
                              groups())
        manager = lifecycle.kv_cache_manager
        assert isinstance(manager, LifecycleHybridKVCacheManager)
        ours = drive(lifecycle, seed, depth, abort_every)
        finished = [sorted(r for entry in log if entry[0] == "finished" for r in entry[1]) for log in (theirs, ours)]
        if num_blocks == 400:
            assert without_usage(ours) == without_usage(theirs)
            for own, vllm in zip(usages(ours), usages(theirs)):
                assert 0 <= own - vllm <= 8 / (num_blocks - 1) + 1e-9
        elif not abort_every:  # (aborts pick the lowest-numbered request then: another, once schedules part)
            assert finished[0] == finished[1] and len(finished[1]) == 24
        hits = sum(n for entry in ours if entry[0] == "scheduled" for _, n in entry[2])
        assert (hits > 0) == caching
        manager.check_invariants()
        assert manager.usage == 0.0 and manager.core.num_live_sequences == 0
        assert lifecycle.reset_prefix_cache() and manager.core.num_cached_blocks == 0


def test_vllms_engine_core_reads_the_facades_groups_at_start_up(model_config: Any) -> None:
    """EngineCore's start-up reads of ``kv_cache_manager.coordinator`` (the effective attention
    block size; the groups' metadata for KV event consumers) answer as over vLLM's manager."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from lifecycle.integrations.vllm import scheduler_class

    answers = []
    for scheduler_cls in (Scheduler, scheduler_class(False)):
        core = type("Core", (), {})()  # the two methods read only these
        core.scheduler = scheduler(scheduler_cls, model_config, 40, False)
        core.vllm_config = core.scheduler.vllm_config
        EngineCore._initialize_effective_attention_block_size(core)
        answers.append((core.vllm_config.cache_config.effective_attention_block_size,
                        EngineCore.get_kv_cache_group_metadata(core)))
    assert answers[0] == answers[1] and answers[0][0] == 16


def test_the_scheduler_classes_refuse_what_the_facade_cannot_serve(model_config: Any) -> None:
    from vllm.config import KVTransferConfig

    from lifecycle.integrations.vllm import scheduler_class

    lifecycle_class = scheduler_class(False)
    assert scheduler_class() is scheduler_class(True) is scheduler_class(async_scheduling=True)
    good = scheduler(lifecycle_class, model_config, 40, False)
    vllm_config = good.vllm_config
    vllm_config.kv_transfer_config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(NotImplementedError, match="'ExampleConnector'"):
        lifecycle_class(vllm_config=vllm_config, kv_cache_config=config(16, 40), log_stats=False,
                        structured_output_manager=good.structured_output_manager, block_size=16)
    vllm_config.kv_transfer_config = None
    with pytest.raises(NotImplementedError, match="async_scheduling is False"):
        scheduler_class(True)(vllm_config=vllm_config, kv_cache_config=config(16, 40), log_stats=False,
                              structured_output_manager=good.structured_output_manager, block_size=16)
    with pytest.raises(NotImplementedError, match="metrics_collector=object"):
        LifecycleKVCacheManager(config(16, 10), max_model_len=8192, metrics_collector=object())
    with pytest.raises(NotImplementedError, match="num_prefill_lookahead=2"):
        LifecycleKVCacheManager(config(16, 10), max_model_len=8192, num_prefill_lookahead=2)


def test_vllm_resolves_the_scheduler_classes_by_name() -> None:
    """``--scheduler-cls lifecycle.integrations.vllm.LifecycleAsyncScheduler`` (or
    ``...LifecycleScheduler``) is how a vLLM server is pointed at the facade."""
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from lifecycle.integrations import vllm as facade

    for name, base in (("LifecycleAsyncScheduler", AsyncScheduler), ("LifecycleScheduler", Scheduler)):
        config_ = SchedulerConfig(max_model_len=1024, is_encoder_decoder=False,
                                  scheduler_cls=f"lifecycle.integrations.vllm.{name}")
        resolved = config_.get_scheduler_cls()
        assert resolved is getattr(facade, name) and resolved.__name__ == name
        assert issubclass(resolved, base) and resolved is not base


# -- several KV cache groups (vLLM's hybrid allocator) ---------------------------------------------------


def hybrid_config(block_size: int, num_blocks: int, *others: Any) -> KVCacheConfig:
    """``make_kv_cache_config_hybrid_model`` of vLLM's tests: a full-attention group and ``others``
    (by default two sliding-window groups of 2 blocks), every group's ids from one pool."""
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    if not others:
        window = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                   sliding_window=2 * block_size)
        others = (window, window)
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate((full, *others))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def hybrid(make: Managers, config: KVCacheConfig, **kwargs: Any) -> Any:
    block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    manager = IMPLEMENTATIONS[make.impl](config, max_model_len=8192, scheduler_block_size=block_size,
                                         hash_block_size=block_size, enable_caching=True, **kwargs)
    make.made.append(manager)
    return manager


def test_prefill_hybrid_model(make: Managers) -> None:
    """vLLM's ``test_prefill_hybrid_model``: three groups, each request's blocks distinct across
    groups; while the first request still runs its prefix is a hit in every group (its blocks
    were cached as they were allocated), the sliding-window groups reading only the last window
    (null blocks before it)."""
    manager = hybrid(make, hybrid_config(16, 21))
    common = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", common + [3] * 7, 16)
    computed, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    blocks = manager.allocate_slots(req0, 55, 0, computed)
    assert blocks is not None
    full, window_a, window_b = blocks.get_block_ids()
    assert len(full) == len(window_a) == len(window_b) == 4
    assert len(set(full) | set(window_a) | set(window_b)) == 12 and 0 not in full + window_a + window_b
    req1 = make.request("1", common + [3] * 5, 16)
    computed, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 48
    assert computed.get_block_ids() == (full[:3], [0, *window_a[1:3]], [0, *window_b[1:3]])
    blocks = manager.allocate_slots(req1, 53 - 48, num_computed, computed)
    assert blocks is not None and [len(group) for group in blocks.get_block_ids()] == [1, 1, 1]
    new: list[int] = sum(blocks.get_block_ids(), [])
    assert len(set(new)) == 3 and not set(new) & set(full + window_a + window_b)
    manager.free(req0)
    manager.free(req1)
    assert manager.usage == 0.0


def spec_of(kind: str, block_size: int = 16) -> Any:
    """The group specs of vLLM's ``_make_hybrid_kv_cache_config``, and a chunked local one."""
    shape = {"block_size": block_size, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    if kind == "full":
        return FullAttentionSpec(**shape)
    if kind == "chunked_local":
        return ChunkedLocalAttentionSpec(**shape, attention_chunk_size=2 * block_size)
    return SlidingWindowSpec(**shape, sliding_window=(4 if kind == "sliding_window_large" else 2) * block_size)


# vLLM's _HYBRID_MODEL_TEST_CASES that the facade serves (a full group and sliding-window groups),
# and full + chunked local; the Mamba cases and the ones without a full group are refused.
COMBINATIONS = [
    pytest.param(["full", "sliding_window"], id="2g-full+sw"),
    pytest.param(["full", "sliding_window", "sliding_window"], id="3g-full+2sw"),
    pytest.param(["full", "sliding_window", "sliding_window_large"], id="3g-full+sw+sw_large"),
    pytest.param(["full", "full", "sliding_window"], id="3g-2full+sw"),
    pytest.param(["full", "sliding_window", "full", "sliding_window_large"], id="4g-interleaved-full+sw+sw_large"),
    pytest.param(["full", "chunked_local"], id="2g-full+chunked"),
]


@pytest.mark.parametrize("kinds", COMBINATIONS)
def test_prefill_hybrid_model_combinations(make: Managers, kinds: list[str]) -> None:
    """vLLM's ``test_prefill_hybrid_model_combinations``: a second request hits the first one's
    common prefix in every group while the first still runs, and gets blocks in every group."""
    full, *others = (spec_of(kind) for kind in kinds)
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate((full, *others))]
    manager = hybrid(make, KVCacheConfig(num_blocks=10 * len(kinds), kv_cache_tensors=[], kv_cache_groups=groups))
    common = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", common + [3] * 7, 16)
    assert prefill_groups(manager, req0)[1] == 0
    manager.new_step_starts()
    req1 = make.request("1", common + [4] * 5, 16)
    computed, num_computed, new = prefill_groups(manager, req1)
    assert num_computed == 48 and len(computed) == len(kinds)
    assert new is not None and len(new) == len(kinds)
    manager.free(req0)
    manager.free(req1)
    assert manager.usage == 0.0


def test_prefill_hybrid_model_with_chunked_local_attention(make: Managers) -> None:
    """Full + chunked local attention: a hit, on a request still running, needs no block before
    the current chunk."""
    chunked = spec_of("chunked_local")
    manager = hybrid(make, hybrid_config(16, 21, chunked))
    tokens = [i for i in range(4) for _ in range(16)]
    req0 = make.request("0", tokens + [9] * 3, 16)
    assert prefill_groups(manager, req0)[1] == 0
    req1 = make.request("1", tokens + [8] * 3, 16)
    (full, chunk), num_computed, new = prefill_groups(manager, req1)
    assert num_computed == 64 and len(full) == 4 and chunk == [0, 0, 0, 0]
    assert new is not None and [len(group) for group in new] == [1, 1]
    manager.free(req0)
    manager.free(req1)
    assert manager.usage == 0.0


def prefill_groups(manager: Any, request: Request) -> tuple[tuple[list[int], ...], int, Any]:
    computed, num_computed, _ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, computed)
    return computed.get_block_ids(), num_computed, None if blocks is None else blocks.get_block_ids()


def test_hybrid_decode_replaces_what_left_the_window_with_the_null_block(make: Managers) -> None:
    """vLLM's ``remove_skipped_blocks`` rule: once the computed tokens pass a block by the window,
    the group's table names the null block there and the block is free again."""
    manager = hybrid(make, hybrid_config(16, 40))
    req = make.request("0", list(range(64)), 16)
    prefill_groups(manager, req)
    usage = manager.usage
    req.num_computed_tokens = 64
    req.append_output_token_ids(7)
    assert manager.allocate_slots(req, 1) is not None
    full, window_a, window_b = manager.get_block_ids("0")
    assert 0 not in full and window_a[:2] == window_b[:2] == [0, 0] and 0 not in window_a[2:]
    assert manager.usage < usage
    manager.free(req)


def test_block_stored_event_group_idx_multiple_groups(make: Managers) -> None:
    """vLLM's test of the same name: each group's stored blocks name its group index."""
    manager = hybrid(make, hybrid_config(16, 40), enable_kv_cache_events=True)
    req = make.request("0", list(range(64)), 16)
    prefill_groups(manager, req)
    req.num_computed_tokens = 64
    manager.free(req)
    stored = {event.group_idx for event in manager.take_events() if isinstance(event, BlockStored)}
    assert stored == {0, 1, 2}


# -- full attention + Mamba groups (vLLM's MambaManager) -----------------------------------------------


def mamba_groups_config(num_blocks: int, kinds: list[str], block_size: int = 16) -> KVCacheConfig:
    """``_make_hybrid_kv_cache_config`` of vLLM's tests with its ``"mamba"`` (mode ``"none"``)
    and ``"mamba_align"`` specs, and the other kinds of ``spec_of``."""
    def spec(kind: str) -> Any:
        if kind == "mla":
            return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
        if kind.startswith("mamba"):
            mode = "align" if kind == "mamba_align" else "none"
            return MambaSpec(block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode=mode)
        return spec_of(kind, block_size)

    groups = [KVCacheGroupSpec([f"layer{i}"], spec(kind)) for i, kind in enumerate(kinds)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def test_prefill_hybrid_model_mamba_align(make: Managers) -> None:
    """vLLM's test of the same name (its issue 34361): a 55-token prompt in one chunk, the Mamba
    table padded with null blocks; caching it skips them."""
    manager = hybrid(make, mamba_groups_config(30, ["full", "mamba_align"]))
    req0 = make.request("0", [i for i in range(3) for _ in range(16)] + [3] * 7, 16)
    computed, num_computed, boundary = manager.get_computed_blocks(req0)
    assert (num_computed, boundary) == (0, 0)
    blocks = manager.allocate_slots(req0, 55, num_computed, computed)
    assert blocks is not None
    full, states = blocks.get_block_ids()
    assert len(full) == 4 and states[:3] == [0, 0, 0] and states[3] not in (0, *full)
    manager.free(req0)
    assert manager.usage == 0.0


def test_hybrid_cache_mamba_align_shared_prefix_detection(make: Managers) -> None:
    """vLLM's test of the same name: the third value of ``get_computed_blocks`` (vLLM 0.33's
    shared-prefix boundary; upstream's ``num_uncached_common_prefix_tokens``) is the attention
    hit where no Mamba state is cached at its end. The scheduler's split at it is checked by the
    scheduler comparison below."""
    manager = hybrid(make, mamba_groups_config(30, ["full", "mamba_align"]))
    prefix = [i for i in range(3) for _ in range(16)]
    req_0 = make.request("0", prefix, 16)
    computed, num_computed, boundary = manager.get_computed_blocks(req_0)
    assert (num_computed, boundary) == (0, 0)
    manager.allocate_slots(req_0, 48, 0, computed)
    manager.new_step_starts()
    req_1 = make.request("1", prefix + [100] * 7, 16)
    computed, num_computed, boundary = manager.get_computed_blocks(req_1)
    assert (num_computed, boundary) == (48, 0)
    manager.allocate_slots(req_1, 7, 48, computed)
    req_2 = make.request("2", prefix[:-1] + [101], 16)
    computed, num_computed, boundary = manager.get_computed_blocks(req_2)
    assert (num_computed, boundary) == (0, 32)  # no state after 2 blocks: a shared prefix to split at
    manager.allocate_slots(req_2, 48, 0, computed)
    for request in (req_0, req_1, req_2):
        manager.free(request)
    assert manager.usage == 0.0


def test_hybrid_model_mamba_align_with_dynamic_draft_tokens(make: Managers) -> None:
    """vLLM's test of the same name (its issue 39271): draft tokens change from 16 to 1 a round;
    the Mamba group's table was over-allocated before and gets nothing."""
    manager = hybrid(make, mamba_groups_config(30, ["full", "mamba_align"]))
    req0 = make.request("0", [i for i in range(3) for _ in range(16)] + [3] * 7, 16)
    computed, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 55, num_computed, computed) is not None
    req0.append_output_token_ids([1])
    req0.num_computed_tokens = 55
    req0.spec_token_ids = [4] * 16
    assert manager.allocate_slots(req0, num_new_tokens=16, num_new_computed_tokens=0) is not None
    req0.append_output_token_ids([4])
    req0.num_computed_tokens += 1
    req0.spec_token_ids = [5]
    blocks = manager.allocate_slots(req0, num_new_tokens=1, num_new_computed_tokens=0)
    assert blocks is not None and all(len(group) == 0 for group in blocks.blocks)
    manager.free(req0)


MAMBA_COMBINATIONS = [
    pytest.param(["full", "mamba_align"], id="2g-full+mamba"),
    pytest.param(["full", "mamba_align", "mamba_align"], id="3g-full+2mamba"),
    pytest.param(["mamba_align", "full"], id="2g-mamba+full"),
    pytest.param(["mla", "mamba_align"], id="2g-mla+mamba"),
]


@pytest.mark.parametrize("kinds", MAMBA_COMBINATIONS)
def test_prefill_hybrid_model_combinations_with_mamba(make: Managers, kinds: list[str]) -> None:
    """The Mamba cases of vLLM's ``test_prefill_hybrid_model_combinations`` the facade serves, in
    align mode (vLLM 0.33 asserts it for prefix caching) and with the first prompt's 48 common
    tokens computed as their own chunk, as vLLM's scheduler splits it (one 55-token chunk caches
    no state at 48, and vLLM's own manager misses there too): the second request hits 48 tokens
    in every group, its Mamba tables the null block but at the cut."""
    manager = hybrid(make, mamba_groups_config(10 * len(kinds), kinds))
    common = [i for i in range(3) for _ in range(16)]
    req0 = make.request("0", common + [3] * 7, 16)
    computed, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    assert manager.allocate_slots(req0, 48, 0, computed) is not None
    req0.num_computed_tokens = 48
    assert manager.allocate_slots(req0, 7) is not None
    manager.new_step_starts()
    req1 = make.request("1", common + [4] * 5, 16)
    computed, num_computed, new = prefill_groups(manager, req1)
    assert num_computed == 48 and len(computed) == len(kinds)
    for kind, group in zip(kinds, computed):
        state = kind.startswith("mamba")
        assert len(group) == 3 and (group[:2] == [0, 0] and group[2] != 0 if state else 0 not in group)
    assert new is not None and [len(group) for group in new] == [1] * len(kinds)
    manager.free(req0)
    manager.free(req1)
    assert manager.usage == 0.0


@pytest.mark.parametrize("kinds", [
    pytest.param(["sliding_window", "mamba_align"], id="2g-sw+mamba"),
    pytest.param(["full", "sliding_window", "mamba_align"], id="3g-full+sw+mamba"),
    pytest.param(["full", "full", "mamba_align"], id="3g-2full+mamba"),
    pytest.param(["full", "mamba_align", "full", "mamba_align"], id="4g-interleaved-full+mamba"),
    pytest.param(["sliding_window", "mamba_align", "sliding_window_large", "mamba_align"],
                 id="4g-sw+mamba+sw_large+mamba"),
    pytest.param(["full", "full", "sliding_window", "mamba_align"], id="4g-2full+sw+mamba"),
])
def test_the_mamba_combinations_not_built_are_refused_by_name(kinds: list[str]) -> None:
    """The rest of vLLM's Mamba combinations: a Mamba group beside anything but one attention
    group is refused, naming the other groups, before anything is allocated."""
    config_ = mamba_groups_config(40, kinds)
    with pytest.raises(NotImplementedError, match=r"Mamba groups beside|MambaSpec; a full-attention \(or MLA\) group"):
        LifecycleKVCacheManager(config_, max_model_len=8192, scheduler_block_size=16, hash_block_size=16)


def mamba_masks(blocks: Any) -> list[tuple[int, list[int]]] | None:
    """The shape of a ``KVCacheBlocks``: per group, how many ids and where the null block is."""
    if blocks is None:
        return None
    return [(len(group), [i for i, b in enumerate(group) if b == 0]) for group in blocks.get_block_ids()]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_mamba_traffic_gets_the_tables_vllms_manager_gives(seed: int) -> None:
    """Differential, full + two Mamba groups in align mode, a pool that never evicts: requests
    over shared prefixes prefilled in block-aligned chunks (ending at the shared-prefix boundary
    where one is reported, as vLLM's scheduler splits), decoded with draft tokens now and then,
    freed; the same calls on vLLM's manager and the facade give the same hits, boundaries and
    refusals, and block tables of the same shape (where the null block is) in every group, the
    same ``estimate_cached_tokens``, the same number of blocks to zero, and the same usage but for
    the cached attention blocks the core keeps as ancestors of a path a live request cached
    (``kept_ancestors``)."""
    rng = random.Random(seed)
    hasher = get_request_block_hasher(16, sha256)
    kinds = ["full", "mamba_align", "mamba_align"]
    managers = [IMPLEMENTATIONS[impl](mamba_groups_config(2000, kinds), max_model_len=8192,
                                      scheduler_block_size=16, hash_block_size=16, enable_caching=True)
                for impl in ("vllm", "lifecycle")]
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(20, 70))] for _ in range(3)]
    live: dict[str, list[Request]] = {}
    log: list[list[Any]] = [[], []]
    kept = 0
    for number in range(150):
        roll = rng.random()
        if live and (len(live) > 5 or roll < 0.15):
            name = rng.choice(sorted(live))
            for manager, request in zip(managers, live.pop(name)):
                manager.free(request)
        elif live and roll < 0.6:
            name = rng.choice(sorted(live))
            pair = live[name]
            left = pair[0].num_prompt_tokens - pair[0].num_computed_tokens
            drafts = rng.choice([0, 0, 3])
            for k, (manager, request) in enumerate(zip(managers, pair)):
                if left > 0:
                    chunk = left if left <= 16 else left // 16 * 16
                else:
                    if request.num_computed_tokens == request.num_tokens:
                        request.append_output_token_ids(7 + number % 5)
                    chunk = request.num_tokens - request.num_computed_tokens + drafts
                new = manager.allocate_slots(request, chunk)
                log[k].append(("step", name, mamba_masks(new)))
                if new is not None:
                    request.num_computed_tokens = min(request.num_computed_tokens + chunk, request.num_tokens)
        else:
            tokens = rng.choice(prefixes)[: rng.randrange(16, 70)] + [rng.randrange(100, 200)
                                                                    for _ in range(rng.randrange(1, 40))]
            name = str(number)
            pair = []
            for k, manager in enumerate(managers):
                params = SamplingParams(max_tokens=50)
                request = Request(name, tokens, params, None, block_hasher=hasher if k == 0 else None)
                computed, hit, boundary = manager.get_computed_blocks(request)
                end = boundary or (len(tokens) // 16 * 16 if len(tokens) > 16 else len(tokens))
                new = manager.allocate_slots(request, max(end - hit, 1), hit, computed)
                log[k].append(("new", name, hit, boundary, mamba_masks(computed), mamba_masks(new)))
                request.num_computed_tokens = hit + max(end - hit, 1)
                pair.append(request)
            live[name] = pair
        for k, manager in enumerate(managers):
            manager.new_step_starts()
            log[k].append(("zero", len(manager.take_new_block_ids())))
            log[k].append(("tables", [(name, mamba_masks(manager.get_blocks(name)),
                                       manager.estimate_cached_tokens(live[name][k])) for name in sorted(live)]))
        assert log[0] == log[1], number
        used = [round(manager.usage * 1999) for manager in managers]
        assert used[1] - used[0] == kept_ancestors(managers[1]), number
        kept += kept_ancestors(managers[1])
    hits = [entry[2] for entry in log[1] if entry[0] == "new"]
    assert sum(hits) > 0 and any(entry[3] for entry in log[1] if entry[0] == "new")
    assert kept  # (the usage check above was not vacuous)
    for manager, requests in zip(managers, zip(*live.values())):
        for request in requests:
            manager.free(request)
    managers[1].check_invariants()
    assert managers[0].usage == managers[1].usage == 0.0


def kept_ancestors(manager: Any) -> int:
    """Cached attention blocks no request holds that the core cannot evict: ancestors, in its
    trie, of a path a live request cached (vLLM counts them free)."""
    refs = manager.core.pool.refcounts()
    held = {int(b) for live in manager._live.values() for b in manager.core.block_table(live.handle)}
    held |= set(manager._owner)
    cache_only = sum(1 for block, count in enumerate(refs.tolist()) if count == 1 and block and block not in held)
    evictable: int = manager.core.num_evictable_blocks
    return cache_only - evictable


def mamba_scheduler(scheduler_cls: type[Any], model_config: Any, num_blocks: int, async_scheduling: bool,
                    caching: bool) -> Any:
    """``scheduler`` over full attention and two Mamba groups: align mode with prefix caching (the
    scheduler then ends prefill chunks on block boundaries), else mode "none" (the Mamba block is
    the model length, 1024 tokens, and the scheduler's block size their least common multiple)."""
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.structured_output import StructuredOutputManager

    mode = "align" if caching else "none"
    scheduler_config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                                       is_encoder_decoder=False, async_scheduling=async_scheduling)
    cache_config = CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=caching,
                               mamba_cache_mode=mode)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config,
                             device_config=DeviceConfig("cpu"))
    kinds = ["full", f"mamba{'_align' if caching else ''}", f"mamba{'_align' if caching else ''}"]
    groups = mamba_groups_config(num_blocks, kinds)
    if not caching:
        state = MambaSpec(block_size=1024, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="none")
        groups = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            groups.kv_cache_groups[0], KVCacheGroupSpec(["m1"], state), KVCacheGroupSpec(["m2"], state)])
    return scheduler_cls(vllm_config=vllm_config, kv_cache_config=groups, log_stats=True,
                         structured_output_manager=StructuredOutputManager(vllm_config),
                         block_size=16 if caching else 1024)


@pytest.mark.parametrize("abort_every", [0, 5], ids=["", "aborts"])
@pytest.mark.parametrize("caching", [True, False], ids=["align", "none"])
@pytest.mark.parametrize("num_blocks", [40, 80, 400])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_vllms_scheduler_over_a_full_and_mamba_config(model_config: Any, async_scheduling: bool, num_blocks: int,
                                                      caching: bool, abort_every: int) -> None:
    """The scheduler comparison on full attention + two Mamba groups, vLLM's manager against the
    facade, with every schedule's block tables compared by shape (where the null block is, in
    every group) and the count of blocks to zero. In mode "none" (one Mamba block a request, no
    caching) and with room to spare in align mode (400 blocks) every step is the same, usage
    included. With 40 or 80 blocks in align mode the schedules part where the pool runs short: a
    request that missed for want of a Mamba state recomputes a prefix whose attention blocks are
    cached, and its copies are cached below the core's (a trie), which keeps those cached-only
    blocks while a request below them lives; vLLM counts them free. Then both finish the same
    requests, and the facade leaks nothing."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from lifecycle.integrations.vllm import LifecycleMambaKVCacheManager, scheduler_class

    own_class = AsyncScheduler if async_scheduling else Scheduler
    depth = 2 if async_scheduling else 1
    for seed in (1, 2):
        theirs = drive(mamba_scheduler(own_class, model_config, num_blocks, async_scheduling, caching), seed, depth,
                       abort_every, tables=True)
        lifecycle = mamba_scheduler(scheduler_class(async_scheduling), model_config, num_blocks, async_scheduling,
                                    caching)
        manager = lifecycle.kv_cache_manager
        assert isinstance(manager, LifecycleMambaKVCacheManager)
        ours = drive(lifecycle, seed, depth, abort_every, tables=True)
        finished = [sorted(r for entry in log if entry[0] == "finished" for r in entry[1]) for log in (theirs, ours)]
        if num_blocks == 400 or not caching:
            assert ours == theirs
        elif not abort_every:
            assert finished[0] == finished[1] and len(finished[1]) == 24
        hits = sum(n for entry in ours if entry[0] == "scheduled" for _, n in entry[2])
        assert (hits > 0) == caching
        manager.check_invariants()
        assert manager.usage == 0.0 and len(manager._live) == 0
        assert lifecycle.reset_prefix_cache() and manager.core.num_cached_blocks == 0
        assert manager.core.num_live_sequences == 0


@pytest.mark.parametrize("caching", [True, False], ids=["align", "none"])
def test_vllms_engine_core_reads_the_mamba_facades_groups_at_start_up(model_config: Any, caching: bool) -> None:
    """EngineCore's start-up reads over full + Mamba groups: the attention block size, and each
    group's kind and block size (a "none"-mode Mamba block is the model length)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from lifecycle.integrations.vllm import scheduler_class

    answers = []
    for scheduler_cls in (Scheduler, scheduler_class(False)):
        core = type("Core", (), {})()
        core.scheduler = mamba_scheduler(scheduler_cls, model_config, 40, False, caching)
        core.vllm_config = core.scheduler.vllm_config
        EngineCore._initialize_effective_attention_block_size(core)
        answers.append((core.vllm_config.cache_config.effective_attention_block_size,
                        EngineCore.get_kv_cache_group_metadata(core)))
    assert answers[0] == answers[1] and answers[0][0] == 16
    assert [group["block_size"] for group in answers[1][1]] == [16, *[16 if caching else 1024] * 2]
