"""The model's side of the tiers below the device pool (:mod:`lifecycle.tiers`) and of its KV events.

``ModelTiers`` is what ``HybridModel`` delegates to when it was built with a host tier, a store or
events:

- after every core call that may evict cached blocks, :meth:`ModelTiers.drain` takes the core's
  event log: removed blocks (logged with their block ids and tokens, the core's *demotion*) are
  copied into the host tier before the call returns, so no engine kernel can have written the
  blocks again; the log is kept for :meth:`ModelTiers.take_events` when events are on;
- at admission, :meth:`ModelTiers.promote` continues the lookup past the device match, into the
  host tier and then the store (one round trip), and copies what it finds into the request's
  fresh blocks, which then count as cached and enter the device prefix cache.

Tier counters are kept here and reported in ``HybridModel.stats()``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields

import numpy as np
import numpy.typing as npt

from lifecycle._kvcache import REMOVED, KVCacheCore, RawEvents
from lifecycle.config import ModelConfig
from lifecycle.device import Device
from lifecycle.errors import ConfigError, OutOfBlocks
from lifecycle.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AdapterLookup,
    BlockRemoved,
    KVEvent,
    KVEventBatch,
    KVEventTranslator,
)
from lifecycle.pools import KVPool
from lifecycle.tiers.host import HostTier
from lifecycle.tiers.records import BlockRecord

__all__ = ["ModelTiers", "TierCounters"]


@dataclass(slots=True)
class TierCounters:
    """What the tiers below the device did for the model."""

    tier_lookups: int = 0  # admissions that looked past the device match
    host_hit_blocks: int = 0  # blocks found in the host tier and promoted
    store_hit_blocks: int = 0  # blocks read from the store (then promoted through the host tier)
    blocks_demoted: int = 0  # evicted device blocks copied into the host tier
    blocks_promoted: int = 0
    tier_ns: int = 0  # time in demotion and promotion (copies included)


class ModelTiers:
    """A host tier of ``host_blocks`` blocks (0: none) with an optional store at ``store_url``
    under it, and the KV event log (``events``), for one model's core and KV pool."""

    def __init__(
        self,
        core: KVCacheCore,
        device: Device,
        kv_pool: KVPool | None,
        config: ModelConfig,
        *,
        host_blocks: int = 0,
        store_url: str | None = None,
        events: bool = False,
        adapter_of: AdapterLookup | None = None,
    ) -> None:
        if isinstance(host_blocks, bool) or not isinstance(host_blocks, int) or host_blocks < 0:
            raise ConfigError(f"host_tier_blocks={host_blocks!r} must be an int >= 0")
        if store_url is not None and host_blocks == 0:
            raise ConfigError("a store needs a host tier above it (host_tier_blocks > 0): blocks enter it from there")
        if host_blocks and (kv_pool is None or not config.enable_prefix_cache):
            raise ConfigError(
                "a host tier keeps evicted prefix-cache blocks: it needs attention layers and the prefix cache on"
            )
        self._core = core
        self._block_size = config.block_size
        self._lock = threading.Lock()
        self.counters = TierCounters()
        self._host: HostTier | None = None
        self._store = None
        self._raw: list[RawEvents] = []
        self._events = events
        self._translators = {
            medium: KVEventTranslator(config.block_size, adapter_of=adapter_of, medium=medium)
            for medium in (MEDIUM_GPU, MEDIUM_CPU)
        }
        self._host_stored: list[list[int]] = []
        if host_blocks:
            assert kv_pool is not None
            self._host = HostTier(device, kv_pool, host_blocks, config.block_size)
            try:
                if store_url is not None:
                    from lifecycle.tiers.store import StoreTier

                    self._store = StoreTier(store_url, config, source=self._host)
                    self._host.subscribe(self._store.write_behind)
                if events:
                    self._host.subscribe(self._on_host_stored)
                    self._host.record_evictions(True)
            except BaseException:
                self._host.close()
                raise
        core.set_events(events, demote=self._host is not None)

    @property
    def host(self) -> HostTier | None:
        return self._host

    @property
    def events(self) -> bool:
        return self._events

    # -- after every core call that may evict ------------------------------------------------------

    def drain(self) -> None:
        """Take the core's log: demote what it evicted, keep the rest for ``take_events``."""
        if not self._core.pending_events:
            return
        raw = self._core.take_events()
        if self._host is not None:
            self._demote(raw)
        if self._events:
            self._raw.append(raw)

    def _demote(self, raw: RawEvents) -> None:
        entries = raw.entries
        removed = (entries["kind"] == REMOVED) & entries["has_ids"]
        if not removed.any():
            return
        counts = entries["count"].astype(np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        hashes = np.concatenate([raw.hashes[s : s + c] for s, c in zip(starts[removed], counts[removed])])
        # Removed entries with ids are the only ones with ids, and their tokens follow in order.
        token_starts = np.concatenate(([0], np.cumsum(entries["num_tokens"].astype(np.int64))[:-1]))
        tokens = np.concatenate(
            [raw.tokens[s : s + n] for s, n in zip(token_starts[removed], entries["num_tokens"][removed])]
        )
        started = time.perf_counter_ns()
        assert self._host is not None
        self.counters.blocks_demoted += self._host.demote(hashes, raw.ids, tokens)
        self.counters.tier_ns += time.perf_counter_ns() - started

    # -- admission -----------------------------------------------------------------------------------

    def promote(self, handle: int, prompt: npt.NDArray[np.int32], reused_blocks: int) -> int:
        """Continue a request's lookup past its ``reused_blocks`` device blocks into the host
        tier and the store, up to the block before the one holding the prompt's last token, and
        copy the run found into the request's blocks (grown to cover it if they do not). Returns
        the blocks promoted."""
        host = self._host
        limit = (len(prompt) - 1) // self._block_size
        if host is None or limit <= reused_blocks:
            return 0
        started = time.perf_counter_ns()
        core = self._core
        self.counters.tier_lookups += 1
        try:
            if core.num_blocks(handle) < limit:
                try:
                    core.grow(handle, limit)
                except OutOfBlocks:
                    pass  # promote into what the request holds
            self.drain()  # blocks that growing evicted go down before the lookup
            limit = min(limit, core.num_blocks(handle))
            if limit <= reused_blocks:
                return 0
            bs = self._block_size
            wanted = core.block_hashes(handle)[reused_blocks:limit]
            tokens = prompt[reused_blocks * bs : limit * bs]
            found = host.lookup(wanted, tokens)
            self.counters.host_hit_blocks += found
            if found < len(wanted) and self._store is not None:
                records = self._store.get_many(wanted[found:], tokens[found * bs :])
                hits: list[BlockRecord] = []
                for record in records[: host.capacity_blocks - found]:  # loading must not push out what was found
                    if record is None:
                        break
                    hits.append(record)
                run = len(hits)
                if run > 0:
                    host.load(hits)
                    self.counters.store_hit_blocks += run
                    found += run
            if found == 0:
                return 0
            table = core.block_table(handle)
            host.promote(wanted[:found], table[reused_blocks : reused_blocks + found])
            core.mark_computed(handle, reused_blocks + found)
            self.counters.blocks_promoted += found
            return found
        finally:
            self.counters.tier_ns += time.perf_counter_ns() - started

    # -- events --------------------------------------------------------------------------------------

    def _on_host_stored(self, hashes: list[int]) -> None:
        with self._lock:
            self._host_stored.append(hashes)

    def take_events(self, data_parallel_rank: int | None = None) -> KVEventBatch:
        """Every event since the last call, in order per tier: the device pool's (``GPU``) first,
        then the host tier's (``CPU``: blocks demoted into it, blocks it evicted)."""
        self.drain()
        raws, self._raw = self._raw, []
        events: list[KVEvent] = []
        for raw in raws:
            events.extend(self._translators[MEDIUM_GPU].events(raw))
        if self._host is not None and self._events:
            with self._lock:
                stored, self._host_stored = self._host_stored, []
            cpu = self._translators[MEDIUM_CPU]
            events.extend(cpu.host_stored(hashes) for hashes in stored)
            evicted = self._host.take_evicted()
            if evicted:
                events.append(BlockRemoved(block_hashes=tuple(evicted), medium=MEDIUM_CPU))
        return KVEventBatch(ts=time.time(), events=tuple(events), data_parallel_rank=data_parallel_rank)

    # -- state ---------------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {field.name: getattr(self.counters, field.name) for field in fields(self.counters)}

    def clear(self) -> None:
        """After a prefix-cache reset: the tiers' blocks go too (they were computed with what the
        reset discards), and pending events."""
        self.drain()
        if self._host is not None:
            self._host.clear()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the store's queued writes are written (True; False on timeout)."""
        return self._store.flush(timeout_s) if self._store is not None else True

    def check_invariants(self) -> None:
        if self._host is not None:
            self._host.check_invariants()
        if self._store is not None:
            self._store.check_invariants()

    def close(self) -> None:
        """The store first (its writer reads the host tier), then the host tier."""
        try:
            if self._store is not None:
                self._store.close()
        finally:
            if self._host is not None:
                self._host.close()
