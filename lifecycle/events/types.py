"""The KV event types, with the fields vLLM's ``vllm.distributed.kv_events`` structs carry, in their
order, and the tiers (``medium``) named as vLLM names them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AdapterLookup",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "RawEvent",
    "SaltLookup",
]

#: The model's KV pool: blocks a request computes into and reads from.
MEDIUM_GPU: Final = "GPU"
#: A tier in host memory below the KV pool.
MEDIUM_CPU: Final = "CPU"
#: A tier in files or a shared store.
MEDIUM_STORAGE: Final = "STORAGE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered a tier: ``block_hashes[i]`` names the block holding
    ``token_ids[i * block_size:(i + 1) * block_size]``; ``parent_block_hash`` names the block before
    the first (None at the start of a sequence). ``lora_id`` / ``lora_name`` name the adapter the
    blocks were computed with (None without one). The fields after ``lora_name`` are vLLM's optional
    ones; lifecycle fills ``extra_keys`` only where vLLM puts a cache salt, in the first block of a
    salted sequence (``((salt,), None, ...)``, one entry a block), and leaves the rest None."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left a tier (evicted or dropped); the fields after ``medium`` stay None."""

    block_hashes: tuple[int, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block is gone (the prefix cache was reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """Events in the order they happened, stamped with ``ts`` (seconds since the epoch, as
    ``time.time()``). A publisher fills ``data_parallel_rank`` with its own when it is None."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


#: One entry of the core's raw log (``KVCacheCore.take_events()``), oldest first:
#: ``("stored", hashes, parent_hash, tokens, adapter_key)``, ``("removed", hashes)``, ``("cleared",)``;
#: blocks of a KV cache group past 0 carry the group index last.
RawEvent: TypeAlias = tuple[Any, ...]

#: ``adapter_of(adapter_key)``: ``(lora_id, lora_name)`` of an adapter key, or None for none.
AdapterLookup: TypeAlias = Callable[[int], tuple[int, str] | None]

#: ``salt_of(adapter_key)``: the cache salt a key was salted with (``HybridModel.attach_prefix``'s
#: ``cache_salt``), or None for an unsalted key.
SaltLookup: TypeAlias = Callable[[int], bytes | str | int | None]
