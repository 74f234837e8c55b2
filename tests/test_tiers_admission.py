"""What enters the store and when: admission by reuse (or a prefix marked to keep), write-through
as an option, keys that expire, and prefetch ahead of admission."""

from __future__ import annotations

from typing import Any

import pytest
from store_server import StoreServer, running_server, shared, store  # noqa: F401

from model_fixtures import models  # noqa: F401
from lifecycle import AttentionLayer, HybridModel, ModelConfig, SequenceState
from lifecycle.errors import ConfigError, InvalidId
from lifecycle.tiers.store import DEFAULT_TTL_S

BS = 4
CONFIG = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=BS, num_blocks=12, max_seqs=4,
    max_blocks_per_seq=12, name="admission",
)
SECRET = b"the admission tests' secret"
PROMPT = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 7]  # three whole blocks and a token


def build(models: list[HybridModel], url: str, **store_options: Any) -> HybridModel:
    model = HybridModel(
        CONFIG, "host", host_tier_blocks=16, store=url, tier_secret=SECRET, store_options=store_options or None
    )
    models.append(model)
    return model


def serve(model: HybridModel, tokens: list[int] = PROMPT) -> tuple[SequenceState, int]:
    seq = model.alloc_sequence_for(len(tokens) + 1)
    return seq, model.attach_prefix(seq, tokens, grow_to=len(tokens))


def cache(model: HybridModel, tokens: list[int] = PROMPT) -> int:
    seq, reused = serve(model, tokens)
    model.finish_sequence(seq)
    return reused


def demote_all(model: HybridModel) -> None:
    model.reclaim_prefix_blocks(CONFIG.num_blocks_resolved)
    assert model.flush_store()


def stored_keys(store: StoreServer) -> int:
    with store.client() as client:
        return len(client.keys("lifecycle:*"))


def test_a_block_used_once_does_not_enter_the_store(models: list[HybridModel], store: StoreServer) -> None:
    model = build(models, store.url)
    cache(model)
    demote_all(model)
    assert model.host_tier is not None and model.host_tier.num_blocks == 3 and stored_keys(store) == 0


def test_a_block_reused_on_the_device_enters_the_store_when_it_leaves(
    models: list[HybridModel], store: StoreServer
) -> None:
    model = build(models, store.url)
    cache(model)
    assert cache(model) == 3 * BS  # reused on the device
    demote_all(model)
    assert stored_keys(store) == 3


def test_a_block_reused_from_the_host_tier_enters_the_store(models: list[HybridModel], store: StoreServer) -> None:
    model = build(models, store.url)
    cache(model)
    demote_all(model)
    assert cache(model) == 3 * BS and model.stats().host_hit_blocks == 3
    assert model.flush_store() and stored_keys(store) == 3


def test_a_prefix_marked_to_keep_enters_the_store_unused(models: list[HybridModel], store: StoreServer) -> None:
    model = build(models, store.url)
    cache(model, [41, 42, 43, 44, 7])  # something in the host tier: the lookup past the device runs
    seq, _ = serve(model)
    tiers = model.tiers
    assert tiers is not None
    tiers.keep(seq.handle)
    model.finish_sequence(seq)
    demote_all(model)
    assert stored_keys(store) == 3


def test_write_through_stores_every_block_entering_the_host_tier(
    models: list[HybridModel], store: StoreServer
) -> None:
    model = build(models, store.url, admit="all")
    cache(model)
    demote_all(model)
    assert stored_keys(store) == 3


def test_an_unknown_admission_is_refused(models: list[HybridModel], store: StoreServer) -> None:
    with pytest.raises(ConfigError, match="admit='sometimes' must be one of"):
        build(models, store.url, admit="sometimes")


def test_keys_live_a_day_by_default(models: list[HybridModel], store: StoreServer) -> None:
    model = build(models, store.url, admit="all")
    cache(model)
    demote_all(model)
    with store.client() as client:
        ttls = [client.ttl(key) for key in client.keys("lifecycle:*")]
    assert len(ttls) == 3 and all(DEFAULT_TTL_S - 60 < ttl <= DEFAULT_TTL_S for ttl in ttls)


def test_keys_without_a_ttl_never_expire(models: list[HybridModel], store: StoreServer) -> None:
    model = build(models, store.url, admit="all", ttl_s=None)
    cache(model)
    demote_all(model)
    with store.client() as client:
        assert [client.ttl(key) for key in client.keys("lifecycle:*")] == [-1] * 3


# -- prefetch -----------------------------------------------------------------------------------------


def published(models: list[HybridModel], url: str) -> None:
    writer = build(models, url, admit="all")
    cache(writer)
    demote_all(writer)


def test_a_prefetched_prompt_is_admitted_without_a_round_trip(models: list[HybridModel], store: StoreServer) -> None:
    published(models, store.url)
    reader = build(models, store.url)
    assert reader.prefetch_prefix(PROMPT) == 3
    tiers = reader.tiers
    assert tiers is not None and tiers.store is not None
    assert tiers.store.wait_prefetched()
    requests = tiers.store.stats().get_requests
    seq, reused = serve(reader)
    reader.finish_sequence(seq)
    stats = tiers.store.stats()
    assert reused == 3 * BS and reader.stats().store_hit_blocks == 3
    assert stats.prefetched == 3 and stats.get_requests == requests + 1 and stats.get_blocks == 3


def test_a_prefetch_of_what_the_host_tier_holds_asks_nothing(models: list[HybridModel], store: StoreServer) -> None:
    model = build(models, store.url)
    cache(model)
    demote_all(model)
    assert model.prefetch_prefix(PROMPT) == 0


def test_a_prefetch_still_on_its_way_is_a_miss_not_a_wait(models: list[HybridModel], store: StoreServer) -> None:
    published(models, store.url)
    reader = build(models, store.url)
    tiers = reader.tiers
    assert tiers is not None and tiers.store is not None
    store.pause()  # the read cannot complete
    try:
        assert reader.prefetch_prefix(PROMPT) == 3
        seq, reused = serve(reader)  # admission does not wait for it, nor read the same blocks again
        reader.finish_sequence(seq)
    finally:
        store.resume()
    assert reused == 0 and tiers.store.stats().misses == 3
    assert tiers.store.wait_prefetched()


def test_a_prefetch_names_the_adapter_and_salt_of_its_admission(
    models: list[HybridModel], store: StoreServer
) -> None:
    published(models, store.url)
    reader = build(models, store.url)
    assert reader.prefetch_prefix(PROMPT, cache_salt="tenant-a") == 3  # not what was published
    tiers = reader.tiers
    assert tiers is not None and tiers.store is not None and tiers.store.wait_prefetched()
    assert cache(reader, PROMPT) == 3 * BS and tiers.store.stats().prefetched == 0  # read at admission instead


def test_a_prefetch_of_bad_tokens_is_refused(models: list[HybridModel], store: StoreServer) -> None:
    reader = build(models, store.url)
    with pytest.raises(InvalidId, match="out of range"):
        reader.prefetch_prefix([1, 2, -3, 4, 5])


def test_a_model_without_a_store_prefetches_nothing(models: list[HybridModel]) -> None:
    model = HybridModel(CONFIG, "host", host_tier_blocks=4)
    models.append(model)
    assert model.prefetch_prefix(PROMPT) == 0
