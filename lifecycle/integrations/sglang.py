"""SGLang's prefix cache and KV-index allocator, backed by lifecycle.

Two classes a scheduler takes in place of SGLang's own, each derived from SGLang's base class (so
every default the scheduler calls is there), built the first time they are asked for (the
``sglang`` extra; importing this module loads neither SGLang nor torch):

- ``LifecycleRadixCache(params: CacheInitParams)``: in place of ``RadixCache``. ``match_prefix``,
  ``insert``, ``evict``, ``inc_lock_ref`` / ``dec_lock_ref`` (and the base class's ``lock`` /
  ``unlock``), ``path_device_indices``, ``checkpoint`` (what SGLang calls where it used to call
  ``cache_unfinished_req`` / ``cache_finished_req``; ``release_kv_cache`` then frees the row),
  ``evictable_size`` / ``protected_size`` / ``total_size``, ``reset``, ``take_events``.
- ``LifecyclePagedAllocator(size, page_size, dtype, device, kvcache, need_sort)``: in place of
  ``PagedTokenToKVPoolAllocator`` (and of ``TokenToKVPoolAllocator`` with ``page_size=1``): pages
  from a lifecycle ``BlockPool`` (page 0 kept for padding, as SGLang does); a page freed twice
  raises ``DoubleFree`` instead of entering the free list twice.

Who owns KV indices (as in SGLang): the allocator owns the free ones; the indices a request was
given are its own until ``insert`` / ``checkpoint`` hands them to the cache, which owns them until
it evicts them and frees them to the allocator; ``insert`` reports how much of the key was cached
already, and the caller frees its duplicates. Either cache works with either allocator.

Inside the cache, the prefix tree is a :class:`PageTree`: lifecycle's KV cache core over *tree
slots*, one per cached page, whose block ids index a table of the engine's KV indices. The core
matches keys by their tokens (whole pages, exact compare), keeps the LRU order, pins locked paths
and logs KV events; a lock is a core record holding the path. The slots are the core's own ids
rather than SGLang's page ids because the core hands out block ids itself: it has no call that
caches blocks an engine allocated elsewhere.

By design (refused with ``Unsupported`` at construction): EAGLE bigram keys, eviction policies
other than LRU, sliding-window and hybrid (Mamba, SWA) trees. Hierarchical caching is SGLang's
``HiRadixCache``, not provided.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Final, final

import numpy as np
import numpy.typing as npt

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore, RawEvents
from lifecycle.errors import (
    ConfigError,
    InvalidId,
    InvariantViolation,
    LifecycleError,
    SequenceStateError,
    Unsupported,
)
from lifecycle.integrations import CacheNamespaces, import_engine, raw_event_log

__all__ = ["PageNode", "PageTree", "allocator_class", "radix_cache_class"]

_EXTRA: Final = "sglang"
#: Tree slots when neither the allocator nor the caller says how many pages there are.
DEFAULT_MAX_PAGES: Final = 1 << 16
_TOKEN_MAX: Final = (1 << 31) - 1

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]


@final
class PageNode:
    """The end of a cached path: what ``match_prefix`` and ``insert`` return as a node. ``tokens``
    is the path's key (whole pages) and one token more (the core never reuses a key's last token);
    ``slots`` the tree slots of its pages. Nodes are views: two matches of one path give two
    nodes, and locks count per path, whichever node took them."""

    __slots__ = ("generation", "namespace", "tokens", "slots", "num_pages")

    def __init__(self, generation: int, namespace: int, tokens: Int32Array, slots: Int32Array) -> None:
        self.generation = generation
        self.namespace = namespace
        self.tokens = tokens
        self.slots = slots
        self.num_pages = len(slots)

    @property
    def evicted(self) -> bool:
        """Always False: a node is a view of the path when it was returned (see :meth:`PageTree.lock`)."""
        return False

    def __repr__(self) -> str:
        return f"PageNode(pages={self.num_pages}, namespace={self.namespace})"


class PageTree:
    """A prefix tree of KV indices in whole pages over lifecycle's core: ``insert`` stores the
    engine's indices under a key, ``match`` finds the longest stored prefix of a key, ``lock``
    keeps a path from eviction, ``evict`` drops least recently used unlocked pages and hands their
    indices to ``on_evict`` (also called when an ``insert`` into a full tree evicts).

    ``num_pages`` tree slots (at most that many pages are cached), ``page_size`` tokens a page;
    ``events``: log KV events for :meth:`take_events`. Keys come from :meth:`key`; namespaces are
    ints from a :class:`CacheNamespaces`.

    A match holds its path with a core record (a *probe*) until the next call: the lock that
    usually follows takes the probe over instead of walking the path again; any other call first
    drops it, so the path is as evictable as if the match had held nothing.
    """

    __slots__ = ("_page_size", "_num_pages", "_events", "_on_evict", "_core", "_values", "_in_tree", "_locks",
                 "_generation", "_pending", "_probe", "_probe_node", "_probe_delta", "root")

    def __init__(
        self, num_pages: int, page_size: int, *, events: bool = False,
        on_evict: Callable[[Int64Array], None] | None = None,
    ) -> None:
        if type(num_pages) is not int or num_pages < 1:
            raise ConfigError(f"PageTree: num_pages={num_pages!r} must be an int >= 1")
        if type(page_size) is not int or not 1 <= page_size <= 1 << 16:
            raise ConfigError(f"PageTree: page_size={page_size!r} must be an int in [1, 65536]")
        self._page_size = page_size
        self._num_pages = num_pages
        self._events = bool(events)
        self._on_evict = on_evict
        self._values: Int64Array = np.zeros((num_pages, page_size), dtype=np.int64)
        self._in_tree = np.zeros(num_pages, dtype=np.bool_)
        self._generation = 0
        self._core = KVCacheCore(BlockPool(num_pages), page_size, events=self._events)
        self._locks: dict[int, list[int]] = {}
        self._pending: list[RawEvents] = []
        self._probe = -1
        self._probe_node: PageNode | None = None
        self._probe_delta = 0
        self.root = PageNode(0, 0, np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.int32))

    @property
    def core(self) -> KVCacheCore:
        """The KV cache core (for inspection and ``check_invariants``)."""
        self._settle()
        return self._core

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    # -- sizes, in pages --------------------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        return self._core.num_cached_blocks

    @property
    def evictable_pages(self) -> int:
        """Cached pages no lock holds (eviction may drop them)."""
        self._settle()
        return self._core.num_evictable_blocks

    @property
    def protected_pages(self) -> int:
        """Cached pages on a locked path."""
        self._settle()
        return self._core.num_cached_blocks - self._core.num_evictable_blocks

    @property
    def num_locks(self) -> int:
        return sum(len(handles) for handles in self._locks.values())

    # -- keys -------------------------------------------------------------------------------------

    def key(self, tokens: npt.NDArray[np.integer[Any]], length: int) -> tuple[Int32Array, int]:
        """The key of the first ``length`` of ``tokens`` (whole pages) as the core reads it, and
        its page count: whole pages of int32 token ids and one token more (the core never reuses
        a key's last token), a view of an int32 ``tokens`` long enough, else a copy. A token id
        outside ``[0, 2**31)`` raises ``InvalidId``."""
        pages = length // self._page_size
        aligned = pages * self._page_size
        if tokens.dtype == np.int32 and len(tokens) > aligned:
            return tokens[: aligned + 1], pages  # type: ignore[return-value]
        key = np.empty(aligned + 1, dtype=np.int32)
        key[aligned] = 0
        if aligned:
            head = tokens[:aligned]
            if head.dtype.itemsize > 4 and int(head.max()) > _TOKEN_MAX:
                raise InvalidId(f"token id {int(head.max())} is outside [0, {_TOKEN_MAX}]")
            key[:aligned] = head  # a negative id is refused by the core
        return key, pages

    # -- the calls --------------------------------------------------------------------------------

    def match(self, key: Int32Array, pages: int, namespace: int) -> PageNode:
        """The node ending the longest cached prefix of ``key`` (at most ``pages`` pages), made
        the most recently used; the root when nothing matches."""
        if self._probe >= 0:
            self._settle()
        if pages <= 0:
            return self.root
        core = self._core
        evictable = core.num_evictable_blocks
        handle = core.admit(key, 0, pages, namespace)
        matched = core.num_blocks(handle)
        if not matched:
            core.finish(handle, False)
            return self.root
        node = PageNode(self._generation, namespace, key[: matched * self._page_size + 1], core.block_table(handle))
        self._probe, self._probe_node, self._probe_delta = handle, node, evictable - core.num_evictable_blocks
        return node

    def insert(self, key: Int32Array, pages: int, values: Int64Array, namespace: int) -> tuple[int, PageNode]:
        """Store ``values`` (``pages * page_size`` KV indices) under ``key``; returns the pages
        that were cached already (the caller's duplicates there stay the caller's) and the node
        ending the key. The tree owns the new pages' indices from here on."""
        if self._probe >= 0:
            self._settle()
        if pages <= 0:
            return 0, self.root
        ps = self._page_size
        if len(values) < pages * ps:
            raise InvalidId(f"insert: {len(values)} KV indices for a key of {pages} pages of {ps}")
        core = self._core
        if core.pool.num_free < pages:
            self.evict(pages - core.pool.num_free)  # a full tree: room first, so no slot is reused unseen
        handle = core.admit(key, pages, pages, namespace)
        slots = core.block_table(handle)
        cached = core.num_blocks(handle) and core.cached_tokens(handle) // ps
        if cached < pages:
            fresh = slots[cached:]
            self._values[fresh] = values[cached * ps : pages * ps].reshape(-1, ps)
            self._in_tree[fresh] = True
        core.finish(handle)
        if self._events:
            self._drain()
        return cached, PageNode(self._generation, namespace, key, slots)

    def values(self, node: PageNode) -> Int64Array:
        """The KV indices of ``node``'s path (a copy)."""
        return self._values[node.slots].reshape(-1)

    def all_values(self) -> Int64Array:
        """The KV indices of every cached page, in no particular order."""
        return self._values[self._in_tree].reshape(-1)

    def lock(self, node: PageNode) -> tuple[int, int]:
        """Keep ``node``'s path from eviction until :meth:`unlock`; returns the lock's handle and
        how many pages it took from the evictable ones. A node whose path was evicted since it
        was returned raises ``SequenceStateError``."""
        if node.num_pages == 0:
            return -1, 0
        if node is self._probe_node:
            handle, delta = self._probe, self._probe_delta
            self._probe, self._probe_node = -1, None
        else:
            self._settle()
            if node.generation != self._generation:
                raise SequenceStateError(f"lock: the node is from before a reset (generation {node.generation}, "
                                         f"now {self._generation})")
            core = self._core
            evictable = core.num_evictable_blocks
            handle = core.admit(node.tokens, 0, node.num_pages, node.namespace)
            held = core.block_table(handle)
            if not np.array_equal(held, node.slots):
                core.finish(handle, False)
                raise SequenceStateError(
                    f"lock: the node's path of {node.num_pages} pages was evicted ({len(held)} of them are cached now)"
                )
            delta = evictable - core.num_evictable_blocks
        end = int(node.slots[-1])
        handles = self._locks.get(end)
        if handles is None:
            self._locks[end] = [handle]
        else:
            handles.append(handle)
        return handle, delta

    def unlock(self, node: PageNode, handle: int | None = None) -> int:
        """Release a lock on ``node``'s path: ``handle`` (from :meth:`lock`), or the latest one;
        returns how many pages became evictable."""
        if node.num_pages == 0:
            return 0
        if self._probe >= 0:
            self._settle()
        end = int(node.slots[-1])
        handles = self._locks.get(end)
        if node.generation != self._generation or not handles or (handle is not None and handle not in handles):
            raise SequenceStateError(
                f"unlock: {'lock ' + str(handle) if handle is not None else 'no lock'} is held on the node ending at "
                f"slot {end} (generation {node.generation}, now {self._generation}; {len(handles or ())} locks held)"
            )
        if handle is None:
            handle = handles.pop()
        else:
            handles.remove(handle)
        if not handles:
            del self._locks[end]
        core = self._core
        evictable = core.num_evictable_blocks
        core.finish(handle, False)
        return core.num_evictable_blocks - evictable

    def evict(self, pages: int) -> int:
        """Drop up to ``pages`` least recently used unlocked pages, handing their indices to
        ``on_evict``; returns how many were dropped."""
        if self._probe >= 0:
            self._settle()
        if pages <= 0:
            return 0
        core = self._core
        freed = core.evict(pages)
        if freed:
            # The slots the core just freed are the top of its pool's free list: taken and put
            # back, they name the evicted pages; each must have been in the tree, or this is
            # not what happened and nothing is freed.
            pool = core.pool
            slots = pool.allocate(freed)
            pool.dec_ref(slots)
            if not self._in_tree[slots].all():
                raise InvariantViolation(f"evict: the {freed} slots the core freed are not all pages of the tree")
            self._in_tree[slots] = False
            if self._on_evict is not None:
                self._on_evict(self._values[slots].reshape(-1))
            if self._events:
                self._drain()
        return freed

    def reset(self) -> None:
        """Drop every page and lock (the engine clears its allocator itself, as SGLang's flush
        does, so the dropped indices are not handed to ``on_evict``); nodes taken before are void."""
        self._settle()
        core = self._core
        for handles in self._locks.values():
            for handle in handles:
                core.finish(handle, False)
        self._locks.clear()
        self._drain()
        if not core.reset():
            raise InvariantViolation(f"reset: the core kept {core.num_cached_blocks} cached pages with no lock held")
        self._in_tree[:] = False
        self._drain()
        self._generation += 1
        self.root = PageNode(self._generation, 0, np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.int32))

    def take_events(self) -> list[RawEvents]:
        """The raw logs drained since the last call, oldest first."""
        self._settle()
        self._drain()
        taken, self._pending = self._pending, []
        return taken

    def check_invariants(self) -> None:
        """The core's recount, and one live core record per lock held."""
        self._settle()
        self._core.check_invariants()
        if self._core.num_live_sequences != self.num_locks:
            raise InvariantViolation(
                f"{self._core.num_live_sequences} core records are live but {self.num_locks} locks are held"
            )

    def _settle(self) -> None:
        """Drop the last match's probe (unless a lock took it over)."""
        if self._probe >= 0:
            handle, self._probe, self._probe_node = self._probe, -1, None
            self._core.finish(handle, False)

    def _drain(self) -> None:
        raw = self._core.take_events()
        if len(raw):
            self._pending.append(raw)


# -- the classes derived from SGLang's own --------------------------------------------------------


def _key_tokens(token_ids: Any) -> npt.NDArray[np.integer[Any]]:
    """A RadixKey's token ids as an array: a view of an ``array('q')``, a conversion otherwise."""
    if getattr(token_ids, "typecode", None) == "q":
        return np.frombuffer(token_ids, dtype=np.int64)
    return np.asarray(token_ids, dtype=np.int64)


@functools.cache
def radix_cache_class() -> type[Any]:
    """``LifecycleRadixCache``: SGLang's ``BasePrefixCache`` over a :class:`PageTree` (built once;
    needs SGLang)."""
    import_engine("sglang", _EXTRA)
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import (
        BasePrefixCache,
        DecLockRefResult,
        EvictResult,
        IncLockRefResult,
        InsertResult,
        MatchResult,
    )

    class LifecycleRadixCache(BasePrefixCache):  # type: ignore[misc]
        """SGLang's ``RadixCache`` interface over lifecycle's core (see the module's docstring).
        ``max_pages``: tree slots, by default the allocator's page count (its ``size`` over
        ``page_size``, plus the padding page)."""

        sliding_window_size = None

        def __init__(self, params: Any, *, max_pages: int | None = None) -> None:
            if params.is_eagle:
                raise Unsupported("LifecycleRadixCache: EAGLE bigram keys are not supported")
            if getattr(params, "sliding_window_size", None) is not None:
                raise Unsupported(f"LifecycleRadixCache: sliding_window_size={params.sliding_window_size}: "
                                  "sliding-window trees are not supported")
            components = getattr(params, "tree_components", None)
            if components is not None and any(int(component) != 0 for component in components):
                raise Unsupported(f"LifecycleRadixCache: tree_components={components!r}: only full attention "
                                  "(ComponentType.FULL) is supported, not hybrid (Mamba, SWA) trees")
            if getattr(params, "enable_mamba_extra_buffer", False):
                raise Unsupported("LifecycleRadixCache: enable_mamba_extra_buffer: Mamba state is not supported")
            policy = str(params.eviction_policy).lower()
            if policy != "lru":
                raise Unsupported(f"LifecycleRadixCache: eviction_policy={policy!r}; only 'lru' is supported")
            self.disable = params.disable
            self.req_to_token_pool = params.req_to_token_pool
            self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
            self.page_size: int = params.page_size
            self.is_eagle = False
            self.eviction_policy = policy
            self.enable_kv_cache_events = bool(params.enable_kv_cache_events) and not params.disable
            self.kv_event_lora_names = params.kv_event_lora_names
            allocator = self.token_to_kv_pool_allocator
            device = getattr(allocator, "device", "cpu") if allocator is not None else "cpu"
            self.device = torch.device(device) if isinstance(device, (str, torch.device)) else torch.device("cpu")
            if max_pages is None:
                size = getattr(allocator, "size", None)
                max_pages = size // self.page_size + 1 if isinstance(size, int) else DEFAULT_MAX_PAGES
            self._namespaces: CacheNamespaces[tuple[str | None, str | None]] = CacheNamespaces()
            self._tree = PageTree(
                max_pages, self.page_size, events=self.enable_kv_cache_events, on_evict=self._free_evicted
            )
            self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
            if params.enable_metrics:
                self.init_metrics_collector()

        @classmethod
        def create_simulated(
            cls, disable: bool = False, mock_allocator: Any = None, page_size: int = 1,
            enable_kv_cache_events: bool = False, **kwargs: Any,
        ) -> Any:
            """A cache without pools, for tests and replays (as ``RadixCache.create_simulated``)."""
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams

            return cls(CacheInitParams(
                disable=disable, req_to_token_pool=None, token_to_kv_pool_allocator=mock_allocator,
                page_size=page_size, enable_kv_cache_events=enable_kv_cache_events, **kwargs,
            ))

        @property
        def tree(self) -> PageTree:
            """The :class:`PageTree` underneath."""
            return self._tree

        @property
        def root_node(self) -> PageNode:
            return self._tree.root

        def _free_evicted(self, values: Int64Array) -> None:
            allocator = self.token_to_kv_pool_allocator
            if allocator is not None:
                allocator.free_segment(self._tensor(values), start_pos=0)

        def _tensor(self, values: Int64Array) -> Any:
            tensor = torch.from_numpy(values)
            return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

        def _namespace(self, key: Any) -> int:
            if key.extra_key is None and key.cache_salt is None:
                return 0
            return self._namespaces.key((key.extra_key, key.cache_salt))

        def _key(self, key: Any) -> tuple[Int32Array, int]:
            if key.is_bigram:
                raise Unsupported("LifecycleRadixCache: EAGLE bigram keys are not supported")
            return self._tree.key(_key_tokens(key.token_ids), len(key))

        # -- BasePrefixCache --------------------------------------------------------------------

        def reset(self) -> None:
            self._tree.reset()

        def match_prefix(self, params: Any) -> Any:
            """The longest cached prefix of ``params.key`` (whole pages): ``device_prefix_len``
            tokens ending at ``last_device_node``, whose indices ``path_device_indices`` gives."""
            node = self._tree.root
            if not self.disable:
                tokens, pages = self._key(params.key)
                node = self._tree.match(tokens, pages, self._namespace(params.key))
            length = node.num_pages * self.page_size
            return MatchResult(
                device_prefix_len=length, last_device_node=node, last_host_node=node, best_match_node=node,
                full_kv_hit_length=length,
            )

        def touch_prefix(self, key: Any) -> None:
            if not self.disable:
                tokens, pages = self._key(key)
                self._tree.match(tokens, pages, self._namespace(key))

        def insert(self, params: Any) -> Any:
            """Store ``params.value`` (KV indices; the key's tokens themselves when None, for
            tests) under ``params.key``'s whole pages; ``prefix_len`` tokens were cached already."""
            if self.disable:
                return InsertResult(prefix_len=0)
            tokens, pages = self._key(params.key)
            value = params.value
            if value is None:
                values = np.array(tokens[: pages * self.page_size], dtype=np.int64)
            else:
                values = np.asarray((value if value.device.type == "cpu" else value.cpu()).numpy(), dtype=np.int64)
            cached, node = self._tree.insert(tokens, pages, values, self._namespace(params.key))
            return InsertResult(prefix_len=cached * self.page_size, total_len=pages * self.page_size,
                                last_device_node=node)

        def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
            """Cache the request's KV up to row position ``up_to`` (whole pages), free its
            duplicates of what was cached, point its row at the cache's indices and move its lock
            to the new path (as ``RadixCache.checkpoint``)."""
            if self.disable:
                return
            kv = req.kv
            ps = self.page_size
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            fill_ids = req.full_untruncated_fill_ids
            tokens, pages = self._tree.key(_key_tokens(fill_ids), min(up_to, len(fill_ids)))
            length = pages * ps
            namespace = 0 if req.extra_key is None and req.cache_salt is None else self._namespaces.key(
                (req.extra_key, req.cache_salt)
            )
            source = row[:length]
            values = (source if source.device.type == "cpu" else source.cpu()).numpy().astype(np.int64, copy=False)
            cached, node = self._tree.insert(tokens, pages, values, namespace)
            kv.cache_inserted_len = max(kv.cache_inserted_len, length)
            protected = kv.cache_protected_len
            prefix_len = cached * ps
            if prefix_len > protected:
                self.token_to_kv_pool_allocator.free_segment(row[protected:prefix_len], start_pos=protected)
            if length > protected:
                indices = self._tensor(self._tree.values(node)[protected:length])
                self.req_to_token_pool.write((kv.req_pool_idx, slice(protected, length)), indices)
            kv.cache_protected_len = length
            self.unlock(req.lock)
            req.lock = self.lock(node)
            req.last_node = node

        def evict(self, params: Any) -> Any:
            if self.disable:
                return EvictResult()
            pages = -(-params.num_tokens // self.page_size)
            return EvictResult(num_tokens_evicted=self._tree.evict(pages) * self.page_size)

        def inc_lock_ref(self, node: PageNode) -> Any:
            if self.disable or node.num_pages == 0:
                return IncLockRefResult(delta=0)
            handle, delta = self._tree.lock(node)
            return IncLockRefResult(delta=-delta * self.page_size, node_id=handle)

        def dec_lock_ref(self, node: PageNode, params: Any = None) -> Any:
            if self.disable or node.num_pages == 0:
                return DecLockRefResult(delta=0)
            delta = self._tree.unlock(node, None if params is None else params.node_id)
            return DecLockRefResult(delta=delta * self.page_size)

        def path_device_indices(self, node: PageNode) -> Any:
            if node.num_pages == 0:
                return self._empty
            return self._tensor(self._tree.values(node))

        def all_values_flatten(self) -> Any:
            """Every cached KV index (in no particular order)."""
            return self._tensor(self._tree.all_values())

        def supports_prefix_sharing(self) -> bool:
            return not self.disable

        def evictable_size(self) -> int:
            return self._tree.evictable_pages * self.page_size

        def full_evictable_size(self) -> int:
            return self.evictable_size()

        def protected_size(self) -> int:
            return self._tree.protected_pages * self.page_size

        def full_protected_size(self) -> int:
            return self.protected_size()

        def total_size(self) -> int:
            return self._tree.cached_pages * self.page_size

        def pretty_print(self) -> None:
            print(f"LifecycleRadixCache: {self.total_size()} tokens in {self._tree.cached_pages} pages "
                  f"({self.protected_size()} protected, {self.evictable_size()} evictable)")

        def take_events(self) -> list[Any]:
            """SGLang's KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) since
            the last call, oldest first, naming pages by lifecycle's content hashes; a run of
            pages cached together is one ``BlockStored``, as SGLang's recorder coalesces them.
            Empty unless ``enable_kv_cache_events``."""
            if not self.enable_kv_cache_events:
                return []
            from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

            out: list[Any] = []
            for raw in self._tree.take_events():
                for entry in raw_event_log(raw):
                    if entry[0] == "stored":
                        _, hashes, parent, tokens, namespace = entry
                        extra_key, cache_salt = self._namespaces.namespace(int(namespace)) or (None, None)
                        out.append(BlockStored(
                            block_hashes=hashes.tolist(), parent_block_hash=None if parent is None else int(parent),
                            token_ids=tokens.tolist(), block_size=self.page_size, lora_id=None, medium="GPU",
                            cache_salt=cache_salt, lora_name=self.kv_event_lora_names.get(extra_key),
                        ))
                    elif entry[0] == "removed":
                        out.append(BlockRemoved(block_hashes=entry[1].tolist(), medium="GPU"))
                    else:
                        out.append(AllBlocksCleared())
            return out

        def check_invariants(self) -> None:
            """The tree's recount (tests call it after every step)."""
            self._tree.check_invariants()

    return LifecycleRadixCache


@functools.cache
def allocator_class() -> type[Any]:
    """``LifecyclePagedAllocator``: SGLang's ``BaseTokenToKVPoolAllocator`` over a lifecycle
    ``BlockPool`` of pages (built once; needs SGLang)."""
    import_engine("sglang", _EXTRA)
    import torch
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.paged import alloc_decode_naive, alloc_extend_naive
    from sglang.srt.utils import get_num_new_pages

    class LifecyclePagedAllocator(BaseTokenToKVPoolAllocator):  # type: ignore[misc]
        """``size`` KV token slots in pages of ``page_size`` (page 0, the padding page, is never
        handed out); ``alloc`` returns page-aligned token indices or None when too few pages are
        free, and never evicts (the scheduler evicts from the cache first, as with SGLang's)."""

        def __init__(self, size: int, page_size: int, dtype: Any, device: Any, kvcache: Any,
                     need_sort: bool = False) -> None:
            super().__init__(size, page_size, dtype, device, kvcache, need_sort)
            if type(size) is not int or type(page_size) is not int or page_size < 1 or size < page_size:
                raise ConfigError(
                    f"LifecyclePagedAllocator: size={size!r} must hold at least one page of {page_size!r} tokens"
                )
            self.page_size: int = page_size
            self.num_pages = size // page_size
            self._offsets = np.arange(page_size, dtype=np.int64)
            self._on_cpu = torch.device(device).type == "cpu"
            self._group: list[Int32Array] | None = None
            self.free_group: list[Any] | None = None
            self.clear()

        def clear(self) -> None:
            self.pool = BlockPool(self.num_pages + 1)
            padding = self.pool.allocate(1)
            if int(padding[0]) != 0:
                raise InvariantViolation(f"LifecyclePagedAllocator: a new pool gave page {int(padding[0])}, not 0")
            self._group = None
            self.free_group = None

        def available_size(self) -> int:
            return self.pool.num_free * self.page_size

        def _tensor(self, values: Int64Array) -> Any:
            tensor = torch.from_numpy(values)
            return tensor if self._on_cpu else tensor.to(self.device, non_blocking=True)

        def _pages(self, num_pages: int) -> Int32Array | None:
            if num_pages > self.pool.num_free:
                return None
            return self.pool.allocate(num_pages)

        def alloc(self, need_size: int) -> Any:
            pages = self._pages(-(-need_size // self.page_size))
            if pages is None:
                return None
            if self.page_size == 1:
                return self._tensor(pages.astype(np.int64))
            indices = (pages.astype(np.int64)[:, None] * self.page_size + self._offsets).reshape(-1)
            return self._tensor(indices[:need_size])

        def alloc_extend(self, prefix_lens: Any, prefix_lens_cpu: Any, seq_lens: Any, seq_lens_cpu: Any,
                         last_loc: Any, extend_num_tokens: int, num_new_pages: int | None = None) -> Any:
            if num_new_pages is None:
                num_new_pages = int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                                      prefix_lens=prefix_lens_cpu))
            pages = self._pages(num_new_pages)
            if pages is None:
                return None
            out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
            alloc_extend_naive(prefix_lens, seq_lens, last_loc, self._tensor(pages.astype(np.int64)), out,
                               self.page_size, self.device)
            return out

        def alloc_decode(self, seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> Any:
            num_new_pages = int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True))
            pages = self._pages(num_new_pages)
            if pages is None:
                return None
            out = torch.empty((len(seq_lens),), dtype=torch.int64, device=self.device)
            alloc_decode_naive(seq_lens, last_loc, self._tensor(pages.astype(np.int64)), out, self.page_size,
                               num_new_pages)
            return out

        def _release(self, pages: npt.NDArray[np.integer[Any]]) -> None:
            if len(pages) == 0:
                return
            if self._group is not None:
                self._group.append(pages.astype(np.int32))
            else:
                self.pool.dec_ref(pages.astype(np.int32, copy=False))

        def free(self, free_index: Any) -> None:
            """Free the pages holding ``free_index`` (each page once, however many of its slots
            are listed)."""
            if free_index.numel() == 0:
                return
            indices = (free_index if self._on_cpu else free_index.cpu()).numpy()
            if self.page_size == 1:
                self._release(indices)
                return
            pages = (indices // self.page_size).astype(np.int32)
            if len(pages) > 1:
                # A page's slots are listed together: dropping repeats of the one before is the
                # common case's dedup, checked by the pool (a page listed twice is refused, then
                # deduplicated for good).
                pages = pages[np.concatenate(([True], pages[1:] != pages[:-1]))]
            if self._group is None and len(pages) > 1:
                try:
                    self.pool.dec_ref(pages)
                except LifecycleError:
                    self._release(np.unique(pages))
                return
            self._release(pages)

        def free_segment(self, free_index: Any, *, start_pos: int) -> None:
            if start_pos % self.page_size:
                raise InvalidId(f"free_segment: start {start_pos} is not a multiple of the page size {self.page_size}")
            if free_index.numel() == 0:
                return
            indices = (free_index if self._on_cpu else free_index.cpu()).numpy()
            self._release(indices[:: self.page_size] // self.page_size)

        def free_page_ids(self, page_ids: Any) -> None:
            if page_ids.numel() == 0:
                return
            self._release((page_ids if self._on_cpu else page_ids.cpu()).numpy())

        def free_group_begin(self) -> None:
            self._group = []
            self.free_group = []

        def free_group_end(self) -> None:
            group, self._group = self._group or [], None
            self.free_group = None
            if group:
                # Each page once: a page listed twice in a group (its slots freed in two calls) must
                # not make the pool refuse, and so keep, the whole group.
                self.pool.dec_ref(np.unique(np.concatenate(group)))

        def merge_and_sort_free(self) -> None:
            """Nothing to merge: freed pages go straight back to the pool's free list."""

        def get_all_free_pages(self) -> Any:
            return self._tensor(np.flatnonzero(self.pool.refcounts() == 0).astype(np.int64))

        def check_invariants(self) -> None:
            """The pool's recount."""
            self.pool.check_invariants()

    return LifecyclePagedAllocator


def __getattr__(name: str) -> type[Any]:
    if name == "LifecycleRadixCache":
        return radix_cache_class()
    if name == "LifecyclePagedAllocator":
        return allocator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
