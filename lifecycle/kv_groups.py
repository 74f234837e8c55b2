"""A model's KV cache groups as the core takes them: one ``BlockPool`` per group past group 0.

``ModelConfig.kv_groups`` says what each group is (its rule and its pool's block count);
``KVCacheCore(pool, block_size, groups=core_groups(config))`` then coordinates them, group 0
being the core's own ``pool`` (the full-attention group).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle.config import ModelConfig
from lifecycle.errors import Unsupported
from lifecycle.pools import KVPool

if TYPE_CHECKING:
    from lifecycle._groups import GroupSpec  # a type alias of the stubs only


def describe_groups(config: ModelConfig) -> str:
    """The groups of ``config`` in one line, for messages: ``full (18 layers), sliding_window 128 (18 layers)``."""
    parts = []
    for group in config.kv_groups:
        rule = f"{group.kind} {group.window}" if group.window else group.kind
        if group.sink_tokens:
            rule += f" (+{group.sink_tokens} sink)"
        parts.append(f"{rule} ({len(group.layer_indices)} layers)")
    return ", ".join(parts)


def core_groups(config: ModelConfig) -> list[GroupSpec] | None:
    """The ``groups=`` argument of the model's ``KVCacheCore``: a fresh ``BlockPool`` of each group
    past group 0 with its rule, or None for a model of one KV group (or none). The core's group 0
    is full attention; a model whose every KV layer is windowed has no such group and is refused."""
    groups = config.kv_groups
    if groups and groups[0].kind != "full":
        raise Unsupported(
            f"{config.name!r} has KV groups {describe_groups(config)}; the core's group 0 must be full attention"
        )
    if len(groups) <= 1:
        return None
    return [(group.kind, group.window, group.sink_tokens, BlockPool(group.num_blocks)) for group in groups[1:]]


def refuse_grouped_tiers(config: ModelConfig, host_tier_blocks: int, store: str | None) -> None:
    """The host tier and the shared store move group 0's blocks only: refuse them for a model of
    several KV groups."""
    if len(config.kv_groups) > 1 and (host_tier_blocks or store is not None):
        raise Unsupported(
            f"HybridModel: host_tier_blocks={host_tier_blocks}, store={store!r}: {config.name!r} has KV groups "
            f"{describe_groups(config)}; the host tier and the store hold blocks of one group"
        )


def group_stats(core: KVCacheCore, pools: Sequence[KVPool]) -> list[dict[str, Any]]:
    """The core's ``group_stats()``, each with its group's ``layers`` and pool ``bytes`` (0 layers
    and bytes for a model without a KV pool)."""
    stats = core.group_stats()
    for entry, pool in itertools.zip_longest(stats, pools[: len(stats)]):
        entry["layers"] = pool.num_layers if pool is not None else 0
        entry["bytes"] = pool.total_bytes if pool is not None else 0
    return stats
