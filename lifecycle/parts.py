"""The parts one ``HybridModel`` is composed of, built in order and closed in reverse: its device
memory (:mod:`lifecycle.memory`), the block pool and the KV cache core over it, the SSM slot pool,
the adapter table and its bindings to the core (:mod:`lifecycle.lora`), the swap context, the KV
event log, the tiers (:mod:`lifecycle.tiers.promote`) and the attach paths past the core's one call
(:mod:`lifecycle.attach`); what is assembled over several of them (the events read through the
tiers, a reset, the counters, the invariants, the teardown report); and :class:`Gate`, the
model's lock with its entry check. A failure while opening the tiers closes what was built before
them (and a device opened for the model).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, final

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle._slots import SlotPool
from lifecycle.attach import PrefixAttach
from lifecycle.config import ModelConfig
from lifecycle.device.base import Device
from lifecycle.events.translate import KVEventLog
from lifecycle.errors import SequenceStateError, TornDown
from lifecycle.events.types import KVEventBatch
from lifecycle.kv_groups import core_groups, group_stats, refuse_grouped_tiers
from lifecycle.lora import AdapterBindings, AdapterTable
from lifecycle.memory import ModelMemory
from lifecycle.pools import KVPool, SSMPool
from lifecycle.sequence import NO_ADAPTER, SequenceState
from lifecycle.stats import ModelCounters, Stats, TeardownReport
from lifecycle.swap import SwapContext
from lifecycle.tiers.host import HostTier
from lifecycle.tiers.promote import ModelTiers, open_tiers

__all__ = ["Gate", "ModelParts", "ModelViews"]


@final
class ModelParts:
    """Every part of one model of ``config`` on ``device`` (closed with the parts when
    ``owns_device``); ``events``, ``host_tier_blocks``, ``store`` and ``null_block`` as
    ``HybridModel`` takes them."""

    __slots__ = (
        "adapters", "attach", "core", "device", "drop_queue", "events", "lora", "memory", "owns_device", "pool",
        "_stats_base", "slots", "swap", "tiers",
    )

    def __init__(
        self, config: ModelConfig, device: Device, *, owns_device: bool, events: bool, host_tier_blocks: int,
        store: str | None, null_block: bool, weights_fingerprint: bytes | str | None = None,
        tier_secret: bytes | str | None = None, store_options: Mapping[str, Any] | None = None,
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
            groups=core_groups(config),
            eviction_policy=config.eviction_policy,
        )
        self.slots = SlotPool(config.max_seqs)
        self.drop_queue: deque[int] = deque()  # handles of sequences dropped unfreed (their finalizers fill it)
        self.adapters = AdapterTable(config.num_adapter_slots)
        self.lora = AdapterBindings(self.adapters, core)
        self.swap = SwapContext(config, device, memory.kv, memory.ssm, staging=memory.staging, adapters=self.adapters,
                                kv_groups=memory.kv_groups, core=self.core,
                                grouped=not config.is_single_attention_group)
        self.events = (
            KVEventLog(
                config.block_size, adapter_of=self.lora.adapter_of, salt_of=core.salts.salt_of, groups=core.groups
            )
            if events else None
        )
        self.tiers: ModelTiers | None = None
        if events or host_tier_blocks or store is not None:
            try:
                refuse_grouped_tiers(config, host_tier_blocks, store)
                self.tiers = open_tiers(
                    core, device, memory.kv, config, ssm=memory.ssm,
                    host_blocks=host_tier_blocks, store_url=store, events=self.events,
                    weights_fingerprint=weights_fingerprint, secret=tier_secret, store_options=store_options,
                )
            except BaseException:
                core.close()
                self.release()
                raise
        self._stats_base: Stats | None = None
        self.attach = PrefixAttach(core, config.block_size, memory.snapshots, self.tiers)

    def reap(self, release_adapter: Callable[[int], None]) -> None:
        """Release what sequences dropped without ``free_sequence`` still held (their slot guard
        already released the slot); ``release_adapter`` takes back an adapter reference."""
        queue = self.drop_queue
        while queue:
            try:
                handle = queue.popleft()
                self.tier_record(handle)
                slot = self.core.finish(handle, False)
            except (SequenceStateError, TornDown, IndexError):
                continue
            if slot != NO_ADAPTER:
                release_adapter(slot)

    def tier_record(self, handle: int, seq: SequenceState | None = None) -> None:
        """(Model lock held) before a sequence is cached (``seq``) or released: the host tier learns
        what its blocks, and on a hybrid model its SSM slot, hold."""
        tiers = self.tiers
        if tiers is not None and tiers.host is not None and self.core.is_live(handle):
            ssm = seq is not None and self.memory.ssm is not None and not seq.is_detached
            tiers.record(handle, seq.slot_idx if ssm and seq is not None else None)

    def take_events(self, data_parallel_rank: int | None) -> KVEventBatch:
        """The KV events since the last call (none without an event log)."""
        if self.events is None:
            return KVEventBatch(ts=time.time(), events=(), data_parallel_rank=data_parallel_rank)
        self.read_events()
        return self.events.take(data_parallel_rank)

    def retire(self, keys: frozenset[int]) -> None:
        """Cache keys no request matches again (a reloaded adapter's): their blocks are published
        as removed, after what the core's log holds."""
        if keys and self.events is not None:
            self.read_events()
            self.events.retire(set(keys))

    def reset(self) -> bool:
        """Drop every cached block, and the tiers', unless a running sequence holds a cached prefix."""
        done: bool = self.core.reset()
        if done and self.tiers is not None:
            self.tiers.clear()
        return done

    def counters(self, model: ModelCounters, reset: bool) -> Stats:
        """Every counter (the core's, the model's own ``model``, the tiers') since the parts were
        built, or since the last call with ``reset``."""
        total = Stats.of_model(self.core.counters(), model, self.tiers.stats() if self.tiers is not None else {})
        since = total.minus(self._stats_base) if self._stats_base is not None else total
        if reset:
            self._stats_base = total
        return since

    def check_invariants(self) -> None:
        """Recount every reference from scratch (the core's, the slots', the adapters', the tiers')."""
        self.core.check_invariants()
        self.slots.check_invariants()
        self.lora.check_invariants()
        if self.tiers is not None:
            self.tiers.check_invariants()

    def read_events(self) -> None:
        """The core's pending log into the event log, through the tiers where there are some (what
        it evicted is demoted on the way)."""
        assert self.events is not None
        if self.tiers is not None:
            self.tiers.drain()
        else:
            self.events.read(self.core)

    def close(self) -> TeardownReport:
        """Close the tiers and the core; returns what was still held. :meth:`release` frees the
        memory then."""
        if self.tiers is not None:
            self.tiers.close()
        live, blocks, cached = self.core.close()
        return TeardownReport(live, blocks, cached, self.slots.num_detached, sum(self.adapters.refcounts()))

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


class ModelViews:
    """The parts of a model, read-only (a base of ``HybridModel``, which sets these attributes)."""

    __slots__ = ()
    _config: ModelConfig
    _device: Device
    _core: KVCacheCore
    _pool: BlockPool
    _slots: SlotPool
    _memory: ModelMemory
    _ssm: SSMPool | None
    _tiers: ModelTiers | None
    _entered: Gate

    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def device(self) -> Device:
        return self._device

    @property
    def core(self) -> KVCacheCore:
        """The KV cache core: every request's state, the prefix trie, the block pool."""
        return self._core

    @property
    def pool(self) -> BlockPool:
        """The block pool (refcounts; the core keeps every reference in it)."""
        return self._pool

    @property
    def slots(self) -> SlotPool:
        """The SSM slot pool (each slot owned through a guard that records its sequence)."""
        return self._slots

    @property
    def kv_pool(self) -> KVPool | None:
        """The paged KV memory (addresses, strides and array views for kernels)."""
        return self._memory.kv

    @property
    def kv_pools(self) -> tuple[KVPool, ...]:
        """The paged KV memory of every KV cache group, group 0 (``kv_pool``) first."""
        return self._memory.kv_groups

    def group_stats(self) -> list[dict[str, Any]]:
        """Per KV cache group, group 0 first: the core's counts (``kind``, ``window``, ``num_blocks``,
        ``num_free``, ``num_cached``, blocks allocated, freed, released from windows, kept at checkpoints,
        evicted) and the group's ``layers`` and pool ``bytes``."""
        with self._entered:
            return group_stats(self._core, self._memory.kv_groups)

    @property
    def ssm_pool(self) -> SSMPool | None:
        return self._ssm

    @property
    def null_block(self) -> int:
        """The block held for padding tables (0), -1 without one."""
        return int(self._core.null_block)

    @property
    def tiers(self) -> ModelTiers | None:
        """The tiers below the device (None without a host tier, a store or events)."""
        return self._tiers

    @property
    def host_tier(self) -> HostTier | None:
        """The host tier under the KV pool (None without one)."""
        return self._tiers.host if self._tiers is not None else None

    @property
    def num_live_sequences(self) -> int:
        with self._entered:
            return int(self._core.num_live_sequences)
