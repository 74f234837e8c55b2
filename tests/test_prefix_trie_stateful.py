"""PrefixTrie against a plain-Python reference trie, under random inserts, matches, pins and evictions.

Tokens come from a two- or three-letter alphabet with blocks of 2-4 tokens, so prefixes are shared
and diverge all the time; some runs keep 0 or 3 bits of the block hash so that nearly every lookup
meets colliding candidates that only the token compare can reject.

Recency in the reference is a stamp per node from one clock. Stamps are given deepest first along a
path when it is inserted or matched (nodes pinned, or above a pinned node, keep theirs), and when a
node stops being protected by pins. Eviction takes the unprotected leaf with the oldest stamp.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lifecycle._prefix_trie import PrefixTrie
from lifecycle.errors import DoubleFree, InvalidId

Block = tuple[int, ...]


@dataclass(eq=False)
class RefNode:
    block_id: int
    parent: RefNode | None
    adapter: int
    key: Block
    node_id: int = -1
    children: dict[Block, RefNode] = field(default_factory=dict)
    pins: int = 0
    tag: int = -1
    stamp: int = 0


class ReferenceTrie:
    """The obvious, slow model: dictionaries of children, protection recomputed by recursion."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.roots: dict[int, dict[Block, RefNode]] = {}
        self.clock = 0
        self.evicted_tags: list[int] = []

    def nodes(self) -> Iterator[RefNode]:
        stack = [node for children in self.roots.values() for node in children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def protected(self, node: RefNode) -> bool:
        return node.pins > 0 or any(self.protected(child) for child in node.children.values())

    def stamp(self, node: RefNode) -> None:
        self.clock += 1
        node.stamp = self.clock

    def blocks(self, tokens: list[int], limit: int) -> list[Block]:
        count = len(tokens) // self.block_size
        if limit >= 0:
            count = min(count, limit)
        return [tuple(tokens[i * self.block_size : (i + 1) * self.block_size]) for i in range(count)]

    def refresh(self, path: list[RefNode]) -> None:
        for node in reversed(path):
            if self.protected(node):
                break
            self.stamp(node)

    def match(self, tokens: list[int], adapter: int, max_blocks: int, pin: bool) -> list[RefNode]:
        children = self.roots.get(adapter, {})
        path: list[RefNode] = []
        for key in self.blocks(tokens, max_blocks):
            node = children.get(key)
            if node is None:
                break
            path.append(node)
            children = node.children
        if pin:
            for node in path:
                node.pins += 1
        else:
            self.refresh(path)
        return path

    def insert(self, tokens: list[int], block_ids: list[int], adapter: int) -> tuple[list[RefNode], int]:
        if not block_ids:
            return [], 0
        children = self.roots.setdefault(adapter, {})
        parent: RefNode | None = None
        path: list[RefNode] = []
        existing = len(block_ids)
        for i, key in enumerate(self.blocks(tokens, len(block_ids))):
            node = children.get(key)
            if node is None:
                existing = min(existing, i)
                node = RefNode(block_ids[i], parent, adapter, key)
                children[key] = node
            path.append(node)
            parent = node
            children = node.children
        self.refresh(path)
        return path, existing

    def unpin(self, nodes: list[RefNode]) -> None:
        for node in nodes:
            chain: list[RefNode] = []
            cursor: RefNode | None = node
            while cursor is not None:
                chain.append(cursor)
                cursor = cursor.parent
            was_protected = [self.protected(member) for member in chain]
            node.pins -= 1
            for member, before in zip(chain, was_protected):
                if not before or self.protected(member):
                    break
                self.stamp(member)

    def evict(self, n: int) -> list[int]:
        evicted: list[int] = []
        for _ in range(n):
            leaves = [node for node in self.nodes() if not node.children and not self.protected(node)]
            if not leaves:
                break
            victim = min(leaves, key=lambda node: node.stamp)
            siblings = victim.parent.children if victim.parent else self.roots[victim.adapter]
            del siblings[victim.key]
            if not self.roots[victim.adapter]:
                del self.roots[victim.adapter]
            if victim.tag >= 0:
                self.evicted_tags.append(victim.tag)
            evicted.append(victim.block_id)
        return evicted


class TrieMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.trie = PrefixTrie(2)
        self.ref = ReferenceTrie(2)
        self.alphabet = 2
        self.next_block = 0
        self.next_tag = 0
        self.pinned: list[list[RefNode]] = []  # one entry per pin the test still owes an unpin

    @initialize(
        block_size=st.integers(2, 4),
        hash_bits=st.sampled_from([64, 64, 3, 0]),
        alphabet=st.integers(2, 3),
    )
    def setup(self, block_size: int, hash_bits: int, alphabet: int) -> None:
        self.trie = PrefixTrie(block_size, hash_bits=hash_bits)
        self.ref = ReferenceTrie(block_size)
        self.alphabet = alphabet

    def draw_tokens(self, data: st.DataObject) -> list[int]:
        length = data.draw(st.integers(0, 5 * self.ref.block_size + 1), label="length")
        return data.draw(st.lists(st.integers(0, self.alphabet - 1), min_size=length, max_size=length), label="tokens")

    def ids(self, nodes: list[RefNode]) -> np.ndarray:
        return np.array([node.node_id for node in nodes], dtype=np.int32)

    def live_nodes(self) -> list[RefNode]:
        return sorted(self.ref.nodes(), key=lambda node: node.node_id)

    @rule(data=st.data(), adapter=st.sampled_from([0, 0, 1, -(2**40)]))
    def insert(self, data: st.DataObject, adapter: int) -> None:
        tokens = self.draw_tokens(data)
        count = data.draw(st.integers(0, len(tokens) // self.ref.block_size), label="blocks")
        block_ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        taken, duplicates, node_ids = self.trie.insert(np.array(tokens, dtype=np.int32), block_ids, adapter)
        path, existing = self.ref.insert(tokens, block_ids, adapter)
        assert taken.tolist() == block_ids[existing:]
        assert duplicates.tolist() == block_ids[:existing]
        for node, node_id in zip(path, node_ids.tolist()):
            if node.node_id < 0:
                node.node_id = node_id
            assert node.node_id == node_id

    @rule(data=st.data(), adapter=st.sampled_from([0, 1]), pin=st.booleans())
    def match(self, data: st.DataObject, adapter: int, pin: bool) -> None:
        tokens = self.draw_tokens(data)
        max_blocks = data.draw(st.integers(-1, 6), label="max_blocks")
        block_ids, node_ids = self.trie.match(np.array(tokens, dtype=np.int32), adapter, max_blocks, pin=pin)
        path = self.ref.match(tokens, adapter, max_blocks, pin)
        assert block_ids.tolist() == [node.block_id for node in path]
        assert node_ids.tolist() == [node.node_id for node in path]
        if pin:
            self.pinned.append(path)

    @rule(data=st.data())
    def match_a_cached_path(self, data: st.DataObject) -> None:
        # Random tokens rarely reach deep; walking down from a cached node always does.
        nodes = self.live_nodes()
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes), label="node")
        keys: list[int] = []
        cursor: RefNode | None = node
        while cursor is not None:
            keys = list(cursor.key) + keys
            cursor = cursor.parent
        pin = data.draw(st.booleans(), label="pin")
        block_ids, _ = self.trie.match(np.array(keys, dtype=np.int32), node.adapter, pin=pin)
        path = self.ref.match(keys, node.adapter, -1, pin)
        assert path[-1] is node
        assert block_ids.tolist() == [member.block_id for member in path]
        if pin:
            self.pinned.append(path)

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def insert_after_a_pinned_match(self, data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(self.pinned), label="pinned path")
        tokens = [token for node in path for token in node.key] + self.draw_tokens(data)
        count = data.draw(st.integers(len(path), len(tokens) // self.ref.block_size), label="blocks")
        block_ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        adapter = path[0].adapter if path else 0
        taken, duplicates, node_ids = self.trie.insert(
            np.array(tokens, dtype=np.int32), block_ids, adapter, known_prefix=self.ids(path)
        )
        ref_path, existing = self.ref.insert(tokens, block_ids, adapter)
        assert taken.tolist() == block_ids[existing:]
        assert duplicates.tolist() == block_ids[:existing]
        for node, node_id in zip(ref_path, node_ids.tolist()):
            if node.node_id < 0:
                node.node_id = node_id
            assert node.node_id == node_id

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        path = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1), label="which"))
        order = data.draw(st.sampled_from(["path", "reversed"]), label="order")
        nodes = path if order == "path" else path[::-1]
        self.trie.unpin(self.ids(nodes))
        self.ref.unpin(nodes)

    @rule(data=st.data())
    def unpin_more_than_pinned_is_refused(self, data: st.DataObject) -> None:
        unpinned = [node for node in self.live_nodes() if node.pins == 0]
        if not unpinned:
            return
        victim = data.draw(st.sampled_from(unpinned), label="victim")
        pinned = [node for path in self.pinned for node in path]
        batch = pinned[:2] + [victim]
        before = self.trie.num_evictable_blocks
        with pytest.raises(DoubleFree):
            self.trie.unpin(self.ids(batch))
        assert self.trie.num_evictable_blocks == before

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        assert self.trie.evict(n).tolist() == self.ref.evict(n)

    @rule(data=st.data())
    def tag(self, data: st.DataObject) -> None:
        nodes = self.live_nodes()
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes), label="node")
        node.tag = self.next_tag
        self.next_tag += 1
        self.trie.set_tag(node.node_id, node.tag)

    @rule()
    def drain_evicted_tags(self) -> None:
        assert self.trie.evicted_tags().tolist() == self.ref.evicted_tags
        self.ref.evicted_tags.clear()

    @rule(data=st.data())
    def deepest_tagged(self, data: st.DataObject) -> None:
        nodes = self.live_nodes()
        if not nodes:
            return
        chosen = data.draw(st.lists(st.sampled_from(nodes), max_size=4), label="nodes")
        tagged = [i for i, node in enumerate(chosen) if node.tag >= 0]
        deepest = -1
        best_depth = -1
        for i in tagged:
            depth = 0
            cursor = chosen[i].parent
            while cursor is not None:
                depth += 1
                cursor = cursor.parent
            if depth > best_depth:
                deepest, best_depth = i, depth
        assert self.trie.deepest_tagged(self.ids(chosen)) == deepest

    @rule()
    def evicted_node_ids_are_refused(self) -> None:
        live = {node.node_id for node in self.ref.nodes()}
        dead = next(node_id for node_id in range(10_000) if node_id not in live)
        with pytest.raises(InvalidId):
            self.trie.pin([dead])

    @invariant()
    def matches_the_reference(self) -> None:
        self.trie.check_invariants()
        nodes = list(self.ref.nodes())
        assert self.trie.num_cached_blocks == len(nodes)
        assert self.trie.num_evictable_blocks == sum(not self.ref.protected(node) for node in nodes)
        assert self.trie.num_adapters == len(self.ref.roots)
        for node in nodes:
            assert self.trie.pin_count(node.node_id) == node.pins
            assert self.trie.get_tag(node.node_id) == node.tag


TestPrefixTrieAgainstReference = TrieMachine.TestCase
