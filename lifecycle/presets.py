"""Named model configurations: small ones for tests, shapes of real models scaled to host memory, and
eight models of 2026 built from their published ``config.json``.

``preset(name, **overrides)`` returns a validated :class:`~lifecycle.config.ModelConfig`; overrides
are any ``ModelConfig`` fields (``num_blocks=`` or ``kv_budget_bytes=`` resizes the KV pool).

The published-model presets (gpt-oss-20b, gpt-oss-120b, gemma-3-27b, llama-4-scout, deepseek-v3,
deepseek-v3.2, qwen3-next-80b-a3b, nemotron-h) are ``ModelConfig.from_hf_config`` of the fields of
their ``config.json`` that fix the cache (:data:`PUBLISHED_CONFIGS`), sized to fit a host device
(a 256 MiB KV budget; 128 MiB and two SSM slots for the SSM hybrids);
:func:`reference_kv_budget` gives the budget the issue-31 targets are measured at.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lifecycle.config import AttentionLayer, Layer, ModelConfig, SSMLayer
from lifecycle.errors import ConfigError

#: The fields of each model's published ``config.json`` that fix its cache (the repository's
#: tests/data/hf_configs/ holds the same fields with their source).
PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "sliding_window": 128, "torch_dtype": "bfloat16",
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    },
    # https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json
    "gpt-oss-120b": {
        "model_type": "gpt_oss", "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "sliding_window": 128, "torch_dtype": "bfloat16",
        "layer_types": ["sliding_attention", "full_attention"] * 18,
    },
    # https://huggingface.co/google/gemma-3-27b-it/blob/main/config.json (text_config)
    "gemma-3-27b": {
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
            "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024, "sliding_window_pattern": 6,
            "torch_dtype": "bfloat16",
        },
    },
    # https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json (text_config)
    "llama-4-scout": {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "num_hidden_layers": 48, "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192, "no_rope_layers": [],
            "torch_dtype": "bfloat16",
        },
    },
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
    "deepseek-v3": {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/deepseek-ai/DeepSeek-V3.2-Exp/blob/main/config.json
    "deepseek-v3.2": {
        "model_type": "deepseek_v32", "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128,
        "index_n_heads": 64, "index_topk": 2048, "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    },
    # https://huggingface.co/nvidia/Nemotron-H-8B-Base-8K/blob/main/config.json
    "nemotron-h": {
        "model_type": "nemotron_h", "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128, "hidden_size": 4096,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
        "expand": 2, "torch_dtype": "bfloat16",
    },
}
#: KV budget of the published-model presets: room to look at each group's pools on a host.
PUBLISHED_KV_BUDGET = 256 << 20
#: Blocks of the all-full-attention footprint whose half is the reference budget.
REFERENCE_BLOCKS = 262_144


def reference_kv_budget(config: ModelConfig, blocks: int = REFERENCE_BLOCKS) -> int:
    """Half the bytes ``blocks`` blocks would take if every KV layer of ``config`` were full
    attention: the budget issue 31's memory targets (concurrent 32k sequences, padding) are
    measured at, the same for every library compared."""
    return config.full_attention_bytes(blocks * config.block_size) // 2


def _published(name: str) -> Callable[[], ModelConfig]:
    def build() -> ModelConfig:
        hf = PUBLISHED_CONFIGS[name]
        ssm = "full_attention_interval" in hf or "hybrid_override_pattern" in hf
        # SSM slots of these models are 70-100 MiB each: two live sequences and two snapshots, and
        # half the KV budget, so that the whole model fits a 512 MiB host device.
        sizing = (
            {"max_seqs": 2, "num_snapshots": 2, "kv_budget_bytes": PUBLISHED_KV_BUDGET // 2}
            if ssm
            else {"max_seqs": 16, "kv_budget_bytes": PUBLISHED_KV_BUDGET}
        )
        return ModelConfig.from_hf_config(hf, name=name, **sizing)

    build.__doc__ = f"{name} from its published config.json"
    return build


def _tiny_hybrid() -> ModelConfig:
    """Two attention and two SSM layers, a few KiB each: the unit tests' model."""
    attention = AttentionLayer(num_kv_heads=2, head_dim=16)
    ssm = SSMLayer(h_state_bytes=2 * 16 * 16 * 4, conv_state_bytes=3 * 64 * 2)
    return ModelConfig(
        layers=(ssm, attention, ssm, attention),
        block_size=4,
        num_blocks=64,
        max_seqs=8,
        num_adapter_slots=2,
        num_query_heads=4,
        num_snapshots=4,
        name="tiny-hybrid",
    )


def _small_hybrid() -> ModelConfig:
    """Eight layers, one attention layer in four: 32 MiB of KV, about 12 MiB of SSM state."""
    attention = AttentionLayer(num_kv_heads=4, head_dim=64)
    ssm = SSMLayer(h_state_bytes=4 * 64 * 64 * 4, conv_state_bytes=3 * 512 * 2)
    layers: tuple[Layer, ...] = (ssm, ssm, ssm, attention) * 2
    return ModelConfig(
        layers=layers,
        block_size=16,
        num_blocks=1024,
        max_seqs=32,
        num_adapter_slots=4,
        num_query_heads=16,
        num_snapshots=32,
        name="small-hybrid",
    )


def _qwen3_next_like() -> ModelConfig:
    """Qwen3-Next's layer shapes: 48 layers, three Gated-DeltaNet layers per gated-attention layer.

    Attention: 2 KV heads of dim 256 (16 query heads), bfloat16. DeltaNet: 32 value heads of
    128x128 float32 recurrent state, and a width-4 convolution (3 cached positions) over 8192
    channels. Pool counts are scaled so the host pools take about 300 MiB.
    """
    attention = AttentionLayer(num_kv_heads=2, head_dim=256, dtype="bfloat16")
    delta_net = SSMLayer(
        h_state_bytes=32 * 128 * 128 * 4,
        conv_state_bytes=3 * 8192 * 2,
        h_dtype="float32",
        conv_dtype="bfloat16",
    )
    layers: tuple[Layer, ...] = (delta_net, delta_net, delta_net, attention) * 12
    return ModelConfig(
        layers=layers,
        block_size=16,
        num_blocks=256,
        max_seqs=2,
        num_query_heads=16,
        num_snapshots=2,
        name="qwen3-next-like",
    )


def _llama_like() -> ModelConfig:
    """Llama-3-8B's cache: 32 dense attention layers, 8 KV heads of dim 128 (GQA with 32 query
    heads), float16; a 256 MiB KV budget (128 blocks of 2 MiB)."""
    attention = AttentionLayer(num_kv_heads=8, head_dim=128)
    return ModelConfig(
        layers=(attention,) * 32,
        block_size=16,
        kv_budget_bytes=256 << 20,
        max_seqs=64,
        num_query_heads=32,
        name="llama-like",
    )


def _small_attention() -> ModelConfig:
    """Eight attention layers of 2 KV heads of dim 64, float16 (64 KiB a block of 16 tokens), 32 MiB
    of KV: a pure-attention model small enough to run anywhere, with tiers under its pool."""
    attention = AttentionLayer(num_kv_heads=2, head_dim=64)
    return ModelConfig(
        layers=(attention,) * 8,
        block_size=16,
        kv_budget_bytes=32 << 20,
        max_seqs=64,
        name="small-attention",
    )


_PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny-hybrid": _tiny_hybrid,
    "small-hybrid": _small_hybrid,
    "qwen3-next-like": _qwen3_next_like,
    "llama-like": _llama_like,
    "small-attention": _small_attention,
    **{name: _published(name) for name in PUBLISHED_CONFIGS},
}


def preset_names() -> tuple[str, ...]:
    """The names :func:`preset` accepts."""
    return tuple(_PRESETS)


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named configuration with ``overrides`` applied (validated like any ``ModelConfig``).
    Raises :class:`ConfigError` for an unknown name (listing the valid ones) or field."""
    factory = _PRESETS.get(name)
    if factory is None:
        raise ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(_PRESETS)}")
    config = factory()
    return config.replace(**overrides) if overrides else config
