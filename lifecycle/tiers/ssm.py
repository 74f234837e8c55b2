"""SSM snapshots in host memory, beside the host tier's attention blocks, for hybrid models.

A hybrid model reuses a prefix only where it has the SSM state after it. When a sequence is cached
or released, :class:`HostSnapshots` copies its slot's state (when the state consumed exactly the
sequence's whole blocks) into one of ``capacity`` host slots, under the tier key of the last of
those blocks; admission promotes a run of host-tier blocks only up to a block whose snapshot is
held, and restores that snapshot into the request's slot. A snapshot is found by the key's high
word and served only when its whole key is the one asked for. Least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from lifecycle.device.base import Device
from lifecycle.errors import ConfigError, InvariantViolation
from lifecycle.pools import SSMPool

__all__ = ["HostSnapshots"]


class HostSnapshots:
    """``capacity`` SSM snapshots of ``ssm``'s slots in one pinned host allocation of ``device``."""

    def __init__(self, device: Device, ssm: SSMPool, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"HostSnapshots: capacity={capacity} must be >= 1")
        self._device = device
        self._ssm = ssm
        self._capacity = capacity
        self._sizes = [nbytes for _, nbytes in ssm.slot_ranges(0)]
        self.snapshot_bytes = sum(self._sizes)
        self._offsets = np.concatenate(([0], np.cumsum(self._sizes)[:-1])).astype(np.int64).tolist()
        self._base = device.alloc_pinned(self.snapshot_bytes * capacity)
        self._keys = np.zeros((capacity, 2), dtype=np.uint64)
        self._index: OrderedDict[int, int] = OrderedDict()  # high word of a key -> host slot
        self._free = list(range(capacity - 1, -1, -1))
        self.saved = self.restored = 0
        self._closed = False

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_snapshots(self) -> int:
        return len(self._index)

    def _rows(self, host_slot: int, slot: int, to_host: bool) -> list[tuple[int, int, int]]:
        base = self._base + host_slot * self.snapshot_bytes
        rows = []
        for (slot_addr, nbytes), offset in zip(self._ssm.slot_ranges(slot), self._offsets):
            rows.append((base + offset, slot_addr, nbytes) if to_host else (slot_addr, base + offset, nbytes))
        return rows

    def holds(self, key: tuple[int, int]) -> bool:
        """Whether the snapshot after the block of ``key`` is held."""
        host_slot = self._index.get(key[0])
        return host_slot is not None and tuple(self._keys[host_slot].tolist()) == key

    def save(self, key: tuple[int, int], slot: int) -> None:
        """Copy SSM slot ``slot``'s state into the snapshot of ``key`` (the most recently used),
        one batched copy completed on return."""
        host_slot = self._index.get(key[0])
        if host_slot is None:
            if not self._free:
                _, evicted = self._index.popitem(last=False)
                self._free.append(evicted)
            host_slot = self._free.pop()
        else:
            self._index.pop(key[0])
        try:
            self._device.copy_batch(self._rows(host_slot, slot, to_host=True))
            self._device.synchronize()
        except BaseException:
            self._free.append(host_slot)
            raise
        self._keys[host_slot] = key
        self._index[key[0]] = host_slot
        self.saved += 1

    def restore(self, key: tuple[int, int], slot: int) -> None:
        """Copy the snapshot of ``key`` (held: :meth:`holds`) into SSM slot ``slot``, completed on
        return; it becomes the most recently used."""
        host_slot = self._index[key[0]]
        self._index.move_to_end(key[0])
        self._device.copy_batch(self._rows(host_slot, slot, to_host=False))
        self._device.synchronize()
        self.restored += 1

    def clear(self) -> None:
        self._index.clear()
        self._free = list(range(self._capacity - 1, -1, -1))

    def check_invariants(self) -> None:
        held = list(self._index.values())
        if len(set(held)) != len(held) or set(held) & set(self._free) or len(held) + len(self._free) != self._capacity:
            raise InvariantViolation(
                f"HostSnapshots: {len(held)} held + {len(self._free)} free slots != capacity {self._capacity}"
            )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._index.clear()
            self._device.free_pinned(self._base)
