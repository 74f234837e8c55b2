"""Drop-in adapters: lifecycle's KV cache core behind the interfaces SGLang and vLLM call.

- :mod:`lifecycle.integrations.sglang`: a prefix cache with SGLang's ``BasePrefixCache`` interface
  (``LifecycleRadixCache``) and a paged KV-index allocator (``LifecyclePagedAllocator``), each a
  subclass of SGLang's own base class.
- :mod:`lifecycle.integrations.vllm`: ``LifecycleKVCacheManager``, shaped like vLLM v1's
  ``KVCacheManager``.

Importing this package or either module loads neither engine nor torch. A class that derives from
an engine's base class is built the first time it is asked for (which needs the ``sglang`` extra);
the vLLM facade loads vLLM only for the calls that return vLLM's own types (statistics, events).
:doc:`integrations` says which of the engines' own tests pass against the adapters.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Hashable
from types import ModuleType
from typing import Generic, TypeVar

from lifecycle._kvcache import CLEARED, REMOVED, STORED, RawEvents
from lifecycle.errors import MalformedEvent
from lifecycle.events import RawEvent

__all__ = ["CacheNamespaces", "import_engine", "raw_event_log"]

Namespace = TypeVar("Namespace", bound=Hashable)


def import_engine(name: str, extra: str) -> ModuleType:
    """``import name``, or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        hint = f"pip install 'kv-lifecycle[{extra}]'"
        raise ImportError(f"lifecycle.integrations needs {name} for this: {hint}") from error


class CacheNamespaces(Generic[Namespace]):
    """Cache namespaces (a LoRA adapter, a cache salt, an engine's extra key) as the core's adapter
    keys: each distinct namespace gets its own trie root, so requests of two namespaces never share
    KV. ``None`` is key 0; any other namespace's key is 63 bits of BLAKE2b over its ``repr`` (never
    0), the same in every process, so content hashes and KV events agree across engines. The
    table remembers the latest ``capacity`` namespaces (for :meth:`namespace`, and to skip the
    hash), so per-user salts do not grow it without bound."""

    __slots__ = ("_keys", "_namespaces", "_capacity")

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._keys: dict[Namespace, int] = {}
        self._namespaces: dict[int, Namespace] = {}
        self._capacity = capacity

    def key(self, namespace: Namespace | None) -> int:
        """The adapter key of ``namespace`` (0 for None)."""
        if namespace is None:
            return 0
        key = self._keys.get(namespace)
        if key is None:
            digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8, person=b"lc-namespace").digest()
            key = (int.from_bytes(digest, "little") & (2**63 - 1)) or 1
            if len(self._keys) >= self._capacity:
                oldest = next(iter(self._keys))
                self._namespaces.pop(self._keys.pop(oldest), None)
            self._keys[namespace] = key
            self._namespaces[key] = namespace
        return key

    def namespace(self, key: int) -> Namespace | None:
        """The namespace that ``key`` stands for; None for key 0 and for one forgotten since."""
        return self._namespaces.get(key)

    def __len__(self) -> int:
        """Namespaces remembered, ``None``'s included."""
        return len(self._keys) + 1


def raw_event_log(raw: RawEvents) -> list[RawEvent]:
    """A drained core log (``KVCacheCore.take_events()``) as the entries
    :class:`lifecycle.events.KVEventTranslator` reads, oldest first."""
    hashes = raw.hashes
    tokens = raw.tokens
    log: list[RawEvent] = []
    h = t = 0
    for row in raw.entries.tolist():
        adapter, parent, count, num_tokens, kind, has_parent = row[:6]
        if kind == STORED:
            parent_hash = parent if has_parent else None
            log.append(("stored", hashes[h : h + count], parent_hash, tokens[t : t + num_tokens], adapter))
        elif kind == REMOVED:
            log.append(("removed", hashes[h : h + count]))
        elif kind == CLEARED:
            log.append(("cleared",))
        else:
            raise MalformedEvent(f"raw event {len(log)} has kind {kind}; expected {STORED}, {REMOVED} or {CLEARED}")
        h += count
        t += num_tokens
    return log
