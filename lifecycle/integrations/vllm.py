"""vLLM v1's ``KVCacheManager`` interface over lifecycle's KV cache core.

:class:`LifecycleKVCacheManager` takes the constructor arguments of vLLM's ``KVCacheManager`` and
answers the calls its scheduler makes: ``get_computed_blocks`` (the longest cached prefix in whole
blocks, never the prompt's last token), ``allocate_slots`` (None when the blocks cannot be had,
changing nothing), ``cache_blocks``, ``free``, ``reset_prefix_cache``, ``take_events`` (vLLM's own
event types), ``usage``, ``make_prefix_cache_stats``, ``get_blocks`` / ``get_block_ids``,
``get_num_common_prefix_blocks``, ``evict_blocks``. Block ids are the core's: block 0 is the null
block, as in vLLM, and ids 1.. are handed out.

What differs from vLLM's manager, by design: blocks are matched by their tokens (and the
request's LoRA adapter and cache salt), so requests need no block hasher (``block_hasher=None``
saves vLLM's per-block sha256); a multimodal request or one given by embeddings reuses and caches
only the blocks before its first placeholder (tokens do not name an image); the returned blocks
are :class:`Block` objects with a ``block_id`` (reference counts and hashes stay in the core);
eviction order is the core's (least recently used leaves first, once no block is free), so which
block id a request gets after an eviction may differ from vLLM's.

Several KV cache groups (vLLM's hybrid allocator: full attention or MLA with sliding-window and
chunked local groups, one block size) get :class:`LifecycleHybridKVCacheManager`, which the
constructor returns for such a config: one core of KV cache groups whose every group takes its ids
from one pool, as vLLM's groups share one ``BlockPool`` (an id names a page in every group's
tensors). A hit is the longest prefix every group serves; a group's table names the null block
where its window released a block; every group's full blocks are cached as vLLM caches them
(at ``allocate_slots`` and ``cache_blocks``), so a request hits another one still running.

One full-attention (or MLA) group with Mamba groups (Jamba, Nemotron-H, Qwen3-Next) gets
:class:`LifecycleMambaKVCacheManager`: the attention group is the core's, the Mamba groups' tables
are vLLM's ``MambaManager``'s (mode "align": the null block but at the running state's block, a
state cached at each block a computed chunk ends on; mode "none": one block a request), each state
one block per Mamba group from the same pool, cached under the content hash of the prefix it ends.
A hit is the longest prefix whose attention blocks are cached with a state at its end. Encoder-
decoder and cross-attention groups, a Mamba group beside windowed or several attention groups,
Mamba's speculative, checkpoint and sparse-retention blocks, partial hits (a hash block below the
block size), attention groups of different block sizes, a group layout with no full-attention
group, EAGLE and the other lookahead rules of speculative decoding, KV connectors, KV cache
residency metrics and context parallelism are refused with ``Unsupported``.

To run vLLM's own scheduler over it, name :func:`scheduler_class`'s classes to vLLM:
``--scheduler-cls lifecycle.integrations.vllm.LifecycleAsyncScheduler`` (vLLM's default
``AsyncScheduler``) or ``lifecycle.integrations.vllm.LifecycleScheduler`` (``Scheduler``, with
``--no-async-scheduling``).

Importing this module loads neither vLLM nor torch: ``make_prefix_cache_stats`` and ``take_events``
load vLLM to build its types; without vLLM :meth:`LifecycleKVCacheManager.from_blocks` makes a
manager for tests and replays.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from math import gcd
from typing import Any, Final, TypeAlias, final, overload

import numpy as np
import numpy.typing as npt

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import KVCacheCore
from lifecycle._retention import DEFAULT_RETENTION
from lifecycle.errors import ConfigError, InvalidId, OutOfBlocks, SequenceStateError, Unsupported
from lifecycle.integrations import CacheNamespaces, import_engine, raw_event_log

__all__ = [
    "Block", "BlockList", "Coordinator", "GroupManager", "KVCacheBlocks", "KVCacheGroupBlocks",
    "LifecycleHybridKVCacheManager", "LifecycleKVCacheManager", "LifecycleMambaKVCacheManager", "group_rule",
    "scheduler_class",
]

_EXTRA: Final = "vllm"
_EMPTY: Final = np.zeros(0, dtype=np.int32)
_WAITING_STATES: Final = frozenset({"WAITING", "PREEMPTED"})
#: What a manager's lookups and allocations return: one group's blocks, or several groups'.
AnyBlocks: TypeAlias = "KVCacheBlocks | KVCacheGroupBlocks"


@final
class Block:
    """One KV block as the scheduler sees it: its id (the null block is 0)."""

    __slots__ = ("block_id",)

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Block) and other.block_id == self.block_id

    def __hash__(self) -> int:
        return hash(self.block_id)

    def __repr__(self) -> str:
        return f"Block({self.block_id})"


@final
class BlockList(Sequence[Block]):
    """A group's blocks as a sequence of :class:`Block`, over an int32 array of ids (made into
    objects only when read one by one)."""

    __slots__ = ("ids",)

    def __init__(self, ids: npt.NDArray[np.int32]) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> Block: ...
    @overload
    def __getitem__(self, index: slice) -> BlockList: ...
    def __getitem__(self, index: int | slice) -> Block | BlockList:
        if isinstance(index, slice):
            return BlockList(self.ids[index])
        return Block(int(self.ids[index]))

    def __iter__(self) -> Iterator[Block]:
        return map(Block, self.ids.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockList):
            return bool(np.array_equal(self.ids, other.ids))
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockList({self.ids.tolist()})"


@final
class KVCacheBlocks:
    """What ``get_computed_blocks`` and ``allocate_slots`` return, shaped like vLLM's
    ``KVCacheBlocks``: ``blocks[0]`` is the one group's blocks."""

    __slots__ = ("ids",)

    def __init__(self, ids: npt.NDArray[np.int32] = _EMPTY) -> None:
        self.ids = ids

    @property
    def blocks(self) -> tuple[BlockList]:
        return (BlockList(self.ids),)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(np.concatenate((self.ids, other.ids)))

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None) -> Any:
        """``([id, ...],)``; None for no blocks when ``allow_none``."""
        if group_ids is not None and list(group_ids) != [0]:
            raise InvalidId(f"get_block_ids: group_ids={list(group_ids)}; this manager has one group, 0")
        if allow_none and len(self.ids) == 0:
            return None
        ids: list[int] = self.ids.tolist()
        return (ids,)

    def get_unhashed_block_ids(self) -> list[int]:
        """Every block id (whether a block is cached stays in the core)."""
        ids: list[int] = self.ids.tolist()
        return ids

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlocks) and bool(np.array_equal(self.ids, other.ids))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.ids.tolist()})"


@final
class _Live:
    """What the manager keeps of a request it allocated for: its core record, the tokens
    recorded in it, its blocks cached so far, and how many of its blocks may be cached."""

    __slots__ = ("handle", "recorded", "cached", "cacheable")

    def __init__(self, handle: int, recorded: int, cached: int, cacheable: int) -> None:
        self.handle = handle
        self.recorded = recorded
        self.cached = cached
        self.cacheable = cacheable


@final
class GroupManager:
    """What vLLM's engine reads of one of ``KVCacheManager.coordinator.single_type_managers``: the
    group's block size and KV cache spec."""

    __slots__ = ("block_size", "kv_cache_spec")

    def __init__(self, block_size: int, kv_cache_spec: Any) -> None:
        self.block_size = block_size
        self.kv_cache_spec = kv_cache_spec


@final
class Coordinator:
    """What vLLM's engine core and scheduler read of ``KVCacheManager.coordinator`` at start-up
    (the effective attention block size, the groups' metadata), one manager per group; the calls a
    KV connector makes on it are not here, as connectors are refused."""

    __slots__ = ("single_type_managers",)
    enable_partial_hash_hits: Final = False  # (a Mamba rule; read only for Mamba groups)

    def __init__(self, block_size: int, *kv_cache_specs: Any) -> None:
        self.single_type_managers = tuple(GroupManager(block_size, spec) for spec in kv_cache_specs)


def group_rule(spec: Any) -> tuple[str, int]:
    """A vLLM group's KV cache spec as the core's ``(kind, window)``: full attention (and MLA)
    ``("full", 0)``, a sliding window ``("sliding_window", window)``, chunked local attention
    ``("chunked_local", chunk)``; any other spec is refused with ``Unsupported`` naming it."""
    kind = type(spec).__name__
    if kind in ("FullAttentionSpec", "MLAAttentionSpec") and not getattr(spec, "sliding_window", None):
        return ("full", 0)
    if kind == "SlidingWindowSpec" and not getattr(spec, "extra_retained_tokens", 0):
        return ("sliding_window", int(spec.sliding_window))
    if kind == "ChunkedLocalAttentionSpec":
        return ("chunked_local", int(spec.attention_chunk_size))
    raise Unsupported(
        f"LifecycleKVCacheManager: a {kind} group; full attention, MLA, sliding-window and chunked local groups "
        "are supported (and Mamba groups beside one full-attention group, through LifecycleKVCacheManager)"
    )


def retention_priority(priority: int) -> int:
    """A vLLM request priority (lower is served first, 0 the default) as the retention priority
    of its blocks: the core's default (35) less the request's priority, within 0-100."""
    return min(100, max(0, DEFAULT_RETENTION - int(priority)))


class LifecycleKVCacheManager:
    """vLLM v1's ``KVCacheManager`` over a :class:`~lifecycle.KVCacheCore` (see the module's
    docstring). The arguments are ``KVCacheManager``'s; the core gets ``kv_cache_config.num_blocks``
    blocks (block 0 held as the null block) of the one group's ``block_size`` tokens."""

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int | None = None,
        hash_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        every = list(getattr(kv_cache_config, "kv_cache_groups", ()))
        groups = self._attention_groups(every, enable_caching, max_model_len)
        rules = [group_rule(group.kv_cache_spec) for group in groups]
        if all(kind != "full" for kind, _ in rules):
            names = ", ".join(type(group.kv_cache_spec).__name__ for group in every) or "none"
            raise Unsupported(
                f"LifecycleKVCacheManager: KV cache groups of {names}; a full-attention (or MLA) group is needed"
            )
        if len(groups) > 1 and not isinstance(self, LifecycleHybridKVCacheManager):
            raise Unsupported(
                f"LifecycleKVCacheManager: {len(groups)} KV cache groups; build it through its constructor"
            )
        spec = groups[0].kv_cache_spec
        if use_eagle or num_hash_lookahead_tokens or num_prefill_lookahead:
            raise Unsupported(
                f"LifecycleKVCacheManager: use_eagle={use_eagle}, "
                f"num_hash_lookahead_tokens={num_hash_lookahead_tokens}, "
                f"num_prefill_lookahead={num_prefill_lookahead}; EAGLE, hash lookahead and prefill lookahead "
                "(speculative decoding's cache rules) are not supported"
            )
        if metrics_collector is not None:
            raise Unsupported(
                f"LifecycleKVCacheManager: metrics_collector={type(metrics_collector).__name__}; KV cache residency "
                "metrics (kv_cache_metrics) sample vLLM's block pool, which the facade does not have"
            )
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise Unsupported(
                f"LifecycleKVCacheManager: dcp_world_size={dcp_world_size}, pcp_world_size={pcp_world_size}; "
                "context parallelism is not supported"
            )
        block_size = int(spec.block_size)
        sizes = sorted({int(group.kv_cache_spec.block_size) for group in groups})
        if len(sizes) > 1:
            raise Unsupported(
                f"LifecycleKVCacheManager: KV cache groups of block sizes {sizes}; one block size is needed"
            )
        scheduling = self._scheduling_block_size(block_size)
        for name, value in (("scheduler_block_size", scheduler_block_size), ("hash_block_size", hash_block_size)):
            if value is not None and value not in (block_size, scheduling):
                raise Unsupported(f"LifecycleKVCacheManager: {name}={value} differs from the block size {block_size}")
        if len(groups) > 1 and getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
            raise Unsupported(
                "LifecycleKVCacheManager: the KV cache config needs new blocks zeroed (mixed-precision groups)"
            )
        self._setup(int(kv_cache_config.num_blocks), block_size, max_model_len, enable_caching=enable_caching,
                    log_stats=log_stats, enable_kv_cache_events=enable_kv_cache_events, watermark=watermark,
                    rules=rules)
        self.kv_cache_config = kv_cache_config
        self.metrics_collector = None
        self.coordinator = Coordinator(block_size, *(group.kv_cache_spec for group in every))
        for manager in self.coordinator.single_type_managers:  # (a Mamba group's blocks may be longer)
            manager.block_size = int(getattr(manager.kv_cache_spec, "block_size", block_size))

    def __new__(cls, *args: Any, **kwargs: Any) -> LifecycleKVCacheManager:
        config = kwargs.get("kv_cache_config", args[0] if args else None)
        groups = getattr(config, "kv_cache_groups", ())
        if cls is LifecycleKVCacheManager and any(type(g.kv_cache_spec).__name__ == "MambaSpec" for g in groups):
            return super().__new__(LifecycleMambaKVCacheManager)
        if cls is LifecycleKVCacheManager and len(groups) > 1:
            return super().__new__(LifecycleHybridKVCacheManager)
        return super().__new__(cls)

    def _attention_groups(self, groups: list[Any], enable_caching: bool, max_model_len: int) -> list[Any]:
        """The groups the core serves (all of them here; a Mamba manager takes its own out)."""
        return groups

    def _scheduling_block_size(self, block_size: int) -> int:
        """The scheduler's block size besides the block size (none here)."""
        return block_size

    @classmethod
    def from_blocks(
        cls, num_blocks: int, block_size: int, max_model_len: int, *, enable_caching: bool = True,
        log_stats: bool = False, enable_kv_cache_events: bool = False, watermark: float = 0.0,
    ) -> LifecycleKVCacheManager:
        """A manager of ``num_blocks`` blocks (block 0 the null block) of ``block_size`` tokens,
        without a vLLM ``KVCacheConfig``."""
        manager = cls.__new__(cls)
        manager._setup(num_blocks, block_size, max_model_len, enable_caching=enable_caching, log_stats=log_stats,
                       enable_kv_cache_events=enable_kv_cache_events, watermark=watermark)
        manager.kv_cache_config = None
        manager.metrics_collector = None
        manager.coordinator = Coordinator(block_size, None)
        return manager

    @classmethod
    def from_groups(
        cls, rules: Sequence[tuple[str, int]], num_blocks: int, block_size: int, max_model_len: int, *,
        enable_caching: bool = True, log_stats: bool = False, enable_kv_cache_events: bool = False,
        watermark: float = 0.0,
    ) -> LifecycleKVCacheManager:
        """A manager of several KV cache groups without a vLLM ``KVCacheConfig``: ``rules`` gives
        each group's ``(kind, window)`` in vLLM's group order (``"full"`` with window 0,
        ``"sliding_window"`` or ``"chunked_local"``), all over one pool of ``num_blocks`` ids."""
        manager = super().__new__(LifecycleHybridKVCacheManager if len(rules) > 1 else cls)
        manager._setup(num_blocks, block_size, max_model_len, enable_caching=enable_caching, log_stats=log_stats,
                       enable_kv_cache_events=enable_kv_cache_events, watermark=watermark,
                       rules=[(str(kind), int(window)) for kind, window in rules])
        manager.kv_cache_config = None
        manager.metrics_collector = None
        manager.coordinator = Coordinator(block_size, *([None] * len(rules)))
        return manager

    def _setup(self, num_blocks: int, block_size: int, max_model_len: int, *, enable_caching: bool, log_stats: bool,
               enable_kv_cache_events: bool, watermark: float, rules: Sequence[tuple[str, int]] = ()) -> None:
        if type(max_model_len) is not int or max_model_len < 1:
            raise ConfigError(f"LifecycleKVCacheManager: max_model_len={max_model_len!r} must be an int >= 1")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0.0 <= watermark < 1.0:
            raise ConfigError(f"LifecycleKVCacheManager: watermark={watermark!r} must lie in [0, 1)")
        if type(num_blocks) is not int or num_blocks < 2:
            raise ConfigError(
                f"LifecycleKVCacheManager: num_blocks={num_blocks!r}; at least 2 are needed (one is the null block)"
            )
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = bool(enable_caching)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.log_stats = bool(log_stats)
        self.num_kv_cache_groups = 1
        self.watermark_blocks = int(watermark * num_blocks)
        self._pool = BlockPool(num_blocks)
        self.core = self._new_core(block_size, rules)
        self.empty_kv_cache_blocks: AnyBlocks = KVCacheBlocks()
        self.prefix_cache_stats = self._new_stats() if self.log_stats else None
        self._namespaces: CacheNamespaces[tuple[tuple[int, str] | None, str | None]] = CacheNamespaces()
        self._live: dict[str, _Live] = {}
        self._probe = -1  # the record of the last lookup, until allocate_slots takes it over
        self._probe_request: str | None = None

    def _new_core(self, block_size: int, rules: Sequence[tuple[str, int]]) -> KVCacheCore:
        if len(rules) > 1 or (rules and rules[0][0] != "full"):
            raise Unsupported(f"LifecycleKVCacheManager: KV cache groups {list(rules)}; one full-attention group here")
        return KVCacheCore(self._pool, block_size, enable_prefix_cache=self.enable_caching, null_block=True,
                           events=self.enable_kv_cache_events)

    # -- lookups and allocation -------------------------------------------------------------------

    def _namespace(self, request: Any) -> int:
        lora = request.lora_request
        salt = request.cache_salt
        if lora is None and salt is None:
            return 0
        lora_key = None if lora is None else (lora.lora_int_id, lora.lora_name)
        return self._namespaces.key((lora_key, salt))

    def _cacheable_tokens(self, request: Any) -> int:
        """Tokens whose blocks may be reused and cached: all, or those before the first
        multimodal placeholder (its tokens do not name the image); none for embeddings."""
        if getattr(request, "prompt_embeds", None) is not None:
            return 0
        features = request.mm_features
        if features:
            return min(int(feature.mm_position.offset) for feature in features)
        return 1 << 62

    @staticmethod
    def _tokens(request: Any) -> Any:
        """The request's token ids as a list the core converts in one C loop: the prompt's own
        list while there are no outputs (no copy), else a copy of all of them."""
        num_tokens = request.num_tokens
        prompt = request.prompt_token_ids
        if prompt is not None and len(prompt) == num_tokens:
            return prompt
        return request.all_token_ids[:num_tokens]

    def _settle(self) -> None:
        if self._probe >= 0:
            handle, self._probe, self._probe_request = self._probe, -1, None
            self.core.finish(handle, False)

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Whether a lookup may run for ``request`` (caching on, and the request reads the cache)."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[AnyBlocks, int, int]:
        """The request's longest cached prefix in whole blocks (at most ``max_cache_hit_length``
        tokens, by default all but the last token): its blocks, its token count, and 0 (no
        sparse-retention junction). Takes no block until ``allocate_slots``."""
        handle = self._probe_for(request, max_cache_hit_length)
        if handle < 0:
            return self.empty_kv_cache_blocks, 0, 0
        table = self.core.block_table(handle)
        return KVCacheBlocks(table), len(table) * self.block_size, 0

    def _probe_for(self, request: Any, max_cache_hit_length: int | None) -> int:
        """The handle of a probe record holding the request's longest cached prefix (kept as the
        probe ``allocate_slots`` takes over), or -1 when nothing is cached for it."""
        self._settle()
        if not self.prefix_cache_lookup_enabled(request):
            return -1
        num_tokens = request.num_tokens
        limit = num_tokens - 1 if max_cache_hit_length is None else min(max_cache_hit_length, num_tokens - 1)
        limit = min(limit, self._cacheable_tokens(request))
        bs = self.block_size
        if limit < bs:
            return -1
        core = self.core
        handle: int = core.admit(self._tokens(request), 0, limit // bs, self._namespace(request))
        if not core.num_blocks(handle):
            core.finish(handle, False)
            return -1
        self._probe, self._probe_request = handle, request.request_id
        return handle

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: AnyBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> AnyBlocks | None:
        """Blocks for ``num_new_tokens`` more tokens (and ``num_lookahead_tokens`` speculative
        ones) after the request's computed tokens and the ``num_new_computed_tokens`` of its
        cached prefix: the new blocks, or None, changing nothing, when they cannot be had (after
        evicting what may be evicted, less ``reserved_blocks`` and the watermark). The blocks of
        the tokens computed by then are cached (at most ``request.num_tokens``)."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise InvalidId("allocate_slots: num_new_tokens must be greater than 0 when there are no computed tokens")
        if num_external_computed_tokens or num_encoder_tokens:
            raise Unsupported("allocate_slots: KV connectors and encoder tokens are not supported")
        bs = self.block_size
        core = self.core
        request_id = request.request_id
        live = self._live.get(request_id)
        opened = -1
        if live is None:
            expected = num_new_computed_tokens // bs
            if num_new_computed_tokens % bs or (expected and not self.enable_caching):
                raise InvalidId(f"allocate_slots: {num_new_computed_tokens} computed tokens are not a cached prefix")
            if self._probe >= 0 and self._probe_request == request_id and core.num_blocks(self._probe) == expected:
                opened, self._probe, self._probe_request = self._probe, -1, None
            else:
                self._settle()
                opened = core.admit(self._tokens(request), 0, expected, self._namespace(request))
                if core.num_blocks(opened) != expected:
                    held = core.num_blocks(opened)
                    core.finish(opened, False)
                    raise SequenceStateError(
                        f"allocate_slots: request {request_id!r} was told of {expected} cached blocks, "
                        f"but {held} are cached now"
                    )
            handle, have = opened, expected
        else:
            self._settle()
            handle, have = live.handle, core.num_blocks(live.handle)
        computed = request.num_computed_tokens + num_new_computed_tokens
        needed = -(-min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len) // bs)
        available = self._pool.num_free + core.num_evictable_blocks - reserved_blocks
        wanted = needed
        if full_sequence_must_fit:
            wanted = max(wanted, -(-min(request.num_tokens, self.max_model_len) // bs))
        if self.watermark_blocks and has_scheduled_reqs and getattr(request.status, "name", None) in _WAITING_STATES:
            wanted += self.watermark_blocks
        if wanted - have > available:
            if opened >= 0:
                core.finish(opened, False)
            return None
        if needed > have:
            core.grow(handle, needed)
        if live is None:
            live = _Live(handle, request.num_tokens, have, self._cacheable_tokens(request) // bs)
            self._live[request_id] = live
            self._retain(request, handle)
        if not delay_cache_blocks:
            self._cache(request, live, min(computed + num_new_tokens, request.num_tokens))
        if needed <= have:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(core.block_table(handle)[have:needed])

    def _retain(self, request: Any, handle: int) -> None:
        """vLLM #47802: a request's priority reaches the cache. Its prompt and generated blocks
        keep :func:`retention_priority` of it (the default priority asks for nothing)."""
        priority = retention_priority(getattr(request, "priority", 0) or 0)
        prompt = self.core.prompt_len(handle)
        if priority != DEFAULT_RETENTION and prompt > 0:
            self.core.set_retention(handle, [(0, prompt, priority)], decode_priority=priority)

    def _cache(self, request: Any, live: _Live, num_tokens: int) -> None:
        """Record the request's tokens up to ``num_tokens`` and cache their full blocks."""
        if not self.enable_caching:
            return
        if num_tokens > live.recorded:
            self.core.append(live.handle, request.all_token_ids[live.recorded : num_tokens])
            live.recorded = num_tokens
        self._cache_full(live, num_tokens)

    def _cache_full(self, live: _Live | _HybridLive, num_tokens: int) -> None:
        """Cache the full blocks of the record's first ``num_tokens`` tokens (recorded already)."""
        full = min(num_tokens // self.block_size, live.cacheable)
        if full > live.cached:
            full = min(full, self.core.num_blocks(live.handle))
        if full > live.cached:
            self.core.cache(live.handle, full)
            live.cached = full

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Cache the full blocks of the request's first ``num_computed_tokens`` tokens."""
        live = self._live.get(request.request_id)
        if live is not None:
            self._settle()
            self._cache(request, live, min(num_computed_tokens, request.num_tokens))

    def free(self, request: Any) -> None:
        """Release the request's blocks; the ones it cached stay cached. Unknown requests are
        ignored, as vLLM does."""
        if self._probe_request == request.request_id:
            self._settle()
        live = self._live.pop(request.request_id, None)
        if live is not None:
            self._settle()
            self.core.finish(live.handle, False)

    # -- the whole cache --------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """The share of blocks in use by requests (cached blocks no request holds count as free,
        as in vLLM)."""
        self._settle()
        total = self.core.pool.num_total - 1
        return 1.0 - (self.core.pool.num_free + self.core.num_evictable_blocks) / total

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False, changing nothing, while any request holds blocks."""
        self._settle()
        if self._live or not self.core.reset():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks (and those cached after them) from the prefix cache. Ids that are
        not ints in the pool's range are refused (``InvalidId``) before anything is evicted."""
        try:
            ids = list(block_ids)
        except TypeError:
            raise InvalidId(f"evict_blocks: block_ids must be an iterable of ints, got {block_ids!r}") from None
        self._settle()
        self.core.evict_blocks(ids)  # checks every id first: a float, str or None is refused, not truncated

    def get_blocks(self, request_id: str) -> AnyBlocks:
        live = self._live.get(request_id)
        if live is None:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(self.core.block_table(live.handle))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        ids: tuple[list[int], ...] = self.get_blocks(request_id).get_block_ids()
        return ids

    def get_num_common_prefix_blocks(self, running_request_id: str | None = None) -> list[int]:
        """The leading blocks every live request shares (cascade attention's common prefix)."""
        handles = [live.handle for live in self._live.values()]
        return [self.core.num_common_prefix_blocks(handles) if handles else 0]

    def new_step_starts(self) -> None:
        """Nothing to do between steps."""

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request in cached blocks (hit at admission or cached since)."""
        live = self._live.get(request.request_id)
        return 0 if live is None else live.cached * self.block_size

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """Copy-on-write copies to run: none (full attention never writes a shared block)."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba boundary states for a connector: none (full attention only)."""
        return {}

    def take_new_block_ids(self) -> list[int]:
        """Blocks to zero: none (full attention never reads a block before writing it)."""
        return []

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Nothing to skip with full attention."""

    def create_kv_cache_blocks(self, blocks: Any) -> AnyBlocks:
        ids = np.fromiter((block.block_id for block in itertools.chain.from_iterable(blocks)), dtype=np.int32)
        return KVCacheBlocks(ids) if len(ids) else self.empty_kv_cache_blocks

    # -- statistics and events ----------------------------------------------------------------------

    def _new_stats(self) -> Any:
        import_engine("vllm", _EXTRA)
        from vllm.v1.metrics.stats import PrefixCacheStats

        return PrefixCacheStats()

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Count a lookup (vLLM's scheduler calls this after ``get_computed_blocks``)."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def make_prefix_cache_stats(self) -> Any:
        """vLLM's ``PrefixCacheStats`` since the last call (None unless ``log_stats``)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._new_stats()
        return stats

    def take_events(self) -> list[Any]:
        """vLLM's KV events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) since the
        last call, oldest first, naming blocks by lifecycle's content hashes; empty unless
        ``enable_kv_cache_events``."""
        if not self.enable_kv_cache_events:
            return []
        self._settle()
        raw = self.core.take_events()
        if len(raw) == 0:
            return []
        import_engine("vllm", _EXTRA)
        from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

        events: list[Any] = []
        groups = self._event_groups(raw)
        for entry, group in zip(raw_event_log(raw), groups):
            if entry[0] == "stored":
                _, hashes, parent, tokens, namespace = entry
                lora, salt = self._namespaces.namespace(int(namespace)) or (None, None)
                # vLLM names a request's cache salt in the extra keys of its first block
                first = parent is None and salt is not None and len(hashes) > 0
                events.append(BlockStored(
                    block_hashes=hashes.tolist(), parent_block_hash=None if parent is None else int(parent),
                    token_ids=tokens.tolist(), block_size=self.block_size,
                    lora_id=None if lora is None else lora[0], medium=MEDIUM_GPU,
                    lora_name=None if lora is None else lora[1],
                    extra_keys=[(salt,), *[None] * (len(hashes) - 1)] if first else None, group_idx=group,
                ))
            elif entry[0] == "removed":
                events.append(BlockRemoved(block_hashes=entry[1].tolist(), medium=MEDIUM_GPU, group_idx=group))
            else:
                events.append(AllBlocksCleared())
        return events

    def _event_groups(self, raw: Any) -> Iterable[int]:
        """vLLM's group index of each entry of a drained core log."""
        return itertools.repeat(0)

    def check_invariants(self) -> None:
        """The core's recount, and one live core record per request holding blocks."""
        self._settle()
        self.core.check_invariants()
        if self.core.num_live_sequences != len(self._live):
            raise SequenceStateError(
                f"{self.core.num_live_sequences} core records are live for {len(self._live)} requests"
            )


@final
class KVCacheGroupBlocks:
    """``KVCacheBlocks`` of a manager of several KV cache groups: ``blocks[i]`` is vLLM group
    ``i``'s blocks (the null block, id 0, where a window needs none), over one int32 array of ids
    per group."""

    __slots__ = ("ids",)

    def __init__(self, ids: tuple[npt.NDArray[np.int32], ...]) -> None:
        self.ids = ids

    @property
    def blocks(self) -> tuple[BlockList, ...]:
        return tuple(BlockList(ids) for ids in self.ids)

    def __add__(self, other: KVCacheGroupBlocks) -> KVCacheGroupBlocks:
        return KVCacheGroupBlocks(tuple(np.concatenate(pair) for pair in zip(self.ids, other.ids)))

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None) -> Any:
        """One list of ids per group (``group_ids``: those groups); None for no blocks when ``allow_none``."""
        if group_ids is None:
            chosen = self.ids
        else:
            if any(not 0 <= g < len(self.ids) for g in group_ids):
                raise InvalidId(f"get_block_ids: group_ids={list(group_ids)}; this manager has {len(self.ids)} groups")
            chosen = tuple(self.ids[g] for g in group_ids)
        if allow_none and all(len(ids) == 0 for ids in chosen):
            return None
        return tuple(ids.tolist() for ids in chosen)

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Every group's ids but the null block (whether a block is cached stays in the core)."""
        return [ids[ids != 0].tolist() for ids in self.ids]

    def new_empty(self) -> KVCacheGroupBlocks:
        return KVCacheGroupBlocks(tuple(_EMPTY for _ in self.ids))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheGroupBlocks) and len(self.ids) == len(other.ids) and all(
            np.array_equal(a, b) for a, b in zip(self.ids, other.ids)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KVCacheGroupBlocks({[ids.tolist() for ids in self.ids]})"


@final
class _HybridLive:
    """``_Live`` of a manager of several groups, with the request (its windows move as its
    committed tokens are told to the core, also from ``remove_skipped_blocks``, which names only
    its id) and how many tokens its KV covers in the core's record (``committed``)."""

    __slots__ = ("handle", "recorded", "cached", "cacheable", "request", "committed")

    def __init__(self, handle: int, recorded: int, cached: int, cacheable: int, request: Any, committed: int) -> None:
        self.handle = handle
        self.recorded = recorded
        self.cached = cached
        self.cacheable = cacheable
        self.request = request
        self.committed = committed


class LifecycleHybridKVCacheManager(LifecycleKVCacheManager):
    """:class:`LifecycleKVCacheManager` of a ``KVCacheConfig`` with several KV cache groups (what
    its constructor returns for one): full attention (and MLA) with sliding-window and chunked
    local groups, over one core of KV cache groups whose every group takes its ids from one
    ``BlockPool`` of ``num_blocks`` (vLLM's layout: an id names a page in every group's tensors,
    so it serves one group at a time). vLLM's first full-attention group is the core's group 0.

    A request's core record holds the tokens whose KV is computed (committed: less
    ``num_in_flight_tokens``); recording them moves its windows, which gives back the blocks that
    left them (the null block in vLLM's tables from then on): at ``allocate_slots`` and
    ``remove_skipped_blocks``, as vLLM moves its windows. The record also holds the known tokens
    scheduled past them, so every group's full blocks are cached as vLLM caches them (at
    ``allocate_slots``, unless ``delay_cache_blocks``, and ``cache_blocks``); a block that then
    leaves a window stays cached, evictable, and ``free`` caches nothing more. A hit is the
    longest prefix every group serves."""

    _order: tuple[int, ...]
    _vllm_group: tuple[int, ...]
    _full: tuple[bool, ...]

    def _new_core(self, block_size: int, rules: Sequence[tuple[str, int]]) -> KVCacheCore:
        first = next((i for i, (kind, _) in enumerate(rules) if kind == "full"), -1)
        if first < 0:
            raise Unsupported(
                f"LifecycleKVCacheManager: KV cache groups {list(rules)}; a full-attention group is needed"
            )
        rest = [i for i in range(len(rules)) if i != first]
        self._vllm_group = (first, *rest)  # by core group
        self._order = tuple(self._vllm_group.index(i) for i in range(len(rules)))  # by vLLM group
        self._full = tuple(kind == "full" for kind, _ in rules)
        self.num_kv_cache_groups = len(rules)
        return KVCacheCore(
            self._pool, block_size, enable_prefix_cache=self.enable_caching, null_block=True,
            events=self.enable_kv_cache_events, groups=[(*rules[i], 0, self._pool) for i in rest],
        )

    def _setup(self, num_blocks: int, block_size: int, max_model_len: int, *, enable_caching: bool, log_stats: bool,
               enable_kv_cache_events: bool, watermark: float, rules: Sequence[tuple[str, int]] = ()) -> None:
        super()._setup(num_blocks, block_size, max_model_len, enable_caching=enable_caching, log_stats=log_stats,
                       enable_kv_cache_events=enable_kv_cache_events, watermark=watermark, rules=rules)
        self.empty_kv_cache_blocks = KVCacheGroupBlocks(tuple(_EMPTY for _ in rules))
        self._hybrid: dict[str, _HybridLive] = {}
        self._live = self._hybrid  # type: ignore[assignment]

    def _blocks(self, handle: int, start: int, stop: int | None = None) -> KVCacheGroupBlocks:
        """The record's ids at ``[start, stop)`` of every vLLM group, the null block where a window needs none."""
        core = self.core
        return KVCacheGroupBlocks(tuple(
            np.maximum(core.block_table(handle, g)[start:stop], 0) for g in self._order
        ))

    def _record(self, live: _HybridLive, committed: int, num_tokens: int = 0) -> None:
        """Record the request's tokens up to ``num_tokens`` (at most those it has; the blocks to
        cache hold them) and tell the core its KV covers the first ``committed`` (the rest are in
        flight, still in every window): each window gives back what left it."""
        request = live.request
        num_tokens = min(max(num_tokens, committed), request.num_tokens)
        committed = min(committed, max(num_tokens, live.recorded))
        if num_tokens <= live.recorded and committed <= live.committed:
            return
        tokens = request.all_token_ids[live.recorded : num_tokens] if num_tokens > live.recorded else _EMPTY
        self.core.append(live.handle, tokens, max(committed, live.committed))
        live.recorded = max(live.recorded, num_tokens)
        live.committed = max(committed, live.committed)

    def _cache(self, request: Any, live: _Live | _HybridLive, num_tokens: int) -> None:
        """Record the request's tokens up to ``num_tokens`` and cache their full blocks in every
        group, as vLLM caches each group's as it fills. The windows stay where they are: vLLM
        moves them at ``allocate_slots`` and ``remove_skipped_blocks`` only."""
        if not self.enable_caching:
            return
        hybrid = self._hybrid[request.request_id]
        self._record(hybrid, hybrid.committed, num_tokens)
        self._cache_full(hybrid, min(num_tokens, hybrid.recorded))

    @staticmethod
    def _committed(request: Any) -> int:
        committed: int = request.num_computed_tokens - (getattr(request, "num_in_flight_tokens", 0) or 0)
        return max(0, committed)

    def _held(self, *handles: int) -> int:
        """Distinct ids live requests (and ``handles``) hold, the null block aside."""
        core = self.core
        tables = [core.block_table(live.handle, g) for live in self._hybrid.values() for g in range(len(self._order))]
        tables += [core.block_table(h, g) for h in handles for g in range(len(self._order))]
        if not tables:
            return 0
        ids = np.concatenate(tables)
        held: int = np.unique(ids[ids > 0]).size
        return held

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[AnyBlocks, int, int]:
        """The longest cached prefix every group serves (see the base class), per group."""
        handle = self._probe_for(request, max_cache_hit_length)
        if handle < 0:
            return self.empty_kv_cache_blocks, 0, 0
        return self._blocks(handle, 0), self.core.num_blocks(handle) * self.block_size, 0

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> AnyBlocks | None:
        """As the base class, in every group at once: the committed tokens are recorded first (what
        left a window goes back to the pool), then every group gets blocks for the new positions."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise InvalidId("allocate_slots: num_new_tokens must be greater than 0 when there are no computed tokens")
        if num_external_computed_tokens or num_encoder_tokens:
            raise Unsupported("allocate_slots: KV connectors and encoder tokens are not supported")
        bs = self.block_size
        core = self.core
        request_id = request.request_id
        live = self._hybrid.get(request_id)
        handle: int
        opened: int = -1
        if live is None:
            expected = num_new_computed_tokens // bs
            if num_new_computed_tokens % bs or (expected and not self.enable_caching):
                raise InvalidId(f"allocate_slots: {num_new_computed_tokens} computed tokens are not a cached prefix")
            # The record holds the hit's tokens and the one after (a lookup never hits a record's last
            # token); the rest are recorded as their KV is computed.
            recorded = min(expected * bs + 1, request.num_tokens)
            opened = core.admit(self._tokens(request)[:recorded], 0, expected, self._namespace(request))
            self._settle()  # the lookup's probe, now that the new record holds the hit
            if core.num_blocks(opened) != expected:
                held = core.num_blocks(opened)
                core.finish(opened, False)
                raise SequenceStateError(
                    f"allocate_slots: request {request_id!r} was told of {expected} cached blocks, "
                    f"but {held} are cached now"
                )
            handle, have = opened, expected
        else:
            self._settle()
            handle = live.handle
            self._record(live, self._committed(request))  # before allocating: what left a window is free
            have = core.num_blocks(handle)
        computed = request.num_computed_tokens + num_new_computed_tokens
        needed = -(-min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len) // bs)
        wanted = needed
        if full_sequence_must_fit:
            wanted = max(wanted, -(-min(request.num_tokens, self.max_model_len) // bs))
        required = max(wanted - have, 0) * len(self._order)
        if self.watermark_blocks and has_scheduled_reqs and getattr(request.status, "name", None) in _WAITING_STATES:
            required += self.watermark_blocks
        pool = self._pool
        if required + reserved_blocks > pool.num_free:
            extra = (opened,) if opened >= 0 else ()
            if required > pool.num_total - 1 - self._held(*extra) - reserved_blocks:
                if opened >= 0:
                    core.finish(opened, False)
                return None
        if needed > have:
            try:
                core.grow(handle, needed)
            except OutOfBlocks:
                if opened >= 0:
                    core.finish(opened, False)
                return None
        if live is None:
            cacheable = self._cacheable_tokens(request) // bs
            live = _HybridLive(handle, recorded, expected, cacheable, request, expected * bs)
            self._hybrid[request_id] = live
            self._retain(request, handle)
        if not delay_cache_blocks:
            self._cache(request, live, min(computed + num_new_tokens, request.num_tokens))
        if needed <= have:
            return self.empty_kv_cache_blocks
        return self._blocks(handle, have, needed)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """The request's KV covers ``processed_computed_tokens``: what left a window goes back
        (to the cache where it was cached, else to the pool)."""
        live = self._hybrid.get(request_id)
        if live is not None:
            self._settle()
            self._record(live, processed_computed_tokens)

    @property
    def usage(self) -> float:
        """The share of blocks in use by requests, every group's (cached blocks no request holds
        count as free, as in vLLM)."""
        self._settle()
        return self._held() / (self._pool.num_total - 1)

    def get_blocks(self, request_id: str) -> AnyBlocks:
        live = self._hybrid.get(request_id)
        if live is None:
            return self.empty_kv_cache_blocks
        return self._blocks(live.handle, 0)

    def get_num_common_prefix_blocks(self, running_request_id: str | None = None) -> list[int]:
        """Per group: the leading blocks every live request shares in a full-attention group; 0 in a windowed one."""
        handles = [live.handle for live in self._hybrid.values()]
        shared = self.core.num_common_prefix_blocks(handles) if handles else 0
        return [shared if full else 0 for full in self._full]

    def create_kv_cache_blocks(self, blocks: Any) -> AnyBlocks:
        return KVCacheGroupBlocks(tuple(
            np.fromiter((block.block_id for block in group), dtype=np.int32) for group in blocks
        ))

    def _event_groups(self, raw: Any) -> Iterable[int]:
        groups: list[int] = raw.entries["group"].tolist()
        return [self._vllm_group[g] for g in groups]


@final
class _MambaLive:
    """A request's Mamba block table as vLLM's ``MambaManager`` keeps it, the same in every Mamba
    group (they move in step): its length, the positions that name blocks (each a Mamba state:
    one block per Mamba group, held by a core record of no tokens) and the align mode's counts
    (``allocated``, ``last_state``, ``retired``, ``cached``: ``_allocated_block_reqs``,
    ``last_state_block_idx``, ``_num_retired_blocks``, ``num_cached_block``)."""

    __slots__ = ("length", "held", "allocated", "last_state", "retired", "cached")

    def __init__(self) -> None:
        self.length = 0
        self.held: dict[int, int] = {}
        self.allocated = False
        self.last_state = -1
        self.retired = 0
        self.cached = 0


class LifecycleMambaKVCacheManager(LifecycleKVCacheManager):
    """:class:`LifecycleKVCacheManager` of a ``KVCacheConfig`` with one full-attention (or MLA)
    group and Mamba groups (what its constructor returns for one), every group's ids from one
    pool. The attention group is the core's (its hits, caching and eviction as for one group); the
    Mamba groups are kept here, as vLLM's ``MambaManager`` keeps them:

    - ``mamba_cache_mode="align"`` (prefix caching): a request's Mamba table is position-indexed
      by block, the null block everywhere but at the block holding its running state (and the
      one before it until ``remove_skipped_blocks`` passes it): ``allocate_slots`` adds one block
      when the tokens reach a new block, padding with null blocks up to it; a block whose tokens
      are computed is cached as the state after its last token (vLLM's scheduler ends prefill
      chunks on block boundaries for this), keyed by the content hash of the prefix it ends
      (lifecycle's, of the attention record's tokens, LoRA and salt). A hit is the longest prefix
      whose attention blocks are cached and whose last block has a Mamba state: the attention hit
      first, then the deepest state within it (one set lookup over its hashes), then the attention
      record cut there. The hit's table names the null block but at its last position, the state;
      ``get_computed_blocks``' third value is the attention hit where it is longer (vLLM's
      shared-prefix boundary, where the scheduler ends the next chunk so its state is cached). A
      state cached this step is not a hit until ``new_step_starts`` (``allocate_slots`` answers
      None, as vLLM does).
    - ``mamba_cache_mode="none"`` (no prefix caching; the Mamba block is the model length): one
      block per Mamba group for each request, from its first ``allocate_slots`` to its ``free``.

    Every Mamba group's state is one unit here: its blocks (one per Mamba group) are taken,
    cached, hit and evicted together (vLLM keeps each group's block in its one free queue, so under
    pressure it may evict one group's and keep another's, a hit then needing all). What differs,
    by design: a cached state no request holds is evicted only when the core has no evictable
    attention block left, least recently used first (vLLM evicts its one free queue's oldest,
    attention or Mamba); a request that missed for want of a state recomputes a prefix whose
    attention blocks are cached, and the core keeps those cached-only ancestors of its cached path
    while it lives (vLLM counts them free: ``usage`` is that much higher, and under pressure the
    schedules part); each state is a core record (``core.num_live_sequences`` counts them).
    ``take_new_block_ids`` names the attention group's new blocks, for the worker to zero, as
    vLLM's manager does for a config with Mamba layers. Refused with ``Unsupported``: a Mamba
    group beside sliding-window, chunked local or several attention groups; Mamba groups of
    different specs; speculative (``num_speculative_blocks``) and prefill checkpoint blocks;
    sparse retention (``prefix_cache_retention_interval``); a hash block size below the block size
    (partial hits); KV cache events."""

    _mamba_groups: tuple[int, ...]
    _attention_group: int
    _align: bool
    _mamba_block_size: int

    def __init__(self, kv_cache_config: Any, max_model_len: int, *args: Any, **kwargs: Any) -> None:
        interval = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
        if interval is not None:
            raise Unsupported(
                f"LifecycleKVCacheManager: prefix_cache_retention_interval={interval!r} with Mamba groups; "
                "sparse retention of Mamba states is not supported (None: every state cached)"
            )
        events = kwargs.get("enable_kv_cache_events", args[8] if len(args) > 8 else False)
        if events:
            raise Unsupported(
                "LifecycleKVCacheManager: enable_kv_cache_events=True with Mamba groups; KV cache events of "
                "Mamba states are not supported"
            )
        super().__init__(kv_cache_config, max_model_len, *args, **kwargs)

    def _attention_groups(self, groups: list[Any], enable_caching: bool, max_model_len: int) -> list[Any]:
        mamba = [i for i, group in enumerate(groups) if type(group.kv_cache_spec).__name__ == "MambaSpec"]
        others = [i for i in range(len(groups)) if i not in mamba]
        if len(others) != 1:
            names = ", ".join(type(groups[i].kv_cache_spec).__name__ for i in others) or "none"
            raise Unsupported(
                f"LifecycleKVCacheManager: Mamba groups beside {names}; Mamba groups are supported beside one "
                "full-attention (or MLA) group"
            )
        first = groups[mamba[0]].kv_cache_spec
        mode = getattr(first, "mamba_cache_mode", "none")
        for i in mamba:
            spec = groups[i].kv_cache_spec
            if getattr(spec, "mamba_cache_mode", "none") not in ("align", "none"):
                raise Unsupported(
                    f"LifecycleKVCacheManager: mamba_cache_mode={spec.mamba_cache_mode!r}; 'align' and 'none' are "
                    "supported"
                )
            for name in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
                if getattr(spec, name, 0):
                    raise Unsupported(
                        f"LifecycleKVCacheManager: a Mamba group with {name}={getattr(spec, name)}; speculative and "
                        "prefill checkpoint blocks are not supported"
                    )
            if spec.block_size != first.block_size or spec.mamba_cache_mode != mode:
                raise Unsupported(
                    f"LifecycleKVCacheManager: Mamba groups of block sizes {first.block_size} and {spec.block_size}, "
                    f"modes {mode!r} and {spec.mamba_cache_mode!r}; one Mamba spec is needed"
                )
        attention = int(groups[others[0]].kv_cache_spec.block_size)
        size = int(first.block_size)
        if mode == "none" and enable_caching:
            raise ConfigError(
                "LifecycleKVCacheManager: mamba_cache_mode='none' with enable_caching=True; prefix caching with Mamba "
                "groups needs mamba_cache_mode='align' (vLLM's MambaManager asserts it too)"
            )
        if mode == "align" and size != attention:
            raise Unsupported(
                f"LifecycleKVCacheManager: a Mamba block size of {size} beside an attention block size of "
                f"{attention}; mamba_cache_mode='align' needs one block size"
            )
        if mode == "none" and size < max_model_len:
            raise Unsupported(
                f"LifecycleKVCacheManager: a Mamba block size of {size} below max_model_len={max_model_len} with "
                "mamba_cache_mode='none'; one Mamba block a request is supported"
            )
        self._mamba_groups = tuple(mamba)
        self._attention_group = others[0]
        self._align = mode == "align"
        self._mamba_block_size = size
        return [groups[others[0]]]

    def _scheduling_block_size(self, block_size: int) -> int:
        """vLLM's scheduler block size: the least common multiple of the groups' block sizes."""
        return block_size * self._mamba_block_size // gcd(block_size, self._mamba_block_size)

    def _setup(self, num_blocks: int, block_size: int, max_model_len: int, *, enable_caching: bool, log_stats: bool,
               enable_kv_cache_events: bool, watermark: float, rules: Sequence[tuple[str, int]] = ()) -> None:
        super()._setup(num_blocks, block_size, max_model_len, enable_caching=enable_caching, log_stats=log_stats,
                       enable_kv_cache_events=enable_kv_cache_events, watermark=watermark, rules=rules)
        self.num_kv_cache_groups = 1 + len(self._mamba_groups)
        self.empty_kv_cache_blocks = KVCacheGroupBlocks(tuple(_EMPTY for _ in range(self.num_kv_cache_groups)))
        self._mamba: dict[str, _MambaLive] = {}
        self._refs: dict[int, int] = {}  # a state's record: the requests holding it, and the cache
        self._state_ids: dict[int, npt.NDArray[np.int32]] = {}  # its block in each Mamba group
        self._owner: dict[int, int] = {}  # block id: the state's record holding it
        self._states: dict[int, int] = {}  # content hash of a prefix: the state cached at its end
        self._state_keys: dict[int, int] = {}  # the reverse
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached states no request holds, oldest first
        self._this_step: set[int] = set()
        self._zero: list[npt.NDArray[np.int32]] = []

    # -- Mamba states -------------------------------------------------------------------------------

    def _new_state(self) -> int:
        """A state's record holding a fresh block for every Mamba group (room made by the caller)."""
        core = self.core
        handle: int = core.open()
        try:
            core.grow(handle, len(self._mamba_groups))
        except BaseException:
            core.finish(handle, False)
            raise
        ids = core.block_table(handle)
        self._refs[handle] = 1
        self._state_ids[handle] = ids
        for block_id in ids.tolist():
            self._owner[block_id] = handle
        return handle

    def _acquire(self, handle: int) -> None:
        self._refs[handle] += 1
        self._evictable.pop(handle, None)

    def _release(self, handle: int) -> None:
        """Drop one holder of the state: freed when none is left, evictable when only the cache is."""
        refs = self._refs[handle] - 1
        if refs:
            self._refs[handle] = refs
            if refs == 1 and handle in self._state_keys:
                self._evictable[handle] = None
            return
        del self._refs[handle]
        for block_id in self._state_ids.pop(handle).tolist():
            del self._owner[block_id]
        self.core.finish(handle, False)

    def _uncache(self, handle: int) -> None:
        """Take the state out of the cache (its blocks go when no request holds them)."""
        del self._states[self._state_keys.pop(handle)]
        self._evictable.pop(handle, None)
        self._release(handle)

    def _make_room(self, blocks: int) -> None:
        """Evict cached states no request holds, least recently used first, until ``blocks`` can
        be had from the pool and the core's evictable attention blocks."""
        pool, core, per = self._pool, self.core, len(self._mamba_groups)
        short = blocks - pool.num_free - core.num_evictable_blocks
        while short > 0 and self._evictable:
            self._uncache(next(iter(self._evictable)))
            short -= per

    def _state_cut(self, handle: int, blocks: int) -> int:
        """The deepest cut within the record's first ``blocks`` with a state cached at its end."""
        if not self._states or blocks == 0:
            return 0
        hashes = self.core.block_hashes(handle)[:blocks]
        common = self._states.keys() & hashes.tolist()
        if not common:
            return 0
        return int(np.flatnonzero(np.isin(hashes, np.fromiter(common, dtype=np.uint64)))[-1]) + 1

    def _columns(self, mamba: _MambaLive | None, start: int, stop: int) -> npt.NDArray[np.int32]:
        """Every Mamba group's ids at positions ``[start, stop)`` (a row a group)."""
        columns = np.zeros((len(self._mamba_groups), max(stop - start, 0)), dtype=np.int32)
        if mamba is not None:
            for position, handle in mamba.held.items():
                if start <= position < stop:
                    columns[:, position - start] = self._state_ids[handle]
        return columns

    def _group_blocks(self, attention: npt.NDArray[np.int32], columns: npt.NDArray[np.int32]) -> KVCacheGroupBlocks:
        ids: list[npt.NDArray[np.int32]] = [_EMPTY] * self.num_kv_cache_groups
        ids[self._attention_group] = attention
        for row, group in enumerate(self._mamba_groups):
            ids[group] = columns[row]
        return KVCacheGroupBlocks(tuple(ids))

    def _mamba_need(self, mamba: _MambaLive, hit: int, main_tokens: int, slot_tokens: int) -> int:
        """Blocks each Mamba group takes for the request (vLLM's ``get_num_blocks_to_allocate``,
        less its evictable hit): at most one in align mode, negative where blocks were
        over-allocated before."""
        if self._align:
            new = -(-main_tokens // self.block_size) - hit - mamba.length
            return min(new, 1) if new > 0 else new
        return max(-(-slot_tokens // self._mamba_block_size) - mamba.length, 0)

    def _mamba_allocate(self, mamba: _MambaLive, main_tokens: int, slot_tokens: int) -> npt.NDArray[np.int32]:
        """vLLM's ``MambaManager.allocate_new_blocks``: the table's new positions, every group's."""
        if not self._align:
            required = -(-slot_tokens // self._mamba_block_size)
            start = mamba.length
            for position in range(start, required):
                mamba.held[position] = self._new_state()
            mamba.length = max(required, start)
            return self._columns(mamba, start, mamba.length)
        required = -(-main_tokens // self.block_size)
        if required <= mamba.length:
            mamba.allocated = True
            return self._columns(None, 0, 0)
        start = mamba.length
        if start > 0:
            mamba.last_state = start - 1  # the state the model runner copies into the new block
        mamba.held[required - 1] = self._new_state()
        mamba.length = required
        mamba.allocated = True
        return self._columns(mamba, start, required)

    def _mamba_remove(self, mamba: _MambaLive, processed: int) -> None:
        """vLLM's align-mode ``remove_skipped_blocks``: blocks before the one holding the last
        processed token's state, and the state two steps back, go (the cache keeps its own)."""
        if not self._align:
            return
        bs = self.block_size
        skipped = min((processed - 1) // bs, mamba.length) if processed > 1 else 0
        first = mamba.retired
        if first < skipped:
            for position in sorted((p for p in mamba.held if first <= p < skipped), reverse=True):
                self._release(mamba.held.pop(position))
            mamba.retired = skipped
        last = mamba.last_state
        if 0 <= last < -(-processed // bs) - 1 and last in mamba.held:
            self._release(mamba.held.pop(last))

    def _cache(self, request: Any, live: _Live, num_tokens: int) -> None:
        """The attention blocks (the base class), then the Mamba states of the blocks computed by
        ``num_tokens`` (vLLM's ``MambaManager.cache_blocks``; not past the attention blocks that
        may be cached)."""
        super()._cache(request, live, num_tokens)
        mamba = self._mamba.get(request.request_id)
        if not self.enable_caching or not self._align or mamba is None:
            return
        full = num_tokens // self.block_size
        if full <= mamba.cached:
            return
        limit = min(full, live.cacheable, self.core.num_blocks(live.handle))
        positions = sorted(p for p in mamba.held if mamba.cached <= p < limit)
        mamba.cached = full
        if not positions:
            return
        hashes = self.core.block_hashes(live.handle)
        for position in positions:
            key = int(hashes[position])
            self._this_step.add(key)
            handle = mamba.held[position]
            if handle not in self._state_keys and key not in self._states:
                self._states[key] = handle
                self._state_keys[handle] = key
                self._refs[handle] += 1

    # -- the scheduler's calls ----------------------------------------------------------------------

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[AnyBlocks, int, int]:
        """The longest prefix whose attention blocks are cached with a Mamba state at its end (see
        the class), per group, and vLLM's shared-prefix boundary: the attention hit where it is
        longer, else 0."""
        handle = self._probe_for(request, max_cache_hit_length)
        if handle < 0:
            return self.empty_kv_cache_blocks, 0, 0
        core = self.core
        attention = core.num_blocks(handle)
        cut = self._state_cut(handle, attention)
        while cut < core.num_blocks(handle):
            self._settle()
            if cut == 0:
                return self.empty_kv_cache_blocks, 0, attention * self.block_size
            handle = core.admit(self._tokens(request), 0, cut, self._namespace(request))
            self._probe, self._probe_request = handle, request.request_id
            cut = self._state_cut(handle, core.num_blocks(handle))
        columns = np.zeros((len(self._mamba_groups), cut), dtype=np.int32)
        columns[:, cut - 1] = self._state_ids[self._states[int(core.block_hashes(handle)[cut - 1])]]
        boundary = attention * self.block_size if attention > cut else 0
        return self._group_blocks(core.block_table(handle), columns), cut * self.block_size, boundary

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> AnyBlocks | None:
        """As the base class for the attention group, and vLLM's ``MambaManager`` for the Mamba
        groups (see the class): their skipped blocks go first, then both groups' blocks are
        counted against the free ones (cached blocks and states no request holds included), the
        hit's state taken, the new blocks allocated and the computed blocks cached."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise InvalidId("allocate_slots: num_new_tokens must be greater than 0 when there are no computed tokens")
        if num_external_computed_tokens or num_encoder_tokens:
            raise Unsupported("allocate_slots: KV connectors and encoder tokens are not supported")
        bs = self.block_size
        core = self.core
        request_id = request.request_id
        live = self._live.get(request_id)
        opened = -1
        state = -1
        state_key = 0
        if live is None:
            expected = num_new_computed_tokens // bs
            if num_new_computed_tokens % bs or (expected and not self.enable_caching):
                raise InvalidId(f"allocate_slots: {num_new_computed_tokens} computed tokens are not a cached prefix")
            if self._probe >= 0 and self._probe_request == request_id and core.num_blocks(self._probe) == expected:
                opened, self._probe, self._probe_request = self._probe, -1, None
            else:
                self._settle()
                opened = core.admit(self._tokens(request), 0, expected, self._namespace(request))
            if core.num_blocks(opened) != expected:
                held = core.num_blocks(opened)
                core.finish(opened, False)
                raise SequenceStateError(
                    f"allocate_slots: request {request_id!r} was told of {expected} cached blocks, "
                    f"but {held} are cached now"
                )
            if expected:
                state_key = int(core.block_hashes(opened)[expected - 1])
                state = self._states.get(state_key, -1)
                if state < 0:
                    core.finish(opened, False)
                    raise SequenceStateError(
                        f"allocate_slots: request {request_id!r} was told of a Mamba state after {expected} blocks, "
                        "but none is cached there now"
                    )
            handle, have = opened, expected
            mamba = _MambaLive()
        else:
            self._settle()
            handle, have = live.handle, core.num_blocks(live.handle)
            mamba = self._mamba[request_id]
            computed_now = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
            self._mamba_remove(mamba, max(0, computed_now - (getattr(request, "num_in_flight_tokens", 0) or 0)))
        computed = request.num_computed_tokens + num_new_computed_tokens
        main = min(computed, self.max_model_len) + num_new_tokens
        slot = min(main + num_lookahead_tokens, self.max_model_len)
        needed = -(-min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len) // bs)
        per = len(self._mamba_groups)
        hit = have if live is None else 0
        taken = int(state in self._evictable)  # (a hit on a state no request holds takes it from the free ones)
        required = max(needed - have, 0) + per * (self._mamba_need(mamba, hit, main, slot) + taken)
        watermark = 0
        if self.watermark_blocks and has_scheduled_reqs and getattr(request.status, "name", None) in _WAITING_STATES:
            watermark = self.watermark_blocks
        free = self._pool.num_free + core.num_evictable_blocks + per * len(self._evictable)
        refused = state_key in self._this_step if state >= 0 else False  # (vLLM: a state of this step is no hit)
        if full_sequence_must_fit and not refused:
            whole = min(request.num_tokens, self.max_model_len)
            need = max(-(-whole // bs) - have, 0) + per * (self._mamba_need(mamba, hit, whole, whole) + taken)
            refused = need + watermark > free
        if refused or required + watermark > free - reserved_blocks:
            if opened >= 0:
                core.finish(opened, False)
            return None
        if state >= 0:
            mamba.length = mamba.cached = have
            mamba.held[have - 1] = state
            self._acquire(state)
        new_states = -(-main // bs) > mamba.length if self._align else max(self._mamba_need(mamba, 0, main, slot), 0)
        self._make_room(max(needed - have, 0) + per * int(new_states))
        if needed > have:
            core.grow(handle, needed)
        columns = self._mamba_allocate(mamba, main, slot)
        if live is None:
            live = _Live(handle, request.num_tokens, have, self._cacheable_tokens(request) // bs)
            self._live[request_id] = live
            self._mamba[request_id] = mamba
            self._retain(request, handle)
        attention = core.block_table(handle)[have:needed] if needed > have else _EMPTY
        if len(attention):
            self._zero.append(attention)
        if not delay_cache_blocks:
            self._cache(request, live, min(computed + num_new_tokens, request.num_tokens))
        return self._group_blocks(attention, columns)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """The Mamba blocks before the last processed token's state go (see ``allocate_slots``)."""
        mamba = self._mamba.get(request_id)
        if mamba is not None:
            self._settle()
            self._mamba_remove(mamba, processed_computed_tokens)

    def free(self, request: Any) -> None:
        """Release the request's blocks and states; the cached ones stay cached."""
        super().free(request)
        mamba = self._mamba.pop(request.request_id, None)
        if mamba is not None:
            for position in sorted(mamba.held, reverse=True):
                self._release(mamba.held[position])

    def new_step_starts(self) -> None:
        """States cached in the last step may be hits from now on."""
        self._this_step.clear()

    @property
    def usage(self) -> float:
        """The share of blocks in use by requests (cached attention blocks and states no request
        holds count as free, as in vLLM)."""
        self._settle()
        free = self._pool.num_free + self.core.num_evictable_blocks + len(self._mamba_groups) * len(self._evictable)
        return 1.0 - free / (self._pool.num_total - 1)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block and state; False, changing nothing, while any request holds blocks."""
        self._settle()
        if self._live:
            return False
        for handle in list(self._state_keys):
            self._uncache(handle)
        self._this_step.clear()
        return super().reset_prefix_cache()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks from the prefix cache: a Mamba block's state (every group's
        block of it), an attention block as the base class does. Ids that are not ints in the
        pool's range are refused (``InvalidId``) before anything is evicted."""
        try:
            ids = list(block_ids)
        except TypeError:
            raise InvalidId(f"evict_blocks: block_ids must be an iterable of ints, got {block_ids!r}") from None
        total = self._pool.num_total
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < total:
                raise InvalidId(f"evict_blocks: block id {block_id!r} is not an int in [0, {total})")
        self._settle()
        attention = [block_id for block_id in ids if block_id not in self._owner]
        self.core.evict_blocks(attention)
        for block_id in ids:
            handle = self._owner.get(block_id, -1)
            if handle >= 0 and handle in self._state_keys:
                self._uncache(handle)

    def get_blocks(self, request_id: str) -> AnyBlocks:
        live = self._live.get(request_id)
        if live is None:
            return self.empty_kv_cache_blocks
        mamba = self._mamba[request_id]
        return self._group_blocks(self.core.block_table(live.handle), self._columns(mamba, 0, mamba.length))

    def get_num_common_prefix_blocks(self, running_request_id: str | None = None) -> list[int]:
        """The attention group's shared leading blocks (the base class); 0 in a Mamba group."""
        counts = [0] * self.num_kv_cache_groups
        counts[self._attention_group] = super().get_num_common_prefix_blocks(running_request_id)[0]
        return counts

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba boundary states handed to a KV connector: none (connectors are refused)."""
        return {}

    def estimate_cached_tokens(self, request: Any) -> int:
        """vLLM's rule: the least over the groups of the deepest cached prefix the request's blocks
        end (the attention group's cached blocks; the deepest cached state it holds)."""
        attention = super().estimate_cached_tokens(request)
        mamba = self._mamba.get(request.request_id)
        if mamba is None:
            return attention
        keys = self._state_keys
        deepest = max(((p + 1) * self.block_size for p, h in mamba.held.items() if h in keys), default=0)
        return min(attention, deepest)

    def take_new_block_ids(self) -> list[int]:
        """The attention group's blocks allocated since the last call, for the worker to zero
        (vLLM's rule for a config with Mamba layers)."""
        ids: list[int] = np.concatenate(self._zero).tolist() if self._zero else []
        self._zero = []
        return ids

    def create_kv_cache_blocks(self, blocks: Any) -> AnyBlocks:
        return KVCacheGroupBlocks(tuple(
            np.fromiter((block.block_id for block in group), dtype=np.int32) for group in blocks
        ))

    def check_invariants(self) -> None:
        """The base class's checks, counting a core record for each state, and the states'
        holders: every request's held states, the cache's, the evictable ones."""
        self._settle()
        self.core.check_invariants()
        if self.core.num_live_sequences != len(self._live) + len(self._refs):
            raise SequenceStateError(
                f"{self.core.num_live_sequences} core records are live for {len(self._live)} requests and "
                f"{len(self._refs)} Mamba states"
            )
        holders = dict.fromkeys(self._refs, 0)
        for mamba in self._mamba.values():
            for handle in mamba.held.values():
                holders[handle] += 1
        for handle in self._state_keys:
            holders[handle] += 1
        evictable = {h for h in self._state_keys if holders[h] == 1}
        if holders != self._refs or evictable != set(self._evictable) or len(self._states) != len(self._state_keys):
            raise SequenceStateError(
                f"Mamba states: holders {holders} against counts {self._refs}, evictable {sorted(self._evictable)} "
                f"against {sorted(evictable)}"
            )


def scheduler_class(async_scheduling: bool = True) -> type[Any]:
    """vLLM's ``AsyncScheduler`` (or, with ``async_scheduling=False``, its ``Scheduler``) with its
    KV cache manager replaced by :class:`LifecycleKVCacheManager`, built from the arguments the
    scheduler gives its own: the module's ``LifecycleAsyncScheduler`` and ``LifecycleScheduler``
    (built once; needs vLLM), for ``--scheduler-cls``. ``Scheduler.__init__`` still builds vLLM's
    manager, reads it once and drops it. Refused with ``Unsupported`` at construction: what the
    facade refuses (see the module's docstring), KV connectors and aux-output connectors (which
    use vLLM's block pool; checked before anything is built) and EAGLE-family speculative
    decoding."""
    return _scheduler_class(bool(async_scheduling))


@functools.cache
def _scheduler_class(async_scheduling: bool) -> type[Any]:
    import_engine("vllm", _EXTRA)
    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    name = "LifecycleAsyncScheduler" if async_scheduling else "LifecycleScheduler"

    def __init__(self: Any, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        transfer = vllm_config.kv_transfer_config
        if transfer is not None:
            raise Unsupported(
                f"{name}: kv_transfer_config names the KV connector {transfer.kv_connector!r}; a KV connector needs "
                "vLLM's own KV cache manager"
            )
        if vllm_config.aux_output_config.enabled:
            raise Unsupported(f"{name}: the aux-output connector (aux_output_config) needs vLLM's own KV cache manager")
        if async_scheduling and not vllm_config.scheduler_config.async_scheduling:
            raise Unsupported(
                f"{name}: scheduler_config.async_scheduling is False (vLLM turned it off or was told to); "
                "use LifecycleScheduler"
            )
        base.__init__(self, vllm_config, kv_cache_config, *args, **kwargs)
        if self.use_eagle:
            method = getattr(vllm_config.speculative_config, "method", None)
            raise Unsupported(f"{name}: speculative decoding method {method!r} is EAGLE-family; not supported")
        self.kv_cache_manager = LifecycleKVCacheManager(
            kv_cache_config=self.kv_cache_config,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=vllm_config.max_in_flight_tokens,
            enable_caching=self.cache_config.enable_prefix_caching,
            use_eagle=self.use_eagle_block_drop,
            num_hash_lookahead_tokens=self.num_hash_lookahead_tokens,
            num_prefill_lookahead=self.num_prefill_lookahead,
            log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events,
            dcp_world_size=self.dcp_world_size,
            pcp_world_size=1,
            scheduler_block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            metrics_collector=self.kv_metrics_collector,
            watermark=self.scheduler_config.watermark,
            enable_mamba_shared_prefix_checkpoint=self.cache_config.enable_mamba_shared_prefix_checkpoint,
        )

    return type(name, (base,), {
        "__init__": __init__, "__module__": __name__, "__qualname__": name,
        "__doc__": f"vLLM's ``{base.__name__}`` over :class:`LifecycleKVCacheManager` (see :func:`scheduler_class`).",
    })


def __getattr__(name: str) -> type[Any]:
    if name == "LifecycleAsyncScheduler":
        return scheduler_class(True)
    if name == "LifecycleScheduler":
        return scheduler_class(False)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
