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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from lifecycle._kvcache import REMOVED, KVCacheCore, RawEvents
from lifecycle.config import ModelConfig
from lifecycle.device import Device
from lifecycle.errors import ConfigError, OutOfBlocks
from lifecycle.events.translate import KVEventLog
from lifecycle.events.types import MEDIUM_CPU
from lifecycle.pools import KVPool, SSMPool
from lifecycle.snapshots import snapshot_blocks_at_finish
from lifecycle.tiers._args import token_blocks
from lifecycle.tiers.host import HostTier
from lifecycle.tiers.keys import TierKeys
from lifecycle.tiers.records import BlockRecord
from lifecycle.tiers.ssm import HostSnapshots

if TYPE_CHECKING:
    from lifecycle.tiers.store import StoreTier

__all__ = ["ModelTiers", "TierCounters", "check_host_blocks", "open_tiers"]

_HASHES: Final = 1 << 64
#: Admitted prompts' keys kept for their release, at most (a handle released past the model's
#: calls leaves its entry behind; the oldest go first).
_CHAINS_MAX: Final = 1 << 16
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
    tier_ns: int = 0  # time in the tiers: demotion, promotion, tier keys (copies and store reads included)
    tier_copy_ns: int = 0  # of which batched copies (with the tier's checks around them)
    tier_store_ns: int = 0  # of which store reads at admission


def check_host_blocks(host_blocks: object) -> None:
    """A host tier's size is an int >= 0 (0: none)."""
    if isinstance(host_blocks, bool) or not isinstance(host_blocks, int) or host_blocks < 0:
        raise ConfigError(f"host_tier_blocks={host_blocks!r} must be an int >= 0")


class ModelTiers:
    """A host tier of ``host_blocks`` blocks with an optional store at ``store_url`` under it, for
    one model's core and KV pool; their events go into ``events`` (None: no events).

    Blocks are found in the tiers by their tier keys (:mod:`lifecycle.tiers.keys`: ``namespace``
    and ``secret``), computed from a request's own tokens: at admission for the lookup, and when a
    holder caches or releases a sequence (:meth:`record`), for every block of its table, so a block
    the device evicts goes down under the key of the prefix it was computed after.
    ``store_options``: keywords of the :class:`~lifecycle.tiers.store.StoreTier` (its ``admit``
    policy, ``ttl_s``, timeouts, ...)."""

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
        weights_fingerprint: bytes | str | None = None,
        secret: bytes | str | None = None,
        store_options: Mapping[str, Any] | None = None,
        ssm: SSMPool | None = None,
    ) -> None:
        check_host_blocks(host_blocks)
        if ssm is not None and store_url is not None:
            raise ConfigError(
                "a store holds KV blocks only: a model with SSM layers reuses from the host tier, whose SSM "
                "snapshots stay in this process"
            )
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
        self._store: StoreTier | None = None
        self._snapshots: HostSnapshots | None = None
        self._events = events
        self._keys = TierKeys(config, weights_fingerprint=weights_fingerprint, secret=secret)
        self._roots: dict[int, int] = {}  # cache key -> the content hash its chains start from
        self._chains: dict[int, npt.NDArray[np.uint64]] = {}  # handle -> tier keys of its admitted prompt
        self._kept: set[int] = set()  # high words of keys marked to keep (written to the store)
        self._event_hashes: dict[int, int] = {}  # with events: high word of a host entry -> its content hash
        num_blocks = kv_pool.num_blocks if kv_pool is not None else 0
        # What each device block holds, as its last holder recorded it: its key, its parent's, its
        # content hash; valid until the block leaves the cache.
        self._block_keys = np.zeros((num_blocks, 2), dtype=np.uint64)
        self._block_parents = np.zeros((num_blocks, 2), dtype=np.uint64)
        self._block_hashes = np.zeros(num_blocks, dtype=np.uint64)
        self._block_valid = np.zeros(num_blocks, dtype=np.bool_)
        self._block_reused = np.zeros(num_blocks, dtype=np.bool_)  # hit on the device since it was cached
        if host_blocks:
            assert kv_pool is not None
            self._host = HostTier(device, kv_pool, host_blocks, config.block_size)
            try:
                if ssm is not None:
                    # snapshots beside the blocks, in a quarter of the blocks' bytes (a few at least)
                    snapshot_bytes = sum(nbytes for _, nbytes in ssm.slot_ranges(0))
                    capacity = max(min(host_blocks, 8), host_blocks * self._host.block_bytes // (4 * snapshot_bytes))
                    self._snapshots = HostSnapshots(device, ssm, capacity)
                if store_url is not None:
                    from lifecycle.tiers.store import StoreTier

                    self._store = StoreTier(
                        store_url, config, source=self._host, namespace=self._keys.namespace,
                        **dict(store_options or {}),
                    )
                    if self._store.admit == "all":
                        self._host.subscribe(self._store.write_behind)
                if events is not None:
                    self._host.record_changes(True)
                self._host.bind_blocks(
                    self._block_keys, self._block_parents, self._block_hashes, self._block_valid, self._block_reused
                )
            except BaseException:
                if self._snapshots is not None:
                    self._snapshots.close()
                self._host.close()
                raise
        core.set_events(events is not None, demote=self._host is not None)

    @property
    def host(self) -> HostTier | None:
        return self._host

    @property
    def store(self) -> StoreTier | None:
        return self._store

    @property
    def keys(self) -> TierKeys:
        return self._keys

    def held_hashes(self) -> set[int]:
        """With events on: the content hashes of the blocks the host tier holds (as its events
        named them); empty otherwise."""
        return set(self._event_hashes.values())

    # -- what each device block holds ---------------------------------------------------------------

    def record(self, handle: int, slot: int | None = None) -> None:
        """Before a holder caches or releases ``handle``: the tier keys of every whole block of
        its table, from its own tokens (the admitted prompt's keys are reused); on a hybrid model
        also the SSM state of its ``slot`` (None: detached), when that state consumed exactly
        whole blocks of it."""
        core = self._core
        bs = self._block_size
        full = min(core.num_tokens(handle) // bs, core.num_blocks(handle))
        chain = self._chains.pop(handle, None)
        if full == 0 or self._host is None:
            return
        started = time.perf_counter_ns()
        root = self._keys.root(core.cache_key(handle))
        done = 0 if chain is None else min(len(chain), full)
        if done < full:
            parent = root if done == 0 else (int(chain[done - 1, 0]), int(chain[done - 1, 1]))  # type: ignore[index]
            rest = self._keys.chain(core.tokens(handle)[done * bs : full * bs], parent)
            chain = rest if done == 0 else np.concatenate((chain[:done], rest))  # type: ignore[index]
        assert chain is not None
        chain = chain[:full]
        ids = core.block_table(handle)[:full]
        hashes = core.block_hashes(handle)[:full]
        if len(hashes) < full:  # blocks not hashed yet hold nothing a tier can name
            full = len(hashes)
            ids, chain = ids[:full], chain[:full]
        self._host.note_blocks(ids, chain, root, hashes)  # each block's key, parent's key, hash
        if self._snapshots is not None and slot is not None:
            self._save_snapshot(handle, chain, slot)
        self.counters.tier_ns += time.perf_counter_ns() - started

    def _save_snapshot(self, handle: int, chain: npt.NDArray[np.uint64], slot: int) -> None:
        """The SSM state of ``slot`` into the host snapshots, after the block it consumed up to."""
        assert self._snapshots is not None
        _, _, num_tokens, _, num_blocks, _, ssm_tokens, failed, _ = self._core.info(handle)
        if failed:
            return
        consumed = None if ssm_tokens < 0 else ssm_tokens
        blocks = min(snapshot_blocks_at_finish(num_tokens, num_blocks, consumed, self._block_size), len(chain))
        if blocks:
            copying = time.perf_counter_ns()
            high, low = chain[blocks - 1].tolist()
            self._snapshots.save((high, low), slot)
            self.counters.tier_copy_ns += time.perf_counter_ns() - copying

    def keep(self, handle: int) -> None:
        """Mark the admitted prompt of ``handle`` to keep: its blocks go to the store when the
        device evicts them, reused or not."""
        chain = self._chains.get(handle)
        if chain is not None and self._store is not None:
            if len(self._kept) > 1 << 20:
                self._kept.clear()
            self._kept.update(chain[:, 0].tolist())

    # -- after every core call that may evict ------------------------------------------------------

    def drain(self) -> None:
        """Take the core's log: its events go into the log, then what it evicted is demoted (and
        the host tier's changes follow in the log)."""
        if not self._core.pending_events:
            return
        raw = self._core.take_events()
        if self._events is None and self._store is None and self._host is not None:
            # the host tier alone: the whole log's demotion is one compiled call
            started = time.perf_counter_ns()
            self.counters.blocks_demoted += self._host.demote_removed(raw)
            self.counters.tier_copy_ns += time.perf_counter_ns() - started
            self.counters.tier_ns += time.perf_counter_ns() - started
            return
        demoted = self._demoted(raw) if self._host is not None else None
        leaving: dict[int, int] = {}  # the cache keys of the blocks that left the device, where not 0
        if self._events is not None:
            self._events.device(raw, leaving)
        if demoted is None:
            return
        hashes, ids, tokens = demoted
        started = time.perf_counter_ns()
        host = self._host
        assert host is not None
        # Only blocks whose last holder named them, as the block the core says left, go down.
        known = self._block_valid[ids] & (self._block_hashes[ids] == hashes)
        reused = self._block_reused[ids]
        self._block_valid[ids] = False
        self._block_reused[ids] = False
        if not known.all():
            hashes, ids, tokens = hashes[known], ids[known], tokens.reshape(-1, self._block_size)[known]
            reused = reused[known]
        keys, parents = self._block_keys[ids], self._block_parents[ids]
        marked = time.perf_counter_ns()
        self.counters.blocks_demoted += host.demote(keys, ids, tokens, parents)
        copied = time.perf_counter_ns()
        self.counters.tier_copy_ns += copied - marked
        store = self._store
        if store is not None and store.admit == "reused":
            # reused on the device, or marked to keep: worth sharing (a host hit is written at promotion)
            if self._kept:
                kept = [key for key in keys[:, 0].tolist() if key in self._kept]
                self._kept.difference_update(kept)
                reused |= np.isin(keys[:, 0], np.array(kept, dtype=np.uint64))
            if reused.any():
                store.write_behind(keys[reused, 0].tolist())
        if self._events is not None:
            demoted_hashes: list[int] = hashes.tolist()
            cache_keys = [leaving.get(h, 0) for h in demoted_hashes] if leaving else [0] * len(demoted_hashes)
            self._log_host(keys[:, 0].tolist(), demoted_hashes, tokens.reshape(-1, self._block_size), cache_keys, None)
        self.counters.tier_ns += time.perf_counter_ns() - started

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

    def _prompt_keys(self, handle: int, prompt: npt.NDArray[np.int32], limit: int) -> npt.NDArray[np.uint64]:
        """The tier keys of the first ``limit`` blocks of ``prompt``, kept for :meth:`record`."""
        chain = self._keys.chain(prompt[: limit * self._block_size], self._keys.root(self._core.cache_key(handle)))
        if len(self._chains) >= _CHAINS_MAX:  # handles released where no record was taken
            del self._chains[next(iter(self._chains))]
        self._chains[handle] = chain
        return chain

    def _parent(self, handle: int, chain: npt.NDArray[np.uint64], first: int) -> tuple[int, int]:
        return _before(chain, first, self._keys.root(self._core.cache_key(handle)))

    def lookup(self, cache_key: int, prompt: npt.NDArray[np.int32], reused_blocks: int, limit: int) -> int:
        """How many blocks past ``reused_blocks`` of ``prompt`` (at most to ``limit``), under
        ``cache_key``, the host tier holds, as :meth:`promote` would find them."""
        if self._host is None or limit <= reused_blocks:
            return 0
        root = self._keys.root(cache_key)
        chain = self._keys.chain(prompt[: limit * self._block_size], root)
        bs = self._block_size
        wanted = chain[reused_blocks:]
        tokens = prompt[reused_blocks * bs : limit * bs]
        found = self._host.lookup_rows(wanted, tokens, _before(chain, reused_blocks, root))
        return self._snapshot_run(wanted, found) if self._snapshots is not None else found

    def prefetch(self, cache_key: int, prompt: npt.ArrayLike) -> int:
        """Ask the store, on its reader thread, for the blocks of ``prompt`` (a queued request's,
        under ``cache_key``) that the host tier does not hold; returns the blocks asked for."""
        size = np.size(prompt)
        prompt = token_blocks("prefetch_prefix", prompt, 1, size).ravel() if size else np.zeros(0, np.int32)
        if self._store is None or self._host is None:
            return 0
        limit = (len(prompt) - 1) // self._block_size
        if limit <= 0:
            return 0
        root = self._keys.root(cache_key)
        chain = self._keys.chain(prompt[: limit * self._block_size], root)
        bs = self._block_size
        found = self._host.lookup_rows(chain, prompt[: limit * bs], root)
        if found == limit:
            return 0
        return self._store.prefetch(chain[found:], prompt[found * bs : limit * bs], _before(chain, found, root))

    def promote(self, handle: int, prompt: npt.NDArray[np.int32], reused_blocks: int, slot: int | None = None) -> int:
        """Continue a request's lookup past its ``reused_blocks`` device blocks into the host
        tier and the store, up to the block before the one holding the prompt's last token, and
        copy the run found into the request's blocks (grown to cover it if they do not). Returns
        the blocks promoted. Every block promoted is the block asked for: the host tier checks
        each entry's key, parent key and tokens, the store each record's, and the copy both. On a
        hybrid model the run ends at a block whose SSM snapshot the host holds, which is restored
        into ``slot`` (None, detached: nothing is promoted)."""
        host = self._host
        limit = (len(prompt) - 1) // self._block_size
        if reused_blocks and self._store is not None:
            self._block_reused[self._core.block_table(handle)[:reused_blocks]] = True
        if host is None or limit <= reused_blocks or (self._snapshots is not None and slot is None):
            return 0
        started = time.perf_counter_ns()
        core = self._core
        self.counters.tier_lookups += 1
        tier_before = self.counters.tier_ns
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
            chain = self._prompt_keys(handle, prompt, limit)
            wanted = chain[reused_blocks:]
            parent = self._parent(handle, chain, reused_blocks)
            tokens = prompt[reused_blocks * bs : limit * bs]
            found = host.lookup_rows(wanted, tokens, parent)
            self.counters.host_hit_blocks += found
            from_host = found
            if found < len(wanted) and self._store is not None:
                room = host.capacity_blocks - found  # loading must not push out what was found
                reading = time.perf_counter_ns()
                run = self._load(handle, chain, reused_blocks + found, tokens[found * bs :], room)
                self.counters.store_hit_blocks += run
                self.counters.tier_store_ns += time.perf_counter_ns() - reading
                found += run
            if self._snapshots is not None:
                found = self._snapshot_run(wanted, found)
            if found == 0:
                return 0
            table = core.block_table(handle)
            copying = time.perf_counter_ns()
            ids = table[reused_blocks : reused_blocks + found]
            host.promote_rows(wanted[:found], ids, tokens[: found * bs], parent)
            if self._snapshots is not None:
                assert slot is not None
                high, low = wanted[found - 1].tolist()
                self._snapshots.restore((high, low), slot)
            self.counters.tier_copy_ns += time.perf_counter_ns() - copying
            core.mark_computed(handle, reused_blocks + found)
            self.counters.blocks_promoted += found
            if from_host and self._store is not None and self._store.admit == "reused":
                self._store.write_behind(wanted[:from_host, 0].tolist())  # reused: worth sharing
            return found
        finally:  # the drain's own time is inside this call's
            self.counters.tier_ns = tier_before + time.perf_counter_ns() - started

    def _snapshot_run(self, wanted: npt.NDArray[np.uint64], found: int) -> int:
        """The longest leading run of the ``found`` blocks of ``wanted`` that ends at a block whose
        SSM snapshot is held (0: none)."""
        assert self._snapshots is not None
        for run in range(found, 0, -1):
            high, low = wanted[run - 1].tolist()
            if self._snapshots.holds((high, low)):
                return run
        return 0

    def _load(
        self, handle: int, chain: npt.NDArray[np.uint64], first: int, tokens: npt.NDArray[np.int32], room: int
    ) -> int:
        """Read blocks ``chain[first:]`` (holding ``tokens``) from the store and load the leading
        run of valid records, at most ``room``, into the host tier; returns the run's length."""
        assert self._store is not None and self._host is not None
        records = self._store.get_many(chain[first:], tokens, self._parent(handle, chain, first))
        hits: list[BlockRecord] = []
        for record in records[:room]:
            if record is None:
                break
            hits.append(record)
        if not hits:
            return 0
        self._host.load(hits)
        if self._events is not None:
            run = len(hits)
            hashes: list[int] = self._core.block_hashes(handle)[: first + run].tolist()
            parents: list[int | None] = [hashes[i - 1] if i else None for i in range(first, first + run)]
            keys = [self._core.cache_key(handle)] * run
            rows = tokens[: run * self._block_size].reshape(run, self._block_size)
            self._log_host(chain[first : first + run, 0].tolist(), hashes[first:], rows, keys, parents)
        return len(hits)

    # -- events --------------------------------------------------------------------------------------

    def _log_host(
        self, tier_keys: list[int], hashes: list[int], rows: npt.NDArray[np.int32], keys: list[int],
        parents: list[int | None] | None,
    ) -> None:
        """The host tier's changes in the call just made on the blocks of ``tier_keys`` (high
        words; their content ``hashes``, token ``rows``, cache ``keys`` and, where known,
        ``parents``; demoted blocks' parents are recovered from the chain) into the log, named by
        their content hashes as the device's events name them."""
        assert self._host is not None and self._events is not None
        position: dict[int, int] | None = None
        named = self._event_hashes
        for kind, changed in self._host.take_changes():
            if kind == "removed":
                self._events.removed(MEDIUM_CPU, [named.pop(key) for key in changed if key in named])
                continue
            if position is None:
                position = {key: i for i, key in enumerate(tier_keys)}
            picked = [position[key] for key in changed]
            picked_hashes = [hashes[i] for i in picked]
            named.update(zip(changed, picked_hashes))
            picked_keys = [keys[i] for i in picked]
            if parents is None:
                picked_parents = self._parents(picked_hashes, rows[picked], picked_keys)
            else:
                picked_parents = [parents[i] for i in picked]
            self._log_cpu_stored(picked_hashes, rows[picked], picked_parents, picked_keys)

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
        self._block_valid[:] = False
        self._event_hashes.clear()
        if self._snapshots is not None:
            self._snapshots.clear()
        if self._host is not None:
            self._host.clear()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the store's queued writes are written (True; False on timeout)."""
        return self._store.flush(timeout_s) if self._store is not None else True

    def check_invariants(self) -> None:
        if self._host is not None:
            self._host.check_invariants()
        if self._snapshots is not None:
            self._snapshots.check_invariants()
        if self._store is not None:
            self._store.check_invariants()

    def close(self) -> None:
        """The store first (its writer reads the host tier), then the host tier."""
        try:
            if self._store is not None:
                self._store.close()
        finally:
            if self._snapshots is not None:
                self._snapshots.close()
            if self._host is not None:
                self._host.close()


def _before(chain: npt.NDArray[np.uint64], first: int, root: tuple[int, int]) -> tuple[int, int]:
    """The key before block ``first`` of ``chain`` (``root`` before the first)."""
    if first == 0:
        return root
    high, low = chain[first - 1].tolist()
    return high, low


def open_tiers(
    core: KVCacheCore,
    device: Device,
    kv_pool: KVPool | None,
    config: ModelConfig,
    *,
    ssm: SSMPool | None,
    host_blocks: int,
    store_url: str | None,
    events: KVEventLog | None,
    weights_fingerprint: bytes | str | None = None,
    secret: bytes | str | None = None,
    store_options: Mapping[str, Any] | None = None,
) -> ModelTiers | None:
    """A model's tiers (a host tier of ``host_blocks``, a store at ``store_url`` under it), or None
    without either: events alone are then read from the core's log by the model, with no tier
    between. ``ssm``: the model's SSM pool (a hybrid's host tier keeps SSM snapshots beside its blocks).
    ``weights_fingerprint`` and ``secret``: see :mod:`lifecycle.tiers.keys`; ``store_options``:
    the store's keywords."""
    if host_blocks or store_url is not None:
        return ModelTiers(
            core, device, kv_pool, config, host_blocks=host_blocks, store_url=store_url, events=events,
            weights_fingerprint=weights_fingerprint, secret=secret, store_options=store_options, ssm=ssm,
        )
    check_host_blocks(host_blocks)
    core.set_events(events is not None, demote=False)
    return None
