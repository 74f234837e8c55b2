"""SSM state snapshots attached to prefix-trie nodes (hybrid prefix caching).

For a hybrid model a cached KV prefix is only reusable together with the SSM state at the same
token, so the cache keeps copies of a slot's state (h and conv of every SSM layer) at cached prefix
ends. They live in their own device pool with its own budget and LRU: when it is full the least
recently used snapshot is dropped and its node's KV stays cached (a later lookup just stops short of
that node). Evicting a node drops its snapshot with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, final

import numpy as np
import numpy.typing as npt

from lifecycle.device.base import Copy, Device
from lifecycle.errors import ConfigError, InvalidId, InvariantViolation

if TYPE_CHECKING:
    from lifecycle._prefix_trie import PrefixTrie
    from lifecycle.pools import SSMPool


@final
class SnapshotPool:
    """``capacity`` snapshots of one SSM slot each, in one device allocation."""

    def __init__(self, device: Device, ssm: SSMPool, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError(f"num_snapshots={capacity} must be > 0 to build a snapshot pool")
        self._device = device
        self._ssm = ssm
        self._capacity = capacity
        sizes = [nbytes for _, nbytes in ssm.slot_ranges(0)]
        self._offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64).tolist()
        self._sizes = sizes
        self.snapshot_bytes = int(sum(sizes))
        self._base = device.alloc(self.snapshot_bytes * capacity)
        self._released = False
        self._free = list(range(capacity - 1, -1, -1))
        self._generations = [0] * capacity  # bumped at every save: tells a reused id from the old one
        self._lru: OrderedDict[int, int] = OrderedDict()  # snapshot id -> trie node, oldest first

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def _copies(self, snapshot_id: int, slot: int, to_snapshot: bool) -> list[Copy]:
        base = self._base + snapshot_id * self.snapshot_bytes
        copies: list[Copy] = []
        for (slot_addr, nbytes), offset in zip(self._ssm.slot_ranges(slot), self._offsets):
            snap_addr = base + offset
            copies.append((snap_addr, slot_addr, nbytes) if to_snapshot else (slot_addr, snap_addr, nbytes))
        return copies

    def save(self, slot: int, node_id: int, forget: Callable[[int], None]) -> int:
        """Copy ``slot``'s state into a snapshot for ``node_id`` and wait for the copy (the engine
        writes the slot again at its next step); returns the snapshot id. When the pool is full the
        least recently used snapshot is reused, and ``forget(its node)`` is called first. If the
        copy fails, the snapshot goes back to the free list."""
        if self._free:
            snapshot_id = self._free.pop()
        else:
            snapshot_id, dropped_node = self._lru.popitem(last=False)
            forget(dropped_node)
        self._generations[snapshot_id] += 1
        try:
            self._device.copy_batch(self._copies(snapshot_id, slot, to_snapshot=True))
            self._device.synchronize()
        except BaseException:
            self._free.append(snapshot_id)
            raise
        self._lru[snapshot_id] = node_id
        return snapshot_id

    def generation(self, snapshot_id: int) -> int:
        """How many times ``snapshot_id`` was (re)filled."""
        return self._generations[snapshot_id]

    def restore_into(self, snapshot_id: int, slot: int) -> None:
        """Copy a snapshot into ``slot`` and wait for it, so the snapshot's memory may be reused
        as soon as this returns."""
        if snapshot_id not in self._lru:
            raise InvalidId(f"snapshot {snapshot_id} is not in use (capacity {self._capacity})")
        self._lru.move_to_end(snapshot_id)
        self._device.copy_batch(self._copies(snapshot_id, slot, to_snapshot=False))
        self._device.synchronize()

    def touch(self, snapshot_id: int) -> None:
        self._lru.move_to_end(snapshot_id)

    def drop(self, snapshot_ids: npt.NDArray[np.int32]) -> int:
        """Free the snapshots of evicted nodes; returns how many were in use."""
        dropped = 0
        for snapshot_id in snapshot_ids.tolist():
            if self._lru.pop(snapshot_id, None) is not None:
                self._free.append(snapshot_id)
                dropped += 1
        return dropped

    def release(self) -> None:
        """Free the device memory, exactly once."""
        if not self._released:
            self._released = True
            self._device.free(self._base)

    def check_invariants(self, trie: PrefixTrie) -> None:
        if len(self._lru) + len(self._free) != self._capacity or set(self._lru) & set(self._free):
            raise InvariantViolation(
                f"snapshot pool: {len(self._lru)} used + {len(self._free)} free != capacity {self._capacity}"
            )
        for snapshot_id, node_id in self._lru.items():
            if trie.get_tag(node_id) != snapshot_id:
                raise InvariantViolation(
                    f"snapshot {snapshot_id} belongs to node {node_id}, whose tag is {trie.get_tag(node_id)}"
                )
