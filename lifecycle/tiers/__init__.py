"""Tiers under the device prefix cache: evicted blocks kept in host memory (:mod:`lifecycle.tiers.host`)
and shared between engines through a Redis / Valkey store (:mod:`lifecycle.tiers.store`), both keyed
by the blocks' content hashes; the store's value format is :mod:`lifecycle.tiers.records`, and
:mod:`lifecycle.tiers.promote` is the model's side of them (what a core call evicted goes down,
what an admission finds there comes back up).

Importing this package loads neither redis-py nor any compiled code beyond the device layer's.
"""

from __future__ import annotations

from lifecycle.tiers.host import HostTier, HostTierStats
from lifecycle.tiers.records import BlockRecord, RecordCorrupt, RecordError, RecordForeign, RecordLayout

__all__ = [
    "BlockRecord",
    "HostTier",
    "HostTierStats",
    "RecordCorrupt",
    "RecordError",
    "RecordForeign",
    "RecordLayout",
]
