"""LoRA adapter slots with reference counts.

An engine loads an adapter into one of ``num_adapter_slots`` slots; every sequence served with it
holds a reference on that slot index. Reloading an adapter gives it a new *generation* (and a new
prefix-cache root, so KV computed with the old weights never matches again); references taken on the
old generation keep pointing at the slot index they acquired, and that slot is only reused once they
are all released.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, final

from lifecycle.errors import (
    AdapterError,
    InvalidId,
    InvariantViolation,
    OutOfSlots,
    SequenceStateError,
    SlotOutOfRange,
)

if TYPE_CHECKING:
    from lifecycle._kvcache import KVCacheCore, SequenceState

_NO_ADAPTER: Final = -1  # lifecycle.sequence.NO_ADAPTER (that module loads the compiled core)
_ACTIVE: Final = 1


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What occupies one adapter slot. ``uid`` keys the adapter's prefix-cache root: a hash of its
    name and generation (:func:`adapter_key`), the same in every process that loads the adapter the
    same number of times, so engines sharing a store share its blocks too."""

    slot: int
    name: str
    generation: int
    uid: int
    refcount: int
    loaded: bool


def adapter_key(name: str, generation: int) -> int:
    """The prefix-cache key of generation ``generation`` of adapter ``name``: 63 bits of BLAKE2b
    over both, never 0 (the key of requests without an adapter)."""
    digest = hashlib.blake2b(f"{name}\0{generation}".encode(), digest_size=8, person=b"lc-adapter").digest()
    return (int.from_bytes(digest, "little") & (2**63 - 1)) or 1


@final
class AdapterTable:
    """Slots, names, generations and refcounts of the loaded LoRA adapters. Not thread-safe on its
    own: the model calls it under its lock."""

    __slots__ = ("_names", "_generations", "_uids", "_refcounts", "_loaded", "_by_name", "_gen_of", "_named")

    def __init__(self, num_slots: int) -> None:
        self._names: list[str | None] = [None] * num_slots
        self._generations = [0] * num_slots
        self._uids = [0] * num_slots
        self._refcounts = [0] * num_slots
        self._loaded = [False] * num_slots
        self._by_name: dict[str, int] = {}
        self._gen_of: dict[str, int] = {}
        self._named: dict[int, tuple[str, int]] = {}  # every key handed out: (name, generation)

    @property
    def num_slots(self) -> int:
        return len(self._names)

    def load(self, name: str) -> int:
        """Load (or reload) ``name`` into a free slot and return the slot. A reload retires the
        old generation's slot: it stays reserved until its last reference is released."""
        if not name:
            raise AdapterError("adapter name must be a non-empty string")
        old = self._by_name.get(name)
        free = next((i for i, n in enumerate(self._names) if n is None), None)
        if free is None and old is not None and self._refcounts[old] == 0:
            free = old  # reloading in place: nobody references the old generation
        if free is None:
            raise OutOfSlots(f"no free adapter slot for {name!r}: all {self.num_slots} slots are in use")
        if old is not None:
            del self._by_name[name]
            self._loaded[old] = False
            self._reap(old)
        generation = self._gen_of.get(name, 0) + 1
        self._gen_of[name] = generation
        self._names[free] = name
        self._generations[free] = generation
        self._uids[free] = adapter_key(name, generation)
        self._named[self._uids[free]] = (name, generation)
        self._loaded[free] = True
        self._by_name[name] = free
        return free

    def unload(self, name: str) -> None:
        """Unload ``name``; its slot is reused once no sequence references it."""
        slot = self._by_name.pop(name, None)
        if slot is None:
            raise AdapterError(f"adapter {name!r} is not loaded (loaded: {sorted(self._by_name)})")
        self._loaded[slot] = False
        self._reap(slot)

    def slot_of(self, name: str) -> int:
        slot = self._by_name.get(name)
        if slot is None:
            raise AdapterError(f"adapter {name!r} is not loaded (loaded: {sorted(self._by_name)})")
        return slot

    def uid_of_loaded(self, slot: int) -> int:
        """The prefix-cache root key of the adapter currently loaded in ``slot``."""
        self._check_range(slot)
        if not self._loaded[slot]:
            raise AdapterError(f"adapter slot {slot} holds no loaded adapter")
        return self._uids[slot]

    def acquire(self, slot: int) -> int:
        """Take a reference on the adapter loaded in ``slot``; returns its uid (to release by)."""
        uid = self.uid_of_loaded(slot)
        self._refcounts[slot] += 1
        return uid

    def release(self, slot: int, uid: int) -> None:
        """Release one reference on ``slot``, which must still hold generation ``uid``."""
        self._check_range(slot)
        if self._uids[slot] != uid or self._refcounts[slot] <= 0:
            raise AdapterError(
                f"adapter slot {slot} has no reference for uid {uid} "
                f"(slot holds uid {self._uids[slot]} with {self._refcounts[slot]} references)"
            )
        self._refcounts[slot] -= 1
        self._reap(slot)

    def release_ref(self, slot: int) -> None:
        """Release one reference on ``slot`` by its index alone. A slot is never reloaded while it
        is referenced, so the reference is on the generation that was acquired."""
        self._check_range(slot)
        self.release(slot, self._uids[slot])

    def info(self, slot: int) -> AdapterInfo:
        self._check_range(slot)
        return AdapterInfo(
            slot=slot,
            name=self._names[slot] or "",
            generation=self._generations[slot],
            uid=self._uids[slot],
            refcount=self._refcounts[slot],
            loaded=self._loaded[slot],
        )

    def named(self, uid: int) -> tuple[str, int] | None:
        """``(name, generation)`` of a key this table handed out (also after unloading), else
        None."""
        return self._named.get(uid)

    def refcounts(self) -> list[int]:
        return list(self._refcounts)

    def _reap(self, slot: int) -> None:
        if not self._loaded[slot] and self._refcounts[slot] == 0:
            self._names[slot] = None
            self._uids[slot] = 0

    def _check_range(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise SlotOutOfRange(f"adapter slot {slot} out of range [0, {self.num_slots})")


@final
class AdapterBindings:
    """One model's adapter ``table`` bound to the records of its ``core``: a bound sequence holds
    one reference on its slot index, released with its record; the cache key a lookup under a
    slot uses; what KV events name. Called under the model's lock."""

    __slots__ = ("_core", "_table")

    def __init__(self, table: AdapterTable, core: KVCacheCore) -> None:
        self._table = table
        self._core = core

    def root_of(self, adapter_slot: int) -> int:
        """The cache key of requests served with ``adapter_slot`` (0 for ``NO_ADAPTER``)."""
        if isinstance(adapter_slot, bool) or not isinstance(adapter_slot, int):
            raise InvalidId(f"adapter_slot={adapter_slot!r} must be an int (NO_ADAPTER = -1 for none)")
        return 0 if adapter_slot == _NO_ADAPTER else self._table.uid_of_loaded(adapter_slot)

    def load(self, name: str) -> tuple[int, frozenset[int]]:
        """Load (or reload) ``name``; returns its slot and, for a reload, the cache keys of the
        previous generation (its own and those salted from it), which no request matches again."""
        slot = self._table.load(name)
        generation = self._table.info(slot).generation
        if generation == 1:
            return slot, frozenset()
        old = adapter_key(name, generation - 1)
        return slot, self._core.salts.derived(old) | {old}

    def bind(self, seq: SequenceState, handle: int, adapter_slot: int) -> None:
        """Take one reference on ``adapter_slot`` for the active sequence ``seq`` (``handle``)."""
        if not seq.is_open or self._core.status(handle) != _ACTIVE:
            raise SequenceStateError(f"bind_adapter: sequence {seq.seq_id} is {seq.status.value}, not active")
        uid = self._table.acquire(adapter_slot)
        try:
            self._core.bind_adapter(handle, adapter_slot, uid)
        except BaseException:
            self._table.release_ref(adapter_slot)
            raise

    def adapter_of(self, key: int) -> tuple[int, str] | None:
        """``(lora_id, lora_name)`` of a cache key, for KV events: the adapter's key and name."""
        base = self._core.salts.base_of(key)
        named = self._table.named(base)
        return None if named is None else (base, named[0])

    def check_invariants(self) -> None:
        """Each slot's reference count is the number of records bound to it."""
        held = [0] * self._table.num_slots
        for slot in self._core.adapter_slots().tolist():
            held[slot] += 1
        if held != self._table.refcounts():
            raise InvariantViolation(f"adapter refcounts {self._table.refcounts()} but sequences hold {held}")
