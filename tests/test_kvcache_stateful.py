"""KVCacheCore against a plain-Python cache with one node per block, under random requests.

The model is the cache the path-compressed trie must be indistinguishable from: a trie of single
blocks under one root per adapter, exact token keys, and one recency list of the blocks that are
neither pinned by a request nor above a pinned block. A use of a path (a lookup, an insertion)
moves its unprotected blocks to the most recent end, deepest first; a block losing its last
protection joins that end the same way; eviction drops the least recently used block, which is
always a leaf. Requests hold one reference on every block of their table, the cache one on every
cached block.

After every step the machine requires the same pool refcount for every block (so the same blocks
cached, evicted and free), the same cached and evictable counts, the same tables and reuse for
every request, the same counters, and a clean ``check_invariants()``; each run ends by looking up
every cached prefix. Block sizes of 1-4, pools of 8-40 blocks and two or three distinct tokens make
runs split, first blocks collide, eviction run under pressure and runs of many blocks form.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lifecycle.errors import OutOfBlocks, SequenceStateError
from kvcache_support import Core, make_core

Block = tuple[int, ...]
ADAPTERS = [0, 0, 0, 7]


@dataclass(eq=False)
class Node:
    key: Block
    block: int
    parent: Node | None
    adapter: int
    depth: int  # blocks from the root to this one's end
    children: dict[Block, Node] = field(default_factory=dict)
    pins: int = 0
    tag: int = -1

    def chain(self) -> Iterator[Node]:
        """This node and its ancestors, deepest first."""
        node: Node | None = self
        while node is not None:
            yield node
            node = node.parent

    def path(self) -> list[Node]:
        return list(self.chain())[::-1]


@dataclass(eq=False)
class Request:
    handle: int
    adapter: int
    tokens: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    pin: Node | None = None
    reused: int = 0  # blocks of the prompt whose KV came from the cache
    failed: bool = False
    rolling: int = -1
    rolling_generation: int = 0

    @property
    def pin_blocks(self) -> int:
        return self.pin.depth if self.pin is not None else 0


class PerBlockCache:
    """The reference: a trie of single blocks with per-block LRU, and the snapshot ids."""

    def __init__(self, num_blocks: int, block_size: int, snapshot_cut: bool, num_snapshots: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.snapshot_cut = snapshot_cut
        self.roots: dict[int, dict[Block, Node]] = {}
        self.lru: dict[Node, None] = {}  # unprotected nodes, least recently used first
        self.requests: dict[int, Request] = {}
        counted = ["blocks_cached", "blocks_evicted", "prefix_lookups", "prefix_hits", "prefix_hit_tokens"]
        self.counters = dict.fromkeys([*counted, "snapshots_evicted"], 0)
        self.snap_node: list[Node | None] = [None] * num_snapshots
        self.snap_generation = [0] * num_snapshots
        self.snap_lru: dict[int, None] = {}
        self.snap_free = list(range(num_snapshots - 1, -1, -1))  # a stack: the next id is last

    # -- the trie --

    def nodes(self) -> Iterator[Node]:
        stack = [node for children in self.roots.values() for node in children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def keys(self, tokens: list[int], count: int) -> list[Block]:
        bs = self.block_size
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(count)]

    def walk(self, adapter: int, tokens: list[int], limit: int) -> list[Node]:
        children, path = self.roots.get(adapter, {}), []
        for key in self.keys(tokens, limit):
            node = children.get(key)
            if node is None:
                break
            path.append(node)
            children = node.children
        return path

    def protected(self, node: Node) -> bool:
        return node.pins > 0 or any(self.protected(child) for child in node.children.values())

    def touch(self, node: Node | None) -> None:
        for member in node.chain() if node is not None else ():
            if self.protected(member):
                break
            del self.lru[member]
            self.lru[member] = None

    def pin(self, node: Node | None) -> None:
        if node is not None:
            node.pins += 1
            for member in node.chain():
                self.lru.pop(member, None)

    def unpin(self, node: Node | None) -> None:
        if node is not None:
            node.pins -= 1
            for member in node.chain():
                if self.protected(member):
                    break
                self.lru[member] = None

    def insert(self, request: Request, full: int) -> Node | None:
        """Blocks [pin, full) of the request under its pinned path, existing nodes keeping their
        blocks; the path is used. Returns the node ending at ``full``."""
        node, keys = request.pin, self.keys(request.tokens, full)
        for i in range(request.pin_blocks, full):
            children = node.children if node is not None else self.roots.setdefault(request.adapter, {})
            child = children.get(keys[i])
            if child is None:
                child = Node(keys[i], request.table[i], node, request.adapter, i + 1)
                children[keys[i]] = child
                self.lru[child] = None
                self.counters["blocks_cached"] += 1
            node = child
        self.touch(node)
        return node

    def node_at(self, request: Request, blocks: int) -> Node:
        assert request.pin is not None
        return request.pin.path()[blocks - 1]

    def evict(self, wanted: int) -> int:
        freed = 0
        while freed < wanted and self.lru:
            victim = next(iter(self.lru))
            assert not victim.children, "the model's least recently used node is not a leaf"
            del self.lru[victim]
            siblings = victim.parent.children if victim.parent is not None else self.roots[victim.adapter]
            del siblings[victim.key]
            if not self.roots[victim.adapter]:
                del self.roots[victim.adapter]
            if victim.tag >= 0:
                self.release_snapshot(victim.tag)
            self.counters["blocks_evicted"] += 1
            if all(victim.block not in request.table for request in self.requests.values()):
                freed += 1
        return freed

    # -- blocks --

    def refcounts(self) -> list[int]:
        counts = [0] * self.num_blocks
        for request in self.requests.values():
            for block in request.table:
                counts[block] += 1
        for node in self.nodes():
            counts[node.block] += 1
        return counts

    def num_free(self) -> int:
        return self.refcounts().count(0)

    def make_room(self, need: int) -> bool:
        """Evict until ``need`` blocks are free or nothing is evictable; whether they are."""
        if self.num_free() < need:
            self.evict(need - self.num_free())
        return self.num_free() >= need

    # -- lookups --

    def match(self, adapter: int, tokens: list[int], max_prefix: int = -1) -> tuple[Node | None, int]:
        """Use the cached prefix of ``tokens`` (never its last token) and return the node ending
        the part a prefill reuses (with snapshot_cut, the deepest one with a snapshot) and the
        blocks matched."""
        if len(tokens) <= 1:
            return None, 0
        limit = (len(tokens) - 1) // self.block_size
        if 0 <= max_prefix < limit:
            limit = max_prefix
        path = self.walk(adapter, tokens, limit)
        if not path:
            return None, 0
        self.touch(path[-1])
        if not self.snapshot_cut:
            return path[-1], len(path)
        tagged = [node for node in path if node.tag >= 0]
        return (tagged[-1] if tagged else None), len(path)

    def count_lookup(self, reuse: int) -> None:
        self.counters["prefix_lookups"] += 1
        if reuse:
            self.counters["prefix_hits"] += 1
            self.counters["prefix_hit_tokens"] += reuse * self.block_size

    # -- snapshots --

    def release_snapshot(self, sid: int) -> None:
        node = self.snap_node[sid]
        assert node is not None
        node.tag = -1
        self.snap_node[sid] = None
        del self.snap_lru[sid]
        self.snap_free.append(sid)
        self.counters["snapshots_evicted"] += 1

    def take_snapshot(self, node: Node) -> int:
        if self.snap_free:
            sid = self.snap_free.pop()
        else:
            sid = next(iter(self.snap_lru))
            self.release_snapshot(sid)
            self.snap_free.pop()
        self.snap_generation[sid] += 1
        self.snap_lru[sid] = None
        self.snap_node[sid] = node
        node.tag = sid
        return sid

    def use_snapshot(self, sid: int) -> None:
        del self.snap_lru[sid]
        self.snap_lru[sid] = None


class KVCacheMachine(RuleBasedStateMachine):
    snapshot_cut = False

    def __init__(self) -> None:
        super().__init__()
        self.bs = 1
        self.alphabet = 2
        self.num_snapshots = 0
        self.core: Core = make_core(8, 1)
        self.model = PerBlockCache(8, 1, False, 0)
        self.documents: list[list[int]] = []

    @initialize(
        data=st.data(),
        block_size=st.integers(1, 4),
        num_blocks=st.integers(8, 40),
        alphabet=st.integers(2, 3),
        num_snapshots=st.integers(1, 4),
        served=st.integers(0, 6),
    )
    def setup(
        self, data: st.DataObject, block_size: int, num_blocks: int, alphabet: int, num_snapshots: int, served: int
    ) -> None:
        self.bs = block_size
        self.alphabet = alphabet
        # A few long shared texts (system prompts, documents) most prompts start with.
        document = st.lists(st.integers(0, alphabet - 1), min_size=8 * block_size, max_size=8 * block_size)
        self.documents = data.draw(st.lists(document, min_size=1, max_size=3), label="documents")
        self.num_snapshots = num_snapshots if self.snapshot_cut else 0
        self.core = make_core(num_blocks, block_size, snapshot_cut=self.snapshot_cut, num_snapshots=self.num_snapshots)
        self.model = PerBlockCache(num_blocks, block_size, self.snapshot_cut, self.num_snapshots)
        for _ in range(served):  # runs start with a cache in use more often than not
            self.serve(data, 0, cache=True)

    # -- drawing --

    def draw_tokens(self, data: st.DataObject, max_blocks: int = 6) -> list[int]:
        """Mostly a shared document's or a cached path's tokens, cut somewhere and continued at
        random: lookups reach deep and diverge inside runs and in first blocks."""
        leaves = [node for node in self.model.nodes() if not node.children]
        paths = [[token for node in leaf.path() for token in node.key] for leaf in leaves]
        source = data.draw(st.sampled_from(["document", "document", "cached path", "random"]), label="source")
        tokens: list[int] = []
        if source == "document":
            tokens = data.draw(st.sampled_from(self.documents), label="document")
        elif source == "cached path" and paths:
            tokens = data.draw(st.sampled_from(paths), label="cached path")
        tokens = tokens[: data.draw(st.integers(0, min(len(tokens), max_blocks * self.bs + 1)), label="cut")]
        extra = data.draw(st.integers(0, max(0, max_blocks * self.bs + 1 - len(tokens))), label="extra tokens")
        return tokens + data.draw(st.lists(st.integers(0, self.alphabet - 1), min_size=extra, max_size=extra))

    def token_lists(self, most: int, held: int) -> st.SearchStrategy[list[int]]:
        """Up to ``most`` tokens to add to ``held`` ones, within the per-request limit."""
        room = (self.model.num_blocks + 1) * self.bs - held
        return st.lists(st.integers(0, self.alphabet - 1), max_size=min(most, room))

    def live(self) -> list[Request]:
        return list(self.model.requests.values())

    def draw_request(self, data: st.DataObject) -> Request:
        return data.draw(st.sampled_from(sorted(self.live(), key=lambda request: request.handle)), label="request")

    def draw_grow_to(self, data: st.DataObject, tokens: list[int], low: int = 0) -> int:
        """Often no growth at all (-1 where allowed): a record holding just its prefix can retry."""
        most = min(len(tokens) // self.bs + 2, self.model.num_blocks)
        return data.draw(st.one_of(st.just(low), st.integers(low, most)), label="grow_to")

    # -- checking --

    def take_new_blocks(self, request: Request) -> None:
        """The blocks the core gave ``request`` past its model table, which must have been free."""
        table = self.core.block_table(request.handle).tolist()
        assert table[: len(request.table)] == request.table
        held = self.model.refcounts()
        for block in table[len(request.table) :]:
            assert held[block] == 0, f"block {block} handed out while held"
        request.table = table

    def reused_blocks(self, node: Node | None) -> list[int]:
        return [member.block for member in node.path()] if node is not None else []

    @invariant()
    def same_state(self) -> None:
        core, model = self.core, self.model
        core.check_invariants()
        assert core.pool.refcounts().tolist() == model.refcounts()
        assert core.num_cached_blocks == sum(1 for _ in model.nodes())
        assert core.num_evictable_blocks == len(model.lru)
        assert core.num_live_sequences == len(model.requests)
        assert core.num_snapshots_used == len(model.snap_lru)
        counters = core.counters()
        assert {key: counters[key] for key in model.counters} == model.counters
        for request in model.requests.values():
            assert core.block_table(request.handle).tolist() == request.table
            assert core.cached_tokens(request.handle) == request.reused * self.bs

    # -- admission --

    def attach_expected(self, request: Request, prompt: list[int], grow_to: int, max_prefix: int) -> bool:
        """The model's side of attaching ``prompt`` to a record without tokens; whether the growth fits."""
        end, matched = self.model.match(request.adapter, prompt, max_prefix)
        self.model.pin(end)
        if self.snapshot_cut and end is not None:
            self.model.use_snapshot(end.tag)
        request.pin, request.tokens, request.prompt = end, list(prompt), list(prompt)
        request.table = self.reused_blocks(end)
        request.reused = len(request.table)
        self.model.count_lookup(request.reused)
        return self.model.make_room(grow_to - len(request.table))

    @rule(data=st.data(), adapter=st.sampled_from(ADAPTERS), max_prefix=st.sampled_from([-1, -1, -1, 0, 1, 2]))
    def admit(self, data: st.DataObject, adapter: int, max_prefix: int) -> None:
        prompt = self.draw_tokens(data)
        grow_to = self.draw_grow_to(data, prompt)
        request = Request(-1, adapter)
        self.model.requests[-1] = request  # its prefix counts as held while room is made
        fits = self.attach_expected(request, prompt, grow_to, max_prefix)
        del self.model.requests[-1]
        try:
            request.handle = self.core.admit(prompt, grow_to, max_prefix=max_prefix, adapter=adapter)
        except OutOfBlocks:
            assert not fits  # nothing stays open: the prefix is let go, what was evicted stays evicted
            self.model.unpin(request.pin)
            return
        assert fits
        assert self.core.block_table(request.handle).tolist()[: len(request.table)] == request.table
        self.model.requests[request.handle] = request
        self.take_new_blocks(request)
        if self.snapshot_cut:
            expected = request.pin.tag if request.pin is not None and request.reused else -1
            assert self.core.prefix_snapshot(request.handle) == expected

    @rule(data=st.data(), adapter=st.sampled_from(ADAPTERS))
    def open_and_attach(self, data: st.DataObject, adapter: int) -> None:
        request = Request(self.core.open(adapter=adapter), adapter)
        self.model.requests[request.handle] = request
        self.attach(data, request)

    def attach(self, data: st.DataObject, request: Request) -> None:
        prompt = self.draw_tokens(data)
        grow_to = self.draw_grow_to(data, prompt, low=-1)
        fits = self.attach_expected(request, prompt, grow_to, -1)
        try:
            reused = self.core.attach(request.handle, prompt, grow_to=grow_to)
        except OutOfBlocks:
            assert not fits  # the prefix stays attached
        else:
            assert fits and reused == request.reused
            self.take_new_blocks(request)

    @precondition(lambda self: self.model.requests)
    @rule(
        data=st.data(),
        other_tokens=st.sampled_from([False, False, False, True]),
        max_prefix=st.sampled_from([-1, -1, -1, 0, 1, 2]),
    )
    def attach_again(self, data: st.DataObject, other_tokens: bool, max_prefix: int) -> None:
        """A retried lookup with the record's tokens; for a record without any, a first one."""
        request = self.draw_request(data)
        if not request.tokens and not request.table:
            self.attach(data, request)
            return
        tokens = request.tokens
        if other_tokens or not tokens:
            tokens = tokens[:-1] + [(tokens[-1] + 1) % self.alphabet] if tokens else [0]
        grow_to = self.draw_grow_to(data, tokens, low=-1)
        if tokens != request.tokens or len(request.table) != request.pin_blocks:
            with pytest.raises(SequenceStateError):
                self.core.attach(request.handle, tokens, grow_to=grow_to, max_prefix=max_prefix)
            return
        end, _ = self.model.match(request.adapter, tokens, max_prefix)
        if end is not request.pin:
            self.model.pin(end)
            self.model.unpin(request.pin)
            request.pin, request.table = end, self.reused_blocks(end)
        request.reused = request.pin_blocks
        fits = self.model.make_room(grow_to - len(request.table))
        try:
            reused = self.core.attach(request.handle, tokens, grow_to=grow_to, max_prefix=max_prefix)
        except OutOfBlocks:
            assert not fits
        else:
            assert fits and reused == request.reused
            self.take_new_blocks(request)

    # -- a request's life --

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        request = self.draw_request(data)
        tokens = data.draw(self.token_lists(2 * self.bs, len(request.tokens)), label="appended")
        self.core.append(request.handle, tokens)
        request.tokens += tokens

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        request = self.draw_request(data)
        wanted = data.draw(st.integers(0, min(len(request.table) + 4, self.model.num_blocks)), label="blocks")
        fits = self.model.make_room(wanted - len(request.table))
        try:
            added = self.core.grow(request.handle, wanted)
        except OutOfBlocks:
            assert not fits
            return
        assert fits and added == max(0, wanted - len(request.table))
        self.take_new_blocks(request)

    def full_blocks(self, request: Request) -> int:
        return min(len(request.tokens) // self.bs, len(request.table))

    def cache_expected(self, request: Request, full: int) -> tuple[Node | None, int]:
        """Insert and pin up to ``full`` blocks mid-life; the node ending there and blocks added."""
        if full <= request.pin_blocks:
            return (self.model.node_at(request, full) if full else None), 0
        before = self.model.counters["blocks_cached"]
        end = self.model.insert(request, full)
        self.model.pin(end)
        self.model.unpin(request.pin)
        request.pin = end
        return end, self.model.counters["blocks_cached"] - before

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        request = self.draw_request(data)
        most = self.full_blocks(request)
        full = data.draw(st.one_of(st.just(most), st.integers(0, most)), label="blocks")
        expected = 0 if request.failed else self.cache_expected(request, full)[1]
        assert self.core.cache(request.handle, full) == expected

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data(), cache=st.booleans())
    def finish(self, data: st.DataObject, cache: bool) -> None:
        self.finish_request(self.draw_request(data), cache)

    def finish_request(self, request: Request, cache: bool) -> None:
        full = self.full_blocks(request)
        if cache and not request.failed and full > request.pin_blocks:
            self.model.insert(request, full)
        self.model.unpin(request.pin)
        self.core.finish(request.handle, cache=cache)
        del self.model.requests[request.handle]

    @rule(data=st.data(), adapter=st.sampled_from(ADAPTERS), cache=st.sampled_from([True, True, True, False]))
    def serve_request(self, data: st.DataObject, adapter: int, cache: bool) -> None:
        self.serve(data, adapter, cache)

    def serve(self, data: st.DataObject, adapter: int, cache: bool) -> None:
        """A whole request in a row: admitted with room for what it generates, then finished."""
        prompt = self.draw_tokens(data)
        generated = data.draw(self.token_lists(3 * self.bs, len(prompt)), label="generated")
        grow_to = min(-(-(len(prompt) + len(generated)) // self.bs), self.model.num_blocks)
        request = Request(-1, adapter)
        self.model.requests[-1] = request
        fits = self.attach_expected(request, prompt, grow_to, -1)
        del self.model.requests[-1]
        if not fits:
            self.model.unpin(request.pin)
            with pytest.raises(OutOfBlocks):
                self.core.admit(prompt, grow_to, adapter=adapter)
            return
        request.handle = self.core.admit(prompt, grow_to, adapter=adapter)
        self.model.requests[request.handle] = request
        self.take_new_blocks(request)
        self.core.append(request.handle, generated)
        request.tokens += generated
        self.while_running(data, request)
        self.finish_request(request, cache)

    def while_running(self, data: st.DataObject, request: Request) -> None:
        """What a model does with a running request besides its KV (a hybrid model: snapshots)."""

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def mark_failed(self, data: st.DataObject) -> None:
        request = self.draw_request(data)
        self.core.mark_failed(request.handle)
        request.failed = True

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        request = self.draw_request(data)
        self.core.clear(request.handle)
        self.model.unpin(request.pin)
        request.pin, request.tokens, request.prompt, request.table, request.reused = None, [], [], [], 0

    # -- the whole cache --

    @rule(num_blocks=st.integers(0, 12))
    def evict(self, num_blocks: int) -> None:
        assert self.core.evict(num_blocks) == self.model.evict(num_blocks)

    @rule(data=st.data(), adapter=st.sampled_from(ADAPTERS))
    def reclaim_for(self, data: st.DataObject, adapter: int) -> None:
        prompt = self.draw_tokens(data)
        needed = data.draw(st.integers(0, self.model.num_blocks + 2), label="blocks_needed")
        end, _ = self.model.match(adapter, prompt)
        target = max(0, needed - (end.depth if end is not None else 0))
        self.model.pin(end)
        self.model.make_room(target)
        self.model.unpin(end)
        assert self.core.reclaim_for(prompt, adapter, needed) == (target, self.model.num_free())

    @rule(now=st.integers(0, 3))
    def reset(self, now: int) -> None:
        if now:  # rarely: it empties the cache that the other rules need
            return
        everything_evictable = len(self.model.lru) == sum(1 for _ in self.model.nodes())
        if everything_evictable:
            self.model.evict(self.model.num_blocks + 1)
        assert self.core.reset() is everything_evictable

    # -- the end: every cached prefix is found, with its blocks --

    def teardown(self) -> None:
        for node in list(self.model.nodes()):
            path = node.path()
            tokens = [token for member in path for token in member.key] + [0]
            handle = self.core.admit(tokens, 0, adapter=node.adapter)
            reused = len(self.reused_blocks(self.model.match(node.adapter, tokens)[0]))
            assert self.core.block_table(handle).tolist() == [member.block for member in path][:reused]
            self.core.finish(handle, cache=False)
        self.core.check_invariants()


class SnapshotCutMachine(KVCacheMachine):
    """The same with a hybrid model's rules: reuse ends at the deepest cached SSM snapshot, whose
    ids are few, reused least recently used first, freed with their block and rolled by requests."""

    snapshot_cut = True

    def while_running(self, data: st.DataObject, request: Request) -> None:
        for _ in range(data.draw(st.integers(0, 2), label="snapshot points")):
            self.snapshot_at(data, request, data.draw(st.booleans(), label="rolling"))

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data(), rolling=st.booleans())
    def snapshot_point(self, data: st.DataObject, rolling: bool) -> None:
        self.snapshot_at(data, self.draw_request(data), rolling)

    def snapshot_at(self, data: st.DataObject, request: Request, rolling: bool) -> None:
        full = self.full_blocks(request)
        if full == 0:
            return
        full = data.draw(st.integers(1, full), label="blocks")
        expected = self.snapshot_expected(request, full, rolling)
        assert self.core.snapshot_point(request.handle, full, rolling) == expected

    def snapshot_expected(self, request: Request, full: int, rolling: bool) -> tuple[int, bool]:
        model = self.model
        if request.failed:
            return -1, False
        previous = request.rolling
        reused_since = previous >= 0 and model.snap_generation[previous] != request.rolling_generation
        if reused_since or (previous >= 0 and model.snap_node[previous] is None):
            previous = request.rolling = -1  # no longer the request's to drop
        node = model.snap_node[previous] if previous >= 0 else None
        if rolling and node is not None and node.depth != full:
            model.release_snapshot(previous)
            request.rolling = previous = -1
        end, _ = self.cache_expected(request, full)
        assert end is not None
        if end.tag >= 0:
            model.use_snapshot(end.tag)
            if not (rolling and previous == end.tag):
                request.rolling = -1
            return end.tag, False
        sid = model.take_snapshot(end)
        request.rolling = sid if rolling else -1
        request.rolling_generation = model.snap_generation[sid]
        return sid, True

    @rule(snapshot_id=st.integers(0, 3))
    def drop_snapshot(self, snapshot_id: int) -> None:
        if snapshot_id >= self.num_snapshots:
            return
        if self.model.snap_node[snapshot_id] is not None:
            self.model.release_snapshot(snapshot_id)
        self.core.drop_snapshot(snapshot_id)


# max_examples comes from the profile (tests/conftest.py: HYPOTHESIS_PROFILE=long runs many more).
TestKVCache = KVCacheMachine.TestCase
TestKVCache.settings = settings(stateful_step_count=40, deadline=None)
TestSnapshotCut = SnapshotCutMachine.TestCase
TestSnapshotCut.settings = settings(stateful_step_count=40, deadline=None)
