"""HostTier: whole blocks kept in host memory by key, verified by key, parent and tokens, LRU, and the
copies to and from the device pool (on every device the suites run on)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from devices import device, live_allocations, read_device, write_device  # noqa: F401

from event_index import EventIndex
from model_fixtures import models  # noqa: F401
from lifecycle.config import AttentionLayer, IndexerLayer, MLALayer, ModelConfig, SSMLayer
from lifecycle.device.allocations import CopyArray
from lifecycle.device.base import Copy, Device
from lifecycle.device.host import HostDevice, physical_memory_bytes
from lifecycle.errors import (
    BlockIdOutOfRange, ConfigError, DeviceError, InvalidId, RetentionError, TornDown, Unsupported,
)
from lifecycle.events import AllBlocksCleared, BlockStored, KVEvent
from lifecycle.model import HybridModel
from lifecycle.pools import KVPool
from lifecycle.tiers.host import HostTier
from lifecycle.tiers.records import BlockRecord

BLOCK_SIZE = 4
NUM_BLOCKS = 16
# Two layers of different sizes, so that a slot's layer offsets matter.
CONFIG = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=2, head_dim=8), AttentionLayer(num_kv_heads=1, head_dim=4, dtype="float32")),
    block_size=BLOCK_SIZE,
    num_blocks=NUM_BLOCKS,
)


def fill_pool(dev: Device, pool: KVPool, seed: int) -> None:
    """Random bytes in every block of every layer."""
    rng = np.random.default_rng(seed)
    for layer, ptr in enumerate(pool.layer_ptrs):
        write_device(dev, ptr, rng.integers(0, 256, NUM_BLOCKS * pool.layer_block_bytes(layer), dtype=np.uint8))


def block_bytes(dev: Device, pool: KVPool, block: int) -> bytes:
    """Every layer's bytes of device block ``block``, layer after layer (a host slot's layout)."""
    return b"".join(
        read_device(dev, pool.block_addr(layer, block), pool.layer_block_bytes(layer)).tobytes()
        for layer in range(pool.num_layers)
    )


def tokens_of(*blocks: int) -> npt.NDArray[np.int32]:
    """Distinct tokens per block number."""
    return np.array([[100 * b + i for i in range(BLOCK_SIZE)] for b in blocks], dtype=np.int32)


@pytest.fixture
def pool(device: Device) -> Iterator[KVPool]:  # noqa: F811
    kv = KVPool(device, CONFIG)
    fill_pool(device, kv, seed=1)
    yield kv
    kv.release()


def make_tier(pool: KVPool, capacity: int = 8) -> HostTier:
    return HostTier(pool.device, pool, capacity, BLOCK_SIZE)


@pytest.fixture
def tier(pool: KVPool) -> Iterator[HostTier]:
    host = make_tier(pool)
    yield host
    host.check_invariants()
    host.close()


# -- demote and lookup -------------------------------------------------------------------------------


def test_demoted_blocks_are_found_with_their_tokens(tier: HostTier) -> None:
    assert tier.demote([11, 12, 13], [0, 1, 2], tokens_of(0, 1, 2)) == 3
    tier.check_invariants()
    assert tier.lookup([11, 12, 13], tokens_of(0, 1, 2)) == 3


def test_lookup_counts_the_leading_run_only(tier: HostTier) -> None:
    tier.demote([11, 13], [0, 2], tokens_of(0, 2))
    assert tier.lookup([11, 12, 13], tokens_of(0, 1, 2)) == 1


def test_a_hash_with_other_tokens_is_a_miss(tier: HostTier) -> None:
    tier.demote([11, 12], [0, 1], tokens_of(0, 1))
    assert tier.lookup([11, 12], tokens_of(0, 7)) == 1
    assert tier.stats().collisions == 1


def test_lookup_counts_blocks_asked_and_hit(tier: HostTier) -> None:
    tier.demote([11], [0], tokens_of(0))
    tier.lookup([11, 12], tokens_of(0, 1))
    stats = tier.stats()
    assert (stats.lookups, stats.hits) == (2, 1)


def test_a_block_already_held_is_not_stored_again(tier: HostTier) -> None:
    tier.demote([11], [0], tokens_of(0))
    assert tier.demote([11], [3], tokens_of(0)) == 0
    assert tier.stats().duplicates == 1


def test_a_hash_repeated_in_one_batch_is_stored_once(tier: HostTier) -> None:
    assert tier.demote([11, 11], [0, 1], tokens_of(0, 0)) == 1
    tier.check_invariants()
    assert tier.num_blocks == 1


def test_listeners_hear_the_hashes_a_demote_stored(tier: HostTier) -> None:
    heard: list[list[int]] = []
    tier.subscribe(heard.append)
    tier.demote([11], [0], tokens_of(0))
    tier.demote([11, 12], [0, 1], tokens_of(0, 1))
    assert heard == [[11], [12]]


# -- copies ------------------------------------------------------------------------------------------


def test_promote_copies_every_layer_of_the_demoted_blocks(tier: HostTier, pool: KVPool) -> None:
    dev = pool.device
    expected = [block_bytes(dev, pool, block) for block in (0, 5)]
    tier.demote([11, 12], [0, 5], tokens_of(0, 5))
    tier.promote([11, 12], [9, 3], tokens_of(0, 5))
    assert [block_bytes(dev, pool, block) for block in (9, 3)] == expected


# DeepSeek-V3.2's one full group: MLA latent rows and indexer pages, each of its own bytes per block.
MLA_CONFIG = ModelConfig(
    layers=(
        MLALayer(kv_lora_rank=16, qk_rope_head_dim=4), IndexerLayer(head_dim=8),
        MLALayer(kv_lora_rank=8, qk_rope_head_dim=4, dtype="float32"),
    ),
    block_size=BLOCK_SIZE,
    num_blocks=NUM_BLOCKS,
)


def test_an_mla_and_indexer_pools_blocks_round_trip_through_the_tier(device: Device) -> None:  # noqa: F811
    pool = KVPool(device, MLA_CONFIG)
    try:
        assert len({pool.layer_block_bytes(layer) for layer in range(pool.num_layers)}) == 3
        fill_pool(device, pool, seed=3)
        tier = make_tier(pool)
        try:
            sent = [block_bytes(device, pool, block) for block in (2, 5)]
            tier.demote([21, 22], [2, 5], tokens_of(2, 5))
            fill_pool(device, pool, seed=4)  # other bytes everywhere: only the promote can bring them back
            tier.promote([21, 22], [9, 0], tokens_of(2, 5))
            assert [block_bytes(device, pool, block) for block in (9, 0)] == sent
            tier.check_invariants()
        finally:
            tier.close()
    finally:
        pool.release()


def test_an_mla_models_evicted_prefix_comes_back_from_the_host_tier_byte_for_byte(
    models: list[HybridModel],  # noqa: F811
) -> None:
    model = HybridModel(MLA_CONFIG, "host", host_tier_blocks=8)
    models.append(model)
    pool, dev = model.kv_pool, model.device
    assert pool is not None
    prompt = list(range(3 * BLOCK_SIZE + 1))
    seq = model.alloc_sequence_for(len(prompt) + 1)
    model.attach_prefix(seq, prompt, grow_to=len(prompt))
    fill_pool(dev, pool, seed=5)
    sent = [block_bytes(dev, pool, int(block)) for block in seq.block_table[:3]]
    model.finish_sequence(seq)
    model.reclaim_prefix_blocks(NUM_BLOCKS)  # the cached blocks go to the host tier
    assert model.core.num_cached_blocks == 0
    fill_pool(dev, pool, seed=6)
    again = model.alloc_sequence_for(len(prompt) + 1)
    assert model.attach_prefix(again, prompt, grow_to=len(prompt)) == 3 * BLOCK_SIZE
    assert [block_bytes(dev, pool, int(block)) for block in again.block_table[:3]] == sent
    model.free_sequence(again)
    model.check_invariants()


def test_a_pool_whose_blocks_are_not_packed_is_refused_naming_the_layer(pool: KVPool) -> None:
    class Strided:  # a KV pool's face with room between blocks
        def __getattr__(self, name: str) -> object:
            return getattr(pool, name)

        def layer_strides(self, layer: int) -> tuple[int, ...]:
            strides = pool.layer_strides(layer)
            return (strides[0] * 2, *strides[1:]) if layer == 1 else strides

    nbytes = pool.layer_block_bytes(1)
    expected = rf"layer 1 of the KV pool \(shaped .*\) steps {2 * nbytes} bytes .* holds {nbytes}"
    with pytest.raises(Unsupported, match=expected):
        HostTier(pool.device, Strided(), 8, BLOCK_SIZE)  # type: ignore[arg-type]


def test_demote_has_copied_before_it_returns(tier: HostTier, pool: KVPool) -> None:
    dev = pool.device
    expected = block_bytes(dev, pool, 4)
    tier.demote([11], [4], tokens_of(4))
    fill_pool(dev, pool, seed=2)  # the device block is reused at once
    tier.promote([11], [4], tokens_of(4))
    assert block_bytes(dev, pool, 4) == expected


def test_promoted_blocks_stay_in_the_tier(tier: HostTier) -> None:
    tier.demote([11], [0], tokens_of(0))
    tier.promote([11], [1], tokens_of(0))
    assert tier.lookup([11], tokens_of(0)) == 1


def test_stats_count_the_bytes_moved(tier: HostTier) -> None:
    tier.demote([11, 12], [0, 1], tokens_of(0, 1))
    tier.promote([12], [2], tokens_of(1), parent=11)
    stats = tier.stats()
    assert (stats.bytes_demoted, stats.bytes_promoted) == (2 * tier.block_bytes, tier.block_bytes)


def test_promote_of_an_absent_hash_names_it_and_copies_nothing(tier: HostTier, pool: KVPool) -> None:
    tier.demote([11], [0], tokens_of(0))
    before = block_bytes(pool.device, pool, 7)
    with pytest.raises(InvalidId, match="0x000000000000000c"):
        tier.promote([11, 12], [6, 7], tokens_of(0, 1))
    assert block_bytes(pool.device, pool, 7) == before
    assert tier.stats().promoted == 0


def test_a_block_id_out_of_range_is_refused_before_anything_changes(tier: HostTier) -> None:
    with pytest.raises(BlockIdOutOfRange, match=f"block id {NUM_BLOCKS} .* 0..{NUM_BLOCKS - 1}"):
        tier.demote([11, 12], [0, NUM_BLOCKS], tokens_of(0, 1))
    assert tier.num_blocks == 0


def test_a_block_id_given_twice_is_refused(tier: HostTier) -> None:
    tier.demote([11, 12], [0, 1], tokens_of(0, 1))
    with pytest.raises(InvalidId, match="block id 3 is given more than once"):
        tier.promote([11, 12], [3, 3], tokens_of(0, 1))


def test_tokens_of_another_count_of_blocks_are_refused(tier: HostTier) -> None:
    with pytest.raises(InvalidId, match="2 blocks of block_size=4"):
        tier.demote([11, 12], [0, 1], tokens_of(0))


def test_a_negative_token_id_is_refused(tier: HostTier) -> None:
    with pytest.raises(InvalidId, match="token id -1"):
        tier.lookup([11], np.full(BLOCK_SIZE, -1, dtype=np.int64))


def test_a_hash_outside_64_bits_is_refused(tier: HostTier) -> None:
    with pytest.raises(InvalidId, match=r"\[0, 2\*\*64\)"):
        tier.lookup([1 << 64], tokens_of(0))


def _slow_forms(hashes: list[int], ids: npt.NDArray[np.int64], tokens: npt.NDArray[np.int32],
                parents: list[int] | None) -> tuple[Any, Any, Any, Any]:
    """The same arguments in forms the index's fast path does not read (a tuple, a list of lists):
    the call takes the checked path."""
    return tuple(hashes), tuple(ids.tolist()), tokens.tolist(), None if parents is None else tuple(parents)


def test_the_fast_path_does_what_the_checked_path_does(pool: KVPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """demote and promote with lists and arrays (read by the index in one pass) store, evict,
    count, copy and refuse exactly as with the same arguments in other forms (checked in Python)."""
    import lifecycle.tiers.host as host_module

    checked = getattr(host_module, "tier_key_rows")
    fallbacks = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        fallbacks[0] += 1
        return checked(*args, **kwargs)

    monkeypatch.setattr(host_module, "tier_key_rows", counted)
    fast, slow = make_tier(pool, capacity=6), make_tier(pool, capacity=6)
    rng = np.random.default_rng(7)
    held: list[tuple[list[int], npt.NDArray[np.int32], list[int] | None]] = []
    for step in range(300):
        count = int(rng.integers(1, 5))
        hashes = [int(h) for h in rng.integers(1, 40, count)]  # repeats and keys held already
        hashes[0] |= int(rng.integers(0, 2)) << 63  # a high bit set: the full 64-bit range
        ids = rng.choice(NUM_BLOCKS, count, replace=False).astype(np.int64)
        tokens = rng.integers(0, 3, (count, BLOCK_SIZE)).astype(np.int32)
        parents = None if rng.integers(0, 2) else [int(p) for p in rng.integers(0, 40, count)]
        calls = fallbacks[0]
        got = fast.demote(hashes, ids if step % 2 else ids.tolist(), tokens, parents)
        assert fallbacks[0] == calls  # the fast path took it
        assert got == slow.demote(*_slow_forms(hashes, ids, tokens, parents))
        assert fallbacks[0] == calls + 1 + (parents is not None)  # the checked path took these
        held.append((hashes, tokens, parents))
        assert fast.stats() == slow.stats()
        assert np.array_equal(fast._index.lru_order(), slow._index.lru_order())
        fast.check_invariants()
        slow.check_invariants()
        # promote a batch demoted earlier: the same copies, or the same refusal (an entry gone or
        # another block than asked)
        hashes, tokens, parents = held[int(rng.integers(0, len(held)))]
        targets = rng.choice(NUM_BLOCKS, len(hashes), replace=False).astype(np.int64)
        outcome: list[object] = []
        for tier, forms in ((fast, (hashes, targets, tokens, parents)),
                            (slow, _slow_forms(hashes, targets, tokens, parents))):
            calls = fallbacks[0]
            try:
                tier.promote(forms[0], forms[1], forms[2], parents=forms[3])
                outcome.append([block_bytes(pool.device, pool, int(b)) for b in targets])
                assert tier is slow or fallbacks[0] == calls  # a promote that copies: the fast path
            except InvalidId as error:
                outcome.append(str(error))
        assert outcome[0] == outcome[1]
        assert fast.stats() == slow.stats()
    counts = fast.stats()
    assert counts.promoted > 20 and counts.duplicates > 20 and counts.evicted > 100  # every case was exercised
    # refusals in the fast forms name the same values and change nothing
    bad_calls: list[tuple[Any, ...]] = [
        ([1, 2], [0, NUM_BLOCKS], tokens_of(0, 1), None),
        ([1, 2], [3, 3], tokens_of(0, 1), None),
        ([1, 2], [-1, 3], tokens_of(0, 1), None),
        ([1, -2], [0, 1], tokens_of(0, 1), None),
        ([1, 1 << 64], [0, 1], tokens_of(0, 1), None),
        ([1, True], [0, 1], tokens_of(0, 1), None),
        ([1, 2], [0, 1], tokens_of(0), None),
        ([1, 2], [0, 1], -tokens_of(0, 1) - 1, None),
        ([1, 2], [0, 1], tokens_of(0, 1), [5]),
        ([1, 2], [0, 1.0], tokens_of(0, 1), None),
    ]
    refused = 0
    for call in bad_calls:
        outcomes: list[object] = []
        given: tuple[Any, Any] = (call[3], None if call[3] is None else tuple(call[3]))
        for tier, parents in zip((fast, slow), given):
            before = (tier.stats(), tier._index.lru_order().tolist())
            try:
                outcomes.append(tier.demote(call[0], call[1], call[2], parents))
            except InvalidId as error:  # named as the checked path names it, nothing changed
                outcomes.append((type(error), str(error)))
                assert (tier.stats(), tier._index.lru_order().tolist()) == before
        assert outcomes[0] == outcomes[1]
        refused += isinstance(outcomes[0], tuple)
        assert fast.stats() == slow.stats()
    assert refused == len(bad_calls) - 1  # all but the bool, which the checked path reads as 1
    fast.close()
    with pytest.raises(TornDown):
        fast.demote([1], [0], tokens_of(0))
    with pytest.raises(TornDown):
        fast.promote([1], [0], tokens_of(0))
    slow.close()


# -- eviction ----------------------------------------------------------------------------------------


def test_the_least_recently_used_entry_is_evicted(pool: KVPool) -> None:
    with make_tier(pool, capacity=2) as tier:
        tier.demote([11, 12], [0, 1], tokens_of(0, 1))
        tier.lookup([11], tokens_of(0))  # 12 is now the least recently used
        tier.demote([13], [2], tokens_of(2))
        tier.check_invariants()
        assert (11 in tier, 12 in tier, 13 in tier) == (True, False, True)
        assert tier.stats().evicted == 1


def test_a_lookup_leaves_the_first_block_most_recent(pool: KVPool) -> None:
    with make_tier(pool, capacity=2) as tier:
        tier.demote([11, 12], [0, 1], tokens_of(0, 1))
        tier.lookup([11, 12], tokens_of(0, 1))
        tier.demote([13], [2], tokens_of(2))
        assert (11 in tier, 12 in tier) == (True, False)


def test_a_batch_larger_than_the_tier_keeps_its_last_blocks(pool: KVPool) -> None:
    with make_tier(pool, capacity=2) as tier:
        assert tier.demote([11, 12, 13], [0, 1, 2], tokens_of(0, 1, 2)) == 2
        tier.check_invariants()
        assert tier.lookup([12, 13], tokens_of(1, 2), parent=11) == 2


def test_an_evicted_slot_holds_the_new_block(pool: KVPool) -> None:
    dev = pool.device
    with make_tier(pool, capacity=1) as tier:
        tier.demote([11], [0], tokens_of(0))
        tier.demote([12], [1], tokens_of(1))
        tier.promote([12], [8], tokens_of(1))
        assert block_bytes(dev, pool, 8) == block_bytes(dev, pool, 1)


# -- records -----------------------------------------------------------------------------------------


def test_read_blocks_gives_tokens_and_bytes_of_held_blocks(tier: HostTier, pool: KVPool) -> None:
    tier.demote([11], [3], tokens_of(3))
    held, absent = tier.read_blocks([11, 12])
    assert absent is None and held is not None
    assert (held.key, held.parent) == ((11, 0), (0, 0))
    assert held.tokens.tolist() == tokens_of(3)[0].tolist()
    assert held.kv == block_bytes(pool.device, pool, 3)


def test_loaded_records_promote_like_demoted_blocks(tier: HostTier, pool: KVPool) -> None:
    kv = bytes(range(256)) * (tier.block_bytes // 256) + bytes(tier.block_bytes % 256)
    assert tier.load([BlockRecord((21, 0), (0, 0), tokens_of(1)[0], kv)]) == 1
    tier.check_invariants()
    assert tier.lookup([21], tokens_of(1)) == 1
    tier.promote([21], [5], tokens_of(1))
    assert block_bytes(pool.device, pool, 5) == kv


def test_a_record_of_another_size_is_refused(tier: HostTier) -> None:
    with pytest.raises(InvalidId, match=f"a block takes {tier.block_bytes}"):
        tier.load([BlockRecord((21, 0), (0, 0), tokens_of(1)[0], b"short")])


# -- construction and teardown ----------------------------------------------------------------------


def test_a_tier_larger_than_memory_is_refused(pool: KVPool) -> None:
    too_many = physical_memory_bytes() // pool.layer_block_bytes(0) + 1
    with pytest.raises(ConfigError, match=f"capacity_blocks={too_many} .* this machine has"):
        HostTier(pool.device, pool, too_many, BLOCK_SIZE)


def test_a_tier_of_no_blocks_is_refused(pool: KVPool) -> None:
    with pytest.raises(ConfigError, match="capacity_blocks=0"):
        HostTier(pool.device, pool, 0, BLOCK_SIZE)


def test_a_block_size_other_than_the_pools_is_refused(pool: KVPool) -> None:
    with pytest.raises(ConfigError, match=f"block_size=8 differs from the KV pool's {BLOCK_SIZE}"):
        HostTier(pool.device, pool, 4, 8)


def test_close_frees_the_host_memory(pool: KVPool) -> None:
    before = live_allocations(pool.device)
    tier = make_tier(pool)
    tier.close()
    assert live_allocations(pool.device) == before


def test_calls_after_close_are_refused(pool: KVPool) -> None:
    tier = make_tier(pool)
    tier.close()
    tier.close()
    with pytest.raises(TornDown):
        tier.lookup([11], tokens_of(0))


class FailingCopies(HostDevice):
    """A host device whose batched copies fail once ``fail`` is set."""

    fail = False

    def copy_batch(self, copies: Sequence[Copy] | CopyArray) -> None:
        if self.fail:
            raise DeviceError("copy_batch: injected failure")
        super().copy_batch(copies)


def test_a_failed_demote_copy_leaves_the_tier_consistent() -> None:
    dev = FailingCopies()
    with dev:
        pool = KVPool(dev, CONFIG)
        with make_tier(pool, capacity=2) as tier:
            tier.demote([11, 12], [0, 1], tokens_of(0, 1))
            dev.fail = True
            with pytest.raises(DeviceError, match="injected"):
                tier.demote([13], [2], tokens_of(2))
            tier.check_invariants()
            assert 13 not in tier
        pool.release()


# -- what issue 28 found --------------------------------------------------------------------------------


@pytest.mark.parametrize("block_ids", [[1.5], np.array([1.5]), ["1"]], ids=["float", "float array", "str"])
@pytest.mark.parametrize("call", ["demote", "promote"])
def test_a_block_id_that_is_not_an_int_is_refused_not_truncated(
    tier: HostTier, pool: KVPool, call: str, block_ids: object
) -> None:
    tier.demote([11], [0], tokens_of(0))
    before, stats = block_bytes(pool.device, pool, 1), tier.stats()
    with pytest.raises(InvalidId, match="must be a 1-D sequence of ints"):
        if call == "demote":
            tier.demote([12], block_ids, tokens_of(1))  # type: ignore[arg-type]
        else:
            tier.promote([11], block_ids, tokens_of(0))  # type: ignore[arg-type]
    assert 12 not in tier and tier.stats() == stats and block_bytes(pool.device, pool, 1) == before


def test_promote_refuses_an_entry_holding_other_tokens_and_copies_nothing(tier: HostTier, pool: KVPool) -> None:
    tier.demote([11], [0], tokens_of(0))
    before, stats = block_bytes(pool.device, pool, 5), tier.stats()
    with pytest.raises(InvalidId, match="key 0x000000000000000b as another block"):
        tier.promote([11], [5], tokens_of(1))  # hash 11, but not the block stored under it
    assert block_bytes(pool.device, pool, 5) == before and tier.stats() == stats


def test_a_record_whose_hash_collides_with_an_entry_takes_its_place_and_promotes_its_own_kv(
    tier: HostTier, pool: KVPool
) -> None:
    tier.demote([11], [0], tokens_of(0))
    kv = bytes(range(256)) * (tier.block_bytes // 256) + bytes(tier.block_bytes % 256)
    assert tier.load([BlockRecord((11, 0), (0, 0), tokens_of(1)[0], kv)]) == 1  # verified by the store for tokens_of(1)
    tier.check_invariants()
    assert tier.stats().replaced == 1 and tier.lookup([11], tokens_of(1)) == 1
    tier.promote([11], [5], tokens_of(1))
    assert block_bytes(pool.device, pool, 5) == kv


def test_a_record_of_a_block_held_with_its_tokens_is_a_duplicate(tier: HostTier, pool: KVPool) -> None:
    tier.demote([11], [0], tokens_of(0))
    assert tier.load([BlockRecord((11, 0), (0, 0), tokens_of(0)[0], bytes(tier.block_bytes))]) == 0
    assert tier.stats().duplicates == 1
    tier.promote([11], [5], tokens_of(0))
    assert block_bytes(pool.device, pool, 5) == block_bytes(pool.device, pool, 0)


def test_clear_counts_what_it_dropped_and_the_recount_holds(tier: HostTier) -> None:
    tier.demote([11, 12], [0, 1], tokens_of(0, 1))
    tier.clear()
    tier.check_invariants()
    assert tier.num_blocks == 0 and tier.stats().cleared == 2


def test_recorded_changes_come_in_the_order_they_happened(pool: KVPool) -> None:
    with make_tier(pool, capacity=1) as tier:
        tier.record_changes()
        tier.demote([11], [0], tokens_of(0))
        tier.demote([12], [1], tokens_of(1))  # 11 makes room
        tier.demote([11], [0], tokens_of(0))  # 12 makes room
        tier.load([BlockRecord((11, 0), (0, 0), tokens_of(3)[0], bytes(tier.block_bytes))])  # replaces 11
        assert tier.take_changes() == [
            ("stored", [11]), ("removed", [11]), ("stored", [12]), ("removed", [12]), ("stored", [11]),
            ("removed", [11]), ("stored", [11]),
        ]
        assert tier.take_changes() == []


def test_a_load_larger_than_the_tier_records_only_what_it_keeps(pool: KVPool) -> None:
    with make_tier(pool, capacity=2) as tier:
        tier.record_changes()
        kv = bytes(tier.block_bytes)
        tier.load([BlockRecord((h, 0), (0, 0), tokens_of(b)[0], kv) for b, h in enumerate((21, 22, 23))])
        changes = tier.take_changes()
        held: set[int] = set()
        for kind, hashes in changes:  # replayed in order, as a KV-event consumer does
            held = held | set(hashes) if kind == "stored" else held - set(hashes)
        assert held == {22, 23} == {h for h in (21, 22, 23) if tier.read_blocks([h])[0] is not None}
        tier.check_invariants()


# -- against a model ---------------------------------------------------------------------------------


class HostTierMachine(RuleBasedStateMachine):
    """The tier against an OrderedDict model of an LRU of (hash -> tokens), with the KV bytes of
    every promoted block compared to the device block it was demoted from."""

    CAPACITY = 3

    @initialize()
    def start(self) -> None:
        self.dev = HostDevice(deferred=True)
        self.pool = KVPool(self.dev, CONFIG)
        fill_pool(self.dev, self.pool, seed=3)
        self.tier = make_tier(self.pool, capacity=self.CAPACITY)
        self.model: OrderedDict[int, tuple[int, bytes]] = OrderedDict()  # hash -> (token seed, bytes)

    @rule(hashes=st.lists(st.integers(1, 6), min_size=1, max_size=4), data=st.data())
    def demote(self, hashes: list[int], data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=len(hashes), max_size=len(hashes),
                                    unique=True))
        seeds = [h % 3 for h in hashes]  # hashes 1 and 4 share tokens: equal tokens, other hash
        # every key's parent is the key before it (0 before 1): lookups ask for runs of keys
        stored = self.tier.demote(hashes, blocks, tokens_of(*seeds), parents=[h - 1 for h in hashes])
        fresh: dict[int, tuple[int, bytes]] = {}
        for key, block, seed in zip(hashes, blocks, seeds):
            if key in self.model:
                self.model.move_to_end(key)
            elif key not in fresh:
                fresh[key] = (seed, block_bytes(self.dev, self.pool, block))
        for key in list(fresh)[-self.CAPACITY :]:
            self.model[key] = fresh[key]
            if len(self.model) > self.CAPACITY:
                self.model.popitem(last=False)
        assert stored == min(len(fresh), self.CAPACITY)

    @rule(first=st.integers(1, 6), length=st.integers(1, 4), other_tokens=st.booleans())
    def lookup(self, first: int, length: int, other_tokens: bool) -> None:
        hashes = list(range(first, min(first + length, 7)))
        seeds = [h % 3 for h in hashes]
        if other_tokens:  # the last block's tokens differ from those stored under its hash
            seeds[-1] = 7
        expected = 0
        for key, seed in zip(hashes, seeds):
            if key not in self.model or self.model[key][0] != seed:
                break
            expected += 1
        for key in reversed(hashes[:expected]):
            self.model.move_to_end(key)
        assert self.tier.lookup(hashes, tokens_of(*seeds), parent=first - 1) == expected

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def promote(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        block = data.draw(st.integers(0, NUM_BLOCKS - 1))
        self.tier.promote([key], [block], tokens_of(self.model[key][0]), parent=key - 1)
        assert block_bytes(self.dev, self.pool, block) == self.model[key][1]

    @invariant()
    def consistent(self) -> None:
        self.tier.check_invariants()
        assert self.tier.num_blocks == len(self.model)

    def teardown(self) -> None:
        self.tier.close()
        self.pool.release()
        self.dev.close()


TestHostTierAgainstAModel = HostTierMachine.TestCase


# -- under a model: the host tier's KV events ----------------------------------------------------------

MODEL = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=BLOCK_SIZE, num_blocks=12, max_seqs=4,
    max_blocks_per_seq=12, name="host-tier-events",
)


def tiered(models: list[HybridModel], host_blocks: int, events: bool = True) -> HybridModel:
    model = HybridModel(MODEL, "host", host_tier_blocks=host_blocks, events=events)
    models.append(model)
    return model


def cache_prompt(model: HybridModel, *blocks: int, salt: str | None = None) -> list[int]:
    """Serve and finish a prompt of the whole blocks ``tokens_of(*blocks)`` and one more token;
    returns its block hashes."""
    tokens = [*tokens_of(*blocks).ravel().tolist(), 7]
    seq = model.alloc_sequence_for(len(tokens))
    model.attach_prefix(seq, tokens, grow_to=len(tokens), cache_salt=salt)
    hashes: list[int] = seq.block_hashes().tolist()
    model.finish_sequence(seq)
    return hashes


def demote_everything(model: HybridModel) -> None:
    model.reclaim_prefix_blocks(MODEL.num_blocks_resolved)


def replayed(model: HybridModel, index: EventIndex) -> list[KVEvent]:
    """Replay the window's events into ``index`` and check they tell what every tier holds."""
    events = list(model.take_events().events)
    index.apply(events)
    host, tiers = model.host_tier, model.tiers
    assert host is not None and tiers is not None
    assert len(index.holds("CPU")) == host.num_blocks and index.holds("CPU") == tiers.held_hashes()
    assert len(index.holds("GPU")) == model.core.num_cached_blocks
    model.check_invariants()
    return events


def stored(events: list[KVEvent], medium: str) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def test_a_block_demoted_dropped_and_demoted_again_in_one_window_reads_as_held(models: list[HybridModel]) -> None:
    model, index = tiered(models, host_blocks=2), EventIndex(BLOCK_SIZE)
    (first,) = cache_prompt(model, 1)
    demote_everything(model)
    cache_prompt(model, 2)
    cache_prompt(model, 3)
    demote_everything(model)
    tiers = model.tiers
    assert tiers is not None and first not in tiers.held_hashes()  # the host tier dropped it for room
    cache_prompt(model, 1)
    demote_everything(model)
    assert first in tiers.held_hashes()
    replayed(model, index)
    assert first in index.holds("CPU")


def test_demotions_and_a_reset_in_one_window_end_with_every_tier_cleared(models: list[HybridModel]) -> None:
    model, index = tiered(models, host_blocks=4), EventIndex(BLOCK_SIZE)
    cache_prompt(model, 1, 2)
    demote_everything(model)
    cache_prompt(model, 3)
    assert model.reset_prefix_cache() is True
    events = replayed(model, index)
    assert isinstance(events[-1], AllBlocksCleared) and stored(events, "CPU")
    assert index.holds("CPU") == index.holds("GPU") == set()


def test_what_happens_after_a_reset_in_one_window_follows_its_cleared_event(models: list[HybridModel]) -> None:
    model, index = tiered(models, host_blocks=4), EventIndex(BLOCK_SIZE)
    cache_prompt(model, 1, 2)
    demote_everything(model)
    assert model.reset_prefix_cache() is True
    after = cache_prompt(model, 3)  # the device and then the host tier, after the reset
    demote_everything(model)
    events = replayed(model, index)
    cleared = next(i for i, event in enumerate(events) if isinstance(event, AllBlocksCleared))
    later = events[cleared + 1 :]
    assert [e.medium for e in later if isinstance(e, BlockStored)] == ["GPU", "CPU"]
    assert index.holds("CPU") == set(after) and index.holds("GPU") == set()


def test_every_tiers_events_name_its_medium(models: list[HybridModel]) -> None:
    model, index = tiered(models, host_blocks=4), EventIndex(BLOCK_SIZE)
    hashes = cache_prompt(model, 1, 2)
    demote_everything(model)
    events = replayed(model, index)
    media = [(type(e).__name__, e.medium) for e in events if not isinstance(e, AllBlocksCleared)]
    assert media == [("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU")]
    assert index.holds("CPU") == set(hashes)


def test_a_reset_with_blocks_in_the_host_tier_keeps_its_recount(models: list[HybridModel]) -> None:
    model = tiered(models, host_blocks=4, events=False)
    cache_prompt(model, 1, 2)
    demote_everything(model)
    host = model.host_tier
    assert host is not None and host.num_blocks == 2
    assert model.reset_prefix_cache() is True
    model.check_invariants()
    assert host.num_blocks == 0 and host.stats().cleared == 2


def test_host_tier_stores_carry_their_tokens_and_parents(models: list[HybridModel]) -> None:
    model, index = tiered(models, host_blocks=8), EventIndex(BLOCK_SIZE)
    hashes = cache_prompt(model, 1, 2, 3)
    demote_everything(model)
    replayed(model, index)
    assert index.holds("CPU") == set(hashes) and index.check_hashes("CPU") == 3
    blocks = index.tiers["CPU"]
    assert [blocks[h].parent for h in hashes] == [None, *hashes[:-1]]
    assert [blocks[h].tokens for h in hashes] == [tuple(tokens_of(b)[0].tolist()) for b in (1, 2, 3)]


def test_host_tier_stores_name_each_parent_before_its_children(models: list[HybridModel]) -> None:
    model, index = tiered(models, host_blocks=8), EventIndex(BLOCK_SIZE)
    first, second = cache_prompt(model, 1, 2, 3), cache_prompt(model, 1, 2, 4)  # a branch after two blocks
    replayed(model, index)
    demote_everything(model)  # leaves first: the branches' last blocks, then the shared ones
    events = replayed(model, index)
    seen: set[int] = set()
    for event in stored(events, "CPU"):
        assert event.parent_block_hash is None or event.parent_block_hash in seen
        seen.update(event.block_hashes)
    assert seen == set(first) | set(second) and index.check_hashes("CPU") == 4


def test_a_salted_sequence_names_its_salt_in_its_first_blocks_extra_keys_in_every_tier(
    models: list[HybridModel],
) -> None:
    model, index = tiered(models, host_blocks=8), EventIndex(BLOCK_SIZE)
    hashes = cache_prompt(model, 1, 2, salt="tenant-a")
    (gpu,) = stored(replayed(model, index), "GPU")
    demote_everything(model)
    cpu = stored(replayed(model, index), "CPU")
    for event in (gpu, *cpu):
        assert list(event.block_hashes) == hashes and event.extra_keys == (("tenant-a",), None)


@pytest.mark.parametrize("seed", range(4))
def test_events_through_random_traffic_tell_what_every_tier_holds(models: list[HybridModel], seed: int) -> None:
    model, index, rng = tiered(models, host_blocks=5), EventIndex(BLOCK_SIZE), np.random.default_rng(seed)
    documents = [[1, 2, 3, 4], [1, 2, 5], [6, 7, 8], [9]]
    for _ in range(60):
        action = rng.integers(10)
        if action < 6:
            document = documents[rng.integers(len(documents))]
            cache_prompt(model, *document[: rng.integers(1, len(document) + 1)])
        elif action < 8:
            model.reclaim_prefix_blocks(int(rng.integers(1, 6)))
        elif action == 8:
            model.reset_prefix_cache()
        else:
            replayed(model, index)
    replayed(model, index)
    assert index.check_hashes("CPU") == len(index.holds("CPU"))


@pytest.mark.parametrize("seed", range(3))
def test_the_compiled_drain_demotes_as_the_drain_with_events_does(
    models: list[HybridModel], seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without events or a store a drain demotes the whole log in one compiled call
    (``HostTier.demote_removed``); with events it goes block by block through ``HostTier.demote``.
    Through the same random traffic both hold the same blocks, hit the same and leak nothing."""
    fast, slow = tiered(models, host_blocks=5, events=False), tiered(models, host_blocks=5, events=True)
    calls: list[tuple[str, HostTier]] = []
    real_removed, real_demote = HostTier.demote_removed, HostTier.demote

    def demote_removed(self: HostTier, raw: Any) -> int:
        calls.append(("removed", self))
        return real_removed(self, raw)

    def demote(self: HostTier, *args: Any, **kwargs: Any) -> int:
        calls.append(("demote", self))
        return real_demote(self, *args, **kwargs)

    monkeypatch.setattr(HostTier, "demote_removed", demote_removed)
    monkeypatch.setattr(HostTier, "demote", demote)
    rng = np.random.default_rng(seed)
    documents = [[1, 2, 3, 4], [1, 2, 5], [6, 7, 8], [9], [1, 2, 3, 10, 11]]
    for _ in range(80):
        action = rng.integers(10)
        document = documents[int(rng.integers(len(documents)))]
        length, count = int(rng.integers(1, len(document) + 1)), int(rng.integers(1, 6))
        for model in (fast, slow):
            if action < 7:
                cache_prompt(model, *document[:length])
            elif action < 9:
                model.reclaim_prefix_blocks(count)
            else:
                model.reset_prefix_cache()
        if action == 9 or rng.integers(4) == 0:
            slow.take_events()
        fast_host, slow_host = fast.host_tier, slow.host_tier
        assert fast_host is not None and slow_host is not None
        assert fast_host.stats() == slow_host.stats()
        assert fast_host._index.lru_order().tolist() == slow_host._index.lru_order().tolist()
        fast_stats, slow_stats = fast.stats(), slow.stats()
        for name in ("blocks_demoted", "blocks_promoted", "host_hit_blocks", "prefix_hit_tokens"):
            assert getattr(fast_stats, name) == getattr(slow_stats, name), name
        fast.check_invariants()
        slow.check_invariants()
    assert fast.stats().blocks_demoted > 0 and fast.stats().blocks_promoted > 0
    assert {kind for kind, host in calls if host is fast.host_tier} == {"removed"}
    assert {kind for kind, host in calls if host is slow.host_tier} == {"demote"}


# -- lifecycle simulate ---------------------------------------------------------------------------------


SIMULATE = ["simulate", "--model", "small-attention", "--requests", "60", "--blocks", "96", "--host-tier-mb", "16"]


def test_simulate_splits_the_tiers_time_into_copies_store_reads_and_bookkeeping(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lifecycle.cli import main

    assert main([*SIMULATE, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["host_hit_tokens"] > 0 and summary["store_hit_tokens"] == 0
    assert summary["tier_copy_ns"] > 0 and summary["tier_store_ns"] == 0
    assert summary["tier_ns"] > summary["tier_copy_ns"] + summary["tier_store_ns"]  # bookkeeping is the rest
    assert summary["tier_ns"] <= summary["time_in_library_ns"]


def test_simulate_prints_the_tiers_hits_and_time(capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle.cli import main

    assert main(SIMULATE) == 0
    out = capsys.readouterr().out
    assert "host, +0 store tokens" in out
    assert "tier time per request" in out and "copies" in out and "bookkeeping" in out


def test_a_block_held_after_another_parent_is_a_miss(tier: HostTier) -> None:
    tier.demote([11], [0], tokens_of(0), parents=[5])
    assert tier.lookup([11], tokens_of(0), parent=6) == 0 and tier.stats().collisions == 1
    assert tier.lookup([11], tokens_of(0), parent=5) == 1


def test_promote_checks_each_blocks_own_parent_when_given(tier: HostTier, pool: KVPool) -> None:
    tier.demote([11, 12], [0, 1], tokens_of(0, 1), parents=[0, 0])  # two blocks of no chain
    tier.promote([12, 11], [4, 5], tokens_of(1, 0), parents=[0, 0])
    assert block_bytes(pool.device, pool, 4) == block_bytes(pool.device, pool, 1)
    with pytest.raises(InvalidId, match="another block"):
        tier.promote([12], [6], tokens_of(1), parents=[11])


# -- hybrid models: SSM snapshots beside the blocks -----------------------------------------------------

HYBRID = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=1, head_dim=8), SSMLayer(h_state_bytes=256, conv_state_bytes=64)),
    block_size=BLOCK_SIZE, num_blocks=12, max_seqs=4, max_blocks_per_seq=12, name="hybrid-host-tier",
)


def hybrid(models: list[HybridModel], host_blocks: int = 8) -> HybridModel:
    model = HybridModel(HYBRID, "host", host_tier_blocks=host_blocks)
    models.append(model)
    return model


def slot_state(model: HybridModel, slot: int) -> bytes:
    ssm = model.ssm_pool
    assert ssm is not None
    return b"".join(model.device.host_array(addr, nbytes).tobytes() for addr, nbytes in ssm.slot_ranges(slot))


def set_slot_state(model: HybridModel, slot: int, seed: int) -> bytes:
    ssm = model.ssm_pool
    assert ssm is not None
    rng = np.random.default_rng(seed)
    for addr, nbytes in ssm.slot_ranges(slot):
        model.device.host_array(addr, nbytes)[:] = rng.integers(1, 256, nbytes, dtype=np.uint8)
    return slot_state(model, slot)


def finish_whole(model: HybridModel, blocks: int, seed: int) -> tuple[list[int], bytes]:
    """Serve a prompt of ``blocks`` whole blocks (its last token generated), give the slot the state
    after them and finish; returns the tokens and that state."""
    tokens = tokens_of(*range(1, blocks + 1)).ravel().tolist()
    seq = model.alloc_sequence_for(len(tokens))
    model.attach_prefix(seq, tokens[:-1], grow_to=len(tokens))
    seq.append_tokens([tokens[-1]])
    state = set_slot_state(model, seq.slot_idx, seed)
    model.finish_sequence(seq)
    return tokens, state


def test_a_hybrid_model_reuses_blocks_and_ssm_state_from_the_host_tier(models: list[HybridModel]) -> None:
    model = hybrid(models)
    tokens, state = finish_whole(model, 3, seed=5)
    model.reclaim_prefix_blocks(HYBRID.num_blocks_resolved)  # the device's blocks and snapshot are gone
    assert model.core.num_cached_blocks == 0 and model.core.num_snapshots_used == 0
    seq = model.alloc_sequence_for(len(tokens) + 2)
    set_slot_state(model, seq.slot_idx, seed=99)
    reused = model.attach_prefix(seq, [*tokens, 7], grow_to=len(tokens) + 1)
    assert reused == 3 * BLOCK_SIZE and model.stats().host_hit_blocks == 3
    assert slot_state(model, seq.slot_idx) == state  # the state after those blocks, restored
    model.free_sequence(seq)


def test_a_hybrid_run_ends_at_the_last_block_with_a_snapshot(models: list[HybridModel]) -> None:
    model = hybrid(models)
    tokens, state = finish_whole(model, 2, seed=5)  # a snapshot after block 2
    longer = [*tokens, *tokens_of(3).ravel().tolist()]
    seq = model.alloc_sequence_for(len(longer) + 1)
    model.attach_prefix(seq, longer, grow_to=len(longer))
    model.free_sequence(seq)  # block 3 cached on the device, its state never known: no snapshot after it
    model.reclaim_prefix_blocks(HYBRID.num_blocks_resolved)
    assert model.reclaim_prefix_blocks_for([*longer, 7], -1, 4).host_blocks == 2  # what attach will promote
    again = model.alloc_sequence_for(len(longer) + 2)
    reused = model.attach_prefix(again, [*longer, 7], grow_to=len(longer) + 1)
    assert reused == 2 * BLOCK_SIZE and slot_state(model, again.slot_idx) == state
    model.free_sequence(again)


def test_a_hybrid_prefix_without_a_snapshot_is_not_reused_from_the_host_tier(models: list[HybridModel]) -> None:
    model = hybrid(models)
    tokens = tokens_of(1, 2).ravel().tolist()
    seq = model.alloc_sequence_for(len(tokens) + 2)
    model.attach_prefix(seq, [*tokens, 7], grow_to=len(tokens) + 1)  # the state consumed 9 tokens
    model.finish_sequence(seq)
    model.reclaim_prefix_blocks(HYBRID.num_blocks_resolved)
    again = model.alloc_sequence_for(len(tokens) + 2)
    assert model.attach_prefix(again, [*tokens, 7], grow_to=len(tokens) + 1) == 0
    model.free_sequence(again)


def test_a_hybrid_model_takes_no_store() -> None:
    with pytest.raises(ConfigError, match="SSM layers reuses from the host tier"):
        HybridModel(HYBRID, "host", host_tier_blocks=8, store="redis://127.0.0.1:1")


def test_simulate_runs_the_small_hybrid_preset_with_a_host_tier(capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle.cli import main

    args = ["simulate", "--model", "small-hybrid", "--requests", "60", "--blocks", "96", "--host-tier-mb", "16"]
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["leaked"] == 0 and summary["pools"]["host_tier_blocks"] > 0
    assert summary["host_hit_tokens"] > 0


# -- retention's minimum priority for demotion ---------------------------------------------------------


def cache_prompt_at(model: HybridModel, priority: int, *blocks: int) -> list[int]:
    """``cache_prompt`` with the whole prompt kept at retention ``priority``."""
    tokens = [*tokens_of(*blocks).ravel().tolist(), 7]
    seq = model.alloc_sequence_for(len(tokens))
    model.attach_prefix(seq, tokens, grow_to=len(tokens))
    model.set_retention(seq, [(0, len(tokens) - 1, priority)])
    hashes: list[int] = seq.block_hashes().tolist()
    model.finish_sequence(seq)
    return hashes


@pytest.mark.parametrize(("minimum", "low_kept"), [(0, True), (50, False)])
def test_only_blocks_at_the_tier_min_priority_or_above_go_down(
    models: list[HybridModel], minimum: int, low_kept: bool
) -> None:
    model = tiered(models, host_blocks=8)
    model.set_tier_min_priority(minimum)
    low = cache_prompt_at(model, 20, 1, 2)
    high = cache_prompt_at(model, 80, 3, 4)
    demote_everything(model)
    tiers = model.tiers
    assert tiers is not None and model.core.num_cached_blocks == 0
    assert set(high) <= tiers.held_hashes()
    assert (set(low) <= tiers.held_hashes()) is low_kept and (set(low) & tiers.held_hashes() == set()) is not low_kept
    assert model.host_tier is not None and model.host_tier.num_blocks == len(high) + (len(low) if low_kept else 0)
    replayed(model, EventIndex(BLOCK_SIZE))  # the events tell the same: a dropped block left every tier


@pytest.mark.parametrize("bad", [-1, 101, True, 2.5, None])
def test_a_bad_tier_min_priority_is_refused_and_the_old_one_stands(models: list[HybridModel], bad: object) -> None:
    model = tiered(models, host_blocks=8, events=False)
    model.set_tier_min_priority(40)
    with pytest.raises(RetentionError, match=rf"demote_min_priority must be an int in \[0, 100\], got {bad!r}"):
        model.set_tier_min_priority(bad)  # type: ignore[arg-type]
    assert model.core.demote_min_priority == 40
