"""pytest-benchmark suite for the prefix trie and cache (match, insert, evict, and the W2 replay).

    python bench/regress.py save -- bench/test_bench_prefix.py    # a baseline under .benchmarks/
    python bench/regress.py check -- bench/test_bench_prefix.py   # fail if a minimum is > 25% slower

Shapes follow W2: blocks of 16 tokens, a shared 64-block system prompt under many unique suffixes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from pytest_benchmark.fixture import BenchmarkFixture

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from lifecycle._blockpool import BlockPool  # noqa: E402
from lifecycle._prefix_trie import PrefixTrie  # noqa: E402
from lifecycle.prefix_cache import PrefixCache  # noqa: E402

BS = 16
SYSTEM_BLOCKS = 64
SUFFIX_BLOCKS = 16
NUM_SUFFIXES = 512
TRACE = HERE / "data" / "traces.npz"


def requests() -> list[NDArray[np.int32]]:
    rng = np.random.default_rng(7)
    system = rng.integers(0, 50_000, SYSTEM_BLOCKS * BS).astype(np.int32)
    return [
        np.concatenate([system, rng.integers(0, 50_000, SUFFIX_BLOCKS * BS).astype(np.int32)])
        for _ in range(NUM_SUFFIXES)
    ]


def filled_trie() -> tuple[PrefixTrie, list[NDArray[np.int32]]]:
    trie = PrefixTrie(BS, capacity=NUM_SUFFIXES * (SYSTEM_BLOCKS + SUFFIX_BLOCKS))
    tokens = requests()
    blocks_per_request = SYSTEM_BLOCKS + SUFFIX_BLOCKS
    for i, request in enumerate(tokens):
        trie.insert(request, np.arange(blocks_per_request, dtype=np.int32) + i * blocks_per_request)
    return trie, tokens


def test_match_80_blocks(benchmark: BenchmarkFixture) -> None:
    trie, tokens = filled_trie()
    block_ids, _ = benchmark(trie.match, tokens[17], 0)
    assert len(block_ids) == SYSTEM_BLOCKS + SUFFIX_BLOCKS


def test_match_and_pin_then_unpin(benchmark: BenchmarkFixture) -> None:
    trie, tokens = filled_trie()

    def match_pin_unpin() -> None:
        _, node_ids = trie.match(tokens[3], 0, pin=True)
        trie.unpin(node_ids)

    benchmark(match_pin_unpin)
    trie.check_invariants()


def test_insert_existing_80_blocks(benchmark: BenchmarkFixture) -> None:
    trie, tokens = filled_trie()
    block_ids = np.arange(SYSTEM_BLOCKS + SUFFIX_BLOCKS, dtype=np.int32)
    taken, _, _ = benchmark(trie.insert, tokens[5], block_ids)
    assert len(taken) == 0


def test_evict_and_reinsert_16_blocks(benchmark: BenchmarkFixture) -> None:
    trie, tokens = filled_trie()
    block_ids = np.arange(SYSTEM_BLOCKS + SUFFIX_BLOCKS, dtype=np.int32)

    def evict_then_insert() -> None:
        evicted = trie.evict(SUFFIX_BLOCKS)
        assert len(evicted) == SUFFIX_BLOCKS
        trie.insert(tokens[int(evicted[0]) // len(block_ids)], block_ids)

    benchmark(evict_then_insert)
    trie.check_invariants()


def test_cache_insert_through_the_pool(benchmark: BenchmarkFixture) -> None:
    pool = BlockPool(SYSTEM_BLOCKS + SUFFIX_BLOCKS)
    cache = PrefixCache(pool, PrefixTrie(BS))
    tokens = requests()[0]
    block_table = pool.allocate(SYSTEM_BLOCKS + SUFFIX_BLOCKS)
    cache.insert(tokens, block_table)
    duplicates = benchmark(cache.insert, tokens, block_table)
    assert len(duplicates) == len(block_table)
    cache.check_invariants()


def test_admit_then_cache_and_release(benchmark: BenchmarkFixture) -> None:
    """One request's life through the fused calls: a 64-block cached prefix reused, 17 blocks
    allocated, then everything cached and released."""
    pool = BlockPool(4 * (SYSTEM_BLOCKS + SUFFIX_BLOCKS))
    cache = PrefixCache(pool, PrefixTrie(BS))
    core = cache.core
    tokens = requests()[:2]
    needed = SYSTEM_BLOCKS + SUFFIX_BLOCKS + 1
    table, pinned, _ = core.admit(tokens[0], needed, 0, needed - 2)
    core.cache_and_release(tokens[0], table, SYSTEM_BLOCKS + SUFFIX_BLOCKS, 0, pinned)

    def request() -> None:
        table, pinned, _ = core.admit(tokens[1], needed, 0, SYSTEM_BLOCKS + SUFFIX_BLOCKS - 1)
        assert len(pinned) >= SYSTEM_BLOCKS
        core.cache_and_release(tokens[1], table, SYSTEM_BLOCKS + SUFFIX_BLOCKS, 0, pinned)

    benchmark(request)
    cache.check_invariants()
    assert pool.num_free + cache.num_cached_blocks == pool.num_total


def test_w2_replay(benchmark: BenchmarkFixture) -> None:
    from w2 import REFERENCE_HIT_TOKENS, load_w2, replay_lifecycle

    trace = load_w2(TRACE)
    _, hit_tokens, _ = benchmark.pedantic(  # type: ignore[no-untyped-call]
        replay_lifecycle, args=(trace,), rounds=5, iterations=1
    )
    assert hit_tokens == REFERENCE_HIT_TOKENS
