"""The host tier: evicted device blocks kept in (pinned) host memory, found again by key.

A :class:`HostTier` owns one host allocation of ``capacity_blocks`` slots (page-locked through the
driver on CUDA, plain memory on the host device). A slot holds one whole block: every attention
layer's K and V, layer after layer, plus the block's key, its parent's key and its tokens. Entries
are indexed by the high word of their key (the model's tiers use keyed chain keys,
:mod:`lifecycle.tiers.keys`) and evicted least recently used first.

A key only finds an entry: :meth:`HostTier.lookup` counts a hit only where the entry's whole key,
its parent's key (the key before it in the run asked for) and its tokens are the ones asked for,
and :meth:`HostTier.promote` checks the same before it copies anything.

Copies: :meth:`HostTier.demote` copies device blocks to host and :meth:`HostTier.promote` host
entries to device blocks, each as one batched copy that has completed when the call returns (the
device is synchronized), so the device block may be reused, or read by kernels, right after. The
caller orders the device's stream after the engine's work first (``Device.wait_stream``), as for
every copy out of the pools.

Every method is thread-safe (one lock): the shared store's writer reads entries from its own
thread (:meth:`HostTier.read_blocks`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from lifecycle.device.base import Device
from lifecycle.device.host import physical_memory_bytes
from lifecycle.errors import BlockIdOutOfRange, ConfigError, InvalidId, InvariantViolation, TornDown, Unsupported
from lifecycle.pools import KVPool
from lifecycle.tiers._args import (
    HashesLike, KeyLike, KeysLike, chained_parents, content_hashes, tier_key, tier_keys, token_blocks,
)
from lifecycle.tiers.records import BlockRecord

__all__ = ["BlockIdsLike", "HashesLike", "HeldBlock", "HostTier", "HostTierStats", "KeyLike", "KeysLike", "TokensLike"]

#: Device block ids: ints, or an integer array.
BlockIdsLike = Sequence[int] | npt.NDArray[np.integer[Any]]
#: Tokens of whole blocks: ``(n, block_size)`` or ``n * block_size`` token ids.
TokensLike = npt.ArrayLike

#: Batches of at most this many copies (blocks x layers) build their rows from Python ints.
_SMALL_BATCH_ROWS: Final = 8


@dataclass(frozen=True, slots=True, eq=False)
class HeldBlock:
    """A copy of one entry (:meth:`HostTier.read_blocks`): its key and its parent's, as (high,
    low), its tokens and its KV bytes."""

    key: tuple[int, int]
    parent: tuple[int, int]
    tokens: npt.NDArray[np.int32]
    kv: bytes


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """Counters of a :class:`HostTier` since it was built (blocks, unless named bytes).

    ``lookups`` counts blocks asked for, ``hits`` those found as asked for (key, parent, tokens; a
    hit rate is ``hits / lookups``); ``collisions`` counts entries whose index word matched but
    whose key, parent or tokens did not. ``stored`` counts blocks demoted into the tier,
    ``loaded`` those put in from records (the store), ``duplicates`` blocks already there,
    ``evicted`` entries dropped for room, ``replaced`` entries a record of the same index word and
    another identity took the place of, ``cleared`` entries :meth:`HostTier.clear` dropped. Held
    blocks are ``stored + loaded - evicted - replaced - cleared``."""

    capacity_blocks: int
    blocks: int
    lookups: int
    hits: int
    collisions: int
    stored: int
    loaded: int
    duplicates: int
    evicted: int
    replaced: int
    cleared: int
    promoted: int
    bytes_demoted: int
    bytes_promoted: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class HostTier:
    """Whole blocks of ``kv_pool`` in ``capacity_blocks`` slots of host memory, by key.

    Raises :class:`ConfigError` for a capacity below one block or larger than the machine's
    memory, or a ``block_size`` other than the pool's; the device's error when the memory cannot
    be had. Nothing is allocated on failure.
    """

    def __init__(self, device: Device, kv_pool: KVPool, capacity_blocks: int, block_size: int) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1:
            raise ConfigError(f"HostTier: capacity_blocks={capacity_blocks!r} must be an int >= 1")
        if block_size != kv_pool.block_size:
            raise ConfigError(f"HostTier: block_size={block_size!r} differs from the KV pool's {kv_pool.block_size}")
        if kv_pool.num_layers == 0 or kv_pool.num_blocks == 0:
            raise ConfigError("HostTier: the KV pool has no attention layer or no block: nothing to keep")
        layer_bytes = [kv_pool.layer_block_bytes(layer) for layer in range(kv_pool.num_layers)]
        for layer, nbytes in enumerate(layer_bytes):
            # A slot holds each layer's block as the bytes from its address on: blocks packed.
            stride = kv_pool.layer_strides(layer)[0]
            if stride != nbytes:
                raise Unsupported(
                    f"HostTier: layer {layer} of the KV pool (shaped {kv_pool.layer_shape(layer)}) steps "
                    f"{stride} bytes from block to block, a block holds {nbytes}: the tier copies packed blocks"
                )
        slot_bytes = sum(layer_bytes)
        total = capacity_blocks * slot_bytes
        memory = physical_memory_bytes()
        if total > memory:
            raise ConfigError(
                f"HostTier: capacity_blocks={capacity_blocks} of {slot_bytes} bytes needs {total} bytes of host "
                f"memory; this machine has {memory}"
            )
        self._device = device
        self._pool = kv_pool
        self._capacity = capacity_blocks
        self._block_size = block_size
        self._slot_bytes = slot_bytes
        offsets = [sum(layer_bytes[:layer]) for layer in range(len(layer_bytes))]
        # (base address, block bytes, offset in a slot) of each layer
        self._layers = tuple(zip(kv_pool.layer_ptrs, layer_bytes, offsets))
        self._base = device.alloc_pinned(total)
        try:
            self._memory = device.host_array(self._base, total)
        except BaseException:
            device.free_pinned(self._base)
            raise
        # Copy rows of a batch are template + slot * slot_step + block * block_step, per direction.
        self._row_templates = {to_host: self._row_template(to_host) for to_host in (True, False)}
        self._tokens = np.zeros((capacity_blocks, block_size), dtype=np.int32)
        self._keys = np.zeros((capacity_blocks, 2), dtype=np.uint64)  # each slot's key, (high, low)
        self._parents = np.zeros((capacity_blocks, 2), dtype=np.uint64)  # and its parent's
        self._index: OrderedDict[int, int] = OrderedDict()  # high word of a key -> slot, least recent first
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._counts = dict.fromkeys(
            ("lookups", "hits", "collisions", "stored", "loaded", "duplicates", "evicted", "replaced", "cleared",
             "promoted", "bytes_demoted", "bytes_promoted"), 0,
        )
        self._listeners: tuple[Callable[[list[int]], object], ...] = ()
        self._changes: list[tuple[str, list[int]]] | None = None  # since take_changes, when recorded
        self._evicted_now: list[int] = []  # hashes the running call evicted
        self._lock = threading.Lock()
        self._closed = False

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def capacity_blocks(self) -> int:
        """Slots of the tier."""
        return self._capacity

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's KV, every layer (one slot)."""
        return self._slot_bytes

    @property
    def num_blocks(self) -> int:
        """Blocks held now."""
        return len(self._index)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def __contains__(self, content_hash: object) -> bool:
        return content_hash in self._index

    def subscribe(self, listener: Callable[[list[int]], object]) -> None:
        """Call ``listener`` with the keys (high words) each :meth:`demote` stored (not those already
        held), after the copy, outside the tier's lock: ``host.subscribe(store.write_behind)``
        writes every block entering the tier behind it. A listener must not raise."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def clear(self) -> None:
        """Drop every entry (after the prefix cache was reset: what the tier holds was computed
        with what the reset discards), counted as ``cleared``. Changes recorded and not yet taken
        are dropped too, and the clear itself is not recorded: the reset's event says it."""
        with self._lock:
            self._check_open("clear")
            self._counts["cleared"] += len(self._index)
            self._index.clear()
            self._free = list(range(self._capacity - 1, -1, -1))
            if self._changes is not None:
                self._changes.clear()

    def record_changes(self, on: bool = True) -> None:
        """Keep, in the order they happen, the keys (high words) of the entries each call stores
        (:meth:`demote`, :meth:`load`) and removes (evicted for room, or replaced), for
        :meth:`take_changes` (the KV events of the host tier)."""
        with self._lock:
            self._changes = [] if on else None

    def take_changes(self) -> list[tuple[str, list[int]]]:
        """``("removed", hashes)`` and ``("stored", hashes)`` entries since the last call, oldest
        first (empty unless recorded). Within one call, what it removed comes before what it
        stored."""
        with self._lock:
            if not self._changes:
                return []
            taken, self._changes = self._changes, []
            return taken

    def _record(self, stored: list[int]) -> None:
        """(Lock held) end of a call that changed entries: record what it removed, then stored."""
        evicted, self._evicted_now = self._evicted_now, []
        if self._changes is not None:
            if evicted:
                self._changes.append(("removed", evicted))
            if stored:
                self._changes.append(("stored", stored))

    # -- argument checks ------------------------------------------------------------------------

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise TornDown(f"HostTier.{call}: the tier is closed")

    def _block_ids(self, call: str, block_ids: BlockIdsLike, count: int) -> list[int]:
        if isinstance(block_ids, list) and all(type(block) is int for block in block_ids):
            ids = block_ids
        else:
            try:
                raw: npt.NDArray[Any] | None = np.asarray(block_ids)
            except (OverflowError, ValueError, TypeError):
                raw = None
            # an int array only: a float id (1.5) is refused, not truncated to another block
            if raw is None or raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
                raise InvalidId(f"{call}: block ids must be a 1-D sequence of ints, got {block_ids!r}")
            ids = raw.tolist()  # Python ints, exact for uint64 too
        if not isinstance(ids, list) or len(ids) != count:
            raise InvalidId(f"{call}: {np.size(block_ids)} block ids for {count} keys")
        if ids:
            limit = self._pool.num_blocks
            low, high = min(ids), max(ids)
            if low < 0 or high >= limit:
                raise BlockIdOutOfRange(
                    f"{call}: block id {low if low < 0 else high} is out of range: valid values are 0..{limit - 1}"
                )
            if len(set(ids)) != count:
                repeated = next(block for position, block in enumerate(ids) if block in ids[:position])
                raise InvalidId(f"{call}: block id {repeated} is given more than once")
        return ids

    # -- copies ---------------------------------------------------------------------------------

    def _row_template(self, to_host: bool) -> tuple[npt.NDArray[np.int64], ...]:
        host_col, device_col = (0, 1) if to_host else (1, 0)
        num_layers = len(self._layers)
        base = np.zeros((num_layers, 3), dtype=np.int64)
        slot_step = np.zeros_like(base)
        block_step = np.zeros_like(base)
        for layer, (ptr, nbytes, offset) in enumerate(self._layers):
            base[layer, host_col] = self._base + offset
            base[layer, device_col] = ptr
            base[layer, 2] = nbytes
            slot_step[layer, host_col] = self._slot_bytes
            block_step[layer, device_col] = nbytes
        return base, slot_step, block_step

    def _copy_rows(self, slots: list[int], block_ids: list[int], to_host: bool) -> npt.NDArray[np.int64]:
        """(dst, src, nbytes) rows moving every layer of each block between its device block and
        its slot, block-major (a slot's layers are adjacent in host memory)."""
        count, num_layers = len(slots), len(self._layers)
        host_col, device_col = (0, 1) if to_host else (1, 0)
        if count * num_layers <= _SMALL_BATCH_ROWS:  # a few rows: plain ints beat a dozen numpy calls
            flat = [0] * (3 * count * num_layers)
            row = 0
            for slot, block in zip(slots, block_ids):
                slot_base = self._base + slot * self._slot_bytes
                for ptr, nbytes, offset in self._layers:
                    flat[row + host_col] = slot_base + offset
                    flat[row + device_col] = ptr + block * nbytes
                    flat[row + 2] = nbytes
                    row += 3
            return np.array(flat, dtype=np.int64).reshape(-1, 3)
        base, slot_step, block_step = self._row_templates[to_host]
        slot_col = np.array(slots, dtype=np.int64)[:, None, None]
        block_col = np.array(block_ids, dtype=np.int64)[:, None, None]
        rows: npt.NDArray[np.int64] = (base + slot_col * slot_step + block_col * block_step).reshape(-1, 3)
        return rows

    def _take_slots(self, count: int, stored_now: list[int] | None = None) -> list[int]:
        """``count`` free slots, evicting the least recently used entries for the missing ones.
        An entry the running call stored (``stored_now``) leaves that list instead of being
        recorded as removed: its events then never say it is held."""
        free, index = self._free, self._index
        for _ in range(count - len(free)):
            key, slot = index.popitem(last=False)
            free.append(slot)
            self._counts["evicted"] += 1
            if stored_now is not None and key in stored_now:
                stored_now.remove(key)  # a replaced entry's removal is recorded already
            else:
                self._evicted_now.append(key)
        slots = free[len(free) - count :]
        del free[len(free) - count :]
        return slots

    def _insert(self, keys: list[int], slots: list[int]) -> None:
        self._index.update(zip(keys, slots))

    def demote(
        self, hashes: KeysLike, block_ids: BlockIdsLike, tokens: TokensLike, parents: KeysLike | None = None
    ) -> int:
        """Copy the device blocks ``block_ids`` (every layer) into the tier under their keys
        ``hashes``, with their ``tokens`` (``len(hashes)`` blocks) and their ``parents``' keys
        (None: the batch is one chain after key 0); returns the blocks stored.

        One batched copy, completed on return. A key already held is not copied again but becomes
        the most recently used (also when the entry differs: :meth:`lookup` checks it); a key
        repeated in the batch counts once. Then the new blocks are stored in batch order, each
        the most recently used so far; the least recently used entries make room, and of more new
        blocks than the tier holds only the last ``capacity_blocks`` are kept. Every argument
        is checked before anything changes."""
        keys, key_rows = tier_keys("demote", hashes)
        parent_rows = self._parent_rows("demote", parents, key_rows)
        ids = self._block_ids("demote", block_ids, len(keys))
        rows = token_blocks("demote", tokens, len(keys), self._block_size)
        with self._lock:
            self._check_open("demote")
            index = self._index
            fresh: list[int] = []  # positions of the batch to store
            seen: set[int] = set()
            for position, key in enumerate(keys):
                if key in index:
                    index.move_to_end(key)
                    self._counts["duplicates"] += 1
                elif key not in seen:
                    seen.add(key)
                    fresh.append(position)
            if len(fresh) > self._capacity:
                fresh = fresh[len(fresh) - self._capacity :]
            if not fresh:
                return 0
            # Entries evicted for room leave the index before their slots are written; the small
            # writes go first, while the caches still hold what they touch.
            slots = self._take_slots(len(fresh))
            everything = len(fresh) == len(keys)
            stored = keys if everything else [keys[i] for i in fresh]
            copies = self._copy_rows(slots, ids if everything else [ids[i] for i in fresh], to_host=True)
            picked = slice(None) if everything else fresh
            self._tokens[slots] = rows[picked]
            self._keys[slots] = key_rows[picked]
            self._parents[slots] = parent_rows[picked]
            self._insert(stored, slots)
            try:
                self._device.copy_batch(copies)
                self._device.synchronize()
            except BaseException:
                for key in stored:  # the slots hold nothing usable
                    del index[key]
                self._free.extend(slots)
                self._record([])
                raise
            self._record(stored)
            self._counts["stored"] += len(fresh)
            self._counts["bytes_demoted"] += len(fresh) * self._slot_bytes
            listeners = self._listeners
        for listener in listeners:  # outside the lock: a listener may read the tier
            listener(stored)
        return len(fresh)

    def _parent_rows(
        self, call: str, parents: KeysLike | None, key_rows: npt.NDArray[np.uint64]
    ) -> npt.NDArray[np.uint64]:
        if parents is None:
            return chained_parents(key_rows, (0, 0))
        _, rows = tier_keys(call, parents, "parents")
        if len(rows) != len(key_rows):
            raise InvalidId(f"{call}: {len(rows)} parents for {len(key_rows)} keys")
        return rows

    def _verified(
        self, slots: list[int], key_rows: npt.NDArray[np.uint64], parent: tuple[int, int] | npt.NDArray[np.uint64],
        rows: npt.NDArray[np.int32],
    ) -> int:
        """(Lock held) how many of ``slots`` lead with entries holding exactly ``key_rows``, each
        after the one before it (the first after ``parent``; or each after its row of
        ``parent``, an array), and the token ``rows``."""
        found = len(slots)
        if not found:
            return 0
        wanted = key_rows[:found]
        parents = parent[:found] if isinstance(parent, np.ndarray) else chained_parents(wanted, parent)
        equal = (self._tokens[slots] == rows[:found]).all(axis=1)
        equal &= (self._keys[slots] == wanted).all(axis=1)
        equal &= (self._parents[slots] == parents).all(axis=1)
        return found if equal.all() else int(np.argmin(equal))

    def _slots_of(self, keys: list[int]) -> list[int]:
        """(Lock held) the slots of the leading run of ``keys`` the index holds."""
        slots: list[int] = []
        for key in keys:
            slot = self._index.get(key)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def lookup(self, hashes: KeysLike, tokens: TokensLike, parent: KeyLike = 0) -> int:
        """Length of the leading run of ``hashes`` held as one chain after ``parent`` with equal
        ``tokens`` (``len(hashes)`` blocks of them). Those entries become the most recently
        used, the first block most."""
        keys, key_rows = tier_keys("lookup", hashes)
        first = tier_key("lookup", parent)
        rows = token_blocks("lookup", tokens, len(keys), self._block_size)
        with self._lock:
            self._check_open("lookup")
            slots = self._slots_of(keys)
            found = self._verified(slots, key_rows, first, rows)
            if found < len(slots):
                self._counts["collisions"] += 1
            for key in reversed(keys[:found]):
                self._index.move_to_end(key)
            self._counts["lookups"] += len(keys)
            self._counts["hits"] += found
            return found

    def promote(
        self, hashes: KeysLike, block_ids: BlockIdsLike, tokens: TokensLike, parent: KeyLike = 0,
        parents: KeysLike | None = None,
    ) -> None:
        """Copy the entries ``hashes`` (every layer) into the device blocks ``block_ids``, one
        batched copy completed on return, once each entry is found to be the block asked for:
        its key, its parent's (the chain after ``parent``; or, given ``parents``, each block's
        own) and its ``tokens`` (``len(hashes)`` blocks of them). A key finds an entry, it never
        proves it. Entries stay in the tier. An absent key, or an entry that is another block,
        raises :class:`InvalidId` naming it, and nothing is copied."""
        keys, key_rows = tier_keys("promote", hashes)
        first: tuple[int, int] | npt.NDArray[np.uint64] = tier_key("promote", parent)
        if parents is not None:
            first = self._parent_rows("promote", parents, key_rows)
        ids = self._block_ids("promote", block_ids, len(keys))
        rows = token_blocks("promote", tokens, len(keys), self._block_size)
        with self._lock:
            self._check_open("promote")
            slots = self._slots_of(keys)
            if len(slots) < len(keys):
                raise InvalidId(
                    f"promote: key {keys[len(slots)]:#018x} is not in the host tier ({len(self._index)} blocks held); "
                    "promote what lookup found, before anything else is demoted"
                )
            if not slots:
                return
            verified = self._verified(slots, key_rows, first, rows)
            if verified < len(slots):
                raise InvalidId(
                    f"promote: the host tier holds key {keys[verified]:#018x} as another block than asked for "
                    "(its key, parent or tokens differ); promote only what lookup found"
                )
            copies = self._copy_rows(slots, ids, to_host=False)
            self._device.copy_batch(copies)
            self._device.synchronize()
            self._counts["promoted"] += len(slots)
            self._counts["bytes_promoted"] += len(slots) * self._slot_bytes

    # -- records (the shared store) ----------------------------------------------------------------

    def read_blocks(self, hashes: HashesLike) -> list[HeldBlock | None]:
        """A copy of each entry of ``hashes`` (high words of keys; None where absent). The
        entries' recency is unchanged."""
        keys = content_hashes("read_blocks", hashes)
        out: list[HeldBlock | None] = []
        with self._lock:
            self._check_open("read_blocks")
            for key in keys:
                slot = self._index.get(key)
                if slot is None:
                    out.append(None)
                    continue
                start = slot * self._slot_bytes
                high, low = self._keys[slot].tolist()
                parent_high, parent_low = self._parents[slot].tolist()
                out.append(HeldBlock(
                    (high, low), (parent_high, parent_low), self._tokens[slot].copy(),
                    self._memory[start : start + self._slot_bytes].tobytes(),
                ))
        return out

    def load(self, records: Sequence[BlockRecord]) -> int:
        """Put blocks read from the store into the tier, as :meth:`demote` puts device blocks
        (same recency and room rules); returns the blocks stored and still held (of more records than
        the tier holds, a later one evicts an earlier one). A record whose key's high word is held
        as another block (key, parent or tokens) takes that entry's place (the caller verified
        the record), counted as ``replaced``."""
        for index, record in enumerate(records):
            if memoryview(record.kv).nbytes != self._slot_bytes:
                raise InvalidId(
                    f"load: record {index} has {memoryview(record.kv).nbytes} KV bytes; "
                    f"a block takes {self._slot_bytes}"
                )
        keys, key_rows = tier_keys("load", np.array([r.key for r in records], dtype=np.uint64).reshape(-1, 2))
        _, parent_rows = tier_keys("load", np.array([r.parent for r in records], dtype=np.uint64).reshape(-1, 2))
        rows = token_blocks("load", [record.tokens for record in records], len(records), self._block_size)
        with self._lock:
            self._check_open("load")
            stored: list[int] = []
            for key, key_row, parent_row, row, record in zip(keys, key_rows, parent_rows, rows, records):
                slot = self._index.get(key)
                if slot is not None:
                    self._index.move_to_end(key)
                    if (
                        (self._tokens[slot] == row).all() and (self._keys[slot] == key_row).all()
                        and (self._parents[slot] == parent_row).all()
                    ):
                        self._counts["duplicates"] += 1
                        continue
                    self._counts["replaced"] += 1
                    self._evicted_now.append(key)
                else:
                    (slot,) = self._take_slots(1, stored)
                start = slot * self._slot_bytes
                self._memory[start : start + self._slot_bytes] = np.frombuffer(record.kv, dtype=np.uint8)
                self._tokens[slot] = row
                self._keys[slot] = key_row
                self._parents[slot] = parent_row
                self._index[key] = slot
                stored.append(key)
                self._counts["loaded"] += 1
            self._record(stored)
            return len(stored)

    # -- state ----------------------------------------------------------------------------------

    def stats(self) -> HostTierStats:
        """The counters now."""
        with self._lock:
            return HostTierStats(capacity_blocks=self._capacity, blocks=len(self._index), **self._counts)

    def check_invariants(self) -> None:
        """Recount the slots from scratch; :class:`InvariantViolation` names the first mismatch."""
        with self._lock:
            held = list(self._index.values())
            if len(set(held)) != len(held):
                raise InvariantViolation(f"HostTier: {len(held) - len(set(held))} slots are held by two hashes")
            overlap = set(held) & set(self._free)
            if overlap:
                raise InvariantViolation(f"HostTier: slot {min(overlap)} is both held and free")
            if len(held) + len(self._free) != self._capacity:
                raise InvariantViolation(
                    f"HostTier: {len(held)} held + {len(self._free)} free slots != capacity {self._capacity}"
                )
            stray = [slot for slot in held + self._free if not 0 <= slot < self._capacity]
            if stray:
                raise InvariantViolation(f"HostTier: slot {stray[0]} is outside 0..{self._capacity - 1}")
            added = self._counts["stored"] + self._counts["loaded"]
            dropped = self._counts["evicted"] + self._counts["replaced"] + self._counts["cleared"]
            if added - dropped != len(held):
                raise InvariantViolation(
                    f"HostTier: {added} blocks added - {dropped} evicted, replaced or cleared != {len(held)} held"
                )

    def close(self) -> None:
        """Free the host memory; a second call does nothing, any other call raises TornDown."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.clear()
            self._free.clear()
            self._memory = np.empty(0, dtype=np.uint8)
            self._device.free_pinned(self._base)

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostTier(capacity_blocks={self._capacity}, block_bytes={self._slot_bytes}, blocks={len(self._index)}, "
            f"closed={self._closed})"
        )
