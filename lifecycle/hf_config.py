"""A :class:`~lifecycle.config.ModelConfig` from a model's Hugging Face ``config.json``.

``config_from_hf(hf_config, **fields)`` (also ``ModelConfig.from_hf_config``) reads the fields that
fix the KV cache and the SSM state of the architectures whose layers this library knows: per-layer
``layer_types`` (gpt-oss, Gemma 3, Qwen3-Next and most recent models), Gemma 3's
``sliding_window_pattern``, Llama 4's ``attention_chunk_size`` and ``no_rope_layers``, MLA
(``kv_lora_rank``, ``qk_rope_head_dim``) and DeepSeek-V3.2's indexer (``index_head_dim``), Qwen3-Next's
gated-delta-net layers (``full_attention_interval``, ``linear_*``), Nemotron-H's
``hybrid_override_pattern`` and Mamba-2 dimensions, and plain dense attention. A multimodal config's
``text_config`` is read in its place. A field it cannot map, or one it needs and does not find,
raises :class:`~lifecycle.errors.ConfigError` naming it.

Bytes per token, as the serving engines store them (vLLM's ``kv_cache_interface`` specs):
attention ``2 * num_key_value_heads * head_dim`` elements (K and V); MLA ``kv_lora_rank +
qk_rope_head_dim`` elements; the indexer ``index_head_dim`` fp8 bytes plus a 4-byte float scale (one
per 128 elements). Per-sequence SSM state: gated delta net ``linear_num_value_heads *
linear_key_head_dim * linear_value_head_dim`` float32 and a convolution window of
``linear_conv_kernel_dim - 1`` positions over ``2 * linear_num_key_heads * linear_key_head_dim +
linear_num_value_heads * linear_value_head_dim`` channels; Mamba-2 ``mamba_num_heads *
mamba_head_dim * ssm_state_size`` float32 and ``conv_kernel - 1`` positions over ``mamba_num_heads *
mamba_head_dim + 2 * n_groups * ssm_state_size`` channels. KV and convolution state are stored in
the model's dtype (``torch_dtype``) unless ``kv_cache_dtype=`` says otherwise.
"""

from __future__ import annotations

from typing import Any, get_args

from lifecycle.config import (
    DTYPE_SIZES,
    AttentionLayer,
    ChunkedLocalLayer,
    DType,
    IndexerLayer,
    Layer,
    MLALayer,
    ModelConfig,
    SlidingWindowLayer,
    SSMLayer,
)
from lifecycle.errors import ConfigError

__all__ = ["UNMAPPED_FIELDS", "config_from_hf"]

#: Fields of architectures whose cache this module does not lay out: a config carrying one is
#: refused (naming it) rather than read as something it is not.
UNMAPPED_FIELDS = (
    "compress_ratios",  # DeepSeek-V4's compressed KV
    "attn_layer_period",  # Jamba's attention placement
    "layers_block_type",
    "cross_attention_layers",  # Llama 3.2 vision's cross-attention cache
    "kv_lora_rank_per_layer",
)
#: The ``layer_types`` entries this module knows, by the kind of layer each becomes.
_FULL_TYPES = ("full_attention", "attention", "global_attention")
_SLIDING_TYPES = ("sliding_attention", "local_attention")
_CHUNKED_TYPES = ("chunked_attention",)
_LINEAR_TYPES = ("linear_attention", "mamba", "mamba2")
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
_MLP_ONLY_PATTERN = "-E"  # Nemotron-H's feed-forward and MoE layers: no cache


def _field(hf: dict[str, Any], name: str, minimum: int = 1) -> int:
    if name not in hf or hf[name] is None:
        raise ConfigError(f"config.json has no {name!r}, which this model's layers need")
    value = hf[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config.json field {name}={value!r} must be an int >= {minimum}")
    return value


def _model_dtype(hf: dict[str, Any], override: str | None) -> DType:
    if override is not None:
        if override not in get_args(DType):
            raise ConfigError(
                f"kv_cache_dtype={override!r} is not a supported dtype; expected one of {get_args(DType)}"
            )
        return override  # type: ignore[return-value]  # checked against DType's names just above
    name = "torch_dtype" if "torch_dtype" in hf else "dtype"
    value = hf.get(name, "bfloat16")
    if not isinstance(value, str) or value not in _DTYPES:
        raise ConfigError(f"config.json field {name}={value!r} is not a dtype this library stores; expected one of "
                          f"{sorted(_DTYPES)}")
    return _DTYPES[value]  # type: ignore[return-value]  # every value of _DTYPES is a DType


def _head_dim(hf: dict[str, Any]) -> int:
    for name in ("head_dim", "attention_head_dim"):
        if hf.get(name) is not None:
            return _field(hf, name)
    return _field(hf, "hidden_size") // _field(hf, "num_attention_heads")


def _kv_heads(hf: dict[str, Any]) -> int:
    return _field(hf, "num_key_value_heads") if hf.get("num_key_value_heads") is not None else _field(
        hf, "num_attention_heads"
    )


def _layer_kinds(hf: dict[str, Any], num_layers: int) -> list[str]:
    """One of "full", "sliding", "chunked", "linear" per layer."""
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(f"config.json field layer_types has {len(types) if isinstance(types, list) else types!r} "
                              f"entries; num_hidden_layers={num_layers}")
        kinds = []
        for index, name in enumerate(types):
            for kind, names in (("full", _FULL_TYPES), ("sliding", _SLIDING_TYPES), ("chunked", _CHUNKED_TYPES),
                                ("linear", _LINEAR_TYPES)):
                if name in names:
                    kinds.append(kind)
                    break
            else:
                raise ConfigError(f"config.json field layer_types[{index}]={name!r} is not a layer kind this library "
                                  "lays out")
        return kinds
    if hf.get("full_attention_interval") is not None:  # Qwen3-Next: linear layers, every n-th full
        interval = _field(hf, "full_attention_interval")
        return ["full" if (index + 1) % interval == 0 else "linear" for index in range(num_layers)]
    if hf.get("sliding_window_pattern") is not None and hf.get("sliding_window") is not None:  # Gemma 3
        pattern = _field(hf, "sliding_window_pattern")
        return ["full" if (index + 1) % pattern == 0 else "sliding" for index in range(num_layers)]
    if hf.get("attention_chunk_size") is not None:  # Llama 4: chunked where RoPE is on, full on NoPE layers
        rope = hf.get("no_rope_layers") or [
            int((index + 1) % int(hf.get("no_rope_layer_interval", 4)) != 0) for index in range(num_layers)
        ]
        if len(rope) != num_layers:
            raise ConfigError(
                f"config.json field no_rope_layers has {len(rope)} entries; num_hidden_layers={num_layers}"
            )
        return ["chunked" if uses_rope else "full" for uses_rope in rope]
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):  # every layer windowed
        return ["sliding"] * num_layers
    return ["full"] * num_layers


def _gated_delta_net(hf: dict[str, Any], dtype: DType) -> SSMLayer:
    value_heads = _field(hf, "linear_num_value_heads")
    key_heads = _field(hf, "linear_num_key_heads")
    key_dim = _field(hf, "linear_key_head_dim")
    value_dim = _field(hf, "linear_value_head_dim")
    window = _field(hf, "linear_conv_kernel_dim", 2) - 1
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    return SSMLayer(
        h_state_bytes=value_heads * key_dim * value_dim * 4,
        conv_state_bytes=window * channels * DTYPE_SIZES[dtype],
        h_dtype="float32",
        conv_dtype=dtype,
    )


def _mamba2(hf: dict[str, Any], dtype: DType) -> SSMLayer:
    heads = _field(hf, "mamba_num_heads")
    head_dim = _field(hf, "mamba_head_dim")
    state = _field(hf, "ssm_state_size")
    groups = _field(hf, "n_groups")
    window = _field(hf, "conv_kernel", 2) - 1
    channels = heads * head_dim + 2 * groups * state
    return SSMLayer(
        h_state_bytes=heads * head_dim * state * 4,
        conv_state_bytes=window * channels * DTYPE_SIZES[dtype],
        h_dtype="float32",
        conv_dtype=dtype,
    )


def hf_layers(hf_config: dict[str, Any], kv_cache_dtype: str | None = None) -> tuple[Layer, ...]:
    """The cache layers of the model ``hf_config`` describes, in model order (layers without a
    cache, such as Nemotron-H's feed-forward layers, are left out)."""
    if not isinstance(hf_config, dict):
        raise ConfigError(f"a config.json must be a dict, got {type(hf_config).__name__}")
    hf = hf_config.get("text_config") or hf_config
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json field text_config must be a dict, got {type(hf).__name__}")
    for name in UNMAPPED_FIELDS:
        if hf.get(name) is not None:
            raise ConfigError(f"config.json field {name!r} describes a cache this library does not lay out")
    dtype = _model_dtype(hf, kv_cache_dtype)
    pattern = hf.get("hybrid_override_pattern")
    if pattern is not None:  # Nemotron-H: M Mamba-2, * attention, - and E no cache
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"config.json field hybrid_override_pattern={pattern!r} must be a non-empty str")
        attention = AttentionLayer(_kv_heads(hf), _head_dim(hf), dtype)
        mamba = _mamba2(hf, dtype) if "M" in pattern else None
        layers: list[Layer] = []
        for index, char in enumerate(pattern):
            if char == "*":
                layers.append(attention)
            elif char == "M" and mamba is not None:
                layers.append(mamba)
            elif char not in _MLP_ONLY_PATTERN:
                raise ConfigError(f"config.json field hybrid_override_pattern[{index}]={char!r} is not a layer kind "
                                  "this library lays out (M, *, -, E)")
        return tuple(layers)
    num_layers = _field(hf, "num_hidden_layers")
    if hf.get("kv_lora_rank") is not None:  # MLA, with DeepSeek-V3.2's indexer beside it
        mla = MLALayer(_field(hf, "kv_lora_rank"), _field(hf, "qk_rope_head_dim", 0), dtype)
        if hf.get("index_head_dim") is None:
            return (mla,) * num_layers
        indexer = IndexerLayer(_field(hf, "index_head_dim"))
        return (mla, indexer) * num_layers
    kinds = _layer_kinds(hf, num_layers)
    heads, head_dim = _kv_heads(hf), _head_dim(hf)
    built: dict[str, Layer] = {}
    for kind in set(kinds):
        if kind == "full":
            built[kind] = AttentionLayer(heads, head_dim, dtype)
        elif kind == "sliding":
            built[kind] = SlidingWindowLayer(heads, head_dim, _field(hf, "sliding_window"), dtype=dtype)
        elif kind == "chunked":
            built[kind] = ChunkedLocalLayer(heads, head_dim, _field(hf, "attention_chunk_size"), dtype)
        else:
            built[kind] = _gated_delta_net(hf, dtype)
    return tuple(built[kind] for kind in kinds)


def config_from_hf(hf_config: dict[str, Any], **fields: Any) -> ModelConfig:
    """A validated :class:`ModelConfig` of ``hf_config``'s layers with ``fields`` applied
    (``kv_cache_dtype=`` overrides the cache dtype; ``name`` defaults to the config's
    ``_name_or_path`` or ``model_type``; without a size, ``kv_budget_bytes`` defaults to 256 MiB)."""
    kv_cache_dtype = fields.pop("kv_cache_dtype", None)
    layers = hf_layers(hf_config, kv_cache_dtype)
    text = hf_config.get("text_config") or hf_config
    fields.setdefault("name", str(hf_config.get("_name_or_path") or text.get("model_type") or "model"))
    has_kv = any(not isinstance(layer, SSMLayer) for layer in layers)
    if has_kv and "num_blocks" not in fields and "kv_budget_bytes" not in fields:
        fields["kv_budget_bytes"] = 256 << 20
    if "num_query_heads" not in fields and text.get("num_attention_heads") and not text.get("kv_lora_rank"):
        fields["num_query_heads"] = text["num_attention_heads"]
    try:
        return ModelConfig(layers=layers, **fields)
    except TypeError as error:  # an unknown field name
        raise ConfigError(f"ModelConfig has no such field: {error}") from None
