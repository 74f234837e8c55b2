"""KV layer kinds, KV cache groups and their pools' split, the memory plan (issue 31, config side)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from lifecycle.config import (
    RETENTION_RESERVE,
    AttentionLayer,
    ChunkedLocalLayer,
    IndexerLayer,
    KVGroupSpec,
    MLALayer,
    ModelConfig,
    SlidingWindowLayer,
    SSMLayer,
)
from lifecycle.errors import ConfigError

FULL = AttentionLayer(num_kv_heads=2, head_dim=8)
SWA = SlidingWindowLayer(num_kv_heads=2, head_dim=8, window=32)
CHUNK = ChunkedLocalLayer(num_kv_heads=2, head_dim=8, chunk_size=64)
SSM = SSMLayer(h_state_bytes=256, conv_state_bytes=64)


def hybrid(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "layers": (SWA, FULL, SWA, FULL, SSM),
        "block_size": 4,
        "kv_budget_bytes": 1 << 20,
        "max_model_len": 1024,
    }
    fields.update(overrides)
    return ModelConfig(**fields)


# --- layer kinds ---------------------------------------------------------------------------------


def test_sliding_window_layer_stores_k_and_v_per_token() -> None:
    layer = SlidingWindowLayer(num_kv_heads=8, head_dim=64, window=128, dtype="bfloat16")
    assert layer.bytes_per_token == 2 * 8 * 64 * 2
    assert layer.block_bytes(16) == 16 * 2 * 8 * 64 * 2


def test_chunked_local_layer_stores_k_and_v_per_token() -> None:
    layer = ChunkedLocalLayer(num_kv_heads=8, head_dim=128, chunk_size=8192, dtype="float8_e4m3fn")
    assert layer.bytes_per_token == 2 * 8 * 128 * 1
    assert layer.block_bytes(16) == 16 * 2 * 8 * 128


def test_mla_layer_stores_one_latent_and_rope_vector_per_token() -> None:
    layer = MLALayer(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16")
    assert layer.bytes_per_token == (512 + 64) * 2
    assert layer.block_bytes(64) == 64 * 576 * 2


def test_indexer_layer_stores_fp8_keys_and_a_scale_per_token() -> None:
    layer = IndexerLayer(head_dim=128)
    assert layer.dtype == "float8_e4m3fn"
    assert layer.bytes_per_token == 128 * 1 + 4
    assert layer.block_bytes(64) == 64 * 132


def test_attention_layer_bytes_per_token_is_its_block_over_block_size() -> None:
    layer = AttentionLayer(num_kv_heads=4, head_dim=64, v_aliases_k=True)
    assert layer.bytes_per_token * 16 == layer.block_bytes(16)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SlidingWindowLayer(2, 8, window=0), "SlidingWindowLayer.window=0 must be >= 1"),
        (lambda: SlidingWindowLayer(2, 8, window=16, sink_tokens=-1), "SlidingWindowLayer.sink_tokens=-1 must be >= 0"),
        (lambda: SlidingWindowLayer(0, 8, window=16), "SlidingWindowLayer.num_kv_heads=0 must be >= 1"),
        (lambda: ChunkedLocalLayer(2, 8, chunk_size=0), "ChunkedLocalLayer.chunk_size=0 must be >= 1"),
        (lambda: ChunkedLocalLayer(2, 8, chunk_size=64, dtype="int4"), "ChunkedLocalLayer.dtype='int4'"),  # type: ignore[arg-type]
        (lambda: MLALayer(kv_lora_rank=0, qk_rope_head_dim=64), "MLALayer.kv_lora_rank=0 must be >= 1"),
        (lambda: MLALayer(kv_lora_rank=512, qk_rope_head_dim=-1), "MLALayer.qk_rope_head_dim=-1 must be >= 0"),
        (lambda: IndexerLayer(head_dim=0), "IndexerLayer.head_dim=0 must be >= 1"),
        (lambda: IndexerLayer(head_dim=128, scale_bytes=-4), "IndexerLayer.scale_bytes=-4 must be >= 0"),
    ],
)
def test_bad_layer_fields_are_refused_naming_the_value(build: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


def test_a_window_larger_than_the_context_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"layers\[0\].window=2048 .* exceeds max_model_len=1024"):
        hybrid(layers=(SlidingWindowLayer(2, 8, window=2048), FULL))


def test_sink_tokens_count_against_the_context() -> None:
    with pytest.raises(ConfigError, match=r"window=1000 \(\+ sink_tokens=100\) exceeds max_model_len=1024"):
        hybrid(layers=(SlidingWindowLayer(2, 8, window=1000, sink_tokens=100), FULL))


def test_a_chunk_larger_than_the_context_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"layers\[1\].chunk_size=8192 exceeds max_model_len=1024"):
        hybrid(layers=(FULL, ChunkedLocalLayer(2, 8, chunk_size=8192)))


def test_max_model_len_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_model_len=0 must be >= 1"):
        hybrid(max_model_len=0)


# --- groups ------------------------------------------------------------------------------------------


def test_layers_of_one_rule_form_one_group_with_the_full_group_first() -> None:
    cfg = hybrid()
    full, window = cfg.kv_groups
    assert (full.index, full.kind, full.window, full.layer_indices) == (0, "full", 0, (1, 3))
    assert (window.index, window.kind, window.window, window.layer_indices) == (1, "sliding_window", 32, (0, 2))
    assert full.block_bytes == 2 * FULL.block_bytes(4)
    assert window.block_bytes == 2 * SWA.block_bytes(4)


def test_windows_of_different_sizes_or_sinks_are_different_groups() -> None:
    other = SlidingWindowLayer(2, 8, window=64)
    sunk = SlidingWindowLayer(2, 8, window=32, sink_tokens=4)
    cfg = hybrid(layers=(SWA, other, sunk, FULL))
    assert [(g.kind, g.window, g.sink_tokens) for g in cfg.kv_groups] == [
        ("full", 0, 0),
        ("sliding_window", 32, 0),
        ("sliding_window", 64, 0),
        ("sliding_window", 32, 4),
    ]


def test_mla_and_indexer_layers_share_the_full_group_with_the_sum_of_their_pages() -> None:
    mla, indexer = MLALayer(512, 64), IndexerLayer(128)
    cfg = ModelConfig(layers=(mla, indexer) * 3, block_size=64, num_blocks=10)
    (group,) = cfg.kv_groups
    assert group.kind == "full" and group.layer_indices == (0, 1, 2, 3, 4, 5)
    assert group.block_bytes == 3 * (64 * 576 * 2 + 64 * 132)
    assert cfg.kv_block_bytes() == group.block_bytes


def test_a_model_without_kv_layers_has_no_groups() -> None:
    cfg = ModelConfig(layers=(SSM,))
    assert cfg.kv_groups == () and cfg.num_blocks_per_group == ()
    assert cfg.memory_plan().concurrent_sequences() == 0


def test_groups_are_kv_group_specs() -> None:
    assert all(isinstance(group, KVGroupSpec) for group in hybrid().kv_groups)


def test_a_group_needs_its_window_plus_one_block_per_sequence() -> None:
    full, window = hybrid().kv_groups
    assert full.blocks_per_sequence(1000, 4) == 250
    assert window.blocks_per_sequence(1000, 4) == 32 // 4 + 1
    assert window.blocks_per_sequence(10, 4) == 3  # never more than the sequence's own blocks


# --- one group keeps today's behaviour -------------------------------------------------------------


def test_one_attention_group_keeps_its_canonical_form() -> None:
    cfg = ModelConfig(layers=(FULL, SSM, FULL), block_size=4, num_blocks=10)
    canonical = "lifecycle-config-v1;block_size=4;A(2,8,float16,0);S(256,float32,64,float16);A(2,8,float16,0)"
    assert cfg._canonical() == canonical


def test_one_attention_group_budget_buys_whole_blocks_as_before() -> None:
    cfg = ModelConfig(layers=(FULL, FULL), block_size=4, kv_budget_bytes=10_000)
    assert cfg.num_blocks_resolved == 10_000 // (2 * FULL.block_bytes(4))
    assert cfg.num_blocks_per_group == (cfg.num_blocks_resolved,)
    assert cfg.kv_pool_bytes() == cfg.num_blocks_resolved * cfg.kv_block_bytes()


def test_max_model_len_does_not_change_a_one_group_config() -> None:
    base = ModelConfig(layers=(FULL,), block_size=4, kv_budget_bytes=10_000)
    longer = base.replace(max_model_len=4096)
    assert longer.num_blocks_resolved == base.num_blocks_resolved
    assert longer.fingerprint() == base.fingerprint()


# --- fingerprint ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer",
    [
        SlidingWindowLayer(2, 8, window=64),
        SlidingWindowLayer(2, 8, window=32, sink_tokens=4),
        SlidingWindowLayer(2, 8, window=32, dtype="bfloat16"),
        ChunkedLocalLayer(2, 8, chunk_size=32),
        MLALayer(8, 4),
        IndexerLayer(16),
    ],
)
def test_the_fingerprint_tells_every_layer_kind_and_rule_apart(layer: Any) -> None:
    base = ModelConfig(layers=(FULL, SWA), block_size=4, kv_budget_bytes=1 << 16)
    other = ModelConfig(layers=(FULL, layer), block_size=4, kv_budget_bytes=1 << 16)
    assert base.fingerprint() != other.fingerprint()


def test_pool_sizes_and_split_do_not_change_the_fingerprint() -> None:
    assert hybrid().fingerprint() == hybrid(kv_budget_bytes=1 << 21, group_budget_fractions=(0.5, 0.5)).fingerprint()


# --- block counts per group ---------------------------------------------------------------------------


def test_a_tuple_gives_each_group_its_count() -> None:
    cfg = hybrid(kv_budget_bytes=None, num_blocks=(100, 20))
    assert cfg.num_blocks_per_group == (100, 20)
    assert cfg.num_blocks_resolved == 100
    assert cfg.kv_pool_bytes() == 100 * cfg.kv_groups[0].block_bytes + 20 * cfg.kv_groups[1].block_bytes


def test_one_count_for_several_groups_is_refused() -> None:
    with pytest.raises(ConfigError, match="num_blocks=100 is one count; the model has 2 KV groups"):
        hybrid(kv_budget_bytes=None, num_blocks=100)


def test_a_tuple_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"num_blocks=\(1, 2, 3\) has 3 counts; the model has 2 KV groups"):
        hybrid(kv_budget_bytes=None, num_blocks=(1, 2, 3))


def test_a_zero_count_in_the_tuple_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"num_blocks\[1\]=0 must be >= 1"):
        hybrid(kv_budget_bytes=None, num_blocks=(10, 0))


def test_the_default_split_follows_what_a_max_model_len_sequence_needs() -> None:
    cfg = hybrid()
    full, window = cfg.kv_groups
    need_full = 1024 // 4 * full.block_bytes
    need_window = (32 // 4 + 1) * window.block_bytes
    windowed_share = need_window / (need_full + need_window) * (1 - RETENTION_RESERVE) + RETENTION_RESERVE
    assert window.num_blocks == math.floor((1 << 20) * windowed_share / window.block_bytes)
    # The rounding's leftover goes to the groups: less than one block of each is left unassigned.
    left = (1 << 20) - cfg.kv_pool_bytes()
    assert 0 <= left < min(full.block_bytes, window.block_bytes)


def test_budget_fractions_override_the_split() -> None:
    cfg = hybrid(group_budget_fractions=(0.25, 0.5))
    full, window = cfg.kv_groups
    assert full.num_blocks == (1 << 20) // 4 // full.block_bytes
    assert window.num_blocks == (1 << 20) // 2 // window.block_bytes


@pytest.mark.parametrize(
    ("fractions", "message"),
    [
        ((0.5,), r"group_budget_fractions=\(0.5,\) must be a tuple of 2 shares"),
        ((0.5, 0.0), r"group_budget_fractions\[1\]=0.0 must be a number in \(0, 1\]"),
        ((0.7, 0.7), "sums to 1.4, more than 1"),
    ],
)
def test_bad_budget_fractions_are_refused(fractions: tuple[float, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        hybrid(group_budget_fractions=fractions)


def test_budget_fractions_with_block_counts_are_refused() -> None:
    with pytest.raises(ConfigError, match="group_budget_fractions=.* splits kv_budget_bytes; num_blocks was given"):
        hybrid(kv_budget_bytes=None, num_blocks=(4, 4), group_budget_fractions=(0.5, 0.5))


def test_a_budget_too_small_for_a_block_of_every_group_is_refused() -> None:
    message = r"kv_budget_bytes=300 gives group 0 \(full\) \d+ bytes, too few for one block of 512 bytes"
    with pytest.raises(ConfigError, match=message):
        hybrid(kv_budget_bytes=300)


def test_replace_resizes_every_group() -> None:
    cfg = hybrid().replace(num_blocks=(8, 4))
    assert cfg.num_blocks_per_group == (8, 4) and cfg.kv_budget_bytes is None


def test_replace_with_block_counts_drops_the_budget_split() -> None:
    cfg = hybrid(group_budget_fractions=(0.5, 0.5)).replace(num_blocks=(8, 4))
    assert cfg.group_budget_fractions is None and cfg.num_blocks_per_group == (8, 4)


# --- memory plan ----------------------------------------------------------------------------------------


def test_the_plan_lists_each_group() -> None:
    cfg = hybrid(layers=(SWA, FULL, SWA, FULL, CHUNK))
    plan = cfg.memory_plan()
    assert [(g.kind, g.layers) for g in plan.groups] == [("full", 2), ("sliding_window", 2), ("chunked_local", 1)]
    for group, spec in zip(plan.groups, cfg.kv_groups, strict=True):
        assert group.block_bytes == spec.block_bytes == group.bytes_per_token * 4
        assert group.bytes == spec.num_blocks * spec.block_bytes
    assert plan.budget_bytes == 1 << 20


def test_concurrent_sequences_is_the_scarcest_group() -> None:
    cfg = hybrid(kv_budget_bytes=None, num_blocks=(1000, 45))
    plan = cfg.memory_plan()
    # full: 1000 // (256 / 4 = 64 blocks) = 15; window: 45 // (32/4 + 1 = 9) = 5
    assert plan.concurrent_sequences(256) == 5
    assert plan.budget_bytes == cfg.kv_pool_bytes()


def test_padding_counts_what_the_sequences_do_not_hold() -> None:
    cfg = hybrid(kv_budget_bytes=None, num_blocks=(128, 18))
    plan = cfg.memory_plan()
    full, window = cfg.kv_groups
    # Two sequences of 250 tokens: full holds 250 tokens each (63 blocks, the last one half used),
    # the window group 9 blocks each.
    held = 2 * (250 * full.block_bytes // 4 + 9 * window.block_bytes)
    assert plan.concurrent_sequences(250) == 2
    assert plan.padding_waste(250) == pytest.approx(1 - held / cfg.kv_pool_bytes())


def test_the_ideal_is_the_budget_over_one_sequences_bytes() -> None:
    plan = hybrid().memory_plan()
    full, window = plan.groups
    one = 1024 * full.bytes_per_token + (32 + 4) * window.bytes_per_token
    assert plan.ideal_sequences(1024) == (1 << 20) // one
    assert plan.ideal_sequences(1024) >= plan.concurrent_sequences(1024)


def test_the_default_split_comes_within_the_targets_of_the_ideal() -> None:
    plan = hybrid(kv_budget_bytes=64 << 20).memory_plan()
    assert plan.concurrent_sequences(1024) >= 0.95 * plan.ideal_sequences(1024)
    assert plan.padding_waste(1024) <= 0.05


def test_the_plan_as_a_dict_carries_the_figures() -> None:
    record = hybrid().memory_plan().as_dict(1024)
    assert record["concurrent_sequences"] == hybrid().memory_plan().concurrent_sequences(1024)
    assert [group["kind"] for group in record["groups"]] == ["full", "sliding_window"]


def test_full_attention_bytes_treat_every_kv_layer_as_full() -> None:
    cfg = hybrid(layers=(SWA, FULL, CHUNK, SSM))
    assert cfg.full_attention_bytes(100) == 100 * (SWA.bytes_per_token + FULL.bytes_per_token + CHUNK.bytes_per_token)


# --- the pools: one per group -------------------------------------------------------------------------


def test_each_kv_pool_holds_its_groups_layers_and_block_count() -> None:
    from lifecycle.device import HostDevice
    from lifecycle.pools import kv_group_pools

    config = hybrid(layers=(SWA, FULL, SWA, FULL))
    device = HostDevice()
    try:
        pools = kv_group_pools(device, config)
        try:
            assert [(p.group, p.kind, p.num_layers, p.num_blocks) for p in pools] == [
                (g.index, g.kind, len(g.layer_indices), g.num_blocks) for g in config.kv_groups
            ]
            assert sum(p.total_bytes for p in pools) == config.kv_pool_bytes()
        finally:
            for pool in pools:
                pool.release()
    finally:
        device.close()
