"""Eviction policies for the prefix cache, measured on a block-level model of a W2/W3 replay,
beside Belady's offline optimum (issue 27, the measurement side; docs/retention.md has the table).

    python bench/workloads.py w3-policies --json   # one JSON record per policy, then the optimum
    python bench/workloads.py w2-policies --json
    python bench/policies.py w3 [--trace PATH]     # the same records

The model (:func:`replay`) follows the replay rules of ``../shared/bench/README.md``: requests in
order, a FIFO window of ``max_live`` live requests; admission reuses the longest cached prefix in
whole blocks, at most ``(len(prompt) - 1) // block_size`` of them, pins it, and allocates the rest
of the blocks the request holds, evicting when the fixed pool runs short; a finish caches every
full block of prompt + generated tokens that is not cached yet, then releases the pins. A block is
its chained prefix key (two 64-bit lanes over its tokens and every block before it; a clash of the
first lane with the second raises), so a block is a hit only if its whole prefix is cached, as in
the trie: eviction takes only a leaf (no cached block below it) that no live request pins, for
every policy. The recency stamps are the library's trie order (pyx/radix.pyx), so the model's LRU
hits and evicts exactly what ``KVCacheCore`` does on W2 and W3 (:func:`run` checks it every time,
tests/test_bench_policies.py on a cut of W3).

Policies: LRU; SLRU (80% and 50% protected); 2Q; S3-FIFO; LFU with dynamic aging; and
:class:`BranchLRU`, reuse- and length-aware at the branch level. Each is adapted to the trie in the
same way: it ranks the evictable leaves by its own order, and a block above cached ones waits until
it is a leaf. :class:`Optimum` is Belady's MIN on the same model (its docstring says why it is the
standard reference and not a proven bound; the never-evict ceiling, the strict bound, is printed
beside it). Session TTL hints (:class:`SessionHints`) take the conversation of each request from
its prompt's chunk chain alone (:func:`conversations`) and keep a continuing conversation's tail
for one fixed TTL, in admissions or in trace time.

``us_per_request`` in the records is this model's own replay time per request (Python and numpy,
milliseconds where the library takes microseconds): it compares the policies' bookkeeping with
each other, not with the library, whose cost per request ``workloads.py w3`` reports.
"""

from __future__ import annotations

import heapq
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from replay import PrefixTrace  # noqa: E402
from w3 import splitmix64  # noqa: E402

Ints = NDArray[np.int64]
#: A next use that never comes.
NEVER = 1 << 62


#: What the block model reads of a W2/W3 trace: what the library's own replay reads.
ReplayTrace = PrefixTrace


@dataclass(frozen=True)
class BlockTrace:
    """A replay at the block level: request ``i``'s full blocks (prompt + generated) are the block
    ids ``keys[offsets[i]:offsets[i + 1]]``, root side first; it may reuse ``reusable[i]`` of them
    and holds ``needed[i]`` blocks while live. A block id stands for its whole prefix (equal ids:
    equal tokens from the root), so ``parent[b]`` is one id (-1 at a root) and ``depth[b]`` its
    position."""

    keys: Ints
    offsets: Ints
    reusable: Ints
    needed: Ints
    parent: Ints
    depth: Ints
    block_size: int
    num_blocks: int
    max_live: int
    prompt_tokens: int
    #: Each request's arrival in the trace's own time (Mooncake: milliseconds), or its index.
    times: Ints

    @property
    def num_requests(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_ids(self) -> int:
        return len(self.parent)

    def blocks(self, i: int) -> Ints:
        return self.keys[self.offsets[i] : self.offsets[i + 1]]


def _content_hashes(rows: NDArray[np.int32], seed: int) -> NDArray[np.uint64]:
    """One 64-bit hash per row of tokens (a block), position in the block included."""
    positions = np.arange(rows.shape[1], dtype=np.uint64) << np.uint64(32)
    mixed = splitmix64(rows.astype(np.uint64) ^ positions ^ np.uint64(seed))
    hashes: NDArray[np.uint64] = mixed.sum(axis=1, dtype=np.uint64)
    return hashes


def _chain_hashes(contents: NDArray[np.uint64], seed: int) -> NDArray[np.uint64]:
    """Prefix hashes: element ``j`` sums a mix of every content up to ``j`` with its depth, so
    equal prefixes hash equal and a difference anywhere in the prefix changes it."""
    depths = splitmix64(np.arange(len(contents), dtype=np.uint64) + np.uint64(seed))
    return np.cumsum(splitmix64(contents ^ depths), dtype=np.uint64)


def block_trace_of(
    contents: Sequence[NDArray[np.uint64]],
    reusable: Sequence[int],
    needed: Sequence[int],
    *,
    block_size: int,
    num_blocks: int,
    max_live: int,
    prompt_tokens: int,
    times: Sequence[int] | None = None,
) -> BlockTrace:
    """The block trace of requests given as the content hash of each full block (two 64-bit lanes
    per block, shape ``(n, 2)``; root side first). Blocks get one id per distinct prefix; a
    disagreement between the lanes (a collision in the first) raises."""
    offsets = np.zeros(len(contents) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in contents], out=offsets[1:])
    lanes = [
        np.concatenate([_chain_hashes(np.ascontiguousarray(c[:, lane]), 3 + lane) for c in contents])
        if len(offsets) > 1 and offsets[-1] > 0
        else np.zeros(0, dtype=np.uint64)
        for lane in (0, 1)
    ]
    unique, first, inverse = np.unique(lanes[0], return_index=True, return_inverse=True)
    keys = inverse.astype(np.int64).reshape(-1)
    if not np.array_equal(lanes[1][first][keys], lanes[1]):
        raise AssertionError("two prefixes share a 64-bit hash: the block ids would merge them")
    previous = np.full(len(keys), -1, dtype=np.int64)
    previous[1:] = keys[:-1]
    starts = offsets[:-1][np.diff(offsets) > 0]
    previous[starts] = -1
    parent = np.full(len(unique), -1, dtype=np.int64)
    parent[keys] = previous
    if not np.array_equal(parent[keys], previous):
        raise AssertionError("one block id under two parents: the block ids would merge two prefixes")
    depth = np.zeros(len(unique), dtype=np.int64)
    depth[keys] = np.arange(len(keys), dtype=np.int64) - np.repeat(offsets[:-1], np.diff(offsets))
    return BlockTrace(
        keys=keys,
        offsets=offsets,
        reusable=np.minimum(np.asarray(reusable, dtype=np.int64), np.diff(offsets)),
        needed=np.asarray(needed, dtype=np.int64),
        parent=parent,
        depth=depth,
        block_size=block_size,
        num_blocks=num_blocks,
        max_live=max_live,
        prompt_tokens=prompt_tokens,
        times=np.asarray(times if times is not None else range(len(contents)), dtype=np.int64),
    )


def block_trace(trace: ReplayTrace, times: Sequence[int] | None = None) -> BlockTrace:
    """The block trace of a W2/W3 replay (every full block of each request's prompt + generated
    tokens, hashed from its tokens)."""
    bs = trace.block_size
    contents = []
    for tokens in trace.tokens:
        rows = tokens[: len(tokens) // bs * bs].reshape(-1, bs)
        contents.append(np.stack([_content_hashes(rows, 1), _content_hashes(rows, 2)], axis=1))
    n = trace.num_requests
    return block_trace_of(
        contents,
        [trace.reusable_blocks(i) for i in range(n)],
        [trace.blocks_needed(i) for i in range(n)],
        block_size=bs,
        num_blocks=trace.num_blocks,
        max_live=trace.max_live,
        prompt_tokens=sum(trace.prompt_lens),
        times=times,
    )


class Cache:
    """The block-level prefix cache one policy drives: which blocks are cached, how many live
    requests pin each (a pin covers a request's whole reused prefix), how many cached children
    each has, and each block's recency stamp in the library's LRU order (see :func:`replay`)."""

    def __init__(self, trace: BlockTrace) -> None:
        n = trace.num_ids
        self.trace = trace
        self.cached = np.zeros(n, dtype=np.bool_)
        self.pins = np.zeros(n, dtype=np.int32)
        self.children = np.zeros(n, dtype=np.int32)
        self.stamp = np.zeros(n, dtype=np.int64)
        self.tick = 0
        self.num_cached = 0
        #: The request being admitted (or, at a finish, the next one to be) and its arrival time.
        self.now = 0
        self.time = 0

    def evictable(self, b: int) -> bool:
        """Cached, pinned by no live request and no cached block below it (a leaf of the trie)."""
        return bool(self.cached[b]) and self.pins[b] == 0 and self.children[b] == 0

    def restamp(self, blocks: Ints) -> None:
        """``blocks`` become the most recently used, the first of them the least so."""
        self.stamp[blocks] = np.arange(self.tick, self.tick + len(blocks), dtype=np.int64)
        self.tick += len(blocks)


class Policy:
    """An eviction policy over the cache's evictable leaves. The replay calls the hooks; a policy
    keeps the evictable leaves it was offered (:meth:`offer`) in its own order and hands one back
    per :meth:`victim`, checking :meth:`Cache.evictable` (an offer may have gone stale)."""

    name = "policy"

    def bind(self, cache: Cache) -> None:
        self.cache = cache

    def hints(self) -> dict[str, Any] | None:
        """The hints the policy was given (recorded beside its figure), None for a plain policy."""
        return None

    def on_hit(self, blocks: Ints) -> None:
        """``blocks`` (root side first) were reused by the request being admitted."""

    def on_insert(self, blocks: Ints) -> None:
        """``blocks`` (deepest first, already stamped) were cached by a finishing request."""

    def on_touch(self, blocks: Ints) -> None:
        """``blocks`` (deepest first) were used again and got fresh stamps: the ones a finishing
        request matched past its prefix, and those whose last pin it released."""

    def on_finish(self, request: int, blocks: Ints) -> None:
        """Request ``request`` finished; ``blocks`` is its whole cached path, root side first."""

    def offer(self, b: int) -> None:
        """Block ``b`` became evictable, or was re-prioritised while evictable."""
        raise NotImplementedError

    def victim(self) -> int:
        """An evictable block to drop (-1: none); the policy forgets it."""
        raise NotImplementedError


@dataclass(frozen=True)
class Outcome:
    """One replay: hit tokens, blocks evicted, seconds the replay took, hit blocks per request."""

    hit_tokens: int
    blocks_evicted: int
    seconds: float
    hits: Ints


def replay(trace: BlockTrace, policy: Policy) -> Outcome:
    """Replay ``trace`` under W2's rules, ``policy`` choosing every victim.

    Admission: the longest cached prefix within ``reusable`` blocks is a hit and is pinned, then
    the rest of ``needed`` is allocated, evicting when the free blocks are short (a block a
    policy evicts frees a pool block: no live request holds an unpinned cached block).
    Finish (the oldest of ``max_live`` live requests, before the next admission): every full
    block not cached yet is cached, then the pins go. Recency stamps follow the library's trie
    (pyx/radix.pyx): at a finish the new leaf run, then the path above it up to the first pinned
    block, then the blocks whose last pin was released, each group deepest first, so a parent is
    always more recent than its children and LRU never picks a block with a cached child.
    The admission's own touch is left out: those blocks are pinned before anything is evicted
    and get their stamp when released."""
    cache = Cache(trace)
    policy.bind(cache)
    cached, pins, children, parent = cache.cached, cache.pins, cache.children, trace.parent
    keys, offsets, reusable, needed, times = trace.keys, trace.offsets, trace.reusable, trace.needed, trace.times
    offer, victim = policy.offer, policy.victim
    live: deque[tuple[int, int]] = deque()
    hits = np.zeros(trace.num_requests, dtype=np.int64)
    free = trace.num_blocks
    evicted = 0

    def evict(n: int) -> None:
        nonlocal evicted
        for _ in range(n):
            b = victim()
            if b < 0:
                raise AssertionError(f"request {cache.now}: nothing left to evict, {n} blocks short")
            cached[b] = False
            p = int(parent[b])
            if p >= 0:
                children[p] -= 1
                if children[p] == 0 and pins[p] == 0:
                    offer(p)
        cache.num_cached -= n
        evicted += n

    def offer_leaves(blocks: Ints) -> None:
        for b in blocks[(children[blocks] == 0) & (pins[blocks] == 0)].tolist():
            offer(b)

    def finish(r: int, m: int) -> int:
        path = keys[offsets[r] : offsets[r + 1]]
        rest = cached[path[m:]]
        pos = m + (len(rest) if rest.all() else int(rest.argmin()))
        new = path[pos:]
        if len(new):
            cached[new] = True
            children[path[max(pos - 1, 0) : -1]] += 1
            cache.num_cached += len(new)
            fresh = new[::-1]
            cache.restamp(fresh)
            policy.on_insert(fresh)
            offer(int(new[-1]))
        matched = path[m:pos][::-1]
        if len(matched):
            held = pins[matched] > 0
            matched = matched[: int(held.argmax())] if held.any() else matched
            cache.restamp(matched)
            policy.on_touch(matched)
            offer_leaves(matched)
        if m:
            prefix = path[:m]
            pins[prefix] -= 1
            released = prefix[pins[prefix] == 0][::-1]
            cache.restamp(released)
            policy.on_touch(released)
            offer_leaves(released)
        policy.on_finish(r, path)
        return int(needed[r]) - m - len(new)

    start = time.perf_counter()
    for i in range(trace.num_requests):
        cache.now, cache.time = i, int(times[i])
        if len(live) == trace.max_live:
            free += finish(*live.popleft())
        path = keys[offsets[i] : offsets[i + 1]]
        head = cached[path[: reusable[i]]]
        m = len(head) if head.all() else int(head.argmin())
        if m:
            prefix = path[:m]
            policy.on_hit(prefix)
            pins[prefix] += 1
        hits[i] = m
        want = int(needed[i]) - m
        if want > free:
            evict(want - free)
            free = want
        free -= want
        live.append((i, m))
    cache.now = trace.num_requests
    while live:
        free += finish(*live.popleft())
    seconds = time.perf_counter() - start
    if free + cache.num_cached != trace.num_blocks or int(cached.sum()) != cache.num_cached:
        raise AssertionError(f"leaked: {free} free + {cache.num_cached} cached != {trace.num_blocks}")
    return Outcome(int(hits.sum()) * trace.block_size, evicted, seconds, hits)


@dataclass(frozen=True)
class SessionHints:
    """Session TTL hints: at the finish of a request that continues a conversation
    (``continues[r] >= 0``, see :func:`conversations`), its whole cached path (the conversation's
    tail) is kept for ``ttl`` after the finish: evicted only once every unhinted block is gone,
    the earliest expiry first. ``unit`` is ``"requests"`` (admissions) or ``"ms"`` (the trace's
    timestamps). An expired hint leaves the block to the policy's own order."""

    continues: Ints
    ttl: int
    unit: str = "requests"

    def record(self) -> dict[str, Any]:
        return {"session_ttl": self.ttl, "unit": self.unit, "sessions_hinted": int((self.continues >= 0).sum())}


class Ranked(Policy):
    """A policy whose cached blocks each sit in one of ``queues`` queues under a key (the lower
    goes first): an offer files the block under its current key, a stale entry is dropped when
    popped. :meth:`choose` is the policy's own order; session hints, when given, hold a hinted
    block back until its hint expires or nothing else is left."""

    queues = 1

    def __init__(self, hints: SessionHints | None = None) -> None:
        self.session_hints = hints

    def bind(self, cache: Cache) -> None:
        super().bind(cache)
        n = cache.trace.num_ids
        self.heaps: list[list[tuple[int, int]]] = [[] for _ in range(self.queues)]
        self.size = [0] * self.queues
        self.queue = np.full(n, -1, dtype=np.int8)
        self.expiry = np.full(n, -1, dtype=np.int64)
        self.held: list[tuple[int, int, int]] = []  # (expiry, stamp, block): hinted blocks popped early
        self.expiring: deque[tuple[int, Ints]] = deque()

    def hints(self) -> dict[str, Any] | None:
        return None if self.session_hints is None else self.session_hints.record()

    def key(self, b: int) -> int:
        raise NotImplementedError

    def choose(self) -> int:
        """The policy's victim among the blocks not held back (-1: none), forgotten by the policy."""
        raise NotImplementedError

    def file(self, blocks: Ints, queue: int) -> None:
        """Count ``blocks`` (cached, in no queue yet or in another) in ``queue``."""
        was = self.queue[blocks]
        for q in range(self.queues):
            self.size[q] -= int((was == q).sum())
        self.size[queue] += len(blocks)
        self.queue[blocks] = queue

    def offer(self, b: int) -> None:
        heapq.heappush(self.heaps[int(self.queue[b])], (self.key(b), b))

    def clock(self) -> int:
        hints = self.session_hints
        return self.cache.time if hints is not None and hints.unit == "ms" else self.cache.now

    def pop(self, queue: int) -> int:
        """The evictable block of ``queue`` with the lowest key, out of its heap (-1: none); a
        block under an unexpired hint is held back instead."""
        heap, evictable, queues, key = self.heaps[queue], self.cache.evictable, self.queue, self.key
        expiry, now, stamp = self.expiry, self.clock(), self.cache.stamp
        while heap:
            k, b = heapq.heappop(heap)
            if queues[b] == queue and key(b) == k and evictable(b):
                if expiry[b] <= now:
                    return b
                heapq.heappush(self.held, (int(expiry[b]), int(stamp[b]), b))
        return -1

    def move(self, b: int, queue: int) -> None:
        """Move one cached block to ``queue`` (offered again if evictable)."""
        self.size[int(self.queue[b])] -= 1
        self.size[queue] += 1
        self.queue[b] = queue
        if self.cache.evictable(b):
            self.offer(b)

    def drop(self, b: int) -> int:
        """Forget a block ``pop`` gave (the replay evicts it); returns it."""
        if b >= 0:
            self.size[int(self.queue[b])] -= 1
            self.queue[b] = -1
        return b

    def on_finish(self, request: int, blocks: Ints) -> None:
        hints = self.session_hints
        if hints is None or hints.continues[request] < 0:
            return
        until = self.clock() + hints.ttl
        self.expiry[blocks] = until
        self.expiring.append((until, blocks))
        if self.cache.evictable(int(blocks[-1])):
            self.offer(int(blocks[-1]))  # a held entry of the old hint is stale now

    def victim(self) -> int:
        cache, expiry, now = self.cache, self.expiry, self.clock()
        while self.expiring and self.expiring[0][0] <= now:
            until, blocks = self.expiring.popleft()
            for b in blocks[expiry[blocks] == until].tolist():
                if cache.evictable(b):
                    self.offer(b)
        b = self.choose()
        held, stamp = self.held, cache.stamp
        while b < 0 and held:
            until, s, h = heapq.heappop(held)
            if expiry[h] == until and stamp[h] == s and cache.evictable(h) and self.queue[h] >= 0:
                b = self.drop(h)
        return b


class LRU(Ranked):
    """Least recently used, the library's policy: the evictable leaf with the oldest stamp."""

    name = "lru"

    def key(self, b: int) -> int:
        return int(self.cache.stamp[b])

    def on_insert(self, blocks: Ints) -> None:
        self.file(blocks, 0)

    def choose(self) -> int:
        return self.drop(self.pop(0))


class NextUse:
    """When each block is next reused: the first request from a given one on whose reusable
    prefix holds it (:data:`NEVER` if none)."""

    def __init__(self, trace: BlockTrace) -> None:
        lengths = np.diff(trace.offsets)
        position = np.arange(len(trace.keys), dtype=np.int64) - np.repeat(trace.offsets[:-1], lengths)
        request = np.repeat(np.arange(trace.num_requests, dtype=np.int64), lengths)
        reused = position < np.repeat(trace.reusable, lengths)
        self.stride = trace.num_requests + 1
        self.uses = np.sort(trace.keys[reused] * self.stride + request[reused])

    def after(self, blocks: Ints, first: int) -> Ints:
        """The next use of each of ``blocks`` by request ``first`` or a later one."""
        if not len(self.uses):
            return np.full(len(blocks), NEVER, dtype=np.int64)
        at = np.searchsorted(self.uses, blocks * self.stride + first)
        found = self.uses[np.minimum(at, len(self.uses) - 1)]
        same = (at < len(self.uses)) & (found // self.stride == blocks)
        return np.where(same, found % self.stride, NEVER)


class Optimum(Ranked):
    """Belady's MIN on the block model: evict the evictable block whose next reuse (the next
    admission whose reusable prefix holds it) is farthest, ties to the least recently used.

    The leaf rule costs MIN nothing: every request reusing a block reuses its parent, so a
    parent's next reuse is never later than its child's and a farthest block can always be
    taken among the leaves. Pins bind it as they bind every policy. This is the classic optimum
    of a demand-paged cache of fixed size; the replay differs from that model (a miss is cached
    only at the request's finish, all of its blocks at once, and the room left to the cache
    shrinks while the live requests' own blocks are held), so MIN here is the standard offline
    reference, not a proven bound: a policy could beat it by a little. The strict bound is the
    never-evict ceiling (``w3.never_evict_hits``), reported beside it."""

    name = "optimum"

    def bind(self, cache: Cache) -> None:
        super().bind(cache)
        self.uses = NextUse(cache.trace)
        self.next = np.full(cache.trace.num_ids, NEVER, dtype=np.int64)

    def key(self, b: int) -> int:
        return ((NEVER - int(self.next[b])) << 40) | int(self.cache.stamp[b])

    def on_hit(self, blocks: Ints) -> None:
        self.next[blocks] = self.uses.after(blocks, self.cache.now + 1)

    def on_insert(self, blocks: Ints) -> None:
        self.next[blocks] = self.uses.after(blocks, self.cache.now)
        self.file(blocks, 0)

    def choose(self) -> int:
        return self.drop(self.pop(0))


class LFU(Ranked):
    """LFU with dynamic aging (LFU-DA, Arlitt et al.): a block's value is the cache's age when
    it was last reused plus its reuses; the age becomes the value of each block evicted, so
    blocks that stopped being reused age out. Ties go by recency."""

    name = "lfu-da"

    def bind(self, cache: Cache) -> None:
        super().bind(cache)
        self.uses = np.zeros(cache.trace.num_ids, dtype=np.int64)
        self.value = np.zeros(cache.trace.num_ids, dtype=np.int64)
        self.age = 0

    def key(self, b: int) -> int:
        return (int(self.value[b]) << 40) | int(self.cache.stamp[b])

    def on_hit(self, blocks: Ints) -> None:
        self.uses[blocks] += 1
        self.value[blocks] = self.age + self.uses[blocks]

    def on_insert(self, blocks: Ints) -> None:
        self.uses[blocks] = 1
        self.value[blocks] = self.age + 1
        self.file(blocks, 0)

    def choose(self) -> int:
        b = self.pop(0)
        if b >= 0:
            self.age = int(self.value[b])
        return self.drop(b)


class SLRU(Ranked):
    """Segmented LRU: new blocks enter a probationary segment, a reused one moves to the
    protected segment (at most ``protected`` of the cached blocks; its least recently used
    overflow goes back to probation). Probation is evicted first, LRU within a segment."""

    queues = 2

    def __init__(self, protected: float = 0.5, hints: SessionHints | None = None) -> None:
        super().__init__(hints)
        self.protected = protected
        self.name = f"slru-{round(protected * 100)}"

    def bind(self, cache: Cache) -> None:
        super().bind(cache)
        self.order: deque[tuple[int, int]] = deque()  # protected blocks by stamp, stale ones skipped

    def key(self, b: int) -> int:
        return int(self.cache.stamp[b])

    def on_hit(self, blocks: Ints) -> None:
        self.file(blocks[self.queue[blocks] == 0], 1)

    def on_insert(self, blocks: Ints) -> None:
        self.file(blocks, 0)

    def on_touch(self, blocks: Ints) -> None:
        kept = blocks[self.queue[blocks] == 1]
        self.order.extend(zip(self.cache.stamp[kept].tolist(), kept.tolist()))

    def choose(self) -> int:
        order, stamp, pins, queue = self.order, self.cache.stamp, self.cache.pins, self.queue
        limit = self.protected * self.cache.num_cached
        while self.size[1] > limit and order:
            s, b = order.popleft()
            if queue[b] == 1 and stamp[b] == s and pins[b] == 0:
                self.move(b, 0)
        b = self.pop(0)
        return self.drop(b if b >= 0 else self.pop(1))


class Ghosts:
    """The keys of the last ``capacity`` blocks evicted (a ghost FIFO), as eviction numbers."""

    def __init__(self, num_ids: int, capacity: int) -> None:
        self.evicted = np.full(num_ids, -(1 << 40), dtype=np.int64)
        self.count = 0
        self.capacity = capacity

    def add(self, b: int) -> int:
        if b >= 0:
            self.evicted[b] = self.count
            self.count += 1
        return b

    def holds(self, blocks: Ints) -> NDArray[np.bool_]:
        return self.evicted[blocks] >= self.count - self.capacity


class TwoQ(Ranked):
    """2Q (Johnson and Shasha): new blocks enter a FIFO (A1in); a block evicted from it leaves
    its key in a ghost FIFO (A1out, ``kout`` of the pool); a block cached again while its ghost
    is there enters the LRU main queue (Am). A1in is evicted first while above ``kin`` of the
    cache (a hit in A1in changes nothing, as in the paper)."""

    name = "2q"
    queues = 2

    def __init__(self, kin: float = 0.25, kout: float = 0.5, hints: SessionHints | None = None) -> None:
        super().__init__(hints)
        self.kin, self.kout = kin, kout

    def bind(self, cache: Cache) -> None:
        super().bind(cache)
        self.entered = np.zeros(cache.trace.num_ids, dtype=np.int64)
        self.ghost = Ghosts(cache.trace.num_ids, round(self.kout * cache.trace.num_blocks))

    def key(self, b: int) -> int:
        return int(self.entered[b] if self.queue[b] == 0 else self.cache.stamp[b])

    def on_insert(self, blocks: Ints) -> None:
        self.entered[blocks] = self.cache.stamp[blocks]
        seen = self.ghost.holds(blocks)
        self.file(blocks[seen], 1)
        self.file(blocks[~seen], 0)

    def choose(self) -> int:
        if self.size[0] > self.kin * self.cache.num_cached:
            b = self.pop(0)
            if b >= 0:
                return self.drop(self.ghost.add(b))
        b = self.pop(1)
        return self.drop(b if b >= 0 else self.ghost.add(self.pop(0)))


class S3FIFO(Ranked):
    """S3-FIFO (Yang et al., SOSP'23): new blocks enter a small FIFO (``small`` of the cache),
    blocks whose ghost is still in the ghost FIFO (``ghost`` of the pool) the main FIFO. Reuses
    count up to 3. While the small FIFO holds at least its share, its oldest block is examined:
    reused at least ``threshold`` times, it moves to the main FIFO (count cleared); else it is
    evicted if it is a leaf and unpinned, and otherwise (a block above cached ones, or in use)
    goes back to the small FIFO's tail, the trie's version of "cannot go yet". The main FIFO
    evicts its oldest leaf, reinserting a reused one with its count less one."""

    name = "s3-fifo"
    queues = 2

    def __init__(
        self, small: float = 0.1, ghost: float = 0.9, threshold: int = 1, hints: SessionHints | None = None
    ) -> None:
        super().__init__(hints)
        self.small, self.ghost_share, self.threshold = small, ghost, threshold

    def bind(self, cache: Cache) -> None:
        super().bind(cache)
        self.entered = np.zeros(cache.trace.num_ids, dtype=np.int64)
        self.freq = np.zeros(cache.trace.num_ids, dtype=np.int64)
        self.ghost = Ghosts(cache.trace.num_ids, round(self.ghost_share * cache.trace.num_blocks))
        self.fifo: deque[tuple[int, int]] = deque()  # every small-FIFO block, oldest first, stale ones skipped

    def key(self, b: int) -> int:
        return int(self.entered[b])

    def on_hit(self, blocks: Ints) -> None:
        self.freq[blocks] = np.minimum(self.freq[blocks] + 1, 3)

    def on_insert(self, blocks: Ints) -> None:
        self.entered[blocks] = self.cache.stamp[blocks]
        self.freq[blocks] = 0
        seen = self.ghost.holds(blocks)
        self.file(blocks[seen], 1)
        small = blocks[~seen]
        self.file(small, 0)
        self.fifo.extend(zip(self.entered[small].tolist(), small.tolist()))

    def enter(self, b: int, queue: int) -> None:
        """At the tail (the head, in the paper's words) of ``queue``."""
        self.entered[b] = self.cache.tick
        self.cache.tick += 1
        if queue == 0:
            self.fifo.append((int(self.entered[b]), b))
        if self.queue[b] == queue:
            if self.cache.evictable(b):
                self.offer(b)
        else:
            self.move(b, queue)

    def from_small(self) -> int:
        """Examine the small FIFO from its oldest block until one is evicted (-1: a whole round
        without)."""
        fifo, entered, queue, freq, evictable = self.fifo, self.entered, self.queue, self.freq, self.cache.evictable
        expiry, now = self.expiry, self.clock()
        for _ in range(len(fifo)):
            if self.size[0] < self.small * self.cache.num_cached:
                break
            e, b = fifo.popleft()
            if queue[b] != 0 or entered[b] != e:
                continue
            if freq[b] >= self.threshold:
                freq[b] = 0
                self.enter(b, 1)
            elif evictable(b) and expiry[b] <= now:
                return self.drop(self.ghost.add(b))
            else:
                self.enter(b, 0)
        return -1

    def choose(self) -> int:
        b = self.from_small()
        while b < 0:
            b = self.pop(1)
            if b < 0:
                return self.drop(self.ghost.add(self.pop(0)))
            if self.freq[b] == 0:
                return self.drop(b)
            self.freq[b] -= 1
            self.enter(b, 1)
            b = -1
        return b


def length_band(blocks: int) -> int:
    """``blocks`` rounded down to a half-octave (1, 2, 3, 4, 6, 8, 12, ...): the length classes
    the C buckets keep."""
    if blocks < 2:
        return max(blocks, 0)
    top = 1 << (blocks.bit_length() - 1)
    return top + top // 2 if blocks >= top + top // 2 else top


class BranchLRU(Ranked):
    """Reuse- and length-aware LRU at the branch level: a block's key is its last use (the
    library's stamp) plus a bonus for its reuses while cached (``reuse_bonus[k]`` pools' worth of
    stamps for ``k`` reuses, the last entry for more) plus ``length_weight`` stamps per block of
    the longest request path that went through it (in half-octave bands). Both bonuses only grow
    toward the root (a request reusing a block reuses its parent; a path through a block goes
    through its parent), like the stamp, so the lowest key is always a leaf and the trie's runs
    stay in key order within a bucket. Equal keys go to the older stamp, as in the core
    (``KVCacheCore(eviction_policy="branch-lru")``), which evicts what this model does."""

    name = "branch-lru"

    def __init__(
        self,
        reuse_bonus: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5),
        length_weight: int = 100,
        hints: SessionHints | None = None,
    ) -> None:
        super().__init__(hints)
        self.reuse_bonus, self.length_weight = reuse_bonus, length_weight

    def bind(self, cache: Cache) -> None:
        super().bind(cache)
        n = cache.trace.num_ids
        self.reuses = np.zeros(n, dtype=np.int64)
        self.longest = np.zeros(n, dtype=np.int64)
        self.bonus = [round(share * cache.trace.num_blocks) for share in self.reuse_bonus]

    def key(self, b: int) -> int:
        """Its key, ties to the older stamp (as the core breaks them) in the low 40 bits."""
        reuses = min(int(self.reuses[b]), len(self.bonus) - 1)
        stamp = int(self.cache.stamp[b])
        return ((stamp + self.bonus[reuses] + self.length_weight * int(self.longest[b])) << 40) | stamp

    def on_hit(self, blocks: Ints) -> None:
        self.reuses[blocks] += 1

    def on_insert(self, blocks: Ints) -> None:
        self.reuses[blocks] = 0
        self.longest[blocks] = 0
        self.file(blocks, 0)

    def on_finish(self, request: int, blocks: Ints) -> None:
        super().on_finish(request, blocks)
        self.longest[blocks] = np.maximum(self.longest[blocks], length_band(len(blocks)))
        if self.cache.evictable(int(blocks[-1])):
            self.offer(int(blocks[-1]))  # the path's only block that can be a leaf changed key

    def choose(self) -> int:
        return self.drop(self.pop(0))


def conversations(chains: Sequence[Sequence[int]]) -> Ints:
    """The conversation each request continues, from prefix chains alone (``chains[i]``: the ids
    of request ``i``'s prompt chunks, Mooncake's ``hash_ids``): the latest earlier request ``p``
    whose chain without its last chunk (the one a longer prompt changes) is a non-empty prefix of
    request ``i``'s, -1 for none. Later requests are never looked at."""
    prefix_ids: dict[tuple[int, int], int] = {}
    latest: dict[int, int] = {}
    continues = np.full(len(chains), -1, dtype=np.int64)
    for i, chain in enumerate(chains):
        ids, node = [], -1
        for chunk in chain:
            node = prefix_ids.setdefault((node, int(chunk)), len(prefix_ids))
            ids.append(node)
        for node in reversed(ids):
            if node in latest:
                continues[i] = latest[node]
                break
        if len(ids) >= 2:
            latest[ids[-2]] = i
    return continues


@dataclass(frozen=True)
class Workload:
    """A replay ready for the model: its block trace, each request's prompt chunk chain (for
    :func:`conversations`) and, for the check against the library, the trace itself."""

    name: str
    blocks: BlockTrace
    chains: list[list[int]]
    trace: ReplayTrace | None


def load(name: str, path: Path) -> Workload:
    """W2 (``bench/data/traces.npz`` form) or W3 (a Mooncake JSONL trace) for the block model.
    W3's chains are Mooncake's ``hash_ids`` and its times the ``timestamp`` field (ms); W2 has
    neither, so its chains are the prompt's block ids and its times the request numbers."""
    if name == "W2":
        from w2 import load_w2

        w2 = load_w2(path)
        blocks = block_trace(w2)
        chains = [blocks.blocks(i)[: w2.prompt_lens[i] // w2.block_size].tolist() for i in range(w2.num_requests)]
        return Workload(name, blocks, chains, w2)
    from traces import mooncake_lines
    from w3 import load_w3

    w3 = load_w3(path)
    times = [int(json.loads(line)["timestamp"]) for line in mooncake_lines(path)]
    return Workload(name, block_trace(w3, times), w3.chunk_ids, w3)


def plain_policies() -> list[Ranked]:
    """The policies measured without hints: the field's and :class:`BranchLRU`, LRU first."""
    return [LRU(), SLRU(0.8), SLRU(0.5), TwoQ(), S3FIFO(), LFU(), BranchLRU()]


#: The session TTLs measured: in admissions and in trace time (W3's timestamps are in ms).
SESSION_TTLS = ((500, "requests"), (120_000, "ms"))


def hinted_policies(continues: Ints) -> list[Ranked]:
    """LRU and :class:`BranchLRU` under each of :data:`SESSION_TTLS`."""
    policies: list[Ranked] = []
    for ttl, unit in SESSION_TTLS:
        hints = SessionHints(continues, ttl, unit)
        policies += [LRU(hints), BranchLRU(hints=hints)]
    return policies


def label(policy: Ranked) -> str:
    """The record's name of a policy: its own, with its session TTL when hinted."""
    hints = policy.session_hints
    if hints is None:
        return policy.name
    ttl = f"{hints.ttl // 1000}s" if hints.unit == "ms" else f"{hints.ttl}req"
    return f"{policy.name}+ttl-{ttl}"


#: The session TTL the core's records use (seconds of trace time), the model's best.
CORE_TTL_S = 120.0


def replay_core_hinted(
    trace: PrefixTrace, times: Ints | None = None, continues: Ints | None = None, ttl_s: float = CORE_TTL_S,
    repeats: int = 3, eviction_policy: str = "lru",
) -> tuple[float, int, int]:
    """The library's own replay (as ``replay.replay_core``), with session TTL hints through
    ``KVCacheCore.set_retention`` when ``continues`` is given: the retention clock follows the
    trace's timestamps (``times``, ms) and every request continuing a conversation gets
    ``ttl_s``; ``eviction_policy`` is the core's. Returns (seconds per request, best of
    ``repeats``; hit tokens; blocks evicted)."""
    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore
    from w2 import no_gc

    requests = [(trace.tokens[i], trace.blocks_needed(i), trace.reusable_blocks(i)) for i in range(trace.num_requests)]
    clock = [] if times is None else (np.asarray(times, dtype=np.float64) / 1000.0).tolist()
    hinted = [] if continues is None else (np.asarray(continues) >= 0).tolist()
    best, hit, evicted = float("inf"), 0, 0
    for _ in range(repeats):
        core = KVCacheCore(BlockPool(trace.num_blocks), trace.block_size, eviction_policy=eviction_policy)
        admit, finish, hint, set_time = core.admit, core.finish, core.set_retention, core.retention.set_time
        live: deque[int] = deque()
        max_live = trace.max_live
        with no_gc():
            start = time.perf_counter()
            if continues is None:
                for tokens, needed, reusable in requests:
                    if len(live) == max_live:
                        finish(live.popleft())
                    live.append(admit(tokens, needed, reusable))
            else:
                for i, (tokens, needed, reusable) in enumerate(requests):
                    set_time(clock[i])
                    if len(live) == max_live:
                        finish(live.popleft())
                    h = admit(tokens, needed, reusable)
                    if hinted[i]:
                        hint(h, ttl_s=ttl_s)
                    live.append(h)
            while live:
                finish(live.popleft())
            best = min(best, time.perf_counter() - start)
        core.check_invariants()
        counters = core.counters()
        hit, evicted = counters["prefix_hit_tokens"], counters["blocks_evicted"]
    return best / trace.num_requests, hit, evicted


def core_records(workload: Workload, lru: int, gap: int, continues: Ints) -> list[dict[str, Any]]:
    """The policies the core ships, measured through it: ``core:lru`` (the default, every block
    at the default priority), ``core:lru+ttl-120s`` (session TTL hints through ``set_retention``,
    the clock on the trace's time), and the same two with ``eviction_policy="branch-lru"``
    (``core:branch-lru``, ``core:branch-lru+ttl-120s``); ``us_per_request`` is the library's,
    ``cost_vs_lru`` its ratio to ``core:lru``'s."""
    trace = workload.trace
    if trace is None:
        return []
    out = []
    ttl = f"+ttl-{int(CORE_TTL_S)}s"
    for policy, name, hints in (
        ("lru", "core:lru", None), ("lru", f"core:lru{ttl}", continues),
        ("branch-lru", "core:branch-lru", None), ("branch-lru", f"core:branch-lru{ttl}", continues),
    ):
        seconds, hit, evicted = replay_core_hinted(trace, workload.blocks.times, hints, eviction_policy=policy)
        record: dict[str, Any] = {
            "workload": workload.name,
            "policy": name,
            "hit_tokens": hit,
            "hit_rate": round(hit / workload.blocks.prompt_tokens, 6),
            "gain_over_lru": round(hit / lru - 1, 4) if lru else 0.0,
            "gap_closed": round((hit - lru) / gap, 4) if gap else 0.0,
            "blocks_evicted": evicted,
            "us_per_request": round(seconds * 1e6, 2),
            "prompt_tokens": workload.blocks.prompt_tokens,
        }
        if hints is not None:
            record["hints"] = {
                "session_ttl_s": CORE_TTL_S, "unit": "s", "sessions_hinted": int((continues >= 0).sum()),
            }
        out.append(record)
    for record in out[1:]:
        record["cost_vs_lru"] = round(record["us_per_request"] / out[0]["us_per_request"], 3)
    return out


def run(workload: Workload, *, check_library: bool = True, core: bool = True) -> list[dict[str, Any]]:
    """Every policy, the hinted ones and the optimum on one workload, one replay each: one
    record per policy (``policy``, ``hit_tokens``, ``hit_rate``, ``us_per_request``: the block
    model's own replay time per request, Python, not the library's cost; ``hints`` where hints
    were used), then the core's own policies measured through it (:func:`core_records`), the
    optimum last with the never-evict ceiling beside it. The LRU record must equal the library's
    own replay (``replay.replay_core``) to the token."""
    blocks = workload.blocks
    continues = conversations(workload.chains)
    outcomes = [(policy, replay(blocks, policy)) for policy in plain_policies() + hinted_policies(continues)]
    best = replay(blocks, Optimum())
    ceiling = replay(replace(blocks, num_blocks=len(blocks.keys) + int(blocks.needed.sum())), LRU())
    lru = outcomes[0][1].hit_tokens
    gap = best.hit_tokens - lru

    def entry(name: str, outcome: Outcome) -> dict[str, Any]:
        return {
            "workload": workload.name,
            "policy": name,
            "hit_tokens": outcome.hit_tokens,
            "hit_rate": round(outcome.hit_tokens / blocks.prompt_tokens, 6),
            "gain_over_lru": round(outcome.hit_tokens / lru - 1, 4) if lru else 0.0,
            "gap_closed": round((outcome.hit_tokens - lru) / gap, 4) if gap else 0.0,
            "blocks_evicted": outcome.blocks_evicted,
            "us_per_request": round(outcome.seconds / blocks.num_requests * 1e6, 1),
            "prompt_tokens": blocks.prompt_tokens,
        }

    records = []
    for policy, outcome in outcomes:
        record = entry(label(policy), outcome)
        if policy.hints() is not None:
            record["hints"] = policy.hints()
        records.append(record)
    if check_library and workload.trace is not None:
        from replay import replay_core

        library = replay_core(workload.trace)[1]
        if library != lru:
            raise AssertionError(f"{workload.name}: the model's LRU hit {lru} tokens, the library {library}")
        records[0]["library_hit_tokens"] = library
    if core:
        records += core_records(workload, lru, gap, continues)
    optimum = entry("optimum", best)
    optimum["never_evict_hit_tokens"] = ceiling.hit_tokens
    records.append(optimum)
    return records


def main(argv: list[str] | None = None) -> int:
    import argparse

    from traces import MOONCAKE_TRACE, TRACES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=("w2", "w3"))
    parser.add_argument("--trace", type=Path, default=None)
    args = parser.parse_args(argv)
    name = args.workload.upper()
    path = args.trace or (TRACES if name == "W2" else MOONCAKE_TRACE)
    for record in run(load(name, path)):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
