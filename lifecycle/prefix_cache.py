"""The prefix cache: a ``PrefixTrie`` whose nodes hold references in a ``BlockPool`` (SPEC §4).

Ownership: the cache holds exactly one pool reference per trie node, on the node's block. A
sequence that uses a cached block holds a reference of its own (taken by whoever attaches the
prefix), so a block leaves the pool's free list only when both the cache and every sequence have
let go of it. References are always acquired before any is released, so a block that changes hands
within one call never passes through refcount 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from lifecycle._blockpool import BlockPool
from lifecycle._prefix_cache import PrefixCacheCore
from lifecycle._prefix_trie import PrefixTrie
from lifecycle.errors import InvalidId, InvariantViolation

Int32Array = NDArray[np.int32]
TokenArray = NDArray[np.int32]

_NO_IDS: Int32Array = np.empty(0, dtype=np.int32)
_NO_IDS.flags.writeable = False


class Match(NamedTuple):
    """A cached prefix: its blocks, the trie nodes holding them, and the tokens they cover.

    A named tuple rather than a dataclass: one is built per lookup, on the scheduler's hot path.
    """

    block_ids: Int32Array
    node_ids: Int32Array
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        """Number of whole blocks matched."""
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class PrefixReclaim:
    """Outcome of ``reclaim_prefix_blocks_for``.

    ``target`` is how many new blocks the prefill still has to allocate once it reuses the cached
    prefix (``blocks_needed`` minus the reusable blocks, never below 0); ``free`` is the pool's
    free block count after reclaiming. ``free >= target`` means the prefill fits.
    """

    target: int
    free: int

    @property
    def fits(self) -> bool:
        """True when the pool now has enough free blocks for the prefill."""
        return self.free >= self.target


def reusable_blocks(prompt_len: int, block_size: int) -> int:
    """Most whole blocks of a prompt that prefill may take from the cache.

    The prompt's last token is always computed (its logits start decoding), so a cached prefix
    never covers it: ``(prompt_len - 1) // block_size``, and 0 for an empty prompt.
    """
    return (prompt_len - 1) // block_size if prompt_len > 0 else 0


_EMPTY_MATCH = Match(_NO_IDS, _NO_IDS, 0)
# tuple.__new__ straight away: the named tuple's own __new__ is one more Python frame per lookup.
_new_match = tuple.__new__


class PrefixCache:
    """A prefix trie and the block pool whose references its nodes hold.

    With ``enabled=False`` nothing is ever cached: lookups miss, inserts hand every block back as a
    duplicate, and the cache takes no reference (SPEC §8 scenario 11).

    The composite operations run in ``core`` (a ``PrefixCacheCore``), one C call each; a hot path
    may call the core's fused operations directly (``acquire_prefix``, ``allocate``,
    ``cache_and_release``, ``insert_path``, ``evict``).
    """

    __slots__ = ("_core", "_pool", "_trie", "_enabled", "_block_size", "_match", "_insert_path", "_evict")

    def __init__(self, pool: BlockPool, trie: PrefixTrie, *, enabled: bool = True) -> None:
        self._core = PrefixCacheCore(pool, trie, enabled=enabled)
        self._pool = pool
        self._trie = trie
        self._enabled = enabled
        self._block_size = trie.block_size
        # Bound once: these run on every scheduler step.
        self._match = trie.match
        self._insert_path = self._core.insert_path
        self._evict = self._core.evict

    @property
    def core(self) -> PrefixCacheCore:
        """The fused operations on the same pool and trie."""
        return self._core

    @property
    def pool(self) -> BlockPool:
        return self._pool

    @property
    def trie(self) -> PrefixTrie:
        return self._trie

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the cache holds a reference on (one per trie node)."""
        return self._trie.num_cached_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks that eviction may drop: not pinned, not above a pinned node."""
        return self._trie.num_evictable_blocks

    @property
    def blocks_evicted(self) -> int:
        """Trie nodes evicted so far (each dropped one cache reference, freed or not)."""
        return self._core.blocks_evicted

    # -- lookups and pins --

    def lookup(
        self, tokens: TokenArray, adapter: int = 0, max_blocks: int = -1, *, pin: bool = False
    ) -> Match:
        """The longest cached whole-block prefix of ``tokens`` under ``adapter`` (LRU-touched).

        Takes no block reference; with ``pin=True`` the matched nodes are pinned in the same
        atomic step, so they cannot be evicted until ``unpin(match.node_ids)``.
        """
        if not self._enabled:
            return _EMPTY_MATCH
        block_ids, node_ids = self._match(tokens, adapter, max_blocks, pin=pin)
        return _new_match(Match, (block_ids, node_ids, len(block_ids) * self._block_size))

    def lookup_prompt(self, prompt: TokenArray, adapter: int = 0, *, pin: bool = True) -> Match:
        """``lookup`` limited to the blocks prefill may reuse (see ``reusable_blocks``), pinned by default."""
        return self.lookup(prompt, adapter, reusable_blocks(len(prompt), self._block_size), pin=pin)

    def pin(self, node_ids: Int32Array) -> None:
        """Pin nodes (from a ``Match``) so that eviction leaves them and their ancestors alone."""
        self._trie.pin(node_ids)

    def unpin(self, node_ids: Int32Array) -> None:
        """Undo one ``pin`` per node; below zero raises ``DoubleFree`` and changes nothing."""
        self._trie.unpin(node_ids)

    # -- inserting and evicting --

    def insert(
        self,
        tokens: TokenArray,
        block_ids: Int32Array,
        adapter: int = 0,
        *,
        known_prefix: Int32Array | None = None,
    ) -> Int32Array:
        """Cache the ``len(block_ids)`` full blocks that start ``tokens``, under ``adapter``.

        Blocks at new nodes gain one cache reference. Returns the duplicates: the caller's blocks
        at positions whose node already existed (that node keeps its own block, and the cache takes
        nothing of the caller's there). The caller's own references are untouched either way: it
        releases every block it holds, duplicates included, when it frees the sequence.

        ``known_prefix`` may name the nodes of a match the caller still holds pinned for these
        tokens (``Match.node_ids``): they are verified rather than looked up again.

        All or nothing: an invalid block id (out of range, or free in the pool), too few tokens or
        a wrong known prefix raise before the trie or any refcount changes.
        """
        return self.insert_path(tokens, block_ids, adapter, known_prefix=known_prefix)[1]

    def insert_path(
        self,
        tokens: TokenArray,
        block_ids: Int32Array,
        adapter: int = 0,
        *,
        known_prefix: Int32Array | None = None,
    ) -> tuple[int, Int32Array, Int32Array]:
        """``insert``, returning (blocks newly taken by the cache, duplicates, the path's node ids).
        With the cache disabled nothing is taken and the path is empty. One C call."""
        return self._insert_path(tokens, block_ids, adapter, known_prefix=known_prefix)

    def evict(self, n: int) -> int:
        """Evict least recently used unpinned leaves until ``n`` blocks became free or nothing is
        evictable; return how many blocks became free (one C call).

        A node whose block a live sequence still references loses the cache's reference but frees
        nothing, and is not counted. So 0 means nothing evictable is left (for ``n > 0``).
        """
        return self._evict(n)

    def reclaim_prefix_blocks(self, n: int) -> int:
        """SPEC §4: ``evict(n)``."""
        return self.evict(n)

    def reclaim_prefix_blocks_for(
        self,
        prompt: TokenArray,
        adapter: int,
        blocks_needed: int,
        reusable: Callable[[Int32Array], int] | None = None,
    ) -> PrefixReclaim:
        """Make room for a prefill of ``prompt`` that needs ``blocks_needed`` blocks in all.

        Pins the prefix prefill will reuse (``reusable_blocks`` of the prompt, cut to
        ``reusable(node_ids)`` of the matched nodes when given — a hybrid model reuses only up to
        an SSM snapshot; none for an empty prompt), sets ``target = max(0, blocks_needed - reused)``,
        evicts until the pool has ``target`` free blocks or nothing is evictable, unpins, and
        returns the target and the free count. The reused prefix is never evicted by this call.
        """
        if blocks_needed < 0:
            raise InvalidId(f"reclaim_prefix_blocks_for: blocks_needed {blocks_needed} must be >= 0")
        if not self._enabled:
            return PrefixReclaim(blocks_needed, self._pool.num_free)
        if reusable is None:
            pinned = self.lookup_prompt(prompt, adapter, pin=True).node_ids
        else:
            matched = self.lookup_prompt(prompt, adapter, pin=False).node_ids
            pinned = matched[: reusable(matched)]
            self._trie.pin(pinned)
        try:
            target = max(0, blocks_needed - len(pinned))
            short = target - self._pool.num_free
            if short > 0:
                self.evict(short)
        finally:
            self._trie.unpin(pinned)
        return PrefixReclaim(target, self._pool.num_free)

    def clear(self) -> int:
        """Drop every cached block (pinned ones too: teardown only); return how many became free."""
        return self._core.clear()

    def check_invariants(self) -> None:
        """Check the trie and the pool, then that every cached block holds at least as many pool
        references as nodes cache it (the cache's own); raise ``InvariantViolation`` otherwise."""
        self._trie.check_invariants()
        self._pool.check_invariants()
        cached = self._trie.cached_block_ids()
        if not self._enabled and len(cached):
            raise InvariantViolation(f"PrefixCache: disabled, yet the trie caches {len(cached)} blocks")
        if len(cached) == 0:
            return
        num_total = self._pool.num_total
        if int(cached.max()) >= num_total:
            raise InvariantViolation(
                f"PrefixCache: the trie caches block {int(cached.max())} outside the pool [0, {num_total})"
            )
        cache_refs = np.bincount(cached, minlength=num_total)
        refcounts = self._pool.refcounts()
        short = np.flatnonzero(refcounts < cache_refs)
        if short.size:
            block = int(short[0])
            raise InvariantViolation(
                f"PrefixCache: block {block} is cached at {int(cache_refs[block])} nodes "
                f"but has refcount {int(refcounts[block])}"
            )
