"""HybridModel over several KV cache groups: a pool per group, tables per group, stats and
invariants per group (lifecycle/kv_groups.py, lifecycle/pools.py); swap: tests/test_swap_groups.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lifecycle import HybridModel
from lifecycle.config import AttentionLayer, MLALayer, ModelConfig, SlidingWindowLayer
from lifecycle.errors import InvalidId, Unsupported
from lifecycle.kv_groups import core_groups
from lifecycle.pools import KVPool

FULL = AttentionLayer(num_kv_heads=2, head_dim=8)
SWA = SlidingWindowLayer(num_kv_heads=2, head_dim=8, window=16)
BLOCK = 4


def config(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "layers": (SWA, FULL, SWA, FULL),
        "block_size": BLOCK,
        "num_blocks": (64, 32),
        "max_seqs": 4,
        "max_model_len": 256,
        "name": "two-groups",
    }
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture
def model() -> Iterator[HybridModel]:
    m = HybridModel(config(), "host")
    yield m
    m.teardown()


def prefilled(model: HybridModel, tokens: int, start: int = 0) -> Any:
    """A sequence of ``tokens`` tokens, its KV recorded as computed through the core."""
    seq = model.alloc_sequence_for(tokens + 8)
    prompt = np.arange(start, start + tokens, dtype=np.int32)
    model.attach_prefix(seq, prompt, grow_to=tokens)
    model.core.append(seq.handle, prompt[:0])  # the prompt's KV is computed: the window releases
    return seq


def test_the_model_has_one_kv_pool_per_group(model: HybridModel) -> None:
    pools = model.kv_pools
    assert [(p.group, p.kind, p.num_layers, p.num_blocks) for p in pools] == [
        (0, "full", 2, 64), (1, "sliding_window", 2, 32)
    ]
    assert model.kv_pool is pools[0]


def test_the_core_gets_each_groups_rule_and_pool(model: HybridModel) -> None:
    assert model.core.groups == (("full", 0, 0), ("sliding_window", 16, 0))
    assert [pool.num_total for pool in model.core.group_pools] == [64, 32]


def test_a_windowed_groups_table_holds_its_own_ids_and_minus_one_before_the_window(model: HybridModel) -> None:
    seq = prefilled(model, 40)
    full, window = model.block_table(seq), model.block_table(seq, 1)
    assert len(full) == len(window) == 10
    held = window[window >= 0]
    assert len(held) <= 16 // BLOCK + 1 and window[0] == -1
    assert held.max() < 32  # ids of the window group's own pool


def test_write_block_tables_writes_the_named_groups_table(model: HybridModel) -> None:
    seq = prefilled(model, 40)
    table = np.full((1, 12), 99, dtype=np.int32)
    model.write_block_tables([seq], table, group=1)
    assert np.array_equal(table[0, :10], model.block_table(seq, 1))
    model.write_block_tables([seq], table)
    assert np.array_equal(table[0, :10], model.block_table(seq))


def test_a_table_of_a_group_that_does_not_exist_is_refused(model: HybridModel) -> None:
    seq = prefilled(model, 8)
    with pytest.raises(InvalidId, match="2"):
        model.block_table(seq, 2)


def test_group_stats_count_each_groups_blocks_layers_and_bytes(model: HybridModel) -> None:
    seq = prefilled(model, 40)
    first, second = model.group_stats()
    assert (first["kind"], first["layers"], first["num_blocks"]) == ("full", 2, 64)
    assert first["num_free"] == 64 - 10
    assert second["kind"] == "sliding_window" and second["blocks_released"] > 0
    assert second["bytes"] == 32 * 2 * SWA.block_bytes(BLOCK)
    assert seq.num_blocks == 10


def test_a_finished_sequence_leaves_every_group_free_or_cached(model: HybridModel) -> None:
    seq = prefilled(model, 40)
    model.finish_sequence(seq)
    model.check_invariants()
    for group in model.group_stats():
        assert group["num_free"] + group["num_cached"] == group["num_blocks"]


def test_the_next_turn_reuses_the_finished_turn_whose_last_window_is_cached(model: HybridModel) -> None:
    model.finish_sequence(prefilled(model, 40))
    again = model.alloc_sequence_for(56)
    assert model.attach_prefix(again, np.arange(48, dtype=np.int32)) == 40
    model.check_invariants()


def test_the_same_prompt_again_reuses_only_cuts_whose_window_is_cached(model: HybridModel) -> None:
    model.finish_sequence(prefilled(model, 40))
    again = model.alloc_sequence_for(48)
    # the cut may not hold the last token (36 at most), and the window before 36 starts in a
    # block released before the finish: no cut the window group serves
    assert model.attach_prefix(again, np.arange(40, dtype=np.int32)) == 0


def test_the_step_writes_each_groups_new_ids_into_its_table(model: HybridModel) -> None:
    seq = prefilled(model, 40)
    seq_tables = [np.full((1, 16), -1, dtype=np.int32) for _ in range(2)]
    for group, table in enumerate(seq_tables):
        model.write_block_tables([seq], table, group=group)
    model.step([seq], np.array([7], dtype=np.int32), table=seq_tables[0], group_tables=seq_tables[1:])
    assert seq.num_tokens == 41 and seq.num_blocks == 11
    assert seq_tables[0][0, 10] == model.block_table(seq)[10]
    assert seq_tables[1][0, 10] == model.block_table(seq, 1)[10]


def test_a_one_group_model_keeps_todays_core_and_one_pool() -> None:
    plain = config(layers=(FULL, FULL), num_blocks=16)
    assert core_groups(plain) is None
    m = HybridModel(plain, "host")
    try:
        assert len(m.kv_pools) == 1 and m.core.num_groups == 1
    finally:
        m.teardown()


def test_a_model_of_windowed_layers_only_is_refused_naming_its_group() -> None:
    with pytest.raises(Unsupported, match="sliding_window 16"):
        core_groups(config(layers=(SWA,), num_blocks=16))


def test_an_mla_pool_has_one_latent_row_per_token() -> None:
    from lifecycle.device import HostDevice

    mla = MLALayer(kv_lora_rank=16, qk_rope_head_dim=4)
    device = HostDevice()
    try:
        pool = KVPool(device, config(layers=(mla,), num_blocks=8))
        try:
            assert pool.layer_shape(0) == (8, BLOCK, 20)
            assert pool.layer_strides(0) == (BLOCK * 20 * 2, 20 * 2, 2)
            assert pool.layer_block_bytes(0) == mla.block_bytes(BLOCK)
        finally:
            pool.release()
    finally:
        device.close()


def test_a_pool_of_a_group_that_does_not_exist_is_refused() -> None:
    from lifecycle.device import HostDevice

    device = HostDevice()
    try:
        with pytest.raises(InvalidId, match="group 2 is out of range"):
            KVPool(device, config(), 2)
    finally:
        device.close()


def test_a_host_tier_for_several_groups_is_refused_naming_them() -> None:
    with pytest.raises(Unsupported, match="host_tier_blocks=8.*sliding_window 16"):
        HybridModel(config(), "host", host_tier_blocks=8)


def test_appending_tokens_to_a_sequence_releases_what_left_the_window() -> None:
    m = HybridModel(config(layers=(SWA, FULL), max_seqs=2), "host")
    try:
        seq = m.alloc_sequence_for(64)
        m.attach_prefix(seq, np.arange(8, dtype=np.int32), grow_to=8)
        for token in range(40):
            m.grow(seq, seq.num_tokens + 1)
            seq.append_tokens([token])
        m.grow(seq, 49)
        seq.append_tokens([0])
        # The KV covers 48 tokens: a query at token 48 reads tokens 33.. (blocks 8 on) of the window group.
        assert m.block_table(seq, 1)[:8].tolist() == [-1] * 8
        released = m.group_stats()[1]["blocks_released"]
        assert released == 8
        m.check_invariants()
    finally:
        m.teardown()


def test_a_grouped_models_step_caches_the_blocks_that_filled(model: HybridModel) -> None:
    seq = prefilled(model, 40)  # blocks 0..5 left the window before any was cached
    model.step([seq], np.array([7], dtype=np.int32))
    assert [group["num_cached"] for group in model.group_stats()] == [10, 4]
    # A second sequence of the same prefix reuses it while the first still runs.
    other = model.alloc_sequence_for(48)
    prompt = np.concatenate([np.arange(40), [7, 1, 2, 3]]).astype(np.int32)
    assert model.attach_prefix(other, prompt) == 40
    model.cache_sequence(other)
    model.check_invariants()
