"""SGLang's prefix cache and KV-index allocator, backed by lifecycle.

Two classes a scheduler takes in place of SGLang's own, each derived from SGLang's base class (so
every default the scheduler calls is there), built the first time they are asked for (the
``sglang`` extra; importing this module loads neither SGLang nor torch):

- ``LifecycleRadixCache(params: CacheInitParams)``: in place of ``RadixCache``. ``match_prefix``,
  ``insert``, ``evict``, ``inc_lock_ref`` / ``dec_lock_ref`` (and the base class's ``lock`` /
  ``unlock``), ``path_device_indices``, ``checkpoint`` (what SGLang calls where it used to call
  ``cache_unfinished_req`` / ``cache_finished_req``; ``release_kv_cache`` then frees the row),
  ``evictable_size`` / ``protected_size`` / ``total_size``, ``reset``, ``take_events``,
  ``dfs_weight_order`` (the ``dfs-weight`` schedule policy; :func:`dfs_weight_order`).
- ``LifecyclePagedAllocator(size, page_size, dtype, device, kvcache, need_sort)``: in place of
  ``PagedTokenToKVPoolAllocator`` (and of ``TokenToKVPoolAllocator`` with ``page_size=1``): pages
  from a lifecycle ``BlockPool`` (page 0 kept for padding, as SGLang does); a page freed twice
  raises ``DoubleFree`` instead of entering the free list twice.

Who owns KV indices (as in SGLang): the allocator owns the free ones; the indices a request was
given are its own until ``insert`` / ``checkpoint`` hands them to the cache, which owns them until
it evicts them and frees them to the allocator; ``insert`` reports how much of the key was cached
already, and the caller frees its duplicates. Either cache works with either allocator.

Inside the cache, the prefix tree is a :class:`PageTree` (compiled, ``lifecycle._sglang_pagetree``; each
of SGLang's calls is one C call there): lifecycle's KV cache core over *tree slots*, one per cached
page, whose block ids index a table of the engine's KV indices. The core
matches keys by their tokens (whole pages, exact compare), keeps the LRU order, pins locked paths
and logs KV events; a lock is a core record holding the path. The slots are the core's own ids
rather than SGLang's page ids because the core hands out block ids itself: it has no call that
caches blocks an engine allocated elsewhere.

By design (refused with ``Unsupported`` at construction): EAGLE bigram keys, eviction policies
other than LRU, sliding-window and hybrid (Mamba, SWA) trees (SWA trees are the next class's).
Hierarchical caching is SGLang's ``HiRadixCache``, not provided.

SWA models (full attention layers beside sliding-window ones): ``LifecycleSWARadixCache(params)``
in place of SGLang's ``UnifiedRadixCache`` with the ``FULL`` and ``SWA`` components, over SGLang's
own ``SWATokenToKVPoolAllocator``, the tree an :class:`SWAPageTree`. The mapping:

- SGLang's two index spaces are the grouped core's two groups: group 0 (``full``) holds a tree
  slot per cached page, group 1 (``sliding_window``) a slot per page whose SWA KV is cached. Both
  tables keep the page's *full* KV indices; the SWA indices are the allocator's
  ``full_to_swa_index_mapping`` of them, so the KV goes back through the allocator's own
  ``free`` (full and SWA), ``free_swa`` (a tombstone: SWA only) and ``free_full``.
- A tombstone is a -1 in group 1's column. ``sliding_window_size`` W is the core's window of
  W + 1 (a query at a cut reads the W tokens before it), so a match is the longest prefix whose
  last W tokens have their SWA KV, SGLang's rule; a lock holds the path in group 0 and its last
  window in group 1.
- ``insert``'s SWA evicted length (``component_evicted_seqlens[SWA]``) is released by the core:
  the record is admitted with the tokens up to it plus a window, the rest appended, so the pages
  below it hold no SWA slot (at most the last window of the key's end may be missing: more is
  refused). A cached page whose SWA KV was a tombstone takes the caller's (the core fills the
  hole; its SWA index moves to the cached full index in the mapping and the caller's full index
  is freed), as SGLang recovers tombstones. Duplicates past ``prev_prefix_len`` are freed by the
  cache, as SGLang's SWA cache does.
- No checkpoints (``retention_interval=0``): SGLang frees a request's out-of-window SWA KV itself.
- ``checkpoint`` (the running request's path, ``cache_unfinished_req``'s place, and the finish):
  as ``UnifiedRadixCache.checkpoint_into_tree`` with FULL and SWA, the request's out-of-window SWA
  KV freed first, the key inserted with its SWA evicted length (counted past the cached part
  only: SGLang clamps it up to ``cache_protected_len``), the row pointed at the cache's indices,
  the lock moved. A match reports SGLang's SWA branch point (``swa_branching_seqlen``: the full
  KV hit, ``KVCacheCore.cached_prefix_blocks``, where it goes past the last cut with a window of
  SWA KV) and ``full_kv_hit_length``; a running request's checkpoint inserts up to that point
  first, before its SWA KV there leaves the window, as SGLang's SWA component does, so a later
  prompt ending its shared prefix there hits (the insert fills the tombstones of that window).
- ``evict``'s ``swa_num_tokens`` tombstones SWA KV (``KVCacheCore.evict_group(1, n)``: least
  recently cached pages' SWA KV first, their full KV kept; a run whose last window lost it is
  trimmed). The order is by when a page's SWA KV was left to the cache, not SGLang's SWA LRU by
  access.
- No call's cost grows with the pools: freed slots are read off the pools' free stacks, sizes
  and lock counts kept as they change. A lock protects its last window's pages, where SGLang
  locks whole tree nodes until they cover the window (its SWA protected size can be larger).
- Not yet: KV events, EAGLE, hierarchical caching, Mamba, ``release_swa_prefix_lock``
  (``SGLANG_OPT_RELEASE_PREFILL_SWA``, off by default), SGLang's split-leaf-on-insert.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from lifecycle._blockpool import BlockPool
from lifecycle._retention import DEFAULT_RETENTION
from lifecycle._sglang_pagetree import PageNode, PageTree, page_indices, pages_of
from lifecycle.errors import ConfigError, InvalidId, InvariantViolation, LifecycleError, SequenceStateError, Unsupported
from lifecycle.integrations import CacheNamespaces, import_engine, raw_event_log

__all__ = [
    "PageNode", "PageTree", "SWANode", "SWAPageTree", "allocator_class", "dfs_weight_order", "radix_cache_class",
    "swa_radix_cache_class",
]

_EXTRA: Final = "sglang"
#: Tree slots when neither the allocator nor the caller says how many pages there are.
DEFAULT_MAX_PAGES: Final = 1 << 16

Int64Array = npt.NDArray[np.int64]


@dataclass(eq=False)
class _Branch:
    """A node of the tree that a set of matched prefixes spans: where one ends, or where two part."""

    depth: int  # in pages
    requests: list[int] = field(default_factory=list)
    children: list[_Branch] = field(default_factory=list)
    weight: int = 0
    first: int = 0


def dfs_weight_order(nodes: Sequence[PageNode]) -> list[int]:
    """SGLang's ``dfs-weight`` order of requests whose matches ended at ``nodes``: depth first
    through the tree of their matched prefixes, the subtree holding more requests first, a
    subtree's deeper requests before the ones ending at its top (the order of SGLang's
    ``_dfs_weight_order`` over its radix tree; of two subtrees holding as many requests, the one
    with the earlier request goes first, where SGLang goes by its children's insertion order).
    The tree is the one the prefixes themselves span (their ends and the pages where they part,
    found from the prefixes sorted), so the cost is that of sorting and comparing them, not of
    walking the cache. A prefix is compared by its tree slots, one per page (a cached page has
    one slot, so two paths share a slot only where they share the page): ``nodes`` are taken
    fresh from one tree, as SGLang matches the queue just before ordering it."""
    ends: dict[tuple[int, bytes], list[int]] = {}
    at_root: list[int] = []
    for index, node in enumerate(nodes):
        if node.num_pages == 0:
            at_root.append(index)
        else:
            slots = np.ascontiguousarray(node.slots[: node.num_pages], dtype=np.int32)
            ends.setdefault((node.namespace, slots.tobytes()), []).append(index)
    root = _Branch(0, at_root)
    stack = [root]
    previous: tuple[int, bytes] | None = None
    page_bytes = 4  # one int32 slot a page
    for key in sorted(ends):  # a prefix sorts before what extends it; a shared prefix groups
        shared = 0
        if previous is not None and previous[0] == key[0]:
            a, b = previous[1], key[1]
            length = min(len(a), len(b))
            differ = np.flatnonzero(np.frombuffer(a, np.uint8, length) != np.frombuffer(b, np.uint8, length))
            shared = (int(differ[0]) if differ.size else length) // page_bytes
        last = None
        while stack[-1].depth > shared:
            last = stack.pop()
        if stack[-1].depth < shared and last is not None:  # the two part inside ``last``'s edge
            branch = _Branch(shared, children=[last])
            stack[-1].children[-1] = branch
            stack.append(branch)
        end = _Branch(len(key[1]) // page_bytes, ends[key])
        stack[-1].children.append(end)
        stack.append(end)
        previous = key
    # Weights and each subtree's earliest request: parents before children, then in reverse.
    preorder: list[_Branch] = []
    pending = [root]
    while pending:
        branch = pending.pop()
        preorder.append(branch)
        pending.extend(branch.children)
    for branch in reversed(preorder):
        branch.weight = len(branch.requests) + sum(child.weight for child in branch.children)
        branch.first = min([*branch.requests, *(child.first for child in branch.children)], default=len(nodes))
    order: list[int] = []
    walk: list[tuple[_Branch, bool]] = [(root, False)]
    while walk:
        branch, visited = walk.pop()
        if visited:
            order.extend(branch.requests)
            continue
        walk.append((branch, True))
        for child in sorted(branch.children, key=lambda c: (c.weight, -c.first)):  # heaviest popped first
            walk.append((child, False))
    return order


@functools.cache
def retention_priority(priority: int) -> int:
    """An SGLang request priority under the ``priority`` eviction policy (a node keeps the highest
    priority that inserted it, the lower evicted first) as a retention priority: the core's
    default (35) plus the request's, within 0-100."""
    return min(100, max(0, DEFAULT_RETENTION + int(priority)))


def _key_namespace(namespaces: CacheNamespaces[tuple[str | None, str | None]], key: Any) -> int:
    """The core's adapter key of a ``RadixKey``'s namespace (its ``extra_key`` and ``cache_salt``;
    0 for neither)."""
    if key.extra_key is None and key.cache_salt is None:
        return 0
    return namespaces.key((key.extra_key, key.cache_salt))


def _unigram_tokens(key: Any, owner: str) -> Any:
    """A ``RadixKey``'s token ids; EAGLE's bigram keys are refused in ``owner``'s name."""
    if key.is_bigram:
        raise Unsupported(f"{owner}: EAGLE bigram keys are not supported")
    return key.token_ids


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

    lifecycle_allocator = allocator_class()

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
                                  "sliding-window trees are swa_radix_cache_class()'s")
            components = getattr(params, "tree_components", None)
            if components is not None and any(int(component) != 0 for component in components):
                raise Unsupported(f"LifecycleRadixCache: tree_components={components!r}: only full attention "
                                  "(ComponentType.FULL) is supported, not hybrid (Mamba, SWA) trees")
            if getattr(params, "enable_mamba_extra_buffer", False):
                raise Unsupported("LifecycleRadixCache: enable_mamba_extra_buffer: Mamba state is not supported")
            policy = str(params.eviction_policy).lower()
            if policy not in ("lru", "priority"):
                raise Unsupported(
                    f"LifecycleRadixCache: eviction_policy={policy!r}; only 'lru' and 'priority' are supported"
                )
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
            self._on_cpu = self.device.type == "cpu"
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
            if allocator is None:
                return
            if isinstance(allocator, lifecycle_allocator):
                allocator.free_indices(values, first_of_page=True)  # no tensor in between
            else:
                allocator.free_segment(self._tensor(values), start_pos=0)

        def _tensor(self, values: Int64Array) -> Any:
            tensor = torch.from_numpy(values)
            return tensor if self._on_cpu else tensor.to(self.device, non_blocking=True)

        def _namespace(self, key: Any) -> int:
            return _key_namespace(self._namespaces, key)

        def _unigram(self, key: Any) -> Any:
            return _unigram_tokens(key, "LifecycleRadixCache")

        # -- BasePrefixCache --------------------------------------------------------------------

        def reset(self) -> None:
            self._tree.reset()

        def match_prefix(self, params: Any) -> Any:
            """The longest cached prefix of ``params.key`` (whole pages): ``device_prefix_len``
            tokens ending at ``last_device_node``, whose indices ``path_device_indices`` gives."""
            key = params.key
            if self.disable:
                node = self._tree.root
            else:
                node = self._tree.match(self._unigram(key), len(key), self._namespace(key))
            length = node.num_pages * self.page_size
            return MatchResult(
                device_prefix_len=length, last_device_node=node, last_host_node=node, best_match_node=node,
                full_kv_hit_length=length,
            )

        def touch_prefix(self, key: Any) -> None:
            if not self.disable:
                self._tree.match(self._unigram(key), len(key), self._namespace(key))

        def insert(self, params: Any) -> Any:
            """Store ``params.value`` (KV indices; the key's tokens themselves when None, for
            tests) under ``params.key``'s whole pages; ``prefix_len`` tokens were cached already."""
            if self.disable:
                return InsertResult(prefix_len=0)
            key = params.key
            tokens = self._unigram(key)
            length = len(key)
            value = params.value  # a tensor (read in place when on the CPU), or the tokens themselves
            cached, node = self._tree.insert(tokens, length, tokens if value is None else value, self._namespace(key))
            ps = self.page_size
            priority = getattr(params, "priority", None) if self.eviction_policy == "priority" else None
            if priority:
                self._tree.core.retention.prioritize(
                    tokens[: length // ps * ps], self._namespace(key), retention_priority(priority)
                )
            return InsertResult(prefix_len=cached * ps, total_len=length // ps * ps, last_device_node=node)

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
            length = min(up_to, len(fill_ids)) // ps * ps
            namespace = 0 if req.extra_key is None and req.cache_salt is None else self._namespaces.key(
                (req.extra_key, req.cache_salt)
            )
            cached, node = self._tree.insert(fill_ids, length, row[:length], namespace)
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
            allocator = self.token_to_kv_pool_allocator
            if isinstance(allocator, lifecycle_allocator) and allocator.page_size == self.page_size \
                    and allocator.free_group is None:
                evicted = self._tree.evict(pages, allocator.pool)  # pages freed in the same C call
            else:
                evicted = self._tree.evict(pages)
            return EvictResult(num_tokens_evicted=evicted * self.page_size)

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

        def dfs_weight_order(self, node_handles: Sequence[PageNode]) -> list[int]:
            """The ``dfs-weight`` schedule policy's order of the requests whose matches ended at
            ``node_handles`` (see :func:`dfs_weight_order`)."""
            return dfs_weight_order(node_handles)

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


def _refuse_padding(pages: npt.NDArray[np.integer[Any]]) -> None:
    """Page 0 pads SGLang's tables and is never handed out: freeing it would hand it to a request."""
    if len(pages) and int(pages.min()) == 0:
        raise InvalidId("free: page 0 is the padding page, which is never allocated; it cannot be freed")


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
            self._on_cpu = torch.device(device).type == "cpu"
            self._group: list[npt.NDArray[np.int32]] | None = None
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

        def _pages(self, num_pages: int) -> npt.NDArray[np.int32] | None:
            if num_pages > self.pool.num_free:
                return None
            return self.pool.allocate(num_pages)

        def alloc(self, need_size: int) -> Any:
            indices = page_indices(self.pool, need_size, self.page_size)
            return None if indices is None else self._tensor(indices)

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
            _refuse_padding(pages)
            if self._group is not None:
                self._group.append(pages.astype(np.int32))
            else:
                self.pool.dec_ref(pages.astype(np.int32, copy=False))

        def free_indices(self, indices: Any, *, first_of_page: bool = False) -> None:
            """Free the pages that the KV indices ``indices`` (a tensor or a numpy array) lie on,
            each page once however many of its slots are listed (with ``first_of_page``, every
            ``page_size``-th index only: a segment starting on a page boundary)."""
            pages = pages_of(indices, self.page_size, first_of_page)
            _refuse_padding(pages)
            if self._group is not None:
                self._group.append(pages)
                return
            try:
                self.pool.dec_ref(pages)
            except LifecycleError:
                if self.page_size == 1:
                    raise  # an index listed twice is a page freed twice
                # A page's slots listed apart (not in one run): each page once, or refused as before.
                self.pool.dec_ref(pages_of(indices, self.page_size, first_of_page, unique=True))

        def free(self, free_index: Any) -> None:
            """Free the pages holding ``free_index`` (each page once, however many of its slots
            are listed)."""
            if free_index.numel():
                self.free_indices(free_index)

        def free_segment(self, free_index: Any, *, start_pos: int) -> None:
            if start_pos % self.page_size:
                raise InvalidId(f"free_segment: start {start_pos} is not a multiple of the page size {self.page_size}")
            if free_index.numel():
                self.free_indices(free_index, first_of_page=True)

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
    if name == "LifecycleSWARadixCache":
        return swa_radix_cache_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- sliding-window (SWA) trees -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SWANode:
    """The end of a cached path of an :class:`SWAPageTree` (a view, as a :class:`PageNode` is):
    the key's whole pages and one token more, and the full group's tree slots of its pages."""

    tree: int
    generation: int
    namespace: int
    tokens: npt.NDArray[np.int32]
    slots: npt.NDArray[np.int32]

    @property
    def num_pages(self) -> int:
        return len(self.slots)

    @property
    def evicted(self) -> bool:
        return False


_SWA_TREES = iter(range(1, 1 << 62))


class SWAPageTree:
    """SGLang's SWA radix tree (a full-attention component and a sliding-window one over two
    index spaces) over lifecycle's grouped core: group 0 holds a tree slot per cached page with
    the page's *full* KV indices, group 1 (``sliding_window``) a slot per page whose SWA KV is
    still cached; a -1 there is SGLang's tombstone. Both groups' values are full KV indices: the
    engine's ``full_to_swa_index_mapping`` turns them into SWA indices, as SGLang's allocator
    frees them.

    ``window``: SGLang's ``sliding_window_size``; a match ends where the ``window`` tokens before
    it have their SWA KV (the core's sliding window of ``window + 1``: a query at a cut reads the
    ``window`` tokens before it). Freed KV goes to ``release``, an object with ``free(full)``
    (full and SWA KV of those pages), ``free_swa(full)`` (their SWA KV only), ``free_full(full)``
    (full only; their SWA KV was freed before) and ``move_swa(source, dest)`` (the SWA KV of the
    full indices ``source`` now belongs to ``dest``), each given int64 full indices.

    No call's cost grows with the pools: the slots a core call freed are read off the top of the
    pool's free stack (a call that only frees pushes them there last), the sizes are counted as
    slots are cached, freed, locked and unlocked."""

    def __init__(self, num_pages: int, num_swa_pages: int, page_size: int, window: int, release: Any) -> None:
        for name, value, low in (("num_pages", num_pages, 1), ("num_swa_pages", num_swa_pages, 1),
                                 ("page_size", page_size, 1), ("window", window, 1)):
            if type(value) is not int or value < low:
                raise ConfigError(f"SWAPageTree: {name}={value!r} must be an int >= {low}")
        self.page_size = page_size
        self.window = window
        self._release = release
        self._pools = [BlockPool(num_pages), BlockPool(num_swa_pages)]
        self._rows = (np.zeros((num_pages, page_size), np.int64), np.zeros((num_swa_pages, page_size), np.int64))
        self._held = (np.zeros(num_pages, np.bool_), np.zeros(num_swa_pages, np.bool_))
        self._lockref = (np.zeros(num_pages, np.int32), np.zeros(num_swa_pages, np.int32))
        # Scratch tables for membership tests (np.isin sorts both sides: ~100 us a call here),
        # all False between calls: one per group's slots, one over full KV indices (grown).
        self._marks = (np.zeros(num_pages, np.bool_), np.zeros(num_swa_pages, np.bool_))
        self._kv_marks = np.zeros(num_pages * page_size, np.bool_)
        self._counts = [0, 0]  # slots held (cached) per group
        self._protected = [0, 0]  # of them, on a lock's path (group 0) or last window (group 1)
        self._id = next(_SWA_TREES)
        self._generation = 0
        self._locks: dict[int, tuple[SWANode, npt.NDArray[np.int32], npt.NDArray[np.int32]]] = {}
        self._new_core()

    def _new_core(self) -> None:
        from lifecycle._kvcache import KVCacheCore

        self.core = KVCacheCore(self._pools[0], self.page_size,
                                groups=[("sliding_window", self.window + 1, 0, self._pools[1])], retention_interval=0)
        self.root = SWANode(self._id, self._generation, 0, np.zeros(1, np.int32), np.zeros(0, np.int32))

    # -- sizes, in pages --------------------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        return self._counts[0]

    @property
    def cached_swa_pages(self) -> int:
        return self._counts[1]

    @property
    def protected_pages(self) -> int:
        """Cached pages on a lock's path."""
        return self._protected[0]

    @property
    def protected_swa_pages(self) -> int:
        """Cached pages whose SWA KV a lock holds (each lock's last window)."""
        return self._protected[1]

    @property
    def num_locks(self) -> int:
        return len(self._locks)

    # -- slots freed by the core --------------------------------------------------------------------

    def _free_counts(self) -> tuple[int, int]:
        return self._pools[0].num_free, self._pools[1].num_free

    def _freed_since(self, before: tuple[int, int]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """The slots of each group freed since ``before`` (the pools' free counts then), by calls
        that only freed: the top of each pool's free stack, taken and put back."""
        out = []
        for g in (0, 1):
            pool = self._pools[g]
            gained = pool.num_free - before[g]
            if gained <= 0:
                out.append(np.empty(0, np.int32))
                continue
            ids = pool.allocate(gained)
            pool.dec_ref(ids[::-1])  # back in the order they were (a LIFO stack)
            out.append(ids)
        return out[0], out[1]

    def _settle(self, before: tuple[int, int]) -> None:
        """Hand back the KV of every cached slot the core freed since ``before``."""
        if self._free_counts() == before:
            return
        gone0, gone1 = self._freed_since(before)
        self._hand_back(gone0[self._held[0][gone0]], gone1[self._held[1][gone1]])

    def _slots_in(self, group: int, values: npt.NDArray[np.int32],
                  members: npt.NDArray[np.int32]) -> npt.NDArray[np.bool_]:
        """``values[i] in members``, for slots (ids >= 0) of ``group``."""
        return _member(values, members, self._marks[group])

    def _kv_in(self, values: Int64Array, members: Int64Array) -> npt.NDArray[np.bool_]:
        """``values[i] in members``, for full KV indices (>= 0)."""
        if not (len(values) and len(members)):
            return np.zeros(len(values), np.bool_)
        top = max(int(values.max()), int(members.max())) + 1
        if top > len(self._kv_marks):
            self._kv_marks = np.zeros(max(top, 2 * len(self._kv_marks)), np.bool_)
        return _member(values, members, self._kv_marks)

    def _hand_back(self, gone0: npt.NDArray[np.int32], gone1: npt.NDArray[np.int32]) -> None:
        """The KV of cached slots that left the cache: full and SWA where a page's two went
        together, SWA only where only its group-1 slot went (a tombstone), full only where its SWA
        KV went before."""
        if not (len(gone0) or len(gone1)):
            return
        for g, gone in ((0, gone0), (1, gone1)):
            if (self._lockref[g][gone] > 0).any():
                raise InvariantViolation(f"group {g}: the core freed a slot a lock holds")
            self._held[g][gone] = False
            self._counts[g] -= len(gone)
        full_rows, swa_rows = self._rows[0][gone0], self._rows[1][gone1]
        both = self._kv_in(full_rows[:, 0], swa_rows[:, 0])
        swa_only = swa_rows[~self._kv_in(swa_rows[:, 0], full_rows[:, 0])]
        if len(swa_only):
            self._release.free_swa(swa_only.reshape(-1))
        if both.any():
            self._release.free(full_rows[both].reshape(-1))
        if (~both).any():
            self._release.free_full(full_rows[~both].reshape(-1))

    def _finish(self, handle: int, cache: bool = False) -> None:
        """Finish a core record and hand back what its finish freed (a leaf trimmed once its
        last pin went)."""
        before = self._free_counts()
        self.core.finish(handle, cache)
        self._settle(before)

    # -- the calls --------------------------------------------------------------------------------

    def _key(self, tokens: Any, pages: int) -> npt.NDArray[np.int32]:
        n = pages * self.page_size
        head = np.asarray(tokens[:n] if not isinstance(tokens, np.ndarray) else tokens[:n], dtype=np.int64)
        if len(head) < n:
            raise InvalidId(f"a key of {n} tokens is longer than its {len(head)} token ids")
        if n and (int(head.min()) < 0 or int(head.max()) > 0x7FFFFFFF):
            bad = int(np.flatnonzero((head < 0) | (head > 0x7FFFFFFF))[0])
            raise InvalidId(f"token id {int(head[bad])} (at index {bad}) is outside [0, {0x7FFFFFFF}]")
        key = np.zeros(n + 1, np.int32)
        key[:n] = head
        return key

    def _node(self, namespace: int, key: npt.NDArray[np.int32], slots: npt.NDArray[np.int32]) -> SWANode:
        key.flags.writeable = False
        slots.flags.writeable = False
        return SWANode(self._id, self._generation, namespace, key, slots)

    def match(self, tokens: Any, length: int, namespace: int = 0) -> SWANode:
        """The node ending the longest cached prefix of the first ``length`` tokens (whole pages)
        whose last ``window`` tokens have their SWA KV cached, made the most recently used."""
        return self.match_pages(tokens, length, namespace)[0]

    def match_pages(self, tokens: Any, length: int, namespace: int = 0) -> tuple[SWANode, int]:
        """:meth:`match`, and how many leading pages of those tokens have their full KV cached
        (SGLang's full-KV hit: at least the node's, more where the SWA KV of a window before a
        later cut was tombstoned)."""
        pages = min(int(length) // self.page_size, self._pools[0].num_total)
        if pages == 0:
            return self.root, 0
        key = self._key(tokens, pages)
        node = self._match_key(key, pages, namespace)
        if node.num_pages == pages:
            return node, pages
        return node, max(self.core.cached_prefix_blocks(key[: pages * self.page_size], namespace), node.num_pages)

    def _match_key(self, key: npt.NDArray[np.int32], pages: int, namespace: int) -> SWANode:
        handle = self.core.admit(key, 0, pages, namespace)
        matched = self.core.cached_tokens(handle) // self.page_size
        slots = self.core.block_table(handle, 0)[:matched].copy()
        self._finish(handle)
        if matched == 0:
            return self.root
        return self._node(namespace, key[: matched * self.page_size + 1].copy(), slots)

    def _room(self, pages: int) -> None:
        """Free slots for ``pages`` new pages in both groups (a live record pins the key's cached
        prefix meanwhile), so that no slot is reused inside a core call before its KV was handed
        back: group 0 by evicting least recently used runs, group 1 by tombstoning the SWA KV of
        least recently cached pages first."""
        before = self._free_counts()
        if self._pools[0].num_free < pages:
            self.core.evict(pages - self._pools[0].num_free)
        if self._pools[1].num_free < pages:
            self.core.evict_group(1, pages - self._pools[1].num_free)
        while self._pools[1].num_free < pages and self.core.evict(1):
            pass
        self._settle(before)

    def insert(self, tokens: Any, length: int, values: Any, namespace: int = 0,
               swa_evicted: int = 0) -> tuple[int, SWANode]:
        """Cache ``values`` (full KV indices, one per token of the key's whole pages) under the
        first ``length`` tokens; the pages below ``swa_evicted`` tokens have no SWA KV any more
        (the request freed it). Returns the pages that were cached already, whose indices stay the
        caller's (it frees them), and the node ending the key. Pages cached with their SWA KV evicted take
        the caller's SWA KV (its full indices are freed here, the SWA KV moved to the cached full
        indices through ``release.move_swa``)."""
        ps = self.page_size
        pages = int(length) // ps
        if pages == 0:
            return 0, self.root
        # The pages that keep SWA KV (those from the freed length on) must fit the SWA pool; a
        # longer key whose SWA KV the request freed as it went is cached with tombstones.
        swa_pages = pages - max(int(swa_evicted), 0) // ps
        if pages > self._pools[0].num_total or swa_pages > self._pools[1].num_total:
            raise InvalidId(f"insert: a key of {pages} pages ({swa_pages} of them with SWA KV) does not fit the "
                            f"tree's {self._pools[0].num_total} pages ({self._pools[1].num_total} SWA pages)")
        full = np.ascontiguousarray(np.asarray(values, dtype=np.int64)[: pages * ps]).reshape(-1)
        if len(full) < pages * ps:
            raise InvalidId(f"insert: {len(full)} KV indices for a key of {pages} pages of {ps}")
        if len(full) and int(full.min()) < 0:
            raise InvalidId(f"insert: KV index {int(full.min())} is negative")
        key = self._key(tokens, pages)
        handle = self.core.admit(key, 0, pages, namespace)
        try:
            cut = self.core.cached_tokens(handle) // ps
            # The caller's SWA KV below ``swa_evicted`` is gone. Below the cut the pages are the
            # cache's (their SWA KV is the cache's); past it, the record releases those pages'
            # blocks: its KV is taken to cover ``keep`` tokens, whose window starts there.
            evicted_pages = max(int(swa_evicted), 0) // ps
            if evicted_pages <= cut:
                evicted_pages = 0
            # ``keep``: the fewest whole pages past ``evicted_pages`` whose window leaves every
            # page below it out (the core releases by whole pages: with a window that is not a
            # multiple of the page, ``evicted_pages * ps + window`` kept page ``evicted_pages - 1``,
            # whose SWA KV the request freed, in the SWA group).
            window_pages = -(-self.window // ps)
            keep = (evicted_pages + window_pages) * ps if evicted_pages else pages * ps
            if keep > pages * ps:
                # No page past the cut has a whole window of SWA KV before it: none could be
                # matched, so none is cached (the caller keeps them, and frees them).
                slots = self.core.block_table(handle, 0)[:cut].copy()
                self._finish(handle)
                return cut, (self._node(namespace, key[: cut * ps + 1].copy(), slots) if cut else self.root)
            if evicted_pages and pages - cut > self._pools[1].num_total:
                # More pages than the SWA pool holds: grow by steps, each releasing what left the
                # window (never past ``keep``, so nothing from ``evicted_pages`` on goes early).
                step = max(1, self._pools[1].num_total - window_pages - 1)
                grown = cut
                while grown < pages:
                    grown = min(pages, grown + step)
                    self._room(min(step, pages - cut))
                    self.core.grow(handle, grown)
                    kv = min(keep, grown * ps)
                    if kv > self.core.kv_tokens(handle):
                        self.core.append(handle, [], kv_tokens=kv)
            else:
                self._room(pages - cut)
                self.core.grow(handle, pages)
                if evicted_pages:
                    self.core.append(handle, [], kv_tokens=keep)
        except BaseException:
            self._finish(handle)
            raise
        rows = full.reshape(pages, ps)
        tables = (self.core.block_table(handle, 0), self.core.block_table(handle, 1))
        new = []
        for group in (0, 1):
            fresh = tables[group][cut:pages]
            fresh = fresh[fresh >= 0]
            self._rows[group][fresh] = rows[cut:pages][tables[group][cut:pages] >= 0]
            self._held[group][fresh] = True
            self._counts[group] += len(fresh)
            new.append(fresh)
        before = self._free_counts()
        self.core.finish(handle, True)
        freed = self._freed_since(before)
        # Of this insert's slots, those the finish freed: pages the cache had already.
        for group in (0, 1):
            mine = freed[group][self._slots_in(group, freed[group], new[group])]
            self._held[group][mine] = False
            self._counts[group] -= len(mine)
        others = [freed[g][self._held[g][freed[g]]] for g in (0, 1)]
        self._hand_back(others[0], others[1])
        # Group 0's blocks the cache already had: a run from the cut (a prefix cache has no holes).
        dup = self._slots_in(0, tables[0][cut:pages], freed[0])
        cached = cut + (int(np.argmin(dup)) if not dup.all() else len(dup))
        slots = tables[0][:pages].copy()
        if cached > cut:
            # The key's last window has its SWA KV now, so a match of all of it reads the path.
            node = self._match_key(key, pages, namespace)
            if node.num_pages < cached:
                raise InvariantViolation(f"insert: {cached} pages were cached, a match reads {node.num_pages}")
            slots[cut:cached] = node.slots[cut:cached]
            tree_rows = self._rows[0][slots[cut:cached]]
            swa = tables[1][cut:cached]
            filled = swa >= 0
            filled[filled] = ~self._slots_in(1, swa[filled], freed[1])
            # A tombstone the caller's SWA KV filled: it now belongs to the cached full indices.
            if filled.any():
                self._rows[1][swa[filled]] = tree_rows[filled]
                self._release.move_swa(rows[cut:cached][filled].reshape(-1), tree_rows[filled].reshape(-1))
                self._release.free_full(rows[cut:cached][filled].reshape(-1))
            below = np.arange(cut, cached) < evicted_pages  # their SWA KV is gone already
            for mask, free in ((~filled & below, self._release.free_full), (~filled & ~below, self._release.free)):
                if mask.any():
                    free(rows[cut:cached][mask].reshape(-1))
        return cut, self._node(namespace, key, slots)

    def values(self, node: SWANode) -> Int64Array:
        """The full KV indices of ``node``'s path."""
        self._own(node, "values")
        return self._rows[0][node.slots].reshape(-1)

    def _own(self, node: SWANode, call: str) -> None:
        if not isinstance(node, SWANode) or node.tree != self._id:
            raise SequenceStateError(f"{call}: {node!r} is not a node of this tree")
        if node.generation != self._generation:
            raise SequenceStateError(f"{call}: the node is from before a reset (generation {node.generation}, "
                                     f"now {self._generation})")

    def lock(self, node: SWANode) -> tuple[int, int, int]:
        """Keep ``node``'s path (full group) and its last window (SWA group) from eviction;
        returns the lock's handle and how many full and SWA pages it took from the evictable."""
        self._own(node, "lock")
        handle = self.core.admit(node.tokens, 0, node.num_pages, node.namespace)
        table = self.core.block_table(handle, 0)
        if len(table) != node.num_pages or not np.array_equal(table, node.slots):
            self._finish(handle)
            raise SequenceStateError(
                f"lock: the node's path of {node.num_pages} pages was evicted ({len(table)} of them are served now)"
            )
        window = self.core.block_table(handle, 1)
        window = window[window >= 0]
        taken = []
        for g, slots in ((0, table), (1, window)):
            refs = self._lockref[g]
            taken.append(int((refs[slots] == 0).sum()))
            refs[slots] += 1
            self._protected[g] += taken[-1]
        self._locks[int(handle)] = (node, table, window)
        return int(handle), taken[0], taken[1]

    def unlock(self, handle: int) -> tuple[int, int]:
        """Release lock ``handle``; returns how many full and SWA pages became evictable."""
        entry: tuple[SWANode, npt.NDArray[np.int32], npt.NDArray[np.int32]] | None = self._locks.pop(handle, None)
        if entry is None:
            raise SequenceStateError(f"unlock: lock {handle} is not held ({len(self._locks)} locks held)")
        given = []
        held: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] = (entry[1], entry[2])
        for g, slots in enumerate(held):
            refs = self._lockref[g]
            refs[slots] -= 1
            given.append(int((refs[slots] == 0).sum()))
            self._protected[g] -= given[-1]
        self._finish(handle)
        return given[0], given[1]

    def lock_of(self, node: SWANode) -> int | None:
        """The most recent lock held on ``node`` (None: none)."""
        for handle in reversed(self._locks):
            if self._locks[handle][0] is node:
                return handle
        return None

    def evict(self, pages: int, swa_pages: int = 0) -> tuple[int, int]:
        """Free at least ``pages`` full pages and ``swa_pages`` SWA pages, or as many as are
        evictable; returns how many of each went. Full eviction trims least recently used runs
        in both groups (SGLang's leaf eviction); SWA eviction tombstones pages: it frees the SWA
        KV of cached pages, least recently cached first, keeping their full KV (a run whose last
        window lost its SWA KV is trimmed, full KV too, as SGLang evicts such a leaf)."""
        before = self._free_counts()
        if pages > 0:
            self.core.evict(int(pages))
        short = int(swa_pages) - (self._pools[1].num_free - before[1])
        if short > 0:
            self.core.evict_group(1, short)
        after = self._free_counts()
        self._settle(before)
        return after[0] - before[0], after[1] - before[1]

    def reset(self) -> None:
        """Drop every page and lock without handing KV back (the engine clears its allocator)."""
        for handle in list(self._locks):
            self.core.finish(handle, False)
        self._locks.clear()
        for g in (0, 1):
            self._held[g][:] = False
            self._lockref[g][:] = 0
            self._counts[g] = self._protected[g] = 0
            self._pools[g] = BlockPool(self._pools[g].num_total)
        self._generation += 1
        self._new_core()

    def check_invariants(self) -> None:
        """The core's recount; every slot the tree keeps KV for is one the core holds, the sizes
        and the locks' counts recounted."""
        self.core.check_invariants()
        for g in (0, 1):
            refs = self._pools[g].refcounts()
            if (self._held[g] != (refs > 0)).any():
                bad = int(np.flatnonzero(self._held[g] != (refs > 0))[0])
                raise InvariantViolation(f"group {g} slot {bad}: kept {bool(self._held[g][bad])}, "
                                         f"references {int(refs[bad])}")
            if self._counts[g] != int(self._held[g].sum()):
                raise InvariantViolation(f"group {g}: {self._counts[g]} slots counted, {int(self._held[g].sum())} held")
            expected = np.zeros_like(self._lockref[g])
            for _, full_slots, swa_slots in self._locks.values():
                expected[swa_slots if g else full_slots] += 1
            if not np.array_equal(expected, self._lockref[g]):
                raise InvariantViolation(f"group {g}: the locks' counts do not match the locks held")
            if self._protected[g] != int((expected > 0).sum()):
                raise InvariantViolation(f"group {g}: {self._protected[g]} slots counted protected, "
                                         f"{int((expected > 0).sum())} locked")
            if (~self._held[g] & (expected > 0)).any():
                raise InvariantViolation(f"group {g}: a lock holds a slot the cache does not keep")
        if self.core.num_live_sequences != len(self._locks):
            raise InvariantViolation(f"{self.core.num_live_sequences} core records for {len(self._locks)} locks")


def _member(values: npt.NDArray[Any], members: npt.NDArray[Any], table: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """``values[i] in members`` through ``table`` (all False, indexed by id; left all False):
    linear in the two arrays, where ``np.isin`` sorts them."""
    table[members] = True
    out: npt.NDArray[np.bool_] = table[values]
    table[members] = False
    return out


class _SWARelease:
    """An :class:`SWAPageTree`'s ``release`` over SGLang's ``SWATokenToKVPoolAllocator`` (its
    ``free`` / ``free_swa`` / ``free_full`` and its ``full_to_swa_index_mapping``). The tree hands
    back whole pages; where the indices are whole pages in SGLang's layout (each a page-aligned
    run of ``page_size``) they go through the allocator's segment frees, which read one index a
    page instead of sorting them all (``torch.unique``)."""

    def __init__(self, allocator: Any, device: Any, page_size: int = 1) -> None:
        import torch

        self._allocator = allocator
        self._torch = torch
        self._device = device
        self._page_size = page_size
        self._offsets = np.arange(page_size, dtype=np.int64)
        self._segments = all(callable(getattr(allocator, name, None))
                             for name in ("free_segment", "free_swa_segment", "free_full_segment"))

    def _tensor(self, values: Int64Array) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(values)).to(self._device)

    def _whole_pages(self, full: Int64Array) -> bool:
        ps = self._page_size
        if not self._segments or len(full) % ps:
            return False
        rows = full.reshape(-1, ps)
        return bool((rows[:, 0] % ps == 0).all() and (rows == rows[:, :1] + self._offsets).all())

    def _free(self, full: Int64Array, segment: Any, plain: Any) -> None:
        if self._whole_pages(full):
            segment(self._tensor(full), start_pos=0)
        else:
            plain(self._tensor(full))

    def free(self, full: Int64Array) -> None:
        self._free(full, self._allocator.free_segment if self._segments else None, self._allocator.free)

    def free_swa(self, full: Int64Array) -> None:
        self._free(full, self._allocator.free_swa_segment if self._segments else None, self._allocator.free_swa)

    def free_full(self, full: Int64Array) -> None:
        self._free(full, self._allocator.free_full_segment if self._segments else None, self._allocator.free_full)

    def move_swa(self, source: Int64Array, dest: Int64Array) -> None:
        mapping = self._allocator.full_to_swa_index_mapping
        src, dst = self._tensor(source), self._tensor(dest)
        mapping[dst] = mapping[src]
        mapping[src] = 0


@functools.cache
def swa_radix_cache_class() -> type[Any]:
    """``LifecycleSWARadixCache``: SGLang's SWA prefix cache (``UnifiedRadixCache`` with a
    full and a sliding-window component) over an :class:`SWAPageTree` (built once; needs SGLang)."""
    import_engine("sglang", _EXTRA)
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import (
        BasePrefixCache,
        DecLockRefResult,
        EvictResult,
        IncLockRefResult,
        InsertParams,
        InsertResult,
        MatchResult,
    )

    class LifecycleSWARadixCache(BasePrefixCache):  # type: ignore[misc]
        """SGLang's SWA radix cache interface over lifecycle's grouped core (see
        :class:`SWAPageTree`); takes SGLang's ``SWATokenToKVPoolAllocator``."""

        def __init__(self, params: Any) -> None:
            window = getattr(params, "sliding_window_size", None)
            if window is None or int(window) <= 0:
                raise ConfigError(f"LifecycleSWARadixCache: sliding_window_size={window!r} must be a positive int")
            if params.is_eagle:
                raise Unsupported("LifecycleSWARadixCache: EAGLE bigram keys are not supported")
            components = getattr(params, "tree_components", None)
            if components is not None and sorted(int(c) for c in components) != [0, 1]:
                raise Unsupported(f"LifecycleSWARadixCache: tree_components={components!r}: only full attention "
                                  "with sliding-window attention (FULL, SWA) is supported")
            if getattr(params, "draft_swa_window", 0):
                raise Unsupported("LifecycleSWARadixCache: a draft model's SWA window is not supported")
            policy = str(params.eviction_policy).lower()
            if policy != "lru":
                raise Unsupported(f"LifecycleSWARadixCache: eviction_policy={policy!r}; only 'lru' is supported")
            allocator = params.token_to_kv_pool_allocator
            for name in ("free_swa", "free_full", "full_to_swa_index_mapping", "size_full", "size_swa"):
                if not hasattr(allocator, name):
                    raise ConfigError(f"LifecycleSWARadixCache: the allocator {type(allocator).__name__} has no "
                                      f"{name}: an SWA allocator (SWATokenToKVPoolAllocator) is needed")
            if getattr(allocator, "swa_req_ring", False):
                raise Unsupported("LifecycleSWARadixCache: a per-request SWA ring is not supported")
            self.disable = params.disable
            self.req_to_token_pool = params.req_to_token_pool
            self.token_to_kv_pool_allocator = allocator
            self.page_size: int = params.page_size
            self.is_eagle = False
            self.eviction_policy = policy
            self.sliding_window_size: int = int(window)
            self.enable_kv_cache_events = False
            self.device = torch.device(getattr(allocator, "device", "cpu"))
            ps = self.page_size
            self._tree = SWAPageTree(allocator.size_full // ps + 1, allocator.size_swa // ps + 1, ps,
                                     self.sliding_window_size, _SWARelease(allocator, self.device, ps))
            self._namespaces: CacheNamespaces[tuple[str | None, str | None]] = CacheNamespaces()
            self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
            if params.enable_metrics:
                self.init_metrics_collector()

        @property
        def tree(self) -> SWAPageTree:
            return self._tree

        @property
        def root_node(self) -> SWANode:
            return self._tree.root

        def supports_swa(self) -> bool:
            return True

        def _namespace(self, key: Any) -> int:
            return _key_namespace(self._namespaces, key)

        def _tokens(self, key: Any) -> Any:
            return _unigram_tokens(key, "LifecycleSWARadixCache")

        def reset(self) -> None:
            self._tree.reset()

        def match_prefix(self, params: Any) -> Any:
            """The longest cached prefix (whole pages) whose last ``sliding_window_size`` tokens
            have their SWA KV cached."""
            key = params.key
            if self.disable:
                node, full = self._tree.root, 0
            else:
                node, full = self._tree.match_pages(self._tokens(key), len(key), self._namespace(key))
            length = node.num_pages * self.page_size
            full *= self.page_size
            # SGLang's branch point: where the full KV goes on past the last window with SWA KV.
            return MatchResult(device_prefix_len=length, last_device_node=node, last_host_node=node,
                               best_match_node=node, full_kv_hit_length=full,
                               swa_branching_seqlen=full if full > length else None)

        def insert(self, params: Any) -> Any:
            """Cache ``params.value`` (full KV indices) under ``params.key``; the SWA KV of the
            tokens below the SWA component's evicted length (``component_evicted_seqlens``) is
            gone. ``prefix_len`` tokens were cached already: the caller's indices there, past
            ``prev_prefix_len``, are freed here (as SGLang's SWA cache does)."""
            if self.disable:
                return InsertResult(prefix_len=0)
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

            key = params.key
            tokens = self._tokens(key)
            value = params.value if params.value is not None else torch.tensor(list(tokens), dtype=torch.int64)
            evicted = params.component_evicted_seqlens.get(ComponentType.SWA, 0)
            cached, node = self._tree.insert(tokens, len(key), value.cpu(), self._namespace(key), evicted)
            ps = self.page_size
            # As SGLang's SWA cache: the caller's duplicates past ``prev_prefix_len`` are freed
            # here (full KV only below the SWA evicted length, whose SWA KV is gone).
            start, split = params.prev_prefix_len, min(max(evicted, params.prev_prefix_len), cached * ps)
            if params.value is not None:
                if split > start:
                    self.token_to_kv_pool_allocator.free_full(params.value[start:split])
                if cached * ps > split:
                    self.token_to_kv_pool_allocator.free(params.value[split:cached * ps])
            return InsertResult(prefix_len=cached * ps, total_len=len(key) // ps * ps, last_device_node=node)

        def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
            """Cache the request's KV up to row position ``up_to`` (whole pages), as
            ``UnifiedRadixCache.checkpoint_into_tree`` does with the FULL and SWA components: a
            running request (chunked prefill, ``cache_unfinished_req``'s place) first frees its
            SWA KV that left the window (``free_swa_out_of_window_slots``, with SGLang's
            ``SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS``), then the key goes in with the
            SWA evicted length (``req.kv``'s ``component_evicted_seqlens[SWA]``): the pages below
            it are cached without their SWA KV (tombstones). Duplicates past
            ``cache_protected_len`` are freed (full KV only below the evicted length), the row is
            pointed at the cache's indices, the request's lock moves to the new node and
            ``cache_protected_len`` / ``cache_inserted_len`` / ``last_node`` advance. Nothing past
            ``up_to``'s whole pages is freed here: ``release_kv_cache`` frees the rest."""
            if self.disable:
                return
            from sglang.srt.environ import envs
            from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
            from sglang.srt.mem_cache.radix_cache import RadixKey
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

            kv = req.kv
            ps = self.page_size
            fill = req.full_untruncated_fill_ids[:up_to]
            protected = kv.cache_protected_len
            running = not req.finished()
            free_window = running and envs.SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS.get()
            # SGLang's SWA branch point (the match's full-KV hit past its last SWA window): a
            # running request goes in up to it first, its window there kept, so that a later
            # prompt sharing exactly that prefix hits; the rest goes in at the next checkpoint. A
            # finished one goes in whole: what of that window it still has is kept either way.
            branch = getattr(req, "swa_branching_seqlen", None)
            at_branch = running and branch is not None and protected < branch <= len(fill)
            token_ids = fill[:branch] if at_branch else fill
            length = len(token_ids)

            def free_out_of_window(pre_len: int) -> None:
                free_swa_out_of_window_slots(
                    req, pre_len, sliding_window_size=self.swa_retain_window, page_size=ps,
                    req_to_token_pool=self.req_to_token_pool,
                    token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, retain_floor=None,
                )

            if free_window:
                free_out_of_window(length - 1)
            evicted = kv.get_evicted_seqlen(ComponentType.SWA)
            aligned = length // ps * ps
            if aligned <= protected:
                return
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            values = row[:aligned].to(dtype=torch.int64, copy=True)
            key = RadixKey(token_ids[:aligned], req.extra_key, cache_salt=req.cache_salt)
            result = self.insert(InsertParams(key=key, value=values, prev_prefix_len=protected,
                                              component_evicted_seqlens={ComponentType.SWA: evicted}))
            kv.cache_inserted_len = max(kv.cache_inserted_len, aligned)
            node = result.last_device_node
            # The path may end short of the key where no page past the cached part had a whole
            # window of SWA KV before it (the request freed it): those pages stay the request's.
            indices = self.path_device_indices(node)
            cached = len(indices)
            if cached < protected:
                raise InvariantViolation(f"checkpoint: the path holds {cached} indices, below the "
                                         f"{protected} the request's lock protects")
            if cached > protected:
                self.req_to_token_pool.write((kv.req_pool_idx, slice(protected, cached)), indices[protected:])
            self.unlock(req.lock)
            req.lock = self.lock(node)
            req.last_node = node
            kv.cache_protected_len = cached
            if at_branch:
                req.swa_branching_seqlen = None
                if free_window:  # the request's own SWA KV past the branch that left the window
                    free_out_of_window(len(fill) - 1)

        def evict(self, params: Any) -> Any:
            if self.disable:
                return EvictResult()
            ps = self.page_size
            full, swa = self._tree.evict(-(-params.num_tokens // ps), -(-params.swa_num_tokens // ps))
            return EvictResult(num_tokens_evicted=full * ps, swa_num_tokens_evicted=swa * ps)

        def inc_lock_ref(self, node: SWANode) -> Any:
            if self.disable or node.num_pages == 0:
                return IncLockRefResult(delta=0)
            handle, full, _ = self._tree.lock(node)
            return IncLockRefResult(delta=-full * self.page_size, node_id=handle)

        def dec_lock_ref(self, node: SWANode, params: Any = None) -> Any:
            if self.disable or node.num_pages == 0:
                return DecLockRefResult(delta=0)
            handle = getattr(params, "node_id", None)
            if handle is None:
                handle = self._tree.lock_of(node)
                if handle is None:
                    raise SequenceStateError("dec_lock_ref: no lock is held on the node")
            full, _ = self._tree.unlock(handle)
            return DecLockRefResult(delta=full * self.page_size)

        def path_device_indices(self, node: SWANode) -> Any:
            if node.num_pages == 0:
                return self._empty
            return torch.from_numpy(self._tree.values(node)).to(self.device)

        def supports_prefix_sharing(self) -> bool:
            return not self.disable

        def full_evictable_size(self) -> int:
            return (self._tree.cached_pages - self._tree.protected_pages) * self.page_size

        def swa_evictable_size(self) -> int:
            return (self._tree.cached_swa_pages - self._tree.protected_swa_pages) * self.page_size

        def full_protected_size(self) -> int:
            return self._tree.protected_pages * self.page_size

        def swa_protected_size(self) -> int:
            return self._tree.protected_swa_pages * self.page_size

        def evictable_size(self) -> int:
            return self.full_evictable_size()

        def protected_size(self) -> int:
            return self.full_protected_size()

        def total_size(self) -> tuple[int, int]:
            """Tokens cached, and of them those with their SWA KV (as ``UnifiedRadixCache``)."""
            return self._tree.cached_pages * self.page_size, self._tree.cached_swa_pages * self.page_size

        def pretty_print(self) -> None:
            print(f"LifecycleSWARadixCache: {self._tree.cached_pages * self.page_size} tokens cached, "
                  f"{self._tree.cached_swa_pages * self.page_size} with their SWA KV "
                  f"({self.full_protected_size()} / {self.swa_protected_size()} protected)")

        def sanity_check(self) -> None:
            self._tree.check_invariants()

        def check_invariants(self) -> None:
            self._tree.check_invariants()

    return LifecycleSWARadixCache
