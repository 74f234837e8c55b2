"""The device memory of one model: the KV pool, the SSM pool, the SSM snapshots, the swap staging
buffer and the block-table staging, allocated together and released together, newest first,
exactly once."""

from __future__ import annotations

from collections.abc import Callable
from typing import final

from lifecycle.block_tables import TableStaging
from lifecycle.config import ModelConfig
from lifecycle.device.base import Device
from lifecycle.errors import LifecycleError
from lifecycle.pools import KVPool, SSMPool, kv_group_pools
from lifecycle.snapshots import SnapshotPool
from lifecycle.swap import StagingBuffer

__all__ = ["ModelMemory"]


@final
class ModelMemory:
    """What ``config`` needs on ``device``: ``kv_groups`` (a KV pool per KV cache group), ``kv``
    (group 0's; None without KV layers), ``ssm`` (None
    without SSM layers), ``snapshots`` (None without snapshots), ``staging`` (pinned on CUDA,
    allocated on first use), ``tables`` (the pinned rows CUDA block tables are sent from, allocated
    on first use) and, per SSM slot, its layers' (h, conv) addresses. A failure while
    allocating releases what was allocated before it."""

    def __init__(self, device: Device, config: ModelConfig) -> None:
        self._releases: list[Callable[[], None]] = []
        try:
            #: One KV pool per KV cache group, group 0 first; ``kv`` is group 0's.
            self.kv_groups: tuple[KVPool, ...] = kv_group_pools(device, config) if config.kv_block_bytes() > 0 else ()
            self._releases.extend(pool.release for pool in self.kv_groups)
            self.kv = self.kv_groups[0] if self.kv_groups else None
            self.ssm = SSMPool(device, config) if config.ssm_layers else None
            if self.ssm is not None:
                self._releases.append(self.ssm.release)
            self.snapshots = (
                SnapshotPool(device, self.ssm, config.num_snapshots)
                if self.ssm is not None and config.num_snapshots > 0
                else None
            )
            if self.snapshots is not None:
                self._releases.append(self.snapshots.release)
        except BaseException:
            self.release()
            raise
        self.staging = StagingBuffer(device)
        self._releases.append(self.staging.release)
        self.tables = TableStaging(device)
        self._releases.append(self.tables.release)
        ssm = self.ssm
        #: Per slot, the (h, conv) addresses of every SSM layer: what a sequence in that slot holds.
        self.addrs_by_slot: list[tuple[tuple[int, int], ...]] = [
            tuple((ssm.h_addr(layer, slot), ssm.conv_addr(layer, slot)) for layer in range(ssm.num_layers))
            if ssm is not None
            else ()
            for slot in range(config.max_seqs)
        ]

    def release(self) -> None:
        """Free every allocation, newest first, each exactly once; keeps going past a failure and
        raises the first one at the end."""
        errors: list[BaseException] = []
        while self._releases:
            release = self._releases.pop()
            try:
                release()
            except LifecycleError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
