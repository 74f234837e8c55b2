"""Named model configurations: small ones for tests, and shapes of real models scaled to host memory.

``preset(name, **overrides)`` returns a validated :class:`~lifecycle.config.ModelConfig`; overrides
are any ``ModelConfig`` fields (``num_blocks=`` or ``kv_budget_bytes=`` resizes the KV pool).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lifecycle.config import AttentionLayer, Layer, ModelConfig, SSMLayer
from lifecycle.errors import ConfigError


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
