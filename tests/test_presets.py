"""The published-model presets against their config.json, ModelConfig.from_hf_config, and the
issue-31 memory targets at its budget. Each preset's bytes per token per group are written out
from the fields of its config.json (tests/data/hf_configs/), not computed by the code under test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lifecycle.config import AttentionLayer, ModelConfig, SSMLayer
from lifecycle.errors import ConfigError
from lifecycle.presets import PUBLISHED_CONFIGS, preset, reference_kv_budget

HF_CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"
BF16 = 2


def published(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((HF_CONFIGS / f"{name}.json").read_text())
    assert data.pop("_source").startswith("https://huggingface.co/")
    return data


def groups(name: str) -> list[tuple[str, int, int, int]]:
    """(kind, window, layers, bytes per token) of each group of the preset."""
    return [(g.kind, g.window, g.layers, g.bytes_per_token) for g in preset(name).memory_plan().groups]


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_the_preset_is_its_saved_config_json(name: str) -> None:
    assert PUBLISHED_CONFIGS[name] == published(name)
    assert preset(name).layers == ModelConfig.from_hf_config(published(name)).layers


def test_gpt_oss_20b_alternates_128_token_windows_and_full_attention() -> None:
    # 24 layers, sliding/full alternating; 8 KV heads of 64, bf16: 2 * 8 * 64 * 2 bytes per layer.
    per_layer = 2 * 8 * 64 * BF16
    assert groups("gpt-oss-20b") == [("full", 0, 12, 12 * per_layer), ("sliding_window", 128, 12, 12 * per_layer)]


def test_gpt_oss_120b_has_36_layers_of_the_same_shape() -> None:
    per_layer = 2 * 8 * 64 * BF16
    assert groups("gpt-oss-120b") == [("full", 0, 18, 18 * per_layer), ("sliding_window", 128, 18, 18 * per_layer)]


def test_gemma_3_27b_has_five_local_layers_per_global_layer() -> None:
    # 62 layers, every 6th global (10), window 1024; 16 KV heads of 128, bf16.
    per_layer = 2 * 16 * 128 * BF16
    assert groups("gemma-3-27b") == [("full", 0, 10, 10 * per_layer), ("sliding_window", 1024, 52, 52 * per_layer)]
    assert [i for i, layer in enumerate(preset("gemma-3-27b").layers) if isinstance(layer, AttentionLayer)] == list(
        range(5, 62, 6)
    )


def test_llama_4_scout_chunks_three_layers_in_four() -> None:
    # 48 layers; every 4th is NoPE and global (12), the others 8,192-token chunks; 8 KV heads of 128.
    per_layer = 2 * 8 * 128 * BF16
    assert groups("llama-4-scout") == [("full", 0, 12, 12 * per_layer), ("chunked_local", 8192, 36, 36 * per_layer)]


def test_deepseek_v3_stores_the_latent_and_rope_per_token() -> None:
    # 61 MLA layers: kv_lora_rank 512 + qk_rope_head_dim 64 bf16 elements each.
    assert groups("deepseek-v3") == [("full", 0, 61, 61 * (512 + 64) * BF16)]


def test_deepseek_v3_2_adds_an_indexer_cache_to_each_layer() -> None:
    # MLA as V3, plus the indexer: index_head_dim 128 fp8 bytes and a 4-byte scale per token.
    assert groups("deepseek-v3.2") == [("full", 0, 2 * 61, 61 * ((512 + 64) * BF16 + 128 + 4))]


def test_qwen3_next_80b_has_one_gated_attention_layer_in_four() -> None:
    # 12 attention layers of 2 KV heads of 256, bf16; 36 gated-delta-net layers of SSM state.
    assert groups("qwen3-next-80b-a3b") == [("full", 0, 12, 12 * 2 * 2 * 256 * BF16)]
    ssm = preset("qwen3-next-80b-a3b").ssm_layers
    assert len(ssm) == 36
    assert ssm[0] == SSMLayer(
        h_state_bytes=32 * 128 * 128 * 4,  # value heads x key dim x value dim, float32
        conv_state_bytes=(4 - 1) * (2 * 16 * 128 + 32 * 128) * BF16,  # kernel - 1 positions of q, k, v channels
        h_dtype="float32",
        conv_dtype="bfloat16",
    )


def test_nemotron_h_has_four_attention_layers_among_its_mamba_layers() -> None:
    # The pattern has 4 '*' (attention: 8 KV heads of 128) and 24 'M' (Mamba-2); '-' layers have no cache.
    assert groups("nemotron-h") == [("full", 0, 4, 4 * 2 * 8 * 128 * BF16)]
    ssm = preset("nemotron-h").ssm_layers
    assert len(ssm) == 24
    assert ssm[0].h_state_bytes == 128 * 64 * 128 * 4  # heads x head dim x state size, float32
    assert ssm[0].conv_state_bytes == (4 - 1) * (128 * 64 + 2 * 8 * 128) * BF16


# --- issue 31's memory targets at its budget ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_32k_sequences_reach_95_percent_of_the_ideal_with_at_most_5_percent_padding(name: str) -> None:
    config = preset(name)
    plan = config.replace(kv_budget_bytes=reference_kv_budget(config)).memory_plan()
    assert plan.concurrent_sequences(32768) >= 0.95 * plan.ideal_sequences(32768)
    assert plan.padding_waste(32768) <= 0.05


def test_the_reference_budget_is_half_the_all_full_footprint() -> None:
    config = preset("gpt-oss-120b")
    per_token = 36 * 2 * 8 * 64 * BF16
    assert reference_kv_budget(config) == per_token * 262_144 * 16 // 2


def test_one_full_group_at_the_reference_budget_fits_64_sequences_of_32k() -> None:
    # Half of 262,144 blocks of 16 tokens is 64 sequences of 2,048 blocks.
    config = preset("deepseek-v3")
    plan = config.replace(kv_budget_bytes=reference_kv_budget(config)).memory_plan()
    assert plan.concurrent_sequences(32768) == 64


# --- from_hf_config ----------------------------------------------------------------------------------


def test_a_dense_model_without_a_preset_is_read() -> None:
    hf = {"num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
          "torch_dtype": "float16"}
    config = ModelConfig.from_hf_config(hf, num_blocks=10)
    assert config.layers == (AttentionLayer(8, 128, "float16"),) * 4
    assert config.num_query_heads == 32


def test_a_uniform_sliding_window_model_is_read() -> None:
    hf = {"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 64, "sliding_window": 4096}
    (group,) = ModelConfig.from_hf_config(hf).kv_groups
    assert (group.kind, group.window) == ("sliding_window", 4096)


def test_a_disabled_sliding_window_is_full_attention() -> None:
    hf = {"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 64, "sliding_window": 4096,
          "use_sliding_window": False}
    assert ModelConfig.from_hf_config(hf).kv_groups[0].kind == "full"


def test_the_cache_dtype_can_be_overridden() -> None:
    config = ModelConfig.from_hf_config(published("gpt-oss-20b"), kv_cache_dtype="float8_e4m3fn")
    assert {layer.dtype for layer in config.kv_layers} == {"float8_e4m3fn"}


def test_model_config_fields_apply() -> None:
    config = ModelConfig.from_hf_config(published("gpt-oss-20b"), num_blocks=(64, 16), name="mine")
    assert config.num_blocks_per_group == (64, 16) and config.name == "mine"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": None}, "config.json has no 'num_hidden_layers'"),
        ({"layer_types": ["sliding_attention", "cross_attention"]}, r"layer_types\[1\]='cross_attention'"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries; num_hidden_layers=2"),
        ({"torch_dtype": "float64"}, "torch_dtype='float64' is not a dtype"),
        ({"compress_ratios": [0, 4]}, "'compress_ratios' describes a cache this library does not lay out"),
        ({"head_dim": 0}, "head_dim=0 must be an int >= 1"),
        ({"sliding_window": 65536}, r"window=65536 .* exceeds max_model_len=32768"),
    ],
)
def test_fields_it_cannot_map_are_refused_naming_them(change: dict[str, Any], message: str) -> None:
    hf: dict[str, Any] = {"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 64, "sliding_window": 128,
                          "layer_types": ["sliding_attention", "full_attention"]}
    hf.update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(hf)


def test_an_unknown_hybrid_pattern_letter_is_refused() -> None:
    hf = dict(published("nemotron-h"), hybrid_override_pattern="M*X")
    with pytest.raises(ConfigError, match=r"hybrid_override_pattern\[2\]='X'"):
        ModelConfig.from_hf_config(hf)


def test_an_unknown_model_config_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="no such field"):
        ModelConfig.from_hf_config(published("gpt-oss-20b"), bogus=1)
