"""The model's side of the tiers below the device pool: demotion, promotion and the tiers' KV events.

````ModelTiers`` is what ``HybridModel`` delegates to when it was built with a host tier or a store
(without one, the model reads the core's event log itself):

- after every core call that may evict cached blocks, :meth:`ModelTiers.drain` takes the core's
  event log: removed blocks (logged with their block ids and tokens, the core's *demotion*) are
  copied into the host tier before the call returns, so no engine kernel can have written the
  blocks again; with events on, the core's events and then the host tier's changes go into the
  model's event log (:class:`~lifecycle.events.KVEventLog`), in the order they happened;
- at admission, :meth:`ModelTiers.promote` continues the lookup past the device match, into the
  host tier and then the store (one round trip), and copies what it finds into the request's
  fresh blocks, which then count as cached and enter the device prefix cache.

Tier counters are kept here and reported in ``HybridModel.stats()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Final

import numpy as np
import numpy.typing as npt

from lifecycle._kvcache import REMOVED, KVCacheCore, RawEvents
from lifecycle.config import ModelConfig
from lifecycle.device import Device
from lifecycle.errors import ConfigError, OutOfBlocks
from lifecycle.events.translate import KVEventLog
from lifecycle.events.types import MEDIUM_CPU
from lifecycle.pools import KVPool
from lifecycle.tiers.host import HostTier
from lifecycle.tiers.records import BlockRecord

__all__ = ["ModelTiers", "TierCounters", "check_host_blocks", "open_tiers"]

_HASHES: Final = 1 << 64
#: The content hash's chain multiplier (docs/content-hashes.md, step 5) and its inverse mod 2**64.
_CHAIN: Final = 0x9E3779B97F4A7C15
_UNCHAIN: Final = pow(_CHAIN, -1, _HASHES)


@dataclass(slots=True)
class TierCounters:
    """What the tiers below the device did for the model."""

    tier_lookups: int = 0  # admissions that looked past the device match
    host_hit_blocks: int = 0  # blocks found in the host tier and promoted
    store_hit_blocks: int = 0  # blocks read from the store (then promoted through the host tier)
    blocks_demoted: int = 0  # evicted device blocks copied into the host tier
    blocks_promoted: int = 0
    tier_ns: int = 0  # time in demotion and promotion (copies included)


def check_host_blocks(host_blocks: object) -> None:
    """A host tier's size is an int >= 0 (0: none)."""
    if isinstance(host_blocks, bool) or not isinstance(host_blocks, int) or host_blocks < 0:
        raise ConfigError(f"host_tier_blocks={host_blocks!r} must be an int >= 0")


class ModelTiers:
    """A host tier of ``host_blocks`` blocks with an optional store at ``store_url`` under it, for
    one model's core and KV pool; their events go into ``events`` (None: no events)."""

    def __init__(
        self,
        core: KVCacheCore,
        device: Device,
        kv_pool: KVPool | None,
        config: ModelConfig,
        *,
        host_blocks: int = 0,
        store_url: str | None = None,
        events: KVEventLog | None = None,
    ) -> None:
        check_host_blocks(host_blocks)
        if store_url is not None and host_blocks == 0:
            raise ConfigError("a store needs a host tier above it (host_tier_blocks > 0): blocks enter it from there")
        if host_blocks and (kv_pool is None or not config.enable_prefix_cache):
            raise ConfigError(
                "a host tier keeps evicted prefix-cache blocks: it needs attention layers and the prefix cache on"
            )
        self._core = core
        self._block_size = config.block_size
        self.counters = TierCounters()
        self._host: HostTier | None = None
        self._store = None
        self._events = events
        self._roots: dict[int, int] = {}  # cache key -> the hash its chains start from
        if host_blocks:
            assert kv_pool is not None
            self._host = HostTier(device, kv_pool, host_blocks, config.block_size)
            try:
                if store_url is not None:
                    from lifecycle.tiers.store import StoreTier

                    self._store = StoreTier(store_url, config, source=self._host)
                    self._host.subscribe(self._store.write_behind)
                if events is not None:
                    self._host.record_changes(True)
            except BaseException:
                self._host.close()
                raise
        core.set_events(events is not None, demote=self._host is not None)

    @property
    def host(self) -> HostTier | None:
        return self._host

    # -- after every core call that may evict ------------------------------------------------------

    def drain(self) -> None:
        """Take the core's log: its events go into the log, then what it evicted is demoted (and
        the host tier's changes follow in the log)."""
        if not self._core.pending_events:
            return
        raw = self._core.take_events()
        demoted = self._demoted(raw) if self._host is not None else None
        leaving: dict[int, int] = {}  # the cache keys of the blocks that left the device, where not 0
        if self._events is not None:
            self._events.device(raw, leaving)
        if demoted is not None:
            hashes, ids, tokens = demoted
            started = time.perf_counter_ns()
            assert self._host is not None
            self.counters.blocks_demoted += self._host.demote(hashes, ids, tokens)
            self.counters.tier_ns += time.perf_counter_ns() - started
            if self._events is not None:
                demoted_hashes: list[int] = hashes.tolist()
                keys = [leaving.get(h, 0) for h in demoted_hashes] if leaving else [0] * len(demoted_hashes)
                self._log_host(demoted_hashes, tokens.reshape(-1, self._block_size), keys, None)

    @staticmethod
    def _demoted(raw: RawEvents) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int32], npt.NDArray[np.int32]] | None:
        """The hashes, block ids and tokens of the blocks the log's removals demote, or None."""
        entries = raw.entries
        removed = (entries["kind"] == REMOVED) & entries["has_ids"]
        if not removed.any():
            return None
        counts = entries["count"].astype(np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        hashes = np.concatenate([raw.hashes[s : s + c] for s, c in zip(starts[removed], counts[removed])])
        # Removed entries with ids are the only ones with ids, and their tokens follow in order.
        token_starts = np.concatenate(([0], np.cumsum(entries["num_tokens"].astype(np.int64))[:-1]))
        tokens = np.concatenate(
            [raw.tokens[s : s + n] for s, n in zip(token_starts[removed], entries["num_tokens"][removed])]
        )
        return hashes, raw.ids, tokens

    # -- admission -----------------------------------------------------------------------------------

    def promote(self, handle: int, prompt: npt.NDArray[np.int32], reused_blocks: int) -> int:
        """Continue a request's lookup past its ``reused_blocks`` device blocks into the host
        tier and the store, up to the block before the one holding the prompt's last token, and
        copy the run found into the request's blocks (grown to cover it if they do not). Returns
        the blocks promoted. Every block promoted holds the request's tokens: the host tier checks
        them for what it held, the store for what it gives back, and the copy for both."""
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
            chain = core.block_hashes(handle)[:limit]
            wanted = chain[reused_blocks:]
            tokens = prompt[reused_blocks * bs : limit * bs]
            found = host.lookup(wanted, tokens)
            self.counters.host_hit_blocks += found
            if found < len(wanted) and self._store is not None:
                room = host.capacity_blocks - found  # loading must not push out what was found
                run = self._load(handle, chain, reused_blocks + found, tokens[found * bs :], room)
                self.counters.store_hit_blocks += run
                found += run
            if found == 0:
                return 0
            table = core.block_table(handle)
            host.promote(wanted[:found], table[reused_blocks : reused_blocks + found], tokens[: found * bs])
            core.mark_computed(handle, reused_blocks + found)
            self.counters.blocks_promoted += found
            return found
        finally:
            self.counters.tier_ns += time.perf_counter_ns() - started

    def _load(
        self, handle: int, chain: npt.NDArray[np.uint64], first: int, tokens: npt.NDArray[np.int32], room: int
    ) -> int:
        """Read blocks ``chain[first:]`` (holding ``tokens``) from the store and load the leading
        run of valid records, at most ``room``, into the host tier; returns the run's length."""
        assert self._store is not None and self._host is not None
        hashes: list[int] = chain.tolist()
        records = self._store.get_many(chain[first:], tokens)
        seen = set(hashes[:first])
        hits: list[BlockRecord] = []
        for record in records[:room]:
            # A hash met twice in one chain (a collision) ends the run: one entry cannot hold both.
            if record is None or record.content_hash in seen:
                break
            seen.add(record.content_hash)
            hits.append(record)
        if not hits:
            return 0
        self._host.load(hits)
        if self._events is not None:
            run = len(hits)
            parents: list[int | None] = [hashes[i - 1] if i else None for i in range(first, first + run)]
            keys = [self._core.cache_key(handle)] * run
            rows = tokens[: run * self._block_size].reshape(run, self._block_size)
            self._log_host(hashes[first : first + run], rows, keys, parents)
        return len(hits)

    # -- events --------------------------------------------------------------------------------------

    def _log_host(
        self, hashes: list[int], rows: npt.NDArray[np.int32], keys: list[int], parents: list[int | None] | None
    ) -> None:
        """The host tier's changes in the call just made on ``hashes`` (their token ``rows``, cache
        ``keys`` and, where known, ``parents``; demoted blocks' parents are recovered from the
        chain) into the log."""
        assert self._host is not None and self._events is not None
        position: dict[int, int] | None = None
        for kind, changed in self._host.take_changes():
            if kind == "removed":
                self._events.removed(MEDIUM_CPU, changed)
                continue
            if position is None:
                position = {content_hash: i for i, content_hash in enumerate(hashes)}
            picked = [position[content_hash] for content_hash in changed]
            picked_keys = [keys[i] for i in picked]
            if parents is None:
                picked_parents = self._parents(changed, rows[picked], picked_keys)
            else:
                picked_parents = [parents[i] for i in picked]
            self._log_cpu_stored(changed, rows[picked], picked_parents, picked_keys)

    def _parents(self, hashes: list[int], rows: npt.NDArray[np.int32], keys: list[int]) -> list[int | None]:
        """The parent of each block (None for a sequence's first) from its hash and tokens: the
        chain ``hash = own + parent * C`` (docs/content-hashes.md) is solved for ``parent``, with
        ``own`` read off the core's hashes of the tokens chained behind a block of zeros."""
        bs = self._block_size
        chained = self._core.content_hashes(np.concatenate((np.zeros(bs, np.int32), rows.ravel())), 0)
        with np.errstate(over="ignore"):
            own = chained[1:] - chained[:-1] * np.uint64(_CHAIN)
            found = (np.asarray(hashes, dtype=np.uint64) - own) * np.uint64(_UNCHAIN)
        return [None if parent == self._root(key) else parent for parent, key in zip(found.tolist(), keys)]

    def _root(self, key: int) -> int:
        """The hash the chains of cache key ``key`` start from, from the core's hashes of two
        blocks of zeros under it."""
        root = self._roots.get(key)
        if root is None:
            first, second = self._core.content_hashes(np.zeros(2 * self._block_size, np.int32), key).tolist()
            own = (second - first * _CHAIN) % _HASHES
            root = (first - own) * _UNCHAIN % _HASHES
            if len(self._roots) >= 4096:
                self._roots.clear()
            self._roots[key] = root
        return root

    def _log_cpu_stored(
        self, hashes: list[int], rows: npt.NDArray[np.int32], parents: list[int | None], keys: list[int]
    ) -> None:
        """``BlockStored`` events (CPU) for blocks that entered the host tier, as chains of one key
        each, every block after its parent where the parent entered too."""
        count = len(hashes)
        starts = [i for i in range(count) if i == 0 or parents[i] != hashes[i - 1] or keys[i] != keys[i - 1]]
        runs = list(zip(starts, [*starts[1:], count]))
        run_of = {hashes[i]: r for r, (begin, end) in enumerate(runs) for i in range(begin, end)}
        order: list[int] = []
        placed = [False] * len(runs)
        for run in range(len(runs)):
            lineage: list[int] = []
            at: int | None = run
            while at is not None and not placed[at]:
                placed[at] = True
                lineage.append(at)
                parent = parents[runs[at][0]]
                at = None if parent is None else run_of.get(parent)
            order.extend(reversed(lineage))
        chains: list[list[int]] = []
        for run in order:
            begin, end = runs[run]
            last = chains[-1][-1] if chains else -1
            if chains and parents[begin] == hashes[last] and keys[begin] == keys[last]:
                chains[-1].extend(range(begin, end))
            else:
                chains.append(list(range(begin, end)))
        assert self._events is not None
        for chain in chains:
            head = chain[0]
            self._events.stored(MEDIUM_CPU, [hashes[i] for i in chain], parents[head], rows[chain], keys[head])

    # -- state ---------------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {field.name: getattr(self.counters, field.name) for field in fields(self.counters)}

    def clear(self) -> None:
        """After a prefix-cache reset: the tiers' blocks go too (they were computed with what the
        reset discards). Pending events are kept, in order: the reset's ``AllBlocksCleared`` comes
        after every event before it, the host tier's included, and stands for the host tier's
        blocks too."""
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


def open_tiers(
    core: KVCacheCore,
    device: Device,
    kv_pool: KVPool | None,
    config: ModelConfig,
    *,
    ssm: bool,
    host_blocks: int,
    store_url: str | None,
    events: KVEventLog | None,
) -> ModelTiers | None:
    """A model's tiers (a host tier of ``host_blocks``, a store at ``store_url`` under it), or None
    without either: events alone are then read from the core's log by the model, with no tier
    between. ``ssm``: the model has SSM layers (which reuse through snapshots, not a host tier)."""
    if host_blocks and ssm:
        raise ConfigError("a host tier holds KV blocks only; a model with SSM layers reuses through snapshots")
    if host_blocks or store_url is not None:
        return ModelTiers(core, device, kv_pool, config, host_blocks=host_blocks, store_url=store_url, events=events)
    check_host_blocks(host_blocks)
    core.set_events(events is not None, demote=False)
    return None
