"""Tier keys and the checks behind them: a crafted collision of the core's chained content hash,
or a block of another namespace (model name, weights, adapter, cache salt, multimodal input),
is a miss in the host tier and in the store, with nothing leaked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvcache_support import colliding_blocks
from store_server import StoreServer, running_server, shared, store  # noqa: F401

from model_fixtures import models  # noqa: F401
from lifecycle import AttentionLayer, HybridModel, ModelConfig, SequenceState
from lifecycle._tierkey import chain_keys, siphash128
from lifecycle.errors import ConfigError, InvalidId
from lifecycle.tiers.keys import TierKeys, namespace_of

BS = 4
CONFIG = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=1, head_dim=8), AttentionLayer(num_kv_heads=2, head_dim=4)),
    block_size=BS,
    num_blocks=12,
    max_seqs=4,
    max_blocks_per_seq=12,
    num_adapter_slots=2,
    name="keys",
)
SECRET = b"a deployment's secret, 16+ bytes"
WRITE_THROUGH = {"admit": "all"}
M64 = (1 << 64) - 1


# -- the keyed hash, as docs/tiers.md says it -----------------------------------------------------------


def _round(v: list[int]) -> list[int]:
    def rotl(x: int, b: int) -> int:
        return ((x << b) | (x >> (64 - b))) & M64

    v0, v1, v2, v3 = v
    v0 = (v0 + v1) & M64
    v1 = rotl(v1, 13) ^ v0
    v0 = rotl(v0, 32)
    v2 = (v2 + v3) & M64
    v3 = rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & M64
    v3 = rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & M64
    v1 = rotl(v1, 17) ^ v2
    v2 = rotl(v2, 32)
    return [v0, v1, v2, v3]


def reference_siphash128(data: bytes, k0: int, k1: int, c: int = 1, d: int = 3) -> tuple[int, int]:
    """SipHash-c-d with a 128-bit output (the reference's ``siphash128``), in plain Python."""
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D ^ 0xEE, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]
    n = len(data)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, n - n % 8, 8)]
    words.append(int.from_bytes(data[n - n % 8 :], "little") | (n & 0xFF) << 56)
    for m in words:
        v[3] ^= m
        for _ in range(c):
            v = _round(v)
        v[0] ^= m
    v[2] ^= 0xEE
    for _ in range(d):
        v = _round(v)
    high = v[0] ^ v[1] ^ v[2] ^ v[3]
    v[1] ^= 0xDD
    for _ in range(d):
        v = _round(v)
    return high, v[0] ^ v[1] ^ v[2] ^ v[3]


def test_the_reference_is_siphash_by_its_published_vector() -> None:
    key = bytes(range(16))
    high, low = reference_siphash128(b"", int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little"), 2, 4)
    assert (high.to_bytes(8, "little") + low.to_bytes(8, "little")).hex() == "a3817f04ba25a8e66df67214c7550293"


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 24, 31])
def test_siphash128_is_the_reference(length: int) -> None:
    data = bytes(range(100, 100 + length))
    assert siphash128(data, 0x0706050403020100, 0x0F0E0D0C0B0A0908) == reference_siphash128(
        data, 0x0706050403020100, 0x0F0E0D0C0B0A0908
    )


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_chain_keys_hash_each_block_after_its_parents_key(block_size: int) -> None:
    tokens = ((np.arange(4 * block_size, dtype=np.int64) * 7919) % (1 << 31)).astype(np.int32)
    keys = chain_keys(tokens, block_size, 11, 22, 33, 44).tolist()
    parent = (33, 44)
    for block, key in enumerate(keys):
        row = tokens[block * block_size : (block + 1) * block_size].astype("<i4").tobytes()
        parent = reference_siphash128(parent[0].to_bytes(8, "little") + parent[1].to_bytes(8, "little") + row, 11, 22)
        assert tuple(key) == parent


def test_chain_keys_refuse_tokens_that_are_not_whole_blocks() -> None:
    with pytest.raises(InvalidId, match="whole blocks of block_size=4"):
        chain_keys(np.zeros(6, np.int32), 4, 0, 0, 0, 0)


def test_keys_depend_on_the_secret() -> None:
    tokens = np.arange(8, dtype=np.int32)
    ours, same, theirs = TierKeys(CONFIG, secret=SECRET), TierKeys(CONFIG, secret=SECRET), TierKeys(CONFIG)
    assert (ours.chain(tokens, ours.root(0)) == same.chain(tokens, same.root(0))).all()
    assert not (ours.chain(tokens, ours.root(0)) == theirs.chain(tokens, theirs.root(0))).any()


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        TierKeys(CONFIG, secret=b"short")


def test_the_namespace_names_model_weights_and_byte_format() -> None:
    names = {
        namespace_of(CONFIG), namespace_of(CONFIG, "weights-v2"), namespace_of(CONFIG.replace(name="other")),
        namespace_of(CONFIG.replace(block_size=8)),
    }
    assert len(names) == 4 and namespace_of(CONFIG, b"weights-v2") == namespace_of(CONFIG, "weights-v2")


# -- models ---------------------------------------------------------------------------------------


def build(models: list[HybridModel], config: ModelConfig = CONFIG, **options: Any) -> HybridModel:
    model = HybridModel(config, "host", host_tier_blocks=16, tier_secret=SECRET, **options)
    models.append(model)
    return model


def serve(model: HybridModel, tokens: list[int], **attach: Any) -> tuple[SequenceState, int]:
    seq = model.alloc_sequence_for(len(tokens) + 1)
    reused = model.attach_prefix(seq, tokens, grow_to=len(tokens), **attach)
    return seq, reused


def cache(model: HybridModel, tokens: list[int], **attach: Any) -> list[int]:
    """Serve and finish ``tokens``; returns their block hashes."""
    seq, _ = serve(model, tokens, **attach)
    hashes: list[int] = seq.block_hashes().tolist()
    model.finish_sequence(seq)
    return hashes


def demote_all(model: HybridModel) -> None:
    model.reclaim_prefix_blocks(CONFIG.num_blocks_resolved)


FILLER = [3000 + i for i in range(BS)]


def collided(model: HybridModel, ours: list[int], theirs: list[int]) -> int:
    """Cache ``ours`` + a block after it, demote it, put ``theirs`` (same content hash) on the
    device, and admit ``theirs`` + the same block: returns the tokens reused."""
    first = cache(model, [*ours, *FILLER, 7])
    demote_all(model)  # the host tier (and the store) hold the filler block computed after ``ours``
    model.flush_store()
    cache(model, [*theirs, 7])  # ``theirs`` is on the device, the filler block is not
    seq, reused = serve(model, [*theirs, *FILLER, 7])
    assert seq.block_hashes().tolist() == first  # the chained hash collides for both blocks
    model.finish_sequence(seq)
    return reused


def test_a_crafted_collision_of_the_chained_hash_is_a_host_tier_miss(models: list[HybridModel]) -> None:
    ours, theirs = colliding_blocks(BS)
    model = build(models)
    assert collided(model, ours, theirs) == BS  # the device's block only: the filler after ``ours`` is not served
    assert model.stats().host_hit_blocks == 0


def test_the_same_prefix_is_a_host_tier_hit(models: list[HybridModel]) -> None:
    ours, _ = colliding_blocks(BS)
    model = build(models)
    assert collided(model, ours, ours) == 2 * BS  # the control: same tokens, the filler is promoted
    assert model.stats().host_hit_blocks == 2  # the first block when it was put back, then the filler


# -- the store ----------------------------------------------------------------------------------------


def test_a_crafted_collision_of_the_chained_hash_is_a_store_miss(models: list[HybridModel], store: StoreServer) -> None:
    ours, theirs = colliding_blocks(BS)
    writer = build(models, store=store.url, store_options=WRITE_THROUGH)
    cache(writer, [*ours, *FILLER, 7])
    demote_all(writer)
    assert writer.flush_store()
    reader = build(models, store=store.url, store_options=WRITE_THROUGH)
    cache(reader, [*theirs, 7])
    seq, reused = serve(reader, [*theirs, *FILLER, 7])
    reader.finish_sequence(seq)
    assert reused == BS and reader.stats().store_hit_blocks == 0


PROMPT = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 7]
Options = dict[str, Any]


def model_of(models: list[HybridModel], url: str, options: Options) -> HybridModel:
    """A model on the store at ``url``: ``options`` may name its ``config`` and ``tier_secret``."""
    options = dict(options)
    config, secret = options.pop("config", CONFIG), options.pop("tier_secret", SECRET)
    store_options = options.pop("store_options", WRITE_THROUGH)
    model = HybridModel(
        config, "host", host_tier_blocks=16, tier_secret=secret, store=url, store_options=store_options, **options
    )
    models.append(model)
    return model


def serve_prompt(model: HybridModel, options: Options) -> None:
    """Serve and finish ``PROMPT`` with ``options`` of the attach (an ``adapter`` name is loaded
    and bound first)."""
    options = dict(options)
    seq = model.alloc_sequence_for(len(PROMPT) + 1)
    adapter = options.pop("adapter", None)
    if adapter is not None:
        model.bind_adapter(seq, model.load_adapter(adapter))
    model.attach_prefix(seq, PROMPT, grow_to=len(PROMPT), **options)
    model.finish_sequence(seq)


Side = tuple[Options, Options]


def store_hits(models: list[HybridModel], url: str, writer: Side, reader: Side) -> int:
    """Blocks of ``PROMPT`` a model (``reader``: its options and its attach's) finds in the store
    after another (``writer``) cached and demoted them."""
    first = model_of(models, url, writer[0])
    serve_prompt(first, writer[1])
    demote_all(first)
    assert first.flush_store()
    second = model_of(models, url, reader[0])
    serve_prompt(second, reader[1])
    return second.stats().store_hit_blocks


MM = [(b"image-a", 0, 4)]
#: (the writer's model and attach options, the reader's), differing in one part of the namespace.
FOREIGN: dict[str, tuple[Side, Side]] = {
    "model name": (({}, {}), ({"config": CONFIG.replace(name="keys-finetune")}, {})),
    "weights": (({"weights_fingerprint": "w1"}, {}), ({"weights_fingerprint": "w2"}, {})),
    "secret": (({}, {}), ({"tier_secret": b"another deployment's secret"}, {})),
    "adapter": (({}, {"adapter": "tenant-a"}), ({}, {"adapter": "tenant-b"})),
    "no adapter": (({}, {"adapter": "tenant-a"}), ({}, {})),
    "salt": (({}, {"cache_salt": "tenant-a"}), ({}, {"cache_salt": "tenant-b"})),
    "mm keys": (({}, {"mm_keys": MM}), ({}, {"mm_keys": [(b"image-b", 0, 4)]})),
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_foreign_namespace_finds_nothing_in_the_store(
    models: list[HybridModel], store: StoreServer, case: str
) -> None:
    writer, reader = FOREIGN[case]
    assert store_hits(models, store.url, writer, reader) == 0


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_the_same_namespace_shares_the_store(models: list[HybridModel], store: StoreServer, case: str) -> None:
    writer, _ = FOREIGN[case]  # the control: the reader as the writer
    assert store_hits(models, store.url, writer, writer) == 3


def test_a_record_moved_under_another_key_is_foreign(models: list[HybridModel], store: StoreServer) -> None:
    writer = model_of(models, store.url, {})
    serve_prompt(writer, {})
    demote_all(writer)
    assert writer.flush_store()
    with store.client() as client:
        keys = sorted(client.keys("lifecycle:*"))
        values = [client.get(key) for key in keys]
        for key, value in zip(keys, [*values[1:], values[0]]):  # every record under another block's key
            client.set(key, value)
    reader = model_of(models, store.url, {})
    serve_prompt(reader, {})
    tiers = reader.tiers
    assert tiers is not None and tiers.store is not None
    assert reader.stats().store_hit_blocks == 0 and tiers.store.stats().foreign >= 1


def test_store_keys_expire(models: list[HybridModel], store: StoreServer) -> None:
    writer = model_of(models, store.url, {"store_options": {**WRITE_THROUGH, "ttl_s": 3600}})
    serve_prompt(writer, {})
    demote_all(writer)
    assert writer.flush_store()
    with store.client() as client:
        ttls = [client.ttl(key) for key in client.keys("lifecycle:*")]
    assert len(ttls) == 3 and all(0 < ttl <= 3600 for ttl in ttls)
