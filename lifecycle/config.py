"""The model's memory, described: layers, block size, pool sizes. Frozen and validated.

A :class:`ModelConfig` is checked completely when it is built, so every later layer (pools, block
pool, slots, swap) can trust it: a bad value raises :class:`~lifecycle.errors.ConfigError` naming the
field and the value. Layer indices elsewhere in the library count attention layers and SSM layers
separately (``config.attention_layers[i]`` is the KV pool's layer ``i``).

KV layers come in five kinds: full attention (:class:`AttentionLayer`), sliding window
(:class:`SlidingWindowLayer`), chunked local attention (:class:`ChunkedLocalLayer`), MLA's latent
cache (:class:`MLALayer`) and a sparse-attention indexer cache (:class:`IndexerLayer`). The layers
that share an attention rule form a KV cache group (:class:`KVGroupSpec`, ``config.kv_groups``);
each group has its own pool of whole pages (no padding between groups), all with the model's one
``block_size`` in tokens. :meth:`ModelConfig.memory_plan` says what each group holds and how many
sequences of a length fit.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np

from lifecycle.errors import ConfigError

#: The names of the dtypes a layer may store (``typing.get_args(DType)`` lists them).
DType: TypeAlias = Literal["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]

#: numpy scalar types of the array views of stored data (see :func:`storage_dtype`).
StorageScalar: TypeAlias = np.float16 | np.uint16 | np.float32 | np.uint8 | np.int8

#: Bytes per element of every dtype a layer may store.
DTYPE_SIZES: dict[DType, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# numpy has no bfloat16 / float8 types: their views use an unsigned integer of the same width, which
# kernels reinterpret (e.g. ``torch.as_tensor(view).view(torch.bfloat16)``).
_STORAGE_DTYPES: dict[DType, type[StorageScalar]] = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "int8": np.int8,
    "uint8": np.uint8,
}

_INT32_MAX = 2**31 - 1

#: Bumped whenever the meaning of a fingerprinted field changes, so old records are refused.
_FINGERPRINT_VERSION = 1

#: Share of a budget that the default split gives the windowed groups (sliding window, chunked local)
#: beyond what their live windows need: room for the windows that prefix caching keeps at retention
#: checkpoints. Small enough that the concurrent max_model_len sequences stay within 3% of the ideal.
RETENTION_RESERVE = 0.02

#: The kinds of KV cache group, by attention rule.
GroupKind: TypeAlias = Literal["full", "sliding_window", "chunked_local"]


def storage_dtype(dtype: DType) -> np.dtype[StorageScalar]:
    """The numpy dtype that array views of ``dtype`` data use (same width; see module notes)."""
    _check_dtype("dtype", dtype)
    return np.dtype(_STORAGE_DTYPES[dtype])


def _check_int(field: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{field}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{field}={value} must be <= {maximum}")


def _check_dtype(field: str, value: object) -> None:
    if not isinstance(value, str) or value not in DTYPE_SIZES:
        raise ConfigError(f"{field}={value!r} is not a supported dtype; expected one of {sorted(DTYPE_SIZES)}")


def _check_bool(field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{field} must be a bool, got {value!r}")


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """An attention layer's paged KV cache: per token, ``num_kv_heads * head_dim`` elements of K and
    of V (K only when ``v_aliases_k``, as in MLA-style caches where V is read from K)."""

    num_kv_heads: int
    head_dim: int
    dtype: DType = "float16"
    v_aliases_k: bool = False

    def __post_init__(self) -> None:
        _check_heads("AttentionLayer", self.num_kv_heads, self.head_dim, self.dtype)
        _check_bool("AttentionLayer.v_aliases_k", self.v_aliases_k)

    @property
    def kv_planes(self) -> int:
        """2 (K and V) or 1 (K only, when V aliases K)."""
        return 1 if self.v_aliases_k else 2

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    def block_shape(self, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one block of this layer: ``(kv_planes, block_size, num_kv_heads, head_dim)``."""
        return (self.kv_planes, block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this layer (K and V, or K alone)."""
        return self.kv_planes * self.num_kv_heads * self.head_dim * self.itemsize

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block of this layer holds (K and V, or K alone)."""
        return block_size * self.bytes_per_token


def _check_heads(kind: str, num_kv_heads: object, head_dim: object, dtype: object) -> None:
    _check_int(f"{kind}.num_kv_heads", num_kv_heads, 1)
    _check_int(f"{kind}.head_dim", head_dim, 1)
    _check_dtype(f"{kind}.dtype", dtype)


class _LocalKV:
    """What the local attention layers (sliding window, chunked) share: K and V of
    ``num_kv_heads * head_dim`` elements per token."""

    __slots__ = ()
    num_kv_heads: int
    head_dim: int
    dtype: DType

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this layer (K and V)."""
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    def block_shape(self, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one block of this layer: ``(2, block_size, num_kv_heads, head_dim)``."""
        return (2, block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block of this layer holds."""
        return block_size * self.bytes_per_token


@dataclass(frozen=True, slots=True)
class SlidingWindowLayer(_LocalKV):
    """A sliding-window attention layer: K and V of ``num_kv_heads * head_dim`` elements per token,
    of which a token attends to the last ``window`` (plus the first ``sink_tokens`` of the
    sequence, as attention sinks)."""

    num_kv_heads: int
    head_dim: int
    window: int
    sink_tokens: int = 0
    dtype: DType = "float16"

    def __post_init__(self) -> None:
        _check_heads("SlidingWindowLayer", self.num_kv_heads, self.head_dim, self.dtype)
        _check_int("SlidingWindowLayer.window", self.window, 1, _INT32_MAX)
        _check_int("SlidingWindowLayer.sink_tokens", self.sink_tokens, 0, _INT32_MAX)


@dataclass(frozen=True, slots=True)
class ChunkedLocalLayer(_LocalKV):
    """A chunked local attention layer (Llama 4's): a token attends to the tokens of its own
    ``chunk_size``-token chunk only; K and V of ``num_kv_heads * head_dim`` elements per token."""

    num_kv_heads: int
    head_dim: int
    chunk_size: int
    dtype: DType = "float16"

    def __post_init__(self) -> None:
        _check_heads("ChunkedLocalLayer", self.num_kv_heads, self.head_dim, self.dtype)
        _check_int("ChunkedLocalLayer.chunk_size", self.chunk_size, 1, _INT32_MAX)


@dataclass(frozen=True, slots=True)
class MLALayer:
    """Multi-head latent attention's cache (DeepSeek-V3, Kimi K2): one vector per token of the
    compressed latent (``kv_lora_rank``) and its rope part (``qk_rope_head_dim``), no per-head K
    and V. Every token is kept (the full-attention rule)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: DType = "bfloat16"

    def __post_init__(self) -> None:
        _check_int("MLALayer.kv_lora_rank", self.kv_lora_rank, 1)
        _check_int("MLALayer.qk_rope_head_dim", self.qk_rope_head_dim, 0)
        _check_dtype("MLALayer.dtype", self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this layer: the latent and rope elements."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * DTYPE_SIZES[self.dtype]

    def block_shape(self, block_size: int) -> tuple[int, int]:
        """Shape of one block of this layer: ``(block_size, kv_lora_rank + qk_rope_head_dim)``."""
        return (block_size, self.kv_lora_rank + self.qk_rope_head_dim)

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block of this layer holds."""
        return block_size * self.bytes_per_token


@dataclass(frozen=True, slots=True)
class IndexerLayer:
    """A sparse-attention indexer's key cache (DeepSeek-V3.2): per token, ``head_dim`` elements of
    ``dtype`` and ``scale_bytes`` of quantization scale. Every token is kept (the full-attention
    rule); its pages have their own size in bytes."""

    head_dim: int
    dtype: DType = "float8_e4m3fn"
    scale_bytes: int = 4

    def __post_init__(self) -> None:
        _check_int("IndexerLayer.head_dim", self.head_dim, 1)
        _check_dtype("IndexerLayer.dtype", self.dtype)
        _check_int("IndexerLayer.scale_bytes", self.scale_bytes, 0)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this layer: the key and its scale."""
        return self.head_dim * DTYPE_SIZES[self.dtype] + self.scale_bytes

    def block_shape(self, block_size: int) -> tuple[int, int]:
        """Shape of one block of this layer in bytes: ``(block_size, bytes_per_token)``."""
        return (block_size, self.bytes_per_token)

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block of this layer holds."""
        return block_size * self.bytes_per_token


@dataclass(frozen=True, slots=True)
class SSMLayer:
    """An SSM / linear-attention layer's per-sequence state: the recurrent ``h`` state and the
    convolution window, each a whole number of elements of its dtype."""

    h_state_bytes: int
    conv_state_bytes: int
    h_dtype: DType = "float32"
    conv_dtype: DType = "float16"

    def __post_init__(self) -> None:
        _check_int("SSMLayer.h_state_bytes", self.h_state_bytes, 1)
        _check_int("SSMLayer.conv_state_bytes", self.conv_state_bytes, 1)
        _check_dtype("SSMLayer.h_dtype", self.h_dtype)
        _check_dtype("SSMLayer.conv_dtype", self.conv_dtype)
        for name, nbytes, dtype in (
            ("h_state_bytes", self.h_state_bytes, self.h_dtype),
            ("conv_state_bytes", self.conv_state_bytes, self.conv_dtype),
        ):
            if nbytes % DTYPE_SIZES[dtype]:
                raise ConfigError(
                    f"SSMLayer.{name}={nbytes} is not a whole number of {dtype} elements "
                    f"({DTYPE_SIZES[dtype]} bytes each)"
                )

    @property
    def slot_bytes(self) -> int:
        """Bytes of one sequence's state in this layer (h and conv)."""
        return self.h_state_bytes + self.conv_state_bytes


#: A layer with a paged KV cache.
KVLayer: TypeAlias = AttentionLayer | SlidingWindowLayer | ChunkedLocalLayer | MLALayer | IndexerLayer
Layer: TypeAlias = KVLayer | SSMLayer
_KV_LAYER_TYPES = (AttentionLayer, SlidingWindowLayer, ChunkedLocalLayer, MLALayer, IndexerLayer)


def layer_rule(layer: KVLayer) -> tuple[GroupKind, int, int]:
    """The attention rule of ``layer``: ``(kind, window or chunk size, sink tokens)``; layers with
    the same rule share a KV cache group."""
    if isinstance(layer, SlidingWindowLayer):
        return ("sliding_window", layer.window, layer.sink_tokens)
    if isinstance(layer, ChunkedLocalLayer):
        return ("chunked_local", layer.chunk_size, 0)
    return ("full", 0, 0)


def blocks_per_sequence(kind: GroupKind, window: int, sink_tokens: int, tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``tokens`` tokens holds at once in a group of that rule: every block
    under full attention; under a sliding window the blocks covering the window and sink tokens,
    plus one (the window straddles a block boundary); under chunked attention the chunk's blocks
    plus one. Never more than the sequence's own blocks."""
    every = -(-tokens // block_size)
    if kind == "full":
        return every
    span = window + sink_tokens if kind == "sliding_window" else window
    return min(every, -(-span // block_size) + 1)


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One KV cache group: the layers that share an attention rule, and its own pool of blocks.

    ``index`` is the group's position in ``config.kv_groups`` (group 0 is the full-attention group
    when there is one); ``window`` is the sliding window or the chunk size (0 for full attention);
    ``sink_tokens`` is 0 unless sliding window; ``layer_indices`` index ``config.layers``;
    ``block_bytes`` is one block across the group's layers (the sum of their pages)."""

    index: int
    kind: GroupKind
    window: int
    sink_tokens: int
    layer_indices: tuple[int, ...]
    block_bytes: int
    num_blocks: int

    def blocks_per_sequence(self, tokens: int, block_size: int) -> int:
        """Blocks one sequence of ``tokens`` tokens holds at once in this group."""
        return blocks_per_sequence(self.kind, self.window, self.sink_tokens, tokens, block_size)


@dataclass(frozen=True, slots=True)
class GroupMemory:
    """One KV cache group's memory in a :class:`MemoryPlan`."""

    index: int
    kind: GroupKind
    window: int
    sink_tokens: int
    layers: int
    bytes_per_token: int
    block_bytes: int
    num_blocks: int
    bytes: int


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What each KV cache group holds, out of ``budget_bytes`` (``kv_budget_bytes``, or the pools'
    bytes when the config gives block counts), and what that buys.

    ``concurrent_sequences(tokens)`` is how many sequences of ``tokens`` tokens fit in every group
    at once; ``ideal_sequences(tokens)`` is the budget divided by the bytes one such sequence needs
    across the groups (full groups every token, windowed groups their window plus one block), what a
    layout with no rounding at all would fit; ``padding_waste(tokens)`` is the share of the budget
    that does not hold those sequences' KV: partial last blocks, the split's rounding and reserve,
    budget left unassigned."""

    groups: tuple[GroupMemory, ...]
    block_size: int
    budget_bytes: int

    def _needs(self, tokens: int) -> list[int]:
        _check_int("tokens", tokens, 1)
        return [
            blocks_per_sequence(group.kind, group.window, group.sink_tokens, tokens, self.block_size)
            for group in self.groups
        ]

    def sequence_bytes(self, tokens: int) -> int:
        """Bytes of KV one sequence of ``tokens`` tokens holds across the groups: each token's
        bytes in full groups, a windowed group's blocks (window plus one block) in the others."""
        total = 0
        for group, blocks in zip(self.groups, self._needs(tokens), strict=True):
            held = tokens if group.kind == "full" else blocks * self.block_size
            total += held * group.bytes_per_token
        return total

    def concurrent_sequences(self, tokens: int = 32768) -> int:
        """Sequences of ``tokens`` tokens that fit in every group at once (0 without KV groups)."""
        needs = self._needs(tokens)
        if not self.groups:
            return 0
        return min(group.num_blocks // need for group, need in zip(self.groups, needs, strict=True))

    def ideal_sequences(self, tokens: int = 32768) -> int:
        """The budget over :meth:`sequence_bytes`: what a layout without rounding would fit."""
        need = self.sequence_bytes(tokens)
        return self.budget_bytes // need if need else 0

    def padding_waste(self, tokens: int = 32768) -> float:
        """Share of the budget not holding the KV of :meth:`concurrent_sequences` sequences."""
        if not self.budget_bytes:
            return 0.0
        used = self.concurrent_sequences(tokens) * self.sequence_bytes(tokens)
        return (self.budget_bytes - used) / self.budget_bytes

    def as_dict(self, tokens: int = 32768) -> dict[str, Any]:
        """The plan and its figures at ``tokens`` as plain JSON-ready values."""
        return {
            "block_size": self.block_size,
            "budget_bytes": self.budget_bytes,
            "tokens": tokens,
            "concurrent_sequences": self.concurrent_sequences(tokens),
            "ideal_sequences": self.ideal_sequences(tokens),
            "padding_waste": round(self.padding_waste(tokens), 6),
            "groups": [dataclasses.asdict(group) for group in self.groups],
        }


@dataclass(frozen=True, slots=True)
class ModelDims:
    """What a swap orchestrator needs to know of a model's memory; ``fingerprint`` identifies the
    byte format of its blocks and slots. ``num_kv_heads`` and ``head_dim`` are those of the first
    attention layer (0 without one); ``max_blocks_per_layer`` is the number of KV blocks."""

    num_layers: int
    num_attention_layers: int
    num_ssm_layers: int
    max_blocks_per_layer: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    fingerprint: int


@dataclass(frozen=True)
class ModelConfig:
    """A model's memory layout and pool sizes; validated when built (``ConfigError`` naming the
    field).

    Exactly one of ``num_blocks`` and ``kv_budget_bytes`` sizes the KV pools when the model has a
    KV layer; a model without one has no KV pool and takes neither (or ``num_blocks=0``). With one
    KV group, ``num_blocks`` is its block count and a budget gives ``kv_budget_bytes //
    kv_block_bytes()`` blocks. With several, ``num_blocks`` is a tuple (one count per group) and a
    budget is split between the groups' pools: by default in proportion to what one sequence of
    ``max_model_len`` tokens needs in each (see :data:`RETENTION_RESERVE`), or by
    ``group_budget_fractions`` (one share per group, summing to at most 1).
    ``num_query_heads=0`` means "same as the KV heads"; ``max_blocks_per_seq=0`` means "the whole
    pool". ``max_model_len`` bounds windows and chunks and sizes the default split.
    ``eviction_policy`` is the order the prefix cache evicts in within a retention priority
    (``KVCacheCore(eviction_policy=...)``: ``"lru"``, ``"branch-lru"`` or ``"branch-lru-exact"``);
    a model of several KV groups takes ``"lru"`` only.
    """

    layers: tuple[Layer, ...]
    block_size: int = 16
    num_blocks: int | tuple[int, ...] | None = None
    kv_budget_bytes: int | None = None
    max_seqs: int = 64
    num_adapter_slots: int = 0
    num_query_heads: int = 0
    max_blocks_per_seq: int = 0
    num_snapshots: int = 0
    enable_prefix_cache: bool = True
    name: str = "model"
    max_model_len: int = 32768
    group_budget_fractions: tuple[float, ...] | None = None
    eviction_policy: str = "lru"
    _num_blocks: int = field(init=False, repr=False, compare=False, default=0)
    _kv_groups: tuple[KVGroupSpec, ...] = field(init=False, repr=False, compare=False, default=())
    _fingerprint: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, list):
            layers = tuple(layers)
            object.__setattr__(self, "layers", layers)
        if not isinstance(layers, tuple) or not layers:
            raise ConfigError(f"layers must be a non-empty tuple of layers (KV layers, SSMLayer), got {self.layers!r}")
        for index, layer in enumerate(layers):
            if not isinstance(layer, (*_KV_LAYER_TYPES, SSMLayer)):
                kinds = ", ".join(kind.__name__ for kind in _KV_LAYER_TYPES)
                raise ConfigError(f"layers[{index}]={layer!r} is neither a KV layer ({kinds}) nor an SSMLayer")
        _check_int("block_size", self.block_size, 1, _INT32_MAX)
        _check_int("max_seqs", self.max_seqs, 1, _INT32_MAX - 1)  # + 1 padding slot stays an int32
        _check_int("num_adapter_slots", self.num_adapter_slots, 0, _INT32_MAX)
        _check_int("num_query_heads", self.num_query_heads, 0)
        _check_int("max_blocks_per_seq", self.max_blocks_per_seq, 0, _INT32_MAX)
        _check_int("num_snapshots", self.num_snapshots, 0, _INT32_MAX)
        _check_int("max_model_len", self.max_model_len, 1, _INT32_MAX)
        _check_bool("enable_prefix_cache", self.enable_prefix_cache)
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"name must be a non-empty str, got {self.name!r}")
        self._check_windows()
        rules = self._group_rules()
        counts = self._resolve_num_blocks(rules)
        groups = tuple(
            KVGroupSpec(
                index=index,
                kind=kind,
                window=window,
                sink_tokens=sink,
                layer_indices=members,
                block_bytes=block_bytes,
                num_blocks=count,
            )
            for index, ((kind, window, sink, members, block_bytes), count) in enumerate(zip(rules, counts, strict=True))
        )
        object.__setattr__(self, "_kv_groups", groups)
        object.__setattr__(self, "_num_blocks", counts[0] if counts else 0)
        self._check_eviction_policy(len(groups))
        if self.max_blocks_per_seq > self._num_blocks:
            raise ConfigError(
                f"max_blocks_per_seq={self.max_blocks_per_seq} exceeds the pool's {self._num_blocks} blocks"
            )
        if self.num_query_heads:
            for index, layer in enumerate(self.kv_layers):
                if isinstance(layer, (MLALayer, IndexerLayer)):
                    continue
                if self.num_query_heads % layer.num_kv_heads:
                    raise ConfigError(
                        f"num_query_heads={self.num_query_heads} is not a multiple of attention layer "
                        f"{index}'s num_kv_heads={layer.num_kv_heads}"
                    )
        if self.num_snapshots and not self.ssm_layers:
            raise ConfigError(f"num_snapshots={self.num_snapshots} needs an SSM layer; the model has none")
        digest = hashlib.blake2b(self._canonical().encode("ascii"), digest_size=8).digest()
        object.__setattr__(self, "_fingerprint", int.from_bytes(digest, "little"))

    def _check_eviction_policy(self, num_groups: int) -> None:
        from lifecycle._kvcache import EVICTION_POLICIES

        policy = self.eviction_policy
        if not isinstance(policy, str) or policy not in EVICTION_POLICIES:
            raise ConfigError(
                f"eviction_policy must be one of {', '.join(map(repr, EVICTION_POLICIES))}, got {policy!r}"
            )
        if policy != "lru" and num_groups > 1:
            raise ConfigError(
                f"eviction_policy={policy!r} is not offered with {num_groups} KV cache groups: only 'lru'"
            )

    def _check_windows(self) -> None:
        limit = self.max_model_len
        for index, layer in enumerate(self.layers):
            if isinstance(layer, SlidingWindowLayer):
                if layer.window + layer.sink_tokens > limit:
                    raise ConfigError(
                        f"layers[{index}].window={layer.window} (+ sink_tokens={layer.sink_tokens}) exceeds "
                        f"max_model_len={limit}"
                    )
            elif isinstance(layer, ChunkedLocalLayer) and layer.chunk_size > limit:
                raise ConfigError(f"layers[{index}].chunk_size={layer.chunk_size} exceeds max_model_len={limit}")

    def _group_rules(self) -> list[tuple[GroupKind, int, int, tuple[int, ...], int]]:
        """Each group's rule, layer indices and block bytes: the full group first, then the others
        in the order their first layer comes."""
        members: dict[tuple[GroupKind, int, int], list[int]] = {}
        for index, layer in enumerate(self.layers):
            if isinstance(layer, _KV_LAYER_TYPES):
                members.setdefault(layer_rule(layer), []).append(index)
        order = sorted(members, key=lambda rule: rule[0] != "full")  # stable: first appearance otherwise
        rules = []
        for rule in order:
            indices = tuple(members[rule])
            block_bytes = 0
            for i in indices:
                layer = self.layers[i]
                assert not isinstance(layer, SSMLayer)
                block_bytes += layer.block_bytes(self.block_size)
            rules.append((*rule, indices, block_bytes))
        return rules

    def _resolve_num_blocks(self, rules: list[tuple[GroupKind, int, int, tuple[int, ...], int]]) -> list[int]:
        num_blocks, budget, fractions = self.num_blocks, self.kv_budget_bytes, self.group_budget_fractions
        if not rules:
            if budget is not None:
                raise ConfigError(f"kv_budget_bytes={budget!r} given, but the model has no attention layer")
            if num_blocks not in (None, 0):
                raise ConfigError(f"num_blocks={num_blocks!r} given, but the model has no attention layer (use 0)")
            if fractions is not None:
                raise ConfigError(f"group_budget_fractions={fractions!r} given, but the model has no KV group")
            return []
        if (num_blocks is None) == (budget is None):
            raise ConfigError(
                f"give exactly one of num_blocks and kv_budget_bytes, got num_blocks={num_blocks!r}, "
                f"kv_budget_bytes={budget!r}"
            )
        if num_blocks is not None:
            if fractions is not None:
                raise ConfigError(f"group_budget_fractions={fractions!r} splits kv_budget_bytes; num_blocks was given")
            return self._counts(num_blocks, len(rules))
        _check_int("kv_budget_bytes", budget, 1)
        assert budget is not None
        block_bytes = [rule[4] for rule in rules]
        if len(rules) == 1 and fractions is None:
            if budget < block_bytes[0]:
                raise ConfigError(f"kv_budget_bytes={budget} is too small for one block of {block_bytes[0]} bytes")
            return [min(budget // block_bytes[0], _INT32_MAX)]
        shares = self._fractions(rules) if fractions is None else self._checked_fractions(fractions, len(rules))
        counts = []
        for index, (share, nbytes) in enumerate(zip(shares, block_bytes, strict=True)):
            count = int(budget * share) // nbytes
            if count < 1:
                raise ConfigError(
                    f"kv_budget_bytes={budget} gives group {index} ({rules[index][0]}) {int(budget * share)} bytes, "
                    f"too few for one block of {nbytes} bytes"
                )
            counts.append(count)
        if fractions is None:
            # The split's rounding leaves less than a block per group: give it out, group by group.
            left = budget - sum(count * nbytes for count, nbytes in zip(counts, block_bytes, strict=True))
            for index, nbytes in enumerate(block_bytes):
                counts[index] += left // nbytes
                left %= nbytes
        return [min(count, _INT32_MAX) for count in counts]

    @staticmethod
    def _counts(num_blocks: object, num_groups: int) -> list[int]:
        if isinstance(num_blocks, tuple):
            if len(num_blocks) != num_groups:
                raise ConfigError(
                    f"num_blocks={num_blocks!r} has {len(num_blocks)} counts; the model has {num_groups} KV groups"
                )
            for index, count in enumerate(num_blocks):
                _check_int(f"num_blocks[{index}]", count, 1, _INT32_MAX)
            return list(num_blocks)
        if num_groups > 1:
            raise ConfigError(
                f"num_blocks={num_blocks!r} is one count; the model has {num_groups} KV groups (give a tuple of "
                f"{num_groups} counts, or kv_budget_bytes)"
            )
        _check_int("num_blocks", num_blocks, 1, _INT32_MAX)
        assert isinstance(num_blocks, int)
        return [num_blocks]

    @staticmethod
    def _checked_fractions(fractions: object, num_groups: int) -> list[float]:
        if not isinstance(fractions, tuple) or len(fractions) != num_groups:
            raise ConfigError(
                f"group_budget_fractions={fractions!r} must be a tuple of {num_groups} shares (one per KV group)"
            )
        for index, share in enumerate(fractions):
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
                raise ConfigError(f"group_budget_fractions[{index}]={share!r} must be a number in (0, 1]")
        if sum(fractions) > 1 + 1e-9:
            raise ConfigError(f"group_budget_fractions={fractions!r} sums to {sum(fractions):g}, more than 1")
        return [float(share) for share in fractions]

    def _fractions(self, rules: list[tuple[GroupKind, int, int, tuple[int, ...], int]]) -> list[float]:
        """The default split: each group's share of the bytes one max_model_len sequence needs, the
        windowed groups' scaled so that they also get :data:`RETENTION_RESERVE` of the budget."""
        needs = [
            blocks_per_sequence(kind, window, sink, self.max_model_len, self.block_size) * block_bytes
            for kind, window, sink, _, block_bytes in rules
        ]
        total = sum(needs)
        windowed = sum(need for need, rule in zip(needs, rules, strict=True) if rule[0] != "full")
        reserve = RETENTION_RESERVE if windowed else 0.0
        shares = []
        for need, rule in zip(needs, rules, strict=True):
            share = need / total * (1 - reserve)
            if rule[0] != "full":
                share += reserve * need / windowed
            shares.append(share)
        return shares

    # --- derived values -------------------------------------------------------------------------

    @property
    def num_blocks_resolved(self) -> int:
        """KV blocks in group 0's pool (the only pool of a one-group model): ``num_blocks``, or
        what ``kv_budget_bytes`` buys (0 without a KV layer)."""
        return self._num_blocks

    @property
    def num_blocks_per_group(self) -> tuple[int, ...]:
        """Blocks in each KV group's pool, in ``kv_groups`` order."""
        return tuple(group.num_blocks for group in self._kv_groups)

    @property
    def kv_groups(self) -> tuple[KVGroupSpec, ...]:
        """The KV cache groups (empty without KV layers): group 0 is the full-attention group when
        there is one, the others follow in the order their first layer comes."""
        return self._kv_groups

    @property
    def kv_layers(self) -> tuple[KVLayer, ...]:
        """Every layer with a paged KV cache, of any kind, in model order."""
        return tuple(layer for layer in self.layers if isinstance(layer, _KV_LAYER_TYPES))

    @property
    def is_single_attention_group(self) -> bool:
        """Whether the KV layers are AttentionLayers in one group (or there are none): the layout
        the pools and the core serve today."""
        return all(isinstance(layer, AttentionLayer) for layer in self.kv_layers)

    @property
    def attention_layers(self) -> tuple[AttentionLayer, ...]:
        """The attention layers, in model order (KV pool layer ``i`` is the i-th of these)."""
        return tuple(layer for layer in self.layers if isinstance(layer, AttentionLayer))

    @property
    def ssm_layers(self) -> tuple[SSMLayer, ...]:
        """The SSM layers, in model order (SSM pool layer ``i`` is the i-th of these)."""
        return tuple(layer for layer in self.layers if isinstance(layer, SSMLayer))

    @property
    def max_blocks_per_seq_resolved(self) -> int:
        """Most blocks one sequence may hold: ``max_blocks_per_seq``, or the whole pool if 0."""
        return self.max_blocks_per_seq or self.num_blocks_resolved

    @property
    def num_ssm_slots(self) -> int:
        """SSM state slots per layer: ``max_seqs`` plus the padding slot (0 without SSM layers)."""
        return self.max_seqs + 1 if self.ssm_layers else 0

    def kv_block_bytes(self) -> int:
        """Bytes one block index of group 0 holds across its layers (every attention layer of a
        one-group model), K and V (K alone where V aliases K): ``num_blocks_resolved *
        kv_block_bytes()`` is that pool's size. 0 without a KV layer."""
        return self._kv_groups[0].block_bytes if self._kv_groups else 0

    def kv_pool_bytes(self) -> int:
        """Bytes of every KV group's pool together."""
        return sum(group.num_blocks * group.block_bytes for group in self._kv_groups)

    def full_attention_bytes(self, tokens: int) -> int:
        """Bytes ``tokens`` tokens would take if every KV layer kept every token (each layer with
        its own bytes per token): the footprint that windowed groups save on."""
        _check_int("tokens", tokens, 0)
        return tokens * sum(layer.bytes_per_token for layer in self.kv_layers)

    def memory_plan(self) -> MemoryPlan:
        """What each KV group holds: its layers, bytes per token, block bytes, blocks and bytes;
        out of ``kv_budget_bytes``, or the pools' bytes when block counts were given."""
        groups = []
        for group in self._kv_groups:
            per_token = 0
            for index in group.layer_indices:
                layer = self.layers[index]
                assert not isinstance(layer, SSMLayer)
                per_token += layer.bytes_per_token
            groups.append(
                GroupMemory(
                    index=group.index,
                    kind=group.kind,
                    window=group.window,
                    sink_tokens=group.sink_tokens,
                    layers=len(group.layer_indices),
                    bytes_per_token=per_token,
                    block_bytes=group.block_bytes,
                    num_blocks=group.num_blocks,
                    bytes=group.num_blocks * group.block_bytes,
                )
            )
        budget = self.kv_budget_bytes if self.kv_budget_bytes is not None else self.kv_pool_bytes()
        return MemoryPlan(groups=tuple(groups), block_size=self.block_size, budget_bytes=budget)

    def ssm_slot_bytes(self) -> int:
        """Bytes of one slot across every SSM layer (h and conv); 0 without an SSM layer."""
        return sum(layer.slot_bytes for layer in self.ssm_layers)

    def ssm_pool_bytes(self) -> int:
        """Bytes of the whole SSM pool, padding slot included."""
        return self.num_ssm_slots * self.ssm_slot_bytes()

    def _canonical(self) -> str:
        # Only what fixes the byte format of a block and of a slot: two configs that agree here can
        # exchange swap records whatever their pool sizes or names.
        # The new kinds carry their rule (window, chunk) too: it fixes which blocks a record holds.
        parts = [f"lifecycle-config-v{_FINGERPRINT_VERSION}", f"block_size={self.block_size}"]
        for layer in self.layers:
            if isinstance(layer, AttentionLayer):
                parts.append(f"A({layer.num_kv_heads},{layer.head_dim},{layer.dtype},{int(layer.v_aliases_k)})")
            elif isinstance(layer, SlidingWindowLayer):
                parts.append(
                    f"W({layer.num_kv_heads},{layer.head_dim},{layer.dtype},{layer.window},{layer.sink_tokens})"
                )
            elif isinstance(layer, ChunkedLocalLayer):
                parts.append(f"C({layer.num_kv_heads},{layer.head_dim},{layer.dtype},{layer.chunk_size})")
            elif isinstance(layer, MLALayer):
                parts.append(f"M({layer.kv_lora_rank},{layer.qk_rope_head_dim},{layer.dtype})")
            elif isinstance(layer, IndexerLayer):
                parts.append(f"I({layer.head_dim},{layer.dtype},{layer.scale_bytes})")
            else:
                parts.append(f"S({layer.h_state_bytes},{layer.h_dtype},{layer.conv_state_bytes},{layer.conv_dtype})")
        return ";".join(parts)

    def fingerprint(self) -> int:
        """A stable unsigned 64-bit hash of the layer list and block size: equal across processes and
        machines for configs whose blocks and slots have the same byte format."""
        return self._fingerprint

    def dims(self) -> ModelDims:
        """The model's :class:`ModelDims`."""
        attention = self.attention_layers
        first = attention[0] if attention else None
        num_kv_heads = first.num_kv_heads if first is not None else 0
        return ModelDims(
            num_layers=len(self.layers),
            num_attention_layers=len(attention),
            num_ssm_layers=len(self.layers) - len(attention),
            max_blocks_per_layer=self.num_blocks_resolved,
            num_query_heads=self.num_query_heads or num_kv_heads,
            num_kv_heads=num_kv_heads,
            head_dim=first.head_dim if first is not None else 0,
            block_size=self.block_size,
            fingerprint=self.fingerprint(),
        )

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied and validated again. Giving one of ``num_blocks`` /
        ``kv_budget_bytes`` drops the other, so a preset can be resized either way (block counts
        also drop ``group_budget_fractions``, which only split a budget)."""
        if "num_blocks" in changes and "kv_budget_bytes" not in changes:
            changes["kv_budget_bytes"] = None
            changes.setdefault("group_budget_fractions", None)
        elif "kv_budget_bytes" in changes and "num_blocks" not in changes:
            changes["num_blocks"] = None
        try:
            return dataclasses.replace(self, **changes)
        except TypeError as error:  # an unknown field name
            raise ConfigError(f"ModelConfig has no such field: {error}") from None

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any], **fields: Any) -> ModelConfig:
        """A config built from a model's Hugging Face ``config.json`` (as a dict): its layers by
        kind and shape, with ``fields`` (any other ``ModelConfig`` fields, e.g. ``kv_budget_bytes``,
        or ``kv_cache_dtype=`` to override the cache dtype) applied. A field it cannot map raises
        :class:`ConfigError` naming it. See :mod:`lifecycle.hf_config`."""
        from lifecycle.hf_config import config_from_hf

        return config_from_hf(hf_config, **fields)
