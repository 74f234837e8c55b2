"""The core's raw event log (``KVCacheCore.take_events()``) as KV events: :func:`raw_entries` reads
it, :class:`KVEventTranslator` turns it into events, and :class:`KVEventLog` keeps one model's
stream in order (the cache keys of published blocks, the adapter generations retired)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from lifecycle._kvcache import REMOVED, STORED, KVCacheCore, RawEvents
from lifecycle.errors import ConfigError, MalformedEvent
from lifecycle.events.types import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AdapterLookup,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    RawEvent,
    SaltLookup,
)

__all__ = ["KVEventLog", "KVEventTranslator", "raw_entries"]

_UINT64_LIMIT = 1 << 64


#: vLLM's ``KVCacheSpecKind`` value of each kind of KV cache group (``KVCacheCore.groups``).
SPEC_KINDS = {"full": "full_attention", "sliding_window": "sliding_window", "chunked_local": "chunked_local_attention"}


def _group_specs(groups: Sequence[tuple[str, int, int]] | None) -> tuple[tuple[str, int | None], ...]:
    """Per group, vLLM's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` (a sliding
    window's tokens, else None) of ``KVCacheCore.groups``-shaped rules."""
    specs = []
    for index, group in enumerate(groups or ()):
        kind, window = group[0], group[1]
        if kind not in SPEC_KINDS:
            raise ConfigError(
                f"KVEventTranslator: groups[{index}] has kind {kind!r}, not one of {', '.join(SPEC_KINDS)}"
            )
        specs.append((SPEC_KINDS[kind], window if kind == "sliding_window" else None))
    return tuple(specs)


def _no_adapter(adapter_key: int) -> tuple[int, str] | None:
    return None


def _no_salt(adapter_key: int) -> bytes | str | int | None:
    return None


def _group(what: str, group: object) -> int:
    if isinstance(group, np.integer):
        group = int(group)
    if type(group) is not int or group < 0:
        raise MalformedEvent(f"{what}: KV cache group {group!r} is not an int >= 0")
    return group


def raw_entries(raw: RawEvents) -> list[RawEvent]:
    """The core's drained log as tuple entries: ``("stored", hashes, parent_hash | None, tokens,
    adapter_key)``, ``("removed", hashes)``, ``("cleared",)`` (slices of its arrays, no copy); an
    entry of a KV cache group past 0 carries its group index last."""
    entries = raw.entries
    if not len(entries):
        return []
    hashes, tokens = raw.hashes, raw.tokens
    hash_ends = np.cumsum(entries["count"], dtype=np.int64).tolist()
    token_ends = np.cumsum(entries["num_tokens"], dtype=np.int64).tolist()
    out: list[RawEvent] = []
    h = t = 0
    for row, h_end, t_end in zip(entries.tolist(), hash_ends, token_ends):
        adapter, parent, _, _, kind, has_parent, _, group = row
        tail = (group,) if group else ()
        if kind == STORED:
            out.append(("stored", hashes[h:h_end], parent if has_parent else None, tokens[t:t_end], adapter, *tail))
        elif kind == REMOVED:
            out.append(("removed", hashes[h:h_end], *tail))
        else:
            out.append(("cleared",))
        h, t = h_end, t_end
    return out


def _hashes(what: str, values: object) -> tuple[int, ...]:
    """Content hashes as Python ints in ``[0, 2**64)``, from a uint64 array or any int sequence."""
    if isinstance(values, np.ndarray) and values.dtype == np.uint64:
        hashes: list[int] = values.ravel().tolist()
        return tuple(hashes)
    if not isinstance(values, Sequence) and not isinstance(values, np.ndarray):
        raise MalformedEvent(f"{what}: hashes must be a uint64 array or a sequence of ints, got {values!r}")
    checked = []
    for value in values:
        number = int(value) if isinstance(value, np.integer) else value
        if type(number) is not int or not 0 <= number < _UINT64_LIMIT:
            raise MalformedEvent(f"{what}: hash {value!r} is not an int in [0, 2**64)")
        checked.append(number)
    return tuple(checked)


def _tokens(what: str, values: object) -> tuple[int, ...]:
    try:
        tokens: list[int] = np.asarray(values, dtype=np.int64).ravel().tolist()
    except (TypeError, ValueError, OverflowError):
        raise MalformedEvent(f"{what}: tokens must be an int32 array or a sequence of ints, got {values!r}") from None
    return tuple(tokens)


class KVEventTranslator:
    """Turns the core's raw event log into batches (:class:`KVEventBatch`).

    ``block_size`` is the model's; ``adapter_of`` maps a non-zero adapter key to ``(lora_id,
    lora_name)`` (key 0 is "no adapter" and is never looked up) and ``salt_of`` to the cache salt
    it was salted with (vLLM puts a request's ``cache_salt`` in the ``extra_keys`` of its first
    block, and so does this translator, for a store that starts a sequence); ``medium`` is the tier
    the core's blocks live in (:data:`MEDIUM_GPU`: the KV pool); ``clock`` stamps each batch.
    ``groups``: the core's KV cache groups (``KVCacheCore.groups``): on a core of several groups
    every event names its group (``group_idx``, group 0 included) and a ``BlockStored`` its
    group's spec as vLLM does (``kv_cache_spec_kind``, and ``kv_cache_spec_sliding_window`` for a
    sliding window); a one-group core's events carry no group, as before; an entry of a group the
    core does not have is malformed.
    """

    __slots__ = ("_adapter_of", "_block_size", "_clock", "_groups", "_medium", "_salt_of")

    def __init__(
        self,
        block_size: int,
        *,
        adapter_of: AdapterLookup | None = None,
        salt_of: SaltLookup | None = None,
        medium: str | None = MEDIUM_GPU,
        clock: Callable[[], float] = time.time,
        groups: Sequence[tuple[str, int, int]] | None = None,
    ) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ConfigError(f"KVEventTranslator: block_size={block_size!r} must be an int >= 1")
        self._groups = _group_specs(groups)
        self._block_size = block_size
        self._adapter_of = adapter_of or _no_adapter
        self._salt_of = salt_of or _no_salt
        self._medium = medium
        self._clock = clock

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def medium(self) -> str | None:
        """The tier named in every event."""
        return self._medium

    def events(self, raw_log: Iterable[RawEvent] | RawEvents) -> list[KVEvent]:
        """The events of ``raw_log`` (the core's :class:`~lifecycle._kvcache.RawEvents`, or
        entries as tuples), one per entry, in its order. A malformed entry raises
        :class:`~lifecycle.errors.MalformedEvent` naming it, and nothing is returned."""
        if isinstance(raw_log, RawEvents):
            raw_log = raw_entries(raw_log)
        return [self._event(index, entry) for index, entry in enumerate(raw_log)]

    def stored(
        self, block_hashes: object, parent_block_hash: int | None, token_ids: object, adapter_key: int = 0
    ) -> BlockStored:
        """The ``BlockStored`` of blocks ``block_hashes`` holding ``token_ids`` (a chain: each
        block's parent is the one before it, the first's ``parent_block_hash``, None at the start
        of a sequence), computed under cache key ``adapter_key``, in this translator's tier. A
        malformed argument raises :class:`~lifecycle.errors.MalformedEvent`."""
        stored = self._stored("stored", block_hashes, parent_block_hash, token_ids, adapter_key)
        return self._named(stored, 0) if len(self._groups) > 1 else stored

    def _named(self, stored: BlockStored, group: int) -> BlockStored:
        """``stored`` as group ``group``'s, naming the group's spec where the groups are known."""
        if not self._groups:
            return dataclasses.replace(stored, group_idx=group)
        spec_kind, window = self._groups[group]
        return dataclasses.replace(
            stored, group_idx=group, kv_cache_spec_kind=spec_kind, kv_cache_spec_sliding_window=window
        )

    def _stored(
        self, what: str, raw_hashes: object, parent: object, raw_tokens: object, adapter_key: object
    ) -> BlockStored:
        hashes = _hashes(what, raw_hashes)
        tokens = _tokens(what, raw_tokens)
        if len(tokens) != len(hashes) * self._block_size:
            raise MalformedEvent(
                f"{what}: {len(tokens)} tokens for {len(hashes)} blocks of {self._block_size}; "
                f"expected {len(hashes) * self._block_size}"
            )
        parent_hash = None if parent is None else _hashes(what, (parent,))[0]
        if isinstance(adapter_key, np.integer):
            adapter_key = int(adapter_key)
        if type(adapter_key) is not int:
            raise MalformedEvent(f"{what}: adapter key {adapter_key!r} is not an int")
        adapter = self._adapter_of(adapter_key) if adapter_key else None
        lora_id, lora_name = adapter if adapter is not None else (None, None)
        salt = self._salt_of(adapter_key) if adapter_key and parent_hash is None and hashes else None
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent_hash,
            token_ids=tokens,
            block_size=self._block_size,
            lora_id=lora_id,
            medium=self._medium,
            lora_name=lora_name,
            extra_keys=None if salt is None else ((salt,), *(None,) * (len(hashes) - 1)),
        )

    def batch(self, raw_log: Iterable[RawEvent], *, data_parallel_rank: int | None = None) -> KVEventBatch:
        """The events of ``raw_log`` as one batch stamped now (possibly with no events)."""
        events = tuple(self.events(raw_log))
        return KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=data_parallel_rank)

    def _event(self, index: int, entry: RawEvent) -> KVEvent:
        kind = entry[0] if isinstance(entry, tuple) and entry else None
        what = f"raw event {index} ({kind!r})"
        if kind == "stored" and len(entry) in (5, 6):
            stored = self._stored(what, entry[1], entry[2], entry[3], entry[4])
            if len(entry) == 5 and len(self._groups) < 2:
                return stored
            return self._named(stored, self._group(what, entry[5]) if len(entry) == 6 else 0)
        if kind == "removed" and len(entry) in (2, 3):
            removed_group = self._group(what, entry[2]) if len(entry) == 3 else (0 if len(self._groups) > 1 else None)
            return BlockRemoved(block_hashes=_hashes(what, entry[1]), medium=self._medium, group_idx=removed_group)
        if kind == "cleared" and len(entry) == 1:
            return AllBlocksCleared()
        raise MalformedEvent(
            f"raw event {index} is {entry!r}; expected ('stored', hashes, parent_hash, tokens, adapter_key[, group]), "
            "('removed', hashes[, group]) or ('cleared',)"
        )

    def _group(self, what: str, group: object) -> int:
        """A raw entry's group index: an int >= 0, and one of the core's groups when they are known."""
        index = _group(what, group)
        if self._groups and index >= len(self._groups):
            raise MalformedEvent(f"{what}: KV cache group {index} does not exist; the core has {len(self._groups)}")
        return index

    def __repr__(self) -> str:
        return f"KVEventTranslator(block_size={self._block_size}, medium={self._medium!r})"


class KVEventLog:
    """One model's KV events since the last :meth:`take`, in the order they happened: the core's
    (the KV pool's, :data:`MEDIUM_GPU`) read straight from its log, and a tier's (:data:`MEDIUM_CPU`)
    as the tier reports them. It remembers the cache key of each block published under a key other
    than 0 (an adapter's or a salt's), per tier: what a demoted block's store event names, and what
    a retired adapter generation's removals are recognised by. ``groups``: the core's KV cache
    groups, as :class:`KVEventTranslator` takes them for the pool's events."""

    __slots__ = ("_events", "_group0", "_keys", "_retired", "_translators")

    def __init__(
        self, block_size: int, *, adapter_of: AdapterLookup | None = None, salt_of: SaltLookup | None = None,
        groups: Sequence[tuple[str, int, int]] | None = None,
    ) -> None:
        self._translators = {
            medium: KVEventTranslator(
                block_size, adapter_of=adapter_of, salt_of=salt_of, medium=medium,
                groups=groups if medium == MEDIUM_GPU else None,  # the tiers hold group 0's blocks only
            )
            for medium in (MEDIUM_GPU, MEDIUM_CPU)
        }
        self._events: list[KVEvent] = []
        # The group index a removal of group 0's blocks carries: 0 on a core of several groups.
        self._group0: dict[str, int | None] = {
            MEDIUM_GPU: 0 if groups is not None and len(groups) > 1 else None, MEDIUM_CPU: None,
        }
        self._keys: dict[str, dict[int, int]] = {MEDIUM_GPU: {}, MEDIUM_CPU: {}}
        self._retired: set[int] = set()  # cache keys of adapter generations that were reloaded

    def read(self, core: KVCacheCore) -> None:
        """Take the core's pending log into this one (a model without tiers)."""
        if core.pending_events:
            self.device(core.take_events())

    def device(self, raw: RawEvents, leaving: dict[int, int] | None = None) -> None:
        """The core's drained log ``raw`` into this one; ``leaving`` gets the key of each block
        removed, where not 0."""
        for entry in raw_entries(raw):
            if entry[0] in ("stored", "removed") and len(entry) in (6, 3):
                # A KV cache group past 0: its blocks are group 0's positions again, not new keys.
                self._events.append(self._translators[MEDIUM_GPU].events([entry])[0])
            elif entry[0] == "stored":
                _, hashes, parent, tokens, key = entry
                self.stored(MEDIUM_GPU, hashes, parent, tokens, key)
            elif entry[0] == "removed":
                self.removed(MEDIUM_GPU, entry[1].tolist(), leaving)
            else:
                for known in self._keys.values():
                    known.clear()
                self._events.append(AllBlocksCleared())

    def stored(self, medium: str, hashes: object, parent: int | None, tokens: object, key: int) -> None:
        """Blocks ``hashes`` (a chain after ``parent``) holding ``tokens`` entered ``medium`` under
        cache key ``key``: a ``BlockStored``, but none for a retired generation's blocks."""
        if key:
            listed = hashes.tolist() if isinstance(hashes, np.ndarray) else hashes
            assert isinstance(listed, list)
            self._keys[medium].update(dict.fromkeys(listed, key))
            if key in self._retired:
                return
        self._events.append(self._translators[medium].stored(hashes, parent, tokens, key))

    def removed(self, medium: str, hashes: list[int], leaving: dict[int, int] | None = None) -> None:
        """Blocks left ``medium``: a removal, but none for a retired generation's blocks (their
        removal was published when the generation was retired). ``leaving`` gets their keys."""
        keys = self._keys[medium]
        if keys:
            shown = []
            for content_hash in hashes:
                key = keys.pop(content_hash, 0)
                if key and leaving is not None:
                    leaving[content_hash] = key
                if key not in self._retired:
                    shown.append(content_hash)
            hashes = shown
        if hashes:
            self._events.append(
                BlockRemoved(block_hashes=tuple(hashes), medium=medium, group_idx=self._group0[medium])
            )

    def retire(self, keys: set[int]) -> None:
        """Cache keys ``keys`` can no longer be matched (an adapter was reloaded as a new
        generation): every block published under them is published as removed now, from every
        tier, and nothing of theirs is published after (their blocks age out unseen). A router
        that names blocks by adapter name and tokens would otherwise count the old generation's
        blocks as the new one's. Read the core's log first: what it holds came before."""
        self._retired |= keys
        for medium, known in self._keys.items():
            gone = [content_hash for content_hash, key in known.items() if key in keys]
            if gone:
                self._events.append(
                    BlockRemoved(block_hashes=tuple(gone), medium=medium, group_idx=self._group0[medium])
                )

    def take(self, data_parallel_rank: int | None = None) -> KVEventBatch:
        """Every event since the last call, every tier's, in the order they happened."""
        events, self._events = self._events, []
        return KVEventBatch(ts=time.time(), events=tuple(events), data_parallel_rank=data_parallel_rank)
