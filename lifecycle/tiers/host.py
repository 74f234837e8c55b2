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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from lifecycle._evlog import RawEvents
from lifecycle._hosttier import HostIndex
from lifecycle.device.base import Device
from lifecycle.device.host import physical_memory_bytes
from lifecycle.errors import BlockIdOutOfRange, ConfigError, InvalidId, TornDown, Unsupported
from lifecycle.pools import KVPool
from lifecycle.tiers._args import (
    HashesLike, KeyLike, KeysLike, chained_parents, content_hashes, tier_key, tier_key_rows, token_blocks,
)
from lifecycle.tiers.records import BlockRecord

__all__ = ["BlockIdsLike", "HashesLike", "HeldBlock", "HostTier", "HostTierStats", "KeyLike", "KeysLike", "TokensLike"]

#: Device block ids: ints, or an integer array.
BlockIdsLike = Sequence[int] | npt.NDArray[np.integer[Any]]
#: Tokens of whole blocks: ``(n, block_size)`` or ``n * block_size`` token ids.
TokensLike = npt.ArrayLike

_WORD: Final = 1 << 64
#: Slots of one tier, at most (the index numbers them with 32-bit ints).
_MAX_SLOTS: Final = (1 << 30) - 1


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

    The index of the slots (key to slot, LRU order, free slots) and the per-block work of every
    call are ``lifecycle._hosttier.HostIndex``'s, one compiled call per batch; this class checks
    the arguments, owns the memory and makes the copies.
    """

    def __init__(self, device: Device, kv_pool: KVPool, capacity_blocks: int, block_size: int) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1:
            raise ConfigError(f"HostTier: capacity_blocks={capacity_blocks!r} must be an int >= 1")
        if block_size != kv_pool.block_size:
            raise ConfigError(f"HostTier: block_size={block_size!r} differs from the KV pool's {kv_pool.block_size}")
        if kv_pool.num_layers == 0 or kv_pool.num_blocks == 0:
            raise ConfigError("HostTier: the KV pool has no attention layer or no block: nothing to keep")
        if capacity_blocks > _MAX_SLOTS:
            raise ConfigError(
                f"HostTier: capacity_blocks={capacity_blocks} is more than the {_MAX_SLOTS} slots a tier has"
            )
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
        # (device base address, block bytes, offset in a slot) of each layer
        layers = np.array(list(zip(kv_pool.layer_ptrs, layer_bytes, offsets)), dtype=np.int64).reshape(-1, 3)
        self._base = device.alloc_pinned(total)
        try:
            self._memory = device.host_array(self._base, total)
            self._index = HostIndex(capacity_blocks, block_size, kv_pool.num_blocks, layers, self._base, slot_bytes)
        except BaseException:
            device.free_pinned(self._base)
            raise
        self._listeners: tuple[Callable[[list[int]], object], ...] = ()
        self._changes: list[tuple[str, list[int]]] | None = None  # since take_changes, when recorded
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
        return self._index.num_blocks

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def __contains__(self, content_hash: object) -> bool:
        return type(content_hash) is int and 0 <= content_hash < _WORD and self._index.contains(content_hash)

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
            self._index.clear()
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

    def _record(self, removed: npt.NDArray[np.uint64], stored: npt.NDArray[np.uint64]) -> None:
        """(Lock held) end of a call that changed entries: record what it removed, then stored."""
        if self._changes is not None:
            if len(removed):
                self._changes.append(("removed", removed.tolist()))
            if len(stored):
                self._changes.append(("stored", stored.tolist()))

    # -- argument checks ------------------------------------------------------------------------

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise TornDown(f"HostTier.{call}: the tier is closed")

    def _block_ids(self, call: str, block_ids: BlockIdsLike, count: int) -> npt.NDArray[np.int64]:
        """``block_ids`` as int64, once each is known to be a device block, given once."""
        if isinstance(block_ids, np.ndarray) and block_ids.ndim == 1 and block_ids.dtype.kind in "iu" and (
            block_ids.dtype.kind == "i" or block_ids.dtype.itemsize < 8
        ):
            ids = np.ascontiguousarray(block_ids, dtype=np.int64)
        else:
            if isinstance(block_ids, list) and all(type(block) is int for block in block_ids):
                values = block_ids
            else:
                try:
                    raw: npt.NDArray[Any] | None = np.asarray(block_ids)
                except (OverflowError, ValueError, TypeError):
                    raw = None
                # an int array only: a float id (1.5) is refused, not truncated to another block
                if raw is None or raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
                    raise InvalidId(f"{call}: block ids must be a 1-D sequence of ints, got {block_ids!r}")
                values = raw.tolist()  # Python ints, exact for uint64 too
            if values and not -_WORD < min(values) <= max(values) < _WORD:
                extreme = min(values) if min(values) < 0 else max(values)
                raise BlockIdOutOfRange(
                    f"{call}: block id {extreme} is out of range: valid values are 0..{self._pool.num_blocks - 1}"
                )
            if values and max(values) >= 1 << 63:
                raise BlockIdOutOfRange(
                    f"{call}: block id {max(values)} is out of range: valid values are 0..{self._pool.num_blocks - 1}"
                )
            ids = np.array(values, dtype=np.int64)
        if len(ids) != count:
            raise InvalidId(f"{call}: {np.size(block_ids)} block ids for {count} keys")
        self._index.check_block_ids(call, ids)
        return ids

    def _parent_rows(
        self, call: str, parents: KeysLike | None, key_rows: npt.NDArray[np.uint64]
    ) -> npt.NDArray[np.uint64]:
        if parents is None:
            return chained_parents(key_rows, (0, 0))
        rows = tier_key_rows(call, parents, "parents")
        if len(rows) != len(key_rows):
            raise InvalidId(f"{call}: {len(rows)} parents for {len(key_rows)} keys")
        return rows

    def _tokens(self, call: str, tokens: TokensLike, count: int) -> npt.NDArray[np.int32]:
        return np.ascontiguousarray(token_blocks(call, tokens, count, self._block_size))

    # -- the calls -----------------------------------------------------------------------------

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
        with self._lock:
            # Arguments in the forms the index reads directly, and valid: one compiled pass.
            fast = None if self._closed else self._index.demote_fast(hashes, block_ids, tokens, parents)
            if fast is not None:
                stored, evicted, copies = fast
                if not len(stored):
                    self._record(evicted, stored)
                    return 0
                listeners = self._write(evicted, stored, copies)
        if fast is not None:
            self._tell(listeners, stored)
            return len(stored)
        key_rows = tier_key_rows("demote", hashes)
        parent_rows = self._parent_rows("demote", parents, key_rows)
        ids = self._block_ids("demote", block_ids, len(key_rows))
        rows = self._tokens("demote", tokens, len(key_rows))
        with self._lock:
            self._check_open("demote")
            # Entries evicted for room leave the index before their slots are written.
            positions, evicted, copies = self._index.demote(key_rows, parent_rows, rows, ids)
            if not len(positions):
                self._record(evicted, positions.view(np.uint64))
                return 0
            stored = key_rows[positions, 0]
            listeners = self._write(evicted, stored, copies)
        self._tell(listeners, stored)
        return len(positions)

    def _write(self, evicted: Any, stored: Any, copies: Any) -> Any:
        """(Lock held) Copy a stored batch into its slots and record it; a failed copy forgets
        the batch (its slots hold nothing usable) and raises. Returns the listeners to tell."""
        try:
            self._device.copy_batch(copies)
            self._device.synchronize()
        except BaseException:
            self._index.forget(stored)
            self._record(evicted, stored[:0])
            raise
        self._record(evicted, stored)
        return self._listeners

    @staticmethod
    def _tell(listeners: Any, stored: Any) -> None:
        """Tell ``listeners`` the keys stored, outside the lock (a listener may read the tier)."""
        if listeners:
            stored_list: list[int] = stored.tolist()
            for listener in listeners:
                listener(stored_list)

    # -- the model's demotion (lifecycle.tiers.promote.ModelTiers) ---------------------------------

    def bind_blocks(
        self, keys: npt.NDArray[np.uint64], parents: npt.NDArray[np.uint64], hashes: npt.NDArray[np.uint64],
        valid: npt.NDArray[np.bool_], reused: npt.NDArray[np.bool_],
    ) -> None:
        """Note what each device block holds in these arrays (one row per device block: its key
        and its parent's, (n, 2) uint64; its content hash; whether it is noted, whether it was
        reused), for :meth:`note_blocks` and :meth:`demote_removed`."""
        with self._lock:
            self._index.bind_blocks(keys, parents, hashes, valid, reused)

    def note_blocks(
        self, block_ids: npt.NDArray[np.int32], keys: npt.NDArray[np.uint64], root: tuple[int, int],
        hashes: npt.NDArray[np.uint64],
    ) -> None:
        """Device blocks ``block_ids`` (int32) hold the chain of ``keys`` after ``root``, with
        content ``hashes``: noted until they leave the device cache (one compiled call)."""
        with self._lock:
            self._index.note_blocks(block_ids, keys, root[0], root[1], hashes)

    def demote_removed(self, raw: RawEvents) -> int:
        """Demote what the removals of the core's drained log ``raw`` name (their block ids and
        tokens), each block under the key noted for it (:meth:`note_blocks`) where its content
        hash is the one noted; every removed block is un-noted. As :meth:`demote` stores a batch,
        in one compiled call for the whole log; returns the blocks stored."""
        with self._lock:
            self._check_open("demote_removed")
            _, stored, evicted, copies = self._index.demote_removed(raw)
            if not len(stored):
                self._record(evicted, stored)
                return 0
            listeners = self._write(evicted, stored, copies)
        self._tell(listeners, stored)
        return len(stored)

    def lookup_rows(self, keys: npt.NDArray[np.uint64], tokens: npt.NDArray[np.int32], parent: tuple[int, int]) -> int:
        """:meth:`lookup` for the model's own arrays: ``keys`` (n, 2) uint64 rows, ``tokens`` its
        int32 token ids (checked when it admitted them), ``parent`` a (high, low) pair; only
        their shapes and types are checked."""
        rows = self._own_tokens("lookup", tokens, len(keys))
        with self._lock:
            self._check_open("lookup")
            found: int = self._index.lookup(keys, rows, parent[0], parent[1])
            return found

    def promote_rows(
        self, keys: npt.NDArray[np.uint64], block_ids: npt.NDArray[np.integer[Any]], tokens: npt.NDArray[np.int32],
        parent: tuple[int, int],
    ) -> None:
        """:meth:`promote` for the model's own arrays (as :meth:`lookup_rows` takes them); the block
        ids are checked as :meth:`promote` checks them."""
        rows = self._own_tokens("promote", tokens, len(keys))
        ids = self._block_ids("promote", block_ids, len(keys))
        with self._lock:
            self._check_open("promote")
            copies = self._index.promote(keys, rows, ids, parent[0], parent[1])
            if not len(keys):
                return
            self._device.copy_batch(copies)
            self._device.synchronize()
            self._index.promoted(len(keys))

    def _own_tokens(self, call: str, tokens: npt.NDArray[np.int32], count: int) -> npt.NDArray[np.int32]:
        if not isinstance(tokens, np.ndarray) or tokens.dtype != np.int32 or tokens.size != count * self._block_size:
            return self._tokens(call, tokens, count)  # names what is wrong
        return np.ascontiguousarray(tokens).reshape(count, self._block_size)

    def lookup(self, hashes: KeysLike, tokens: TokensLike, parent: KeyLike = 0) -> int:
        """Length of the leading run of ``hashes`` held as one chain after ``parent`` with equal
        ``tokens`` (``len(hashes)`` blocks of them). Those entries become the most recently
        used, the first block most."""
        key_rows = tier_key_rows("lookup", hashes)
        first = tier_key("lookup", parent)
        rows = self._tokens("lookup", tokens, len(key_rows))
        with self._lock:
            self._check_open("lookup")
            found: int = self._index.lookup(key_rows, rows, first[0], first[1])
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
        with self._lock:
            # Arguments in the forms the index reads directly, valid and found: one compiled pass.
            copies = None if self._closed else self._index.promote_fast(hashes, block_ids, tokens, parent, parents)
            if copies is not None:
                self._device.copy_batch(copies)
                self._device.synchronize()
                self._index.promoted(len(hashes))
                return
        key_rows = tier_key_rows("promote", hashes)
        first = tier_key("promote", parent)
        parent_rows = None if parents is None else self._parent_rows("promote", parents, key_rows)
        ids = self._block_ids("promote", block_ids, len(key_rows))
        rows = self._tokens("promote", tokens, len(key_rows))
        with self._lock:
            self._check_open("promote")
            copies = self._index.promote(key_rows, rows, ids, first[0], first[1], parent_rows)
            if not len(key_rows):
                return
            self._device.copy_batch(copies)
            self._device.synchronize()
            self._index.promoted(len(key_rows))

    # -- records (the shared store) ----------------------------------------------------------------

    def read_blocks(self, hashes: HashesLike) -> list[HeldBlock | None]:
        """A copy of each entry of ``hashes`` (high words of keys; None where absent). The
        entries' recency is unchanged."""
        keys = content_hashes("read_blocks", hashes)
        out: list[HeldBlock | None] = []
        with self._lock:
            self._check_open("read_blocks")
            slots: list[int] = self._index.find(np.array(keys, dtype=np.uint64)).tolist()
            key_array, parent_array, token_array = self._index.keys, self._index.parents, self._index.tokens
            for slot in slots:
                if slot < 0:
                    out.append(None)
                    continue
                start = slot * self._slot_bytes
                high, low = key_array[slot].tolist()
                parent_high, parent_low = parent_array[slot].tolist()
                out.append(HeldBlock(
                    (high, low), (parent_high, parent_low), token_array[slot].copy(),
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
        key_rows = tier_key_rows("load", np.array([r.key for r in records], dtype=np.uint64).reshape(-1, 2))
        parent_rows = tier_key_rows("load", np.array([r.parent for r in records], dtype=np.uint64).reshape(-1, 2))
        rows = self._tokens("load", [record.tokens for record in records], len(records))
        with self._lock:
            self._check_open("load")
            slots, positions, removed = self._index.load(key_rows, parent_rows, rows)
            for record, slot in zip(records, slots.tolist()):  # in record order: a later one may reuse a slot
                if slot >= 0:
                    start = slot * self._slot_bytes
                    self._memory[start : start + self._slot_bytes] = np.frombuffer(record.kv, dtype=np.uint8)
            self._record(removed, key_rows[positions, 0])
            return len(positions)

    # -- state ----------------------------------------------------------------------------------

    def stats(self) -> HostTierStats:
        """The counters now."""
        with self._lock:
            return HostTierStats(capacity_blocks=self._capacity, blocks=self._index.num_blocks, **self._index.counts())

    def check_invariants(self) -> None:
        """Recount the slots from scratch; :class:`InvariantViolation` names the first mismatch."""
        with self._lock:
            if not self._closed:
                self._index.check_invariants()

    def close(self) -> None:
        """Free the host memory; a second call does nothing, any other call raises TornDown."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._memory = np.empty(0, dtype=np.uint8)
            self._device.free_pinned(self._base)

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostTier(capacity_blocks={self._capacity}, block_bytes={self._slot_bytes}, "
            f"blocks={self._index.num_blocks}, closed={self._closed})"
        )
