"""The parts one ``HybridModel`` is composed of, built in order and closed in reverse: its device
memory (:mod:`lifecycle.memory`), the block pool and the KV cache core over it, the SSM slot pool,
the adapter table and its bindings to the core (:mod:`lifecycle.lora`), the swap context, the KV
event log, the tiers (:mod:`lifecycle.tiers.promote`) and the attach paths past the core's one call
(:mod:`lifecycle.attach`); and :class:`Gate`, the model's lock with its entry check. A failure
while opening the tiers closes what was built before them (and a device opened for the model).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import final

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle._slots import SlotPool
from lifecycle.attach import PrefixAttach
from lifecycle.config import ModelConfig
from lifecycle.device.base import Device
from lifecycle.events.translate import KVEventLog
from lifecycle.lora import AdapterBindings, AdapterTable
from lifecycle.memory import ModelMemory
from lifecycle.swap import SwapContext
from lifecycle.tiers.promote import ModelTiers, open_tiers

__all__ = ["Gate", "ModelParts"]


@final
class ModelParts:
    """Every part of one model of ``config`` on ``device`` (closed with the parts when
    ``owns_device``); ``events``, ``host_tier_blocks``, ``store`` and ``null_block`` as
    ``HybridModel`` takes them."""

    __slots__ = (
        "adapters", "attach", "core", "device", "events", "lora", "memory", "owns_device", "pool", "slots", "swap",
        "tiers",
    )

    def __init__(
        self, config: ModelConfig, device: Device, *, owns_device: bool, events: bool, host_tier_blocks: int,
        store: str | None, null_block: bool,
    ) -> None:
        self.device, self.owns_device = device, owns_device
        self.memory = memory = ModelMemory(device, config)
        self.pool = BlockPool(config.num_blocks_resolved)
        self.core = core = KVCacheCore(
            self.pool,
            config.block_size,
            enable_prefix_cache=config.enable_prefix_cache,
            snapshot_cut=memory.ssm is not None,
            num_snapshots=memory.snapshots.capacity if memory.snapshots is not None else 0,
            max_blocks_per_seq=config.max_blocks_per_seq_resolved,
            # Without attention layers a sequence holds no blocks, and its tokens are not bounded by them.
            max_tokens_per_seq=None if memory.kv is not None else 2**31 - 1,
            null_block=null_block,
        )
        self.slots = SlotPool(config.max_seqs)
        self.adapters = AdapterTable(config.num_adapter_slots)
        self.lora = AdapterBindings(self.adapters, core)
        self.swap = SwapContext(config, device, memory.kv, memory.ssm, staging=memory.staging, adapters=self.adapters)
        self.events = (
            KVEventLog(config.block_size, adapter_of=self.lora.adapter_of, salt_of=core.salts.salt_of)
            if events else None
        )
        self.tiers: ModelTiers | None = None
        if events or host_tier_blocks or store is not None:
            try:
                self.tiers = open_tiers(
                    core, device, memory.kv, config, ssm=memory.ssm is not None,
                    host_blocks=host_tier_blocks, store_url=store, events=self.events,
                )
            except BaseException:
                core.close()
                self.release()
                raise
        self.attach = PrefixAttach(core, config.block_size, memory.snapshots, self.tiers)

    def read_events(self) -> None:
        """The core's pending log into the event log, through the tiers where there are some (what
        it evicted is demoted on the way)."""
        assert self.events is not None
        if self.tiers is not None:
            self.tiers.drain()
        else:
            self.events.read(self.core)

    def close(self) -> tuple[int, int, int]:
        """Close the tiers and the core; returns what the core still held: (sequences, blocks,
        cached blocks). :meth:`release` frees the memory then."""
        if self.tiers is not None:
            self.tiers.close()
        held: tuple[int, int, int] = self.core.close()
        return held

    def release(self) -> None:
        """Release the device memory, newest first, and the device when the model opened it."""
        try:
            self.memory.release()
        finally:
            if self.owns_device:
                self.device.close()


@final
class Gate:
    """``with gate:``: ``lock``, then the entry check ``enter`` (the model's: refused after
    teardown, dropped sequences reaped); the lock is released again if the check raises."""

    __slots__ = ("_enter", "_lock")

    def __init__(self, lock: threading.RLock, enter: Callable[[], None]) -> None:
        self._lock, self._enter = lock, enter

    def __enter__(self) -> None:
        self._lock.acquire()
        try:
            self._enter()
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, *_: object) -> None:
        self._lock.release()
