"""What a KV-aware router knows of one engine, rebuilt from the engine's KV events alone.

``EventIndex.apply`` replays batches the way a router's index does (Dynamo's keeps, per worker, each
block's parent and tokens): a store must carry its blocks' tokens and must not store a block the
tier holds already; a removal must name a block the tier holds; a clear empties
every tier. Any of those broken raises ``AssertionError`` naming the event: the stream was not true.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvcache_support import chained_hash, root_hash

from lifecycle.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True)
class Block:
    """One block as the index keeps it."""

    parent: int | None
    tokens: tuple[int, ...]
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None


class EventIndex:
    """The blocks of each tier (``"GPU"``, ``"CPU"``) by content hash, as the events told them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tiers: dict[str, dict[int, Block]] = {"GPU": {}, "CPU": {}}

    def apply(self, events: Iterable[KVEvent]) -> None:
        for position, event in enumerate(events):
            where = f"event {position} ({event!r})"
            if isinstance(event, AllBlocksCleared):
                for tier in self.tiers.values():
                    tier.clear()
            elif isinstance(event, BlockRemoved):
                tier = self.tiers[str(event.medium)]
                for content_hash in event.block_hashes:
                    assert content_hash in tier, f"{where}: removes {content_hash:#x}, which the tier does not hold"
                    del tier[content_hash]
            else:
                assert isinstance(event, BlockStored)
                self._stored(where, event)

    def _stored(self, where: str, event: BlockStored) -> None:
        tier, bs = self.tiers[str(event.medium)], self.block_size
        assert len(event.token_ids) == len(event.block_hashes) * bs, f"{where}: tokens do not cover the blocks"
        assert event.extra_keys is None or len(event.extra_keys) == len(event.block_hashes), where
        parent = event.parent_block_hash
        for i, content_hash in enumerate(event.block_hashes):
            assert content_hash not in tier, f"{where}: stores {content_hash:#x}, which the tier holds already"
            tokens = tuple(event.token_ids[i * bs : (i + 1) * bs])
            extra = None if event.extra_keys is None else event.extra_keys[i]
            tier[content_hash] = Block(parent, tokens, event.lora_name, extra)
            parent = content_hash

    def holds(self, medium: str) -> set[int]:
        return set(self.tiers[medium])

    def check_hashes(self, medium: str) -> int:
        """Every block of ``medium`` without an adapter or a salt hashes, from its tokens and its
        parent (the root without one), to the hash it was stored under, as a router that hashes
        tokens itself finds; returns how many blocks were checked."""
        checked = 0
        for content_hash, block in self.tiers[medium].items():
            if block.lora_name is None and block.extra_keys is None:
                parent = root_hash(0) if block.parent is None else block.parent
                assert chained_hash(parent, block.tokens) == content_hash, f"{content_hash:#x}: {block}"
                checked += 1
        return checked
