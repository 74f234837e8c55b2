"""The model's engine surface (issues 16 and 17): KV events with adapters, cache salts and
multimodal keys, the operational calls, engine-owned tables, per-tier stats, and the host tier and
shared store under the KV pool, checked down to the bytes a promoted block holds.

Stores are real Valkey / Redis servers (tests/store_server.py); every test ends with
``check_invariants`` and a teardown that leaked nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from model_fixtures import models  # noqa: F401
from lifecycle import AttentionLayer, HybridModel, ModelConfig, SequenceState
from lifecycle.lora import adapter_key
from lifecycle.cache_keys import IDENTITY_TOKEN_BASE, identity_tokens, salted_key
from lifecycle.cli import main as cli_main
from lifecycle.errors import ConfigError, InvalidId, SequenceStateError
from lifecycle.events import AllBlocksCleared, BlockRemoved, BlockStored
from lifecycle.presets import preset
from event_index import EventIndex
from kvcache_support import colliding_blocks
from store_server import StoreServer, running_server

BS = 4
CONFIG = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=1, head_dim=8), AttentionLayer(num_kv_heads=2, head_dim=4)),
    block_size=BS,
    num_blocks=12,
    max_seqs=4,
    max_blocks_per_seq=12,
    num_adapter_slots=2,
    name="surface",
)


def prompt(*rows: int, last: int = 7) -> list[int]:
    """Whole blocks (block ``r`` holds ``r*10 ...``) and one more token."""
    return [row * 10 + i for row in rows for i in range(BS)] + [last]


#: Stores written behind every block entering the host tier (not only reused ones).
WRITE_THROUGH = {"admit": "all"}


def build(models: list[HybridModel], **options: object) -> HybridModel:
    model = HybridModel(CONFIG, "host", **options)  # type: ignore[arg-type]
    models.append(model)
    return model


def serve(model: HybridModel, tokens: list[int], **attach: object) -> tuple[SequenceState, int]:
    seq = model.alloc_sequence_for(len(tokens) + 1)
    reused = model.attach_prefix(seq, tokens, grow_to=len(tokens), **attach)  # type: ignore[arg-type]
    return seq, reused


def fill_kv(model: HybridModel, seq: SequenceState, seed: int) -> dict[int, list[bytes]]:
    """Write distinct bytes into every layer of the sequence's blocks; returns them by block
    position."""
    kv = model.kv_pool
    assert kv is not None
    written: dict[int, list[bytes]] = {}
    rng = np.random.default_rng(seed)
    for position, block in enumerate(seq.block_table.tolist()):
        written[position] = []
        for layer in range(kv.num_layers):
            view = np.asarray(kv.kv_view(layer))
            view[block] = rng.integers(0, 2**15, view[block].shape).astype(view.dtype)
            written[position].append(view[block].tobytes())
    return written


def kv_bytes(model: HybridModel, seq: SequenceState, position: int) -> list[bytes]:
    kv = model.kv_pool
    assert kv is not None
    block = int(seq.block_table[position])
    return [np.asarray(kv.kv_view(layer))[block].tobytes() for layer in range(kv.num_layers)]


# -- events ----------------------------------------------------------------------------------------


def test_events_name_the_adapter_and_follow_the_cache(models: list[HybridModel]) -> None:
    model = build(models, events=True)
    slot = model.load_adapter("support-bot")
    seq = model.alloc_sequence_for(16)
    model.bind_adapter(seq, slot)
    model.attach_prefix(seq, prompt(1, 2, 3), grow_to=13)
    hashes = seq.block_hashes().tolist()
    model.finish_sequence(seq)
    [stored] = model.take_events(data_parallel_rank=3).events
    assert isinstance(stored, BlockStored)
    assert list(stored.block_hashes) == hashes and stored.parent_block_hash is None
    assert (stored.lora_name, stored.lora_id) == ("support-bot", adapter_key("support-bot", 1))
    assert list(stored.token_ids) == prompt(1, 2, 3)[:12] and stored.medium == "GPU"
    assert model.reclaim_prefix_blocks(2) == 2
    [removed] = model.take_events().events
    assert isinstance(removed, BlockRemoved) and set(removed.block_hashes) <= set(hashes)
    assert model.reset_prefix_cache() is True
    assert [type(e) for e in model.take_events().events] == [AllBlocksCleared]
    assert model.take_events().events == ()


def cache_with_adapter(model: HybridModel, slot: int, tokens: list[int]) -> tuple[list[int], int]:
    """Serve and finish ``tokens`` under the adapter in ``slot``; its block hashes and reused tokens."""
    seq = model.alloc_sequence_for(len(tokens))
    model.bind_adapter(seq, slot)
    reused = model.attach_prefix(seq, tokens, grow_to=len(tokens))
    hashes: list[int] = seq.block_hashes().tolist()
    model.finish_sequence(seq)
    return hashes, reused


def test_reloading_an_adapter_takes_the_old_generations_blocks_out_of_the_stream(models: list[HybridModel]) -> None:
    model, index = build(models, events=True, host_tier_blocks=8), EventIndex(BS)
    tokens = prompt(1, 2, 3)
    first = model.load_adapter("support-bot")
    demoted, _ = cache_with_adapter(model, first, tokens)
    model.reclaim_prefix_blocks(100)  # generation 1's blocks go down to the host tier
    cached, reused = cache_with_adapter(model, first, tokens)  # and are promoted back
    assert cached == demoted and reused == 3 * BS
    index.apply(model.take_events().events)
    assert index.holds("GPU") == index.holds("CPU") == set(demoted)
    slot = model.load_adapter("support-bot")  # generation 2: no request matches generation 1's blocks again
    index.apply(model.take_events().events)
    assert index.holds("GPU") == index.holds("CPU") == set()
    fresh, reused = cache_with_adapter(model, slot, tokens)
    assert reused == 0 and not set(fresh) & set(demoted)
    model.reclaim_prefix_blocks(100)  # both generations' blocks leave the device
    index.apply(model.take_events().events)  # no removal of a block the stream no longer holds
    tiers = model.tiers
    assert tiers is not None and index.holds("GPU") == set()
    held = tiers.held_hashes()
    assert index.holds("CPU") == {h for h in fresh if h in held} and all(h in held for h in demoted)
    assert {index.tiers["CPU"][h].lora_name for h in index.holds("CPU")} == {"support-bot"}


def test_loading_an_unloaded_adapter_again_retires_its_salted_blocks_too(models: list[HybridModel]) -> None:
    model, index = build(models, events=True), EventIndex(BS)
    seq = model.alloc_sequence_for(16)
    model.bind_adapter(seq, model.load_adapter("support-bot"))
    model.attach_prefix(seq, prompt(1, 2), grow_to=9, cache_salt="tenant-a")
    hashes = seq.block_hashes().tolist()
    model.finish_sequence(seq)
    index.apply(model.take_events().events)
    assert index.holds("GPU") == set(hashes) and index.tiers["GPU"][hashes[0]].extra_keys == ("tenant-a",)
    model.unload_adapter("support-bot")
    model.load_adapter("support-bot")  # a new generation, as a reload makes
    index.apply(model.take_events().events)
    assert index.holds("GPU") == set() and model.core.num_cached_blocks == 2  # unreachable, and unpublished
    model.reclaim_prefix_blocks(100)
    index.apply(model.take_events().events)  # their eviction is not published a second time
    assert model.core.num_cached_blocks == 0


def test_without_events_the_batch_is_empty(models: list[HybridModel]) -> None:
    model = build(models)
    seq, _ = serve(model, prompt(1, 2))
    model.finish_sequence(seq)
    batch = model.take_events(data_parallel_rank=1)
    assert batch.events == () and batch.data_parallel_rank == 1


# -- identity beyond tokens -------------------------------------------------------------------------


def test_a_cache_salt_keeps_same_token_blocks_apart(models: list[HybridModel]) -> None:
    model = build(models, events=True)
    first, _ = serve(model, prompt(1, 2, 3), cache_salt="tenant-a")
    salted_hashes = first.block_hashes().tolist()
    model.finish_sequence(first)
    other, reused = serve(model, prompt(1, 2, 3), cache_salt=b"tenant-b")
    assert reused == 0 and other.block_hashes().tolist() != salted_hashes
    model.finish_sequence(other)
    plain, reused = serve(model, prompt(1, 2, 3))
    assert reused == 0
    model.finish_sequence(plain)
    again = model.alloc_sequence_for(16)
    assert model.attach_prefix(again, prompt(1, 2, 3), cache_salt="tenant-a") == 3 * BS
    # A retried attach must bring the same salt.
    assert model.attach_prefix(again, prompt(1, 2, 3), cache_salt="tenant-a") == 3 * BS
    with pytest.raises(SequenceStateError, match="another cache salt"):
        model.attach_prefix(again, prompt(1, 2, 3), cache_salt="tenant-b")
    model.finish_sequence(again)
    assert salted_key(0, "tenant-a") != salted_key(0, "tenant-b") != 0
    assert len(model.take_events().events) == 3  # three distinct stores, no store for the hit


def test_multimodal_inputs_are_part_of_a_blocks_identity(models: list[HybridModel]) -> None:
    model = build(models)
    tokens = prompt(1, 2, 3)
    cat, _ = serve(model, tokens, mm_keys=[(b"cat.png", 4, 8)])
    assert all(t >= IDENTITY_TOKEN_BASE for t in cat.tokens[4:8].tolist())
    model.finish_sequence(cat)
    dog, reused = serve(model, tokens, mm_keys=[(b"dog.png", 4, 8)])
    assert reused == BS  # the block before the image only
    model.finish_sequence(dog)
    cat_again, reused = serve(model, tokens, mm_keys=[(b"cat.png", 4, 8)])
    assert reused == 3 * BS
    model.finish_sequence(cat_again)
    shifted = identity_tokens([0] * 12, [("cat.png", 8, 12)])[8:].tolist()
    assert shifted == identity_tokens([0] * 8, [("cat.png", 4, 8)])[4:].tolist()  # position within the span only
    for bad in ([("x", 4, 3)], [("x", 0, 99)], [("x", 0, 4), ("y", 2, 6)], [(1.5, 0, 2)], [("x", 0)]):
        seq = model.alloc_sequence_for(16)
        with pytest.raises(InvalidId):
            model.attach_prefix(seq, tokens, mm_keys=bad)  # type: ignore[arg-type]
        model.free_sequence(seq)


# -- operational calls -----------------------------------------------------------------------------


def test_reset_refuses_while_a_cached_prefix_is_in_use(models: list[HybridModel]) -> None:
    model = build(models, host_tier_blocks=8)
    first, _ = serve(model, prompt(1, 2, 3))
    model.finish_sequence(first)
    holder, reused = serve(model, prompt(1, 2, 9))
    assert reused == 2 * BS
    cached = model.stats().blocks_cached
    assert model.reset_prefix_cache() is False
    assert model.stats().blocks_cached == cached and model.core.num_cached_blocks == 3
    model.finish_sequence(holder)
    assert model.reset_prefix_cache() is True
    host = model.host_tier
    assert model.core.num_cached_blocks == 0 and host is not None and host.num_blocks == 0


def test_evict_blocks_and_common_prefix_through_the_model(models: list[HybridModel]) -> None:
    model = build(models)
    first, _ = serve(model, prompt(1, 2, 3))
    table = first.block_table.tolist()
    model.finish_sequence(first)
    a, _ = serve(model, prompt(1, 2, 5))
    b, _ = serve(model, prompt(1, 2, 6))
    assert model.num_common_prefix_blocks([a, b]) == 2
    model.finish_sequence(a)
    model.finish_sequence(b)
    dropped = model.evict_blocks([table[1]]).tolist()
    assert table[1] in dropped and table[2] in dropped and table[0] not in dropped


def test_write_block_table_into_an_engine_row(models: list[HybridModel]) -> None:
    model = build(models)
    seq, _ = serve(model, prompt(1, 2))
    rows = np.full((2, 6), 99, dtype=np.int32)
    assert model.write_block_table(seq, rows[1], pad=0) == 3
    assert rows[1].tolist() == seq.block_table.tolist() + [0, 0, 0] and rows[0].tolist() == [99] * 6
    with pytest.raises(InvalidId):
        model.write_block_table(seq, rows[1, :2])
    model.finish_sequence(seq)


def test_stats_read_and_reset_for_an_exporter(models: list[HybridModel]) -> None:
    model = build(models)
    seq, _ = serve(model, prompt(1, 2))
    model.finish_sequence(seq)
    assert model.stats(reset=True).prefix_lookups == 1
    assert model.stats().prefix_lookups == 0
    seq, reused = serve(model, prompt(1, 2))
    model.finish_sequence(seq)
    since = model.stats(reset=True)
    assert (since.prefix_lookups, since.prefix_hit_tokens, since.sequences_allocated) == (1, reused, 1)
    assert model.stats().prefix_lookups == 0


def test_streams_and_events_are_accepted_on_the_host_device(models: list[HybridModel]) -> None:
    model = build(models)
    with model.use_stream(7):
        seq, _ = serve(model, prompt(1))
    model.record_event(5)
    model.wait_event(5)
    with pytest.raises(InvalidId, match="not a stream"):
        with model.use_stream(None):
            pass
    model.finish_sequence(seq)


# -- the host tier ----------------------------------------------------------------------------------


def test_evicted_blocks_come_back_from_the_host_tier_with_their_bytes(models: list[HybridModel]) -> None:
    model = build(models, host_tier_blocks=16, events=True)
    tokens = prompt(1, 2, 3, 4)
    first, reused = serve(model, tokens)
    assert reused == 0
    written = fill_kv(model, first, seed=5)
    model.finish_sequence(first)
    for row in range(5, 9):  # other prompts push the first one's blocks out of the device pool
        seq, _ = serve(model, prompt(row * 3, row * 3 + 1, row * 3 + 2, row * 3 + 3))
        fill_kv(model, seq, seed=row)
        model.finish_sequence(seq)
    stats = model.stats()
    assert stats.blocks_demoted >= 4
    again, reused = serve(model, tokens)
    stats = model.stats()
    device_tokens = reused - stats.blocks_promoted * BS
    assert reused == 4 * BS and stats.blocks_promoted > 0 and stats.host_hit_blocks == stats.blocks_promoted
    assert again.num_cached_tokens == reused
    for position in range(device_tokens // BS, 4):
        assert kv_bytes(model, again, position) == written[position]
    model.finish_sequence(again)
    kinds = {(type(e).__name__, getattr(e, "medium", None)) for e in model.take_events().events}
    assert {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU")} <= kinds
    assert model.reclaim_prefix_blocks_for(tokens, -1, 5).host_blocks >= 0


def test_tiers_refuse_what_they_cannot_serve() -> None:
    hybrid = preset("tiny-hybrid")
    with pytest.raises(ConfigError, match="SSM"):  # its snapshots stay in the host tier
        HybridModel(hybrid, "host", host_tier_blocks=4, store="redis://127.0.0.1:1")
    with pytest.raises(ConfigError, match="host tier"):
        HybridModel(CONFIG, "host", store="redis://127.0.0.1:1")
    with pytest.raises(ConfigError, match="host_tier_blocks"):
        HybridModel(CONFIG, "host", host_tier_blocks=-1)


# -- the shared store -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    with running_server(tmp_path_factory.mktemp("valkey")) as server:
        yield server


def test_two_models_share_prefixes_through_the_store(models: list[HybridModel], store: StoreServer) -> None:
    with store.client() as client:
        client.flushall()
    writer = build(models, host_tier_blocks=16, store=store.url, store_options=WRITE_THROUGH)
    reader = build(models, host_tier_blocks=16, store=store.url, store_options=WRITE_THROUGH)
    tokens = prompt(1, 2, 3, 4)
    seq, _ = serve(writer, tokens)
    written = fill_kv(writer, seq, seed=11)
    writer.finish_sequence(seq)
    writer.reclaim_prefix_blocks(100)  # demoted into the host tier, written behind to the store
    assert writer.flush_store()
    copy, reused = serve(reader, tokens)
    assert reused == 4 * BS and reader.stats().store_hit_blocks == 4
    for position in range(4):
        assert kv_bytes(reader, copy, position) == written[position]
    reader.finish_sequence(copy)


def test_blocks_loaded_from_the_store_are_host_tier_stores_with_their_tokens_and_parents(
    models: list[HybridModel], store: StoreServer
) -> None:
    with store.client() as client:
        client.flushall()
    writer = build(models, host_tier_blocks=16, store=store.url, store_options=WRITE_THROUGH)
    reader = build(models, host_tier_blocks=16, store=store.url, store_options=WRITE_THROUGH, events=True)
    index = EventIndex(BS)
    tokens = prompt(1, 2, 3, 4)
    seq, _ = serve(writer, tokens)
    writer.finish_sequence(seq)
    writer.reclaim_prefix_blocks(100)
    assert writer.flush_store()
    copy, reused = serve(reader, tokens)
    hashes = copy.block_hashes().tolist()
    reader.finish_sequence(copy)
    assert reused == 4 * BS and reader.stats().store_hit_blocks == 4
    index.apply(reader.take_events().events)
    tiers = reader.tiers
    assert tiers is not None and index.holds("CPU") == set(hashes) == tiers.held_hashes()
    assert index.holds("GPU") == set(hashes) and index.check_hashes("CPU") == 4
    assert [index.tiers["CPU"][h].parent for h in hashes] == [None, *hashes[:-1]]


def test_a_block_whose_hash_collides_with_a_host_entry_is_served_the_stores_kv_not_the_entrys(
    models: list[HybridModel], store: StoreServer
) -> None:
    with store.client() as client:
        client.flushall()
    ours, theirs = colliding_blocks(BS)  # other tokens, one content hash: a collision built on purpose
    reader = build(models, host_tier_blocks=16, store=store.url, store_options=WRITE_THROUGH)
    writer = build(models, host_tier_blocks=16, store=store.url, store_options=WRITE_THROUGH)
    held, _ = serve(reader, [*ours, 7])
    fill_kv(reader, held, seed=3)
    held_hashes = held.block_hashes().tolist()
    reader.finish_sequence(held)
    reader.reclaim_prefix_blocks(100)  # the reader's host tier holds its block under the hash
    assert reader.flush_store()
    theirs_seq, _ = serve(writer, [*theirs, 7])
    assert theirs_seq.block_hashes().tolist() == held_hashes
    written = fill_kv(writer, theirs_seq, seed=4)
    writer.finish_sequence(theirs_seq)
    writer.reclaim_prefix_blocks(100)  # the store's record under the hash is now the writer's block
    assert writer.flush_store()
    served, reused = serve(reader, [*theirs, 7])
    assert reused == BS and reader.stats().store_hit_blocks == 1  # the host entry was refused, the record verified
    assert kv_bytes(reader, served, 0) == written[0]
    reader.finish_sequence(served)


def test_models_of_one_byte_format_but_other_names_never_share_blocks(
    models: list[HybridModel], store: StoreServer
) -> None:
    with store.client() as client:
        client.flushall()
    def named(name: str) -> HybridModel:
        model = HybridModel(
            CONFIG.replace(name=name), "host", host_tier_blocks=16, store=store.url, store_options=WRITE_THROUGH
        )
        models.append(model)
        return model

    llama, mistral, twin = named("llama"), named("mistral"), named("llama")
    assert llama.config.fingerprint() == mistral.config.fingerprint()  # the same bytes per block
    tokens = prompt(1, 2, 3, 4)
    seq, _ = serve(llama, tokens)
    llama.finish_sequence(seq)
    llama.reclaim_prefix_blocks(100)
    assert llama.flush_store()
    other, reused = serve(mistral, tokens)
    assert reused == 0 and mistral.stats().store_hit_blocks == 0
    mistral.finish_sequence(other)
    copy, reused = serve(twin, tokens)  # the same model, name and bytes, still shares
    assert reused == 4 * BS and twin.stats().store_hit_blocks == 4
    twin.finish_sequence(copy)


def test_a_store_that_went_away_costs_misses_only(models: list[HybridModel], tmp_path: Path) -> None:
    with running_server(tmp_path / "valkey") as server:
        model = build(models, host_tier_blocks=2, store=server.url)
        seq, _ = serve(model, prompt(1, 2, 3, 4))
        model.finish_sequence(seq)
        model.reclaim_prefix_blocks(100)
        server.stop()
        again, reused = serve(model, prompt(1, 2, 3, 4))
        assert reused <= 2 * BS  # what the host tier kept; the store counts a miss
        model.finish_sequence(again)


# -- the main job ---------------------------------------------------------------------------------


def test_simulate_reports_the_host_tier(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(
        ["simulate", "--model", "small-attention", "--requests", "60", "--blocks", "96", "--host-tier-mb", "16",
         "--json", "--check-every", "10"]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["pools"]["host_tier_blocks"] == 256 and summary["leaked"] == 0
    assert summary["host_hit_tokens"] > 0 and summary["hit_rate_with_tiers"] > summary["prefix_hit_rate"]
