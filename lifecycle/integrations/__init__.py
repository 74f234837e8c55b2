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
    KV. ``None`` is key 0; every other namespace gets the next int, kept for the cache's life."""

    __slots__ = ("_keys", "_namespaces")

    def __init__(self) -> None:
        self._keys: dict[Namespace, int] = {}
        self._namespaces: list[Namespace | None] = [None]

    def key(self, namespace: Namespace | None) -> int:
        """The adapter key of ``namespace`` (0 for None)."""
        if namespace is None:
            return 0
        key = self._keys.get(namespace)
        if key is None:
            key = self._keys[namespace] = len(self._namespaces)
            self._namespaces.append(namespace)
        return key

    def namespace(self, key: int) -> Namespace | None:
        """The namespace that ``key`` was given to."""
        return self._namespaces[key]

    def __len__(self) -> int:
        return len(self._namespaces)


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
