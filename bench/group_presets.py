"""The models of issue 31's group targets, as their published ``config.json`` gives them, and the KV
budget every library gets for them (bench/peers_groups.py, peer_vllm_groups.py, peer_sglang_groups.py).

Each preset lists its KV layers in order: ``("full", 0)``, ``("sliding_window", window)`` or
``("chunked_local", chunk)``, all with the same ``num_kv_heads`` x ``head_dim`` per token (or, for
MLA, one ``kv_lora_rank + qk_rope_head_dim`` vector) in bf16. The values, from the configs:

- gpt-oss-120b / gpt-oss-20b (openai): 36 / 24 layers, ``layer_types`` alternating
  ``sliding_attention`` (even indices) and ``full_attention``, ``sliding_window`` 128,
  ``num_key_value_heads`` 8, ``head_dim`` 64, ``max_position_embeddings`` 131,072.
- gemma-3-27b (google/gemma-3-27b-it, ``text_config``): 62 layers, ``sliding_window`` 1,024,
  ``sliding_window_pattern`` 6 (layer ``i`` is global when ``(i + 1) % 6 == 0``: 10 global, 52 local),
  ``num_key_value_heads`` 16, ``head_dim`` 128, ``max_position_embeddings`` 131,072.
- llama-4-scout (meta-llama/Llama-4-Scout-17B-16E, ``text_config``): 48 layers,
  ``attention_chunk_size`` 8,192 on the RoPE layers; ``no_rope_layer_interval`` 4 makes every
  fourth layer (``(i + 1) % 4 == 0``) a NoPE global layer: 12 full, 36 chunked;
  ``num_key_value_heads`` 8, ``head_dim`` 128.
- deepseek-v3 (deepseek-ai/DeepSeek-V3): 61 MLA layers, ``kv_lora_rank`` 512,
  ``qk_rope_head_dim`` 64.

The budget (issue 31, Targets): half the all-full-attention footprint of 262,144 blocks of 16
tokens, ``0.5 * 262144 * 16 * sum over KV layers of the layer's bytes per token``.

Only the standard library here, so that the peers' environments can import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BLOCK_SIZE = 16
FOOTPRINT_BLOCKS = 262_144
BUDGET_FRACTION = 0.5
CONTEXT_32K = 32_768
DTYPE_BYTES = 2  # bfloat16


@dataclass(frozen=True)
class GroupPreset:
    name: str
    layers: tuple[tuple[str, int], ...]  # (kind, window or chunk; 0 for full)
    num_kv_heads: int
    head_dim: int
    mla_dim: int = 0  # kv_lora_rank + qk_rope_head_dim for MLA layers; 0 otherwise
    hf_config: tuple[tuple[str, Any], ...] = ()  # the config.json fields a peer's own config reader wants

    @property
    def bytes_per_token_per_layer(self) -> int:
        if self.mla_dim:
            return self.mla_dim * DTYPE_BYTES
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES

    @property
    def budget_bytes(self) -> int:
        return int(BUDGET_FRACTION * FOOTPRINT_BLOCKS * BLOCK_SIZE * self.bytes_per_token_per_layer * len(self.layers))

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.layers if k == kind)

    @property
    def window(self) -> int:
        """The sliding window or chunk of the model's windowed layers (0 when it has none)."""
        return max((w for _, w in self.layers), default=0)

    def ideal_32k_sequences(self) -> int:
        """Sequences of 32k tokens the budget holds when every layer keeps only what it attends to:
        full layers the whole context, windowed or chunked layers their window or chunk plus one
        block (issue 31's "ideal")."""
        per_sequence = 0
        for kind, window in self.layers:
            tokens = CONTEXT_32K if kind == "full" else min(CONTEXT_32K, window + BLOCK_SIZE)
            per_sequence += math.ceil(tokens / BLOCK_SIZE) * BLOCK_SIZE * self.bytes_per_token_per_layer
        return self.budget_bytes // per_sequence

    def config_json(self) -> dict[str, Any]:
        return dict(self.hf_config)


def _gpt_oss(name: str, layers: int) -> GroupPreset:
    kinds = tuple(("sliding_window", 128) if i % 2 == 0 else ("full", 0) for i in range(layers))
    return GroupPreset(
        name=name,
        layers=kinds,
        num_kv_heads=8,
        head_dim=64,
        hf_config=(
            ("architectures", ["GptOssForCausalLM"]),
            ("model_type", "gpt_oss"),
            ("num_hidden_layers", layers),
            ("num_attention_heads", 64),
            ("num_key_value_heads", 8),
            ("head_dim", 64),
            ("hidden_size", 2880),
            ("intermediate_size", 2880),
            ("sliding_window", 128),
            ("layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]),
            ("vocab_size", 201088),
            ("max_position_embeddings", 131072),
            ("num_local_experts", 128 if layers == 36 else 32),
            ("num_experts_per_tok", 4),
            ("experts_per_token", 4),
            ("rope_theta", 150000),
            ("torch_dtype", "bfloat16"),
        ),
    )


def _gemma3_27b() -> GroupPreset:
    layers = tuple(("full", 0) if (i + 1) % 6 == 0 else ("sliding_window", 1024) for i in range(62))
    return GroupPreset(
        name="gemma-3-27b",
        layers=layers,
        num_kv_heads=16,
        head_dim=128,
        hf_config=(
            ("architectures", ["Gemma3ForCausalLM"]),
            ("model_type", "gemma3_text"),
            ("num_hidden_layers", 62),
            ("num_attention_heads", 32),
            ("num_key_value_heads", 16),
            ("head_dim", 128),
            ("hidden_size", 5376),
            ("intermediate_size", 21504),
            ("sliding_window", 1024),
            ("sliding_window_pattern", 6),
            ("layer_types", ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]),
            ("vocab_size", 262208),
            ("max_position_embeddings", 131072),
            ("query_pre_attn_scalar", 168),
            ("rope_theta", 1000000.0),
            ("rope_local_base_freq", 10000.0),
            ("torch_dtype", "bfloat16"),
        ),
    )


def _llama4_scout() -> GroupPreset:
    layers = tuple(("full", 0) if (i + 1) % 4 == 0 else ("chunked_local", 8192) for i in range(48))
    return GroupPreset(
        name="llama-4-scout",
        layers=layers,
        num_kv_heads=8,
        head_dim=128,
        hf_config=(
            ("architectures", ["Llama4ForCausalLM"]),
            ("model_type", "llama4_text"),
            ("num_hidden_layers", 48),
            ("num_attention_heads", 40),
            ("num_key_value_heads", 8),
            ("head_dim", 128),
            ("hidden_size", 5120),
            ("intermediate_size", 8192),
            ("intermediate_size_mlp", 16384),
            ("attention_chunk_size", 8192),
            ("no_rope_layers", [int((i + 1) % 4 != 0) for i in range(48)]),
            ("num_local_experts", 16),
            ("num_experts_per_tok", 1),
            ("interleave_moe_layer_step", 1),
            ("vocab_size", 202048),
            ("max_position_embeddings", 10485760),
            ("rope_theta", 500000.0),
            ("torch_dtype", "bfloat16"),
        ),
    )


def _deepseek_v3() -> GroupPreset:
    return GroupPreset(
        name="deepseek-v3",
        layers=(("full", 0),) * 61,
        num_kv_heads=1,
        head_dim=576,
        mla_dim=512 + 64,
        hf_config=(
            ("architectures", ["DeepseekV3ForCausalLM"]),
            ("model_type", "deepseek_v3"),
            ("num_hidden_layers", 61),
            ("kv_lora_rank", 512),
            ("qk_rope_head_dim", 64),
            ("qk_nope_head_dim", 128),
            ("v_head_dim", 128),
            ("torch_dtype", "bfloat16"),
        ),
    )


PRESETS: dict[str, GroupPreset] = {
    p.name: p
    for p in (_gpt_oss("gpt-oss-120b", 36), _gemma3_27b(), _llama4_scout(), _gpt_oss("gpt-oss-20b", 24), _deepseek_v3())
}
DEFAULT_PRESETS = ("gpt-oss-120b", "gemma-3-27b", "llama-4-scout", "gpt-oss-20b")
