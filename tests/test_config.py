"""ModelConfig, layer specs, ModelDims and presets: validation, derived sizes, fingerprint."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pytest

from lifecycle.config import DTYPE_SIZES, AttentionLayer, DType, ModelConfig, ModelDims, SSMLayer, storage_dtype
from lifecycle.errors import ConfigError
from lifecycle.presets import preset, preset_names

REPO = Path(__file__).resolve().parent.parent
ATTN = AttentionLayer(num_kv_heads=2, head_dim=8)
SSM = SSMLayer(h_state_bytes=256, conv_state_bytes=64)


def config(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {"layers": (ATTN, SSM, ATTN), "block_size": 4, "num_blocks": 10}
    fields.update(overrides)
    return ModelConfig(**fields)


# --- layer specs -----------------------------------------------------------------------------------


def test_attention_layer_block_bytes_count_k_and_v() -> None:
    layer = AttentionLayer(num_kv_heads=4, head_dim=64, dtype="bfloat16")
    assert layer.block_bytes(16) == 2 * 16 * 4 * 64 * 2
    assert layer.block_shape(16) == (2, 16, 4, 64)


def test_attention_layer_with_v_aliasing_k_stores_k_only() -> None:
    layer = AttentionLayer(num_kv_heads=1, head_dim=576, dtype="float8_e4m3fn", v_aliases_k=True)
    assert layer.kv_planes == 1
    assert layer.block_bytes(16) == 16 * 576


def test_the_dtype_literal_names_exactly_the_supported_dtypes() -> None:
    assert sorted(get_args(DType)) == sorted(DTYPE_SIZES)


@pytest.mark.parametrize("dtype", get_args(DType))
def test_every_supported_dtype_is_accepted(dtype: DType) -> None:
    assert AttentionLayer(1, 8, dtype=dtype).itemsize == DTYPE_SIZES[dtype]
    assert storage_dtype(dtype).itemsize == DTYPE_SIZES[dtype]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_kv_heads": 0, "head_dim": 8}, "num_kv_heads=0"),
        ({"num_kv_heads": -2, "head_dim": 8}, "num_kv_heads=-2"),
        ({"num_kv_heads": 2, "head_dim": 0}, "head_dim=0"),
        ({"num_kv_heads": 2.0, "head_dim": 8}, "num_kv_heads must be an int, got 2.0"),
        ({"num_kv_heads": True, "head_dim": 8}, "num_kv_heads must be an int, got True"),
        ({"num_kv_heads": 2, "head_dim": 8, "dtype": "float64"}, "dtype='float64'"),
        ({"num_kv_heads": 2, "head_dim": 8, "v_aliases_k": 1}, "v_aliases_k must be a bool"),
    ],
)
def test_invalid_attention_layer_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"AttentionLayer.{field}"):
        AttentionLayer(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"h_state_bytes": 0, "conv_state_bytes": 8}, "h_state_bytes=0"),
        ({"h_state_bytes": 8, "conv_state_bytes": -1}, "conv_state_bytes=-1"),
        ({"h_state_bytes": 8, "conv_state_bytes": 8, "h_dtype": "fp32"}, "h_dtype='fp32'"),
        ({"h_state_bytes": 8, "conv_state_bytes": 8, "conv_dtype": None}, "conv_dtype=None"),
        ({"h_state_bytes": 6, "conv_state_bytes": 8}, "h_state_bytes=6 is not a whole number of float32"),
        ({"h_state_bytes": 8, "conv_state_bytes": 3}, "conv_state_bytes=3 is not a whole number of float16"),
    ],
)
def test_invalid_ssm_layer_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"SSMLayer.{field}"):
        SSMLayer(**kwargs)


def test_unknown_dtype_error_lists_the_supported_ones() -> None:
    with pytest.raises(ConfigError, match="bfloat16.*float8_e4m3fn"):
        AttentionLayer(2, 8, dtype="fp8")  # type: ignore[arg-type]  # refused at run time too


def test_layer_specs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ATTN.head_dim = 16  # type: ignore[misc]


# --- ModelConfig validation ------------------------------------------------------------------------


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        config().max_seqs = 3  # type: ignore[misc]


def test_layers_given_as_a_list_become_a_tuple() -> None:
    assert config(layers=[ATTN, SSM]).layers == (ATTN, SSM)


@pytest.mark.parametrize("layers", [(), [], None, "attention"])
def test_model_without_layers_is_refused(layers: object) -> None:
    with pytest.raises(ConfigError, match="layers must be a non-empty tuple"):
        config(layers=layers)


def test_layer_of_another_type_is_refused_naming_its_index() -> None:
    with pytest.raises(ConfigError, match=r"layers\[1\]=42 is neither"):
        config(layers=(ATTN, 42))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 0),
        ("block_size", -16),
        ("num_blocks", 0),
        ("num_blocks", -1),
        ("num_blocks", 2**31),
        ("max_seqs", 0),
        ("num_adapter_slots", -1),
        ("num_query_heads", -4),
        ("max_blocks_per_seq", -1),
        ("num_snapshots", -1),
    ],
)
def test_out_of_range_size_names_field_and_value(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=rf"{field}={value} must be"):
        config(**{field: value})


@pytest.mark.parametrize("field", ["block_size", "num_blocks", "max_seqs", "num_adapter_slots"])
def test_non_integer_size_is_refused(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be an int, got '8'"):
        config(**{field: "8"})


def test_non_bool_prefix_cache_flag_is_refused() -> None:
    with pytest.raises(ConfigError, match="enable_prefix_cache must be a bool"):
        config(enable_prefix_cache="yes")


def test_empty_name_is_refused() -> None:
    with pytest.raises(ConfigError, match="name must be a non-empty str"):
        config(name="")


def test_neither_block_count_nor_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="exactly one of num_blocks and kv_budget_bytes.*None.*None"):
        config(num_blocks=None)


def test_both_block_count_and_budget_are_refused() -> None:
    with pytest.raises(ConfigError, match="num_blocks=10, kv_budget_bytes=4096"):
        config(kv_budget_bytes=4096)


def test_budget_gives_the_whole_blocks_it_can_pay_for() -> None:
    block_bytes = config().kv_block_bytes()
    cfg = config(num_blocks=None, kv_budget_bytes=7 * block_bytes + block_bytes - 1)
    assert cfg.num_blocks_resolved == 7


def test_budget_too_small_for_one_block_is_refused() -> None:
    block_bytes = config().kv_block_bytes()
    message = rf"kv_budget_bytes={block_bytes - 1} is too small for one block of {block_bytes} bytes"
    with pytest.raises(ConfigError, match=message):
        config(num_blocks=None, kv_budget_bytes=block_bytes - 1)


def test_non_positive_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_budget_bytes=0 must be >= 1"):
        config(num_blocks=None, kv_budget_bytes=0)


def test_model_without_attention_needs_no_blocks() -> None:
    cfg = config(layers=(SSM,), num_blocks=None)
    assert cfg.num_blocks_resolved == 0 and cfg.kv_block_bytes() == 0
    assert config(layers=(SSM,), num_blocks=0).num_blocks_resolved == 0


def test_model_without_attention_refuses_blocks_or_budget() -> None:
    with pytest.raises(ConfigError, match="num_blocks=5 given, but the model has no attention layer"):
        config(layers=(SSM,), num_blocks=5)
    with pytest.raises(ConfigError, match="kv_budget_bytes=4096 given, but the model has no attention layer"):
        config(layers=(SSM,), num_blocks=None, kv_budget_bytes=4096)


def test_max_blocks_per_seq_beyond_the_pool_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_blocks_per_seq=11 exceeds the pool's 10 blocks"):
        config(max_blocks_per_seq=11)


def test_max_blocks_per_seq_zero_means_the_whole_pool() -> None:
    assert config().max_blocks_per_seq_resolved == 10
    assert config(max_blocks_per_seq=3).max_blocks_per_seq_resolved == 3


def test_query_heads_must_be_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ConfigError, match="num_query_heads=3 is not a multiple of attention layer 0's num_kv_heads=2"):
        config(num_query_heads=3)


def test_snapshots_need_an_ssm_layer() -> None:
    with pytest.raises(ConfigError, match="num_snapshots=2 needs an SSM layer"):
        config(layers=(ATTN,), num_snapshots=2)


# --- derived sizes ---------------------------------------------------------------------------------


def test_kv_block_bytes_sum_every_attention_layer() -> None:
    mla = AttentionLayer(num_kv_heads=1, head_dim=32, dtype="int8", v_aliases_k=True)
    cfg = config(layers=(ATTN, SSM, mla))
    assert cfg.kv_block_bytes() == 2 * 4 * 2 * 8 * 2 + 1 * 4 * 1 * 32 * 1


def test_kv_pool_bytes_is_blocks_times_block_bytes() -> None:
    cfg = config()
    assert cfg.kv_pool_bytes() == cfg.num_blocks_resolved * cfg.kv_block_bytes()


def test_ssm_pool_has_a_padding_slot() -> None:
    cfg = config(max_seqs=5)
    assert cfg.num_ssm_slots == 6
    assert cfg.ssm_slot_bytes() == 256 + 64
    assert cfg.ssm_pool_bytes() == 6 * (256 + 64)


def test_layers_are_split_by_kind_in_model_order() -> None:
    other = AttentionLayer(num_kv_heads=4, head_dim=8)
    cfg = config(layers=(SSM, other, ATTN))
    assert cfg.attention_layers == (other, ATTN)
    assert cfg.ssm_layers == (SSM,)


def test_dims_describe_the_model() -> None:
    cfg = config(num_query_heads=8)
    assert cfg.dims() == ModelDims(
        num_layers=3,
        num_attention_layers=2,
        num_ssm_layers=1,
        max_blocks_per_layer=10,
        num_query_heads=8,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        fingerprint=cfg.fingerprint(),
    )


def test_dims_query_heads_default_to_kv_heads() -> None:
    assert config().dims().num_query_heads == 2


def test_dims_of_a_model_without_attention_are_zero() -> None:
    dims = config(layers=(SSM,), num_blocks=None).dims()
    assert (dims.num_kv_heads, dims.head_dim, dims.max_blocks_per_layer) == (0, 0, 0)


# --- fingerprint -----------------------------------------------------------------------------------


def test_fingerprint_is_an_unsigned_64_bit_int() -> None:
    assert 0 <= config().fingerprint() < 2**64


def test_fingerprint_is_the_same_in_another_process() -> None:
    code = (
        "from lifecycle.config import *\n"
        "print(ModelConfig(layers=(AttentionLayer(2, 8), SSMLayer(256, 64), AttentionLayer(2, 8)),"
        " block_size=4, num_blocks=10).fingerprint())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}  # a different str hash seed must not matter
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=REPO)
    assert int(out.stdout) == config().fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"block_size": 8},
        {"layers": (ATTN, SSM)},
        {"layers": (SSM, ATTN, ATTN)},
        {"layers": (ATTN, SSM, AttentionLayer(2, 8, dtype="bfloat16"))},
        {"layers": (ATTN, SSM, AttentionLayer(2, 8, v_aliases_k=True))},
        {"layers": (ATTN, SSM, AttentionLayer(4, 8))},
        {"layers": (ATTN, SSMLayer(256, 64, h_dtype="bfloat16"), ATTN)},
        {"layers": (ATTN, SSMLayer(256, 128), ATTN)},
    ],
)
def test_fingerprint_changes_with_the_byte_format(change: dict[str, Any]) -> None:
    assert config(**change).fingerprint() != config().fingerprint()


def test_fingerprint_ignores_pool_sizes_and_name() -> None:
    resized = config(num_blocks=99, max_seqs=3, num_adapter_slots=2, name="other", enable_prefix_cache=False)
    assert resized.fingerprint() == config().fingerprint()


# --- replace, equality, pickling -------------------------------------------------------------------


def test_replace_revalidates() -> None:
    with pytest.raises(ConfigError, match="max_seqs=0"):
        config().replace(max_seqs=0)


def test_replace_with_a_budget_drops_the_block_count() -> None:
    cfg = config().replace(kv_budget_bytes=4 * config().kv_block_bytes())
    assert cfg.num_blocks is None and cfg.num_blocks_resolved == 4


def test_replace_with_a_block_count_drops_the_budget() -> None:
    cfg = config(num_blocks=None, kv_budget_bytes=10_000).replace(num_blocks=3)
    assert cfg.kv_budget_bytes is None and cfg.num_blocks_resolved == 3


def test_replace_of_an_unknown_field_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no such field"):
        config().replace(num_heads=4)


def test_equal_configs_compare_and_hash_equal() -> None:
    assert config() == config() and hash(config()) == hash(config())
    assert config() != config(max_seqs=3)


def test_config_survives_pickling() -> None:
    cfg = config(num_blocks=None, kv_budget_bytes=10_000)
    clone = pickle.loads(pickle.dumps(cfg))
    assert clone == cfg and clone.num_blocks_resolved == cfg.num_blocks_resolved
    assert clone.fingerprint() == cfg.fingerprint()


# --- presets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_is_a_valid_config_named_after_itself(name: str) -> None:
    cfg = preset(name)
    assert cfg.name == name
    assert cfg.kv_pool_bytes() + cfg.ssm_pool_bytes() <= 512 << 20  # fits a host device


def test_preset_names_include_the_documented_ones() -> None:
    assert {"tiny-hybrid", "small-hybrid", "qwen3-next-like", "llama-like"} <= set(preset_names())


def test_unknown_preset_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'gpt-5'; valid presets: tiny-hybrid, small-hybrid"):
        preset("gpt-5")


def test_preset_overrides_apply_and_are_validated() -> None:
    assert preset("tiny-hybrid", max_seqs=3).max_seqs == 3
    with pytest.raises(ConfigError, match="block_size=0"):
        preset("tiny-hybrid", block_size=0)


def test_preset_can_be_resized_by_budget() -> None:
    cfg = preset("llama-like", kv_budget_bytes=64 << 20)
    assert cfg.num_blocks_resolved == (64 << 20) // cfg.kv_block_bytes()


def test_qwen3_next_like_has_three_linear_layers_per_attention_layer() -> None:
    cfg = preset("qwen3-next-like")
    assert len(cfg.ssm_layers) == 3 * len(cfg.attention_layers)
    assert all(isinstance(layer, AttentionLayer) for layer in cfg.layers[3::4])


def test_llama_like_is_dense_attention_with_gqa() -> None:
    dims = preset("llama-like").dims()
    assert dims.num_ssm_layers == 0
    assert dims.num_query_heads > dims.num_kv_heads


def test_storage_dtype_of_types_numpy_lacks_keeps_the_width() -> None:
    assert storage_dtype("bfloat16") == np.dtype(np.uint16)
    assert storage_dtype("float8_e5m2") == np.dtype(np.uint8)
    with pytest.raises(ConfigError):
        storage_dtype("float64")  # type: ignore[arg-type]
