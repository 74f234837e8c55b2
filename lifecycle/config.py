"""The model's memory, described: layers, block size, pool sizes. Frozen and validated.

A :class:`ModelConfig` is checked completely when it is built, so every later layer (pools, block
pool, slots, swap) can trust it: a bad value raises :class:`~lifecycle.errors.ConfigError` naming the
field and the value. Layer indices elsewhere in the library count attention layers and SSM layers
separately (``config.attention_layers[i]`` is the KV pool's layer ``i``).
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
        _check_int("AttentionLayer.num_kv_heads", self.num_kv_heads, 1)
        _check_int("AttentionLayer.head_dim", self.head_dim, 1)
        _check_dtype("AttentionLayer.dtype", self.dtype)
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

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block of this layer holds (K and V, or K alone)."""
        return self.kv_planes * block_size * self.num_kv_heads * self.head_dim * self.itemsize


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


Layer: TypeAlias = AttentionLayer | SSMLayer


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

    Exactly one of ``num_blocks`` and ``kv_budget_bytes`` sizes the KV pool when the model has an
    attention layer (a budget gives ``kv_budget_bytes // kv_block_bytes()`` blocks); a model without
    one has no KV pool and takes neither (or ``num_blocks=0``). ``num_query_heads=0`` means "same as
    the KV heads"; ``max_blocks_per_seq=0`` means "the whole pool".
    """

    layers: tuple[Layer, ...]
    block_size: int = 16
    num_blocks: int | None = None
    kv_budget_bytes: int | None = None
    max_seqs: int = 64
    num_adapter_slots: int = 0
    num_query_heads: int = 0
    max_blocks_per_seq: int = 0
    num_snapshots: int = 0
    enable_prefix_cache: bool = True
    name: str = "model"
    _num_blocks: int = field(init=False, repr=False, compare=False, default=0)
    _fingerprint: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, list):
            layers = tuple(layers)
            object.__setattr__(self, "layers", layers)
        if not isinstance(layers, tuple) or not layers:
            raise ConfigError(f"layers must be a non-empty tuple of AttentionLayer/SSMLayer, got {self.layers!r}")
        for index, layer in enumerate(layers):
            if not isinstance(layer, (AttentionLayer, SSMLayer)):
                raise ConfigError(f"layers[{index}]={layer!r} is neither an AttentionLayer nor an SSMLayer")
        _check_int("block_size", self.block_size, 1, _INT32_MAX)
        _check_int("max_seqs", self.max_seqs, 1, _INT32_MAX - 1)  # + 1 padding slot stays an int32
        _check_int("num_adapter_slots", self.num_adapter_slots, 0, _INT32_MAX)
        _check_int("num_query_heads", self.num_query_heads, 0)
        _check_int("max_blocks_per_seq", self.max_blocks_per_seq, 0, _INT32_MAX)
        _check_int("num_snapshots", self.num_snapshots, 0, _INT32_MAX)
        _check_bool("enable_prefix_cache", self.enable_prefix_cache)
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"name must be a non-empty str, got {self.name!r}")
        object.__setattr__(self, "_num_blocks", self._resolve_num_blocks())
        if self.max_blocks_per_seq > self._num_blocks:
            raise ConfigError(
                f"max_blocks_per_seq={self.max_blocks_per_seq} exceeds the pool's {self._num_blocks} blocks"
            )
        if self.num_query_heads:
            for index, layer in enumerate(self.attention_layers):
                if self.num_query_heads % layer.num_kv_heads:
                    raise ConfigError(
                        f"num_query_heads={self.num_query_heads} is not a multiple of attention layer "
                        f"{index}'s num_kv_heads={layer.num_kv_heads}"
                    )
        if self.num_snapshots and not self.ssm_layers:
            raise ConfigError(f"num_snapshots={self.num_snapshots} needs an SSM layer; the model has none")
        digest = hashlib.blake2b(self._canonical().encode("ascii"), digest_size=8).digest()
        object.__setattr__(self, "_fingerprint", int.from_bytes(digest, "little"))

    def _resolve_num_blocks(self) -> int:
        block_bytes = self.kv_block_bytes()
        num_blocks, budget = self.num_blocks, self.kv_budget_bytes
        if block_bytes == 0:
            if budget is not None:
                raise ConfigError(f"kv_budget_bytes={budget!r} given, but the model has no attention layer")
            if num_blocks not in (None, 0):
                raise ConfigError(f"num_blocks={num_blocks!r} given, but the model has no attention layer (use 0)")
            return 0
        if (num_blocks is None) == (budget is None):
            raise ConfigError(
                f"give exactly one of num_blocks and kv_budget_bytes, got num_blocks={num_blocks!r}, "
                f"kv_budget_bytes={budget!r}"
            )
        if num_blocks is not None:
            _check_int("num_blocks", num_blocks, 1, _INT32_MAX)
            return num_blocks
        _check_int("kv_budget_bytes", budget, 1)
        assert budget is not None
        if budget < block_bytes:
            raise ConfigError(f"kv_budget_bytes={budget} is too small for one block of {block_bytes} bytes")
        return min(budget // block_bytes, _INT32_MAX)

    # --- derived values -------------------------------------------------------------------------

    @property
    def num_blocks_resolved(self) -> int:
        """KV blocks in the pool: ``num_blocks``, or what ``kv_budget_bytes`` buys (0 without an
        attention layer)."""
        return self._num_blocks

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
        """Bytes one block index holds across every attention layer, K and V (K alone where V
        aliases K): ``num_blocks_resolved * kv_block_bytes()`` is the KV pool's size. 0 without an
        attention layer."""
        return sum(layer.block_bytes(self.block_size) for layer in self.attention_layers)

    def kv_pool_bytes(self) -> int:
        """Bytes of the whole KV pool."""
        return self.num_blocks_resolved * self.kv_block_bytes()

    def ssm_slot_bytes(self) -> int:
        """Bytes of one slot across every SSM layer (h and conv); 0 without an SSM layer."""
        return sum(layer.slot_bytes for layer in self.ssm_layers)

    def ssm_pool_bytes(self) -> int:
        """Bytes of the whole SSM pool, padding slot included."""
        return self.num_ssm_slots * self.ssm_slot_bytes()

    def _canonical(self) -> str:
        # Only what fixes the byte format of a block and of a slot: two configs that agree here can
        # exchange swap records whatever their pool sizes or names.
        parts = [f"lifecycle-config-v{_FINGERPRINT_VERSION}", f"block_size={self.block_size}"]
        for layer in self.layers:
            if isinstance(layer, AttentionLayer):
                parts.append(f"A({layer.num_kv_heads},{layer.head_dim},{layer.dtype},{int(layer.v_aliases_k)})")
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
        ``kv_budget_bytes`` drops the other, so a preset can be resized either way."""
        if "num_blocks" in changes and "kv_budget_bytes" not in changes:
            changes["kv_budget_bytes"] = None
        elif "kv_budget_bytes" in changes and "num_blocks" not in changes:
            changes["num_blocks"] = None
        try:
            return dataclasses.replace(self, **changes)
        except TypeError as error:  # an unknown field name
            raise ConfigError(f"ModelConfig has no such field: {error}") from None
